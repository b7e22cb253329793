"""Every public name of the package has a docstring (inherited ones count: an override of a
documented ``Semiring`` method is documented by its base, as ``help()`` shows it)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import semipack


def _modules() -> list[str]:
    names = ["semipack"]
    for info in pkgutil.walk_packages(semipack.__path__, "semipack."):
        if info.name != "semipack.__main__":  # importing it runs the command line
            names.append(info.name)
    return sorted(names)


def _public_members(module) -> list[tuple[str, object]]:
    """Functions and classes defined in ``module`` (not imported into it) whose names do not
    start with an underscore, and the public methods and properties those classes define."""
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        out.append((name, obj))
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) or isinstance(member, property):
                    out.append((f"{name}.{attr}", getattr(obj, attr)))
    return out


@pytest.mark.parametrize("module_name", _modules())
def test_public_names_have_docstrings(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert inspect.getdoc(module), f"{module_name} has no module docstring"
    missing = [name for name, obj in _public_members(module) if not inspect.getdoc(obj)]
    assert missing == [], f"{module_name}: no docstring on {', '.join(missing)}"
