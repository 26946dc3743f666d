"""Pairs a chunk of the fused linear DPO and ORPO at Liger-Kernel's benchmark shape: time and memory.

    python -m benchmarks.tune_fused_linear_preference

16 pairs x 512 tokens x 4096 hidden x 128256 vocab, bf16, forward+backward through benchmarks.kernels' harness
(launched and graphed medians, peak memory beyond the inputs): tigon at 1, 2, 4 and 8 pairs a chunk, then
torch.compile and Liger-Kernel at the same shape in the same run. Larger chunks re-read the weight gradient
fewer times and hold more logits.
"""

from __future__ import annotations

from benchmarks.harness import measure_copy_bandwidth, measure_matmul_rate
from benchmarks.kernels import Case, dpo_case, orpo_case, run_case

PAIRS, SEQ, HIDDEN, VOCAB = 16, 512, 4096, 128256


def only(case: Case, *providers: str) -> Case:
    case.providers = {name: forward for name, forward in case.providers.items() if name in providers}
    return case


def main() -> None:
    copy_bw, matmul = measure_copy_bandwidth(), measure_matmul_rate()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s", flush=True)
    shape = f"{PAIRS} pairs x{SEQ}x{HIDDEN}x{VOCAB}"
    for op, make_case in (("fused_linear_dpo", dpo_case), ("fused_linear_orpo", orpo_case)):
        for pairs in (1, 2, 4, 8):
            print(f"{op}: {pairs} pairs a chunk", flush=True)
            run_case(
                op, shape, lambda m=make_case, p=pairs: only(m(PAIRS, SEQ, HIDDEN, VOCAB, p), "tigon"), copy_bw, matmul,
                with_memory=True,
            )  # fmt: skip
        run_case(
            op, shape, lambda m=make_case: only(m(PAIRS, SEQ, HIDDEN, VOCAB), "compile", "liger"), copy_bw, matmul,
            with_memory=True,
        )  # fmt: skip


if __name__ == "__main__":
    main()
