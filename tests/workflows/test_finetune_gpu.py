"""The Flyte workflow on this machine's GPUs (marker `gpu`): `pyflyte run workflows/finetune.py finetune` with a
one-node GPU job template, flytekit's local engine, torch elastic with NCCL and one worker per GPU. This is a
user's first cluster job minus Kubernetes: it trains under FSDP2 with the kernels on, checkpoints, resumes after
a killed worker and exports.

    python -m pytest -m gpu tests/workflows/test_finetune_gpu.py

The job template is written for the machine (`nproc_per_node` = its GPU count) into a directory named by
$TIGON_JOB_TEMPLATES, as a platform engineer would add one. A killed worker makes torch elastic restart the
group; the run resumes from its newest checkpoint to the uninterrupted run's per-step losses bit for bit
(FSDP2 over NCCL reduces in a fixed order for a fixed group; the multi-GPU runtime tests show the same).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

pytest.importorskip("flytekit")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
CHECKPOINT_EVERY = 8
pytestmark = pytest.mark.gpu


def gpu_template(directory: Path, gpus: int) -> Path:
    """A one-node template with a worker per GPU, beside the shipped ones (TIGON_JOB_TEMPLATES replaces them)."""
    directory.mkdir(parents=True, exist_ok=True)
    for shipped in (ROOT / "deploy" / "job-templates").glob("*.yaml"):
        (directory / shipped.name).write_text(shipped.read_text())
    template = yaml.safe_load((ROOT / "deploy" / "job-templates" / "h100x1.yaml").read_text())
    template.update(name="local-gpus", description=f"this machine: {gpus} GPUs", nproc_per_node=gpus)
    template.update(gpus_per_node=gpus, max_restarts=2)
    (directory / "local-gpus.yaml").write_text(yaml.safe_dump(template))
    return directory


def gpu_config(tmp_path: Path) -> Path:
    """The demo task on a wider Llama in bf16 under FSDP2 over NCCL, with the kernels on."""
    raw = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    raw["data"].update(train=str(ROOT / raw["data"]["train"]), eval=str(ROOT / raw["data"]["eval"]))
    raw["model"]["config_overrides"].update(hidden_size=512, intermediate_size=1408, num_hidden_layers=4)
    raw["model"]["config_overrides"].update(num_attention_heads=8, num_key_value_heads=4)
    raw["model"]["dtype"] = "float32"
    raw["training"].update(precision="bf16", micro_batch_size=8, learning_rate=1e-3)
    raw["parallelism"] = {"strategy": "fsdp", "backend": "nccl"}
    raw["checkpoint"].update(every_steps=CHECKPOINT_EVERY, keep_last=2, resume=True, export=True)
    raw["logging"].update(every_steps=1, tensorboard=False)
    raw["eval"] = {"every_steps": 0, "metrics": ["loss"], "max_batches": 2}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def pyflyte_run(config: Path, run_dir: Path, templates: Path, on_start=None) -> None:
    """`pyflyte run workflows/finetune.py finetune` with the local GPU template, from the repository root."""
    command = [sys.executable, "-m", "flytekit.clis.sdk_in_container.pyflyte", "run", "workflows/finetune.py"]
    command += ["finetune", "--config", str(config), "--steps", str(STEPS), "--run_dir", str(run_dir)]
    command += ["--job_template", "local-gpus"]
    env = {**os.environ, "TIGON_JOB_TEMPLATES": str(templates)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = threading.Thread(target=on_start, args=(process,)) if on_start else None
    if watcher:
        watcher.start()
    output, _ = process.communicate(timeout=540)
    if watcher:
        watcher.join()
    assert process.returncode == 0, output[-6000:]


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def test_pyflyte_run_on_the_gpus_trains_resumes_after_a_killed_worker_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    gpus = torch.cuda.device_count()
    if gpus < 1:
        pytest.fail("needs a CUDA GPU")
    templates, config = gpu_template(tmp_path / "templates", gpus), gpu_config(tmp_path)
    clean, interrupted = tmp_path / "clean", tmp_path / "killed"
    started = time.perf_counter()
    pyflyte_run(config, clean, templates)
    clean_seconds = time.perf_counter() - started
    killed: list[int] = []

    def kill_a_worker_after_the_first_checkpoint(process: subprocess.Popen) -> None:
        checkpoint = interrupted / "checkpoints" / f"step-{CHECKPOINT_EVERY}"
        deadline = time.time() + 500
        while time.time() < deadline and not checkpoint.exists() and process.poll() is None:
            time.sleep(0.05)
        children = psutil.Process(process.pid).children(recursive=True)
        workers = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        if workers:
            workers[-1].kill()
            killed.append(workers[-1].pid)

    pyflyte_run(config, interrupted, templates, on_start=kill_a_worker_after_the_first_checkpoint)
    assert killed, "no elastic worker process was found to kill"

    summary = json.loads((interrupted / "summary.json").read_text())
    print(
        f"pyflyte run on {gpus} GPUs: {clean_seconds:.0f} s for {STEPS} steps; worker {killed[0]} killed after step "
        f"{CHECKPOINT_EVERY}'s checkpoint, resumed from step {summary['resumed_from_step']}, world size "
        f"{summary['world_size']}, {summary['tokens_per_second']:.0f} tokens/s"
    )
    assert summary["world_size"] == gpus
    assert summary["resumed_from_step"] in (CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY), summary["resumed_from_step"]
    uninterrupted, resumed = losses(clean), losses(interrupted)
    assert len(uninterrupted) == STEPS and uninterrupted[-1] < uninterrupted[0], uninterrupted
    assert resumed == uninterrupted, (resumed, uninterrupted)

    model = AutoModelForCausalLM.from_pretrained(summary["export_dir"])
    assert model.config.hidden_size == 512 and model.config.num_hidden_layers == 4
    assert (interrupted / "report.html").is_file()
