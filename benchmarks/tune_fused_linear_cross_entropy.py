"""Chunk size and weight-gradient accumulation of fused linear cross entropy: time, memory, error.

    python -m benchmarks.tune_fused_linear_cross_entropy

At 8192 tokens x 4096 hidden x 128256 vocab (bf16): for each chunk size, with the weight gradient
accumulated in fp32 or in bf16, the forward+backward time, the peak memory beyond the inputs,
and the relative error of the weight gradient against an fp32 accumulation at one large chunk.
"""

from __future__ import annotations

import torch
import triton.testing

from tigon.kernels.functional import fused_linear_cross_entropy


def main() -> None:
    tokens, hidden, vocab = 8192, 4096, 128256
    torch.manual_seed(0)
    x = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), device="cuda")

    def grads(chunk: int, fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        loss = fused_linear_cross_entropy(x, w, target, chunk_size=chunk, accumulate_in_fp32=fp32, check_targets=False)
        return torch.autograd.grad(loss, [x, w])

    reference_dw = grads(8192, True)[1].float()
    print("chunk  accumulate   ms       peak MB   dW rel. error vs fp32 single chunk")
    for chunk in (256, 512, 1024, 2048, 4096):
        for fp32 in (True, False):
            ms = triton.testing.do_bench(lambda c=chunk, f=fp32: grads(c, f), warmup=2, rep=300, return_mode="median")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            _, dw = grads(chunk, fp32)
            peak = (torch.cuda.max_memory_allocated() - before) / 1e6
            error = ((dw.float() - reference_dw).norm() / reference_dw.norm()).item()
            print(f"{chunk:5d}  {'fp32' if fp32 else 'bf16':10s} {ms:7.2f}  {peak:9.0f}   {error:.2e}", flush=True)
            del dw


if __name__ == "__main__":
    main()
