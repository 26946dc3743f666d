"""The package layout of docs/architecture.md: folders mapped to tigon.*, and no shadowing of `platform`."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_standard_platform_module_importable_from_repo_root():
    code = "import platform, torch; print(platform.__file__, platform.python_version())"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    module_file = result.stdout.split()[0]
    assert not module_file.startswith(str(ROOT)), f"the repo's platform/ shadows the stdlib: {module_file}"


def test_platform_folder_is_a_namespace_package():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_layers_import_under_tigon():
    import tigon.kernels
    import tigon.runtime

    assert Path(tigon.kernels.__file__).parent == ROOT / "kernels"
    assert Path(tigon.runtime.__file__).parent == ROOT / "runtime"


def test_kernels_import_without_heavy_stacks():
    code = (
        "import sys, tigon.kernels, tigon.kernels.functional, tigon.kernels.modules; "
        "heavy = [m for m in ('transformers', 'flytekit', 'lightning', 'deepspeed') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# docs/architecture.md: dependencies point one way, workflows -> platform -> runtime -> kernels.
FORBIDDEN_IMPORTS = {
    "kernels": ("tigon.runtime", "tigon.platform", "workflows"),
    "runtime": ("tigon.platform", "workflows"),
    "platform": ("workflows",),
}


def test_layers_import_only_the_layers_below():
    import ast

    wrong = []
    for layer, forbidden in FORBIDDEN_IMPORTS.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                wrong += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                    for name in names
                    if any(name == f or name.startswith(f + ".") for f in forbidden)
                ]
    assert not wrong, "a layer imports one above it:\n" + "\n".join(wrong)
