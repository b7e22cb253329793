"""F.embedding (hence nn.Embedding): each looked-up row routes its message back to its row."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..graph.provenance import current_module
from ..graph.sites import Site, stamp
from ..semirings.base import scatter_into_zeros
from .base import InnerGraph, extends, frees_context, messages, split_message, wants_graph


def embedding_messages(sr, m, indices, num_weights: int, padding_idx: int | None):
    """Weight state of ``weight[indices]``: an edge of weight 1 per lookup, none for padding."""
    dim = m[0].shape[-1]
    flat_ids = indices.reshape(-1)
    src = tuple(p.reshape(-1, dim) for p in m)
    if padding_idx is not None and padding_idx >= 0:
        keep = flat_ids != padding_idx
        flat_ids, src = flat_ids[keep], tuple(p[keep] for p in src)
    return scatter_into_zeros(sr, (num_weights, dim), 0, flat_ids, src, m[0].dtype)


class EmbeddingFunction(torch.autograd.Function):
    """W -> W[indices], with the call's inner graph recorded beforehand."""

    @staticmethod
    def forward(ctx, inner: InnerGraph, weight, indices, padding_idx):
        ctx.inner, ctx.indices, ctx.padding_idx = inner, indices, padding_idx
        return inner.take_outputs()

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        (reg,) = ctx.inner.regular_grads([regular])
        if parts is None:
            return None, reg, None, None
        (weight,) = ctx.inner.values()
        state = embedding_messages(sr, parts, ctx.indices, weight.shape[0], ctx.padding_idx)
        return (None, *messages([reg], [state], sr, [weight]), None, None)


@extends(F.embedding)
def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """``F.embedding`` inside ``extend``: each lookup routes its message to its weight row."""
    if max_norm is not None or scale_grad_by_freq or sparse or not wants_graph(weight):
        # max_norm renormalises the weight in place and scale_grad_by_freq rescales gradients:
        # both leave the plain ops in charge (the generic path then names the problem).
        return F.embedding(
            input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
        )
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    inner = InnerGraph(lambda w: F.embedding(input, w, padding_idx), [weight])
    if inner.escapes:
        return inner.plain_outputs()
    out = EmbeddingFunction.apply(inner, weight, input, padding_idx)
    dims = ("batch", "token", "feature")[-out.dim() :]
    stamp(out, (Site(current_module(), "output", dims),))
    return out
