"""No function of the package runs over 60 lines, its signature and docstring included: a longer one is split into
named steps. The Triton kernels and their launchers (the `*triton*.py` files) are exempt: a kernel is one program."""

import ast

from helpers import REPO

MAX_FUNCTION_LINES = 60


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function of `source` longer than `MAX_FUNCTION_LINES`."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_runs_over_60_lines():
    found = [f"{path.relative_to(REPO)}:{line} {name} ({length} lines)"
             for path in sorted((REPO / "fat5").rglob("*.py")) if "triton" not in path.name
             for name, line, length in long_functions(path.read_text())]
    assert not found, "functions over 60 lines:\n" + "\n".join(found)


def test_a_long_function_is_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def short():\n    pass\n\n\ndef long():\n{body}") == [("long", 5, MAX_FUNCTION_LINES + 1)]
