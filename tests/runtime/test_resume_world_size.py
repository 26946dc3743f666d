"""A run resumed on another number of processes keeps its global batch: the gradient accumulation (and, where
that alone cannot, the micro-batch) changes so that each step trains the checkpoint's global batch, and the run
continues on the same sequences to the uninterrupted run's losses. FSDP2's checkpoint reshards from 2 processes
to 1, DDP's goes from 1 to 2 under each trainer (gloo); what cannot resume elsewhere is refused with the fix."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.runtime.configs import resumable_config, tiny_config
from tests.runtime.worker_groups import RELATIVE_TOLERANCE, launch, worst_relative
from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import ConfigError
from tigon.runtime.run import keep_global_batch, saved_global_batch
from tigon.runtime.storage import RunStorage


def mkdir(directory: Path) -> Path:
    directory.mkdir()
    return directory


def saved_training(run_dir: Path, step: int) -> tuple[dict, dict]:
    """(state.json, config.json's training section) of checkpoint `step`."""
    directory = run_dir / "checkpoints" / f"step-{step}"
    state = json.loads((directory / ckpt.STATE_FILE).read_text())
    return state, json.loads((directory / "config.json").read_text())["training"]


def test_fsdp2_resumed_on_one_process_continues_the_two_process_run(tmp_path):
    """2 ranks x micro-batch 1 x accumulation 2 for 3 steps, then the same config on 1 process: accumulation 4, the
    DCP shards of 2 ranks loaded into 1, and steps 4-6 equal the uninterrupted 2-rank run's (fp32; the gradients
    of a step are summed in another order)."""
    sections = {
        "parallelism": {"strategy": "fsdp"},
        "training": {"micro_batch_size": 1, "gradient_accumulation_steps": 2},
    }
    two = launch(
        tmp_path,
        {
            "full": resumable_config(tmp_path, "full", 6, False, **sections),
            "killed": resumable_config(tmp_path, "moved", 3, False, **sections),
        },
    )
    one = launch(
        mkdir(tmp_path / "one"), {"resumed": resumable_config(tmp_path, "moved", 6, False, **sections)}, nproc=1
    )
    full, resumed = two["full"]["losses"], one["resumed"]
    assert two["killed"]["losses"] == full[:3] and resumed["resumed_from"] == 3, (two, resumed)
    assert resumed["losses"][:3] == full[:3] and resumed["world_size"] == 1, resumed
    worst = worst_relative(resumed["losses"][3:], full[3:])
    print(f"FSDP2 2 -> 1 processes: worst relative difference of steps 4-6 {worst:.2e}")
    assert worst < RELATIVE_TOLERANCE, (resumed["losses"], full)
    state, training = saved_training(tmp_path / "moved", 6)
    assert (state["world_size"], state["global_batch"]) == (1, 4), state
    assert (training["micro_batch_size"], training["gradient_accumulation_steps"]) == (1, 4), training


@pytest.mark.parametrize("trainer", ["torch", "hf", "lightning"])
def test_ddp_resumed_on_two_processes_continues_the_one_process_run(tmp_path, trainer):
    """Micro-batch 4 on 1 process for 3 steps, then on 2: micro-batch 2 a rank, and steps 4-6 equal the
    uninterrupted one-process run's, under each trainer."""
    one = launch(
        tmp_path,
        {
            "full": resumable_config(tmp_path, "full", 6, False, trainer=trainer, training={"micro_batch_size": 4}),
            "killed": resumable_config(tmp_path, "moved", 3, False, trainer=trainer, training={"micro_batch_size": 4}),
        },
        nproc=1,
    )
    two = launch(
        mkdir(tmp_path / "two"),
        {"resumed": resumable_config(tmp_path, "moved", 6, False, trainer=trainer, training={"micro_batch_size": 4})},
    )
    full, resumed = one["full"]["losses"], two["resumed"]
    assert resumed["resumed_from"] == 3 and resumed["losses"][:3] == full[:3] and resumed["world_size"] == 2
    worst = worst_relative(resumed["losses"][3:], full[3:])
    print(f"DDP 1 -> 2 processes: worst relative difference of steps 4-6 {worst:.2e}")
    assert worst < RELATIVE_TOLERANCE, (resumed["losses"], full)
    state, training = saved_training(tmp_path / "moved", 6)
    assert (state["world_size"], state["global_batch"]) == (2, 4), state
    assert (training["micro_batch_size"], training["gradient_accumulation_steps"]) == (2, 1), training


def fake_checkpoint(tmp_path: Path, where: str, world_size: int, training: dict, global_batch: int | None) -> Path:
    """`tmp_path/where/checkpoints/step-3` with the two files resuming reads: state.json (without `global_batch`
    when None, as written before it was recorded) and the config.json of the tiny run with `training`."""
    directory = tmp_path / where / "checkpoints" / "step-3"
    directory.mkdir(parents=True)
    state = {"step": 3, "world_size": world_size} | ({"global_batch": global_batch} if global_batch else {})
    (directory / ckpt.STATE_FILE).write_text(json.dumps(state))
    (directory / "config.json").write_text(tiny_config(tmp_path, training=training).model_dump_json())
    return directory


def resuming(tmp_path: Path, run_dir: Path, **sections):
    """The tiny run in `run_dir` with resume on, `sections` as tiny_config takes them."""
    checkpoint = {"resume": True, **sections.pop("checkpoint", {})}
    return tiny_config(tmp_path, logging={"run_dir": str(run_dir)}, checkpoint=checkpoint, **sections)


def split(config) -> tuple[int, int]:
    return config.training.micro_batch_size, config.training.gradient_accumulation_steps


TWO_BY_TWO = {"micro_batch_size": 2, "gradient_accumulation_steps": 2}


def test_the_global_batch_is_kept_by_accumulation_then_micro_batch(tmp_path, caplog):
    fake_checkpoint(tmp_path, "run", 2, TWO_BY_TWO, 8)
    config = resuming(tmp_path, tmp_path / "run", training=TWO_BY_TWO)
    assert saved_global_batch(config) == (8, 2)
    assert keep_global_batch(config, 2) is config  # nothing moved
    with caplog.at_level(logging.INFO, logger="tigon.runtime"):
        assert split(keep_global_batch(config, 4)) == (2, 1)
    assert "resuming on 4 processes a run written by 2: micro-batch 2 x accumulation 1 (was 2 x 2)" in caplog.text
    assert split(keep_global_batch(config, 1)) == (2, 4)
    assert split(keep_global_batch(config, 8)) == (1, 1)  # the micro-batch shrinks where accumulation cannot
    wide = resuming(tmp_path, tmp_path / "run", training={"micro_batch_size": 3})
    assert split(keep_global_batch(wide, 1)) == (2, 4)  # the largest micro-batch up to the config's that divides 8
    off = resuming(tmp_path, tmp_path / "run", training={"micro_batch_size": 3}, checkpoint={"resume": False})
    assert keep_global_batch(off, 4) is off


def test_a_checkpoint_from_before_the_record_gives_its_config_s_global_batch(tmp_path):
    fake_checkpoint(tmp_path, "run", 2, {"micro_batch_size": 3, "gradient_accumulation_steps": 2}, None)
    assert saved_global_batch(resuming(tmp_path, tmp_path / "run")) == (12, 2)


def test_the_global_batch_is_read_from_the_object_store_on_a_new_pod(tmp_path):
    staged = fake_checkpoint(tmp_path, "staged", 4, {"micro_batch_size": 1}, 4)
    url = f"file://{tmp_path / 'bucket' / 'run'}"
    RunStorage(url).upload_dir(staged, "checkpoints", "step-3")
    config = resuming(tmp_path, tmp_path / "empty", checkpoint={"remote_dir": url}, training={"micro_batch_size": 1})
    assert saved_global_batch(config) == (4, 4)
    assert split(keep_global_batch(config, 2)) == (1, 2)


def test_another_run_s_checkpoint_is_named_before_its_global_batch(tmp_path):
    fake_checkpoint(tmp_path, "run", 2, TWO_BY_TWO, 8)
    other = resuming(tmp_path, tmp_path / "run", training={"micro_batch_size": 1}, data={"max_seq_len": 40})
    with pytest.raises(ConfigError, match="belongs to a run with different data settings"):
        keep_global_batch(other, 2)


@pytest.mark.parametrize(
    ("world_size", "sections", "message"),
    [
        (
            3,
            {},
            r"global batch of 8 sequences \(written by 2 processes\) does not split evenly over 3 processes; "
            r"resume on one of \[1, 2, 4, 8\] processes",
        ),
        (
            1,
            {"parallelism": {"strategy": "deepspeed", "zero_stage": 2}},
            r"written by 2 processes and this run has 1; DeepSpeed's ZeRO partitions .* resume on 2 processes",
        ),
        (
            2,
            {"training": {"micro_batch_size": 4, "gradient_accumulation_steps": 2}},
            r"trained global batches of 8 sequences, and this config's are 16 .* set micro_batch_size x "
            r"gradient_accumulation_steps to 4",
        ),
    ],
)
def test_what_cannot_resume_elsewhere_is_refused_with_the_fix(tmp_path, world_size, sections, message):
    fake_checkpoint(tmp_path, "run", 2, TWO_BY_TWO, 8)
    config = resuming(tmp_path, tmp_path / "run", **{"training": TWO_BY_TWO, **sections})
    with pytest.raises(ConfigError, match=message):
        keep_global_batch(config, world_size)
