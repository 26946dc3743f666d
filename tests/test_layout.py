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


def runtime_import_graph() -> dict[str, dict[str, int]]:
    """Which tigon.runtime modules each runtime/*.py imports, and on which line: at the top or inside a function
    alike (an import hidden in a function still closes a cycle), leaving out `if TYPE_CHECKING:` blocks, which
    never run."""
    import ast

    modules = {path.stem for path in (ROOT / "runtime").glob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for path in sorted((ROOT / "runtime").glob("*.py")):
        tree = ast.parse(path.read_text())
        type_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for statement in node.body
            for inner in ast.walk(statement)
        }
        imported: dict[str, int] = {}
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tigon.runtime":
                names = [alias.name for alias in node.names]
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("tigon.runtime.")
            ):
                names = [node.module.split(".")[2]]
            elif isinstance(node, ast.Import):
                names = [alias.name.split(".")[2] for alias in node.names if alias.name.startswith("tigon.runtime.")]
            else:
                continue
            for name in names:
                if name in modules and name != path.stem:
                    imported.setdefault(name, node.lineno)
        graph[path.stem] = imported
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """A cycle of `graph` as the path of modules that closes it (first module repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once all it reaches is explored
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_find_cycle_reports_the_path_that_closes_it():
    graph = {"a": {"b": 1}, "b": {"c": 4}, "c": {"a": 9}, "d": {"a": 2}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 3, "b": 5}}) is None


def test_runtime_modules_import_each_other_one_way():
    """docs/architecture.md, "Inside the runtime": imports among the runtime's modules form no cycle."""
    graph = runtime_import_graph()
    assert graph["trainer"] and graph["torch_trainer"], "the import graph reads the runtime's imports"
    cycle = find_cycle(graph)
    assert cycle is None, "runtime modules import each other in a cycle: " + " -> ".join(
        f"runtime/{a}.py:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:], strict=False)
    )


def test_test_modules_import_helpers_not_other_test_modules():
    """docs/architecture.md: helpers several test modules use live in helper modules (configs.py, worker_groups.py,
    helpers.py, ...), so no test module imports another. tests/compat collects the patching tests (and one compile
    test) again on purpose."""
    import ast

    wrong = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.parent.name == "compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.module else [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            wrong += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[-1].startswith("test_")
            ]
    assert not wrong, "a test module imports another; move the shared helper into a helper module:\n" + "\n".join(wrong)
