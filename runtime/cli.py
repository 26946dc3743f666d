"""The `tigon` command.

    tigon train CONFIG [--set key.path=value ...]     train (or resume) a run
    tigon plan CONFIG [--gpu-memory 80GB] [--gpus N]  estimate peak GPU memory, pick the fastest setting that fits
    tigon schema                                      print the config's JSON schema (for editors)
    tigon demo-data PATH [--examples N] [--seed S]    write the arithmetic task as JSONL

Under torchrun every process runs the same command:
    torchrun --nproc_per_node 2 -m tigon.runtime train examples/demo.yaml
A config (or dataset) error prints its message, without a traceback, and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

EXIT_CONFIG_ERROR = 2


def _positive(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number; give 1 or more")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tigon", description=__doc__.split("\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train (or resume) the run a YAML config describes")
    train.add_argument("config", help="YAML config file, e.g. examples/demo.yaml")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set training.max_steps=20 (repeatable; values parsed as YAML)",
    )
    train.add_argument("--quiet", action="store_true", help="warnings only in the log")

    plan = commands.add_parser("plan", help="estimate peak GPU memory and pick the fastest setting that fits")
    plan.add_argument("config", help="YAML config file, e.g. examples/demo.yaml")
    plan.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GB or 141GiB (default: this machine's GPU)")
    plan.add_argument(
        "--gpus", type=_positive, default=None, help="GPUs the run spreads over (default: $WORLD_SIZE or 1)"
    )
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    commands.add_parser("schema", help="print the config file's JSON schema")

    demo = commands.add_parser("demo-data", help="write the arithmetic demo task (instruction/response JSONL)")
    demo.add_argument("path", help="output file, e.g. data/arithmetic-train.jsonl")
    demo.add_argument("--examples", type=int, default=2000, help="number of problems (default 2000)")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def _setup_logging(quiet: bool) -> None:
    rank = int(os.environ.get("RANK", "0") or 0)
    level = logging.WARNING if quiet or rank != 0 else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _fail(message: str) -> int:
    rank = os.environ.get("RANK", "0")
    prefix = f"[rank {rank}] " if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    return EXIT_CONFIG_ERROR


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tigon` console script; returns (and, as a script, exits with) the status."""
    args = _parser().parse_args(argv)
    # each command imports what it runs, so `tigon schema` and `tigon demo-data` start without torch
    from tigon.runtime.config import ConfigError, json_schema, load_config

    if args.command == "schema":
        print(json_schema())
        return 0
    if args.command == "demo-data":
        from tigon.runtime.tasks import write_arithmetic_dataset

        try:
            records = write_arithmetic_dataset(args.path, args.examples, seed=args.seed)
        except (ValueError, OSError) as error:
            return _fail(str(error))
        print(f"wrote {len(records)} arithmetic problems to {args.path}")
        return 0

    if args.command == "plan":
        from tigon.runtime import planner

        try:
            config = load_config(args.config, args.overrides)
            memory = planner.parse_memory(args.gpu_memory) if args.gpu_memory else None
            print(planner.make_plan(config, memory, args.gpus).table())
        except ConfigError as error:
            return _fail(str(error))
        return 0

    _setup_logging(args.quiet)
    from tigon.runtime.checkpoint import CheckpointError
    from tigon.runtime.data import DataError
    from tigon.runtime.lock import RunDirInUse
    from tigon.runtime.planner import TrainingOutOfMemory
    from tigon.runtime.storage import StorageError

    try:
        config = load_config(args.config, args.overrides)
        from tigon.runtime.trainer import train

        train(config)
    except (
        ConfigError,
        CheckpointError,
        DataError,
        FileNotFoundError,
        FloatingPointError,
        RunDirInUse,
        StorageError,
        TrainingOutOfMemory,
    ) as error:
        return _fail(str(error))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
