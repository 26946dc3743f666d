"""Where a packed micro-batch's time goes under varlen attention: one GPU, Llama-3-8B widths at 4 layers,
micro-batches of 4 in-order packed rows of 4096, forward, backward and a fused AdamW step per micro-batch.

    python -m benchmarks.varlen_steps OUT fp8-compiled-mixed
    python -m benchmarks.varlen_steps OUT bf16-compiled-mixed-2048-static-nosync
    python -m benchmarks.varlen_steps OUT bf16-eager-mixed 1024 4   # rows of 1024, 4 micro-batches a part

MODE is PRECISION-COMPILE-DOCS[-FLAG...]: PRECISION bf16 or fp8; COMPILE compiled (training.compile) or eager;
DOCS mixed (documents of 100-4000 characters, as benchmarks/headline.py draws them) or full (one document a row).
Flags: a number N grows each micro-batch's tokens to a multiple of N (padding kept after the last label);
`static` turns off torch.compile's automatic dynamic shapes and gives every micro-batch the same boundary layout
(the offsets padded with empty documents to 64, the longest document set to the row length), so each token count
compiles its own static graph; `devicecheck` has the fused loss check its labels on the device (one sync a
micro-batch, as a model built outside `tigon.runtime.run.prepare` does); `nosync` also skips transformers' own
packed-sequence detection (another sync a micro-batch).

It prints, per micro-batch (30, or STEPS), its tokens, documents, the host's time to enqueue it and the time to
finish it; then as many micro-batches back to back with no sync between (`unsynced_tok_s`, the rate a training
loop sees), a cProfile of the host over 3 more, and the device syncs of one (`torch.cuda.set_sync_debug_mode`).
Tokens are the micro-batch's computed tokens (with a number N: after growing). Rows are 4096 tokens (SEQ) on a GPU;
without one a tiny Llama trains rows of 64. Writes OUT/varlen-steps-MODE.json.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from benchmarks.headline import prepare as prepare_config
from tigon.runtime import batches, data
from tigon.runtime.batches import collate, token_loss_sum
from tigon.runtime.config import load_config
from tigon.runtime.data import labelled_lengths
from tigon.runtime.run import prepare

MICRO_BATCH = 4
LAYERS = 4
MOST_DOCUMENTS = 64  # `static`: the boundary offsets a micro-batch is padded to


def static_boundaries(found: dict, row_length: int) -> dict:
    """The same documents with the offsets padded by empty documents to MOST_DOCUMENTS, the longest the row's length."""
    offsets = found["cu_seq_lens_q"]
    if offsets.numel() > MOST_DOCUMENTS + 1:
        raise ValueError(f"{offsets.numel() - 1} documents in a micro-batch; static takes up to {MOST_DOCUMENTS}")
    offsets = torch.cat([offsets, offsets[-1:].expand(MOST_DOCUMENTS + 1 - offsets.numel())])
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": row_length, "max_length_k": row_length}


def configure(flags: list[str]) -> int | None:
    """Apply the mode's flags to this process; returns the token multiple (None: the run's own)."""
    multiple = next((int(flag) for flag in flags if flag.isdigit()), None)
    if multiple:
        batches.token_multiple = lambda precision: multiple
    if "nosync" in flags:
        import transformers.masking_utils as masking

        masking.find_packed_sequence_indices = lambda position_ids: None
    if "static" in flags:
        import torch._dynamo

        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 64
        original = data.document_boundaries
        data.document_boundaries = lambda positions, lengths=None, device=None: static_boundaries(
            original(positions, lengths, device), positions.shape[1]
        )
    return multiple


def main(out: Path, mode: str, seq: int | None = None, steps: int = 30) -> dict:
    precision, compiled, docs, *flags = mode.split("-")
    multiple = configure(flags)
    cuda = torch.cuda.is_available()
    settings = [
        "data.packing_strategy=in_order",
        "training.gradient_checkpointing=false",
        "model.attn_implementation=varlen",
    ]
    path = prepare_config(
        out / "runs", "tigon-compiled" if compiled == "compiled" else "tigon", seq or (4096 if cuda else 64), 1, 60,
        MICRO_BATCH, LAYERS, tiny=not cuda, settings=[*settings, f"training.precision={precision}"], tag=mode,
        documents=docs,
    )  # fmt: skip
    config = load_config(path)
    prepared = prepare(config)
    model, dataset, device = prepared.model, prepared.train_dataset, prepared.device
    if "devicecheck" in flags:  # a run's model trusts its labels, checked on the host while it prepares
        from tigon.kernels.patching.causal_lm import CHECK_TARGETS

        model.__dict__[CHECK_TARGETS] = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    synchronize = torch.cuda.synchronize if cuda else lambda: None

    def micro_batch(index: int, sync: bool = True) -> dict:
        batch = collate([dataset[i] for i in range(MICRO_BATCH * index, MICRO_BATCH * (index + 1))])
        tokens = int(labelled_lengths(batch["labels"]).sum()) if docs == "mixed" else batch["input_ids"].numel()
        if multiple:
            tokens = -(-tokens // multiple) * multiple
        if sync:
            synchronize()
        begun = time.perf_counter()
        loss = token_loss_sum(model, batch, config.model.attn_implementation, device, precision)
        loss.backward()
        value = float(loss) if sync and index < 2 else None  # the first two losses, to compare modes
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        enqueued = time.perf_counter() - begun
        if sync:
            synchronize()
        return {
            "index": index, "loss": value, "tokens": tokens, "documents": int((batch["position_ids"] == 0).sum()),
            "enqueue_ms": enqueued * 1e3, "ms": (time.perf_counter() - begun) * 1e3,
        }  # fmt: skip

    steps = min(steps, len(dataset) // MICRO_BATCH // 2 - 4)
    rows = []
    for index in range(steps):
        rows.append(micro_batch(index))
        print(mode, json.dumps(rows[-1]), flush=True)
    timed = rows[min(5, steps // 2) :]
    summary = {
        "mode": mode,
        "median_tok_s": statistics.median(r["tokens"] / r["ms"] * 1e3 for r in timed),
        "total_tok_s": sum(r["tokens"] for r in timed) / sum(r["ms"] for r in timed) * 1e3,
        "median_ms": statistics.median(r["ms"] for r in timed),
        "median_enqueue_ms": statistics.median(r["enqueue_ms"] for r in timed),
    }
    synchronize()
    begun = time.perf_counter()
    unsynced = [micro_batch(index, sync=False) for index in range(steps, 2 * steps)]
    synchronize()
    summary["unsynced_tok_s"] = sum(r["tokens"] for r in unsynced) / (time.perf_counter() - begun)
    print("SUMMARY", json.dumps(summary), flush=True)
    host = cProfile.Profile()
    host.enable()
    for index in range(2 * steps, 2 * steps + 3):
        micro_batch(index, sync=False)
    synchronize()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    if cuda:
        syncs = []
        warnings.showwarning = lambda *args, **kwargs: syncs.append(
            " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()[-11:-2])
        )
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        micro_batch(2 * steps + 3)
        torch.cuda.set_sync_debug_mode(0)
        summary["syncs"] = syncs
        print("\n".join(f"SYNC {stack}" for stack in syncs))
    (out / f"varlen-steps-{mode}.json").write_text(json.dumps({"summary": summary, "micro_batches": rows}))
    return summary


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *(int(arg) for arg in sys.argv[3:5]))
