"""What keeps rlsys's code readable, checked on every module of rlsys/, actors/, rollout/ and
weight_sync/: modules import in layers (none imports one that imports it back, directly or around a
circle, counting imports inside functions and under TYPE_CHECKING: a circle hidden in a function is
still two modules that cannot be read, moved or tested one without the other), no function is
longer than a screen (MAX_FUNCTION_LINES) and no module longer than MAX_FILE_LINES (one job a
module: a longer one holds two)."""

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("rlsys", "actors", "rollout", "weight_sync")  # the last three are rlsys.<folder> when imported
MAX_FUNCTION_LINES = 60  # a def's first line to its last, docstring and comments included
MAX_FILE_LINES = 600


def _modules() -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            parts = parts if parts[0] == "rlsys" else ["rlsys", *parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_names(tree: ast.AST, package: str) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the rlsys modules it imports (a package's own __init__ and rlsys's left out)."""
    modules = _modules()

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = {module_of(name) for name in _imported_names(ast.parse(path.read_text()), package)
                 if name.startswith("rlsys.")}
        graph[module] = {other for other in found
                         if other and other != module and other != "rlsys" and not module.startswith(other + ".")}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 100 and "rlsys.actors.trainer" in graph["rlsys.actors.group"]  # the walk sees the tree
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        raise AssertionError(f"an import circle: {' -> '.join(error.args[1])}") from None


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        assert set(error.args[1]) == {"a", "b", "c"}
    else:
        raise AssertionError("the circle a -> b -> c -> a was not found")


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], f"split these (at most {MAX_FUNCTION_LINES} lines each): {long}"


def test_no_module_is_longer_than_max_file_lines():
    long = {str(path.relative_to(REPO)): lines for path in _modules().values()
            if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"split these along their jobs (at most {MAX_FILE_LINES} lines each): {long}"
