"""F.embedding (hence nn.Embedding): each looked-up row routes its message back to its row."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import PerSampleError
from ..semirings.base import Semiring, SparseRows, State, scatter_into_zeros, sparse_rows
from .base import (
    BackwardCall,
    ExtensionFunction,
    Sites,
    extends,
    per_sample_rule,
    wants_graph,
)


def embedding_messages(
    sr: Semiring, m: State, indices: Tensor, weight: Tensor, padding_idx: int | None
) -> SparseRows:
    """Weight state of ``weight[indices]``: an edge of weight 1 per lookup, none for padding;
    kept as the rows a lookup reached (``SparseRows``): the table's full state is built only if
    an op needs it, and the readout skips the other rows.

    m's parts: [*indices.shape, dim]; the state comes shaped like the weight [num_weights, dim].
    The table's gradient dtype is the weight's: a ``Product``'s first component may be another
    dtype (``Boolean``'s bool), and the unreached rows' zeros must match the reached ones'.
    """
    dim = m[0].shape[-1]
    flat_ids = indices.reshape(-1)
    src = tuple(p.reshape(-1, dim) for p in m)
    if padding_idx is not None and padding_idx >= 0:
        keep = flat_ids != padding_idx
        flat_ids, src = flat_ids[keep], tuple(p[keep] for p in src)
    return sparse_rows(sr, (weight.shape[0], dim), flat_ids, src, weight.dtype)


def embedding_per_sample(
    sr: Semiring, m: State, indices: Tensor, weight: Tensor, padding_idx: int | None
) -> State:
    """Per-sample weight state ``[N, num_weights, dim]`` of ``weight[indices]`` (indices
    ``[N, ...]``): example n's lookups go to rows ``n * num_weights + id`` of one scatter."""
    n, dim, num_weights = indices.shape[0], m[0].shape[-1], weight.shape[0]
    offsets = torch.arange(n, device=indices.device).reshape(n, *[1] * (indices.dim() - 1))
    flat_ids = (indices + offsets * num_weights).reshape(-1)
    src = tuple(p.reshape(-1, dim) for p in m)
    if padding_idx is not None and padding_idx >= 0:
        keep = (indices != padding_idx).reshape(-1)
        flat_ids, src = flat_ids[keep], tuple(p[keep] for p in src)
    rows = scatter_into_zeros(sr, (n * num_weights, dim), 0, flat_ids, src, weight.dtype)
    return tuple(p.reshape(n, num_weights, dim) for p in rows)


@per_sample_rule
class EmbeddingFunction(ExtensionFunction):
    """W -> W[indices]; options: (indices, padding_idx). The messages read no weight value."""

    direct_regular_grads = True

    batched_inputs = ()  # the batch is in the indices (options)

    @staticmethod
    def messages(call: BackwardCall) -> tuple[State]:
        (weight,), (indices, padding_idx) = call.inputs, call.options
        sr, (m,) = call.semiring, call.incoming
        return (embedding_messages(sr, m, indices, weight, padding_idx),)

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        """Rows ``[N, num_weights, dim]``: example n's lookups go to rows ``n * num_weights +
        id`` of one scatter."""
        (weight,), (indices, padding_idx) = call.inputs, call.options
        (m,) = call.incoming
        if indices.dim() < 2 or m is None:
            # ids [T] are refused even where T is the batch size: position ids shared by the
            # batch (``arange(T)``) look the same, and their rows would be wrong
            raise PerSampleError(
                "per-sample values: an embedding lookup with ids of shape "
                f"{tuple(indices.shape)} has no batch dim: the ids must be [N, ...] with the "
                "batch first (one id per example: ids[:, None]; ids shared by the batch, such "
                "as positions arange(T): expand them to [N, T])"
            )
        return [embedding_per_sample(call.semiring, m, indices, weight, padding_idx)]

    @staticmethod
    def sites(out: Tensor) -> Sites:
        return (("output", ("batch", "token", "feature")[-out.dim() :]),)


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
    """``F.embedding`` inside ``extend``: each lookup routes its message to its weight row.
    ``max_norm`` renormalises the looked-up rows in place first, as ``F.embedding`` does (a
    sparse table with it fell to the generic rules, which carry no sparse gradient, trial
    122)."""
    if scale_grad_by_freq or not wants_graph(weight):
        # scale_grad_by_freq rescales gradients by a count: the plain ops stay in charge (the
        # generic path then names the problem)
        return F.embedding(
            input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
        )
    if max_norm is not None:
        input = input.contiguous()
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach(), input, max_norm, norm_type)
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return EmbeddingFunction.run(
        lambda w: F.embedding(input, w, padding_idx, sparse=sparse), [weight], (input, padding_idx)
    )
