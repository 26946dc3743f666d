"""Launch-configuration sweep for the cross-entropy kernel at 8192 x 128256 bf16 (forward+backward).

    python -m benchmarks.tune_cross_entropy

Rows in flight (programs per multiprocessor) decide whether pass 2 re-reads rows from L2; the
vocabulary chunk and warps decide how many bytes each program has in flight.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

from tigon.kernels.ops import cross_entropy as ce
from tigon.kernels.utils import multiprocessor_count


def main() -> None:
    tokens, vocab = 8192, 128256
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    floor_bytes = 2 * logits.numel() * logits.element_size()
    source = torch.empty(1 << 28, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: source.clone(), return_mode="median")
    bandwidth = 2 * source.numel() * 4 / (copy_ms * 1e-3)
    sms = multiprocessor_count(logits.device)
    original, rows = ce._launch_config, []
    for per_sm, block, warps in itertools.product((1, 2, 4, 8, 64), (4096, 8192, 16384), (8, 16, 32)):
        config = (min(tokens, sms * per_sm), block, warps)
        ce._launch_config = lambda n_rows, n_cols, device, c=config: c

        def step():
            torch.autograd.grad(ce.cross_entropy(logits, target, check_targets=False), [logits])

        try:
            ms = triton.testing.do_bench(step, warmup=20, rep=100, return_mode="median")
        except Exception as error:  # a configuration that does not compile is reported and skipped
            print(f"per_sm={per_sm} block={block} warps={warps}: {type(error).__name__}")
            continue
        rows.append((ms, per_sm, block, warps))
    ce._launch_config = original
    for ms, per_sm, block, warps in sorted(rows)[:10]:
        print(
            f"{ms:.3f} ms  {100 * floor_bytes / bandwidth / (ms * 1e-3):5.1f}% of copy  per_sm={per_sm} "
            f"block={block} warps={warps}"
        )


if __name__ == "__main__":
    main()
