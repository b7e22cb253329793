"""Per-sample parameter messages (``extend(..., per_sample=True)``): which autograd nodes may
touch a parameter, and which nodes mix the examples of a batch.

A parameter's message is a semiring contraction over the batch: for a linear weight,
``W[o, i] = ⊕_{n, t} m[n, t, o] ⊗ x[n, t, i]``. Per-sample values keep the batch axis instead
(``rows[n, o, i] = ⊕_t ...``). Only a node that knows its batch axis can do that, so each such
node is registered here by its autograd node name; the per-sample pass refuses (before it runs)
a graph in which any other node feeds a parameter of the model, and a graph with a node that
mixes examples (``mixing_reason``): there a row would no longer be "what example n alone gives".

Two kinds of entries:

- the module extensions (``extensions/``) compute their rows themselves in their backward
  (``ExtensionFunction.per_sample``) and register with ``register_per_sample(name)``;
- a few generic autograd nodes get a *row rule* here (``register_per_sample(name, rule)``): the
  pass calls ``rule(semiring, node, state, input_nr)`` from a pre-hook on the node with the
  state of the node's output, and the rule returns the ``[N, *param.shape]`` rows of the
  parameter at ``input_nr``. Built in: a parameter broadcast into ``x * p``, ``x + p``,
  ``x - p`` (a hand-written bias, gain or layer scale), batch norm's affine parameters in
  eval mode, group norm's and instance norm's (the repeat of its parameters that PyTorch's
  ``instance_norm`` makes, ``_instance_norm_repeat``), ``F.rms_norm``'s gain (a product whose
  other factor is made inside the call, ``_batched_as_the_product``; a GPU's fused node,
  ``_fused_rms_norm_rows``), and a parameter expanded to the batch
  (a class token, ``batch_expand_rows``: the ``ExpandBackward0`` the batch following marked,
  once its dim 0 met the batch).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..errors import PerSampleError
from ..semirings.base import Semiring, State
from .embedding import BagLookups, bag_table_state

#: rows of the parameter at ``input_nr`` of ``node`` from the state at the node's output.
RowRule = Callable[[Semiring, object, State, int], State]

#: autograd node name -> its row rule, or None for nodes that report their own rows.
PER_SAMPLE_NODES: dict[str, RowRule | None] = {}

#: autograd node name -> which nodes of that name have rows, for a name whose nodes have them
#: only where a call made them (``RepeatBackward0``: instance norm's repeat of its parameters).
_ONLY_WHERE: dict[str, Callable[[object], bool]] = {}


def register_per_sample(
    node_name: str, rule: RowRule | None = None, only_where: Callable[[object], bool] | None = None
) -> None:
    """Declare that the autograd node ``node_name`` has per-sample rows for the parameters it
    feeds: computed by ``rule`` (see the module docstring) or, without one, reported by the
    node's own backward (``ExtensionFunction.per_sample``); with ``only_where``, only the
    nodes of that name it accepts."""
    PER_SAMPLE_NODES[node_name] = rule
    if only_where is not None:
        _ONLY_WHERE[node_name] = only_where


def has_per_sample_rule(node) -> bool:
    """Whether the autograd node ``node`` computes per-sample rows for the parameters it
    feeds."""
    name = node.name()
    if name not in PER_SAMPLE_NODES:
        return False
    only_where = _ONLY_WHERE.get(name)
    return only_where is None or only_where(node)


def row_rule(node) -> RowRule | None:
    """The generic row rule of the autograd node ``node`` (None for self-reporting nodes and
    for nodes without rows)."""
    return PER_SAMPLE_NODES.get(node.name()) if has_per_sample_rule(node) else None


# --- generic row rules -------------------------------------------------------------------------


def _broadcast_rows(sr: Semiring, state: State, param_shape: Sequence[int]) -> State:
    """Rows ``[N, *param_shape]`` of a parameter broadcast into a batched output: the state
    (shaped like the output, batch on dim 0) semiring-summed over every other broadcast dim."""
    out = state[0].shape
    shape = list(param_shape)
    if len(shape) == len(out):
        if shape[0] != 1 and out[0] != 1:
            raise PerSampleError(
                f"per-sample values: its value, of shape {tuple(shape)}, spans the batch dim of "
                f"the output, of shape {tuple(out)}, with no expand to the batch that met it "
                "there: a table with a row per example, or an expanded value moved before it "
                "met the batch, has no per-sample rows"
            )
        shape = shape[1:]
    if len(shape) >= len(out):
        raise PerSampleError(
            f"per-sample values: its value, of shape {tuple(param_shape)}, is not broadcast "
            f"over the batched output, of shape {tuple(out)}"
        )
    target = [1] * (len(out) - 1 - len(shape)) + shape
    dims = [d + 1 for d, size in enumerate(target) if size == 1 and out[d + 1] != 1]
    rows = sr.sum(state, dims, keepdim=True) if dims else state
    return tuple(p.reshape(out[0], *param_shape) for p in rows)


def _param_shape(node, input_nr: int) -> torch.Size:
    """The shape of ``node``'s input ``input_nr``: a parameter, or a value computed from one
    alone (``parameter_step``: ``1 + w``, ``w.float()``, ``w.t()``)."""
    return input_shape(node.next_functions[input_nr][0])


def input_shape(nxt) -> torch.Size:
    """The shape of the value an input edge's node ``nxt`` receives the gradient of: the leaf's
    (``AccumulateGrad``) or the node's own output's."""
    variable = getattr(nxt, "variable", None)
    if variable is not None:
        return variable.shape
    return torch.Size(nxt._input_metadata[0].shape)


#: Autograd node metadata of ``x * p`` with a leaf ``p``: the two factors, kept by the
#: per-sample block's forward (``transport.per_sample.BatchedTensors``). Reading the node's
#: saved factor instead unpacks it, and inside a non-reentrant checkpoint a saved tensor may
#: be unpacked once: the node's own backward then raised ``CheckpointError``.
FACTORS_KEY = "semipack_factors"


def _mul_factor(node, input_nr: int) -> Tensor:
    """The factor of ``MulBackward0`` that multiplies its input ``input_nr``'s entries."""
    factors = node.metadata.get(FACTORS_KEY)
    if factors is not None:
        return factors[1 - input_nr]
    return node._saved_other if input_nr == 0 else node._saved_self


def _mul_rows(sr: Semiring, node, state: State, input_nr: int) -> State:
    """``x * p``: the edge from p[j] to out[n, ...] weighs the other factor there."""
    other = _mul_factor(node, input_nr)
    weighted = sr.scale(state, other.expand(state[0].shape).to(state[0].dtype))
    return _broadcast_rows(sr, weighted, _param_shape(node, input_nr))


def _add_rows(sign: float) -> RowRule:
    def rows(sr: Semiring, node, state: State, input_nr: int) -> State:
        """``x + alpha * p`` (``x - alpha * p``): each edge from p weighs ±alpha, 1 from x."""
        out = _broadcast_rows(sr, state, _param_shape(node, input_nr))
        weight = 1.0 if input_nr == 0 else sign * float(node._saved_alpha)
        if weight == 1.0:
            return out
        return sr.scale(out, torch.tensor(weight, dtype=out[0].dtype))

    return rows


def _batch_norm_eval_rows(sr: Semiring, node, state: State, input_nr: int) -> State:
    """Batch norm in eval mode: ``out = x̂ γ + β`` with x̂ from the running statistics, so the
    edge from γ[c] to out[n, c, ...] weighs x̂[n, c, ...] and the one from β[c] weighs 1."""
    if getattr(node, "_saved_training", True):
        raise PerSampleError(
            "per-sample values: batch norm in train mode normalises over the batch (use eval mode)"
        )
    dtype = state[0].dtype
    if input_nr == 1:
        x: Tensor = node._saved_input
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = node._saved_running_mean.reshape(shape)
        var = node._saved_running_var.reshape(shape)
        eps = getattr(node, "_saved_eps", None)  # cuDNN's and MIOpen's nodes: epsilon
        eps = node._saved_epsilon if eps is None else eps
        x_hat = ((x - mean) * torch.rsqrt(var + eps)).to(dtype)
        state = sr.scale(state, x_hat)
    n, c = state[0].shape[:2]
    dims = list(range(2, state[0].dim()))
    rows = sr.sum(state, dims) if dims else state
    return tuple(p.reshape(n, c) for p in rows)


def _group_norm_rows(sr: Semiring, node, state: State, input_nr: int) -> State:
    """Group norm: its statistics are each example's own (over a group of its channels and
    positions), so ``out = x̂ γ + β`` mixes no examples: the edge from γ[c] to out[n, c, ...]
    weighs x̂[n, c, ...] and the one from β[c] weighs 1. GroupNorm is what per-example
    training puts where batch norm would mix the batch."""
    dtype = state[0].dtype
    if input_nr == 1:
        x: Tensor = node._saved_input
        n, groups = x.shape[0], int(node._saved_group)
        grouped = x.reshape(n, groups, -1)
        mean, rstd = node._saved_result1, node._saved_result2  # [N, G] each
        x_hat = ((grouped - mean[..., None]) * rstd[..., None]).reshape(x.shape).to(dtype)
        state = sr.scale(state, x_hat)
    n, c = state[0].shape[:2]
    dims = list(range(2, state[0].dim()))
    rows = sr.sum(state, dims) if dims else state
    return tuple(p.reshape(n, c) for p in rows)


#: Autograd node metadata: the node's output was computed from the model's input in a
#: per-sample block, its batch on the dim this key holds (None: no dim holds one example
#: per index); ``transport.per_sample.BatchedTensors`` marks it during the forward.
BATCHED_KEY = "semipack_batched"

#: Autograd node metadata: the name of the call that made the node as one of its inner ops
#: (``rms_norm``'s multiplications), when the block saw only that call: the batch following
#: does not mark such a node, and the error says which call hid it.
INSIDE_CALL_KEY = "semipack_inside_call"

#: Node metadata: the call by which a value lost the batch (``transport.batch_following``).
LOST_BY_KEY = "semipack_batch_lost_by"

#: Node metadata of a layer call (a module extension's node) whose input holds the batch merged
#: with the dims after it on the layer's batch dim (``x.reshape(N * T, d)``, the batch the outer
#: factor): the number of examples there. The batch following stamps it on the layers that
#: act on each index of that dim apart (``SPLITS_MERGED_BATCH``); their rows split it out again.
MERGED_EXAMPLES_KEY = "semipack_merged_examples"

#: The layers (``transport.batch_following.LAYER_INPUTS``' names) whose per-sample rows read a
#: merged batch (``MERGED_EXAMPLES_KEY``): a linear map or a normalisation of the last dims.
SPLITS_MERGED_BATCH = frozenset(("Linear", "LayerNorm"))


def how_lost(call: str) -> str:
    """What the call ``call`` (a ``graph.batch_dims.call_name``) did to the batch, in words."""
    if call in MERGING:
        return (
            f"'{call}' merged the batch with other dims or split it (x.reshape(N * T, -1), "
            "x.reshape(2, N // 2, -1)): every layer must see the batch as a dim of its own"
        )
    if call == "__getitem__":
        return "indexing picked or reordered examples"
    if call == "__setitem__":
        return "an indexed assignment wrote examples into other places"
    if call == UNSEEN_WRITE:
        return (
            "its values changed by a write the block did not see (code below Python, or an op "
            "under DisableTorchFunction, in a custom autograd.Function's forward say)"
        )
    return f"'{call}' mixed, split or picked the examples"


#: The ``lost_by`` of a tensor whose version counter moved by a write the block did not see.
UNSEEN_WRITE = "a write the block did not see"


MERGING = frozenset(("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel"))


#: The calls of the recurrent layers (``torch.lstm`` and kin, as ``INSIDE_CALL_KEY`` names
#: them): their weights have no per-sample rows.
_RECURRENT_CALLS = frozenset(("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell"))

#: The generic rules that read the parameter's use off a product or sum with another operand:
#: their rows are right only when that operand carries the batch.
_BROADCAST_NODES = ("MulBackward0", "AddBackward0", "SubBackward0")


def unbatched_operand(node, input_nr: int, is_batched: Callable[[Tensor], bool]) -> str | None:
    """Why the other operand of ``x * p``, ``x + p`` or ``x - p`` (``node``, the parameter at
    ``input_nr``) may not carry the batch on dim 0, or None when it does: the model's input or
    a value computed from it in the block with the batch kept on dim 0 (``is_batched``, and
    nodes marked ``BATCHED_KEY``). A
    parameter, a buffer, a constant or a value computed from those alone does not, and the
    rule would read its dim 0 as the batch: ``proj * gain`` with a buffer ``proj`` of shape
    [O, I] gave O "rows" where O equalled the batch size, and so did a positional table
    computed from a buffer and added to the activations. An add's operand is not saved: one
    that no node feeds is not known to be batched."""
    if node.name() not in _BROADCAST_NODES:
        return None
    if node.name() == "MulBackward0" and _batched_as_the_product(node, _mul_factor(node, input_nr)):
        return None
    other, _ = node.next_functions[1 - input_nr]
    if other is not None:
        leaf = getattr(other, "variable", None)
        if leaf is None:
            inside = other.metadata.get(INSIDE_CALL_KEY)
            if BATCHED_KEY not in other.metadata and inside in _RECURRENT_CALLS:
                return (
                    f"a value {other.name()} computed inside '{inside}': recurrent layers "
                    "(RNN, LSTM, GRU) have no per-sample rows, whichever kernel runs them"
                )
            if BATCHED_KEY not in other.metadata and inside is not None:
                return (
                    f"a value {other.name()} computed inside '{inside}', a call whose own ops "
                    "the block does not follow one by one (only the layers and products the "
                    "README lists have per-sample rows; a call's own product with a parameter "
                    "has them where the call's result has the batch on dim 0, as F.rms_norm's "
                    "gain does)"
                )
            if BATCHED_KEY not in other.metadata:
                return (
                    f"a value {other.name()} computed without the model's input, as far as the "
                    "block saw (a custom autograd.Function, a scripted function or a forward "
                    "called without the module's __call__ hide it)"
                )
            dim = other.metadata[BATCHED_KEY]
            if dim == 0:
                return None
            if dim is None:
                lost = other.metadata.get(LOST_BY_KEY)
                how = how_lost(lost) if lost else "the examples were mixed, split or picked"
                return (
                    f"a value {other.name()} computed from the model's input in which no dim "
                    f"holds one example per index ({how})"
                )
            return (
                f"a value {other.name()} computed from the model's input with the batch on dim "
                f"{dim}, not dim 0 (a transpose, say)"
            )
        if is_batched(leaf):
            return None  # the model's input, asked for its own semiring_grad
        return "another parameter or leaf"
    if node.name() == "MulBackward0":
        factor = _mul_factor(node, input_nr)
        if is_batched(factor):
            return None
        return (
            f"a factor of shape {tuple(factor.shape)} whose dim 0 is not the batch (not computed "
            "from the model's input, or with its batch moved off dim 0)"
        )
    return "an operand not computed in the graph"


def _batched_as_the_product(node, factor: Tensor) -> bool:
    """Whether ``factor`` carries the batch on dim 0 because the product ``node`` (``factor *
    p``, p the parameter) does: the block followed the product's own output with the batch on
    dim 0 (``BATCHED_KEY``), and the factor has the output's shape. p is no value computed
    from the input, so the batch came in through the factor. That is how ``F.rms_norm``'s gain
    meets a value made inside the call (``x * rsqrt(mean(x²) + eps)``), which the block does
    not see but whose result it follows (in half precision the result is a cast of the product,
    and the block's batch dim reaches the product through it:
    ``transport.batch_following.share_batch_with_inner_nodes``)."""
    if node.metadata.get(BATCHED_KEY, None) != 0:
        return False
    return tuple(factor.shape) == tuple(node._input_metadata[0].shape)


# --- values computed from a parameter alone ---------------------------------------------------
# Gemma's RMSNorm scales by ``1 + w.float()``, other code by ``w.t()`` or ``2 * w``: the row
# rule's input there is not the parameter but a value computed from it alone, the same for every
# example. Its rows ``[N, *value.shape]`` become the parameter's through that value's own ops,
# each taken back as the generic op rules draw it: an edge of weight 1 for a cast or an added
# constant, of the constant for a product, a move of the entries for a transpose or a view.
#: node name -> ``step(sr, node, rows, input_nr)``: the rows of the node's input ``input_nr``
#: from the rows of its output (both ``[N, ...]``).
ParameterStep = Callable[[Semiring, object, State, int], State]


def _scaled(sr: Semiring, rows: State, weight: float | Tensor) -> State:
    if not isinstance(weight, Tensor) and weight == 1.0:
        return rows
    return sr.scale(rows, torch.as_tensor(weight, dtype=rows[0].dtype).to(rows[0].device))


def _same(sr: Semiring, node, rows: State, input_nr: int) -> State:
    return rows


def _add_step(sign: float) -> ParameterStep:
    def step(sr: Semiring, node, rows: State, input_nr: int) -> State:
        return _scaled(sr, rows, 1.0 if input_nr == 0 else sign * float(node._saved_alpha))

    return step


def _rsub_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    return _scaled(sr, rows, -float(node._saved_alpha))  # other - alpha * self


def _neg_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    return _scaled(sr, rows, -1.0)


def _mul_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    factor = _mul_factor(node, input_nr).to(rows[0].dtype)
    return _scaled(sr, rows, factor.expand(rows[0].shape[1:]))


def _div_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    # ones / c, not c.reciprocal(): a Python number is saved as a "wrapped number", and a unary
    # op on one gives the default dtype (1/3 rounded to float32 in a float64 model)
    dtype = rows[0].dtype if rows[0].is_floating_point() else torch.float64  # Boolean's bool
    ones = torch.ones(rows[0].shape[1:], dtype=dtype, device=rows[0].device)
    return _scaled(sr, rows, ones.div_(node._saved_other.to(dtype)))


def _t_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    return tuple(p.transpose(1, 2) if p.dim() == 3 else p for p in rows)


def _transpose_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    rank = rows[0].dim() - 1
    d0, d1 = (_signed(int(d)) % rank for d in (node._saved_dim0, node._saved_dim1))
    return tuple(p.transpose(d0 + 1, d1 + 1) for p in rows)


def _permute_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    rank = rows[0].dim() - 1
    dims = [_signed(int(d)) % rank for d in node._saved_dims]
    inverse = [dims.index(i) for i in range(rank)]
    return tuple(p.permute(0, *(i + 1 for i in inverse)) for p in rows)


def _view_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    shape = tuple(node._saved_self_sym_sizes)
    return tuple(p.reshape(p.shape[0], *shape) for p in rows)


def _unsqueeze_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    rank = rows[0].dim() - 1
    return tuple(p.squeeze(_signed(int(node._saved_dim)) % rank + 1) for p in rows)


def _summed_to(sr: Semiring, rows: State, shape: Sequence[int]) -> State:
    """Rows ``[N, *out]`` of a value broadcast from ``shape`` to ``out``, as rows
    ``[N, *shape]``: an entry feeds every entry it is broadcast to, so its row is the semiring
    sum over them (the size-1 dims made larger and the new leading ones)."""
    out = rows[0].shape[1:]
    leading = len(out) - len(shape)
    kept = [1 + leading + d for d, n in enumerate(shape) if n == 1 and out[leading + d] != 1]
    if kept:
        rows = sr.sum(rows, kept, keepdim=True)
    if leading:
        rows = sr.sum(rows, list(range(1, 1 + leading)))
    return tuple(p.reshape(p.shape[0], *shape) for p in rows)


def _expand_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    """``w.expand(...)``: ``_summed_to`` the shape of ``w``."""
    return _summed_to(sr, rows, tuple(node._saved_self_sym_sizes))


def _placed(sr: Semiring, rows: State, shape: Sequence[int], where: tuple) -> State:
    """Rows ``[N, *shape]`` holding ``rows`` at ``where`` (an index of ``shape``) and the
    semiring's zero (no path) at every entry it leaves out."""
    n = rows[0].shape[0]
    full = tuple(
        torch.full((n, *shape), zero, dtype=r.dtype, device=r.device)
        for r, zero in zip(rows, sr.zero, strict=True)
    )
    for f, r in zip(full, rows, strict=True):
        f[(slice(None), *where)] = r
    return full


def _slice_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    """``w[:, a:b:c]`` (YOLOS's position table cut to the tokens): the rows of the slice go
    back to its entries of ``w``; the entries the slice leaves out get no path."""
    shape = tuple(node._saved_self_sym_sizes)
    dim = _signed(int(node._saved_dim)) % len(shape)
    start, end, step = (
        _signed(int(v)) for v in (node._saved_start, node._saved_end, node._saved_step)
    )
    window = slice(*slice(start, end, step).indices(shape[dim]))
    return _placed(sr, rows, shape, (slice(None),) * dim + (window,))


def _select_step(sr: Semiring, node, rows: State, input_nr: int) -> State:
    """``w[i]`` (a layer's own slice of a stacked table, YOLOS's ``mid_position_embeddings``):
    the rows go back to entry ``i`` of the selected dim, every other entry gets no path."""
    shape = tuple(node._saved_self_sym_sizes)
    dim = _signed(int(node._saved_dim)) % len(shape)
    index = _signed(int(node._saved_index)) % shape[dim]
    return _placed(sr, rows, shape, (slice(None),) * dim + (index,))


#: Autograd node metadata: an ``ExpandBackward0`` whose output is a parameter (or a value
#: computed from one alone) expanded to the batch on dim 0 (ViT's class token
#: ``cls.expand(N, -1, -1)``, Perceiver's learned queries, ``b.view(1, C, 1, 1).expand_as(h)``):
#: set by the block's batch following, with a provisional mark on dim 0 that must meet the
#: batch there (``LAYER_MARKS_KEY``).
EXPANDED_KEY = "semipack_expanded_over_batch"


def expanded_over_batch(node) -> bool:
    """Whether ``node`` expanded a parameter's value to the batch (``EXPANDED_KEY``): its
    output's entry ``[n, ...]`` is read by example ``n`` alone once the mark met the batch on
    dim 0, so the node computes the parameter's rows itself (``batch_expand_rows``)."""
    return EXPANDED_KEY in node.metadata


def batch_expand_rows(sr: Semiring, node, state: State, input_nr: int) -> State:
    """Rows of the value ``node`` expanded to the batch: example ``n``'s are the state at its
    own entries ``[n, ...]``, summed over every other dim the expand broadcast
    (``_summed_to`` the value's dims below the batch), shaped ``[N, *value.shape]`` (a size-1
    dim 0 of the value stays). Where an expand broadcasts an entry over the examples, no other
    example reads it, so its row is what example ``n`` alone gives (the batch following
    confirmed the dim as the batch's)."""
    shape = tuple(node._saved_self_sym_sizes)
    inner = shape[1:] if len(shape) == state[0].dim() else shape  # the dims below the batch
    return tuple(p.reshape(p.shape[0], *shape) for p in _summed_to(sr, state, inner))


#: The ops a value computed from one parameter alone may pass through on its way to a row rule.
PARAMETER_STEPS: dict[str, ParameterStep] = {
    "ToCopyBackward0": _same,
    "AliasBackward0": _same,
    "CloneBackward0": _same,
    "AddBackward0": _add_step(1.0),
    "SubBackward0": _add_step(-1.0),
    "RsubBackward1": _rsub_step,
    "NegBackward0": _neg_step,
    "MulBackward0": _mul_step,
    "DivBackward0": _div_step,
    "TBackward0": _t_step,
    "TransposeBackward0": _transpose_step,
    "PermuteBackward0": _permute_step,
    "ViewBackward0": _view_step,
    "UnsafeViewBackward0": _view_step,
    "ReshapeAliasBackward0": _view_step,
    "UnsqueezeBackward0": _unsqueeze_step,
    "SqueezeBackward0": _view_step,  # the input's shape, with its size-1 dims back
    "SqueezeBackward1": _view_step,
    "SqueezeBackward2": _view_step,
    "ExpandBackward0": _expand_step,
    "SliceBackward0": _slice_step,
    "SelectBackward0": _select_step,
}
_ELEMENTWISE_STEPS = {
    "AddBackward0",
    "SubBackward0",
    "RsubBackward1",
    "MulBackward0",
    "DivBackward0",
}


#: The calls of ``x @ W``: ``torch.matmul``, ``torch.linalg.matmul``, ``Tensor.matmul`` and the
#: operator.
MATMULS = (torch.matmul, torch.linalg.matmul, Tensor.matmul, Tensor.__matmul__)


def parameter_projection(input: object, other: object) -> bool:
    """Whether ``input @ other`` is a projection by a parameter: ``other`` a 2-D floating
    parameter, or a value computed from one parameter alone through ``PARAMETER_STEPS``
    (``W.T``, ``2 * W``, ``W.to(dtype)``), ``input`` at least 2-D of the same dtype. Such a
    call is a linear layer (the ``matmul`` extension takes it, and per-sample rows read its
    input's dim 0 as the batch, as a Linear's)."""
    if not (isinstance(input, Tensor) and isinstance(other, Tensor)):
        return False
    return (
        input.dim() >= 2
        and other.dim() == 2
        and other.numel() > 0
        and input.dtype == other.dtype
        and other.dtype.is_floating_point
        and from_one_parameter(other)
    )


def from_one_parameter(t: Tensor) -> bool:
    """Whether ``t`` is a parameter, a view of one, or a value computed from one parameter
    alone, every step one of ``PARAMETER_STEPS`` (rows go back through them)."""
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return True
    node = t.grad_fn
    for _ in range(64):
        if node is None:
            return False
        variable = getattr(node, "variable", None)
        if variable is not None:
            return isinstance(variable, torch.nn.Parameter)
        edges = [(i, n) for i, (n, _) in enumerate(node.next_functions) if n is not None]
        if len(edges) != 1 or parameter_step(node, edges[0][0]) is None:
            return False
        node = edges[0][1]
    return False


def parameter_step(node, input_nr: int) -> ParameterStep | None:
    """How rows go back through ``node`` to its input ``input_nr``, where ``node`` computes a
    value from that input alone (every other input a constant: no gradient edge, no batch in
    the block's batch following) entry by entry or by moving entries; None otherwise. A value
    computed from the model's input is never one: its node carries the batch (``BATCHED_KEY``)."""
    step = PARAMETER_STEPS.get(node.name())
    if step is None or BATCHED_KEY in node.metadata:
        return None
    edges = node.next_functions
    if any(other is not None for i, (other, _) in enumerate(edges) if i != input_nr):
        return None
    if node.name() in _ELEMENTWISE_STEPS:  # no broadcast: one output entry per input entry
        if input_shape(edges[input_nr][0]) != torch.Size(node._input_metadata[0].shape):
            return None
        if node.name() == "DivBackward0" and input_nr != 0:
            return None
    return step


def _fused_rms_norm_rows(sr: Semiring, node, state: State, input_nr: int) -> State:
    """RMS norm's fused kernel (``FusedRmsNormBackward0``, a GPU's ``F.rms_norm``): ``y = (x · r)
    · w``, r each row's own, so the edge from w[j] to y[n, ..., j] weighs ``t = x · r`` there,
    the rows the CPU's composite gets from its gain's ``MulBackward0`` (``_mul_rows``)."""
    if input_nr != 1:
        raise PerSampleError(
            "per-sample values: rms_norm's input is no parameter's use with rows of its own"
        )
    dtype = state[0].dtype
    t = node._saved_input.to(dtype) * node._saved_result1.to(dtype)
    weighted = sr.scale(state, t.expand(state[0].shape))
    return _broadcast_rows(sr, weighted, tuple(node._saved_normalized_shape))


def _instance_norm_repeat(node) -> bool:
    """Whether ``node`` (a ``RepeatBackward0``) is instance norm's repeat of its 1-D gain or
    bias. PyTorch runs ``instance_norm`` as a batch norm over the N·C channels of
    ``x.view(1, N·C, ...)`` with ``γ.repeat(N)``: entry ``n·C + c`` of the repeat serves
    channel c of example n alone, so the repeat's message holds each example's value."""
    return (
        node.metadata.get(INSIDE_CALL_KEY) in INSTANCE_NORMS
        and len(node._saved_repeats) == 1
        and len(node._saved_self_sym_sizes) == 1
    )


def _instance_norm_rows(sr: Semiring, node, state: State, input_nr: int) -> State:
    """Instance norm's gain or bias: the message of its repeat ``[N·C]`` is the rows ``[N, C]``
    (``_instance_norm_repeat``); the repeat's own rule takes the ⊕ over the N copies, so the
    rows' ⊕ is the parameter's message."""
    examples = int(node._saved_repeats[0])
    return tuple(p.reshape(examples, -1) for p in state)


#: The calls (``graph.batch_dims.call_name``) whose inner repeat ``_instance_norm_repeat``
#: reads: ``F.instance_norm`` (``nn.InstanceNorm1d/2d/3d``) and ``torch.instance_norm``.
INSTANCE_NORMS = frozenset(("instance_norm",))


def _embedding_bag_rows(sr: Semiring, node, state: State, input_nr: int) -> State:
    """``nn.EmbeddingBag`` whose output has the batch on dim 0 (ids ``[N, L]``, bags as rows,
    or offsets ``[N]`` that carry the batch, ``graph.batch_dims``): bag n is example n, so the
    table's rows ``[N, num_weights, dim]`` are each bag's own edges (``bag_table_state``).
    Flat ids as the model's batch have one entry per lookup, not per bag: refused."""
    if node.metadata.get(BATCHED_KEY, None) != 0:
        raise PerSampleError(
            "per-sample values: an embedding bag's bags are known to be its examples with ids "
            "of shape [N, L] whose dim 0 is the batch (the model's first argument, or another "
            "of N rows; pad shorter bags with padding_idx), or with 1-D ids and offsets of "
            "shape [N] that carry the batch (likewise, without include_last_offset); here they "
            "are not"
        )
    if node._saved_scale_grad_by_freq:
        raise PerSampleError("per-sample values: scale_grad_by_freq has no Jacobian to split")
    bags = BagLookups(
        indices=node._saved_indices,
        offsets=node._saved_offsets,
        offset2bag=node._saved_result1,
        bag_size=node._saved_result2,
        maximum_indices=node._saved_result3,
        mode=int(node._saved_mode),
        per_sample_weights=node._saved_per_sample_weights,
        padding_idx=node._saved_padding_idx,
        num_weights=int(node._saved_weight_sym_argsize_0),
    )
    return bag_table_state(sr, state, bags, node._input_metadata[0].dtype, per_bag=True)


register_per_sample("MulBackward0", _mul_rows)
register_per_sample("AddBackward0", _add_rows(1.0))
register_per_sample("SubBackward0", _add_rows(-1.0))
register_per_sample("NativeBatchNormBackward0", _batch_norm_eval_rows)
register_per_sample("CudnnBatchNormBackward0", _batch_norm_eval_rows)
register_per_sample("MiopenBatchNormBackward0", _batch_norm_eval_rows)
register_per_sample("NativeGroupNormBackward0", _group_norm_rows)
register_per_sample("RepeatBackward0", _instance_norm_rows, _instance_norm_repeat)
register_per_sample("FusedRmsNormBackward0", _fused_rms_norm_rows)
register_per_sample("EmbeddingBagBackward0", _embedding_bag_rows)


#: Reductions whose saved ``dim`` says which axes they reduce (``SumBackward1``, ...).
_REDUCTIONS = {
    "Sum",
    "Mean",
    "Nansum",
    "Nanmean",
    "Amax",
    "Amin",
    "Max",
    "Min",
    "Std",
    "Var",
    "StdMean",
    "VarMean",
    "Logsumexp",
    "Prod",
    "Norm",
    "LinalgVectorNorm",
    "Cumsum",
    "Cumprod",
    "Cummax",
    "Cummin",
    "Logcumsumexp",
    "Softmax",
    "LogSoftmax",
    "Median",
    "Nanmedian",
    "Sort",
    "Topk",
    "Kthvalue",
    "Mode",
}
#: Reductions above whose output has the input's shape: the shape autograd records for the
#: node's output is the input's (CumsumBackward0 saves nothing else).
_SHAPE_PRESERVING = {
    "Cumsum", "Cumprod", "Cummax", "Cummin", "Logcumsumexp", "Softmax", "LogSoftmax", "Sort",
}  # fmt: skip
_NODE_NAME = re.compile(r"^(?P<op>[A-Za-z]+?)Backward\d*$")


def _signed(d: int) -> int:
    """A dim as autograd saves it (negative dims wrap around as unsigned 64-bit integers)."""
    return d - 2**64 if d >= 2**63 else d


_TRANSPOSES = {"TBackward0", "TransposeBackward0", "PermuteBackward0"}


def _own_transpose(node) -> bool:
    """Whether a 2-D matrix product's second factor is its first one transposed."""
    (a, _), (b, _) = node.next_functions
    if a is None or b is None or b.name() not in _TRANSPOSES:
        return False
    return any(src is a for src, _ in b.next_functions)


def _input_shape(node, op: str) -> tuple[int, ...] | None:
    """The shape of a reduction's input, from what its node saved (sizes, the input itself,
    or for shape-preserving ops the output's recorded shape); None when nothing says."""
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if sizes is not None:
        return tuple(int(s) for s in sizes)
    try:
        saved = getattr(node, "_saved_self", None)
    except RuntimeError:  # freed by an earlier backward: the pass itself will say so
        saved = None
    if isinstance(saved, torch.Tensor):
        return tuple(saved.shape)
    if op in _SHAPE_PRESERVING and node._input_metadata:
        return tuple(node._input_metadata[0].shape)
    return None


def _batch_dim_in(node) -> int | None:
    """The dim the batch is on in ``node``'s first input, as the per-sample block followed it
    (``BATCHED_KEY`` on the input's node): 0 when the block did not (a raw input, a leaf),
    None when no dim holds one example per index (``transport.per_sample`` refuses that)."""
    nxt = node.next_functions[0][0] if node.next_functions else None
    if nxt is None or BATCHED_KEY not in nxt.metadata:
        return 0
    return nxt.metadata[BATCHED_KEY]


def _exchange_reason(node, batches: frozenset[int]) -> str | None:
    """``flip`` or ``roll`` along the batch dim (``roll`` without dims flattens first): each
    example's output holds another example's entries."""
    shape = tuple(node._input_metadata[0].shape)
    batch = _batch_dim_in(node)
    if batch is None or len(shape) <= batch or shape[batch] <= 1:
        return None
    if batches and shape[batch] not in batches:
        return None
    dims = list(node._saved_dims)
    if (not dims and node.name() == "RollBackward0") or any(
        _signed(d) % len(shape) == batch for d in dims
    ):
        return f"it moves entries along dim {batch} (the batch) of a tensor of shape {shape}"
    return None


def mixing_reason(node, is_root: bool = False, batches: frozenset[int] = frozenset()) -> str | None:
    """Why ``node`` (an autograd node inside the model) mixes the examples of the batch, or
    None. Batch norm in train mode normalises over the batch; a reduction, scan, softmax or
    sort over the batch dim (dim 0, or where the block followed it, ``BATCHED_KEY``) of a
    tensor with more than one row combines examples before the loss, and so does a reduction
    over every dim unless it is the root itself (a loss computed by the model); so do
    ``flip`` and ``roll`` along the batch and ``x @ x.T`` on a [batch, features] matrix.
    ``batches`` holds the dim-0 sizes of the model's inputs when known: a reduction of a
    tensor whose batch dim has none of them (a weight's norm computed in the forward) is not
    over the batch. Other mixing (a matrix product with another example's features, an
    exchange written by indexing) is refused by ``transport.per_sample.check_graph`` from the
    batch dims the block followed."""
    name = node.name()
    if "BatchNorm" in name and not hasattr(node, "_saved_training"):
        return (
            "this batch norm backward (cuDNN or MIOpen) does not record whether it ran in train "
            "mode, where it normalises over the batch (for eval mode, run the forward under "
            "torch.backends.cudnn.flags(enabled=False))"
        )
    if "BatchNorm" in name and node._saved_training:
        saved = getattr(node, "_saved_input", None)
        if saved is None or saved.dim() == 0 or saved.shape[0] > 1:
            return "batch norm in train mode normalises over the batch (use eval mode)"
        return None
    if name == "MmBackward0" and _own_transpose(node):
        return "it multiplies a batch by its own transpose (x @ x.T), pairing the examples"
    if name in ("FlipBackward0", "RollBackward0"):  # output shape = input shape
        return _exchange_reason(node, batches)
    match = _NODE_NAME.match(name)
    if match is None or match.group("op") not in _REDUCTIONS:
        return None
    sizes = _input_shape(node, match.group("op"))
    batch = _batch_dim_in(node)
    if sizes is None or batch is None or len(sizes) <= batch or sizes[batch] <= 1:
        return None
    if batches and sizes[batch] not in batches:
        return None
    dims = getattr(node, "_saved_dim", None)
    dims = [] if dims is None else [dims] if isinstance(dims, int) else list(dims)
    if not dims:  # no dim: every dim is reduced, the batch with the rest
        if is_root:
            return None
        return f"it reduces over every dim, the batch included, of a tensor of shape {sizes}"
    if len(sizes) < 2:
        return None
    if any(_signed(d) % len(sizes) == batch for d in dims):
        return f"it reduces over dim {batch} (the batch) of a tensor of shape {sizes}"
    return None


__all__ = [
    "BATCHED_KEY",
    "EXPANDED_KEY",
    "FACTORS_KEY",
    "MATMULS",
    "MERGED_EXAMPLES_KEY",
    "PARAMETER_STEPS",
    "PER_SAMPLE_NODES",
    "SPLITS_MERGED_BATCH",
    "UNSEEN_WRITE",
    "ParameterStep",
    "RowRule",
    "batch_expand_rows",
    "expanded_over_batch",
    "from_one_parameter",
    "has_per_sample_rule",
    "input_shape",
    "mixing_reason",
    "parameter_projection",
    "parameter_step",
    "register_per_sample",
    "row_rule",
    "unbatched_operand",
]
