"""semipack on tiny random-weight versions of real model families (tests/real_models.py).

For every model and built-in semiring, ``loss.backward()`` runs inside
``semipack.extend(model, semiring)`` (forward inside the block), once with the module extensions
and once on the generic per-op rules (``extensions=False``). Each run is checked against a plain
backward of a fresh copy of the same model:

1. every ``.grad`` is bitwise the plain one, and exactly the plain backward's leaves get one;
2. every leaf the plain backward reaches has a ``semiring_grad`` of its shape;
3. ``Real`` equals the gradient, and every other semiring is consistent with reachability
   (``Boolean``) and with the other semirings' bounds (see ``check_readout``);
4. the generic path gives the extensions' values.

Runs are cached per worker, one model at a time (the tests of a model are collected next to
each other), so the checks of one semiring reuse the reference runs (Boolean, MaxProd, LogCount)
of the others without holding every model's results.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import SEMIRINGS_BY_CLASS
from real_models import MODEL_NAMES, build
from torch import Tensor

import semipack

SEMIRINGS = SEMIRINGS_BY_CLASS


@dataclass(frozen=True)
class Tolerance:
    """How closely float values computed along different routes must agree.

    ``rtol`` is relative to each entry; ``scale_atol`` is relative to the largest gradient entry of
    the whole model (rounding of analytically-zero gradients, e.g. attention key biases, sits at
    that scale times machine epsilon); ``log_atol`` is absolute, for log-domain values and
    entropies (nats).
    """

    rtol: float
    scale_atol: float
    log_atol: float


TOLERANCES = {
    torch.float32: Tolerance(rtol=1e-4, scale_atol=1e-5, log_atol=1e-3),
    torch.float64: Tolerance(rtol=1e-9, scale_atol=1e-12, log_atol=1e-9),
}


@dataclass(frozen=True)
class Run:
    """What one backward left on the leaves of a fresh copy of a model."""

    grads: dict[str, Tensor | None]
    readouts: dict[str, Any]
    shapes: dict[str, torch.Size]
    #: TopPath only: (leaf name, log value of its best entry, the path's log value, the last
    #: step's log value) for the leaf whose best path is read out.
    path: tuple[str, float, float, float] | None = None


def one_model_at_a_time(run: Callable[..., Run]) -> Callable[..., Run]:
    """Cache runs of the most recently requested (model, dtype) only: a resnet18 run holds
    ~90 MB of gradients and semiring values, and a worker sees dozens of runs per model."""
    cache: dict[tuple, Run] = {}

    @functools.wraps(run)
    def cached(name: str, *args: Any) -> Run:
        key = (name, *args)
        model = (name, args[-1])  # the dtype is always the last argument
        if any((k[0], k[-1]) != model for k in cache):
            cache.clear()
        if key not in cache:
            cache[key] = run(name, *args)
        return cache[key]

    return cached


@one_model_at_a_time
def plain_run(name: str, dtype: torch.dtype) -> Run:
    """An ordinary ``loss.backward()``."""
    case = build(name, dtype)
    case.loss().backward()
    leaves = case.named_leaves()
    return Run(
        grads={n: t.grad for n, t in leaves.items()},
        readouts={},
        shapes={n: t.shape for n, t in leaves.items()},
    )


@one_model_at_a_time
def semiring_run(name: str, semiring: str, extensions: bool, dtype: torch.dtype) -> Run:
    """``loss.backward()`` inside ``semipack.extend`` on a fresh copy of the model."""
    case = build(name, dtype)
    sr = SEMIRINGS[semiring]()
    with semipack.extend(case.model, sr, extensions=extensions):
        case.loss().backward()
    leaves = case.named_leaves()
    path = None
    if isinstance(sr, semipack.TopPath):
        leaf_name, leaf = next(
            (n, t)
            for n, t in leaves.items()
            if hasattr(t, "semiring_grad") and bool((t.semiring_grad > 0).any())
        )
        best = sr.path(leaf)
        last = best.steps[-1].log_value if best.steps else math.nan
        path = (leaf_name, float(leaf.semiring_grad.max().log()), best.log_value, last)
    return Run(
        grads={n: t.grad for n, t in leaves.items()},
        readouts={n: getattr(t, "semiring_grad", None) for n, t in leaves.items()},
        shapes={n: t.shape for n, t in leaves.items()},
        path=path,
    )


def gradient_scale(plain: Run) -> float:
    """The largest |gradient| entry over every leaf of the model."""
    return max(float(g.abs().max()) for g in plain.grads.values() if g is not None)


# --- checks -------------------------------------------------------------------------------------


def check_regular_grads(where: str, plain: Run, run: Run) -> None:
    """``.grad`` bitwise equal to a plain backward's, on exactly the plain backward's leaves."""
    assert run.grads.keys() == plain.grads.keys(), where
    filled = {n for n, g in run.grads.items() if g is not None}
    want = {n for n, g in plain.grads.items() if g is not None}
    assert filled == want, f"{where}: leaves lost {want - filled}, extra {filled - want}"
    for leaf in want:
        got, expected = run.grads[leaf], plain.grads[leaf]
        assert got.dtype == expected.dtype and got.shape == expected.shape, (where, leaf)
        assert torch.equal(got, expected), (
            f"{where} {leaf}: .grad differs, max |diff| {(got - expected).abs().max():.3e}"
        )


def check_readout_shapes(where: str, plain: Run, run: Run) -> None:
    """Every leaf a plain backward reaches has a semiring value of its own shape."""
    for leaf, grad in plain.grads.items():
        if grad is None:
            continue
        value = run.readouts[leaf]
        assert value is not None, f"{where} {leaf}: no semiring_grad"
        parts = value if isinstance(value, semipack.Extremes) else (value,)
        for part in parts:
            assert part.shape == run.shapes[leaf], f"{where} {leaf}: shape {tuple(part.shape)}"


def _close(where: str, got: Tensor, want: Tensor, rtol: float, atol: float) -> None:
    """Entries equal within ``atol + rtol * |want|``; ±inf and NaN only where ``want`` has the
    same. Computed in the values' own dtype, in a few passes (leaves have up to 11M entries)."""
    same = (got == want) | (got.isnan() & want.isnan())
    finite = torch.isfinite(got) & torch.isfinite(want)
    ok = same | (finite & ((got - want).abs() <= atol + rtol * want.abs()))
    if not bool(ok.all()):
        bad = ~ok
        worst = (got[bad & finite] - want[bad & finite]).abs()
        raise AssertionError(
            f"{where}: {int(bad.sum())} entries differ (rtol {rtol}, atol {atol:.3e}); worst "
            f"|diff| {float(worst.max()) if worst.numel() else math.nan:.3e}; first: got "
            f"{got[bad][:3].tolist()}, want {want[bad][:3].tolist()}"
        )


def _holds(where: str, condition: Tensor, what: str) -> None:
    """Assert an elementwise condition everywhere, naming how many entries break it."""
    if not bool(condition.all()):
        raise AssertionError(f"{where}: {what} at {int((~condition).sum())} entries")


def _references(name: str, extensions: bool, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Readouts of the semirings the others are checked against, from the same path."""
    return {
        sr: semiring_run(name, sr, extensions, dtype).readouts
        for sr in ("Boolean", "MaxProd", "LogCount")
    }


def check_readout(
    where: str, semiring: str, value: Any, grad: Tensor, refs: dict[str, Any], tol: Tolerance,
    scale: float,
) -> None:  # fmt: skip
    """One leaf's semiring value against the gradient and the reference semirings.

    ``refs`` holds this leaf's Boolean, MaxProd and LogCount values. Where Boolean says a path
    exists: MaxProd > 0 and finite, log MaxProd <= LogSum <= log MaxProd + LogCount (a sum over
    paths lies between its largest term and count x largest term), 0 <= Entropy <= LogCount (the
    entropy of a distribution over N paths is at most log N), LogCount >= 0. Where no path
    exists: each semiring's "no path" value. A non-zero gradient implies a path.
    """
    reach = refs["Boolean"]
    assert reach.dtype == torch.bool, where
    none = ~reach
    _holds(where, reach | (grad == 0), "a non-zero gradient where Boolean says no path")
    if semiring == "Real":
        _close(where, value, grad, tol.rtol, tol.scale_atol * scale)
    elif semiring == "Boolean":
        assert value.dtype == torch.bool and torch.equal(value, reach), where
    elif semiring in ("MaxProd", "TopPath"):
        _holds(where, torch.isfinite(value), "not finite")
        _holds(where, torch.where(reach, value > 0, value == 0), "value > 0 != Boolean")
        if semiring == "TopPath":  # same maximum; softmax edge weights are rounded differently
            _close(f"{where} vs MaxProd", value, refs["MaxProd"], tol.rtol, 0.0)
    elif semiring == "SignedMaxProd":
        largest, smallest = value
        _holds(where, torch.isfinite(largest) & torch.isfinite(smallest), "not finite")
        _holds(where, reach | ((largest == 0) & (smallest == 0)), "a value without a path")
        _holds(where, largest >= smallest, "largest < smallest")
        best = torch.maximum(largest.abs(), smallest.abs())
        _close(f"{where} vs MaxProd", best, refs["MaxProd"], tol.rtol, 0.0)
    elif semiring in ("LogSum", "LogCount"):
        _holds(where, torch.where(reach, torch.isfinite(value), value == -math.inf), "-inf")
        log_max, log_count = refs["MaxProd"].log(), refs["LogCount"]
        if semiring == "LogSum":
            _holds(where, none | (value >= log_max - tol.log_atol), "LogSum < log MaxProd")
            upper = log_max + log_count + tol.log_atol
            _holds(where, none | (value <= upper), "LogSum > log MaxProd + LogCount")
        else:
            _holds(where, none | (value >= -tol.log_atol), "fewer than one path")
    elif semiring == "Entropy":
        _holds(where, torch.where(reach, torch.isfinite(value), value.isnan()), "NaN pattern")
        _holds(where, none | (value >= -tol.log_atol), "negative entropy")
        upper = refs["LogCount"] + tol.log_atol
        _holds(where, none | (value <= upper), "Entropy > LogCount")
    else:
        raise AssertionError(f"no check for {semiring}")


def check_semiring_run(name: str, semiring: str, extensions: bool, dtype: torch.dtype) -> None:
    """Checks 1-3 of the module docstring for one (model, semiring, path)."""
    where = f"{name} {semiring} extensions={extensions} {dtype}"
    plain = plain_run(name, dtype)
    run = semiring_run(name, semiring, extensions, dtype)
    check_regular_grads(where, plain, run)
    check_readout_shapes(where, plain, run)
    refs = _references(name, extensions, dtype)
    tol, scale = TOLERANCES[dtype], gradient_scale(plain)
    for leaf, grad in plain.grads.items():
        if grad is not None:
            leaf_refs = {sr: readouts[leaf] for sr, readouts in refs.items()}
            check_readout(
                f"{where} {leaf}", semiring, run.readouts[leaf], grad, leaf_refs, tol, scale
            )
    if run.path is not None:
        leaf, log_best, log_path, log_last = run.path
        assert math.isclose(log_path, log_best, rel_tol=tol.rtol, abs_tol=tol.log_atol), where
        assert abs(log_last) <= tol.log_atol, f"{where} {leaf}: the path does not end at the root"


def check_same_values(
    where: str, semiring: str, got: dict[str, Any], want: dict[str, Any], plain: Run,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """Two runs' semiring values agree on every leaf a plain backward reaches: Boolean exactly,
    max-product values to ``rtol``, Real to ``rtol`` and the gradient scale, logs to
    ``log_atol``."""
    tol, scale = TOLERANCES[dtype], gradient_scale(plain)
    for leaf, grad in plain.grads.items():
        if grad is None:
            continue
        at = f"{where} {leaf}"
        a, b = got[leaf], want[leaf]
        assert a is not None and b is not None, f"{at}: no semiring_grad"
        if semiring == "Boolean":
            assert torch.equal(a, b), at
        elif semiring == "SignedMaxProd":
            for a_part, b_part in zip(a, b, strict=True):
                _close(at, a_part, b_part, tol.rtol, 0.0)
        elif semiring == "Real":
            _close(at, a, b, tol.rtol, tol.scale_atol * scale)
        elif semiring in ("MaxProd", "TopPath"):
            _close(at, a, b, tol.rtol, 0.0)
        else:
            _close(at, a, b, 0.0, tol.log_atol)


def check_paths_agree(name: str, semiring: str, dtype: torch.dtype) -> None:
    """Check 4: the generic per-op rules give the extensions' semiring values."""
    check_same_values(
        f"{name} {semiring} {dtype}: generic vs extensions",
        semiring,
        semiring_run(name, semiring, False, dtype).readouts,
        semiring_run(name, semiring, True, dtype).readouts,
        plain_run(name, dtype),
        dtype,
    )


# --- expected failures ----------------------------------------------------------------------------

ALL_TESTS = ("extensions", "generic", "agree")


@dataclass(frozen=True)
class ExpectedFailure:
    """A known failure, marked strict: the case turns red once the root cause is fixed.

    ``tests``: which of ``ALL_TESTS`` fail ("agree" compares the generic rules with the
    extensions, so it fails wherever the extensions do); ``dtypes``: in which precision;
    ``semirings``: for which semirings (None: all).
    """

    model: str
    tests: tuple[str, ...]
    reason: str
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    semirings: tuple[str, ...] | None = None


#: Known failures: none today. Add ``ExpectedFailure(model, tests, reason)`` entries (strict
#: xfails) when a model exposes a problem that cannot be fixed at once.
EXPECTED_FAILURES: list[ExpectedFailure] = []


def _xfail_reason(name: str, semiring: str, test: str, dtype: torch.dtype) -> str | None:
    for known in EXPECTED_FAILURES:
        if (
            known.model == name
            and test in known.tests
            and dtype in known.dtypes
            and (known.semirings is None or semiring in known.semirings)
        ):
            return known.reason
    return None


def _cases(models: list[str], dtype: torch.dtype) -> list[Any]:
    """(model, semiring, test) triples, model by model: the tests of one model stay next to each
    other, so xdist hands them to the same worker and they share its cached runs."""
    params = []
    for name in models:
        for semiring in SEMIRINGS:
            for test in ALL_TESTS:
                reason = _xfail_reason(name, semiring, test, dtype)
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                params.append(
                    pytest.param(name, semiring, test, marks=marks, id=f"{name}-{semiring}-{test}")
                )
    return params


def _run_test(name: str, semiring: str, test: str, dtype: torch.dtype) -> None:
    if test == "agree":
        check_paths_agree(name, semiring, dtype)
    else:
        check_semiring_run(name, semiring, test == "extensions", dtype)


#: The slowest models (~10-25 s of a worker each), collected first: xdist then spreads them over
#: the workers and fills in with the quick ones, instead of ending on one worker with a resnet.
SLOWEST_FIRST = ["resnet18_train", "resnet18_eval", "mobilenet_v3_small_train"]
ORDERED_MODELS = SLOWEST_FIRST + [n for n in MODEL_NAMES if n not in SLOWEST_FIRST]


@pytest.mark.parametrize(("name", "semiring", "test"), _cases(ORDERED_MODELS, torch.float32))
def test_real_model(name: str, semiring: str, test: str) -> None:
    """``extensions``/``generic``: checks 1-3 on that path; ``agree``: check 4 (float32)."""
    _run_test(name, semiring, test, torch.float32)


#: Models whose whole graph stays in float64 when built in float64. Not the Hugging Face causal
#: LMs: their loss upcasts the logits with ``.float()``, a downcast for a float64 model, so their
#: loss is float32 and their gradients carry float32 rounding (~1e-7 relative). The LSTM runs
#: here on PyTorch's non-fused cell (the fused mkldnn layer is float32-only).
FLOAT64_MODELS = ["bert_eager", "nn_transformer", "vit_torchvision_train", "lstm"]


@pytest.mark.parametrize(("name", "semiring", "test"), _cases(FLOAT64_MODELS, torch.float64))
def test_real_model_float64(name: str, semiring: str, test: str) -> None:
    """The same checks with float64 weights and tight tolerances (``TOLERANCES``)."""
    _run_test(name, semiring, test, torch.float64)


# --- eager and sdpa attention draw the same graph -------------------------------------------------

HF_FAMILIES = ["bert", "distilbert", "gpt2", "llama", "mistral", "qwen2", "vit_hf", "t5"]


def _family_cases() -> list[Any]:
    params = []
    for family in HF_FAMILIES:
        for semiring in SEMIRINGS:
            params.append(pytest.param(family, semiring, id=f"{family}-{semiring}"))
    return params


@pytest.mark.parametrize(("family", "semiring"), _family_cases())
def test_eager_and_sdpa_attention_agree(family: str, semiring: str) -> None:
    """The same weights with ``attn_implementation="eager"`` and ``"sdpa"`` give the same
    semiring values: fused attention is drawn as its reference decomposition (README). Fresh,
    uncached runs with extensions (the other tests tie the generic rules to them)."""
    eager_name, sdpa_name = f"{family}_eager", f"{family}_sdpa"
    dtype = torch.float32
    eager = semiring_run.__wrapped__(eager_name, semiring, True, dtype).readouts
    sdpa = semiring_run.__wrapped__(sdpa_name, semiring, True, dtype).readouts
    plain = plain_run.__wrapped__(eager_name, dtype)
    check_same_values(f"{family} {semiring}: sdpa vs eager", semiring, sdpa, eager, plain, dtype)
