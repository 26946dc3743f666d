"""The planner's memory estimate against the measured peak, one `tigon train` run per setting on one GPU.

    python -m benchmarks.estimate_check --out /tmp/check --strategies fsdp,ddp --accumulation 1,2 --micro-batch 4

Each run is benchmarks/headline.py's config (a real model config with random weights, bf16, AdamW, kernels on) at
the given strategy, micro-batch and accumulation, for 5 steps; the peak is the run's summary.json
(`torch.cuda.max_memory_allocated`), the estimate `planner.estimate` for the same setting on one GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.headline import SHAPES, STRATEGIES, prepare

GiB = 2**30
STEPS = 5


def check(
    out: Path,
    shape: str,
    strategy: str,
    accumulation: int,
    micro_batch: int,
    seq: int,
    checkpointing: bool,
    tiny: bool = False,
):
    """Train one setting; (measured peak bytes or None, the planner's Estimate, the run's exit status)."""
    from tigon.runtime import planner
    from tigon.runtime.config import load_config

    path = prepare(
        out / f"{strategy}-{accumulation}",
        "tigon",
        seq,
        1,
        STEPS * accumulation,
        micro_batch,
        None,
        tiny,
        shape,
        strategy,
    )
    overrides = [
        f"training.gradient_accumulation_steps={accumulation}",
        f"training.gradient_checkpointing={json.dumps(checkpointing)}",
        f"training.max_steps={STEPS}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "tigon.runtime", "train", str(path), *(w for o in overrides for w in ("--set", o))]
    )
    config = load_config(path, overrides)
    estimate = planner.estimate(planner.workload(config, world_size=1), planner.setting_of(config))
    summary = path.parent / "summary.json"
    peak = json.loads(summary.read_text())["peak_memory_bytes"] if summary.is_file() else None
    return peak, estimate, done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES)
    parser.add_argument("--strategies", default="fsdp,ddp", help=f"comma-separated, of {', '.join(STRATEGIES)}")
    parser.add_argument("--accumulation", default="1,2", help="comma-separated accumulation steps")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on (default off)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU smoke runs; the peaks mean nothing)")
    args = parser.parse_args(argv)
    print("| strategy | accumulation | measured GiB | estimate GiB | peak moment |")
    print("|---|---|---|---|---|")
    failed = 0
    for strategy in args.strategies.split(","):
        for accumulation in (int(a) for a in args.accumulation.split(",")):
            peak, estimate, status = check(
                Path(args.out),
                args.shape,
                strategy,
                accumulation,
                args.micro_batch,
                args.seq,
                args.checkpointing,
                args.tiny,
            )
            measured = f"{peak / GiB:.2f}" if peak else f"failed (exit {status})"
            failed += peak is None
            print(f"| {strategy} | {accumulation} | {measured} | {estimate.peak / GiB:.2f} | {estimate.moment} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
