"""FP8 against bf16 loss curves: a task trained with `training.precision` bf16 and fp8 (tensorwise and rowwise
scaling), the same seed and data order, and how far apart the per-step losses are; with `--seeds K`, bf16 again
at K - 1 other seeds, whose distance from the first is the noise an FP8 difference is read against.

    python -m benchmarks.fp8_loss_curve --steps 600 --hidden 1024 --layers 4 --out fp8-loss.json   # GPU, the demo
    python -m benchmarks.fp8_loss_curve --corpus stdlib --steps 1000 --hidden 1024 --layers 4 --seeds 3 --out f.json
    python -m benchmarks.fp8_loss_curve --corpus stdlib --steps 1000 --hidden 1024 --layers 8 --micro-batch 32 \
        --learning-rate 6e-4 --seeds 3 --corpus-mb 40 --out f.json   # a larger batch and a lower rate: less noise
    TIGON_FP8_EMULATE=1 python -m benchmarks.fp8_loss_curve --steps 4 --compile-backend aot_eager --out fp8.json  # CPU

The model is examples/demo.yaml's Llama, optionally wider and deeper, on its task (two-digit addition, packed) or,
with `--corpus stdlib`, on real text: the running Python's standard library source, file by file, as language
modelling (characters, 512 a sequence, packed). Every run compiles its decoder layers (fp8 needs
training.compile, and bf16 compiled is the fair baseline). Reported per run against the first bf16 one: the
largest and the mean relative difference of the per-step losses, over the steps and over the last tenth of the
run (where a drift would show). Results: JSON to --out, the curves to --out with .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
from pathlib import Path

from tigon.runtime.files import atomic_write_text

SCALINGS = ("tensorwise", "rowwise")
RUNS = {"bf16": {"precision": "bf16"}, **{f"fp8-{s}": {"precision": "fp8", "fp8_scaling": s} for s in SCALINGS}}


CORPUS_SEQ_LEN = 512


def stdlib_corpus(path: Path, max_bytes: int) -> Path:
    """A text dataset of real writing: the running Python's standard library source, one document a file (sorted by
    path), until `max_bytes`; written to `path` as JSON lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines, size = [], 0
    for source in sorted(root.rglob("*.py")):
        if "site-packages" in source.parts or size >= max_bytes:
            continue
        text = source.read_text(encoding="utf-8", errors="replace")
        if not text.strip():  # an empty __init__.py is no document
            continue
        lines.append(json.dumps({"text": text}))
        size += len(text)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def runs_in_order(seeds: int) -> dict[str, dict]:
    """bf16, fp8 tensorwise, bf16 at the other seeds (the noise floor tensorwise is read against), then rowwise."""
    other_seeds = {f"bf16-seed{seed}": {"precision": "bf16", "seed": seed} for seed in range(1, seeds)}
    return {
        "bf16": RUNS["bf16"],
        "fp8-tensorwise": RUNS["fp8-tensorwise"],
        **other_seeds,
        "fp8-rowwise": RUNS["fp8-rowwise"],
    }


def run_config(args: argparse.Namespace, training: dict, run_dir: Path, corpus: Path | None = None):
    """examples/demo.yaml (on `corpus` when given) for `args.steps` steps, wider or deeper as asked, compiled,
    without evaluation."""
    from tigon.runtime.config import load_config

    overrides = [
        f"training.max_steps={args.steps}",
        "training.compile=true",
        f"training.compile_backend={args.compile_backend}",
        "eval.every_steps=0",
        "eval.metrics=[loss]",
        "checkpoint.every_steps=0",
        "checkpoint.export=false",
        "checkpoint.resume=false",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
        *(f"training.{key}={value}" for key, value in training.items()),
    ]
    if args.hidden:
        heads = args.hidden // 64
        overrides += [
            f"model.config_overrides.hidden_size={args.hidden}",
            f"model.config_overrides.intermediate_size={args.hidden * 11 // 4 // 16 * 16}",
            f"model.config_overrides.num_attention_heads={heads}",
            f"model.config_overrides.num_key_value_heads={max(1, heads // 2)}",
        ]
    if args.layers:
        overrides.append(f"model.config_overrides.num_hidden_layers={args.layers}")
    if args.learning_rate:
        overrides.append(f"training.learning_rate={args.learning_rate}")
    if args.micro_batch:
        overrides.append(f"training.micro_batch_size={args.micro_batch}")
    if corpus is not None:
        overrides += [
            f"data.train={corpus}",
            "data.eval=null",
            "data.format=text",
            f"data.max_seq_len={CORPUS_SEQ_LEN}",
            f"model.config_overrides.max_position_embeddings={CORPUS_SEQ_LEN}",
        ]
    return load_config(args.config, overrides)


def relative(got: list[float], want: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]


def compare(losses: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per run but the first bf16 one (fp8's, and bf16's at other seeds): the largest and mean relative difference
    to that bf16 run, over all steps and the last tenth; and `last_tenth_loss`, the signed relative difference of
    the two runs' mean losses over the last tenth (the per-step noise averaged out: the curves' distance)."""
    base = losses["bf16"]
    tail = max(1, len(base) // 10)
    result = {}
    for name, curve in losses.items():
        if name == "bf16":
            continue
        diffs = relative(curve, base)
        result[name] = {
            "max": max(diffs),
            "mean": statistics.fmean(diffs),
            "last_tenth_max": max(diffs[-tail:]),
            "last_tenth_mean": statistics.fmean(diffs[-tail:]),
            "last_tenth_loss": statistics.fmean(curve[-tail:]) / statistics.fmean(base[-tail:]) - 1,
            "final_loss": curve[-1],
        }
    return result


def moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of each `window` consecutive values (len(values) - window + 1 of them)."""
    return [statistics.fmean(values[i : i + window]) for i in range(len(values) - window + 1)]


def plot(losses: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(losses["bf16"]) // 20)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    base = moving_mean(losses["bf16"], window)
    for index, (name, curve) in enumerate(losses.items()):
        smooth = moving_mean(curve, window)
        steps = range(window, len(curve) + 1)
        top.plot(steps, smooth, label=name, linewidth=1, color=f"C{index}")
        if name != "bf16":
            ratio = [a / b - 1 for a, b in zip(smooth, base, strict=True)]
            bottom.plot(steps, ratio, label=name, linewidth=1, color=f"C{index}")
    top.set_ylabel(f"training loss, mean of {window} steps")
    top.legend()
    bottom.axhline(0, color="gray", linewidth=0.5)
    bottom.set_ylabel("run / bf16 - 1 (same means)")
    bottom.set_xlabel("optimizer step")
    bottom.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results file (the plot goes beside it, .png)")
    parser.add_argument("--config", default="examples/demo.yaml", help="the run config to train (default: the demo)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    parser.add_argument("--hidden", type=int, help="hidden size (a multiple of 64; heads of 64); default the config's")
    parser.add_argument("--layers", type=int, help="decoder layers; default the config's")
    parser.add_argument("--learning-rate", type=float, help="peak learning rate; default the config's")
    parser.add_argument("--micro-batch", type=int, help="sequences a step; default the config's")
    parser.add_argument(
        "--compile-backend", default="inductor", choices=["inductor", "aot_eager"], help="training.compile_backend"
    )
    parser.add_argument("--corpus", choices=["stdlib"], help="train on real text instead of the config's data")
    parser.add_argument("--corpus-mb", type=float, default=20.0, help="megabytes of the corpus (default 20)")
    parser.add_argument("--seeds", type=int, default=1, help="bf16 runs at this many seeds (the noise floor)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: give at least 1")
    if args.hidden is not None and (args.hidden <= 0 or args.hidden % 64):
        parser.error(f"--hidden {args.hidden}: give a positive multiple of 64 (attention heads of width 64)")

    import torch

    from tigon.runtime.trainer import train

    out = Path(args.out)
    corpus = None
    if args.corpus == "stdlib":
        corpus = stdlib_corpus(out.parent / f"{out.stem}-stdlib.jsonl", int(args.corpus_mb * 2**20))
    losses = {}
    for name, training in runs_in_order(args.seeds).items():
        torch._dynamo.reset()  # each run compiles its own layers
        result = train(run_config(args, training, out.parent / f"{out.stem}-{name}", corpus))
        losses[name] = result.losses
        print(f"{name}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}", flush=True)
        report = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "torch": torch.__version__,
            "settings": vars(args),
            "comparison": compare(losses),
            "losses": losses,
        }
        atomic_write_text(out, json.dumps(report, indent=2) + "\n")  # after every run: a cut-short job keeps its curves
    plot(losses, out.with_suffix(".png"))
    for name, numbers in report["comparison"].items():
        tail = (
            f"last tenth max {numbers['last_tenth_max']:.2e}, mean {numbers['last_tenth_mean']:.2e}; last tenth's "
            f"mean loss {numbers['last_tenth_loss']:+.2%}"
        )
        print(
            f"{name} against bf16 over {args.steps} steps: relative difference max {numbers['max']:.2e}, mean "
            f"{numbers['mean']:.2e}; {tail}"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
