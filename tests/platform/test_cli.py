"""`tigon render-job` and `tigon templates`: kubectl-ready output, errors before anything is printed."""

from pathlib import Path

import yaml

from tigon.platform.cli import main
from tigon.platform.jobs import check_pytorchjob

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")


def test_render_job_prints_config_map_and_pytorchjob(capsys):
    assert main(["render-job", DEMO, "--job-template", "h100x8x2", "--nodes", "3", "--namespace", "ml"]) == 0
    out = capsys.readouterr().out
    assert "&id" not in out and "*id" not in out  # plain YAML: shared objects are written out, not aliased
    config_map, job = yaml.safe_load_all(out)
    assert config_map["kind"] == "ConfigMap" and "config.yaml" in config_map["data"]
    check_pytorchjob(job)
    assert job["metadata"] == {"name": "demo-arithmetic", "namespace": "ml", "labels": job["metadata"]["labels"]}
    (workers,) = job["spec"]["pytorchReplicaSpecs"].values()
    assert workers["replicas"] == 3
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in workers["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["tigon-triton-cache", "tigon-hf-cache"]
    argv = ["render-job", DEMO, "--job-template", "h100x8", "--triton-cache-claim", "", "--hf-cache-claim", ""]
    assert main(argv) == 0
    _, job = yaml.safe_load_all(capsys.readouterr().out)
    volumes = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert [v["name"] for v in volumes] == ["config", "dshm"]


def test_render_job_errors_exit_2_and_print_nothing(capsys, tmp_path):
    assert main(["render-job", DEMO, "--job-template", "tpu-v5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "unknown job template 'tpu-v5'" in captured.err and "cpu-small" in captured.err
    assert main(["render-job", DEMO, "--job-template", "h100x8", "--nodes", "2"]) == 2
    assert "at most 1 node" in capsys.readouterr().err
    assert main(["render-job", DEMO, "--job-template", "h100x8", "--set", "training.micro_batch_size=-1"]) == 2
    assert "training.micro_batch_size" in capsys.readouterr().err


def test_templates_lists_each_template(capsys):
    assert main(["templates"]) == 0
    listing = capsys.readouterr().out
    assert "cpu-small" in listing and "h100x8x2     2 node(s) x 8 proc, 8 GPU" in listing


def test_runtime_commands_pass_through(capsys):
    assert main(["schema"]) == 0
    assert '"RunConfig"' in capsys.readouterr().out
