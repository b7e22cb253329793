"""An activation writes its new regular gradient into the incoming one's memory when nothing
else holds that message or tensor (``messages.donation``). Each test holds the incoming
gradient another way (a second consumer, a hook, ``retain_grad``, the caller's own gradient, a
broadcast) and checks every value against PyTorch's autograd and against a pass that donates
nothing; the first checks that the write happens at all where nothing else holds it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import semipack
from semipack.kernels import reuse
from semipack.messages import donation
from semipack.messages.message import OpCall
from semipack.rules import pointwise

SEMIRINGS: dict[str, Callable[[], semipack.Semiring]] = {
    "MaxProd": semipack.MaxProd,
    "LogSum": semipack.LogSum,
    "Entropy": semipack.Entropy,
    "Product": lambda: semipack.Product(semipack.MaxProd(), semipack.Entropy()),
}


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": torch.relu,
    "silu": F.silu,
    "relu6": F.relu6,
}


class _Net(nn.Module):
    """Linear, an activation, Linear on [2, 3, 5] (or [2, 3, 64, 5] into 128 units: large
    enough for the compiled kernels): the activation's incoming gradient is the second linear
    layer's reshaped matrix product (a view whose base nothing else holds)."""

    def __init__(self, activation: str = "gelu", width: int = 7) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, width), nn.Linear(width, 4)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.activation(self.a(x)))


def _written_into(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each ``run_regular_donated`` from now on: whether its result is in the memory of
    the incoming regular gradient; and for each ReLU cut of a state, whether it wrote into the
    incoming state (same list, before the call's regular entry)."""
    seen: list[bool] = []
    original = OpCall.run_regular_donated

    def spy(self: OpCall):
        incoming = self.args[0].regular_grad
        out = original(self)
        if incoming is not None:  # a Product's later factors carry no regular gradient
            seen.append(out.data_ptr() == incoming.data_ptr())
        return out

    cut = pointwise._ReluCut.__call__

    def cut_spy(self, part, zero, in_place=False):
        out = cut(self, part, zero, in_place)
        seen.append(out.data_ptr() == part.data_ptr())
        return out

    monkeypatch.setattr(OpCall, "run_regular_donated", spy)
    monkeypatch.setattr(pointwise._ReluCut, "__call__", cut_spy)
    return seen


def _pass(
    model: nn.Module,
    x: torch.Tensor,
    sr: semipack.Semiring | None,
    loss: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """Every leaf's gradient, then (with a semiring) every leaf's semiring gradient."""
    leaves = [*model.parameters(), x]
    for t in leaves:
        t.grad = None
    if sr is None:
        loss(model(x)).backward()
        return [t.grad.clone() for t in leaves]
    with semipack.extend(model, sr):
        loss(model(x)).backward()
    values = [t.grad.clone() for t in leaves]
    for t in leaves:
        readout = t.semiring_grad
        values.extend(r.clone() for r in (readout if isinstance(readout, tuple) else (readout,)))
    return values


def _assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Equal bits, NaN (an Entropy readout where no path reaches) matching NaN."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e) or (
            torch.equal(g.nan_to_num(), e.nan_to_num()) and bool((g.isnan() == e.isnan()).all())
        )


def _undonated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(donation, "_ALONE", {})


def _check(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    model: nn.Module,
    loss: Callable[[torch.Tensor], torch.Tensor],
    shape: tuple[int, ...] = (2, 3, 5),
) -> list[bool]:
    """Run ``loss(model(x))`` plain, with a semiring, and with a semiring donating nothing:
    the regular gradients must equal autograd's and every value the undonated pass's. Returns
    whether each activation wrote into its incoming tensors (``_written_into``)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    plain = _pass(model, x, None, loss)
    with monkeypatch.context() as m:
        _undonated(m)
        reference = _pass(model, x, SEMIRINGS[name](), loss)
    written = _written_into(monkeypatch)
    got = _pass(model, x, SEMIRINGS[name](), loss)
    _assert_same(got[: len(plain)], plain)
    _assert_same(got, reference)
    return written


def _components(name: str) -> int:
    return len(SEMIRINGS[name]().components)


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("name", SEMIRINGS)
def test_an_activation_writes_its_results_into_the_incoming_message(
    monkeypatch: pytest.MonkeyPatch, name: str, activation: str, size: str
) -> None:
    """Where nothing else holds the message: GELU its regular gradient, ReLU every tensor
    (a large state takes the compiled in-place cut)."""
    assert set(donation._ALONE) == set(donation._NODES)  # every node calibrated on this PyTorch
    shape = (2, 3, 5) if size == "small" else (2, 3, 64, 5)
    width = 7 if size == "small" else 128  # 2 x 3 x 64 x 128 = 49k entries
    weights = torch.randn(*shape[:-1], 4, generator=torch.Generator().manual_seed(2))
    model = _Net(activation, width)
    written = _check(monkeypatch, name, model, lambda y: (y * weights).sum(), shape)
    states = _components(name) if activation == "relu" else 0
    assert written == [True] * (states + 1)


class _TwoConsumers(nn.Module):
    """Two activations of two linear maps, added: the addition hands one gradient object to
    both activations' nodes."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)
        self.first, self.second = ACTIVATIONS[first], ACTIVATIONS[second]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(self.a(x)) + self.second(self.b(x))


@pytest.mark.parametrize("pair", [("gelu", "silu"), ("relu", "relu6"), ("relu", "gelu")])
@pytest.mark.parametrize("name", SEMIRINGS)
def test_a_gradient_handed_to_two_consumers_is_written_into_by_the_last_only(
    monkeypatch: pytest.MonkeyPatch, name: str, pair: tuple[str, str]
) -> None:
    weights = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2))
    model = _TwoConsumers(*pair)
    written = _check(monkeypatch, name, model, lambda y: (y * weights).sum())
    # the second runs once the first has let the message go; the later branch's node first
    states = [_components(name) if a == "relu" else 0 for a in reversed(pair)]
    assert written == [False] * (states[0] + 1) + [True] * (states[1] + 1)


class _Held(nn.Module):
    """Linear, then GELU, whose input gradient ``hold`` keeps a way (and records its value
    when the hook ran); a second linear layer gives the GELU a fresh incoming gradient."""

    def __init__(self, hold: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.hold = nn.Linear(5, 7), nn.Linear(7, 4), hold
        self.kept: list[torch.Tensor] = []
        self.at_hook: list[torch.Tensor] = []
        self.retained: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        if self.hold == "hook":

            def keep(g: torch.Tensor) -> None:
                self.kept.append(g)
                self.at_hook.append(g.clone())

            h.register_hook(keep)
        elif self.hold == "retain_grad":
            h.retain_grad()
            self.retained = h
        return self.b(h)


@pytest.mark.parametrize("hold", ["hook", "retain_grad"])
@pytest.mark.parametrize("name", ["MaxProd", "Product"])
def test_a_gradient_a_hook_or_retain_grad_holds_is_not_written_into(
    monkeypatch: pytest.MonkeyPatch, name: str, hold: str
) -> None:
    weights = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2))
    model = _Held(hold)
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    loss = lambda y: (y * weights).sum()  # noqa: E731
    _pass(model, x, None, loss)
    plain_h_grad = model.retained.grad.clone() if hold == "retain_grad" else None
    written = _written_into(monkeypatch)
    _pass(model, x, SEMIRINGS[name](), loss)
    if hold == "hook":  # the hook holds the very tensor
        assert written == [False]
        (kept,), (at_hook,) = model.kept[-1:], model.at_hook[-1:]
        assert torch.equal(kept, at_hook)
    else:  # retain_grad keeps a copy (PyTorch's hook clones the gradient it retains)
        assert type(model.retained.grad) is torch.Tensor
        assert torch.equal(model.retained.grad, plain_h_grad)


@pytest.mark.parametrize("name", ["MaxProd", "Entropy"])
def test_the_callers_own_gradient_is_not_written_into(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 7)
    x = torch.randn(3, 5)
    gradient = torch.randn(3, 7)
    before = gradient.clone()
    written = _written_into(monkeypatch)
    with semipack.extend(layer, SEMIRINGS[name]()):
        F.gelu(layer(x)).backward(gradient)
    assert written == [False]
    assert torch.equal(gradient, before)


@pytest.mark.parametrize("name", ["MaxProd", "LogSum"])
def test_a_broadcast_gradient_is_not_written_into(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A sum's gradient reaches the GELU as its scalar seed expanded (stride 0): no memory of
    its own per entry, so an ``out=`` write would fail."""
    written = _check(monkeypatch, name, nn.Sequential(nn.Linear(5, 4), nn.GELU()), torch.sum)
    assert written == [False]


@pytest.mark.parametrize("node", sorted(donation._NODES))
def test_the_calibration_refuses_counts_that_do_not_tell_one_holder_from_two(
    monkeypatch: pytest.MonkeyPatch, node: str
) -> None:
    forward, op = donation._NODES[node]
    assert donation._calibrate(node, forward, op) == donation._ALONE[node]
    monkeypatch.setattr(donation, "_holders", lambda message: (1, 1))
    assert donation._calibrate(node, forward, op) is None


def test_a_view_counts_as_alone_only_while_nothing_else_holds_its_base() -> None:
    class Owner:
        pass

    owner = Owner()
    owner.value = torch.zeros(6).view(2, 3)
    assert reuse.alone_in_attribute(owner, "value")
    base = owner.value._base
    assert not reuse.alone_in_attribute(owner, "value")
    del base
    assert reuse.alone_in_attribute(owner, "value")
    other_view = owner.value._base.view(3, 2)
    assert not reuse.alone_in_attribute(owner, "value")
    del other_view
    # PyTorch's engine adds into a gradient in place only when no view shares its memory:
    # the layout decision that follows it counts a view as held (trial 97)
    owner.regular_grad = owner.value
    del owner.value
    assert reuse.alone_in_attribute(owner, "regular_grad")
    assert not reuse.held_only_by(owner, "regular_grad")
    owner.value = owner.regular_grad
    del owner.regular_grad
    owner.value = torch.zeros(6)
    storage = owner.value.untyped_storage()
    assert not reuse.alone_in_attribute(owner, "value")
    del storage
    assert reuse.alone_in_attribute(owner, "value")


def test_only_tensors_with_memory_of_their_own_per_entry_are_donated() -> None:
    assert donation._dense(torch.zeros(2, 3))
    assert donation._dense(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert not donation._dense(torch.zeros(()).expand(3))
    assert not donation._dense(torch.zeros(3, 4).t())


def _plain_and_semiring_grads(
    model: nn.Module, run: Callable[[], torch.Tensor], sr: semipack.Semiring
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    run().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, sr):
        run().backward()
    return plain, [p.grad.clone() for p in model.parameters()]


def test_an_op_whose_result_follows_its_input_layout_keeps_the_plain_bits() -> None:
    """LeakyReLU lays its gradient out like its input: on a transposed input the plain result
    is transposed, and the bias's sum below adds in that order (trial 96)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 512)
    x, c = torch.randn(256, 16), torch.randn(512, 256)
    plain, got = _plain_and_semiring_grads(
        layer, lambda: (F.leaky_relu(layer(x).t()) * c).sum(), semipack.MaxProd()
    )
    for p, g in zip(plain, got, strict=True):
        assert torch.equal(p, g)


@pytest.mark.parametrize("name", ["MaxProd", "Product"])
def test_a_channels_last_map_of_one_by_one_keeps_the_plain_bits(name: str) -> None:
    """On [N, C, 1, 1] a channels-last gradient (C, 1, C, C) passes ``is_contiguous`` while
    Hardswish's input is (C, 1, 1, 1), whose layout its gradient takes (MobileNetV3's squeeze
    blocks; trial 96)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 576, 1),
        nn.BatchNorm2d(576),
        nn.Hardswish(),
        nn.Conv2d(576, 576, 5, padding=2, groups=576),
        nn.Flatten(),
    )
    model = model.eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 16, 1, 1).to(memory_format=torch.channels_last)
    w = torch.randn(2, 576)
    plain, got = _plain_and_semiring_grads(model, lambda: (model(x) * w).sum(), SEMIRINGS[name]())
    for p, g in zip(plain, got, strict=True):
        assert torch.equal(p, g)


@pytest.mark.parametrize("wrap", ["from_numpy", "frombuffer"])
def test_memory_from_outside_pytorch_is_never_written_into(wrap: str) -> None:
    """A hook may hand back a gradient on a numpy array's or a buffer's memory: no other
    tensor holds that storage, but its maker does (trial 96)."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(2, 3, 5)
    memory = np.full((2, 3, 7), 0.5, dtype=np.float32)
    buffer = bytearray(memory.tobytes())

    def outside(g: torch.Tensor) -> torch.Tensor:
        if wrap == "from_numpy":
            return torch.from_numpy(memory)
        return torch.frombuffer(buffer, dtype=torch.float32).view(2, 3, 7)

    with semipack.extend(model, semipack.MaxProd()):
        h = model.a(x)
        h.register_hook(outside)  # the incoming gradient of nothing: h's own, below GELU
        g = F.gelu(h)
        g.register_hook(outside)  # GELU's incoming gradient
        model.b(g).sum().backward()
    assert (memory == 0.5).all()
    assert (np.frombuffer(buffer, dtype=np.float32) == 0.5).all()


def test_a_tracer_active_while_calibrating_does_not_lower_the_bar() -> None:
    """A trace function that reads each frame's locals holds one more reference to every
    local: counts calibrated under it would take a message one Python object holds for one
    nothing holds, once the tracer is gone (trial 96)."""

    def tracer(frame, event, arg):
        frame.f_locals  # noqa: B018 - what debuggers and snooping tools do
        return tracer

    forward, op = donation._NODES["GeluBackward0"]
    sys.settrace(tracer)
    try:
        with reuse.calibrating():
            shielded = donation._calibrate("GeluBackward0", forward, op)
            baselines = reuse._baseline_refs()
        exposed = donation._calibrate("GeluBackward0", forward, op)
    finally:
        sys.settrace(None)
    assert shielded == donation._ALONE["GeluBackward0"]
    assert baselines == (reuse._ALONE_AS_ATTRIBUTE, reuse._ALONE_AS_ITEM, reuse._ALONE_STORAGE)
    assert exposed != shielded  # the tracer does change the counts it is shielded from


@pytest.mark.parametrize(
    "mode", ["torch.no_grad()", "torch.inference_mode()", "torch.autograd.detect_anomaly()"]
)
def test_semipack_imports_and_calibrates_under_a_gradient_mode(mode: str) -> None:
    code = (
        f"import torch\nwith {mode}:\n    import semipack\n"
        "from semipack.messages import donation\n"
        "assert set(donation._ALONE) == set(donation._NODES), donation._ALONE\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
