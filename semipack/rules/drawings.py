"""Drawings: how composite functions are drawn as graphs (``semipack.extend(drawing=...)``).

Every semiring other than Real depends on the drawing (README "Semantics"). Two are offered:

- ``"atomic"`` (the default): softmax and log_softmax are one op each, contributing their own
  Jacobian entries. For softmax, the edge from score ``s_j`` to probability ``p_i`` weighs
  ``p_i (δ_ij - p_j)``: a query's path through the key that wins the attention has weight
  ``p (1 - p)``, which vanishes as attention sharpens.
- ``"decomposed"``: softmax is drawn as ``exp(s - logsumexp(s))`` and log_softmax as
  ``s - logsumexp(s)``, with log-sum-exp as one op (no max-shift artefacts: the shift PyTorch
  uses inside logsumexp is part of that op). The direct edge from ``s_i`` to ``p_i`` now weighs
  ``p_i`` and the path through the log-sum-exp ``-p_i p_j``, as in the paper's framework.
  Cross-entropy is drawn on the decomposed log_softmax, and scaled dot-product attention as its
  reference decomposition with the decomposed softmax.

The decomposed drawing changes the forward's arithmetic, not its function: values and regular
gradients equal the atomic ones up to rounding (``exp(s - lse)`` is not bit for bit
``softmax(s)``). Attention extensions (which compute the atomic drawing's messages in fused
kernels) step aside under it; ``semipack.extend`` takes care of that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import SemipackError
from ..graph.saved_inputs import run_recording_inputs
from .attention import attention_scores

#: The drawings ``semipack.extend`` accepts.
DRAWINGS = ("atomic", "decomposed")

_softmax, _log_softmax = torch.softmax, torch.log_softmax


def decomposed_log_softmax(
    input: Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> Tensor:
    """``input - logsumexp(input, dim)``: log_softmax drawn with log-sum-exp as one op."""
    if dim is None:
        raise SemipackError("log_softmax needs an explicit dim under the decomposed drawing")
    x = input if dtype is None else input.to(dtype)
    return x - torch.logsumexp(x, dim, keepdim=True)


def decomposed_softmax(
    input: Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> Tensor:
    """``exp(input - logsumexp(input, dim))``: softmax drawn through log-sum-exp. The exp's
    input is recorded (as the mode records any exp), so its edge weights stay exact in float32.
    A row whose every entry is ``-inf`` gives NaN here as in a plain run of this expression;
    PyTorch's softmax gives NaN there too."""
    return run_recording_inputs(torch.exp, (decomposed_log_softmax(input, dim, dtype=dtype),), {})


def _tensor_method(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``x.softmax(dim, dtype=...)`` has no ``_stacklevel`` argument: map it onto ``function``."""

    def method(self: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
        return function(self, dim, dtype=dtype)

    return method


def decomposed_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` as ``nll_loss`` of the decomposed log_softmax (class targets) or
    ``-(target * log_softmax)`` summed over classes (probability targets)."""
    if size_average is not None or reduce is not None:
        raise SemipackError("the decomposed drawing needs reduction=, not size_average/reduce")
    if label_smoothing != 0.0:
        raise SemipackError(
            "the decomposed drawing of cross_entropy does not support label_smoothing; use the "
            "atomic drawing or write the smoothed loss out of log_softmax"
        )
    class_dim = 1 if input.dim() > 1 else 0
    log_probs = decomposed_log_softmax(input, class_dim)
    if not target.is_floating_point():
        return F.nll_loss(log_probs, target, weight, ignore_index=ignore_index, reduction=reduction)
    if weight is not None:
        shape = [1] * input.dim()
        shape[class_dim] = -1
        log_probs = log_probs * weight.reshape(shape)
    per_entry = -(target * log_probs).sum(class_dim)
    if reduction == "mean":
        return per_entry.sum() / (per_entry.numel() if per_entry.dim() else 1)
    return per_entry.sum() if reduction == "sum" else per_entry


def decomposed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` as its reference decomposition with the decomposed
    softmax: ``P = exp(S - logsumexp(S))``, ``S = Q Kᵀ · scale (+ mask)``, ``out = P V``.
    Query ``[..., L, E]``, key ``[..., S, E]``, value ``[..., S, Ev]``; a boolean mask keeps
    ``True`` entries. Dropout would need the fused kernel's own mask and is refused."""
    if dropout_p > 0.0:
        raise SemipackError(
            "scaled_dot_product_attention with dropout_p > 0 cannot be drawn decomposed (the "
            "kernel samples its own mask); use eval mode or the atomic drawing"
        )
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, -3)
        value = value.repeat_interleave(groups, -3)
    factor = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = attention_scores(query, key, attn_mask, is_causal, factor)
    return decomposed_softmax(scores, -1) @ value


def _multi_head_attention_undrawable(*args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` calls softmax from inside a torch function, where the
    routing mode cannot see it: rather than silently keep the atomic drawing, refuse."""
    if not torch.is_grad_enabled():
        return F.multi_head_attention_forward(*args, **kwargs)
    raise SemipackError(
        "nn.MultiheadAttention (F.multi_head_attention_forward) cannot be drawn decomposed: its "
        "softmax runs inside a fused torch function. Use the atomic drawing, or write the "
        "attention with F.scaled_dot_product_attention or an explicit softmax"
    )


#: torch function -> its decomposed drawing, routed inside ``extend(drawing="decomposed")``.
DECOMPOSED_ROUTES: dict[Callable[..., Any], Callable[..., Any]] = {
    torch.softmax: lambda input, dim, dtype=None: decomposed_softmax(input, dim, dtype=dtype),
    torch.special.softmax: lambda input, dim, dtype=None: decomposed_softmax(
        input, dim, dtype=dtype
    ),
    F.softmax: decomposed_softmax,
    torch.Tensor.softmax: _tensor_method(decomposed_softmax),
    torch.log_softmax: lambda input, dim, dtype=None: decomposed_log_softmax(
        input, dim, dtype=dtype
    ),
    torch.special.log_softmax: lambda input, dim, dtype=None: decomposed_log_softmax(
        input, dim, dtype=dtype
    ),
    F.log_softmax: decomposed_log_softmax,
    torch.Tensor.log_softmax: _tensor_method(decomposed_log_softmax),
    F.cross_entropy: decomposed_cross_entropy,
    F.scaled_dot_product_attention: decomposed_attention,
    F.multi_head_attention_forward: _multi_head_attention_undrawable,
}


def drawing_routes(drawing: str) -> dict[Callable[..., Any], Callable[..., Any]]:
    """The forward routes a drawing adds (none for the atomic drawing); a ValueError names the
    drawings on offer for anything else."""
    if drawing not in DRAWINGS:
        raise ValueError(f"unknown drawing {drawing!r}: choose one of {', '.join(DRAWINGS)}")
    return dict(DECOMPOSED_ROUTES) if drawing == "decomposed" else {}
