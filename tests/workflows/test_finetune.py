"""The Flyte workflow, executed for real by flytekit's local engine (2 elastic workers over gloo)."""

import html
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

pytest.importorskip("flytekit")

from flytekit import task  # noqa: E402
from flytekit.core.context_manager import FlyteContextManager  # noqa: E402
from flytekit.core.data_persistence import FileAccessProvider  # noqa: E402
from flytekit.exceptions.user import FlyteRecoverableException  # noqa: E402

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
        raw.setdefault(section, {}).update(values)
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
    # flytekit's local engine writes each task's Deck as deck.html under its file access's sandbox: give it ours
    sandbox = FileAccessProvider(local_sandbox_dir=str(tmp_path / "flyte"), raw_output_prefix=str(tmp_path / "raw"))
    context = FlyteContextManager.current_context().with_file_access(sandbox)
    with FlyteContextManager.with_context(context):
        exported = wf.finetune(config=config, steps=8, run_dir=str(run_dir))
    model = AutoModelForCausalLM.from_pretrained(exported.path)
    assert model.config.num_hidden_layers == 2
    curve = losses(run_dir)
    assert len(curve) >= 8 and curve[-1] < curve[0], curve
    report = (run_dir / "report.html").read_text()
    assert "<h2>Training</h2>" in report and "data:image/png;base64" in report and "learning_rate" in report

    decks = [path.read_text() for path in (tmp_path / "flyte").rglob("deck.html")]
    (deck,) = [page for page in decks if "<h2>Training</h2>" in page]  # the report task's, once
    summary = json.loads((run_dir / "summary.json").read_text())
    training = deck[deck.index("<h2>Training</h2>") : deck.index("<h2>Config</h2>")]
    assert '<img src="data:image/png;base64,' in training  # the loss curve
    first, last = summary["losses"][0], summary["losses"][-1]
    assert f"<tr><th>steps</th><td>{len(summary['losses'])}</td></tr>" in training
    assert f"<tr><th>loss</th><td>{first:.4f} -&gt; {last:.4f}</td></tr>" in training
    assert "<th>tokens/s</th>" in training and "<th>peak memory</th>" in training
    config_section = deck[deck.index("<h2>Config</h2>") :]
    effective = yaml.safe_load(html.unescape(re.search(r"<pre>(.*?)</pre>", config_section, re.S).group(1)))
    assert effective["training"]["max_steps"] == 8 and effective["logging"]["run_dir"] == str(run_dir)
    assert f"Model exported to {summary['export_dir']}" in deck


def test_killed_worker_resumes_from_checkpoint_with_the_same_final_loss(tmp_path):
    """torch elastic restarts the worker group; the runtime resumes from the newest checkpoint."""
    options = dict(checkpoint={"every_steps": 3, "resume": True}, logging={"every_steps": 1})
    uninterrupted, interrupted = tmp_path / "clean", tmp_path / "killed"
    wf.finetune(config=write_config(tmp_path, **options), steps=9, run_dir=str(uninterrupted))
    killed: list[int] = []

    def kill_a_worker_after_first_checkpoint():
        deadline = time.time() + 600
        while time.time() < deadline and not (interrupted / "checkpoints" / "step-3").exists():
            time.sleep(0.05)
        workers = [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        if workers:
            workers[-1].kill()
            killed.append(workers[-1].pid)

    killer = threading.Thread(target=kill_a_worker_after_first_checkpoint)
    killer.start()
    wf.finetune(config=write_config(tmp_path, **options), steps=9, run_dir=str(interrupted))
    killer.join()
    assert killed, "no elastic worker process was found to kill"
    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["resumed_from_step"] in (3, 6), summary["resumed_from_step"]  # restarted, not from step 0
    clean, resumed = losses(uninterrupted), losses(interrupted)
    assert len(resumed) == len(clean) == 9
    assert resumed[-1] == pytest.approx(clean[-1], rel=1e-5), (clean, resumed)


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


def _ended_by_a_signal() -> str:
    """Rank 1 is killed from outside (like an evicted pod); rank 0 waits to be stopped with the group."""
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    return "not reached"


def test_a_worker_lost_after_the_last_restart_makes_flyte_retry():
    lost = task(task_config=wf.TrainElastic(nnodes=1, nproc_per_node=2, max_restarts=0))(_ended_by_a_signal)
    assert isinstance(lost, wf.TrainElasticTask)
    with pytest.raises(FlyteRecoverableException, match="was ended by SIGKILL"):
        lost()


def test_packed_once_cached_and_never_tokenized_in_the_train_task(tmp_path):
    """prepare_data packs the data; the train task loads the packed arrays (its run summary records the manifest's
    fingerprint, which only pre-packed data carries); a second run with the same data hits flytekit's local cache
    (the same packed build, not a new one), even with other steps and another run directory."""
    data = tmp_path / "train.jsonl"
    lines = (ROOT / "examples" / "data" / "arithmetic-train.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["nonce"] = uuid.uuid4().hex  # unique content, so no earlier run's cache entry can answer
    data.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    config = write_config(tmp_path, data={"train": str(data)})
    fingerprint = wf.data_fingerprint(wf.resolve_config(config, 2, ""))

    wf.finetune(config=config, steps=2, run_dir=str(tmp_path / "one"))
    wf.finetune(config=config, steps=3, run_dir=str(tmp_path / "two"))
    one, two = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("one", "two"))
    assert one["data_manifest"]["fingerprint"] == two["data_manifest"]["fingerprint"] == fingerprint
    assert one["data_manifest"]["build_id"] == two["data_manifest"]["build_id"]  # packed once: a cache hit
    assert two["steps"] == 3 and one["data_manifest"]["sequences"]["train"] > 0


def test_data_urls_are_hashed_and_fetched_through_fsspec(tmp_path):
    """Data on an object store (here fsspec's real in-memory filesystem) hashes like the same bytes on disk,
    and prepare_data works on local copies of it."""
    import fsspec

    train_bytes = (ROOT / "examples" / "data" / "arithmetic-train.jsonl").read_bytes()
    url = f"memory://tigon-tests/{uuid.uuid4().hex}/train.jsonl"
    fsspec.filesystem("memory").pipe_file(url, train_bytes)
    (tmp_path / "train.jsonl").write_bytes(train_bytes)
    on_disk = wf.resolve_config(write_config(tmp_path, data={"train": str(tmp_path / "train.jsonl")}), 2, "")
    remote = wf.resolve_config(write_config(tmp_path, data={"train": url}), 2, "")
    assert remote.data.train == url
    assert wf.data_fingerprint(remote) == wf.data_fingerprint(on_disk)
    local = wf._local_data(remote, tmp_path / "cache")
    assert Path(local.data.train).read_bytes() == train_bytes and local.data.eval == remote.data.eval
    fsspec.filesystem("memory").rm(url)


def test_hub_dataset_names_are_kept_and_keyed_by_name_and_revision(tmp_path):
    """A Hub dataset is not read to fingerprint it: its name and data.revision stand for its content."""
    data = {"train": "HuggingFaceTB/smoltalk", "eval": None, "subset": "everyday-conversations"}
    pinned = wf.resolve_config(write_config(tmp_path, data={**data, "revision": "v1"}), 2, "")
    assert pinned.data.train == "HuggingFaceTB/smoltalk" and wf._local_data(pinned, tmp_path) == pinned
    moved = pinned.model_copy(update={"data": pinned.data.model_copy(update={"revision": "v2"})})
    assert wf.data_fingerprint(pinned) != wf.data_fingerprint(moved)


def test_gpu_settings_on_a_cpu_template_and_too_many_nodes_fail_in_validation(tmp_path):
    config = write_config(tmp_path, parallelism={"backend": "nccl"})
    with pytest.raises(Exception, match="has no GPUs"):
        wf.finetune(config=config, steps=2, run_dir=str(tmp_path / "never"))
    with pytest.raises(Exception, match="at most 1 node"):
        wf.finetune(config=write_config(tmp_path), steps=2, run_dir=str(tmp_path / "never"), nodes=2)
    assert not (tmp_path / "never").exists()


def test_config_errors_fail_in_validation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "examples" / "demo.yaml").read_text().replace("learning_rate:", "learnin_rate:"))
    with pytest.raises(Exception, match="did you mean 'learning_rate'"):
        wf.finetune(config=str(bad), steps=2, run_dir=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_a_preference_objective_is_part_of_the_data_cache_key(monkeypatch):
    """Preference records are tokenized per objective (pairs, or KTO's completions), so each gets its own cache
    entry: data prepared for ORPO is never handed to a DPO run."""
    from tigon.runtime.config import load_config

    monkeypatch.chdir(ROOT)
    dpo, orpo = (load_config(ROOT / "examples" / name) for name in ("dpo.yaml", "orpo.yaml"))
    assert dpo.data == orpo.data and wf.data_fingerprint(dpo) != wf.data_fingerprint(orpo)
