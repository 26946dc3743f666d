"""The Helm chart, rendered and linted by real Helm for every values file, checked object by object.

Kubernetes schemas: kubernetes-validate at a pinned version (strict: unknown fields fail).
Policies: non-root, nothing privileged, pinned images, resource requests on training pods, RBAC
without wildcards or cluster-admin. Job templates: the chart's ConfigMap loads with
tigon.platform.templates and its PyTorchJobs pass tigon.platform.jobs.check_pytorchjob.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.docker import tool
from tests.deploy.helm import (
    CHART,
    DEPENDENCIES,
    KUBERNETES_VERSION,
    NAMESPACE,
    OPERATOR_CHART,
    ROOT,
    VALUES_FILES,
    chart,
    effective_values,
    lint,
    load_values,
    objects,
    pod_specs,
    render,
    rendered_file,
    values_schema_module,
)
from tests.deploy.pod_security import restricted_violations
from tigon.platform import image
from tigon.platform.jobs import check_pytorchjob, pytorchjob_manifests
from tigon.platform.templates import REPO_TEMPLATES, load_templates
from tigon.runtime.config import parse_config

DEVICE_PLUGIN = "nvidia-device-plugin"
OPERATOR = "training-operator"  # the app.kubernetes.io/component of the training-operator chart's objects
CLUSTER_SCOPED = (
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "CustomResourceDefinition",
    "ValidatingWebhookConfiguration",
)


def component(obj: dict) -> str:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def by_kind(objs, kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


# ---------------------------------------------------------------- schema is generated, lint is clean


def test_committed_schema_is_the_generated_one():
    module = values_schema_module()
    committed = (CHART / "values.schema.json").read_text()
    assert committed == module.render(), "values.schema.json is stale: run python deploy/helm/values_schema.py"
    assert module.main(["--check"]) == 0


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_helm_lint(values_file):
    report = lint(load_values(values_file))
    assert report["errors"] == [], report
    # The only warning: flyte-binary is not downloaded into charts/ (`helm dependency build` does that);
    # the training-operator chart is there, so Helm does not name it.
    warnings = [m["error"] for m in report["messages"] if m["severity"] >= 2]
    assert warnings == ["chart directory is missing these dependencies: flyte-binary"], warnings


def test_chart_declares_its_dependencies_with_conditions():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    dependencies = {d["name"]: d for d in chart["dependencies"]}
    assert set(dependencies) == set(DEPENDENCIES)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for name, dependency in dependencies.items():
        assert dependency["condition"] == f"{name}.enabled"
        assert defaults[name]["enabled"] is True and dependency["version"]
    assert dependencies["flyte-binary"]["repository"].startswith("https://")
    # training-operator: no repository, so Helm takes the committed charts/training-operator/ as it is.
    assert dependencies["training-operator"]["repository"] == ""
    operator = yaml.safe_load((OPERATOR_CHART / "Chart.yaml").read_text())
    assert operator["name"] == "training-operator"
    assert operator["version"] == dependencies["training-operator"]["version"]
    assert operator["appVersion"].startswith("v1.9.")
    # The image the v1.9.2 standalone kustomization pins (docs/deploy.md says how this tag was found).
    assert defaults["training-operator"]["image"] == {
        "repository": "docker.io/kubeflow/training-operator",
        "tag": "v1-3f15cb8",
        "pullPolicy": "IfNotPresent",
    }


def test_helm_resolves_the_operator_chart_offline(tmp_path):
    """Helm finds training-operator in charts/ without a download; only flyte-binary needs one."""
    status = {d["name"]: d["status"] for d in helm.dependency_list(CHART)}
    assert status["training-operator"] == "unpacked" and status["flyte-binary"] in ("missing", "ok")
    assert [d["name"] for d in chart().dependencies] == ["training-operator"]
    # `helm dependency update` on a copy without flyte-binary (the one download) runs offline, writes
    # Chart.lock and leaves exactly one training-operator chart (no packed copy beside the directory).
    copy = tmp_path / "tigon"
    shutil.copytree(CHART, copy, ignore=shutil.ignore_patterns("*.tgz"))
    metadata = yaml.safe_load((copy / "Chart.yaml").read_text())
    metadata["dependencies"] = [d for d in metadata["dependencies"] if d["name"] != "flyte-binary"]
    (copy / "Chart.yaml").write_text(yaml.safe_dump(metadata, sort_keys=False))
    helm.dependency_update(copy)
    helm.dependency_build(copy)
    assert sorted(p.name for p in (copy / "charts").iterdir()) == ["training-operator"]
    lock = yaml.safe_load((copy / "Chart.lock").read_text())
    assert lock["dependencies"] == [{"name": "training-operator", "repository": "", "version": "1.9.2"}]
    with helm.Chart.load(copy) as copied:
        assert [d["name"] for d in copied.dependencies] == ["training-operator"]


# ---------------------------------------------------------------- every object valid for Kubernetes


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_object_is_valid_kubernetes(values_file):
    _, objs = rendered_file(values_file)
    assert len(objs) > 10
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {error.message} at {list(error.path)}")
        namespaced = obj["kind"] not in CLUSTER_SCOPED
        assert bool(obj["metadata"].get("namespace")) == namespaced, (obj["kind"], obj["metadata"]["name"])
        if obj["kind"] == "PyTorchJob":
            check_pytorchjob(obj)


def test_optional_pieces_render_valid():
    """Everything switched on at once: MinIO, PostgreSQL, device plugin, existing cache claim."""
    values = load_values("values-kind.yaml")
    values["nvidiaDevicePlugin"] = {"enabled": True, "nodeSelector": {"nvidia.com/gpu.present": "true"}}
    values["trainer"] = {"imagePullSecrets": ["registry"]}
    objs = objects(render(values))
    plugin = [o for o in objs if component(o) == DEVICE_PLUGIN]
    assert [o["kind"] for o in plugin] == ["DaemonSet"] and plugin[0]["metadata"]["namespace"] == "kube-system"
    for obj in objs:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    pods = by_kind(objs, "PodTemplate")
    assert all(p["template"]["spec"]["imagePullSecrets"] == [{"name": "registry"}] for p in pods)


# ---------------------------------------------------------------- policies


# The policy renders: every values file, and the defaults with the NVIDIA device plugin on (off in all of them).
POLICY_RENDERS = [*VALUES_FILES, "device-plugin"]
# The one pod allowed to run as root and mount a host path: the device plugin writes the kubelet's socket.
ROOT_EXCEPTION = ("DaemonSet", "tigon-nvidia-device-plugin")
KUBELET_SOCKETS = {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}


def policy_objects(render_name: str) -> tuple[dict, ...]:
    if render_name == "device-plugin":
        return tuple(objects(render({"nvidiaDevicePlugin": {"enabled": True}})))
    return rendered_file(render_name)[1]


@pytest.mark.parametrize("render_name", POLICY_RENDERS)
def test_policy_non_root_unprivileged_pinned(render_name):
    objs = policy_objects(render_name)
    checked, root = 0, []
    for obj in objs:
        for spec in pod_specs(obj):
            checked += 1
            name = f"{obj['kind']} {obj['metadata']['name']}"
            assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
            if (obj["kind"], obj["metadata"]["name"]) == ROOT_EXCEPTION:
                root.append(name)
                assert [v["hostPath"] for v in spec["volumes"] if "hostPath" in v] == [KUBELET_SOCKETS], name
                assert spec["automountServiceAccountToken"] is False, name
            else:
                assert spec["securityContext"]["runAsNonRoot"] is True, name
                assert spec["securityContext"].get("runAsUser", 1) != 0, name
                assert not any("hostPath" in v for v in spec.get("volumes", [])), name
            for container in containers(spec):
                image = container["image"]
                assert re.match(r"^[^:@\s]+(:[A-Za-z0-9_][A-Za-z0-9_.-]*|@sha256:[0-9a-f]{64})$", image), image
                assert not image.endswith(":latest"), f"{name}: {image} is not pinned"
                context = container.get("securityContext", {})
                assert context.get("privileged") is not True, name
                assert context.get("allowPrivilegeEscalation") is False, name
                assert context.get("capabilities", {}).get("drop") == ["ALL"], name
                assert not context.get("capabilities", {}).get("add"), name
                assert container.get("resources", {}).get("requests"), f"{name}/{container['name']}: no requests"
    assert checked >= 5
    assert root == ([" ".join(ROOT_EXCEPTION)] if render_name == "device-plugin" else []), root


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_pod_meets_pod_security_restricted_and_training_namespaces_enforce_it(values_file):
    """Every pod the chart renders (but the device plugin, in kube-system) passes the "restricted" checks, and
    the training namespaces enforce that level, so a pod that does not is refused there."""
    _, objs = rendered_file(values_file)
    for obj in objs:
        for spec in pod_specs(obj):
            assert restricted_violations(spec) == [], (obj["kind"], obj["metadata"]["name"])
    training = effective_values(values_file)["namespaces"]["training"]
    namespaces = {o["metadata"]["name"]: o["metadata"]["labels"] for o in by_kind(objs, "Namespace")}
    assert set(namespaces) == set(training)
    for labels in namespaces.values():
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("render_name", POLICY_RENDERS)
def test_policy_rbac_least_privilege(render_name):
    objs = policy_objects(render_name)
    for obj in objs:
        if obj["kind"] in ("Role", "ClusterRole"):
            for rule in obj["rules"]:
                for field in ("verbs", "resources", "apiGroups"):
                    assert "*" not in rule.get(field, []), f"{obj['metadata']['name']}: wildcard {field}"
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), obj["metadata"]["name"]
                if "secrets" in rule["resources"]:
                    _check_operator_secret_rule(obj, rule)
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert obj["roleRef"]["name"] not in ("cluster-admin", "admin", "edit"), obj["metadata"]["name"]
    # the training pods call no Kubernetes API: no Role for their service account, no token in their pods
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding") and o["metadata"]["name"].endswith("-trainer")]
    accounts = [o for o in objs if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "tigon-trainer"]
    assert accounts and all(a["automountServiceAccountToken"] is False for a in accounts)
    for template in by_kind(objs, "PodTemplate"):
        assert template["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_training_namespaces_admit_traffic_only_from_themselves_and_quotas_hold_the_templates(values_file):
    _, objs = rendered_file(values_file)
    values = effective_values(values_file)
    training = values["namespaces"]["training"]
    policies = {o["metadata"]["namespace"]: o["spec"] for o in by_kind(objs, "NetworkPolicy")}
    assert set(policies) == set(training)
    for spec in policies.values():  # every pod; ingress only from pods of the same namespace; egress open
        assert spec == {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]}
    quotas = by_kind(objs, "ResourceQuota")
    assert {q["metadata"]["namespace"] for q in quotas} == (
        set(training) if values["namespaces"]["resourceQuota"] else set()
    )
    templates = [*load_templates(REPO_TEMPLATES).values()]
    for quota in quotas:
        gpus = quota["spec"]["hard"].get("requests.nvidia.com/gpu")
        for template in templates:  # a job above the quota would never start
            assert gpus is None or template.gpus_per_node * template.nnodes <= int(gpus), (values_file, template.name)


def test_trainer_role_when_asked_for_is_read_only():
    objs = objects(render({"trainer": {"rbac": {"create": True}}}))
    (role,) = [o for o in by_kind(objs, "Role") if o["metadata"]["name"] == "tigon-trainer"]
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"]), role["rules"]


def _check_operator_secret_rule(role: dict, rule: dict) -> None:
    """Secrets only for the operator's cert-controller: a Role in the release namespace, writing one Secret."""
    name = role["metadata"]["name"]
    assert role["kind"] == "Role" and component(role) == OPERATOR, f"{name}: no secrets access"
    assert role["metadata"]["namespace"] == NAMESPACE and rule["resources"] == ["secrets"], name
    assert set(rule["verbs"]) <= {"get", "list", "watch", "update"}, rule
    if {"get", "update"} & set(rule["verbs"]):
        assert rule["resourceNames"] == ["tigon-training-operator-webhook-cert"], rule


def test_flyte_role_gets_pytorchjobs_rules():
    _, objs = rendered_file("values.yaml")
    (role,) = [o for o in by_kind(objs, "ClusterRole") if component(o) != OPERATOR]
    rules = {resource: set(rule["verbs"]) for rule in role["rules"] for resource in rule["resources"]}
    assert {"create", "get", "list", "watch", "delete"} <= rules["pytorchjobs"]
    (binding,) = [o for o in by_kind(objs, "ClusterRoleBinding") if component(o) != OPERATOR]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "flyte-binary", "namespace": NAMESPACE}]
    flyte = load_values("values-kind.yaml")  # and the flyte-binary dependency's own ClusterRole gets them too
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["flyte-binary"]
    extra = {r for rule in defaults["rbac"]["extraRules"] for r in rule["resources"]}
    assert {"pytorchjobs", "podtemplates"} <= extra and flyte["flyte-binary"]["enabled"] is True


# ---------------------------------------------------------------- job templates: ConfigMap and PodTemplates


def test_values_job_templates_are_the_repository_templates():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["jobTemplates"]
    files = {p.stem: yaml.safe_load(p.read_text()) for p in sorted(REPO_TEMPLATES.glob("*.yaml"))}
    assert defaults == files, "values.yaml jobTemplates and deploy/job-templates/*.yaml differ: keep them equal"


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_tigon_image_the_chart_renders_has_the_computed_tag(values_file):
    """PodTemplates and the job-template ConfigMaps name tigon's image by `python -m tigon.platform.image` tag."""
    _, objs = rendered_file(values_file)
    found = []
    for obj in objs:
        for spec in pod_specs(obj):
            found += [c["image"] for c in containers(spec) if c["image"].startswith(f"{image.REPOSITORY}:")]
        if obj["kind"] == "ConfigMap" and component(obj) == "job-templates":
            found += [yaml.safe_load(text)["image"] for text in obj["data"].values()]
    assert len(found) > 4, found
    for reference in found:
        assert reference == image.image_name(image.tag_variant(reference.rsplit(":", 1)[1])), (values_file, reference)


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_job_templates_configmap_loads_with_the_platform(values_file, tmp_path):
    _, objs = rendered_file(values_file)
    maps = [o for o in by_kind(objs, "ConfigMap") if component(o) == "job-templates"]
    training = load_values(values_file).get("namespaces", {}).get("training", ["tigon-development"])
    assert {m["metadata"]["namespace"] for m in maps} == {NAMESPACE, *training}
    for name, text in maps[0]["data"].items():
        (tmp_path / name).write_text(text)
    templates = load_templates(tmp_path)
    assert set(templates) == {"cpu-small", "h100x1", "h100x8", "h100x8x2"}
    if values_file == "values.yaml":
        assert templates == load_templates(REPO_TEMPLATES)
    if values_file == "values-kind.yaml":
        assert (templates["cpu-small"].cpu, templates["cpu-small"].memory) == ("2", "4Gi")
    config = parse_config(
        {
            "name": "chart-check",
            "model": {"config_name": "llama", "tokenizer": "char"},
            "data": {"train": "examples/data/arithmetic-train.jsonl"},
            "training": {"max_steps": 1},
        }
    )
    for template in templates.values():
        _, job = pytorchjob_manifests(config, template, namespace=training[0])
        check_pytorchjob(job)
        for replica in job["spec"]["pytorchReplicaSpecs"].values():
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": replica["template"]["spec"]}
            kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_pod_templates_follow_the_job_templates(values_file, tmp_path):
    _, objs = rendered_file(values_file)
    maps = [o for o in by_kind(objs, "ConfigMap") if component(o) == "job-templates"]
    for name, text in maps[0]["data"].items():
        (tmp_path / name).write_text(text)
    templates = load_templates(tmp_path)
    pod_templates = by_kind(objs, "PodTemplate")
    training = load_values(values_file).get("namespaces", {}).get("training", ["tigon-development"])
    values = effective_values(values_file)
    cache = values["tritonCache"]["enabled"]
    hf_cache = values["hfCache"]["enabled"]
    assert hf_cache == cache  # every shipped values file mounts both caches or neither
    for namespace in training:
        here = {p["metadata"]["name"]: p for p in pod_templates if p["metadata"]["namespace"] == namespace}
        assert set(here) == {f"tigon-{name}" for name in templates} | {"tigon-default"}
        # every task pod's base: the cpu-small template without /dev/shm (Flyte mounts the train tasks' shared
        # memory itself, from their shared_memory setting; Kubernetes rejects two mounts at one path)
        base, small = here["tigon-default"]["template"]["spec"], here["tigon-cpu-small"]["template"]["spec"]
        assert [v for v in base.get("volumes", []) if v["name"] != "dshm"] == base.get("volumes", [])
        assert "/dev/shm" not in {m["mountPath"] for m in base["containers"][0].get("volumeMounts", [])}
        small_volumes = [v for v in small["volumes"] if v["name"] != "dshm"]
        small_mounts = [m for m in small["containers"][0]["volumeMounts"] if m["name"] != "dshm"]
        without_shm = {k: v for k, v in small.items() if k != "volumes"} | ({"volumes": small_volumes} if cache else {})
        container = {k: v for k, v in small["containers"][0].items() if k != "volumeMounts"}
        without_shm["containers"] = [container | ({"volumeMounts": small_mounts} if cache else {})]
        assert base == without_shm
        assert "TIGON_WARMUP" not in {e["name"] for e in base["containers"][0]["env"]}  # no warm-up outside training
        for name, template in templates.items():
            spec = here[f"tigon-{name}"]["template"]["spec"]
            (container,) = spec["containers"]
            assert container["name"] == "default" and container["image"] == template.image
            requests, limits = container["resources"]["requests"], container["resources"]["limits"]
            assert (requests["cpu"], requests["memory"]) == (template.cpu, template.memory)
            assert requests == limits
            assert requests.get("nvidia.com/gpu", 0) == template.gpus_per_node
            assert spec.get("nodeSelector", {}) == template.node_selector
            tolerations = [t.model_dump(exclude_none=True) for t in template.tolerations]
            assert spec.get("tolerations", []) == tolerations
            assert spec.get("priorityClassName") == template.priority_class
            assert spec["serviceAccountName"] == template.service_account == "tigon-trainer"
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert {k: env[k] for k in template.env} == template.env
            assert env.get("TRITON_CACHE_DIR") == ("/cache/triton" if cache else template.env.get("TRITON_CACHE_DIR"))
            assert env.get("HF_HOME") == ("/cache/huggingface" if hf_cache else template.env.get("HF_HOME"))
            from_secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
            for name, ref in template.secret_env.items():
                assert from_secrets[name] == {"name": ref.secret, "key": ref.key, "optional": ref.optional}
            shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
            assert shm[0]["emptyDir"] == {"medium": "Memory", "sizeLimit": template.shared_memory}
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            caches = {"/cache/triton", "/cache/huggingface"}
            assert ({"/dev/shm"} | caches) & mounts == ({"/dev/shm"} | caches if cache else {"/dev/shm"})
    priority_classes = {p["metadata"]["name"] for p in by_kind(objs, "PriorityClass")}
    assert {t.priority_class for t in templates.values() if t.priority_class} <= priority_classes


def test_template_defaults_match_the_platform_model():
    """A template giving only name and image gets JobTemplate's defaults in its PodTemplate too."""
    from tigon.platform.templates import JobTemplate

    minimal = {"name": "tiny", "image": "example.org/tiny:1.0"}
    values = {"jobTemplates": {"tiny": minimal}, "tritonCache": {"enabled": False}, "hfCache": {"enabled": False}}
    objs = objects(render(values))
    (pod,) = [p for p in by_kind(objs, "PodTemplate") if p["metadata"]["name"] == "tigon-tiny"]
    spec, model = pod["template"]["spec"], JobTemplate(**minimal)
    requests = spec["containers"][0]["resources"]["requests"]
    assert (requests["cpu"], requests["memory"]) == (model.cpu, model.memory) and "nvidia.com/gpu" not in requests
    assert spec["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": model.shared_memory}}]
    assert spec["serviceAccountName"] == model.service_account


# ---------------------------------------------------------------- the persistent caches

CACHES = {"triton-cache": ("tritonCache", "TRITON_CACHE_DIR"), "hf-cache": ("hfCache", "HF_HOME")}


def cache_mounts(spec: dict) -> dict[str, tuple[str, str, str | None]]:
    """volume name -> (its claim, its mount path, the env value of the cache's variable) of a cache in a pod."""
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", []) if v["name"] in CACHES
    }
    paths = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in CACHES}
    assert set(claims) == set(paths)
    return {name: (claims[name], paths[name], env.get(CACHES[name][1])) for name in claims}


def cache_claims(objs) -> dict[tuple[str, str], dict]:
    return {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in by_kind(objs, "PersistentVolumeClaim")}


@pytest.mark.parametrize("values_file", ["values.yaml", "values-aws.yaml", "values-gcp.yaml"])
def test_each_training_namespace_gets_both_cache_claims_kept_on_uninstall(values_file):
    values = effective_values(values_file)
    _, objs = rendered_file(values_file)
    claims = cache_claims(objs)
    training = values["namespaces"]["training"]
    assert set(claims) == {(ns, f"tigon-{name}") for ns in training for name in CACHES}
    for (_, name), claim in claims.items():
        cache = values[CACHES[name.removeprefix("tigon-")][0]]
        assert component(claim) == name.removeprefix("tigon-")
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert claim["spec"]["accessModes"] == cache["accessModes"] == ["ReadWriteMany"]
        assert claim["spec"]["resources"]["requests"]["storage"] == cache["size"]
        assert claim["spec"].get("storageClassName") == cache["storageClassName"]
    hf = {name: claim["spec"] for (_, name), claim in claims.items() if name == "tigon-hf-cache"}
    expected = {
        "values.yaml": ("100Gi", None),
        "values-aws.yaml": ("100Gi", "efs-sc"),
        "values-gcp.yaml": ("1Ti", "standard-rwx"),
    }[values_file]
    assert {(s["resources"]["requests"]["storage"], s.get("storageClassName")) for s in hf.values()} == {expected}


def test_every_training_pod_mounts_both_caches_and_points_at_them():
    _, objs = rendered_file("values.yaml")
    pods = by_kind(objs, "PodTemplate")
    assert len(pods) == 5 and {p["metadata"]["namespace"] for p in pods} == {"tigon-development"}
    for pod in pods:
        assert cache_mounts(pod["template"]["spec"]) == {
            "triton-cache": ("tigon-triton-cache", "/cache/triton", "/cache/triton"),
            "hf-cache": ("tigon-hf-cache", "/cache/huggingface", "/cache/huggingface"),
        }


def test_hf_cache_mount_path_and_a_job_templates_own_hf_home():
    """HF_HOME follows mountPath; a job template that sets HF_HOME itself keeps its value."""
    values = {
        "hfCache": {"mountPath": "/models"},
        "jobTemplates": {"h100x1": {"env": {"HF_HOME": "/models/h100"}}},
    }
    pods = {p["metadata"]["name"]: p["template"]["spec"] for p in by_kind(objects(render(values)), "PodTemplate")}
    assert cache_mounts(pods["tigon-h100x8"])["hf-cache"] == ("tigon-hf-cache", "/models", "/models")
    assert cache_mounts(pods["tigon-h100x1"])["hf-cache"] == ("tigon-hf-cache", "/models", "/models/h100")
    env = {e["name"]: e.get("value") for e in pods["tigon-h100x1"]["containers"][0]["env"]}
    assert env["TRITON_CACHE_DIR"] == "/cache/triton"  # the template's other variables are merged, not replaced


def test_hf_cache_existing_claim_replaces_the_charts_claim():
    objs = objects(render({"hfCache": {"existingClaim": "shared-models"}}))
    assert set(cache_claims(objs)) == {("tigon-development", "tigon-triton-cache")}
    pods = by_kind(objs, "PodTemplate")
    assert pods
    for pod in pods:
        mounts = cache_mounts(pod["template"]["spec"])
        assert mounts["hf-cache"] == ("shared-models", "/cache/huggingface", "/cache/huggingface")
        assert mounts["triton-cache"][0] == "tigon-triton-cache"
    for obj in objs:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_hf_cache_disabled_renders_no_claim_no_mount_no_hf_home():
    objs = objects(render({"hfCache": {"enabled": False}}))
    assert set(cache_claims(objs)) == {("tigon-development", "tigon-triton-cache")}
    for pod in by_kind(objs, "PodTemplate"):
        spec = pod["template"]["spec"]
        assert set(cache_mounts(spec)) == {"triton-cache"}
        assert "HF_HOME" not in {e["name"] for e in spec["containers"][0]["env"]}
    both_off = objects(render({"hfCache": {"enabled": False}, "tritonCache": {"enabled": False}}))
    assert cache_claims(both_off) == {}
    for pod in by_kind(both_off, "PodTemplate"):
        assert cache_mounts(pod["template"]["spec"]) == {}


def test_the_documented_hf_cache_values_render_as_written():
    """docs/deploy.md's hfCache example is valid values: its claim uses the class and size it names."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    (block,) = re.findall(r"```yaml\n( *hfCache:\n.*?)```", text, re.DOTALL)
    values = yaml.safe_load(textwrap.dedent(block))
    claims = cache_claims(objects(render(values)))
    spec = claims[("tigon-development", "tigon-hf-cache")]["spec"]
    assert (spec["storageClassName"], spec["resources"]["requests"]["storage"]) == ("efs-sc", "100Gi")


# ---------------------------------------------------------------- kind values wire MinIO and PostgreSQL into Flyte


def test_kind_values_point_flyte_at_the_charts_minio_and_postgres():
    values = load_values("values-kind.yaml")
    _, objs = rendered_file("values-kind.yaml")
    services = {(o["metadata"]["name"], o["metadata"]["namespace"]) for o in by_kind(objs, "Service")}
    configuration = values["flyte-binary"]["configuration"]
    s3 = configuration["storage"]["providerConfig"]["s3"]
    minio_host = re.match(r"http://([^.]+)\.([^.]+)\.svc\.cluster\.local:9000$", s3["endpoint"]).groups()
    assert minio_host in services
    assert (s3["accessKey"], s3["secretKey"]) == (values["minio"].get("rootUser", "minio"), "miniostorage")
    db_host = configuration["database"]["host"].split(".")[:2]
    assert tuple(db_host) in services
    assert configuration["database"]["password"] == "flyte-kind-only"
    assert set(values["minio"].get("buckets", ["flyte", "tigon"])) >= {configuration["storage"]["metadataContainer"]}
    (minio_service,) = [o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "tigon-minio"]
    assert minio_service["spec"]["ports"][0]["nodePort"] == 30002
    kind_cluster = yaml.safe_load((CHART.parents[1] / "kind" / "cluster.yaml").read_text())
    host_ports = {m["hostPort"] for node in kind_cluster["nodes"] for m in node.get("extraPortMappings", [])}
    assert {30002, 30080, 30081} <= host_ports


def pod_environment(objs, pod_template: dict) -> dict[str, str]:
    """A PodTemplate's container environment as the pod sees it: values, and Secret keys resolved."""
    secrets = {
        (s["metadata"]["namespace"], s["metadata"]["name"]): s.get("stringData", {}) for s in by_kind(objs, "Secret")
    }
    namespace = pod_template["metadata"]["namespace"]
    env = {}
    for var in pod_template["template"]["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            if ref.get("optional") and (namespace, ref["name"]) not in secrets:
                continue  # an optional Secret that is absent leaves the variable unset
            env[var["name"]] = secrets[(namespace, ref["name"])][ref["key"]]
    return env


def test_kind_training_namespaces_get_the_trainer_users_keys_only():
    """Flyte uses MinIO's root keys; the training namespaces get a separate user's, made by the bucket Job."""
    values = effective_values("values-kind.yaml")["minio"]
    _, objs = rendered_file("values-kind.yaml")
    secrets = {
        o["metadata"]["namespace"]: o["stringData"] for o in by_kind(objs, "Secret") if component(o) == "object-store"
    }
    training = effective_values("values-kind.yaml")["namespaces"]["training"]
    assert set(secrets) == {NAMESPACE, *training}
    for namespace in training:
        assert secrets[namespace] == {
            "AWS_ACCESS_KEY_ID": values["trainerUser"],
            "AWS_SECRET_ACCESS_KEY": values["trainerPassword"],
        }
    assert values["rootPassword"] not in {v for ns in training for v in secrets[ns].values()}
    (job,) = [o for o in by_kind(objs, "Job") if o["metadata"]["name"] == "tigon-minio-buckets"]
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert 'mc admin user add tigon "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY"' in script
    assert 'mc admin policy attach tigon readwrite --user "$AWS_ACCESS_KEY_ID"' in script


def test_kind_pods_reach_minio_through_their_environment(monkeypatch):
    """Every variable the chart sets is read by the client it is meant for: botocore (s3fs), fsspec, flytekit."""
    import botocore.session
    import fsspec.config
    from flytekit.configuration import S3Config

    values = load_values("values-kind.yaml")
    _, objs = rendered_file("values-kind.yaml")
    (pod_template,) = [p for p in by_kind(objs, "PodTemplate") if p["metadata"]["name"] == "tigon-default"]
    env = pod_environment(objs, pod_template)
    storage = ["AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "FSSPEC_S3_ENDPOINT_URL"]
    storage += ["FLYTE_AWS_ENDPOINT", "FLYTE_AWS_ACCESS_KEY_ID", "FLYTE_AWS_SECRET_ACCESS_KEY"]
    assert set(env) == {*storage, "OMP_NUM_THREADS"}  # no TRITON_CACHE_DIR: kind has no cache claim
    minio = f"http://tigon-minio.{NAMESPACE}.svc.cluster.local:9000"
    keys = ("tigon-trainer", "tigon-trainer-kind-only")  # the trainer user's, not MinIO's root keys Flyte uses
    for name in list(os.environ):
        if name.startswith(("AWS_", "FLYTE_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s3 = botocore.session.get_session().create_client("s3")
    assert (s3.meta.endpoint_url, s3.meta.region_name) == (minio, values["objectStore"]["region"])
    credentials = botocore.session.get_session().get_credentials()
    assert (credentials.access_key, credentials.secret_key) == keys
    conf = {}
    fsspec.config.set_conf_env(conf, env)
    assert conf == {"s3": {"endpoint_url": minio}}
    flyte = S3Config.auto()
    assert (flyte.endpoint, flyte.access_key_id, flyte.secret_access_key) == (minio, *keys)


def test_flyte_values_enable_the_pytorch_plugin_and_default_pod_template():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    plugins = defaults["flyte-binary"]["enabled_plugins"]["tasks"]["task-plugins"]
    assert "pytorch" in plugins["enabled-plugins"] and plugins["default-for-task-types"]["pytorch"] == "pytorch"
    for values_file in VALUES_FILES:
        k8s = effective_values(values_file)["flyte-binary"]["configuration"]["inline"]["plugins"]["k8s"]
        assert k8s["default-pod-template-name"] == defaults["podTemplates"]["defaultName"]


# ---------------------------------------------------------------- NOTES and helm test


def test_notes_print_the_next_commands():
    rendered, _ = rendered_file("values-kind.yaml")
    notes = rendered["tigon/templates/NOTES.txt"]
    assert f"helm test tigon -n {NAMESPACE}" in notes
    assert "tigon submit examples/demo.yaml --job-template cpu-small" in notes
    assert "--project tigon --domain development" in notes
    assert "--host localhost:30081 --insecure" in notes


def helm_test_script() -> str:
    _, objs = rendered_file("values.yaml")
    (pod,) = [o for o in by_kind(objs, "Pod") if o["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-ec"]
    return container["args"][0]


def discovery_response(resources: list[tuple[str, str]], pretty: bool) -> str:
    """GET /apis/kubeflow.org/v1 as the API server answers: indented for curl's user agent, else compact."""
    listed = [{"name": name, "namespaced": True, "kind": kind, "verbs": ["get", "list"]} for name, kind in resources]
    body = {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "kubeflow.org/v1", "resources": listed}
    return json.dumps(body, indent=2) if pretty else json.dumps(body, separators=(",", ":"))


def test_helm_test_pod_finds_pytorchjobs_in_the_api_servers_answer(tmp_path):
    """The pod's own grep, run by sh on discovery answers for the CRD the chart installs, compact and pretty."""
    script = helm_test_script()
    assert "https://kubernetes.default.svc/apis/kubeflow.org/v1 > /tmp/kubeflow.json" in script
    (check,) = re.findall(r"^\s*if ! (grep .+) /tmp/kubeflow\.json; then$", script, re.MULTILINE)
    _, objs = rendered_file("values.yaml")
    (crd,) = by_kind(objs, "CustomResourceDefinition")
    plural, kind = crd["spec"]["names"]["plural"], crd["spec"]["names"]["kind"]
    cases = {
        "served": ([(plural, kind), (f"{plural}/status", kind)], True),
        "other kinds only": ([("tfjobs", "TFJob"), ("mpijobs", "MPIJob")], False),
        "subresource only": ([(f"{plural}/status", kind)], False),
    }
    answer = tmp_path / "kubeflow.json"
    for case, (resources, served) in cases.items():
        for pretty in (False, True):
            answer.write_text(discovery_response(resources, pretty))
            result = subprocess.run(["sh", "-c", f'{check} "$1"', "sh", str(answer)], capture_output=True)
            assert (result.returncode == 0) is served, (case, f"pretty={pretty}", answer.read_text())


def test_helm_test_script_is_valid_sh_and_checks_flyte():
    script = helm_test_script()
    result = subprocess.run([tool("shellcheck"), "--shell=sh", "-"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "http://flyte-binary-http.flyte.svc.cluster.local:8088/healthcheck" in script
