"""Forms of model weights derived for a semiring product (log|W|, |W| log|W|), kept across
backward passes and recomputed only when a weight's contents change.

Why: every semiring backward contracts the messages with each weight matrix, and the semiring
first lifts it (MaxProd takes log|W|, Entropy |W| and |W| log|W|). On a short input, one sentence
or one image, these passes over the weights cost as much as the products themselves: a MiniLM
feed-forward weight's log|W| took 0.76 ms, its max-plus product with a 20-token message 0.92 ms
(``benchmarks/bench_kernel_costs.py``).

What is kept: derived forms of the tensors ``watch`` names (``extend`` names the model's
parameters at every backward) and of views that hold exactly their entries in another order
(``W.T``, as GPT-2's ``Conv1D`` and tied output layers use their weights); any other tensor
(an activation, a slice of a weight) is computed as before.

When an entry is reused: when a 256-bit fingerprint of the weight's bytes (``fingerprint.c``,
one read at memory speed, certain to change with any single changed word) equals the one taken
when the entry was made. Version counters would be cheaper but are not enough: writes through
``p.data`` (hand-written optimizer steps, weight clipping) leave ``p._version`` unchanged, and a
stale log|W| would give wrong semiring values without any error. Without the native library
nothing is kept.

Memory: at most ``max_bytes`` (default 1 GiB, ``SEMIPACK_WEIGHT_CACHE_MB`` or
:func:`set_weight_cache_bytes`). A new entry replaces entries no pass has used since the last
``watch``, oldest first; when those do not make room, it is not kept (a model larger than the
budget keeps its first weights instead of cycling through all of them). An entry lives no
longer than the parameter it was made from: deleting the model frees its forms.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import Tensor

from .native import fingerprint, no_nan_or_posinf

T = TypeVar("T")

DEFAULT_MAX_BYTES = int(float(os.environ.get("SEMIPACK_WEIGHT_CACHE_MB", "1024")) * 2**20)


@dataclass
class _Entry:
    fingerprint: tuple[int, ...]
    value: Any
    nbytes: int
    generation: int
    owner: tuple  # the location of the watched tensor it was made from
    #: forms computed from the value itself (``WeightCache.kept_form``), by kind and view
    forms: dict[tuple, Any] = field(default_factory=dict)


def _tensors_of(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for v in value for t in _tensors_of(v)]
    return []


def _nbytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _location(t: Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _layout(t: Tensor) -> list[tuple[int, int]]:
    """(stride, size) of the dims with more than one entry, sorted: two tensors at the same
    address with the same layout hold the same entries (a permutation of dims keeps it)."""
    return sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1)


class WeightCache:
    """Derived forms of watched weights, reused while the weights' bytes stay the same.

    A value handed out is shared with later passes: callers must only read it.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently used first
        #: location -> the watched tensor there (weakly: the cache must not keep it alive)
        self._watched: dict[tuple, weakref.ref[Tensor]] = {}
        #: address -> locations of the watched tensors there, for views of them
        self._by_address: dict[int, list[tuple]] = {}
        self._finalizers: dict[tuple, weakref.finalize] = {}  # per location with entries
        #: location -> its fingerprint, taken once per generation: the forms of one weight
        #: (Entropy's magnitudes, a lift, LogSum's edge columns) share one read of its bytes
        self._stamps: dict[tuple, tuple[int, ...] | None] = {}
        #: id of each tensor an entry's value holds -> the entry's key (``kept_form``)
        self._holders: dict[int, tuple] = {}
        self._generation = 0
        self._bytes = 0
        self._lock = threading.RLock()  # a finalizer may run inside a locked region

    @property
    def nbytes(self) -> int:
        """Bytes held by the entries."""
        return self._bytes

    def watch(self, tensors: Iterable[Tensor]) -> None:
        """From now on, keep derived forms of ``tensors`` (and no others); starts a new
        generation for the eviction rule."""
        with self._lock:
            self._drop_moved()
            self._watched = {_location(t): weakref.ref(t) for t in tensors}
            self._by_address = {}
            for location in self._watched:
                self._by_address.setdefault(location[0], []).append(location)
            self._generation += 1
            self._stamps = {}

    def unwatch(self) -> None:
        """End of a pass: keep forms of no tensor, and forget the pass's fingerprints (a weight
        may change before the next pass)."""
        with self._lock:
            self._watched = {}
            self._by_address = {}
            self._stamps = {}

    @contextlib.contextmanager
    def watching(self, tensors: Iterable[Tensor]) -> Iterator[None]:
        """``watch(tensors)`` for the block (one backward pass), ``unwatch()`` after it."""
        self.watch(tensors)
        try:
            yield
        finally:
            self.unwatch()

    def derived(self, w: Tensor, kind: Hashable, make: Callable[[], T]) -> T:
        """``make()``, a form of ``w`` named ``kind``: the kept one while ``w``'s bytes are
        unchanged, else computed (and kept when ``w`` is watched and there is room)."""
        if self.max_bytes <= 0 or not self._watched:
            return make()
        location = _location(w)
        owner = location if location in self._watched else self._owner_of(w)
        if owner is None:
            return make()
        key = (kind, *location)
        if owner in self._stamps:
            stamp = self._stamps[owner]
        else:
            held = self._watched[owner]()
            stamp = None if held is None else fingerprint(held)
        self._stamps[owner] = stamp
        if stamp is None:
            return make()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.fingerprint == stamp and entry.owner == owner:
                entry.generation = self._generation
                self._entries.move_to_end(key)
                return entry.value
        value = make()
        self._keep(key, _Entry(stamp, value, _nbytes(value), self._generation, owner))
        return value

    def _owner_of(self, view: Tensor) -> tuple | None:
        """The location of the watched tensor whose entries ``view`` holds, all of them and
        no others, in some order (``W.T``, ``W.permute(...)``); None for anything else."""
        candidates = self._by_address.get(view.data_ptr(), ())
        for location in candidates:
            held = self._watched[location]()
            if (
                held is not None
                and held.dtype == view.dtype
                and held.device == view.device
                and held.numel() == view.numel()
                and _layout(held) == _layout(view)
            ):
                return location
        return None

    def _forget(self, location: tuple) -> None:
        """Drop every entry made from the tensor at ``location`` (it was freed)."""
        with self._lock:
            self._finalizers.pop(location, None)
            for key in [k for k, e in self._entries.items() if e.owner == location]:
                self._remove(key)

    def _drop_moved(self) -> None:
        """Drop the entries of tensors that now live elsewhere: ``p.data = p.data - lr * g``
        gives a parameter new memory at every step, and the forms made at the old location can
        never be read again (without this they piled up to the whole budget)."""
        for location, finalizer in list(self._finalizers.items()):
            alive = finalizer.peek()
            if alive is not None and _location(alive[0]) != location:
                finalizer.detach()
                self._forget(location)

    def _tie_to_owner(self, location: tuple) -> None:
        """Make the entries at ``location`` end with the tensor they were made from."""
        if location in self._finalizers:
            return
        ref = self._watched.get(location)
        owner = None if ref is None else ref()
        if owner is not None:
            self._finalizers[location] = weakref.finalize(owner, self._forget, location)

    def _keep(self, key: tuple, entry: _Entry) -> None:
        with self._lock:
            if key in self._entries:
                self._remove(key)
            room = self.max_bytes - self._bytes
            if entry.nbytes > room:
                idle = [k for k, e in self._entries.items() if e.generation < self._generation]
                freed, victims = 0, []
                for k in idle:  # oldest first
                    if room + freed >= entry.nbytes:
                        break
                    victims.append(k)
                    freed += self._entries[k].nbytes
                if room + freed < entry.nbytes:
                    return
                for k in victims:
                    self._remove(k)
            self._entries[key] = entry
            self._bytes += entry.nbytes
            for t in _tensors_of(entry.value):
                self._holders[id(t)] = key
            self._tie_to_owner(entry.owner)

    def _remove(self, key: tuple) -> _Entry:
        """Take the entry at ``key`` out, with its bytes and its values' ids."""
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        for t in _tensors_of(entry.value):
            if self._holders.get(id(t)) == key:
                del self._holders[id(t)]
        return entry

    def kept_form(self, t: Tensor, kind: Hashable, make: Callable[[], T]) -> T:
        """``make()``, a form named ``kind`` of ``t``: a value this cache handed out, or a view
        of one (the packed panels of ``log|W|.T``, its column maxima, whether it holds NaN).

        Why: a kept value is read-only and lives as long as its entry, so what a kernel
        computes from it alone is the same at every pass until the weight changes (then
        ``derived`` makes a new value, and its entry replaces this one with its forms). Kept
        with the entry, counted in its bytes, while there is room; anything else (an
        activation, a value written to since) is computed each time.
        """
        with self._lock:
            for root in (t, t._base):
                key = None if root is None else self._holders.get(id(root))
                entry = None if key is None else self._entries.get(key)
                if entry is not None and any(v is root for v in _tensors_of(entry.value)):
                    break
            else:
                return make()
            # the view's place in the value, and the value's version: a write into the value
            # (which callers must not do) would make the form a new one, not a stale one
            view = (kind, t.storage_offset(), tuple(t.shape), tuple(t.stride()), root._version)
            if view in entry.forms:
                return entry.forms[view]
        value = make()
        nbytes = _nbytes(value)
        with self._lock:
            if self._entries.get(key) is entry and self._bytes + nbytes <= self.max_bytes:
                entry.forms[view] = value
                entry.nbytes += nbytes
                self._bytes += nbytes
        return value

    def clear(self) -> None:
        """Drop every entry (their memory is freed once no pass uses them)."""
        with self._lock:
            self._entries.clear()
            self._holders.clear()
            self._bytes = 0
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()


#: The process's cache, shared by every ``extend`` block.
WEIGHTS = WeightCache()


def no_nan_or_posinf_kept(*tensors: Tensor) -> bool:
    """``native.no_nan_or_posinf(*tensors)``, the check of a kept weight form (or a view of
    one) made once while it is kept: a reduction over the whole weight at every product."""
    return all(WEIGHTS.kept_form(t, "finite", lambda t=t: no_nan_or_posinf(t)) for t in tensors)


def set_weight_cache_bytes(max_bytes: int) -> None:
    """Cap the memory of kept weight forms, in bytes (public as
    ``semipack.set_weight_cache_bytes``; 0 turns keeping off). What is kept beyond the new cap
    is dropped."""
    WEIGHTS.max_bytes = int(max_bytes)
    if WEIGHTS.nbytes > WEIGHTS.max_bytes:  # over the new budget: start again
        WEIGHTS.clear()
