"""The package's imports form layers without circles: every module under fat5/ (and the `fat5` console entry beside
it) is read with `ast`, each import it makes, at the top or inside a function, resolved to the module it loads. A
string that is a dotted module's full name counts as an import too: `importlib.import_module` loads it by name. And
`import fat5` stays cheap."""

import ast
import subprocess
import sys
from importlib import import_module
from pathlib import Path

from helpers import REPO

from fat5.remote_code import PIPELINE_CLASS

PACKAGE = REPO / "fat5"
CONSOLE_ENTRY = REPO / "fat5_command.py"

# Lowest first; a module may import its own layer's modules and lower ones, never a higher layer's. The first prefix
# a module's name starts with (longest wins) gives its layer.
LAYERS = [
    ["fat5.errors", "fat5.dtypes", "fat5.conversion_defaults", "fat5.configuration_fat5", "fat5.kernels",
     "fat5.position_encoding", "fat5.token_layout", "fat5.remote_code", "fat5.pipeline_fat5"],
    ["fat5.modeling_fat5", "fat5.graphed_decoding", "fat5.integrations"],
    ["fat5.conversion", "fat5.hub_upload", "fat5.trainer", "fat5.output_folder", "fat5.folder_contents",
     "fat5.checkpoints", "fat5.testing"],
    ["fat5.commands", "fat5.cli", "fat5_command"],
]
# `fat5/__init__.py` is the public facade: it registers the models with transformers' Auto classes, so it stands on
# the modelling layer and only the tools and commands above may import from it.
FACADE = "fat5"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules["fat5_command"] = CONSOLE_ENTRY
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` (at `path`) imports, wherever in the file the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            candidates = [node.value] if node.value in known else []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from package import module` loads the submodule; `from module import name` the module itself
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate:
                found.add(candidate)
                break
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import themselves, and the strongly connected components of more than one module (Tarjan's
    algorithm, iteratively)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return components


def layer_of(name: str) -> int:
    if name == FACADE:
        return 1
    matches = [(len(prefix), level) for level, prefixes in enumerate(LAYERS) for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{name} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
            for name, targets in sorted(graph.items()) for target in sorted(targets)
            if layer_of(target) > layer_of(name)]


def test_the_module_names_are_resolved():
    """The reader finds the imports it must: absolute, relative, lazy, and `from package import submodule`."""
    graph = import_graph()
    assert "fat5.kernels.attention" in graph["fat5.modeling_fat5"]
    assert "fat5.errors" in graph["fat5.conversion.convert"]
    assert "fat5.commands.hub" in graph["fat5_command"]


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(component) for component in found)


def test_no_module_imports_a_higher_layer():
    upward = upward_imports(import_graph())
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_checks_find_a_circle_a_self_import_and_an_upward_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"], ["d"]]
    assert upward_imports({"fat5.kernels.attention": {"fat5.errors", "fat5.modeling_fat5"}, "fat5.errors": set(),
                           "fat5.modeling_fat5": {"fat5"}, "fat5": set()}) == [
        "fat5.kernels.attention (layer 0) imports fat5.modeling_fat5 (layer 1)"]


def test_importing_fat5_leaves_transformers_pipelines_unloaded():
    # they cost seconds (image and audio processors) to every `import fat5`, `fat5 pretrain` and remote-code load;
    # a saved folder names its pipeline's class instead (remote_code.PIPELINE_CLASS)
    code = "import sys, fat5; print(sorted(name for name in sys.modules if name.startswith('transformers.pipelines')))"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert completed.stdout.strip() == "[]"
    module_name, _, class_name = PIPELINE_CLASS.partition(".")
    assert getattr(import_module(f"fat5.{module_name}"), class_name).__module__ == f"fat5.{module_name}"
