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

Image tags say what is in the image: `<tigon version>-<variant>-<digest>`, the digest a sha256 of the build
inputs (the Dockerfile, the variant's lock, the entrypoint) and the variant, so a changed pin gives a new tag and a run
pins what it ran on. `image_tag` is the one place the tag is computed; the build commands, the quickstart
(through the cpu-small template) and the job templates all take it from here:

    python -m tigon.platform.image name cuda     # ghcr.io/tigon-ml/tigon:0.1.0-cuda-<digest>, for docker build -t
    python -m tigon.platform.image pin [--check] # write (or check) that tag into the job templates and values.yaml
    python -m tigon.platform.image cpu-lock      # the cpu variant's lock, derived from docker/requirements.lock
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flytekit import ImageSpec

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
LOCK = REPO / "docker" / "requirements.lock"
#: the cpu variant's lock: LOCK without torch and the CUDA packages; the Dockerfile adds torch's CPU wheel
CPU_LOCK = REPO / "docker" / "requirements-cpu.lock"
#: what only the CUDA build of torch needs (its CUDA libraries and bindings), and torch itself
CUDA_ONLY = re.compile(r"^(torch|cuda-[a-z0-9-]+|nvidia-[a-z0-9-]+)$")
ENTRYPOINT = "docker/entrypoint.sh"
# What the image holds of the repository: the package (its three layer folders) and the entrypoint.
SOURCES = ["pyproject.toml", "README.md", "kernels", "runtime", "platform", ENTRYPOINT]
#: where tigon's images are published; the templates' images of this repository carry computed tags
REPOSITORY = "ghcr.io/tigon-ml/tigon"
VARIANTS = ("cuda", "cpu")
#: what decides an image's contents besides tigon's own code (which its version names), per variant
BUILD_INPUTS = {
    "cuda": ["docker/Dockerfile", "docker/requirements.lock", ENTRYPOINT],
    "cpu": ["docker/Dockerfile", "docker/requirements-cpu.lock", ENTRYPOINT],
}
#: the files that name tigon's images: the job templates, their packaged copy, the chart's defaults
IMAGE_REFERENCES = ["deploy/job-templates/*.yaml", "platform/job-templates/*.yaml", "deploy/helm/tigon/values.yaml"]
DIGEST_LENGTH = 12
MUTABLE_TAGS = ("latest", "main", "master", "nightly", "edge", "dev")
TAGGED_IMAGE = re.compile(rf"({re.escape(REPOSITORY)}):([A-Za-z0-9_][A-Za-z0-9_.-]*)")


class ImageError(ValueError):
    """A missing build input, an unknown variant, or an image reference that does not pin its contents."""


def tigon_version(root: Path = REPO) -> str:
    """The version in pyproject.toml: the part of the tag that names tigon's own code."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        raise ImageError(f"{pyproject} is missing: image tags are computed in a tigon checkout")
    # The [project] table's version line (tomllib is not in Python 3.10, which tigon supports).
    project = pyproject.read_text().split("[project]", 1)[-1].split("\n[", 1)[0]
    found = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    if not found:
        raise ImageError(f"{pyproject} has no [project] version: set one, it is the first part of the image tag")
    return found[1]


def build_digest(variant: str, root: Path = REPO) -> str:
    """sha256 of the variant and of each build input's path and bytes: any change to them changes it."""
    if variant not in VARIANTS:
        raise ImageError(f"unknown image variant {variant!r}; use one of {', '.join(VARIANTS)}")
    digest = hashlib.sha256(variant.encode())
    for name in BUILD_INPUTS[variant]:
        path = root / name
        if not path.is_file():
            raise ImageError(f"build input {path} is missing: image tags are computed in a tigon checkout")
        digest.update(b"\0" + name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def image_tag(variant: str, root: Path = REPO) -> str:
    """`<version>-<variant>-<digest>`, e.g. `0.1.0-cuda-3f2a9c01b7de`."""
    return f"{tigon_version(root)}-{variant}-{build_digest(variant, root)[:DIGEST_LENGTH]}"


def image_name(variant: str, repository: str = REPOSITORY, root: Path = REPO) -> str:
    return f"{repository}:{image_tag(variant, root)}"


def tag_variant(tag: str) -> str:
    """The variant a tag of tigon's repository names (`0.1.0-cpu-...` -> `cpu`)."""
    for variant in VARIANTS:
        if re.search(rf"(^|-){variant}(-|$)", tag):
            return variant
    raise ImageError(
        f"image tag {tag!r} names no variant; tigon's tags look like <version>-<{'|'.join(VARIANTS)}>-<digest>"
    )


def cpu_lock(lock: str) -> str:
    """The cpu variant's lock from the CUDA lock: every package entry (its `==` line, hashes and `# via` lines)
    except torch and the packages only its CUDA build needs, under a header saying how it was made."""
    header = (
        "# The cpu image's packages: docker/requirements.lock without torch and its CUDA packages (torch's CPU\n"
        "# wheel comes from PyTorch's CPU index, see docker/Dockerfile). Written by\n"
        "#    python -m tigon.platform.image cpu-lock\n"
    )
    entries = re.split(r"\n(?=[a-z0-9])", lock)
    kept = [entry for entry in entries[1:] if not CUDA_ONLY.match(re.split(r"[=\s]", entry, maxsplit=1)[0])]
    return header + "\n".join(kept)


def check_pinned(image: str) -> None:
    """Refuse an image whose tag can move under a run: no tag (= `latest`) or a branch-like tag."""
    if "@sha256:" in image:
        return
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:  # "registry:5000/tigon" has a port, not a tag
        raise ImageError(
            f"image {image!r} has no tag, so it means `latest` and can change under a run; "
            "name a version tag (python -m tigon.platform.image name cuda) or a digest (@sha256:...)"
        )
    if tag in MUTABLE_TAGS:
        raise ImageError(
            f"image {image!r} has the mutable tag {tag!r}: a restarted pod may pull other code; "
            "name a version tag (python -m tigon.platform.image name cuda) or a digest (@sha256:...)"
        )


def pin_references(root: Path = REPO, write: bool = True) -> list[Path]:
    """Set every `ghcr.io/tigon-ml/tigon:<tag>` in the job templates and values.yaml to its variant's computed
    tag; the files that were (with `write=False`: that would be) changed."""
    tags = {variant: image_tag(variant, root) for variant in VARIANTS}
    changed = []
    for pattern in IMAGE_REFERENCES:
        for path in sorted(root.glob(pattern)):
            text = path.read_text()
            pinned = TAGGED_IMAGE.sub(lambda match: f"{match[1]}:{tags[tag_variant(match[2])]}", text)
            if pinned != text:
                changed.append(path)
                if write:
                    path.write_text(pinned)
    return changed


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.platform.image", description="tigon's image tags")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in ("tag", "name"):
        sub = commands.add_parser(command, help=f"print the image {command} of a variant")
        sub.add_argument("variant", choices=VARIANTS)
        if command == "name":
            sub.add_argument("--repository", default=REPOSITORY)
    pin = commands.add_parser("pin", help="write the computed tags into the job templates and values.yaml")
    pin.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file names another tag")
    lock = commands.add_parser("cpu-lock", help="write docker/requirements-cpu.lock from docker/requirements.lock")
    lock.add_argument("--check", action="store_true", help="change nothing; exit 1 if the file is stale")
    args = parser.parse_args(argv)
    try:
        if args.command == "tag":
            print(image_tag(args.variant))
        elif args.command == "name":
            print(image_name(args.variant, args.repository))
        elif args.command == "cpu-lock":
            expected = cpu_lock(LOCK.read_text())
            if CPU_LOCK.is_file() and CPU_LOCK.read_text() == expected:
                return 0
            if args.check:
                print(
                    f"{CPU_LOCK.relative_to(REPO)} is stale: python -m tigon.platform.image cpu-lock", file=sys.stderr
                )
                return 1
            CPU_LOCK.write_text(expected)
        else:
            changed = pin_references(write=not args.check)
            for path in changed:
                verb = "names another tag than" if args.check else "now names"
                print(f"{path.relative_to(REPO)} {verb} the computed one", file=sys.stderr)
            return 1 if args.check and changed else 0
    except ImageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
