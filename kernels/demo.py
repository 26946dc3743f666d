"""Kernel demo: train steps of a small Llama with and without tigon's kernels, side by side.

python -m tigon.kernels.demo            # GPU: speed-up and memory saved; CPU: reference path
python -m tigon.kernels.demo --steps 3  # fewer timed steps
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch

from tigon.kernels.patching import apply
from tigon.kernels.utils import interpreter_active


def build_model(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    large = device == "cuda"
    config = LlamaConfig(
        hidden_size=2048 if large else 64,
        intermediate_size=5632 if large else 176,
        num_hidden_layers=4 if large else 2,
        num_attention_heads=16 if large else 4,
        num_key_value_heads=4 if large else 2,
        vocab_size=32000 if large else 512,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def time_steps(model, batch: torch.Tensor, steps: int) -> tuple[float, float, int]:
    """Median forward+backward seconds, the first step's loss, and peak bytes (GPU only)."""
    timings, first_loss = [], None
    if batch.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 1):
        if batch.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if batch.is_cuda:
            torch.cuda.synchronize()
        if step == 0:
            first_loss = loss.item()
        else:
            timings.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if batch.is_cuda else 0
    return statistics.median(timings), first_loss, peak


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed forward+backward steps per model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    baseline = build_model(device, dtype)
    patched = copy.deepcopy(baseline)
    batch_size, seq = (4, 2048) if device == "cuda" else (2, 32)
    batch = torch.randint(0, baseline.config.vocab_size, (batch_size, seq), device=device)

    print(f"[1/2] Hugging Face eager: {batch_size} x {seq} tokens, {args.steps} steps on {device}")
    base_time, base_loss, base_peak = time_steps(baseline, batch, args.steps)
    del baseline
    report = apply(patched)
    print(f"[2/2] {report}")
    tigon_time, tigon_loss, tigon_peak = time_steps(patched, batch, args.steps)

    tokens = batch.numel()
    print("\n                 step time    tokens/s     peak memory   first loss")
    for name, seconds, peak, loss in (
        ("HF eager", base_time, base_peak, base_loss),
        ("tigon", tigon_time, tigon_peak, tigon_loss),
    ):
        print(f"{name:12s}  {seconds * 1e3:10.1f} ms {tokens / seconds:11.0f} {peak / 2**30:11.2f} GiB   {loss:.5f}")
    if device == "cuda":
        saved = 100 * (1 - tigon_peak / base_peak)
        print(f"\nspeed-up {base_time / tigon_time:.2f}x, peak memory {saved:.0f}% lower")
    elif interpreter_active():
        print("\nCPU: the Triton kernels ran through Triton's interpreter (correctness, not speed).")
    else:
        print("\nCPU: no GPU, so tigon ran its pure-PyTorch reference path (same math, no speed-up).")
    if abs(tigon_loss - base_loss) > 1e-2 * abs(base_loss):
        raise SystemExit(f"loss mismatch: HF {base_loss} vs tigon {tigon_loss}")
    print(f"losses agree: |{tigon_loss:.5f} - {base_loss:.5f}| within 1%")


if __name__ == "__main__":
    main()
