"""Fused attention is drawn as its reference decomposition: SDPA and eager give the same values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import semipack

SEMIRINGS = [
    semipack.Real(),
    semipack.MaxProd(),
    semipack.SignedMaxProd(),
    semipack.LogSum(),
    semipack.Entropy(),
    semipack.Boolean(),
    semipack.LogCount(),
]
IDS = [s.name for s in SEMIRINGS]


def eager_attention(q, k, v, mask=None, causal=False, scale=None):
    """The textbook decomposition, written op by op as eager model code does it."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def assert_same_readout(a, b) -> None:
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            assert_same_readout(x, y)
    elif a.dtype == torch.bool:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True)


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "float_mask": {"mask": "float"},
    "bool_mask": {"mask": "bool"},
    "scale": {"scale": 0.3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_equals_eager_decomposition(semiring, case: str) -> None:
    g = torch.Generator().manual_seed(3)
    shape = (2, 3, 4, 5)  # batch, heads, tokens, head dim
    q, k, v = (
        torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    opts = dict(CASES[case])
    mask = None
    if opts.pop("mask", None) == "float":
        mask = torch.randn(4, 4, generator=g, dtype=torch.float64)
        mask[0, 1] = float("-inf")
    elif case == "bool_mask":
        mask = torch.rand(4, 4, generator=g) > 0.3
        mask[:, 0] = True  # every query keeps one key
    causal = opts.get("causal", False)
    scale = opts.get("scale")
    weights = torch.randn(shape, generator=g, dtype=torch.float64)

    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    eager = eager_attention(q, k, v, mask, causal, scale)
    torch.testing.assert_close(fused, eager)
    got = semipack.grad((fused * weights).sum(), [q, k, v], semiring)
    want = semipack.grad((eager * weights).sum(), [q, k, v], semiring)
    for a, b in zip(got, want, strict=True):
        assert_same_readout(a, b)


def _bert(impl: str):
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = impl
    torch.manual_seed(0)
    return BertModel(config).double().eval()


def test_bert_sdpa_equals_eager(semiring) -> None:
    pytest.importorskip("transformers")
    eager, sdpa = _bert("eager"), _bert("sdpa")
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.tensor([[1, 5, 7, 9, 2, 0], [1, 3, 3, 8, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    values = []
    for model in (eager, sdpa):
        model.zero_grad()
        with semipack.extend(model, semiring):
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            out[:, 0].sum().backward()
        values.append(
            {n: p.semiring_grad for n, p in model.named_parameters() if hasattr(p, "semiring_grad")}
        )
    assert values[0].keys() == values[1].keys()
    assert "encoder.layer.0.attention.self.query.weight" in values[0]
    for name in values[0]:
        assert_same_readout(values[0][name], values[1][name])


MASKS = ["none", "causal", "bool_per_batch", "float_per_batch", "bool_shared"]


def _attention_inputs(mask_kind: str):
    g = torch.Generator().manual_seed(5)
    shape = (3, 2, 4, 5)  # batch, heads, tokens, head dim
    q, k, v = (
        torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    mask = None
    if mask_kind == "bool_per_batch":
        mask = torch.rand(3, 1, 4, 4, generator=g) > 0.4
        mask[..., 0] = True
    elif mask_kind == "float_per_batch":
        mask = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64)
        mask[1, 0, 2, 3] = float("-inf")
    elif mask_kind == "bool_shared":
        mask = torch.rand(4, 4, generator=g) > 0.4
        mask[:, 0] = True
    weights = torch.randn(shape, generator=g, dtype=torch.float64)
    return q, k, v, mask, mask_kind == "causal", weights


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("extensions", [True, False], ids=["extension", "generic"])
def test_attention_chunked_over_the_batch_equals_the_decomposition(
    semiring, mask_kind: str, extensions: bool, monkeypatch
) -> None:
    """One batch entry per chunk (each with its own slice of a per-batch mask) gives the values
    of the op-by-op decomposition, through the extension and through the generic rule."""
    from semipack.rules import attention as attention_rules

    monkeypatch.setattr(attention_rules, "ATTENTION_CHUNK_ELEMENTS", 1)
    q, k, v, mask, causal, weights = _attention_inputs(mask_kind)
    want = semipack.grad(
        (eager_attention(q, k, v, mask, causal) * weights).sum(), [q, k, v], semiring
    )
    if extensions:
        with semipack.extend(None, semiring):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            (out * weights).sum().backward()
        got = [t.semiring_grad for t in (q, k, v)]
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        got = semipack.grad((out * weights).sum(), [q, k, v], semiring)
    for a, b in zip(got, want, strict=True):
        assert_same_readout(a, b)
