"""Following the batch through a per-sample block's forward (``extend(..., per_sample=True)``).

Per-sample rows read the batch off dim 0 of a layer's input (and of a hand-written ``x * p``'s
other operand). That is right only where dim 0 holds one example per index. The block's
torch-function mode hands every call to ``BatchedTensors.follow``, which keeps, for each tensor
computed from the model's first input, the dim its batch is on (``graph.batch_dims`` works it
out call by call), and marks the autograd nodes with it for the pass's checks
(``per_sample.check_graph``).

A layer's input need not come from the batch: position ids passed beside it, a buffer expanded
to the batch's size (BERT's default token types), a table of relative-position buckets (T5). Its
rows are examples only if its dim 0 later meets the batch on the batch's own dim. So such an
input gets a provisional mark on that dim, followed like the batch; where a marked value meets
the batch, the mark is confirmed or refuted, and a layer whose mark was refuted (T5's bucket
table lands on the query dim of the attention scores) is refused when the pass reaches its
parameters. A model argument's entries belong to its examples (a pass over one example slices
it too): where its mark is refuted, the examples of the result are mixed (``x + y.flip(0)``).

Writes are followed too: an indexed assignment through its index, an in-place call through the
memory it shares with views and aliases, and a write the block did not see by the version
counter it moved.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ..graph.batch_dims import batch_dim_after, call_name, dim_after_index
from ..graph.provenance import OUTSIDE_MODEL, current_module
from ..rules.per_sample import (
    BATCHED_KEY,
    EXPANDED_KEY,
    FACTORS_KEY,
    LOST_BY_KEY,
    MATMULS,
    MERGED_EXAMPLES_KEY,
    MERGING,
    SPLITS_MERGED_BATCH,
    UNSEEN_WRITE,
    from_one_parameter,
    how_lost,
    parameter_projection,
)

#: Autograd node metadata: why the layer call that made the node cannot compute per-sample
#: rows (``misplaced_batch``, or a refuted mark); ``check_graph`` raises it when the node feeds
#: a parameter.
MISPLACED_KEY = "semipack_misplaced_batch"

#: Calls whose backward computes per-sample rows from one input's dim (``extensions``,
#: batch norm's generic rule): the layer's name and its input's batch dim (inside
#: ``F.multi_head_attention_forward`` the layout is sequence-first).
LAYER_INPUTS: dict[Any, tuple[str, int]] = {
    F.linear: ("Linear", 0),
    torch.conv1d: ("Conv1d", 0),
    torch.conv2d: ("Conv2d", 0),
    F.layer_norm: ("LayerNorm", 0),
    F.embedding: ("Embedding", 0),
    F.embedding_bag: ("EmbeddingBag", 0),
    F.batch_norm: ("BatchNorm", 0),
    F.instance_norm: ("InstanceNorm", 0),
    torch.instance_norm: ("InstanceNorm", 0),
    F.rms_norm: ("RMSNorm", 0),
    torch.rms_norm: ("RMSNorm", 0),
    F.multi_head_attention_forward: ("MultiheadAttention", 1),
}


#: ``torch.addmm(b, x, W)`` (Hugging Face's ``Conv1D``): with a parameter ``W``, a Linear
#: whose input is the second argument.
_ADDMMS = (torch.addmm, Tensor.addmm)


def layer_of(func: Any, args: tuple) -> tuple[str, int] | None:
    """``LAYER_INPUTS``' entry for a call, and ``x @ W`` or ``addmm(b, x, W)`` with a
    parameter ``W``: a Linear (the matmul and addmm extensions compute its rows from ``x``'s
    dim 0)."""
    layer = LAYER_INPUTS.get(func)
    projection = func in MATMULS and len(args) >= 2 and parameter_projection(args[0], args[1])
    affine = func in _ADDMMS and len(args) >= 3 and parameter_projection(args[1], args[2])
    return ("Linear", 0) if layer is None and (projection or affine) else layer


def _layer_input(func: Any, args: tuple, kwargs: dict) -> Any:
    """The argument of a layer call (``layer_of``) whose batch dim the rows read."""
    if func in _ADDMMS:
        return args[1] if len(args) > 1 else kwargs.get("mat1")
    return args[0] if args else kwargs.get("input", kwargs.get("query"))


class NotHeld:
    """``BatchedTensors.batch_dim`` of a tensor not computed from the model's input."""

    def __repr__(self) -> str:
        return "NOT_HELD"


NOT_HELD = NotHeld()

#: A provisional mark: (mark id, the dim it is on in the tensor that carries it, or None).
Mark = tuple[int, "int | None"]


class BatchedTensors:
    """The tensors of a per-sample block computed from the model's first input, with the dim
    their batch is on (None where a call mixed, split or merged the examples), and the
    tensors carrying provisional marks (module docstring). Held weakly, by id: a WeakSet's
    membership test compares tensors with ``==``."""

    def __init__(self) -> None:
        self._tensors: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self._held: dict[int, _Held] = {}
        #: storage address -> ids of held tensors there (views and aliases share one)
        self._by_memory: dict[int, set[int]] = {}
        self._marked: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self._marks: dict[int, tuple[Mark, ...]] = {}
        #: mark -> the size of the dim it was put on (its entries, one per example if it is
        #: confirmed): a reshape that merges them with other dims keeps them as the outer
        #: factor, and one that splits them out again finds them (Falcon's and Bloom's ALiBi
        #: tables, built from the padding mask as [N * heads, 1, T] and viewed back)
        self._mark_sizes: dict[int, int] = {}
        #: storage address -> the call that wrote the batch (or a mark) into a view of it: the
        #: view follows the write, but its base and the base's other views, not held, would
        #: read as constants in a layout the write does not give (``b.t()[:] = h``, then
        #: ``b.reshape(N, T)``): they count as values without a batch dim of their own
        self._written_memory: dict[int, str] = {}
        self._new_mark = itertools.count()
        #: marks confirmed where they met the batch; refuted ones with the reason
        self.confirmed: set[int] = set()
        self.refuted: dict[int, str] = {}
        #: mark -> what made it, for messages ("Embedding (module 'x')")
        self._mark_names: dict[int, str] = {}
        #: marks of model arguments (the others mark layer inputs built in the block)
        self._of_arguments: set[int] = set()
        #: the metadata of autograd nodes whose values carry marks (the values themselves
        #: may be gone by the pass: only autograd keeps them), with the marks
        self._marked_nodes: list[tuple[dict, tuple[Mark, ...]]] = []
        #: dim-0 sizes of the model's inputs
        self.sizes: set[int] = set()
        #: which tensor the batch was taken from, for messages: at the latest call (the one
        #: a forward-time message is about), and per batch size (the backward's checks)
        self.batch_source = "the model's first tensor argument"
        self.batch_sources: dict[int, str] = {}

    # --- what is held -------------------------------------------------------------------------

    def add_inputs(self, tensors: list[Tensor]) -> None:
        """The model's tensor arguments: the first is the batch (dim 0); each other one whose
        dim 0 has the batch's size gets a provisional mark on dim 0 (position ids, decoder
        ids; a table of as many classes as examples must not count as examples)."""
        first, *others = tensors
        self.sizes.add(int(first.shape[0]))
        self.batch_source = f"the model's first tensor argument, of shape {tuple(first.shape)}"
        self.batch_sources.setdefault(int(first.shape[0]), self.batch_source)
        self.add(first)
        for t in others:
            # each call marks its own arguments: a position table [1, T] marked by an earlier
            # call with a batch of one was taken for one example's row at the next call, and
            # its broadcast read as mixing the examples (trial 85)
            if self._marked.get(id(t)) is t:
                del self._marked[id(t)]
            if t.dim() > 0 and t.shape[0] == first.shape[0] and self.batch_dim(t) is NOT_HELD:
                self._of_arguments.add(self._mark(t, "a model argument beside the batch"))

    def add(
        self, tensor: Tensor, dim: int | None = 0, lost_by: str = "", examples: int = 0
    ) -> None:
        """Hold ``tensor`` with its batch on ``dim`` (None: no dim holds one example per
        index, since the call ``lost_by``), ``examples`` of them there (0: the dim's size),
        and mark its autograd node (a merged batch as no batch: no layer may read it)."""
        if len(self._held) > 2 * len(self._tensors) + 1024:  # ids of tensors gone
            self._held = {k: self._held[k] for k in list(self._tensors) if k in self._held}
            self._by_memory = {}
            for k, record in self._held.items():
                self._by_memory.setdefault(record.memory, set()).add(k)
        examples = examples or (tensor.shape[dim] if dim is not None else 0)
        memory = _memory(tensor)
        self._tensors[id(tensor)] = tensor
        self._held[id(tensor)] = _Held(dim, lost_by, examples, tensor._version, memory)
        self._by_memory.setdefault(memory, set()).add(id(tensor))
        self._marked.pop(id(tensor), None)  # the batch itself: no provisional layout
        if tensor.grad_fn is not None:
            merged = dim is not None and tensor.shape[dim] != examples
            tensor.grad_fn.metadata[BATCHED_KEY] = None if merged else dim
            tensor.grad_fn.metadata[LOST_BY_KEY] = "reshape" if merged else lost_by

    def batch_dim(self, tensor: Tensor) -> int | NotHeld | None:
        """The dim ``tensor`` (itself, not an equal one) has its batch on, None if it has
        none, ``NOT_HELD`` if it was not computed from the model's input in the block."""
        if self._tensors.get(id(tensor)) is not tensor:
            call = self._written_memory.get(_memory(tensor)) if self._written_memory else None
            if call is None:
                return NOT_HELD
            self.add(tensor, None, call)  # on memory a view of it had the batch written into
        return self._record(tensor).dim

    def lost_by(self, tensor: Tensor) -> str:
        """The call after which a held ``tensor``'s examples have no dim of their own."""
        return self._record(tensor).lost_by

    def examples(self, tensor: Tensor) -> int:
        """How many examples a held ``tensor``'s batch dim holds (0 if it has none)."""
        return self._record(tensor).examples

    def _record(self, tensor: Tensor) -> _Held:
        return self._held.get(id(tensor), _NOT_KNOWN)

    def _sharing_memory(self, tensor: Tensor) -> list[Tensor]:
        """The held tensors with ``tensor``'s storage (itself included, when held)."""
        memory = _memory(tensor)
        found = [self._tensors.get(k) for k in list(self._by_memory.get(memory, ()))]
        return [t for t in found if t is not None and _memory(t) == memory]

    def merged(self, tensor: Tensor) -> bool:
        """Whether a held ``tensor``'s batch is merged with the dims after it."""
        dim = self.batch_dim(tensor)
        return isinstance(dim, int) and tensor.shape[dim] != self.examples(tensor)

    def marks(self, tensor: Tensor) -> tuple[Mark, ...]:
        """The provisional marks ``tensor`` (itself) carries."""
        if self._marked.get(id(tensor)) is not tensor:
            return ()
        return self._marks.get(id(tensor), ())

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` has the batch on dim 0: computed from the model's input, or
        carrying a mark on dim 0 that met the batch there (a decoder's hidden states)."""
        dim = self.batch_dim(tensor)
        if dim is not NOT_HELD:
            return dim == 0 and not self.merged(tensor)
        return self._confirmed_on_dim_0(self._whole(tensor, self.marks(tensor)))

    def _mark(self, tensor: Tensor, name: str, dim: int = 0) -> int:
        mark = next(self._new_mark)
        self._mark_names[mark] = name
        self._mark_sizes[mark] = int(tensor.shape[dim])
        self._set_marks(tensor, ((mark, dim),))
        return mark

    def _set_marks(self, tensor: Tensor, marks: tuple[Mark, ...]) -> None:
        if len(self._marks) > 2 * len(self._marked) + 1024:
            self._marks = {k: self._marks[k] for k in list(self._marked) if k in self._marks}
        self._marked[id(tensor)] = tensor
        self._marks[id(tensor)] = marks

    # --- following calls ----------------------------------------------------------------------

    def follow(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """After a call ``func`` in the block: hold each result computed from a held
        argument, with the dim its batch went to; carry provisional marks along, and judge
        them where they meet the batch; mark the nodes of a layer whose input has the batch
        off its dim (``MISPLACED_KEY``, for ``check_graph``). A result that is an unheld
        argument itself stays unheld unless the call wrote into it (``buffer.to(x)`` returns
        the buffer unchanged); an indexed assignment writes the batch into its target."""
        if not self._tensors:
            return
        name = call_name(func)
        if name in _EXPANDS and self._expanded_parameter(args, result):
            return
        if (
            name in _SHAPED_LIKE_OTHER
            and args
            and isinstance(args[0], Tensor)
            and self.batch_dim(args[0]) is NOT_HELD
            and not self.marks(args[0])
        ):
            return  # p.expand_as(h): h gives the shape only, nothing of the batch
        # ``a.type_as(h)``, ``a.expand_as(h)``, ``a.to(h)``: the result is ``a``'s entries; the
        # other tensor gives a dtype or a shape only, its batch none (trial 78: a ViT's masked
        # image modelling mask, ``bool_masked_pos.type_as(mask_tokens)``, read as lost)
        only_first = name in _SHAPED_LIKE_OTHER or (
            name == "to" and len(args) > 1 and isinstance(args[1], Tensor)
        )
        sources = args[:1] if only_first else (args, kwargs)
        given = [t for t in tree_leaves(sources) if isinstance(t, Tensor)]
        held = [(t, d) for t in given if (d := self.batch_dim(t)) is not NOT_HELD]
        marked = [(t, m) for t in given if (m := self.marks(t))]
        if not held and not marked:
            self._mark_layer_input(func, args, kwargs, result)
            return
        in_place = func is Tensor.__setitem__ or _writes_into_first(func, kwargs)
        written = args[0] if in_place else None
        for t, d in held:  # a node made after the call the block saw (not by this very call)
            node = t.grad_fn
            if node is not None and BATCHED_KEY not in node.metadata and t is not written:
                self._stamp_late_node(t, d)
        examples = merged_examples(func, args, kwargs, self) if held else None
        # a layer whose rows split a merged batch out again has its batch where they read it
        problem = misplaced_batch(func, args, kwargs, self) if held and not examples else None
        if problem is not None:  # refused if the backward reaches one of its parameters
            _mark_nodes(result, problem)
        if examples is not None:  # read by the layer's node when it computes the rows
            for t in tree_leaves(result):
                if isinstance(t, Tensor) and t.grad_fn is not None:
                    t.grad_fn.metadata[MERGED_EXAMPLES_KEY] = examples
        assigned = _indexed_assignment(func, name, args, kwargs, result) if given else None
        if assigned is not None:
            # ``target[index] = value``, ``target.index_put_(index, value)`` (added there with
            # ``accumulate``) and ``index_put``, that assignment into a copy of the target
            # (trials 121 and 122: the last two were refused)
            target, index, value = assigned
            if not in_place:  # the copy starts as the target: its batch and its marks
                own = self.batch_dim(args[0])
                if own is not NOT_HELD:
                    self.add(target, own, self.lost_by(args[0]), self.examples(args[0]))
                if self.marks(args[0]):
                    self._set_marks(target, self.marks(args[0]))
            self._follow_assignment((target, index, value))
            if in_place:
                self._saw_write(target)
                self._wrote_through_view(target, name)
            return
        if name == "new_tensor":  # x.new_tensor(data): a copy of data
            self._follow_copy(args[1] if len(args) > 1 else kwargs.get("data"), result, name)
            return
        if name in _SHAPED_BY_ARGUMENTS:
            return  # x.new_zeros(shape): nothing of the batch, in a layout of its own
        _keep_factors(func, args, result)
        out = kwargs.get("out")
        out = out if isinstance(out, Tensor) else None  # torch.cumsum(h, 0, out=buf) writes buf
        writes = _writes_into_first(func, kwargs)
        results = [t for t in tree_leaves(result) if isinstance(t, Tensor)]
        for position, t in enumerate(results):
            writes_t = writes or t is out
            if not writes_t and any(t is a for a in given):
                continue  # an argument handed back unchanged
            if held:
                dim, examples = self._combined(func, args, kwargs, held, t, position)
                lost = next((self.lost_by(s) for s, d in held if d is None), None) or name
                self.add(t, dim, lost, examples)
                self._judge(func, args, kwargs, marked, t, position, dim)
                if writes_t and dim is None:  # a view, a detached alias: their memory changed
                    self._lose(t, lost)
            else:
                self._carry(func, args, kwargs, marked, t, position)
            if writes_t:
                self._saw_write(t)
                self._wrote_through_view(t, name)
        if not held:
            self._mark_layer_input(func, args, kwargs, result)

    def _follow_copy(self, data: Any, out: Any, call: str) -> None:
        """``out`` is a copy of ``data``: its batch dim, or its marks."""
        if not isinstance(data, Tensor) or not isinstance(out, Tensor):
            return
        dim = self.batch_dim(data)
        if dim is not NOT_HELD:
            self.add(out, dim, self.lost_by(data) or call, self.examples(data))
        elif self.marks(data):
            self._set_marks(out, self.marks(data))

    def _wrote_through_view(self, target: Tensor, call: str) -> None:
        """A write that left the batch (or a mark) in ``target``, a view: the memory's other
        tensors that are not held read as values without a batch dim (``_written_memory``)."""
        if target._base is None:
            return
        if self.batch_dim(target) is NOT_HELD and not self.marks(target):
            return
        memory = _memory(target)
        if memory is not None:
            self._written_memory.setdefault(memory, call)

    def _combined(
        self, func, args, kwargs, sources: list[tuple[Tensor, int | None]], out, position: int
    ) -> tuple[int | None, int]:
        """The batch dim of ``out`` (result ``position``) that every held argument agrees on
        (None if any disagrees, or came in without one), and its number of examples."""
        places = set()
        for s, d in sources:
            examples = self.examples(s)
            if d is None:
                places.add((None, 0))
                continue
            place = batch_dim_after(func, args, kwargs, s, d, out, position, examples)
            places.add((place, examples if place is not None else 0))
        return places.pop() if len(places) == 1 else (None, 0)

    def _carry(self, func, args, kwargs, marked, out: Tensor, position: int) -> None:
        """Marks of the arguments, placed in ``out`` as the batch would be."""
        carried = _agreed(
            (mark, _place(func, args, kwargs, s, d, out, position, self._mark_sizes.get(mark)))
            for s, marks in marked
            for mark, d in marks
        )
        self._set_marks(out, carried)
        if out.grad_fn is not None:  # judged at the pass's start (``mark_nodes``)
            self._marked_nodes.append((out.grad_fn.metadata, self._whole(out, carried)))
            out.grad_fn.metadata[SEEN_KEY] = True
        if _writes_into_first(func, kwargs) and any(d is None for _, d in carried):
            self._lose(out, call_name(func))  # y[:1].mul_(2): the rest of y's memory too

    def _judge(self, func, args, kwargs, marked, out: Tensor, position: int, dim) -> None:
        """Marked values meet the batch in ``out`` (on ``dim``, None where it is lost, merged
        where ``out``'s dim holds more than the examples)."""
        if dim is None:
            return  # the batch is lost here already: the lost-batch check speaks
        mixed = False
        examples = self.examples(out)
        merged = out.shape[dim] != examples
        call = call_name(func)
        for s, marks in marked:
            for mark, d in marks:
                size = self._mark_sizes.get(mark)
                place = _place(func, args, kwargs, s, d, out, position, size)
                if place is not None and (merged or out.shape[place] != size):
                    # Merged with other dims, mark or batch: they meet whole examples only
                    # where both are merged alike on one dim, one example's block each
                    # (Bloom's ALiBi table, [N * heads, 1, T], added to its [N * heads, T, T]
                    # scores); else no example is whole there.
                    alike = place == dim and size == examples
                    place = place if alike else None
                mixed |= self._judge_marks(((mark, d),), lambda _, place=place: place, dim, call)
        if mixed:
            self.add(out, None, call_name(func))
            self._lose(out, call_name(func))

    def _judge_marks(self, marks, lands, dim: int, call: str) -> bool:
        """Each mark is confirmed where it ``lands`` on the batch's ``dim``, refuted where it
        lands elsewhere, nowhere, or on a batch merged with other dims. Returns whether a
        model argument's mark was refuted: its entries, one per example (a pass over one
        example slices it too), met other examples' (``x + y.flip(0)``), so the result's
        examples are mixed. A table built in the block is shared by every example: meeting
        it off its dim refutes only its own layer's rows."""
        mixed = False
        for mark, d in marks:
            place = lands(d)
            if place == dim:
                self.confirmed.add(mark)
                continue
            mixed = mixed or mark in self._of_arguments
            if mark not in self.refuted:
                self.refuted[mark] = (
                    f"{self._mark_names[mark]}, whose input's batch dim has the batch's size but "
                    f"was not computed from the model's input: its rows would be examples only "
                    f"if that dim met the batch on the batch's dim, and in '{call}' it lands "
                    + ("nowhere" if place is None else f"on dim {place}")
                    + f" where the batch is on dim {dim} (a table shared by the batch, T5's "
                    "relative position buckets say, has no per-example rows)"
                )
        return mixed

    def _expanded_parameter(self, args: tuple, result: Any) -> bool:
        """A parameter (or a value computed from one alone) expanded to the batch on dim 0
        (``cls.expand(N, -1, -1)``): its result gets a provisional mark on dim 0, and its
        ``ExpandBackward0`` computes the parameter's rows (``rules.per_sample.
        batch_expand_rows``) if the mark meets the batch there, each example reading its own
        entries; where it lands elsewhere or nowhere (a dim of as many entries as examples
        that is no batch), the expand is an ordinary step on the way to the rule of its use
        (``rules.per_sample.parameter_step``). Whether the call was one."""
        x = args[0] if args else None
        if not (
            isinstance(x, Tensor)
            and isinstance(result, Tensor)
            and result.grad_fn is not None
            and result.dim() > 0
            # a batch of one: expand(1, ...) too (a size-1 dim is no batch dim elsewhere,
            # where it may broadcast over a larger batch)
            and (result.shape[0] in self.sizes - {1} or self.sizes == {1} == {result.shape[0]})
            and (x.dim() < result.dim() or x.shape[0] == 1)
            and self.batch_dim(x) is NOT_HELD
            and not self.marks(x)
            and from_one_parameter(x)
        ):
            return False
        module = _module_name(current_module())
        label = f"a parameter expanded to the batch{f' (module {module!r})' if module else ''}"
        mark = self._mark(result, label, 0)
        result.grad_fn.metadata[LAYER_MARKS_KEY] = (mark,)
        result.grad_fn.metadata[EXPANDED_KEY] = True
        return True

    def _mark_layer_input(self, func, args, kwargs, result) -> None:
        """A layer that computes rows (``LAYER_INPUTS``) called on an input not computed
        from the batch, whose batch dim has the batch's size: its rows are examples only
        if that dim meets the batch on the batch's dim later. Mark its output."""
        layer = layer_of(func, args)
        if layer is None:
            return
        name, want = layer
        x = _layer_input(func, args, kwargs)
        if not isinstance(x, Tensor) or x.dim() <= want or x.shape[want] not in self.sizes - {1}:
            return
        if name == "Embedding" and x.dim() == 1:
            return  # 1-D ids have no batch dim: the extension refuses them, saying how to fix
        marks = self.marks(x)
        module = _module_name(current_module())
        label = f"{name}{f' ({module})' if module else ''}"
        on_dim = tuple(m for m, d in marks if d == want)
        elsewhere = [d for m, d in marks if d != want and m in self._of_arguments]
        if on_dim:  # a model argument's dim 0, or a table's, on the layer's batch dim
            mark_ids = on_dim
            for m in mark_ids:
                self._mark_names[m] = label
        elif elsewhere:  # the rows would read another dim than the argument's examples
            where = "lost" if elsewhere[0] is None else f"now on dim {elsewhere[0]}"
            _mark_nodes(
                result,
                f"{label} on an input whose dim {want} has the batch's size but was not "
                "computed from the model's input, and whose examples (a model argument's "
                f"dim 0) are {where}: its rows would not be examples",
            )
            return
        else:  # built in the block (marks of tables on other dims ride along): its own mark
            out = next((t for t in tree_leaves(result) if isinstance(t, Tensor)), None)
            if out is None:
                return
            mark_ids = (self._mark(out, label, want),)
        for t in tree_leaves(result):
            if isinstance(t, Tensor) and t.grad_fn is not None:
                t.grad_fn.metadata[LAYER_MARKS_KEY] = mark_ids

    def _lose(self, tensor: Tensor, call: str) -> None:
        """A write left ``tensor`` without a batch dim of its own: so is every held or
        marked tensor sharing its memory (its base, a ``detach()`` or ``.data`` alias)."""
        memory = _memory(tensor)
        if memory is None:
            return
        for t in self._sharing_memory(tensor):
            if t is not tensor:
                self.add(t, None, call)
        for key, t in list(self._marked.items()):
            if _memory(t) == memory:
                self._marks[key] = tuple((m, None) for m, _ in self._marks.get(key, ()))

    def _follow_assignment(self, args: tuple) -> None:
        """``target[index] = value``. The value's batch lands in the target through the index
        (``out[:, 0] = h[:, 0]``, ``buf[0] = h``); an index tensor on it (``out[perm] = h``)
        moves examples. A write into part of the target's batch dim (``h[0] = 0``: the batch
        overwrites one example, a pass over that example alone would overwrite it) or of
        another batch mixes them; an elementwise mask computed from the batch (``h[h < 0] =
        0``) does not. Marks on the value are carried into the target, or judged where the
        target holds the batch. A target that is a view writes its base."""
        target, index = args[0], args[1]
        value = args[2] if len(args) > 2 else None
        own = self.batch_dim(target)
        written = self.batch_dim(value) if isinstance(value, Tensor) else NOT_HELD
        value_marks = self.marks(value) if isinstance(value, Tensor) else ()
        if own is NOT_HELD and written is NOT_HELD:
            # a marked target keeps a mark only on a dim written whole
            kept = tuple(
                (m, d if d is not None and self._writes_whole(target, index, d) else None)
                for m, d in self.marks(target)
            )
            if value_marks:
                lands = _landing(target, index, value)
                kept = tuple((m, lands(d)) for m, d in value_marks) + kept
            kept = self._rows_by_example(target, index) + kept
            if kept:
                self._set_marks(target, kept)
                if any(d is None for _, d in kept):
                    self._lose(target, "__setitem__")
            return
        merged = (written is not NOT_HELD and self.merged(value)) or (
            own is not NOT_HELD and self.merged(target)
        )
        lands = _landing(target, index, value) if isinstance(value, Tensor) else None
        place = None if merged or not isinstance(written, int) else lands(written)
        if own is NOT_HELD:
            dim = place
        elif own is None or merged or not self._writes_whole(target, index, own):
            dim = None
        elif written is NOT_HELD:
            dim = own
        else:
            dim = own if place == own else None
        lost = self.lost_by(value) if written is None else "__setitem__"
        self.add(target, dim, lost)
        if (
            dim is not None
            and value_marks
            and self._judge_marks(value_marks, lands, dim, "__setitem__")
        ):
            dim = None
            self.add(target, None, "__setitem__")
        if dim is None:  # written through a view or an alias: what shares its memory too
            self._lose(target, lost)

    def _rows_by_example(self, target: Tensor, index: Any) -> tuple[Mark, ...]:
        """The marks ``target[(torch.arange(N), j)] = v`` gives a fresh ``target``: row ``n``
        is written at ``j[n]`` alone, so the marks of ``j``'s dim 0 (a model argument's
        examples) are the target's dim 0's. Wav2Vec2 builds its feature-level padding mask
        so from the lengths in its ``attention_mask``, then writes zeros through it; the mask
        was taken for one mixing examples (trial 80)."""
        if not (isinstance(index, tuple) and len(index) >= 2 and isinstance(index[0], Tensor)):
            return ()
        rows, n = index[0], target.shape[0] if target.dim() > 0 else -1
        others = [e for e in index[1:] if isinstance(e, Tensor)]
        if not (
            rows.dim() == 1
            and rows.shape[0] == n
            and not rows.is_floating_point()
            and rows.dtype != torch.bool
            and self.batch_dim(rows) is NOT_HELD
            and not self.marks(rows)
            and others
            and all(e.dim() == 1 and e.shape[0] == n for e in others)
        ):
            return ()
        marks = tuple((m, 0) for e in others for m, d in self.marks(e) if d == 0)
        if not marks or not torch.equal(rows, torch.arange(n, device=rows.device)):
            return ()  # one read of N ids
        return marks

    def _writes_whole(self, target: Tensor, index: Any, dim: int) -> bool:
        """Whether ``target[index] = ...`` writes every example alike: the index takes all of
        ``dim``, or is a mask over the leading dims whose examples are the target's on the same
        dim: computed from the batch (``h[h < 0] = 0``), or from a model argument beside it
        (Wav2Vec2's ``h[~mask[..., None].repeat(1, 1, d)] = 0`` with its padding mask; trial
        80), whose mark the write confirms."""
        if isinstance(index, Tensor):
            if not (
                index.dtype == torch.bool
                and dim < index.dim() <= target.dim()
                and index.shape == target.shape[: index.dim()]
            ):
                return False
            held = self.batch_dim(index)
            if held is not NOT_HELD:
                return held == dim
            marks = self.marks(index)
            on_dim = any(d == dim for _, d in marks)
            return on_dim and not self._judge_marks(marks, lambda d: d, dim, "__setitem__")
        entries = index if isinstance(index, tuple) else (index,)
        if any(e is Ellipsis for e in entries):
            rest = sum(e is not None for e in entries) - 1
            at = next(k for k, e in enumerate(entries) if e is Ellipsis)
            entries = entries[:at] + (slice(None),) * (target.dim() - rest) + entries[at + 1 :]
        position = 0
        for e in entries:
            if e is None:
                continue
            if position == dim:
                return isinstance(e, slice) and e == slice(None)
            position += 1
        return True  # the index stops before the batch dim: all of it is written

    def mark_nodes(self) -> None:
        """At the pass's start: mark the autograd nodes of held tensors that got theirs after
        the call the block saw (a custom ``autograd.Function``'s output is the tensor its
        forward computed, its node set by ``apply`` afterwards), and of marked tensors whose
        marks all met the batch on dim 0 (``holds``)."""
        for tensor in list(self._tensors.values()):
            if tensor.grad_fn is not None and BATCHED_KEY not in tensor.grad_fn.metadata:
                self._stamp_late_node(tensor, self.batch_dim(tensor))
        for metadata, marks in self._marked_nodes:
            if BATCHED_KEY not in metadata and self._confirmed_on_dim_0(marks):
                metadata[BATCHED_KEY] = 0
        self._marked_nodes = []

    def _whole(self, tensor: Tensor, marks: tuple[Mark, ...]) -> tuple[Mark, ...]:
        """``marks`` of ``tensor`` but those merged there with other dims (a dim holding
        more than the mark's entries is no dim of examples)."""
        return tuple(
            (m, d)
            for m, d in marks
            if d is None or tensor.shape[d] == self._mark_sizes.get(m, tensor.shape[d])
        )

    def _confirmed_on_dim_0(self, marks: tuple[Mark, ...]) -> bool:
        """Whether dim 0 of a value with ``marks`` is the batch: a mark on dim 0 met the
        batch there, and none on dim 0 was refuted (marks on other dims concern their own
        layers, which ``refutation`` answers for)."""
        on_dim_0 = [m for m, d in marks if d == 0]
        return any(m in self.confirmed for m in on_dim_0) and not any(
            m in self.refuted for m in on_dim_0
        )

    def _stamp_late_node(self, tensor: Tensor, dim: int | None) -> None:
        """``tensor`` got its autograd node after the call the block followed: a custom
        ``autograd.Function``'s output (the tensor its forward computed, its node set by
        ``apply``) or a view's node made again after a seen write to its memory keep their
        batch dim; a write the block did not see (a scripted ``h.copy_(...)``, a custom
        Function's forward writing into its result under ``DisableTorchFunction``: the
        version counter moved since the last write the block saw) leaves it unknown. A
        custom Function's output was exempt, and such a write mixing examples gave rows
        silently (trial 113). A write that moves no version counter (numpy, a kernel on
        ``data_ptr``) cannot be seen: README, "Limits"."""
        if tensor._version != self._record(tensor).version:
            self.add(tensor, None, UNSEEN_WRITE)
        else:
            self.add(tensor, dim, self.lost_by(tensor), self.examples(tensor))

    def _saw_write(self, tensor: Tensor) -> None:
        """A write the block followed: every held tensor sharing ``tensor``'s memory (views,
        aliases: one version counter) is at its new version."""
        for t in self._sharing_memory(tensor):
            self._held[id(t)] = self._record(t)._replace(version=t._version)

    def met_batch(self, node: Any) -> bool:
        """Whether the provisional mark of ``node``'s value (a parameter expanded to the
        batch, ``_expanded_parameter``) met the batch on dim 0, and nowhere else."""
        marks = node.metadata.get(LAYER_MARKS_KEY, ())
        return any(m in self.confirmed for m in marks) and not any(m in self.refuted for m in marks)

    def refutation(self, node: Any) -> str | None:
        """Why the layer call that made ``node`` has no per-sample rows: the mark on its
        input's batch dim was refuted, or, for an input built in the block (not a model
        argument, which a pass over one example slices too), never met the batch (a table's
        branch summed into the loss apart from the examples)."""
        for mark in node.metadata.get(LAYER_MARKS_KEY, ()):
            if mark in self.refuted:
                return self.refuted[mark]
            if mark not in self.confirmed and mark not in self._of_arguments:
                return (
                    f"{self._mark_names[mark]}, whose input's batch dim has the batch's size "
                    "but was not computed from the model's input, and never met the batch: "
                    "its rows would not be examples"
                )
        return None


#: Autograd node metadata: a node the block saw made from a marked value (not the batch's).
SEEN_KEY = "semipack_seen"

#: Autograd node metadata: the provisional marks of a layer call's input (``LAYER_INPUTS``).
LAYER_MARKS_KEY = "semipack_layer_marks"


def share_layer_marks(created: Sequence[Any], result: Any) -> None:
    """Give the nodes a call made inside it (``created``, besides its results' own) the marks
    and problems its results' nodes got (``LAYER_MARKS_KEY``, ``MISPLACED_KEY``): a layer
    whose parameters reach the per-sample check through an inner node (instance norm's
    ``γ.repeat(N)``) is judged there by its input's batch, as one whose own node uses them."""
    shared = {}
    for t in tree_leaves(result):
        if isinstance(t, Tensor) and t.grad_fn is not None:
            for key in (LAYER_MARKS_KEY, MISPLACED_KEY):
                if key in t.grad_fn.metadata:
                    shared.setdefault(key, t.grad_fn.metadata[key])
    if not shared:
        return
    for node in created:
        for key, value in shared.items():
            node.metadata.setdefault(key, value)


def share_batch_with_inner_nodes(func: Any, created: Sequence[Any], result: Any) -> None:
    """Give nodes a call ``func`` made inside it (``created``) what the block followed on its result
    (``BATCHED_KEY``) where that holds for them too:

    - the node under a result that is a cast of a value the call made (a half-precision
      ``F.rms_norm`` computes in float32 and casts back: its gain's product is that value,
      not the result) gets the result's batch dim: a cast moves no entry, so the value holds
      the examples where the result does (a cast of the result's own shape only);
    - a layer's result (``LAYER_INPUTS``) that holds no dim of examples gives the layer's
      inner nodes none either (``_share_lost_batch``)."""
    inner = {id(node) for node in created}
    for t in tree_leaves(result):
        node = t.grad_fn if isinstance(t, Tensor) else None
        if node is None or BATCHED_KEY not in node.metadata:
            continue
        if node.metadata[BATCHED_KEY] is None:
            if func in LAYER_INPUTS:  # a reduction's inner values keep the batch
                _share_lost_batch(created, node)
            continue
        if node.name() != "ToCopyBackward0":
            continue
        below, _ = node.next_functions[0]
        if below is None or id(below) not in inner or BATCHED_KEY in below.metadata:
            continue
        shapes = [tuple(m.shape) for m in below._input_metadata]
        if shapes != [tuple(t.shape)]:
            continue
        below.metadata[BATCHED_KEY] = node.metadata[BATCHED_KEY]
        below.metadata[LOST_BY_KEY] = node.metadata.get(LOST_BY_KEY, "")


def _share_lost_batch(created: Sequence[Any], node: Any) -> None:
    """A layer whose result holds no dim of examples (``F.rms_norm`` over a shape that spans
    the batch) mixed them in every value it made: a parameter used inside is refused for the
    layer's mixing, not as a call the block does not follow (trial 116: the message blamed a
    weight computed from parameters). Only layers: a reduction's result (a loss summed inside
    the model) holds no examples either, while its inner values do."""
    lost_by = node.metadata.get(LOST_BY_KEY, "")
    for inner in created:
        # a parameter's AccumulateGrad, made on its first use inside the call, is no value
        leaf = getattr(inner, "variable", None) is not None
        if inner is not node and not leaf and BATCHED_KEY not in inner.metadata:
            inner.metadata[BATCHED_KEY] = None
            inner.metadata[LOST_BY_KEY] = lost_by


def _mark_nodes(result: Any, problem: str) -> None:
    for t in tree_leaves(result):
        if isinstance(t, Tensor) and t.grad_fn is not None:
            t.grad_fn.metadata[MISPLACED_KEY] = problem


class _Held(NamedTuple):
    """What the block knows of a held tensor."""

    #: the batch's dim (None: no dim holds one example per index)
    dim: int | None
    #: the call after which the dim was None
    lost_by: str
    #: the examples on ``dim``: fewer than its size where a reshape merged the batch with
    #: the dims after it (``[N * H, T, d]``)
    examples: int
    #: the version counter when the block last saw a write to the tensor's memory
    version: int
    #: the storage's address (views and aliases share it)
    memory: int | None


_NOT_KNOWN = _Held(None, "", 0, -1, None)


def _memory(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _landing(target: Tensor, index: Any, value: Tensor):
    """Where a dim of ``value`` lands in ``target`` by ``target[index] = value`` (the value
    broadcast into the indexed view from the back)."""
    view = target[index]

    def lands(d: int | None) -> int | None:
        if d is None:
            return None
        at = d + view.dim() - value.dim()
        if not 0 <= at < view.dim() or view.shape[at] != value.shape[d]:
            return None
        for t in range(target.dim()):
            if dim_after_index(target, index, t, view) == at:
                return t
        return None

    return lands


def _agreed(marks: Iterable[Mark]) -> tuple[Mark, ...]:
    """Each mark once: where it comes in on two places (``y - y.mean(0)``: its own dim and
    nowhere), its entries met other positions' and it has no dim of its own (None)."""
    places: dict[int, set[int | None]] = {}
    for mark, d in marks:
        places.setdefault(mark, set()).add(d)
    return tuple((m, ds.pop() if len(ds) == 1 else None) for m, ds in places.items())


def _place(
    func, args, kwargs, source: Tensor, dim, out: Tensor, position: int, size: int | None = None
) -> int | None:
    """Where a mark on ``dim`` of ``source`` goes in ``out``: a dim of the same size, or, for
    a mark of ``size`` entries, a dim of whole blocks of them that a reshape merged with the
    dims after it (the outer factor, as the batch's own) or split out again; a merge that
    breaks them up loses the mark."""
    if dim is None:
        return None
    merged = size is not None and source.shape[dim] != size
    examples = size if merged else None
    place = batch_dim_after(func, args, kwargs, source, dim, out, position, examples)
    if place is None:
        return None
    if out.shape[place] == source.shape[dim]:
        return place
    whole = size is not None and out.shape[place] % size == 0 and out.shape[place] >= size
    return place if whole and call_name(func) in MERGING else None


def misplaced_batch(func: Any, args: tuple, kwargs: dict, batched: BatchedTensors) -> str | None:
    """Why ``func`` (one of ``LAYER_INPUTS``) cannot compute rows from its input, or None:
    an input computed from the model's input whose batch is not where the layer's rows read
    it, because it moved to another dim or was lost while that dim kept a batch's size. Its
    rows would be one per token (``x.transpose(0, 1)`` with as many tokens as examples),
    silently. The caller asks ``merged_examples`` first: a merged batch those rows split out
    again is in its place."""
    layer = layer_of(func, args)
    if layer is None:
        return None
    name, want = layer
    x = _layer_input(func, args, kwargs)
    if not isinstance(x, Tensor) or x.dim() <= want:
        return None
    dim = batched.batch_dim(x)
    if dim is NOT_HELD or (dim == want and not batched.merged(x)):
        return None
    if batched.merged(x):
        dim = None
    if dim is None and x.shape[want] not in batched.sizes - {1}:
        return None  # not taken for examples: the rows' own checks name what went wrong
    where = (
        f"no dim holds one example per index ({how_lost(batched.lost_by(x) or 'reshape')})"
        if dim is None
        else f"the batch is on dim {dim}"
    )
    module = _module_name(current_module())
    return (
        f"{name}{f' ({module})' if module else ''} on an input of shape {tuple(x.shape)} "
        f"computed from the model's input in which {where}: its rows would not be examples "
        f"(the batch is dim 0 of {batched.batch_source}; if that is not the batch, pass the "
        "batch as the first argument). "
        f"Keep the batch in dim {want} of every layer's input (a sequence-first layout such "
        "as x.transpose(0, 1) gives one row per token)"
    )


def merged_examples(func: Any, args: tuple, kwargs: dict, batched: BatchedTensors) -> int | None:
    """The number of examples a layer call's input (``layer_of``) holds on its batch dim when
    a reshape merged the batch there with the dims after it (``x.reshape(N * T, d)`` into
    OPT's feed-forward, ``x.view(-1, d)`` into Hugging Face's ``Conv1D``), for the layers whose
    rows split it out again (``SPLITS_MERGED_BATCH``); None for any other call or input."""
    layer = layer_of(func, args)
    if layer is None or layer[0] not in SPLITS_MERGED_BATCH:
        return None
    x = _layer_input(func, args, kwargs)
    if not isinstance(x, Tensor) or x.dim() <= layer[1]:
        return None
    if batched.batch_dim(x) != layer[1] or not batched.merged(x):
        return None
    return batched.examples(x)


#: Calls whose result's values come from no entry of the tensor they are called on: the shape
#: from their arguments (``x.new_zeros(n, d)``), or the shape alone (``torch.empty_like(x)``,
#: a buffer a kernel then writes). The result holds nothing of the batch until a write the
#: block sees puts it there (``out.copy_(h)``, ``out[i] = h[i]``): trial 113 found a custom
#: ``autograd.Function`` whose kernel below Python wrote examples mixed into
#: ``torch.empty_like(x)``, and the rows given as if the buffer held ``x``'s examples.
_SHAPED_BY_ARGUMENTS = frozenset(
    (
        "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like",
        "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    )
)  # fmt: skip
#: Calls that read only the shape or dtype of their second tensor (``p.expand_as(h)``): a
#: result of a first tensor without the batch holds nothing of it.
_SHAPED_LIKE_OTHER = frozenset(("expand_as", "view_as", "reshape_as", "type_as"))
#: Calls that broadcast their first tensor to a larger shape (``_expanded_parameter``).
_EXPANDS = frozenset(("expand", "expand_as", "broadcast_to"))


def _keep_factors(func: Any, args: tuple, result: Any) -> None:
    """``x * p`` with a leaf ``p`` (a gain): keep both factors on the node for the row rule
    (``rules.per_sample.FACTORS_KEY``). The node saved ``x`` anyway; inside a checkpoint
    this keeps it alive until the row rule has run (``hook_rules`` lets it go)."""
    if call_name(func) not in _PRODUCTS or len(args) != 2 or not isinstance(result, Tensor):
        return
    if _writes_into_first(func):  # h.mul_(g): h is the product now; autograd saved the factor
        return
    if result.grad_fn is None or result.grad_fn.name() != "MulBackward0":
        return
    if not all(isinstance(a, Tensor) for a in args):
        return
    if any(a.requires_grad and a.grad_fn is None for a in args):
        first, second = args if call_name(func) != "__rmul__" else args[::-1]
        result.grad_fn.metadata[FACTORS_KEY] = (first, second)


_PRODUCTS = frozenset(("mul", "multiply", "__mul__", "__rmul__"))


def _indexed_assignment(
    func: Any, name: str, args: tuple, kwargs: dict, result: Any
) -> tuple[Tensor, Any, Any] | None:
    """(target, index, value) of a call that writes ``value`` into ``target[index]``:
    ``__setitem__`` and ``index_put_`` write their first argument, ``index_put`` its result
    (a copy of the first argument); None for any other call."""
    if func is Tensor.__setitem__:
        return args[0], args[1], args[2] if len(args) > 2 else None
    if name != "index_put" or not isinstance(result, Tensor):
        return None
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    values = args[2] if len(args) > 2 else kwargs.get("values")
    return result, tuple(indices), values


def _writes_into_first(func: Any, kwargs: dict | None = None) -> bool:
    """Whether ``func`` is an in-place call (``add_``, ``__iadd__``, ``copy_``, ``F.relu(x,
    inplace=True)``, ...): its result is its first argument, changed."""
    name = getattr(func, "__name__", "")
    if kwargs and kwargs.get("inplace") is True:
        return True
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "pow", "and", "or", "xor")
)


def _module_name(module: str | None) -> str | None:
    if module is None or module == OUTSIDE_MODEL:
        return None
    return "the root module" if module == "" else f"module '{module}'"


__all__ = [
    "LAYER_INPUTS",
    "LAYER_MARKS_KEY",
    "LOST_BY_KEY",
    "MISPLACED_KEY",
    "NOT_HELD",
    "SEEN_KEY",
    "BatchedTensors",
    "how_lost",
    "misplaced_batch",
    "share_layer_marks",
]
