"""Lifted model weights kept across backward passes (``kernels.weight_cache``).

The cache may only ever save time: every pass must give the values a pass without it gives,
whatever happened to the weights in between (an optimizer step, a write through ``p.data`` that
leaves the version counter alone, a swapped ``p.data``), and it must keep nothing but the
watched parameters' forms, within its budget.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import semipack
from semipack.kernels.native import fingerprint, native_available
from semipack.kernels.weight_cache import WEIGHTS, WeightCache
from semipack.semirings._log import log_abs

pytestmark = pytest.mark.skipif(
    not native_available(), reason="entries are fingerprinted by the native library"
)

SEMIRINGS = {
    "max_prod": semipack.MaxProd,
    "top_path": semipack.TopPath,
    "log_sum": semipack.LogSum,
    "entropy": semipack.Entropy,
    "k_best": lambda: semipack.KBest(2),
    "signed_max_prod": semipack.SignedMaxProd,
}


@pytest.fixture(autouse=True)
def _empty_cache():
    WEIGHTS.clear()
    yield
    WEIGHTS.clear()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 3))


def _values(model: nn.Module, semiring: semipack.Semiring, x: torch.Tensor) -> list:
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semiring):
        model(x).sum().backward()
    return [t.clone() for p in model.parameters() for t in tree_leaves(p.semiring_grad)]


def _without_cache(values: Callable[[], list]) -> list:
    """``values()`` with keeping switched off (and the cache emptied), then the budget back."""
    budget = WEIGHTS.max_bytes
    semipack.set_weight_cache_bytes(0)
    try:
        return values()
    finally:
        semipack.set_weight_cache_bytes(budget)


def _uncached(model: nn.Module, semiring: semipack.Semiring, x: torch.Tensor) -> list:
    return _without_cache(lambda: _values(model, semiring, x))


def _assert_same(got: list, expected: list) -> None:
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", SEMIRINGS)
def test_a_kept_lift_gives_the_values_of_a_pass_without_the_cache(name: str) -> None:
    model, x = _model(), torch.randn(5, 24)
    first = _values(model, SEMIRINGS[name](), x)
    assert WEIGHTS.nbytes > 0  # the weights' forms were kept (LogSum's BLAS form: |W|)...
    second = _values(model, SEMIRINGS[name](), x)  # ...and this pass reads them
    _assert_same(first, second)
    _assert_same(second, _uncached(model, SEMIRINGS[name](), x))


def _scale_through_data(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.mul_(0.5)  # p._version does not change


def _optimizer_step(model: nn.Module) -> None:
    model(torch.randn(2, 24)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()


def _swap_data(model: nn.Module) -> None:
    for p in model.parameters():
        p.data = p.data.flip(0).contiguous()


def _change_one_entry(model: nn.Module) -> None:
    model[2].weight.data[1, 7] *= -40.0  # the lifted weight, version unchanged


@pytest.mark.parametrize(
    "change",
    [_scale_through_data, _optimizer_step, _swap_data, _change_one_entry],
    ids=lambda change: change.__name__.strip("_"),
)
@pytest.mark.parametrize("name", SEMIRINGS)
def test_changed_weights_are_never_read_from_the_cache(name: str, change) -> None:
    model, x = _model(), torch.randn(5, 24)
    before = _values(model, SEMIRINGS[name](), x)
    change(model)
    after = _values(model, SEMIRINGS[name](), x)
    _assert_same(after, _uncached(model, SEMIRINGS[name](), x))
    assert not all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_the_cached_forms_equal_a_fresh_lift_after_a_pass() -> None:
    """Callers only read what the cache hands out: after two passes the kept log|W| is still
    log|W|."""
    model, x = _model(), torch.randn(5, 24, requires_grad=True)  # both weights are lifted
    for _ in range(2):
        _values(model, semipack.MaxProd(), x)
    kept = [e.value for e in WEIGHTS._entries.values()]
    weights = [model[0].weight.detach(), model[2].weight.detach()]
    assert len(kept) == 2
    for value in kept:
        match = [w for w in weights if w.shape == value.shape]
        assert len(match) == 1
        # a fresh lift, by the same function (the float32 native log has its own last bits) ...
        assert torch.equal(value, log_abs(match[0], match[0].dtype))
        # ... which is log|W| within float rounding
        torch.testing.assert_close(value, match[0].abs().log(), rtol=2e-7, atol=0.0)


def test_only_the_extended_models_parameters_are_kept() -> None:
    w = torch.randn(30, 20, requires_grad=True)
    x = torch.randn(4, 30)
    semipack.grad((x @ w).tanh().sum(), [w], semipack.MaxProd())
    assert WEIGHTS.nbytes == 0  # no model named its parameters
    model = _model()
    _values(model, semipack.MaxProd(), torch.randn(5, 24, requires_grad=True))
    assert WEIGHTS.nbytes == sum(p.numel() * 4 for p in (model[0].weight, model[2].weight))


def _table(tensors: list[torch.Tensor], max_bytes: int) -> WeightCache:
    cache = WeightCache(max_bytes)
    cache.watch(tensors)
    return cache


def test_an_entry_beyond_the_budget_is_not_kept() -> None:
    a, b = torch.randn(100), torch.randn(100)  # 400 bytes each
    cache = _table([a, b], max_bytes=600)
    made = []
    for t in (a, b, a, b):
        cache.derived(t, "double", lambda t=t: made.append(t) or t * 2)
    # a fits and stays; b never fits beside it while a is in use in this generation
    assert cache.nbytes == 400 and [m is a for m in made] == [True, False, False]


def test_entries_idle_since_the_last_watch_make_room() -> None:
    a, b = torch.randn(100), torch.randn(100)
    cache = _table([a, b], max_bytes=600)
    cache.derived(a, "double", lambda: a * 2)
    cache.watch([a, b])  # a new pass: a has not been used in it yet
    kept_b = cache.derived(b, "double", lambda: b * 2)
    assert cache.nbytes == 400
    assert cache.derived(b, "double", lambda: pytest.fail("b was kept")) is kept_b


def test_a_zero_budget_keeps_nothing() -> None:
    a = torch.randn(100)
    cache = _table([a], max_bytes=0)
    cache.derived(a, "double", lambda: a * 2)
    assert cache.nbytes == 0


@pytest.mark.parametrize("nbytes", [4, 32, 36, 4096, 4100, 4 * 1001])
def test_the_fingerprint_changes_with_every_single_changed_word(nbytes: int) -> None:
    torch.manual_seed(nbytes)
    t = torch.randn(nbytes // 4)
    base = fingerprint(t)
    assert fingerprint(t.clone()) == base
    for i in range(t.numel()):
        changed = t.clone()
        changed[i] = torch.nextafter(changed[i], torch.tensor(float("inf")))
        assert fingerprint(changed) != base, i


def test_the_fingerprint_tells_lengths_and_odd_byte_counts_apart() -> None:
    t = torch.zeros(64, dtype=torch.uint8)
    prints = {fingerprint(t[:n]) for n in range(65)}
    assert len(prints) == 65
    odd = torch.arange(37, dtype=torch.uint8)
    changed = odd.clone()
    changed[36] += 1  # a tail byte, past the last 32-byte block
    assert fingerprint(odd) != fingerprint(changed)


def test_the_fingerprint_needs_contiguous_cpu_memory() -> None:
    t = torch.randn(8, 8)
    assert fingerprint(t.t()) is None
    assert fingerprint(t) is not None


def test_a_smaller_budget_drops_what_it_cannot_hold() -> None:
    model = _model()
    _values(model, semipack.Entropy(), torch.randn(5, 24, requires_grad=True))
    held, budget = WEIGHTS.nbytes, WEIGHTS.max_bytes
    try:
        semipack.set_weight_cache_bytes(held)
        assert WEIGHTS.nbytes == held  # still fits
        semipack.set_weight_cache_bytes(held - 1)
        assert WEIGHTS.nbytes == 0
    finally:
        semipack.set_weight_cache_bytes(budget)


class _ThresholdCount(semipack.LogSum):
    """log of the number of paths whose every |local derivative| exceeds ``eps``: a lift that
    reads a setting of the instance."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def magnitude(self, w: torch.Tensor) -> torch.Tensor:
        return (w.abs() > self.eps).to(w.dtype)

    def log_magnitude(self, log_abs: torch.Tensor) -> torch.Tensor:
        keep = log_abs > torch.tensor(self.eps).log()
        return torch.where(keep, 0.0, float("-inf")).to(log_abs.dtype)


def test_a_subclass_that_lifts_its_own_way_never_shares_kept_forms() -> None:
    """Two instances whose lifts differ (a threshold) on the same weights: the second must not
    read the first one's kept lift (it read one path where there is none)."""
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[0.05, 0.3], [0.3, 0.3]]))
    x = torch.tensor([[-2.0, 1.0]], requires_grad=True)

    def count(eps: float) -> list:
        with semipack.extend(model, _ThresholdCount(eps)):
            model(x).sum().backward()
        return x.semiring_grad.tolist()

    assert count(0.1) == [[float("-inf"), 0.0]]
    assert count(0.5) == [[float("-inf"), float("-inf")]]  # no |w| above 0.5: no path


class _SquaredMaxProd(semipack.MaxProd):
    """Paths weighted by squared derivatives: MaxProd's algebra with its own lift."""

    def lift(self, w: torch.Tensor) -> tuple:
        return (2 * super().lift(w)[0],)


def test_a_max_prod_subclass_with_its_own_lift_multiplies_by_it() -> None:
    """Through linear layers only every edge is lifted, so squaring each edge doubles every
    log path value exactly, also right after MaxProd kept log|W| of the same weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Linear(40, 3, bias=False))
    x = torch.randn(5, 24, requires_grad=True)
    with semipack.extend(model, semipack.MaxProd(log=True)):
        model(x).sum().backward()
    plain = x.semiring_grad.clone()
    assert WEIGHTS.nbytes > 0  # log|W| is kept
    with semipack.extend(model, _SquaredMaxProd(log=True)):
        model(x).sum().backward()
    assert torch.equal(x.semiring_grad, 2 * plain)


def test_deleting_the_model_frees_its_kept_forms() -> None:
    import gc

    model = _model()
    _values(model, semipack.Entropy(), torch.randn(5, 24, requires_grad=True))
    assert WEIGHTS.nbytes > 0
    del model
    gc.collect()
    assert WEIGHTS.nbytes == 0


def test_one_fingerprint_per_weight_and_pass(monkeypatch) -> None:
    """The forms of one weight share one read of its bytes within a pass; the next pass reads
    them again (the weight may have changed in between)."""
    from semipack.kernels import weight_cache

    taken = []
    monkeypatch.setattr(weight_cache, "fingerprint", lambda t: taken.append(1) or (len(taken),))
    a = torch.randn(100)
    cache = _table([a], max_bytes=10_000)
    cache.derived(a, "double", lambda: a * 2)
    cache.derived(a, "triple", lambda: a * 3)
    assert len(taken) == 1
    cache.watch([a])
    kept = cache.derived(a, "double", lambda: a * 2)
    assert len(taken) == 2 and torch.equal(kept, a * 2)


def test_nothing_is_watched_outside_a_backward_pass() -> None:
    """After ``extend``'s backward the parameters are no longer watched: a later computation on
    them (``semipack.grad``, after the weights changed) reads nothing kept from the pass."""
    model = _model()
    _values(model, semipack.MaxProd(), torch.randn(5, 24, requires_grad=True))
    weight = model[2].weight.detach()
    made = []
    WEIGHTS.derived(weight, ("log_abs", torch.float32), lambda: made.append(1) or weight)
    assert made == [1]


class _InputMajor(nn.Module):
    """A layer that stores its weight as [in, out] and computes ``x @ W + b`` (GPT-2's Conv1D):
    the message to its input multiplies by the view ``W.T``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


def _input_major_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_InputMajor(24, 40), nn.Tanh(), _InputMajor(40, 3))


def _change_one_stored_entry(model: nn.Module) -> None:
    model[2].weight.data.view(-1)[7] *= -40.0  # version unchanged


@pytest.mark.parametrize(
    "change", [_scale_through_data, _swap_data, _change_one_stored_entry], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("name", SEMIRINGS)
def test_forms_of_a_transposed_weight_follow_the_weight(name: str, change) -> None:
    """``W.T`` holds W's entries: its forms are kept (checked by W's fingerprint) and never
    read after W changed."""
    model, x = _input_major_model(), torch.randn(5, 24, requires_grad=True)
    first = _values(model, SEMIRINGS[name](), x)
    _assert_same(first, _values(model, SEMIRINGS[name](), x))
    change(model)
    after = _values(model, SEMIRINGS[name](), x)
    _assert_same(after, _uncached(model, SEMIRINGS[name](), x))
    assert not all(torch.equal(a, b) for a, b in zip(after, first, strict=True))


def test_a_transposed_view_is_kept_and_a_slice_is_not() -> None:
    w = torch.randn(6, 4)
    cache = _table([w], max_bytes=10_000)
    kept = cache.derived(w.T, "double", lambda: w.T * 2)
    assert torch.equal(kept, w.T * 2) and cache.nbytes == kept.numel() * 4
    assert cache.derived(w.T, "double", lambda: pytest.fail("w.T was kept")) is kept
    assert cache.derived(w, "double", lambda: w * 2).shape == (6, 4)  # its own entry
    made = []
    for part in (w[:3], w.T[:, :2], w.view(-1)[1:], w.view(torch.int32)):
        cache.derived(part, "double", lambda part=part: made.append(1) or part)
    assert len(made) == 4 and cache.nbytes == 2 * 6 * 4 * 4


def test_deleting_a_model_frees_the_forms_of_its_transposed_weights() -> None:
    import gc

    model = _input_major_model()
    _values(model, semipack.MaxProd(), torch.randn(5, 24, requires_grad=True))
    owners = {e.owner for e in WEIGHTS._entries.values()}
    views = [k for k in WEIGHTS._entries if k[1:] not in owners]
    assert views  # W.T's log|W.T| was kept...
    del model
    gc.collect()
    assert WEIGHTS.nbytes == 0  # ...and ended with W


@pytest.mark.parametrize("make_model", [_model, _input_major_model], ids=["linear", "input_major"])
def test_boolean_edges_follow_the_weight(make_model) -> None:
    """Boolean keeps each weight's 0/1 edge matrix (W and W.T). Scaling a weight leaves every
    reachability as it was; a column of zeros written through ``p.data`` cuts the paths
    through one hidden unit, and the next pass must see it."""
    model, x = make_model(), torch.randn(5, 24, requires_grad=True)
    first = _values(model, semipack.Boolean(), x)
    assert WEIGHTS.nbytes > 0
    weight = model[2].weight.data
    column = weight[:, 7] if weight.shape[1] == 40 else weight[7]
    column.zero_()  # hidden unit 7 no longer reaches the output
    after = _values(model, semipack.Boolean(), x)
    _assert_same(after, _uncached(model, semipack.Boolean(), x))
    assert not all(torch.equal(a, b) for a, b in zip(after, first, strict=True))


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2), nn.Flatten()
    )


@pytest.mark.parametrize("name", ["max_prod", "top_path"])
def test_packed_convolution_taps_follow_the_weight(name: str) -> None:
    """The max-plus convolution keeps each tap's packed log|W| (its input messages read them);
    a weight changed through ``p.data`` is packed again."""
    model = _conv_model()
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def values() -> list:
        model.zero_grad(set_to_none=True)
        x.semiring_grad = None
        with semipack.extend(model, SEMIRINGS[name]()):
            model(x).pow(2).sum().backward()
        leaves = [p.semiring_grad for p in model.parameters()] + [x.semiring_grad]
        return [t.clone() for t in tree_leaves(leaves)]

    first = values()
    assert any(k[0][0] == "max-plus tap panels" for k in WEIGHTS._entries)
    _assert_same(first, values())
    _assert_same(first, _without_cache(values))
    model[2].weight.data[1, 3, 0, 2] *= -40.0  # version unchanged
    after = values()
    _assert_same(after, _without_cache(values))
    assert not all(torch.equal(a, b) for a, b in zip(after, first, strict=True))


def test_forms_of_a_weight_given_new_memory_are_dropped() -> None:
    """``p.data = p.data - lr * g`` moves every parameter to new memory at each step: the forms
    made at the old place can never be read again, and are dropped at the next pass instead of
    piling up to the whole budget."""
    model = _conv_model()
    x = torch.randn(1, 3, 9, 9, generator=torch.Generator().manual_seed(2), requires_grad=True)
    sizes = []
    for _ in range(6):
        model.zero_grad(set_to_none=True)
        with semipack.extend(model, semipack.MaxProd()):
            model(x).sum().backward()
        sizes.append(WEIGHTS.nbytes)
        for p in model.parameters():
            p.data = p.data - 0.01 * p.grad
    assert sizes[0] > 0
    assert sizes == [sizes[0]] * 6  # one set of forms, not one per step


def test_forms_of_a_kept_value_are_made_once_per_view_and_counted() -> None:
    """``kept_form``: what a kernel computes from a kept value (its packed panels, its maxima)
    is made once per view of the value and kind, and its bytes count against the budget."""
    a = torch.randn(10, 20)  # 800 bytes
    cache = _table([a], max_bytes=4000)
    value = cache.derived(a, "double", lambda: a * 2)
    made = []

    def negated(t: torch.Tensor) -> torch.Tensor:
        made.append(t.shape)
        return -t

    for _ in range(2):
        first = cache.kept_form(value, "neg", lambda: negated(value))
        second = cache.kept_form(value.t(), "neg", lambda: negated(value.t()))
    assert made == [(10, 20), (20, 10)]  # one per view, not one per call
    torch.testing.assert_close(first, -2 * a, rtol=0, atol=0)
    torch.testing.assert_close(second, -2 * a.t(), rtol=0, atol=0)
    assert cache.nbytes == 3 * 800
    assert cache.kept_form(value, "other kind", lambda: 7) == 7


def test_forms_of_anything_but_a_kept_value_are_computed_each_time() -> None:
    a, activation = torch.randn(10, 20), torch.randn(10, 20)
    cache = _table([a], max_bytes=4000)
    cache.derived(a, "double", lambda: a * 2)
    made = []
    for t in (activation, activation, a):  # a itself is watched, but not a kept value
        cache.kept_form(t, "neg", lambda t=t: made.append(1) or -t)
    assert made == [1, 1, 1] and cache.nbytes == 800


def test_forms_of_a_replaced_value_are_dropped_with_it() -> None:
    """A changed weight gets a new value (its entry replaced): its forms are made again and
    the old ones' bytes are freed; a form that finds no room is not kept."""
    a = torch.randn(10, 20)
    cache = _table([a], max_bytes=2000)
    old = cache.derived(a, "double", lambda: a * 2)
    cache.kept_form(old, "neg", lambda: -old)
    assert cache.nbytes == 1600
    a.mul_(3)
    cache.watch([a])  # the next pass fingerprints the weight again
    new = cache.derived(a, "double", lambda: a * 2)
    assert new is not old and cache.nbytes == 800
    form = cache.kept_form(new, "neg", lambda: -new)
    torch.testing.assert_close(form, -(a * 2), rtol=0, atol=0)
    assert cache.kept_form(new, "neg", lambda: pytest.fail("kept")) is form
    cache.kept_form(new, "big", lambda: torch.zeros(1000))  # 4000 bytes: no room
    assert cache.nbytes == 1600


@pytest.mark.parametrize("name", ["max_prod", "top_path"])
def test_packed_panels_of_a_linear_weight_follow_the_weight(name: str) -> None:
    """A layer large enough for the native max-plus kernels keeps the packed panels and row
    maxima of its log|W| with the weight's entry: the next pass gives the same values as a pass
    without the cache, and so does a pass after a write through ``p.data``."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(384, 1536), nn.Tanh(), nn.Linear(1536, 8))
    x = torch.randn(20, 384, requires_grad=True)

    def values() -> list:
        model.zero_grad(set_to_none=True)
        x.semiring_grad = None
        with semipack.extend(model, SEMIRINGS[name]()):
            model(x).sum().backward()
        leaves = [p.semiring_grad for p in model.parameters()] + [x.semiring_grad]
        return [t.clone() for t in tree_leaves(leaves)]

    first = values()
    kinds = {view[0] for e in WEIGHTS._entries.values() for view in e.forms}
    assert {"panels", "finite"} <= kinds
    _assert_same(first, values())
    _assert_same(first, _without_cache(values))
    model[0].weight.data[5, 100] *= -4000.0  # version unchanged: a new log|W|, new panels
    after = values()
    _assert_same(after, _without_cache(values))
    assert not all(torch.equal(a, b) for a, b in zip(after, first, strict=True))


def test_log_sum_keeps_the_magnitudes_of_convolution_weights() -> None:
    """LogSum's shared-shift convolution multiplies by |W|: kept with the weight, and a write
    through ``p.data`` makes it again."""
    model = _conv_model()
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(4), requires_grad=True)

    def values() -> list:
        model.zero_grad(set_to_none=True)
        x.semiring_grad = None
        with semipack.extend(model, semipack.LogSum()):
            model(x).pow(2).sum().backward()
        return [
            t.clone() for t in [p.semiring_grad for p in model.parameters()] + [x.semiring_grad]
        ]

    first = values()
    assert any(k[0][0] == "magnitude" for k in WEIGHTS._entries)
    _assert_same(first, values())
    _assert_same(first, _without_cache(values))
    model[0].weight.data[1, 2, 0, 1] *= -40.0
    after = values()
    _assert_same(after, _without_cache(values))
    assert not torch.equal(after[-1], first[-1])
