"""Launch-configuration sweep for the cross-entropy kernel at 8192 x 128256 bf16 (forward+backward).

    python -m benchmarks.tune_cross_entropy

Rows in flight (programs per multiprocessor) decide how much of a row pass 2 finds still in L2; the
vocabulary chunk how many bytes each program has in flight (the next chunk is loaded into registers while
one is worked on), and the warps how many threads share a chunk. Each configuration is timed from a CUDA
graph, as benchmarks/kernels.py times the op, so launch gaps stay out.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

from tigon.kernels.ops import cross_entropy as ce
from tigon.kernels.utils import multiprocessor_count


def graphed_ms(step) -> float:
    return triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")


def main() -> None:
    tokens, vocab = 8192, 128256
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    floor_bytes = 2 * logits.numel() * logits.element_size()
    source = torch.empty(1 << 28, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: source.clone(), return_mode="median")
    bandwidth = 2 * source.numel() * 4 / (copy_ms * 1e-3)
    print(f"copy {bandwidth / 1e12:.2f} TB/s, floor {floor_bytes / bandwidth * 1e3:.3f} ms", flush=True)

    def percent(ms: float) -> str:
        return f"{100 * floor_bytes / bandwidth / (ms * 1e-3):5.1f}% of copy"

    grad = logits.detach().clone()
    for factor in (1.0, 0.5):
        g = torch.full((), factor, device="cuda")
        print(f"backward scaling alone, factor {factor}: {graphed_ms(lambda g=g: ce.scale_in_place(grad, g)):.4f} ms")
    sms = multiprocessor_count(logits.device)
    original, rows = ce._launch_config, []
    shapes = itertools.product((4, 64), (4096, 8192, 16384), (8, 16, 32), (8, 16, None))
    for per_sm, block, warps, lane in shapes:
        if not 4 <= block // (32 * warps) <= 64:
            continue  # too few or too many values a thread
        lane = lane or block  # None: one (max, sum) a chunk
        setting = f"per_sm={per_sm} block={block} warps={warps} lane={lane}"
        config = (min(tokens, sms * per_sm), block, warps, lane)
        ce._launch_config = lambda n_rows, n_cols, element_size, device, c=config: c

        def step():
            torch.autograd.grad(ce.cross_entropy(logits, target, check_targets=False), [logits])

        try:
            step()
            ms = graphed_ms(step)
        except Exception as error:  # a configuration that does not compile is reported and skipped
            print(f"{setting}: {type(error).__name__}")
            continue
        print(f"{ms:.3f} ms  {percent(ms)}  {setting}", flush=True)
        rows.append((ms, setting))
    ce._launch_config = original
    print(f"best on {torch.cuda.get_device_name()}:")
    for ms, setting in sorted(rows)[:8]:
        print(f"{ms:.3f} ms  {percent(ms)}  {setting}")


if __name__ == "__main__":
    main()
