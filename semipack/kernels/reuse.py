"""Which results of an earlier pass nothing else holds, so that a new pass may write into their
memory (``transport.backward`` stores an embedding table's readout this way: a fresh table of
tens of megabytes comes from the OS at every allocation, and touching its pages the first time
cost as much as a small model's backward).

A value counts as unheld only when every kind of holder is ruled out: other Python references
(reference counts, measured against a calibrated baseline because they depend on the
interpreter), other tensors on the same TensorImpl (views, graphs that saved it), other owners
of its memory (a tensor built on its storage, the storage object itself), and other processes
(shared memory). ``tests/test_unreached_rows.py`` holds each kind and checks that the old value
survives a new pass.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

#: Attribute name of the probe used to measure the baseline reference counts.
_PROBE = "semipack_probe"


def _attribute_refs(owner: Any, name: str) -> tuple[Any, int]:
    """``owner.name`` and its reference count as seen from here (a calibrated baseline)."""
    value = owner.__dict__.get(name)
    return value, sys.getrefcount(value)


def _item_refs(items: tuple, i: int) -> tuple[Any, int]:
    """``items[i]`` and its reference count as seen from here (a calibrated baseline)."""
    value = items[i]
    return value, sys.getrefcount(value)


def _storage_refs(value: Tensor) -> tuple[Any, int]:
    """``value``'s storage object and its reference count as seen from here. PyTorch keeps one
    Python object per storage, so a user who holds the storage (``untyped_storage()``) holds
    this very object: only its reference count shows it."""
    storage = value.untyped_storage()
    return storage, sys.getrefcount(storage)


@contextlib.contextmanager
def calibrating() -> Iterator[None]:
    """The state reference counts are calibrated in: no trace or profile function (a tracer
    that reads a frame's locals holds one more reference to each: a baseline measured under
    one would count a held value as alone once it is gone), no torch function or dispatch
    mode, gradients on, outside inference mode and anomaly detection (semipack may be imported
    under any of them)."""
    trace, profile = sys.gettrace(), sys.getprofile()
    sys.settrace(None)
    sys.setprofile(None)
    try:
        with (
            _disable_current_modes(),
            torch._C.DisableTorchFunction(),
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autograd.set_detect_anomaly(False),
        ):
            yield
    finally:
        sys.settrace(trace)
        sys.setprofile(profile)


def _baseline_refs() -> tuple[int, int, int]:
    """The counts of ``_attribute_refs``, ``_item_refs`` and ``_storage_refs`` for objects with
    no other holder (measured, not assumed: they depend on the interpreter)."""
    owner = torch.empty(0)
    setattr(owner, _PROBE, torch.empty(1))
    _, attribute = _attribute_refs(owner, _PROBE)
    _, item = _item_refs((torch.empty(0),), 0)
    _, storage = _storage_refs(torch.empty(1))
    return attribute, item, storage


with calibrating():
    _ALONE_AS_ATTRIBUTE, _ALONE_AS_ITEM, _ALONE_STORAGE = _baseline_refs()


def _base_refs(view: Tensor) -> tuple[Tensor, int]:
    """``view``'s base tensor and its reference count as seen from here (a calibrated
    baseline): PyTorch keeps one Python object per tensor, so a holder of the base in Python
    holds this very object."""
    base = view._base
    return base, sys.getrefcount(base)


def _view_baseline() -> tuple[int, int]:
    """The counts of ``_base_refs`` and of the base's owners (``_use_count``) for a view whose
    base nothing else holds: the view's own record of its base, and the object made here."""
    view = torch.empty(4).view(2, 2)
    base, refs = _base_refs(view)
    return refs, base._use_count()


with calibrating():
    _ALONE_BASE_REFS, _ALONE_BASE_USES = _view_baseline()


def _alone(
    value: Any, refs: int, baseline: int, other_processes: bool = True, views: bool = False
) -> bool:
    """Whether no one but its holder can reach ``value``: no other Python reference, no other
    owner of the tensor (a graph that saved it), no other owner of its memory (another tensor
    on it, a holder of its storage object) and, with ``other_processes``, no other process
    (shared memory, as a ``torch.multiprocessing`` queue leaves a tensor it sent; PyTorch
    reports every CUDA tensor as shared). With ``views``, a view counts when its base is held
    by nothing but the view (a backward formula's reshaped result): its memory has no other
    owner (PyTorch's engine counts a view as shared, and ``held_only_by`` follows it). Memory
    PyTorch did not allocate (``torch.from_numpy``, ``torch.frombuffer``) never counts."""
    if type(value) is not Tensor or refs > baseline or value._use_count() != 1:
        return False
    if value.layout != torch.strided:  # a sparse gradient: no storage of its own to ask about
        return False
    # the storage's own check: ``Tensor.is_shared`` answers the same through a TypedStorage
    # made for the call (3 us against 0.3, for every parameter's readout of every pass)
    if other_processes and value.untyped_storage().is_shared():
        return False
    owners = 2  # the tensor and, while held here, its storage object
    if value._base is not None:
        if not views:
            return False
        base, base_refs = _base_refs(value)
        if base_refs > _ALONE_BASE_REFS or base._use_count() > _ALONE_BASE_USES:
            return False
        del base
        owners = 3  # and the base, which only the view holds
    storage, storage_refs = _storage_refs(value)  # one more owner of the memory while held here
    return (
        storage_refs <= _ALONE_STORAGE
        and torch._C._storage_Use_Count(storage._cdata) <= owners
        # memory from outside PyTorch's allocator (numpy, a buffer, DLPack): its maker holds it
        and storage.resizable()
    )


def alone_in_attribute(owner: Any, name: str) -> bool:
    """Whether ``owner.<name>`` is a tensor nothing but ``owner`` holds, in this process or
    another (``_alone``): one a new value may be written into."""
    value, refs = _attribute_refs(owner, name)
    return _alone(value, refs, _ALONE_AS_ATTRIBUTE, views=True)


def alone_in_items(owner: Any, name: str) -> list[bool]:
    """For ``owner.<name>``, a tuple nothing but ``owner`` holds: whether each item is a tensor
    nothing but the tuple holds (``_alone``); all False for a tuple held elsewhere."""
    items, refs = _attribute_refs(owner, name)
    if type(items) is not tuple:
        return []
    if refs > _ALONE_AS_ATTRIBUTE:
        return [False] * len(items)
    del items
    items = owner.__dict__[name]
    out = []
    for i in range(len(items)):
        value, refs = _item_refs(items, i)
        out.append(_alone(value, refs, _ALONE_AS_ITEM, views=True))
    return out


def unheld_value(t: Tensor, name: str) -> Any:
    """``t.<name>`` (a readout from an earlier pass) where nothing but ``t`` holds it: a new
    readout may then be written into its memory, as PyTorch reuses a gradient's buffer.
    Otherwise ``None`` (and a tuple of readouts gets ``None`` for each one held elsewhere)."""
    value, refs = _attribute_refs(t, name)
    if isinstance(value, tuple):  # a Product's readouts, ``Entropy(flow=True)``'s pair
        return _unheld_items(value) if refs <= _ALONE_AS_ATTRIBUTE else None
    return value if _alone(value, refs, _ALONE_AS_ATTRIBUTE) else None


def _unheld_items(value: tuple) -> tuple | None:
    """A tuple readout with each item that nothing else holds (a tensor, or a tuple of them in
    turn) and None for the others; None for a tuple type other than a plain or named tuple."""
    if type(value) is not tuple and not hasattr(type(value), "_fields"):
        return None
    items = []
    for i in range(len(value)):
        item, refs = _item_refs(value, i)
        if isinstance(item, tuple):
            items.append(_unheld_items(item) if refs <= _ALONE_AS_ITEM else None)
        else:
            items.append(item if _alone(item, refs, _ALONE_AS_ITEM) else None)
    return tuple(items) if type(value) is tuple else type(value)(*items)


def held_only_by(t: Any, name: str) -> bool:
    """Whether ``t.<name>`` is a tensor that nothing in this process holds but ``t`` (Python
    references, other tensors on it or on its memory), as PyTorch's engine asks of a gradient
    before adding another into its buffer. Other processes are not asked about: only for
    decisions that write nothing (a layout), never for writing into the memory."""
    value, refs = _attribute_refs(t, name)
    return _alone(value, refs, _ALONE_AS_ATTRIBUTE, other_processes=False)


def same_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are tensors on the same memory (a value written into the other,
    or one that is the other)."""
    return (
        isinstance(a, Tensor)
        and isinstance(b, Tensor)
        and a.layout == b.layout == torch.strided  # a sparse tensor has no storage to compare
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )
