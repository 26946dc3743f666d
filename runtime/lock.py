"""One run per run directory: a lock its holder keeps for the whole run, released by the kernel when it dies.

    lock = RunDirLock("runs/demo").acquire()  # RunDirInUse when another run holds it
    ...  # train
    lock.release()

The lock is `flock` on `<run_dir>/run.lock`, so it is released when the holding process exits in any
way, `kill -9` included: a restarted run never finds a stale lock. The file also records the holder
(host, pid, start time, command line), so a second run on the same directory fails at once with an
error that names it. Under torchrun only rank 0 takes the lock (the run directory is shared by the
ranks); another job's rank 0 then fails before its workers touch the directory. The file itself is
never removed: removing it would let two processes lock two different files of the same name.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from pathlib import Path

from tigon.runtime.config import ConfigError

logger = logging.getLogger("tigon.runtime")

LOCK_FILE = "run.lock"


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory; the message names it."""


def prepare_run_dir(run_dir: str | Path) -> Path:
    """Create `logging.run_dir` if missing; ConfigError naming the key when it is a file or cannot be created."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            f"logging.run_dir {run_dir} is a file, not a directory; set logging.run_dir to a directory (it is "
            "created when missing)"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(
            f"logging.run_dir {run_dir} cannot be created: a part of its path is a file; set logging.run_dir to a "
            "path under a directory"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"logging.run_dir {run_dir} cannot be created: permission denied; set logging.run_dir to a writable path"
        ) from None
    return run_dir


def holder_text(path: Path) -> str:
    """Who holds a lock file, as its holder recorded it."""
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']} ({holder['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet recorded itself"


class RunDirLock:
    """The exclusive lock on one run directory (see the module docstring)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock, or raise RunDirInUse naming the holder. On a filesystem without locks it warns and runs."""
        prepare_run_dir(self.run_dir)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirInUse(
                f"logging.run_dir {self.run_dir} is in use by another run: {holder_text(self.path)}. Wait for it to "
                "finish or stop it, or give this run another logging.run_dir"
            ) from None
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            logger.warning(
                "cannot lock %s (%s): this filesystem has no file locks, so nothing stops a second run on it",
                self.run_dir,
                error,
            )
            return self
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays, emptied)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
