"""Causal attention forward+backward through PyTorch's SDPA backends, at the end-to-end shapes.

tigon's kernels, like Liger-Kernel's, leave attention to `scaled_dot_product_attention`, and at 1B-8B sizes
attention is the largest part of a step that is not a matrix product. This measures, per shape, PyTorch's
own choice (`default`, with the op it ran) and each backend forced alone: forward+backward time, the
attention FLOP rate, and the error of the output and of the three gradients against float32 math (on one
sequence's first heads). Tensors are laid out as transformers makes them: (batch, heads, tokens, dim)
views of (batch, tokens, heads, dim) memory, grouped-query heads through `enable_gqa` without a mask; the
`packed` rows carry a block-diagonal mask (two documents per row, as the runtime packs them), with the
key/value heads repeated, as transformers does when a mask is given.

    python -m benchmarks.attention_backends --out attention.json
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.harness import write_report

BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
# (name, batch, query heads, key/value heads, tokens, head dim, packed): Llama-3.2-1B at 4K and 8K x 8,
# Llama-3-8B at 4K x 8 and 16K x 1, and the 1B shape with two documents per row.
SHAPES = [
    ("llama-1b", 8, 32, 8, 4096, 64, False),
    ("llama-1b", 8, 32, 8, 8192, 64, False),
    ("llama-8b", 8, 32, 8, 4096, 128, False),
    ("llama-8b", 1, 32, 8, 16384, 128, False),
    ("llama-1b packed", 8, 32, 8, 4096, 64, True),
]


def attention_flops(batch: int, heads: int, tokens: int, head_dim: int) -> float:
    """Forward + backward matrix FLOPs of causal attention: 2 products forward, 5 backward, half the square."""
    return 7 * 2 * batch * heads * tokens * tokens * head_dim / 2


def attention(q, k, v, mask):
    if mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def run(backend: str, q, k, v, grad, mask):
    choice = BACKENDS[backend]
    with sdpa_kernel([choice]) if choice is not None else contextlib.nullcontext():
        out = attention(q, k, v, mask)
        out.backward(grad)
    return out


def chosen_op(q, k, v, grad, mask) -> str:
    """The SDPA op PyTorch's own choice runs here, by its aten name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run("default", q, k, v, grad, mask)
    ops = [e.key for e in profile.key_averages() if e.key.startswith("aten::_scaled_dot_product_")]
    return ", ".join(sorted(op.removeprefix("aten::") for op in ops if not op.endswith("_backward")))


def tokens_major(batch: int, heads: int, tokens: int, head_dim: int) -> torch.Tensor:
    """A (batch, heads, tokens, dim) view of (batch, tokens, heads, dim) memory: the layout transformers hands over."""
    return torch.randn(batch, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


def two_documents(batch: int, tokens: int) -> torch.Tensor:
    """(batch, 1, tokens, tokens) boolean mask: causal within each of two documents, none across them."""
    document = (torch.arange(tokens, device="cuda") >= tokens // 3).int()
    causal = torch.ones(tokens, tokens, device="cuda", dtype=torch.bool).tril()
    return (causal & (document[:, None] == document[None, :])).expand(batch, 1, tokens, tokens)


def relative_errors(backend: str, leaves, q, k, v, grad, mask, rows: int = 8) -> dict[str, float]:
    """||got - want|| / ||want|| of the output and each gradient against float32 math, on the first sequence's
    first `rows` query heads (and the key/value heads they read), which depend on nothing else."""
    groups = q.shape[1] // k.shape[1]
    pieces = [t[:1, :n] for t, n in ((q, rows), (k, rows // groups), (v, rows // groups))]
    reference = [t.detach().float().requires_grad_() for t in pieces]
    with sdpa_kernel([SDPBackend.MATH]):
        expected = attention(*reference, None if mask is None else mask[:1])
        expected.backward(grad[:1, :rows].float())
    for leaf in leaves:
        leaf.grad = None
    out = run(backend, q, k, v, grad, mask)
    grads = [leaf.grad.transpose(1, 2) for leaf in leaves]
    got = [out[:1, :rows], grads[0][:1, :rows], *(g[:1, : rows // groups] for g in grads[1:])]
    want = [expected, *(t.grad for t in reference)]
    return {
        name: ((a.float() - b).norm() / b.norm()).item()
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
    }


def measure(name: str, batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int, packed: bool) -> list[dict]:
    torch.manual_seed(0)
    kv_heads = heads if packed else kv_heads  # transformers repeats the key/value heads when it passes a mask
    leaves = [tokens_major(batch, h, tokens, head_dim)._base.requires_grad_() for h in (heads, kv_heads, kv_heads)]
    q, k, v = (leaf.transpose(1, 2) for leaf in leaves)
    grad = tokens_major(batch, heads, tokens, head_dim)
    mask = two_documents(batch, tokens) if packed else None
    rows = []
    for backend in BACKENDS:
        row = {"model": name, "shape": f"{batch}x{heads}/{kv_heads}x{tokens}x{head_dim}", "backend": backend}
        try:
            if backend == "default":
                row["op"] = chosen_op(q, k, v, grad, mask)
            row["errors"] = relative_errors(backend, leaves, q, k, v, grad, mask)
            ms = triton.testing.do_bench(lambda b=backend: run(b, q, k, v, grad, mask), grad_to_none=leaves, rep=300)
            row["ms"] = ms
            row["tflops"] = attention_flops(batch, heads, tokens, head_dim) / (ms * 1e-3) / 1e12
        except RuntimeError as error:
            row["error"] = str(error).splitlines()[0][:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | shape (batch x heads/kv x tokens x dim) | backend | fwd+bwd ms | TFLOP/s | worst rel. error |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        backend = f"{row['backend']} ({row['op']})" if row.get("op") else row["backend"]
        if "error" in row:
            lines.append(f"| {row['model']} | {row['shape']} | {backend} | not run: {row['error']} | | |")
        else:
            lines.append(
                f"| {row['model']} | {row['shape']} | {backend} | {row['ms']:.3f} | {row['tflops']:.0f} "
                f"| {max(row['errors'].values()):.1e} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention.json", help="JSON results file (markdown beside it)")
    args = parser.parse_args(argv)
    rows = [row for shape in SHAPES for row in measure(*shape)]
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    write_report(args.out, payload, markdown(rows))


if __name__ == "__main__":
    main()
