"""Checkpoint benchmark: how long an FSDP2 save stalls training, synchronous and asynchronous, and resume.

    python -m benchmarks.checkpoint_scale --out ckpt.json                        # GPU: all local GPUs, Llama-3-8B
    python -m benchmarks.checkpoint_scale --shape llama-3.2-1b --out ckpt.json   # GPU: a smaller model
    python -m benchmarks.checkpoint_scale --shape tiny --out /tmp/ckpt.json      # CPU rehearsal, 2 ranks on gloo

One `torchrun --standalone` group over every local GPU (`--nproc`, default all; 2 processes on a CPU) trains a
randomly initialized Llama of the `--shape` through the torch trainer's own step and FSDP2 strategy (fp32 master
weights, bf16 compute on a GPU, AdamW) on random tokens: `--interval` steps, then for each mode in turn, sync and
async (`checkpoint.async_save`):

1. it starts a checkpoint and trains `--interval` more steps: `stall_seconds` is how long the save held the
   training loop (async: staging the shards in CPU memory), `durable_seconds` the time from the save's start
   until the checkpoint is whole (async: the background write, then the manifest and the rename when the run
   next waits for it), `train_seconds_after_save` those steps' time (async: beside the background write);
2. it resumes from that checkpoint (`resume_seconds`: rank 0 verifies the manifest, every rank loads) and trains
   the same steps again: `losses_equal` says whether the resumed per-step losses equal the uninterrupted ones
   bit for bit (`max_loss_difference` is the largest difference), and the next mode goes on from there.

`bytes_written` is the checkpoint's size from its manifest. Each checkpoint is removed before the next mode
writes, so the disk needs room for one (the Llama-3-8B shape's, with fp32 AdamW state: about 96 GB). Results:
JSON to --out (rank 0), and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "llama-3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    },
}
MODES = ("sync", "async")


def run_config(args: argparse.Namespace, run_dir: Path, async_save: bool, cuda: bool):
    """The RunConfig of the measurement: FSDP2, fp32 master weights, bf16 compute on a GPU."""
    from tigon.runtime.config import parse_config

    shape = {**SHAPES[args.shape], "max_position_embeddings": max(args.seq, 128)}
    raw = {
        "name": f"checkpoint-scale-{args.shape}",
        "model": {"config_name": "llama", "config_overrides": shape, "tokenizer": "char", "dtype": "float32"},
        "data": {"train": "random-tokens", "max_seq_len": args.seq, "packing": False},
        "training": {
            "max_steps": args.interval * (1 + len(args.modes)),
            "learning_rate": 1e-4,
            "lr_schedule": "constant",
            "micro_batch_size": args.micro_batch,
            "gradient_checkpointing": cuda,
            "precision": "bf16" if cuda else "fp32",
            "deterministic": args.deterministic,
        },
        "parallelism": {"strategy": "fsdp"},
        "kernels": {"enabled": False},
        "checkpoint": {"every_steps": args.interval, "keep_last": 1, "export": False, "async_save": async_save},
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "progress_bar": False},
    }
    return parse_config(raw, f"checkpoint_scale {args.shape}")


def worker(args: argparse.Namespace) -> None:
    """Every rank: build, train `--interval` steps, then measure each mode in turn (see the module docstring)."""
    import torch

    from benchmarks.end_to_end_runner import random_dataset
    from tigon.runtime import batches, torch_trainer
    from tigon.runtime import checkpoint as ckpt
    from tigon.runtime.distributed import barrier, init_distributed, shutdown
    from tigon.runtime.files import atomic_write_text
    from tigon.runtime.model import build_model
    from tigon.runtime.run import seed_everything
    from tigon.runtime.strategies import build_strategy

    cuda = torch.cuda.is_available()
    root = Path(args.run_dir)
    total = args.interval * (1 + len(args.modes))
    config = run_config(args, root, False, cuda)
    env, device = init_distributed(config)
    seed_everything(config.training.seed, config.training.deterministic)
    vocab = config.model.config_overrides["vocab_size"]
    started = time.perf_counter()
    model = build_model(config, vocab, meta=not env.is_main, device=device)
    strategy = build_strategy(model, config, env, device, total)
    strategy.model.train()
    build_seconds = time.perf_counter() - started
    micro = config.training.micro_batch_size
    dataset = random_dataset(micro * env.world_size * total, args.seq, vocab, config.training.seed)
    sampler = batches.GlobalBatchSampler(len(dataset), micro, 1, env.world_size, env.rank, config.training.seed)
    state = ckpt.TrainState(world_size=env.world_size)
    ahead = torch_trainer.inputs_ahead(strategy, sampler, dataset, config, device)

    def train_steps() -> list[float]:
        """`--interval` optimizer steps from where `state` stands; their losses."""
        losses = []
        for _ in range(args.interval):
            loss, _, _ = torch_trainer.train_step(
                strategy, ahead, state, config, env, device, total, sampler.batches_per_epoch
            )
            if cuda:
                torch.cuda.synchronize(device)
            state.step += 1
            state.batches_in_epoch += 1
            state.losses.append(loss)
            losses.append(loss)
        return losses

    train_steps()
    results = []
    report = {
        "shape": args.shape,
        "config": SHAPES[args.shape],
        "parameters": sum(p.numel() for p in model.parameters()),  # FSDP2's DTensors count whole
        "world_size": env.world_size,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "interval": args.interval,
        "deterministic": args.deterministic,
        "build_seconds": build_seconds,
        "results": results,
    }
    for mode in args.modes:
        async_save = mode == "async"
        run_dir = root / mode
        strategy.config = run_config(args, run_dir, async_save, cuda)  # write_state reads async_save there
        barrier(env)
        began = time.perf_counter()
        saving = strategy.begin_checkpoint(run_dir, state, 1, config.model_dump_json())
        written: dict[str, float] = {}
        if saving.writing is not None:
            saving.writing.add_done_callback(lambda _, written=written: written.setdefault("at", time.perf_counter()))
        else:
            saving.finish()
        stall = time.perf_counter() - began
        reference = train_steps()
        train_seconds = time.perf_counter() - began - stall
        finishing = time.perf_counter()
        if async_save:
            saving.finish()
        durable = written["at"] - began + (time.perf_counter() - finishing) if async_save else stall
        barrier(env)
        resumed_at = time.perf_counter()
        latest = ckpt.resume_checkpoint(run_dir, env)
        state = strategy.load_checkpoint(latest)
        barrier(env)
        resume = time.perf_counter() - resumed_at
        again = train_steps()
        results.append(
            {
                "mode": mode,
                "saved_at_step": state.step - args.interval,
                "stall_seconds": stall,
                "durable_seconds": durable,
                "resume_seconds": resume,
                "bytes_written": ckpt.checkpoint_bytes(latest) if env.is_main else 0,
                "train_seconds_after_save": train_seconds,
                "losses": reference,
                "resumed_losses": again,
                "losses_equal": again == reference,
                "max_loss_difference": max(abs(a - b) for a, b in zip(again, reference, strict=True)),
            }
        )
        barrier(env)
        if env.is_main:  # each mode's result as soon as it is measured; one checkpoint on disk at a time
            atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
            shutil.rmtree(run_dir, ignore_errors=True)
    if env.is_main:
        print(table(report), flush=True)
        if args.remove_run_dir:
            shutil.rmtree(root, ignore_errors=True)
    shutdown()


def table(report: dict) -> str:
    """A short markdown table of one report."""
    lines = [
        f"{report['shape']} on {report['world_size']} x {report['device']} (torch {report['torch']}), "
        f"seq {report['seq']} x micro-batch {report['micro_batch']}, {report['parameters']:,} parameters",
        "",
        "| mode | at step | stall s | durable s | resume s | GiB written | resumed losses equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['mode']} | {row['saved_at_step']} | {row['stall_seconds']:.2f} | {row['durable_seconds']:.2f} | "
            f"{row['resume_seconds']:.2f} | {row['bytes_written'] / 2**30:.2f} | {row['losses_equal']} "
            f"(max difference {row['max_loss_difference']:.2e}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: every local GPU; CPU: 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; tiny: 32)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--interval", type=int, default=2, help="steps before each save and after it (default 2)")
    parser.add_argument("--run-dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of sync and async (default both)")
    parser.add_argument(
        "--deterministic", action="store_true", help="training.deterministic: resumed losses comparable bit for bit"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--remove-run-dir", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seq is None:
        args.seq = 32 if args.shape == "tiny" else 1024
    args.modes = args.modes.split(",")
    if not args.modes or any(mode not in MODES for mode in args.modes):
        parser.error(f"--modes takes {', '.join(MODES)} (comma-separated), got {','.join(args.modes)}")
    if args.interval < 1:
        parser.error(f"--interval must be at least 1, got {args.interval}")
    if args.worker:
        worker(args)
        return
    import torch

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command += ["-m", "benchmarks.checkpoint_scale", "--worker", "--out", str(args.out), "--shape", args.shape]
    command += ["--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--interval", str(args.interval)]
    command += ["--modes", ",".join(args.modes)] + (["--deterministic"] if args.deterministic else [])
    if args.run_dir is None:  # the worker removes it at the end
        command += ["--run-dir", tempfile.mkdtemp(prefix="checkpoint-scale-"), "--remove-run-dir"]
    else:
        command += ["--run-dir", args.run_dir]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.execv(sys.executable, command)  # torchrun in this process: a `timeout` around it stops the workers too


if __name__ == "__main__":
    main()
