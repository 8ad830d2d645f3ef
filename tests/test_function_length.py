"""No function of the package runs over 60 lines, its signature and docstring included: a longer one is split into
named steps. Host code is held to it in every file, the kernels' launchers included; a Triton kernel (``@triton.jit``,
or the attention kernels' ``@_jit_for_varying_shapes``, which wraps it) is one program for the GPU and is exempt."""

import ast

from helpers import REPO

MAX_FUNCTION_LINES = 60
KERNEL_DECORATORS = {"triton.jit", "_jit_for_varying_shapes"}


def is_triton_kernel(node: ast.FunctionDef) -> bool:
    """Whether ``node`` is decorated with a Triton JIT (bare, or called with options)."""
    return any(ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator) in KERNEL_DECORATORS
               for decorator in node.decorator_list)


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function of `source` but the Triton kernels longer than
    `MAX_FUNCTION_LINES`."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_runs_over_60_lines():
    paths = [*sorted((REPO / "fat5").rglob("*.py")), REPO / "fat5_command.py"]
    found = [f"{path.relative_to(REPO)}:{line} {name} ({length} lines)"
             for path in paths for name, line, length in long_functions(path.read_text())]
    assert not found, "functions over 60 lines:\n" + "\n".join(found)


def test_a_long_function_is_found_and_only_a_triton_kernel_is_let_through():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"def short():\n    pass\n\n\ndef long():\n{body}"
    assert long_functions(source) == [("long", 5, MAX_FUNCTION_LINES + 1)]
    for decorator in ("@triton.jit", "@triton.jit(do_not_specialize=['n'])", "@launcher\n@triton.jit",
                      "@_jit_for_varying_shapes"):
        assert long_functions(f"{decorator}\ndef kernel():\n{body}") == []
    for decorator in ("@functools.cache", "@torch.no_grad()", "@triton.testing.perf_report(x)"):
        assert long_functions(f"{decorator}\ndef host():\n{body}") == [("host", 2 + decorator.count("\n"),
                                                                         MAX_FUNCTION_LINES + 1)]
