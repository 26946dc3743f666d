"""Bad values fail before anything reaches a cluster, and every value is documented.

The schema (values.schema.json, generated with `additionalProperties: false`) rejects unknown keys
and wrong types in `helm template`/`helm install` and in `helm lint`; the chart's own checks
(`tigon.validate`) reject what a JSON schema cannot say, with a message naming the value and the fix.
"""

from __future__ import annotations

import json
import re

import helm_python as helm
import pytest
import yaml

from tests.deploy.helm import CHART, DEPENDENCIES, DOWNLOADED, OPERATOR_CHART, lint, load_values, render

BAD_VALUES = [
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"minio": {"enabeld": True}}, "additional properties 'enabeld' not allowed"),
    ({"tritonCache": {"size": 20}}, "/tritonCache/size"),
    ({"tritonCache": {"size": "lots"}}, "/tritonCache/size"),
    ({"tritonCache": {"accessModes": ["ReadWriteAll"]}}, "/tritonCache/accessModes/0"),
    ({"hfCache": {"size": "lots"}}, "/hfCache/size"),
    ({"hfCache": {"accessModes": []}}, "/hfCache/accessModes"),
    ({"hfCache": {"claim": "models"}}, "additional properties 'claim' not allowed"),
    ({"minio": {"image": {"tag": "latest"}}}, "/minio/image/tag"),
    ({"tests": {"image": {"tag": ""}}}, "/tests/image/tag"),
    ({"namespaces": {"training": ["Tigon_Dev"]}}, "/namespaces/training/0"),
    ({"namespaces": {"training": []}}, "/namespaces/training"),
    ({"objectStore": {"provider": "azure"}}, "/objectStore/provider"),
    ({"trainer": {"securityContext": {"runAsUser": 0}}}, "/trainer/securityContext/runAsUser"),
    ({"jobTemplates": {"cpu-small": {"gpus": 1}}}, "additional properties 'gpus' not allowed"),
    ({"jobTemplates": {"cpu-small": {"gpus_per_node": -1}}}, "/jobTemplates/cpu-small/gpus_per_node"),
    ({"jobTemplates": {"cpu-small": {"nnodes": "two"}}}, "/jobTemplates/cpu-small/nnodes"),
    ({"jobTemplates": {"new": {"name": "new"}}}, "missing property 'image'"),
    ({"priorityClasses": [{"name": "x", "value": 2000000000}]}, "/priorityClasses/0/value"),
    ({"training-operator": {"replica": 2}}, "additional properties 'replica' not allowed"),
    ({"training-operator": {"image": {"tag": "latest"}}}, "/training-operator/image/tag"),
    ({"training-operator": {"replicas": 0}}, "/training-operator/replicas"),
    ({"training-operator": {"logLevel": "verbose"}}, "/training-operator/logLevel"),
    ({"training-operator": {"pytorchInitContainerImage": "alpine"}}, "/training-operator/pytorchInitContainerImage"),
    ({"training-operator": {"pytorchInitContainerImage": "a:latest"}}, "/training-operator/pytorchInitContainerImage"),
    ({"training-operator": {"webhook": {"failurePolicy": "Maybe"}}}, "/training-operator/webhook/failurePolicy"),
    ({"training-operator": {"crd": {"keep": "yes"}}}, "/training-operator/crd/keep"),
]


@pytest.mark.parametrize("values, message", BAD_VALUES, ids=[json.dumps(v)[:60] for v, _ in BAD_VALUES])
def test_schema_rejects_bad_values(values, message):
    with pytest.raises(helm.HelmValuesError) as error:
        render(values)
    assert message in str(error.value)
    report = lint(values)
    assert any(message in e for e in report["errors"]), report


TEMPLATE_CHECKS = [
    ({"jobTemplates": {"cpu-small": {"name": "cpu-tiny"}}}, 'jobTemplates.cpu-small: its name is "cpu-tiny"'),
    ({"jobTemplates": {"h100x8": {"nproc_per_node": 4}}}, "nproc_per_node 4 must equal gpus_per_node 8"),
    ({"jobTemplates": {"h100x8": {"nnodes": 2}}}, "nnodes 2 is above max_nnodes 1"),
    ({"podTemplates": {"default": "h200x64"}}, 'podTemplates.default is "h200x64", which names no job template'),
    ({"objectStore": {"provider": "minio"}}, "enable minio or set the endpoint"),
    ({"minio": {"enabled": True, "service": {"type": "NodePort"}}}, "set minio.service.nodePort"),
    (
        {"hfCache": {"mountPath": "/cache/triton"}},
        "tritonCache.mountPath and hfCache.mountPath are both /cache/triton: give each cache its own path",
    ),
]


@pytest.mark.parametrize("values, message", TEMPLATE_CHECKS, ids=[json.dumps(v)[:60] for v, _ in TEMPLATE_CHECKS])
def test_chart_checks_what_the_schema_cannot(values, message):
    with pytest.raises(helm.HelmRenderError) as error:
        render(values)
    assert message in str(error.value)


@pytest.mark.parametrize("name", ["values-kind.yaml", "values-aws.yaml", "values-gcp.yaml"])
def test_example_values_files_pass_the_schema(name):
    helm.Chart.load(CHART).validate_schema(load_values(name))


def test_subchart_values_pass_through():
    """Only `enabled` of flyte-binary is typed here; its chart owns the rest of its values."""
    chart = helm.Chart.load(CHART)
    render({"flyte-binary": {"enabled": False, "anything": {"nested": [1, 2]}}})
    for dependency in DEPENDENCIES:
        with pytest.raises(helm.HelmValuesError, match=f"/{dependency}/enabled"):
            chart.validate_schema({dependency: {"enabled": "yes"}})


def test_operator_values_are_typed_and_equal_to_its_charts_defaults():
    """tigon types its own training-operator chart's values in full; values.yaml repeats that chart's defaults."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["training-operator"]
    chart_defaults = yaml.safe_load((OPERATOR_CHART / "values.yaml").read_text())
    assert {k: v for k, v in defaults.items() if k != "enabled"} == chart_defaults
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["training-operator"]
    assert schema["additionalProperties"] is False and set(chart_defaults) | {"enabled", "global"} == set(
        schema["properties"]
    )


def _schema_leaves(schema: dict, path: tuple = ()) -> dict[tuple, dict]:
    """Typed leaf properties of the chart's own models (sub-chart and free-form maps excluded)."""
    leaves = {}
    for key, node in schema.get("properties", {}).items():
        if key in DOWNLOADED or key == "global":
            continue
        if node.get("type") == "object" and node.get("additionalProperties") is False:
            leaves.update(_schema_leaves(node, (*path, key)))
        else:
            leaves[(*path, key)] = node
    return leaves


def _documented_keys(text: str) -> set[tuple]:
    """Key paths of values.yaml whose line, or the comment block right above it, carries a comment."""
    documented, stack, previous_comment = set(), [], False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            previous_comment = False
            continue
        if stripped.startswith("#"):
            previous_comment = True
            continue
        match = re.match(r"^( *)([A-Za-z0-9_.-]+):(\s|$)", line)
        if match:
            indent = len(match.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, match.group(2))]
            if previous_comment or " #" in line:
                documented.add(tuple(k for _, k in stack))
        previous_comment = False
    return documented


def test_every_value_is_documented():
    schema = json.loads((CHART / "values.schema.json").read_text())
    leaves = _schema_leaves(schema)
    for path, node in leaves.items():
        assert node.get("description"), f"{'.'.join(path)} has no description in values_schema.py"
    text = (CHART / "values.yaml").read_text()
    defaults = yaml.safe_load(text)
    documented = _documented_keys(text)

    def present(path):
        node = defaults
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        return True

    missing = [".".join(p) for p in leaves if present(p) and p not in documented]
    assert not missing, f"values.yaml keys without a comment: {missing}"
    job_templates = {p for p in documented if p[:1] == ("jobTemplates",) and len(p) == 2}
    assert len(job_templates) == len(defaults["jobTemplates"])
    for dependency in DEPENDENCIES:
        assert (dependency, "enabled") in documented
