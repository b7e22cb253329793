"""No extension may lose a gradient: for every extended function and every subset of its tensor
arguments that require grad (learnable masks and biases included), the leaves that receive
``.grad`` inside ``semipack.extend`` are exactly those of a plain backward, with bitwise equal
values, each with a ``semiring_grad``; and ``Real`` equals autograd.

Each tensor argument is a function of its own leaf (``leaf * 1``, a non-leaf like real
activations), so a lost gradient shows up as a leaf without ``.grad``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import semipack

DTYPE = torch.float64


def _rand(*shape: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=DTYPE)


@dataclass(frozen=True)
class Call:
    """An extended function, the shapes of its tensor arguments, and how to call it."""

    name: str
    shapes: dict[str, tuple[int, ...]]
    run: Callable[[dict[str, Tensor]], Tensor]


def _sdpa(t: dict[str, Tensor]) -> Tensor:
    return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["mask"])


_MHA = nn.MultiheadAttention(4, 2, batch_first=True, dtype=DTYPE)


def _mha(t: dict[str, Tensor]) -> Tensor:
    """nn.MultiheadAttention's own parameters stay as they are; its masks are arguments."""
    out, weights = _MHA(t["x"], t["x"], t["x"], attn_mask=t["mask"], key_padding_mask=t["pad"])
    return out.sum() + weights.sum()


def _eager_attention(t: dict[str, Tensor]) -> Tensor:
    """Hugging Face eager attention (through transformers' registry) with a learnable mask."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention, eager_attention_forward

    from semipack.extensions.hf import semiring_eager_attention

    module = BertSelfAttention(BertConfig(hidden_size=4, num_attention_heads=2)).eval()
    out, _ = semiring_eager_attention(
        module, t["q"], t["k"], t["v"], t["mask"], dropout=0.0, eager=eager_attention_forward
    )
    return out.sum()


CALLS = [
    Call(
        "linear", {"x": (3, 4), "w": (2, 4), "b": (2,)}, lambda t: F.linear(t["x"], t["w"], t["b"])
    ),
    Call(
        "conv1d",
        {"x": (2, 2, 5), "w": (3, 2, 2), "b": (3,)},
        lambda t: F.conv1d(t["x"], t["w"], t["b"], padding=1),
    ),
    Call(
        "conv2d",
        {"x": (1, 2, 4, 4), "w": (2, 1, 3, 3), "b": (2,)},
        lambda t: F.conv2d(t["x"], t["w"], t["b"], stride=2, groups=2),
    ),
    Call(
        "layer_norm",
        {"x": (3, 4), "w": (4,), "b": (4,)},
        lambda t: F.layer_norm(t["x"], (4,), t["w"], t["b"]),
    ),
    Call(
        "embedding",
        {"w": (5, 3)},
        lambda t: F.embedding(torch.tensor([[0, 4, 1]]), t["w"], padding_idx=1),
    ),
    Call("sdpa", {"q": (1, 2, 3, 4), "k": (1, 2, 3, 4), "v": (1, 2, 3, 4), "mask": (3, 3)}, _sdpa),
    Call("multihead", {"x": (2, 3, 4), "mask": (3, 3), "pad": (2, 3)}, _mha),
    Call(
        "hf_eager",
        {"q": (1, 2, 3, 2), "k": (1, 2, 3, 2), "v": (1, 2, 3, 2), "mask": (1, 1, 3, 3)},
        _eager_attention,
    ),
]


def _cases():
    for call in CALLS:
        names = list(call.shapes)
        for learnable in itertools.product([False, True], repeat=len(names)):
            if any(learnable):
                chosen = tuple(n for n, on in zip(names, learnable, strict=True) if on)
                yield pytest.param(call, chosen, id=f"{call.name}-{'+'.join(chosen)}")


def _leaves(call: Call, learnable: tuple[str, ...]) -> dict[str, Tensor]:
    return {
        name: _rand(*shape, seed=i).requires_grad_(name in learnable)
        for i, (name, shape) in enumerate(call.shapes.items())
    }


def _loss(call: Call, leaves: dict[str, Tensor]) -> Tensor:
    args = {name: leaf * 1 for name, leaf in leaves.items()}  # non-leaf arguments
    out = call.run(args)
    weights = _rand(*out.shape, seed=99) if out.dim() else torch.ones((), dtype=DTYPE)
    return (out * weights).sum()


@pytest.mark.parametrize(("call", "learnable"), list(_cases()))
def test_extensions_lose_no_gradient(call: Call, learnable: tuple[str, ...]) -> None:
    if call.name == "hf_eager":
        pytest.importorskip("transformers")
    plain = _leaves(call, learnable)
    _loss(call, plain).backward()
    for sr in (semipack.Real(), semipack.MaxProd()):
        leaves = _leaves(call, learnable)
        with semipack.extend(_MHA, sr):
            _loss(call, leaves).backward()
        for name in call.shapes:
            want, got = plain[name].grad, leaves[name].grad
            assert (want is None) == (got is None), f"{name}: .grad {got} vs plain {want}"
            if want is None:
                assert not hasattr(leaves[name], "semiring_grad"), name
                continue
            assert torch.equal(got, want), name
            assert leaves[name].semiring_grad.shape == leaves[name].shape, name
            if isinstance(sr, semipack.Real):
                # float64 sums of the same products in another order: an entry that cancels
                # to near zero differs by rounding relative to the terms, not to itself
                scale = float(want.abs().max())
                torch.testing.assert_close(
                    leaves[name].semiring_grad, want, rtol=1e-12, atol=1e-12 * scale
                )


def test_a_captured_learnable_mask_keeps_its_gradient_and_the_generic_drawing() -> None:
    """The lost-gradient case of the issue: a learnable additive attention bias (T5/ALiBi style).

    Its values must be those of the generic per-op path (the extension steps aside).
    """
    leaves = _leaves(CALLS[5], ("q", "mask"))
    values = {}
    for extensions in (True, False):
        for leaf in leaves.values():
            leaf.grad = None
        with semipack.extend(None, semipack.LogSum(), extensions=extensions):
            _loss(CALLS[5], leaves).backward()
        values[extensions] = leaves["mask"].semiring_grad.clone()
        assert leaves["mask"].grad is not None
    torch.testing.assert_close(values[True], values[False], rtol=1e-12, atol=0)


def _grads_and_values(
    params: dict[str, Tensor], loss: Callable[[], Tensor], sr: semipack.Semiring | None, **kw
) -> tuple[dict[str, Tensor | None], dict[str, Tensor | None]]:
    """(.grad, .semiring_grad) of each parameter after one backward of ``loss()``, plain when
    ``sr`` is None, else inside ``semipack.extend`` with ``kw``."""
    for p in params.values():
        p.grad = None
        if hasattr(p, "semiring_grad"):
            del p.semiring_grad
    if sr is None:
        loss().backward()
    else:
        with semipack.extend(None, sr, **kw):
            loss().backward()
    grads = {n: p.grad for n, p in params.items()}
    values = {n: getattr(p, "semiring_grad", None) for n, p in params.items()}
    return grads, values


def _assert_like_plain_and_generic(params, loss) -> None:
    """.grad bitwise plain (None where plain has None) and never a Message; semiring values
    only where plain has a gradient, equal to the generic per-op path's (Real: to .grad)."""
    plain, _ = _grads_and_values(params, loss, None)
    for sr in (semipack.MaxProd(), semipack.LogSum(), semipack.Real()):
        grads, fused = _grads_and_values(params, loss, sr)
        _, generic = _grads_and_values(params, loss, sr, extensions=False)
        for name, want in plain.items():
            got = grads[name]
            assert (got is None) == (want is None), f"{sr.name} {name}: .grad {got!r}"
            assert (fused[name] is None) == (want is None), f"{sr.name} {name}: semiring_grad"
            if want is None:
                continue
            assert type(got) is Tensor and torch.equal(got, want), f"{sr.name} {name}"
            # Real's sums cancel to rounding noise where the gradient is 0: an absolute floor
            floor = 1e-12 if isinstance(sr, semipack.Real) else 0.0
            torch.testing.assert_close(fused[name], generic[name], rtol=1e-9, atol=floor)
            if isinstance(sr, semipack.Real):
                torch.testing.assert_close(fused[name], want, rtol=1e-9, atol=floor)


@pytest.mark.parametrize("output", ["attention output", "attention weights"])
def test_a_loss_of_one_output_of_multihead_attention(output: str) -> None:
    """The loss reads one of nn.MultiheadAttention's two outputs. From the weights only, the
    value rows of the input projection and out_proj are on no path: out_proj gets no gradient
    (as in a plain backward) and no semiring value. A message without a regular gradient used
    to end in out_proj's ``.grad`` (a new-user trial found it: an optimizer step then raised)."""
    mha = nn.MultiheadAttention(4, 2, batch_first=True, dtype=DTYPE)
    x = _rand(2, 3, 4, seed=1).requires_grad_()
    params = {**dict(mha.named_parameters()), "x": x}
    which = 0 if output == "attention output" else 1

    def loss() -> Tensor:
        return mha(x * 1, x * 1, x * 1, need_weights=True)[which].pow(2).sum()

    _assert_like_plain_and_generic(params, loss)


def test_a_loss_of_a_hugging_face_models_attention_weights() -> None:
    """A loss of the last layer's attention probabilities (``output_attentions=True``) of a
    two-layer BERT with eager attention: that layer's value projection and everything after it
    get no gradient. A regular-gradient-less message from the value projection used to be added
    into the residual stream and leave Messages in every earlier parameter's ``.grad``."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, torch_dtype=DTYPE,
    )  # fmt: skip
    model = transformers.BertModel._from_config(cfg, attn_implementation="eager").eval()
    model = model.to(DTYPE)
    ids = torch.tensor([[3, 5, 7, 2]])
    params = dict(model.named_parameters())

    def loss() -> Tensor:
        return model(input_ids=ids, output_attentions=True).attentions[1].pow(2).sum()

    _assert_like_plain_and_generic(params, loss)


def _penalty_grads(call: Call, leaves: dict[str, Tensor]) -> tuple[list[bool], tuple]:
    """Which gradients of the loss carry a graph (``create_graph=True``, as a gradient penalty
    or double backprop computes them), and the gradients of their squared norm, by direct
    ``torch.autograd.grad`` calls (None where the penalty is constant)."""
    loss = _loss(call, leaves)
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True, allow_unused=True)
    graphs = [g is not None and g.requires_grad for g in grads]
    if not any(graphs):
        return graphs, (None,) * len(leaves)
    penalty = sum(g.pow(2).sum() for g, on in zip(grads, graphs, strict=True) if on)
    return graphs, torch.autograd.grad(penalty, list(leaves.values()), allow_unused=True)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_a_gradient_penalty_differentiates_through_extensions(call: Call) -> None:
    """``torch.autograd.grad(..., create_graph=True)`` inside ``extend`` gives a gradient that
    can be differentiated again, through every extension, to the second-order gradients of a
    plain run, bitwise. The extensions' inner graphs hang off detached aliases, so their
    gradients used to be constants: a gradient penalty's second-order term was silently lost
    (a new-user trial found it). Linear's penalised loss also runs a semiring backward."""
    if call.name == "hf_eager":
        pytest.importorskip("transformers")
    names = tuple(call.shapes)
    try:
        want = _penalty_grads(call, _leaves(call, names))
    except RuntimeError as exc:  # PyTorch itself has no double backward for this kernel
        pytest.skip(f"plain double backward unavailable: {exc}"[:200])
    with semipack.extend(_MHA, semipack.MaxProd()):
        got = _penalty_grads(call, _leaves(call, names))
    assert got[0] == want[0], "which gradients carry a graph"
    for name, w, g in zip(names, want[1], got[1], strict=True):
        assert (w is None) == (g is None), name
        assert w is None or torch.equal(g, w), name
    if call.name == "linear":
        plain = _leaves(call, names)
        loss = _loss(call, plain)
        grads = torch.autograd.grad(loss, list(plain.values()), create_graph=True)
        (loss + sum(g.pow(2).sum() for g in grads)).backward()
        leaves = _leaves(call, names)
        with semipack.extend(None, semipack.Real()):
            loss = _loss(call, leaves)
            grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
            (loss + sum(g.pow(2).sum() for g in grads)).backward()
        for name in names:
            assert torch.equal(leaves[name].grad, plain[name].grad), name
            torch.testing.assert_close(leaves[name].semiring_grad, plain[name].grad)


def test_a_model_under_torch_func_vmap_inside_extend() -> None:
    """``torch.func.vmap(functional_call(model, ...))`` inside ``extend``: the extensions step
    aside (their inner graph's detached aliases cannot be made inside a functorch transform; it
    used to raise functorch's own error) and the generic path gives plain gradients and the
    semiring values."""
    from torch.func import functional_call, vmap

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)
    x = _rand(2, 3, seed=0)
    params = dict(model.named_parameters())

    def loss() -> Tensor:
        return vmap(lambda xi: functional_call(model, params, (xi,)))(x).pow(2).sum()

    _assert_like_plain_and_generic(params, loss)
