"""The embedding extension keeps its table's message as the rows a lookup reached
(``SparseRows`` in ``Message.sparse``): the readout skips the other rows and the full state is
built only where an op needs it (a tied weight's two messages meet). The values must equal the
oracle's, with every unreached row read as "no path", for every semiring, KBest's k axis and a
Product's factors."""

from __future__ import annotations

import pytest
import torch
from helpers import SEMIRINGS, assert_readout_matches, oracle_readouts
from oracle import build_graph
from torch import nn

import semipack
from semipack.semirings.base import SparseRows


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
    """The rows of every ``cls.readout_sparse`` call from now on (the call still runs)."""
    calls: list[list[int]] = []
    original = cls.readout_sparse

    def spy(self, a, into=None):
        calls.append(a.rows.tolist())
        return original(self, a, into)

    monkeypatch.setattr(cls, "readout_sparse", spy)
    return calls


def _tables_built(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of every full state built from sparse rows from now on."""
    built: list[tuple[int, ...]] = []
    original = SparseRows.dense

    def spy(self, sr):
        built.append(self.shape)
        return original(self, sr)

    monkeypatch.setattr(SparseRows, "dense", spy)
    return built


def test_the_readout_skips_unreached_rows_only_where_the_hint_holds(monkeypatch) -> None:
    model = _Lookup(tied=False)
    ids = torch.tensor([[5, 9]])
    calls = _rows_read(monkeypatch, semipack.MaxProd)
    built = _tables_built(monkeypatch)
    with semipack.extend(model, semipack.MaxProd(log=True)):
        model(ids).backward()
    assert calls == [[5, 9]] and built == []  # the 40 x 3 state was never built
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


def test_a_tied_table_builds_its_full_state_where_the_two_messages_meet(monkeypatch) -> None:
    built = _tables_built(monkeypatch)
    model = _Lookup(tied=True)
    with semipack.extend(model, semipack.MaxProd()):
        model(torch.tensor([[3, 7]])).backward()
    assert built == [(40, 3)]  # the engine adds the lookup's message to the projection's


@pytest.mark.parametrize("semiring", [semipack.TopPath(), semipack.KBest(2)], ids=repr)
def test_recorded_paths_keep_the_reached_rows_and_read_as_the_full_table(
    monkeypatch, semiring
) -> None:
    """A path-recording pass keeps the table's paths as the reached rows only (the full state
    is never built); every path read from them, the best one included, equals the path read from
    the full-shaped values and ids, and unreached rows have none."""
    from semipack.messages.paths import LeafPaths

    built = _tables_built(monkeypatch)
    model = _Lookup(tied=False)
    ids = torch.tensor([[6, 2, 6, 17]])
    with semipack.extend(model, semiring):
        model(ids).backward()
    assert built == []
    kept = model.table.weight.semiring_paths
    assert kept.rows.tolist() == [2, 6, 17]
    full = LeafPaths(kept.trace, kept.name, kept.log_values, kept.successors, kept.shape)
    assert kept.log_values.shape == (kept._values.shape[0], 40, 3)
    assert torch.isfinite(kept.log_values[0, [2, 6, 17]]).all()
    assert not torch.isfinite(kept.log_values[:, [0, 1, 3, 39]]).any()
    assert kept.path() == full.path() and kept.path().steps
    for row in (0, 2, 6, 17, 39):
        for col in range(3):
            assert kept.paths((row, col)) == full.paths((row, col))
            assert bool(kept.paths((row, col))) == (row in (2, 6, 17))


def test_a_table_without_any_path_starts_its_best_path_at_the_first_entry() -> None:
    """When no reached row has a path (the loss ignores the lookups), the default entry is the
    first one, as an argmax over the full-shaped values gives, and the path is empty."""
    model = _Lookup(tied=False)
    ids = torch.tensor([[5, 9]])
    with semipack.extend(model, semipack.TopPath()):
        (model(ids) * 0.0).backward()
    kept = model.table.weight.semiring_paths
    assert kept.rows is not None and not torch.isfinite(kept.log_values).any()
    path = kept.path()
    assert path.index == (0, 0) and not path.steps


def _table_pass(model: _Lookup, semiring: semipack.Semiring, ids: list[int]):
    with semipack.extend(model, semiring):
        model(torch.tensor([ids])).backward()
    return model.table.weight.semiring_grad


def _fresh_readout(semiring: semipack.Semiring, ids: list[int]):
    """The readout of a new model with the same weights, so no earlier readout exists."""
    return _table_pass(_Lookup(tied=False), semiring, ids)


def test_a_new_readout_reuses_the_memory_of_the_last_one_that_nobody_holds() -> None:
    """The second pass writes into the first readout's memory; rows the first pass reached and
    the second did not read as no path again."""
    model = _Lookup(tied=False)
    first_ptr = _table_pass(model, semipack.MaxProd(), [3, 8]).data_ptr()
    second = _table_pass(model, semipack.MaxProd(), [5, 8])
    assert second.data_ptr() == first_ptr
    assert torch.equal(second, _fresh_readout(semipack.MaxProd(), [5, 8]))
    assert int(second[3].count_nonzero()) == 0 and int(second[5].count_nonzero()) == 3


@pytest.mark.parametrize(
    "keep",
    [
        lambda grad: grad,  # a name for it
        lambda grad: grad[3:],  # a view
        lambda grad: grad.numpy(),  # an array sharing its memory
        lambda grad: torch.empty(0, dtype=grad.dtype).set_(  # another tensor on its memory
            grad.untyped_storage(), 0, grad.shape
        ),
    ],
    ids=["name", "view", "numpy", "storage"],
)
def test_a_readout_someone_still_holds_is_never_overwritten(keep) -> None:
    model = _Lookup(tied=False)
    first = _table_pass(model, semipack.MaxProd(), [3, 8])
    expected = first.clone()
    kept = keep(first)
    del first
    second = _table_pass(model, semipack.MaxProd(), [5, 9])
    assert torch.equal(torch.as_tensor(kept), expected[-len(kept) :])
    assert torch.equal(second, _fresh_readout(semipack.MaxProd(), [5, 9]))


def test_a_held_storage_object_or_shared_memory_is_never_overwritten() -> None:
    """Holding only the storage (``untyped_storage()`` returns the one Python object PyTorch
    keeps per storage) or having sent the tensor to another process (its memory is shared)
    keeps a readout from being written into."""
    model = _Lookup(tied=False)
    first = _table_pass(model, semipack.MaxProd(), [3, 8])
    expected, storage, shape = first.clone(), first.untyped_storage(), first.shape
    del first
    _table_pass(model, semipack.MaxProd(), [5, 9])
    held = torch.empty(0, dtype=expected.dtype).set_(storage, 0, shape)
    assert torch.equal(held, expected)
    sent = _table_pass(model, semipack.MaxProd(), [3, 8]).share_memory_()  # a queue does this
    expected = sent.clone()
    del sent
    _table_pass(model, semipack.MaxProd(), [5, 9])
    assert not model.table.weight.semiring_grad.is_shared()


def test_each_pass_gives_a_new_readout_object() -> None:
    """Written into the old memory or not, the readout is a new value: weak references to the
    old one end, and memos keyed by identity cannot mistake one pass for another."""
    import weakref

    model = _Lookup(tied=False)
    old = weakref.ref(_table_pass(model, semipack.MaxProd(), [3, 8]))
    new = _table_pass(model, semipack.MaxProd(), [5, 8])
    assert old() is None and new is model.table.weight.semiring_grad


def test_a_product_reuses_each_factor_nobody_holds() -> None:
    model = _Lookup(tied=False)
    product = semipack.Product(semipack.MaxProd(), semipack.LogSum())
    max_prod, log_sum = _table_pass(model, product, [3, 8])
    held, log_sum_ptr = max_prod.clone(), log_sum.data_ptr()
    del log_sum
    second = _table_pass(model, product, [5, 8])
    assert torch.equal(max_prod, held)  # held by a name here: untouched
    assert second[0].data_ptr() != max_prod.data_ptr()
    assert second[1].data_ptr() == log_sum_ptr
    for joint, fresh in zip(second, _fresh_readout(product, [5, 8]), strict=True):
        assert torch.equal(joint, fresh)


def test_a_product_readout_held_as_a_whole_is_never_overwritten() -> None:
    model = _Lookup(tied=False)
    product = semipack.Product(semipack.MaxProd(), semipack.LogSum())
    both = _table_pass(model, product, [3, 8])
    expected = [r.clone() for r in both]
    _table_pass(model, product, [5, 9])
    for kept, value in zip(both, expected, strict=True):
        assert torch.equal(kept, value)
