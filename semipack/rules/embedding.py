"""embedding_dense_backward: each looked-up row sends its message back to its weight row."""

from __future__ import annotations

import torch

from ..messages import OpCall, register_rule
from ..semirings.base import scatter_into_zeros

aten = torch.ops.aten


@register_rule(aten.embedding_dense_backward.default)
def embedding_dense_backward(call: OpCall):
    """The message to an embedding table: each looked-up row receives the messages of
    the positions that used it, combined with the semiring's plus; ``padding_idx`` rows get no
    path. ``scale_grad_by_freq`` is refused."""
    if call["scale_grad_by_freq"]:
        raise call.error("scale_grad_by_freq scales gradients by a statistic, not a derivative")
    msg, indices = call["grad_output"], call["indices"].reshape(-1)
    dim = msg.shape[-1]
    src = tuple(p.reshape(-1, dim) for p in msg.parts)
    padding = call["padding_idx"]
    if padding is not None and padding >= 0:  # autograd treats the padding row as constant
        keep = indices != padding
        indices, src = indices[keep], tuple(p[keep] for p in src)
    shape = (call["num_weights"], dim)
    state = scatter_into_zeros(call.semiring, shape, 0, indices, src, call.dtype)
    return call.wrap(call.run_regular(), state)
