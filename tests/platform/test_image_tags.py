"""Image tags that say what is in the image: computed in one place (tigon.platform.image), changed by any build
input, named by every job template and every object rendered from them; mutable tags are refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tigon.platform import image
from tigon.platform.cli import main as tigon
from tigon.platform.jobs import flyte_task_options, pytorchjob_manifests
from tigon.platform.templates import REPO_TEMPLATES, load_templates
from tigon.runtime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.yaml"


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The files image tags are computed from, and the files that name the images, in a scratch checkout."""
    names = {"pyproject.toml", *(name for names in image.BUILD_INPUTS.values() for name in names)}
    for pattern in image.IMAGE_REFERENCES:
        names |= {str(path.relative_to(ROOT)) for path in ROOT.glob(pattern)}
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_tag_names_version_variant_and_digest():
    version = image.tigon_version()
    for variant in image.VARIANTS:
        tag = image.image_tag(variant)
        assert tag == f"{version}-{variant}-{image.build_digest(variant)[:12]}"
        assert image.tag_variant(tag) == variant
        assert image.image_name(variant) == f"ghcr.io/tigon-ml/tigon:{tag}"
    assert image.image_tag("cuda") != image.image_tag("cpu")
    with pytest.raises(image.ImageError, match="unknown image variant 'rocm'; use one of cuda, cpu"):
        image.image_tag("rocm")


@pytest.mark.parametrize(
    "name", ["docker/Dockerfile", "docker/requirements.lock", "docker/requirements-cpu.lock", "docker/entrypoint.sh"]
)
def test_tag_changes_when_a_build_input_changes(checkout, name):
    before = {variant: image.image_tag(variant, checkout) for variant in image.VARIANTS}
    assert before == {variant: image.image_tag(variant) for variant in image.VARIANTS}
    with open(checkout / name, "a") as file:
        file.write("\n# one more line\n")
    after = {variant: image.image_tag(variant, checkout) for variant in image.VARIANTS}
    assert all(
        after[variant] != before[variant] for variant in image.BUILD_INPUTS if name in image.BUILD_INPUTS[variant]
    )


def test_tag_changes_with_the_version_and_not_with_other_files(checkout):
    before = image.image_tag("cuda", checkout)
    (checkout / "README.md").write_text("not a build input\n")
    assert image.image_tag("cuda", checkout) == before
    pyproject = checkout / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.2.0"', 1))
    assert image.image_tag("cuda", checkout).startswith("0.2.0-cuda-")


def test_missing_build_input_names_the_file(checkout):
    (checkout / "docker" / "requirements.lock").unlink()
    with pytest.raises(image.ImageError, match=r"requirements\.lock is missing"):
        image.image_tag("cuda", checkout)


def test_repository_names_the_computed_tags_and_pin_rewrites_stale_ones(checkout, capsys):
    assert image.main(["pin", "--check"]) == 0, capsys.readouterr().err
    assert image.pin_references(checkout, write=False) == []
    (checkout / "docker" / "entrypoint.sh").write_text('#!/bin/sh\nexec "$@"\n')
    stale = image.pin_references(checkout, write=False)
    assert {path.relative_to(checkout).parts[0] for path in stale} == {"deploy", "platform"}
    assert image.pin_references(checkout) == stale and image.pin_references(checkout, write=False) == []
    cpu = yaml.safe_load((checkout / "deploy" / "job-templates" / "cpu-small.yaml").read_text())["image"]
    assert cpu == image.image_name("cpu", root=checkout) != image.image_name("cpu")


def test_every_template_and_rendered_object_uses_the_computed_tag():
    config = load_config(str(DEMO))
    for template in load_templates(REPO_TEMPLATES).values():
        variant = "cuda" if template.gpus_per_node else "cpu"
        expected = image.image_name(variant)
        assert template.image == expected, template.name
        _, job = pytorchjob_manifests(config, template)
        for replica in job["spec"]["pytorchReplicaSpecs"].values():
            assert [c["image"] for c in replica["template"]["spec"]["containers"]] == [expected]
        assert flyte_task_options(template)["container_image"] == expected


def test_print_commands(capsys):
    assert image.main(["tag", "cpu"]) == 0
    assert capsys.readouterr().out == image.image_tag("cpu") + "\n"
    assert image.main(["name", "cuda", "--repository", "registry.example.com/ml/tigon"]) == 0
    assert capsys.readouterr().out == f"registry.example.com/ml/tigon:{image.image_tag('cuda')}\n"


@pytest.mark.parametrize(
    "reference",
    ["ghcr.io/tigon-ml/tigon:0.1.0-cuda-0123456789ab", "registry:5000/tigon:1.2", "tigon@sha256:" + "a" * 64],
)
def test_pinned_references_pass(reference):
    image.check_pinned(reference)


@pytest.mark.parametrize(
    "reference, message",
    [
        ("ghcr.io/tigon-ml/tigon:latest", "mutable tag 'latest'"),
        ("ghcr.io/tigon-ml/tigon", "has no tag, so it means `latest`"),
        ("registry:5000/tigon", "has no tag"),
        ("ghcr.io/tigon-ml/tigon:main", "mutable tag 'main'"),
    ],
)
def test_mutable_references_are_refused(reference, message):
    with pytest.raises(image.ImageError, match=message):
        image.check_pinned(reference)


def test_render_job_refuses_a_template_with_a_mutable_tag(tmp_path, monkeypatch, capsys):
    raw = yaml.safe_load((REPO_TEMPLATES / "cpu-small.yaml").read_text())
    (tmp_path / "cpu-small.yaml").write_text(yaml.safe_dump({**raw, "image": "ghcr.io/tigon-ml/tigon:latest"}))
    monkeypatch.setenv("TIGON_JOB_TEMPLATES", str(tmp_path))
    assert tigon(["render-job", str(DEMO), "--job-template", "cpu-small"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        "job template 'cpu-small': image 'ghcr.io/tigon-ml/tigon:latest' has the mutable tag 'latest'" in captured.err
    )
    assert "python -m tigon.platform.image name" in captured.err
