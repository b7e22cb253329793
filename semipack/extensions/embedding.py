"""nn.Embedding: each looked-up row routes its message back to the weight row it came from."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..readout.sites import Site, stamp
from ..semirings.base import scatter_into_zeros
from ..transport.provenance import current_module
from .base import (
    ModuleExtension,
    frees_context,
    inner_inputs,
    messages,
    record_inner,
    register_extension,
    split_message,
)


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
    @staticmethod
    def forward(ctx, weight, indices, padding_idx):
        ctx.indices, ctx.padding_idx = indices, padding_idx
        return record_inner(ctx, lambda w: F.embedding(indices, w, padding_idx), [weight])

    @staticmethod
    @frees_context
    def backward(ctx, grad):
        regular, parts, sr = split_message(grad)
        (reg,) = ctx.inner.regular_grads([regular])
        if parts is None:
            return reg, None, None
        (weight,) = inner_inputs(ctx)
        state = embedding_messages(sr, parts, ctx.indices, weight.shape[0], ctx.padding_idx)
        return (*messages([reg], [state], sr, [weight]), None, None)


class EmbeddingExtension(ModuleExtension):
    module_class = nn.Embedding

    def applies_to(self, module: nn.Module) -> bool:
        # max_norm renormalises the weight in place and scale_grad_by_freq rescales gradients:
        # both leave the plain ops in charge (the generic path then names the problem).
        return (
            super().applies_to(module)
            and module.max_norm is None
            and not module.scale_grad_by_freq
            and not module.sparse
        )

    def forward(self, module: nn.Embedding, indices: torch.Tensor) -> torch.Tensor:
        padding = module.padding_idx
        out = EmbeddingFunction.apply(module.weight, indices, padding)
        dims = ("batch", "token", "feature")[-out.dim() :]
        stamp(out, (Site(current_module(), "output", dims),))
        return out


register_extension(EmbeddingExtension())
