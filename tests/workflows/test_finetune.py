"""The Flyte workflow, executed for real by flytekit's local engine (2 elastic workers over gloo)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("flytekit")

from flytekit.configuration import Image, ImageConfig, SerializationSettings  # noqa: E402
from flytekit.tools.translator import get_serializable  # noqa: E402

from workflows import finetune as wf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def reference_kernels_in_workers(monkeypatch):
    """The workers take the kernels' reference path: these tests prove the orchestration, and the
    interpreter would make a training run take minutes (the kernels have their own tests)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def write_config(tmp_path: Path, **changes) -> str:
    """The demo config, shrunk for a test, with absolute data paths and the given section changes."""
    raw = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    raw["data"].update(train=str(ROOT / raw["data"]["train"]), eval=str(ROOT / raw["data"]["eval"]), max_seq_len=64)
    raw["training"]["micro_batch_size"] = 4
    raw["eval"] = {"every_steps": 0, "metrics": ["loss"], "max_batches": 2}
    for section, values in changes.items():
        raw[section].update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def test_local_workflow_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    config = write_config(tmp_path, logging={"every_steps": 1})
    exported = wf.finetune(config=config, steps=8, run_dir=str(run_dir))
    model = AutoModelForCausalLM.from_pretrained(exported.path)
    assert model.config.num_hidden_layers == 2
    curve = losses(run_dir)
    assert len(curve) >= 8 and curve[-1] < curve[0], curve
    report = (run_dir / "report.html").read_text()
    assert "<h2>Training</h2>" in report and "data:image/png;base64" in report and "learning_rate" in report


@pytest.mark.parametrize("template", sorted(wf.TEMPLATES))
def test_train_task_serializes_per_job_template(template):
    settings = SerializationSettings(
        image_config=ImageConfig(default_image=Image(name="d", fqn="ghcr.io/x/y", tag="1"))
    )
    spec = get_serializable({}, settings, wf.TRAIN_TASKS[f"train_{template.replace('-', '_')}"])
    expected = wf.TEMPLATES[template]
    task_template = spec.template
    task_config = wf.TRAIN_TASKS[f"train_{template.replace('-', '_')}"].task_config
    assert (task_config.nnodes, task_config.nproc_per_node) == (expected.nnodes, expected.nproc_per_node)
    if expected.nnodes == 1:  # a single elastic pod: torch elastic runs inside it, no PyTorchJob
        assert task_template.type == "python-task" and task_template.custom is None
    else:  # a PyTorchJob of nnodes workers with an elastic policy
        assert task_template.type == "pytorch"
        elastic = task_template.custom["elasticConfig"]
        assert elastic["nprocPerNode"] == expected.nproc_per_node and elastic["maxRestarts"] == expected.max_restarts
        assert elastic["minReplicas"] == elastic["maxReplicas"] == expected.nnodes
        assert task_template.custom["workerReplicas"]["replicas"] == expected.nnodes
    container = task_template.k8s_pod.pod_spec["containers"][0]
    assert container["image"] == expected.image
    limits = container["resources"]["limits"]
    assert (limits["cpu"], limits["memory"]) == (expected.cpu, expected.memory)
    assert limits.get("gpu") == (str(expected.gpus_per_node) if expected.gpus_per_node else None)
    assert {e["name"]: e["value"] for e in container.get("env", [])} == expected.env
    pod = task_template.k8s_pod.pod_spec
    assert [t["key"] for t in pod.get("tolerations", [])] == [t.key for t in expected.tolerations]
    assert pod.get("nodeSelector", {}) == expected.node_selector
    shared_memory = task_template.extended_resources.shared_memory  # Flyte mounts it at /dev/shm
    assert shared_memory.size_limit == expected.shared_memory


def test_unknown_job_template_is_rejected_before_running():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flytekit.clis.sdk_in_container.pyflyte",
            "run",
            "workflows/finetune.py",
            "finetune",
            "--job_template",
            "h200x64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "h200x64" in result.stderr + result.stdout and "cpu-small" in result.stderr + result.stdout


def test_config_errors_fail_in_validation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "examples" / "demo.yaml").read_text().replace("learning_rate:", "learnin_rate:"))
    with pytest.raises(Exception, match="did you mean 'learning_rate'"):
        wf.finetune(config=str(bad), steps=2, run_dir=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()
