"""Shared-shift products (one exponentiation for both products of a bilinear op) against the
semirings' own per-product ``matmul`` and ``sum``, which shift along the reduced dimension."""

from __future__ import annotations

import pytest
import torch

import semipack
from semipack.extensions.linear import linear_messages
from semipack.messages.shared_shift import SHARED_SHIFT_SPAN, global_shift, shared_shift_products
from semipack.messages.windows import ConvGeometry
from semipack.semirings import Semiring

F64 = torch.float64
SUM_LIKE = [semipack.LogSum(), semipack.LogCount(), semipack.Entropy()]


def _generator(seed: int) -> torch.Generator:
    """A seeded generator on the default device (``dev/gpu_check/extra_cuda.py`` runs these tests
    with CUDA as the default device, whose tensors a CPU generator cannot fill)."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def message(sr: Semiring, shape: tuple[int, ...], spread: float, seed: int):
    """A state whose log-normaliser spans ``spread`` nats, with some entries without a path."""
    gen = _generator(seed)
    log_z = torch.rand(shape, generator=gen, dtype=F64) * spread
    log_z[..., 1, :2] = float("-inf")
    if isinstance(sr, semipack.Entropy):
        return (log_z, torch.randn(shape, generator=gen, dtype=F64))
    return (log_z,)


def weights(*shape: int, seed: int) -> torch.Tensor:
    gen = _generator(seed)
    w = torch.randn(shape, generator=gen, dtype=F64)
    return torch.where(torch.rand(shape, generator=gen, dtype=F64) < 0.2, 0.0, w)


def assert_states_close(sr: Semiring, got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    if isinstance(sr, semipack.Entropy):
        live = torch.isfinite(want[0])
        torch.testing.assert_close(got[1][live], want[1][live], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_both_products_and_sum_match_the_semiring_ops(sr: Semiring, batch) -> None:
    m = message(sr, (*batch, 5, 7), spread=30.0, seed=1)
    right = weights(*batch, 7, 4, seed=2)
    left = weights(*batch, 5, 6, seed=3)
    by_right, by_left, total = shared_shift_products(sr, m, right, left, want_sum=True)
    assert_states_close(sr, by_right, sr.matmul(m, right))
    m_t = tuple(p.transpose(-1, -2) for p in m)
    assert_states_close(sr, by_left, sr.matmul(m_t, left))
    assert_states_close(sr, total, sr.sum(m, [m[0].dim() - 2]))


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
def test_wide_or_empty_messages_fall_back(sr: Semiring) -> None:
    wide = message(sr, (5, 7), spread=SHARED_SHIFT_SPAN + 5.0, seed=4)
    wide[0][0, 0], wide[0][0, 1] = 0.0, SHARED_SHIFT_SPAN + 1.0
    assert shared_shift_products(sr, wide, weights(7, 3, seed=5)) is None
    empty = (torch.full((5, 7), float("-inf"), dtype=F64), *wide[1:])
    assert global_shift(empty[0]) is None
    assert shared_shift_products(sr, empty, weights(7, 3, seed=5)) is None


def test_only_the_sum_like_log_semirings_take_it() -> None:
    m = (torch.zeros(3, 4, dtype=F64),)
    for sr in [semipack.Real(), semipack.MaxProd(), semipack.Boolean()]:
        assert shared_shift_products(sr, m, torch.ones(4, 2, dtype=F64)) is None

    class MyLogSum(semipack.LogSum):  # changes plus: no inherited fast path
        def plus(self, a, b):
            return (torch.maximum(a[0], b[0]),)

    class Renamed(semipack.LogSum):  # changes nothing: keeps it
        pass

    assert shared_shift_products(MyLogSum(), m, torch.ones(4, 2, dtype=F64)) is None
    assert shared_shift_products(Renamed(), m, torch.ones(4, 2, dtype=F64)) is not None


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
@pytest.mark.parametrize("spread", [10.0, 80.0])
@pytest.mark.parametrize("rows", [6, 3], ids=["many_rows", "few_rows"])
def test_linear_messages_equal_per_product_shifts(
    sr: Semiring, spread: float, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides of the span threshold give the per-product values. Entropy's weight message
    over few rows (at most a quarter of the layer's inputs and outputs) sums ``[e·r; e]``
    against ``[|x|; -|x| log|x|]`` in one product (``_stacked_sums``), over many in two."""
    from semipack.semirings import entropy

    stacked: list[torch.Size] = []
    original = entropy.stacked_magnitudes

    def spy(x: torch.Tensor):
        stacked.append(x.shape)
        return original(x)

    monkeypatch.setattr(entropy, "stacked_magnitudes", spy)
    inputs, outputs = (4, 5) if rows == 6 else (12, 16)
    m = message(sr, (rows, outputs), spread=spread, seed=6)
    x, w = weights(rows, inputs, seed=7), weights(outputs, inputs, seed=8)
    m_x, m_w, m_b = linear_messages(sr, m, x, w, True, True, True)
    assert_states_close(sr, m_x, sr.matmul(m, w))
    assert_states_close(sr, m_w, sr.matmul(tuple(p.t() for p in m), x))
    assert_states_close(sr, m_b, sr.sum(m, [0]))
    took_shared_shift = spread < SHARED_SHIFT_SPAN
    few = rows == 3 and isinstance(sr, semipack.Entropy) and took_shared_shift
    assert stacked == ([x.shape] if few else [])


CONV_GEOMETRIES = {
    "conv2d": dict(x=(2, 4, 6, 5), w=(6, 4, 3, 3), stride=[1, 1], padding=[1, 1], dilation=[1, 1]),
    "strided_dilated": dict(
        x=(2, 4, 9, 8), w=(6, 2, 3, 2), stride=[2, 1], padding=[2, 0], dilation=[2, 3], groups=2
    ),
    "conv1d": dict(x=(3, 2, 11), w=(5, 2, 4), stride=[3], padding=[2], dilation=[1]),
    "depthwise": dict(x=(2, 3, 5, 5), w=(3, 1, 3, 3), stride=[1, 1], padding=[0, 0], groups=3),
}


def _in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (same values) in memory order ``layout``: "contiguous", "channels_last" (4-D),
    or "batch_inner" (channel-major: the channel dim outermost in memory, then the batch dim;
    no batch-stacked form)."""
    if layout == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "batch_inner":
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
@pytest.mark.parametrize("geometry", list(CONV_GEOMETRIES))
@pytest.mark.parametrize(
    "layout", ["contiguous", "channels_last", "batch_inner", "message_batch_inner"]
)
def test_conv_messages_through_torch_convolution_match_the_window_maps(
    sr: Semiring, geometry: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Input, weight and bias messages from PyTorch's convolution backward on the shifted
    messages equal the im2col reference (window index maps and the semiring's own matmul and
    plus), including exact zeros of inputs and weights (no edge) and entries without a path.
    Entropy's weight message takes two sums where the input's batch dim is outermost in memory
    (contiguous, channels-last: ``[e·r; e]`` against ``[|x|; -|x| log|x|]``; a message in
    another layout, as a train-mode batch norm hands over, is stacked in the standard one),
    three elsewhere."""
    from conv_reference import window_map_messages

    from semipack.messages import shared_shift
    from semipack.messages.shared_shift import shared_shift_conv

    g = dict(CONV_GEOMETRIES[geometry])
    x, w = weights(*g.pop("x"), seed=7), weights(*g.pop("w"), seed=8)
    g.setdefault("dilation", [1] * (x.dim() - 2))
    groups = g.pop("groups", 1)
    out = torch.nn.functional.conv1d if x.dim() == 3 else torch.nn.functional.conv2d
    out_shape = out(x, w, None, g["stride"], g["padding"], g["dilation"], groups).shape
    m = message(sr, tuple(out_shape), spread=25.0, seed=9)
    if layout == "message_batch_inner":
        m = tuple(_in_layout(p, "batch_inner") for p in m)
    else:
        x, m = _in_layout(x, layout), tuple(_in_layout(p, layout) for p in m)
    geometry = ConvGeometry.of(x.dim() - 2, g["stride"], g["padding"], g["dilation"], groups)
    args = (sr, m, x, w, geometry, (True, True, True))
    sums: list[tuple[bool, int]] = []  # (toward the weight, batch) of each convolution sum
    run = shared_shift._ConvSums._run

    def counted(self, g, x, w, mask):
        sums.append((mask[1], g.shape[0]))
        return run(self, g, x, w, mask)

    monkeypatch.setattr(shared_shift._ConvSums, "_run", counted)
    fast = shared_shift_conv(*args)
    assert fast is not None
    for got, want in zip(fast, window_map_messages(*args), strict=True):
        assert_states_close(sr, got, want)
    n = x.shape[0]
    to_weight = sorted(batch for toward_weight, batch in sums if toward_weight)
    if not isinstance(sr, semipack.Entropy):
        assert to_weight == [n]
    elif layout == "batch_inner":
        assert to_weight == [n, n, n]
    else:
        assert to_weight == [n, 2 * n]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "batch_inner"])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 16, 32, 33)], ids=["eager", "compiled"])
def test_stacked_magnitudes_are_the_magnitudes_and_their_negated_x_log_x(
    layout: str, size: tuple[int, ...]
) -> None:
    """``[|x|; -|x| log|x|]`` in one tensor of 2N examples, each half in ``x``'s layout: the
    bits of ``abs_and_xlogx`` (zeros, -0.0, NaN and infinities among the entries; 0 log 0 = 0),
    eagerly and compiled (from 16k entries); None where the batch dim is not outermost."""
    from semipack.kernels.logspace import abs_and_xlogx, stacked_magnitudes

    x = torch.randn(size, generator=_generator(3))
    flat = x.view(-1)
    flat[::7], flat[1::7], flat[2::11], flat[3::13] = 0.0, -0.0, float("nan"), float("-inf")
    x = _in_layout(x, layout)
    stacked = stacked_magnitudes(x)
    if layout == "batch_inner":
        assert stacked is None
        return
    n = x.shape[0]
    mag, neg = stacked[:n], stacked[n:]
    assert stacked.shape == (2 * n, *x.shape[1:])
    assert mag.stride() == neg.stride() == x.stride()
    want_mag, want_xlogx = abs_and_xlogx(x.contiguous())
    for got, want in ((mag, want_mag), (neg, -want_xlogx)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(neg[x == 0], torch.zeros(int((x == 0).sum())))  # 0 log 0 = 0


@pytest.mark.parametrize("sr", SUM_LIKE, ids=lambda s: s.name)
def test_conv_with_a_wide_message_falls_back_to_the_window_maps(sr: Semiring) -> None:
    from semipack.messages.shared_shift import shared_shift_conv

    x, w = weights(2, 3, 5, 5, seed=1), weights(4, 3, 3, 3, seed=2)
    m = message(sr, (2, 4, 3, 3), spread=SHARED_SHIFT_SPAN + 10.0, seed=3)
    m[0][0, 0, 0, 0], m[0][0, 0, 0, 1] = 0.0, SHARED_SHIFT_SPAN + 5.0
    mask = (True, True, True)
    assert shared_shift_conv(sr, m, x, w, ConvGeometry.of(2, 1, 0, 1), mask) is None


@pytest.mark.parametrize("layout", ["channels_last", "batch_inner"])
def test_a_large_message_in_another_layout_than_the_input_gives_the_reference_values(
    layout: str,
) -> None:
    """Entropy's ``[e·r; e]`` is made in the message's layout where it has one with the batch
    outermost, else in the standard layout. A message of at least ``FUSED_MIN_ELEMENTS``
    entries takes the one-loop kernel over flat memory only where e's layout is the message's:
    a channel-major message (a train-mode batch norm's) written flat into standard-layout
    halves scrambled every entry (found 2026-11-28 before it landed). Against the im2col
    reference and against the same message contiguous (the same bits)."""
    from conv_reference import window_map_messages

    from semipack.kernels.compiled import FUSED_MIN_ELEMENTS
    from semipack.messages.shared_shift import shared_shift_conv

    sr = semipack.Entropy()
    x, w = weights(2, 3, 48, 48, seed=11), weights(8, 3, 3, 3, seed=12)
    m = message(sr, (2, 8, 48, 48), spread=25.0, seed=13)
    assert m[0].numel() >= FUSED_MIN_ELEMENTS
    geometry = ConvGeometry.of(2, 1, 1, 1)
    mask = (True, True, False)
    moved = tuple(_in_layout(p, layout) for p in m)
    assert moved[0].stride() != m[0].stride()
    got = shared_shift_conv(sr, moved, x, w, geometry, mask)
    same_values = shared_shift_conv(sr, m, x, w, geometry, mask)
    reference = window_map_messages(sr, m, x, w, geometry, mask)
    for i in range(2):
        for g, s in zip(got[i], same_values[i], strict=True):
            assert torch.equal(g.nan_to_num(), s.nan_to_num())
        assert_states_close(sr, got[i], reference[i])


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_conv_net_gives_the_three_sum_values_with_its_weight_sums_stacked(
    train: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A convolution, batch norm (train mode hands its messages over channel-major), ReLU and
    a convolution, on messages above ``FUSED_MIN_ELEMENTS``: every parameter's Entropy with the
    weight sums stacked equals the values with three sums (``stacked=False``) within float32
    rounding, with the same NaN entries, and ``p.grad`` is autograd's, bit for bit."""
    from semipack.semirings import entropy

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
    ).train(train)
    x = torch.randn(4, 3, 48, 48)
    weights_out = torch.randn(4, 16, 48, 48)

    def run() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with semipack.extend(model, semipack.Entropy()):
            (model(x) * weights_out).sum().backward()
        return {n: (p.semiring_grad.clone(), p.grad.clone()) for n, p in model.named_parameters()}

    stacked = run()
    original = entropy._shared_shift_stacked
    monkeypatch.setattr(
        entropy, "_shared_shift_stacked", lambda m, stacked=True: original(m, stacked=False)
    )
    three = run()
    model.zero_grad(set_to_none=True)
    (model(x) * weights_out).sum().backward()
    for name, p in model.named_parameters():
        (got, got_grad), (want, _) = stacked[name], three[name]
        assert torch.equal(got_grad, p.grad)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
