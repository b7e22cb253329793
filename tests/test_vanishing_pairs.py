"""Softmax's off-diagonal edges below any float are no edge, also when each factor is a float.

An edge whose log-weight is below ``NO_EDGE_LOG`` (log 2^-1074) is absent ("Semantics"). A
softmax's off-diagonal edge ``p_i p_j`` can be that small while ``p_i`` and ``p_j`` are not
(both under e^-372: scores hundreds of nats apart). The O(n) softmax forms multiply by the
factors one at a time and kept such pairs: Boolean said a path exists where MaxProd said none,
and LogSum, LogCount and Entropy counted them (trial 63). Checked against the brute-force
oracle, which builds every pair's edge and cuts it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import SEMIRINGS, assert_readout_matches, oracle_readouts, semiring_names
from oracle import build_graph

import semipack
from semipack.rules.softmax import _rows_with_vanishing_pairs

F64 = torch.float64
#: scores whose first two probabilities are e^-531 and e^-586: the pair's edge is e^-1118
SCORES = [626.9304913073527, 574.4586970600898, 1159.669253246258]
NAMES = semiring_names("real")  # Real keeps what the float holds: it is the gradient


def _reads_first(scores: torch.Tensor) -> torch.Tensor:
    """The first probability of each row (only the pair's edge reaches the second score)."""
    return torch.softmax(scores, -1)[..., 0].sum()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("inside", [True, False], ids=["forward inside", "forward outside"])
def test_a_pair_below_any_float_is_no_edge(name: str, inside: bool) -> None:
    scores = torch.tensor([SCORES], dtype=F64, requires_grad=True)
    expected = oracle_readouts(build_graph(_reads_first(scores)), [scores], name)[0]
    sr = SEMIRINGS[name]()
    if inside:
        with semipack.extend(None, sr):
            _reads_first(scores).backward()
        got = scores.semiring_grad
    else:
        (got,) = semipack.grad(_reads_first(scores), [scores], sr)
    assert_readout_matches(name, expected, got, "softmax row")
    if name == "boolean":
        assert got.tolist() == [[True, False, True]]


def test_rows_of_scores_far_apart_match_the_oracle() -> None:
    """Rows of four scores spread over 1200 nats, each row read at every probability with its
    own weight: several rows hold pairs below any float. Which entries have a path is compared
    exactly; values where they lie above e^-650 (below, the oracle's linear-domain sums lose
    bits near the subnormal range; semipack's are in log space)."""
    generator = torch.Generator().manual_seed(3)
    scores = (1200 * torch.rand(60, 4, generator=generator, dtype=F64)).requires_grad_()
    weights = torch.rand(60, 4, generator=generator, dtype=F64)
    assert _rows_with_vanishing_pairs(torch.softmax(scores, -1).detach(), None) is not None
    graph = build_graph((torch.softmax(scores, -1) * weights).sum())
    flow = oracle_readouts(graph, [scores], "log_sum")[0]
    ordinary = flow.isfinite() & (flow > -650)
    got = {}
    for name in ("boolean", "log_count", "log_sum", "max_prod", "entropy"):
        root = (torch.softmax(scores, -1) * weights).sum()
        (got[name],) = semipack.grad(root, [scores], SEMIRINGS[name]())
        expected = oracle_readouts(graph, [scores], name)[0]
        if name == "boolean":
            assert torch.equal(got[name], expected)
            continue
        if name == "max_prod":  # values, not logs: 0 is no path
            assert torch.equal(got[name] == 0, expected == 0)
            continue
        assert torch.equal(got[name].isnan(), expected.isnan()), name
        assert torch.equal(got[name].isfinite(), expected.isfinite()), name
        torch.testing.assert_close(got[name][ordinary], expected[ordinary], rtol=1e-7, atol=1e-9)
    assert torch.equal(got["boolean"], got["log_sum"].isfinite())  # one structure for all


@pytest.mark.parametrize("name", ["log_sum", "log_count", "boolean"])
def test_attention_keys_whose_only_edge_vanishes_have_no_path(name: str) -> None:
    """The same pair inside scaled_dot_product_attention (one query, three keys whose scores
    are ``SCORES``; the values read by the output are the first key's only)."""
    q = torch.ones(1, 1, 1, 1, dtype=F64)
    v = torch.tensor([1.0, 0.0, 0.0], dtype=F64).reshape(1, 1, 3, 1)
    k = torch.tensor(SCORES, dtype=F64).reshape(1, 1, 3, 1).requires_grad_()
    expected = oracle_readouts(
        build_graph(F.scaled_dot_product_attention(q, k, v, scale=1.0).sum()), [k], name
    )[0]
    for extensions in (True, False):
        with semipack.extend(None, SEMIRINGS[name](), extensions=extensions):
            F.scaled_dot_product_attention(q, k, v, scale=1.0).sum().backward()
        assert_readout_matches(name, expected, k.semiring_grad, f"extensions={extensions}")
        second = k.semiring_grad.reshape(-1)[1]
        assert second.item() is False if name == "boolean" else second.item() == -float("inf")


def test_ordinary_rows_keep_the_o_n_form() -> None:
    """The check costs one pass over the row when no pair is near the limit (a -inf mask is
    no edge already and does not count)."""
    probs = torch.softmax(
        torch.tensor([[0.0, 300.0, -float("inf")], [1.0, 2.0, 3.0]], dtype=F64), -1
    )
    assert _rows_with_vanishing_pairs(probs, None) is None
    far = torch.softmax(torch.tensor([[0.0, 100.0, 500.0], [1.0, 2.0, 3.0]], dtype=F64), -1)
    assert _rows_with_vanishing_pairs(far, None).tolist() == [0]


@pytest.mark.parametrize("name", ["boolean", "log_count", "log_sum"])
def test_a_nan_in_another_row_does_not_switch_the_cut_off(name: str) -> None:
    """The check reads the smallest log-probability of the whole batch: one NaN row made it
    NaN, and every other row kept its vanishing pairs (trial 64)."""
    values = {}
    for other_row in ([0.0, 1.0, 2.0], [0.0, float("nan"), 2.0]):
        scores = torch.tensor([SCORES], dtype=F64, requires_grad=True)
        other = torch.tensor([other_row], dtype=F64, requires_grad=True)
        root = torch.softmax(torch.cat([scores, other]), -1)[0, 0]
        values[len(values)] = semipack.grad(root, [scores, other], SEMIRINGS[name]())[0]
    assert torch.equal(values[0], values[1])
    second = values[1][0, 1].item()
    assert second is False if name == "boolean" else second == -float("inf")
