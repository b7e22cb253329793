"""Work saved between and inside passes must never change a value.

Lifted parameters are cached across backward passes (``semirings/lift_cache.py``): a cached
lift must be reused while the parameter is unchanged and recomputed after any change (an
optimizer step, ``load_state_dict``, ``p.data = ...``). The embedding extension marks the rows
of its table that no lookup reached (``Message.rows_reached``) and the readout skips them: the
values must equal the oracle's, with every unreached row read as "no path".
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import SEMIRINGS, assert_readout_matches, oracle_readouts
from oracle import build_graph
from torch import nn

import semipack
from semipack.semirings import lift_cache


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _values(model: nn.Module, x: torch.Tensor, sr: semipack.Semiring) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, sr):
        model(x).pow(2).sum().backward()
    return [p.semiring_grad.clone() for p in model.parameters()]


def _fresh_values(model: nn.Module, x: torch.Tensor, sr: semipack.Semiring) -> list[torch.Tensor]:
    lift_cache.clear_lift_cache()
    return _values(model, x, sr)


def _cached_weights(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if id(p) in lift_cache._CACHE}


def _cached_states(model: nn.Module) -> dict[str, list[int]]:
    """Object ids of the cached lifted states, per parameter."""
    return {
        n: [id(state) for _, state in lift_cache._CACHE[id(p)].values()]
        for n, p in model.named_parameters()
        if id(p) in lift_cache._CACHE
    }


def test_a_second_pass_reuses_the_lifted_weights_until_a_step() -> None:
    model, x, sr = _mlp(), torch.randn(4, 5, dtype=torch.float64), semipack.MaxProd()
    lift_cache.clear_lift_cache()
    first = _values(model, x, sr)
    cached = _cached_states(model)
    # The second layer's weight only: the first layer sends no message to the input (which
    # needs none), and biases are never lifted.
    assert set(cached) == {"2.weight"}
    second = _values(model, x, sr)
    assert _cached_states(model) == cached  # the same state objects: nothing lifted again
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        model[2].weight.mul_(2.0)
    _values(model, x, sr)
    assert _cached_states(model)["2.weight"] != cached["2.weight"]  # lifted again


@pytest.mark.parametrize("semiring_name", ["max_prod", "log_sum", "entropy", "top_path"])
def test_values_after_an_optimizer_step_equal_a_fresh_pass(semiring_name: str) -> None:
    model, x = _mlp(), torch.randn(4, 5, dtype=torch.float64)
    sr = SEMIRINGS[semiring_name]()
    _values(model, x, sr)  # fills the cache
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).pow(2).sum().backward()
    opt.step()
    after = _values(model, x, sr)
    expected = oracle_readouts(
        build_graph(model(x).pow(2).sum()), list(model.parameters()), semiring_name
    )
    for name_p, e, a in zip(["0.w", "0.b", "2.w", "2.b"], expected, after, strict=True):
        assert_readout_matches(semiring_name, e, a, name_p)


def test_load_state_dict_and_data_assignment_invalidate_the_cache() -> None:
    model, x, sr = _mlp(), torch.randn(4, 5, dtype=torch.float64), semipack.MaxProd()
    _values(model, x, sr)
    other = _mlp()
    with torch.no_grad():
        for p in other.parameters():  # another model, same seed: scale it
            p.mul_(3.0)
    model.load_state_dict(other.state_dict())  # copy_ in place: the version counter moves
    assert all(
        torch.equal(a, b)
        for a, b in zip(_values(model, x, sr), _fresh_values(model, x, sr), strict=True)
    )
    _values(model, x, sr)
    model[2].weight.data = torch.randn(
        3, 7, dtype=torch.float64
    )  # new storage, same parameter object
    assert all(
        torch.equal(a, b)
        for a, b in zip(_values(model, x, sr), _fresh_values(model, x, sr), strict=True)
    )


def test_a_cached_lift_written_in_place_fails_loudly_and_is_dropped() -> None:
    """PyTorch raises on the write only after writing: the failed pass drops the cache."""
    model, x, sr = _mlp(), torch.randn(4, 5, dtype=torch.float64), semipack.MaxProd()
    expected = _fresh_values(model, x, sr)
    (lifted,) = next(iter(lift_cache._CACHE[id(model[2].weight)].values()))[1]
    original = semipack.MaxProd.matmul

    def corrupting(self, a, w):
        out = original(self, a, w)
        self.lift(w)[0].add_(1.0)
        return out

    semipack.MaxProd.matmul = corrupting
    try:
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            _values(model, x, sr)
    finally:
        semipack.MaxProd.matmul = original
    assert lift_cache._CACHE == {}
    assert all(torch.equal(a, b) for a, b in zip(_values(model, x, sr), expected, strict=True))
    assert not torch.equal(lifted, model[2].weight.detach().abs().log())  # it was written


def test_activations_are_not_cached_and_entries_die_with_their_parameter() -> None:
    lift_cache.clear_lift_cache()
    sr = semipack.MaxProd()
    with torch.no_grad():
        sr.lift(torch.randn(3, 4))
        assert lift_cache._CACHE == {}
        weight = nn.Parameter(torch.randn(3, 4))
        sr.lift(weight)
        sr.lift(weight.t())  # a view: its own entry, under the same parameter
    assert len(lift_cache._CACHE[id(weight)]) == 2
    del weight
    gc.collect()
    assert lift_cache._CACHE == {}


def test_semiring_configurations_do_not_share_entries() -> None:
    weight = nn.Parameter(torch.tensor([[0.5, -2.0]]))
    with torch.no_grad():
        (log_sum,) = semipack.LogSum().lift(weight)
        (log_count,) = semipack.LogCount().lift(weight)
    assert torch.equal(log_sum, torch.tensor([[0.5, 2.0]]).log())
    assert torch.equal(log_count, torch.zeros(1, 2))  # every edge counts 1


# --- rows of an embedding table no lookup reached ----------------------------------------------


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


def test_the_readout_skips_unreached_rows_only_where_the_hint_holds() -> None:
    model = _Lookup(tied=False)
    ids = torch.tensor([[5, 9]])
    calls = []
    original = semipack.MaxProd.readout_rows

    def spy(self, a, rows):
        calls.append(rows.tolist())
        return original(self, a, rows)

    semipack.MaxProd.readout_rows = spy
    try:
        with semipack.extend(model, semipack.MaxProd(log=True)):
            model(ids).backward()
    finally:
        semipack.MaxProd.readout_rows = original
    assert calls == [[5, 9]]
    grad = model.table.weight.semiring_grad
    reached = torch.isfinite(grad).all(1)
    assert reached.nonzero().flatten().tolist() == [5, 9]
    assert torch.equal(grad[~reached], torch.full((38, 3), float("-inf")))
