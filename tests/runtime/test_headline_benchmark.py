"""benchmarks/headline.sh and benchmarks/scaling.sh cannot rot: their tiny CPU runs (`tigon train` under torchrun
over gloo)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.runtime.worker_groups import script_env

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_headline_run_tabulates_both_variants(tmp_path):
    env = script_env(tmp_path, TINY="1", GPUS="2", SEQS="32", VARIANTS="eager tigon", STEPS="5", MICRO_BATCH="2")
    done = subprocess.run(
        ["bash", "benchmarks/headline.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "== eager at seq 32 on 2 GPUs" in done.stdout and "exit 0" in done.stdout

    report = json.loads((tmp_path / "headline" / "headline.json").read_text())
    rows = {row["variant"]: row for row in report["runs"]}
    assert set(rows) == {"eager", "tigon"}
    for row in rows.values():
        assert row["seq"] == 32 and not row["oom"] and row["world_size"] == 2
        assert row["micro_batch"] == 2 and row["checkpointing"]
        assert row["tokens_per_second"] > 0 and row["peak_bytes_rank0"] > 0
        assert row["real_token_fraction"] == 1.0  # one document a sequence, filling it
    assert report["longest"] == {"eager": 32, "tigon": 32}
    config = (tmp_path / "headline" / "tigon-32" / "config.yaml").read_text()
    assert "strategy: fsdp" in config
    assert "| tigon | 32 | 2 x 1 | on |" in (tmp_path / "headline" / "headline.md").read_text()
    assert all(len(row["step_seconds"]) == 2 and min(row["step_seconds"]) > 0 for row in rows.values())


def test_paired_runs_compare_step_by_step(tmp_path):
    """Two runs of the same batches: each step's time against the other's (the logged rates are cumulative)."""
    from benchmarks.headline import paired, step_seconds

    def write_run(name: str, seconds: list[float]) -> None:
        (tmp_path / name).mkdir()
        tokens, elapsed, lines = 0, 0.0, []
        for step, took in enumerate(seconds, start=1):
            tokens, elapsed = tokens + 1000, elapsed + took
            lines.append(json.dumps({"step": step, "tokens_seen": tokens, "tokens_per_second": tokens / elapsed}))
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    write_run("base", [9.0, 5.0, 5.0, 1.0, 2.0, 4.0])
    write_run("other", [1.0, 1.0, 1.0, 1.1, 2.4, 4.0, 7.0])
    metrics = [json.loads(line) for line in (tmp_path / "base" / "metrics.jsonl").read_text().splitlines()]
    assert [round(s, 9) for s in step_seconds(metrics)] == [1.0, 2.0, 4.0]  # after 3 warm-up steps
    result = paired(tmp_path, "base", "other")
    assert result["steps"] == 3 and abs(result["median_ratio"] - 1.1) < 1e-9  # of 1.1, 1.2 and 1.0
    assert abs(result["total_ratio"] - 7.5 / 7.0) < 1e-9


def test_tiny_scaling_run_tabulates_tokens_per_gpu_and_efficiency(tmp_path):
    env = script_env(tmp_path, TINY="1", GPU_COUNTS="1 2", STRATEGIES="fsdp", SEQ="32", STEPS="5", MICRO_BATCH="2")
    done = subprocess.run(
        ["bash", "benchmarks/scaling.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "scaling" / "scaling.json").read_text())
    rows = {row["gpus"]: row for row in report["runs"]}
    assert set(rows) == {1, 2} and all(
        row["strategy"] == "fsdp" and row["world_size"] == row["gpus"] for row in rows.values()
    )
    assert rows[1]["efficiency"] == 1.0
    assert rows[2]["tokens_per_second_per_gpu"] == rows[2]["tokens_per_second"] / 2
    assert rows[2]["efficiency"] == rows[2]["tokens_per_second"] / (2 * rows[1]["tokens_per_second"])
    assert "| fsdp | 2 | 32 | 2 |" in (tmp_path / "scaling" / "scaling.md").read_text()
    from tigon.runtime.config import load_config
    from tigon.runtime.planner import estimate, setting_of, workload

    for gpus, row in rows.items():  # the planner's estimate of each run, from its own config
        config = load_config(tmp_path / "scaling" / f"fsdp-{gpus}gpu" / "tigon-32" / "config.yaml")
        assert row["estimate_bytes"] == estimate(workload(config, gpus), setting_of(config)).peak > 0


def test_prepare_names_compiled_variants_and_applies_overrides(tmp_path):
    from benchmarks.headline import prepare
    from tigon.runtime.config import load_config

    path = prepare(
        tmp_path,
        "planner-compiled",
        32,
        2,
        5,
        2,
        None,
        tiny=True,
        settings=["training.checkpoint_layers=1"],
        tag="ckpt1",
    )
    assert path == tmp_path / "planner-compiled-ckpt1-32" / "config.yaml"
    config = load_config(path)
    assert config.training.compile and config.training.plan == "auto" and config.kernels.enabled
    assert config.training.checkpoint_layers == 1


def test_mixed_documents_are_packed_fine_tuning_data_with_tigon_attending_over_their_boundaries(tmp_path):
    from benchmarks.headline import MIXED_LENGTHS, prepare
    from tigon.runtime.config import load_config

    tigon = load_config(prepare(tmp_path, "planner", 4096, 2, 3, 2, None, tiny=True, documents="mixed"))
    eager = load_config(prepare(tmp_path, "eager", 4096, 2, 3, 2, None, tiny=True, documents="mixed"))
    assert tigon.model.attn_implementation == "auto" and eager.model.attn_implementation == "sdpa"
    assert tigon.data.train == eager.data.train and tigon.data.packing
    lengths = [len(json.loads(line)["text"]) for line in Path(tigon.data.train).read_text().splitlines()]
    assert min(lengths) >= MIXED_LENGTHS[0] and max(lengths) <= MIXED_LENGTHS[1]
    assert sum(lengths) >= (int(2 * 2 * 3 * 1.1) + 8) * 4096  # as many characters as the full-length data holds
    assert sum(length < 1000 for length in lengths) > sum(length > 3000 for length in lengths)  # log-uniform
    full = load_config(prepare(tmp_path, "tigon", 4096, 2, 3, 2, None, tiny=True))
    assert full.model.attn_implementation == "sdpa" and full.data.train != tigon.data.train


def test_instruction_documents_are_the_mixed_ones_with_half_their_tokens_prompts(tmp_path):
    from benchmarks.headline import prepare
    from tigon.runtime.config import load_config
    from tigon.runtime.data import build_datasets
    from tigon.runtime.tokenizer import load_tokenizer

    config = load_config(prepare(tmp_path, "tigon", 4096, 2, 3, 2, None, tiny=True, documents="instruction"))
    mixed = load_config(prepare(tmp_path, "liger", 4096, 2, 3, 2, None, tiny=True, documents="mixed"))
    assert config.data.format == "instruction" and config.model.attn_implementation == "auto"
    records = [json.loads(line) for line in Path(config.data.train).read_text().splitlines()]
    texts = [json.loads(line)["text"] for line in Path(mixed.data.train).read_text().splitlines()]
    assert [record["instruction"] + record["response"] for record in records] == texts
    assert all(record["instruction"] and record["response"] for record in records)
    _, _, summary = build_datasets(config, load_tokenizer(config.model))
    assert 0.4 < summary.loss_fraction < 0.6  # the prompts, about half the tokens, carry no loss


def test_pairs_are_dpo_records_whose_sequences_fit_4096_tokens(tmp_path):
    from benchmarks.headline import prepare
    from tigon.runtime.config import load_config

    config = load_config(prepare(tmp_path, "tigon", 4096, 2, 3, 2, None, tiny=True, documents="pairs"))
    assert config.objective.type == "dpo" and config.objective.reference_source == "model" and config.data.packing
    records = [json.loads(line) for line in Path(config.data.train).read_text().splitlines()]
    assert len(records) == int(2 * 2 * 3 * 1.1) + 8
    lengths = [len(record[key]) for record in records for key in ("prompt", "chosen", "rejected")]
    assert min(lengths) >= 100 and max(lengths) <= 2000


def test_the_docs_plots_redraw_from_the_recorded_reports(tmp_path):
    """The command docs/benchmarks.md gives for its two multi-GPU plots, on the reports in docs/results."""
    from benchmarks.headline import main

    results = ROOT / "docs" / "results"
    scaling = [f"Llama-3-8B={results / 'scaling-llama-3-8b-h200x4.json'}"]
    headline = [str(results / "headline-llama-3-8b-h200x4.json"), str(results / "headline-llama-3-8b-h200x4-16k.json")]
    assert main(["plot", "--scaling", *scaling, "--headline", *headline, "--out-dir", str(tmp_path)]) == 0
    for name in ("multi-gpu-scaling.png", "multi-gpu-memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tiny_bars_run_pairs_the_planner_exact_and_fp8_with_the_base(tmp_path):
    """benchmarks/bars.sh on the CPU: the base at the largest micro-batch that fits, then the planner in bf16 and in
    FP8 (emulated, the layers `FP8_LAYERS` names), each paired with it; the base's setting is flex attention's,
    which the smoke run swaps for SDPA."""
    env = script_env(
        tmp_path,
        TINY="1",
        GPUS="2",
        SEQ="1024",
        STEPS="5",
        MICRO_BATCH="2",
        BASE="eager",
        SETS="model.attn_implementation=sdpa training.compile_backend=aot_eager",
        TIGON_FP8_EMULATE="1",
        FP8_LAYERS="tigon",
    )
    done = subprocess.run(
        ["bash", "benchmarks/bars.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    pairs = (tmp_path / "headline" / "bars.txt").read_text().splitlines()
    assert [line.split(",")[0] for line in pairs] == [
        "planner-bars-1024 over eager-bars2-1024",
        "planner-compiled-bars-fp8-tigon-1024 over eager-bars2-1024",
    ]
    assert all("x as fast)" in line for line in pairs)
    base = (tmp_path / "headline" / "eager-bars2-1024" / "config.yaml").read_text()
    assert "gradient_checkpointing: false" in base and "strategy: fsdp" in base
    fp8 = (tmp_path / "headline" / "planner-compiled-bars-fp8-tigon-1024" / "config.yaml").read_text()
    assert "precision: fp8" in fp8 and "compile: true" in fp8 and "fp8_layers: tigon" in fp8


def test_a_failed_run_is_tabulated_with_the_line_that_names_its_error(tmp_path):
    """A rank's `error:` line rather than torchrun's closing banner, and a run stopped at the time limit as such."""
    from benchmarks.headline import collect

    logs = {
        "tigon-32": "09:54:34 tigon.runtime: rank 0 of 2 failed\n[rank 0] error: dataset x.jsonl: too short\n"
        "Traceback (most recent call last):\n  File ...\n============\n",
        "liger-32": "step 1\nSignalException: Process 612 got signal: 15\nstopped at the time limit: LIMIT=60 s\n",
        "eager-32": "",
    }
    for name, text in logs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("{}\n")
        (tmp_path / f"{name}.log").write_text(text)
    errors = {row["variant"]: row["error"] for row in collect(tmp_path)["runs"]}
    assert errors == {
        "tigon": "[rank 0] error: dataset x.jsonl: too short",
        "liger": "stopped at the time limit: LIMIT=60 s",
        "eager": "no log",
    }
    assert "| tigon | 32 | | | [rank 0] error: dataset x.jsonl: too short | |" in (tmp_path / "headline.md").read_text()
