"""Checks before submission: `tigon submit` and `render-job` fail on the laptop, before any container starts."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from tigon.platform.cli import main
from tigon.platform.submit import SubmissionError, check_submission, gpu_settings
from tigon.platform.templates import get_template
from tigon.runtime.config import load_config

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")


def test_dry_run_prints_the_remote_command_with_the_validated_config(capsys):
    assert main(["submit", DEMO, "--job-template", "h100x8x2", "--nodes", "4", "--steps", "50", "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[3:5] == ["run", "--remote"] and command[-7:-5] == ["finetune", "--config_yaml"]
    assert command[-4:] == ["--job_template", "h100x8x2", "--nodes", "4"]
    sent = yaml.safe_load(command[-5])
    assert sent["training"]["max_steps"] == 50 and sent["name"] == "demo-arithmetic"


def test_pyflyte_options_pass_through(capsys):
    argv = ["submit", DEMO, "--job-template", "h100x8", "--project", "ml", "--domain", "production", "--dry-run"]
    assert main(argv) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[5:9] == ["--project", "ml", "--domain", "production"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--job-template", "tpu-v5"], "unknown job template 'tpu-v5'"),
        (["--job-template", "h100x8", "--nodes", "2"], "at most 1 node"),
        (["--job-template", "cpu-small", "--set", "parallelism.backend=nccl"], "has no GPUs"),
        (["--job-template", "h100x8", "--set", "training.learnin_rate=0.1"], "did you mean 'learning_rate'"),
    ],
)
def test_submit_errors_exit_2_before_anything_runs(capsys, argv, message):
    assert main(["submit", DEMO, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_gpu_settings_on_a_cpu_template():
    config = load_config(DEMO, ["parallelism.backend=nccl", "model.attn_implementation=flash_attention_2"])
    assert len(gpu_settings(config)) == 2
    with pytest.raises(SubmissionError, match="flash_attention_2") as error:
        check_submission(config, get_template("cpu-small"))
    assert "Pick a GPU template" in str(error.value)
    assert check_submission(config, get_template("h100x8x2"), 3).nnodes == 3
    assert check_submission(load_config(DEMO), get_template("cpu-small")).name == "cpu-small"


def test_render_job_refuses_gpu_settings_on_a_cpu_template(capsys):
    assert main(["render-job", DEMO, "--job-template", "cpu-small", "--set", "parallelism.backend=nccl"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "parallelism.backend: nccl" in captured.err
