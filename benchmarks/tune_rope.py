"""Launch-configuration sweep for the RoPE kernel: tokens per program and warps, Llama's heads (32 q, 8 kv, head
dim 128), batch 4, sequence 1024-8192, bf16, forward+backward timed from a CUDA graph (as benchmarks/kernels.py
times the op), beside Liger-Kernel when it is installed.

    python -m benchmarks.tune_rope

At short sequences one program per token leaves the op a few waves of small programs; several tokens per program
put more bytes in flight per program and fewer programs in the tail.
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.harness import graph_median_ms, measure_copy_bandwidth
from benchmarks.kernels import rope_case
from tigon.kernels.ops import rope as rope_module


def graphed_ms(case, forward) -> float:
    """forward+backward of one provider of `case`, from a CUDA graph."""

    def step():
        torch.autograd.grad(forward(), case.leaves, case.grads)

    step()
    return graph_median_ms(step, case.leaves)


def main() -> None:
    bandwidth = measure_copy_bandwidth()
    print(f"copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    original = rope_module._launch_config
    for seq in (1024, 2048, 4096, 8192):
        case = rope_case(4, 32, 8, seq, 128)
        floor_ms = case.bytes_moved / bandwidth * 1e3
        if "liger" in case.providers:
            ms = graphed_ms(case, case.providers["liger"])
            print(f"seq {seq}: liger {ms:.4f} ms ({100 * floor_ms / ms:.1f}% of copy)", flush=True)
        rows = []
        for tokens, warps in itertools.product((1, 2, 4, 8), (4, 8, 16)):
            rope_module._launch_config = lambda *shape, t=tokens, w=warps: (t, *original(*shape)[1:5], w)
            try:
                ms = graphed_ms(case, case.providers["tigon"])
            except Exception as error:  # a configuration that does not compile is reported and skipped
                print(f"seq {seq} tokens={tokens} warps={warps}: {type(error).__name__}")
                continue
            finally:
                rope_module._launch_config = original
            rows.append((ms, tokens, warps))
            print(f"seq {seq}: {ms:.4f} ms ({100 * floor_ms / ms:.1f}%) tokens={tokens} warps={warps}", flush=True)
        ms, tokens, warps = min(rows)
        rule_ms = graphed_ms(case, case.providers["tigon"])
        print(f"seq {seq} best: {ms:.4f} ms tokens={tokens} warps={warps}; the current rule: {rule_ms:.4f} ms")


if __name__ == "__main__":
    main()
