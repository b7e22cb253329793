"""Every Python example in the README runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    from semipack.rules import registry

    saved = dict(registry._RULES)
    try:
        exec(compile(BLOCKS[index], f"README example {index}", "exec"), {"__name__": "readme"})
    finally:
        registry._RULES.clear()
        registry._RULES.update(saved)
