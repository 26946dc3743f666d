"""Tokens/s against peak memory across recomputation settings: collect `recompute-curve` results, plot the curves.

    python -m benchmarks.recompute_curve collect bench-out --out recompute-llama-3-8b.json   # after gpu_run.sh
    python -m benchmarks.recompute_curve plot "Llama-3.2-1B=a.json" "Llama-3-8B=b.json" --out docs/recompute-curve.png

`bash benchmarks/gpu_run.sh recompute-curve` writes one `benchmarks/end_to_end.py` report per setting
(recompute-N.json: N layers checkpointed whole, sM: M selective, N+sM: both; recompute-liger-on/off.json).
`collect` keeps each run's point (variant, setting, tokens/s, peak and the planner's estimate) in one JSON file;
`plot` draws each model's points, tigon's settings as a line from most to least memory and Liger-Kernel's two
settings as separate markers, so a budget reads off as the fastest point left of it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tigon.runtime.files import atomic_write_text

GiB = 2**30


def collect(folder: Path) -> list[dict]:
    """One point per `recompute-*.json` run in `folder`, most memory first."""
    points = []
    for path in sorted(folder.glob("recompute-*.json")):
        report = json.loads(path.read_text())
        for run in report["runs"]:
            if not run.get("tokens_per_second"):
                continue
            points.append(
                {
                    "variant": run["variant"],
                    "recompute": run.get("recompute") or ("on" if run["checkpointing"] else "off"),
                    "micro_batch": run["micro_batch"],
                    "seq": run["seq"],
                    "tokens_per_second": run["tokens_per_second"],
                    "peak_gib": run["peak_bytes"] / GiB if run.get("peak_bytes") else None,
                    "estimate_gib": run["estimate_bytes"] / GiB if run.get("estimate_bytes") else None,
                    "gpu": report["environment"].get("gpu"),
                }
            )
    return sorted(points, key=lambda p: (p["variant"], -(p["peak_gib"] or 0)))


def markdown(points: list[dict]) -> str:
    lines = ["| variant | recomputation | tokens/s | peak GiB | planner estimate GiB |", "|---|---|---|---|---|"]
    for p in points:
        estimate = f"{p['estimate_gib']:.2f}" if p["estimate_gib"] else "-"
        peak = f"{p['peak_gib']:.2f}" if p["peak_gib"] else "-"
        lines.append(f"| {p['variant']} | {p['recompute']} | {p['tokens_per_second']:,.0f} | {peak} | {estimate} |")
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    """One panel per model: tokens/s against peak GiB, tigon's settings joined, Liger-Kernel's apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for axis, (name, points) in zip(axes[0], curves.items(), strict=True):
        tigon = sorted((p for p in points if p["variant"] == "tigon"), key=lambda p: p["peak_gib"])
        axis.plot([p["peak_gib"] for p in tigon], [p["tokens_per_second"] for p in tigon], "o-", label="tigon")
        for p in tigon:
            axis.annotate(
                p["recompute"],
                (p["peak_gib"], p["tokens_per_second"]),
                fontsize=8,
                textcoords="offset points",
                xytext=(4, -10),
            )
        liger = [p for p in points if p["variant"] == "liger"]
        axis.plot(
            [p["peak_gib"] for p in liger],
            [p["tokens_per_second"] for p in liger],
            "s",
            markersize=9,
            fillstyle="none",
            label="HF + Liger-Kernel (checkpointing on, off)",
        )
        first = points[0]
        axis.set_title(f"{name}, seq {first['seq']} x micro-batch {first['micro_batch']}, {first['gpu']}")
        axis.set_xlabel("peak GiB (lower is better)")
        axis.set_ylabel("tokens/s (higher is better)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gather = commands.add_parser("collect", help="one JSON file of the points in a results folder")
    gather.add_argument("folder", type=Path)
    gather.add_argument("--out", type=Path, required=True)
    draw = commands.add_parser("plot", help="the curves of collected JSON files")
    draw.add_argument("curves", nargs="+", metavar="NAME=points.json")
    draw.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "collect":
        points = collect(args.folder)
        if not points:
            parser.error(f"no recompute-*.json run with tokens/s in {args.folder}")
        atomic_write_text(args.out, json.dumps(points, indent=2) + "\n")
        print(markdown(points))
        return 0
    curves = {}
    for item in args.curves:
        name, sep, file = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: give NAME=points.json")
        curves[name] = [p for p in json.loads(Path(file).read_text()) if p["peak_gib"]]
        if not curves[name]:
            parser.error(f"{file}: no point has a measured peak (a CPU run has none); plot a GPU run's points")
    plot(curves, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
