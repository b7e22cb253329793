"""Ops that move message entries without combining them: views, copies, concatenation, selection.

Moving a message entry is exact in every semiring, so these rules run the op on each state
component. Ops that create fresh entries (zero-filled gradients, padding) fill them with the
semiring's zero, never with a literal 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..errors import MessageLostError
from ..graph.provenance import current_site
from ..messages import OpCall, per_component, register_rule, wrap_outputs
from ..messages.message import Message, map_arguments

aten = torch.ops.aten

VIEW_LIKE = [
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.squeeze,
    aten.unsqueeze.default,
    aten.select.int,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unsafe_split.Tensor,
    aten.unbind.int,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.flip.default,
    aten.roll.default,
    aten.rot90.default,
    aten.diagonal.default,
    aten.repeat.default,
    aten.unfold.default,
    aten.index.Tensor,
    aten.index_select.default,
    aten.gather.default,
    aten.lift_fresh.default,
    aten.pixel_shuffle.default,
    aten.pixel_unshuffle.default,
    aten.channel_shuffle.default,  # ShuffleNet; its backward is another channel_shuffle
    aten.native_channel_shuffle.default,
]


@register_rule(*VIEW_LIKE)
def move_entries(call: OpCall):
    """Ops that only move, copy or drop entries (views, permutes, expand, index,
    gather, unfold, pixel and channel shuffles): each output entry has one edge of weight 1 from
    the input entry it comes from, so every state component goes through the same op."""
    regular, outs = per_component(call, ("self",))
    return wrap_outputs(call, regular, outs)


@register_rule(aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default)
def reshape(call: OpCall):
    """State components need not share the regular gradient's strides, so they reshape
    (copying only when a view is impossible) where the gradient views."""
    msg, size = call["self"], call["size"]
    return call.wrap(call.run_regular(), tuple(p.reshape(size) for p in msg.parts))


@register_rule(aten.cat.default, aten.stack.default)
def concatenate(call: OpCall):
    """cat and stack: each output entry comes from one entry of one input; per component."""
    regular, outs = per_component(call, ("tensors",))
    return wrap_outputs(call, regular, outs)


@register_rule(
    aten.select_scatter.default,
    aten.slice_scatter.default,
    aten.diagonal_scatter.default,
    aten.scatter.src,
)
def overwrite_entries(call: OpCall):
    """Writing ``src`` into a slice, a selection, a diagonal or scattered positions of
    ``self``: every output entry has one edge, from ``self`` or from ``src``; per component."""
    regular, outs = per_component(call, ("self", "src"))
    return wrap_outputs(call, regular, outs)


@register_rule(aten.masked_scatter.default)
def masked_scatter(call: OpCall):
    """``self.masked_scatter(mask, source)``: entries under the mask come from ``source``
    (row-major), the others from ``self``; per component."""
    regular, outs = per_component(call, ("self", "source"))
    return wrap_outputs(call, regular, outs)


def _select_padded(part: Tensor, mask: Tensor, sizes: tuple[int, ...], zero: object) -> Tensor:
    """``part[mask]`` in row-major order, padded with ``zero`` to ``prod(sizes)`` entries and
    shaped ``sizes``. ``mask`` broadcasts against ``part``; at most ``prod(sizes)`` are True."""
    selected = part.masked_select(mask)
    missing = math.prod(sizes) - selected.numel()
    if missing > 0:
        fill = torch.full((missing,), zero, dtype=part.dtype, device=part.device)
        selected = torch.cat([selected, fill])
    return selected.reshape(sizes)


@register_rule(aten.masked_scatter_backward.default)
def masked_scatter_backward(call: OpCall):
    """The message to ``source`` of ``self.masked_scatter(mask, source)``.

    The k-th True entry of the mask (row-major) was taken from ``source.flatten()[k]``: that
    source entry has one edge of weight 1 from it. Source entries past the number of True
    entries were never used, so their message is the semiring's zero ("no path"), not a
    literal 0. ``grad_output``: the output's shape; ``mask``: broadcastable to it; result:
    ``sizes`` (the source's shape).
    """
    msg, mask, sizes = call["grad_output"], call["mask"], tuple(call["sizes"])
    parts = tuple(
        _select_padded(p, mask, sizes, z)
        for p, z in zip(call.state(msg), call.semiring.zero, strict=True)
    )
    return call.wrap(call.run_regular(), parts)


@register_rule(aten.tril.default, aten.triu.default)
def triangle(call: OpCall):
    """Entries outside the triangle become "no path", not a literal 0."""
    msg = call["self"]
    rows, cols = msg.shape[-2:]
    keep = torch.ones(rows, cols, dtype=torch.bool, device=msg.device)
    keep = (
        keep.tril(call["diagonal"])
        if call.func is aten.tril.default
        else keep.triu(call["diagonal"])
    )
    zeros = call.zeros(msg.shape)
    return call.wrap(call.run_regular(), call.semiring.where(keep, msg.parts, zeros))


@register_rule(aten.where.self)
def where(call: OpCall):
    """``where(cond, self, other)``: each entry comes from one of the two; per component."""
    regular, outs = per_component(call, ("self", "other"))
    return wrap_outputs(call, regular, outs)


@register_rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(call: OpCall):
    """``grad.masked_fill(mask, 0)``, as backward formulas write it: masked entries have no
    path (the semiring's zero). Any other fill value has no semiring meaning and is refused."""
    value = call["value"]
    value = value.item() if isinstance(value, Tensor) else value
    if value != 0:
        raise call.error("masked_fill of a message with a non-zero value")
    msg, mask = call["self"], call["mask"]
    parts = tuple(
        p.masked_fill(mask, z) for p, z in zip(msg.parts, call.semiring.zero, strict=True)
    )
    return call.wrap(call.run_regular(), parts)


@register_rule(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(call: OpCall):
    """``grad.index_fill(dim, index, 0)``: the message to ``self`` of ``index_copy`` and
    ``index_fill``. The overwritten slices have no path to ``self``: they get the semiring's
    zero. Filling with any other value has no semiring meaning and is refused; a message as
    the value is ``_message_filled``."""
    if isinstance(call["value"], Message):
        return _message_filled(call)
    return _zero_filled(call, "index_fill", Tensor.index_fill)


def _message_filled(call: OpCall):
    """``base.index_fill(dim, index, m)`` with a message ``m`` of one entry: ``trace``'s
    backward writes its incoming message into the diagonal of a zero tensor this way. Each
    filled entry is ``m`` (an edge of weight 1 from the one output), every other entry is
    ``base``'s: a message, or a plain tensor of exact zeros (no path). A plain base with other
    values would add a constant to a message, which no semiring draws: refused."""
    value, base, dim, index = call["value"], call["self"], call["dim"], call["index"]
    if isinstance(base, Message):
        parts = base.parts
    elif bool((base == 0).all()):
        parts = call.zeros(base.shape)
    else:
        raise call.error("index_fill of a message into a tensor with non-zero values")
    filled = tuple(p.index_fill(dim, index, v) for p, v in zip(parts, value.parts, strict=True))
    return call.wrap(call.run_regular(), filled)


@register_rule(aten.scatter.value)
def scatter_fill(call: OpCall):
    """``grad.scatter(dim, index, 0)``: the message to ``self`` of ``scatter`` (and of
    ``scatter_reduce(..., include_self=False)``). The entries the scatter overwrites have no
    path to ``self``: they get the semiring's zero. Any other value is refused."""
    return _zero_filled(call, "scatter", Tensor.scatter)


def _zero_filled(call: OpCall, name: str, fill: Callable[..., Tensor]):
    """``fill(grad, dim, index, 0)`` of a message: each component filled with its zero."""
    value = call["value"]
    if isinstance(value, Message):
        raise call.error(f"a message as the fill value of {name}")
    if (value.item() if isinstance(value, Tensor) else value) != 0:
        raise call.error(f"{name} of a message with a non-zero value")
    msg, dim, index = call["self"], call["dim"], call["index"]
    parts = tuple(
        fill(p, dim, index, z) for p, z in zip(msg.parts, call.semiring.zero, strict=True)
    )
    return call.wrap(call.run_regular(), parts)


@register_rule(aten.constant_pad_nd.default)
def pad(call: OpCall):
    """Zero padding of a message: the padded entries have no path (the semiring's zero)."""
    if call["value"] != 0:
        raise call.error("padding a message with a non-zero value")
    msg = call["self"]
    parts = tuple(
        aten.constant_pad_nd.default(p, call["pad"], z)
        for p, z in zip(msg.parts, call.semiring.zero, strict=True)
    )
    return call.wrap(call.run_regular(), parts)


# --- fresh gradients: zero-filled, i.e. "no path" ------------------------------------------------


@register_rule(aten.new_empty_strided.default)
def fresh_zero_strided(call: OpCall):
    """Zero message with the given strides: ``as_strided`` views of it are then meaningful."""
    msg, size, stride = call["self"], tuple(call["size"]), tuple(call["stride"])
    dtypes = call.semiring.component_dtypes(msg.dtype)
    parts = tuple(
        torch.empty_strided(size, stride, dtype=dt, device=msg.device).fill_(z)
        for dt, z in zip(dtypes, call.semiring.zero, strict=True)
    )
    regular = None
    if call.has_regular_grad:
        regular = torch.empty_strided(size, stride, dtype=msg.dtype, device=msg.device).zero_()
    return call.wrap(regular, parts)


@register_rule(aten.as_strided.default)
def as_strided(call: OpCall):
    """A raw strided view is only meaningful when every component shares the message's layout
    (as for the buffers autograd's CopySlices allocates); anything else is refused."""
    msg = call["self"]
    ref = msg.regular_grad if msg.regular_grad is not None else msg.parts[0]
    for p in msg.parts:
        if p.stride() != ref.stride() or p.storage_offset() != ref.storage_offset():
            raise call.error(
                "as_strided on a message whose state layout differs from its gradient's"
            )
    regular, outs = per_component(call, ("self",))
    return wrap_outputs(call, regular, outs)


@register_rule(
    aten.zeros_like.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
)
def fresh_zero(call: OpCall):
    """A new zero-filled gradient buffer (``zeros_like`` and friends): "no path" in every
    entry, and a zero regular gradient when regular gradients are on."""
    msg = call["self"]
    size = call.bound.get("size")
    shape = tuple(msg.shape) if size is None else tuple(size)
    regular = None
    if call.has_regular_grad:
        regular = torch.zeros(shape, dtype=call.bound.get("dtype") or msg.dtype, device=msg.device)
    return call.wrap(regular, call.zeros(shape))


@register_rule(aten.new_full.default, aten.full_like.default)
def fresh_full(call: OpCall):
    """``full_like(grad, 0)``: as ``fresh_zero``; a non-zero fill is refused."""
    if call["fill_value"] != 0:
        raise call.error("a message filled with a non-zero constant")
    return fresh_zero(call)


#: The backward nodes whose formula counts its inputs in a tensor made from the gradient
#: (``ones_like(grad)``, ``zeros_like(grad).scatter_add(..., ones)``): the means of
#: ``scatter_reduce`` and ``index_reduce``.
_COUNTING_NODES = frozenset(("ScatterReduceBackward0", "IndexReduceBackward0"))


def _counting() -> bool:
    """Whether the running backward function is one of ``_COUNTING_NODES``."""
    return current_site()[0] in _COUNTING_NODES


@register_rule(aten.ones_like.default)
def fresh_constant(call: OpCall) -> Tensor:
    """``ones_like(grad)`` in a mean's backward (``_COUNTING_NODES``): a plain tensor, no
    message. A backward is linear in its incoming gradient, so such a constant is no part of
    one: the mean divides by the counts it starts. Should the formula add it into a gradient
    after all, that meeting raises (``OpCall.state``). Elsewhere (a custom backward returning
    ``ones_like(g)``) the op is refused by name, as before: no value is guessed."""
    if not _counting():
        raise call.error("a message filled with a non-zero constant")

    def stand_in(x: Any) -> Any:  # what the op reads of a message: shape, strides, dtype
        if not isinstance(x, Message):
            return x
        if x.regular_grad is not None:
            return x.regular_grad
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)

    args, kwargs = map_arguments(stand_in, call.args, call.kwargs)
    return call.func(*args, **kwargs)


@register_rule(aten.zero_.default)
def zero_(call: OpCall):
    """Zeroing a message in place: every entry becomes "no path"."""
    msg = call["self"]
    for p, z in zip(msg.parts, call.semiring.zero, strict=True):
        p.fill_(z)
    if msg.regular_grad is not None:
        msg.regular_grad.zero_()
    return msg


@register_rule(aten.fill_.Scalar, aten.fill_.Tensor)
def fill_(call: OpCall):
    """``fill_(0)`` on a message: as ``zero_``; a non-zero fill is refused."""
    value = call["value"]
    if (value.item() if isinstance(value, Tensor) else value) != 0:
        raise call.error("filling a message with a non-zero constant")
    return zero_(call)


def _scatter_into_zeros(call: OpCall, view) -> Message:
    """``out = zeros(input_sizes); view(out).copy_(grad)`` with the semiring's zero."""
    msg = call["grad_output"]
    sizes = tuple(call["input_sizes"])
    parts = []
    for p, z in zip(msg.parts, call.semiring.zero, strict=True):
        out = torch.full(sizes, z, dtype=p.dtype, device=p.device)
        view(out).copy_(p)
        parts.append(out)
    return call.wrap(call.run_regular(), tuple(parts))


@register_rule(aten.slice_backward.default)
def slice_backward(call: OpCall):
    """The message to the input of a slice: the slice's entries in place, "no path"
    elsewhere. ``grad_output``: the slice's shape; result: ``input_sizes``."""
    dim, start, end, step = call["dim"], call["start"], call["end"], call["step"]
    return _scatter_into_zeros(call, lambda t: aten.slice.Tensor(t, dim, start, end, step))


@register_rule(aten.select_backward.default)
def select_backward(call: OpCall):
    """The message to the input of ``select``: as ``slice_backward`` for one index."""
    dim, index = call["dim"], call["index"]
    return _scatter_into_zeros(call, lambda t: t.select(dim, index))


@register_rule(aten.diagonal_backward.default)
def diagonal_backward(call: OpCall):
    """The message to the input of ``diagonal``: the diagonal in place, "no path"
    elsewhere."""
    offset, d1, d2 = call["offset"], call["dim1"], call["dim2"]
    return _scatter_into_zeros(call, lambda t: t.diagonal(offset, d1, d2))


@register_rule(aten._to_copy.default)
def to_copy(call: OpCall):
    """dtype/device casts: the regular gradient is cast; the state keeps its own dtype."""
    msg = call["self"]
    regular = call.run_regular()
    dtype = call.bound.get("dtype") or msg.dtype
    device = call.bound.get("device") or msg.device
    dtypes = call.semiring.component_dtypes(dtype)
    parts = tuple(p.to(device=device, dtype=dt) for p, dt in zip(msg.parts, dtypes, strict=True))
    return Message(regular, parts, call.semiring, dtype)


@register_rule(aten.to.dtype_layout)
def to_dtype_layout(call: OpCall):
    """``grad.to(device="meta")`` in a formula that returns an efficient zero tensor shaped
    like the gradient (sgn of a real input, whose derivative is 0): only the gradient's
    metadata is read, so a plain meta tensor of its shape and dtype, no values (trial 68: sgn
    raised where sign gave "no path"). Other calls cast like ``_to_copy``."""
    msg = call["self"]
    device = call.bound.get("device")
    if device is not None and torch.device(device).type == "meta":
        return torch.empty(msg.shape, dtype=call.bound.get("dtype") or msg.dtype, device="meta")
    return to_copy(call)


# --- in-place ops ------------------------------------------------------------------------------


@register_rule(aten.copy_.default)
def copy_(call: OpCall):
    """``dest.copy_(src)`` into a message buffer (CopySlices): the state is copied too; copying
    a message into a plain tensor would drop its state and is refused."""
    dest, src = call["self"], call["src"]
    if not isinstance(dest, Message):
        raise call.error("copying a semiring message into a plain tensor would drop its state")
    state = call.state(src, dest.shape)
    for d, s in zip(dest.parts, state, strict=True):
        d.copy_(s)
    if dest.regular_grad is not None:
        dest.regular_grad.copy_(src.regular_grad if isinstance(src, Message) else src)
    return dest


def _accumulated_into(grad) -> MessageLostError:
    """The engine adding a message into a tensor's ``.grad`` in place (``grad += message``):
    it reached a tensor no leaf hook of the pass took it from (a backward run inside a custom
    Function's backward, or a reentrant checkpoint, reaching a tensor outside the model's
    parameters) that already held a gradient; without one the message lands in ``.grad`` and
    the pass names it afterwards (trial 77: this read as a missing rule for ``add_``). The pass
    then fails and puts every ``.grad`` back."""
    return MessageLostError(
        f"a tensor whose .grad (of shape {tuple(grad.shape)}) already held a gradient received "
        "a semiring message through the engine's accumulation instead of through the pass's "
        "leaf hooks (a backward run inside a custom autograd Function's backward or a reentrant "
        "checkpoint, reaching a tensor outside the model's parameters)"
    )


def inplace_from(outofplace):
    """Make an in-place rule from an out-of-place one: compute, then write into ``self``."""

    def rule(call: OpCall):
        dest = call.args[0]
        if not isinstance(dest, Message):
            if current_site()[0] == "torch::autograd::AccumulateGrad":
                raise _accumulated_into(dest)
            raise call.error("an in-place op would write a semiring message into a plain tensor")
        functional = _functional_variant(call.func)
        result = outofplace(OpCall(functional, call.args, call.kwargs))
        for d, r in zip(dest.parts, result.parts, strict=True):
            d.copy_(r)
        if dest.regular_grad is not None:
            dest.regular_grad.copy_(result.regular_grad)
        return dest

    return rule


def _functional_variant(func):
    name = func._schema.name.split("::")[1].rstrip("_")
    packet = getattr(aten, name)
    return getattr(packet, func._overloadname)


@register_rule(aten.index_put.default)
def index_put(call: OpCall):
    """``index_put``: without ``accumulate`` each entry comes from ``self`` or ``values``;
    with it, values sent to one position meet there with the semiring's plus."""
    msg, indices, values = call["self"], call["indices"], call["values"]
    if not call["accumulate"]:
        regular, outs = per_component(call, ("self", "values"))
        return wrap_outputs(call, regular, outs)
    # accumulate=True: duplicated indices meet, so they combine with the semiring's plus.
    shape = tuple(msg.shape)
    # in an aten index list None means "all of this dim", not a new axis
    where = tuple(slice(None) if i is None else i for i in indices)
    flat_ids = torch.arange(msg.numel(), device=msg.device).reshape(shape)[where]
    dest = tuple(p.reshape(-1) for p in call.state(msg, shape))
    src = tuple(p.expand(flat_ids.shape).reshape(-1) for p in call.state(values, flat_ids.shape))
    out = call.semiring.index_plus(dest, 0, flat_ids.reshape(-1), src)
    return call.wrap(call.run_regular(), tuple(p.reshape(shape) for p in out))


def _count_in_a_fresh_buffer(call: OpCall, msg: Any, src: Any) -> bool:
    """Whether a scatter adds a plain non-zero source into a message that holds nothing, no
    path and a zero (or no) regular gradient: a mean's backward counting its inputs in
    ``zeros_like(grad)`` (``scatter_reduce`` and ``index_reduce`` with ``include_self=False``).
    A backward is linear in its gradient, so that sum is a plain count, not a gradient; it is
    computed as one (and, should a formula add it to a gradient, that meeting raises)."""
    return (
        _counting()
        and isinstance(msg, Message)
        and isinstance(src, Tensor)
        and not isinstance(src, Message)
        and bool((src != 0).any())
        and (msg.regular_grad is None or not bool(msg.regular_grad.any()))
        and bool(call.semiring.is_zero(msg.parts).all())
    )


def _fresh_plain(msg: Message) -> Tensor:
    return torch.zeros(msg.shape, dtype=msg.dtype, device=msg.device)


@register_rule(aten.index_add.default)
def index_add(call: OpCall):
    """``index_add`` (alpha 1): source slices meet their destination slices with the
    semiring's plus (``index_plus``); a count in a fresh buffer is plain
    (``_count_in_a_fresh_buffer``)."""
    if call["alpha"] != 1:
        raise call.error("index_add with alpha != 1")
    msg = call["self"]
    if _count_in_a_fresh_buffer(call, msg, call["source"]):
        return _fresh_plain(msg).index_add(call["dim"], call["index"], call["source"])
    dest = call.state(msg, msg.shape)
    src = call.state(call["source"])
    out = call.semiring.index_plus(dest, call["dim"] % msg.dim(), call["index"], src)
    return call.wrap(call.run_regular(), out)


@register_rule(aten.scatter_add.default)
def scatter_add(call: OpCall):
    """``scatter_add``: source entries meet at their target positions with the semiring's
    plus; the source is read in the window ``index`` covers, as PyTorch reads it. A count in
    a fresh buffer is plain (``_count_in_a_fresh_buffer``)."""
    msg, dim, index, src = call["self"], call["dim"], call["index"], call["src"]
    if _count_in_a_fresh_buffer(call, msg, src):
        return _fresh_plain(msg).scatter_add(dim, index, src)
    shape = tuple(msg.shape)
    targets = torch.arange(msg.numel(), device=msg.device).reshape(shape).gather(dim, index)
    window = tuple(slice(0, s) for s in index.shape)
    src_parts = tuple(p[window].reshape(-1) for p in call.state(src))
    dest = tuple(p.reshape(-1) for p in call.state(msg, shape))
    out = call.semiring.index_plus(dest, 0, targets.reshape(-1), src_parts)
    return call.wrap(call.run_regular(), tuple(p.reshape(shape) for p in out))


for _inplace, _rule in [
    (aten.index_put_.default, index_put),
    (aten.index_add_.default, index_add),
    (aten.scatter_add_.default, scatter_add),
    (aten.masked_fill_.Scalar, masked_fill),
    (aten.masked_fill_.Tensor, masked_fill),
    (aten.index_fill_.int_Scalar, index_fill),
    (aten.index_fill_.int_Tensor, index_fill),
]:
    register_rule(_inplace)(inplace_from(_rule))
