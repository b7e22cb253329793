"""Every Python example in the README runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import semipack

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    with semipack.scoped_rules():  # rules an example registers leave with it
        exec(compile(BLOCKS[index], f"README example {index}", "exec"), {"__name__": "readme"})
