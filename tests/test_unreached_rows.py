"""The embedding extension marks the rows of its table that no lookup reached
(``Message.rows_reached``) and the readout skips them: the values must equal the oracle's,
with every unreached row read as "no path", also where the hint is lost (a tied weight's two
messages meet) or the readout is not a tensor per entry (KBest's k axis)."""

from __future__ import annotations

import pytest
import torch
from helpers import SEMIRINGS, assert_readout_matches, oracle_readouts
from oracle import build_graph
from torch import nn

import semipack


class _Lookup(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = nn.Embedding(40, 3, padding_idx=0).double()
        self.out = nn.Linear(3, 40, bias=False).double()
        if tied:
            self.out.weight = self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.table(ids).tanh()).sum()


@pytest.mark.parametrize("tied", [False, True], ids=["separate", "tied"])
@pytest.mark.parametrize("semiring_name", ["max_prod", "log_sum", "entropy", "boolean", "real"])
def test_embedding_rows_no_lookup_reached_read_as_no_path(semiring_name: str, tied: bool) -> None:
    model = _Lookup(tied)
    ids = torch.tensor([[3, 7, 0, 3]])  # 0 is padding: reached by no edge
    expected = oracle_readouts(build_graph(model(ids)), [model.table.weight], semiring_name)[0]
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, SEMIRINGS[semiring_name]()):
        model(ids).backward()
    assert_readout_matches(semiring_name, expected, model.table.weight.semiring_grad, "table")


def _rows_read(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[list[int]]:
    """The ``rows`` of every ``cls.readout_rows`` call from now on (the call still runs)."""
    calls: list[list[int]] = []
    original = cls.readout_rows

    def spy(self, a, rows):
        calls.append(rows.tolist())
        return original(self, a, rows)

    monkeypatch.setattr(cls, "readout_rows", spy)
    return calls


def test_the_readout_skips_unreached_rows_only_where_the_hint_holds(monkeypatch) -> None:
    model = _Lookup(tied=False)
    ids = torch.tensor([[5, 9]])
    calls = _rows_read(monkeypatch, semipack.MaxProd)
    with semipack.extend(model, semipack.MaxProd(log=True)):
        model(ids).backward()
    assert calls == [[5, 9]]
    grad = model.table.weight.semiring_grad
    reached = torch.isfinite(grad).all(1)
    assert reached.nonzero().flatten().tolist() == [5, 9]
    assert torch.equal(grad[~reached], torch.full((38, 3), float("-inf")))


def test_k_best_reads_unreached_rows_as_k_missing_paths() -> None:
    model = _Lookup(tied=False)
    ids = torch.tensor([[2, 2, 11]])
    with semipack.extend(model, semipack.KBest(2)):
        model(ids).backward()
    grad = model.table.weight.semiring_grad  # [40, 3, 2]
    with semipack.extend(model, semipack.KBest(2), extensions=False):
        model(ids).backward()
    assert torch.equal(grad, model.table.weight.semiring_grad)  # the generic path: no hint
    assert grad.shape == (40, 3, 2) and bool((grad[[2, 11]] > 0).all())
    assert int(grad.count_nonzero()) == 12


def test_a_product_keeps_the_hint_and_reads_each_factor_as_its_own_pass(monkeypatch) -> None:
    model = _Lookup(tied=False)
    ids = torch.tensor([[4, 30, 4]])
    factors = (semipack.MaxProd(log=True), semipack.LogSum(), semipack.Entropy())
    separate = []
    for sr in factors:
        with semipack.extend(model, sr):
            model(ids).backward()
        separate.append(model.table.weight.semiring_grad)
    calls = _rows_read(monkeypatch, semipack.Product)
    with semipack.extend(model, semipack.Product(*factors)):
        model(ids).backward()
    assert calls == [[4, 30]]
    for alone, joint in zip(separate, model.table.weight.semiring_grad, strict=True):
        torch.testing.assert_close(joint, alone, rtol=0, atol=0, equal_nan=True)
