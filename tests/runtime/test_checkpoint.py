"""Checkpoints: atomic, pruned to the last K, and a resumed run continues exactly; the export loads."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.configs import TINY_MODEL, tiny_config
from tests.runtime.worker_groups import capture_before_export
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.distributed import DistEnv
from tigon.runtime.trainer import train


def _logging(run_dir: Path) -> dict:
    return {"run_dir": str(run_dir), "tensorboard": False, "progress_bar": False, "every_steps": 1}


def test_resumed_run_repeats_the_uninterrupted_losses_exactly(tmp_path):
    """Stop at step 3 (checkpoint), resume to step 8: bit-identical per-step losses.

    Dropout is on (so the restored RNG states matter) and an epoch is 3 steps long (so the data position
    crosses epoch boundaries). The schedule is constant after warmup so that the shortened first run
    follows the same learning rates as the full one.
    """

    def config(run_dir: Path, max_steps: int):
        return tiny_config(
            tmp_path,
            n_train=60,
            model={"config_overrides": {**TINY_MODEL, "attention_dropout": 0.2}},
            training={"max_steps": max_steps, "warmup_steps": 2, "lr_schedule": "constant", "weight_decay": 0.1},
            checkpoint={"every_steps": 3, "keep_last": 2, "resume": True},
            eval={"metrics": []},
            logging=_logging(run_dir),
        )

    full = train(config(tmp_path / "full", 8))
    assert full.resumed_from_step is None

    first = train(config(tmp_path / "resumed", 3))  # the "killed" run: stops after its checkpoint at step 3
    assert first.losses == full.losses[:3]
    assert ckpt.latest_checkpoint(tmp_path / "resumed").name == "step-3"

    resumed = train(config(tmp_path / "resumed", 8))
    assert resumed.resumed_from_step == 3
    assert resumed.losses == full.losses, (resumed.losses, full.losses)
    assert [name for _, name in _names(tmp_path / "resumed")] == ["step-6", "step-8"]

    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step-8" / "state.json").read_text())
    assert state["step"] == 8 and state["losses"] == full.losses and state["epoch"] >= 2
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), "metrics.jsonl must hold each step once across the two runs"


def _names(run_dir: Path) -> list[tuple[int, str]]:
    return [(step, path.name) for step, path in ckpt.list_checkpoints(run_dir)]


def test_half_written_checkpoint_is_ignored_and_a_finished_run_is_kept_unless_asked(tmp_path, caplog):
    from tigon.runtime.config import ConfigError

    config = tiny_config(
        tmp_path, training={"max_steps": 2}, checkpoint={"every_steps": 1, "keep_last": 1, "resume": True}
    )
    train(config)
    run_dir = Path(config.logging.run_dir)
    assert _names(run_dir) == [(2, "step-2")]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]

    # a run killed while writing step 5 leaves a temporary directory, and one without state.json
    (run_dir / "checkpoints" / ".tmp-step-5").mkdir()
    (run_dir / "checkpoints" / "step-7").mkdir()
    assert ckpt.latest_checkpoint(run_dir).name == "step-2"

    again = train(config)  # resume is the default: the finished run is continued (nothing left), not deleted
    assert again.resumed_from_step == 2 and again.steps == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-7"]
    shorter = config.model_copy(deep=True)
    shorter.training.max_steps = 1
    with caplog.at_level("WARNING", logger="tigon.runtime"):
        assert train(shorter).steps == 2
    assert "is at step 2, past this run's 1 steps: nothing is trained" in caplog.text

    fresh = config.model_copy(deep=True)
    fresh.checkpoint.resume = False
    with pytest.raises(ConfigError, match="holds a finished run's checkpoints, which starting over would delete"):
        train(fresh)
    assert _names(run_dir) == [(2, "step-2")]
    fresh.checkpoint.overwrite = True
    over = train(fresh)
    assert over.resumed_from_step is None and over.steps == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_run_resumed_with_more_steps_follows_its_own_schedule(tmp_path, schedule):
    """A run of 3 steps (warm-up 2, so its steps equal the longer run's) continued to 6 decays as a 6-step run
    from its first resumed step: the checkpoint's optimizer holds the 3-step schedule's last rate (zero), which
    the resumed run replaces by its own schedule's."""

    def config(run_dir: Path, max_steps: int):
        return tiny_config(
            tmp_path,
            training={"max_steps": max_steps, "warmup_steps": 2, "lr_schedule": schedule},
            checkpoint={"every_steps": 3, "resume": True},
            eval={"metrics": []},
            logging=_logging(run_dir),
        )

    full = train(config(tmp_path / "full", 6))
    assert train(config(tmp_path / "extended", 3)).losses == full.losses[:3]
    extended = train(config(tmp_path / "extended", 6))
    assert extended.resumed_from_step == 3 and extended.losses == full.losses, (extended.losses, full.losses)


def test_resume_is_the_default_everywhere():
    from tigon.runtime.config import CheckpointConfig, load_config

    assert CheckpointConfig().resume is True
    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "examples").glob("*.yaml")):
        assert load_config(path).checkpoint.resume is True, path


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    from tigon.runtime.config import ConfigError

    first = tiny_config(tmp_path, training={"max_steps": 1}, checkpoint={"every_steps": 1, "resume": True})
    train(first)
    wider = {**TINY_MODEL, "hidden_size": 64}
    second = tiny_config(tmp_path, model={"config_overrides": wider}, checkpoint={"every_steps": 1, "resume": True})
    with pytest.raises(ConfigError, match="different model settings; use another logging.run_dir"):
        train(second)


def test_resume_accepts_a_checkpoint_from_before_new_settings_and_another_cache(tmp_path):
    """A checkpoint's config.json without later fields (they take their defaults) or with another download cache."""
    import json

    from tigon.runtime.run import check_resumable

    config = tiny_config(tmp_path)
    saved = json.loads(config.model_dump_json())
    for key in ("revision", "trust_remote_code"):
        del saved["model"][key]
    del saved["data"]["subset"]
    saved["model"]["cache_dir"] = "/another/cache"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    check_resumable(tmp_path, config)


def test_checkpoint_round_trip_restores_everything(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = ckpt.TrainState(step=1, epoch=0, batches_in_epoch=1, losses=[1.5])
    env = DistEnv()
    random.seed(7)
    torch.manual_seed(7)
    ckpt.save_checkpoint(tmp_path, state, model, optimizer, scheduler, env, keep_last=2)
    expected = (random.random(), torch.rand(3))

    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    other_scheduler = torch.optim.lr_scheduler.LambdaLR(other_optimizer, lambda step: 1 / (step + 1))
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), other, other_optimizer, other_scheduler, env)
    assert loaded == state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
    assert other_scheduler.last_epoch == 1 and other_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.equal(
        other_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert (random.random(), torch.rand(3)) == (expected[0], pytest.approx(expected[1]))


def test_export_loads_with_from_pretrained(tmp_path, restore_rope, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([[1, 20, 21, 14, 22, 30]])
    captured = capture_before_export(monkeypatch, ids)
    config = tiny_config(
        tmp_path,
        training={"max_steps": 2},
        kernels={"enabled": True, "rope": False},  # patched norms and MLPs must save under Hugging Face's names
        checkpoint={"export": True},
        eval={"metrics": []},
    )
    result = train(config)
    export = Path(result.export_dir)
    assert export == Path(config.logging.run_dir) / "export"
    loaded = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert loaded.config.hidden_size == 32 and loaded.config.vocab_size == len(tokenizer)
    assert tokenizer.decode(tokenizer("12+3=", add_special_tokens=False)["input_ids"]) == "12+3="
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, captured["logits"], atol=1e-5), "the export holds the trained weights"
    assert not [p for p in export.parent.iterdir() if p.name.startswith(".")]


def test_lora_export_is_merged_into_plain_weights(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 20, 21, 14, 22, 30]])
    captured = capture_before_export(monkeypatch, ids)
    config = tiny_config(
        tmp_path, training={"max_steps": 3}, lora={"enabled": True, "r": 4}, checkpoint={"export": True}
    )
    result = train(config)
    loaded = AutoModelForCausalLM.from_pretrained(result.export_dir)
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, captured["logits"], atol=1e-5)


# ---------------------------------------------------------------- damaged checkpoints


def _small_checkpoint(root: Path, step: int, keep_last: int = 5) -> Path:
    """A real checkpoint of a small model, with a nested file as the sharded layouts (dcp/, deepspeed/) have."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()

    def write_state(directory: Path) -> None:
        ckpt.write_torch_state(directory, model, optimizer, scheduler, DistEnv())
        (directory / "shards").mkdir()
        (directory / "shards" / "rank0.bin").write_bytes(bytes(range(256)) * 16)

    state = ckpt.TrainState(step=step, losses=[1.0] * step)
    return ckpt.save_checkpoint(root, state, None, None, None, DistEnv(), keep_last, write_state=write_state)


def _flip_bytes(path: Path, offset: int, count: int = 4) -> None:
    data = bytearray(path.read_bytes())
    for index in range(offset, offset + count):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda d: (d / "model.pt").write_bytes((d / "model.pt").read_bytes()[:100]),
            r"model.pt is truncated \(100 of",
        ),
        (lambda d: (d / "model.pt").unlink(), "model.pt is missing"),
        (lambda d: _flip_bytes(d / "model.pt", 2000), "model.pt is corrupted"),
        (lambda d: _flip_bytes(d / "optimizer.pt", 1500), "optimizer.pt is corrupted"),
        (lambda d: (d / "state.json").write_text("{"), "state.json is truncated"),
        (lambda d: _flip_bytes(d / "shards" / "rank0.bin", 7, 1), "shards/rank0.bin is corrupted"),
        (lambda d: (d / "rng-rank0.pt").write_bytes(b"x" * 10**5), "rng-rank0.pt has 100000 bytes"),
        (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda d: (d / "manifest.json").write_text("[1"), "manifest.json is damaged"),
    ],
    ids=["truncated", "deleted", "bytes-flipped", "optimizer-flipped", "state", "shard", "grown", "no-manifest", "bad"],
)
def test_verify_names_what_is_wrong_with_each_file(tmp_path, damage, expected):
    directory = _small_checkpoint(tmp_path, 1)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "model.pt",
        "optimizer.pt",
        "scheduler.pt",
        "rng-rank0.pt",
        "state.json",
        "shards/rank0.bin",
    }
    assert ckpt.verify_checkpoint(directory) == []
    damage(directory)
    problems = ckpt.verify_checkpoint(directory)
    assert len(problems) == 1 and re.search(expected, problems[0]), problems


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    for step in (2, 4, 6):
        _small_checkpoint(tmp_path, step)
    root = tmp_path / "checkpoints"
    _flip_bytes(root / "step-6" / "model.pt", 1000)
    (root / "step-4" / "optimizer.pt").write_bytes((root / "step-4" / "optimizer.pt").read_bytes()[:-10])
    with caplog.at_level("WARNING", logger="tigon.runtime"):
        assert ckpt.resume_checkpoint(tmp_path, DistEnv()) == root / "step-2"
    assert "step-6 is damaged (model.pt is corrupted" in caplog.text
    assert "step-4 is damaged (optimizer.pt is truncated" in caplog.text
    assert "resuming from" in caplog.text and "step-2, the newest checkpoint that verifies" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["damaged-step-4", "damaged-step-6", "step-2"]

    (root / "step-2" / "model.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint in .* verifies .*step 2: model.pt is missing"):
        ckpt.resume_checkpoint(tmp_path, DistEnv())


def test_a_checkpoint_from_before_manifests_is_resumed_unverified(tmp_path, caplog):
    directory = _small_checkpoint(tmp_path, 4)
    (directory / "manifest.json").unlink()
    with caplog.at_level("WARNING", logger="tigon.runtime"):
        assert ckpt.resume_checkpoint(tmp_path, DistEnv()) == directory
    assert "has no manifest.json (written before checkpoints had one); resuming from it unverified" in caplog.text


def test_a_missing_model_file_is_called_damage_not_another_strategy(tmp_path):
    directory = _small_checkpoint(tmp_path, 1)
    (directory / "model.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="no model.pt .* and no other strategy's: the checkpoint is damaged"):
        ckpt.require_layout(directory, "model.pt", "ddp")
    (directory / "dcp").mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"it holds dcp \(fsdp\), written by another parallelism.strategy"):
        ckpt.require_layout(directory, "model.pt", "ddp")


def test_training_resumes_from_the_newest_whole_checkpoint(tmp_path, caplog):
    """A run whose newest checkpoint has random bytes in model.pt resumes from the one before, exactly."""

    def config(run_dir: Path, max_steps: int):
        return tiny_config(
            tmp_path,
            training={"max_steps": max_steps},
            checkpoint={"every_steps": 2, "keep_last": 3, "resume": True},
            eval={"metrics": []},
            logging=_logging(run_dir),
        )

    full = train(config(tmp_path / "full", 6))
    train(config(tmp_path / "run", 4))
    model_file = tmp_path / "run" / "checkpoints" / "step-4" / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[3000:7000] = random.Random(0).randbytes(4000)
    model_file.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="tigon.runtime"):
        resumed = train(config(tmp_path / "run", 6))
    assert "step-4 is damaged (model.pt is corrupted" in caplog.text
    assert resumed.resumed_from_step == 2 and resumed.losses == full.losses
    assert [name for _, name in _names(tmp_path / "run")] == ["step-2", "step-4", "step-6"]


# ---------------------------------------------------------------- interrupted writes and full disks


KILLED_MID_WRITE = """
import os, sys, time
from pathlib import Path
import torch
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.distributed import DistEnv
from tigon.runtime.distributed import DistEnv

def write_state(directory: Path) -> None:
    torch.save(torch.zeros(1000), directory / "model.pt")
    (directory / "optimizer.pt").write_bytes(b"half")
    print("writing", flush=True)
    time.sleep(60)

ckpt.save_checkpoint(sys.argv[1], ckpt.TrainState(step=9), None, None, None, DistEnv(), 2, write_state=write_state)
"""


def test_a_run_killed_mid_write_leaves_its_previous_checkpoint_and_no_temporary(tmp_path):
    """kill -9 while the model state is being written: the next start removes the temporary and resumes."""
    _small_checkpoint(tmp_path, 3)
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-9", "step-3"]
    removed = ckpt.clean_temporaries(tmp_path)
    assert [p.name for p in removed] == [".tmp-step-9"]
    assert ckpt.resume_checkpoint(tmp_path, DistEnv()) == root / "step-3"


def test_free_space_is_checked_before_writing(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert ckpt.free_space_problem(tmp_path, free // 2) is None
    problem = ckpt.free_space_problem(tmp_path, free + 2 * ckpt.GIB)
    assert f"not enough disk space for a checkpoint in {tmp_path}" in problem
    assert f"({free + 2 * ckpt.GIB} bytes)" in problem and "lower checkpoint.keep_last" in problem

    state = ckpt.TrainState(step=1)
    with pytest.raises(ckpt.CheckpointError, match="not enough disk space"):
        ckpt.save_checkpoint(tmp_path, state, None, None, None, DistEnv(), 2, estimated_bytes=free + 2 * ckpt.GIB)
    assert list((tmp_path / "checkpoints").iterdir()) == [], "nothing half-written is left"


def test_old_checkpoints_are_pruned_before_the_new_one_is_written(tmp_path):
    """keep_last 2: while step 3 is written only step 2 is on disk, so the run never needs room for 3."""
    for step in (1, 2):
        _small_checkpoint(tmp_path, step, keep_last=2)
    seen = []

    def write_state(directory: Path) -> None:
        seen.extend(sorted(p.name for p in (tmp_path / "checkpoints").iterdir()))
        torch.save({}, directory / "model.pt")

    ckpt.save_checkpoint(tmp_path, ckpt.TrainState(step=3), None, None, None, DistEnv(), 2, write_state=write_state)
    assert seen == [".tmp-step-3", "step-2"]
    assert [name for _, name in _names(tmp_path)] == ["step-2", "step-3"]


FULL_DISK = """
import json, sys
from pathlib import Path
import torch
from tigon.runtime import checkpoint as ckpt, cli
from tigon.runtime.distributed import DistEnv

small, roomy, spill = (Path(arg) for arg in sys.argv[1:4])
report = {"small": cli.main(["train", str(small.parent / "small.yaml"), "--quiet"])}
report["small_left"] = sorted(p.name for p in (small / "run" / "checkpoints").iterdir())
report["roomy"] = cli.main(["train", str(roomy.parent / "roomy.yaml"), "--quiet"])
report["roomy_left"] = sorted(p.name for p in (roomy / "run" / "checkpoints").iterdir())
model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights into a 1 MiB filesystem, with no estimate to stop it
try:
    ckpt.save_checkpoint(spill, ckpt.TrainState(step=1), model, torch.optim.SGD(model.parameters()), None, DistEnv(), 1)
except ckpt.CheckpointError as error:
    report["spill"] = str(error)
report["spill_left"] = sorted(p.name for p in (spill / "checkpoints").iterdir())
print(json.dumps(report))
"""


def _tmpfs_in_a_namespace(tmp_path: Path) -> bool:
    """True when this machine lets an unprivileged user mount a tmpfs in its own user and mount namespace."""
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    command = ["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "tmpfs", str(probe)]
    return subprocess.run(command, capture_output=True).returncode == 0


def test_full_disk_fails_with_the_space_and_pruning_first_needs_room_for_keep_last_only(tmp_path):
    """Real small filesystems (tmpfs): a checkpoint is ~0.35 MB.

    - 600 KB, keep_last 1: step 1 fits; step 2 would need room for two, so the run stops with the directory and
      the space named, exit status 2, step 1 intact and nothing half-written.
    - 900 KB, keep_last 2, 3 steps: the oldest checkpoint goes before the third is written, so two fit.
    - 1 MB and a 4 MiB model with no estimate: the disk fills mid-write; the error says so, the partial checkpoint
      is removed.
    """
    if not _tmpfs_in_a_namespace(tmp_path):
        pytest.skip("no unprivileged tmpfs mounts (unshare --user --mount) on this machine")
    dirs = {name: tmp_path / name / "disk" for name in ("small", "roomy", "spill")}
    for name, keep, steps in (("small", 1, 2), ("roomy", 2, 3)):
        dirs[name].mkdir(parents=True)
        config = tiny_config(
            tmp_path,
            training={"max_steps": steps},
            checkpoint={"every_steps": 1, "keep_last": keep, "resume": True},
            eval={"metrics": []},
            logging={**_logging(dirs[name] / "run"), "every_steps": 10},
        )
        (tmp_path / name / f"{name}.yaml").write_text(json.dumps(config.model_dump(mode="json")))
    dirs["spill"].mkdir(parents=True)
    mounts = " && ".join(
        f"mount -t tmpfs -o size={size} tmpfs {dirs[name]}"
        for name, size in (("small", "600k"), ("roomy", "900k"), ("spill", "1m"))
    )
    script = f'{mounts} && exec "$0" -c "$1" {" ".join(map(str, dirs.values()))}'
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, sys.executable, FULL_DISK],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["small"] == 2 and report["small_left"] == ["step-1"], report
    assert f"error: not enough disk space for a checkpoint in {dirs['small'] / 'run' / 'checkpoints'}" in done.stderr
    assert "lower checkpoint.keep_last" in done.stderr and "Traceback" not in done.stderr
    assert report["roomy"] == 0 and report["roomy_left"] == ["step-2", "step-3"], report
    assert "filled up while writing checkpoint step-1" in report["spill"] and report["spill_left"] == [], report


KILLED_AT_STAGE = """
import os, signal, sys
from pathlib import Path
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import load_config
from tigon.runtime.trainer import train

function, config = sys.argv[1], load_config(sys.argv[2])
root = Path(config.logging.run_dir) / "checkpoints"
original = getattr(ckpt, function)


def killed_while_writing_step_6(*args, **kwargs):
    if any((root / name).exists() for name in (".tmp-step-6", "step-6")) or function == "remove_checkpoint":
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)


setattr(ckpt, function, killed_while_writing_step_6)
train(config)
"""
KILL_STAGES = {  # stage of writing step-6 (checkpoints every 2 steps): (function killed in, keep_last, resumed from)
    "pruning-before": ("remove_checkpoint", 2, 4),  # step-2 goes before step-6 is written
    "model-state": ("write_torch_state", 2, 4),
    "manifest": ("write_manifest", 2, 4),
    "rename": ("replace_dir", 2, 4),
    "pruning-after": ("remove_checkpoint", 1, 4),  # keep_last 1: step-2 goes once step-4 is in place
}


def stage_config(directory: Path, name: str, keep_last: int):
    return tiny_config(
        directory,
        training={"max_steps": 8},
        checkpoint={"every_steps": 2, "keep_last": keep_last, "resume": True},
        logging={"run_dir": str(directory / name)},
    )


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory) -> list[float]:
    return train(stage_config(tmp_path_factory.mktemp("uninterrupted"), "run", 2)).losses


@pytest.mark.parametrize("stage", list(KILL_STAGES))
def test_a_run_killed_at_each_stage_of_a_checkpoint_write_resumes_exactly(tmp_path, stage, uninterrupted_losses):
    """kill -9 inside each step of writing a checkpoint; started again, the run resumes from the newest whole
    checkpoint, leaves no temporary, and ends with the uninterrupted run's losses bit for bit."""
    function, keep_last, resumed_from = KILL_STAGES[stage]
    killed = stage_config(tmp_path, "killed", keep_last)
    path = tmp_path / "killed.yaml"
    path.write_text(json.dumps(killed.model_dump(mode="json")))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", KILLED_AT_STAGE, function, str(path)], env=env, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]

    resumed = train(killed)
    assert resumed.resumed_from_step == resumed_from
    assert resumed.losses == uninterrupted_losses
    root = tmp_path / "killed" / "checkpoints"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert [p.name for p in sorted(root.iterdir())][-1] == "step-8"


def test_a_checkpoint_written_in_the_background_appears_only_once_finished(tmp_path):
    """`begin_checkpoint` with a state writer that returns a Future: until `finish` the previous checkpoint is the
    newest and the new one is only a temporary directory; then it is whole and verifies."""
    from concurrent.futures import Future

    ckpt.save_checkpoint(tmp_path, ckpt.TrainState(step=1), None, None, None, DistEnv(), 2, write_state=lambda d: None)
    writing = Future()

    def write_state(directory):
        (directory / "weights.bin").write_bytes(b"w" * 100)
        return writing

    pending = ckpt.begin_checkpoint(tmp_path, ckpt.TrainState(step=2, losses=[1.0, 0.5]), DistEnv(), 2, write_state)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert (tmp_path / "checkpoints" / ".tmp-step-2" / "weights.bin").is_file()
    writing.set_result(None)
    final = pending.finish()
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2]
    assert ckpt.verify_checkpoint(final) == []
    assert json.loads((final / "state.json").read_text())["losses"] == [1.0, 0.5]


def test_a_background_write_that_fails_leaves_the_previous_checkpoint_newest(tmp_path):
    from concurrent.futures import Future

    ckpt.save_checkpoint(tmp_path, ckpt.TrainState(step=1), None, None, None, DistEnv(), 2, write_state=lambda d: None)
    writing = Future()
    pending = ckpt.begin_checkpoint(tmp_path, ckpt.TrainState(step=2), DistEnv(), 2, lambda directory: writing)
    writing.set_exception(OSError("the store went away"))
    with pytest.raises(OSError, match="the store went away"):
        pending.finish()
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert not (tmp_path / "checkpoints" / ".tmp-step-2").exists()


def test_a_checkpoint_from_before_best_fit_packing_resumes_only_in_order(tmp_path):
    """Rows were packed in order before data.packing_strategy existed: resuming such a checkpoint with best-fit rows
    would train other rows, so it is refused, naming the field and the value that resumes it."""
    from tigon.runtime.config import ConfigError
    from tigon.runtime.run import check_resumable

    saved = json.loads(tiny_config(tmp_path).model_dump_json())
    del saved["data"]["packing_strategy"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match="data.packing_strategy: 'in_order' there, 'best_fit' here"):
        check_resumable(tmp_path, tiny_config(tmp_path))
    check_resumable(tmp_path, tiny_config(tmp_path, data={"packing_strategy": "in_order"}))
