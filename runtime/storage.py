"""Checkpoints and the exported model in object storage (s3://, gs://, any fsspec URL).

Training writes checkpoints to the local run directory as always (`tigon.runtime.checkpoint`); with
`checkpoint.remote_dir` set, each finished checkpoint is then copied to the object store, and a run
that resumes first fetches the newest one from there. So a restarted pod (or a Flyte retry on
another node) resumes from the object store, not from step 0.

    <remote_dir>/checkpoints/step-N/...   one uploaded checkpoint
    <remote_dir>/export/...               the save_pretrained directory

Object stores cannot rename a directory atomically, so an upload is committed by a marker written
last: `COMMITTED.json`, listing every file and its size. Readers only take committed directories
and check the sizes of what they download; an upload cut short is never resumed from, and is
replaced by the next upload of the same step.

A run holds its prefix with a lease, `<remote_dir>/LEASE.json` (`RunLease`): the holder's host, pid,
torchrun job id and a counter it bumps every `ttl / 3` seconds. A run that finds another holder's
lease watches it for `ttl` seconds: if the counter moves, the holder is alive and the run fails
naming it; if not, the holder died (kill -9, a lost node) and the lease is taken over. No clocks are
compared. A restart of the same torchrun job (same `TORCHELASTIC_RUN_ID`, other than the default
`none`) takes its earlier attempt's lease at once: torchrun stops a job's workers before restarting it. Object
stores offer no compare-and-swap through fsspec, so two runs starting within the same moment can
both take it; the lease is read back after writing, which catches most such races.

Store errors at start (the lease is the first write) name `checkpoint.remote_dir` and the fix:
missing credentials, no write permission, or no fsspec filesystem installed for the URL's scheme.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import shutil
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from tigon.runtime.checkpoint import (
    CHECKPOINTS,
    MANIFEST,
    STATE_FILE,
    CheckpointError,
    checkpoint_root,
    list_checkpoints,
    ranks_not_seeing,
    replace_dir,
)
from tigon.runtime.checkpoint import resume_checkpoint as checkpoint_resume
from tigon.runtime.distributed import DistEnv, all_gather_object, barrier, broadcast_object
from tigon.runtime.lock import RunDirInUse

logger = logging.getLogger("tigon.runtime")

MARKER = "COMMITTED.json"
LEASE = "LEASE.json"
LEASE_TTL = 30.0  # seconds a lease that stops being renewed takes to lapse
EXPORT = "export"
LOCAL_PROTOCOLS = ("file", "local")


class StorageError(RuntimeError):
    """An object-store directory that is missing, uncommitted or does not match its marker."""


def is_local_url(url: str) -> bool:
    """True for plain paths and file:// URLs (the pod's or laptop's own disk)."""
    return fsspec.utils.get_protocol(url) in LOCAL_PROTOCOLS


def remote_problem(url: str, error: BaseException) -> str:
    """What went wrong talking to `checkpoint.remote_dir`, with the fix."""
    scheme = fsspec.utils.get_protocol(url)
    names = " ".join(type(cause).__name__ for cause in (error, error.__cause__, error.__context__) if cause)
    if "Credential" in names or "credentials" in str(error).lower():
        return (
            f"checkpoint.remote_dir {url}: no credentials for {scheme}:// ({error}); provide them the way the "
            "provider's SDK reads them (for s3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; for gs: "
            "GOOGLE_APPLICATION_CREDENTIALS), or the pod's service account, or unset checkpoint.remote_dir"
        )
    read_only = isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    if read_only or "AccessDenied" in names or "Forbidden" in str(error):
        return (
            f"checkpoint.remote_dir {url} is not writable ({error}); grant this run write access there, or set "
            "checkpoint.remote_dir to a prefix it may write"
        )
    if isinstance(error, ImportError | ValueError) and ("protocol" in str(error).lower() or "install" in str(error)):
        return f"checkpoint.remote_dir {url}: no filesystem for {scheme}:// is installed ({error}); install it"
    return f"checkpoint.remote_dir {url} cannot be written ({type(error).__name__}: {error}); check the URL and access"


class RunStorage:
    """One run's prefix in an object store: committed checkpoints and the exported model."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = url_to_fs(self.url)
        except (ImportError, ValueError) as error:
            raise StorageError(remote_problem(self.url, error)) from None
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    # ------------------------------------------------------------ directories committed by a marker

    def upload_dir(self, local_dir: str | Path, *parts: str) -> str:
        """Copy a finished local directory to `<url>/<parts>`, committing it with the marker last; returns its URL."""
        local_dir = Path(local_dir)
        target = self._path(*parts)
        self._uncommit(target)
        names = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
        if not names:
            raise StorageError(f"{local_dir} holds no files to upload")
        self.commit(self.upload_files(local_dir, names, *parts), *parts)
        return self._url(target)

    def upload_files(self, local_dir: str | Path, names: list[str], *parts: str) -> dict[str, int]:
        """Copy the files `names` (relative to `local_dir`) under `<url>/<parts>` without committing; their sizes."""
        target = self._path(*parts)
        listing: dict[str, int] = {}
        for relative in names:
            destination = posixpath.join(target, relative)
            self.fs.makedirs(posixpath.dirname(destination), exist_ok=True)
            self.fs.put_file(str(Path(local_dir) / relative), destination)
            listing[relative] = (Path(local_dir) / relative).stat().st_size
        return listing

    def commit(self, listing: dict[str, int], *parts: str) -> None:
        """Mark `<url>/<parts>` whole: its marker, listing every file and its size, written last."""
        self._write_marker(self._path(*parts), {"files": listing})

    def uncommit(self, *parts: str) -> None:
        """Remove `<url>/<parts>` (marker first), e.g. before several writers upload into it."""
        self._uncommit(self._path(*parts))

    def _write_marker(self, target: str, content: dict[str, Any]) -> None:
        temporary = posixpath.join(target, f".{MARKER}.tmp")
        self.fs.pipe_file(temporary, json.dumps(content).encode())
        self.fs.mv(temporary, posixpath.join(target, MARKER))

    def _uncommit(self, target: str) -> None:
        """Remove a directory (its marker first, so it is never seen half deleted)."""
        if self.fs.exists(posixpath.join(target, MARKER)):
            self.fs.rm_file(posixpath.join(target, MARKER))
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    def committed(self, *parts: str) -> dict[str, int] | None:
        """The file listing of a committed directory, or None when it is absent or uncommitted."""
        marker = self._path(*parts, MARKER)
        try:
            return json.loads(self.fs.cat_file(marker))["files"]
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def read_text(self, *parts: str) -> str | None:
        """The text of the file `<url>/<parts>`, or None when it is absent."""
        try:
            return self.fs.cat_file(self._path(*parts)).decode()
        except FileNotFoundError:
            return None

    def download_dir(self, local_dir: str | Path, *parts: str) -> Path:
        """Copy a committed directory to `local_dir` (written beside it, checked, then renamed into place)."""
        listing = self.committed(*parts)
        source = self._path(*parts)
        if listing is None:
            raise StorageError(f"{self._url(source)} is not a committed upload (no {MARKER}); nothing to download")
        local_dir = Path(local_dir)
        local_dir.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=f".download-{local_dir.name}-", dir=local_dir.parent))
        try:
            for relative, size in listing.items():
                destination = temporary / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(posixpath.join(source, relative), str(destination))
                if destination.stat().st_size != size:
                    raise StorageError(
                        f"{self._url(posixpath.join(source, relative))}: downloaded {destination.stat().st_size} "
                        f"bytes, its marker says {size}; the upload was changed after it was committed"
                    )
            replace_dir(temporary, local_dir)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return local_dir

    # ------------------------------------------------------------ checkpoints

    def checkpoint_steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        root = self._path(CHECKPOINTS)
        if not self.fs.exists(root):
            return []
        steps = []
        for entry in self.fs.ls(root, detail=False):
            name = posixpath.basename(entry.rstrip("/"))
            if name.startswith("step-") and name[5:].isdigit() and self.committed(CHECKPOINTS, name) is not None:
                steps.append(int(name[5:]))
        return sorted(steps)

    def upload_checkpoint(self, checkpoint_dir: str | Path, keep_last: int) -> str:
        """Upload a finished `step-N` directory, then remove all but the newest `keep_last` uploaded ones."""
        checkpoint_dir = Path(checkpoint_dir)
        if not (checkpoint_dir / STATE_FILE).is_file():
            raise StorageError(f"{checkpoint_dir} is not a finished checkpoint (no {STATE_FILE}); not uploading it")
        try:
            url = self.upload_dir(checkpoint_dir, CHECKPOINTS, checkpoint_dir.name)
            self.prune_checkpoints(keep_last)
        except StorageError:
            raise
        except Exception as error:
            raise StorageError(remote_problem(self.url, error)) from error
        logger.info("checkpoint uploaded: %s", url)
        return url

    def prune_checkpoints(self, keep_last: int) -> None:
        """Remove all but the newest `keep_last` committed checkpoints."""
        for step in self.checkpoint_steps()[:-keep_last]:
            self._uncommit(self._path(CHECKPOINTS, f"step-{step}"))

    def clear_checkpoints(self) -> None:
        """Remove every uploaded checkpoint (a run that starts over)."""
        root = self._path(CHECKPOINTS)
        if self.fs.exists(root):
            for step in self.checkpoint_steps():
                self._uncommit(self._path(CHECKPOINTS, f"step-{step}"))
            self.fs.rm(root, recursive=True)

    # ------------------------------------------------------------ export

    @property
    def export_url(self) -> str:
        return self._url(self._path(EXPORT))

    def upload_export(self, export_dir: str | Path) -> str:
        url = self.upload_dir(export_dir, EXPORT)
        logger.info("model export uploaded: %s", url)
        return url


class RunLease:
    """A run's hold on its object-store prefix (see the module docstring); `acquire`, then `release` at the end."""

    def __init__(self, storage: RunStorage, ttl: float = LEASE_TTL):
        self.storage, self.ttl = storage, ttl
        self.path = storage._path(LEASE)
        self.record = {
            "token": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": " ".join(sys.argv),
            "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),  # the same across torchrun's restarts of one job
            "renewals": 0,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        try:
            return json.loads(self.storage.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # a lease half-written by a killed holder: nobody holds it

    def _write(self) -> None:
        self.storage.fs.pipe_file(self.path, json.dumps(self.record).encode())

    def _same_job(self, lease: dict) -> bool:
        """True for a lease left by an earlier attempt of this torchrun job (its workers were stopped to restart
        them): torchrun's run id, unless it is the shared default 'none'."""
        job = self.record["job"]
        return job not in ("", "none") and lease.get("job") == job

    def _holder_text(self, lease: dict) -> str:
        return f"pid {lease.get('pid')} on host {lease.get('host')} ({lease.get('command')})"

    def acquire(self) -> RunLease:
        """Take the lease, waiting up to `ttl` seconds for a silent holder's to lapse; RunDirInUse when a live run
        holds it, StorageError (with the fix) when the store cannot be read or written."""
        url = self.storage.url
        try:
            held = self._read()
            if held is not None and self._same_job(held):
                logger.info("taking over the lease on %s from an earlier attempt of this job", url)
            elif held is not None and held.get("token") != self.record["token"]:
                logger.info("%s holds a lease on %s; watching it for %.0f s", self._holder_text(held), url, self.ttl)
                waited, step = 0.0, self.ttl / 6
                while waited < self.ttl:
                    threading.Event().wait(step)
                    waited += step
                    now = self._read()
                    if now is not None and now != held:
                        raise RunDirInUse(
                            f"checkpoint.remote_dir {url} is in use by another run: {self._holder_text(now)}, which "
                            "keeps renewing its lease. Wait for it to finish or stop it, or set another "
                            "checkpoint.remote_dir (and logging.run_dir)"
                        )
                    if now is None:
                        break
                logger.warning(
                    "took over the lease on %s from %s, which stopped renewing it", url, self._holder_text(held)
                )
            self.storage.fs.makedirs(self.storage.root, exist_ok=True)
            self._write()
            threading.Event().wait(min(1.0, self.ttl / 10))
            if (now := self._read()) is None or now.get("token") != self.record["token"]:
                raise RunDirInUse(
                    f"checkpoint.remote_dir {url} was claimed at the same moment by another run: "
                    f"{self._holder_text(now or {})}; stop one of the two"
                )
        except (RunDirInUse, StorageError):
            raise
        except Exception as error:
            raise StorageError(remote_problem(url, error)) from None
        self._thread = threading.Thread(target=self._renew, name="tigon-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self.record["renewals"] += 1
            try:
                self._write()
            except Exception as error:  # a store hiccup: the next renewal tries again
                logger.warning("could not renew the lease on %s: %s", self.storage.url, error)

    def release(self) -> None:
        """Stop renewing and remove the lease (when it is still this run's)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            if (self._read() or {}).get("token") == self.record["token"]:
                self.storage.fs.rm_file(self.path)
        except Exception as error:
            logger.warning("could not remove the lease %s: %s", self.path, error)


def run_storage(remote_dir: str | None) -> RunStorage | None:
    """The run's object-store prefix (`checkpoint.remote_dir`), or None when checkpoints stay local only."""
    return RunStorage(remote_dir) if remote_dir else None


def resume_point(remote_dir: str | None, run_dir: str | Path, env: DistEnv) -> Path | None:
    """The checkpoint to resume from, present on every node (call on all ranks); None when there is none.

    Without `remote_dir` it is `checkpoint.resume_checkpoint`'s pick. With it, rank 0 names the newest committed
    checkpoint newer than its own newest local one; it is downloaded (by rank 0 when every rank sees its run
    directory, else by each node's first process, unless the node holds it) and rank 0 verifies it: a damaged one
    is set aside and the next older committed one tried. Then every node that lacks the picked checkpoint, or
    holds another copy of it (its manifest differs from rank 0's), downloads it: nodes that share no filesystem
    each resume from their own copy.
    """
    store = run_storage(remote_dir)
    if store is None:
        return checkpoint_resume(run_dir, env)
    downloads = env.is_node_leader if not _shares_run_dir(run_dir, env) else env.is_main
    tried: set[int] = set()
    while True:
        wanted = None
        if env.is_main:
            wanted = _store_call(store, lambda: _newest_to_fetch(store, run_dir, tried))
        wanted = broadcast_object(wanted, env)
        if wanted is not None:
            tried.add(wanted)
            _download(store, run_dir, f"step-{wanted}", None, env, downloads)
        try:
            picked = checkpoint_resume(run_dir, env)
        except CheckpointError:
            if wanted is None:
                raise
            continue  # the download was damaged (rank 0 set it aside); try an older committed checkpoint
        if wanted is not None and (picked is None or picked.name != f"step-{wanted}"):
            continue
        if picked is not None:
            manifest = (picked / MANIFEST).read_bytes() if env.is_main and (picked / MANIFEST).is_file() else None
            manifest = broadcast_object(manifest, env)
            _download(store, run_dir, picked.name, manifest, env, downloads)
        return picked


def _store_call(store: RunStorage, call: Callable[[], Any]) -> Any:
    """`call()`, with a store error turned into a StorageError that names checkpoint.remote_dir and the fix."""
    try:
        return call()
    except StorageError:
        raise
    except Exception as error:
        raise StorageError(remote_problem(store.url, error)) from error


def _newest_to_fetch(store: RunStorage, run_dir: str | Path, tried: set[int]) -> int | None:
    """The newest committed step newer than every local checkpoint and not tried yet; None when there is none."""
    local = list_checkpoints(run_dir)
    newest_local = local[-1][0] if local else -1
    steps = [step for step in store.checkpoint_steps() if step > newest_local and step not in tried]
    return steps[-1] if steps else None


def _shares_run_dir(run_dir: str | Path, env: DistEnv) -> bool:
    """Whether every rank sees rank 0's `<run_dir>/checkpoints` (one shared filesystem); True in one process."""
    if not env.distributed:
        return True
    probe = checkpoint_root(run_dir) / f".probe-{broadcast_object(uuid.uuid4().hex, env)}"
    if env.is_main:
        probe.mkdir(parents=True)
    shared = not ranks_not_seeing(probe, env)
    barrier(env)
    if env.is_main:
        probe.rmdir()
    return shared


def _download(store: RunStorage, run_dir: str | Path, name: str, manifest: bytes | None, env, here: bool) -> None:
    """Where `here` (rank 0 on a shared run directory, else each node's first process), download checkpoint `name`
    unless its copy is there (and, given rank 0's manifest, the same); then every rank waits. A failure on any
    node is raised on every rank."""
    problem = None
    if here:
        local = checkpoint_root(run_dir) / name
        present = (local / STATE_FILE).is_file() and (
            manifest is None or ((local / MANIFEST).is_file() and (local / MANIFEST).read_bytes() == manifest)
        )
        if not present:
            try:
                _store_call(store, lambda: store.download_dir(local, CHECKPOINTS, name))
                logger.info("resuming from the object store: %s -> %s", store.url, local)
            except StorageError as error:
                problem = f"node {env.group_rank}: {error}"
    problems = [entry for entry in all_gather_object(problem, env) if entry]
    if problems:
        raise StorageError("; ".join(dict.fromkeys(problems)))


def default_remote_dir(raw_output_prefix: str, run_name: str) -> str | None:
    """On a cluster, the run's prefix under Flyte's raw output prefix (s3://, gs://); None locally."""
    if not raw_output_prefix or is_local_url(raw_output_prefix):
        return None
    return f"{raw_output_prefix.rstrip('/')}/tigon/{run_name}"
