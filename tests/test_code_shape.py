"""The code's shape, measured: short functions on the request path, every module named by
a test (issue 28's goals; the layering has its own test in test_layering.py)."""

import ast
import pathlib

import pagedserve

ROOT = pathlib.Path(pagedserve.__file__).parent
TESTS = pathlib.Path(__file__).parent
MAX_LINES = 60
# the request path: the scheduler layer, the engine's front-end half, the server, the step
REQUEST_PATH = ["core", "engine", "server", "executor/model_runner.py", "executor/input_batch.py", "executor/sampler.py"]


def functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_on_the_request_path_is_over_60_lines():
    long = []
    for part in REQUEST_PATH:
        target = ROOT / part
        for path in [target] if target.is_file() else sorted(target.rglob("*.py")):
            long += [f"{path.relative_to(ROOT)}:{name} ({n} lines)" for name, n in functions(path) if n > MAX_LINES]
    assert long == []


def test_every_module_is_imported_by_name_in_a_test():
    """`import pagedserve.x.y` / `from pagedserve.x.y import ...` (or `from pagedserve.x import y`)
    somewhere under tests/, for every module of the package."""
    named = set()
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedserve"):
                named.add(node.module)
                named.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                named.update(a.name for a in node.names if a.name.startswith("pagedserve"))
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        module = ".".join(parts)
        # a package counts when a test names it or anything in it
        if module not in named and not (rel.name == "__init__" and any(n.startswith(module + ".") for n in named)):
            missing.append(module)
    assert missing == []
