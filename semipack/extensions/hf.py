"""Hugging Face "eager" attention (QKᵀ / softmax / V by hand) through the fused extension.

A model resolves its attention function with ``ALL_ATTENTION_FUNCTIONS.get_interface(
implementation, default)``, where ``default`` is its own modeling file's eager function (most
are named ``eager_attention_forward``; some files have several, such as a text and a vision
one). While ``extend`` is active, ``get_interface`` hands out that very function wrapped in
``semiring_eager_attention``: it runs as the inner graph (exact regular gradients) of
``AttentionFunction`` (fused semiring backward, named heads and tokens).

The fused backward draws softmax(Q Kᵀ·scale + mask) V. An eager function that computes anything
else runs unwrapped, i.e. through the generic per-op path, which draws whatever it computes:
- dropout in training, and any argument of its own beyond the common ones (a T5 relative
  position bias, soft-capping, a sliding window, attention sinks) given a value;
- a module with attention sinks (read from the module, not passed);
- and, as a check on every wrapped call (``reference_check``), a recorded graph of other ops,
  weights or an output that differ from the reference decomposition computed from the same Q,
  K, V, scale and mask (beyond rounding), or a backward that differs from its backward.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from .attention import AttentionFunction, AttentionSpec

#: The parameters every eager attention function takes; one with any other named parameter
#: (``position_bias``, ``softcap``, ``sliding_window``, ``sinks``) computes something else
#: when that parameter has a value.
_COMMON_PARAMETERS = frozenset(
    ("module", "query", "key", "value", "attention_mask", "scaling", "dropout")
)


@functools.cache
def _own_parameters(eager: Callable[..., Any]) -> tuple[str, ...] | None:
    """The named parameters of ``eager`` beyond the common ones; None where it has no signature
    to read (every keyword may then be one of its own)."""
    try:
        parameters = inspect.signature(eager).parameters.values()
    except (TypeError, ValueError):
        return None
    return tuple(
        p.name
        for p in parameters
        if p.name not in _COMMON_PARAMETERS
        and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    )


def _draws_reference(eager: Callable[..., Any], module: nn.Module, kwargs: dict) -> bool:
    """Whether the call is the reference decomposition as far as its arguments tell."""
    own = _own_parameters(eager)
    names = kwargs if own is None else own
    if any(kwargs.get(name) is not None for name in names):
        return False
    return getattr(module, "sinks", None) is None and kwargs.get("s_aux") is None


def semiring_eager_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    eager: Callable[..., Any],
    **kwargs: Any,
):
    """transformers' "eager" attention inside ``extend``: the model's own eager function
    ``eager`` runs as the inner graph of one fused attention extension, so a Hugging Face model
    gives the same values with eager and sdpa attention. query: ``[batch, heads, tokens,
    head_dim]``; key, value: ``[batch, kv_heads, tokens, head_dim]`` (the eager function
    repeats them for grouped-query attention); returns what ``eager`` returns (output
    ``[batch, tokens, heads, head_dim]`` and weights). Anything else than the reference
    decomposition runs ``eager`` itself (the generic path; see the module docstring)."""

    def run_original(q: Tensor, k: Tensor, v: Tensor):
        return eager(module, q, k, v, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    plain = (dropout > 0.0 and module.training) or not _draws_reference(eager, module, kwargs)
    if plain or not any(t.requires_grad for t in (query, key, value)):
        return run_original(query, key, value)

    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[..., : key.shape[-2]]
    groups = query.shape[-3] // key.shape[-3]

    def inner(q: Tensor, k: Tensor, v: Tensor):
        out, weights = run_original(q, k, v)
        return out.transpose(1, 2), weights  # back to [batch, head, query, dim]

    spec = AttentionSpec(scale=scale, mask=mask, kv_groups=groups, own_code=inner)

    out, weights = AttentionFunction.run(inner, [query, key, value], spec)
    return out.transpose(1, 2).contiguous(), weights


_routed_blocks = 0
_original_get_interface: Any = None
_lock = threading.Lock()


def _routed_get_interface(self: Any, attn_implementation: str, default: Callable) -> Callable:
    """``AttentionInterface.get_interface`` while routed: "eager" gives the model's own eager
    function (``default``) wrapped, unless the registry holds an "eager" entry of its own."""
    found = _original_get_interface(self, attn_implementation, default)
    if attn_implementation == "eager" and found is default and callable(default):
        return functools.partial(semiring_eager_attention, eager=default)
    return found


@contextmanager
def eager_attention_routed() -> Iterator[bool]:
    """Route transformers' eager attention through ``semiring_eager_attention`` for the
    duration of the block.

    ``get_interface`` is a class attribute, so the routing is counted: the first block to
    enter installs it, the last to leave restores the original (blocks in other threads may
    overlap). Only where transformers' models are loaded already (``transformers.modeling_utils``
    imported: every model class imports it): importing transformers for a torchvision model
    made a process's first ``extend`` seconds slower. A transformers model first
    imported inside the block runs its eager attention through the generic rules (the same
    values, without the attention extension's sites and kernels).
    """
    global _routed_blocks, _original_get_interface
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None:  # transformers is optional
        yield False
        return
    with _lock:
        if _routed_blocks == 0:
            _original_get_interface = interface.get_interface
            interface.get_interface = _routed_get_interface
        _routed_blocks += 1
    try:
        yield True
    finally:
        with _lock:
            _routed_blocks -= 1
            if _routed_blocks == 0:
                interface.get_interface = _original_get_interface
                _original_get_interface = None
