"""FP8 against bf16 loss curves: the demo task trained with `training.precision` bf16 and fp8 (tensorwise and
rowwise scaling), the same seed and data order, and how far apart the per-step losses are.

    python -m benchmarks.fp8_loss_curve --steps 600 --hidden 1024 --layers 4 --out fp8-loss.json   # GPU
    TIGON_FP8_EMULATE=1 python -m benchmarks.fp8_loss_curve --steps 4 --compile-backend aot_eager --out fp8.json  # CPU

The model is examples/demo.yaml's Llama (two-digit addition, packed), optionally wider and deeper; every run
compiles its decoder layers (fp8 needs training.compile, and bf16 compiled is the fair baseline). Reported per
scaling: the largest and the mean relative difference |fp8 - bf16| / bf16 over the steps, and over the last
tenth of the run (where a drift would show). Results: JSON to --out, the curves to --out with .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tigon.runtime.files import atomic_write_text

SCALINGS = ("tensorwise", "rowwise")
RUNS = {"bf16": {"precision": "bf16"}, **{f"fp8-{s}": {"precision": "fp8", "fp8_scaling": s} for s in SCALINGS}}


def run_config(args: argparse.Namespace, training: dict, run_dir: Path):
    """examples/demo.yaml for `args.steps` steps, wider or deeper as asked, compiled, without evaluation."""
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
    return load_config(args.config, overrides)


def relative(got: list[float], want: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]


def compare(losses: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per fp8 run: the largest and mean relative difference to bf16, over all steps and the last tenth."""
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
            "final_loss": curve[-1],
        }
    return result


def plot(losses: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, curve in losses.items():
        top.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1)
        if name != "bf16":
            bottom.plot(range(1, len(curve) + 1), relative(curve, losses["bf16"]), label=name, linewidth=1)
    top.set_ylabel("training loss")
    top.legend()
    bottom.set_ylabel("|fp8 - bf16| / bf16")
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
    parser.add_argument(
        "--compile-backend", default="inductor", choices=["inductor", "aot_eager"], help="training.compile_backend"
    )
    args = parser.parse_args(argv)
    if args.hidden is not None and (args.hidden <= 0 or args.hidden % 64):
        parser.error(f"--hidden {args.hidden}: give a positive multiple of 64 (attention heads of width 64)")

    import torch

    from tigon.runtime.trainer import train

    out = Path(args.out)
    losses = {}
    for name, training in RUNS.items():
        torch._dynamo.reset()  # each run compiles its own layers
        result = train(run_config(args, training, out.parent / f"{out.stem}-{name}"))
        losses[name] = result.losses
        print(f"{name}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}", flush=True)
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "settings": vars(args),
        "comparison": compare(losses),
        "losses": losses,
    }
    atomic_write_text(out, json.dumps(report, indent=2) + "\n")
    plot(losses, out.with_suffix(".png"))
    for name, numbers in report["comparison"].items():
        tail = f"last tenth max {numbers['last_tenth_max']:.2e}, mean {numbers['last_tenth_mean']:.2e}"
        print(
            f"{name} against bf16 over {args.steps} steps: relative difference max {numbers['max']:.2e}, mean "
            f"{numbers['mean']:.2e}; {tail}"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
