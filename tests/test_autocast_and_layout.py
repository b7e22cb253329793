"""Mixed precision and memory layouts: the values are those of the ops the forward ran.

Under ``torch.autocast`` a layer multiplies low-precision copies of its input and weight; an
entry that rounds to 0 there is no edge. Module extensions step aside under autocast (the
per-op rules see the casts), so the values equal the generic path's and brute force on the
recorded graph. With channels_last maps of 1 x 1 the regular gradient's layout decides which
kernel the next backward takes: ``.grad`` must stay bitwise a plain backward's.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from oracle import build_graph, dynamic_programming
from torch import nn

import semipack


def _semiring_grads(model: nn.Module, loss_fn, semiring, extensions: bool) -> dict:
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semiring, extensions=extensions):
        loss_fn().backward()
    return {n: p.semiring_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("semiring", "no_path"),
    [(semipack.Boolean(), False), (semipack.MaxProd(), 0.0), (semipack.LogCount(), -math.inf)],
    ids=["Boolean", "MaxProd", "LogCount"],
)
def test_an_input_that_float16_rounds_to_zero_is_no_edge(semiring, no_path) -> None:
    """x[1] = 1e-9 is 0 in float16: the weight column it multiplies has no path (and a zero
    gradient), with extensions on as off."""
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    x = torch.tensor([[1.0, 1e-9, 2.0]])

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = linear(x)
        return out.float().sum()

    fast = _semiring_grads(linear, loss, semiring, extensions=True)
    assert torch.equal(linear.weight.grad[:, 1], torch.zeros(2))
    slow = _semiring_grads(linear, loss, semiring, extensions=False)
    assert torch.equal(fast["weight"], slow["weight"])
    assert (fast["weight"][:, 0] != no_path).all()
    assert (fast["weight"][:, 1] == no_path).all()


def test_bfloat16_autocast_values_match_brute_force() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    x = torch.randn(2, 3)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return out.float().pow(2).sum()

    for name in ("max_prod", "log_sum"):
        expected = dynamic_programming(build_graph(loss()), list(model.parameters()), name)
        semiring = semipack.MaxProd() if name == "max_prod" else semipack.LogSum()
        got = _semiring_grads(model, loss, semiring, extensions=True)
        for (param_name, _), want in zip(model.named_parameters(), expected, strict=True):
            value = got[param_name].double()
            if name == "log_sum":  # log values: compare the magnitudes they stand for
                value, want = value.exp(), want.exp()
            torch.testing.assert_close(value, want, rtol=1e-6, atol=0, msg=param_name)


class _ConvAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.query = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2)  # [N, 16 positions, 4 channels]
        q = self.query(h).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("semiring", [semipack.MaxProd(), semipack.Entropy()], ids=repr)
def test_extensions_equal_the_generic_path_under_autocast(semiring) -> None:
    torch.manual_seed(1)
    model = _ConvAttention()
    x = torch.randn(2, 2, 4, 4)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return out.float().pow(2).sum()

    fast = _semiring_grads(model, loss, semiring, extensions=True)
    slow = _semiring_grads(model, loss, semiring, extensions=False)
    for name in fast:
        torch.testing.assert_close(fast[name], slow[name], rtol=0, atol=0, equal_nan=True)


class _OneByOneBlock(nn.Module):
    """A 1 x 1 map used twice: its gradient is the sum of two, whose layout BatchNorm reads."""

    def __init__(self, channels: int = 160) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.a(x))
        return self.c(h + self.b(h))


@pytest.mark.parametrize("train", [False, True])
def test_channels_last_gradients_of_one_by_one_maps_are_bitwise_plain(train: bool) -> None:
    torch.manual_seed(0)
    model = _OneByOneBlock().train(train).to(memory_format=torch.channels_last)
    x = torch.randn(2, 160, 1, 1).contiguous(memory_format=torch.channels_last)
    if train:
        x = torch.randn(4, 160, 1, 1).contiguous(memory_format=torch.channels_last)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model(x).pow(2).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semipack.MaxProd()):
        model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, plain[name]), name


@pytest.mark.parametrize(
    "semiring", [semipack.LogSum(), semipack.Real(), semipack.Entropy()], ids=repr
)
def test_a_backward_inside_autocast_keeps_float32_states(semiring) -> None:
    """``loss.backward()`` written inside an AMP step's autocast block, the model's layer run
    in float32: `.grad` is PyTorch's own (its formulas run in bfloat16 there), the semiring
    values are float32 and those of the forward's values (as from a backward outside)."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    x = torch.randn(3, 5, 8)

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return linear(x).tanh().pow(2).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward().backward()
    plain = linear.weight.grad.clone()
    linear.zero_grad(set_to_none=True)
    with semipack.extend(linear, semiring):
        loss = forward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss.backward()
        inside = linear.weight.semiring_grad.clone()
        assert torch.equal(linear.weight.grad, plain)
        forward().backward()
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, linear.weight.semiring_grad, rtol=1e-6, atol=1e-6)


def test_a_map_used_three_times_sums_its_gradients_in_pytorchs_layouts() -> None:
    """A sum's gradient passed to two summands is held twice: PyTorch adds into neither
    (TensorIterator's layout), then into its own result (that layout again)."""
    torch.manual_seed(0)
    channels = 32
    norm, a1, a2 = (
        nn.BatchNorm2d(channels),
        nn.Conv2d(channels, channels, 1),
        nn.Conv2d(channels, channels, 1),
    )
    model = nn.ModuleList([norm, a1, a2]).eval().to(memory_format=torch.channels_last)
    x = torch.randn(4, channels, 1, 1).contiguous(memory_format=torch.channels_last)

    def loss() -> torch.Tensor:
        h = norm(x)
        return a2(a1(h) + h * 2 + h.contiguous()).pow(2).sum()

    loss().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semipack.MaxProd()):
        loss().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, plain[name]), name


def _channels_last_1x1(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, C, 1, 1] with channels_last strides (C, 1, C, C), as pooling such a map gives."""
    out = torch.empty(t.shape, dtype=t.dtype, memory_format=torch.channels_last)
    return out.copy_(t)


def _batch_norm_grads(semiring, loss) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The strides of the gradient reaching a 1 x 1 batch-norm output ``h`` and the layer's
    ``.grad``s, after a backward of ``loss(h)`` (plain without ``semiring``)."""
    torch.manual_seed(0)
    norm = nn.BatchNorm2d(16)
    x = torch.randn(64, 16, 1, 1) * 3 + 1
    seen: list = []

    def backward() -> None:
        h = norm(x)
        h.register_hook(lambda g: seen.append(g.stride()))
        loss(h).backward()

    if semiring is None:
        backward()
    else:
        with semipack.extend(norm, semiring):
            backward()
    return seen, norm.weight.grad, norm.bias.grad


def _pooled(h: torch.Tensor) -> torch.Tensor:
    wide = F.interpolate(h, scale_factor=2).contiguous(memory_format=torch.channels_last)
    return F.adaptive_avg_pool2d(wide, 1)


def _weights(like: torch.Tensor) -> torch.Tensor:
    ramp = torch.arange(like.numel(), dtype=like.dtype).reshape(like.shape)
    return _channels_last_1x1(ramp.cos())


def _pending(h: torch.Tensor) -> torch.Tensor:
    y = h * 2 + _pooled(h) + h  # the first gradient reaching h waits in h * 2's buffer too
    return (y * _weights(y)).sum()


_STORED: list = []


def _stored(h: torch.Tensor) -> torch.Tensor:
    pooled = _pooled(h)
    c = h.clone()  # made last, so its gradient reaches h first
    c.register_hook(_STORED.append)  # keeps the gradient, returns None
    return (c * _weights(c)).sum() + (pooled * 1.5).sum()


@pytest.mark.parametrize("loss", [_pending, _stored], ids=["held by a pending branch", "stored"])
@pytest.mark.parametrize(
    "semiring",
    [
        semipack.Real(),
        semipack.MaxProd(),
        semipack.Entropy(),
        semipack.TopPath(),
        semipack.Product(semipack.MaxProd(), semipack.Entropy()),
    ],
    ids=repr,
)
def test_a_first_gradient_held_elsewhere_is_not_accumulated_into(semiring, loss) -> None:
    """PyTorch adds out of place when the first gradient is held elsewhere (a branch still to
    run, a hook that kept it): the sum's layout, and BatchNorm's rounding after it, follow."""
    _STORED.clear()
    plain = _batch_norm_grads(None, loss)
    got = _batch_norm_grads(semiring, loss)
    assert got[0] == plain[0]
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])


def test_a_retained_gradient_kept_from_an_earlier_backward_keeps_its_values() -> None:
    """PyTorch's retain hook sets ``grad + new``, a new tensor, on a second backward."""
    torch.manual_seed(0)
    linear = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    for semiring in (None, semipack.MaxProd()):
        context = semipack.extend(linear, semiring) if semiring is not None else nullcontext()
        with context:
            h = linear(x)
            h.retain_grad()
            loss = (h * h).sum()
            loss.backward(retain_graph=True)
            first = h.grad
            kept = first.clone()
            loss.backward()
        assert torch.equal(first, kept) and h.grad is not first
        torch.testing.assert_close(h.grad, 2 * kept, rtol=0, atol=0)
