"""Where a profiled step's GPU time goes on its timeline, from the Chrome trace `logging.profile_step` writes.

    python -m benchmarks.step_timeline RUN/trace.json [--out timeline.json]

On several GPUs the kernels' own times (`profile.json`) add up to more than the step, since NCCL's collectives
run beside the computation. This reads the trace's kernels and reports:

- the step's timeline: computing, communication exposed (only collectives ran), overlapped, idle;
- the longest exposed-communication spans and idle gaps, with the kernels on either side;
- what running beside a collective costs the matrix products: each product kernel's time when a collective
  overlaps it against the median of the same kernel (by name) when none does, summed over the overlapped ones.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import statistics
import sys
from pathlib import Path

from tigon.runtime.profiling import kind_of, merged, timeline

SHOWN = 8  # spans and gaps listed


def kernels_of(trace: dict) -> list[tuple[str, float, float]]:
    """The trace's GPU kernels (and memory copies and sets) as (name, start, end) in ms, by start."""
    kinds = {"kernel", "gpu_memcpy", "gpu_memset"}
    events = [e for e in trace["traceEvents"] if e.get("cat") in kinds and e.get("ph") == "X"]
    return sorted(((e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events), key=lambda k: k[1])


def uncovered(span: tuple[float, float], cover: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `span` that no span of `cover` (merged) covers."""
    start, end = span
    parts = []
    i = max(0, bisect.bisect_right(cover, (start, float("inf"))) - 1)
    while start < end and i < len(cover):
        c_start, c_end = cover[i]
        if c_end <= start:
            i += 1
            continue
        if c_start >= end:
            break
        if c_start > start:
            parts.append((start, c_start))
        start = max(start, c_end)
        i += 1
    if start < end:
        parts.append((start, end))
    return parts


class Neighbours:
    """Which kernel ended last before a time, and which starts first at or after it."""

    def __init__(self, kernels: list[tuple[str, float, float]]) -> None:
        self.by_end = sorted((end, name) for name, _, end in kernels)
        self.by_start = sorted((start, name) for name, start, _ in kernels)

    def before(self, at: float) -> str:
        i = bisect.bisect_right(self.by_end, (at + 1e-6, "\uffff"))
        return self.by_end[i - 1][1] if i else "-"

    def after(self, at: float) -> str:
        i = bisect.bisect_left(self.by_start, (at - 1e-6, ""))
        return self.by_start[i][1] if i < len(self.by_start) else "-"


def analyse(kernels: list[tuple[str, float, float]]) -> dict:
    """The step's timeline, its longest exposed collectives and idle gaps, and the products' cost beside collectives."""
    if not kernels:
        raise SystemExit("the trace holds no GPU kernels: profile a step on a GPU (logging.profile_step)")
    collectives = [k for k in kernels if kind_of(k[0]) == "communication"]
    computing = [k for k in kernels if kind_of(k[0]) != "communication"]
    first, last = min(k[1] for k in kernels), max(k[2] for k in kernels)
    laid_out = timeline([(name, (start, end)) for name, start, end in kernels], last - first)
    compute_cover = merged([(start, end) for _, start, end in computing])
    near_computing, near_any = Neighbours(computing), Neighbours(kernels)
    exposed = [
        {"ms": part[1] - part[0], "collective": name[:90], "after": near_computing.before(part[0])[:90]}
        for name, start, end in collectives
        for part in uncovered((start, end), compute_cover)
    ]
    busy_cover = merged([(start, end) for _, start, end in kernels])
    gaps = [
        {"ms": start - end, "after": near_any.before(end)[:90], "before": near_any.after(start)[:90]}
        for (_, end), (start, _) in itertools.pairwise(busy_cover)
    ]
    collective_cover = merged([(start, end) for _, start, end in collectives])
    alone: dict[str, list[float]] = {}
    beside: dict[str, list[float]] = {}
    for name, start, end in computing:
        if kind_of(name) != "matmul":
            continue
        alone_ms = sum(b - a for a, b in uncovered((start, end), collective_cover))
        (beside if alone_ms < end - start else alone).setdefault(name, []).append(end - start)
    extra, compared = 0.0, 0
    for name, durations in beside.items():
        if name in alone:
            typical = statistics.median(alone[name])
            extra += sum(d - typical for d in durations)
            compared += len(durations)
    matmul_ms = sum(sum(d) for d in alone.values()) + sum(sum(d) for d in beside.values())
    return {
        "window_ms": last - first,
        "timeline_ms": laid_out,
        "exposed_collectives": sorted(exposed, key=lambda e: -e["ms"])[:SHOWN],
        "idle_gaps": sorted(gaps, key=lambda g: -g["ms"])[:SHOWN],
        "matmul_ms": matmul_ms,
        "matmul_beside_collectives": {
            "kernels": sum(len(d) for d in beside.values()),
            "compared": compared,
            "extra_ms": extra,
        },
    }


def text(report: dict) -> str:
    """The report as a few lines to read."""
    window = report["window_ms"]
    lines = [f"first kernel to last: {window:.1f} ms"]
    lines += [f"  {part:<26} {ms:9.1f} ms  {100 * ms / window:5.1f}%" for part, ms in report["timeline_ms"].items()]
    side = report["matmul_beside_collectives"]
    lines.append(
        f"matrix products {report['matmul_ms']:.1f} ms; {side['kernels']} ran beside a collective, "
        f"{side['extra_ms']:+.1f} ms against the same kernels alone ({side['compared']} compared)"
    )
    lines.append("longest exposed collectives:")
    lines += [f"  {e['ms']:7.2f} ms  {e['collective']}  (after {e['after']})" for e in report["exposed_collectives"]]
    lines.append("longest idle gaps:")
    lines += [f"  {g['ms']:7.2f} ms  after {g['after']}  before {g['before']}" for g in report["idle_gaps"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a profiled step's Chrome trace (RUN/trace.json)")
    parser.add_argument("--out", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    report = analyse(kernels_of(json.loads(args.trace.read_text())))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
