"""Where one training step's time goes: its kernels, grouped by kind, from one profiled step.

`logging.profile_step` profiles that optimizer step of a run (the torch trainer), and the end-to-end
benchmark profiles one step per variant (`python -m benchmarks.end_to_end --profile`).

On a GPU the kernels are the CUDA kernels the step launched (their own device time); on the CPU, the aten
ops (their own CPU time; the rest of the step is Python and framework work). Grouping is by name: a kernel
goes to the first kind whose patterns its name contains, so matrix products, attention (cuDNN's, flash's),
Triton kernels (tigon's, Liger-Kernel's, torch.compile's), PyTorch's own elementwise and reduction kernels,
copies and fills, the optimizer's fused kernels and communication (NCCL's kernels, copies from another GPU) are
told apart, and the rest is "other". What no kernel covers (the step's wall time less the busy time) is, on a
GPU, time the device waited on the host; the profiler itself adds a little to the wall time.

On several GPUs NCCL's collectives run on their own streams, beside the computation: kernels' own times then add
up to more than the step. A GPU step's profile also lays its kernels on the timeline (`timeline_ms`): the time
some computation ran, the time only communication ran (exposed: what overlapping it would save), and the time no
kernel ran at all (the device waiting on the host).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tigon.runtime.files import atomic_path

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "memcpy ptop")),  # NCCL's kernels; peer-to-peer copies (copy-engine gathers)
    ("attention", ("sdpa", "fmha", "flash", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "grouped_mm", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
    ("copies", ("memcpy", "memset", "copy", "fill")),
    ("pytorch elementwise", ("elementwise", "reduce", "index", "scatter", "gather", "aten::")),
    ("triton kernels", ("triton", "_kernel")),
)
KIND_NAMES = [kind for kind, _ in KINDS] + ["other"]


def kind_of(name: str) -> str:
    """The kind of a kernel or op, by its name (see `KINDS`; "other" when no pattern matches)."""
    lowered = name.lower()
    return next((kind for kind, patterns in KINDS if any(p in lowered for p in patterns)), "other")


Interval = tuple[float, float]


def merged(intervals: list[Interval]) -> list[Interval]:
    """The intervals' union as sorted, disjoint intervals."""
    union: list[list[float]] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return [(start, end) for start, end in union]


def covered(intervals: list[Interval]) -> float:
    """How much of the timeline the intervals (start, end) cover together, counting overlaps once."""
    return sum(end - start for start, end in merged(intervals))


def timeline(kernels: list[tuple[str, Interval]], wall_ms: float) -> dict[str, float]:
    """A step's kernels (name, (start, end) in ms) laid on its timeline: computing (any kernel but a collective
    ran), communication exposed (only collectives ran), idle (no kernel ran: the step's wall time less the rest)."""
    compute = [span for name, span in kernels if kind_of(name) != "communication"]
    communication = [span for name, span in kernels if kind_of(name) == "communication"]
    computing = covered(compute)
    busy = covered(compute + communication)
    return {
        "computing": computing,
        "communication exposed": busy - computing,
        "communication overlapped": covered(communication) - (busy - computing),
        "idle": max(0.0, wall_ms - busy),
    }


def profile_step(step: Callable[[], Any], cuda: bool, trace: str | Path | None = None) -> tuple[Any, dict]:
    """Run `step` once under the profiler; returns what it returned and its profile: wall time, busy time, the
    time per kind, the top kernels. `trace`: also write the Chrome trace there (Perfetto, chrome://tracing)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        if cuda:
            torch.cuda.synchronize()
        begun = time.perf_counter()
        returned = step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - begun) * 1e3
    if trace is not None:
        with atomic_path(trace) as temporary:
            profile.export_chrome_trace(str(temporary))
    laid_out = None
    if cuda:  # kernels only: a user annotation's GPU range (the optimizer's step, say) spans kernels counted already
        own = {
            e.key: e.self_device_time_total / 1e3
            for e in profile.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and e.self_device_time_total > 0
            and not getattr(e, "is_user_annotation", False)
        }
        kernels = [
            (e.name, (e.time_range.start / 1e3, e.time_range.end / 1e3))
            for e in profile.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        laid_out = timeline(kernels, wall)
    else:
        own = {e.key: e.self_cpu_time_total / 1e3 for e in profile.key_averages() if e.key.startswith("aten::")}
    kinds: dict[str, float] = {}
    for name, ms in own.items():
        kind = kind_of(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    top = sorted(own.items(), key=lambda item: -item[1])[:8]
    return returned, {
        "device": "cuda" if cuda else "cpu",
        "step_ms": wall,
        "busy_ms": sum(own.values()),
        "kinds_ms": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "top_ms": [[name[:120], ms] for name, ms in top],
        **({"timeline_ms": laid_out} if laid_out is not None else {}),
    }


def profile_text(profile: dict) -> str:
    """A few lines for a run's summary: the step, each kind's share of it, the waiting, the busiest kernels."""
    step = profile["step_ms"]
    lines = [f"{step:.1f} ms, of which (kernels' own time):"]
    for kind, ms in profile["kinds_ms"].items():
        lines.append(f"  {kind:<20} {ms:9.1f} ms  {100 * ms / step:5.1f}%")
    laid_out = profile.get("timeline_ms")
    if laid_out is not None and laid_out["communication overlapped"] + laid_out["communication exposed"] > 0:
        lines.append("on the timeline:")
        lines += [f"  {part:<26} {ms:9.1f} ms  {100 * ms / step:5.1f}%" for part, ms in laid_out.items()]
    else:
        waiting = laid_out["idle"] if laid_out is not None else max(0.0, step - profile["busy_ms"])
        label = "waiting on the host" if profile["device"] == "cuda" else "outside aten ops"
        lines.append(f"  {label:<20} {waiting:9.1f} ms  {100 * waiting / step:5.1f}%")
    lines.append("busiest: " + "; ".join(f"{name[:60]} {ms:.1f} ms" for name, ms in profile["top_ms"][:3]))
    return "\n".join(lines)
