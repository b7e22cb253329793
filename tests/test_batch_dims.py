"""Following the batch dim through a per-sample block's forward (``graph.batch_dims`` and
``transport.batch_following.BatchedTensors``).

Oracle, independent of the code: a result dim ``c`` holds the batch when changing example
``m`` of the input (a random perturbation of its entries) changes only entries whose index
on ``c`` is ``m``. A claimed dim must pass it for every ``m`` (soundness: no rows from a
dim that is not the batch); for calls that only move entries, the oracle's dim must be
found (completeness).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.overrides import TorchFunctionMode

from semipack.graph.batch_dims import batch_dim_after, call_name
from semipack.transport.batch_following import NOT_HELD, BatchedTensors


class _Following(TorchFunctionMode):
    def __init__(self, batched: BatchedTensors) -> None:
        super().__init__()
        self.batched = batched

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.batched.follow(func, args, kwargs, result)
        return result


def _followed(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, object]:
    """``fn(x)`` with ``x`` held as batched on dim 0, and the batch dim the block gives."""
    batched = BatchedTensors()
    batched.add_inputs([x])
    with _Following(batched):
        out = fn(x)
    if batched.merged(out):  # the examples share a dim with other entries: none of its own
        return out, None
    return out, batched.batch_dim(out)


def _oracle(fn: Callable[[Tensor], Tensor], x: Tensor) -> set[int]:
    """The result dims that hold the batch by the perturbation oracle (module docstring)."""
    out = fn(x)
    n = x.shape[0]
    changed = []
    generator = torch.Generator().manual_seed(0)
    for m in range(n):
        moved = x.clone()
        moved[m] += torch.rand(moved[m].shape, generator=generator, dtype=x.dtype) + 0.5
        changed.append(fn(moved) != out)
    dims = set()
    for c in range(out.dim()):
        if out.shape[c] != n:
            continue
        index = torch.arange(n).reshape([-1 if d == c else 1 for d in range(out.dim())])
        if all(not (changed[m] & (index != m)).any() for m in range(n)):
            dims.add(c)
    return dims


def _check(fn: Callable[[Tensor], Tensor], x: Tensor, moves_only: bool) -> object:
    _, dim = _followed(fn, x)
    truth = _oracle(fn, x)
    assert dim is not NOT_HELD
    if dim is not None:
        assert dim in truth, f"claimed dim {dim}, oracle {truth}"
    elif moves_only:
        assert not truth, f"lost the batch the oracle finds on {truth}"
    return dim


N, T, D = 3, 3, 4  # as many tokens as examples: dim 1 has the batch's size


def _x() -> Tensor:
    return torch.randn(N, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


_W = torch.randn(D, 5, dtype=torch.float64)
_SQ = torch.randn(N, N, dtype=torch.float64)
_IDX = torch.tensor([2, 0])
_MASK = torch.tensor([True, False, True])

#: calls that only move, copy or pick entries: the block must find the oracle's dim.
MOVES: dict[str, Callable[[Tensor], Tensor]] = {
    # elementwise activations with no pointwise ATen tag (trial 75: refused as mixing)
    "F.threshold": lambda x: F.threshold(x, 0.3, -1.0),
    "nn.Threshold": lambda x: torch.nn.Threshold(0.3, -1.0)(x),
    "F.logsigmoid": lambda x: F.logsigmoid(x),
    # casts to another tensor's dtype, of another shape (trial 78: read as lost)
    "type_as(other)": lambda x: x.type_as(torch.zeros(2, dtype=torch.float32)),
    "to(other)": lambda x: x.to(torch.zeros(5, 2, dtype=torch.float32)),
    "transpose(0, 1)": lambda x: x.transpose(0, 1),
    "transpose(1, 2)": lambda x: x.transpose(1, 2),
    "torch.transpose": lambda x: torch.transpose(x, 0, 2),
    "swapaxes": lambda x: x.swapaxes(0, 1),
    "mT": lambda x: x.mT,
    "T of a matrix": lambda x: x[:, 0].T,
    "t()": lambda x: x[:, 0].t(),
    "permute": lambda x: x.permute(2, 0, 1),
    "movedim": lambda x: x.movedim(0, -1),
    "transpose_ in place": lambda x: x.clone().transpose_(0, 1),
    "transpose there and back": lambda x: (x.transpose(0, 1) * 2).transpose(0, 1),
    "reshape(N, -1)": lambda x: x.reshape(N, -1),
    "flatten(1)": lambda x: x.flatten(1),
    "flatten(0, 1)": lambda x: x.flatten(0, 1),
    "merged and split again": lambda x: x.flatten(0, 1).unflatten(0, (N, T)),
    "merged, scaled and viewed back": lambda x: (x.reshape(N * T, D) * 2).view(N, T, D),
    "merged then split elsewhere": lambda x: x.flatten(0, 1).unflatten(0, (T, N)),
    "unflatten": lambda x: x.unflatten(-1, (2, 2)),
    "unsqueeze(0)": lambda x: x.unsqueeze(0),
    "view(1, N, -1)": lambda x: x.view(1, N, -1),
    "squeeze": lambda x: x[:, :1].squeeze(1),
    "x[:, 0]": lambda x: x[:, 0],
    "x[0]": lambda x: x[0],
    "x[..., 1:]": lambda x: x[..., 1:],
    "x[:, None]": lambda x: x[:, None],
    "x[None, ..., None]": lambda x: x[None, ..., None],
    "x[1:]": lambda x: x[1:],
    "x[idx] on the batch": lambda x: x[_IDX],
    "x[:, idx]": lambda x: x[:, _IDX],
    "x[:, idx, idx]": lambda x: x[:, _IDX, _IDX],
    "x[idx, :, idx] (separated)": lambda x: x.transpose(0, 1)[_IDX, :, _IDX],
    "x[:, 0, idx]": lambda x: x[:, 0, _IDX],
    "x[mask] on the batch": lambda x: x[_MASK],
    "x[:, mask]": lambda x: x[:, _MASK],
    "x[tensor(1)]": lambda x: x[:, torch.tensor(1)],
    "expand": lambda x: x[:, None].expand(-1, 2, -1, -1),
    "expand in front": lambda x: x.expand(2, N, T, D),
    "repeat": lambda x: x.repeat(1, 2, 1),
    "repeat in front": lambda x: x.repeat(2, 1, 1, 1),
    "stack(dim=1)": lambda x: torch.stack([x, x], dim=1),
    "stack(dim=0)": lambda x: torch.stack([x, x]),
    "cat(dim=2)": lambda x: torch.cat([x, x], dim=2),
    "select(1, 0)": lambda x: x.select(1, 0),
    "unbind(1)": lambda x: x.unbind(1)[1],
    "unbind(0)": lambda x: x.unbind(0)[1],
    "narrow(1)": lambda x: x.narrow(1, 0, 2),
    "split(dim=2)": lambda x: x.split(2, dim=2)[1],
    "chunk(dim=0)": lambda x: x.chunk(3, dim=0)[0],
    "flip(0)": lambda x: x.flip(0),
    "flip(1)": lambda x: x.flip(1),
    "roll(1, 2)": lambda x: x.roll(1, 2),
    "roll(1)": lambda x: x.roll(1),
    "index_select(0)": lambda x: x.index_select(0, _IDX),
    "index_select(2)": lambda x: x.index_select(2, _IDX),
    "gather(2)": lambda x: x.gather(2, torch.zeros(N, T, 1, dtype=torch.long)),
    "einsum nij->jni": lambda x: torch.einsum("nij->jni", x),
    "einsum n...->...n": lambda x: torch.einsum("n...->...n", x),
    "einsum ...ij->...ji": lambda x: torch.einsum("...ij->...ji", x),
    "einsum implicit": lambda x: torch.einsum("nij", x),
    "sort(0)": lambda x: x.sort(0).values,
    "sort(-1)": lambda x: x.sort(-1).values,
}

torch.manual_seed(0)
_GRU_FIRST = torch.nn.GRU(D, 2, batch_first=True).double().requires_grad_(False)
_GRU_SEQUENCE_FIRST = torch.nn.GRU(D, 2).double().requires_grad_(False)
_ATTENTION = torch.nn.MultiheadAttention(D, 2, batch_first=True).double().requires_grad_(False)


def _scattered(x: Tensor, index: Tensor) -> Tensor:
    out = torch.zeros_like(x)
    out[index] = x
    return out


def _cls_written(x: Tensor) -> Tensor:
    out = torch.zeros(N, T, D, dtype=x.dtype)
    out[:, 0] = x[:, 0] * 2
    return out


def _through_a_view(x: Tensor) -> Tensor:
    h = x * 1
    h.narrow(0, 0, 1).add_(h.narrow(0, 1, 1))
    return h


def _written_through_a_view(x: Tensor) -> Tensor:
    h = x * 1
    v = h.transpose(0, 1)
    v[:, 0] = v[:, 1]
    return h


def _last_token(x: Tensor) -> Tensor:
    last = (x[:, :, 0] > 0).long().sum(1).clamp(max=T - 1)
    return x[torch.arange(N), last]


#: calls that combine entries: a claimed dim must pass the oracle.
COMBINES: dict[str, Callable[[Tensor], Tensor]] = {
    "diagonal(0, 1, 2)": lambda x: x[:, :, :T].diagonal(0, 1, 2),
    "tril of the last dims": lambda x: x.tril(),
    "tril with the batch in the last dims": lambda x: x.transpose(0, 2).tril().transpose(0, 2),
    "embedding of a batched table": lambda x: F.embedding(torch.tensor([1, 0, 2]), x[:, 0]),
    "written through a transposed view": _written_through_a_view,
    "diagonal(0, 0, 1)": lambda x: x.diagonal(0, 0, 1),
    "a product over merged heads": lambda x: (
        x.reshape(N * T, 1, D) @ x.reshape(N * T, D, 1)
    ).reshape(N, T),
    "a sum over the merged dim": lambda x: x.flatten(0, 1).sum(0),
    "baddbmm by keyword over merged heads": lambda x: (
        torch.ones(N * T, 1, 1, dtype=x.dtype)
        .baddbmm(batch1=x.reshape(N * T, 1, D), batch2=x.reshape(N * T, D, 1))
        .reshape(N, T)
    ),
    "addbmm sums the batch": lambda x: torch.addbmm(torch.zeros(T, T, dtype=x.dtype), x, x.mT),
    "tensordot over the batch": lambda x: torch.tensordot(_SQ, x[:, :, 0], dims=([1], [0])),
    "tensordot over features": lambda x: torch.tensordot(x, _W, dims=1),
    "linalg.matmul over the batch": lambda x: torch.linalg.matmul(_SQ, x[:, :, 0]),
    "linalg.matmul": lambda x: torch.linalg.matmul(x, _W),
    "mv over the batch": lambda x: torch.mv(_SQ, x[:, 0, 0]),
    "as_strided transpose": lambda x: x.as_strided((T, N, D), (D, T * D, 1)),
    "negative pad on the batch": lambda x: F.pad(x, (0, 0, 0, 0, 1, -1)),
    "pad of the features": lambda x: F.pad(x, (1, 1)),
    "diff with prepend": lambda x: torch.diff(x, dim=0, prepend=torch.zeros(1, T, D)),
    "diff along tokens": lambda x: torch.diff(x, dim=1),
    "written at permuted places": lambda x: _scattered(x, torch.tensor([2, 0, 1])),
    "index_put at permuted places": lambda x: torch.zeros_like(x).index_put(
        (torch.tensor([2, 0, 1]),), x
    ),
    "a class token written in": _cls_written,
    "written through a view": _through_a_view,
    "the last token of each": _last_token,
    "gather by a batched index": lambda x: x.gather(1, (x[:, :1, :1] > 0).long().expand(N, 1, D)),
    "GRU batch first": lambda x: _GRU_FIRST(x)[0],
    "GRU batch first, last state": lambda x: _GRU_FIRST(x)[1].transpose(0, 1),
    "GRU sequence first on a batch-first input": lambda x: _GRU_SEQUENCE_FIRST(x)[0],
    "attention, batch first": lambda x: _ATTENTION(x, x, x)[0],
    "attention weights": lambda x: _ATTENTION(x, x, x)[1],
    "attention over the batch": lambda x: _ATTENTION(x.transpose(0, 1), x, x)[0],
    "cat(dim=0)": lambda x: torch.cat([x, x[:0]], dim=0),
    "x @ x": lambda x: x[:, :, :T] @ x[:, :, :T],
    "matmul of one matrix with itself": lambda x: x[:, 0, :N] @ x[:, 0, :N],
    "x @ W": lambda x: x @ _W,
    "matmul of a matrix": lambda x: x[:, 0] @ _W,
    "W @ x (over the batch)": lambda x: _SQ @ x[:, :, 0],
    "W @ x batched": lambda x: _SQ @ x,
    "x @ v": lambda x: x @ _W[:, 0],
    "v @ x.mT": lambda x: _W[:, 0] @ x.mT,
    "x @ x.mT": lambda x: x @ x.mT,
    "x @ x.T over the batch": lambda x: x[:, 0] @ x[:, 0].T,
    "bmm": lambda x: torch.bmm(x, x.mT),
    "addmm": lambda x: torch.addmm(_W[0], x[:, 0], _W),
    "einsum ntd,de->nte": lambda x: torch.einsum("ntd,de->nte", x, _W),
    "einsum ntd,mtd->nm": lambda x: torch.einsum("ntd,mtd->nm", x, x),
    "einsum ntd->td": lambda x: torch.einsum("ntd->td", x),
    "linear": lambda x: F.linear(x, _W.T),
    "sum(1)": lambda x: x.sum(1),
    "sum(0)": lambda x: x.sum(0),
    "sum()": lambda x: x.sum().reshape(1),
    "mean(-1, keepdim)": lambda x: x.mean(-1, keepdim=True),
    "mean(0, keepdim)": lambda x: x.mean(0, keepdim=True).expand(N, T, D),
    "max(1)": lambda x: x.max(1).values,
    "amax((1, 2))": lambda x: x.amax((1, 2)),
    "std(0)": lambda x: x.std(0),
    "norm(dim=2)": lambda x: x.norm(dim=2),
    "norm(2, 0)": lambda x: x.norm(2, 0),
    "logsumexp(0)": lambda x: torch.logsumexp(x, 0),
    "softmax(0)": lambda x: x.softmax(0),
    "softmax(-1)": lambda x: x.softmax(-1),
    "cumsum(0)": lambda x: x.cumsum(0),
    "cumsum(1)": lambda x: x.cumsum(1),
    "topk(-1)": lambda x: x.topk(2).values,
    "normalize(dim=0)": lambda x: F.normalize(x, dim=0),
    "x - x.mean(0)": lambda x: x - x.mean(0),
    "x + x.transpose(0, 1)": lambda x: x + x.transpose(0, 1),
    "broadcast against more dims": lambda x: x * torch.ones(2, N, T, D, dtype=x.dtype),
    "broadcast against N in front": lambda x: x * torch.ones(N, N, T, D, dtype=x.dtype),
    "where": lambda x: torch.where(x > 0, x, torch.zeros(T, D, dtype=x.dtype)),
    "conv1d": lambda x: F.conv1d(x, torch.ones(2, T, 2, dtype=x.dtype)),
    "unfold": lambda x: F.unfold(x[:, None], (2, 2)),
    "softmax of scores": lambda x: (x @ x.mT).softmax(-1) @ x,
    "conv1d along the batch": lambda x: F.conv1d(
        x.permute(1, 2, 0), torch.ones(2, D, 2, dtype=x.dtype), padding=1
    ).permute(2, 0, 1),
    "conv1d over channels that are the batch": lambda x: F.conv1d(
        x.transpose(0, 1), torch.ones(N, N, 1, dtype=x.dtype)
    ).transpose(0, 1),
    "max_pool1d along the batch": lambda x: F.max_pool1d(x.transpose(0, 2), 2, 1, 1)[
        ..., :N
    ].transpose(0, 2),
    "max_pool1d along the tokens": lambda x: F.max_pool1d(x.transpose(1, 2), 2, 1, 1)[..., :T],
    "linear over the batch": lambda x: F.linear(x.transpose(0, 2), _SQ),
    "group_norm over the batch": lambda x: F.group_norm(x.transpose(0, 1), 1),
    "group_norm per example": lambda x: F.group_norm(x, 1),
    "interpolate along the batch": lambda x: F.interpolate(x.transpose(0, 2), size=N),
    "interpolate along the tokens": lambda x: F.interpolate(x.transpose(1, 2), size=T),
}


@pytest.mark.parametrize("name", list(MOVES))
def test_moves_find_the_oracles_dim(name: str) -> None:
    _check(MOVES[name], _x(), moves_only=True)


@pytest.mark.parametrize("name", list(COMBINES))
def test_combining_calls_never_claim_a_dim_the_oracle_refutes(name: str) -> None:
    _check(COMBINES[name], _x(), moves_only=False)


def test_where_the_common_cases_put_the_batch() -> None:
    """Exact dims for the layouts per-sample rows depend on (each also passes the oracle
    above): moved by a transpose, back after a second one, kept by layers and reductions of
    later dims, lost by a reduction over it."""
    x = _x()
    expected = {
        "transpose(0, 1)": 1,
        "transpose there and back": 0,
        "merged and split again": 0,
        "merged, scaled and viewed back": 0,
        "einsum n...->...n": 2,
        "x[idx, :, idx] (separated)": 1,
        "stack(dim=0)": 1,
        "x[1:]": None,
        "x[mask] on the batch": None,
    }
    for name, dim in expected.items():
        assert _followed(MOVES[name], x)[1] == dim, name
    combining = {
        "x @ W": 0,
        "sum(1)": 0,
        "sum(0)": None,
        "x @ x.mT": 0,
        "conv1d along the batch": None,
        "max_pool1d along the tokens": 0,
        "linear over the batch": None,
        "group_norm per example": 0,
        "interpolate along the tokens": 0,
        "tensordot over features": 0,
        "diagonal(0, 1, 2)": 0,
        "tril of the last dims": 0,
        "a product over merged heads": 0,
        "baddbmm by keyword over merged heads": 0,
        "linalg.matmul": 0,
        "pad of the features": 0,
        "diff along tokens": 0,
        "a class token written in": 0,
        "the last token of each": 0,
        "gather by a batched index": 0,
        "GRU batch first": 0,
        "GRU batch first, last state": 0,
        "attention, batch first": 0,
        "attention weights": 0,
    }
    for name, dim in combining.items():
        assert _followed(COMBINES[name], x)[1] == dim, name


_INDEX_PART = st.one_of(
    st.just(slice(None)),
    st.builds(slice, st.integers(0, 1), st.just(None)),
    st.integers(-2, 1),
    st.just(None),
    st.just(Ellipsis),
    st.lists(st.integers(0, 1), min_size=1, max_size=2).map(torch.tensor),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_INDEX_PART, min_size=1, max_size=4), st.permutations([0, 1, 2]))
def test_any_index_passes_the_oracle(index: list, order: list[int]) -> None:
    """Random basic and advanced indexes of a permuted batch: a claimed dim holds the batch
    and a dim the oracle finds is found (indexing only picks entries)."""
    key = tuple(index)
    if sum(i is Ellipsis for i in key) > 1:
        return  # PyTorch reads a second ellipsis its own way; refused as not known
    x = _x()

    def fn(t: Tensor) -> Tensor:
        return t.permute(*order)[key]

    try:
        fn(x)
    except (IndexError, RuntimeError, TypeError):
        return  # not a valid index for this shape
    _check(fn, x, moves_only=True)


@settings(max_examples=200, deadline=None)
@given(
    st.permutations([0, 1, 2]),
    st.sampled_from([(N, -1), (1, N, T, D), (N * T, D), (N, T, 2, 2), (D, T, N), (T, N * D)]),
)
def test_any_reshape_of_a_permutation_passes_the_oracle(order: list[int], shape: tuple) -> None:
    x = _x()

    def fn(t: Tensor) -> Tensor:
        return t.permute(*order).reshape(shape)

    _check(fn, x, moves_only=True)


def test_call_names() -> None:
    assert call_name(torch.Tensor.transpose_) == "transpose"
    assert call_name(torch.transpose) == "transpose"
    assert call_name(torch.Tensor.T.__get__) == "T"
    assert call_name(torch.Tensor.__matmul__) == "__matmul__"


def test_a_result_without_dims_has_no_batch() -> None:
    x = _x()
    assert batch_dim_after(torch.sum, (x,), {}, x, 0, x.sum()) is None
