"""The public API contract: extend / grad, restoration of the model, errors, graph semantics."""

from __future__ import annotations

import copy
import math
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import SEMIRINGS, assert_readout_matches, semiring_names
from torch import nn

import semipack


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])


def snapshot(model: nn.Module) -> dict:
    """Everything extend could leave behind on a model."""
    return {
        name: (
            type(m),
            dict(m._forward_hooks),
            dict(m._forward_pre_hooks),
            dict(m._backward_hooks),
            dict(m._backward_pre_hooks),
            sorted(k for k in vars(m) if not k.startswith("_")),
            m.forward,
        )
        for name, m in model.named_modules()
    }


# --- graph semantics: y = 2x versus y = x + x versus y = x * x ---------------------------------


@pytest.mark.parametrize(
    ("sr", "two_x", "x_plus_x", "x_times_x"),
    [
        # x = 3. 2x: one edge of weight 2. x+x: two edges of weight 1. x*x: two edges of weight 3.
        (semipack.Real(), 2.0, 2.0, 6.0),
        (semipack.MaxProd(), 2.0, 1.0, 3.0),
        (semipack.LogSum(), math.log(2.0), math.log(2.0), math.log(6.0)),
        (semipack.LogCount(), 0.0, math.log(2.0), math.log(2.0)),
        (semipack.Entropy(), 0.0, math.log(2.0), math.log(2.0)),
        (semipack.Boolean(), True, True, True),
    ],
    ids=lambda v: v.name if isinstance(v, semipack.Semiring) else None,
)
def test_per_use_edges(sr, two_x, x_plus_x, x_times_x) -> None:
    x = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)
    for f, expected in [
        (lambda t: 2 * t, two_x),
        (lambda t: t + t, x_plus_x),
        (lambda t: t * t, x_times_x),
    ]:
        (value,) = semipack.grad(f(x).sum(), x, sr)
        if isinstance(expected, bool):
            assert value.item() is expected
        else:
            assert value.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_signed_paths_swap_under_negative_edges() -> None:
    """loss = 2x - 5x has paths +2 and -5: largest +2, smallest -5; MaxProd sees |−5| = 5."""
    x = torch.tensor([1.5], dtype=torch.float64, requires_grad=True)
    (ext,) = semipack.grad((2 * x - 5 * x).sum(), x, semipack.SignedMaxProd())
    assert ext.largest.item() == pytest.approx(2.0)
    assert ext.smallest.item() == pytest.approx(-5.0)
    (mp,) = semipack.grad((2 * x - 5 * x).sum(), x, semipack.MaxProd())
    assert mp.item() == pytest.approx(5.0)
    # a further negative edge swaps which path is largest
    (ext,) = semipack.grad((-(2 * x - 5 * x)).sum(), x, semipack.SignedMaxProd())
    assert ext.largest.item() == pytest.approx(5.0)
    assert ext.smallest.item() == pytest.approx(-2.0)


def test_a_path_through_an_off_relu_is_no_signed_path() -> None:
    """relu(-x) * 5 - 2x at x = 1 (the README's example): the path through the ReLU has an
    exact zero, so it is no path, and the one path left, -2, is the largest and the smallest
    (0 would be the largest if zero edges counted; trial 124)."""
    x = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    (ext,) = semipack.grad((torch.relu(-x) * 5 - 2 * x).sum(), x, semipack.SignedMaxProd())
    assert ext.largest.item() == -2.0 and ext.smallest.item() == -2.0


def test_a_zero_edge_next_to_an_infinite_one() -> None:
    """hypot at (0, 0): its backward multiplies by x (an edge of 0) and divides by the result
    (an edge of inf). As documented in the README's Limits: NaN where the values multiply
    (Real, as PyTorch's gradient, MaxProd, LogSum, Entropy), no path where a zero edge ends
    the path (Boolean, LogCount, SignedMaxProd, which reads there what it reads where no path
    exists at all: relu(-x) at x = 1; trial 129)."""
    x = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    y = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    loss = torch.hypot(x, y).sum()
    (grad,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert math.isnan(grad[0]) and grad[1] == 1.0
    for sr in (semipack.Real(), semipack.MaxProd(), semipack.LogSum(), semipack.Entropy()):
        (value,) = semipack.grad(loss, x, sr, retain_graph=True)
        assert math.isnan(value[0]) and not math.isnan(value[1]), sr
    (reach,) = semipack.grad(loss, x, semipack.Boolean(), retain_graph=True)
    assert reach.tolist() == [False, True]
    (count,) = semipack.grad(loss, x, semipack.LogCount(), retain_graph=True)
    assert count.tolist() == [-math.inf, 0.0]
    (signed,) = semipack.grad(loss, x, semipack.SignedMaxProd())
    off = torch.ones(1, dtype=torch.float64, requires_grad=True)
    (none,) = semipack.grad(torch.relu(-off).sum(), off, semipack.SignedMaxProd())
    assert signed.largest[0] == none.largest[0] and signed.smallest[0] == none.smallest[0]
    assert signed.largest[1] == signed.smallest[1] == 1.0


def test_relu_zero_derivative_removes_the_edge() -> None:
    x = torch.tensor([-1.0, 2.0], dtype=torch.float64, requires_grad=True)
    loss = torch.relu(x).sum()
    (reach,) = semipack.grad(loss, x, semipack.Boolean(), retain_graph=True)
    assert reach.tolist() == [False, True]
    (ent,) = semipack.grad(loss, x, semipack.Entropy())
    assert math.isnan(ent[0].item()) and ent[1].item() == 0.0


def test_grad_outputs_are_lifted_as_root_edges() -> None:
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    y = 3 * x
    (val,) = semipack.grad(y, x, semipack.MaxProd(), torch.tensor([-2.0, 0.5], dtype=torch.float64))
    assert val.tolist() == pytest.approx([6.0, 1.5])


# --- extend --------------------------------------------------------------------------------------


@pytest.mark.parametrize("forward_inside", [True, False])
def test_extend_sets_grad_exactly_and_semiring_grad(forward_inside: bool) -> None:
    model = small_model()
    x, y = data()
    x.requires_grad_(True)
    reference = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_(True)
    F.cross_entropy(reference(x_ref), y).backward()

    if forward_inside:
        with semipack.extend(model, semipack.MaxProd()):
            F.cross_entropy(model(x), y).backward()
    else:
        loss = F.cross_entropy(model(x), y)
        with semipack.extend(model, semipack.MaxProd()):
            loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
        assert p.semiring_grad.shape == p.shape
        assert (p.semiring_grad >= 0).all()
    assert torch.equal(x.grad, x_ref.grad)
    assert x.semiring_grad.shape == x.shape


def test_extend_matches_functional_grad() -> None:
    model = small_model()
    x, y = data()
    for sr in [semipack.Real(), semipack.LogSum(), semipack.Entropy()]:
        loss = F.cross_entropy(model(x), y)
        expected = semipack.grad(loss, list(model.parameters()), sr)
        model.zero_grad()
        with semipack.extend(model, sr):
            F.cross_entropy(model(x), y).backward()
        for p, e in zip(model.parameters(), expected, strict=True):
            # Same products; the fused bias sum adds exp(m - max) in another order than the
            # generic path's logsumexp, so the log-space semirings agree to rounding.
            tight = type(sr) is semipack.Real
            torch.testing.assert_close(
                p.semiring_grad, e, rtol=0 if tight else 1e-13, atol=0 if tight else 1e-15
            )


def test_real_semiring_grad_equals_autograd() -> None:
    model = small_model()
    x, y = data()
    with semipack.extend(model, semipack.Real()):
        F.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        torch.testing.assert_close(p.semiring_grad, p.grad, rtol=1e-12, atol=1e-14)


def test_regular_grads_off_leaves_grad_untouched() -> None:
    model = small_model()
    x, y = data()
    with semipack.extend(model, semipack.LogSum(), regular_grads=False):
        F.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        assert p.grad is None
        assert torch.isfinite(p.semiring_grad).all()


def test_grads_accumulate_like_autograd_and_semiring_grad_is_per_backward() -> None:
    model = small_model()
    x, y = data()
    reference = copy.deepcopy(model)
    for _ in range(2):
        F.cross_entropy(reference(x), y).backward()
    with semipack.extend(model, semipack.MaxProd()):
        F.cross_entropy(model(x), y).backward()
        first = model[0].weight.semiring_grad.clone()
        F.cross_entropy(model(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    torch.testing.assert_close(model[0].weight.semiring_grad, first, rtol=0, atol=0)


def test_unreached_parameters_lose_stale_values() -> None:
    model = small_model()
    x, y = data()
    with semipack.extend(model, semipack.MaxProd()):
        F.cross_entropy(model(x), y).backward()
        assert hasattr(model[0].weight, "semiring_grad")
        # a backward that only reaches the last layer
        model[2](torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    assert not hasattr(model[0].weight, "semiring_grad")
    assert hasattr(model[2].weight, "semiring_grad")


@pytest.mark.parametrize("later", ["TopPath", "KBest", "MaxProd"])
@pytest.mark.parametrize("first", ["TopPath", "KBest"])
def test_unreached_parameters_lose_stale_paths(first: str, later: str) -> None:
    """A later backward that does not reach a parameter removes its recorded paths with its
    ``semiring_grad`` (trial 114: ``path(w)`` returned the earlier pass's path, from any
    TopPath instance, without an error)."""
    make = {
        "TopPath": semipack.TopPath,
        "KBest": lambda: semipack.KBest(2),
        "MaxProd": semipack.MaxProd,
    }
    model = small_model()
    x, y = data()
    recorder = make[first]()
    with semipack.extend(model, recorder):
        F.cross_entropy(model(x), y).backward()
    assert hasattr(model[0].weight, "semiring_paths")
    read = (lambda sr, w: sr.path(w)) if first == "TopPath" else (lambda sr, w: sr.paths(w, (0, 0)))
    read(recorder, model[0].weight)  # recorded
    with semipack.extend(model, make[later]()):
        model[2](torch.randn(2, 5, dtype=torch.float64)).sum().backward()  # the last layer only
    assert not hasattr(model[0].weight, "semiring_grad")
    assert not hasattr(model[0].weight, "semiring_paths")
    with pytest.raises(KeyError, match="holds no"):
        read(recorder, model[0].weight)
    if later != "MaxProd":  # the later pass's own paths on what it reached
        assert hasattr(model[2].weight, "semiring_paths")


def _readout_parts(value):
    """A readout as a tuple of tensors (SignedMaxProd's and Entropy's flow readouts are pairs)."""
    return tuple(value) if isinstance(value, tuple) else (value,)


# TopPath records its paths per pass: refused with accumulate (below)
@pytest.mark.parametrize("semiring_name", semiring_names("top_path"))
def test_accumulate_adds_the_blocks_backwards_up(semiring_name: str) -> None:
    """``extend(..., accumulate=True)``: two backwards over halves of a batch leave the values
    of one backward over the summed loss, the union of both passes' paths (trial 115: each
    backward replaced the last, so a monitor under gradient accumulation recorded the last
    micro-batch); ``.grad`` accumulates as in a plain loop, bitwise."""
    model, plain = small_model(), small_model()
    x, y = data()
    sr = SEMIRINGS[semiring_name]()
    with semipack.extend(model, sr, accumulate=True):
        for part in (slice(0, 2), slice(2, 6)):
            F.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
    got = {name: p.semiring_grad for name, p in model.named_parameters()}
    assert not any(hasattr(p, "semiring_state") for p in model.parameters())
    for part in (slice(0, 2), slice(2, 6)):
        F.cross_entropy(plain(x[part]), y[part], reduction="sum").backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    whole = small_model()
    with semipack.extend(whole, sr):
        F.cross_entropy(whole(x), y, reduction="sum").backward()
    for name, p in whole.named_parameters():
        want = p.semiring_grad
        if semiring_name == "real":  # Real's readout is the gradient: sums in another order
            torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-12)
        else:
            assert_readout_matches(semiring_name, want, got[name], name)


def test_accumulate_keeps_what_a_later_backward_does_not_reach() -> None:
    """A parameter the block's first backward reached and its second did not (a GAN's
    generator trained before its discriminator) keeps the first one's values; ``keep_state``
    keeps the added states."""
    model = small_model()
    x, y = data()
    sr = semipack.Entropy()
    with semipack.extend(model, sr, accumulate=True, keep_state=True):
        F.cross_entropy(model(x), y).backward()
        first = model[0].weight.semiring_grad.clone()
        model[2](torch.tanh(model[0](x)).detach()).sum().backward()  # the last layer only
    assert torch.equal(model[0].weight.semiring_grad, first)
    last = model[2].weight
    assert torch.equal(last.semiring_grad, sr.readout(tuple(last.semiring_state)))
    added = tuple(t.clone() for t in last.semiring_state)
    with semipack.extend(model, sr, keep_state=True):
        F.cross_entropy(model(x), y).backward()
        one = tuple(t.clone() for t in model[2].weight.semiring_state)  # (its memory is reused)
        model[2](torch.tanh(model[0](x)).detach()).sum().backward()
        other = tuple(model[2].weight.semiring_state)
    for got, want in zip(added, sr.plus(one, other), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("semiring", "options", "message"),
    [
        (semipack.TopPath(), {}, "accumulate=True with TopPath: its paths are recorded per"),
        (semipack.KBest(2), {}, "accumulate=True with KBest"),
        (semipack.MaxProd(), {"per_sample": True}, "accumulate=True and per_sample=True"),
    ],
)
def test_accumulate_refuses_what_cannot_add_up(semiring, options, message) -> None:
    with (
        pytest.raises(ValueError, match=message),
        semipack.extend(small_model(), semiring, accumulate=True, **options),
    ):
        pass
    with pytest.raises(TypeError, match="accumulate must be True or False"):
        semipack.extend(small_model(), semipack.MaxProd(), accumulate="yes")


def test_backward_inputs_argument_restricts_leaves() -> None:
    model = small_model()
    x, y = data()
    with semipack.extend(model, semipack.MaxProd()):
        F.cross_entropy(model(x), y).backward(inputs=[model[2].weight])
    assert model[2].weight.grad is not None and model[0].weight.grad is None
    assert hasattr(model[2].weight, "semiring_grad")
    assert not hasattr(model[0].weight, "semiring_grad")


@pytest.mark.parametrize("regular_grads", [True, False])
@pytest.mark.parametrize("extensions", [True, False])
def test_backward_inputs_with_a_non_leaf_above_another_input(regular_grads, extensions) -> None:
    """``backward(inputs=[h, x, w])`` with ``x`` and ``w`` below the non-leaf ``h`` (trial 68:
    the hook on ``h`` handed the engine the regular gradient, which reached ``x`` as a plain
    one and the pass failed). ``.grad`` as PyTorch's, bitwise; each semiring value as
    ``semipack.grad``'s for that input alone; no warning (a non-leaf's ``.grad`` read)."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
    model = nn.Sequential(lin1, lin2)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def loss():
        h = torch.tanh(lin1(x))
        return h, (lin2(h) ** 2).sum()

    h, out = loss()
    out.backward(inputs=[h, x, lin1.weight])
    plain = [h.grad, x.grad, lin1.weight.grad]
    x.grad = lin1.weight.grad = None
    for sr in (semipack.Real(), semipack.MaxProd()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with semipack.extend(model, sr, extensions=extensions, regular_grads=regular_grads):
                h, out = loss()
                out.backward(inputs=[h, x, lin1.weight], retain_graph=True)
                alone = [
                    semipack.grad(out, t, sr, retain_graph=True)[0] for t in (h, x, lin1.weight)
                ]
        for t, want, value in zip((h, x, lin1.weight), plain, alone, strict=True):
            if regular_grads:
                assert torch.equal(t.grad, want)
            elif t.is_leaf:  # (h: PyTorch warns on reading a non-leaf's .grad)
                assert t.grad is None
            torch.testing.assert_close(t.semiring_grad, value, rtol=1e-12, atol=0)
            if isinstance(sr, semipack.Real):
                torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-15)
        x.grad = lin1.weight.grad = None


@pytest.mark.parametrize(
    ("semiring", "no_path"),
    [(semipack.MaxProd, 0.0), (semipack.Boolean, False), (semipack.LogSum, -math.inf)],
)
def test_a_retained_tensor_whose_gradient_is_a_made_zero_has_no_path(semiring, no_path) -> None:
    """``prod`` over two exact zeros hands back a zero tensor it made (no message): a leaf read
    it as "no path" but a retained tensor in the same place got no ``semiring_grad`` at all
    (trial 83)."""
    x = torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64, requires_grad=True)
    with semipack.extend(None, semiring()):
        h = x * 1.0
        h.retain_grad()
        h.prod().backward()
    assert torch.equal(h.grad, torch.zeros(3, dtype=torch.float64))
    for t in (x, h):
        assert t.semiring_grad.tolist() == [no_path] * 3
    with semipack.extend(None, semiring(), regular_grads=False):  # .grad left as it was
        h = x * 1.0
        h.retain_grad()
        h.prod().backward()
    assert h.grad is None and h.semiring_grad.tolist() == [no_path] * 3


@pytest.mark.parametrize("regular_grads", [True, False])
def test_a_retained_tensor_listed_in_inputs(regular_grads) -> None:
    """``h.retain_grad()`` then ``backward(inputs=[h, x])``: ``h`` is read once, as PyTorch
    fills its ``.grad`` once (trial 69: without regular gradients its message in ``.grad`` was
    taken for a stray one, blaming a custom Function)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    h = torch.tanh(lin(x))
    h.retain_grad()
    (h**2).sum().backward(inputs=[h, x])
    plain = h.grad, x.grad
    x.grad = None
    with semipack.extend(lin, semipack.Real(), regular_grads=regular_grads):
        h = torch.tanh(lin(x))
        h.retain_grad()
        (h**2).sum().backward(inputs=[h, x])
    for t, want in zip((h, x), plain, strict=True):
        torch.testing.assert_close(t.semiring_grad, want, rtol=1e-12, atol=0)
        assert torch.equal(t.grad, want) if regular_grads else t.grad is None


def test_semipack_grad_leaves_a_retained_grad_as_it_was() -> None:
    """A tensor retained inside the block: ``semipack.grad`` (no regular gradient) leaves its
    ``.grad`` as it was, before or after a backward (trial 68: it took the message, and the
    next backward failed; with a gradient already there semipack.grad itself failed)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    h = torch.tanh(lin(x))
    h.retain_grad()
    (h * 2).sum().backward()
    plain = h.grad
    lin.zero_grad()
    with semipack.extend(lin, semipack.MaxProd()):
        h = torch.tanh(lin(x))
        h.retain_grad()
        out = (h * 2).sum()
        first = semipack.grad(out, [x], semipack.MaxProd(), retain_graph=True)[0]
        assert h.grad is None
        out.backward(retain_graph=True)
        assert torch.equal(h.grad, plain)
        kept = h.grad
        again = semipack.grad(out, [x], semipack.MaxProd())[0]
        assert h.grad is kept and torch.equal(h.grad, plain)
    torch.testing.assert_close(first, x.semiring_grad, rtol=0, atol=0)
    torch.testing.assert_close(again, x.semiring_grad, rtol=0, atol=0)


def test_torch_autograd_backward_is_intercepted_too() -> None:
    model = small_model()
    x, y = data()
    with semipack.extend(model, semipack.Boolean()):
        torch.autograd.backward(F.cross_entropy(model(x), y))
    assert model[0].weight.semiring_grad.dtype == torch.bool


def test_model_restored_after_normal_exit_and_after_exception() -> None:
    model = small_model()
    x, y = data()
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before = snapshot(model)
    modules = list(model.modules())
    with semipack.extend(model, semipack.Entropy()):
        F.cross_entropy(model(x), y).backward()
    assert snapshot(model) == before
    assert list(model.modules()) == modules  # same module objects
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_state[k])

    with pytest.raises(ZeroDivisionError), semipack.extend(model, semipack.MaxProd()):
        model(x)
        raise ZeroDivisionError
    assert snapshot(model) == before
    assert torch.overrides._get_current_function_mode_stack() == []

    class Boom(nn.Module):
        def forward(self, t):
            raise ValueError("inside forward")

    model.append(Boom())
    before = snapshot(model)
    with pytest.raises(ValueError, match="inside forward"), semipack.extend(model, semipack.Real()):
        model(x)
    assert snapshot(model) == before


def test_plain_backward_after_the_block_is_plain() -> None:
    model = small_model()
    x, y = data()
    with semipack.extend(model, semipack.MaxProd()):
        pass
    F.cross_entropy(model(x), y).backward()
    assert not hasattr(model[0].weight, "semiring_grad")


def test_extend_rejects_non_semirings() -> None:
    with pytest.raises(TypeError, match="semipack semiring"), semipack.extend(small_model(), "max"):
        pass


def test_extend_rejects_options_that_are_not_flags() -> None:
    with pytest.raises(TypeError, match="per_sample must be True or False, got 'yes'"):
        semipack.extend(small_model(), semipack.MaxProd(), per_sample="yes")


def test_one_extend_object_enters_again() -> None:
    """Like ``torch.no_grad()``, one ``extend(...)`` object may be entered again after its
    block (it failed inside contextlib before); each block gives a fresh semiring pass."""
    model = small_model()
    x, _ = data()
    block = semipack.extend(model, semipack.Real())
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with block:
            model(x).sum().backward()
        for p in model.parameters():
            torch.testing.assert_close(p.semiring_grad, p.grad)
    with block, pytest.raises(semipack.SemipackError, match="cannot be nested"), block:
        pass


# --- errors --------------------------------------------------------------------------------------


class Resampled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.head = nn.Sequential(nn.Identity(), GridSampled())

    def forward(self, x):
        return self.head(self.proj(x))


def _grid_sample(x: torch.Tensor) -> torch.Tensor:
    """[B, 3] -> [B, 1, 2, 2] through F.grid_sample, an op without a semiring rule."""
    grid = torch.zeros(x.shape[0], 2, 2, 2, dtype=x.dtype)
    return F.grid_sample(x[:, None, :, None], grid, align_corners=False)


class GridSampled(nn.Module):
    def forward(self, x):
        return _grid_sample(x)


def test_unsupported_op_names_op_node_module_and_fix() -> None:
    model = Resampled()
    with (
        pytest.raises(semipack.UnsupportedOpError) as info,
        semipack.extend(model, semipack.MaxProd()),
    ):
        model(torch.randn(2, 3)).sum().backward()
    err = info.value
    assert err.op == "aten.grid_sampler_2d_backward.default"
    assert err.node == "GridSampler2DBackward0"
    assert err.module == "head.1"
    assert str(err) == (
        "semipack has no semiring rule for aten.grid_sampler_2d_backward.default in the "
        "backward of GridSampler2DBackward0, created by module 'head.1'. Register one with "
        "@semipack.register_rule(torch.ops.aten.grid_sampler_2d_backward.default) (see "
        "'Adding an op rule' in the README)."
    )
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_general_op_inside_a_formula_is_not_advised_a_rule_of_its_own() -> None:
    """``logcumsumexp``'s backward applies ``abs`` to the gradient: the error says a rule for
    ``aten.abs`` would change every use of it and points to custom ops (trial 68: it advised
    registering one). A node's own backward op keeps the plain advice (above)."""
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(semipack.UnsupportedOpError) as info:
        semipack.grad(x.logcumsumexp(1).sum(), x, semipack.MaxProd())
    message = str(info.value)
    assert info.value.node == "LogcumsumexpBackward0" and info.value.op.startswith("aten.")
    assert f"{info.value.op} is not LogcumsumexpBackward0's own backward op" in message
    assert "write the forward as a custom op with its own backward" in message
    from semipack.errors import _one_step_of

    # a node's own op, and a custom Function's node (its name ends in Backward, no number)
    assert not _one_step_of("aten.mul.Tensor", "MulBackward0")
    assert not _one_step_of("aten._to_copy.default", "ToCopyBackward0")
    assert not _one_step_of("aten.abs.default", "MyFunctionBackward")


def test_unsupported_op_without_module_says_how_to_name_it() -> None:
    x = torch.randn(1, 3, requires_grad=True)
    with pytest.raises(semipack.UnsupportedOpError, match="module unknown"):
        semipack.grad(_grid_sample(x).sum(), x, semipack.MaxProd())


def test_ops_without_semiring_meaning_raise() -> None:
    x = torch.randn(3, requires_grad=True)

    class SquareGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g * g  # a product of two messages

    with pytest.raises(semipack.UnsupportedOpError, match="product of two messages"):
        semipack.grad(SquareGrad.apply(x).sum(), x, semipack.MaxProd())


def test_plain_gradient_reaching_a_leaf_is_an_error() -> None:
    x = torch.randn(3, requires_grad=True)

    class Forgetful(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.ones(3)  # ignores the incoming message

    with pytest.raises(
        semipack.MessageLostError,
        match=r"^a plain gradient reached a leaf of shape \(3,\) from ForgetfulBackward: ",
    ):
        semipack.grad(Forgetful.apply(x).sum(), x, semipack.MaxProd())


def test_a_zero_gradient_pytorch_makes_up_is_no_path() -> None:
    """copysign's gradient for its sign source is ``zeros_like(other)``, made without the
    incoming gradient: every partial derivative is 0, so the source has no path (an edge of
    weight 0 is no edge), and ``.grad`` is PyTorch's zeros. A made-up tensor that is not all
    zeros still raises (``test_plain_gradient_reaching_a_leaf_is_an_error``)."""
    sign = nn.Parameter(torch.randn(5))
    a = torch.randn(4, 5, requires_grad=True)
    for sr, no_path in ((semipack.MaxProd(), 0.0), (semipack.LogSum(), -math.inf)):
        sign.grad = a.grad = None
        with semipack.extend(nn.Module(), sr):
            torch.copysign(a, sign).sum().backward()
        assert torch.equal(sign.grad, torch.zeros(5))
        assert torch.equal(sign.semiring_grad, torch.full((5,), no_path))
        assert torch.equal(a.grad, torch.sign(a) * torch.sign(sign))


def test_user_rule_registration_is_used() -> None:
    """A user rule (replacing the built-in one) for reflection padding: each padded position sends
    its message back to the input entry it copies; copies of one entry meet in the plus."""
    aten = torch.ops.aten
    op = aten.reflection_pad1d_backward.default
    built_in = semipack.messages.rule_for(op)
    calls = []

    def reflection_pad_rule(call: semipack.OpCall):
        calls.append(call.func)
        msg, x, (left, right) = call["grad_output"], call["self"], call["padding"]
        n = x.shape[-1]
        q = torch.arange(n + left + right) - left
        source = torch.where(q < 0, -q, torch.where(q >= n, 2 * (n - 1) - q, q))
        dest = call.zeros(x.shape)
        return call.wrap(
            call.run_regular(), call.semiring.index_plus(dest, x.dim() - 1, source, msg.parts)
        )

    with semipack.scoped_rules():
        semipack.register_rule(op, replace=True)(reflection_pad_rule)
        x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64, requires_grad=True)
        padded = F.pad(x, (2, 1), mode="reflect")  # [3, 2, 1, 2, 3, 4, 3]
        (count,) = semipack.grad(padded.sum(), x, semipack.LogCount(), retain_graph=True)
        # x[0] appears once, x[1] twice, x[2] three times, x[3] once
        torch.testing.assert_close(
            count, torch.tensor([[1.0, 2.0, 3.0, 1.0]], dtype=torch.float64).log()
        )
        (regular,) = semipack.grad(padded.sum(), x, semipack.Real())
        torch.testing.assert_close(
            regular, torch.autograd.grad(F.pad(x, (2, 1), mode="reflect").sum(), x)[0]
        )
    assert calls == [op, op]
    assert semipack.messages.rule_for(op) is built_in  # restored when the block ended


def test_replacing_a_built_in_rule_needs_replace_true() -> None:
    op = torch.ops.aten.tanh_backward.default
    built_in = semipack.messages.rule_for(op)
    with pytest.raises(ValueError) as info:
        semipack.register_rule(op)(lambda call: None)
    assert str(info.value) == (
        "aten.tanh_backward.default already has a semiring rule; pass replace=True to "
        "semipack.register_rule to override it (or register inside semipack.scoped_rules() "
        "to override it for one block)"
    )
    assert built_in is not None and semipack.messages.rule_for(op) is built_in


def test_rules_registered_in_a_scope_leave_with_it() -> None:
    op = torch.ops.aten.special_zeta.default
    assert semipack.messages.rule_for(op) is None
    with semipack.scoped_rules():
        semipack.register_rule(op)(lambda call: None)
        assert semipack.messages.rule_for(op) is not None
    assert semipack.messages.rule_for(op) is None


def test_a_rule_whose_state_has_another_shape_is_named_not_broadcast() -> None:
    """A rule that returns a state of another shape than its regular gradient (here one summed
    entry for a [2, 3] gradient) raises, naming the op and the node: broadcast, the one entry
    would stand for six copies of its paths."""
    op = torch.ops.aten.reflection_pad1d_backward.default

    def summed_rule(call: semipack.OpCall):
        msg = call["grad_output"]
        return call.wrap(call.run_regular(), call.semiring.sum(msg.parts, [0, 1], keepdim=True))

    with semipack.scoped_rules():
        semipack.register_rule(op, replace=True)(summed_rule)
        x = torch.randn(2, 3, requires_grad=True)
        with (
            pytest.raises(semipack.UnsupportedOpError) as info,
            semipack.extend(torch.nn.Module(), semipack.LogCount()),
        ):
            F.pad(x, (1, 1), mode="reflect").sum().backward()
    assert str(info.value) == (
        "the semiring rule for aten.reflection_pad1d_backward.default in the backward of "
        "ReflectionPad1DBackward0, created by module '<outside the model>': its rule returned a "
        "semiring state of shape (1, 1) for a message of shape (2, 3) (a defect in the rule). "
        "Fix that rule (see 'Adding an op rule' in the README)."
    )
    assert isinstance(info.value.__cause__, semipack.StateShapeError)


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        ("tensor", r"gave wrap\(\) a Tensor as the state, not a tuple of 1 tensor\(s\)"),
        ("none", r"its rule returned None \(a defect in the rule\)\. Fix that rule"),
        ("bad name", r"has no argument 'gradient'; its arguments: \['grad_output', 'self'"),
    ],
)
def test_a_wrong_rule_is_named_as_the_rules_defect(returns: str, message: str) -> None:
    """A rule that returns a bare tensor was told "a state of 4 components" (the tensor's
    length), one that returns None got PyTorch's "Expected a proper Tensor", a wrong argument
    name a bare KeyError; a rule's defect no longer asks to register a rule."""
    op = torch.ops.aten.reflection_pad1d_backward.default

    def wrong_rule(call: semipack.OpCall):
        if returns == "bad name":
            return call["gradient"]
        state = call["grad_output"].parts[0][..., 1:-1].contiguous()
        return None if returns == "none" else call.wrap(call.run_regular(), state)

    x = torch.randn(2, 4, requires_grad=True)
    error = KeyError if returns == "bad name" else semipack.UnsupportedOpError
    with semipack.scoped_rules():
        semipack.register_rule(op, replace=True)(wrong_rule)
        with pytest.raises(error, match=message), semipack.extend(None, semipack.MaxProd()):
            F.pad(x, (1, 1), mode="reflect").sum().backward()


def test_a_rule_whose_state_has_another_number_of_components_is_named() -> None:
    """Three components for MaxProd's one: the extra ones were dropped unseen and the readout
    came out of the first (a trial found it, with and without regular gradients)."""
    op = torch.ops.aten.reflection_pad1d_backward.default

    def tripled_rule(call: semipack.OpCall):
        state = call["grad_output"].parts[0][..., 1:-1].contiguous()  # shaped like the input
        return call.wrap(call.run_regular(), (state, state, state))

    x = torch.randn(2, 3, requires_grad=True)
    message = r"3 components, MaxProd\(.*\) has 1"
    with semipack.scoped_rules():
        semipack.register_rule(op, replace=True)(tripled_rule)
        for regular_grads in (True, False):
            with (
                pytest.raises(semipack.UnsupportedOpError, match=message),
                semipack.extend(None, semipack.MaxProd(), regular_grads=regular_grads),
            ):
                F.pad(x, (1, 1), mode="reflect").sum().backward()


def test_one_extend_object_entered_by_two_threads_closes_each_ones_own_block() -> None:
    """Thread A enters, B enters, A leaves, B runs its backward and leaves: B's block is still
    a semiring block after A's exit (each thread keeps its own open blocks), and torch.compile's
    process-wide stance is back to default after both (were each block to restore the stance it
    found on entry, B would restore A's "force_eager" and compiled code would stay eager)."""
    import threading

    model = small_model()
    x, _ = data()
    block = semipack.extend(model, semipack.Real())
    b_in, a_out = threading.Event(), threading.Event()
    seen = {}

    def a() -> None:
        with block:
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        with block:
            b_in.set()
            a_out.wait(10)
            w = nn.Linear(4, 2).double()
            w(x).sum().backward()
            seen["b"] = hasattr(w.weight, "semiring_grad")

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"b": True}
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_a_tensor_listed_twice_in_backward_inputs_is_one_input() -> None:
    """PyTorch accepts ``inputs=[w, w]``: the gradient is accumulated once."""
    model = small_model()
    x, y = data()
    F.cross_entropy(model(x), y).backward(inputs=[model[2].weight, model[2].weight])
    plain = model[2].weight.grad.clone()
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semipack.MaxProd()):
        F.cross_entropy(model(x), y).backward(inputs=[model[2].weight, model[2].weight])
    assert torch.equal(model[2].weight.grad, plain)
    once = model[2].weight.semiring_grad.clone()
    with semipack.extend(model, semipack.MaxProd()):
        F.cross_entropy(model(x), y).backward(inputs=[model[2].weight])
    assert torch.equal(model[2].weight.semiring_grad, once)


def test_a_checkpoint_with_kept_states_loads_and_copies() -> None:
    """``keep_state=True`` leaves each parameter's state as ``semiring_state``: ``torch.save``
    of the model wrote it, and loading it raised (``KeptState.__new__`` missing an argument),
    as did ``copy.deepcopy`` of the state. Both now give the same components and semiring."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with semipack.extend(model, semipack.Entropy(), keep_state=True):
        model(torch.randn(2, 3)).pow(2).sum().backward()
    state = model[0].weight.semiring_state
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for got in (loaded[0].weight.semiring_state, copy.deepcopy(state)):
        assert type(got) is type(state) and got.semiring_type is semipack.Entropy
        assert len(got) == len(state) == 2
        assert all(torch.equal(a, b) for a, b in zip(got, state, strict=True))


def test_a_second_backward_through_a_freed_graph_raises_as_in_pytorch() -> None:
    """Module extensions keep their state on the node's context, which the engine does not
    free: a second backward without ``retain_graph`` ran again (``.grad`` doubled) where
    PyTorch raises. It now raises PyTorch's own error, after a plain backward outside the
    block or a plain ``torch.autograd.grad`` inside it; with ``retain_graph=True`` both run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    with semipack.extend(model, semipack.MaxProd()):
        loss = model(x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    with semipack.extend(model, semipack.MaxProd()):
        loss = model(x).sum()
        torch.autograd.grad(loss, list(model.parameters()))
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semipack.MaxProd()):
        loss = model(x).sum()
        torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    plain.load_state_dict(model.state_dict())
    plain(x).sum().backward()
    assert all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(model.parameters(), plain.parameters(), strict=True)
    )


@pytest.mark.parametrize("per_sample", [False, True])
def test_a_parameter_unfrozen_or_frozen_inside_the_block_is_seen_at_each_pass(
    per_sample: bool,
) -> None:
    """The block asks the model for its parameters at each pass: a weight unfrozen inside the
    block (a fine-tuning schedule) gets its value, and its per-sample rows, equal to a block
    entered with it trainable; a later pass that does not reach it removes that value (it had
    kept the stale one); freezing it again inside the block removes it too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    with semipack.extend(model, semipack.MaxProd(), per_sample=per_sample):
        model(x).pow(2).sum().backward()
    want = model[0].weight.semiring_grad.clone()
    want_rows = model[0].weight.semiring_grad_batch.clone() if per_sample else None
    model[0].weight.requires_grad_(False)
    del model[0].weight.semiring_grad
    with semipack.extend(model, semipack.MaxProd(), per_sample=per_sample):
        model[0].weight.requires_grad_(True)
        model(x).pow(2).sum().backward()
        assert torch.equal(model[0].weight.semiring_grad, want)
        if per_sample:
            assert torch.equal(model[0].weight.semiring_grad_batch, want_rows)
        model[2](torch.tanh(model[0](x)).detach()).pow(2).sum().backward()
        assert not hasattr(model[0].weight, "semiring_grad")
        model(x).pow(2).sum().backward()
        model[0].weight.requires_grad_(False)
        model(x).pow(2).sum().backward()
        assert not hasattr(model[0].weight, "semiring_grad")


def test_no_garbage_collection_runs_inside_a_block() -> None:
    """A block's forward and backward keep thousands of small objects alive until the pass
    ends; collections meanwhile moved them to the oldest generation, and every ~75 passes of a
    MiniLM sentence Python walked the whole process's objects (0.2-0.6 s). The collector is
    paused in the block, even where the block allocates far past the young generation's
    threshold, and is as before after it (a user's ``gc.disable()`` stays)."""
    import gc

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    runs: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(seen)
    try:
        with semipack.extend(model, semipack.MaxProd()):  # its first entry imports modules
            model(x).sum().backward()
        gc.collect()  # the young generation starts empty: no collection before the block
        runs.clear()
        with semipack.extend(model, semipack.MaxProd()):
            held = [[i] for i in range(5 * gc.get_threshold()[0])]  # would trigger collections
            model(x).sum().backward()
            assert not gc.isenabled()
            inside = list(runs)
        assert inside == [] and len(held) > 0  # one runs right after the block: it is due
        assert gc.isenabled()
        gc.disable()
        with semipack.extend(model, semipack.MaxProd()):
            model(x).sum().backward()
        assert not gc.isenabled()  # the user's choice
    finally:
        gc.enable()
        gc.callbacks.remove(seen)
    assert model[0].weight.semiring_grad.shape == (4, 3)


class _RecomputedInBackward(torch.autograd.Function):
    """Reformer's reversible layers: the forward keeps no graph; the backward runs the layer
    again under grad mode and calls ``torch.autograd.backward`` itself, so the layer's
    parameters get their gradients from that inner engine run, not from this node's outputs."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.layer(x)
        torch.autograd.backward(out, grad)
        return x.grad, None


class _Reversible(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.first, self.inner = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.last, self.recompute = nn.Linear(4, 2), recompute

    def forward(self, x):
        h = self.first(x)
        h = _RecomputedInBackward.apply(h, self.inner) if self.recompute else self.inner(h)
        return self.last(h)


@pytest.mark.parametrize("semiring", [semipack.MaxProd(), semipack.Entropy(), semipack.Real()])
def test_a_backward_run_inside_a_custom_functions_backward_reaches_the_parameters(semiring):
    """Reformer: the inner run handed the inner layer's parameters their messages as ``.grad``
    (the pass "succeeded", the optimizer then met a message; trial 52). The parameters are
    watched whenever the graph holds a custom Function: the inner layer's values are those of
    the same model without the Function (the paths run through the recomputed ops), ``.grad``
    is a plain backward's."""
    torch.manual_seed(0)
    model = _Reversible(recompute=True).double()
    direct = copy.deepcopy(model)
    direct.recompute = False
    x = torch.randn(5, 3, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for net in (model, direct):
        with semipack.extend(net, semiring):
            net(x).pow(2).sum().backward()
    for p, q, want in zip(model.parameters(), direct.parameters(), plain, strict=True):
        assert type(p.grad) is torch.Tensor and torch.equal(p.grad, want)
        torch.testing.assert_close(p.semiring_grad, q.semiring_grad, rtol=1e-12, atol=0)


def test_a_custom_functions_inner_backward_beside_inputs_or_without_regular_gradients() -> None:
    """``backward(inputs=[x])``: PyTorch's inner run still gives the layer's parameters their
    ``.grad``; semipack's gave them messages. With ``regular_grads=False`` nothing can take
    the inner run's messages: the pass fails naming it, and no message is left in ``.grad``."""
    torch.manual_seed(0)
    model = _Reversible(recompute=True).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    model(x).pow(2).sum().backward(inputs=[x])
    plain = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    want_x = x.grad.clone()
    model.zero_grad(set_to_none=True)
    x.grad = None
    with semipack.extend(model, semipack.MaxProd()):
        model(x).pow(2).sum().backward(inputs=[x])
    assert torch.equal(x.grad, want_x)
    for p, want in zip(model.parameters(), plain, strict=True):
        assert (p.grad is None) == (want is None)
        if want is not None:
            assert type(p.grad) is torch.Tensor and torch.equal(p.grad, want)
            assert p.semiring_grad.shape == p.shape
    model.zero_grad(set_to_none=True)
    with (
        pytest.raises(semipack.MessageLostError, match="under regular_grads=False"),
        semipack.extend(model, semipack.MaxProd(), regular_grads=False),
    ):
        model(x).pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_an_inner_backward_reaching_a_tensor_outside_the_model_fails_the_pass() -> None:
    """A tensor outside the model's parameters that only a custom Function's inner run reaches
    got a message in its ``.grad`` (semipack.grad left them in the parameters too). The pass
    fails naming it and leaves ``.grad`` None; the Function's own leaf (its detached input,
    whose ``.grad`` it reads) is not one of them."""
    torch.manual_seed(0)
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    model = _Reversible(recompute=True).double()
    model.inner.append(_Scale(scale))
    x = torch.randn(5, 3, dtype=torch.float64)
    with (
        pytest.raises(semipack.MessageLostError, match=r"1 tensor\(s\) of shape \(\) received"),
        semipack.extend(model, semipack.MaxProd()),
    ):
        model(x).pow(2).sum().backward()
    assert scale.grad is None and all(p.grad is None for p in model.parameters())
    # the same tensor already holding a gradient: the engine adds the message into it in
    # place, which read as a missing rule for aten.add_ (trial 77); named as the same loss
    scale.grad = torch.tensor(0.5, dtype=torch.float64)
    held = scale.grad
    with (
        pytest.raises(
            semipack.MessageLostError,
            match=r"a tensor whose \.grad \(of shape \(\)\) "
            r"already held a gradient received a semiring message through the "
            r"engine's accumulation",
        ),
        semipack.extend(model, semipack.MaxProd()),
    ):
        model(x).pow(2).sum().backward()
    assert scale.grad is held and float(scale.grad) == 0.5
    scale.grad = None
    model = _Reversible(recompute=True).double()
    x.requires_grad_()
    with pytest.raises(semipack.MessageLostError, match="under regular_grads=False"):
        semipack.grad(model(x).pow(2).sum(), [x], semipack.MaxProd())
    assert all(p.grad is None for p in model.parameters())


class _Scale(nn.Module):
    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.scale = scale  # a tensor, not a parameter: outside the model's parameters

    def forward(self, h):
        return h * self.scale


def test_a_block_interrupted_inside_its_own_entry_is_cleared_by_the_next() -> None:
    """A KeyboardInterrupt between the entry of a block's contexts and the registration of
    their exits left semipack's function mode on torch's stack (every later block failed), the
    block marked open ("cannot be nested" for good), the garbage collector paused and the
    compile stance forced (trial 53). The next block clears them, says so, and is exact."""
    import gc

    from semipack.api import _blocks
    from semipack.transport.interception import SemiringMode
    from semipack.transport.passes import collector_paused, user_code_eager

    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(5, 3)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    # what an interrupted entry leaves: each context entered, none of their exits run (the
    # contexts kept alive, as a stored traceback keeps them: Jupyter's sys.last_traceback)
    left = [SemiringMode(semipack.MaxProd(), True), collector_paused(), user_code_eager()]
    for context in left:
        context.__enter__()
    _blocks.semiring = semipack.MaxProd()
    assert not gc.isenabled()
    with (
        pytest.warns(RuntimeWarning, match="an earlier extend block of this thread was interr"),
        semipack.extend(model, semipack.MaxProd()),
    ):
        model(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))
    assert model[0].weight.semiring_grad.shape == (4, 3)
    assert gc.isenabled() and torch.overrides._get_current_function_mode_stack() == []
    assert torch._dynamo.eval_frame._stance.stance == "default"
    with warnings.catch_warnings():  # nothing left to clear
        warnings.simplefilter("error")
        with semipack.extend(model, semipack.MaxProd()):
            model(x).sum().backward()
    del left  # their exits never run (the generators' are closed unentered)


def test_a_lock_left_held_by_an_interrupted_pass_is_released_by_the_next_block() -> None:
    """A KeyboardInterrupt between a ``with lock:`` body's end and the release left the
    readouts' lock held: every later pass waited on it forever (trial 59). With no pass
    running, the next block releases it, says so, and runs."""
    from semipack.transport import backward as bw

    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(5, 3)
    bw._READOUT_LOCK.__enter__()  # what the interrupted pass left: held by this thread
    with (
        pytest.warns(RuntimeWarning, match="an earlier extend block of this thread was interr"),
        semipack.extend(model, semipack.MaxProd()),
    ):
        model(x).sum().backward()
    assert not bw._READOUT_LOCK.locked()
    assert model[0].weight.semiring_grad.shape == (4, 3)


def test_another_threads_lock_is_never_taken_back() -> None:
    """The next block released the pass locks whenever no pass was counted as running, also
    one that another thread's pass had just taken: that pass's release then raised "release
    unlocked lock" (found by tests/test_threads.py under load). Only a lock this thread holds
    outside its passes is released."""
    from semipack.transport import backward as bw

    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with bw._HOOK_ORDER_LOCK:
            taken.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(10)
        assert not bw.release_stale_locks()
        assert bw._HOOK_ORDER_LOCK.locked()
    finally:
        done.set()
        holder.join()
    assert not bw._HOOK_ORDER_LOCK.locked()


class _FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises: a pass that fails halfway."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a backward that fails")


class _ReadoutFailing(semipack.LogSum):
    """LogSum whose readouts fail from the ``fail_at``-th on: a pass that fails after it
    wrote some leaves' values."""

    fail_at: int | None = None

    def readout(self, a):
        if self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at < 0:
                raise RuntimeError("a readout that fails")
        return super().readout(a)


@pytest.mark.parametrize(
    "where", ["in the engine", "among the pass's readouts", "among the added values' readouts"]
)
def test_accumulate_keeps_the_earlier_values_when_a_pass_fails(where: str) -> None:
    """A backward that fails inside an ``accumulate`` block, in the engine, among its own
    readouts or among those of the values it adds up, leaves the values of the block's earlier
    backwards, and a retry adds up as if it had not run."""
    model = small_model()
    x, y = data()
    sr = _ReadoutFailing()
    with semipack.extend(model, sr, accumulate=True):
        F.cross_entropy(model(x[:2]), y[:2], reduction="sum").backward()
        first = {n: p.semiring_grad.clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with pytest.raises(RuntimeError, match=r"a (backward|readout) that fails"):
            if where == "in the engine":
                out = model[2](_FailsInBackward.apply(torch.tanh(model[0](x[2:]))))
            else:  # four leaves: the pass reads out four values, then the four it adds up
                sr.fail_at, out = (2 if "pass's" in where else 5), model(x[2:])
            F.cross_entropy(out, y[2:], reduction="sum").backward()
        sr.fail_at = None
        for name, p in model.named_parameters():
            assert torch.equal(p.semiring_grad, first[name]), name
            if where != "among the added values' readouts":  # the engine's pass completed
                assert torch.equal(p.grad, grads[name]), name
        if where == "among the added values' readouts":
            for p, g in zip(model.parameters(), grads.values(), strict=True):
                p.grad = g.clone()  # the completed pass's gradient taken back, for the retry
        F.cross_entropy(model(x[2:]), y[2:], reduction="sum").backward()
        got = {n: p.semiring_grad for n, p in model.named_parameters()}
    whole = small_model()
    with semipack.extend(whole, sr):
        F.cross_entropy(whole(x), y, reduction="sum").backward()
    for name, p in whole.named_parameters():
        assert_readout_matches("log_sum", p.semiring_grad, got[name], name)


def test_accumulate_adds_up_a_retained_tensors_values_too() -> None:
    """A ``retain_grad()`` tensor's value adds up like a parameter's (trial 116: it kept the
    last backward's while its ``.grad`` added up), also when it is an ``inputs=`` entry."""
    lin = small_model()[0]
    x = torch.randn(2, 4, dtype=torch.float64)
    for inputs in (None, "retained"):
        with semipack.extend(lin, semipack.Real(), accumulate=True):
            h = lin(x)
            h.retain_grad()
            loss = h.sum()
            chosen = [h, lin.bias] if inputs else None
            loss.backward(retain_graph=True, inputs=chosen)
            (3 * loss).backward(inputs=chosen)
        assert torch.equal(h.semiring_grad, torch.full_like(h, 4.0))
        assert torch.equal(h.grad, torch.full_like(h, 4.0))
        assert torch.equal(lin.bias.semiring_grad, torch.full_like(lin.bias, 8.0))
        lin.zero_grad()


def test_accumulate_starts_afresh_where_a_value_was_removed() -> None:
    """Inside an ``accumulate`` block, removing a tensor's value (``del p.semiring_grad``, as
    ``zero_grad()`` empties ``.grad``) starts its sum again (trial 116: the earlier passes
    came back); the others keep adding up."""
    lin = small_model()[0]
    x = torch.randn(2, 4, dtype=torch.float64)
    with semipack.extend(lin, semipack.Real(), accumulate=True):
        lin(x).sum().backward()
        del lin.weight.semiring_grad
        (3 * lin(x)).sum().backward()
    assert torch.equal(lin.bias.semiring_grad, torch.full_like(lin.bias, 8.0))
    want = 3 * x.sum(0).expand_as(lin.weight)  # the second backward's alone
    torch.testing.assert_close(lin.weight.semiring_grad, want, rtol=1e-14, atol=1e-14)
