"""The training image as a flytekit `ImageSpec`: the alternative to `docker/Dockerfile` for teams
whose Flyte builds images itself (`pyflyte run --remote` builds and pushes an ImageSpec on demand).

Both are read from the same files: the Python packages from `docker/requirements.lock` (exact
versions and hashes), and CUDA, Ubuntu, Python, flash-attn and the Triton cache path from the
Dockerfile's ARG/ENV lines, so the two images cannot drift apart.

    from tigon.platform.image import training_image_spec
    image = training_image_spec(registry="ghcr.io/my-org")
    @task(container_image=image, ...)

Build it from the repository root (flytekit resolves `copy` paths against the working directory),
as `pyflyte run` is run. Differences from the Dockerfile, all flytekit's builder's: one stage on the CUDA *devel* image
(flash-attn needs nvcc, and an ImageSpec has no second stage), Python from micromamba instead of
Ubuntu's, and the non-root user is flytekit's `flytekit` instead of `tigon`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flytekit import ImageSpec

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
LOCK = REPO / "docker" / "requirements.lock"
ENTRYPOINT = "docker/entrypoint.sh"
# What the image holds of the repository: the package (its three layer folders) and the entrypoint.
SOURCES = ["pyproject.toml", "README.md", "kernels", "runtime", "platform", ENTRYPOINT]


def dockerfile_settings(path: Path = DOCKERFILE) -> dict[str, str]:
    """The Dockerfile's ARG defaults and ENV values (first definition wins), e.g. TORCH_VERSION, TRITON_CACHE_DIR."""
    settings: dict[str, str] = {}
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("ARG ") and "=" in line:
            name, value = line[4:].split("=", 1)
            settings.setdefault(name.strip(), value.strip().strip('"'))
        elif line.startswith("ENV "):
            for name, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", line[4:]):
                settings.setdefault(name, value.strip('"'))
    return settings


def training_image_spec(
    registry: str | None = None,
    name: str = "tigon",
    flash_attn: bool = True,
    platform: str = "linux/amd64",
) -> ImageSpec:
    """An ImageSpec with the Dockerfile's contents: CUDA, torch, triton, flash-attn, tigon, flytekit."""
    from flytekit import ImageSpec
    from flytekit.constants import CopyFileDetection

    args = dockerfile_settings()
    cache = args["TRITON_CACHE_DIR"]
    commands = [f"mkdir -p {cache} && chown flytekit {cache}"]
    if flash_attn:
        commands.append(
            f"FLASH_ATTN_CUDA_ARCHS='{args['FLASH_ATTN_CUDA_ARCHS']}' FLASH_ATTENTION_FORCE_BUILD=TRUE "
            f"MAX_JOBS={args['MAX_JOBS']} uv pip install --no-build-isolation --no-deps --no-binary flash-attn "
            f"flash-attn=={args['FLASH_ATTN_VERSION']}"
        )
    commands.append("uv pip install --no-build-isolation --no-deps /root")
    return ImageSpec(
        name=name,
        registry=registry,
        platform=platform,
        base_image=f"nvidia/cuda:{args['CUDA_VERSION']}-cudnn-devel-ubuntu{args['UBUNTU_VERSION']}",
        python_version=args["PYTHON_VERSION"],
        requirements=str(LOCK),
        apt_packages=["gcc", "libc6-dev", "git", "ca-certificates", "tini"],
        env={"TRITON_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"},
        source_root=str(REPO),
        source_copy_mode=CopyFileDetection.NO_COPY,  # `copy` below names exactly what goes in
        copy=list(SOURCES),
        commands=commands,
        entrypoint=["/usr/bin/tini", "--", f"/root/{ENTRYPOINT}"],
    )
