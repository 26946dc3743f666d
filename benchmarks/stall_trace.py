"""Why a training step stalls, traced from the host: Python's garbage collections, Triton's compiles and the main
thread's stack, placed in the steps of a run.

    python -m benchmarks.stall_trace train CONFIG --out DIR --tag TAG   # under torchrun, as `tigon train CONFIG`
    python -m benchmarks.stall_trace report DIR/trace-TAG-rank0.json [DIR/trace-TAG-rank1.json ...] RUN/metrics.jsonl

`train` runs `tigon train` (the torch trainer) with each rank recording

- when each optimizer step starts and ends (the trainer's `train_step`, wrapped);
- every full collection (generation 2) and any other collection over 5 ms, with its duration;
- every Triton kernel compiled (`triton.knobs.runtime.jit_cache_hook`: a kernel or a variant not yet in memory);
- the main thread's innermost frames every 10 ms,

and writes DIR/trace-TAG-rankR.json when training returns. `report` lists the steps over 1.2x the median and the
collections and compiles of every rank given inside each step after the first. `bash benchmarks/stalls.sh` does
both for runs with and without `training.freeze_gc`.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import gc
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.headline import every_step_seconds

SAMPLE_SECONDS = 0.01
SLOW_COLLECTION_SECONDS = 0.005
STALL_FACTOR = 1.2  # a step over this many times the median step is a stall


class Trace:
    """The events of one process, collected by the hooks `install` sets."""

    def __init__(self) -> None:
        self.collections: list[tuple[float, int, float, int]] = []  # (end time, generation, seconds, collected)
        self.compiles: list[tuple[float, str, str]] = []  # (time, thread, kernel)
        self.samples: list[tuple[float, str]] = []  # (time, "file:function<file:function<...", innermost first)
        self.steps: list[tuple[float, float]] = []  # (start, end) of each optimizer step
        self._started: dict[int, float] = {}
        self._stop = threading.Event()
        self.sampler: threading.Thread | None = None

    def on_collection(self, phase: str, info: dict) -> None:
        generation = info["generation"]
        if phase == "start":
            self._started[generation] = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started.pop(generation, time.perf_counter())
        if generation == 2 or seconds > SLOW_COLLECTION_SECONDS:
            self.collections.append((time.time(), generation, seconds, info["collected"]))

    def on_compile(self, *args, **kwargs) -> bool:
        name = getattr(kwargs.get("fn"), "name", None) or str(kwargs.get("repr", "?")).split("[")[0]
        self.compiles.append((time.time(), threading.current_thread().name, name))
        return False  # go on and compile

    def sample(self, main_thread: int) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            frame = sys._current_frames().get(main_thread)
            if frame is not None:
                self.samples.append((time.time(), frame_names(frame)))

    def timed(self, function):
        """`function`, recording when each call starts and ends."""

        @functools.wraps(function)
        def step(*args, **kwargs):
            started = time.time()
            try:
                return function(*args, **kwargs)
            finally:
                self.steps.append((started, time.time()))

        return step

    def write(self, path: Path) -> None:
        """Stop tracing and write the trace (to a temporary name, then renamed)."""
        gc.callbacks.remove(self.on_collection)
        self._stop.set()
        if self.sampler is not None:  # joined before the process exits: a sampling thread at exit can abort it
            self.sampler.join()
        record = {
            "steps": self.steps,
            "collections": self.collections,
            "compiles": self.compiles,
            "samples": self.samples,
        }
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(record))
        temporary.replace(path)


def frame_names(frame, depth: int = 6) -> str:
    names = []
    while frame is not None and len(names) < depth:
        names.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return "<".join(names)


def install() -> Trace:
    """Start tracing this process (until `Trace.write`)."""
    trace = Trace()
    gc.callbacks.append(trace.on_collection)
    try:
        from triton import knobs

        knobs.runtime.jit_cache_hook = trace.on_compile
    except ImportError:  # a Triton without knobs: compiles are not traced
        pass
    trace.sampler = threading.Thread(target=trace.sample, args=(threading.main_thread().ident,), daemon=True)
    trace.sampler.start()
    return trace


def step_of(moment: float, steps: list[tuple[float, float]]) -> int | None:
    """The 1-based step running at `moment`, or None between steps."""
    index = bisect.bisect([start for start, _ in steps], moment) - 1
    return index + 1 if index >= 0 and moment <= steps[index][1] else None


def main_thread_frames(samples: list[tuple[float, str]], start: float, end: float, top: int = 3) -> list[str]:
    """The main thread's most sampled innermost frames between `start` and `end`, with their share."""
    inside = [stack.split("<")[0] for moment, stack in samples if start <= moment <= end]
    counts = collections.Counter(inside).most_common(top)
    return [f"{frame} {count / len(inside):.0%}" for frame, count in counts]


def rank_of(trace_path: Path) -> int:
    """The rank a trace file was written by (`trace-TAG-rankR.json`; 0 for another name)."""
    match = re.search(r"-rank(\d+)\.json$", trace_path.name)
    return int(match.group(1)) if match else 0


def report(trace_paths: list[Path], metrics_path: Path) -> dict:
    """The run's stalls (steps over STALL_FACTOR x the median of steps 2 on), and the full collections and the
    compiles of every rank inside each step after the first. The steps are the first trace's (rank 0's): on several
    GPUs every rank waits for the slowest in the step's collectives, so any rank's collection stalls the step."""
    traces = {rank_of(path): json.loads(path.read_text()) for path in trace_paths}
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    seconds = every_step_seconds(metrics)
    first = traces[rank_of(trace_paths[0])]
    steps = first["steps"]
    if not steps:
        raise ValueError(f"{trace_paths[0]} timed no optimizer step (was the torch trainer running?)")
    median = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    collections = [
        {"step": step_of(t, steps), "rank": rank, "ms": round(s * 1000, 1), "collected": n}
        for rank, trace in sorted(traces.items())
        for t, g, s, n in trace["collections"]
        if g == 2
    ]
    compiles = [
        {"step": step_of(t, steps), "rank": rank, "thread": thread, "kernel": k}
        for rank, trace in sorted(traces.items())
        for t, thread, k in trace["compiles"]
    ]
    later = [i + 1 for i, s in enumerate(seconds) if i > 0 and s > STALL_FACTOR * median]
    frames = {step: main_thread_frames(first["samples"], *steps[step - 1]) for step in later if step <= len(steps)}
    return {
        "ranks": sorted(traces),
        "steps": len(seconds),
        "seconds_after_step_1": round(sum(seconds[1:]), 3),
        "median_step": round(median, 4),
        "stalls": [
            {"step": step, "seconds": round(seconds[step - 1], 3), "main_thread": frames.get(step, [])}
            for step in later
        ],
        "full_collections": sorted(
            (c for c in collections if c["step"] is not None and c["step"] > 1), key=lambda c: (c["step"], c["rank"])
        ),
        "compiles_after_step_1": [c for c in compiles if c["step"] is not None and c["step"] > 1],
    }


def train(config: str, out: Path, tag: str) -> int:
    """`tigon train CONFIG` with this process traced."""
    from tigon.runtime import torch_trainer
    from tigon.runtime.cli import main as tigon_main

    out.mkdir(parents=True, exist_ok=True)
    trace = install()
    torch_trainer.train_step = trace.timed(torch_trainer.train_step)
    try:
        return tigon_main(["train", config])
    finally:
        trace.write(out / f"trace-{tag}-rank{os.environ.get('RANK', '0')}.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("train", help="tigon train CONFIG, traced")
    command.add_argument("config")
    command.add_argument("--out", type=Path, required=True, help="where trace-TAG-rankR.json goes")
    command.add_argument("--tag", default="run")
    command = commands.add_parser("report", help="place the traces' events in the steps of a run")
    command.add_argument("traces", type=Path, nargs="+", help="rank 0's trace first, then any other ranks'")
    command.add_argument("metrics", type=Path, help="the run's metrics.jsonl")
    command.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    if args.command == "train":
        return train(args.config, args.out, args.tag)
    summary = report(args.traces, args.metrics)
    ranks = f" ({len(summary['ranks'])} ranks)" if len(summary["ranks"]) > 1 else ""
    print(f"{args.traces[0].name}{ranks}: {summary['steps']} steps, median {summary['median_step']} s")
    for stall in summary["stalls"]:
        step = stall["step"]
        events = [
            f"full collection {c['ms']} ms on rank {c['rank']}"
            for c in summary["full_collections"]
            if c["step"] == step
        ]
        events += [
            f"compiled {c['kernel']} on rank {c['rank']}" for c in summary["compiles_after_step_1"] if c["step"] == step
        ]
        print(f"  step {step}: {stall['seconds']} s: {', '.join(events) or 'no collection or compile traced'}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
