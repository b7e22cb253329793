"""Weight normalisation: the fused kernel is drawn as the decomposition PyTorch falls back to.

The oracle reads the decomposed graph ``v * (g / norm_except_dim(v, 2, dim))`` (what
``torch._weight_norm`` records for the dims without a fused kernel), and semipack must give its
values through the fused ``_weight_norm_interface`` too.
"""

from __future__ import annotations

import pytest
import torch
from cases_kernels import WEIGHT_NORM, weight_norm_losses
from helpers import SEMIRINGS, assert_readout_matches, oracle_readouts
from oracle import build_graph
from torch import nn

import semipack


@pytest.mark.parametrize(("dim", "g_shape"), WEIGHT_NORM, ids=["dim0", "last_dim"])
def test_fused_weight_norm_matches_the_decomposition(dim: int, g_shape, semiring_name: str) -> None:
    name = semiring_name
    fused, decomposed, (v, g) = weight_norm_losses(dim, g_shape)
    nodes = {fused.grad_fn.next_functions[0][0].next_functions[0][0].name()}
    assert nodes == {"WeightNormInterfaceBackward0"}  # the fused kernel really ran
    expected = oracle_readouts(build_graph(decomposed), [v, g], name)
    got = semipack.grad(fused, [v, g], SEMIRINGS[name]())
    for e, a, label in zip(expected, got, ("v", "g"), strict=True):
        assert_readout_matches(name, e, a, f"dim {dim} {label}")


def test_weight_norm_parametrization_in_a_model_keeps_exact_grads() -> None:
    """wav2vec2-style: a parametrized convolution, with and without extensions."""
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 3, 3, padding=1), dim=2)
    x = torch.randn(2, 2, 5)
    conv(x).tanh().sum().backward()
    plain = {n: p.grad.clone() for n, p in conv.named_parameters()}
    values = {}
    for extensions in (True, False):
        conv.zero_grad(set_to_none=True)
        with semipack.extend(conv, semipack.LogSum(), extensions=extensions):
            conv(x).tanh().sum().backward()
        for n, p in conv.named_parameters():
            assert torch.equal(p.grad, plain[n]), n
        values[extensions] = {n: p.semiring_grad for n, p in conv.named_parameters()}
    for n in plain:
        torch.testing.assert_close(values[True][n], values[False][n], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(values[True][n]).all(), n
