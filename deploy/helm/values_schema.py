"""The one source of the tigon chart's `values.schema.json`.

Every value the chart reads is a field of a pydantic model below, with its type, limits and a
description. Models forbid unknown keys, so the generated JSON schema carries
`additionalProperties: false` and `helm lint`, `helm template` and `helm install` reject a
mistyped value. The job templates reuse `tigon.platform.templates.JobTemplate`, so the chart
accepts exactly the fields of `deploy/job-templates/*.yaml`.

    python deploy/helm/values_schema.py            # rewrite deploy/helm/tigon/values.schema.json
    python deploy/helm/values_schema.py --check    # exit 1 if the committed schema is stale

`training-operator` is tigon's own sub-chart (charts/training-operator/): its values are typed here in
full. `flyte-binary` owns its values: only its `enabled` switch is typed, the rest passes through to it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from tigon.platform.templates import JobTemplate

CHART = Path(__file__).resolve().parent / "tigon"
SCHEMA_PATH = CHART / "values.schema.json"

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$"
# An image tag (Docker's tag grammar); `latest` is refused separately (RE2, Helm's regexp, has no look-ahead).
IMAGE_TAG = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
DnsLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL, max_length=63)]


class Values(BaseModel):
    """Base of every section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Image(Values):
    repository: str = Field(min_length=1, description="image repository, e.g. docker.io/minio/minio")
    tag: str = Field(
        pattern=IMAGE_TAG,
        json_schema_extra={"not": {"const": "latest"}},
        description="a pinned tag; `latest` is refused",
    )
    pullPolicy: Literal["IfNotPresent", "Always", "Never"] = Field("IfNotPresent", description="image pull policy")

    @field_validator("tag")
    @classmethod
    def _pinned(cls, tag: str) -> str:
        if tag == "latest":
            raise ValueError("the image tag `latest` is not pinned; name a version")
        return tag


class Resources(Values):
    requests: dict[str, str | int] = Field(default_factory=dict, description="resource requests, e.g. cpu: 100m")
    limits: dict[str, str | int] = Field(default_factory=dict, description="resource limits, e.g. memory: 512Mi")


class Persistence(Values):
    size: str = Field("10Gi", pattern=QUANTITY, description="size of the PersistentVolumeClaim")
    storageClassName: str | None = Field(None, description="storage class; null uses the cluster's default")


class PodSecurity(Values):
    enforce: Literal["privileged", "baseline", "restricted"] = Field(
        "restricted", description="Pod Security Standard enforced on the training namespaces"
    )
    warn: Literal["privileged", "baseline", "restricted"] = Field(
        "restricted", description="Pod Security Standard that only warns on the training namespaces"
    )


class Namespaces(Values):
    create: bool = Field(True, description="create the training namespaces (false: they exist already)")
    training: list[DnsLabel] = Field(
        default_factory=lambda: ["tigon-development"],
        min_length=1,
        description="namespaces where training pods run; Flyte runs a project's tasks in <project>-<domain>",
    )
    podSecurity: PodSecurity = Field(default_factory=PodSecurity, description="Pod Security Admission labels")
    resourceQuota: dict[str, str | int] = Field(
        default_factory=dict,
        description="ResourceQuota `hard` of each training namespace, e.g. requests.nvidia.com/gpu: 16 (empty: none)",
    )
    networkPolicy: bool = Field(
        True, description="admit traffic into training pods only from pods of their own namespace"
    )


class ServiceAccount(Values):
    create: bool = Field(True, description="create the training service account in every training namespace")
    name: str = Field("tigon-trainer", pattern=DNS_LABEL, description="its name; job templates refer to it")
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="annotations, e.g. eks.amazonaws.com/role-arn or iam.gke.io/gcp-service-account",
    )


class SecurityContext(Values):
    runAsUser: int = Field(1000, ge=1, description="uid of training containers (the image's `tigon` user)")
    runAsGroup: int = Field(1000, ge=1, description="gid of training containers")
    fsGroup: int = Field(1000, ge=1, description="group that owns mounted volumes (the Triton and Hugging Face caches)")


class Rbac(Values):
    create: bool = Field(
        False, description="create a read-only Role (configmaps, pods) for training pods; tigon's own use no API"
    )


class Trainer(Values):
    serviceAccount: ServiceAccount = Field(default_factory=ServiceAccount, description="training service account")
    rbac: Rbac = Field(default_factory=Rbac, description="training pods' RBAC")
    automountServiceAccountToken: bool = Field(
        False, description="mount the service account token in training pods (tigon's own call no Kubernetes API)"
    )
    securityContext: SecurityContext = Field(default_factory=SecurityContext, description="non-root identity")
    imagePullSecrets: list[str] = Field(default_factory=list, description="pull secrets added to every pod template")


class PriorityClass(Values):
    name: DnsLabel = Field(description="name a job template's priority_class refers to")
    value: int = Field(ge=-2147483648, le=1000000000, description="priority; higher preempts lower")
    description: str = Field("", description="what it is for")
    preemptionPolicy: Literal["PreemptLowerPriority", "Never"] = Field(
        "PreemptLowerPriority", description="whether its pods preempt lower-priority pods"
    )


class KueueQuota(Values):
    cpu: str | int = Field(description='CPUs the flavor gives the ClusterQueue, e.g. "192"')
    memory: str = Field(description="memory the flavor gives the ClusterQueue, e.g. 1800Gi")
    nvidia_gpu: int = Field(ge=0, alias="nvidia.com/gpu", description="GPUs the flavor gives the ClusterQueue")


class KueueFlavor(Values):
    name: DnsLabel = Field(description="the ResourceFlavor's name (cluster-wide)")
    nodeLabels: dict[str, str] = Field(
        default_factory=dict, description="labels of the flavor's nodes; Kueue adds them to admitted pods' selectors"
    )
    quota: KueueQuota = Field(description="nominal quota of cpu, memory and nvidia.com/gpu in this flavor")


class Kueue(Values):
    enabled: bool = Field(False, description="create the ResourceFlavors, the ClusterQueue and the LocalQueues")
    clusterQueue: DnsLabel = Field("tigon-training", description="the ClusterQueue the training namespaces share")
    localQueue: DnsLabel = Field(
        "default", description="the LocalQueue in each training namespace; job templates name it in `queue`"
    )
    queueingStrategy: Literal["BestEffortFIFO", "StrictFIFO"] = Field(
        "BestEffortFIFO", description="whether an older job that does not fit blocks newer ones (StrictFIFO)"
    )
    flavors: list[KueueFlavor] = Field(
        default_factory=list, min_length=1, description="ResourceFlavors in the order Kueue tries them, with quotas"
    )


class PodTemplates(Values):
    enabled: bool = Field(
        True, description="also render each job template as a PodTemplate <prefix><name>, for other Flyte tasks"
    )
    prefix: str = Field("tigon-", description="prefix of the PodTemplate names")
    default: str | None = Field(
        "cpu-small", description="job template rendered as Flyte's default PodTemplate; null renders none"
    )
    defaultName: str = Field(
        "tigon-default",
        pattern=DNS_LABEL,
        description="name of the default PodTemplate; must equal Flyte's plugins.k8s.default-pod-template-name",
    )


class CacheVolume(Values):
    """A persistent cache mounted into every training pod: a claim per training namespace, or an existing one."""

    enabled: bool = Field(True, description="mount the cache into training pods")
    mountPath: str = Field(description="where it is mounted")
    size: str = Field(pattern=QUANTITY, description="size of the cache volume claim")
    storageClassName: str | None = Field(None, description="storage class; null uses the cluster's default")
    accessModes: list[Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]] = Field(
        default_factory=lambda: ["ReadWriteMany"], min_length=1, description="ReadWriteMany lets nodes share it"
    )
    existingClaim: str = Field("", description="use this claim instead of creating one per training namespace")


class TritonCache(CacheVolume):
    enabled: bool = Field(True, description="mount a persistent Triton kernel cache into training pods")
    mountPath: str = Field("/cache/triton", description="where it is mounted; TRITON_CACHE_DIR points here")
    size: str = Field("20Gi", pattern=QUANTITY, description="size of the cache volume claim")


class HfCache(CacheVolume):
    enabled: bool = Field(True, description="mount a persistent Hugging Face cache into training pods")
    mountPath: str = Field("/cache/huggingface", description="where it is mounted; HF_HOME points here")
    size: str = Field("100Gi", pattern=QUANTITY, description="size of the cache volume claim (an 8B model: 16 GB)")


class ObjectStore(Values):
    provider: Literal["minio", "s3", "gcs"] = Field(
        "s3", description="the object store training pods reach: minio (kind), s3 or gcs"
    )
    region: str = Field("", description="bucket region (S3): AWS_REGION of the training pods")
    endpoint: str = Field("", description="S3-compatible endpoint URL (MinIO); empty for AWS S3 and GCS")
    credentialsSecret: str = Field(
        "", description="Secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; empty uses workload identity"
    )


class MinioService(Values):
    type: Literal["ClusterIP", "NodePort"] = Field("ClusterIP", description="NodePort exposes it on kind's host port")
    nodePort: int | None = Field(None, ge=30000, le=32767, description="node port of the S3 API when type is NodePort")


class Minio(Values):
    enabled: bool = Field(False, description="run MinIO in the release namespace (kind and other test clusters)")
    image: Image = Field(
        default_factory=lambda: Image(repository="docker.io/minio/minio", tag="RELEASE.2024-12-18T13-15-44Z"),
        description="MinIO server image",
    )
    clientImage: Image = Field(
        default_factory=lambda: Image(repository="docker.io/minio/mc", tag="RELEASE.2024-11-21T17-21-54Z"),
        description="MinIO client image of the bucket-creating post-install Job",
    )
    rootUser: str = Field("minio", min_length=3, description="MinIO root user (also the S3 access key)")
    rootPassword: str = Field("miniostorage", min_length=8, description="MinIO root password (S3 secret key)")
    trainerUser: str = Field(
        "tigon-trainer", min_length=3, description="MinIO user whose keys the training pods get (not the root user)"
    )
    trainerPassword: str = Field(
        "tigon-trainer-kind-only", min_length=8, description="that user's password, the pods' S3 secret key"
    )
    buckets: list[DnsLabel] = Field(
        default_factory=lambda: ["flyte", "tigon"], description="buckets created after install"
    )
    service: MinioService = Field(default_factory=MinioService, description="Service of the S3 API (port 9000)")
    persistence: Persistence = Field(default_factory=Persistence, description="MinIO data volume")
    resources: Resources = Field(default_factory=Resources, description="MinIO container resources")


class Postgres(Values):
    enabled: bool = Field(False, description="run PostgreSQL for Flyte in the release namespace (kind)")
    image: Image = Field(
        default_factory=lambda: Image(repository="docker.io/library/postgres", tag="16.6"), description="image"
    )
    database: str = Field("flyte", min_length=1, description="database Flyte uses")
    username: str = Field("flyte", min_length=1, description="database user")
    password: str = Field("flyte-kind-only", min_length=8, description="database password (kind only: use a Secret)")
    persistence: Persistence = Field(default_factory=Persistence, description="database volume")
    resources: Resources = Field(default_factory=Resources, description="PostgreSQL container resources")


class DevicePlugin(Values):
    enabled: bool = Field(False, description="run the NVIDIA device plugin DaemonSet (off when the GPU Operator runs)")
    namespace: str = Field("kube-system", pattern=DNS_LABEL, description="namespace of the DaemonSet")
    image: Image = Field(
        default_factory=lambda: Image(repository="nvcr.io/nvidia/k8s-device-plugin", tag="v0.17.1"),
        description="device plugin image",
    )
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="nodes it runs on")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="taints it tolerates",
    )
    priorityClassName: str = Field("system-node-critical", description="priority class of the DaemonSet pods")
    resources: Resources = Field(default_factory=Resources, description="device plugin container resources")


class FlyteRbac(Values):
    create: bool = Field(
        True, description="give an existing Flyte's service account the pytorchjobs rules its default role lacks"
    )
    serviceAccountName: str = Field("flyte-binary", description="Flyte's service account (flyte-binary's default)")
    serviceAccountNamespace: str = Field("", description="its namespace; empty means the release namespace")


class Flyte(Values):
    endpoint: str = Field(
        "dns:///flyte-binary-grpc.flyte.svc.cluster.local:8089",
        description="Flyte admin gRPC endpoint that pyflyte --remote uses (shown in NOTES)",
    )
    httpEndpoint: str = Field(
        "http://flyte-binary-http.flyte.svc.cluster.local:8088",
        description="Flyte HTTP endpoint; the helm test checks <httpEndpoint>/healthcheck",
    )
    project: str = Field("tigon", pattern=DNS_LABEL, description="Flyte project the workflows are registered in")
    domain: str = Field("development", pattern=DNS_LABEL, description="Flyte domain runs go to")
    rbac: FlyteRbac = Field(default_factory=FlyteRbac, description="pytorchjobs RBAC for Flyte's service account")


class Tests(Values):
    enabled: bool = Field(True, description="render the `helm test` pod")
    image: Image = Field(
        default_factory=lambda: Image(repository="docker.io/curlimages/curl", tag="8.11.1"),
        description="image with curl for the test pod",
    )


# An image reference with a tag or digest (the operator's --pytorch-init-container-image).
IMAGE_REF = r"^[^:@\s]+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$"


class OperatorCrd(Values):
    create: bool = Field(True, description="install the PyTorchJob CRD (false: the cluster has it already)")
    keep: bool = Field(
        True, description="keep the CRD on helm uninstall (deleting it deletes every PyTorchJob in the cluster)"
    )


class OperatorWebhook(Values):
    failurePolicy: Literal["Fail", "Ignore"] = Field(
        "Fail", description="Fail refuses PyTorchJobs while the operator is down; Ignore admits them unvalidated"
    )
    timeoutSeconds: int = Field(10, ge=1, le=30, description="seconds the API server waits for the webhook")


class TrainingOperator(Values):
    """tigon's training-operator chart (Kubeflow training-operator v1.9, PyTorchJob only)."""

    enabled: bool = Field(
        True, description="install the operator and the PyTorchJob CRD; false keeps the cluster's existing operator"
    )
    image: Image = Field(
        default_factory=lambda: Image(repository="docker.io/kubeflow/training-operator", tag="v1-3f15cb8"),
        description="operator image; v1-3f15cb8 is the v1.9.2 release build (Kubeflow tags v1 images by commit)",
    )
    imagePullSecrets: list[str] = Field(default_factory=list, description="pull secrets of the operator pod")
    replicas: int = Field(1, ge=1, le=5, description="operator replicas; leader election picks the active one")
    controllerThreads: int = Field(1, ge=1, le=64, description="PyTorchJobs reconciled in parallel")
    logLevel: Literal["debug", "info", "error"] = Field("info", description="operator log level (--zap-log-level)")
    pytorchInitContainerImage: str = Field(
        "docker.io/library/alpine:3.10",
        pattern=IMAGE_REF,
        json_schema_extra={"not": {"pattern": ":latest$"}},
        description="image of the init container that makes Worker pods wait for the Master's DNS; pinned",
    )
    gangSchedulerName: str = Field(
        "",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description='gang scheduler for PodGroups: "" (off), "volcano" or a scheduler-plugins scheduler name',
    )
    crd: OperatorCrd = Field(default_factory=OperatorCrd, description="the PyTorchJob CRD")
    webhook: OperatorWebhook = Field(default_factory=OperatorWebhook, description="the PyTorchJob validating webhook")
    resources: Resources = Field(default_factory=Resources, description="operator container resources")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="nodes the operator may run on")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="taints the operator tolerates")
    affinity: dict[str, Any] = Field(default_factory=dict, description="affinity of the operator pod")
    priorityClassName: str = Field("", description="priority class of the operator pod; empty for none")
    # Helm copies the parent's `global` values into every sub-chart's values before validating them.
    global_: dict[str, Any] = Field(default_factory=dict, alias="global", description="Helm's global values")

    @field_validator("pytorchInitContainerImage")
    @classmethod
    def _pinned(cls, image: str) -> str:
        if image.endswith(":latest"):
            raise ValueError("the init container image `latest` is not pinned; name a version")
        return image


class SubChart(BaseModel):
    """A dependency's values: `enabled` is typed here, the rest belongs to the sub-chart."""

    model_config = ConfigDict(extra="allow")

    enabled: bool = Field(True, description="install this dependency; false keeps the cluster's existing install")


class ChartValues(Values):
    nameOverride: str = Field("", description="replaces the chart name in object names")
    fullnameOverride: str = Field("", description="replaces <release>-<chart> in object names")
    commonLabels: dict[str, str] = Field(default_factory=dict, description="labels added to every object")
    namespaces: Namespaces = Field(default_factory=Namespaces, description="training namespaces")
    trainer: Trainer = Field(default_factory=Trainer, description="identity and RBAC of training pods")
    jobTemplates: dict[str, JobTemplate] = Field(
        default_factory=dict,
        description="job templates by name, the fields of deploy/job-templates/*.yaml; the key must equal `name`",
    )
    priorityClasses: list[PriorityClass] = Field(
        default_factory=list, description="PriorityClasses the job templates name in priority_class"
    )
    kueue: Kueue = Field(default_factory=Kueue, description="gang admission of PyTorchJobs by Kueue")
    podTemplates: PodTemplates = Field(default_factory=PodTemplates, description="Flyte PodTemplates")
    tritonCache: TritonCache = Field(default_factory=TritonCache, description="persistent Triton kernel cache")
    hfCache: HfCache = Field(default_factory=HfCache, description="persistent Hugging Face cache (HF_HOME)")
    objectStore: ObjectStore = Field(default_factory=ObjectStore, description="checkpoint and export storage")
    minio: Minio = Field(default_factory=Minio, description="MinIO for kind")
    postgres: Postgres = Field(default_factory=Postgres, description="PostgreSQL for Flyte on kind")
    nvidiaDevicePlugin: DevicePlugin = Field(default_factory=DevicePlugin, description="NVIDIA device plugin")
    flyte: Flyte = Field(default_factory=Flyte, description="how tigon reaches Flyte")
    tests: Tests = Field(default_factory=Tests, description="the `helm test` pod")
    training_operator: TrainingOperator = Field(
        default_factory=TrainingOperator,
        alias="training-operator",
        description="Kubeflow training-operator v1.9 (PyTorchJob only), tigon's own sub-chart",
    )
    flyte_binary: SubChart = Field(default_factory=SubChart, alias="flyte-binary", description="flyte-binary sub-chart")
    global_: dict[str, Any] = Field(default_factory=dict, alias="global", description="Helm's global values")


# Keywords dropped from the generated schema: titles repeat the key, and defaults live in values.yaml only.
DROPPED = {"title", "default"}


def _tidy(node: Any, definitions: dict[str, Any], in_properties: bool = False) -> Any:
    """Inline every `$ref` (no indirection to read) and drop the DROPPED keywords (not property names)."""
    if isinstance(node, list):
        return [_tidy(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = definitions[node["$ref"].rsplit("/", 1)[-1]]
        extra = {key: value for key, value in node.items() if key != "$ref"}
        return _tidy({**copy.deepcopy(target), **extra}, definitions)
    return {
        key: _tidy(value, definitions, in_properties=key == "properties" and not in_properties)
        for key, value in node.items()
        if in_properties or key not in DROPPED
    }


def build_schema() -> dict[str, Any]:
    schema = ChartValues.model_json_schema(by_alias=True)
    definitions = schema.pop("$defs", {})
    schema = _tidy(schema, definitions)
    schema.pop("description", None)
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "tigon chart values",
        "description": "Generated by deploy/helm/values_schema.py; do not edit by hand.",
        **schema,
    }


def render() -> str:
    return json.dumps(build_schema(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed schema differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not SCHEMA_PATH.exists() or SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale: run python deploy/helm/values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
