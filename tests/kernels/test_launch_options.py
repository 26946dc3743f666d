"""Every Triton launch in the ops asks for the options the kernels were tested and measured with, and every kernel
compiles once whatever the data's counts."""

from __future__ import annotations

import ast
from pathlib import Path

import tigon.kernels.ops as ops_package
from tigon.kernels.utils import DATA_COUNTS

OPS_DIR = Path(ops_package.__file__).parent


def kernel_launches(source: str) -> list[ast.Call]:
    """Calls of the form `kernel[grid](...)`."""
    return [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
    ]


def passes_launch_options(call: ast.Call) -> bool:
    """`**LAUNCH_OPTIONS`, or the fusion setting by name (the FP8 cast rounds its product before the clamp)."""
    return any(
        (keyword.arg is None and isinstance(keyword.value, ast.Name) and keyword.value.id == "LAUNCH_OPTIONS")
        or keyword.arg == "enable_fp_fusion"
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
    source = (
        "kernel[(4,)](x, y, BLOCK=8, num_warps=4)\nkernel[(4,)](x, y, num_warps=4, **LAUNCH_OPTIONS)\n"
        "kernel[(4,)](x, y, enable_fp_fusion=False)\n"
    )
    assert [passes_launch_options(call) for call in kernel_launches(source)] == [False, True, True]


def jit_kernels(source: str) -> dict[str, ast.FunctionDef]:
    """The module's `@triton.jit` functions by name (with or without arguments to the decorator)."""
    kernels = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target) == "triton.jit":
                    kernels[node.name] = node
    return kernels


def takes_data_counts(kernel: ast.FunctionDef) -> bool:
    return any(arg.arg in DATA_COUNTS for arg in kernel.args.args)


def leaves_data_counts_unspecialized(kernel: ast.FunctionDef) -> bool:
    takes_counts = takes_data_counts(kernel)
    unspecialized = any(
        isinstance(decorator, ast.Call)
        and any(k.arg == "do_not_specialize" and ast.unparse(k.value) == "DATA_COUNTS" for k in decorator.keywords)
        for decorator in kernel.decorator_list
    )
    return unspecialized == takes_counts


# Faster with their row counts specialized (kernels/utils.py says why): the exceptions.
SPECIALIZED_ROW_COUNTS = ("rms_norm.py", "layer_norm.py", "fp8_linear.py")


def test_every_kernel_that_takes_a_data_count_leaves_it_unspecialized():
    kernels, norms = {}, {}
    for path in sorted(OPS_DIR.glob("*.py")):
        for name, kernel in jit_kernels(path.read_text()).items():
            if path.name in SPECIALIZED_ROW_COUNTS and takes_data_counts(kernel):
                norms[f"{path.name}:{name}"] = leaves_data_counts_unspecialized(kernel)
            else:
                kernels[f"{path.name}:{name}"] = leaves_data_counts_unspecialized(kernel)
    assert sum(1 for where in kernels if where.startswith("cross_entropy.py")) == 6, kernels
    assert len(norms) == 6 and not any(norms.values()), norms  # the norms' 5 kernels and the FP8 cast
    assert [where for where, ok in kernels.items() if not ok] == []


def test_the_check_sees_a_specialized_count():
    source = (
        "@triton.jit\ndef a(X, n_rows, BLOCK: tl.constexpr):\n    pass\n"
        "@triton.jit(do_not_specialize=DATA_COUNTS)\ndef b(X, n_rows):\n    pass\n"
        "@triton.jit\ndef c(X, n_cols):\n    pass\n"
    )
    kernels = jit_kernels(source)
    assert {name: leaves_data_counts_unspecialized(kernel) for name, kernel in kernels.items()} == {
        "a": False,
        "b": True,
        "c": True,
    }
