"""Multi-GPU training runs through `tigon train` under torchrun: the headline sweep (benchmarks/headline.sh)
and the scaling sweep (benchmarks/scaling.sh) drive these pieces.

    python -m benchmarks.headline prepare --out DIR --variant tigon --seq 4096 --gpus 4   # prints the config path
    torchrun --nproc_per_node 4 -m tigon.runtime train DIR/tigon-4096/config.yaml        # eager, tigon, planner
    torchrun --nproc_per_node 4 -m benchmarks.headline liger-train DIR/liger-4096/config.yaml
    python -m benchmarks.headline collect --out DIR                                      # headline.json + .md
    python -m benchmarks.headline scaling --out DIR    # tokens/s per GPU against GPUs (scaling.json + .md)
    python -m benchmarks.headline paired --out DIR tigon-plain-4096 tigon-4096   # the same batches, step by step

The model is a real config with random weights: Llama-3-8B (hidden 4096, intermediate 14336, 32 layers,
32 heads, 8 KV heads, vocab 128256, rope_theta 500000) or Llama-3.2-1B (`--shape llama-3.2-1b`), bf16,
AdamW, gradient checkpointing on, FSDP2 by default (`--strategy ddp`, `fsdp` or `zero3`), trained on random
characters (the char tokenizer; the head still spans all 128256 tokens): one document a sequence, or with
`--documents mixed` fine-tuning-like documents of 100 to 4000 characters (log-uniform, as
benchmarks/packed_attention.py draws them) packed into each sequence, where tigon's variants attend over the
documents' boundaries (`model.attn_implementation: auto`) and eager and liger through SDPA's block-diagonal mask;
`--documents instruction` the same documents as instruction records, each split at a uniform point into a prompt
without loss and a response; `--documents pairs` DPO records (a frozen reference copy) whose prompt and two
responses are 100 to 2000 characters each, a micro-batch's pairs packed into one row.
Variants: eager (kernels off),
liger (HF + Liger-Kernel patched into transformers' Llama before the model is built), tigon (kernels on),
planner (kernels on, `training.plan: auto`). `--layers` shortens the model (real widths and vocab);
`--tiny` makes a tiny Llama for CPU smoke runs. Tokens/s is measured after the warm-up steps from
metrics.jsonl; peak memory is rank 0's torch.cuda.max_memory_allocated (summary.json).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import sys
from pathlib import Path

import yaml

from benchmarks.presets import LLAMA_3_8B
from tigon.runtime.config import apply_override, load_config
from tigon.runtime.files import atomic_path
from tigon.runtime.planner import Setting, estimate, setting_of, workload

GiB = 2**30
WARMUP_STEPS = 3
VARIANTS = ("eager", "liger", "tigon", "planner", "tigon-compiled", "planner-compiled")
LLAMA_3_2_1B = {
    **LLAMA_3_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "tie_word_embeddings": True,
}
TINY = {**LLAMA_3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY |= {"num_key_value_heads": 2, "vocab_size": 512}
SHAPES = {"llama-3-8b": LLAMA_3_8B, "llama-3.2-1b": LLAMA_3_2_1B}
ALPHABET = string.ascii_letters + string.digits + " "  # the random text's characters
DOCUMENTS = ("full", "mixed", "instruction", "pairs")
MIXED_LENGTHS = (100, 4000)  # characters a document, log-uniform
REAL_TOKENS = re.compile(r"sequences, (\d+) tokens \(.*?, (\d+) padding\)")
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "zero1": {"strategy": "deepspeed", "zero_stage": 1},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
}


def write_data(path: Path, n_docs: int, length: int, seed: int = 0) -> None:
    """`n_docs` text records that are `length` tokens each under the char tokenizer (one record per packed
    sequence): `length - 2` random characters, between the start and end tokens it adds."""
    if path.is_file():
        return
    rng = random.Random(seed)
    with atomic_path(path) as temporary, temporary.open("w") as file:
        for _ in range(n_docs):
            file.write(json.dumps({"text": "".join(rng.choices(ALPHABET, k=length - 2))}) + "\n")


def write_documents(path: Path, n_chars: int, seed: int = 0, prompts: bool = False) -> None:
    """Text records of random characters whose lengths are log-uniform in MIXED_LENGTHS, `n_chars` in all; with
    `prompts`, instruction records instead: each document split at a uniformly drawn point into a prompt (no loss)
    and a response, so prompts hold about half the tokens."""
    if path.is_file():
        return
    from benchmarks.packed_attention import documents

    rng = random.Random(seed)
    with atomic_path(path) as temporary, temporary.open("w") as file:
        for doc in documents(n_chars, len(ALPHABET), *MIXED_LENGTHS, seed):
            text = "".join(ALPHABET[i] for i in doc)
            if prompts:
                split = rng.randint(1, len(text) - 1)
                record = {"instruction": text[:split], "response": text[split:]}
            else:
                record = {"text": text}
            file.write(json.dumps(record) + "\n")


def write_pairs(path: Path, n_pairs: int, seed: int = 0) -> None:
    """`n_pairs` DPO records of random characters: a prompt, a chosen and a rejected response, each of 100 to 2000
    characters (log-uniform), so a sequence fits 4096 tokens and its prompt is about half of it."""
    if path.is_file():
        return
    rng = random.Random(seed)
    low, high = 100, 2000
    with atomic_path(path) as temporary, temporary.open("w") as file:
        for _ in range(n_pairs):
            texts = ["".join(rng.choices(ALPHABET, k=round(low * (high / low) ** rng.random()))) for _ in range(3)]
            file.write(json.dumps(dict(zip(("prompt", "chosen", "rejected"), texts, strict=True))) + "\n")


def prepare(
    out: Path,
    variant: str,
    seq: int,
    gpus: int,
    steps: int,
    micro_batch: int,
    layers: int | None,
    tiny: bool = False,
    shape_name: str = "llama-3-8b",
    strategy: str = "fsdp",
    settings: list[str] = (),
    tag: str = "",
    documents: str = "full",
) -> Path:
    """Write the run's data (shared per sequence length) and config; returns the config path. `settings` are
    `KEY=VALUE` overrides as `tigon train --set` takes them; `tag` names such a run apart (`tigon-TAG-4096`);
    `documents` is one document a sequence ("full"), packed fine-tuning-like documents ("mixed"), or those as
    instruction records whose prompts carry no loss ("instruction")."""
    sequences = int(gpus * micro_batch * steps * 1.1) + 8
    data = out / "data" / f"{'text' if documents == 'full' else documents}-{seq}.jsonl"
    if documents == "full":
        write_data(data, n_docs=sequences, length=seq)
    elif documents == "pairs":
        write_pairs(data, n_pairs=sequences)
    else:
        write_documents(data, n_chars=int(sequences * seq * 1.1), prompts=documents == "instruction")
    kernels = variant.startswith(("tigon", "planner"))
    shape = {**(TINY if tiny else SHAPES[shape_name]), "max_position_embeddings": max(8192, seq)}
    if layers:
        shape["num_hidden_layers"] = layers
    run_dir = out / f"{variant}{'-' + tag if tag else ''}-{seq}"
    config = {
        "name": f"headline-{variant}-{seq}",
        "model": {
            "config_name": "llama",
            "config_overrides": shape,
            "tokenizer": "char",
            "dtype": "bfloat16",
            "attn_implementation": "auto" if kernels and documents != "full" else "sdpa",
        },
        "data": {
            "train": str(data.resolve()),
            "format": "instruction" if documents == "instruction" else "text",
            "max_seq_len": seq,
            "packing": True,
        },
        "objective": {"type": "dpo", "reference": "model"} if documents == "pairs" else {"type": "sft"},
        "training": {
            "max_steps": steps,
            "learning_rate": 1e-5,
            "lr_schedule": "constant",
            "micro_batch_size": micro_batch,
            "gradient_checkpointing": True,
            "precision": "bf16",
            "plan": "auto" if variant.startswith("planner") else "manual",
            "compile": variant.endswith("-compiled"),
        },
        "kernels": {"enabled": kernels},
        "parallelism": STRATEGIES[strategy],
        "checkpoint": {"every_steps": 0, "export": False, "resume": False},
        "logging": {"run_dir": str(run_dir.resolve()), "every_steps": 1, "tensorboard": False, "progress_bar": False},
        "eval": {"metrics": ["loss"]},
    }
    for setting in settings:
        apply_override(config, setting)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def liger_train(config_path: str) -> int:
    """`tigon train CONFIG` with Liger-Kernel patched into transformers' Llama first (every model built after), and
    the runtime's CUDA allocator settings before that (Liger-Kernel's import starts CUDA, after which the runtime
    leaves the allocator as it is)."""
    from tigon.runtime.distributed import configure_allocator

    configure_allocator()
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama()
    from tigon.runtime.cli import main

    return main(["train", config_path])


def steady_tokens_per_second(metrics: list[dict]) -> float | None:
    """Tokens/s between the end of the warm-up steps and the last step (the logged rates are cumulative)."""
    steps = [m for m in metrics if m.get("tokens_per_second")]
    if len(steps) <= WARMUP_STEPS:
        return None
    seconds = sum(step_seconds(steps))
    return (steps[-1]["tokens_seen"] - steps[WARMUP_STEPS - 1]["tokens_seen"]) / seconds if seconds > 0 else None


def step_seconds(metrics: list[dict]) -> list[float]:
    """Each step's seconds after the warm-up steps (from the cumulative rates the run logs)."""
    return every_step_seconds(metrics)[WARMUP_STEPS:]


def every_step_seconds(metrics: list[dict]) -> list[float]:
    """Each step's seconds, the first included, from the cumulative rates the run logs."""
    ends = [m["tokens_seen"] / m["tokens_per_second"] for m in metrics if m.get("tokens_per_second")]
    return [end - start for start, end in zip([0.0, *ends], ends, strict=False)]


def paired(out: Path, base: str, other: str) -> dict:
    """Two runs under `out` (directory names, e.g. tigon-plain-4096) that trained the same global batches in the
    same order, step by step: the median of `other`'s step time over `base`'s, and their total times' ratio. Pairing
    the steps takes out what varies from batch to batch (the tokens a step holds)."""
    seconds = []
    for name in (base, other):
        metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
        seconds.append(step_seconds(metrics))
    ratios = [b / a for a, b in zip(*seconds, strict=False)]
    if not ratios:
        raise ValueError(f"{base} and {other} have no timed step in common (each needs more than {WARMUP_STEPS})")
    steps = len(ratios)
    total = sum(seconds[1][:steps]) / sum(seconds[0][:steps])
    return {"steps": steps, "median_ratio": statistics.median(ratios), "total_ratio": total}


TIME_LIMIT = "stopped at the time limit"  # benchmarks/headline.sh's last line in a run it stopped (LIMIT)


def collect(out: Path) -> dict:
    """Every run under `out`: tokens/s after warm-up, rank 0's peak memory, out-of-memory, the longest fit."""
    runs = []
    for run_dir in sorted(p for p in out.iterdir() if p.is_dir() and (p / "config.yaml").is_file()):
        variant, seq = run_dir.name.rsplit("-", 1)
        log = out / f"{run_dir.name}.log"
        log_text = log.read_text(errors="replace") if log.is_file() else ""
        summary_file = run_dir / "summary.json"
        row = {"variant": variant, "seq": int(seq), "oom": "out of memory" in log_text.lower()}
        counted = REAL_TOKENS.search(log_text)
        if counted:  # the packed data's share of real tokens (a sequence's tail is padding)
            real, padding = int(counted.group(1)), int(counted.group(2))
            row["real_token_fraction"] = real / (real + padding)
        if summary_file.is_file():
            summary = json.loads(summary_file.read_text())
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            training = summary["config"]["training"]
            row |= {
                "tokens_per_second": steady_tokens_per_second(metrics),
                "step_seconds": [round(seconds, 4) for seconds in step_seconds(metrics)],
                "peak_bytes_rank0": summary["peak_memory_bytes"],
                "world_size": summary["world_size"],
                "micro_batch": training["micro_batch_size"],
                "accumulation": training["gradient_accumulation_steps"],
                "accumulate_sharded": summary["config"]["parallelism"].get("accumulate_sharded", False),
                "checkpointing": training["gradient_checkpointing"],
                "recompute": recompute_text(training),
                "final_loss": summary["final_loss"],
            }
        elif not row["oom"]:
            row["error"] = failure_line(log_text)
        runs.append(row)
    runs.sort(key=lambda r: (VARIANTS.index(r["variant"]) if r["variant"] in VARIANTS else 9, r["seq"]))
    longest = {}
    for row in runs:
        if "tokens_per_second" in row:
            longest[row["variant"]] = max(longest.get(row["variant"], 0), row["seq"])
    report = {"runs": runs, "longest": longest}
    (out / "headline.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "headline.md").write_text(markdown(report))
    return report


def failure_line(log_text: str) -> str:
    """What a failed run's log says went wrong: its last line naming an error (each rank's `error:` line, the time
    limit's), else its last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    named = [line for line in lines if "error:" in line.lower() or line.startswith(TIME_LIMIT)]
    return (named or lines or ["no log"])[-1]


def recompute_text(training: dict) -> str:
    """A run's checkpointing as the planner's table writes it: on, off, N layers, M selective."""
    full = training["checkpoint_layers"] if training["gradient_checkpointing"] else None
    setting = Setting(1, 1, training["gradient_checkpointing"], True, full, training.get("selective_layers", 0))
    return setting.checkpointing_text()


def markdown(report: dict) -> str:
    lines = [
        "| variant | seq | micro x accum | checkpointing | tokens/s (all GPUs) | peak GiB (rank 0) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if "tokens_per_second" in r:
            tps = f"{r['tokens_per_second']:,.0f}" if r["tokens_per_second"] else "-"
            recompute = r.get("recompute", "on" if r["checkpointing"] else "off")
            lines.append(
                f"| {r['variant']} | {r['seq']} | {r['micro_batch']} x {r['accumulation']}"
                f"{' sharded' if r.get('accumulate_sharded') else ''} | "
                f"{recompute} | {tps} | {r['peak_bytes_rank0'] / GiB:.2f} |"
            )
        else:
            lines.append(f"| {r['variant']} | {r['seq']} | | | {'out of memory' if r['oom'] else r['error']} | |")
    lines += ["", "| variant | longest sequence that ran |", "|---|---|"]
    lines += [f"| {name} | {seq} |" for name, seq in report["longest"].items()]
    return "\n".join(lines) + "\n"


def scaling(out: Path) -> dict:
    """The runs of benchmarks/scaling.sh (`out/STRATEGY-NGPU/tigon-SEQ`): tokens/s per GPU at each GPU count,
    the scaling efficiency, N-GPU tokens/s over N times the one-GPU tokens/s of the same strategy, and the memory
    planner's estimate of each run's peak beside the measured one."""
    rows = []
    for group in sorted(p for p in out.iterdir() if p.is_dir() and p.name.endswith("gpu")):
        strategy, gpus = group.name.rsplit("-", 1)
        for run in collect(group)["runs"]:
            row = {"strategy": strategy, "gpus": int(gpus.removesuffix("gpu")), **run}
            if row.get("tokens_per_second"):
                row["tokens_per_second_per_gpu"] = row["tokens_per_second"] / row["gpus"]
            config = load_config(group / f"{run['variant']}-{run['seq']}" / "config.yaml")
            row["estimate_bytes"] = estimate(workload(config, row["gpus"]), setting_of(config)).peak
            rows.append(row)
    one_gpu = {(r["strategy"], r["seq"]): r.get("tokens_per_second") for r in rows if r["gpus"] == 1}
    for row in rows:
        base = one_gpu.get((row["strategy"], row["seq"]))
        if base and row.get("tokens_per_second"):
            row["efficiency"] = row["tokens_per_second"] / (row["gpus"] * base)
    rows.sort(key=lambda r: (r["strategy"], r["seq"], r["gpus"]))
    report = {"runs": rows}
    (out / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "scaling.md").write_text(scaling_markdown(report))
    return report


def scaling_markdown(report: dict) -> str:
    lines = [
        "| strategy | GPUs | seq | micro-batch | tokens/s (all GPUs) | tokens/s per GPU | efficiency | peak GiB | "
        "estimate GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        estimated = f"{r['estimate_bytes'] / GiB:.2f}"
        if not r.get("tokens_per_second"):
            failed = "out of memory" if r["oom"] else r.get("error", "-")
            lines.append(f"| {r['strategy']} | {r['gpus']} | {r['seq']} | | {failed} | | | | {estimated} |")
            continue
        efficiency = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        lines.append(
            f"| {r['strategy']} | {r['gpus']} | {r['seq']} | {r['micro_batch']} | {r['tokens_per_second']:,.0f} | "
            f"{r['tokens_per_second_per_gpu']:,.0f} | {efficiency} | {r['peak_bytes_rank0'] / GiB:.2f} | "
            f"{estimated} |"
        )
    return "\n".join(lines) + "\n"


def plot(scaling_reports: dict[str, Path], headline_reports: list[Path], out_dir: Path) -> list[Path]:
    """Two PNGs: tokens/s per GPU against GPUs (one line per model and strategy), and rank 0's peak memory
    against sequence length at micro-batch 1 without accumulation (one line per variant, from every report)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, len(scaling_reports), figsize=(4.2 * len(scaling_reports), 4.2), squeeze=False)
    for axes, (model, path) in zip(panels[0], scaling_reports.items(), strict=True):
        runs = json.loads(path.read_text())["runs"]
        for strategy in sorted({r["strategy"] for r in runs}):
            points = sorted((r["gpus"], r["tokens_per_second_per_gpu"]) for r in runs if r["strategy"] == strategy)
            axes.plot(*zip(*points, strict=True), marker="o", label=strategy)
        axes.set(xlabel="GPUs", ylabel="tokens/s per GPU", title=model)
        axes.set_xticks([1, 2, 4])
        axes.set_ylim(bottom=0)
        axes.legend(fontsize=8)
    figure.suptitle("Scaling (tigon kernels, seq 4096, micro-batch 8 per GPU)")
    scaling_png = out_dir / "multi-gpu-scaling.png"
    figure.tight_layout()
    figure.savefig(scaling_png, dpi=120)
    plt.close(figure)

    runs = [
        r
        for report in headline_reports
        for r in json.loads(report.read_text())["runs"]
        if r.get("micro_batch") == 1 and r.get("accumulation") == 1
    ]
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for index, variant in enumerate(sorted({r["variant"] for r in runs})):
        points = sorted((r["seq"], r["peak_bytes_rank0"] / GiB) for r in runs if r["variant"] == variant)
        style = ("-", "--", ":")[index % 3]  # equal peaks stay visible one over the other
        axes.plot(*zip(*points, strict=True), marker="o", linestyle=style, label=variant)
    axes.set(xlabel="sequence length", ylabel="peak GiB (rank 0)", title="Llama-3-8B, FSDP2 on 4 GPUs, micro-batch 1")
    axes.set_xscale("log", base=2)
    axes.set_ylim(bottom=0)
    axes.legend()
    memory_png = out_dir / "multi-gpu-memory.png"
    figure.tight_layout()
    figure.savefig(memory_png, dpi=120)
    plt.close(figure)
    return [scaling_png, memory_png]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write one run's data and config; print the config path")
    prep.add_argument("--out", required=True)
    prep.add_argument("--variant", required=True, choices=VARIANTS)
    prep.add_argument("--seq", type=int, required=True)
    prep.add_argument("--gpus", type=int, default=8)
    prep.add_argument("--steps", type=int, default=12)
    prep.add_argument("--micro-batch", type=int, default=8)
    prep.add_argument("--layers", type=int, default=None, help="fewer decoder layers (real widths and vocab)")
    prep.add_argument("--tiny", action="store_true", help="a tiny Llama instead of Llama-3-8B (CPU smoke runs)")
    prep.add_argument("--shape", default="llama-3-8b", choices=SHAPES, help="the model's config (random weights)")
    prep.add_argument("--strategy", default="fsdp", choices=STRATEGIES, help="parallelism (zero3: DeepSpeed ZeRO-3)")
    prep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    prep.add_argument("--tag", default="", help="names a run with overrides apart: VARIANT-TAG-SEQ")
    prep.add_argument("--documents", default="full", choices=DOCUMENTS, help="one a sequence, or mixed lengths packed")
    liger = commands.add_parser("liger-train", help="tigon train CONFIG with Liger-Kernel applied to Llama")
    liger.add_argument("config")
    gather = commands.add_parser("collect", help="tabulate every run under --out (headline.json, headline.md)")
    gather.add_argument("--out", required=True)
    pair = commands.add_parser("paired", help="two runs of the same batches, step by step: OTHER's time over BASE's")
    pair.add_argument("--out", required=True)
    pair.add_argument("base", help="a run directory under --out, e.g. tigon-plain-4096")
    pair.add_argument("other")
    scale = commands.add_parser("scaling", help="tabulate benchmarks/scaling.sh's runs (scaling.json, scaling.md)")
    scale.add_argument("--out", required=True)
    draw = commands.add_parser("plot", help="the scaling and memory PNGs from scaling and headline reports")
    draw.add_argument("--scaling", nargs="+", required=True, metavar="MODEL=scaling.json")
    draw.add_argument("--headline", nargs="+", required=True, help="headline.json reports (micro-batch 1 runs)")
    draw.add_argument("--out-dir", default="docs")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        out = Path(args.out)
        print(
            prepare(
                out,
                args.variant,
                args.seq,
                args.gpus,
                args.steps,
                args.micro_batch,
                args.layers,
                args.tiny,
                args.shape,
                args.strategy,
                args.set,
                args.tag,
                args.documents,
            )
        )
        return 0
    if args.command == "liger-train":
        return liger_train(args.config)
    if args.command == "plot":
        reports = {model: Path(path) for model, path in (item.split("=", 1) for item in args.scaling)}
        for path in plot(reports, [Path(path) for path in args.headline], Path(args.out_dir)):
            print(path)
        return 0
    if args.command == "paired":
        result = paired(Path(args.out), args.base, args.other)
        print(
            f"{args.other} over {args.base}, {result['steps']} steps: median step time ratio "
            f"{result['median_ratio']:.4f} ({1 / result['median_ratio']:.3f}x as fast), total "
            f"{result['total_ratio']:.4f}"
        )
        return 0
    if args.command == "scaling":
        print(scaling_markdown(scaling(Path(args.out))))
        return 0
    print(markdown(collect(Path(args.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
