"""The memory planner against the measured peak of preference runs: padded and packed pairs, a frozen reference
copy and a precomputed reference pass.

    python -m benchmarks.preference_memory --out preference-memory.json          # GPU: every case, ~2 minutes
    python -m benchmarks.preference_memory --tiny --out /tmp/preference.json     # CPU rehearsal: estimates only

Each case trains a small Llama (bf16, AdamW, hidden 1024, 8 layers, vocabulary 32000; `--tiny`: hidden 64, 2
layers) with the torch trainer's `train()` for a few steps in a fresh process, on random preference records whose
every sequence fills `data.max_seq_len` (the planner's bound, so the estimate is for the data as trained), and
records `torch.cuda.max_memory_allocated` over the whole run (the precomputed pass included) next to the planner's
estimate for the run's setting. Results: JSON to --out and a line per case.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from benchmarks.end_to_end_runner import run_worker

GiB = 2**30
SMALL_LLAMA = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}
TINY_LLAMA = {**SMALL_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 512}
#: name: (objective, data.packing, gradient checkpointing, kernels)
CASES = {
    "dpo-model-padded": ({"type": "dpo", "reference": "model"}, False, False, True),
    "dpo-model-packed": ({"type": "dpo", "reference": "model"}, True, False, True),
    "dpo-precomputed-packed-ckpt": ({"type": "dpo", "reference": "precomputed"}, True, True, True),
    "kto-model-padded-eager": ({"type": "kto", "reference": "model"}, False, False, False),
    "orpo-packed": ({"type": "orpo"}, True, False, True),
}


def records(objective: str, count: int, length: int, seed: int) -> list[dict]:
    """Random text records whose prompt plus any completion is longer than `length` characters, so every
    tokenized sequence is cut to exactly `data.max_seq_len` (the char tokenizer: a token a character)."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghij0123456789 ") for _ in range(n))

    prompt_length = length // 4
    result = []
    for index in range(count):
        prompt = text(prompt_length)
        if objective == "kto":
            result.append({"prompt": prompt, "completion": text(length), "label": index % 2 == 0})
        else:
            result.append({"prompt": prompt, "chosen": text(length), "rejected": text(length)})
    return result


def case_config(spec: dict, directory: Path):
    """The run of one case: `spec` holds the case name, seq, micro_batch, accumulation, steps and tiny."""
    from tigon.runtime.config import parse_config

    objective, packing, checkpointing, kernels = CASES[spec["case"]]
    global_batch = spec["micro_batch"] * spec["accumulation"]
    data = directory / "train.jsonl"
    rows = records(objective["type"], global_batch * spec["steps"], spec["seq"], seed=0)
    data.write_text("".join(json.dumps(record) + "\n" for record in rows))
    return parse_config(
        {
            "model": {
                "config_name": "llama",
                "config_overrides": TINY_LLAMA if spec["tiny"] else SMALL_LLAMA,
                "tokenizer": "char",
                "dtype": "bfloat16",
            },
            "data": {"train": str(data), "max_seq_len": spec["seq"], "packing": packing},
            "objective": objective,
            "training": {
                "max_steps": spec["steps"],
                "micro_batch_size": spec["micro_batch"],
                "gradient_accumulation_steps": spec["accumulation"],
                "gradient_checkpointing": checkpointing,
                "precision": "bf16",
                "lr_schedule": "constant",
            },
            "kernels": {"enabled": kernels},
            "checkpoint": {"export": False, "resume": False},
            "logging": {"run_dir": str(directory / "run"), "tensorboard": False, "progress_bar": False},
        }
    )


def worker(spec: dict) -> dict:
    """One case in this (fresh) process: the planner's estimate and, on a GPU, the measured peak."""
    import torch

    from tigon.runtime import planner
    from tigon.runtime.trainer import train

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as directory:
        config = case_config(spec, Path(directory))
        work = planner.workload(config, world_size=1)
        estimate = planner.estimate(work, planner.setting_of(config))
        if cuda:
            torch.cuda.init()
            torch.cuda.reset_peak_memory_stats()
        try:
            result = train(config)
        except torch.OutOfMemoryError:
            return {"case": spec["case"], "oom": True, "estimate_bytes": estimate.peak}
        peak = torch.cuda.max_memory_allocated() if cuda else None
    return {
        "case": spec["case"],
        "oom": False,
        "seq": spec["seq"],
        "micro_batch": spec["micro_batch"],
        "estimate_bytes": estimate.peak,
        "estimate_moment": estimate.moment,
        "estimate_parts": estimate.parts,
        "peak_bytes": peak,
        "losses": result.losses,
    }


def describe(result: dict) -> str:
    if "error" in result:
        return f"{result['case']}: failed: {result['error']}"
    estimate = result["estimate_bytes"] / GiB
    if result["oom"]:
        return f"{result['case']}: out of memory (estimate {estimate:.3f} GiB)"
    line = f"{result['case']}: estimate {estimate:.3f} GiB at the {result['estimate_moment']}"
    if result["peak_bytes"] is not None:
        peak = result["peak_bytes"] / GiB
        line += f", measured {peak:.3f} GiB, ratio {estimate / peak:.3f}"
    return line + f", losses {[round(loss, 4) for loss in result['losses']]}"


def run_case(case: str, seq: int, micro_batch: int, tiny: bool = False, timeout: float = 600) -> dict:
    """One case in a fresh interpreter (`end_to_end.run_worker`)."""
    spec = {"case": case, "seq": seq, "micro_batch": micro_batch, "accumulation": 2, "steps": 2, "tiny": tiny}
    return run_worker("benchmarks.preference_memory", spec, {"case": case, "oom": False}, timeout, case)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="the tiny model at sequence 32: a CPU rehearsal")
    parser.add_argument("--out", type=Path, required=False)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    seq = 32 if args.tiny else args.seq
    results = []
    for case in args.cases.split(","):
        if case not in CASES:
            sys.exit(f"unknown case {case!r}; the cases are {', '.join(CASES)}")
        results.append(run_case(case, seq, args.micro_batch, args.tiny))
        print(describe(results[-1]), flush=True)
    if args.out:
        temporary = args.out.with_name(f".{args.out.name}.tmp")
        temporary.write_text(json.dumps(results, indent=1))
        temporary.replace(args.out)


if __name__ == "__main__":
    main()
