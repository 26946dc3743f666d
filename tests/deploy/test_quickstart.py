"""The commands users are told to run: the kind quickstart builds the image the demo's job template names;
every `tigon submit` of the demo (NOTES.txt, quickstart.sh, docs/deploy.md) runs, and every pyflyte command of
the finetune workflow, shown or made by tigon submit, passes only inputs the workflow has (pyflyte names
options after the inputs: --job_template, not --job-template)."""

from __future__ import annotations

import re
import shlex
import shutil
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
    assert '--build-arg VARIANT=cpu -t "$image"' in script, "the demo's template runs the cpu variant"


def workflow_options(text: str) -> list[list[str]]:
    """The options after `finetune` in each `pyflyte run ... workflows/finetune.py finetune` command."""
    joined = re.sub(r"\\+\n\s*", " ", text)  # shell line continuations
    commands = re.findall(r"pyflyte run .*?workflows/finetune\.py finetune(.*)", joined)
    return [re.findall(r"(?:^|\s)--([\w-]+)", arguments) for arguments in commands]


@pytest.fixture(scope="module")
def workflow_inputs() -> set[str]:
    from workflows.finetune import finetune

    return set(finetune.python_interface.inputs)


def shown_text(source: str) -> str:
    if source.startswith("NOTES.txt"):
        rendered, _ = rendered_file("values-kind.yaml" if "kind" in source else "values.yaml")
        return rendered["tigon/templates/NOTES.txt"]
    return (QUICKSTART if source == "quickstart.sh" else DOCS).read_text()


def submit_commands(text: str) -> list[list[str]]:
    """The arguments of each `tigon submit` command in `text`."""
    joined = re.sub(r"\\+\n\s*", " ", text)
    return [shlex.split(arguments) for arguments in re.findall(r"tigon submit (.*)", joined)]


@pytest.mark.parametrize("source", ["NOTES.txt (kind)", "NOTES.txt (defaults)", "quickstart.sh", "docs/deploy.md"])
def test_shown_commands_run_and_pass_workflow_inputs(source, workflow_inputs, monkeypatch, capsys):
    """Each `tigon submit` of a config in this repository runs as shown (with --dry-run, from the repository root),
    and the pyflyte command it makes, like each `pyflyte run ... finetune` shown, passes only workflow inputs."""
    from tigon.platform.cli import main

    text = shown_text(source)
    monkeypatch.chdir(ROOT)
    commands = workflow_options(text)
    for arguments in submit_commands(text):
        assert {"--job-template", "--job_template"} & set(arguments), arguments
        if not (ROOT / arguments[0]).is_file():
            continue  # a user's own config (my.yaml)
        assert main(["submit", *arguments, "--dry-run"]) == 0, capsys.readouterr().err
        made = shlex.split(capsys.readouterr().out)
        options = made[made.index("finetune") + 1 :]
        commands.append([option[2:] for option in options if option.startswith("--")])
        if "--data_dir" in options:
            shutil.rmtree(options[options.index("--data_dir") + 1])
    assert commands, f"{source}: no command that runs the finetune workflow"
    for options in commands:
        assert "job_template" in options, options
        assert set(options) <= workflow_inputs, f"{source}: {sorted(set(options) - workflow_inputs)} are no inputs"
