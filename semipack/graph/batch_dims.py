"""Where the batch is: the dim of a tensor that indexes the model's examples, followed call by
call through the forward of a per-sample block (``extend(..., per_sample=True)``).

Per-sample rows read dim 0 of a layer's input (or of a hand-written ``x * p``'s other operand)
as the example. A tensor whose batch has moved elsewhere while its dim 0 kept the batch's size
(``x.transpose(0, 1)`` of an ``[N, N, D]`` input, a sequence-first layer inside a batch-first
model with as many tokens as examples) would give one row per token, silently. So the block
asks, for each call, where a batched argument's batch dim went in each result:
``batch_dim_after`` gives that dim, or None when the call mixed or split the examples (a
reduction over the batch, a cat or an index along it) or when where it went is not known.

Shapes only, never values: calls are recognised by name (``Tensor.transpose``,
``torch.transpose`` and ``transpose_`` alike), pure permutations are replayed on a meta tensor,
and any other call keeps the batch where the result's shape says it can be.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ..kernels.shapes import broadcast_shapes

#: ``batch_dim_after``'s arguments: the call, its arguments, the batched argument, its batch
#: dim and one result tensor.
Handler = Callable[[Any, tuple, dict, Tensor, int, Tensor], "int | None"]


def call_name(func: Any) -> str:
    """The name a call is known by here: ``transpose`` for ``Tensor.transpose``,
    ``torch.transpose`` and ``transpose_``; a property getter's property (``T``, ``mT``)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # x.T, x.mT: the getter of a property of the tensor class
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    if name.endswith("_") and not name.endswith("__"):
        return name[:-1]
    return name


def batch_dim_after(
    func: Any,
    args: tuple,
    kwargs: dict,
    source: Tensor,
    dim: int,
    out: Tensor,
    position: int = 0,
    examples: int | None = None,
) -> int | None:
    """The batch dim of ``out`` (the result at ``position`` among the tensors
    ``func(*args, **kwargs)`` returned) given that argument ``source`` has the examples on
    ``dim``; None if ``out`` has no dim that holds them, as far as the call's name and shapes
    tell. ``examples`` is their number where ``dim`` holds more entries (a batch merged with
    the dims after it, ``[N * H, T, d]``: each example a block of ``source.shape[dim] /
    examples`` indices); a reshape may merge or split it, every other call keeps the dim's
    size."""
    if out.dim() == 0 or source.dim() == 0:
        return None
    dim %= source.dim()
    handler = _HANDLERS.get(call_name(func), _pointwise)
    if handler in _BY_POSITION:  # results of different layouts
        found = handler(func, args, kwargs, source, dim, out, position)
    elif handler is _reshaped:
        found = _reshaped(func, args, kwargs, source, dim, out, examples)
    else:
        found = handler(func, args, kwargs, source, dim, out)
    if found is None or not 0 <= found < out.dim():
        return None
    if handler is _reshaped:
        return found
    return found if out.shape[found] == source.shape[dim] else None


# --- the default: elementwise calls --------------------------------------------------------


def _pointwise(func, args, kwargs, source, dim, out) -> int | None:
    """A call not named below: an elementwise one (its ATen op tagged pointwise, or a cast,
    copy or dropout in ``_LAYOUT_KEEPING``) whose result has the broadcast shape of its tensor
    arguments keeps the batch at its dim counted from the back, as broadcasting lines dims
    up. Any other call is not known (None): its result's shape alone cannot tell a
    contraction over the batch from an elementwise op (``torch.tensordot(A, h, 1)`` of two
    square matrices keeps the shape and mixes every example)."""
    if not _is_elementwise(call_name(func)):
        return None
    shapes = [t.shape for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    try:
        broadcast = broadcast_shapes(*shapes)
    except RuntimeError:
        return None
    if tuple(broadcast) != tuple(out.shape):
        return None
    return dim + out.dim() - source.dim()


#: Elementwise calls that are no ATen op tagged pointwise (casts, copies, dropout, Python
#: activations of ``torch.nn.functional``), and the ``*_like`` constructors, whose result is
#: laid out as their argument.
_LAYOUT_KEEPING = frozenset(
    (
        "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool",
        "cpu", "cuda", "contiguous", "detach", "copy", "fill", "zero", "requires_grad",
        "dropout", "alpha_dropout", "feature_alpha_dropout", "native_dropout", "hardswish",
        "softsign", "tanhshrink", "logsigmoid", "log_sigmoid", "threshold", "_threshold",
        "rrelu", "bernoulli",
        "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
        "randint_like", "positive", "conj", "resolve_conj", "resolve_neg", "data", "real",
        "imag",
    )
)  # fmt: skip

#: Operators whose ATen op has another name.
_OPERATORS = {
    "truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "invert": "bitwise_not",
    "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor", "pos": "positive",
}  # fmt: skip

_ELEMENTWISE: dict[str, bool] = {}


def _is_elementwise(name: str) -> bool:
    """Whether the call ``name`` (``add``, ``__radd__``, ``gelu``) is elementwise: in
    ``_LAYOUT_KEEPING``, or an ATen op whose overloads carry the pointwise tag."""
    known = _ELEMENTWISE.get(name)
    if known is None:
        core = name.strip("_") if name.startswith("__") else name
        candidates = [core]
        if name.startswith("__") and core[:1] in ("r", "i"):
            candidates.append(core[1:])  # __radd__, __iadd__
        candidates = [_OPERATORS.get(c, c) for c in candidates]
        known = any(c in _LAYOUT_KEEPING or _tagged_pointwise(c) for c in candidates)
        _ELEMENTWISE[name] = known
    return known


def _tagged_pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "overloads"):
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _first_input_layout(func, args, kwargs, source, dim, out) -> int | None:
    """Per-channel calls whose result is laid out as their first input (``prelu``, batch
    norm in eval mode, channel dropout): the batch keeps its dim unless it is the channels
    (dim 1). Batch norm in train mode normalises over the batch."""
    if not args or args[0] is not source or (dim == 1 and source.dim() > 1):
        return None
    if call_name(func) == "batch_norm":
        training = kwargs.get("training", args[5] if len(args) > 5 else False)
        if training:
            return None
    return dim


def _cast(func, args, kwargs, source, dim, out) -> int | None:
    """A cast, also to another tensor's dtype or device (``a.type_as(h)``, ``a.to(h)``): the
    first input's entries in its layout. The other tensor gives a dtype only; the broadcast
    of both shapes, read as an elementwise call, lost the batch (trial 78: a ViT's masked
    image modelling mask, ``bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)``)."""
    if not args or args[0] is not source or tuple(out.shape) != tuple(source.shape):
        return None
    return dim


def _keeps_place(func, args, kwargs, source, dim, out) -> int | None:
    """Dims appended after the input's (``F.embedding``, ``one_hot``): the ids' dims stay;
    a table computed from the batch and looked up by other ids moves rows between examples."""
    return dim if args and args[0] is source else None


def _triangle(func, args, kwargs, source, dim, out) -> int | None:
    """``tril``/``triu`` zero entries by their (row, column) place in the last two dims: with
    the batch there, each example would be masked by its index in the batch."""
    if not args or args[0] is not source or dim >= source.dim() - 2:
        return None
    return dim


def _unfolded(func, args, kwargs, source, dim, out) -> int | None:
    """``Tensor.unfold(dim, size, step)`` windows one dim (along the batch, examples mix) and
    appends the window dim; ``F.unfold`` (im2col) keeps only dim 0 of ``[N, C, H, W]``."""
    if func is Tensor.unfold:
        return None if args[1] % source.dim() == dim else dim
    return 0 if dim == 0 and args[0] is source else None


# --- calls that only move dims ------------------------------------------------------------


def _permuted(func, args, kwargs, source, dim, out) -> int | None:
    """Transposes, permutes and moves of dims: replayed on a meta tensor whose dims all
    differ in size, the batch dim found by its size in the result."""
    sizes = tuple(range(2, source.dim() + 2))
    probe = torch.empty(sizes, device="meta")
    try:
        moved = func(*_replace(args, source, probe), **_replace_kw(kwargs, source, probe))
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    if not isinstance(moved, Tensor) or sizes[dim] not in moved.shape:
        return None
    return tuple(moved.shape).index(sizes[dim])


def _replace(args: tuple, old: Tensor, new: Tensor) -> tuple:
    return tuple(new if a is old else a for a in args)


def _replace_kw(kwargs: dict, old: Tensor, new: Tensor) -> dict:
    return {k: new if v is old else v for k, v in kwargs.items()}


def _reshaped(func, args, kwargs, source, dim, out, examples: int | None = None) -> int | None:
    """A reshape keeps entries in row-major order. The examples, the outermost factor of the
    source's ``dim``, stay the outermost factor of the result's dim ``c`` exactly when the
    dims before ``c`` hold as many entries as those before ``dim`` and ``c``'s size is a
    multiple of their number: ``[N, T, D] -> [N, T * D]`` keeps them alone on dim 0,
    ``[N, H, T, d] -> [N * H, T, d]`` merges them with the heads, and the reverse splits
    them out again."""
    before = math.prod(source.shape[:dim])
    n = examples or source.shape[dim]
    if n == 0:  # an empty batch: its dim is the result's first of size 0 with as much before
        empty = [c for c in range(out.dim()) if out.shape[c] == 0]
        return next((c for c in empty if math.prod(out.shape[:c]) == before), None)
    for c in range(out.dim()):
        if out.shape[c] % n or (out.shape[c] == 1 and n != 1):
            continue
        if math.prod(out.shape[:c]) == before:
            return c
    return None


def _prepends(func, args, kwargs, source, dim, out) -> int | None:
    """``expand``, ``broadcast_to``, ``repeat``, ``tile``: new dims go in front."""
    return dim + out.dim() - source.dim()


def _indexed(func, args, kwargs, source, dim, out) -> int | None:
    """``source[index]``: integers remove dims, ``None`` adds one, slices keep theirs (a
    slice of the batch changes its size, which the caller's check sees). An index tensor on
    the batch picks examples; index tensors on other dims leave one block of dims, in their
    place when they are adjacent and in front otherwise (PyTorch's rule, integers not
    counting as index tensors). An index tensor on the batch that takes every example in
    order (``h[torch.arange(N), last]``, the last-token pooling of Hugging Face's sequence
    classifiers) puts the batch where that block goes, when the block is one dim."""
    if args[0] is not source:
        return _index_tensor_place(args[0], args[1], source, dim, out)
    return _index_place(source, args[1], dim, out)


def _index_selected(func, args, kwargs, source, dim, out) -> int | None:
    """``x.index_select(d, index)``: along ``d`` of ``x`` it picks entries, as ``narrow``
    does; an index computed from the batch picks rows of ``x`` for each of its own entries, as
    ``x[:, ..., index]`` does (M2M100's positions, ``table.index_select(0, pos.view(-1))``,
    were refused as picking examples; trial 84)."""
    index = args[2] if len(args) > 2 else kwargs.get("index")
    if source is index and args and args[0] is not source:
        d = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        d = d % max(args[0].dim(), 1)
        return _index_tensor_place(args[0], (slice(None),) * d + (source,), source, dim, out)
    return _SELECTED_ALONG(func, args, kwargs, source, dim, out)


def _index_tensor_place(
    indexed: Tensor, index: Any, source: Tensor, dim: int, out: Tensor
) -> int | None:
    """Where an index tensor's dim ``dim`` goes in ``indexed[index]``: the index tensors
    broadcast to one block of dims (in place when adjacent, else in front), their dims
    right-aligned in it (``h[arange(N), last]`` with ``last`` computed from the batch)."""
    index = index if isinstance(index, tuple) else (index,)
    if not any(i is source for i in index) or source.dtype == torch.bool:
        return None
    if any(i is Ellipsis for i in index):
        rest = sum(_dims_consumed(i) for i in index)
        at = next(k for k, i in enumerate(index) if i is Ellipsis)
        index = index[:at] + (slice(None),) * (indexed.dim() - rest) + index[at + 1 :]
    position, out_dim, blocks = 0, 0, []
    for i in index:
        if i is None or isinstance(i, slice):
            out_dim += 1
        elif _is_advanced(i) and (not blocks or blocks[-1] != out_dim):
            blocks.append(out_dim)
        position += 0 if i is None else _dims_consumed(i)
    width = out.dim() - (out_dim + indexed.dim() - position)
    start = 0 if len(blocks) > 1 else blocks[0]
    return start + width - source.dim() + dim


def _index_place(source: Tensor, index: Any, dim: int, out: Tensor) -> int | None:
    """Where ``source[index]`` (``out``) has ``source``'s dim ``dim`` (see ``_indexed``)."""
    index = index if isinstance(index, tuple) else (index,)
    ellipses = [k for k, i in enumerate(index) if i is Ellipsis]
    if len(ellipses) > 1:
        return None
    if ellipses:
        rest = sum(_dims_consumed(i) for i in index)
        at = ellipses[0]
        index = index[:at] + (slice(None),) * (source.dim() - rest) + index[at + 1 :]
    placed, position, out_dim, blocks, in_block = None, 0, 0, [], None
    for i in index:
        if i is None:
            out_dim += 1
            continue
        width = _dims_consumed(i)
        if position <= dim < position + width and not isinstance(i, slice):
            in_block = _every_example_in_order(i, source.shape[dim])
            if in_block is None:
                return None  # one example, or examples picked by an index tensor or mask
            in_block -= i.dim()  # its place counted from the block's end
        if _is_advanced(i):
            if not blocks or blocks[-1] != out_dim:
                blocks.append(out_dim)
        elif isinstance(i, slice):
            if position == dim:
                placed = out_dim
            out_dim += 1
        position += width
    block = out.dim() - (out_dim + source.dim() - position)
    if in_block is not None:  # index tensors broadcast right-aligned into the block
        return (0 if len(blocks) > 1 else blocks[0]) + block + in_block
    if placed is None:  # the batch is after every index entry
        placed = out_dim + dim - position
    if not blocks:
        return placed
    if len(blocks) > 1 or blocks[0] <= placed:  # in front, or in place before the batch
        return placed + block
    return placed


def _every_example_in_order(i: Any, n: int) -> int | None:
    """The dim along which an index on the batch dim is ``arange(n)``, broadcast along its
    other dims (size 1): ``arange(N)``, or ``arange(N)[:, None, None, None]`` as Hugging
    Face's mask functions index a padding mask; None for any other index."""
    if isinstance(i, list):
        return 0 if i == list(range(n)) else None
    if not isinstance(i, Tensor) or i.dtype in (torch.bool, torch.uint8) or i.dim() == 0:
        return None
    if i.is_floating_point() or i.is_complex() or i.device.type == "meta":
        return None
    varying = [k for k, size in enumerate(i.shape) if size != 1]
    if len(varying) != 1 or i.shape[varying[0]] != n:
        return 0 if n == 1 and i.numel() == 1 and int(i.reshape(())) == 0 else None
    line = i.reshape(-1)
    if not torch.equal(line, torch.arange(n, device=i.device, dtype=i.dtype)):
        return None
    return varying[0]


def dim_after_index(source: Tensor, index: Any, dim: int, out: Tensor) -> int | None:
    """The dim of ``out = source[index]`` that holds ``source``'s dim ``dim`` (its size
    checked), or None: an indexed assignment's value lines up with the target through it."""
    found = _index_place(source, index, dim % source.dim(), out)
    if found is None or not 0 <= found < out.dim() or out.shape[found] != source.shape[dim]:
        return None
    return found


def _index_put(func, args, kwargs, source, dim, out) -> int | None:
    """``index_put(target, indices, values)``: an index tensor on the target's batch dim
    writes examples into other examples' places; values written through indices are not
    followed."""
    if not args or args[0] is not source:
        return None
    position = 0
    for i in args[1]:
        width = 1 if i is None else _dims_consumed(i)
        if i is not None and position <= dim < position + width:
            return None
        position += width
    return dim


def _dims_consumed(i: Any) -> int:
    if i is None or i is Ellipsis:
        return 0
    if isinstance(i, Tensor) and i.dtype == torch.bool:
        return i.dim()
    return 1


def _is_advanced(i: Any) -> bool:
    """An index tensor or list (a 0-dim integer tensor acts as an integer)."""
    if isinstance(i, Tensor):
        return i.dim() > 0 or i.dtype == torch.bool
    return isinstance(i, list)


# --- calls along one dim ------------------------------------------------------------------


def _dim_argument(args: tuple, kwargs: dict, position: int, default: Any) -> Any:
    for key in ("dim", "axis", "dims"):
        if key in kwargs:
            return kwargs[key]
    return args[position] if len(args) > position else default


def _as_dims(value: Any, ndim: int) -> list[int] | None:
    """``value`` (an int, a sequence of ints, or None for every dim) as dims in
    ``range(ndim)``; None when it is not a dim argument (a tensor, a bool)."""
    if value is None:
        return list(range(ndim))
    if isinstance(value, bool):
        return None
    if isinstance(value, int | torch.SymInt):
        return [int(value) % max(ndim, 1)]
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return None
        return [int(v) % max(ndim, 1) for v in value] if value else list(range(ndim))
    return None


def _along(position: int, default: Any = 0, *, removes: bool = False) -> Handler:
    """A call that works along dims given at ``args[position]`` (or ``dim=``): along the
    batch it mixes or splits the examples; otherwise the batch keeps its dim, less the dims
    removed before it (a reduction without ``keepdim``)."""

    def handler(func, args, kwargs, source, dim, out) -> int | None:
        if args and args[0] is not source:
            return _pointwise(func, args, kwargs, source, dim, out)
        value = _dim_argument(args, kwargs, position, default)
        if isinstance(value, Tensor):  # torch.max(a, b): elementwise
            return _pointwise(func, args, kwargs, source, dim, out)
        dims = _as_dims(value, source.dim())
        if dims is None:
            return _pointwise(func, args, kwargs, source, dim, out)
        if dim in dims:
            return None
        if removes and out.dim() < source.dim():
            return dim - sum(d < dim for d in set(dims))
        return dim

    return handler


#: a dim argument at position 1: ``narrow``, ``index_add``, ... and ``index_select``'s own
_SELECTED_ALONG = _along(1, None)


def _indexed_into(func, args, kwargs, source, dim, out) -> int | None:
    """``index_add``, ``index_copy``, ``index_reduce`` (``self, dim, index, source``): along
    ``dim`` the source's slices land in the slices ``index`` names, every other dim lines up
    one to one. So the source's batch, on another dim, keeps its place (a graph network
    gathering messages along its node dim, trial 121: refused as mixing); on ``dim`` the
    examples move. The target itself: as ``_SELECTED_ALONG``; an index computed from the batch
    mixes it."""
    if args and args[0] is source:
        return _SELECTED_ALONG(func, args, kwargs, source, dim, out)
    given = args[3] if len(args) > 3 else kwargs.get("source")
    if given is not source or source.dim() != out.dim():
        return None
    along = _as_dims(_dim_argument(args, kwargs, 1, None), out.dim())
    if along is None or dim in along or source.shape[dim] != out.shape[dim]:
        return None
    return dim


def _picked_by(position: int) -> Handler:
    """``gather(input, dim, index)``, ``take_along_dim(input, index, dim)`` (``position``:
    where ``dim`` is), ``scatter(input, dim, index, src)``: along the input's batch the
    examples mix; an index or source computed from the batch has the result's layout, its
    batch kept unless it is on the dim picked along."""
    along = _along(position, None)

    def handler(func, args, kwargs, source, dim, out) -> int | None:
        if args and args[0] is source:
            return along(func, args, kwargs, source, dim, out)
        picked = _as_dims(_dim_argument(args, kwargs, position, None), source.dim())
        return None if picked is None or dim in picked else dim

    return handler


def _diagonal(func, args, kwargs, source, dim, out) -> int | None:
    """``diagonal(offset, dim1, dim2)``: the two dims go, their diagonal is appended last."""
    first = kwargs.get("dim1", args[2] if len(args) > 2 else 0) % source.dim()
    second = kwargs.get("dim2", args[3] if len(args) > 3 else 1) % source.dim()
    if dim in (first, second):
        return None
    return dim - (first < dim) - (second < dim)


def _select(func, args, kwargs, source, dim, out) -> int | None:
    """``select(dim, index)``, ``unbind(dim)``: the dim goes away."""
    d = _dim_argument(args, kwargs, 1, 0) % source.dim()
    if d == dim:
        return None
    return dim - (d < dim)


def _joined(func, args, kwargs, source, dim, out) -> int | None:
    """``cat(tensors, dim)`` along another dim keeps the batch; ``stack`` adds a dim."""
    d = _dim_argument(args, kwargs, 1, 0)
    if call_name(func) == "stack":
        d %= source.dim() + 1
        return dim + (d <= dim)
    return None if d % source.dim() == dim else dim


# --- products -----------------------------------------------------------------------------


def _matrix_product(func, args, kwargs, source, dim, out) -> int | None:
    """``a @ b`` (``matmul``, ``mm``, ``bmm``; ``addmm``, ``baddbmm``, ``addbmm`` with their
    added input, positional or by keyword as Bloom's ``alibi.baddbmm(batch1=q, batch2=k)``):
    the batch is a row of ``a``, a column of ``b`` or a broadcast batch dim of either; on the
    contracted dim (or ``addbmm``'s summed batch) it is summed over; the added input is
    broadcast into the result."""
    name = call_name(func)
    if name in ("addmm", "baddbmm", "addbmm"):
        added = args[0] if args else kwargs.get("input")
        first = args[1] if len(args) > 1 else kwargs.get("mat1", kwargs.get("batch1"))
        second = args[2] if len(args) > 2 else kwargs.get("mat2", kwargs.get("batch2"))
    else:
        added = None
        first = args[0] if args else kwargs.get("input")
        second = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    operands = [first, second]
    if name == "__rmatmul__":
        operands.reverse()
    if not all(isinstance(op, Tensor) for op in operands):
        return None
    places = {_product_place(k, operands, dim, out) for k in (0, 1) if operands[k] is source}
    if added is source:
        places.add(dim + out.dim() - source.dim())
    return places.pop() if len(places) == 1 else None  # x @ x: the batch on rows and columns


def _product_place(k: int, operands: list[Tensor], dim: int, out: Tensor) -> int | None:
    """Where ``operands[k]``'s dim ``dim`` goes in ``out = operands[0] @ operands[1]``."""
    nd, other = operands[k].dim(), operands[1 - k]
    if nd == 1:
        return None
    row, column = nd - 2, nd - 1
    if dim == (column if k == 0 else row):
        return None  # contracted
    if dim == (row if k == 0 else column):
        return out.dim() - 1 if k == 1 or other.dim() == 1 else out.dim() - 2
    matrix_dims = 1 if other.dim() == 1 else 2
    return dim + (out.dim() - matrix_dims) - (nd - 2)


def _tensordot(func, args, kwargs, source, dim, out) -> int | None:
    """``tensordot(a, b, dims)``: the free dims of ``a`` then those of ``b``; a contracted
    batch is summed over."""
    a, b = args[0], args[1]
    dims = args[2] if len(args) > 2 else kwargs.get("dims", 2)
    if isinstance(dims, int):
        contracted = (list(range(a.dim() - dims, a.dim())), list(range(dims)))
    elif isinstance(dims, Tensor) or not isinstance(dims, Sequence) or len(dims) != 2:
        return None
    else:
        first, second = dims
        first = [first] if isinstance(first, int) else list(first)
        second = [second] if isinstance(second, int) else list(second)
        contracted = ([d % a.dim() for d in first], [d % b.dim() for d in second])
    places = set()
    for k, operand in enumerate((a, b)):
        if operand is not source:
            continue
        if dim in contracted[k]:
            return None
        free = [d for d in range(operand.dim()) if d not in contracted[k]]
        offset = 0 if k == 0 else a.dim() - len(contracted[0])
        places.add(offset + free.index(dim))
    return places.pop() if len(places) == 1 else None


def _einsum(func, args, kwargs, source, dim, out) -> int | None:
    """``einsum(equation, *operands)``: where the output puts the batch's subscript (an
    ellipsis's dims right-aligned across operands, as einsum broadcasts them)."""
    if not args or not isinstance(args[0], str):
        return None
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = tuple(operands[0])
    equation = args[0].replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        return None
    if not arrow:  # implicit output: an ellipsis, then the subscripts used once, sorted
        letters = [c for c in inputs if c.isalpha()]
        once = sorted(c for c in set(letters) if letters.count(c) == 1)
        output = ("..." if "..." in inputs else "") + "".join(once)
    found = _subscripts(output, out.dim())
    places = set()
    for term, operand in zip(terms, operands, strict=True):
        if operand is not source:
            continue
        labels = _subscripts(term, source.dim())
        if labels is None or found is None or labels[dim] not in found:
            return None
        places.add(found.index(labels[dim]))
    return places.pop() if len(places) == 1 else None  # an operand given twice


def _subscripts(term: str, ndim: int) -> list[Any] | None:
    """One label per dim of an einsum operand: its letter, or for an ellipsis's dims their
    place counted from the ellipsis's end (how operands' ellipses line up)."""
    head, ellipsis, tail = term.partition("...")
    if not all(c.isalpha() for c in head + tail):
        return None
    width = ndim - len(head) - len(tail)
    if (not ellipsis and width != 0) or width < 0:
        return None
    return [*head, *(("...", width - j) for j in range(width)), *tail]


def _normalised(func, args, kwargs, source, dim, out) -> int | None:
    """``layer_norm(x, shape)``, ``rms_norm``: each entry depends on the last
    ``len(shape)`` dims; with the batch among them the examples mix."""
    if not args or args[0] is not source:
        return _pointwise(func, args, kwargs, source, dim, out)
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    width = 1 if isinstance(shape, int) else len(shape) if shape is not None else 0
    return None if dim >= source.dim() - width else dim


def _attention(func, args, kwargs, source, dim, out) -> int | None:
    """``scaled_dot_product_attention(q, k, v)``: each query row reads every key and value
    row, so the batch must be a leading dim (on the sequence dims the examples mix)."""
    if dim >= source.dim() - 2:
        return None
    return dim + out.dim() - source.dim()


def _spatial(rank: int, mixes_channels: bool) -> Handler:
    """Convolutions (``mixes_channels``) and pools, interpolations, pads over ``rank``
    spatial dims: each output entry reads a window of the spatial dims (and for a
    convolution every channel). The batch kept is dim 0 of a batched input
    (``[N, C, *spatial]``); on a window dim, or on the channels of a convolution, the
    examples mix."""

    def handler(func, args, kwargs, source, dim, out) -> int | None:
        if not args or args[0] is not source:
            return None  # a weight, a grid, an offset computed from the batch
        if dim >= source.dim() - rank:
            return None
        if mixes_channels and not (dim == 0 and source.dim() == rank + 2):
            return None
        return dim + out.dim() - source.dim()

    return handler


def _padded(func, args, kwargs, source, dim, out) -> int | None:
    """``F.pad(x, pad)``: ``pad`` holds (before, after) pairs from the last dim backwards;
    padding or cropping the batch's dim shifts examples (a negative pad drops one)."""
    if not args or args[0] is not source:
        return None
    pad = args[1] if len(args) > 1 else kwargs.get("pad")
    pairs = len(pad) // 2
    from_back = source.dim() - 1 - dim
    if from_back < pairs and (pad[2 * from_back] != 0 or pad[2 * from_back + 1] != 0):
        return None
    return dim


def _recurrent(func, args, kwargs, source, dim, out, position) -> int | None:
    """``_VF.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` (input, hx, weights, ..., batch_first):
    the recurrence runs along the time dim, so the batch must be the input's batch dim (0
    with ``batch_first``, else 1); the output keeps it, the hidden states have it on dim 1.
    A packed sequence's call (its batch sizes as second argument) is not followed."""
    if len(args) < 9 or not isinstance(args[8], bool) or not isinstance(args[0], Tensor):
        return None
    wanted = 0 if args[8] else 1
    if args[0] is source:
        if source.dim() != 3 or dim != wanted:
            return None  # the recurrence would run across examples
    elif dim != 1:  # a hidden state computed from the batch: [layers, N, H]
        return None
    return wanted if position == 0 else 1


def _attention_forward(func, args, kwargs, source, dim, out, position) -> int | None:
    """``F.multi_head_attention_forward(query, key, value, ...)`` is sequence-first: the
    batch must be dim 1 of a 3-D query, key or value (dim 0 is the sequence every query
    attends over), or dim 0 of the ``key_padding_mask`` ([N, S]); the output keeps it on
    dim 1, the attention weights on dim 0."""
    padding = kwargs.get("key_padding_mask", args[14] if len(args) > 14 else None)
    if source is padding and source.dim() == 2 and dim == 0:
        return 1 if position == 0 else 0
    if not any(source is a for a in args[:3]) or source.dim() != 3 or dim != 1:
        return None
    return 1 if position == 0 else 0


def _bagged(func, args, kwargs, source, dim, out, position) -> int | None:
    """``F.embedding_bag(ids, weight, offsets, ..., per_sample_weights)``: output row b sums
    (or averages, or takes the maximum of) bag b's lookups. With ids ``[N, L]`` each row of
    the ids (and of the per-sample weights) is a bag, so the batch on their dim 0 stays on
    the output's; with 1-D ids every bag is a run of lookups from its offset on, so the batch
    of flat ids is no bag's, and a batch on the offsets' dim 0 is the output's (without
    ``include_last_offset``, whose last offset starts no bag). ``torch.embedding_bag``
    (weight first, four results) is not followed."""
    if func is not torch.nn.functional.embedding_bag or position != 0 or dim != 0:
        return None

    def given(index: int, name: str) -> Any:
        return args[index] if len(args) > index else kwargs.get(name)

    ids, offsets = given(0, "input"), given(2, "offsets")
    if not isinstance(ids, Tensor):
        return None
    if ids.dim() == 2:
        return 0 if source is ids or source is given(8, "per_sample_weights") else None
    return 0 if source is offsets and not given(9, "include_last_offset") else None


def _leading(kept: int) -> Handler:
    """``group_norm`` (``kept`` 1: each example's channels and positions together),
    ``instance_norm`` and ``interpolate`` (``kept`` 2: the spatial dims after ``[N, C]``):
    the batch must be one of the first ``kept`` dims."""

    def handler(func, args, kwargs, source, dim, out) -> int | None:
        if not args or args[0] is not source:
            return None
        return dim if dim < kept else None

    return handler


def _features_last(func, args, kwargs, source, dim, out) -> int | None:
    """``F.linear(x, W)``, ``F.bilinear``: each output entry sums over ``x``'s last dim."""
    if not args or args[0] is not source or dim == source.dim() - 1:
        return None
    return dim


_HANDLERS: dict[str, Handler] = {
    **dict.fromkeys(
        ("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"), _permuted
    ),
    **dict.fromkeys(("T", "mT", "H", "mH", "adjoint"), _permuted),
    **dict.fromkeys(
        (
            "view",
            "reshape",
            "flatten",
            "unflatten",
            "view_as",
            "reshape_as",
            "squeeze",
            "unsqueeze",
            "view_as_real",
            "view_as_complex",
            "ravel",
        ),
        _reshaped,
    ),
    **dict.fromkeys(("expand", "expand_as", "broadcast_to", "repeat", "tile"), _prepends),
    **dict.fromkeys(("embedding", "one_hot"), _keeps_place),
    "unfold": _unfolded,
    **dict.fromkeys(("to", "type_as"), _cast),
    "__getitem__": _indexed,
    **dict.fromkeys(("select", "unbind"), _select),
    **dict.fromkeys(("cat", "concat", "concatenate", "stack"), _joined),
    **dict.fromkeys(
        (
            "matmul",
            "linalg_matmul",
            "__matmul__",
            "__rmatmul__",
            "mm",
            "bmm",
            "addmm",
            "baddbmm",
            "addbmm",
        ),
        _matrix_product,
    ),
    "einsum": _einsum,
    "tensordot": _tensordot,
    **dict.fromkeys(("tril", "triu"), _triangle),
    "diagonal": _diagonal,
    "index_put": _index_put,
    "pad": _padded,
    "diff": _along(2, -1),
    **dict.fromkeys(("lstm", "gru", "rnn_tanh", "rnn_relu"), _recurrent),
    "multi_head_attention_forward": _attention_forward,
    "embedding_bag": _bagged,
    **dict.fromkeys(
        ("prelu", "batch_norm", "dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout"),
        _first_input_layout,
    ),
    **dict.fromkeys(
        ("grid_sample", "affine_grid", "pixel_shuffle", "pixel_unshuffle"), _leading(1)
    ),
    **dict.fromkeys(("channel_shuffle", "fold", "local_response_norm"), _leading(1)),
    **dict.fromkeys(("cosine_similarity",), _along(2, 1, removes=True)),
    "pairwise_distance": _along(2, -1, removes=True),
    **dict.fromkeys(("layer_norm", "rms_norm"), _normalised),
    "scaled_dot_product_attention": _attention,
    **dict.fromkeys(("linear", "bilinear"), _features_last),
    **{f"conv{n}d": _spatial(n, True) for n in (1, 2, 3)},
    **{f"conv_transpose{n}d": _spatial(n, True) for n in (1, 2, 3)},
    **{
        f"{kind}{n}d": _spatial(n, False)
        for n in (1, 2, 3)
        for kind in ("avg_pool", "max_pool", "adaptive_avg_pool", "adaptive_max_pool", "lp_pool")
    },
    **{f"max_pool{n}d_with_indices": _spatial(n, False) for n in (1, 2, 3)},
    "group_norm": _leading(1),
    **dict.fromkeys(("instance_norm", "interpolate", "upsample"), _leading(2)),
    # along a dim, same shape (a scan, a softmax, a sort, an exchange of entries)
    **dict.fromkeys(
        ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax", "log_softmax"),
        _along(1),
    ),
    **dict.fromkeys(("sort", "argsort"), _along(1, -1)),
    "msort": _along(1, 0),
    "flip": _along(1),
    "roll": _along(2, None),
    "normalize": _along(2, 1),
    "glu": _along(1, -1),
    **dict.fromkeys(("topk", "kthvalue"), _along(2, -1, removes=True)),
    # along a dim, picking or splitting entries
    **dict.fromkeys(("narrow", "index_fill"), _SELECTED_ALONG),
    **dict.fromkeys(("index_add", "index_copy", "index_reduce"), _indexed_into),
    "index_select": _index_selected,
    "repeat_interleave": _along(2, None),
    "take_along_dim": _picked_by(2),
    **dict.fromkeys(("gather", "scatter", "scatter_add", "scatter_reduce"), _picked_by(1)),
    **dict.fromkeys(("split", "chunk", "tensor_split", "split_with_sizes"), _along(2)),
    # reductions (no dim: every dim)
    **dict.fromkeys(
        (
            "sum",
            "mean",
            "nansum",
            "nanmean",
            "amax",
            "amin",
            "max",
            "min",
            "aminmax",
            "std",
            "var",
            "std_mean",
            "var_mean",
            "logsumexp",
            "prod",
            "median",
            "nanmedian",
            "all",
            "any",
            "argmax",
            "argmin",
            "count_nonzero",
        ),
        _along(1, None, removes=True),
    ),
    "mode": _along(1, -1, removes=True),
    **dict.fromkeys(("quantile", "nanquantile"), _along(2, None, removes=True)),
    **dict.fromkeys(
        ("norm", "vector_norm", "linalg_vector_norm", "linalg_norm"), _along(2, None, removes=True)
    ),
}


#: Handlers told which of the call's results they place (``position``).
_BY_POSITION = (_recurrent, _attention_forward, _bagged)

__all__ = ["batch_dim_after", "call_name", "dim_after_index"]
