"""Gang admission with Kueue (kueue.enabled): the chart's ResourceFlavors, ClusterQueue and LocalQueues, rendered
by real Helm, validate against Kueue v0.19.2's own CRDs (vendored in deploy/kueue); the multi-node job template's
PyTorchJob carries the queue label; the queue's quota admits every queued template."""

from __future__ import annotations

import hashlib
import re

import helm_python as helm
import pytest
import yaml
from kubernetes.utils import parse_quantity

from tests.deploy.helm import (
    ROOT,
    VALUES_FILES,
    crd_validator,
    objects,
    render,
    rendered_file,
    strict_validator,
    structural_errors,
)
from tigon.platform.jobs import KUEUE_QUEUE_LABEL, pytorchjob_manifests
from tigon.platform.templates import REPO_TEMPLATES, load_templates
from tigon.runtime.config import load_config

KUEUE = ROOT / "deploy" / "kueue"
KINDS = {"ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues"}
TRAINING = ["tigon-development", "tigon-production"]
ENABLED = {"kueue": {"enabled": True}, "namespaces": {"training": TRAINING}}


def crd(kind: str) -> dict:
    return yaml.safe_load((KUEUE / f"kueue.x-k8s.io_{KINDS[kind]}.yaml").read_text())


def kueue_objects(values: dict) -> list[dict]:
    return [o for o in objects(render(values)) if o["apiVersion"].startswith("kueue.x-k8s.io/")]


def test_vendored_crds_are_upstreams_v0_19_2():
    readme = (KUEUE / "README.md").read_text()
    assert "v0.19.2" in readme and "Apache License" in (KUEUE / "LICENSE").read_text()
    for kind, plural in KINDS.items():
        path = KUEUE / f"kueue.x-k8s.io_{plural}.yaml"
        assert hashlib.sha256(path.read_bytes()).hexdigest() in readme, f"{path.name}: digest not in README.md"
        definition = crd(kind)
        assert definition["spec"]["group"] == "kueue.x-k8s.io" and definition["spec"]["names"]["kind"] == kind
        stored = [v["name"] for v in definition["spec"]["versions"] if v["storage"] and v["served"]]
        assert stored == ["v1beta2"], (kind, stored)
        schema = next(v for v in definition["spec"]["versions"] if v["name"] == "v1beta2")["schema"]
        assert structural_errors(schema["openAPIV3Schema"]) == [], kind


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_off_by_default(values_file):
    _, objs = rendered_file(values_file)
    assert not [o for o in objs if o["apiVersion"].startswith("kueue.x-k8s.io/")]


def test_rendered_objects_validate_against_kueues_crds():
    objs = kueue_objects(ENABLED)
    assert sorted(o["kind"] for o in objs) == ["ClusterQueue", "LocalQueue", "LocalQueue", "ResourceFlavor"]
    for obj in objs:
        assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta2"
        errors = [f"{list(e.path)}: {e.message}" for e in crd_validator(crd(obj["kind"]), "v1beta2").iter_errors(obj)]
        assert errors == [], (obj["kind"], errors)
    (queue,) = [o for o in objs if o["kind"] == "ClusterQueue"]
    flavors = {o["metadata"]["name"] for o in objs if o["kind"] == "ResourceFlavor"}
    for group in queue["spec"]["resourceGroups"]:  # the CRD's CEL rule, which jsonschema does not evaluate
        assert all(len(f["resources"]) == len(group["coveredResources"]) for f in group["flavors"])
        assert {f["name"] for f in group["flavors"]} == flavors
    (selector,) = queue["spec"]["namespaceSelector"]["matchExpressions"]
    assert selector == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": TRAINING}
    locals_ = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "LocalQueue"}
    assert set(locals_) == set(TRAINING)
    assert all(
        q["metadata"]["name"] == "default" and q["spec"] == {"clusterQueue": "tigon-training"} for q in locals_.values()
    )


def test_validation_really_checks_the_crds():
    """A field of another Kueue API version (v1beta1's `cohort`) and a wrong type fail."""
    (queue,) = [o for o in kueue_objects(ENABLED) if o["kind"] == "ClusterQueue"]
    validator = crd_validator(crd("ClusterQueue"), "v1beta2")
    queue["spec"]["cohort"] = "team"
    assert any("'cohort' was unexpected" in e.message for e in validator.iter_errors(queue))
    del queue["spec"]["cohort"]
    queue["spec"]["queueingStrategy"] = "LIFO"
    assert any("'LIFO' is not one of" in e.message for e in validator.iter_errors(queue))


def test_multi_node_template_job_carries_the_queue_label():
    config = load_config(str(ROOT / "examples" / "demo.yaml"))
    templates = load_templates(REPO_TEMPLATES)
    queued = [t for t in templates.values() if t.nnodes > 1]
    assert queued and all(t.queue == "default" for t in queued)
    for template in templates.values():
        _, job = pytorchjob_manifests(config, template, namespace=TRAINING[0])
        assert job["metadata"]["labels"].get(KUEUE_QUEUE_LABEL) == template.queue, template.name
        assert not [e.message for e in strict_validator().iter_errors(job)]


def _requests(template) -> dict[str, object]:
    """What Kueue counts for a template's job at its node count: every pod's container requests."""
    return {
        "cpu": parse_quantity(template.cpu) * template.nnodes,
        "memory": parse_quantity(template.memory) * template.nnodes,
        "nvidia.com/gpu": template.gpus_per_node * template.nnodes,
    }


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_queue_quota_admits_every_queued_template(values_file):
    """A job above every flavor's quota would wait forever: each queued template fits one flavor."""
    objs = kueue_objects({**yaml.safe_load((ROOT / "deploy/helm/tigon" / values_file).read_text()), **ENABLED})
    (queue,) = [o for o in objs if o["kind"] == "ClusterQueue"]
    (group,) = queue["spec"]["resourceGroups"]
    quotas = [{r["name"]: parse_quantity(r["nominalQuota"]) for r in f["resources"]} for f in group["flavors"]]
    queued = [t for t in load_templates(REPO_TEMPLATES).values() if t.queue]
    assert queued
    for template in queued:
        needs = _requests(template)
        assert any(all(needs[name] <= quota[name] for name in needs) for quota in quotas), (template.name, needs)
    bigger = queued[0].with_nodes(queued[0].max_nnodes)  # the check can fail: 4 nodes need 32 GPUs
    assert not any(all(_requests(bigger)[n] <= q[n] for n in q) for q in quotas)


def test_bad_kueue_values_are_refused():
    with pytest.raises(
        helm.HelmRenderError, match=re.escape('jobTemplates.h100x8x2: queue "default" is not kueue.localQueue "gpu"')
    ):
        render({**ENABLED, "kueue": {"enabled": True, "localQueue": "gpu"}})
    with pytest.raises(helm.HelmValuesError, match="nvidia.com/gpu"):
        render({"kueue": {"flavors": [{"name": "h100", "quota": {"cpu": "8", "memory": "1Gi"}}]}})
    with pytest.raises(helm.HelmValuesError, match="/kueue/flavors"):
        render({"kueue": {"enabled": True, "flavors": []}})


def test_kueue_values_turn_on_pytorchjobs_and_wait_for_pods_ready():
    """The values given to Kueue's own chart: its configuration queues PyTorchJobs (off in Kueue's defaults) and
    evicts a job whose pods are not all running in time, and leaves plain pods (single-node tasks) alone."""
    values = yaml.safe_load((KUEUE / "kueue-values.yaml").read_text())
    config = yaml.safe_load(values["managerConfig"]["controllerManagerConfigYaml"])
    assert (config["apiVersion"], config["kind"]) == ("config.kueue.x-k8s.io/v1beta2", "Configuration")
    assert "kubeflow.org/pytorchjob" in config["integrations"]["frameworks"]
    assert "pod" not in config["integrations"]["frameworks"]
    assert config["waitForPodsReady"] == {"timeout": "10m", "blockAdmission": True}
