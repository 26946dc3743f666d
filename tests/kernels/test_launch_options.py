"""Every Triton launch in the ops asks for the options the kernels were tested and measured with."""

from __future__ import annotations

import ast
from pathlib import Path

import tigon.kernels.ops as ops_package

OPS_DIR = Path(ops_package.__file__).parent


def kernel_launches(source: str) -> list[ast.Call]:
    """Calls of the form `kernel[grid](...)`."""
    return [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
    ]


def passes_launch_options(call: ast.Call) -> bool:
    return any(
        keyword.arg is None and isinstance(keyword.value, ast.Name) and keyword.value.id == "LAUNCH_OPTIONS"
        for keyword in call.keywords
    )


def test_every_kernel_launch_passes_the_launch_options():
    launches = {}
    for path in sorted(OPS_DIR.glob("*.py")):
        for call in kernel_launches(path.read_text()):
            launches[f"{path.name}:{call.lineno}"] = passes_launch_options(call)
    assert len(launches) >= 17, launches  # the ops' kernels are launched from 17 places
    assert [where for where, ok in launches.items() if not ok] == []


def test_the_check_sees_a_launch_without_the_options():
    source = "kernel[(4,)](x, y, BLOCK=8, num_warps=4)\nkernel[(4,)](x, y, num_warps=4, **LAUNCH_OPTIONS)\n"
    assert [passes_launch_options(call) for call in kernel_launches(source)] == [False, True]
