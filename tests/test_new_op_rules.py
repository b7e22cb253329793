"""Rules for group norm, transposed convolutions, interpolation, F.unfold/F.fold, F.bilinear,
masked_scatter, index_copy/index_fill, channel shuffle, soft/hard shrink and the margin losses.

Each op is checked, for every built-in semiring and several geometries, against the brute-force
oracle (``tests/oracle.py``, which reads every edge weight off autograd's own backward in
float64) and, for Real, against ``torch.autograd.grad``; in float32 against the float64 oracle;
and with two user semirings built from the primitives only, against small dynamic programs over
the oracle's scalar graph written here. Hand-counted cases pin down what the oracle could share
with the rules: taps that meet on one input entry are one edge, exact zero coefficients none.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cases_ops import CASES, case_leaves, weighted_loss
from helpers import SEMIRINGS, MinProd, assert_readout_matches, oracle_readouts
from oracle import ScalarGraph, build_graph, dynamic_programming
from torch import Tensor

import semipack
from semipack.messages.windows import ConvGeometry
from semipack.rules import contractions, interpolation
from semipack.rules.convolution import conv_messages, transposed_per_tap_messages
from semipack.rules.normalization import normalized_contract_dense

pytestmark = pytest.mark.usefixtures("single_thread")


ALL_SEMIRINGS = list(SEMIRINGS)


@functools.cache
def _graph(name: str) -> tuple[Tensor, list[Tensor], ScalarGraph]:
    """The float64 loss, its leaves and the oracle's graph, built once per case and worker."""
    leaves = case_leaves(CASES[name])
    loss = weighted_loss(CASES[name], leaves)
    return loss, leaves, build_graph(loss)


@pytest.mark.parametrize("name", list(CASES))
def test_rule_matches_oracle(name: str, semiring_name: str) -> None:
    loss, leaves, graph = _graph(name)
    expected = oracle_readouts(graph, leaves, semiring_name)
    sr = SEMIRINGS[semiring_name]()
    actual = semipack.grad(loss, leaves, sr, retain_graph=True)
    for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert_readout_matches(semiring_name, want, got, f"{name} leaf {i}")
    if semiring_name == "real":
        autograd = torch.autograd.grad(loss, leaves, retain_graph=True)
        for got, want in zip(actual, autograd, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("semiring_name", ["real", "log_count"])
@pytest.mark.parametrize("name", list(CASES))
def test_rule_with_regular_gradients_matches_oracle(name: str, semiring_name: str) -> None:
    """The same cases in an ordinary backward under ``extend`` (regular gradients alongside,
    which ``semipack.grad`` leaves out): a rule whose state has another shape than its gradient
    (PReLU's weight once did) is an error, never a broadcast. LogCount counts every path, so a
    path counted twice shows; Real must equal ``.grad``."""
    _, leaves, graph = _graph(name)
    expected = oracle_readouts(graph, leaves, semiring_name)
    fresh = [leaf.detach().clone().requires_grad_(True) for leaf in leaves]
    with semipack.extend(torch.nn.Module(), SEMIRINGS[semiring_name]()):
        weighted_loss(CASES[name], fresh).backward()
    for i, (want, leaf) in enumerate(zip(expected, fresh, strict=True)):
        assert_readout_matches(semiring_name, want, leaf.semiring_grad, f"{name} leaf {i}")
    if semiring_name == "real":
        for leaf in fresh:
            torch.testing.assert_close(leaf.semiring_grad, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_top_path_value_is_max_prod_and_its_path_reads_out(name: str) -> None:
    loss, leaves, _ = _graph(name)
    tp = semipack.TopPath()
    best = semipack.grad(loss, leaves, tp, retain_graph=True)
    max_prod = semipack.grad(loss, leaves, semipack.MaxProd(), retain_graph=True)
    for got, want in zip(best, max_prod, strict=True):
        assert torch.equal(got, want)
    path = tp.path(leaves[0])  # the best entry of the first leaf, walked up to the root
    assert path.value == pytest.approx(float(max_prod[0].max()), rel=1e-12)
    assert path.steps[-1].log_value == pytest.approx(0.0, abs=1e-12)


# --- float32 ---------------------------------------------------------------------------------

#: Cases whose coefficients are exact in float32. (Antialiasing 5 -> 3 has a tap that is
#: rounding noise: 7.9e-17 in float64, an edge; exactly 0 in float32, none. Each dtype follows
#: its own op, so such a case cannot be compared across dtypes.)
FLOAT32_CASES = [
    "group_norm_1_group_2d",
    "conv_transpose2d_strided",
    "bicubic_align_corners",
    "bilinear_antialias_half",
    "trilinear",
    "unfold_geometry",
    "fold_geometry",
    "bilinear_layer",
    "masked_scatter_spare_source",
    "index_copy_dim1_unsorted",
    "channel_shuffle",
    "softshrink",
    "multilabel_margin_none",
]
#: float32 against float64: relative error of the values, absolute of logs and entropies.
F32_TOL = 2e-4


def _assert_float32_close(semiring_name: str, expected, actual, where: str) -> None:
    if semiring_name == "signed_max_prod":
        pairs = [(expected[0], actual.largest), (expected[1], actual.smallest)]
    else:
        pairs = [(expected, actual)]
    for want, got in pairs:
        assert got.shape == want.shape, where
        if semiring_name == "boolean":
            assert torch.equal(got, want), where
            continue
        assert got.dtype == torch.float32, where
        got = got.double()
        same_nan = torch.equal(torch.isnan(got), torch.isnan(want))
        assert same_nan and torch.equal(torch.isinf(got), torch.isinf(want)), where
        live = torch.isfinite(want)
        scale = max(1.0, float(want[live].abs().max())) if semiring_name == "real" else 1.0
        torch.testing.assert_close(
            got[live], want[live], rtol=F32_TOL, atol=F32_TOL * scale, msg=where
        )


@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_float32_values_match_the_float64_oracle(name: str) -> None:
    _, leaves64, graph = _graph(name)
    leaves = [t.detach().float().requires_grad_(True) for t in leaves64]
    loss = weighted_loss(CASES[name], leaves)
    for semiring_name in ALL_SEMIRINGS:
        expected = oracle_readouts(graph, leaves64, semiring_name)
        sr = SEMIRINGS[semiring_name]()
        actual = semipack.grad(loss, leaves, sr, retain_graph=True)
        for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
            _assert_float32_close(semiring_name, want, got, f"{semiring_name} {name} leaf {i}")


# --- user semirings: only the primitives -------------------------------------------------------


#: Edges at or below this |weight| do not count for ``StrongReach``.
STRONG = 0.3


class StrongReach(semipack.Semiring):
    """Is there a path on which every |derivative| exceeds ``STRONG``? (1.0 or 0.0)

    Its lift is not multiplicative (0.5 and 0.5 pass, their product 0.25 does not), so it
    only gives the oracle's answer if every rule lifts each edge's own weight.
    """

    zero = (0.0,)
    one = (1.0,)

    def lift(self, w: Tensor) -> tuple[Tensor, ...]:
        return ((w.abs() > STRONG).to(self.state_dtype(w.dtype)),)

    def plus(self, a, b):
        return (torch.maximum(a[0], b[0]),)

    def times(self, a, b):
        return (a[0] * b[0],)

    def sum(self, a, dims, keepdim=False):
        return (a[0].amax(dims, keepdim=keepdim),)


def _user_oracle(graph: ScalarGraph, leaves: list[Tensor], kind: str) -> list[Tensor]:
    """Min path product (``kind="min"``) or strong reachability (``"strong"``) of each leaf
    entry, by one sweep over the oracle's Jacobian blocks (already in a valid order)."""
    empty = np.inf if kind == "min" else 0.0
    best = {slot: np.full(graph.slot_size(slot), empty) for slot in graph.slot_shapes}
    best[graph.root_slot][graph.root_entry] = 1.0
    for block in graph.blocks:
        if block.weights.shape[0] == 0:
            continue
        mag, source = np.abs(block.weights), best[block.out_slot][:, None]
        if kind == "min":
            with np.errstate(invalid="ignore"):
                found = np.where(mag != 0, source * mag, np.inf).min(axis=0)
            best[block.in_slot] = np.minimum(best[block.in_slot], found)
        else:
            found = ((mag > STRONG) * source).max(axis=0)
            best[block.in_slot] = np.maximum(best[block.in_slot], found)
    out = []
    for leaf in leaves:
        slot = graph.slot_of_leaf(leaf)
        values = best[slot] if slot is not None else np.full(leaf.numel(), empty)
        out.append(torch.from_numpy(values).reshape(leaf.shape))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_user_semirings_get_the_oracle_values(name: str) -> None:
    loss, leaves, graph = _graph(name)
    for sr, kind in ((MinProd(), "min"), (StrongReach(), "strong")):
        actual = semipack.grad(loss, leaves, sr, retain_graph=True)
        for got, want in zip(actual, _user_oracle(graph, leaves, kind), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=0, msg=f"{kind} {name}")


def test_strong_reach_needs_the_literal_edges() -> None:
    """bilinear 2 -> 3 with align_corners: out[1, 1] reads x at source (0.5, 0.5), per-dim
    coefficients 0.5 and 0.5, each above the threshold; the four edges weigh 0.25, none above
    it. Lifting per dim would report a strong path; the literal edges report none."""
    x = torch.randn(1, 1, 2, 2, dtype=torch.float64, requires_grad=True)
    out = F.interpolate(x, size=(3, 3), mode="bilinear", align_corners=True)
    (reach,) = semipack.grad(out[0, 0, 1, 1], x, StrongReach(), retain_graph=True)
    assert reach.tolist() == [[[[0.0, 0.0], [0.0, 0.0]]]]
    # out[0, 1] reads x[0, 0] and x[0, 1] with weights 0.5 each: strong edges.
    (reach,) = semipack.grad(out[0, 0, 0, 1], x, StrongReach())
    assert reach.tolist() == [[[[1.0, 1.0], [0.0, 0.0]]]]


# --- hand-counted edges --------------------------------------------------------------------------


def test_bicubic_border_taps_are_one_edge_and_zero_coefficients_none() -> None:
    """3 -> 5 with align_corners: sources 0, 0.5, 1, 1.5, 2 (cubic kernel, A = -0.75).

    At integer sources the outer taps weigh exactly 0: no edge. At 0.5 the taps hit x0 (twice,
    clamped), x1, x2 with weights -0.09375 + 0.59375 = 0.5, 0.59375, -0.09375; at 1.5
    symmetrically. So each input entry has 3 paths from the sum, and out[3] reaches x2 by ONE
    edge of weight 0.5 (not 0.59375 and -0.09375 separately).
    """
    x = torch.randn(1, 1, 1, 3, dtype=torch.float64, requires_grad=True)
    out = F.interpolate(x, size=(1, 5), mode="bicubic", align_corners=True)
    (count,) = semipack.grad(out.sum(), x, semipack.LogCount(log=False))
    torch.testing.assert_close(count, torch.full_like(count, 3.0), rtol=1e-12, atol=0)
    (best,) = semipack.grad(out[0, 0, 0, 3], x, semipack.MaxProd())
    torch.testing.assert_close(best.flatten(), torch.tensor([0.09375, 0.59375, 0.5]).double())
    (paths,) = semipack.grad(out[0, 0, 0, 3], x, semipack.LogCount(log=False))
    torch.testing.assert_close(paths, torch.ones_like(paths), rtol=1e-12, atol=0)


def test_unfold_counts_the_windows_covering_each_entry() -> None:
    x = torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    (count,) = semipack.grad(F.unfold(x, 2).sum(), x, semipack.LogCount(log=False))
    corners_edges_centre = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]])
    want = corners_edges_centre.expand(1, 2, 3, 3).double()
    torch.testing.assert_close(count, want, rtol=1e-12, atol=0)


def test_fold_padding_columns_have_no_path() -> None:
    """Column entries that fold into the padding reach nothing: Boolean False, MaxProd 0."""
    cols = torch.randn(1, 4, 9, dtype=torch.float64, requires_grad=True)
    out = F.fold(cols, (2, 2), 2, padding=1)  # 3 x 3 windows over the padded 4 x 4
    (reach,) = semipack.grad(out.sum(), cols, semipack.Boolean(), retain_graph=True)
    (best,) = semipack.grad(out.sum(), cols, semipack.MaxProd(), retain_graph=True)
    (grad,) = torch.autograd.grad(out.sum(), cols)  # 1 where the entry lands, 0 in the padding
    assert torch.equal(reach, grad != 0)
    assert torch.equal(best, grad)
    assert int(reach.sum()) == 4 * 4  # each of the 4 output positions is hit by 4 taps


def test_group_norm_with_an_empty_batch() -> None:
    x = torch.randn(0, 4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    loss = F.group_norm(x, 2, w, b).sum()
    gx, gw, gb = semipack.grad(loss, [x, w, b], semipack.LogSum(), retain_graph=True)
    assert gx.shape == (0, 4, 3)
    assert torch.equal(gw, torch.full((4,), -math.inf, dtype=torch.float64))
    assert torch.equal(gb, torch.full((4,), -math.inf, dtype=torch.float64))
    real = semipack.grad(loss, [x, w, b], semipack.Real())
    assert torch.equal(real[1], torch.zeros(4, dtype=torch.float64))


def _counts(loss: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    return list(semipack.grad(loss, leaves, semipack.LogCount(log=False), retain_graph=True))


def _assert_values(got: Tensor, want: list) -> None:
    """Equal to float64 rounding (MaxProd works in log space: 7 reads back as 6.999...)."""
    expected = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_masked_scatter_with_no_true_entry_leaves_the_source_unreached() -> None:
    """An all-False mask takes nothing from the source: every source entry has no path (Real 0,
    MaxProd 0, Boolean False, LogSum -inf) and every entry of ``self`` its one path."""
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    src = torch.randn(4, dtype=torch.float64, requires_grad=True)
    loss = x.masked_scatter(torch.zeros(2, 3, dtype=torch.bool), src).sum()
    gx, gs = semipack.grad(loss, [x, src], semipack.Boolean(), retain_graph=True)
    assert bool(gx.all()) and not bool(gs.any())
    _, log_sum = semipack.grad(loss, [x, src], semipack.LogSum(), retain_graph=True)
    assert torch.equal(log_sum, torch.full((4,), -math.inf, dtype=torch.float64))
    _, best = semipack.grad(loss, [x, src], semipack.MaxProd(), retain_graph=True)
    assert torch.equal(best, torch.zeros(4, dtype=torch.float64))
    _, real = semipack.grad(loss, [x, src], semipack.Real())
    assert torch.equal(real, torch.zeros(4, dtype=torch.float64))


def test_masked_scatter_fills_true_entries_in_row_major_order() -> None:
    """mask [[T, F], [F, T]] takes source[0] into out[0, 0] and source[1] into out[1, 1];
    source[2] is spare. With loss = sum(out * w): source gets |w00|, |w11|, no path; x gets
    |w01| and |w10| where the mask is False, no path where it is True."""
    x = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    src = torch.randn(3, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[2.0, -3.0], [5.0, -7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False], [False, True]])
    loss = (x.masked_scatter(mask, src) * w).sum()
    gx, gs = semipack.grad(loss, [x, src], semipack.MaxProd(), retain_graph=True)
    _assert_values(gs, [2.0, 7.0, 0.0])
    _assert_values(gx, [[0.0, 3.0], [5.0, 0.0]])
    cx, cs = _counts(loss, [x, src])
    assert cs.tolist() == [1.0, 1.0, 0.0] and cx.tolist() == [[0.0, 1.0], [1.0, 0.0]]


def test_index_copy_paths_by_hand() -> None:
    """out = x.index_copy(0, [2, 0], s) = [s1, x1, s0]; loss = out . [1, -2, 3]: x reaches the
    loss only through x1 (weight 2), s0 with weight 3, s1 with weight 1. (PyTorch leaves
    repeated indices undefined, so no case repeats one.)"""
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    s = torch.randn(2, dtype=torch.float64, requires_grad=True)
    out = x.index_copy(0, torch.tensor([2, 0]), s)
    loss = (out * torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)).sum()
    gx, gs = semipack.grad(loss, [x, s], semipack.MaxProd(), retain_graph=True)
    _assert_values(gx, [0.0, 2.0, 0.0])
    _assert_values(gs, [3.0, 1.0])
    rx, rs = semipack.grad(loss, [x, s], semipack.Boolean(), retain_graph=True)
    assert rx.tolist() == [False, True, False] and rs.tolist() == [True, True]
    hi, lo = semipack.grad(loss, x, semipack.SignedMaxProd())[0]
    _assert_values(hi, [0.0, -2.0, 0.0])
    _assert_values(lo, [0.0, -2.0, 0.0])


def test_channel_shuffle_moves_channel_2_to_1() -> None:
    """groups=2 over 4 channels: output channels are input channels [0, 2, 1, 3]."""
    x = torch.randn(1, 4, 2, dtype=torch.float64, requires_grad=True)
    (reach,) = semipack.grad(F.channel_shuffle(x, 2)[0, 1].sum(), x, semipack.Boolean())
    want = torch.zeros(1, 4, 2, dtype=torch.bool)
    want[0, 2] = True
    assert torch.equal(reach, want)


@pytest.mark.parametrize("shrink", [F.softshrink, F.hardshrink])
def test_shrink_has_no_edge_inside_the_dead_zone(shrink) -> None:
    """Derivative 1 where |x| > lambd and 0 on [-lambd, lambd] (both ends included)."""
    x = torch.tensor([-1.0, -0.5, 0.2, 0.5, 0.8], dtype=torch.float64, requires_grad=True)
    (count,) = semipack.grad(shrink(x, 0.5).sum(), x, semipack.LogCount(log=False))
    assert count.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_multi_margin_loss_edges_by_hand() -> None:
    """x = [-2, 1, 0.5], target 1, margin 1, p 1: the terms for j = 0 (1 - 1 - 2 < 0) and
    j = 2 (1 - 1 + 0.5 = 0.5) give loss = 0.5 / 3; x0 has no edge, x2 weight 1/3, x1 -1/3."""
    x = torch.tensor([[-2.0, 1.0, 0.5]], dtype=torch.float64, requires_grad=True)
    loss = F.multi_margin_loss(x, torch.tensor([1]))
    (best,) = semipack.grad(loss, x, semipack.MaxProd(), retain_graph=True)
    _assert_values(best, [[0.0, 1 / 3, 1 / 3]])
    (count,) = _counts(loss, [x])
    assert count.tolist() == [[0.0, 1.0, 1.0]]


def test_multilabel_margin_loss_edges_by_hand() -> None:
    """x = [1.5, 0, 1], labels {0}: the terms 1 - (x0 - xj) are -0.5 (j = 1, inactive) and 0.5
    (j = 2), so x0 has weight -1/3, x2 weight 1/3 and x1 no edge."""
    x = torch.tensor([1.5, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    loss = F.multilabel_margin_loss(x, torch.tensor([0, -1, 2]))
    hi, lo = semipack.grad(loss, x, semipack.SignedMaxProd(), retain_graph=True)[0]
    _assert_values(hi, [-1 / 3, 0.0, 1 / 3])
    _assert_values(lo, [-1 / 3, 0.0, 1 / 3])
    (reach,) = semipack.grad(loss, x, semipack.Boolean())
    assert reach.tolist() == [True, False, True]


# --- the library's forms against independent references ---------------------------------------

CONV_SEMIRINGS = [
    semipack.Real(),
    semipack.MaxProd(),
    semipack.TopPath(),
    semipack.SignedMaxProd(),
    semipack.LogSum(),
    semipack.LogCount(),
    semipack.Entropy(),
    semipack.Boolean(),
    MinProd(),
]

TRANSPOSED = {
    "padded_strided": dict(
        x=(2, 3, 3, 4), w=(3, 2, 3, 2), stride=(2, 1), padding=1, out_pad=(1, 0)
    ),
    "groups_dilated_1d": dict(x=(2, 4, 5), w=(4, 3, 3), stride=2, dilation=2, groups=2),
}


def _transposed_reference(sr, m, x, w, g: dict, mask):
    """Messages over the literal edge matrices: d out / d x and d out / d w, one edge per
    non-zero entry (a transposed convolution never sums two terms into one pair)."""

    def conv(xx, ww):
        return _conv_transpose(xx, ww, g)

    jac_x = torch.autograd.functional.jacobian(lambda t: conv(t, w), x)
    jac_w = torch.autograd.functional.jacobian(lambda t: conv(x, t), w)
    flat = tuple(c.reshape(1, -1) for c in m)
    to_x = sr.matmul(flat, jac_x.reshape(flat[0].shape[1], -1))
    to_w = sr.matmul(flat, jac_w.reshape(flat[0].shape[1], -1))
    bias = sr.sum(tuple(c.movedim(1, 0).reshape(c.shape[1], -1) for c in m), [1])
    return (
        tuple(c.reshape(x.shape) for c in to_x),
        tuple(c.reshape(w.shape) for c in to_w),
        bias,
    )


def _conv_transpose(x: Tensor, w: Tensor, g: dict) -> Tensor:
    fn = {3: F.conv_transpose1d, 4: F.conv_transpose2d}[x.dim()]
    return fn(
        x,
        w,
        None,
        g.get("stride", 1),
        g.get("padding", 0),
        g.get("out_pad", 0),
        g.get("groups", 1),
        g.get("dilation", 1),
    )


@pytest.mark.parametrize("sr", CONV_SEMIRINGS, ids=lambda s: s.name)
@pytest.mark.parametrize("geometry", list(TRANSPOSED))
def test_transposed_convolution_forms_equal_the_edge_matrices(sr, geometry: str) -> None:
    """Both forms (one tap at a time for every semiring, and PyTorch's transposed-convolution
    backward on shifted messages for LogSum, LogCount and Entropy) against the semiring's own
    matmul over the explicit edges, exact zeros of input, weight and message included."""
    g = TRANSPOSED[geometry]
    gen = torch.Generator().manual_seed(3)

    def draw(shape):
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        return torch.where(torch.rand(shape, generator=gen) < 0.2, 0.0, t)

    x, w = draw(g["x"]), draw(g["w"])
    m = sr.lift(draw(_conv_transpose(x, w, g).shape) * 3)
    geo = ConvGeometry.of(
        x.dim() - 2,
        g.get("stride", 1),
        g.get("padding", 0),
        g.get("dilation", 1),
        g.get("groups", 1),
        True,
        g.get("out_pad", 0),
    )
    mask = (True, True, True)
    want = _transposed_reference(sr, m, x, w, g, mask)
    forms = [
        transposed_per_tap_messages(sr, m, x, w, geo, mask),
        conv_messages(sr, m, x, w, geo, mask),
    ]
    for got in forms:
        for a, b in zip(got, want, strict=True):
            _assert_states_equal(sr, a, b)


def _assert_states_equal(sr: semipack.Semiring, got: tuple, want: tuple) -> None:
    """Values to float64 rounding; Entropy's mean surprisal only where a path exists; TopPath's
    successor ids are not compared (ties may be broken by another candidate)."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    if isinstance(sr, semipack.Entropy):
        live = torch.isfinite(want[0])
        torch.testing.assert_close(got[1][live], want[1][live], rtol=1e-10, atol=1e-12)
    elif not isinstance(sr, semipack.TopPath):
        for c, d in zip(got[1:], want[1:], strict=True):
            torch.testing.assert_close(c, d, rtol=1e-10, atol=1e-12)


def test_blocked_forms_equal_the_whole(monkeypatch) -> None:
    """Interpolation coefficients read a few output positions at a time and bilinear edge
    weights built in small blocks give the same values as in one piece."""
    cases = ["bicubic_align_corners", "bilinear_layer", "bilinear_batched_zeros", "trilinear"]
    whole = {}
    for name in cases:
        loss, leaves, _ = _graph(name)
        whole[name] = [
            semipack.grad(loss, leaves, sr(), retain_graph=True)
            for sr in (semipack.MaxProd, semipack.Entropy)
        ]
    monkeypatch.setattr(interpolation, "BLOCK_ELEMENTS", 16)
    monkeypatch.setattr(contractions, "BLOCK_ELEMENTS", 5)
    for name in cases:
        loss, leaves, _ = _graph(name)
        for sr, want in zip((semipack.MaxProd, semipack.Entropy), whole[name], strict=True):
            got = semipack.grad(loss, leaves, sr(), retain_graph=True)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize(
    "sr",
    [semipack.Real(), semipack.MaxProd(), semipack.LogSum(), semipack.Entropy()],
    ids=lambda s: s.name,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_norm_gains_per_row_and_entry_in_the_fused_kernels(sr, dtype) -> None:
    """A [rows, n] gain (group norm's channels) through ``normalized_messages`` (the Real
    closed form; MaxProd, LogSum and Entropy: their native float32 kernels or the fused
    kernels' eager form) equals the dense contraction of the full Jacobian."""
    from semipack.messages.normalization import normalized_messages

    gen = torch.Generator().manual_seed(4)
    rows, n = 6, 10
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    x_hat = ((x - x.mean(1, keepdim=True)) * (x.var(1, False, keepdim=True) + 1e-5).rsqrt()).to(
        dtype
    )
    rstd = torch.rand(rows, generator=gen, dtype=torch.float64).add(0.5).to(dtype)
    gain = torch.randn(rows, n, generator=gen, dtype=torch.float64).to(dtype)
    gain[0, 3] = 0.0
    m = sr.lift(torch.randn(rows, n, generator=gen, dtype=torch.float64).to(dtype))
    want = normalized_contract_dense(sr, m, x_hat, rstd, gain, False)
    mode = "compiled" if dtype == torch.float32 and not isinstance(sr, semipack.Real) else "eager"
    got = normalized_messages(sr, m, x_hat, rstd, gain, False, mode=mode)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


# --- inside a model ------------------------------------------------------------------------------


class Decoder(torch.nn.Module):
    """Every new op in one small model, run under ``semipack.extend`` (module extensions on for
    the linear layer, generic rules for the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 4)
        self.up = torch.nn.ConvTranspose2d(4, 2, 2, stride=2)
        self.mix = torch.nn.Bilinear(8, 8, 3)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(torch.tanh(self.norm(x)))  # [B, 2, 4, 4]
        h = F.interpolate(h, size=(3, 3), mode="bicubic")
        cols = F.unfold(h, 2)  # [B, 8, 4]
        h = F.fold(cols, (3, 3), 2)  # [B, 2, 3, 3]
        cols = F.unfold(h, 2).transpose(1, 2)  # [B, 4, 8]
        return self.mix(cols, self.proj(cols))


@pytest.mark.parametrize("semiring_name", ["max_prod", "entropy", "log_count", "real"])
def test_model_with_every_new_op_matches_oracle(semiring_name: str) -> None:
    torch.manual_seed(0)
    model = Decoder().double()
    x = torch.randn(2, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    leaves = [x, *model.parameters()]
    expected = dynamic_programming(build_graph(model(x).square().sum()), leaves, semiring_name)
    with semipack.extend(model, SEMIRINGS[semiring_name]()):
        model(x).square().sum().backward()
    for i, (leaf, want) in enumerate(zip(leaves, expected, strict=True)):
        assert_readout_matches(semiring_name, want, leaf.semiring_grad, f"decoder leaf {i}")


class TinyVisionLanguage(torch.nn.Module):
    """A vision-language model's merge step and the other new ops: image features scattered
    into the token embeddings at the image tokens (id 0), as LLaVA-style models do, then
    shrink activations, a channel shuffle, an index_copy and a multi-margin loss."""

    IMAGE_TOKEN = 0

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.vision = torch.nn.Linear(6, 4)
        self.shuffle = torch.nn.ChannelShuffle(2)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids: Tensor, patches: Tensor, labels: Tensor) -> Tensor:
        h = self.embed(ids)  # [B, T, 4]
        mask = (ids == self.IMAGE_TOKEN).unsqueeze(-1).expand_as(h)
        h = h.masked_scatter(mask, self.vision(patches))  # patches [P, 6]
        h = self.shuffle(F.softshrink(h, 0.1).transpose(1, 2)).transpose(1, 2)
        h = h.index_copy(1, torch.tensor([2, 0]), F.hardshrink(h[:, 1:3], 0.2))
        return F.multi_margin_loss(self.head(h).flatten(0, 1), labels)


@pytest.mark.parametrize("semiring_name", ["max_prod", "entropy", "log_count", "real"])
def test_vision_language_merge_matches_oracle(semiring_name: str) -> None:
    torch.manual_seed(0)
    model = TinyVisionLanguage().double()
    ids = torch.tensor([[1, 0, 0, 3], [0, 2, 4, 0]])  # 4 image tokens, 4 patches
    patches = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 2, 1, 1, 2, 0, 0, 1])
    leaves = [patches, *model.parameters()]
    graph = build_graph(model(ids, patches, labels))
    expected = dynamic_programming(graph, leaves, semiring_name)
    with semipack.extend(model, SEMIRINGS[semiring_name]()):
        model(ids, patches, labels).backward()
    for i, (leaf, want) in enumerate(zip(leaves, expected, strict=True)):
        assert_readout_matches(semiring_name, want, leaf.semiring_grad, f"vlm leaf {i}")


GPU_CASES = [
    "group_norm_1_group_2d",
    "conv_transpose2d_strided",
    "bicubic_align_corners",
    "bilinear_antialias_half",
    "fold_geometry",
    "bilinear_layer",
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", GPU_CASES)
def test_cuda_values_match_the_oracle(name: str) -> None:
    """The same rules on CUDA tensors (float64) against the CPU oracle."""
    _, leaves64, graph = _graph(name)
    leaves = [t.detach().cuda().requires_grad_(True) for t in leaves64]
    loss = weighted_loss(CASES[name], leaves)
    for semiring_name in ALL_SEMIRINGS:
        expected = oracle_readouts(graph, leaves64, semiring_name)
        actual = semipack.grad(loss, leaves, SEMIRINGS[semiring_name](), retain_graph=True)
        for i, (want, got) in enumerate(zip(expected, actual, strict=True)):
            got = tuple(c.cpu() for c in got) if isinstance(got, tuple) else got.cpu()
            if semiring_name == "signed_max_prod":
                got = type(actual[i])(*got)
            assert_readout_matches(semiring_name, want, got, f"cuda {name} leaf {i}")


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_size_dims_are_the_exact_identity(align_corners: bool, dtype) -> None:
    """What reading one dim's coefficients at a time relies on, for every interpolation op."""
    for op, dims in zip(interpolation._BACKWARDS, (1, 2, 2, 3, 2, 2), strict=True):
        assert interpolation.keeps_same_size_exactly(op, dims, align_corners, dtype, "cpu"), op


def test_interpolation_refuses_coefficients_it_cannot_read_exactly(monkeypatch) -> None:
    monkeypatch.setattr(interpolation, "keeps_same_size_exactly", lambda *args: False)
    x = torch.randn(1, 1, 2, 3, dtype=torch.float64, requires_grad=True)
    out = F.interpolate(x, scale_factor=2, mode="bilinear")
    with pytest.raises(semipack.UnsupportedOpError, match="cannot be read off exactly") as info:
        semipack.grad(out.sum(), x, semipack.MaxProd())
    assert info.value.op == "aten.upsample_bilinear2d_backward.default"
