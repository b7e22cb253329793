"""What the test modules share: the built-in semirings and comparing readouts with the oracle.

A helper module, not a test module: test modules import it (and ``oracle``, ``zoo``,
``real_models`` and the ``cases_*`` tables), never each other. ``conftest.py`` turns
``SEMIRINGS`` into the ``semiring_name`` / ``semiring`` fixtures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
from oracle import Readout, ScalarGraph, dynamic_programming
from torch import Tensor

import semipack
from semipack.kernels.native import native_available as _native_available

#: Every built-in semiring, under the name ``tests/oracle.py`` uses for the semiring whose values
#: it computes (TopPath has no oracle of its own: its readout is MaxProd's, see ``ORACLE_NAME``).
SEMIRINGS: dict[str, Callable[[], semipack.Semiring]] = {
    "real": semipack.Real,
    "max_prod": semipack.MaxProd,
    "top_path": semipack.TopPath,
    "signed_max_prod": semipack.SignedMaxProd,
    "log_sum": semipack.LogSum,
    "log_count": semipack.LogCount,
    "boolean": semipack.Boolean,
    "entropy": semipack.Entropy,
}

#: The oracle semiring whose readouts each built-in must reproduce.
ORACLE_NAME: dict[str, str] = {name: name for name in SEMIRINGS} | {"top_path": "max_prod"}

#: The same semirings keyed by class name ("MaxProd"), for the modules that report that way.
SEMIRINGS_BY_CLASS: dict[str, Callable[[], semipack.Semiring]] = {
    make.__name__: make for make in SEMIRINGS.values()
}


def semiring_names(*leave_out: str) -> list[str]:
    """Names of every built-in semiring but ``leave_out`` (say why next to each use)."""
    unknown = set(leave_out) - set(SEMIRINGS)
    assert not unknown, f"not built-in semirings: {sorted(unknown)}"
    return [name for name in SEMIRINGS if name not in leave_out]


def all_semirings(*leave_out: str) -> list[semipack.Semiring]:
    """One fresh instance of every built-in semiring but ``leave_out``."""
    return [SEMIRINGS[name]() for name in semiring_names(*leave_out)]


def graph_nodes(root: Tensor) -> list:
    """The autograd nodes reachable from ``root``'s ``grad_fn``, each once."""
    seen: dict[object, None] = {}
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = None
        stack.extend(n for n, _ in node.next_functions)
    return list(seen)


def oracle_readouts(graph: ScalarGraph, leaves: Sequence[Tensor], name: str) -> list[Readout]:
    """The oracle's readouts of the leaves for built-in semiring ``name`` (TopPath: MaxProd's)."""
    return dynamic_programming(graph, leaves, ORACLE_NAME[name])


# --------------------------------------------------------------------------------------------
# Comparing readouts
# --------------------------------------------------------------------------------------------

#: Relative tolerance for float64 values computed along different routes.
RTOL = 1e-7
#: Absolute slack for log-domain quantities and entropies whose exact value may be 0.
LOG_ATOL = 1e-9


def mismatch(where: str, expected: Tensor, actual: Tensor, what: str) -> str:
    return f"{where}: {what}\n  expected: {expected.tolist()}\n  actual:   {actual.tolist()}"


def _assert_same_mask(where: str, expected: Tensor, actual: Tensor, mask: str) -> Tensor:
    """Assert the "no path" positions agree exactly; return them."""
    if mask == "zero":
        exp_mask, act_mask = expected == 0, actual == 0
    elif mask == "neginf":
        exp_mask, act_mask = expected == -math.inf, actual == -math.inf
    else:
        exp_mask, act_mask = torch.isnan(expected), torch.isnan(actual)
    assert torch.equal(exp_mask, act_mask), mismatch(
        where, expected, actual, f"'no path' ({mask}) positions differ"
    )
    return exp_mask


def _assert_close_where(
    where: str, expected: Tensor, actual: Tensor, skip: Tensor, atol: float
) -> None:
    keep = ~skip
    assert torch.isfinite(actual[keep]).all(), mismatch(where, expected, actual, "not finite")
    assert torch.allclose(actual[keep], expected[keep], rtol=RTOL, atol=atol), mismatch(
        where, expected, actual, f"values differ beyond rtol={RTOL}, atol={atol}"
    )


def assert_readout_matches(
    semiring_name: str, expected: Readout, actual: object, where: str
) -> None:
    """Compare one leaf's readout; "no path" markers must match exactly, values to float64.

    ``semiring_name`` is a key of ``SEMIRINGS``; ``expected`` is the oracle's readout for it
    (``oracle_readouts``), so TopPath is held to MaxProd's values.
    """
    where = f"{semiring_name} {where}"
    semiring_name = ORACLE_NAME[semiring_name]
    if semiring_name == "signed_max_prod":
        assert isinstance(actual, tuple), f"{where}: expected an Extremes tuple, got {actual!r}"
        assert isinstance(expected, tuple)
        largest, smallest = actual.largest, actual.smallest  # type: ignore[attr-defined]
        for label, exp, act in (
            ("largest", expected[0], largest),
            ("smallest", expected[1], smallest),
        ):
            assert act.shape == exp.shape, f"{where} {label}: shape {act.shape} != {exp.shape}"
            no_path = _assert_same_mask(f"{where} {label}", exp, act.detach().double(), "zero")
            _assert_close_where(f"{where} {label}", exp, act.detach().double(), no_path, 0.0)
        return
    assert isinstance(expected, Tensor) and isinstance(actual, Tensor), where
    assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
    if semiring_name == "boolean":
        assert actual.dtype == torch.bool, f"{where}: dtype {actual.dtype}, expected bool"
        assert torch.equal(actual, expected), mismatch(where, expected, actual, "differ")
        return
    assert actual.is_floating_point(), f"{where}: dtype {actual.dtype}"
    act = actual.detach().double()
    if semiring_name == "real":
        scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
        _assert_close_where(
            where, expected, act, torch.zeros_like(act, dtype=torch.bool), 1e-9 * scale
        )
    elif semiring_name == "max_prod":
        no_path = _assert_same_mask(where, expected, act, "zero")
        _assert_close_where(where, expected, act, no_path, 0.0)
    elif semiring_name in ("log_sum", "log_count"):
        no_path = _assert_same_mask(where, expected, act, "neginf")
        _assert_close_where(where, expected, act, no_path, LOG_ATOL)
    elif semiring_name == "entropy":
        no_path = _assert_same_mask(where, expected, act, "nan")
        _assert_close_where(where, expected, act, no_path, LOG_ATOL)
    else:
        raise AssertionError(f"unknown semiring {semiring_name}")


class MinProd(semipack.Semiring):
    """The weakest path (the README's user semiring): min over paths of the product of
    |derivatives|, in log space, built from the primitives only."""

    zero = (math.inf,)
    one = (0.0,)

    def lift(self, w: Tensor) -> tuple[Tensor, ...]:
        lw = w.to(self.state_dtype(w.dtype)).abs().log()
        return (torch.where(w == 0, math.inf, lw),)

    def plus(self, a, b):
        return (torch.minimum(a[0], b[0]),)

    def times(self, a, b):
        return (a[0] + b[0],)

    def sum(self, a, dims, keepdim=False):
        return (a[0].amin(dims, keepdim=keepdim),)

    def readout(self, a):
        return a[0].exp()


def tiny_bert_config(**overrides):
    """A BERT of one layer, hidden size 8, two heads and no dropout (tests build it in
    seconds, with random weights)."""
    import transformers

    settings = dict(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertConfig(**(settings | overrides))


class SquaresItsGradient(torch.autograd.Function):
    """Identity forward; its backward multiplies the gradient by itself, which has no semiring
    meaning: a semiring backward fails there (``UnsupportedOpError``, "product of two
    messages"). For tests of what a failed pass leaves behind."""

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g * g


#: Skips a test module where the native kernels cannot run (no C compiler, not x86-64 with
#: AVX2) or are switched off (``SEMIPACK_NATIVE=0``): ``pytestmark = needs_native``.
needs_native = pytest.mark.skipif(
    not _native_available(),
    reason="native kernels not available here or switched off (SEMIPACK_NATIVE=0)",
)
