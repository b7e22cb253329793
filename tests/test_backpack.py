"""BackPACK's extensions in the same backward as a semiring pass (README "BackPACK in the same
backward").

BackPACK runs its extensions in full module backward hooks, on the model's modules and on the
loss module, reading the inputs and outputs it saved in the forward and the hooks' gradients;
second-order extensions carry their own quantities from module to module in those hooks, not
through autograd. Semiring passes hand such hooks the regular gradient (``transport.hooks``), so
one backward gives ``.grad``, BackPACK's quantities and ``.semiring_grad``. Each test compares
the combined backward with separate runs, exactly: BackPACK alone on the same extended model,
and semipack alone on the plain model (no hooks at all), with the same seed for the Monte-Carlo
extensions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import backpack
import pytest
import torch
from backpack import extensions as bpe
from helpers import SEMIRINGS
from torch import Tensor, nn

import semipack

#: The seed each run sets before its forward and backward (DiagGGNMC and KFAC sample).
SEED = 7


class Residual(nn.Module):
    """A ResNet-like block: ``h + fc2(relu(fc1(h)))`` between two linear layers. Its residual
    add is a function call, which BackPACK needs converted (``use_converter=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(5, 6)
        self.fc1 = nn.Linear(6, 6)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        """[batch, 5] -> [batch, 3]."""
        h = self.fc0(x)
        return self.head(h + self.fc2(self.act(self.fc1(h))))


def mlp() -> nn.Module:
    """[batch, 5] -> [batch, 3]."""
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 6), nn.Sigmoid(), nn.Linear(6, 3))


def cnn() -> nn.Module:
    """[batch, 2, 8, 8] -> [batch, 3]: conv, max pool, conv, average pool, flatten, linear."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


#: name -> (model builder, input shape, whether BackPACK must convert it)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], bool]] = {
    "mlp": (mlp, (4, 5), False),
    "cnn": (cnn, (4, 2, 8, 8), False),
    "residual": (Residual, (4, 5), True),
}

EXTENSIONS: dict[str, Callable[[], Any]] = {
    "BatchGrad": bpe.BatchGrad,
    "Variance": bpe.Variance,
    "SumGradSquared": bpe.SumGradSquared,
    "BatchL2Grad": bpe.BatchL2Grad,
    "DiagGGNExact": bpe.DiagGGNExact,
    "DiagGGNMC": bpe.DiagGGNMC,
    "DiagHessian": bpe.DiagHessian,
    "KFAC": bpe.KFAC,
    "KFLR": bpe.KFLR,
    "KFRA": bpe.KFRA,
}

#: (model, extension) pairs BackPACK itself does not support (no rule for the residual add's
#: module): the combined backward raises BackPACK's own error.
UNSUPPORTED = {("residual", "DiagHessian"), ("residual", "KFLR"), ("residual", "KFRA")}

#: The semirings the comparisons rotate through.
ROTATION = ("max_prod", "entropy", "log_sum")


def models(kind: str) -> tuple[nn.Module, nn.Module]:
    """(plain model, the same weights extended by BackPACK), seeded."""
    build, _, convert = MODELS[kind]
    torch.manual_seed(0)
    plain = build()
    extended = backpack.extend(copy.deepcopy(plain), use_converter=convert)
    return plain, extended


def batch(kind: str) -> tuple[Tensor, Tensor]:
    """Inputs of the model's input shape and class targets in [0, 3)."""
    g = torch.Generator().manual_seed(1)
    shape = MODELS[kind][1]
    return torch.randn(shape, generator=g), torch.randint(0, 3, (shape[0],), generator=g)


def run(
    model: nn.Module,
    kind: str,
    contexts: list[AbstractContextManager[Any]],
    savefields: list[str],
    hooked_loss: bool = True,
) -> dict[str, dict[str, Any]]:
    """One seeded forward and backward inside ``contexts`` (entered in order), with a
    cross-entropy loss module extended by BackPACK (or, ``hooked_loss=False``, a plain one);
    per parameter name: ``grad``, ``semiring_grad`` and each BackPACK savefield (None where
    absent)."""
    x, y = batch(kind)
    loss = backpack.extend(nn.CrossEntropyLoss()) if hooked_loss else nn.CrossEntropyLoss()
    torch.manual_seed(SEED)
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        loss(model(x), y).backward()
    return {
        name: {field: getattr(p, field, None) for field in ["grad", "semiring_grad", *savefields]}
        for name, p in model.named_parameters()
    }


def assert_identical(got: Any, want: Any, what: str) -> None:
    """Exact equality of tensors or lists of tensors (KFAC's factors), NaN equal to NaN."""
    assert got is not None and want is not None, what
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), what
        for g, w in zip(got, want, strict=True):
            assert_identical(g, w, what)
        return
    assert type(got) is torch.Tensor, what  # a gradient, never a semiring message
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=what)


def combined(
    kind: str, extensions: list[Any], semiring: semipack.Semiring, backpack_first: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(combined run, BackPACK alone, semipack alone on the plain model)."""
    fields = [ext.savefield for ext in extensions]
    plain, extended = models(kind)
    sr_type = type(semiring)
    contexts = [backpack.backpack(*extensions), semipack.extend(extended, semiring)]
    both = run(extended, kind, contexts if backpack_first else contexts[::-1], fields)
    _, alone = models(kind)
    bp = run(alone, kind, [backpack.backpack(*extensions)], fields)
    sp = run(plain, kind, [semipack.extend(plain, sr_type())], [], hooked_loss=False)
    return both, bp, sp


def assert_same_as_separate_runs(both, bp, sp, fields: list[str]) -> None:
    """Every parameter's gradient and BackPACK quantities equal BackPACK's alone, and its
    gradient and semiring value equal semipack's alone."""
    assert both.keys() == bp.keys() == sp.keys()
    for name, got in both.items():
        assert_identical(got["grad"], bp[name]["grad"], f"{name}.grad vs BackPACK alone")
        assert_identical(got["grad"], sp[name]["grad"], f"{name}.grad vs semipack alone")
        assert_identical(got["semiring_grad"], sp[name]["semiring_grad"], f"{name} semiring")
        for field in fields:
            assert_identical(got[field], bp[name][field], f"{name}.{field}")


CASES = [
    pytest.param(kind, ext, ROTATION[i % len(ROTATION)], id=f"{kind}-{ext}")
    for i, (kind, ext) in enumerate((k, e) for k in MODELS for e in EXTENSIONS)
    if (kind, ext) not in UNSUPPORTED
]


@pytest.mark.parametrize("backpack_first", [True, False], ids=["backpack-outer", "semipack-outer"])
@pytest.mark.parametrize(("kind", "extension", "semiring_name"), CASES)
def test_each_extension_equals_separate_runs(
    kind: str, extension: str, semiring_name: str, backpack_first: bool
) -> None:
    ext = EXTENSIONS[extension]()
    both, bp, sp = combined(kind, [ext], SEMIRINGS[semiring_name](), backpack_first)
    assert_same_as_separate_runs(both, bp, sp, [ext.savefield])


@pytest.mark.parametrize("semiring_name", ROTATION)
@pytest.mark.parametrize("kind", list(MODELS))
def test_several_extensions_in_one_backward(kind: str, semiring_name: str) -> None:
    """The README's example: per-example gradients, their variance and the exact GGN diagonal
    beside the semiring values, for each semiring of the rotation on each model."""
    exts = [bpe.BatchGrad(), bpe.Variance(), bpe.DiagGGNExact(), bpe.KFAC()]
    both, bp, sp = combined(kind, exts, SEMIRINGS[semiring_name](), backpack_first=True)
    assert_same_as_separate_runs(both, bp, sp, [e.savefield for e in exts])


@pytest.mark.parametrize(("kind", "extension"), sorted(UNSUPPORTED))
def test_what_backpack_does_not_support_raises_its_own_error(kind: str, extension: str) -> None:
    """A module BackPACK has no rule for fails as with BackPACK alone, and the failed semiring
    pass leaves every ``.grad`` as it was."""
    _, extended = models(kind)
    x, y = batch(kind)
    loss = backpack.extend(nn.CrossEntropyLoss())
    ext = EXTENSIONS[extension]()  # one instance: BackPACK's message may print it
    with pytest.raises(NotImplementedError) as alone, backpack.backpack(ext):
        loss(extended(x), y).backward()
    _, extended = models(kind)
    with (
        pytest.raises(NotImplementedError) as both,
        backpack.backpack(ext),
        semipack.extend(extended, semipack.MaxProd()),
    ):
        loss(extended(x), y).backward()
    assert str(both.value) == str(alone.value)
    assert all(p.grad is None for p in extended.parameters())


def test_second_order_quantities_do_not_depend_on_how_semipack_routes_the_graph() -> None:
    """BackPACK's second-order quantities travel in its hooks, not through autograd: the
    generic per-op rules (``extensions=False``) and a path-recording pass give the same GGN
    diagonal and Kronecker factors as BackPACK alone."""
    exts = [bpe.DiagGGNExact(), bpe.DiagHessian(), bpe.KFLR()]
    fields = [e.savefield for e in exts]
    _, alone = models("cnn")
    want = run(alone, "cnn", [backpack.backpack(*exts)], fields)
    for sr, routed in [(semipack.LogSum(), False), (semipack.TopPath(), True)]:
        _, extended = models("cnn")
        contexts = [backpack.backpack(*exts), semipack.extend(extended, sr, extensions=routed)]
        got = run(extended, "cnn", contexts, fields)
        for name, values in got.items():
            for field in ["grad", *fields]:
                assert_identical(values[field], want[name][field], f"{name}.{field}")


def test_paths_do_not_show_the_hook_nodes() -> None:
    """The identity nodes PyTorch puts around hooked modules are no path step: TopPath gives
    the plain model's paths, step for step."""
    plain, extended = models("mlp")
    x, y = batch("mlp")
    loss = backpack.extend(nn.CrossEntropyLoss())
    tp_plain, tp_both = semipack.TopPath(), semipack.TopPath()
    with semipack.extend(plain, tp_plain):
        nn.functional.cross_entropy(plain(x), y).backward()
    with backpack.backpack(bpe.BatchGrad()), semipack.extend(extended, tp_both):
        loss(extended(x), y).backward()
    for (name, p), q in zip(plain.named_parameters(), extended.parameters(), strict=True):
        assert tp_both.path(q) == tp_plain.path(p), name


def test_forward_before_the_block() -> None:
    """The hook nodes are found when the backward starts, wherever the forward ran (the
    semipack-only reference runs its forward before the block too: inside it, tanh records its
    input for exact edge weights)."""
    plain, extended = models("cnn")
    x, y = batch("cnn")
    loss = backpack.extend(nn.CrossEntropyLoss())
    with backpack.backpack(bpe.BatchGrad()):
        out = loss(extended(x), y)
        with semipack.extend(extended, semipack.Entropy()):
            out.backward()
    out = nn.functional.cross_entropy(plain(x), y)
    with semipack.extend(plain, semipack.Entropy()):
        out.backward()
    _, alone = models("cnn")
    want = run(alone, "cnn", [backpack.backpack(bpe.BatchGrad())], ["grad_batch"])
    for (name, p), q in zip(extended.named_parameters(), plain.parameters(), strict=True):
        assert_identical(p.grad_batch, want[name]["grad_batch"], name)
        assert_identical(p.grad, want[name]["grad"], name)
        assert_identical(p.semiring_grad, q.semiring_grad, name)


def test_without_regular_gradients_it_raises_before_any_hook_runs() -> None:
    _, extended = models("mlp")
    x, y = batch("mlp")
    loss = backpack.extend(nn.CrossEntropyLoss())
    with (
        backpack.backpack(bpe.BatchGrad()),
        semipack.extend(extended, semipack.MaxProd(), regular_grads=False),
        pytest.raises(semipack.SemipackError, match=r"regular_grads=False\) does not compute"),
    ):
        loss(extended(x), y).backward()
    for p in extended.parameters():
        assert p.grad is None
        assert not hasattr(p, "grad_batch") and not hasattr(p, "semiring_grad")


def test_semipack_grad_refuses_a_graph_with_module_hooks() -> None:
    """``semipack.grad`` computes no regular gradient: BackPACK would have stored messages."""
    _, extended = models("mlp")
    x, y = batch("mlp")
    loss = backpack.extend(nn.CrossEntropyLoss())
    with (
        backpack.backpack(bpe.BatchGrad()),
        pytest.raises(semipack.SemipackError, match=r"semipack\.grad does not compute"),
    ):
        semipack.grad(loss(extended(x), y), list(extended.parameters()), semipack.MaxProd())
    assert not any(hasattr(p, "grad_batch") for p in extended.parameters())


def test_branch_readouts_see_through_the_hook_nodes() -> None:
    """A hooked module receives a copy of its input made by PyTorch's identity node; the
    branches are still the uses inside its forward, equal to the plain model's, and the extra
    passes carrying them down leave BackPACK's hooks alone."""
    x, y = batch("mlp")
    x.requires_grad_(True)
    loss = backpack.extend(nn.CrossEntropyLoss())
    plain, extended = models("mlp")
    with semipack.extend(plain, semipack.MaxProd()):
        with semipack.branches(plain[2], inputs=[x]) as want:
            out = plain(x)
        nn.functional.cross_entropy(out, y).backward()
    want_values = {k: v.clone() for k, v in want.values.items()}
    want_below = {k: [t.clone() for t in v] for k, v in want.at_inputs.items()}
    with backpack.backpack(bpe.BatchGrad()), semipack.extend(extended, semipack.MaxProd()):
        with semipack.branches(extended[2], inputs=[x]) as got:
            out = extended(x)
        loss(out, y).backward()
    assert got.names == want.names == ["2"]
    for name in want.names:
        assert_identical(got.values[name], want_values[name], name)
        assert_identical(got.at_inputs[name], want_below[name], name)
    _, alone = models("mlp")
    bp = run(alone, "mlp", [backpack.backpack(bpe.BatchGrad())], ["grad_batch"])
    for name, p in extended.named_parameters():
        assert_identical(p.grad_batch, bp[name]["grad_batch"], name)


def test_hooks_registered_in_the_block_refuse_the_extra_passes_of_branch_readouts() -> None:
    """The extra passes that carry branches down have no regular gradient: BackPACK's hooks
    registered inside the block (not wrapped to skip them) raise there instead of storing a
    semiring message as a per-example gradient."""
    x, y = batch("mlp")
    x.requires_grad_(True)
    loss = backpack.extend(nn.CrossEntropyLoss())
    plain, _ = models("mlp")
    with (
        backpack.backpack(bpe.BatchGrad()),
        semipack.extend(plain, semipack.MaxProd()),
        pytest.raises(semipack.UnsupportedOpError, match="extra pass of a branch readout"),
    ):
        model = backpack.extend(plain)
        with semipack.branches(model[2], inputs=[x]):
            out = model(x)
        loss(out, y).backward()
    for p in plain.parameters():
        assert p.grad is None
        assert not isinstance(getattr(p, "grad_batch", None), semipack.Message)
