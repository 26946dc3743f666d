"""Job templates and the PyTorchJob manifests rendered from them, validated against Kubernetes schemas."""

import copy

import kubernetes_validate
import pytest
import yaml

from tests.deploy.pod_security import restricted_violations
from tigon.platform.jobs import (
    JobSpecError,
    check_pytorchjob,
    flyte_task_options,
    job_name,
    pytorchjob_manifests,
    render_yaml,
)
from tigon.platform.templates import TemplateError, get_template, load_templates
from tigon.runtime.config import parse_config

KUBERNETES_VERSION = "1.33.0"


def run_config(name="Demo Run 1"):
    return parse_config(
        {
            "name": name,
            "model": {"config_name": "llama", "tokenizer": "char"},
            "data": {"train": "examples/data/arithmetic-train.jsonl"},
            "training": {"max_steps": 10},
        }
    )


def validate_kubernetes(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def pods_of(job: dict):
    for kind, replica in job["spec"]["pytorchReplicaSpecs"].items():
        template = replica["template"]
        yield (
            kind,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "x", **template["metadata"]},
                "spec": template["spec"],
            },
        )


def test_shipped_templates_load():
    templates = load_templates()
    assert {"cpu-small", "h100x1", "h100x8", "h100x8x2"} <= set(templates)
    assert templates["h100x8"].gpus_per_node == 8 and templates["cpu-small"].gpus_per_node == 0


@pytest.mark.parametrize("name", ["cpu-small", "h100x1", "h100x8", "h100x8x2"])
def test_rendered_manifests_are_valid(name):
    template = get_template(name)
    config_map, job = pytorchjob_manifests(run_config(), template, namespace="ml")
    validate_kubernetes(config_map)
    for _, pod in pods_of(job):
        validate_kubernetes(pod)
        assert restricted_violations(pod["spec"]) == []
        assert pod["spec"]["automountServiceAccountToken"] is False  # the run calls no Kubernetes API
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["triton-cache"] == "/cache/triton" and mounts["hf-cache"] == "/cache/huggingface"
        volumes = pod["spec"]["volumes"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}
        assert claims == {"triton-cache": "tigon-triton-cache", "hf-cache": "tigon-hf-cache"}
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["TRITON_CACHE_DIR"] == "/cache/triton" and env["TIGON_WARMUP"] == "1"  # kernels run here
        assert env["HF_HOME"] == "/cache/huggingface"  # models and tokenizers by Hub id land on the claim
    assert job["metadata"]["name"] == "demo-run-1"
    (replica,) = job["spec"]["pytorchReplicaSpecs"].values()
    container = replica["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["image"] == template.image
    assert container["args"][:2] == ["torchrun", f"--nproc_per_node={template.nproc_per_node}"]
    assert "command" not in container  # the image entrypoint (kernel warm-up) runs first
    assert container["resources"]["limits"].get("nvidia.com/gpu", 0) == template.gpus_per_node
    loaded = yaml.safe_load(config_map["data"]["config.yaml"])
    assert parse_config(loaded) == run_config()
    documents = list(yaml.safe_load_all(render_yaml([config_map, job])))
    assert [d["kind"] for d in documents] == ["ConfigMap", "PyTorchJob"]


def test_multi_node_job_has_only_workers_and_an_elastic_policy():
    """Workers only, as Flyte's pytorch plugin creates elastic jobs: with a Master the operator would add a root
    init container (waiting for the Master's DNS) to every Worker, which Pod Security "restricted" refuses."""
    _, job = pytorchjob_manifests(run_config(), get_template("h100x8x2"))
    spec = job["spec"]
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    # processes per node only in spec.nprocPerNode: the operator's webhook rejects elasticPolicy.nProcPerNode with it
    assert spec["nprocPerNode"] == "8"
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2, "maxRestarts": 3}
    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]


def test_a_job_that_goes_on_with_fewer_nodes_asks_torch_elastic_for_a_range():
    """`min_nnodes`: torchrun's --nnodes, the elasticPolicy and Flyte's Elastic all take the range, so a node lost
    for good leaves the job on the nodes left; a run asking for fewer nodes narrows it."""
    template = get_template("h100x8x2").model_copy(update={"min_nnodes": 1}).with_nodes(3)
    _, job = pytorchjob_manifests(run_config(), template)  # checked against the operator's rules as it renders
    spec = job["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 3, "maxRestarts": 3}
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    args = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"]
    assert "--nnodes=1:3" in args
    assert flyte_task_options(template)["task_config"].nnodes == "1:3"
    # each rendezvous round publishes its own address, so a node that joins (or comes back) finds it
    env = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in env
    assert flyte_task_options(template)["environment"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    fixed = get_template("h100x8x2")
    assert fixed.elastic_nodes == 2 and flyte_task_options(fixed)["task_config"].nnodes == 2
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in flyte_task_options(fixed)["environment"]
    assert get_template("h100x8x2").model_copy(update={"min_nnodes": 3}).fewest_nodes == 2  # up to nnodes


def test_cache_claims_mount_where_the_template_points_and_can_be_left_out():
    template = get_template("h100x8").model_copy(update={"env": {"HF_HOME": "/models"}})
    _, job = pytorchjob_manifests(run_config(), template, hf_cache_claim="shared-models")
    spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "shared-models"}} in spec["volumes"]
    assert mounts["hf-cache"] == "/models" and mounts["triton-cache"] == "/cache/triton"
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["HF_HOME"] == "/models"
    _, job = pytorchjob_manifests(run_config(), get_template("h100x8"), triton_cache_claim="", hf_cache_claim="")
    spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["config", "dshm"]
    env = {e["name"] for e in spec["containers"][0]["env"]}
    assert "HF_HOME" not in env and "TRITON_CACHE_DIR" in env  # the template's own setting stays


def test_hf_token_comes_from_a_secret_in_pytorchjobs_and_flyte_tasks():
    template = get_template("h100x8")
    _, job = pytorchjob_manifests(run_config(), template)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    reference = {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}}
    assert {"name": "HF_TOKEN", "valueFrom": reference} in container["env"]
    (primary,) = flyte_task_options(template)["pod_template"].pod_spec.containers
    (variable,) = primary.env
    assert variable.name == "HF_TOKEN" and variable.value_from.secret_key_ref.name == "hf-token"


def test_single_node_job_has_only_a_master():
    _, job = pytorchjob_manifests(run_config(), get_template("h100x8"))
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"} and "elasticPolicy" not in job["spec"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda j: j["metadata"].update(name="Bad_Name"), "DNS-1035"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief={}), "not allowed"),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"].update(Master={"replicas": 2}),
            "Master replica spec must have exactly one replica",
        ),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=0), "at least 1"),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(name="x"),
            "Worker: a container named 'pytorch'",
        ),
        (lambda j: j["spec"]["pytorchReplicaSpecs"].pop("Worker"), "pytorchReplicaSpecs is empty"),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"].update(
                Master={**j["spec"]["pytorchReplicaSpecs"].pop("Worker"), "replicas": 1}
            ),
            "needs a Worker",
        ),
        (
            lambda j: j["spec"]["elasticPolicy"].update(nProcPerNode=8),
            r"elasticPolicy.nProcPerNode \(deprecated\) must not be used with spec.nprocPerNode",
        ),
    ],
)
def test_operator_rules_reject_bad_jobs(mutate, message):
    _, job = pytorchjob_manifests(run_config(), get_template("h100x8x2"))
    check_pytorchjob(job)
    broken = copy.deepcopy(job)
    mutate(broken)
    with pytest.raises(JobSpecError, match=message):
        check_pytorchjob(broken)


def test_job_name_is_dns_1035():
    assert job_name("My_Run 42!") == "my-run-42"
    assert job_name("7b-sft") == "tigon-7b-sft"
    assert len(job_name("x" * 100)) == 63


def test_unknown_template_lists_what_exists():
    with pytest.raises(TemplateError, match="unknown job template 'h200x64'") as error:
        get_template("h200x64")
    assert "cpu-small" in str(error.value) and "h100x8" in str(error.value)


def test_request_beyond_template_limit():
    with pytest.raises(TemplateError, match="at most 1 node"):
        get_template("h100x8").with_nodes(2)
    assert get_template("h100x8x2").with_nodes(4).nnodes == 4


def test_malformed_template_names_the_key(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: bad\nimage: x\ngpus_per_node: many\n")
    with pytest.raises(TemplateError, match="gpus_per_node"):
        load_templates(tmp_path)


def test_gpu_type_needs_gpus(tmp_path):
    (tmp_path / "cpu.yaml").write_text("name: cpu\nimage: x\ngpu_type: nvidia-h100-80gb\n")
    with pytest.raises(TemplateError, match="gpu_type 'nvidia-h100-80gb' needs gpus_per_node above 0"):
        load_templates(tmp_path)


def sized_config(**changes):
    """A run of a Llama with its own sizes (from config_overrides), or with `changes` to any section."""
    raw = {
        "name": "sized",
        "model": {
            "config_name": "llama",
            "tokenizer": "char",
            "config_overrides": {
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 1000,
            },
        },
        "data": {"train": "examples/data/arithmetic-train.jsonl", "max_seq_len": 128},
        "training": {"max_steps": 1, "micro_batch_size": 4},
    }
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **values}
    return parse_config(raw)


def container_env(job: dict) -> dict[str, str]:
    (replica,) = job["spec"]["pytorchReplicaSpecs"].values()
    (container,) = replica["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_warm_up_compiles_for_the_runs_model_in_pytorchjobs_and_flyte_tasks():
    """The entrypoint's warm-up gets the run's sizes, vocabulary, family and tokens per micro-batch, in the form
    tigon.kernels.warmup's own command line reads."""
    from tigon.kernels.warmup import Shapes, _build_shapes, _parser

    config = sized_config()
    env = container_env(pytorchjob_manifests(config, get_template("h100x8x2"))[1])
    args = env["TIGON_WARMUP_ARGS"]
    assert env["TIGON_WARMUP"] == "1"
    shapes, family = _build_shapes(_parser().parse_args(args.split()))
    assert shapes == [Shapes(hidden=256, intermediate=688, heads=4, kv_heads=2, head_dim=64, tokens=512, vocab=1000)]
    assert family == "llama"
    flyte_env = flyte_task_options(get_template("h100x8x2"), config)["environment"]
    assert flyte_env["TIGON_WARMUP_ARGS"] == args and flyte_env["NCCL_IB_DISABLE"] == "1"
    assert "TIGON_WARMUP_ARGS" not in flyte_task_options(get_template("h100x8x2"))["environment"]


def test_warm_up_follows_the_kernels_setting_and_yields_to_the_template(tmp_path):
    off = container_env(pytorchjob_manifests(sized_config(kernels={"enabled": False}), get_template("h100x8"))[1])
    assert off["TIGON_WARMUP"] == "0" and "TIGON_WARMUP_ARGS" not in off
    template = get_template("h100x8").model_copy(update={"env": {"TIGON_WARMUP_ARGS": "--hidden 8192"}})
    assert container_env(pytorchjob_manifests(sized_config(), template)[1])["TIGON_WARMUP_ARGS"] == "--hidden 8192"


def test_warm_up_without_the_models_sizes_falls_back_and_says_why(tmp_path, monkeypatch, caplog):
    """A Hub model whose config cannot be fetched here: the job still renders; the pod warms the default size."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    config = sized_config(model={"config_name": None, "config_overrides": {}, "path": "tigon-test/not-cached"})
    env = container_env(pytorchjob_manifests(config, get_template("h100x8"))[1])
    assert env["TIGON_WARMUP"] == "1" and "TIGON_WARMUP_ARGS" not in env
    assert "the model's sizes are unknown here" in caplog.text and "tigon-test/not-cached" in caplog.text
