"""embedding_dense_backward: each looked-up row sends its message back to its weight row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..messages import OpCall, register_rule
from ..semirings.base import Semiring, State, scatter_into_zeros

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


def lookup_bags(offset2bag: Tensor, offsets: Tensor, lookups: int, bags: int) -> Tensor:
    """The bag of each lookup ([lookups] int64): the forward's ``offset2bag`` where it has one
    entry per lookup, else from the offsets (a bag holds the lookups from its offset on)."""
    if offset2bag.numel() == lookups:
        return offset2bag.long()
    starts = offsets[:bags].long()
    positions = torch.arange(lookups, device=starts.device)
    return torch.searchsorted(starts, positions, right=True) - 1


@dataclass(frozen=True)
class BagLookups:
    """What an ``embedding_bag`` forward saved for its backward: the flat ids, the bag of
    each lookup (``offset2bag`` or the offsets), each bag's size, the row each output entry's
    maximum came from (``max`` mode) and the per-sample weights."""

    indices: Tensor
    offsets: Tensor
    offset2bag: Tensor
    bag_size: Tensor
    maximum_indices: Tensor
    mode: int
    per_sample_weights: Tensor | None
    padding_idx: int | None
    num_weights: int


def bag_table_state(
    sr: Semiring, parts: State, bags: BagLookups, dtype: torch.dtype, per_bag: bool = False
) -> State:
    """The table's state from the bags' output message ``parts`` ([bags, dim] each): row ``r``
    has an edge to bag ``b``'s output of weight the Jacobian entry, the number of lookups of
    ``r`` in ``b`` (``sum``), the sum of their per-sample weights (``sum`` with
    ``per_sample_weights``) or that number over the bag's size (``mean``); in ``max`` mode
    each output entry ``[b, d]`` has one edge, from the row the forward took the maximum of
    (``maximum_indices``, as PyTorch's gradient), and an empty bag none; ``padding_idx``
    lookups are no edges. ``[num_weights, dim]``, the bags combined with the semiring's plus;
    ``per_bag``: ``[bags, num_weights, dim]``, each bag's own (per-sample rows, a bag being an
    example)."""
    indices = bags.indices.reshape(-1).long()
    count, dim = parts[0].shape
    rows = bags.num_weights
    tables = count if per_bag else 1
    if bags.mode == _MAX:
        nonempty = bags.bag_size > 0  # an empty bag's maximum_indices name no maximum
        taken = bags.maximum_indices[nonempty].long()  # [bags', dim]: the row of each max
        if per_bag:
            taken = taken + rows * torch.nonzero(nonempty).reshape(-1, 1)
        flat = taken * dim + torch.arange(dim, device=taken.device)
        src = tuple(p[nonempty].reshape(-1) for p in parts)
        state = scatter_into_zeros(sr, (tables * rows * dim,), 0, flat.reshape(-1), src, dtype)
    else:
        bag = lookup_bags(bags.offset2bag, bags.offsets, indices.numel(), count)
        weights = bags.per_sample_weights
        if bags.mode == _MEAN:
            weights = 1.0 / bags.bag_size[bag].to(dtype)
        elif weights is None:
            weights = torch.ones(indices.shape, dtype=dtype, device=indices.device)
        weights = weights.reshape(-1).to(dtype)
        padding = bags.padding_idx
        if padding is not None and padding >= 0:  # autograd treats the padding row as constant
            keep = indices != padding
            indices, bag, weights = indices[keep], bag[keep], weights[keep]
        # A row looked up twice by one bag is one Jacobian entry, the sum of the lookups'
        # weights (the op is atomic: d out[b] / d W[r] counts r's lookups in b), not two edges
        pairs, which = torch.unique(bag * rows + indices, return_inverse=True)
        summed = torch.zeros(pairs.shape, dtype=weights.dtype, device=weights.device)
        summed.index_add_(0, which, weights)
        src = sr.scale(tuple(p[pairs // rows] for p in parts), summed[:, None])
        target = pairs if per_bag else pairs % rows
        state = scatter_into_zeros(sr, (tables * rows, dim), 0, target, src, dtype)
    shape = (count, rows, dim) if per_bag else (rows, dim)
    return tuple(p.reshape(shape) for p in state)


@register_rule(aten._embedding_bag_backward.default)
def embedding_bag_backward(call: OpCall):
    """The message to an ``embedding_bag`` table (``nn.EmbeddingBag``), ``bag_table_state``;
    the regular gradient is PyTorch's own (sparse with ``sparse=True``)."""
    if call["scale_grad_by_freq"]:
        raise call.error("scale_grad_by_freq scales gradients by a statistic, not a derivative")
    bags = BagLookups(
        indices=call["indices"],
        offsets=call["offsets"],
        offset2bag=call["offset2bag"],
        bag_size=call["bag_size"],
        maximum_indices=call["maximum_indices"],
        mode=call["mode"],
        per_sample_weights=call["per_sample_weights"],
        padding_idx=call["padding_idx"],
        num_weights=call["num_weights"],
    )
    state = bag_table_state(call.semiring, call["grad"].parts, bags, call.dtype)
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
    bag = lookup_bags(call["offset2bag"], call["offsets"], indices.numel(), msg.shape[0])
    rows = weight[indices].to(call.dtype)  # [lookups, dim]: the edge weights
    padding = call["padding_idx"]
    if padding is not None and padding >= 0:
        rows = rows.masked_fill((indices == padding)[:, None], 0.0)  # weight 0: no edge
    edges = call.semiring.scale(tuple(p[bag] for p in msg.parts), rows)
    return call.wrap(call.run_regular(), call.semiring.sum(edges, [1]))
