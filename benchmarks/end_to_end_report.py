"""The end-to-end benchmark's reports: a run's outcome in a line, the markdown tables, several device calls'
JSON reports merged into one, and the plots (benchmarks/end_to_end.py writes them)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.presets import PRESETS, VARIANTS, text_shape

GiB = 2**30


def count_text(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def describe(result: dict) -> str:
    if "unavailable" in result:
        return f"not available: {result['unavailable']}"
    if "skipped" in result:
        return f"not run: {result['skipped']}"
    if "error" in result:
        return f"failed: {result['error']}"
    if result["oom"]:
        return "out of memory"
    peak = result["peak_bytes"]
    estimate = result["estimate_bytes"]
    memory = f", peak {peak / GiB:.2f} GiB" if peak is not None else ""
    if peak is not None and estimate is not None:
        memory += f" (estimate {estimate / GiB:.2f} GiB, {estimate / peak:.2f}x)"
    return f"{result['tokens_per_second']:,.0f} tokens/s{memory}, first loss {result['losses'][0]:.4f}"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"End-to-end training: {env.get('gpu') or 'CPU'}, torch {env['torch']}, transformers {env['transformers']}"
        + (f", triton {env['triton']}" if env.get("triton") else "")
        + (f", liger-kernel {env['liger_kernel']}" if env.get("liger_kernel") else "")
        + (", decoder layers compiled (training.compile)" if report.get("settings", {}).get("compile") else "")
        + (", FP8 matmuls (training.precision: fp8)" if report.get("settings", {}).get("precision") == "fp8" else ""),
        "",
        "| family | model | parameters | Liger-Kernel |",
        "|---|---|---|---|",
    ]
    for name, family in report["families"].items():
        params = next((r["params"] for r in report["runs"] if r.get("family") == name and r.get("params")), None)
        cells = [name, family["model"], count_text(params) if params else "-", family["liger"] or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    if report["runs"]:
        lines += [
            "",
            "| family | variant | seq | micro x accum | checkpointing | kernels | tokens/s | peak GiB |"
            " planner estimate GiB | estimate / peak |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in report["runs"]:
        family = r.get("family", "llama")
        if "micro_batch" not in r:  # not available, not run, failed, or the planner found nothing that fits
            lines.append(f"| {family} | {r['variant']} | {r['seq']} | | | | {describe(r)} | | | |")
            continue
        peak, estimate = r.get("peak_bytes"), r.get("estimate_bytes")
        cells = [
            family,
            r["variant"],
            r["seq"],
            f"{r['micro_batch']} x {r['accumulation']}",
            r.get("recompute") or ("on" if r["checkpointing"] else "off"),
            "on" if r["kernels"] else "off",
            "out of memory" if r["oom"] else f"{r['tokens_per_second']:,.0f}",
            f"{peak / GiB:.2f}" if peak else "-",
            f"{estimate / GiB:.2f}" if estimate else "not modeled" if r.get("estimate_note") else "-",
            f"{estimate / peak:.2f}" if estimate and peak else "-",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines += profile_table(report["runs"])
    if report.get("longest"):
        micro = report["settings"]["micro_batch"]
        lines += [
            "",
            f"| family | variant | longest sequence that fits (micro-batch {micro}) | context length |"
            " tokens/s there | peak GiB there | probes |",
            "|---|---|---|---|---|---|---|",
        ]
        for family, variants in report["longest"].items():
            context = text_shape(report["families"][family]["shape"]).get("max_position_embeddings", "-")
            for name, seq in variants.items():
                probes = [p for p in report.get("longest_probes", []) if (p["family"], p["variant"]) == (family, name)]
                there = probe_at_longest(report, family, name)
                speed = f"{there['tokens_per_second']:,.0f}" if "tokens_per_second" in there else "-"
                peak = f"{there['peak_bytes'] / GiB:.2f}" if there.get("peak_bytes") else "-"
                cells = [family, name, seq if seq else "none", context, speed, peak, len(probes)]
                lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines += [
        "",
        "Loss: the model's own with labels (HF eager: full logits; Liger and tigon: fused linear cross entropy,"
        " except Liger's Granite patch, which keeps the logits)."
        + (
            ' Planner estimate "not modeled": the planner counts other parameters than this model\'s (a shape it'
            " does not model)."
            if any(r.get("estimate_note") for r in report["runs"])
            else ""
        ),
    ]
    return "\n".join(lines) + "\n"


def merge_reports(reports: list[dict]) -> dict:
    """One report from several: families in PRESETS order; per (family, variant, seq) the last measured run, else
    the last outcome (not available, failed), else the record that it was not run."""
    families = {name: family for report in reports for name, family in report["families"].items()}

    def rank(run: dict) -> int:
        return 2 if "micro_batch" in run else 0 if "skipped" in run else 1

    runs: dict[tuple, dict] = {}
    for run in (run for report in reports for run in report["runs"]):
        key = (run.get("family", "llama"), run["variant"], run["seq"])
        if key not in runs or rank(run) >= rank(runs[key]):
            runs[key] = run
    order = list(PRESETS)
    merged = {
        "families": {name: families[name] for name in sorted(families, key=order.index)},
        "environment": reports[0]["environment"],
        "settings": reports[0]["settings"],
        "runs": sorted(runs.values(), key=lambda r: (order.index(r.get("family", "llama")), r["seq"])),
    }

    def found(outcome) -> int:  # a length (or None: nothing fits) beats not available / failed beats not run
        return 2 if outcome is None or isinstance(outcome, int) else 0 if outcome.startswith("not run") else 1

    longest: dict[str, dict] = {}
    for report in reports:
        for family, variants in report.get("longest", {}).items():
            for variant, outcome in variants.items():
                known = longest.setdefault(family, {})
                if variant not in known or found(outcome) >= found(known[variant]):
                    known[variant] = outcome
    if longest:
        merged["longest"] = {name: longest[name] for name in sorted(longest, key=order.index)}
        merged["longest_probes"] = [probe for report in reports for probe in report.get("longest_probes", [])]
    return merged


def profile_table(runs: list[dict]) -> list[str]:
    """Markdown lines: each profiled run's step split by kind of kernel (ms), busiest kinds first."""
    from tigon.runtime.profiling import KIND_NAMES

    profiled = [r for r in runs if r.get("profile")]
    if not profiled:
        return []
    kinds = KIND_NAMES
    lines = [
        "",
        "Where one profiled step's time goes (ms; kernels grouped by name, `runtime/profiling.py`):",
        "",
        "| family | variant | seq | step | busy | " + " | ".join(kinds) + " | waiting on the host |",
        "|---|---|---|---|---|" + "---|" * (len(kinds) + 1),
    ]
    for r in profiled:
        p = r["profile"]
        cells = [r.get("family", "llama"), r["variant"], r["seq"], f"{p['step_ms']:.1f}", f"{p['busy_ms']:.1f}"]
        cells += [f"{p['kinds_ms'].get(kind, 0.0):.1f}" for kind in kinds]
        cells.append(f"{max(0.0, p['step_ms'] - p['busy_ms']):.1f}")
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return lines


def plot_families(report: dict, path: Path) -> None:
    """Per family: tokens/s and peak memory of Liger-Kernel and tigon as multiples of HF eager's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {(r["family"], r["variant"]): r for r in report["runs"] if r.get("tokens_per_second")}
    families = [f for f in report["families"] if (f, "eager") in measured]
    figure, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for offset, variant in ((-0.2, "liger"), (0.2, "tigon")):
        for axis, key in zip(axes, ("tokens_per_second", "peak_bytes"), strict=True):
            values = [
                measured[(f, variant)][key] / measured[(f, "eager")][key]
                if (f, variant) in measured and measured[(f, variant)][key]  # CPU runs have no peak
                else 0.0
                for f in families
            ]
            axis.bar([i + offset for i in range(len(families))], values, width=0.4, label=variant)
    axes[0].set_ylabel("tokens/s / HF eager's\n(higher is better)")
    axes[1].set_ylabel("peak memory / HF eager's\n(lower is better)")
    for axis in axes:
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.grid(axis="y", alpha=0.3)
        axis.legend()
    axes[1].set_xticks(range(len(families)), families, rotation=30, fontsize=9)
    settings, env = report["settings"], report["environment"]
    axes[0].set_title(
        f"One training step per family, bf16, AdamW, seq {report['runs'][0]['seq']} x micro-batch "
        f"{settings['micro_batch']}, checkpointing on, {env.get('gpu') or 'CPU'} (no bar: not measured)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def probe_at_longest(report: dict, family: str, variant: str) -> dict:
    """The measured probe at the longest length `variant` of `family` fit; {} where none fit or it was not run."""
    seq = report["longest"][family].get(variant)
    probes = report.get("longest_probes", [])
    return next(
        (
            p
            for p in probes
            if (p["family"], p["variant"], p["seq"]) == (family, variant, seq) and not p["oom"] and "error" not in p
        ),
        {},
    )


def plot_longest(report: dict, path: Path) -> None:
    """Per family and variant: the peak memory at the longest sequence that fit, that length written on the bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in VARIANTS if any(v in found for found in report["longest"].values())]
    families = list(report["longest"])
    figure, axis = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(variants)
    for index, variant in enumerate(variants):
        for position, family in enumerate(families):
            probe = probe_at_longest(report, family, variant)
            if not probe.get("peak_bytes"):
                continue
            x = position - 0.4 + width * (index + 0.5)
            axis.bar(x, probe["peak_bytes"] / GiB, width=width, color=f"C{index}")
            axis.text(x, probe["peak_bytes"] / GiB, f"{probe['seq'] / 1024:g}K", ha="center", va="bottom", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(variants))]
    axis.legend(handles, variants)
    axis.set_xticks(range(len(families)), families, rotation=30, fontsize=9)
    axis.set_ylabel("peak GiB at that length")
    axis.grid(axis="y", alpha=0.3)
    axis.set_title(
        f"Longest sequence that fits (on the bar, up to the model's context length) and its peak memory, micro-batch "
        f"{report['settings']['micro_batch']}, {report['environment'].get('gpu') or 'CPU'}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
