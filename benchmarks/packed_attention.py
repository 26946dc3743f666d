"""Packed fine-tuning data: real tokens/s and peak memory of tigon's varlen attention against the dense mask,
flex attention, and Hugging Face + Liger-Kernel on transformers' padding-free collator.

    python -m benchmarks.packed_attention --out packed.json                      # GPU: Llama-3.2-1B shape, 4096, 8192
    python -m benchmarks.packed_attention --tiny --out /tmp/packed.json          # CPU rehearsal, tiny shape

Data: documents of random tokens whose lengths are drawn log-uniformly from 100 to 4000 tokens (seeded; many
short, some long, as fine-tuning sets are), packed to the sequence length by tigon's own packer
(`PackedDataset`: greedy, in order; a row's tail is padding). A step trains on the documents of `--rows` packed
rows (8 x 4096 or 4 x 8192: 32768 token slots), one row's documents per micro-batch, accumulated; every
variant trains on the same documents in the same micro-batches, from the same initial weights (Llama-3.2-1B's
config, random init, bf16, gradient checkpointing on, AdamW, loss summed over the step's labelled tokens and
divided by their count, gradient clipping at 1.0). Tokens/s counts real tokens only (no padding).

- tigon:       tigon's kernels, model.attn_implementation varlen, through the torch trainer's step (its
               `run_global_batch`): each row without its padding, the documents' boundaries, no mask
- tigon-flex:  tigon's kernels, flex_attention (transformers builds the document BlockMask from position ids)
- tigon-dense: tigon's kernels, sdpa with the packed (1, 1, T, T) mask, padding included
- hf-liger:    Hugging Face modules + Liger-Kernel (`apply_liger_kernel_to_llama`), micro-batches made by
               `DataCollatorWithFlattening` (one row of the documents, position ids, no padding), a Trainer-style
               step (forward with num_items_in_batch, backward, clipping, fused AdamW)
- hf:          as hf-liger without Liger-Kernel
- hf-liger-padded, hf-padded: as hf-liger and hf, each micro-batch's documents as rows padded to the longest
               (a padding collator's batch: the mask covers the padding, the loss skips it)

Each run records the attention it took (the attention function transformers called and the mask it was given)
and its first step's loss: the same documents from the same weights must give the same loss in every variant.
Every run is a fresh subprocess, so peaks do not mix. JSON to --out, the table to --md (default: --out with .md).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmarks.end_to_end_runner import Budget, environment, liger_function, run_worker
from benchmarks.presets import PRESETS
from tigon.runtime.files import atomic_write_text

GiB = 2**30
VARIANTS = {  # variant: (tigon's kernels, model.attn_implementation, Liger-Kernel, HF micro-batches padded)
    "tigon": (True, "varlen", False, False),
    "hf-liger": (False, "sdpa", True, False),
    "hf-liger-padded": (False, "sdpa", True, True),
    "tigon-dense": (True, "sdpa", False, False),
    "hf": (False, "sdpa", False, False),
    "hf-padded": (False, "sdpa", False, True),
    "tigon-flex": (True, "flex_attention", False, False),
}
TOKENS_PER_STEP = 32768


def documents(n_tokens: int, vocab: int, low: int, high: int, seed: int) -> list[list[int]]:
    """Documents of random tokens, lengths log-uniform in [low, high], until they hold `n_tokens` tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    docs, total = [], 0
    while total < n_tokens:
        u = float(torch.rand((), generator=generator))
        length = round(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))
        docs.append(torch.randint(0, vocab, (length,), generator=generator).tolist())
        total += length
    return docs


def packed_rows(spec: dict):
    """The run's PackedDataset: enough rows for warm-up and timed steps."""
    from tigon.runtime.data import PackedDataset

    rows_needed = spec["rows"] * (spec["warmup"] + spec["steps"])
    docs = documents(rows_needed * spec["seq"], spec["shape"]["vocab_size"], spec["low"], spec["high"], spec["seed"])
    dataset = PackedDataset([(d, d) for d in docs], spec["seq"], pad_token_id=0, strategy="in_order")
    if len(dataset) < rows_needed:
        raise RuntimeError(f"packed {len(dataset)} rows, the run needs {rows_needed}")
    return dataset


def row_documents(row: dict) -> list[list[int]]:
    """A packed row's documents (its padding dropped): split where position ids restart at 0."""
    from tigon.runtime.data import labelled_lengths

    length = int(labelled_lengths(row["labels"][None])[0])
    ids, positions = row["input_ids"][:length].tolist(), row["position_ids"][:length].tolist()
    starts = [i for i, p in enumerate(positions) if p == 0] + [length]
    return [ids[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def run_config(spec: dict, cuda: bool):
    from tigon.runtime.config import parse_config

    kernels, attention, _, _ = VARIANTS[spec["variant"]]
    raw = {
        "name": f"packed-{spec['variant']}",
        "model": {
            "config_name": "llama",
            "config_overrides": dict(spec["shape"]),
            "tokenizer": "char",
            "dtype": "bfloat16" if cuda else "float32",
            "attn_implementation": attention,
        },
        "data": {"train": "random-documents", "max_seq_len": spec["seq"]},
        "training": {
            "max_steps": spec["warmup"] + spec["steps"],
            "learning_rate": 1e-4,
            "lr_schedule": "constant",
            "micro_batch_size": 1,
            "gradient_accumulation_steps": spec["rows"],
            "gradient_checkpointing": True,
            "precision": "bf16" if cuda else "fp32",
        },
        "kernels": {"enabled": kernels},
        "checkpoint": {"export": False, "resume": False},
        "logging": {"run_dir": "runs/packed", "tensorboard": False, "progress_bar": False},
    }
    return parse_config(raw, f"packed_attention {spec['variant']}")


def record_attention(model, seen: dict) -> None:
    """Wrap the model's attention function to record what it was called with: the function and the mask it got
    (or the documents' boundaries) on the first call that had one, else on the first call (rows of one document)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    function = ALL_ATTENTION_FUNCTIONS[name]

    def recorded(module, query, key, value, attention_mask, **kwargs):
        boundaries = kwargs.get("cu_seq_lens_q") is not None
        if not seen or (seen["plain"] and (attention_mask is not None or boundaries)):
            if attention_mask is None:
                mask = "no mask"
            elif hasattr(attention_mask, "mask_mod"):
                mask = f"BlockMask {tuple(attention_mask.shape)}"
            else:
                mask = f"{str(attention_mask.dtype).removeprefix('torch.')} mask {tuple(attention_mask.shape)}"
            described = f"{name}: {mask}{', document boundaries' if boundaries else ''}, query {tuple(query.shape)}"
            seen.update(attention=described, plain=attention_mask is None and not boundaries)
        return function(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS[name] = recorded


def worker(spec: dict) -> dict:
    """One variant at one sequence length in this (fresh) process."""
    import torch

    from tigon.runtime import batches, torch_trainer
    from tigon.runtime.config import ConfigError
    from tigon.runtime.distributed import DistEnv
    from tigon.runtime.model import build_model
    from tigon.runtime.run import seed_everything
    from tigon.runtime.strategies import build_strategy

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    head = {"variant": spec["variant"], "seq": spec["seq"]}
    kernels, attention, liger, padded = VARIANTS[spec["variant"]]
    apply_liger = None
    if liger:
        apply_liger, missing = liger_function("llama", cuda)
        if missing:
            return {**head, "unavailable": missing}
    config = run_config(spec, cuda)
    dataset = packed_rows(spec)
    if cuda:
        torch.zeros((), device=device)
        torch.cuda.reset_peak_memory_stats(device)
    seed_everything(config.training.seed)
    try:
        with device:
            model = build_model(config, spec["shape"]["vocab_size"])
    except ConfigError as error:  # flex attention on a CPU
        return {**head, "unavailable": str(error)}
    if apply_liger is not None:
        apply_liger(model=model)
    seen: dict = {}
    record_attention(model, seen)
    env = DistEnv()
    total = spec["warmup"] + spec["steps"]
    if spec["variant"].startswith("tigon"):
        strategy = build_strategy(model, config, env, device, total)
        strategy.model.train()

        def step(rows: list[dict], number: int) -> float:
            micro_batches = [batches.collate([row]) for row in rows]
            return torch_trainer.run_global_batch(strategy, micro_batches, config, env, device, number)[0]
    else:
        step = hf_step(model, config, device, padded)
    losses, seconds, tokens = [], 0.0, 0
    try:
        for number in range(total):
            rows = [dataset[i] for i in range(number * spec["rows"], (number + 1) * spec["rows"])]
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            losses.append(step(rows, number + 1))
            if cuda:
                torch.cuda.synchronize(device)
            if number >= spec["warmup"]:
                seconds += time.perf_counter() - started
                tokens += sum(len(doc) for row in rows for doc in row_documents(row))
    except torch.OutOfMemoryError:
        return {**head, "oom": True, "attention": seen.get("attention")}
    return {
        **head,
        "oom": False,
        "tokens_per_second": tokens / seconds,
        "real_tokens_per_step": tokens / spec["steps"],
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "losses": losses,
        "attention": seen.get("attention"),
    }


def padded_batch(docs: list[list[int]]) -> dict:
    """The documents as rows padded to the longest, as a padding collator makes them: the padding masked out of
    attention and of the loss."""
    import torch

    longest = max(map(len, docs))
    input_ids = torch.zeros(len(docs), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for i, doc in enumerate(docs):
        input_ids[i, : len(doc)] = torch.tensor(doc)
        attention_mask[i, : len(doc)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(attention_mask == 0, -100),
    }


def hf_step(model, config, device, padded: bool = False):
    """A Hugging Face Trainer-style step over micro-batches of `DataCollatorWithFlattening` (or, `padded`, of the
    same documents as padded rows): forward under autocast, the loss summed over the step's labelled tokens
    (`num_items_in_batch`), clipping, fused AdamW."""
    import torch
    from transformers import DataCollatorWithFlattening

    from tigon.runtime.batches import autocast

    flattening = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)

    def collator(items: list[dict]) -> dict:
        return padded_batch([item["input_ids"] for item in items]) if padded else flattening(items)

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.training.learning_rate, fused=device.type == "cuda")
    model.train()

    def step(rows: list[dict], number: int) -> float:
        batches = [collator([{"input_ids": doc} for doc in row_documents(row)]) for row in rows]
        items = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in batches)
        loss_sum = 0.0
        for batch in batches:
            batch = {key: value.to(device) for key, value in batch.items()}
            with autocast(device, config.training.precision):  # the Trainer's bf16=True
                loss = model(**batch, use_cache=False, num_items_in_batch=items).loss
            loss.backward()
            loss_sum += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss_sum)

    return step


# ---------------------------------------------------------------------------------------------------- driver


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    """`worker(spec)` in a fresh interpreter (`run_worker`)."""
    return run_worker("benchmarks.packed_attention", spec, {"variant": spec["variant"], "seq": spec["seq"]}, timeout)


def outcome(run: dict) -> str | None:
    """Why a run has no measurement, or None."""
    if "unavailable" in run:
        return f"not available: {run['unavailable']}"
    if "skipped" in run:
        return f"not run: {run['skipped']}"
    if "error" in run:
        return f"failed: {run['error']}"
    if run.get("oom"):
        return "out of memory"
    return None


def markdown(report: dict) -> str:
    env, settings = report["environment"], report["settings"]
    lines = [
        f"Packed fine-tuning data: {env.get('gpu') or 'CPU'}, torch {env['torch']}, transformers {env['transformers']}"
        + (f", triton {env['triton']}" if env.get("triton") else "")
        + (f", liger-kernel {env['liger_kernel']}" if env.get("liger_kernel") else ""),
        "",
        f"{settings['model']}; documents of {settings['low']} to {settings['high']} tokens (log-uniform, seed "
        f"{settings['seed']}); {settings['tokens_per_step']} token slots a step, one packed row a micro-batch; "
        f"{settings['warmup']} warm-up and {settings['steps']} timed steps.",
        "",
        "| seq | variant | real tokens/s | vs hf-liger | peak GiB | real tokens a step | first-step loss | attention |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        why = outcome(run)
        if why:
            lines.append(f"| {run['seq']} | {run['variant']} | {why} | | | | | {run.get('attention') or ''} |")
            continue
        liger = next(
            (r for r in report["runs"] if r["seq"] == run["seq"] and r["variant"] == "hf-liger" and not outcome(r)),
            None,
        )
        cells = [
            run["seq"],
            run["variant"],
            f"{run['tokens_per_second']:,.0f}",
            f"{run['tokens_per_second'] / liger['tokens_per_second']:.2f}x" if liger else "-",
            f"{run['peak_bytes'] / GiB:.2f}" if run["peak_bytes"] else "-",
            f"{run['real_tokens_per_step']:,.0f}",
            f"{run['losses'][0]:.4f}",
            run.get("attention") or "-",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON results file")
    parser.add_argument("--md", help="markdown table file (default: --out with .md)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seqs", default=None, help="sequence lengths (default 4096,8192; --tiny: 256,512)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --tiny 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the documents")
    parser.add_argument("--tiny", action="store_true", help="tiny model and documents: a CPU rehearsal")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; later runs are not started")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    preset = PRESETS["llama"]
    shape = preset.tiny_shape() if args.tiny else preset.shape()
    seqs = [int(s) for s in (args.seqs or ("256,512" if args.tiny else "4096,8192")).split(",")]
    low, high = (10, 250) if args.tiny else (100, 4000)
    tokens_per_step = 4 * max(seqs) if args.tiny else TOKENS_PER_STEP
    steps = args.steps or (2 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    settings = {
        "model": preset.describe(tiny=args.tiny),
        "low": low,
        "high": high,
        "seed": args.seed,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "warmup": warmup,
    }
    report = {"environment": environment(), "settings": settings, "runs": []}
    budget = Budget(args.time_budget)
    for variant in variants:
        for seq in seqs:
            if not budget.allows_another():
                report["runs"].append({"variant": variant, "seq": seq, "skipped": budget.skipped()})
                continue
            spec = {"variant": variant, "seq": seq, "shape": shape, "rows": tokens_per_step // seq}
            spec |= {"steps": steps, "warmup": warmup, "low": low, "high": high, "seed": args.seed}
            run = run_in_subprocess(spec, timeout=max(60.0, min(600.0, budget.left())))
            budget.record(run)
            measured = outcome(run) or "{:,.0f} real tokens/s".format(run["tokens_per_second"])
            print(f"{variant} at {seq}: {measured}", flush=True)
            report["runs"].append(run)
    table = markdown(report)
    print(table)
    if args.out:
        out = Path(args.out)
        atomic_write_text(out, json.dumps(report, indent=2) + "\n")
        atomic_write_text(Path(args.md) if args.md else out.with_suffix(".md"), table)


if __name__ == "__main__":
    main()
