"""Chunk size and weight-gradient accumulation of fused linear cross entropy: time, memory, error.

    python -m benchmarks.tune_fused_linear_cross_entropy

At 8192 tokens x 4096 hidden x 128256 vocab (bf16): for each chunk size, with the weight gradient
accumulated in fp32 or in bf16, the forward+backward time, the peak memory beyond the inputs,
and the relative error of the weight gradient against an fp32 accumulation at one large chunk.
Then, per chunk size, each step of one chunk timed alone from a CUDA graph (the logits matmul, the
cross-entropy kernel, the hidden gradient's matmul, the weight gradient's accumulating matmul), to show
which one small chunks slow down.

    python -m benchmarks.tune_fused_linear_cross_entropy --time-memory flce-time-memory.png

instead plots time against peak memory: tigon at each chunk size, with the logits in a buffer of their own and
held in the weight gradient, torch.compile and Liger-Kernel, with two reference lines (1.15x the matmul
floor, Liger-Kernel's memory) drawn in.

    python -m benchmarks.tune_fused_linear_cross_entropy --traffic-bound

times the memory traffic alone that a pass at Liger-Kernel's memory (256-token chunks) must move, next to 1.15x
the matmul floor: per chunk, two reads of the weight (for the logits and for the hidden gradient's product) and a read
and a write of the bf16 weight gradient; and the same with the two weight reads shared.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton.testing

from benchmarks.harness import measure_copy_bandwidth, measure_matmul_rate
from benchmarks.kernels import Case, fused_linear_cross_entropy_case, run_case
from tigon.kernels.functional import fused_linear_cross_entropy
from tigon.kernels.ops.cross_entropy import LossOptions, cross_entropy_rows, loss_scales
from tigon.kernels.ops.fused_linear_cross_entropy import accumulate_product


def one_chunk(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, chunk: int) -> dict[str, Callable[[], object]]:
    """The four steps the op runs on each chunk of `chunk` tokens, on the first chunk's tensors."""
    vocab = w.shape[0]
    options = LossOptions()
    scales = loss_scales(target, None, vocab, options)
    losses = torch.empty(chunk, device="cuda")
    logits = torch.empty(chunk, vocab, device="cuda", dtype=x.dtype)
    grad_hidden = torch.empty_like(x[:chunk])
    grad_weight = torch.empty_like(w)
    h = x[:chunk]
    return {
        "logits = h @ W.T": lambda: torch.mm(h, w.t(), out=logits),
        "cross-entropy kernel": lambda: cross_entropy_rows(logits, target[:chunk], None, scales, options, True, losses),
        "dh = dlogits @ W": lambda: torch.mm(logits, w, out=grad_hidden),
        "dW += dlogits.T @ h": lambda: accumulate_product(grad_weight, logits.t(), h, first=False),
    }


def chunk_steps(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> None:
    """Each step of one chunk graph-timed, with the matmuls' rates, and their sum over a whole pass."""
    tokens, hidden = x.shape
    print("chunk  step                      ms      TFLOP/s")
    for chunk in (256, 512, 1024, 2048):
        total = 0.0
        for name, step in one_chunk(x, w, target, chunk).items():
            step()
            ms = triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")
            total += ms
            rate = "" if "kernel" in name else f"{2 * chunk * hidden * w.shape[0] / ms / 1e9:7.0f}"
            print(f"{chunk:5d}  {name:22s} {ms:7.3f}  {rate}", flush=True)
        print(f"{chunk:5d}  {'sum x chunks':22s} {total * tokens / chunk:7.2f}", flush=True)


def time_against_memory(
    path: str,
    chunks: tuple[int, ...] = (256, 384, 512, 768, 1024, 2048, 4096),
    borrowed_chunks: tuple[int, ...] = (512, 768, 1024),
) -> None:
    """Forward+backward time (graphed; launched for Liger-Kernel, which cannot be graphed) against peak memory
    at 8192 x 4096 x 128256 bf16, printed and plotted to `path` with two reference lines
    (1.15x the matmul floor, Liger-Kernel's peak): tigon's chunk sizes with the
    logits in a buffer of their own (`chunks`) and held in the weight gradient (`borrowed_chunks`, at most 1024
    tokens: a quarter of the weight gradient)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, hidden, vocab = 8192, 4096, 128256
    shape = f"{tokens}x{hidden}x{vocab}"
    case = fused_linear_cross_entropy_case(tokens, hidden, vocab)
    x, w = case.leaves
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    providers = {
        f"tigon, {chunk}-token chunks": lambda c=chunk: (
            fused_linear_cross_entropy(x, w, target, chunk_size=c, check_targets=False, borrow_weight_grad=False),
        )
        for chunk in chunks
    }
    providers |= {
        f"tigon, {chunk}-token chunks in the weight gradient": lambda c=chunk: (
            fused_linear_cross_entropy(x, w, target, chunk_size=c, check_targets=False),
        )
        for chunk in borrowed_chunks
    }
    providers |= {name: case.providers[name] for name in ("compile", "liger") if name in case.providers}
    case = Case(case.leaves, case.grads, case.bytes_moved, providers, case.flops)
    rows = run_case("fused_linear_cross_entropy/chunk", shape, lambda: case, measure_copy_bandwidth(),
                    measure_matmul_rate(), with_memory=True)  # fmt: skip
    floor_ms = rows[0].floor_ms
    print(f"floor {floor_ms:.2f} ms (time bar {1.15 * floor_ms:.2f} ms)")
    points = {r.provider: (r.peak_extra_mb, r.graph_ms if r.graph_ms == r.graph_ms else r.ms) for r in rows}
    figure, axis = plt.subplots(figsize=(8, 5))
    for label, sizes, suffix in (
        ("tigon, logits buffer of its own", chunks, "chunks"),
        ("tigon, logits in the weight gradient", borrowed_chunks, "chunks in the weight gradient"),
    ):
        line = [points[f"tigon, {chunk}-token {suffix}"] for chunk in sizes]
        axis.plot(*zip(*line, strict=True), marker="o", label=f"{label} (chunk sizes)")
        for chunk, (mb, ms) in zip(sizes, line, strict=True):
            axis.annotate(str(chunk), (mb, ms), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for name in ("compile", "liger"):
        if name in points:
            axis.plot(
                *points[name],
                marker="s",
                linestyle="none",
                label={"compile": "torch.compile"}.get(name, "Liger-Kernel (launched: it cannot be graphed)"),
            )
    axis.axhline(1.15 * floor_ms, color="gray", linestyle="--", label="time bar: 1.15x the matmul floor")
    if "liger" in points:
        axis.axvline(points["liger"][0], color="gray", linestyle=":", label="memory bar: Liger-Kernel's peak")
    axis.set_xscale("log")
    axis.set_xlabel("peak MB beyond the inputs (log)")
    axis.set_ylabel("forward+backward ms")
    axis.set_title(f"fused linear CE 8192 x 4096 x 128256 bf16, {torch.cuda.get_device_name()}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def traffic_bound(tokens: int = 8192, hidden: int = 4096, vocab: int = 128256, chunk: int = 256) -> None:
    """Graph-time the weight and weight-gradient traffic of a `chunk`-token pass with no arithmetic at all."""
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    dw = torch.zeros_like(w)
    n_chunks = tokens // chunk
    weight_gb = w.numel() * w.element_size() / 1e9

    def shared_read() -> None:  # per chunk: read W and dW, write dW
        for _ in range(n_chunks):
            torch.add(dw, w, out=dw)

    def two_reads() -> None:  # the same plus a second read of W
        for _ in range(n_chunks):
            torch.add(dw, w, out=dw)
            w.sum()

    copy = measure_copy_bandwidth()
    bar_ms = 1.15 * 6 * tokens * hidden * vocab / measure_matmul_rate() * 1e3
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s; time bar {bar_ms:.2f} ms")
    print(f"{n_chunks} chunks of {chunk} tokens   GB a pass   at copy rate   measured (graphed)")
    for name, step, reads in (("weight read twice", two_reads, 2), ("weight read once", shared_read, 1)):
        gigabytes = n_chunks * (reads + 2) * weight_gb
        ms = triton.testing.do_bench_cudagraph(step, rep=1000, return_mode="median")
        print(f"{name:30s} {gigabytes:9.1f}   {gigabytes / copy * 1e12:9.2f} ms   {ms:9.2f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-memory", metavar="PNG", help="plot time against memory instead of the sweeps")
    parser.add_argument("--traffic-bound", action="store_true", help="time the traffic of a pass at Liger's memory")
    args = parser.parse_args()
    if args.traffic_bound:
        traffic_bound()
        return
    if args.time_memory:
        time_against_memory(args.time_memory)
        return
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
    chunk_steps(x.detach(), w.detach(), target)


if __name__ == "__main__":
    main()
