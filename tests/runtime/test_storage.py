"""Checkpoints and exports in object storage, on fsspec's real in-memory and local filesystems."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest

from tests.runtime.configs import tiny_config
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.distributed import DistEnv
from tigon.runtime.storage import MARKER, RunStorage, StorageError, default_remote_dir, resume_point
from tigon.runtime.trainer import train


@pytest.fixture(params=["memory", "file"])
def remote_url(request, tmp_path) -> str:
    """A fresh prefix on fsspec's in-memory filesystem (process-wide, so uniquely named) or under tmp_path."""
    if request.param == "memory":
        url = f"memory://tigon-tests/{uuid.uuid4().hex}/run"
        yield url
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
    else:
        yield f"file://{tmp_path / 'bucket' / 'run'}"


def fake_checkpoint(root: Path, step: int, payload: bytes = b"weights") -> Path:
    directory = root / "checkpoints" / f"step-{step}"
    (directory / "nested").mkdir(parents=True)
    (directory / "model.pt").write_bytes(payload * step)
    (directory / "nested" / "rng-rank0.pt").write_bytes(b"rng")
    (directory / ckpt.STATE_FILE).write_text(f'{{"step": {step}}}')
    return directory


def test_upload_commits_last_and_download_round_trips(remote_url, tmp_path):
    storage = RunStorage(remote_url)
    source = fake_checkpoint(tmp_path / "pod-a", 3)
    url = storage.upload_checkpoint(source, keep_last=2)
    assert url.endswith("/checkpoints/step-3")
    assert storage.committed("checkpoints", "step-3") == {"model.pt": 21, "nested/rng-rank0.pt": 3, "state.json": 11}

    fetched = resume_point(remote_url, tmp_path / "pod-b", DistEnv())  # a new pod with an empty run directory
    assert fetched == tmp_path / "pod-b" / "checkpoints" / "step-3"
    for relative in ("model.pt", "nested/rng-rank0.pt", "state.json"):
        assert (fetched / relative).read_bytes() == (source / relative).read_bytes()
    assert ckpt.latest_checkpoint(tmp_path / "pod-b") == fetched
    (fetched / "model.pt").write_bytes(b"kept locally")  # the run directory has it: nothing is downloaded again
    assert resume_point(remote_url, tmp_path / "pod-b", DistEnv()) == fetched
    assert (fetched / "model.pt").read_bytes() == b"kept locally"
    assert not [p for p in fetched.parent.iterdir() if p.name.startswith(".")]  # no download leftovers


def test_uncommitted_upload_is_ignored_and_replaced(remote_url, tmp_path):
    storage = RunStorage(remote_url)
    storage.upload_checkpoint(fake_checkpoint(tmp_path, 3), keep_last=5)
    # An upload cut short: files of step 6 arrived, its marker never did.
    storage.fs.makedirs(f"{storage.root}/checkpoints/step-6", exist_ok=True)
    storage.fs.pipe_file(f"{storage.root}/checkpoints/step-6/model.pt", b"partial")
    assert storage.checkpoint_steps() == [3]
    assert resume_point(remote_url, tmp_path / "new-pod", DistEnv()).name == "step-3"

    storage.upload_checkpoint(fake_checkpoint(tmp_path / "again", 6), keep_last=5)
    assert storage.checkpoint_steps() == [3, 6]
    assert storage.fs.cat_file(f"{storage.root}/checkpoints/step-6/model.pt") == b"weights" * 6


def test_prune_keeps_the_newest_uploads(remote_url, tmp_path):
    storage = RunStorage(remote_url)
    for step in (2, 4, 6):
        storage.upload_checkpoint(fake_checkpoint(tmp_path, step), keep_last=2)
    assert storage.checkpoint_steps() == [4, 6]
    assert not storage.fs.exists(f"{storage.root}/checkpoints/step-2")
    storage.clear_checkpoints()
    assert storage.checkpoint_steps() == []


def test_a_download_that_does_not_match_its_marker_fails_and_leaves_nothing(remote_url, tmp_path):
    storage = RunStorage(remote_url)
    storage.upload_checkpoint(fake_checkpoint(tmp_path, 3), keep_last=2)
    storage.fs.pipe_file(f"{storage.root}/checkpoints/step-3/model.pt", b"truncated")
    with pytest.raises(StorageError, match="marker says 21"):
        resume_point(remote_url, tmp_path / "pod", DistEnv())
    assert ckpt.list_checkpoints(tmp_path / "pod") == []
    assert list((tmp_path / "pod" / "checkpoints").iterdir()) == []


def test_a_damaged_upload_is_set_aside_and_resume_takes_the_one_before(remote_url, tmp_path, caplog):
    """A committed checkpoint whose bytes changed in the store (same size, so the download passes): rank 0's
    manifest check finds it, sets it aside as damaged-step-4, and the older committed step-2 is fetched."""
    storage = RunStorage(remote_url)
    for step in (2, 4):
        ckpt.write_manifest(fake_checkpoint(tmp_path, step))
        storage.upload_checkpoint(tmp_path / "checkpoints" / f"step-{step}", keep_last=2)
    storage.fs.pipe_file(f"{storage.root}/checkpoints/step-4/model.pt", b"W" * len(b"weights" * 4))
    picked = resume_point(remote_url, tmp_path / "pod", DistEnv())
    assert picked == tmp_path / "pod" / "checkpoints" / "step-2"
    assert ckpt.verify_checkpoint(picked) == []
    assert sorted(p.name for p in picked.parent.iterdir()) == ["damaged-step-4", "step-2"]
    assert "model.pt is corrupted" in caplog.text


def test_unfinished_checkpoint_and_uncommitted_directory_are_refused(remote_url, tmp_path):
    storage = RunStorage(remote_url)
    unfinished = tmp_path / "checkpoints" / ".tmp-step-3"
    unfinished.mkdir(parents=True)
    with pytest.raises(StorageError, match="not a finished checkpoint"):
        storage.upload_checkpoint(unfinished, keep_last=1)
    with pytest.raises(StorageError, match=f"no {MARKER}"):
        storage.download_dir(tmp_path / "x", "export")


def test_default_remote_dir_is_the_object_store_on_a_cluster_and_none_locally():
    assert default_remote_dir("s3://bucket/raw/ab/f1-n0-0", "demo") == "s3://bucket/raw/ab/f1-n0-0/tigon/demo"
    assert default_remote_dir("gs://bucket/raw/", "demo") == "gs://bucket/raw/tigon/demo"
    assert default_remote_dir("/tmp/flyte/raw", "demo") is None
    assert default_remote_dir("file:///tmp/flyte/raw", "demo") is None


def test_resume_from_the_object_store_on_a_new_pod(tmp_path):
    """A run stops after its step-3 checkpoint; its pod (and run directory) is gone; a new pod resumes from the
    object store and repeats the uninterrupted run's losses exactly. The export lands in the object store too."""
    remote = f"memory://tigon-tests/{uuid.uuid4().hex}/run"

    def config(run_dir: Path, max_steps: int, remote_dir: str | None):
        return tiny_config(
            tmp_path,
            n_train=60,
            training={"max_steps": max_steps, "warmup_steps": 2, "lr_schedule": "constant"},
            checkpoint={"every_steps": 3, "keep_last": 2, "resume": True, "export": True, "remote_dir": remote_dir},
            eval={"metrics": []},
            logging={"run_dir": str(run_dir), "tensorboard": False, "progress_bar": False, "every_steps": 1},
        )

    full = train(config(tmp_path / "full", 8, None))
    first = train(config(tmp_path / "pod-1", 3, remote))
    assert first.losses == full.losses[:3]
    shutil.rmtree(tmp_path / "pod-1")  # the pod is gone, its disk with it

    resumed = train(config(tmp_path / "pod-2", 8, remote))
    assert resumed.resumed_from_step == 3
    assert resumed.losses == full.losses, (resumed.losses, full.losses)
    storage = RunStorage(remote)
    assert storage.checkpoint_steps() == [6, 8]
    assert resumed.export_url == storage.export_url
    assert set(storage.committed("export")) >= {"config.json", "model.safetensors", "tokenizer.json"}
    fsspec.filesystem("memory").rm(remote, recursive=True)


LEASE_HOLDER = """
import sys, time
from tigon.runtime.storage import RunLease, RunStorage
RunLease(RunStorage(sys.argv[1]), ttl=float(sys.argv[2])).acquire()
print("holding", flush=True)
time.sleep(120)
"""


def test_lease_refuses_a_second_run_and_lapses_when_its_holder_is_killed(tmp_path, caplog):
    import json
    import subprocess
    import sys

    from tigon.runtime.lock import RunDirInUse
    from tigon.runtime.storage import LEASE, RunLease

    url, ttl = f"file://{tmp_path / 'bucket' / 'run'}", 1.5
    storage = RunStorage(url)
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, url, str(ttl)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(RunDirInUse, match=rf"remote_dir {url} is in use by another run: pid {holder.pid} on host"):
            RunLease(storage, ttl=ttl).acquire()
    finally:
        holder.kill()  # -9: the lease stays behind, no longer renewed
        holder.wait()
    assert json.loads(storage.fs.cat_file(storage._path(LEASE)))["pid"] == holder.pid
    with caplog.at_level("WARNING", logger="tigon.runtime"):
        lease = RunLease(storage, ttl=ttl).acquire()
    assert f"took over the lease on {url} from pid {holder.pid}" in caplog.text
    lease.release()
    assert not storage.fs.exists(storage._path(LEASE))


def test_a_restart_of_the_same_torchrun_job_takes_its_lease_at_once(tmp_path, monkeypatch):
    import subprocess
    import sys
    import time

    from tigon.runtime.storage import RunLease

    url = f"file://{tmp_path / 'bucket' / 'run'}"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job-7"}
    holder = subprocess.Popen(
        [sys.executable, "-c", LEASE_HOLDER, url, "60"], stdout=subprocess.PIPE, text=True, env=env
    )
    assert holder.stdout.readline().strip() == "holding"
    holder.kill()
    holder.wait()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    started = time.monotonic()
    RunLease(RunStorage(url), ttl=60).acquire().release()
    assert time.monotonic() - started < 10, "no 60 s wait for its own earlier attempt"


def test_missing_object_store_credentials_name_the_setting_and_the_fix(tmp_path, monkeypatch):
    """s3fs's real client with no credentials anywhere (no variables, files or instance metadata)."""
    pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    url = f"s3://tigon-no-such-bucket/{uuid.uuid4().hex}"
    config = tiny_config(tmp_path, checkpoint={"remote_dir": url})
    with pytest.raises(
        StorageError, match=rf"checkpoint.remote_dir {url}: no credentials for s3:// .*AWS_ACCESS_KEY_ID"
    ):
        train(config)


READ_ONLY_REMOTE = """
import sys
from tigon.runtime.storage import RunLease, RunStorage, StorageError
try:
    RunLease(RunStorage(sys.argv[1])).acquire()
except StorageError as error:
    print(error)
"""


def test_unwritable_remote_dir_names_the_setting(tmp_path):
    """A real read-only filesystem (a tmpfs mounted read-only in a user and mount namespace) as the remote."""
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    mount = tmp_path / "store"
    mount.mkdir()
    url = f"file://{mount}/run"
    done = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            f'mount -t tmpfs -o ro tmpfs {mount} && exec "$0" -c "$1" {url}',
            sys.executable,
            READ_ONLY_REMOTE,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"no unprivileged tmpfs mounts here: {done.stderr.strip()}")
    assert f"checkpoint.remote_dir {url} is not writable" in done.stdout, (done.stdout, done.stderr)
