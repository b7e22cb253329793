"""Fixtures shared by the test modules (the shared functions are in ``helpers.py``).

``semiring_name`` runs a test once per built-in semiring, TopPath included; ``semiring`` is a
fresh instance of it. A test that cannot take some semiring parametrizes ``semiring_name`` itself
with ``helpers.semiring_names(...)`` and says why.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import SEMIRINGS

import semipack


@pytest.fixture(params=list(SEMIRINGS))
def semiring_name(request: pytest.FixtureRequest) -> str:
    """Every built-in semiring's name (a key of ``helpers.SEMIRINGS``, as the oracle names it)."""
    return request.param


@pytest.fixture
def semiring(semiring_name: str) -> semipack.Semiring:
    """A fresh instance of every built-in semiring in turn."""
    return SEMIRINGS[semiring_name]()


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Run a module on one intra-op thread, restoring the setting afterwards.

    The tensors in the oracle modules are tiny, and on a small loaded machine OpenMP threads
    contending for cores made single backward calls up to 1000x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
