"""Lifted parameters kept from one backward pass to the next.

Every semiring matrix product against a weight needs the weight lifted (``log|W|`` for the
log-space semirings); the weight does not change between two backward passes of an analysis,
and changes only through ``optimizer.step()`` in training. ``cached_lift`` wraps a semiring's
``lift`` so that a parameter (or a view of one, such as the ``W.t()`` a generic ``addmm`` rule
sees) is lifted once and reused until the parameter changes.

A cached entry is valid while the parameter's version counter (bumped by every in-place update,
``optimizer.step()`` and ``load_state_dict`` included) and its data pointer (changed by
``p.data = ...``) are those it was computed for, so training stays exact. Entries are built in
inference mode: an op rule that tried to write into a cached lifted weight would fail loudly
("Inplace update to inference tensor") instead of corrupting the next pass. The cache holds one
lifted copy per parameter and semiring configuration, freed with the parameter or by
``clear_lift_cache()``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["cached_lift", "clear_lift_cache", "detached_parameter"]

#: id(parameter) -> {(semiring key, view geometry): ((version, data pointer), lifted state)}.
#: Keyed by id, not a WeakKeyDictionary (tensors compare elementwise); a finalizer drops the
#: entry when the parameter is freed, before its id can be reused.
_CACHE: dict[int, dict[tuple, tuple[tuple[int, int], Any]]] = {}


def _entries(owner: Tensor) -> dict[tuple, tuple[tuple[int, int], Any]]:
    """The cache entries of ``owner``, created (with the finalizer) on first use."""
    entries = _CACHE.get(id(owner))
    if entries is None:
        entries = _CACHE[id(owner)] = {}
        weakref.finalize(owner, _CACHE.pop, id(owner), None)
    return entries


def clear_lift_cache() -> None:
    """Drop every cached lifted parameter (memory comes back; the next pass lifts again)."""
    _CACHE.clear()


#: Attribute on a detached alias naming the parameter it aliases (see ``detached_parameter``).
_ALIAS_OF = "_semipack_alias_of"


def detached_parameter(t: Tensor) -> Tensor:
    """``t.detach()``, remembering the parameter it aliases when ``t`` is one: extensions hand
    their messages detached inputs, and the cache must still know a weight from an activation.
    """
    alias = t.detach()
    if isinstance(t, nn.Parameter):
        setattr(alias, _ALIAS_OF, t)
    return alias


def _owning_parameter(w: Tensor) -> Tensor | None:
    """The parameter ``w`` is, aliases or is a view of; None for anything else (activations
    change every pass and are never cached)."""
    if isinstance(w, nn.Parameter):
        return w
    owner = getattr(w, _ALIAS_OF, None)
    if owner is not None:
        return owner
    base = w._base
    return base if isinstance(base, nn.Parameter) else None


def _semiring_key(sr: Any) -> Hashable | None:
    """The semiring's class and configuration (its attributes but the pass trace), or None
    when some attribute is not hashable (then nothing is cached)."""
    config = tuple(sorted((k, v) for k, v in vars(sr).items() if k != "trace"))
    try:
        hash(config)
    except TypeError:
        return None
    return (type(sr), config)


def cached_lift(lift: Callable[[Any, Tensor], Any]) -> Callable[[Any, Tensor], Any]:
    """``lift`` with parameters served from the cache (see the module docstring)."""

    @functools.wraps(lift)
    def lift_with_cache(self: Any, w: Tensor) -> Any:
        owner = _owning_parameter(w)
        if owner is None or (torch.is_grad_enabled() and w.requires_grad):
            return lift(self, w)
        semiring = _semiring_key(self)
        if semiring is None:
            return lift(self, w)
        key = (semiring, w.dtype, w.device, tuple(w.shape), w.stride(), w.storage_offset())
        version = (owner._version, owner.data_ptr())
        entries = _entries(owner)
        hit = entries.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        with torch.inference_mode():
            state = lift(self, w.detach())
        entries[key] = (version, state)
        return state

    lift_with_cache._cached = True
    return lift_with_cache
