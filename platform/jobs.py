"""From a run config and a job template to what the cluster runs.

Two outputs of one mapping:
- `pytorchjob_manifests`: a ConfigMap with the validated config and a Kubeflow PyTorchJob (v1, the
  API Flyte's pytorch plugin targets), for `kubectl apply` (`tigon render-job`).
- `flyte_task_options`: the `@task` settings (Elastic config, resources, pod template, image) for
  the Flyte workflow's train task.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import yaml

from tigon.platform.templates import JobTemplate
from tigon.runtime.config import RunConfig

logger = logging.getLogger(__name__)

CONFIG_MOUNT = "/etc/tigon"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
REPLICA_TYPES = ("Master", "Worker")
#: the chart's Triton cache claim (release `tigon`) and where the image's warm-up and Triton look for it
TRITON_CACHE_CLAIM = "tigon-triton-cache"
TRITON_CACHE_DIR = "/cache/triton"
#: the chart's Hugging Face cache claim (release `tigon`) and where huggingface_hub, transformers and datasets keep it
HF_CACHE_CLAIM = "tigon-hf-cache"
HF_HOME = "/cache/huggingface"
#: each cache's volume name: the variable that points the process at it and its mount path unless a template sets it
CACHE_MOUNTS = {"triton-cache": ("TRITON_CACHE_DIR", TRITON_CACHE_DIR), "hf-cache": ("HF_HOME", HF_HOME)}
#: the image's `tigon` user; with these, every pod meets the Pod Security Standard "restricted"
TRAINER_UID = 1000
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": TRAINER_UID,
    "runAsGroup": TRAINER_UID,
    "fsGroup": TRAINER_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
#: the label that puts a job into a Kueue LocalQueue of its namespace (gang admission: all pods or none)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: the image's entrypoint warms the Triton kernels only where this is set: in train pods, where kernels run
WARMUP_ENV = {"TIGON_WARMUP": "1"}


#: an elastic job's rendezvous builds each round's address afresh: with torch elastic's shared TCP store a node that
#: stays rank 0 when another joins does not publish the new round's address, and the joining node waits until its
#: timeout (tests/runtime/test_elastic.py)
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def elastic_env(template: JobTemplate) -> dict[str, str]:
    """ELASTIC_ENV for a job that may change its number of nodes (min_nnodes), else nothing."""
    return dict(ELASTIC_ENV) if template.fewest_nodes < template.nnodes else {}


def warmup_env(config: RunConfig) -> dict[str, str]:
    """The entrypoint's warm-up settings for this run: TIGON_WARMUP_ARGS with the model's sizes, vocabulary, family
    and tokens per micro-batch, so the kernels compiled before training are the ones the run uses. Without the
    sizes (a Hub config that cannot be fetched here) the entrypoint warms its default size; with the kernels off
    there is nothing to warm. A template's own TIGON_WARMUP / TIGON_WARMUP_ARGS take precedence over these."""
    if not config.kernels.enabled:
        return {"TIGON_WARMUP": "0"}
    from tigon.kernels.warmup import family_of
    from tigon.runtime.planner import model_shape

    try:
        shape = model_shape(config)
    except (OSError, ValueError) as error:
        logger.warning("kernel warm-up: the model's sizes are unknown here (%s); it warms its default size", error)
        return dict(WARMUP_ENV)
    tokens = config.training.micro_batch_size * config.data.max_seq_len
    args = (
        f"--hidden {shape.hidden} --intermediate {shape.intermediate} --heads {shape.heads} "
        f"--kv-heads {shape.kv_heads} --head-dim {shape.head_dim} --vocab {shape.vocab} --tokens {tokens} "
        f"--family {family_of(shape.model_type)}"
    )
    return {**WARMUP_ENV, "TIGON_WARMUP_ARGS": args}


class JobSpecError(ValueError):
    """A manifest the training-operator would reject; the message names the rule."""


def job_name(run_name: str) -> str:
    """A DNS-1035 label from a run name: lower case, dashes, starts with a letter, at most 63 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"tigon-{name}".rstrip("-")
    return name[:63].rstrip("-")


def torchrun_command(template: JobTemplate) -> list[str]:
    """The container command: torchrun reads the node count and rendezvous from the operator's PET_* env."""
    command = ["torchrun", f"--nproc_per_node={template.nproc_per_node}"]
    if template.nnodes == 1:
        command.append("--standalone")
    else:
        command += [
            f"--nnodes={template.elastic_nodes}",
            "--rdzv_backend=c10d",
            f"--max_restarts={template.max_restarts}",
        ]
    return command + ["-m", "tigon.runtime", "train", f"{CONFIG_MOUNT}/config.yaml"]


def _resources(template: JobTemplate) -> dict[str, dict[str, Any]]:
    amounts: dict[str, Any] = {"cpu": template.cpu, "memory": template.memory}
    if template.gpus_per_node:
        amounts["nvidia.com/gpu"] = template.gpus_per_node
    return {"requests": dict(amounts), "limits": dict(amounts)}


def secret_env(template: JobTemplate) -> list[dict[str, Any]]:
    """The template's variables from Secrets, as container `env` entries with `valueFrom.secretKeyRef`."""
    return [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key, "optional": ref.optional}}}
        for name, ref in sorted(template.secret_env.items())
    ]


def _pod_template(
    template: JobTemplate, config_map: str, run: str, cache_claims: dict[str, str], warmup: dict[str, str]
) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": config_map}}]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    env = {**warmup, **elastic_env(template), **template.env}
    if template.shared_memory:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": template.shared_memory}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    for volume, claim in cache_claims.items():
        if claim:
            variable, path = CACHE_MOUNTS[volume]
            volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim}})
            mounts.append({"name": volume, "mountPath": env.setdefault(variable, path)})
    container = {
        "name": "pytorch",
        "image": template.image,
        "args": torchrun_command(template),  # args, not command: the image's entrypoint warms the kernels first
        "env": [{"name": key, "value": value} for key, value in sorted(env.items())] + secret_env(template),
        "resources": _resources(template),
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the run calls no Kubernetes API
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": volumes,
    }
    if template.node_selector:
        spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True) for t in template.tolerations]
    if template.priority_class:
        spec["priorityClassName"] = template.priority_class
    if template.service_account:
        spec["serviceAccountName"] = template.service_account
    if template.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in template.image_pull_secrets]
    labels = {"app.kubernetes.io/name": "tigon", "tigon.dev/run": run, "tigon.dev/job-template": template.name}
    return {"metadata": {"labels": labels}, "spec": spec}


def pytorchjob_manifests(
    config: RunConfig,
    template: JobTemplate,
    namespace: str | None = None,
    triton_cache_claim: str = TRITON_CACHE_CLAIM,
    hf_cache_claim: str = HF_CACHE_CLAIM,
) -> list[dict]:
    """A ConfigMap holding the run config and the PyTorchJob that trains it.

    One node: a single Master replica (torchrun --standalone). Several: Workers only with an elasticPolicy, as
    Flyte's pytorch plugin creates them; with a Master beside them the operator would add a root init container
    to every Worker. `triton_cache_claim` and `hf_cache_claim`: the Triton and Hugging Face cache claims to mount
    ("" for none), at the template's TRITON_CACHE_DIR and HF_HOME if it sets them. A template's `queue` labels the
    job for Kueue, which then admits it whole (all pods at once) or holds it suspended.
    """
    name = job_name(config.name)
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "tigon", "tigon.dev/run": name}}
    if namespace:
        metadata["namespace"] = namespace
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**metadata, "name": f"{name}-config"},
        "data": {"config.yaml": yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)},
    }
    claims = {"triton-cache": triton_cache_claim, "hf-cache": hf_cache_claim}
    pod = _pod_template(template, f"{name}-config", name, claims, warmup_env(config))
    replica = "Master" if template.nnodes == 1 else "Worker"
    replicas = {replica: {"replicas": template.nnodes, "restartPolicy": "OnFailure", "template": pod}}
    spec: dict[str, Any] = {
        "nprocPerNode": str(template.nproc_per_node),
        "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": template.max_restarts},
        "pytorchReplicaSpecs": replicas,
    }
    if template.nnodes > 1:
        spec["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "minReplicas": template.fewest_nodes,
            "maxReplicas": template.nnodes,
            "maxRestarts": template.max_restarts,
        }
    job_metadata = copy.deepcopy(metadata)
    if template.queue:
        job_metadata["labels"][KUEUE_QUEUE_LABEL] = template.queue
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": job_metadata, "spec": spec}
    check_pytorchjob(job)
    return [config_map, job]


def check_pytorchjob(job: dict) -> None:
    """The PyTorchJob v1 rules of the training-operator's API and admission webhook."""
    name = job.get("metadata", {}).get("name", "")
    if not DNS_1035.match(name) or len(name) > 63:
        raise JobSpecError(f"PyTorchJob name {name!r} is not a DNS-1035 label (a-z, 0-9, '-', starts with a letter)")
    specs = job.get("spec", {}).get("pytorchReplicaSpecs", {})
    unknown = set(specs) - set(REPLICA_TYPES)
    if unknown:
        raise JobSpecError(f"replica types {sorted(unknown)} are not allowed; only {REPLICA_TYPES}")
    if not specs:
        raise JobSpecError("spec.pytorchReplicaSpecs is empty: give a Master (one node) or Workers (elastic)")
    if "Master" in specs and specs["Master"].get("replicas") != 1:
        raise JobSpecError("a Master replica spec must have exactly one replica; put further nodes in Worker")
    if "Worker" in specs and specs["Worker"].get("replicas", 1) < 1:
        raise JobSpecError("Worker replicas must be at least 1")
    for kind, replica in specs.items():
        containers = replica.get("template", {}).get("spec", {}).get("containers", [])
        pytorch = [c for c in containers if c.get("name") == "pytorch"]
        if not pytorch or not pytorch[0].get("image"):
            raise JobSpecError(f"{kind}: a container named 'pytorch' with an image is required")
    elastic = job["spec"].get("elasticPolicy")
    if elastic is not None and "Worker" not in specs:
        raise JobSpecError("elasticPolicy needs a Worker replica spec")
    if elastic and "nProcPerNode" in elastic and "nprocPerNode" in job["spec"]:
        raise JobSpecError(
            "elasticPolicy.nProcPerNode (deprecated) must not be used with spec.nprocPerNode: "
            "drop elasticPolicy.nProcPerNode"
        )


def render_yaml(manifests: list[dict]) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=False)


def flyte_task_options(template: JobTemplate, config: RunConfig | None = None) -> dict[str, Any]:
    """Keyword arguments for flytekit's `@task` that run the train task as this template says; with the run's
    config, its kernel warm-up compiles for the run's model (`warmup_env`)."""
    from flytekit import PodTemplate, Resources
    from flytekit.extras.accelerators import GPUAccelerator
    from flytekitplugins.kfpytorch import Elastic
    from kubernetes.client import (
        V1Capabilities,
        V1Container,
        V1EnvVar,
        V1EnvVarSource,
        V1LocalObjectReference,
        V1PodSecurityContext,
        V1PodSpec,
        V1SeccompProfile,
        V1SecretKeySelector,
        V1SecurityContext,
        V1Toleration,
    )

    resources = Resources(
        cpu=template.cpu, mem=template.memory, gpu=str(template.gpus_per_node) if template.gpus_per_node else None
    )
    pod_security = V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=TRAINER_UID,
        run_as_group=TRAINER_UID,
        fs_group=TRAINER_UID,
        seccomp_profile=V1SeccompProfile(type="RuntimeDefault"),
    )
    container_security = V1SecurityContext(allow_privilege_escalation=False, capabilities=V1Capabilities(drop=["ALL"]))
    secrets = [
        V1EnvVar(
            name=name,
            value_from=V1EnvVarSource(
                secret_key_ref=V1SecretKeySelector(name=ref.secret, key=ref.key, optional=ref.optional)
            ),
        )
        for name, ref in sorted(template.secret_env.items())
    ]
    pod_spec = V1PodSpec(
        containers=[V1Container(name="primary", security_context=container_security, env=secrets or None)],
        security_context=pod_security,
        automount_service_account_token=False,
        node_selector=template.node_selector or None,
        tolerations=[V1Toleration(**t.model_dump(exclude_none=True)) for t in template.tolerations] or None,
        priority_class_name=template.priority_class,
        service_account_name=template.service_account,
        image_pull_secrets=[V1LocalObjectReference(name=name) for name in template.image_pull_secrets] or None,
    )
    options: dict[str, Any] = {
        "task_config": Elastic(
            nnodes=template.elastic_nodes,
            nproc_per_node=template.nproc_per_node,
            max_restarts=template.max_restarts,
            increase_shared_mem=False,
        ),
        "requests": resources,
        "limits": resources,
        "pod_template": PodTemplate(pod_spec=pod_spec),
        "container_image": template.image,
        "environment": {**(warmup_env(config) if config else WARMUP_ENV), **elastic_env(template), **template.env},
        # Flyte retries a FlyteRecoverableException (lost node, network) as often as a PyTorchJob's backoffLimit.
        "retries": template.max_restarts,
    }
    if template.shared_memory:
        options["shared_memory"] = template.shared_memory
    if template.gpu_type:  # Flyte turns the accelerator into a node selector for that GPU type
        options["accelerator"] = GPUAccelerator(template.gpu_type)
    return options
