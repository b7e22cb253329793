"""``nn.Embedding(sparse=True)`` inside ``extend``: the embedding extension carries the sparse
regular gradient beside the table's semiring state, so ``p.grad`` is the sparse gradient a
plain backward gives (bitwise) and ``p.semiring_grad`` the same value as for a dense table.
The oracle reads the dense twin of the model (the same weights, ``sparse=False``): the graph is
the same, only the regular gradient's layout differs. Until the thirty-fourth session such a
table was refused."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ORACLE_NAME, SEMIRINGS, assert_readout_matches, oracle_readouts
from oracle import build_graph
from torch import nn

import semipack


class _Lookup(nn.Module):
    def __init__(self, tied: bool, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = nn.Embedding(40, 3, padding_idx=0, sparse=sparse).double()
        self.out = nn.Linear(3, 40, bias=False).double()
        if tied:
            self.out.weight = self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.table(ids).tanh()).sum()


def _dense_twin(model: _Lookup) -> _Lookup:
    twin = copy.deepcopy(model)
    twin.table.sparse = False
    return twin


IDS = torch.tensor([[3, 7, 0, 3], [5, 3, 39, 0]])  # 0 is padding


@pytest.mark.parametrize("tied", [False, True], ids=["separate", "tied"])
@pytest.mark.parametrize("semiring_name", sorted(SEMIRINGS))
def test_a_sparse_table_gives_the_dense_tables_values(semiring_name: str, tied: bool) -> None:
    model = _Lookup(tied, sparse=True)
    twin = _dense_twin(model)
    oracle = ORACLE_NAME[semiring_name]
    expected = oracle_readouts(build_graph(twin(IDS)), [twin.table.weight], oracle)[0]
    model(IDS).backward()
    plain = model.table.weight.grad
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, SEMIRINGS[semiring_name]()):
        model(IDS).backward()
    grad = model.table.weight.grad
    # a separate table's gradient stays sparse; a tied one's adds the output layer's dense one
    assert grad.layout == plain.layout == (torch.strided if tied else torch.sparse_coo)
    assert torch.equal(grad.to_dense(), plain.to_dense())
    if not tied:
        assert torch.equal(grad.coalesce().indices(), plain.coalesce().indices())
    assert_readout_matches(oracle, expected, model.table.weight.semiring_grad, "table")


def test_training_with_sparse_adam_under_the_monitor_is_plain_training() -> None:
    """``SparseAdam`` needs the sparse gradient: the monitor's sampled steps hand it over."""
    monitored, plain = _Lookup(False, sparse=True), _Lookup(False, sparse=True)
    monitor = semipack.Monitor(monitored, every=2)
    runs = []
    for model, mon in ((monitored, monitor), (plain, None)):
        optimizers = [
            torch.optim.SparseAdam(list(model.table.parameters()), lr=0.1),
            torch.optim.Adam(list(model.out.parameters()), lr=0.1),
        ]
        for step in range(4):
            for opt in optimizers:
                opt.zero_grad()
            ids = IDS.roll(step, dims=1)
            if mon is None:
                model(ids).backward()
            else:
                with mon.step(step):
                    model(ids).backward()
            for opt in optimizers:
                opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    assert {r.step for r in monitor.records} == {0, 2}
    assert {r.layer for r in monitor.records} == {"table", "out"}


def test_per_sample_rows_of_a_sparse_table_are_single_example_passes() -> None:
    model = _Lookup(False, sparse=True)
    with semipack.extend(model, semipack.LogSum(), per_sample=True):
        model(IDS).backward()
    rows = model.table.weight.semiring_grad_batch
    assert model.table.weight.grad.layout == torch.sparse_coo
    for n in range(IDS.shape[0]):
        with semipack.extend(model, semipack.LogSum()):
            model(IDS[n : n + 1]).backward()
        torch.testing.assert_close(rows[n], model.table.weight.semiring_grad, rtol=1e-12, atol=0)


def test_backwards_added_up_keep_the_sparse_gradient() -> None:
    """Two backwards in one ``accumulate=True`` block: the sparse gradients add as PyTorch adds
    them, and the values equal one backward over the summed loss."""
    model = _Lookup(False, sparse=True)
    model(IDS[:1]).backward()
    model(IDS[1:]).backward()
    plain = model.table.weight.grad.to_dense()
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semipack.LogSum(), accumulate=True):
        model(IDS[:1]).backward()
        model(IDS[1:]).backward()
    assert model.table.weight.grad.layout == torch.sparse_coo
    assert torch.equal(model.table.weight.grad.to_dense(), plain)
    added = model.table.weight.semiring_grad
    with semipack.extend(model, semipack.LogSum()):
        (model(IDS[:1]) + model(IDS[1:])).backward()
    torch.testing.assert_close(added, model.table.weight.semiring_grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("semiring_name", ["real", "max_prod", "log_sum", "entropy", "top_path"])
def test_max_norm_renormalises_first_in_the_extension(semiring_name: str, sparse: bool) -> None:
    """``max_norm`` renormalises the looked-up rows in place before each lookup: the extension
    does it as ``F.embedding`` does, so a sparse table with it runs (it fell to the generic
    rules, which refused its sparse gradient, trial 122). Two lookups, each renormalising."""
    torch.manual_seed(0)
    table = nn.Embedding(8, 3, max_norm=1.0, sparse=sparse).double()
    head = nn.Linear(3, 2).double()
    ids = torch.tensor([[1, 3, 3], [0, 5, 1]])

    def loss(t: nn.Embedding) -> torch.Tensor:
        return (head(t(ids).tanh()) + head(t(ids[:, :1]))[:, :1]).square().sum()

    plain, twin = copy.deepcopy(table), copy.deepcopy(table)
    twin.sparse = False
    loss(plain).backward()
    oracle = ORACLE_NAME[semiring_name]
    expected = oracle_readouts(build_graph(loss(twin)), [twin.weight], oracle)[0]
    with semipack.extend(nn.ModuleList([table, head]), SEMIRINGS[semiring_name]()):
        loss(table).backward()
    assert torch.equal(table.weight, plain.weight)  # renormalised as PyTorch does
    assert table.weight.grad.layout == plain.weight.grad.layout
    assert torch.equal(table.weight.grad.to_dense(), plain.weight.grad.to_dense())
    assert_readout_matches(oracle, expected, table.weight.semiring_grad, "table")
