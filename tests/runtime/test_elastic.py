"""A node lost for good: an elastic job goes on with the nodes left, on the CPU over gloo.

Two "nodes" are two torch elastic agents of one process each (`torchrun --nnodes 1:2`, c10d rendezvous on
localhost, one run directory they share), each running `python -m tigon.runtime train` as a job template's pods
do. The second node's worker stops for good in its fourth optimizer step (benchmarks/rank_fault), and once the
run's step-3 checkpoint is in place that node is killed whole (agent and worker, as a node that goes away). The
first node's worker fails in its next collective, its agent restarts it, the rendezvous re-forms with the one node
left (the job's minimum), and the run resumes from its newest checkpoint on one process with its global batch kept
(accumulation 1 -> 2): every per-step loss equals the uninterrupted two-process run's within RELATIVE_TOLERANCE (the
one process sums a step's gradients in another order).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.runtime.configs import resumable_config
from tests.runtime.worker_groups import RELATIVE_TOLERANCE, ROOT, launch, worker_env, worst_relative, write_configs
from tigon.runtime import checkpoint as ckpt

STEPS = 9


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def elastic_agent(config_file: str, port: int, host: bool, cwd: Path, **variables: str) -> subprocess.Popen:
    """One node: a torch elastic agent of 1 to 2 nodes that restarts its worker up to 3 times; the node at `host`
    keeps the rendezvous store. `variables` go to its environment."""
    rendezvous = f"is_host={int(host)},last_call_timeout=1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "1"]
    command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic-test"]
    command += ["--rdzv_conf", rendezvous, "--max_restarts", "3", "-m", "tigon.runtime", "train", config_file]
    return subprocess.Popen(
        command,
        cwd=cwd,
        env={**worker_env(), **variables},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_lost_node_leaves_the_job_on_the_nodes_left_with_the_same_losses(tmp_path):
    sections = {"training": {"micro_batch_size": 2}}  # a checkpoint every 3 steps
    full = launch(tmp_path, {"full": resumable_config(tmp_path, "full", STEPS, False, **sections)})["full"]["losses"]
    (config_file,) = write_configs(
        tmp_path / "elastic", {"run": resumable_config(tmp_path, "run", STEPS, False, **sections)}
    )
    port = free_port()
    survivor = elastic_agent(config_file, port, True, tmp_path / "elastic")
    # the node to lose stops for good in its fourth optimizer step, so that the run cannot end before it is killed
    stuck = {"FAULT_RANK": "any", "FAULT_AT_STEP": "4", "FAULT_KIND": "hang"}
    stuck["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "rank_fault"), worker_env()["PYTHONPATH"]])
    lost = elastic_agent(config_file, port, False, tmp_path / "elastic", **stuck)
    step_3 = tmp_path / "run" / "checkpoints" / "step-3" / ckpt.STATE_FILE
    deadline = time.monotonic() + 240
    while not step_3.is_file() and time.monotonic() < deadline and lost.poll() is None:
        time.sleep(0.1)
    assert step_3.is_file(), lost.communicate()[0][-6000:]
    for process in psutil.Process(lost.pid).children(recursive=True):  # torch elastic's workers: their own sessions
        process.kill()
    lost.kill()
    lost.wait()
    output = survivor.communicate(timeout=300)[0]
    assert survivor.returncode == 0, output[-6000:]
    assert "resuming on 1 processes a run written by 2: micro-batch 2 x accumulation 2 (was 2 x 1)" in output, output[
        -6000:
    ]
    state = json.loads((tmp_path / "run" / "checkpoints" / f"step-{STEPS}" / ckpt.STATE_FILE).read_text())
    assert (state["world_size"], state["global_batch"]) == (1, 4), state
    worst = worst_relative(state["losses"], full)
    print(f"a node lost after step 3: worst relative difference to the uninterrupted run {worst:.2e}")
    assert len(state["losses"]) == STEPS and worst < RELATIVE_TOLERANCE, (state["losses"], full)
