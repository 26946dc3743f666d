"""Render and lint the tigon chart with Helm itself (the Helm v4 library bundled by helm-python-sdk).

Of the chart's two dependencies, training-operator is tigon's own chart, committed unpacked in
charts/training-operator/: every render includes it (enabled, as it is by default). flyte-binary is
downloaded by `helm dependency build` and cannot be here, so every render disables it
(`flyte-binary.enabled=false`); its values still pass the chart's schema.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
from pathlib import Path

import helm_python as helm
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
HELM_DIR = ROOT / "deploy" / "helm"
CHART = HELM_DIR / "tigon"
VALUES_FILES = ["values.yaml", "values-kind.yaml", "values-aws.yaml", "values-gcp.yaml"]
RELEASE, NAMESPACE = "tigon", "flyte"
KUBERNETES_VERSION = "1.33.0"
DEPENDENCIES = ("training-operator", "flyte-binary")
OPERATOR_CHART = CHART / "charts" / "training-operator"
DOWNLOADED = ("flyte-binary",)  # dependencies that need a download: disabled in every render here


@functools.cache
def values_schema_module():
    """deploy/helm/values_schema.py, the schema's single source (deploy/ is not a package)."""
    name = "tigon_chart_values_schema"
    spec = importlib.util.spec_from_file_location(name, HELM_DIR / "values_schema.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the models' annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def load_values(name: str) -> dict:
    """A values file's overrides (values.yaml itself is the chart's defaults: no overrides)."""
    if name == "values.yaml":
        return {}
    return yaml.safe_load((CHART / name).read_text()) or {}


def merge_values(base: dict, overrides: dict) -> dict:
    """Helm's merge of a values file over the chart's defaults: maps merge key by key, null deletes a key,
    anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def effective_values(name: str) -> dict:
    """The values a release installed with this values file has: values.yaml with the file's overrides."""
    return merge_values(yaml.safe_load((CHART / "values.yaml").read_text()), load_values(name))


def without_downloads(values: dict) -> dict:
    values = copy.deepcopy(values)
    for dependency in DOWNLOADED:
        values.setdefault(dependency, {})["enabled"] = False
    return values


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: dict | None = None) -> dict[str, str]:
    """template path -> rendered text, as `helm template --namespace flyte tigon deploy/helm/tigon`."""
    return chart().render(values=without_downloads(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True)


# libyaml's loader when PyYAML has it: the upstream PyTorchJob CRD alone is 600 KB of YAML in every render
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def objects(rendered: dict[str, str]) -> list[dict]:
    found = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            found += [document for document in yaml.load_all(text, Loader=YAML_LOADER) if document]
    return found


@functools.cache
def rendered_file(name: str) -> tuple[dict[str, str], tuple[dict, ...]]:
    rendered = render(load_values(name))
    return rendered, tuple(objects(rendered))


def lint(values: dict | None = None) -> dict:
    return helm.lint(
        CHART, values=without_downloads(values or {}), namespace=NAMESPACE, kube_version=f"v{KUBERNETES_VERSION}"
    )


def pod_specs(obj: dict) -> list[dict]:
    """The pod specs inside a workload, PodTemplate or Pod."""
    kind = obj["kind"]
    if kind == "Pod":
        return [obj["spec"]]
    if kind == "PodTemplate":
        return [obj["template"]["spec"]]
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "Job", "ReplicaSet"):
        return [obj["spec"]["template"]["spec"]]
    if kind == "CronJob":
        return [obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    return []


def crd_validator(crd: dict, version: str | None = None) -> jsonschema.Draft7Validator:
    """A CRD version's schema as the API server applies it under strict field validation: an object node that lists
    its properties and does not preserve unknown fields rejects any other field. `version`: the CRD's only one if
    not given. CEL rules (x-kubernetes-validations) are not evaluated; tests check the ones that apply."""

    def strict(node):
        if isinstance(node, list):
            return [strict(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if "properties" in node and "additionalProperties" not in node:
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out

    versions = crd["spec"]["versions"]
    (served,) = [v for v in versions if v["name"] == version] if version else versions
    return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


def operator_objects(objs) -> dict[tuple[str, str], dict]:
    """The training operator's objects among `objs`, by (kind, name)."""
    found = {}
    for obj in objs:
        if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "training-operator":
            found[(obj["kind"], obj["metadata"]["name"])] = obj
    return found


def pytorchjob_crd(objs=None) -> dict:
    """The PyTorchJob CRD among `objs` (the chart rendered with values.yaml when none are given)."""
    objs = objs if objs is not None else rendered_file("values.yaml")[1]
    return operator_objects(objs)[("CustomResourceDefinition", "pytorchjobs.kubeflow.org")]


def structural_errors(node: dict, path: str = "") -> list[str]:
    """The structural-schema rules the API server enforces on a CRD that matter here: every node has a type
    (unless it preserves unknown fields or is int-or-string), and properties never meet additionalProperties."""
    errors = []
    if (
        "type" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
        and not node.get("x-kubernetes-int-or-string")
    ):
        errors.append(f"{path or '/'}: no type")
    if "properties" in node and "additionalProperties" in node:
        errors.append(f"{path}: properties and additionalProperties together")
    for key, child in node.get("properties", {}).items():
        errors += structural_errors(child, f"{path}/{key}")
    if isinstance(node.get("additionalProperties"), dict):
        errors += structural_errors(node["additionalProperties"], f"{path}/*")
    if "items" in node:
        errors += structural_errors(node["items"], f"{path}[]")
    return errors


def strict_validator() -> jsonschema.Draft7Validator:
    """A validator of PyTorchJobs against the rendered CRD, unknown fields refused."""
    return crd_validator(pytorchjob_crd())
