"""The commands users are told to run: the kind quickstart builds the image the demo's job template names,
and every `pyflyte run ... finetune` command (NOTES.txt, quickstart.sh, docs/deploy.md) passes only inputs
the workflow has (pyflyte names options after the inputs: --job_template, not --job-template)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy.helm import ROOT, rendered_file
from tigon.platform.templates import REPO_TEMPLATES, load_templates

QUICKSTART = ROOT / "deploy" / "kind" / "quickstart.sh"
DOCS = ROOT / "docs" / "deploy.md"


def test_quickstart_builds_the_image_of_the_demo_template():
    script = QUICKSTART.read_text()
    (line,) = re.findall(r"^image=.*$", script, re.MULTILINE)
    result = subprocess.run(
        ["bash", "-c", f'root="$1"; {line}; printf %s "$image"', "bash", str(ROOT)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout == load_templates(REPO_TEMPLATES)["cpu-small"].image
    assert 'build_image="${BUILD_IMAGE:-1}"' in script, "the quickstart builds the image unless BUILD_IMAGE=0"


def workflow_options(text: str) -> list[list[str]]:
    """The options after `finetune` in each `pyflyte run ... workflows/finetune.py finetune` command."""
    joined = re.sub(r"\\+\n\s*", " ", text)  # shell line continuations
    commands = re.findall(r"pyflyte run .*?workflows/finetune\.py finetune(.*)", joined)
    return [re.findall(r"(?:^|\s)--([\w-]+)", arguments) for arguments in commands]


@pytest.fixture(scope="module")
def workflow_inputs() -> set[str]:
    from workflows.finetune import finetune

    return set(finetune.python_interface.inputs)


@pytest.mark.parametrize("source", ["NOTES.txt (kind)", "NOTES.txt (defaults)", "quickstart.sh", "docs/deploy.md"])
def test_pyflyte_commands_pass_workflow_inputs(source, workflow_inputs):
    if source.startswith("NOTES.txt"):
        rendered, _ = rendered_file("values-kind.yaml" if "kind" in source else "values.yaml")
        text = rendered["tigon/templates/NOTES.txt"]
    else:
        text = (QUICKSTART if source == "quickstart.sh" else DOCS).read_text()
    commands = workflow_options(text)
    assert commands, f"{source}: no pyflyte run command of the finetune workflow"
    for options in commands:
        assert "job_template" in options, options
        assert set(options) <= workflow_inputs, f"{source}: {sorted(set(options) - workflow_inputs)} are no inputs"
