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


#: ``mode`` of ``aten._embedding_bag``'s backward ops.
_SUM, _MEAN, _MAX = 0, 1, 2


def _lookup_bags(call: OpCall, lookups: int, bags: int) -> torch.Tensor:
    """The bag of each lookup ([lookups] int64): the forward's ``offset2bag`` where it has one
    entry per lookup, else from the offsets (a bag holds the lookups from its offset on)."""
    offset2bag = call["offset2bag"]
    if offset2bag.numel() == lookups:
        return offset2bag.long()
    starts = call["offsets"][:bags].long()
    positions = torch.arange(lookups, device=starts.device)
    return torch.searchsorted(starts, positions, right=True) - 1


@register_rule(aten._embedding_bag_backward.default)
def embedding_bag_backward(call: OpCall):
    """The message to an ``embedding_bag`` table (``nn.EmbeddingBag``): row ``r`` has an edge
    to bag ``b``'s output of weight the Jacobian entry, the number of lookups of ``r`` in ``b``
    (``sum``), the sum of their per-sample weights (``sum`` with ``per_sample_weights``) or
    that number over the bag's size (``mean``), the bags' messages combined with the
    semiring's plus; in ``max`` mode each output entry ``[b, d]``
    has one edge, from the row PyTorch's forward took the maximum of (``maximum_indices``, as
    its gradient), and an empty bag none. ``padding_idx`` lookups are no edges. The regular
    gradient is PyTorch's own (sparse with ``sparse=True``)."""
    if call["scale_grad_by_freq"]:
        raise call.error("scale_grad_by_freq scales gradients by a statistic, not a derivative")
    msg, indices = call["grad"], call["indices"].reshape(-1).long()
    bags, dim = msg.shape
    shape = (call["num_weights"], dim)
    mode, padding = call["mode"], call["padding_idx"]
    sr = call.semiring
    if mode == _MAX:
        nonempty = call["bag_size"] > 0  # an empty bag's maximum_indices name no maximum
        rows = call["maximum_indices"][nonempty].long()  # [bags', dim]: the row of each max
        flat = rows * dim + torch.arange(dim, device=rows.device)
        src = tuple(p[nonempty].reshape(-1) for p in msg.parts)
        state = scatter_into_zeros(sr, (shape[0] * dim,), 0, flat.reshape(-1), src, call.dtype)
        return call.wrap(call.run_regular(), tuple(p.reshape(shape) for p in state))
    bag = _lookup_bags(call, indices.numel(), bags)
    weights = call["per_sample_weights"]
    if mode == _MEAN:
        weights = 1.0 / call["bag_size"][bag].to(call.dtype)
    elif weights is None:
        weights = torch.ones(indices.shape, dtype=call.dtype, device=indices.device)
    weights = weights.reshape(-1).to(call.dtype)
    if padding is not None and padding >= 0:  # autograd treats the padding row as constant
        keep = indices != padding
        indices, bag, weights = indices[keep], bag[keep], weights[keep]
    # A row looked up twice by one bag is one Jacobian entry, the sum of the lookups' weights
    # (the op is atomic: d out[b] / d W[r] counts r's lookups in b), not two edges
    pairs, which = torch.unique(bag * shape[0] + indices, return_inverse=True)
    summed = torch.zeros(pairs.shape, dtype=weights.dtype, device=weights.device)
    summed.index_add_(0, which, weights)
    src = sr.scale(tuple(p[pairs // shape[0]] for p in msg.parts), summed[:, None])
    state = scatter_into_zeros(sr, shape, 0, pairs % shape[0], src, call.dtype)
    return call.wrap(call.run_regular(), state)


@register_rule(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(call: OpCall):
    """The message to ``embedding_bag``'s per-sample weights (``sum`` mode): lookup ``i``'s
    weight scales its row into its bag's output, an edge of weight ``W[id_i, d]`` to each
    output entry ``[bag, d]``; a padding lookup has none."""
    if call["mode"] != _SUM:
        raise call.error("per-sample weights are defined for mode='sum' only")
    msg, weight = call["grad"], call["weight"]
    indices = call["indices"].reshape(-1).long()
    bag = _lookup_bags(call, indices.numel(), msg.shape[0])
    rows = weight[indices].to(call.dtype)  # [lookups, dim]: the edge weights
    padding = call["padding_idx"]
    if padding is not None and padding >= 0:
        rows = rows.masked_fill((indices == padding)[:, None], 0.0)  # weight 0: no edge
    edges = call.semiring.scale(tuple(p[bag] for p in msg.parts), rows)
    return call.wrap(call.run_regular(), call.semiring.sum(edges, [1]))
