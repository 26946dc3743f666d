"""tigon's training-operator chart (Kubeflow training-operator v1.9, PyTorchJob only), rendered by real Helm.

The CRD must serve exactly what tigon.platform.jobs creates (PyTorchJob kubeflow.org/v1) and accept the
PyTorchJobs it renders for every job template; the operator must run PyTorchJob only, non-root, with its
webhook Service, certificate Secret and ValidatingWebhookConfiguration wired to the names its flags give.
"""

from __future__ import annotations

import copy
import hashlib

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.helm import (
    KUBERNETES_VERSION,
    NAMESPACE,
    OPERATOR_CHART,
    VALUES_FILES,
    load_values,
    objects,
    operator_objects,
    pod_specs,
    pytorchjob_crd,
    render,
    rendered_file,
    strict_validator,
    structural_errors,
)
from tigon.platform.jobs import pytorchjob_manifests
from tigon.platform.templates import REPO_TEMPLATES, load_templates
from tigon.runtime.config import parse_config

NAME = "tigon-training-operator"
WEBHOOK_CONFIGURATION = "validator.training-operator.kubeflow.org"  # fixed by the v1.9 operator's cert-controller
UPSTREAM_CRD = OPERATOR_CHART / "files" / "kubeflow.org_pytorchjobs.yaml"
CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"  # controller-runtime's default, where cert-controller looks


def _flags(container: dict) -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    for arg in container["args"]:
        key, _, value = arg.partition("=")
        flags.setdefault(key, []).append(value)
    return flags


def _tigon_pytorchjobs() -> list[dict]:
    config = parse_config(
        {
            "name": "crd-check",
            "model": {"config_name": "llama", "tokenizer": "char"},
            "data": {"train": "examples/data/arithmetic-train.jsonl"},
            "training": {"max_steps": 1},
        }
    )
    templates = load_templates(REPO_TEMPLATES).values()
    return [pytorchjob_manifests(config, t, namespace="tigon-development")[1] for t in templates]


# ---------------------------------------------------------------- rendered for every values file


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_operator_renders_valid_for_every_values_file(values_file):
    _, objs = rendered_file(values_file)
    found = operator_objects(objs)
    assert set(found) == {
        ("CustomResourceDefinition", "pytorchjobs.kubeflow.org"),
        ("ServiceAccount", NAME),
        ("ClusterRole", NAME),
        ("ClusterRoleBinding", NAME),
        ("Role", NAME),
        ("RoleBinding", NAME),
        ("Secret", f"{NAME}-webhook-cert"),
        ("Service", NAME),
        ("Deployment", NAME),
        ("ValidatingWebhookConfiguration", WEBHOOK_CONFIGURATION),
    }
    for obj in found.values():
        # The CRD validates as apiextensions.k8s.io/v1, the webhook as admissionregistration.k8s.io/v1.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        if obj["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            if obj["kind"] != "ValidatingWebhookConfiguration":
                assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]


def test_schema_validation_really_checks_crds():
    """kubernetes-validate descends into a CRD's schema: a wrong type inside it fails."""
    crd = copy.deepcopy(pytorchjob_crd())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["properties"]["nprocPerNode"]["type"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)


# ---------------------------------------------------------------- the CRD serves what tigon creates


def test_crd_names_match_the_platforms_pytorchjob():
    crd, jobs = pytorchjob_crd(), _tigon_pytorchjobs()
    group, version = jobs[0]["apiVersion"].split("/")
    assert {(j["apiVersion"], j["kind"]) for j in jobs} == {("kubeflow.org/v1", "PyTorchJob")}
    assert crd["spec"]["group"] == group == "kubeflow.org"
    assert crd["metadata"]["name"] == f"{crd['spec']['names']['plural']}.{group}"
    assert crd["spec"]["names"] == {
        "kind": jobs[0]["kind"],
        "listKind": "PyTorchJobList",
        "plural": "pytorchjobs",
        "singular": "pytorchjob",
    }
    assert crd["spec"]["scope"] == "Namespaced"
    (served,) = crd["spec"]["versions"]
    assert (served["name"], served["served"], served["storage"]) == (version, True, True)
    assert served["subresources"]["status"] == {}
    assert served["subresources"]["scale"]["specReplicasPath"] == ".spec.pytorchReplicaSpecs.Worker.replicas"
    columns = {c["name"]: c["jsonPath"] for c in served["additionalPrinterColumns"]}
    assert columns == {"State": ".status.conditions[-1:].type", "Age": ".metadata.creationTimestamp"}


def test_crd_is_upstreams_v1_9_2_crd():
    """The vendored file is upstream's, byte for byte (the digest files/README.md records), and the rendered CRD
    is that file with the chart's labels and keep annotation only."""
    text = UPSTREAM_CRD.read_bytes()
    digest = hashlib.sha256(text).hexdigest()
    readme = (UPSTREAM_CRD.parent / "README.md").read_text()
    assert f"sha256 `{digest}`" in readme and "v1.9.2" in readme
    assert "Apache License" in (UPSTREAM_CRD.parent / "LICENSE").read_text()
    upstream, rendered = yaml.safe_load(text), pytorchjob_crd()
    assert rendered["spec"] == upstream["spec"]
    assert rendered["metadata"]["name"] == upstream["metadata"]["name"]
    kept = {**upstream["metadata"]["annotations"], "helm.sh/resource-policy": "keep"}
    assert rendered["metadata"]["annotations"] == kept


def test_crd_schema_is_structural_and_accepts_tigons_jobs():
    schema = pytorchjob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert structural_errors(schema) == []
    validator = strict_validator()
    jobs = _tigon_pytorchjobs()
    assert any("Worker" in j["spec"]["pytorchReplicaSpecs"] and "elasticPolicy" in j["spec"] for j in jobs)
    for job in jobs:
        errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(job)]
        assert errors == [], (job["metadata"]["name"], errors)


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "nProcPerNodee"), "8"),  # a misspelled nprocPerNode
        (("spec", "elasticPolicy", "maxRestart"), 3),
        (("spec", "runPolicy", "backoffLimits"), 3),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "nodeSelectors"), {"a": "b"}),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0, "resource"), {}),
    ],
)
def test_crd_rejects_misspelled_fields(path, value):
    """A schema that keeps unknown fields (x-kubernetes-preserve-unknown-fields) would take a typo and ignore it;
    upstream's names every field down to the pod template's containers."""
    job = copy.deepcopy(next(j for j in _tigon_pytorchjobs() if "elasticPolicy" in j["spec"]))
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    messages = [e.message for e in strict_validator().iter_errors(job)]
    assert any(f"'{path[-1]}' was unexpected" in m for m in messages), messages


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("spec", "pytorchReplicaSpecs", "Worker", "replicas"), "one", "is not of type 'integer'"),
        (("spec", "elasticPolicy", "nProcPerNode"), "8", "is not of type 'integer'"),
        (("spec", "nprocPerNode"), 8, "is not of type 'string'"),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers"), {}, "is not of type 'array'"),
    ],
)
def test_crd_schema_rejects_wrong_types(path, value, message):
    job = copy.deepcopy(next(j for j in _tigon_pytorchjobs() if "elasticPolicy" in j["spec"]))
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = list(strict_validator().iter_errors(job))
    assert any(message in e.message for e in errors), [e.message for e in errors]


def test_crd_is_kept_on_uninstall_and_can_be_left_out():
    assert pytorchjob_crd()["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    objs = objects(render({"training-operator": {"crd": {"create": False}}}))
    found = operator_objects(objs)
    assert ("CustomResourceDefinition", "pytorchjobs.kubeflow.org") not in found and ("Deployment", NAME) in found
    unkept = pytorchjob_crd(objects(render({"training-operator": {"crd": {"keep": False}}})))
    assert "helm.sh/resource-policy" not in unkept["metadata"]["annotations"]


# ---------------------------------------------------------------- the operator: PyTorchJob only, non-root, wired


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_operator_runs_pytorchjob_only_as_non_root(values_file):
    found = operator_objects(rendered_file(values_file)[1])
    deployment = found[("Deployment", NAME)]
    (spec,) = pod_specs(deployment)
    assert spec["serviceAccountName"] == NAME
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 65532
    (container,) = spec["containers"]
    assert container["image"] == "docker.io/kubeflow/training-operator:v1-3f15cb8"
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    flags = _flags(container)
    assert flags["--enable-scheme"] == ["pytorchjob"]
    assert "--leader-elect" in flags and "--namespace" not in flags
    assert "KUBEFLOW_NAMESPACE" not in {e["name"] for e in container["env"]}  # it would watch one namespace only
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}


def test_operator_probes_ports_webhook_and_certificate_agree():
    found = operator_objects(rendered_file("values.yaml")[1])
    (spec,) = pod_specs(found[("Deployment", NAME)])
    (container,) = spec["containers"]
    flags = _flags(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # Probes on the operator's health port (--health-probe-bind-address).
    assert flags["--health-probe-bind-address"] == [f":{ports['health']}"] == [":8081"]
    assert (container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]) == (
        {"path": "/healthz", "port": "health"},
        {"path": "/readyz", "port": "health"},
    )
    # The webhook: Service (named in the serving certificate) -> container port -> --webhook-server-port.
    service = found[("Service", NAME)]
    assert flags["--webhook-service-name"] == [service["metadata"]["name"]]
    assert flags["--webhook-server-port"] == [str(ports["webhook"])] == ["9443"]
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert (service_ports["webhook"]["port"], service_ports["webhook"]["targetPort"]) == (443, "webhook")
    pod_labels = found[("Deployment", NAME)]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # The certificate: the Secret the cert-controller fills is the one mounted where the webhook server reads.
    secret = found[("Secret", f"{NAME}-webhook-cert")]
    assert flags["--webhook-secret-name"] == [secret["metadata"]["name"]] and "data" not in secret
    (volume,) = [v for v in spec["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert (mount["mountPath"], mount["readOnly"]) == (CERT_DIR, True)
    # The ValidatingWebhookConfiguration calls that Service for PyTorchJob CREATE/UPDATE.
    configuration = found[("ValidatingWebhookConfiguration", WEBHOOK_CONFIGURATION)]
    (hook,) = configuration["webhooks"]
    assert hook["name"] == "validator.pytorchjob.training-operator.kubeflow.org"
    assert hook["clientConfig"] == {
        "service": {"name": NAME, "namespace": NAMESPACE, "path": "/validate-kubeflow-org-v1-pytorchjob", "port": 443}
    }
    assert hook["rules"] == [
        {
            "apiGroups": ["kubeflow.org"],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["pytorchjobs"],
            "scope": "Namespaced",
        }
    ]
    assert (hook["failurePolicy"], hook["sideEffects"]) == ("Fail", "None")


def test_operator_values_reach_the_deployment():
    values = {
        "training-operator": {
            "image": {"repository": "registry.example.com/training-operator", "tag": "v1-abc1234"},
            "replicas": 2,
            "controllerThreads": 4,
            "logLevel": "debug",
            "pytorchInitContainerImage": "registry.example.com/alpine:3.20",
            "webhook": {"failurePolicy": "Ignore", "timeoutSeconds": 5},
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "imagePullSecrets": ["registry"],
        }
    }
    found = operator_objects(objects(render(values)))
    deployment = found[("Deployment", NAME)]
    (spec,) = pod_specs(deployment)
    (container,) = spec["containers"]
    flags = _flags(container)
    assert container["image"] == "registry.example.com/training-operator:v1-abc1234"
    assert deployment["spec"]["replicas"] == 2 and spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert flags["--controller-threads"] == ["4"] and flags["--zap-log-level"] == ["debug"]
    assert flags["--pytorch-init-container-image"] == ["registry.example.com/alpine:3.20"]
    assert found[("ServiceAccount", NAME)]["imagePullSecrets"] == [{"name": "registry"}]
    (hook,) = found[("ValidatingWebhookConfiguration", WEBHOOK_CONFIGURATION)]["webhooks"]
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Ignore", 5)


# ---------------------------------------------------------------- RBAC: what the operator touches, no more


def _rules(role: dict) -> dict[tuple[str, str], set[str]]:
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource + ("@" + ",".join(rule["resourceNames"]) if "resourceNames" in rule else ""))
                rules.setdefault(key, set()).update(rule["verbs"])
    return rules


def test_operator_rbac_is_least_privilege():
    found = operator_objects(rendered_file("values.yaml")[1])
    cluster = _rules(found[("ClusterRole", NAME)])
    assert cluster == {
        ("kubeflow.org", "pytorchjobs"): {"get", "list", "watch", "update", "patch", "delete"},
        ("kubeflow.org", "pytorchjobs/status"): {"get", "update", "patch"},
        ("kubeflow.org", "pytorchjobs/finalizers"): {"update"},
        ("", "pods"): {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
        ("", "events"): {"create", "patch"},
        ("autoscaling", "horizontalpodautoscalers"): {"get", "list", "watch", "create", "update", "delete"},
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): {"get", "list", "watch"},
        ("admissionregistration.k8s.io", f"validatingwebhookconfigurations@{WEBHOOK_CONFIGURATION}"): {
            "update",
            "patch",
        },
    }
    namespaced = found[("Role", NAME)]
    assert namespaced["metadata"]["namespace"] == NAMESPACE
    assert _rules(namespaced) == {
        ("", "secrets"): {"list", "watch"},
        ("", f"secrets@{NAME}-webhook-cert"): {"get", "update"},
        ("coordination.k8s.io", "leases"): {"get", "create", "update"},
    }
    for binding in (found[("ClusterRoleBinding", NAME)], found[("RoleBinding", NAME)]):
        assert binding["roleRef"]["name"] == NAME
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]


@pytest.mark.parametrize(
    "scheduler, group", [("volcano", "scheduling.volcano.sh"), ("scheduler-plugins-scheduler", "scheduling.x-k8s.io")]
)
def test_gang_scheduling_adds_only_podgroup_rules(scheduler, group):
    found = operator_objects(objects(render({"training-operator": {"gangSchedulerName": scheduler}})))
    (container,) = pod_specs(found[("Deployment", NAME)])[0]["containers"]
    assert _flags(container)["--gang-scheduler-name"] == [scheduler]
    rules = _rules(found[("ClusterRole", NAME)])
    assert rules[(group, "podgroups")] == {"get", "list", "watch", "create", "update", "patch", "delete"}
    assert rules[("scheduling.k8s.io", "priorityclasses")] == {"get", "list", "watch"}
    plain = _rules(operator_objects(rendered_file("values.yaml")[1])[("ClusterRole", NAME)])
    assert set(rules) - set(plain) == {(group, "podgroups"), ("scheduling.k8s.io", "priorityclasses")}


# ---------------------------------------------------------------- disabled: a cluster keeps its own operator


def test_disabled_operator_renders_nothing_and_notes_say_so():
    rendered = render({"training-operator": {"enabled": False}})
    assert operator_objects(objects(rendered)) == {}
    assert "the cluster must already serve kubeflow.org/v1 PyTorchJob" in rendered["tigon/templates/NOTES.txt"]
    enabled = render({})["tigon/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} rollout status deployment/{NAME}" in enabled
    kind = load_values("values-kind.yaml")
    assert kind.get("training-operator", {}).get("enabled", True) is True  # kind gets the operator


def test_helm_test_pod_asks_for_the_crds_group_version():
    """The `helm test` pod still renders beside the operator and asks for the API the CRD serves (test_chart.py runs
    its check on discovery answers naming the CRD's plural)."""
    _, objs = rendered_file("values.yaml")
    crd = pytorchjob_crd(objs)
    (pod,) = [o for o in objs if o["kind"] == "Pod" and o["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    script = pod["spec"]["containers"][0]["args"][0]
    group_version = f"/apis/{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
    assert f"https://kubernetes.default.svc{group_version} " in script


def test_operator_chart_renders_on_its_own():
    """The sub-chart is a chart of its own too: `helm template charts/training-operator` works without tigon."""
    with helm.Chart.load(OPERATOR_CHART) as chart:
        rendered = chart.render(name="kubeflow", namespace="kubeflow", is_install=True)
    objs = [o for text in rendered.values() for o in yaml.safe_load_all(text) if o]
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("Deployment", "kubeflow-training-operator") in names
    report = helm.lint(OPERATOR_CHART, namespace="kubeflow", strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    for obj in objs:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_nothing_points_at_the_nonexistent_kubeflow_helm_repository():
    """Kubeflow has no Helm repository for the v1 operator: no install step may `helm repo add` one."""
    root = OPERATOR_CHART.parents[4]
    paths = [
        root / "docs" / "deploy.md",
        root / "deploy" / "kind" / "quickstart.sh",
        OPERATOR_CHART.parents[1] / "Chart.yaml",
    ]
    for path in paths:
        assert "kubeflow.github.io/training-operator" not in path.read_text(), path
