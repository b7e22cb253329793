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
    from transformers.models.bert.modeling_bert import BertSelfAttention

    from semipack.extensions.hf import semiring_eager_attention

    module = BertSelfAttention(BertConfig(hidden_size=4, num_attention_heads=2)).eval()
    out, _ = semiring_eager_attention(module, t["q"], t["k"], t["v"], t["mask"], dropout=0.0)
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
                torch.testing.assert_close(leaves[name].semiring_grad, want, rtol=1e-12, atol=0)


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
