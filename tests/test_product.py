"""``semipack.Product``: several semirings in one backward, each factor's readout bitwise what a
pass with that semiring alone gives (extensions on and off), ``.grad`` bitwise a plain
backward's."""

from __future__ import annotations

import pytest
import torch
from helpers import MinProd, tiny_bert_config
from torch import nn

import semipack

F64 = torch.float64
FACTORS = [
    semipack.MaxProd, semipack.Entropy, semipack.LogSum, semipack.Real, semipack.Boolean,
    semipack.LogCount, semipack.SignedMaxProd, MinProd,
]  # fmt: skip


def _readouts(model: nn.Module, run, semiring, extensions: bool):
    leaves = [p for p in model.parameters() if p.requires_grad]
    for p in leaves:
        p.grad = None
    with semipack.extend(model, semiring, extensions=extensions):
        inputs = run()
    leaves = [t for t in leaves + inputs if t.grad is not None]  # BERT's pooler gets none
    return [t.semiring_grad for t in leaves], [t.grad.clone() for t in leaves]


def _same(a, b, where: str) -> None:
    if isinstance(a, tuple):  # SignedMaxProd's Extremes
        for x, y in zip(a, b, strict=True):
            _same(x, y, where)
        return
    if isinstance(a, torch.Tensor) and hasattr(a, "log_abs"):
        a, b = torch.stack([a.sign, a.log_abs]), torch.stack([b.sign, b.log_abs])
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.ReLU(), nn.LayerNorm(7),
                          nn.Linear(7, 3)).double()  # fmt: skip
    x = torch.randn(4, 5, dtype=F64, requires_grad=True)

    def run():
        x.grad = None
        model(x).log_softmax(-1)[:, 0].sum().backward()
        return [x]

    return model, run


def _cnn():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, groups=2), nn.Sigmoid(), nn.Flatten(), nn.Linear(4, 3),
    ).double().eval()  # fmt: skip
    x = torch.randn(2, 2, 6, 6, dtype=F64, requires_grad=True)

    def run():
        x.grad = None
        nn.functional.cross_entropy(model(x), torch.tensor([0, 2])).backward()
        return [x]

    return model, run


def _bert(attention: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    cfg = tiny_bert_config(num_hidden_layers=2)
    model = transformers.BertModel._from_config(cfg, attn_implementation=attention).double()
    ids = torch.tensor([[2, 5, 7, 9, 3]])

    def run():
        model(input_ids=ids).last_hidden_state[0, 1:3].sum().backward()
        return []

    return model, run


@pytest.mark.parametrize("extensions", [True, False])
@pytest.mark.parametrize("build", ["mlp", "cnn", "bert_eager", "bert_sdpa"])
def test_each_factor_equals_its_own_pass(build: str, extensions: bool) -> None:
    model, run = {"mlp": _mlp, "cnn": _cnn}.get(build, lambda: _bert(build.split("_")[1]))()
    product = semipack.Product(*(make() for make in FACTORS))
    got, grads = _readouts(model, run, product, extensions)
    for i, make in enumerate(FACTORS):
        want, want_grads = _readouts(model, run, make(), extensions)
        for n, (a, b) in enumerate(zip(got, want, strict=True)):
            _same(a[i], b, f"{build}: leaf {n}, {make.__name__}")
        for a, b in zip(grads, want_grads, strict=True):
            assert torch.equal(a, b)  # .grad is the plain backward's in both passes


@pytest.mark.parametrize("extensions", [True, False])
def test_a_product_led_by_boolean_reads_out_a_float64_embedding_table(extensions: bool) -> None:
    """The embedding table's state is kept as its reached rows; the others get each factor's
    zero in the table's gradient dtype. Taken from the first component, Boolean's bool, it
    was float32 beside float64 rows: the readout failed (trial 38)."""
    model, run = _bert("eager")
    factors = [semipack.Boolean, semipack.MaxProd, semipack.Entropy, semipack.LogSum]
    got, grads = _readouts(model, run, semipack.Product(*(f() for f in factors)), extensions)
    for i, make in enumerate(factors):
        want, want_grads = _readouts(model, run, make(), extensions)
        for n, (a, b) in enumerate(zip(got, want, strict=True)):
            _same(a[i], b, f"leaf {n}, {make.__name__}")
        for a, b in zip(grads, want_grads, strict=True):
            assert torch.equal(a, b)


def test_regular_gradient_is_autograd_and_branches_split_a_product() -> None:
    model, _run = _mlp()
    with semipack.extend(model, semipack.Product(semipack.MaxProd(), semipack.LogSum())):
        x = torch.randn(4, 5, dtype=F64)
        with semipack.branches(model[1]) as split:
            out = model(x)
        out.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()
    for a, p in zip(got, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)
    best, flow = split.values["1"]
    with semipack.extend(model, semipack.MaxProd()):
        with semipack.branches(model[1]) as alone:
            out = model(x)
        out.sum().backward()
    assert torch.equal(best, alone.values["1"])
    assert flow.shape == best.shape


@pytest.mark.parametrize(
    ("factors", "error", "message"),
    [
        ((), ValueError, "Product needs at least one semiring"),
        ((semipack.MaxProd,), TypeError, "Product takes semiring instances: pass MaxProd()"),
        ((semipack.TopPath(),), ValueError, "TopPath records paths and cannot be a factor"),
        ((semipack.Product(semipack.MaxProd()),), ValueError, "cannot contain a Product"),
        (("MaxProd",), TypeError, "Product takes semirings, got str"),
    ],
)
def test_mistakes_are_named(factors, error, message) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        semipack.Product(*factors)


def test_readout_order_and_repr() -> None:
    product = semipack.Product(semipack.LogSum(), semipack.MaxProd())
    assert repr(product) == "Product(LogSum(log=True), MaxProd(log=False))"
    assert product.components == ("LogSum.value", "MaxProd.value")
    w = torch.tensor([0.5, 0.0, -2.0], dtype=F64)
    flow, best = product.readout(product.lift(w))
    assert torch.equal(flow, torch.tensor([0.5, 0.0, 2.0], dtype=F64).log())
    assert torch.equal(best, torch.tensor([0.5, 0.0, 2.0], dtype=F64))


def test_a_list_of_factors_is_refused_with_the_spelling() -> None:
    """``Product([MaxProd(), LogSum()])`` said only "got list" (trial 58)."""
    with pytest.raises(TypeError, match=r"write Product\(\*factors\)"):
        semipack.Product([semipack.MaxProd(), semipack.LogSum()])
