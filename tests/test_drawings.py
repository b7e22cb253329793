"""Drawings (``semipack.extend(drawing=...)``): each equals the brute-force oracle run on the
correspondingly written function, and the two differ where the README says they do.

The oracle reads every edge off autograd's own backward of the function as written, so the
atomic drawing is checked against ``softmax`` / ``log_softmax`` / ``cross_entropy`` /
``scaled_dot_product_attention`` themselves, and the decomposed drawing against the same
functions written out with ``exp``, ``logsumexp`` and ``nll_loss`` by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_readout_matches, oracle_readouts, tiny_bert_config
from oracle import build_graph
from torch import Tensor, nn

import semipack

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("single_thread")


def _by_hand_log_softmax(x: Tensor, dim: int) -> Tensor:
    return x - torch.logsumexp(x, dim, keepdim=True)


def _by_hand_softmax(x: Tensor, dim: int) -> Tensor:
    return torch.exp(_by_hand_log_softmax(x, dim))


def _by_hand_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, softmax=_by_hand_softmax
):
    """Attention's reference decomposition (how semipack draws the fused kernels), with the
    given softmax."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + mask
    return softmax(scores, -1) @ v


MASK = torch.tensor([[0.0, -1.5, float("-inf")], [0.0, 0.0, 0.3]], dtype=F64)
TARGET = torch.tensor([2, 0])
SOFT_TARGET = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=F64)

#: name -> (as users write it, the decomposed drawing written by hand, leaf shapes)
CASES: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor], tuple]] = {
    "softmax_then_matmul": (
        lambda x, w: F.softmax(x @ w, -1) @ w.t(),
        lambda x, w: _by_hand_softmax(x @ w, -1) @ w.t(),
        ((2, 3), (3, 3)),
    ),
    "tensor_softmax_method_dim0": (
        lambda x: x.softmax(0) * x,
        lambda x: _by_hand_softmax(x, 0) * x,
        ((3, 2),),
    ),
    "log_softmax_nll": (
        lambda x: F.nll_loss(torch.log_softmax(x, 1), TARGET),
        lambda x: F.nll_loss(_by_hand_log_softmax(x, 1), TARGET),
        ((2, 3),),
    ),
    "cross_entropy_classes": (
        lambda x: F.cross_entropy(x, TARGET, reduction="sum"),
        lambda x: F.nll_loss(_by_hand_log_softmax(x, 1), TARGET, reduction="sum"),
        ((2, 3),),
    ),
    "cross_entropy_probabilities": (
        lambda x: F.cross_entropy(x, SOFT_TARGET),
        lambda x: -(SOFT_TARGET * _by_hand_log_softmax(x, 1)).sum(1).sum() / 2,
        ((2, 3),),
    ),
    "sdpa_masked": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=MASK),
        lambda q, k, v: _by_hand_attention(q, k, v, MASK, False),
        ((1, 2, 2), (1, 3, 2), (1, 3, 2)),
    ),
    "sdpa_causal": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v: _by_hand_attention(q, k, v, None, True),
        ((1, 3, 2), (1, 3, 2), (1, 3, 2)),
    ),
}


#: Fused attention is drawn as its reference decomposition (README "Semantics"); the oracle of
#: the fused kernel would read it as one op, so the atomic drawing's reference is written out.
ATOMIC_REFERENCE: dict[str, Callable[..., Tensor]] = {
    "sdpa_masked": lambda q, k, v: _by_hand_attention(q, k, v, MASK, False, torch.softmax),
    "sdpa_causal": lambda q, k, v: _by_hand_attention(q, k, v, None, True, torch.softmax),
}


def _leaves(shapes: tuple, seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=F64).requires_grad_() for s in shapes]


def _weighted(out: Tensor) -> Tensor:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    return (out * w).sum()


@pytest.mark.parametrize("extensions", [True, False], ids=["extensions", "generic"])
@pytest.mark.parametrize("drawing", ["atomic", "decomposed"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_drawing_equals_the_oracle_of_its_function(
    case: str, drawing: str, extensions: bool, semiring_name: str, semiring
) -> None:
    as_written, by_hand, shapes = CASES[case]
    reference = ATOMIC_REFERENCE.get(case, as_written) if drawing == "atomic" else by_hand
    leaves = _leaves(shapes)
    expected = oracle_readouts(build_graph(_weighted(reference(*leaves))), leaves, semiring_name)
    with semipack.extend(None, semiring, extensions=extensions, drawing=drawing):
        _weighted(as_written(*leaves)).backward()
    for i, (want, leaf) in enumerate(zip(expected, leaves, strict=True)):
        assert_readout_matches(semiring_name, want, leaf.semiring_grad, f"{case} leaf {i}")


def test_the_two_key_attention_example() -> None:
    """README "Semantics": scores s = (2, 0), P = softmax(s), out = P · (1, 1). The best path
    from the winning key's score s_0 weighs p_0 (1 - p_0) = p_0 p_1 drawn atomic (both of its
    paths, to p_0 and to p_1, carry that weight) and p_0 drawn decomposed (the direct exp
    edge; the paths through logsumexp weigh p_0 p_i)."""
    p0 = math.exp(2) / (1 + math.exp(2))
    p1 = 1 - p0
    want = {"atomic": [p0 * p1, p0 * p1], "decomposed": [p0, p1]}
    for drawing, values in want.items():
        s = torch.tensor([2.0, 0.0], dtype=F64, requires_grad=True)
        with semipack.extend(None, semipack.MaxProd(), drawing=drawing):
            (F.softmax(s, -1) @ torch.ones(2, dtype=F64)).backward()
        torch.testing.assert_close(s.semiring_grad, torch.tensor(values, dtype=F64))
        assert s.grad.abs().max() < 1e-15  # softmax sums to 1: the gradient is 0 either way


def test_a_hugging_face_model_is_drawn_decomposed_with_eager_and_sdpa() -> None:
    """With the decomposed drawing, a BERT layer's attention is drawn through logsumexp by both
    attention implementations (eager calls softmax, sdpa calls the fused function)."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_bert_config()
    ids = torch.tensor([[3, 5, 7, 2]])
    values = {}
    for attention in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = transformers.BertModel._from_config(cfg, attn_implementation=attention).double()
        for drawing in ("atomic", "decomposed"):
            with semipack.extend(model, semipack.MaxProd(log=True), drawing=drawing):
                model(input_ids=ids).last_hidden_state.pow(2).sum().backward()
            # every path from the query weights goes through the attention's softmax
            query = model.encoder.layer[0].attention.self.query.weight
            values[attention, drawing] = query.semiring_grad
    for drawing in ("atomic", "decomposed"):
        torch.testing.assert_close(values["eager", drawing], values["sdpa", drawing])
    assert not torch.allclose(values["eager", "atomic"], values["eager", "decomposed"])


def test_unknown_drawings_and_undrawable_calls_say_so() -> None:
    unknown = pytest.raises(ValueError, match="unknown drawing 'split': choose one of atomic, deco")
    with unknown, semipack.extend(None, semipack.MaxProd(), drawing="split"):
        pass
    mha = nn.MultiheadAttention(4, 2).double()
    x = torch.randn(3, 1, 4, dtype=F64)
    refused = pytest.raises(semipack.SemipackError, match="cannot be drawn decomposed")
    with refused, semipack.extend(mha, semipack.MaxProd(), drawing="decomposed"):
        mha(x, x, x)
    logits = torch.randn(2, 3, dtype=F64, requires_grad=True)
    refused = pytest.raises(semipack.SemipackError, match="does not support label_smoothing")
    with refused, semipack.extend(None, semipack.MaxProd(), drawing="decomposed"):
        F.cross_entropy(logits, TARGET, label_smoothing=0.1)
