"""Measurement plumbing for the benchmarks: medians with do_bench, peak memory, the two ceilings."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton
import triton.testing

from tigon.runtime.files import atomic_write_text


@dataclass
class Measurement:
    op: str
    provider: str
    shape: str
    ms: float
    graph_ms: float
    floor_ms: float
    bytes_moved: int
    peak_extra_mb: float
    fraction_of_copy: float


def measure_copy_bandwidth(gigabytes: float = 2.0) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    n = int(gigabytes * 2**30) // 2
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bytes_moved = 2 * src.numel() * src.element_size()
    return bytes_moved / (ms * 1e-3)


def measure_matmul_rate(size: int = 8192) -> float:
    """bf16 matrix-product rate in FLOP/s on random data."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * size**3 / (ms * 1e-3)


MIN_RUNS = 10  # do_bench times rep / (one step's time) runs: a 100 ms step would get only two at rep=200


def median_ms(step: Callable[[], object], grads: list[torch.Tensor]) -> float:
    """Median launched time of `step` (L2 cleared before each run) over at least `MIN_RUNS` runs."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    for tensor in grads:
        tensor.grad = None
    rep = max(200.0, MIN_RUNS * start.elapsed_time(end))
    return triton.testing.do_bench(step, warmup=25, rep=rep, grad_to_none=grads, return_mode="median")


def graph_median_ms(step: Callable[[], object], grads: list[torch.Tensor]) -> float:
    """Median of the step replayed from a CUDA graph: GPU time without Python launch overhead.

    A step that synchronizes with the host cannot be captured; it is found first with the sync
    debug mode, because a failed capture leaves the CUDA random generator unusable.
    """
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as error:
        print(f"  (no CUDA-graph time: the step synchronizes with the host: {str(error).splitlines()[0]})")
        return float("nan")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    try:
        return triton.testing.do_bench_cudagraph(step, rep=50, grad_to_none=grads, return_mode="median")
    except Exception as error:  # a provider that cannot be captured is reported without a graph time
        print(f"  (no CUDA-graph time: {type(error).__name__}: {error})")
        return float("nan")


def peak_extra_mb(step: Callable[[], object], grads: list[torch.Tensor]) -> float:
    """Peak bytes allocated during one step beyond what was live before it, in MB."""
    for tensor in grads:
        tensor.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    for tensor in grads:
        tensor.grad = None
    return peak / 1e6


def write_json_atomic(path: str, payload: dict) -> None:
    """Write `payload` as JSON, whole or not at all (`tigon.runtime.files`)."""
    atomic_write_text(path, json.dumps(payload, indent=1))


def write_report(path: str, payload: dict, table: str) -> None:
    """The results file `path` (JSON, whole or not at all) and its markdown table beside it (.md); prints the table."""
    write_json_atomic(path, payload)
    atomic_write_text(path.removesuffix(".json") + ".md", table + "\n")
    print(table)


def as_dicts(measurements: list[Measurement]) -> list[dict]:
    return [asdict(m) for m in measurements]
