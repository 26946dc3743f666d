"""What Flyte does with the chart's values on a real cluster, checked with Flyte's own configuration keys.

- flyteadmin's `task_resources` limits: propeller lowers every task's requests and limits to them, the train
  tasks of the dynamic train step included (registration never sees those), so they must hold every job template.
- propeller's `plugins.k8s.gpu-device-node-label`: a task's accelerator (a template's `gpu_type`) becomes a required
  node affinity `<label> In [gpu_type]`, so the label must be the one the cloud's GPU nodes carry.
- the cloud values: the database password mounted where `passwordPath` says, TLS and a gRPC backend on the
  ingress pyflyte uses, authentication on.
- `helm upgrade --install --wait` waits until every PersistentVolumeClaim is Bound; on kind a claim binds only once a
  pod uses it, so the kind values must render no claim that no pod of the release uses.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import kubernetes_validate
import pytest
from kubernetes.utils import parse_quantity

from tests.deploy.helm import (
    KUBERNETES_VERSION,
    VALUES_FILES,
    effective_values,
    load_values,
    merge_values,
    objects,
    pod_specs,
    render,
)
from tigon.platform.jobs import flyte_task_options
from tigon.platform.templates import REPO_TEMPLATES, JobTemplate, load_templates

# The keys Flyte 1.16 reads (flyteadmin/pkg/runtime/task_resource_provider.go: section `task_resources` with
# `defaults` and `limits`, each a TaskResourceSet; flyteplugins' flytek8s/config/config.go: the `plugins.k8s` keys).
TASK_RESOURCE_KEYS = {"cpu", "gpu", "memory", "ephemeralStorage"}
K8S_PLUGIN_KEYS = {"default-pod-template-name", "gpu-device-node-label", "gpu-partition-size-node-label"}
CLOUD_VALUES = ["values.yaml", "values-aws.yaml", "values-gcp.yaml"]

# A GPU node as each cloud labels and taints it. GKE sets cloud.google.com/gke-accelerator to the accelerator type
# and taints GPU node pools nvidia.com/gpu=present:NoSchedule; EKS sets no accelerator label, so docs/deploy.md has
# the node groups labelled k8s.amazonaws.com/accelerator=<gpu_type> (propeller's default label).
GPU_NODES = {
    "values.yaml": ({"k8s.amazonaws.com/accelerator": "nvidia-h100-80gb"}, []),
    "values-aws.yaml": ({"k8s.amazonaws.com/accelerator": "nvidia-h100-80gb"}, []),
    "values-gcp.yaml": (
        {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "cloud.google.com/gke-nodepool": "h100"},
        [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    ),
}


def flyte_config(values_file: str) -> dict:
    """flyte-binary's inline configuration (merged by Flyte into its config files) for this values file."""
    return effective_values(values_file)["flyte-binary"]["configuration"]["inline"]


def release_templates(values_file: str) -> list[JobTemplate]:
    """The job templates of a release (its values) and those tigon's workflow submits (deploy/job-templates)."""
    values = effective_values(values_file)["jobTemplates"]
    return [JobTemplate.model_validate(t) for t in values.values()] + list(load_templates(REPO_TEMPLATES).values())


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_task_resource_limits_hold_every_job_template(values_file):
    resources = flyte_config(values_file)["task_resources"]
    assert set(resources) == {"defaults", "limits"}
    assert set(resources["defaults"]) | set(resources["limits"]) <= TASK_RESOURCE_KEYS
    limits = {key: parse_quantity(str(value)) for key, value in resources["limits"].items()}
    for key, value in resources["defaults"].items():
        assert parse_quantity(str(value)) <= limits[key], f"task_resources.defaults.{key} is above its limit"
    for template in release_templates(values_file):
        asked = {"cpu": template.cpu, "memory": template.memory, "gpu": template.gpus_per_node}
        for key, amount in asked.items():
            assert key in limits, f"{values_file}: task_resources.limits.{key} is unset (Flyte's default is low)"
            assert parse_quantity(str(amount)) <= limits[key], (
                f"{values_file}: job template {template.name} asks for {key} {amount}, above Flyte's "
                f"task_resources.limits.{key} {resources['limits'][key]}: propeller would shrink its train pods"
            )


def test_flyte_defaults_would_shrink_the_gpu_templates():
    """Without the values' limits Flyte's own (2 CPU, 1Gi, 1 GPU) apply: the check above would fail."""
    builtin = {"cpu": parse_quantity("2"), "memory": parse_quantity("1Gi"), "gpu": parse_quantity("1")}
    h100x8 = load_templates(REPO_TEMPLATES)["h100x8"]
    assert parse_quantity(h100x8.memory) > builtin["memory"] and h100x8.gpus_per_node > builtin["gpu"]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_k8s_plugin_keys_are_flytes(values_file):
    k8s = flyte_config(values_file)["plugins"]["k8s"]
    assert set(k8s) <= K8S_PLUGIN_KEYS, f"keys Flyte's k8s plugin does not read: {set(k8s) - K8S_PLUGIN_KEYS}"
    assert k8s["default-pod-template-name"] == effective_values(values_file)["podTemplates"]["defaultName"]


def schedulable(pod_spec: dict, device_label: str, device: str | None, labels: dict, taints: list) -> list[str]:
    """Why the node cannot take the pod, after propeller's ApplyGPUNodeSelectors (empty: it can)."""
    reasons = []
    tolerations = list(pod_spec.get("tolerations") or [])
    if device:  # propeller: required affinity <label> In [device], and a toleration for a taint of that label
        if labels.get(device_label) != device:
            reasons.append(f"node affinity {device_label} In [{device}]")
        tolerations.append({"key": device_label, "operator": "Equal", "value": device, "effect": "NoSchedule"})
    for key, value in (pod_spec.get("node_selector") or {}).items():
        if labels.get(key) != value:
            reasons.append(f"nodeSelector {key}={value}")
    for taint in taints:
        tolerated = any(
            t["key"] == taint["key"]
            and (t.get("operator") == "Exists" or t.get("value") == taint["value"])
            and t.get("effect") in (None, taint["effect"])
            for t in tolerations
        )
        if not tolerated:
            reasons.append(f"taint {taint}")
    return reasons


@pytest.mark.parametrize("values_file", CLOUD_VALUES)
def test_gpu_train_tasks_schedule_on_the_clouds_gpu_nodes(values_file):
    label = flyte_config(values_file)["plugins"]["k8s"]["gpu-device-node-label"]
    labels, taints = GPU_NODES[values_file]
    gpu_templates = [t for t in load_templates(REPO_TEMPLATES).values() if t.gpus_per_node]
    assert gpu_templates
    for template in gpu_templates:
        options = flyte_task_options(template)
        device = options["accelerator"].to_flyte_idl().device
        pod_spec = options["pod_template"].pod_spec.to_dict()
        tolerations = [{k: v for k, v in t.items() if v is not None} for t in pod_spec.get("tolerations") or []]
        reasons = schedulable({**pod_spec, "tolerations": tolerations}, label, device, labels, taints)
        assert not reasons, f"{values_file}: {template.name}'s train pod does not fit a GPU node: {reasons}"


def test_gke_needs_its_own_gpu_label():
    """With propeller's default label a GKE node never matches: the check above catches a missing override."""
    labels, taints = GPU_NODES["values-gcp.yaml"]
    assert schedulable({}, "k8s.amazonaws.com/accelerator", "nvidia-h100-80gb", labels, taints)


def unconsumed_claims(objs: list[dict]) -> set[tuple[str, str]]:
    """Claims that no pod the release starts (before its hooks) uses: `helm --wait` waits on them while a
    WaitForFirstConsumer StorageClass keeps them Pending."""
    claims = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs if o["kind"] == "PersistentVolumeClaim"}
    used = set()
    for obj in objs:
        if obj["kind"] == "PodTemplate" or "helm.sh/hook" in obj["metadata"].get("annotations", {}):
            continue  # a PodTemplate starts no pod; hooks run after the wait
        for spec in pod_specs(obj):
            for volume in spec.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    used.add((obj["metadata"]["namespace"], volume["persistentVolumeClaim"]["claimName"]))
    return claims - used


def test_kind_install_waits_on_no_unbound_claim():
    kind = load_values("values-kind.yaml")
    assert unconsumed_claims(objects(render(kind))) == set()
    with_caches = merge_values(kind, {"tritonCache": {"enabled": True}, "hfCache": {"enabled": True}})
    assert unconsumed_claims(objects(render(with_caches))) == {
        ("tigon-development", "tigon-triton-cache"),
        ("tigon-development", "tigon-hf-cache"),
    }


# How each cloud's ingress controller is told that the admin service speaks gRPC (HTTP/2 to the backend).
GRPC_BACKEND = {
    "alb": ("alb.ingress.kubernetes.io/backend-protocol-version", "GRPC"),
    "nginx": ("nginx.ingress.kubernetes.io/backend-protocol", "GRPC"),
}


@pytest.mark.parametrize("values_file", ["values-aws.yaml", "values-gcp.yaml"])
def test_cloud_flyte_mounts_its_database_password(values_file):
    flyte = effective_values(values_file)["flyte-binary"]
    path = PurePosixPath(flyte["configuration"]["database"]["passwordPath"])
    deployment = flyte["deployment"]
    (mount,) = [m for m in deployment["extraVolumeMounts"] if PurePosixPath(m["mountPath"]) == path.parent]
    (volume,) = [v for v in deployment["extraVolumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] and mount["readOnly"] is True  # a Secret's key `password` is that file
    assert path.name == "password"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "flyte"},
        "spec": {
            "containers": [{"name": "flyte", "image": "flyte", "volumeMounts": deployment["extraVolumeMounts"]}],
            "volumes": deployment["extraVolumes"],
        },
    }
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    assert "password" not in flyte["configuration"]["database"]  # no password in the values


@pytest.mark.parametrize("values_file", ["values-aws.yaml", "values-gcp.yaml"])
def test_cloud_flyte_is_behind_tls_with_a_grpc_backend_and_authentication(values_file):
    values = effective_values(values_file)
    flyte = values["flyte-binary"]
    ingress = flyte["ingress"]
    host = ingress["host"]
    assert ingress["create"] and ingress["separateGrpcIngress"]
    assert any(host in entry["hosts"] for entry in ingress["tls"])
    key, value = GRPC_BACKEND[ingress["ingressClassName"]]
    assert ingress["grpcAnnotations"][key] == value
    assert values["flyte"]["endpoint"] == f"dns:///{host}:443"  # pyflyte reaches the API through the ingress
    auth = flyte["configuration"]["auth"]
    assert auth["enabled"] is True and auth["oidc"]["baseUrl"] and auth["oidc"]["clientId"]
    assert auth["clientSecretsExternalSecretRef"] and auth["internal"]["clientSecretHash"]
    assert "clientSecret" not in auth["oidc"] and "clientSecret" not in auth["internal"]  # secrets stay out of values
    assert f"https://{host}" in auth["authorizedUris"]
