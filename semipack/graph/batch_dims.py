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
    func: Any, args: tuple, kwargs: dict, source: Tensor, dim: int, out: Tensor
) -> int | None:
    """The batch dim of ``out`` (a result of ``func(*args, **kwargs)``) given that argument
    ``source`` has its ``source.shape[dim]`` examples on ``dim``; None if ``out`` has no dim
    that holds exactly those examples, one per index, as far as the call's shapes tell."""
    if out.dim() == 0 or source.dim() == 0:
        return None
    handler = _HANDLERS.get(call_name(func), _by_shape)
    found = handler(func, args, kwargs, source, dim % source.dim(), out)
    if found is None or not 0 <= found < out.dim():
        return None
    return found if out.shape[found] == source.shape[dim] else None


# --- the default: the result's shape --------------------------------------------------------


def _by_shape(func, args, kwargs, source, dim, out) -> int | None:
    """A call not named below: the batch stays at its dim counted from the front (a layer, an
    elementwise op, a reduction of later dims, dims appended) or from the back (a broadcast
    against an operand with more dims), wherever exactly one of the two has the batch's
    size. Both can (``[N, D] * [N, N, D]``): not known."""
    shift = out.dim() - source.dim()
    n = source.shape[dim]
    places = {c for c in (dim, dim + shift) if 0 <= c < out.dim() and out.shape[c] == n}
    return places.pop() if len(places) == 1 else None


def _keeps_place(func, args, kwargs, source, dim, out) -> int | None:
    """Dims appended after the input's (``F.embedding``, ``one_hot``, ``unfold``)."""
    return dim


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


def _reshaped(func, args, kwargs, source, dim, out) -> int | None:
    """A reshape keeps entries in row-major order, so the batch stays a dim of its own
    exactly where the result has a dim of the batch's size whose preceding dims hold as many
    entries as the source's did before the batch."""
    before = math.prod(source.shape[:dim])
    n = source.shape[dim]
    for c in range(out.dim()):
        if out.shape[c] == n and math.prod(out.shape[:c]) == before:
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
    counting as index tensors)."""
    if args[0] is not source:
        return None
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    ellipses = [k for k, i in enumerate(index) if i is Ellipsis]
    if len(ellipses) > 1:
        return None
    if ellipses:
        rest = sum(_dims_consumed(i) for i in index)
        at = ellipses[0]
        index = index[:at] + (slice(None),) * (source.dim() - rest) + index[at + 1 :]
    placed, position, out_dim, blocks = None, 0, 0, []
    for i in index:
        if i is None:
            out_dim += 1
            continue
        width = _dims_consumed(i)
        if position <= dim < position + width and not isinstance(i, slice):
            return None  # one example, or examples picked by an index tensor or mask
        if _is_advanced(i):
            if not blocks or blocks[-1] != out_dim:
                blocks.append(out_dim)
        elif isinstance(i, slice):
            if position == dim:
                placed = out_dim
            out_dim += 1
        position += width
    if placed is None:  # the batch is after every index entry
        placed = out_dim + dim - position
    if not blocks:
        return placed
    block = out.dim() - (out_dim + source.dim() - position)
    if len(blocks) > 1 or blocks[0] <= placed:  # in front, or in place before the batch
        return placed + block
    return placed


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
            return _by_shape(func, args, kwargs, source, dim, out)
        value = _dim_argument(args, kwargs, position, default)
        if isinstance(value, Tensor):  # torch.max(a, b): elementwise
            return _by_shape(func, args, kwargs, source, dim, out)
        dims = _as_dims(value, source.dim())
        if dims is None:
            return _by_shape(func, args, kwargs, source, dim, out)
        if dim in dims:
            return None
        if removes and out.dim() < source.dim():
            return dim - sum(d < dim for d in set(dims))
        return dim

    return handler


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
    """``a @ b`` (``matmul``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``): the batch is a row of
    ``a``, a column of ``b`` or a broadcast batch dim of either; on the contracted dim it
    is summed over."""
    name = call_name(func)
    operands = list(args[1:3]) if name in ("addmm", "baddbmm", "addbmm") else list(args[:2])
    if name == "__rmatmul__":
        operands.reverse()
    if len(operands) != 2 or not all(isinstance(op, Tensor) for op in operands):
        return None
    places = {_product_place(k, operands, dim, out) for k in (0, 1) if operands[k] is source}
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
        return _by_shape(func, args, kwargs, source, dim, out)
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
    **dict.fromkeys(("embedding", "one_hot", "unfold"), _keeps_place),
    "__getitem__": _indexed,
    **dict.fromkeys(("select", "unbind"), _select),
    **dict.fromkeys(("cat", "concat", "concatenate", "stack"), _joined),
    **dict.fromkeys(
        ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm"),
        _matrix_product,
    ),
    "einsum": _einsum,
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
    **dict.fromkeys(
        (
            "narrow",
            "index_select",
            "gather",
            "scatter",
            "scatter_add",
            "scatter_reduce",
            "index_add",
            "index_copy",
            "index_fill",
            "index_reduce",
        ),
        _along(1, None),
    ),
    **dict.fromkeys(("take_along_dim", "repeat_interleave"), _along(2, None)),
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
    **dict.fromkeys(("norm", "vector_norm", "linalg_vector_norm"), _along(2, None, removes=True)),
}


__all__ = ["batch_dim_after", "call_name"]
