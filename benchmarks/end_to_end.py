"""End-to-end training benchmark: tokens/s and peak memory through the runtime's own step.

    python -m benchmarks.end_to_end --out e2e.json                    # GPU: Llama, seq 4096 and 8192, every variant
    python -m benchmarks.end_to_end --family all --seqs 4096 --out families.json   # GPU: every model family
    python -m benchmarks.end_to_end --longest --out longest.json      # GPU: the longest sequence each fits
    python -m benchmarks.end_to_end --tiny --family all --variants eager,tigon --out /tmp/e2e.json   # CPU smoke run
    python -m benchmarks.end_to_end --merge part1.json part2.json --out families.json   # one table and a plot
    python -m benchmarks.end_to_end --seqs 4096 --variants liger,tigon --profile --out e2e.json   # + time per kind
    python -m benchmarks.end_to_end --shape llama-3-8b --variants tigon --compile --precision fp8 --out fp8.json

One model per family of tigon's kernel table (`--family`, default llama; `all`, or a comma-separated list),
randomly initialized from the config of a named public member, or transformers' defaults for the family
(`PRESETS` in benchmarks/presets.py): a ~1B-4B model as it is, or for larger ones their real widths, heads and
vocabulary with fewer layers. A vision-language family's model is its `*ForConditionalGeneration`, vision tower
included, trained on text alone (no image batch), as a text-only fine-tune of it runs. `NOT_BENCHMARKED` names the
table's families without a preset, and why. In bf16 with AdamW, micro-batch 8 (or less where a preset caps it:
Falcon-H1's PyTorch Mamba-2 mixer takes 1, Llama 4's all-experts MoE 2), gradient checkpointing on, trained on
random tokens by the torch trainer's own `train_step` and strategy (its loss, clipping and AdamW step).
Variants:

- eager:   Hugging Face modules (kernels.enabled: false)
- liger:   HF + Liger-Kernel (the family's `apply_liger_kernel_to_*` on the built model; GPU machine only;
           "not available" for a family Liger-Kernel has no function for, or without liger-kernel, and
           "not supported by liger" where its function raises on the built model)
- tigon:   tigon's kernels (kernels.enabled: true)
- planner: the memory planner's choice for this GPU (`training.plan: auto`), same global batch

`--precision fp8` trains the decoder layers' Linear layers in FP8 (`training.precision: fp8`, with `--compile`; on
a CPU only with TIGON_FP8_EMULATE=1, the tests' emulation).
Every variant runs in a fresh subprocess so peaks do not mix; warm-up steps are not timed. The
planner's estimate is recorded next to each measured peak (the planner models eager and tigon;
Liger's rows have none, nor have models whose parameters the planner's shape does not count: a
Llama-like decoder, with Mixtral's, Qwen2-MoE's or Qwen3-MoE's MoE block). The trainer's loss is the
model's own, called with labels: HF eager computes `ForCausalLMLoss` from the full logits; Liger's and
tigon's patched forwards use their fused linear cross entropy, so neither materializes the
(tokens x vocab) logits (Liger's Granite patch has none: it keeps the logits and swaps in its cross
entropy).
`--tiny` shrinks every family's widths, layers and vocabulary but keeps its model_type and quirks
(softcapping, logit scaling, sliding windows, partial rotary, MoE routing, tied or untied head).
`--time-budget` stops starting runs once the next one would not finish in time; those rows say so.
Results: JSON to --out, a markdown table to --md (default: --out with .md). `--merge` joins reports of
several device calls (the last measured run of each family, variant and sequence wins) and also draws
tokens/s and peak memory against HF eager per family (--out with .png).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.end_to_end_report import describe, markdown, merge_reports, plot_families, plot_longest
from benchmarks.end_to_end_runner import (
    Budget,
    environment,
    liger_function,
    longest_sequence,
    run_in_subprocess,
    worker,
)
from benchmarks.presets import LARGER_SHAPES, PRESETS, VARIANTS, parse_families
from tigon.runtime.files import atomic_write_text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=False, help="JSON results file")
    parser.add_argument("--md", help="markdown table file (default: --out with .md)")
    parser.add_argument("--family", default="llama", help=f"all, or comma-separated, of {', '.join(PRESETS)}")
    parser.add_argument("--variants", default="eager,liger,tigon,planner", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--seqs", default=None, help="sequence lengths (default 4096,8192; --tiny: 64,128)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 8; --tiny 2)")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off (default on)")
    parser.add_argument("--checkpoint-layers", type=int, help="checkpoint the first N layers (default all)")
    parser.add_argument(
        "--selective-layers", type=int, default=0, help="after those, N layers recompute only element-wise work"
    )
    parser.add_argument("--compile", action="store_true", help="training.compile: each decoder layer compiled")
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp8"],
        help="training.precision on a GPU (default bf16; the CPU runs fp32); fp8 needs --compile",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    parser.add_argument("--longest", action="store_true", help="search the longest sequence each variant fits")
    parser.add_argument(
        "--longest-only", action="store_true", help="the longest-sequence search alone, no timed runs first"
    )
    parser.add_argument(
        "--longest-max",
        type=int,
        default=None,
        help="longest sequence probed (default: each model's context length; --tiny 256)",
    )
    parser.add_argument("--gpu-memory", help="planner variant: plan for this much memory (default: the GPU's)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run that works on the CPU")
    parser.add_argument("--shape", choices=LARGER_SHAPES, help="--family llama only: this model's shape instead")
    parser.add_argument("--qlora", action="store_true", help="QLoRA: the base in 4 bits (NF4), LoRA adapters train")
    parser.add_argument("--profile", action="store_true", help="one more step per run, profiled: time per kernel kind")
    parser.add_argument("--trace-dir", help="with --profile: write each profiled step's Chrome trace into this folder")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (default: none)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join these reports into --out, with a plot")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if not args.out:
        parser.error("--out is required")
    if args.merge:
        report = merge_reports([json.loads(Path(name).read_text()) for name in args.merge])
        out = Path(args.out)
        atomic_write_text(out, json.dumps(report, indent=2) + "\n")
        atomic_write_text(Path(args.md) if args.md else out.with_suffix(".md"), markdown(report))
        if any("tokens_per_second" in run for run in report["runs"]):
            plot_families(report, out.with_suffix(".png"))
        if report.get("longest"):
            plot_longest(report, out.with_name(out.stem + "-longest.png"))
        print(f"{markdown(report)}\nwrote {out}, its .md and the plots")
        return
    if args.precision == "fp8" and not args.compile:
        parser.error("--precision fp8 trains compiled decoder layers (training.compile): add --compile")
    if args.trace_dir:
        if not args.profile:
            parser.error("--trace-dir writes the profiled step's trace: add --profile")
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        families = parse_families(args.family)
    except ValueError as error:
        parser.error(str(error))
    if args.shape and families != ["llama"]:
        parser.error("--shape replaces the llama preset's shape: use it with --family llama")
    tiny = args.tiny
    seqs = [int(s) for s in (args.seqs or ("64,128" if tiny else "4096,8192")).split(",")]
    settings = {
        "micro_batch": args.micro_batch or (2 if tiny else 8),
        "checkpointing": not args.no_checkpointing,
        "checkpoint_layers": args.checkpoint_layers,
        "selective_layers": args.selective_layers,
        "compile": args.compile,
        "precision": args.precision,
        "steps": args.steps or (2 if tiny else 10),
        "warmup": args.warmup if args.warmup is not None else (1 if tiny else 3),
        "profile": args.profile,
        "trace_dir": args.trace_dir,
        "gpu_memory": args.gpu_memory,
        "qlora": args.qlora,
    }
    environment_info = environment()
    cuda = environment_info["gpu"] is not None
    report = {
        "families": {
            name: {
                "model": f"{args.shape} shape (random init)" if args.shape else PRESETS[name].describe(tiny),
                "source": PRESETS[name].source,
                "liger": PRESETS[name].liger,
                "attention": PRESETS[name].attention,
                "shape": PRESETS[name].tiny_shape() if tiny else LARGER_SHAPES.get(args.shape) or PRESETS[name].shape(),
            }
            for name in families
        },
        "environment": environment_info,
        "settings": settings | ({"time_budget_seconds": args.time_budget} if args.time_budget else {}),
        "runs": [],
    }
    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    budget = Budget(args.time_budget)

    def save() -> None:
        atomic_write_text(out, json.dumps(report, indent=2) + "\n")
        atomic_write_text(md, markdown(report))

    def micro_batch_of(family: str) -> int:
        """The micro-batch of the family's runs: the setting's, or the preset's cap (at its real shape)."""
        requested = settings["micro_batch"]
        return requested if tiny or args.shape else PRESETS[family].micro_batch_for(requested)

    def base_of(family: str) -> dict:
        return {
            "family": family,
            "shape": report["families"][family]["shape"],
            "attention": PRESETS[family].attention,
            **settings,
            "micro_batch": micro_batch_of(family),
        }

    timed_seqs = [] if args.longest_only else seqs
    total = len(families) * len(timed_seqs) * len(variants)
    jobs = ((f, s, v) for f in families for s in timed_seqs for v in variants)  # family by family: partials compare
    for index, (family, seq, variant) in enumerate(jobs, start=1):
        head = {"family": family, "variant": variant, "seq": seq, "oom": False}
        print(f"[{index}/{total}] {family} {variant} at seq {seq} x micro-batch {micro_batch_of(family)} ...")
        if variant == "liger" and (PRESETS[family].liger is None or not cuda):
            result = {**head, "unavailable": liger_function(family, cuda)[1]}  # no process needed to know
        elif not budget.allows_another():
            result = {**head, "skipped": budget.skipped()}
        else:
            result = run_in_subprocess(
                {**base_of(family), "variant": variant, "seq": seq}, min(args.timeout, budget.left())
            )
            budget.record(result)
        report["runs"].append(result)
        print(f"    {describe(result)}", flush=True)
        save()
    if args.longest or args.longest_only:
        report["longest"], report["longest_probes"] = {}, []
        step = 16 if tiny else 1024
        for family in families:
            report["longest"][family] = {}
            limit = args.longest_max or (256 if tiny else PRESETS[family].config["max_position_embeddings"])
            for variant in variants:
                print(f"longest sequence for {family} {variant}:", flush=True)
                if variant == "liger" and (PRESETS[family].liger is None or not cuda):
                    report["longest"][family][variant] = f"not available: {liger_function(family, cuda)[1]}"
                    continue
                if not budget.allows_another():
                    report["longest"][family][variant] = f"not run: {budget.skipped()}"
                    continue
                probe = {**base_of(family), "variant": variant, "steps": 1, "warmup": 1}
                seq, probes = longest_sequence(probe, limit, step, min(args.timeout, budget.left()))
                for result in probes:
                    budget.record(result)
                failed = seq is None and probes and ("error" in probes[-1] or "unavailable" in probes[-1])
                report["longest"][family][variant] = "failed (see longest_probes)" if failed else seq
                report["longest_probes"] += probes
                save()
    save()
    print(f"\n{markdown(report)}\nwrote {out} and {md}")
    not_run = sorted({r["family"] for r in report["runs"] if "skipped" in r}, key=families.index)
    if not_run:
        print(f"not run within the time budget: --family {','.join(not_run)}")


if __name__ == "__main__":
    main()
