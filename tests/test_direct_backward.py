"""The regular gradient of an extension's inner graph by calling its nodes (``direct_backward``)
is the engine's, bit for bit, and the engine still runs wherever the two could differ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import semipack
from semipack.extensions import base, direct_backward
from semipack.extensions.direct_backward import direct_grads


def _leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator).requires_grad_() for s in shapes]


def _calls() -> dict[str, tuple]:
    """Single torch ops as the extensions record them: (function, leaves)."""
    return {
        "conv2d": (
            lambda x, w, b: F.conv2d(x, w, b, padding=1, stride=2),
            _leaves((2, 3, 9, 9), (4, 3, 3, 3), (4,)),
        ),
        "conv2d, grouped, no bias": (
            lambda x, w: F.conv2d(x, w, None, groups=3),
            _leaves((2, 6, 5, 5), (6, 2, 3, 3)),
        ),
        "linear, 3-d input": (F.linear, _leaves((2, 5, 7), (3, 7), (3,))),
        "linear, no bias": (F.linear, _leaves((4, 7), (3, 7))),
        "layer norm": (
            lambda x, w, b: torch.native_layer_norm(x, (6,), w, b, 1e-5),
            _leaves((2, 4, 6), (6,), (6,)),
        ),
        "embedding": (
            lambda w: F.embedding(torch.tensor([[1, 3, 1], [0, 2, 4]]), w, 1),
            _leaves((5, 4)),
        ),
        "matmul, batched": (torch.matmul, _leaves((2, 3, 5), (5, 4))),
        "addmm": (torch.addmm, _leaves((4,), (3, 5), (5, 4))),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_direct_gradients_are_the_engines_bits(name: str) -> None:
    fn, leaves = _calls()[name]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    edge = torch.autograd.graph.get_gradient_edge(out)
    expected = torch.autograd.grad([edge], leaves, [grad], retain_graph=True, allow_unused=True)
    found = direct_grads(edge, grad, leaves)
    assert found is not None
    for e, f in zip(expected, found, strict=True):
        assert f is not None and e is not None
        assert f.dtype == e.dtype and f.shape == e.shape
        assert torch.equal(f, e)


def test_a_custom_function_in_the_graph_takes_the_engine() -> None:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    (x,) = _leaves((3, 4))
    out = Twice.apply(x).sin()
    edge = torch.autograd.graph.get_gradient_edge(out)
    assert direct_grads(edge, torch.ones(3, 4), [x]) is None


def test_a_node_reached_twice_takes_the_engine() -> None:
    """``h = x.exp(); h * h``: the engine adds both gradients of ``h`` before ``ExpBackward``
    runs; calling it once per edge would differ, so the direct path refuses."""
    (x,) = _leaves((3, 4))
    h = x.exp()
    out = h * h
    edge = torch.autograd.graph.get_gradient_edge(out)
    assert direct_grads(edge, torch.ones(3, 4), [x]) is None


def test_a_leaf_reached_twice_or_outside_the_inputs_takes_the_engine() -> None:
    x, w = _leaves((3, 4), (4, 4))
    out = x @ x.T  # x reached twice
    edge = torch.autograd.graph.get_gradient_edge(out)
    assert direct_grads(edge, torch.ones(3, 3), [x]) is None
    out = x @ w  # w is no input given
    edge = torch.autograd.graph.get_gradient_edge(out)
    assert direct_grads(edge, torch.ones(3, 4), [x]) is None


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_anomaly_mode_takes_the_engine() -> None:
    x, w = _leaves((3, 4), (5, 4))
    out = F.linear(x, w)
    edge = torch.autograd.graph.get_gradient_edge(out)
    with torch.autograd.detect_anomaly(check_nan=True):
        assert direct_grads(edge, torch.ones(3, 5), [x, w]) is None
    assert direct_grads(edge, torch.ones(3, 5), [x, w]) is not None


def test_a_gradient_the_engine_would_cast_takes_the_engine() -> None:
    """A float64 leaf cast to float32: ``ToCopyBackward`` gives float64, as the leaf is. A
    gradient of another dtype, or of a shape the engine could not reduce to its input's, is
    never passed on; one broadcast over leading dims is summed as the engine sums it."""
    (x,) = _leaves((3, 4))
    x64 = x.detach().double().requires_grad_()
    out = x64.float().sin()
    edge = torch.autograd.graph.get_gradient_edge(out)
    found = direct_grads(edge, torch.ones(3, 4), [x64])
    expected = torch.autograd.grad([edge], [x64], [torch.ones(3, 4)], retain_graph=True)
    assert found is not None and found[0].dtype == torch.float64
    assert torch.equal(found[0], expected[0])
    passed_on = direct_backward._passed_on
    assert passed_on(torch.ones(3, 4), (3, 4), torch.float64, x.device) is None
    assert passed_on(torch.ones(3, 4), (4, 3), torch.float32, x.device) is None
    summed = passed_on(torch.ones(3, 4), (4,), torch.float32, x.device)
    assert torch.equal(summed, torch.full((4,), 3.0))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(ids).transpose(1, 2)).transpose(1, 2).relu()
        return self.head(self.norm(h)).mean(1)


@pytest.fixture
def direct_answers(monkeypatch) -> list[bool]:
    """Whether each call of the direct path inside ``extend`` answered (True) or declined."""
    answers: list[bool] = []

    def counted(*args):
        found = direct_grads(*args)
        answers.append(found is not None)
        return found

    monkeypatch.setattr(base, "direct_grads", counted)
    return answers


@pytest.mark.parametrize("semiring", [semipack.MaxProd(), semipack.Entropy(), semipack.LogSum()])
def test_extensions_take_the_direct_path_and_keep_plain_grads(semiring, direct_answers) -> None:
    """Inside ``extend`` every extension node of this model takes its regular gradient from
    the direct path (counted), and ``.grad`` equals a plain backward's bit for bit."""
    torch.manual_seed(0)
    model = _Net()
    ids = torch.randint(0, 11, (2, 6))
    target = torch.tensor([0, 2])
    F.cross_entropy(model(ids), target).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with semipack.extend(model, semiring):
        F.cross_entropy(model(ids), target).backward()
    assert direct_answers == [True] * 4  # head, norm, conv, embedding
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain[n]), n
        assert p.semiring_grad is not None


@pytest.mark.parametrize("how", ["inputs", "autograd.grad"])
def test_a_backward_for_some_leaves_takes_the_engine(how: str, direct_answers) -> None:
    """``backward(inputs=...)`` and ``torch.autograd.grad`` run a graph task that lists the
    nodes to run: PyTorch's nodes called directly would compute no gradient for the inner
    graph's leaves. The direct path sees that (its probe) and declines; values stay plain.
    (``torch.autograd.grad`` inside ``extend`` is a plain backward: the engine's path.)"""
    torch.manual_seed(0)
    model = _Net()
    ids = torch.randint(0, 11, (2, 6))
    target = torch.tensor([0, 2])
    weight = model.head.weight
    want = torch.autograd.grad(F.cross_entropy(model(ids), target), [weight])[0]
    with semipack.extend(model, semipack.MaxProd()):
        loss = F.cross_entropy(model(ids), target)
        if how == "inputs":
            loss.backward(inputs=[weight])
            got = weight.grad
        else:
            got = torch.autograd.grad(loss, [weight])[0]
    assert not any(direct_answers)
    if how == "inputs":  # a semiring pass, whose extension nodes asked and were declined
        assert direct_answers
    assert torch.equal(got, want)


def test_direct_gradients_record_no_graph_even_with_grad_mode_on() -> None:
    """The engine runs a node without ``create_graph`` in no-grad mode: so do the direct
    calls, whatever mode the caller is in (the gradients hang off no graph)."""
    x, w, b = _leaves((2, 5), (3, 5), (3,))
    out = F.linear(x, w, b)
    edge = torch.autograd.graph.get_gradient_edge(out)
    with torch.enable_grad():
        found = direct_grads(edge, torch.ones(2, 3), [x, w, b])
    assert found is not None
    assert all(g is not None and g.grad_fn is None and not g.requires_grad for g in found)


def test_the_probe_runs_once_per_backward_and_again_for_the_next(direct_answers) -> None:
    """The probe's answer holds for a graph task's whole life: one probe per backward, not one
    per extension node; the next backward (here one for some leaves only) asks again."""
    torch.manual_seed(0)
    model = _Net()
    ids = torch.randint(0, 11, (2, 6))
    target = torch.tensor([0, 2])
    direct_backward._filtered()  # the probe graph exists
    leaf, node = direct_backward._PROBE[0]
    probes: list[int] = []

    def counted(grad):
        probes.append(1)
        return node(grad)

    direct_backward._PROBE[0] = (leaf, counted)
    try:
        with semipack.extend(model, semipack.MaxProd()):
            F.cross_entropy(model(ids), target).backward()
        assert len(probes) == 1 and direct_answers == [True] * 4
        with semipack.extend(model, semipack.MaxProd()):
            F.cross_entropy(model(ids), target).backward(inputs=[model.head.weight])
        assert len(probes) == 2 and direct_answers[4:] and not any(direct_answers[4:])
    finally:
        direct_backward._PROBE[0] = (leaf, node)
