"""Packed documents' causal attention, forward+backward: cuDNN's ragged kernel against PyTorch's varlen flash.

The runtime's "varlen" attention takes cuDNN's kernel on Hopper and Blackwell GPUs where NVIDIA's cuDNN frontend
is installed (`tigon.runtime.cudnn_attention`) and PyTorch's flash kernel elsewhere. This times both on the
(tokens, heads, dim) tensors a packed micro-batch hands them, at the Llama-3.2-1B and Llama-3-8B heads, for
documents of mixed lengths (log-uniform, as `benchmarks/packed_attention.py` draws them) and for rows that are one
document each; and the error of the output and the three gradients against float32 attention over each document.

    python -m benchmarks.varlen_attention --out varlen-attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks.harness import write_report
from tigon.runtime import cudnn_attention

TOKENS = 32768  # a micro-batch of 8 x 4096
# (model, query heads, key/value heads, head dim)
MODELS = [("llama-3.2-1b", 32, 8, 64), ("llama-3-8b", 32, 8, 128)]
# (name, shortest, longest document): log-uniform lengths until the micro-batch is full
MIXES = [("100-4000 tokens", 100, 4000), ("100-1000 tokens", 100, 1000), ("4096 each", 4096, 4096)]


def lengths(shortest: int, longest: int, seed: int = 0) -> list[int]:
    draw, left, out = random.Random(seed), TOKENS, []
    while left:
        length = min(left, round(math.exp(draw.uniform(math.log(shortest), math.log(longest)))))
        out.append(length)
        left -= length
    return out


def flops(documents: list[int], heads: int, head_dim: int) -> float:
    """Forward + backward matrix FLOPs of causal attention over each document: 7 products of half the square."""
    return sum(7 * 2 * heads * n * n * head_dim / 2 for n in documents)


def flash(q, k, v, starts, longest):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, starts, starts, longest, longest, window_size=(-1, 0))


def cudnn(q, k, v, starts, longest):
    return cudnn_attention.attend(q, k, v, starts, longest)


def errors(kernel, q, k, v, grad, starts, documents, rows: int = 4096) -> dict[str, float]:
    """||got - want|| / ||want|| of the output and each gradient against float32 attention, over the documents
    within the first `rows` tokens (each depends on nothing else)."""
    ends = [end for end in itertools.accumulate(documents) if end <= rows] or [documents[0]]
    count = ends[-1]
    for x in (q, k, v):
        x.grad = None
    out = kernel(q, k, v, starts, max(documents))
    out.backward(grad)
    got = [out[:count], q.grad[:count], k.grad[:count], v.grad[:count]]
    leaves = [x[:count].detach().float().requires_grad_() for x in (q, k, v)]
    pieces = []
    for start, end in itertools.pairwise([0, *ends]):
        qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in leaves)
        pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
    want = torch.cat(pieces)
    want.backward(grad[:count].float())
    return {
        name: float((a.float() - b).norm() / b.norm())
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, [want, *(x.grad for x in leaves)], strict=True)
    }


def measure(model: str, heads: int, kv_heads: int, head_dim: int, mix: str, shortest: int, longest: int) -> list:
    documents = lengths(shortest, longest)
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(TOKENS, h, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(TOKENS, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *itertools.accumulate(documents)], dtype=torch.int32, device="cuda")
    rows = []
    for name, kernel in (("flash", flash), ("cudnn", cudnn)):
        row = {"model": model, "documents": mix, "count": len(documents), "kernel": name}
        row["errors"] = errors(kernel, q, k, v, grad, starts, documents)

        def step(kernel=kernel):
            kernel(q, k, v, starts, max(documents)).backward(grad)

        row["ms"] = triton.testing.do_bench(step, grad_to_none=[q, k, v], rep=300)
        row["tflops"] = flops(documents, heads, head_dim) / (row["ms"] * 1e-3) / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows[-1]["speedup"] = rows[0]["ms"] / rows[-1]["ms"]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | documents (count) | kernel | fwd+bwd ms | TFLOP/s | worst rel. error | cuDNN's speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else ""
        lines.append(
            f"| {row['model']} | {row['documents']} ({row['count']}) | {row['kernel']} | {row['ms']:.3f} "
            f"| {row['tflops']:.0f} | {max(row['errors'].values()):.1e} | {speedup} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="varlen-attention.json", help="JSON results file (markdown beside it)")
    args = parser.parse_args(argv)
    q = torch.empty(1, 32, 64, device="cuda", dtype=torch.bfloat16)
    if not cudnn_attention.supports(q, q[:, :8], 0.0, None):
        raise SystemExit("cuDNN's ragged attention does not run here: it needs a Hopper or Blackwell GPU and "
                         "nvidia-cudnn-frontend (pip install nvidia-cudnn-frontend)")  # fmt: skip
    rows = [row for model in MODELS for mix in MIXES for row in measure(*model, *mix)]
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "rows": rows}  # fmt: skip
    write_report(args.out, payload, markdown(rows))


if __name__ == "__main__":
    main()
