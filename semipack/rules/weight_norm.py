"""Weight normalisation's fused kernel, drawn as the decomposition PyTorch falls back to.

``torch._weight_norm(v, g, dim)`` computes ``w = v * (g / norm_except_dim(v, 2, dim))``. For
``dim`` 0 or the last dim on CPU and CUDA it runs the fused
``_weight_norm_interface``; for other dims it records that very decomposition. So that the
kernel does not change the answer, the fused op is drawn as the decomposition too (one slice
``s`` per index along ``dim``, ``n_s = ||v_s||``, ``c_s = g_s / n_s``):

    v ──(c_s)──────────────────────────────────────────────▶ w      (Mul, the direct edge)
    v ──(v_j / n_s)──▶ n_s ──(-g_s / n_s²)──▶ c_s ──(v_i)──▶ w      (norm, div, mul)
    g ──(1 / n_s)──▶ c_s ──(v_i)──▶ w

Every entry of a slice reaches every entry of that slice through ``n_s`` and ``c_s``, so the
messages cost O(slice) per slice, never O(slice²). Shapes: ``v`` and ``w`` [*], ``g`` and the
saved norms [*] with size 1 except along ``dim`` (a single entry for ``dim = -1``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..messages import OpCall, register_rule
from ..semirings.base import State

aten = torch.ops.aten


def _slices(t: Tensor, dim: int) -> Tensor:
    """[S, n]: one row per index along ``dim`` (a single row for ``dim = -1``)."""
    if dim == -1:
        return t.reshape(1, -1)
    return t.movedim(dim, 0).reshape(t.shape[dim], -1)


def _unslice(t: Tensor, like: Tensor, dim: int) -> Tensor:
    if dim == -1:
        return t.reshape(like.shape)
    moved = like.movedim(dim, 0).shape
    return t.reshape(moved).movedim(0, dim)


@register_rule(aten._weight_norm_interface_backward.default)
def weight_norm_backward(call: OpCall):
    """The fused weight-norm backward, drawn as the decomposition ``w = g v / ||v||``
    PyTorch falls back to."""
    msg, v, g, norms = call["grad_w"], call["saved_v"], call["saved_g"], call["saved_norms"]
    dim = call["dim"]
    sr, dtype = call.semiring, call.weight_dtype
    v2 = _slices(v.to(dtype), dim)  # [S, n]
    n = norms.to(dtype).reshape(-1, 1)  # [S, 1]
    gain = g.to(dtype).reshape(-1, 1)
    m = tuple(_slices(p, dim) for p in msg.parts)
    # w = v * c: the direct edge of weight c_s, and the slice sum into c_s (weights v_i).
    direct = sr.scale(m, (gain / n).expand_as(v2))
    into_c: State = sr.sum(sr.scale(m, v2), [1], keepdim=True)  # [S, 1]
    # c = g / n: to g with weight 1 / n, to n with weight -g / n²; n = ||v||: to v_j with v_j / n.
    to_g = sr.scale(into_c, 1.0 / n)
    to_n = sr.scale(into_c, -gain / (n * n))
    through_norm = sr.scale(tuple(p.expand_as(v2) for p in to_n), v2 / n)
    to_v = sr.plus(direct, through_norm)
    regular = call.run_regular()
    reals = regular if regular is not None else (None, None)
    return (
        call.wrap(reals[0], tuple(_unslice(p, v, dim) for p in to_v)),
        call.wrap(reals[1], tuple(p.reshape(g.shape) for p in to_g)),
    )
