"""Grouped matrix products (mixture-of-experts layers) against the brute-force oracle.

``torch._grouped_mm`` runs in float32 (it has no float64 kernel and wants 16-byte strides), so
the oracle reads float32 Jacobians and the comparison allows float32 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from cases_kernels import GROUPED_MM, grouped_mm_loss
from helpers import SEMIRINGS, oracle_readouts
from oracle import build_graph

import semipack


def _close(name: str, expected, actual) -> bool:
    if name == "boolean":
        return torch.equal(expected, actual)
    if name == "signed_max_prod":
        return all(
            torch.allclose(e.double(), a.double(), rtol=1e-5, atol=1e-6)
            for e, a in zip(expected, actual, strict=True)
        )
    return torch.allclose(expected.double(), actual.double(), rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("case", list(GROUPED_MM))
def test_grouped_mm_matches_the_oracle(case: str, semiring_name: str) -> None:
    name = semiring_name
    loss, (a, b) = grouped_mm_loss(case)
    expected = oracle_readouts(build_graph(loss), [a, b], name)
    got = semipack.grad(loss, [a, b], SEMIRINGS[name](), retain_graph=True)
    for e, g, label in zip(expected, got, ("a", "b"), strict=True):
        assert _close(name, e, g), f"{case} {name} {label}\n{e}\n{g}"


def test_a_tiny_mixture_of_experts_model_keeps_exact_grads() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with semipack.extend(model, semipack.LogSum()):
        model(ids, labels=ids).loss.backward()
    reached = {n: p for n, p in model.named_parameters() if p.grad is not None}
    assert reached.keys() == plain.keys()
    for n, p in reached.items():
        assert torch.equal(p.grad, plain[n]), n
        values = p.semiring_grad
        assert values.shape == p.shape, n
        # a path exists wherever the gradient is non-zero
        assert bool(torch.isfinite(values[p.grad != 0]).all()), n
    assert math.isfinite(
        float(reached["model.layers.0.mlp.experts.gate_up_proj"].semiring_grad.max())
    )
