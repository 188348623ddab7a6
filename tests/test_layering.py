"""Imports run downward only: front end / server -> engine (the front-end half) -> core
(the scheduler layer) -> executor -> neutral modules.

Every `import pagedserve...` in the package, lazy ones included, is checked against the
layer table below, so an upward import (executor -> engine, engine -> front end) or an
import circle between packages fails here.
"""

import ast
import pathlib

import pagedserve

ROOT = pathlib.Path(pagedserve.__file__).parent

NEUTRAL = {"lora", "config", "errors", "messages", "sampling_params", "outputs", "model_files", "tokenizer", "engine_args"}
# layer -> the layers it may import (besides itself and the neutral modules)
# structured_outputs (grammars, matchers, the bitmask) sits under the executor: the engine
# compiles and advances grammars, the executor applies the bitmask, the server validates.
ALLOWED = {
    "neutral": set(),
    "structured_outputs": set(),
    "executor": {"structured_outputs"},
    "core": {"executor", "structured_outputs"},
    "engine": {"core", "structured_outputs"},
    "frontend": {"engine", "structured_outputs"},
    "server": {"engine", "structured_outputs"},
    "bench": {"core", "engine", "executor", "frontend", "server", "structured_outputs"},
    "__init__": {"engine", "frontend"},
}


def layer_of(module: str) -> str:
    top = module.split(".")[1] if module.startswith("pagedserve.") else module
    return "neutral" if top in NEUTRAL else top


def imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedserve"):
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pagedserve"):
                    yield alias.name, node.lineno


def test_imports_only_run_downward():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        src_layer = "__init__" if str(rel) == "__init__.py" else layer_of("pagedserve." + rel.parts[0].removesuffix(".py"))
        for module, line in imports(path):
            if module == "pagedserve":
                continue
            dst = layer_of(module)
            if dst in (src_layer, "neutral"):
                continue
            if dst not in ALLOWED[src_layer]:
                bad.append(f"{rel}:{line} ({src_layer}) imports {module} ({dst})")
    assert bad == []
