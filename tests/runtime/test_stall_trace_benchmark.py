"""benchmarks/stall_trace.py places a run's garbage collections and Triton compiles in its steps, and
benchmarks/stalls.sh runs it end to end (a tiny run on the CPU)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time
from pathlib import Path

from benchmarks.stall_trace import install, report
from tests.runtime.worker_groups import script_env

ROOT = Path(__file__).resolve().parents[2]


def write_metrics(path: Path, seconds: list[float], tokens: int = 1000) -> None:
    """metrics.jsonl as the trainer logs it: cumulative tokens and the rate over the steps so far."""
    lines, elapsed = [], 0.0
    for step, took in enumerate(seconds, start=1):
        elapsed += took
        rate = step * tokens / elapsed
        lines.append(json.dumps({"step": step, "tokens_seen": step * tokens, "tokens_per_second": rate}))
    path.write_text("\n".join(lines) + "\n")


def test_report_places_each_event_of_every_rank_in_its_step(tmp_path):
    seconds = [3.0, 0.5, 0.9, 0.5, 0.5, 0.8]
    starts = [100.0 + sum(seconds[:i]) + 0.01 * i for i in range(len(seconds))]
    steps = [(start, start + took) for start, took in zip(starts, seconds, strict=True)]
    rank0 = {
        "steps": steps,
        "collections": [
            (steps[2][0] + 0.3, 2, 0.28, 40),  # a full collection inside step 3
            (steps[3][1] + 0.005, 2, 0.01, 0),  # one between steps 4 and 5 (a freeze's collection)
            (steps[1][0] + 0.1, 0, 0.02, 3),  # a young generation's: not a full collection
        ],
        "compiles": [
            (steps[0][0] + 1.0, "MainThread", "_rope_kernel"),  # in the first step: not listed
            (steps[2][0] + 0.1, "Dummy-2", "_scale_kernel"),
        ],
        "samples": [(steps[2][0] + 0.1 * i, "gc_frames:collect<x:y") for i in range(1, 4)],
    }
    # rank 1's own steps are not read: its events are placed in rank 0's
    rank1 = {"steps": [], "collections": [(steps[5][0] + 0.2, 2, 0.25, 7)], "compiles": [], "samples": []}
    paths = [tmp_path / "trace-run-rank0.json", tmp_path / "trace-run-rank1.json"]
    for path, trace in zip(paths, (rank0, rank1), strict=True):
        path.write_text(json.dumps(trace))
    write_metrics(tmp_path / "metrics.jsonl", seconds)
    summary = report(paths, tmp_path / "metrics.jsonl")
    assert summary["ranks"] == [0, 1] and summary["steps"] == 6 and summary["median_step"] == 0.5
    assert summary["stalls"] == [
        {"step": 3, "seconds": 0.9, "main_thread": ["gc_frames:collect 100%"]},
        {"step": 6, "seconds": 0.8, "main_thread": []},
    ]
    assert summary["full_collections"] == [
        {"step": 3, "rank": 0, "ms": 280.0, "collected": 40},
        {"step": 6, "rank": 1, "ms": 250.0, "collected": 7},
    ]
    assert summary["compiles_after_step_1"] == [{"step": 3, "rank": 0, "thread": "Dummy-2", "kernel": "_scale_kernel"}]
    assert report(paths[:1], tmp_path / "metrics.jsonl")["full_collections"] == summary["full_collections"][:1]


def test_the_trace_records_a_collection_and_the_timed_steps(tmp_path):
    trace = install()
    alive = [[i] for i in range(50_000)]
    step = trace.timed(lambda: gc.collect())
    step()
    time.sleep(0.05)
    trace.write(tmp_path / "trace.json")
    record = json.loads((tmp_path / "trace.json").read_text())
    assert len(record["steps"]) == 1 and len(alive) == 50_000
    start, end = record["steps"][0]
    assert any(start <= moment <= end and generation == 2 for moment, generation, _, _ in record["collections"])
    assert record["samples"] and all("<" in stack or ":" in stack for _, stack in record["samples"])
    assert trace.on_collection not in gc.callbacks


def test_stalls_script_traces_a_tiny_run_on_two_ranks(tmp_path):
    env = script_env(tmp_path, TINY="1", SEQS="64", MICRO_BATCH="2", DOCS="full", STEPS="4", RUNS="freeze", GPUS="2")
    done = subprocess.run(
        ["bash", "benchmarks/stalls.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert "exit 0" in done.stdout, done.stdout + done.stderr
    summary = json.loads((tmp_path / "stalls" / "summary-freeze.json").read_text())
    assert summary["steps"] == 4 and summary["ranks"] == [0, 1]
    for rank in (0, 1):
        trace = json.loads((tmp_path / "stalls" / f"trace-freeze-rank{rank}.json").read_text())
        assert len(trace["steps"]) == 4
    assert os.path.exists(tmp_path / "stalls" / "tigon-freeze-64" / "metrics.jsonl")
