"""Turn a kernels.py results file into docs/benchmarks.md tables and PNG plots.

python -m benchmarks.report results.json --command "python -m benchmarks.kernels --out results.json"
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from tigon.runtime.files import atomic_write_text

PROVIDERS = ("tigon", "liger", "compile", "eager")
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"


def _ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"


def table(results: list[dict]) -> str:
    by_shape: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for row in results:
        by_shape[(row["op"], row["shape"])][row["provider"]] = row
    lines = [
        "| op | shape | floor ms | "
        + " | ".join(f"{p} ms graphed / launched (% of floor)" for p in PROVIDERS)
        + " | tigon vs liger | "
        + " | ".join(f"{p} peak MB" for p in PROVIDERS)
        + " |",
        "|---|---|---|" + "---|" * (2 * len(PROVIDERS) + 1),
    ]
    for (op, shape), rows in by_shape.items():
        floor = next(iter(rows.values()))["floor_ms"]
        times = [
            f"{_ms(rows[p]['graph_ms'])} / {rows[p]['ms']:.3f} ({100 * rows[p]['fraction_of_copy']:.0f}%)"
            if p in rows
            else "-"
            for p in PROVIDERS
        ]
        ratio = "-"
        if "tigon" in rows and "liger" in rows:
            ours, theirs = rows["tigon"], rows["liger"]
            graphed = theirs["graph_ms"] / ours["graph_ms"]
            ratio = f"{_ratio(graphed)} / {theirs['ms'] / ours['ms']:.2f}x"
        peaks = [
            f"{rows[p]['peak_extra_mb']:.0f}"
            if p in rows and rows[p]["peak_extra_mb"] == rows[p]["peak_extra_mb"]
            else "-"
            for p in PROVIDERS
        ]
        lines.append(
            f"| {op} | {shape} | {floor:.3f} | " + " | ".join(times) + f" | {ratio} | " + " | ".join(peaks) + " |"
        )
    return "\n".join(lines)


def plot_sweeps(results: list[dict], folder: Path, device: str) -> list[str]:
    """One PNG per sweep: % of the floor against shape, and beside it peak memory where the sweep measured it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps: dict[str, list[dict]] = defaultdict(list)
    for row in results:
        if "/" in row["op"]:
            sweeps[row["op"]].append(row)
    names = []
    for sweep, rows in sweeps.items():
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        with_memory = any(r["peak_extra_mb"] == r["peak_extra_mb"] for r in rows)
        figure, axes = plt.subplots(1, 2 if with_memory else 1, figsize=(13 if with_memory else 7, 4), squeeze=False)
        panels = [("fraction_of_copy", 100, "% of the floor (higher is better)")]
        if with_memory:
            panels.append(("peak_extra_mb", 1, "peak MB beyond the inputs (lower is better)"))
        for axis, (key, scale, label) in zip(axes[0], panels, strict=True):
            for provider in PROVIDERS:
                points = {r["shape"]: scale * r[key] for r in rows if r["provider"] == provider}
                if points:
                    values = [points.get(s, float("nan")) for s in shapes]
                    axis.plot(range(len(shapes)), values, marker="o", label=provider)
            axis.set_xticks(range(len(shapes)), shapes, rotation=20, fontsize=8)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
            axis.legend()
        axes[0][0].set_ylim(0, 105)
        if with_memory:
            axes[0][1].set_yscale("log")
        figure.suptitle(f"{sweep} forward+backward, bf16, {device}")
        figure.tight_layout()
        name = f"bench-{sweep.replace('/', '-')}.png"
        figure.savefig(folder / name, dpi=110)
        plt.close(figure)
        names.append(name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="JSON written by benchmarks/kernels.py")
    parser.add_argument("--command", required=True, help="the command that produced the results, for the record")
    parser.add_argument("--section", default="Kernel benchmarks", help="heading of the generated section")
    args = parser.parse_args()
    data = json.loads(Path(args.results).read_text())
    main_rows = [r for r in data["results"] if "/" not in r["op"]]
    sweep_rows = [r for r in data["results"] if "/" in r["op"]]
    plots = plot_sweeps(data["results"], DOCS, data["device"])
    section = [
        f"## {args.section}",
        "",
        f"Device: **{data['device']}**, torch {data['torch']}, triton {data['triton']}, "
        f"Liger-Kernel {data['liger_kernel']}. Measured copy bandwidth "
        f"{data['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (bytes read + written), bf16 matmul "
        f"{data['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s.",
        "",
        f"Command: `{args.command}`",
        "",
        "Forward+backward step, bf16, medians. *graphed*: the step replayed from a CUDA graph "
        "(`do_bench_cudagraph`), which is GPU time alone, as inside a training step whose CPU runs ahead; "
        "*launched*: the step launched from Python (`do_bench`), launch overhead included. *floor* = the "
        "fewest bytes the step must move over the copy bandwidth, or for matrix-bound steps its FLOPs over the "
        "matmul rate, whichever is larger; *% of floor* = floor / time (graphed where the step could be "
        "graphed; a step that synchronizes with the host cannot be). *peak MB* = memory the step allocates "
        "beyond its live inputs. *tigon vs liger* = Liger-Kernel's time over tigon's (graphed / launched).",
        "",
        table(main_rows),
        "",
        *(["### Sweeps", "", table(sweep_rows), ""] if sweep_rows else []),
        *[f"![{name}]({name})" for name in plots],
        "",
    ]
    target = DOCS / "benchmarks.md"
    existing = target.read_text() if target.exists() else "# Benchmarks\n\n"
    marker = f"## {args.section}"
    head = existing.split(marker)[0].rstrip() + "\n\n"
    tail = ""
    if marker in existing:
        rest = existing.split(marker, 1)[1]
        tail = "\n## " + rest.split("\n## ", 1)[1] if "\n## " in rest else ""
    atomic_write_text(target, head + "\n".join(section) + tail)
    print(f"wrote {target} and {len(plots)} plots")


if __name__ == "__main__":
    main()
