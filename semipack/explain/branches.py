"""Branch readouts: the semiring value split by which *use* of a tensor a path leaves through.

A tensor ``h`` (an attention block's input, say) is used by several consumers: the query, key
and value projections, the residual add. Every path from the root to ``h`` ends with an edge of
exactly one of those uses, so the semiring value at ``h`` is the plus, over consumers, of the
values of the paths through each. ``branches`` keeps them apart: while its block is active,
every op that receives ``h`` receives a fresh alias of it instead (``h.view_as(h)``, the same
values, a node of its own), named after the module that made the call; the message each alias
gets in the backward is that consumer's branch. Messages below ``h`` are carried down
separately too (``inputs=``): when every branch has arrived at ``h``, one extra pass per branch
runs from ``h`` down to the inputs, seeded with that branch's state, before the main pass goes
on.

Shapes: each branch value is shaped like ``h``; each value at an input is shaped like the input.
Everything is vectorised over examples and positions (one pass per branch, not per token).
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..errors import SemipackError, user_stacklevel
from ..graph.provenance import current_module
from ..graph.sites import ROOT_MODULE
from ..messages.message import MODULE_HOOK_NODE, Message
from ..semirings.base import State
from ..transport.backward import carry_down
from ..transport.hooks import BlockPreHook
from ..transport.interception import SemiringMode
from ..transport.passes import in_carry_pass, watch_backwards


@dataclass
class Branches:
    """The branches of one split tensor after a backward.

    Attributes:
        names: the consumers of the split tensor, in the order of their first use; a name is the
            dotted path of the module whose forward made the call (``"<root module>"`` for the
            extended model's own forward, ``"<outside the model>"`` outside it), with the
            argument name when a single call uses the tensor more than once (``"...:query"``)
            and ``#2``, ``#3`` for further calls by the same module.
        split: the split tensor.
        calls: before a backward, how many times the split module was called with grad mode
            on since the last backward (each call is split; the backward reads the call it
            reaches, as each backward inside ``extend`` replaces ``semiring_grad``); after
            one, how many calls it reached (more than 1 warns: only the first reached is
            split). 1 for a split tensor. Calls under ``torch.no_grad`` record no graph and
            are not counted (``calls_without_grad``).
        ops: branch name -> the name of the function whose call made that use (``linear``,
            ``add``, ``__add__``, ``multi_head_attention_forward``): a use by the split module's
            own forward is a residual add or a projection of its own, told apart by this.
        offsets: the branches whose use adds to the split tensor a value not computed from it
            (DETR's ``h + position`` before its query and key projections): such an add is
            no residual (``x + f(x)``), so ``explain_layers`` names that branch ``add``.
    """

    names: list[str] = field(default_factory=list)
    ops: dict[str, str] = field(default_factory=dict)
    offsets: set[str] = field(default_factory=set)
    #: a module split: the positions (and keyword names) of its first call's arguments that
    #: are the split tensor (``(0,)`` for a cross-attention's query, ``(0, 1, 2)`` for
    #: ``mha(x, x, x)``)
    arguments: tuple[int | str, ...] = ()
    #: a module split: the calls that used the split tensor before the module was called and
    #: whose results a backward then reached (their paths are in no branch; ``explain_layers``
    #: refuses such a layer); a use no backward reaches, a logged ``h.norm().item()``, has no
    #: path and is not listed
    used_before: list[str] = field(default_factory=list)
    #: uses of the split tensor made where this block sees no call (a custom
    #: ``autograd.Function``'s ``apply``, code below Python) whose nodes a backward then
    #: reached, by node name: their paths are in no branch
    unseen_uses: list[str] = field(default_factory=list)
    split: Tensor | None = None
    calls: int = 0
    #: calls of the split module under ``torch.no_grad`` (a validation forward, a reentrant
    #: checkpoint's first run): no graph, no use split
    calls_without_grad: int = 0
    messages: dict[str, Message] = field(default_factory=dict, repr=False)
    input_states: dict[str, list[State | None]] = field(default_factory=dict, repr=False)

    @property
    def values(self) -> dict[str, Any]:
        """Branch name -> semiring readout at the split tensor (shaped like it), for the
        branches a path reached in the last backward."""
        return {name: m.semiring.readout(m.parts) for name, m in self.messages.items()}

    @property
    def at_inputs(self) -> dict[str, list[Any]]:
        """Branch name -> one readout per requested input (shaped like it; None where that
        branch reaches no entry of it)."""
        return {
            name: [None if st is None else self._semiring().readout(st) for st in states]
            for name, states in self.input_states.items()
        }

    def aggregate(
        self,
        dims: int | Sequence[int],
        at: int | None = None,
        rename: Callable[[str], str] | None = None,
    ) -> dict[str, Any]:
        """Branch name -> readout of the semiring *sum* over ``dims`` (the union of the paths
        of those entries, e.g. every hidden unit of a token: MaxProd gives the max, LogSum the
        log of the total, Entropy the entropy of the union, not an average of entropies), at
        the split tensor (``at=None``) or at input number ``at``. Shapes: the tensor's without
        ``dims``. Vectorised over everything else (examples, positions). Empty when no path
        reached the split tensor. ``rename`` maps branch names to the keys of the result;
        branches given the same key are joined by the semiring's plus (all their paths)."""
        if at is not None and (isinstance(at, bool) or not isinstance(at, int)):
            raise TypeError(f"aggregate(at=...) takes the index of an input, got {type(at)}")
        if not self.messages:
            return {}
        carried = len(next(iter(self.input_states.values()), ()))
        if at is not None and not -carried <= at < carried:
            raise IndexError(
                f"aggregate(at={at}): the branches were carried down to {carried} input(s) "
                "(branches(..., inputs=[...]))"
            )
        sr = self._semiring()
        dims = [dims] if isinstance(dims, int) else list(dims)
        joined: dict[str, State | None] = {}
        for name in self.messages:
            key = rename(name) if rename is not None else name
            state = self.messages[name].parts if at is None else self.input_states[name][at]
            if key in joined and joined[key] is not None and state is not None:
                state = sr.plus(joined[key], state)
            elif key in joined and state is None:
                state = joined[key]
            joined[key] = state
        out = {}
        for key, state in joined.items():
            if state is None:
                out[key] = None
                continue
            rank = state[0].dim()
            out[key] = sr.readout(sr.sum(state, sorted(d % rank for d in dims)))
        return out

    def total(self, dims: int | Sequence[int], view: Sequence[int] | None = None) -> Any:
        """Readout of every branch together (the semiring plus over branches: all the paths to
        the split tensor), summed over ``dims`` like ``aggregate``; with ``view`` the state is
        first viewed in that shape (``[b, t, heads, head_dim]`` for a ``[b, t, hidden]`` tensor
        whose last dim packs the heads), and ``dims`` refer to it. None before a backward."""
        if not self.messages:
            return None
        sr = self._semiring()
        states = [m.parts for m in self.messages.values()]
        state = states[0]
        for other in states[1:]:
            state = sr.plus(state, other)
        if view is not None:
            state = tuple(c.reshape(tuple(view)) for c in state)
        dims = [dims] if isinstance(dims, int) else list(dims)
        return sr.readout(sr.sum(state, sorted(d % state[0].dim() for d in dims)))

    def _semiring(self):
        return next(iter(self.messages.values())).semiring


class _OpenSplits(threading.local):
    """The split modes open in this thread, and whether one is making an alias: two splits
    of one tensor (a module and its parent given the same input, a Monitor's split and the
    user's) each see the other's alias as a form of their tensor, not as a use of it (trial
    72: the outer split's branches were the inner one's aliases, named ``view_as:arg0/1``)."""

    def __init__(self) -> None:
        self.modes: list[_SplitMode] = []
        self.aliasing = 0


_OPEN_SPLITS = _OpenSplits()


@contextmanager
def _making_alias() -> Iterator[None]:
    _OPEN_SPLITS.aliasing += 1
    try:
        yield
    finally:
        _OPEN_SPLITS.aliasing -= 1


class _SplitMode(TorchFunctionMode):
    """Gives each use of the split tensor its own alias, named after its consumer."""

    def __init__(self, result: Branches, on_alias: Callable[[str, Tensor], None]) -> None:
        super().__init__()
        self.result = result
        self.on_alias = on_alias
        self.target: Tensor | None = None
        #: the split tensor and its copies behind module-hook nodes (``_behind_module_hook``)
        self.forms: list[Tensor] = []
        self.counts: dict[str, int] = {}
        #: whether a use of the split tensor ran without grad mode (no alias, no branch)
        self.uses_without_grad = False
        #: before the split module is called: the tensors calls used (id -> each use's weak
        #: reference, call and result nodes), to tell whether the split tensor had uses
        #: before it (``Branches.used_before``); None once the split tensor is taken
        self.earlier_uses: dict[int, list[tuple[weakref.ref, str, list]]] | None = {}
        #: whether the block is open (a backward inside it re-arms the watch for uses
        #: before the module's next call)
        self.inside = False
        #: calls of this mode running (``__torch_function__`` nested)
        self.calling = 0
        #: the (node id, output) edges a use of the split tensor or of one of its forms has,
        #: kept as forms and hook copies appear (read at every node the block creates), and
        #: the nodes they name (kept alive: ids are compared)
        self.split_edges: set[tuple[int, int]] = set()
        self._edge_nodes: list[Any] = []

    def split_at(self, tensor: Tensor | None) -> None:
        """Split ``tensor`` from now on (None: nothing, until the module's next call)."""
        self.forms = [] if tensor is None else [tensor]
        self.split_edges, self._edge_nodes = set(), []
        if tensor is not None:
            self._add_edge(_gradient_node(tensor), tensor.output_nr)

    def _add_form(self, t: Tensor) -> None:
        """``t`` is the split tensor too (a copy behind module hooks, another split's alias)."""
        self.forms.append(t)
        if t.grad_fn is not None:
            self._add_edge(t.grad_fn, t.output_nr)

    def _add_edge(self, node: Any, output_nr: int) -> None:
        self._edge_nodes.append(node)
        self.split_edges.add((id(node), output_nr))

    def watch_unseen(self, node: Any, late: list) -> None:
        """A node created while the block is open (``node_creation_hook``): one with an edge
        from the split tensor, made outside any call this mode saw (``Function.apply`` of a
        custom ``autograd.Function`` does not go through torch function modes), is a use
        no alias carries. Its paths would be missing from every branch, silently (trial 82:
        ``h @ W + Sq.apply(h)`` split into one branch whose value fell short of ``h``'s): a
        backward reaching it records it in ``unseen_uses``, which warns."""
        if self.calling or self.target is None or _OPEN_SPLITS.aliasing:
            return
        if torch._C._current_graph_task_id() != -1:  # made in a backward (a recomputation)
            return
        reached = [
            i
            for i, (n, nr) in enumerate(node.next_functions)
            if n is not None and (id(n), nr) in self.split_edges
        ]
        if not reached:
            return
        if node.name() == MODULE_HOOK_NODE:  # a module with backward hooks: output i is its
            # input i's copy, whose uses are the split tensor's (trial 86: one behind two such
            # copies was not watched); its other outputs are other inputs' (trial 87)
            for i in reached:
                self._add_edge(node, i)
            return
        node.register_prehook(_mark_unseen_use(self.result, node.name(), late))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calling += 1  # nodes made inside a call this mode sees are no unseen uses
        try:
            return self._call(func, args, kwargs or {})
        finally:
            self.calling -= 1

    def _call(self, func, args, kwargs):
        if _OPEN_SPLITS.aliasing:  # another split making its alias
            return func(*args, **kwargs)
        watching = self.target is None and self.earlier_uses is not None
        if watching and torch.is_grad_enabled() and not _reads_metadata(func):
            result = func(*args, **kwargs)
            self._record_uses(func, args, kwargs, result)
            return result
        if self.target is None or _reads_metadata(func):
            return func(*args, **kwargs)
        # an in-place op writes its first argument: that one keeps the tensor (an alias would
        # be written through); the split tensor as one of its other arguments is a use
        first = 1 if _in_place(func) else 0
        if not torch.is_grad_enabled():
            if not self.uses_without_grad:
                every = (*args[first:], *kwargs.values())
                self.uses_without_grad = any(self._in_argument(a) for a in every)
            return func(*args, **kwargs)
        uses = [i for i, a in enumerate(args) if i >= first and self._is_split(a)]
        named = [k for k, v in kwargs.items() if self._is_split(v)]
        listed = [i for i, a in enumerate(args) if i >= first and self._in_list(a)]
        if not uses and not named and not listed:
            result = func(*args, **kwargs)
            if self.earlier_uses is not None:  # uses before the module's next call
                self._record_uses(func, args, kwargs, result)
            return result
        module = current_module()
        labels = _argument_labels(func, uses, named) if len(uses) + len(named) > 1 else None
        args, kwargs = list(args), dict(kwargs)
        op = getattr(func, "__name__", type(func).__name__)
        before = len(self.result.names)
        made: list[tuple[Tensor, Tensor]] = []  # (alias, the tensor it stands for)
        for n, i in enumerate(uses):
            made.append((self._alias(args[i], module, labels[n] if labels else None, op), args[i]))
            args[i] = made[-1][0]
        for n, k in enumerate(named):
            label = labels[len(uses) + n] if labels else None
            made.append((self._alias(kwargs[k], module, label, op), kwargs[k]))
            kwargs[k] = made[-1][0]
        listed_aliases: list[Tensor] = []

        def listed_alias(a: Tensor) -> Tensor:
            listed_aliases.append(self._alias(a, module, None, op))
            return listed_aliases[-1]

        for i in listed:  # torch.cat([h, g]), torch.stack: each listed use is a branch
            args[i] = type(args[i])(listed_alias(a) if self._is_split(a) else a for a in args[i])
        if op in ADDS and not self._adds_a_value_of_the_split(args, kwargs, made):
            self.result.offsets.update(self.result.names[before:])
        created: list[Any] = []
        with torch.autograd.graph.node_creation_hook(created.append):
            result = func(*args, **kwargs)
        aliases = [alias for alias, _ in made] + listed_aliases  # in the order of their names
        self._forget_edgeless(before, aliases, created)
        original = next((t for alias, t in made if result is alias), None)
        if original is not None:
            # A call that hands its argument back (``h.to(torch.float32)`` of a float32 ``h``,
            # ``.contiguous()``, ``.float()``) made no use: its result is the split tensor,
            # whose later uses are each a branch. Through the alias they would be summed at
            # the alias first, in another order than a plain backward sums them at the split
            # tensor (``.grad`` one rounding apart).
            self._forget(before)
            return original
        return result

    def _record_uses(self, func, args, kwargs, result) -> None:
        """Remember each tensor that requires grad this call used, with the nodes of its
        result (``earlier_uses``): a use before the module's call once a backward reaches it."""
        if not _records_a_use(result):  # detach, isfinite, retain_grad, register_hook
            return
        nodes = list(
            {
                id(t.grad_fn): t.grad_fn
                for t in tree_leaves(result)
                if isinstance(t, Tensor) and t.grad_fn is not None
            }.values()
        )
        for a in tree_leaves((args, kwargs)):
            # a call that hands its argument back (eval-mode dropout, .to()) is no use
            if isinstance(a, Tensor) and a.requires_grad and a is not result:
                use = (weakref.ref(a), _call_name(func), nodes)
                self.earlier_uses.setdefault(id(a), []).append(use)

    def _adds_a_value_of_the_split(
        self, args: list[Any], kwargs: dict[str, Any], made: list[tuple[Tensor, Tensor]]
    ) -> bool:
        """Whether an add's other tensor operand is computed from the split tensor (a residual
        add ``x + f(x)``), rather than a value from elsewhere (``h + position``, a constant).
        Walks that operand's graph back looking for the split tensor's node; a graph too large
        to walk (over ``_WALK_LIMIT`` nodes) counts as computed from it, the name it had."""
        aliases = {id(alias) for alias, _ in made}
        others = [
            a
            for a in tree_leaves((args, kwargs))
            if isinstance(a, Tensor) and id(a) not in aliases and a.requires_grad
        ]
        targets: list[Any] = [t.grad_fn for t in self.forms if t.grad_fn is not None]
        targets += [
            torch.autograd.graph.get_gradient_edge(t).node
            for t in self.forms
            if t.grad_fn is None and t.requires_grad
        ]
        wanted = {id(n) for n in targets}
        stack = [a.grad_fn for a in others if a.grad_fn is not None]
        seen: set[int] = set()
        kept: list[Any] = []  # nodes stay alive while their ids are compared
        while stack:
            node = stack.pop()
            if id(node) in wanted:
                return True
            if id(node) in seen:
                continue
            seen.add(id(node))
            kept.append(node)
            if len(seen) > _WALK_LIMIT:
                return True
            stack.extend(n for n, _ in node.next_functions if n is not None)
        return False

    def _forget_edgeless(self, first: int, aliases: list[Tensor], created: list[Any]) -> None:
        """Drop the branches named from position ``first`` on (one per alias in ``aliases``)
        whose alias no node the call ``created`` has an edge from: the call read its dtype or
        shape only (``y.type_as(h)``, ``torch.zeros_like(h)``, ``h.new_zeros(...)``), or its
        result takes no gradient (``h.argmax()``, ``h > 0``). Such a branch never received a
        message: ``names`` listed it and ``values`` had no entry (trial 80: Gemma's RMSNorm
        ends in ``output.type_as(x)``)."""
        reached = {id(n) for node in created for n, _ in node.next_functions if n is not None}
        names = self.result.names[first:]
        edgeless = {
            name
            for name, alias in zip(names, aliases, strict=True)
            if alias.grad_fn is not None and id(alias.grad_fn) not in reached
        }
        for name in reversed(names):
            if name not in edgeless:
                continue
            self.result.names.remove(name)
            self.result.ops.pop(name, None)
            self.result.offsets.discard(name)
            base, _, number = name.partition("#")
            if self.counts.get(base) == int(number or 1):  # the last one named: no gap
                self.counts[base] -= 1

    def _forget(self, first: int) -> None:
        """Drop the branches named from position ``first`` on (aliases no op used)."""
        for name in self.result.names[first:]:
            self.result.ops.pop(name, None)
            self.result.offsets.discard(name)
            base = name.split("#")[0]
            self.counts[base] -= 1
        del self.result.names[first:]

    def _in_list(self, a: Any) -> bool:
        """Whether ``a`` is a list or tuple of arguments holding the split tensor."""
        return isinstance(a, (list, tuple)) and any(self._is_split(t) for t in a)

    def _in_argument(self, a: Any) -> bool:
        return self._is_split(a) or self._in_list(a)

    def _is_split(self, a: Any) -> bool:
        """Whether ``a`` is the split tensor, or it as a module with backward hooks (BackPACK's,
        say) receives it: PyTorch hands such a module's forward a copy made by an identity
        node, invisible to this mode, so the uses inside the forward are the copy's."""
        if not isinstance(a, Tensor):
            return False
        if any(a is f for f in self.forms):
            return True
        if any(_behind_module_hook(a, f) for f in self.forms):
            self._add_form(a)
            return True
        return False

    def _alias(self, of: Tensor, module: str, label: str | None, op: str) -> Tensor:
        module = module or ROOT_MODULE  # the extended model's own forward
        name = module if label is None else f"{module}:{label}"
        seen = self.counts.get(name, 0) + 1
        self.counts[name] = seen
        if seen > 1:
            name = f"{name}#{seen}"
        with _making_alias():  # no use for the other splits: a form of their tensor too
            alias = of.view_as(of)
        for other in _OPEN_SPLITS.modes:
            if other is not self and other._is_split(of):
                other._add_form(alias)
        self.result.names.append(name)
        self.result.ops[name] = op
        self.on_alias(name, alias)
        return alias


#: Calls that read a tensor's metadata or attributes (``h.shape``, ``h.grad_fn``, ``h.dim()``):
#: they are not uses in the graph and must see the tensor itself.
_NOT_USES = {"__get__", "__set__", "size", "dim", "numel", "stride", "is_contiguous", "data_ptr"}


def _behind_module_hook(a: Tensor, t: Tensor) -> bool:
    """Whether ``a`` is ``t`` passed through the identity nodes PyTorch puts in front of (or
    behind) modules with full backward hooks or backward pre-hooks: output ``i`` of such a node
    is its input ``i``, whose edge leads to ``t``'s node (its AccumulateGrad for a leaf), or to
    another such node (the split module's and a submodule's hooks: trial 85 found the
    submodule's use in no branch, silently)."""
    node, nr = a.grad_fn, a.output_nr
    while node is not None and node.name() == MODULE_HOOK_NODE:
        node, nr = node.next_functions[nr]
        if t.grad_fn is None and getattr(node, "variable", None) is t:
            return True
        if t.grad_fn is not None and node is t.grad_fn and nr == t.output_nr:
            return True
    return False


def _records_a_use(result: Any) -> bool:
    """Whether a call with this result is a use in the graph: some tensor it returns requires
    grad. ``h.detach()``, ``torch.isfinite(h)``, ``h.retain_grad()`` and ``h.register_hook``
    touch the tensor and add no edge from it (trial 67: they were taken for uses before the
    split module, and ``explain_layers`` refused such a layer)."""
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(result))


def _reads_metadata(func: Callable[..., Any]) -> bool:
    """Metadata reads are no uses: they see the tensor itself."""
    return getattr(func, "__name__", "") in _NOT_USES


def _in_place(func: Callable[..., Any]) -> bool:
    """Whether ``func`` writes its first argument (``add_``, ``mul_``, ``__iadd__``)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


#: Calls that add (or subtract) two values: a use of the split tensor by one of these in the
#: split module's own forward is a residual add when the other operand is computed from it.
ADDS = {"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__"}

#: Nodes an add's other operand's graph is searched through for the split tensor.
_WALK_LIMIT = 20000


def _call_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _argument_labels(func: Callable[..., Any], uses: list[int], named: list[str]) -> list[str]:
    """Parameter names of the positions and keywords where one call uses the split tensor
    (``arg<i>`` where the position has no name of its own: ``*args``)."""
    schema = getattr(func, "_schema", None)  # an ATen op overload: its schema's names
    if schema is not None:
        params = [a.name for a in schema.arguments if not a.kwarg_only]
    else:
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            parameters = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = []
        for p in parameters:  # up to ``*args`` (trial 85: torch.ops calls read "args")
            if p.kind not in positional:
                break
            params.append(p.name)
    labels = [params[i] if i < len(params) else f"arg{i}" for i in uses]
    return labels + named


@contextmanager
def branches(at: nn.Module | Tensor, inputs: Sequence[Tensor] = ()) -> Iterator[Branches]:
    """Split the semiring value at a tensor by the use a path leaves it through.

    Use inside ``semipack.extend`` around the forward (the backward may come after the
    ``branches`` block, inside ``extend``)::

        with semipack.extend(model, semipack.MaxProd()):
            with semipack.branches(model.encoder.layer[0].attention, inputs=[emb]) as split:
                loss = model(x).logits[0, y]
            loss.backward()
        split.values        # {"encoder.layer.0.attention.self.query": [...], ...}
        split.at_inputs     # the same branches carried down to ``emb``

    ``at`` is a module (each of its calls with grad mode on is split, at the first tensor it
    receives that requires grad, such as an attention block's hidden states; each backward
    reads the call it reaches) or a tensor that requires grad (split from now on).
    ``inputs`` are tensors below the split tensor (leaves, or intermediate tensors such as the
    embeddings' output) at which each branch is also read out on its own.
    """
    for i, t in enumerate(inputs):  # (trial 72: raw errors from inside the backward)
        if not isinstance(t, Tensor) or not t.requires_grad:
            what = type(t).__name__ if not isinstance(t, Tensor) else "a tensor without grad"
            raise TypeError(
                f"semipack.branches(inputs=...) takes tensors that require grad, below the split "
                f"tensor; entry {i} is {what}"
            )
    if not any(
        isinstance(m, SemiringMode) for m in torch.overrides._get_current_function_mode_stack()
    ):
        warnings.warn(
            "semipack.branches outside semipack.extend: a backward there is plain (no branch "
            "gets a value), and semipack.grad names no module; open the extend block first",
            stacklevel=user_stacklevel(),
        )
    result = Branches()
    #: one record per split call (a module's call with grad mode on; a split tensor has one):
    #: its names, ops, offsets, arguments and uses before it
    calls: list[Branches] = []
    #: the backward whose messages ``result`` holds (graph task id), the record it adopted,
    #: the records it reached, and the calls taken since it
    state = _SplitState(result)
    watch_backwards(state)
    #: after the block: warns of what a later backward finds (uses before the module, calls)
    late: list[Callable[[str], None] | None] = [None]
    mode = _SplitMode(
        result,
        lambda name, alias: _read_branch(alias, name, len(calls) - 1, calls, result, state, late),
    )
    handles = []

    def take(tensor: Tensor, arguments: tuple[int | str, ...] = ()) -> None:
        """A call of the module (or the tensor given): its input is split from now on."""
        if not isinstance(tensor, Tensor) or not tensor.requires_grad:
            what = f"{type(at).__name__}'s input" if isinstance(at, nn.Module) else "this tensor"
            # with grad mode on, the tensor was computed from nothing that requires grad
            cause = NO_GRAPH_CAUSES if not torch.is_grad_enabled() else _NOTHING_REQUIRES_GRAD
            raise SemipackError(
                f"semipack.branches splits a tensor that requires grad; {what} does not ({cause})"
            )
        record = Branches(split=tensor, arguments=arguments, calls=1)
        calls.append(record)
        mode.result, mode.target, mode.counts = record, tensor, {}
        mode.split_at(tensor)
        state.since += 1
        result.calls = state.since
        if state.task is None:  # before any backward: the latest call is shown
            _show(result, record)
        if mode.earlier_uses is not None:
            for ref, call, nodes in mode.earlier_uses.get(id(tensor), ()):
                if ref() is tensor:
                    for node in nodes:
                        node.register_prehook(_mark_used_before(record, call, late))
            # a module's next call (a metric forward came first, trial 71) is watched too
            mode.earlier_uses = {} if isinstance(at, nn.Module) else None
        if inputs:
            if tensor.grad_fn is None:
                raise SemipackError(
                    "semipack.branches(inputs=...) carries branches down from the split tensor, "
                    "which is a leaf here: nothing lies below it"
                )
            carrier = _carrier(result, list(inputs), len(calls) - 1, state)
            handles.append(tensor.grad_fn.register_prehook(carrier))

    def rearm() -> None:
        """After a backward: watch for uses before the module's next call again (a split
        tensor stays split)."""
        if mode.inside and isinstance(at, nn.Module):
            mode.target, mode.earlier_uses = None, {}
            mode.split_at(None)

    state.rearm = rearm

    if isinstance(at, nn.Module):

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # a checkpoint's recomputation in the backward: the call was counted
            if not torch.is_grad_enabled():  # no graph (a validation forward, a reentrant
                result.calls_without_grad += 1  # checkpoint's first run): no use to split
                return
            # the first tensor of the call that requires grad (else the first tensor), also
            # inside a list (DenseNet's layers take the list of earlier features; trial 67:
            # such a module read as never called) or after a mask (trial 69: refused)
            tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
            first = next((a for a in tensors if a.requires_grad), tensors[0] if tensors else None)
            if first is not None:
                arguments = (
                    *(i for i, a in enumerate(args) if a is first),
                    *(k for k, a in kwargs.items() if a is first),
                )
                take(first, arguments)

        handles.append(at.register_forward_pre_hook(BlockPreHook(pre_hook), with_kwargs=True))
    elif isinstance(at, Tensor):
        take(at)
    else:
        raise TypeError(f"semipack.branches splits at a module or a tensor, got {type(at)}")
    watching = torch.autograd.graph.node_creation_hook(lambda n: mode.watch_unseen(n, late))
    try:
        with mode, watching:
            mode.inside = state.open = True
            _OPEN_SPLITS.modes.append(mode)
            yield result
    finally:
        mode.inside = state.open = False
        if mode in _OPEN_SPLITS.modes:
            _OPEN_SPLITS.modes.remove(mode)
        if isinstance(at, nn.Module):
            handles[0].remove()
        mode.target = None
        mode.split_at(None)
    if result.split is not None and not result.names and mode.uses_without_grad:
        raise SemipackError(
            "semipack.branches: the split tensor was used only where autograd records nothing "
            f"({NO_GRAPH_CAUSES}), so no branch can be told apart"
        )
    if result.split is None and result.calls_without_grad:
        raise SemipackError(
            f"semipack.branches splits a tensor that requires grad; {type(at).__name__} was "
            f"called only where autograd records nothing ({NO_GRAPH_CAUSES})"
        )
    if result.split is None:
        raise SemipackError(
            f"semipack.branches: {type(at).__name__} was not called inside the block"
        )
    name = type(at).__name__
    subject = f"{name}'s input" if isinstance(at, nn.Module) else "the split tensor"
    if result.unseen_uses:  # a backward inside the block reached them
        _warn_unseen(subject, result.unseen_uses)
    if isinstance(at, nn.Module):
        if result.used_before:
            _warn_used_before(name, result.used_before)
        if len(state.reached) > 1:
            _warn_calls(name, len(state.reached))
    # a backward after the block warns when it finds any of them
    late[0] = lambda what: (
        _warn_calls(name, len(state.reached))
        if what == _CALLS
        else _warn_unseen(subject, [what.removeprefix(_UNSEEN)])
        if what.startswith(_UNSEEN)
        else _warn_used_before(name, [what])
    )


#: Why a tensor computed with grad mode on does not require grad.
_NOTHING_REQUIRES_GRAD = (
    "nothing it is computed from requires grad: the model's input itself (a split of the "
    "first layer, whose input is the batch: call x.requires_grad_() on it before the forward), "
    "or a frozen model, model.requires_grad_(False), with an input that does not require grad "
    "either (unfreeze the parameters whose paths you want)"
)

#: Why a forward inside the block records no graph, for the errors that meet it.
NO_GRAPH_CAUSES = (
    "a forward under torch.no_grad, or inside a reentrant activation checkpoint "
    "(torch.utils.checkpoint with use_reentrant=True), which records the graph only while "
    "the backward runs, after this block: use use_reentrant=False"
)


#: What ``late`` is told when a backward reaches several calls of the split module.
_CALLS = "<several calls>"


@dataclass(eq=False)
class _SplitState:
    """Which backward a split's values come from (``branches``)."""

    result: Branches
    task: int | None = None  # the graph task id of the backward whose messages are kept
    adopted: int = -1  # the call record it reached first, whose branches are kept
    reached: set[int] = field(default_factory=set)  # the call records it reached
    since: int = 0  # calls taken since that backward
    rearm: Callable[[], None] = lambda: None
    open: bool = False  # whether the ``branches`` block is open

    def backward_started(self) -> None:
        """A backward of ``semipack.extend`` starts inside the block: the values become its
        own, none if it does not reach the split (trial 71: an earlier micro-batch's stayed).
        After the block only a backward that reaches the split replaces them (another model's
        backward leaves them)."""
        if self.task is not None and self.open:
            self.result.messages, self.result.input_states = {}, {}


def _show(result: Branches, record: Branches) -> None:
    """``result`` shows ``record``'s call: its names, ops, offsets, arguments, uses before it
    and split tensor (the same objects, so later additions show too)."""
    result.names, result.ops, result.offsets = record.names, record.ops, record.offsets
    result.used_before, result.arguments, result.split = (
        record.used_before,
        record.arguments,
        record.split,
    )
    result.unseen_uses = record.unseen_uses


def _warn_used_before(module: str, calls: Sequence[str]) -> None:
    warnings.warn(
        f"semipack.branches: {module}'s input was used before the module was called (by "
        f"{', '.join(calls)}): those uses' paths are in no branch",
        stacklevel=user_stacklevel(),
    )


def _warn_calls(module: str, n: int) -> None:
    warnings.warn(
        f"semipack.branches: one backward reached {n} calls of {module}; only the call it "
        "reached first is split (the other calls' paths are in no branch). Split a tensor "
        "instead, or run the module once per backward",
        stacklevel=user_stacklevel(),
    )


#: What ``late`` is told, before a node's name, when a backward reaches an unseen use.
_UNSEEN = "<unseen>"


def _gradient_node(t: Tensor) -> Any:
    """The node a use of ``t`` has an edge to: its ``grad_fn``, a leaf's ``AccumulateGrad``
    (found through a view, which no split may take for a use)."""
    if t.grad_fn is not None:
        return t.grad_fn
    with _making_alias():
        return torch.autograd.graph.get_gradient_edge(t).node


def _warn_unseen(subject: str, nodes: Sequence[str]) -> None:
    warnings.warn(
        f"semipack.branches: {subject} was used by {', '.join(nodes)}, made by a call "
        "the block does not see (a custom autograd.Function's apply, code below Python): "
        "those uses' paths are in no branch, and the branches do not add up to the split "
        "tensor's value",
        stacklevel=user_stacklevel(),
    )


def _mark_reached(found: list[str], name: str, said: str, late: list):
    """A pre-hook for a node whose paths are in no branch: once a backward's message reaches
    it, ``name`` joins ``found`` (``Branches.unseen_uses``, ``used_before``) and ``late[0]``,
    when set, is told ``said``."""

    def hook(grad_outputs):
        if name in found or in_carry_pass():
            return None
        if any(isinstance(g, Message) for g in grad_outputs):
            found.append(name)
            if late[0] is not None:
                late[0](said)
        return None

    return hook


def _mark_unseen_use(record: Branches, node_name: str, late: list):
    """The pre-hook of an unseen use's node (``_SplitMode.watch_unseen``)."""
    return _mark_reached(record.unseen_uses, node_name, _UNSEEN + node_name, late)


def _mark_used_before(record: Branches, call: str, late: list):
    """The pre-hook of a use of the split tensor made before the module's call."""
    return _mark_reached(record.used_before, call, call, late)


def _read_branch(
    alias: Tensor,
    name: str,
    index: int,
    calls: list[Branches],
    result: Branches,
    state: _SplitState,
    late: list,
) -> None:
    """Keep the message the alias's node receives: that consumer's branch. The first message
    of a backward adopts its call: ``result`` then shows that call's branches and only its
    messages (gradient accumulation: each backward replaces the values, as it replaces
    ``semiring_grad``; a forward no backward follows changes nothing); a second call the same
    backward reaches is in no branch, and counted."""

    def hook(grad_outputs):
        msg = grad_outputs[0]
        if not isinstance(msg, Message) or in_carry_pass():  # (a branch carried down, trial 71)
            return None
        task = torch._C._current_graph_task_id()
        if task != state.task:  # the first message of a backward
            state.task, state.adopted, state.reached, state.since = task, index, {index}, 0
            _show(result, calls[index])
            result.messages, result.input_states, result.calls = {}, {}, 1
            state.rearm()
        elif index != state.adopted:
            if index not in state.reached:
                state.reached.add(index)
                result.calls = len(state.reached)
                if late[0] is not None:  # after the block: said now
                    late[0](_CALLS)
            return None
        result.messages[name] = msg
        return None

    alias.grad_fn.register_prehook(hook)


def _carrier(result: Branches, inputs: list[Tensor], index: int, state: _SplitState):
    """A pre-hook for the split tensor's node, which the engine runs after every consumer: one
    pass per branch from the split tensor down to ``inputs``, for the call the running backward
    adopted."""

    carrying = []

    def hook(grad_outputs):
        adopted = state.adopted == index and state.task == torch._C._current_graph_task_id()
        if not result.messages or carrying or not adopted:
            return None  # (the branch passes start at this node too)
        carrying.append(True)
        try:
            names = list(result.messages)
            first = result.messages[names[0]]
            if first.semiring.records_paths:
                kind = type(first.semiring).__name__
                raise SemipackError(
                    f"semipack.branches(inputs=...) cannot carry {kind} branches down (their "
                    f"paths would be recorded twice); read {kind} at the split tensor, or use "
                    "MaxProd for the values at the inputs"
                )
            states = [result.messages[n].parts for n in names]
            carried = carry_down(result.split, states, first.semiring, inputs)
            result.input_states = dict(zip(names, carried, strict=True))
        finally:
            carrying.clear()
        return None

    return hook


__all__ = ["Branches", "branches"]
