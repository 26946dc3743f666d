"""Nodes lost and gained: an elastic job goes on with the nodes it has, on the CPU over gloo.

Two "nodes" are two torch elastic agents of one process each (`torchrun --nnodes 1:2`, c10d rendezvous on
localhost, one run directory they share), each running `python -m tigon.runtime train` as a job template's pods
do. The second node's worker stops for good in its fourth optimizer step (benchmarks/rank_fault), and once the
run's step-3 checkpoint is in place that node is killed whole (agent and worker, as a node that goes away). The
first node's worker fails in its next collective, its agent restarts it, the rendezvous re-forms with the one node
left (the job's minimum), and the run resumes from its newest checkpoint on one process with its global batch kept
(accumulation 1 -> 2): every per-step loss equals the uninterrupted two-process run's within RELATIVE_TOLERANCE (the
one process sums a step's gradients in another order).

The other way, a node that joins a running job (a lost one coming back, or a new one): the job starts on one node,
the second joins after the step-3 checkpoint, and the run resumes on two processes (accumulation 2 -> 1) to the
one-process run's losses.
"""

from __future__ import annotations

import json

from tests.runtime.configs import resumable_config
from tests.runtime.worker_groups import (
    RELATIVE_TOLERANCE,
    launch,
    train_gaining_a_node,
    train_losing_a_node,
    worst_relative,
)
from tigon.runtime import checkpoint as ckpt

STEPS = 9


def assert_resumed_to(tmp_path, output: str, resumed: str, world_size: int, reference: list[float]) -> None:
    """The elastic run logged `resumed`, ended on `world_size` processes with its global batch of 4, and every
    per-step loss is the reference run's within RELATIVE_TOLERANCE."""
    assert resumed in output, output[-6000:]
    state = json.loads((tmp_path / "run" / "checkpoints" / f"step-{STEPS}" / ckpt.STATE_FILE).read_text())
    assert (state["world_size"], state["global_batch"]) == (world_size, 4), state
    worst = worst_relative(state["losses"], reference)
    print(f"resumed on {world_size} processes: worst relative difference to the reference run {worst:.2e}")
    assert len(state["losses"]) == STEPS and worst < RELATIVE_TOLERANCE, (state["losses"], reference)


def test_a_lost_node_leaves_the_job_on_the_nodes_left_with_the_same_losses(tmp_path):
    sections = {"training": {"micro_batch_size": 2}}  # a checkpoint every 3 steps
    full = launch(tmp_path, {"full": resumable_config(tmp_path, "full", STEPS, False, **sections)})["full"]["losses"]
    output = train_losing_a_node(tmp_path / "elastic", resumable_config(tmp_path, "run", STEPS, False, **sections))
    resumed = "resuming on 1 processes a run written by 2: micro-batch 2 x accumulation 2 (was 2 x 1)"
    assert_resumed_to(tmp_path, output, resumed, 1, full)


def test_a_node_that_joins_a_running_job_takes_its_share_with_the_same_losses(tmp_path):
    sections = {"training": {"micro_batch_size": 2, "gradient_accumulation_steps": 2}}
    alone = resumable_config(tmp_path, "alone", STEPS, False, **sections)
    full = launch(tmp_path, {"alone": alone}, nproc=1)["alone"]["losses"]
    output = train_gaining_a_node(tmp_path / "elastic", resumable_config(tmp_path, "run", STEPS, False, **sections))
    resumed = "resuming on 2 processes a run written by 1: micro-batch 2 x accumulation 1 (was 2 x 2)"
    assert_resumed_to(tmp_path, output, resumed, 2, full)
