"""``Entropy(flow=True)``: the entropy and the log total flow from one Entropy pass.

The log flow is held to the brute-force oracle's LogSum values and the entropy to its Entropy
values, on a small graph with an unreached embedding row, a dead unit and a layer norm; the
entropy is also bitwise a plain ``Entropy()`` pass's, and the flow matches a ``LogSum()``
pass within float rounding (its log Z is the same sum taken by other kernels).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_readout_matches, oracle_readouts
from oracle import build_graph
from torch import Tensor, nn

import semipack

pytestmark = pytest.mark.usefixtures("single_thread")


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(6, 3), nn.LayerNorm(3), nn.Linear(3, 4), nn.ReLU())
    model.append(nn.Linear(4, 2))
    with torch.no_grad():
        model[2].bias[1] = -50.0  # unit 1 is off for every token: its weights have no path
    return model.to(dtype)


TOKENS = torch.tensor([[0, 2, 2, 5]])  # rows 1, 3 and 4 of the table are never read


def _run(model: nn.Module, semiring: semipack.Semiring, extensions: bool = True) -> list:
    model.zero_grad()
    with semipack.extend(model, semiring, extensions=extensions):
        model(TOKENS).pow(2).sum().backward()
    return [p.semiring_grad for p in model.parameters()]


@pytest.mark.parametrize("extensions", [True, False])
def test_both_values_equal_the_oracle(extensions: bool) -> None:
    model = _model(torch.float64)
    got = _run(model, semipack.Entropy(flow=True), extensions)
    graph = build_graph(model(TOKENS).pow(2).sum())
    leaves = list(model.parameters())
    want_entropy = oracle_readouts(graph, leaves, "entropy")
    want_flow = oracle_readouts(graph, leaves, "log_sum")
    for i, (value, entropy, flow) in enumerate(zip(got, want_entropy, want_flow, strict=True)):
        assert isinstance(value, semipack.EntropyFlow)
        assert_readout_matches("entropy", entropy, value.entropy, f"parameter {i}")
        assert_readout_matches("log_sum", flow, value.log_flow, f"parameter {i}")
    table = got[0]
    assert table.log_flow[[1, 3, 4]].isneginf().all()  # unread rows: no path ...
    assert table.entropy[[1, 3, 4]].isnan().all()  # ... and no distribution
    assert got[3].log_flow[1].isneginf().all()  # the dead unit's weights


def test_entropy_is_bitwise_a_plain_entropy_pass_and_flow_a_log_sum_pass() -> None:
    model = _model(torch.float32)
    both = _run(model, semipack.Entropy(flow=True))
    entropy = _run(model, semipack.Entropy())
    flow = _run(model, semipack.LogSum())
    for pair, e, f in zip(both, entropy, flow, strict=True):
        assert torch.equal(pair.entropy.nan_to_num(123.0), e.nan_to_num(123.0))
        assert torch.equal(pair.log_flow.isneginf(), f.isneginf())
        reached = ~f.isneginf()
        torch.testing.assert_close(pair.log_flow[reached], f[reached], rtol=1e-5, atol=1e-5)


def test_in_a_product_and_per_sample() -> None:
    """A Product factor reads out its pair too; per-sample rows are pairs of [N, ...] rows."""
    model = _model(torch.float64)
    best, pair = _run(model, semipack.Product(semipack.MaxProd(), semipack.Entropy(flow=True)))[2]
    alone = _run(model, semipack.Entropy(flow=True))[2]
    assert torch.equal(pair.log_flow, alone.log_flow)
    assert torch.equal(best, _run(model, semipack.MaxProd())[2])
    model.zero_grad()
    with semipack.extend(model, semipack.Entropy(flow=True), per_sample=True):
        model(torch.tensor([[0, 2], [2, 5]])).pow(2).sum().backward()
    rows: Tensor = model[2].weight.semiring_grad_batch
    assert isinstance(rows, semipack.EntropyFlow) and rows.log_flow.shape == (2, 4, 3)
    for n, tokens in enumerate(([0, 2], [2, 5])):
        model.zero_grad()
        with semipack.extend(model, semipack.Entropy(flow=True)):
            model(torch.tensor([tokens])).pow(2).sum().backward()
        one = model[2].weight.semiring_grad
        torch.testing.assert_close(rows.log_flow[n], one.log_flow, equal_nan=True)
        torch.testing.assert_close(rows.entropy[n], one.entropy, equal_nan=True)


def test_flag_is_checked_and_shown() -> None:
    assert repr(semipack.Entropy(flow=True)) == "Entropy(flow=True)"
    assert repr(semipack.Entropy()) == "Entropy()"
    with pytest.raises(TypeError, match=r"Entropy\(flow=...\) must be True or False, got 'yes'"):
        semipack.Entropy(flow="yes")  # type: ignore[arg-type]
