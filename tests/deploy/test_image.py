"""The Flyte ImageSpec alternative (tigon.platform.image) holds what docker/Dockerfile holds; flytekit's
own builder turns it into a Dockerfile (no Docker engine needed to check that)."""

from __future__ import annotations

import re

from flytekit import ImageSpec
from flytekit.image_spec.default_builder import create_docker_context

from tests.deploy.docker import dockerfile_args, lock_pins
from tigon.platform.image import LOCK, REPO, dockerfile_settings, training_image_spec


def test_settings_are_the_dockerfiles():
    settings = dockerfile_settings()
    args = {name: values[0] for name, values in dockerfile_args().items()}
    assert {name: settings[name] for name in args} == args
    assert settings["TRITON_CACHE_DIR"] == "/cache/triton"


def test_image_spec_matches_the_dockerfile():
    spec = training_image_spec(registry="ghcr.io/tigon-ml")
    args = dockerfile_settings()
    assert isinstance(spec, ImageSpec) and spec.name == "tigon" and spec.registry == "ghcr.io/tigon-ml"
    assert spec.python_version == args["PYTHON_VERSION"]
    assert spec.base_image == f"nvidia/cuda:{args['CUDA_VERSION']}-cudnn-devel-ubuntu{args['UBUNTU_VERSION']}"
    assert spec.requirements == str(LOCK) and lock_pins()["torch"] == args["TORCH_VERSION"]
    assert spec.env["TRITON_CACHE_DIR"] == args["TRITON_CACHE_DIR"]
    assert any(f"flash-attn=={args['FLASH_ATTN_VERSION']}" in command for command in spec.commands)
    assert spec.entrypoint[-1] == "/root/docker/entrypoint.sh"
    assert not any("flash-attn" in c for c in training_image_spec(flash_attn=False).commands)
    assert re.match(r"^ghcr\.io/tigon-ml/tigon:\S+$", spec.image_name())


def test_flytekit_builds_a_dockerfile_from_it(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # ImageSpec `copy` paths are relative to the repository root
    create_docker_context(training_image_spec(), tmp_path)
    dockerfile = (tmp_path / "Dockerfile").read_text()
    args = dockerfile_settings()
    assert f"FROM nvidia/cuda:{args['CUDA_VERSION']}-cudnn-devel-ubuntu{args['UBUNTU_VERSION']}" in dockerfile
    assert "uv pip install --requirement requirements_uv.txt" in dockerfile
    assert "torch==" + args["TORCH_VERSION"] in (tmp_path / "requirements_uv.txt").read_text()
    assert "COPY --chown=flytekit kernels /root/kernels/" in dockerfile and "./src" not in dockerfile
    assert (tmp_path / "docker" / "entrypoint.sh").exists()
    assert re.search(r"^USER flytekit$", dockerfile, re.MULTILINE)
