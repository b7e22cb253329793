"""Hugging Face "eager" attention (QKᵀ / softmax / V by hand) through the fused extension.

transformers resolves attention functions through ``ALL_ATTENTION_FUNCTIONS``; "eager" is not in
that registry, so each model falls back to the ``eager_attention_forward`` of its own modeling
file. While ``extend`` is active we register an "eager" entry that runs the model's own eager
function as the inner graph (exact regular gradients) inside ``AttentionFunction`` (fused
semiring backward, named heads and tokens). Anything the reference decomposition does not
describe (attention dropout in training, soft-capping, sliding windows, attention sinks) runs the
model's own function unchanged, i.e. through the generic per-op path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from .attention import AttentionFunction, AttentionSpec

_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks")


def _own_eager(module: nn.Module):
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def semiring_eager_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
):
    """transformers' "eager" attention interface inside ``extend``: the model's own
    ``eager_attention_forward`` runs as the inner graph of one fused attention extension, so a
    Hugging Face model gives the same values with eager and sdpa attention. query:
    ``[batch, heads, tokens, head_dim]``; key, value: ``[batch, kv_heads, tokens, head_dim]``
    (the eager function repeats them for grouped-query attention); returns what the model's
    eager function returns (output ``[batch, tokens, heads, head_dim]`` and weights). Dropout in
    training and unsupported keyword arguments run the original function (the generic path)."""
    original = _own_eager(module)
    if original is None:
        raise RuntimeError(
            f"semipack: {type(module).__name__} resolved 'eager' attention but its modeling "
            "file has no eager_attention_forward"
        )

    def run_original(q: Tensor, k: Tensor, v: Tensor):
        return original(module, q, k, v, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    plain = (dropout > 0.0 and module.training) or any(
        kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS
    )
    if plain or not any(t.requires_grad for t in (query, key, value)):
        return run_original(query, key, value)

    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[..., : key.shape[-2]]
    groups = getattr(module, "num_key_value_groups", 1) or 1
    spec = AttentionSpec(scale=scale, mask=mask, kv_groups=groups)

    def inner(q: Tensor, k: Tensor, v: Tensor):
        out, weights = run_original(q, k, v)
        return out.transpose(1, 2), weights  # back to [batch, head, query, dim]

    out, weights = AttentionFunction.run(inner, [query, key, value], spec)
    return out.transpose(1, 2).contiguous(), weights


_routed_blocks = 0
_previous_eager: Any = None
_MISSING = object()
_lock = threading.Lock()


@contextmanager
def eager_attention_routed() -> Iterator[bool]:
    """Register the semiring eager attention with transformers for the duration of the block.

    The registry is global, so the registration is counted: the first block to enter installs
    it, the last to leave restores what was there (blocks in other threads may overlap).
    """
    global _routed_blocks, _previous_eager
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # transformers is optional
        yield False
        return
    mapping = AttentionInterface._global_mapping
    with _lock:
        if _routed_blocks == 0:
            _previous_eager = mapping.get("eager", _MISSING)
            mapping["eager"] = semiring_eager_attention
        _routed_blocks += 1
    try:
        yield True
    finally:
        with _lock:
            _routed_blocks -= 1
            if _routed_blocks == 0:
                if _previous_eager is _MISSING:
                    mapping.pop("eager", None)
                else:
                    mapping["eager"] = _previous_eager
                _previous_eager = None
