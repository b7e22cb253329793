"""A new extension written with the template: a handful of lines, the same values as the
generic path, a plain ``.grad`` bitwise, and a registration that ends with its block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import graph_nodes
from torch import Tensor, nn
from torch.overrides import handle_torch_function, has_torch_function

import semipack
from semipack.extensions import FUNCTION_EXTENSIONS, BackwardCall, ExtensionFunction, extending
from semipack.extensions.linear import linear_messages


def diag_scale(x: Tensor, w: Tensor) -> Tensor:
    """y[..., i] = x[..., i] * w[i]; open to torch function modes, so ``extend`` can route it."""
    if has_torch_function((x, w)):
        return handle_torch_function(diag_scale, (x, w), x, w)
    return x * w


# --- the whole extension ------------------------------------------------------------------------


class DiagScaleFunction(ExtensionFunction):
    """(x [..., n], w [n]) -> x * w."""

    reads = (0, 1)

    @staticmethod
    def messages(call: BackwardCall):
        sr, (m,), (x, w) = call.semiring, call.incoming, call.inputs
        dtype = sr.state_dtype(x.dtype)
        batch = list(range(x.dim() - 1))
        return sr.scale(m, w.to(dtype)), sr.sum(sr.scale(m, x.to(dtype)), batch)

    @staticmethod
    def sites(out: Tensor):
        return (("output", ("batch", "feature")),)


def diag_scale_extension(x: Tensor, w: Tensor) -> Tensor:
    return DiagScaleFunction.run(diag_scale, [x, w])


# ------------------------------------------------------------------------------------------------


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.out = nn.Linear(4, 3, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(diag_scale(x, self.gain).tanh())


SEMIRINGS = [semipack.Real, semipack.MaxProd, semipack.LogSum, semipack.Entropy]


def _run(semiring: semipack.Semiring | None, extensions: bool):
    """(semiring values, .grad, names of the graph's nodes) of one backward, by leaf name;
    ``semiring=None`` is a plain backward."""
    torch.manual_seed(0)
    model, x = Toy(), torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(5, 3, dtype=torch.float64)
    leaves = {"x": x, **dict(model.named_parameters())}
    if semiring is None:
        loss = (model(x) * weights).sum()
        loss.backward()
        return None, {n: t.grad for n, t in leaves.items()}, {loss.grad_fn.name()}
    with (
        extending(diag_scale_extension, diag_scale),
        semipack.extend(model, semiring, extensions=extensions),
    ):
        loss = (model(x) * weights).sum()
        names = {n.name() for n in graph_nodes(loss)}
        loss.backward()
    values = {n: t.semiring_grad for n, t in leaves.items()}
    return values, {n: t.grad for n, t in leaves.items()}, names


def _assert_close(a, b, name: str) -> None:
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _assert_close(x, y, name)
    else:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True, msg=name)


@pytest.mark.parametrize("semiring", SEMIRINGS, ids=[s.__name__ for s in SEMIRINGS])
def test_new_extension_equals_the_generic_path(semiring) -> None:
    fast, fast_grads, fast_nodes = _run(semiring(), extensions=True)
    slow, slow_grads, slow_nodes = _run(semiring(), extensions=False)
    _, plain, _ = _run(None, extensions=False)
    assert "DiagScaleFunctionBackward" in fast_nodes
    assert "DiagScaleFunctionBackward" not in slow_nodes
    for name in plain:
        _assert_close(fast[name], slow[name], name)
        assert torch.equal(fast_grads[name], plain[name]), name
        assert torch.equal(slow_grads[name], plain[name]), name
        if semiring is semipack.Real:
            _assert_close(fast[name], plain[name], name)


def test_the_new_extension_names_its_site_and_frees_its_context() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    with extending(diag_scale_extension, diag_scale), semipack.extend(None, semipack.LogSum()):
        y = diag_scale(x, w)
        node = y.grad_fn
        assert node.name() == "DiagScaleFunctionBackward"
        (site,) = node.metadata["semipack.sites"]
        assert (site.tensor, site.dims) == ("output", ("batch", "feature"))
        y.sum().backward()
    assert vars(node) == {}
    torch.testing.assert_close(w.semiring_grad, x.detach().abs().log().logsumexp(0))


def test_a_plain_call_stays_plain() -> None:
    """No graph wanted: the template runs the plain function, no Function node."""
    x, w = torch.randn(2, 3), torch.randn(3)
    with extending(diag_scale_extension, diag_scale), semipack.extend(None, semipack.MaxProd()):
        assert diag_scale(x, w).grad_fn is None
        assert torch.equal(diag_scale(x, w), x * w)


class TinyLinearFunction(ExtensionFunction):
    """A second extension for F.linear in a few lines, standing in for the shipped one."""

    reads = (0, 1)

    @staticmethod
    def messages(call: BackwardCall):
        (x, weight, _), (m,) = call.inputs, call.incoming
        return linear_messages(call.semiring, m, x, weight, *call.needs)


def test_registration_is_scoped_and_restores_the_previous_extension() -> None:
    shipped = FUNCTION_EXTENSIONS[F.linear]
    torch.manual_seed(0)
    model = nn.Linear(3, 2, dtype=torch.float64)
    data = torch.randn(4, 3, dtype=torch.float64)

    def tiny(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return TinyLinearFunction.run(F.linear, [input, weight, bias])

    values = []
    for handler in (tiny, shipped):
        x = data.clone().requires_grad_()
        with extending(handler, F.linear), semipack.extend(model, semipack.LogSum()):
            out = model(x)
            expected = "TinyLinearFunctionBackward" if handler is tiny else "LinearFunctionBackward"
            assert out.grad_fn.name() == expected
            out.sum().backward()
        values.append((x.semiring_grad, model.weight.semiring_grad, model.bias.semiring_grad))
        assert FUNCTION_EXTENSIONS[F.linear] is shipped
    for a, b in zip(*values, strict=True):
        assert torch.equal(a, b)
    with extending(diag_scale_extension, diag_scale):
        assert FUNCTION_EXTENSIONS[diag_scale] is diag_scale_extension
    assert diag_scale not in FUNCTION_EXTENSIONS


class OutOfGraphFunction(ExtensionFunction):
    """A faulty extension: its messages give ``w`` a path that its call (``x * 2``, ``w``
    unused) does not have."""

    @staticmethod
    def messages(call: BackwardCall):
        sr, (m,), (x, _) = call.semiring, call.incoming, call.inputs
        return sr.scale(m, torch.full_like(x, 2.0)), sr.sum(m, list(range(x.dim() - 1)))


def test_messages_where_the_plain_backward_has_no_gradient_raise() -> None:
    """An input the call's plain backward does not reach gets no message (as in a plain
    backward, ``.grad`` stays None); if the extension's messages claim a path to it anyway,
    the pass raises instead of dropping or keeping that path silently."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with semipack.extend(None, semipack.MaxProd()):
        out = OutOfGraphFunction.run(lambda a, b: a * 2, [x * 1, w * 1])
        with pytest.raises(semipack.MessageLostError, match="OutOfGraph: the semiring messages"):
            out.sum().backward()
