"""Retry classification on real failures: a gloo peer that dies, a store nobody serves, the run's own errors."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tigon.platform.faults import is_retryable, lost_worker
from tigon.runtime.config import ConfigError, load_config
from tigon.runtime.data import DataError, read_records

ROOT = Path(__file__).resolve().parents[2]


def _lose_a_peer(rank: int, store_file: str, report: str) -> None:
    """Rank 1 dies without a word after joining; rank 0's next collective fails, and is classified."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    dist.barrier()
    if rank == 1:
        os._exit(1)
    time.sleep(1.0)
    try:
        dist.all_reduce(torch.ones(4))
        outcome = {"raised": None}
    except Exception as error:  # noqa: BLE001 - the test records whatever gloo raises
        outcome = {"raised": type(error).__name__, "message": str(error)[:300], "retryable": is_retryable(error)}
    Path(report).write_text(json.dumps(outcome))
    os._exit(0)


def test_a_lost_gloo_peer_is_retryable(tmp_path):
    report = tmp_path / "report.json"
    context = mp.start_processes(
        _lose_a_peer, args=(str(tmp_path / "store"), str(report)), nprocs=2, join=False, start_method="spawn"
    )
    for process in context.processes:
        process.join(120)
    outcome = json.loads(report.read_text())
    assert outcome["raised"] is not None, "the collective with a dead peer did not fail"
    assert outcome["retryable"], outcome


def test_a_store_nobody_serves_is_retryable():
    with pytest.raises(dist.DistNetworkError) as error:
        dist.TCPStore("127.0.0.1", 1, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=1))
    assert is_retryable(error.value)


def test_a_network_error_under_a_runtime_error_is_retryable():
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as cause:
            raise RuntimeError("checkpoint upload failed") from cause
    except RuntimeError as error:
        assert is_retryable(error)


def test_the_runs_own_errors_are_not_retryable(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "examples" / "demo.yaml").read_text().replace("learning_rate:", "learnin_rate:"))
    with pytest.raises(ConfigError) as config_error:
        load_config(bad)
    with pytest.raises(DataError) as data_error:
        read_records(tmp_path / "missing.jsonl")
    errors = [
        config_error.value,
        data_error.value,
        FloatingPointError("the loss became nan at step 3"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        FileNotFoundError(2, "No such file or directory", "/data/train.jsonl"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
    ]
    assert [is_retryable(error) for error in errors] == [False] * len(errors)
    # A config error stays one even when a network error happened on the way (e.g. while reading the file).
    try:
        try:
            raise TimeoutError("timed out")
        except TimeoutError:
            raise ConfigError("training.learnin_rate: unknown key") from None
    except ConfigError as error:
        assert not is_retryable(error)


def test_a_worker_ended_by_a_signal_is_a_lost_worker():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failed(exitcode: int) -> ChildFailedError:
        return ChildFailedError("train", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file="-")})

    assert lost_worker(failed(-9)) == "worker rank 1 (pid 4242) was ended by SIGKILL"
    assert lost_worker(failed(-15)) == "worker rank 1 (pid 4242) was ended by SIGTERM"
    assert lost_worker(failed(1)) is None  # the worker raised (its own error decides) or exited with an error
    assert lost_worker(failed(-11)) is None  # SIGSEGV: a crash in the process, not a lost machine
    assert lost_worker(RuntimeError("Connection closed by peer")) is None
