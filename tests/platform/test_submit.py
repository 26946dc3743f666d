"""Checks before submission: `tigon submit` and `render-job` fail on the laptop, before any container starts."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from tigon.platform.cli import main
from tigon.platform.submit import SubmissionError, check_submission, gpu_settings
from tigon.platform.templates import get_template
from tigon.runtime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "demo.yaml")
# The demo's data as the pods can read it: object-store URLs instead of paths relative to the config.
ON_OBJECT_STORE = ["--set", "data.train=s3://tigon-data/train.jsonl", "--set", "data.eval=s3://tigon-data/eval.jsonl"]


def test_dry_run_prints_the_remote_command_with_the_validated_config(capsys):
    argv = ["submit", DEMO, "--job-template", "h100x8x2", "--nodes", "4", "--steps", "50", *ON_OBJECT_STORE]
    assert main([*argv, "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    # every task runs in the template's image: the train task names it, the others take pyflyte's default image
    assert command[3:7] == ["run", "--remote", "--image", get_template("h100x8x2").image]
    assert command[7:9] == ["--labels", "kueue.x-k8s.io/queue-name=default"]  # the template's Kueue queue
    assert command[-7:-5] == ["finetune", "--config_yaml"]
    assert command[-4:] == ["--job_template", "h100x8x2", "--nodes", "4"]
    sent = yaml.safe_load(command[-5])  # the config itself, not a path on this machine
    assert sent["training"]["max_steps"] == 50 and sent["name"] == "demo-arithmetic"
    assert sent["data"]["train"] == "s3://tigon-data/train.jsonl"


def test_pyflyte_options_pass_through_and_job_template_takes_either_spelling(capsys):
    argv = ["submit", DEMO, "--job_template", "h100x8", *ON_OBJECT_STORE, "--project", "ml", "--domain", "production"]
    assert main([*argv, "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[7:11] == ["--project", "ml", "--domain", "production"]
    assert command[-4:-2] == ["--job_template", "h100x8"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--job-template", "tpu-v5"], "unknown job template 'tpu-v5'"),
        (["--job-template", "h100x8", "--nodes", "2"], "at most 1 node"),
        (["--job-template", "cpu-small", "--set", "parallelism.backend=nccl"], "has no GPUs"),
        (["--job-template", "h100x8", "--set", "training.learnin_rate=0.1"], "did you mean 'learning_rate'"),
        (["--job-template", "h100x8", "--image", "ghcr.io/me/mine:1"], "change `image` in the template"),
        (["--job-template", "h100x8", "--set", "eval.every_steps=5", "--set", "data.eval=null"], "data.eval is not"),
        (
            ["--job-template", "h100x8", "--set", "trainer=hf", "--set", "parallelism.strategy=fsdp"]
            + ["--set", "training.precision=fp16"],
            "fp16 with trainer 'hf' and parallelism.strategy 'fsdp' is not supported",
        ),
    ],
)
def test_submit_errors_exit_2_before_anything_runs(capsys, argv, message):
    assert main(["submit", DEMO, *ON_OBJECT_STORE, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_local_data_is_staged_and_sent_as_the_workflows_data_dir(capsys, monkeypatch):
    """The demo's data files (paths relative to the repository) are copied into one directory that pyflyte uploads
    (`--data_dir`), and the config sent names them relative to it."""
    monkeypatch.chdir(ROOT)
    assert main(["submit", DEMO, "--job-template", "cpu-small", "--dry-run"]) == 0
    captured = capsys.readouterr()
    command = shlex.split(captured.out)
    assert command[-2] == "--data_dir"
    staged = Path(command[-1])
    try:
        assert f"staged in {staged}" in captured.err
        sent = yaml.safe_load(command[command.index("--config_yaml") + 1])
        assert sent["data"]["train"] == "train/arithmetic-train.jsonl"
        assert sent["data"]["eval"] == "eval/arithmetic-eval.jsonl"
        for key in ("train", "eval"):
            original = ROOT / "examples" / "data" / f"arithmetic-{key}.jsonl"
            assert (staged / sent["data"][key]).read_bytes() == original.read_bytes()
    finally:
        shutil.rmtree(staged)


def test_data_relative_to_the_config_file_is_staged_as_the_workflow_reads_it(capsys, tmp_path, monkeypatch):
    """A config in another directory naming its data relative to itself: `tigon submit` finds the files where the
    workflow's validate task would (the config's directory), not only from the current directory."""
    config_dir = tmp_path / "configs"
    (config_dir / "data").mkdir(parents=True)
    raw = yaml.safe_load(Path(DEMO).read_text())
    for key in ("train", "eval"):
        (config_dir / "data" / f"{key}.jsonl").write_bytes((ROOT / raw["data"][key]).read_bytes())
    raw["data"].update(train="data/train.jsonl", eval="data/eval.jsonl")
    (config_dir / "run.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "configs/run.yaml", "--job-template", "cpu-small", "--dry-run"]) == 0, capsys.readouterr()
    command = shlex.split(capsys.readouterr().out)
    staged = Path(command[command.index("--data_dir") + 1])
    try:
        sent = yaml.safe_load(command[command.index("--config_yaml") + 1])
        assert sent["data"]["train"] == "train/train.jsonl"
        assert (staged / "train" / "train.jsonl").read_bytes() == (config_dir / "data" / "train.jsonl").read_bytes()
    finally:
        shutil.rmtree(staged)


def test_missing_local_data_is_refused_and_data_in_the_image_or_a_bucket_is_sent_as_it_is(capsys, tmp_path):
    missing = ["--set", "data.train=nowhere/train.jsonl"]
    assert main(["submit", DEMO, "--job-template", "cpu-small", *missing, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "data not found on this machine: data.train: nowhere/train.jsonl" in captured.err
    elsewhere = ["--set", "data.train=/data/train.jsonl", "--set", "data.eval=s3://tigon-data/eval.jsonl"]
    assert main(["submit", DEMO, "--job-template", "cpu-small", *elsewhere, "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert "--data_dir" not in command
    sent = yaml.safe_load(command[command.index("--config_yaml") + 1])
    assert (sent["data"]["train"], sent["data"]["eval"]) == ("/data/train.jsonl", "s3://tigon-data/eval.jsonl")


def test_gpu_settings_on_a_cpu_template():
    config = load_config(DEMO, ["parallelism.backend=nccl", "model.attn_implementation=flash_attention_2"])
    assert len(gpu_settings(config)) == 2
    with pytest.raises(SubmissionError, match="flash_attention_2") as error:
        check_submission(config, get_template("cpu-small"))
    assert "Pick a GPU template" in str(error.value)
    assert check_submission(config, get_template("h100x8x2"), 3).nnodes == 3
    assert check_submission(load_config(DEMO), get_template("cpu-small")).name == "cpu-small"


def test_a_job_that_goes_on_with_fewer_nodes_needs_a_global_batch_every_node_count_divides():
    elastic = get_template("h100x8x2").model_copy(update={"min_nnodes": 1})
    even = load_config(DEMO, ["training.micro_batch_size=1", "training.gradient_accumulation_steps=2"])
    assert check_submission(even, elastic, 3).fewest_nodes == 1  # 48 sequences: 8, 16 and 24 processes divide it
    odd = load_config(DEMO, ["training.micro_batch_size=1", "training.gradient_accumulation_steps=1"])
    with pytest.raises(SubmissionError, match=r"global batch of 24 sequences .* does not split evenly over 2 node"):
        check_submission(odd, elastic, 3)  # 1 x 1 x 24 = 24: 16 processes do not divide it
    zero = load_config(DEMO, ["parallelism.strategy=deepspeed", "parallelism.zero_stage=2"])
    with pytest.raises(SubmissionError, match="DeepSpeed's ZeRO checkpoints load only on the number of processes"):
        check_submission(zero, elastic)


def test_render_job_refuses_gpu_settings_on_a_cpu_template(capsys):
    assert main(["render-job", DEMO, "--job-template", "cpu-small", "--set", "parallelism.backend=nccl"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "parallelism.backend: nccl" in captured.err


def test_submit_needs_the_workflow_file_of_a_checkout(capsys, monkeypatch, tmp_path):
    from tigon.platform import submit

    monkeypatch.setattr(submit, "WORKFLOW", tmp_path / "workflows" / "finetune.py")  # as in an installed tigon
    assert main(["submit", DEMO, "--job-template", "h100x8", *ON_OBJECT_STORE, "--dry-run"]) == 2
    assert "runs from a tigon checkout" in capsys.readouterr().err


def test_hub_dataset_names_stay_names_and_local_directories_win(tmp_path):
    from tigon.platform.submit import resolve_data_path

    assert resolve_data_path("HuggingFaceTB/smoltalk", tmp_path, from_cwd=True) == "HuggingFaceTB/smoltalk"
    assert resolve_data_path("HuggingFaceTB/smoltalk", "s3://bucket/data") == "HuggingFaceTB/smoltalk"
    assert resolve_data_path("./data/train", "s3://bucket/data") == "s3://bucket/data/./data/train"
    assert resolve_data_path("data/train.jsonl", "s3://bucket/data") == "s3://bucket/data/data/train.jsonl"
    (tmp_path / "org" / "sums").mkdir(parents=True)
    assert resolve_data_path("org/sums", tmp_path) == str(tmp_path / "org" / "sums")
