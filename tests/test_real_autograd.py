"""End-to-end checks of semiring backpropagation on every model of the zoo (tests/zoo.py).

1. The Real semiring through ``semipack.grad`` reproduces ``torch.autograd.grad``.
2. Inside ``semipack.extend`` every leaf's ``.grad`` is bitwise what a plain backward gives.
3. Every semiring runs, and its readouts are sane on their own and consistent with each other.

Runs under ``extend`` are cached per (model, semiring), so the readout checks reuse them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import SEMIRINGS_BY_CLASS
from torch import Tensor
from zoo import ZOO_NAMES, build

import semipack

SEMIRINGS = SEMIRINGS_BY_CLASS

REQUIRED_MODELS = {
    "residual_mlp",
    "small_cnn",
    "resnet_block_train",
    "transformer_encoder_train",
    "transformer_encoder_eval",
    "hand_attention",
    "multihead_attention",
    "bert_eager",
    "bert_sdpa",
}


@dataclass(frozen=True)
class ExtendRun:
    """What one ``loss.backward()`` inside ``semipack.extend`` left on the leaves."""

    shapes: dict[str, torch.Size]
    grads: dict[str, Tensor | None]
    readouts: dict[str, Any]


@functools.cache
def plain_grads(name: str) -> dict[str, Tensor | None]:
    """``.grad`` of every leaf after an ordinary backward on a fresh copy of the case."""
    case = build(name)
    case.loss().backward()
    return {leaf_name: leaf.grad for leaf_name, leaf in case.named_leaves()}


@functools.cache
def extend_run(name: str, semiring: str) -> ExtendRun:
    """Forward and backward of a fresh copy of the case inside ``semipack.extend``."""
    case = build(name)
    with semipack.extend(case.model, SEMIRINGS[semiring]()):
        case.loss().backward()
    leaves = case.named_leaves()
    return ExtendRun(
        shapes={n: t.shape for n, t in leaves},
        grads={n: t.grad for n, t in leaves},
        readouts={n: getattr(t, "semiring_grad", None) for n, t in leaves},
    )


def _max_abs_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# --- the zoo itself ---------------------------------------------------------------------------


def test_zoo_has_the_required_models() -> None:
    assert len(ZOO_NAMES) >= 17
    assert set(ZOO_NAMES) >= REQUIRED_MODELS, REQUIRED_MODELS - set(ZOO_NAMES)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_is_deterministic(name: str) -> None:
    """Two builds give bitwise equal losses: the premise of the bitwise .grad comparison."""
    case = build(name)
    assert case.name == name
    first, second = case.loss(), build(name).loss()
    assert torch.equal(first, second), (float(first), float(second))


# --- 1. Real semiring == autograd -------------------------------------------------------------


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_real_semiring_matches_autograd(name: str) -> None:
    case = build(name)
    named = case.named_leaves()
    leaves = [t for _, t in named]
    loss = case.loss()
    got = semipack.grad(loss, leaves, semipack.Real(), retain_graph=True)
    want = torch.autograd.grad(loss, leaves)
    assert len(got) == len(want) == len(named)
    for (leaf_name, _), g, w in zip(named, got, want, strict=True):
        assert isinstance(g, Tensor), f"{leaf_name}: got {type(g).__name__}"
        assert g.shape == w.shape, f"{leaf_name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        torch.testing.assert_close(
            g,
            w,
            rtol=1e-10,
            atol=1e-12,
            msg=lambda m, leaf_name=leaf_name: f"{name} {leaf_name}: {m}",
        )


# --- 2. extend keeps .grad bitwise --------------------------------------------------------------


@pytest.mark.parametrize("semiring", list(SEMIRINGS))
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_extend_keeps_regular_grads_bitwise(name: str, semiring: str) -> None:
    want = plain_grads(name)
    run = extend_run(name, semiring)
    assert run.grads.keys() == want.keys()
    for leaf_name, w in want.items():
        g = run.grads[leaf_name]
        assert w is not None, f"plain backward left no grad on {leaf_name}"
        assert g is not None, f"{leaf_name}: extend left no .grad"
        assert g.dtype == w.dtype and g.shape == w.shape, (leaf_name, g.dtype, g.shape)
        assert torch.equal(g, w), (
            f"{name} {leaf_name}: .grad differs under extend({semiring}), "
            f"max |diff| = {_max_abs_diff(g, w):.3e}"
        )


# --- 3. every semiring runs and reads out sanely ------------------------------------------------


def _check_readout(semiring: str, leaf: str, value: Any, shape: torch.Size, grad: Tensor) -> None:
    """Per-semiring sanity of one leaf's readout."""
    if semiring == "SignedMaxProd":
        assert isinstance(value, semipack.Extremes), f"{leaf}: {type(value).__name__}"
        largest, smallest = value
        assert largest.shape == shape and smallest.shape == shape, leaf
        assert not largest.isnan().any() and not smallest.isnan().any(), f"{leaf}: NaN"
        bad = largest < smallest
        assert not bad.any(), (
            f"{leaf}: largest < smallest at {bad.nonzero()[:5].tolist()}: "
            f"{largest[bad][:5].tolist()} < {smallest[bad][:5].tolist()}"
        )
        return
    assert isinstance(value, Tensor), f"{leaf}: readout is {type(value).__name__}"
    assert value.shape == shape, f"{leaf}: readout shape {tuple(value.shape)} != {tuple(shape)}"
    if semiring == "Real":
        torch.testing.assert_close(
            value.to(grad.dtype), grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{leaf}: {m}"
        )
    elif semiring in ("MaxProd", "TopPath"):
        assert torch.isfinite(value).all(), f"{leaf}: non-finite {value[~torch.isfinite(value)]}"
        assert (value >= 0).all(), f"{leaf}: negative {value[value < 0]}"
    elif semiring in ("LogSum", "LogCount"):
        assert not value.isnan().any(), f"{leaf}: NaN at {value.isnan().nonzero()[:5].tolist()}"
        assert not (value == float("inf")).any(), f"{leaf}: +inf"
    elif semiring == "Boolean":
        assert value.dtype == torch.bool, f"{leaf}: dtype {value.dtype}"
    elif semiring == "Entropy":
        finite = torch.isfinite(value)
        assert not value.isinf().any(), f"{leaf}: ±inf entropy"
        assert (value[finite] >= -1e-9).all(), f"{leaf}: negative {value[finite].min()}"
    else:
        raise AssertionError(f"no check for {semiring}")


@pytest.mark.parametrize("semiring", list(SEMIRINGS))
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_semiring_readouts_are_sane(name: str, semiring: str) -> None:
    run = extend_run(name, semiring)
    grads = plain_grads(name)
    for leaf, value in run.readouts.items():
        assert value is not None, f"{name} {leaf}: no semiring_grad under {semiring}"
        _check_readout(semiring, f"{name} {leaf}", value, run.shapes[leaf], grads[leaf])


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_semirings_agree_with_each_other(name: str) -> None:
    runs = {sr: extend_run(name, sr).readouts for sr in SEMIRINGS}
    grads = plain_grads(name)
    for leaf in grads:
        where = f"{name} {leaf}"
        max_prod = runs["MaxProd"][leaf]
        largest, smallest = runs["SignedMaxProd"][leaf]
        torch.testing.assert_close(
            max_prod,
            torch.maximum(largest.abs(), smallest.abs()),
            rtol=1e-9,
            atol=0.0,
            msg=lambda m, where=where: f"{where}: MaxProd vs SignedMaxProd: {m}",
        )
        torch.testing.assert_close(
            runs["TopPath"][leaf],
            max_prod,
            rtol=1e-9,
            atol=0.0,
            msg=lambda m, where=where: f"{where}: TopPath vs MaxProd: {m}",
        )
        reachable = runs["Boolean"][leaf]
        log_sum, log_count = runs["LogSum"][leaf], runs["LogCount"][leaf]
        assert torch.equal(reachable, log_count > float("-inf")), f"{where}: Boolean vs LogCount"
        assert torch.equal(log_sum > float("-inf"), reachable), f"{where}: LogSum vs Boolean"
        entropy = runs["Entropy"][leaf]
        assert torch.equal(entropy.isnan(), log_sum == float("-inf")), (
            f"{where}: Entropy NaN pattern differs from LogSum's -inf pattern"
        )
        assert torch.equal(max_prod > 0, reachable), f"{where}: MaxProd > 0 vs Boolean"
        gradient_without_path = (grads[leaf] != 0) & ~reachable
        assert not gradient_without_path.any(), (
            f"{where}: non-zero gradient where Boolean says no path, at "
            f"{gradient_without_path.nonzero()[:5].tolist()}"
        )
