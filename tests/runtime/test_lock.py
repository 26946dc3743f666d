"""One run per run directory: a second run is refused with the holder's name, and a holder killed with -9 leaves
no stale lock."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.runtime.configs import tiny_config
from tigon.runtime.config import ConfigError
from tigon.runtime.lock import LOCK_FILE, RunDirInUse, RunDirLock
from tigon.runtime.trainer import train

HOLDER = """
import sys, time
from tigon.runtime.lock import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("holding", flush=True)
time.sleep(120)
"""


def test_second_run_is_refused_while_the_first_lives_and_runs_after_it_is_killed(tmp_path):
    config = tiny_config(tmp_path, training={"max_steps": 1})
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(RunDirInUse) as refused:
            train(config)
        message = str(refused.value)
        assert f"logging.run_dir {run_dir} is in use by another run: pid {holder.pid}" in message
        assert f"on host {socket.gethostname()}" in message and "another logging.run_dir" in message
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: the holder gets no chance to clean up
        holder.wait()
    assert (run_dir / LOCK_FILE).read_text(), "the dead holder's record is still there"
    assert train(config).steps == 1, "the kernel released the lock of the killed holder"
    RunDirLock(run_dir).acquire().release()  # and the finished run released its own


def test_run_dir_that_is_a_file_is_a_config_error(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ConfigError, match=r"logging.run_dir .*/run is a file, not a directory"):
        train(tiny_config(tmp_path))
    with pytest.raises(ConfigError, match="cannot be created: a part of its path is a file"):
        train(tiny_config(tmp_path, logging={"run_dir": str(tmp_path / "run" / "sub")}))
