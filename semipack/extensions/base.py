"""Extensions: a speed and naming layer over the generic per-op rules.

An extension takes over one torch function (``F.linear``, ``torch.conv2d``, ``F.layer_norm``,
``F.embedding``, ``F.multi_head_attention_forward``, ``F.scaled_dot_product_attention``) while
``semipack.extend`` is active, whichever module or user code calls it. Nothing is changed on the
module objects, so deep copies, pickling, patched ``forward`` methods and keyword calls behave
as without semipack.

The call runs the function's own ops under autograd on detached aliases of its inputs (the
*inner graph*: the same ops and saved tensors as a plain forward), so the regular gradient is
later taken from exactly the ops a plain backward would run. An ``ExtensionFunction`` then
stands in for the call in the outer graph: its backward computes the semiring messages of the
whole call at once with fused kernels and tags them with site names. The template owns the steps
of that backward; an extension states only its messages, the inputs they read and its sites.

Extensions must give the same semiring values as the generic per-op path; tests prove it. They
must also never lose a gradient: when the inner graph reaches a tensor that requires grad and is
not one of the extension's inputs (a learnable attention bias captured in a closure, say), the
call keeps its plain outputs and the generic path carries that tensor's messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..errors import MessageLostError, PerSampleError
from ..graph.provenance import current_module, current_site, under_legacy_backward_hook
from ..graph.sites import Site, stamp
from ..messages.message import Message
from ..rules.per_sample import MERGED_EXAMPLES_KEY, register_per_sample
from ..semirings.base import Semiring, SparseRows, State
from ..semirings.product import Product
from ..transport.passes import autocast_on, graph_retained, in_carry_pass
from ..transport.per_sample import active_rows
from .direct_backward import direct_grads

#: torch function -> the extension that takes its calls over inside ``semipack.extend``.
FUNCTION_EXTENSIONS: dict[Callable[..., Any], Callable[..., Any]] = {}


def extends(*functions: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: route calls of ``functions`` to the decorated handler inside ``extend``.

    The handler has the function's signature and must return exactly what the function
    returns (it may call the function itself for cases it does not cover).
    """

    def register(handler: Callable[..., Any]) -> Callable[..., Any]:
        for f in functions:
            FUNCTION_EXTENSIONS[f] = handler
        return handler

    return register


@contextmanager
def extending(handler: Callable[..., Any], *functions: Callable[..., Any]) -> Iterator[None]:
    """Route calls of ``functions`` to ``handler`` in ``extend`` blocks entered inside this one,
    then restore what was registered before (another extension, or none).

    ``extend`` reads the registrations when it is entered, so this block must enclose it.
    """
    before = {f: FUNCTION_EXTENSIONS.get(f) for f in functions}
    extends(*functions)(handler)
    try:
        yield
    finally:
        for f, previous in before.items():
            if previous is None:
                FUNCTION_EXTENSIONS.pop(f, None)
            else:
                FUNCTION_EXTENSIONS[f] = previous


def wants_graph(*tensors: Tensor | None) -> bool:
    """Whether a call records an autograd graph at all (grad mode on, some input needs grad)."""
    return torch.is_grad_enabled() and any(
        t is not None and isinstance(t, Tensor) and t.requires_grad for t in tensors
    )


# --- the inner graph ---------------------------------------------------------------------------


#: The qualified name's beginning of the pack hook ``torch.utils.checkpoint`` pushes for a
#: non-reentrant checkpoint's forward.
_CHECKPOINT_PACK = "_checkpoint_hook."


class _CheckpointedTensors:
    """The saved tensors of an inner graph recorded inside a non-reentrant checkpoint, each
    read once per outer backward.

    Why: under the checkpoint's hooks alone, each ``torch.autograd.grad`` over the inner graph
    (a graph task of its own) recomputed the whole checkpointed region again: its forward ran
    once per extension in it instead of once per backward, and a batch norm's running
    statistics, a spectral norm's vectors, dropout's draws and with them ``.grad`` came out
    unlike a plain backward's (trial 81). Here each tensor is packed by the checkpoint (its
    recomputation saves the same tensors: the plain call where no extension runs in the
    backward, the same inner graph where one does, Hugging Face's eager attention; see
    ``commit``), and ``read`` unpacks them all in the outer backward's graph task, where the
    region is recomputed once, as a plain backward does; the inner backward then reads those
    values (the recomputed ones, as a plain backward's nodes do)."""

    def __init__(self, pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> None:
        self._pack, self._unpack = pack, unpack
        #: [checkpoint's handle (None until ``commit``), value read or None, tensor to pack]
        self._slots: list[list[Any]] = []

    @staticmethod
    def under_checkpoint() -> _CheckpointedTensors | None:
        """For the non-reentrant checkpoint whose forward is running, or None."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or not getattr(top[0], "__qualname__", "").startswith(_CHECKPOINT_PACK):
            return None
        return _CheckpointedTensors(*top)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._packed, self._unpacked)

    def _packed(self, t: Tensor) -> list[Any]:
        slot = [None, None, t]
        self._slots.append(slot)
        return slot

    def commit(self) -> None:
        """Hand the saved tensors to the checkpoint, in the order they were saved, once the
        extension uses the inner graph (right after it is recorded, before any other op
        saves a tensor: ``draws``, which a recomputation runs after the inner graph where
        the extension runs there too, Hugging Face's eager attention; trial 85). An inner graph
        given up for the plain call, which saves its own (an input used twice, ``sdpa(q, q,
        q)``), hands none: the checkpoint counts the tensors saved in the forward against its
        recomputation's (trial 82: 11 against 6)."""
        for slot in self._slots:
            slot[0], slot[2] = self._pack(slot[2]), None

    def _unpacked(self, slot: list[Any]) -> Tensor:
        return slot[1] if slot[1] is not None else self._unpack(slot[0])

    def read(self) -> None:
        """Unpack every tensor in the running (outer) backward's graph task."""
        for slot in self._slots:
            slot[1] = self._unpack(slot[0])


class InnerGraph:
    """A call's own ops, recorded under autograd on detached aliases of its inputs.

    ``escapes`` is True when the recorded graph reaches a tensor that requires grad other than
    the given inputs: an extension built on this graph would treat that tensor as a constant and
    lose its gradient, so the caller must use the plain call (``plain_outputs``) instead.
    ``reuses_an_input`` is True when the call's ops use one input more than once
    (``F.linear(w, w)``): the inner backward would add its gradients before the outer one adds
    the input's other gradients, where a plain backward adds them all in one buffer, in another
    order (a last-bit difference in ``.grad``); the caller uses the plain call there too.
    """

    #: Keep the inner graph's saved tensors after ``regular_grads`` (set per pass by
    #: ``frees_context``; kept unless the running semiring passes free the graph).
    retain: bool = True

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Tensor | None]) -> None:
        self.fn = fn
        self.originals: list[Tensor | None] = list(inputs)
        # Detached aliases (same storage and version counter): hooks on the real inputs must not
        # see the inner backward's plain gradients. A repeated input gets one alias, so the inner
        # ops see the same identities as a plain forward does.
        aliases: dict[int, Tensor] = {}
        self.inputs: list[Tensor | None] = []
        self.first_use: list[bool] = []
        for t in inputs:
            if t is None:
                self.inputs.append(None)
                self.first_use.append(False)
                continue
            alias = aliases.get(id(t))
            self.first_use.append(alias is None)
            if alias is None:
                alias = aliases[id(t)] = t.detach().requires_grad_(t.requires_grad)
            self.inputs.append(alias)
        self.versions = [None if t is None else t._version for t in self.inputs]
        created: list[torch.autograd.graph.Node] = []
        self.checkpointed = _CheckpointedTensors.under_checkpoint()
        hooks = self.checkpointed.hooks() if self.checkpointed is not None else nullcontext()
        with torch.enable_grad(), torch.autograd.graph.node_creation_hook(created.append), hooks:
            self.outputs = fn(*self.inputs)
        self.escapes, self.reuses_an_input = _boundary(self._output_tensors(), self.inputs, created)

    def plain_outputs(self) -> Any:
        """The call's outputs with its ordinary autograd graph on the real inputs (for a call
        that ``escapes``): the function is run again on them."""
        self.outputs = None
        return self.fn(*self.originals)

    def _output_tensors(self) -> list[Tensor | None]:
        outs = self.outputs if isinstance(self.outputs, tuple) else (self.outputs,)
        return [o if isinstance(o, Tensor) else None for o in outs]

    def take_outputs(self) -> Any:
        """The outputs, detached, for the Function to return; from then on the inner graph
        keeps only their autograd edges (a plain backward does not keep a call's outputs)."""
        outs = self._output_tensors()
        self.edges = [
            None if o is None or o.grad_fn is None else torch.autograd.graph.get_gradient_edge(o)
            for o in outs
        ]
        if isinstance(self.outputs, tuple):
            detached = tuple(o.detach() if isinstance(o, Tensor) else o for o in self.outputs)
        else:
            detached = self.outputs.detach()
        self.outputs = None
        return detached

    def values(self) -> list[Tensor | None]:
        """The inputs, detached, for the semiring computation."""
        return [None if t is None else t.detach() for t in self.inputs]

    def check_unmodified(self, positions: Iterable[int]) -> None:
        """Raise PyTorch's error if an input the messages read was modified in place since
        the forward (a plain backward checks every saved tensor the same way; without the
        regular gradient nothing else would look). Aliases share the inputs' version counters."""
        for i in positions:
            t, version = self.inputs[i], self.versions[i]
            if t is not None and t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                    f"{t._version}; expected version {version} instead. Hint: the tensor was "
                    "changed after the forward pass of a semipack extension that reads it."
                )

    def regular_grads(
        self, grads: Sequence[Tensor | None], direct: bool = False
    ) -> list[Tensor | None]:
        """Gradients for the inputs from exactly the ops of a plain backward, given the
        gradients of the outputs (in order; None for an output without one).

        A repeated input receives its whole gradient at its first position and zeros at the
        others (autograd adds them up again). ``direct``: the call is one torch op, so its
        nodes may be called without starting the engine (``direct_backward``; the same bits).
        """
        pairs = [
            (e, g)
            for e, g in zip(self.edges, grads, strict=False)
            if g is not None and e is not None
        ]
        if self.checkpointed is not None and pairs:
            self.checkpointed.read()
        elif (
            direct
            and len(pairs) == 1
            and all(
                first or t is None for t, first in zip(self.inputs, self.first_use, strict=True)
            )
        ):
            inputs = [t for t in self.inputs if t is not None and t.requires_grad]
            found = direct_grads(pairs[0][0], pairs[0][1], inputs)
            if found is not None:
                by_id = dict(zip(map(id, inputs), found, strict=True))
                return [None if t is None else by_id.get(id(t)) for t in self.inputs]
        return self._grads_by_position(
            pairs, self.inputs, retain_graph=self.retain, create_graph=False
        )

    def differentiable_grads(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """``regular_grads`` for a backward that records a graph (``create_graph=True``: a
        gradient penalty or double backprop differentiates the gradient again). The inner
        graph hangs off detached aliases, so its gradients would be constants; the call runs
        again on its real inputs and is differentiated with ``create_graph``: the same ops, so
        the same values, now connected to the inputs and to the incoming gradients. It runs
        with torch function modes off, as the forward's call did (``extend``'s mode hands the
        call over with itself disabled): nested calls must not become extensions of their own."""
        with torch._C.DisableTorchFunction():
            outs = self.fn(*self.originals)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [
            (o, g)
            for o, g in zip(outs, grads, strict=False)
            if g is not None and isinstance(o, Tensor) and o.requires_grad
        ]
        return self._grads_by_position(pairs, self.originals, retain_graph=True, create_graph=True)

    def _grads_by_position(
        self, pairs: list, inputs: Sequence[Tensor | None], retain_graph: bool, create_graph: bool
    ) -> list[Tensor | None]:
        """``torch.autograd.grad`` of the (output or edge, gradient) ``pairs`` with respect to
        ``inputs`` (the aliases or the originals), one per position: a repeated input gets its
        gradient at its first position and zeros at the others."""
        unique = [
            t
            for t, first in zip(inputs, self.first_use, strict=True)
            if first and t is not None and t.requires_grad
        ]
        if not unique or not pairs:
            return [None] * len(inputs)
        got = torch.autograd.grad(
            [o for o, _ in pairs],
            unique,
            [g for _, g in pairs],
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=True,
        )
        found = dict(zip((id(t) for t in unique), got, strict=True))
        out: list[Tensor | None] = []
        for t, first in zip(inputs, self.first_use, strict=True):
            g = None if t is None else found.get(id(t))
            out.append(torch.zeros_like(g) if g is not None and not first else g)
        return out


def _boundary(
    outputs: Sequence[Tensor | None],
    inputs: Sequence[Tensor | None],
    created: Sequence[torch.autograd.graph.Node],
) -> tuple[bool, bool]:
    """Whether the graph behind ``outputs`` has an edge into anything but ``inputs`` (it
    escapes), and whether it has more than one edge into some input (it reuses one).

    Nodes created while the call ran are the call's own; its boundary is the inputs' gradient
    edges. Any other edge (a captured parameter, a tensor computed outside the call) escapes.
    ``created`` holds the node objects alive, so their identities are stable here.
    """
    own = {id(n) for n in created}
    # The edges are kept in a list: node objects must stay alive for their ids to stay stable.
    edges = [
        torch.autograd.graph.get_gradient_edge(t)
        for t in inputs
        if t is not None and t.requires_grad
    ]
    boundary = {(id(e.node), e.output_nr) for e in edges}
    reached: set[tuple[int, int]] = set()
    reused = False
    stack = [o.grad_fn for o in outputs if o is not None and o.grad_fn is not None]
    visited: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            if (id(nxt), nr) in boundary:
                reused = reused or (id(nxt), nr) in reached
                reached.add((id(nxt), nr))
                continue
            # A leaf's accumulator may be created during the call: it is still outside.
            if id(nxt) not in own or hasattr(nxt, "variable"):
                return True, reused
            stack.append(nxt)
    return False, reused


# --- the template ------------------------------------------------------------------------------

#: ``(tensor name, dim names)`` per output of an extended call, e.g. ``("output", ("batch",
#: "neuron"))``; the template adds the module the call ran in.
Sites = Sequence[tuple[str, tuple[str, ...]]]


@dataclass(frozen=True)
class BackwardCall:
    """What a semiring backward hands an extension's ``messages``.

    ``incoming`` has one semiring state per output of the Function (a tuple of tensors shaped
    like that output, in ``semiring.state_dtype``), or None where no message reached the output.
    ``inputs`` are the call's tensors as given to ``ExtensionFunction.run``, detached (None where
    the call got None); ``needs[i]`` says whether input ``i`` wants a message. ``options`` is
    ``run``'s non-tensor argument and ``kept`` what ``keep`` set aside in the forward.
    ``examples``, for ``per_sample`` only: how many examples the batched inputs' batch dim
    holds where the batch is merged with the dims after it there (``[N * T, d]``, the outer
    factor; ``MERGED_EXAMPLES_KEY``), else None (one per index).
    """

    semiring: Semiring
    incoming: tuple[State | None, ...]
    inputs: list[Tensor | None]
    needs: tuple[bool, ...]
    options: Any
    kept: Any
    examples: int | None = None


#: The tensor every extension node saves for backward (see ``ExtensionFunction.forward``).
_GRAPH_TOKEN = torch.empty(0)


class ExtensionFunction(torch.autograd.Function):
    """Template of an extension: one autograd Function per extended call, backward written once.

    A subclass states only what differs between extensions:

    - ``messages(call)``: one semiring state per input (shaped like the input; None for an input
      that does not need one), from the states of the outputs (``BackwardCall``);
    - ``sites(output)``: ``(tensor name, dim names)`` per output of the call, for path readouts;
    - ``reads``: the positions of the inputs whose values ``messages`` reads (a plain backward
      would fail on them after an in-place change; without the check nothing would);
    - optionally ``keep(outputs)``, splitting the inner function's outputs into what the call
      returns and what the messages need besides (layer norm's mean and rstd).

    The forward is ``run``: it records the call's inner graph, falls back to the plain call when
    that graph reaches a tensor outside the inputs (the generic path must carry its gradient),
    applies the Function and names the sites. The Function's arguments are ``(inner, options,
    *inputs)``; its node is named after the subclass (``LinearFunctionBackward``).

    The backward (``backward``) owns the steps every extension shares:

    1. Split each incoming gradient into regular gradient, semiring state and semiring. With no
       Message among them this is a plain backward: the regular gradients come from exactly the
       inner graph's ops, so ``.grad`` is bitwise a plain backward's.
    2. Check that the inputs in ``reads`` are unmodified, then compute the messages.
    3. Only then the regular gradients. The messages' temporaries (state-dtype copies, shifted
       exponentials, partial products: the peak of the backward) are gone by the time the
       regular gradients exist; the other order holds the regular gradients through that peak.
    4. Wrap each (regular gradient, state) pair as a Message; two leading Nones for ``inner``
       and ``options``.
    5. After a semiring pass that does not retain the graph, empty the context. The engine
       frees a plain node's saved tensors right after it runs, but a custom Function's context
       (here the inner graph with the call's activations) lives until the whole graph is gone:
       without this a semiring backward would hold every extended call's activations to its end.
       A second pass through it then fails with the error a plain backward gives.
    """

    #: marks semipack's own nodes: the pass knows their backward runs no engine of its own
    SEMIPACK_EXTENSION = True

    #: positions (in ``run``'s ``inputs``) of the inputs whose values ``messages`` reads.
    reads: ClassVar[tuple[int, ...]] = ()

    #: The order of the node's edges, as positions in ``run``'s ``inputs`` (None: theirs).
    #: Why: the parameters' gradient nodes that one node makes ready run in the order of its
    #: edges (the first of two pushed runs first), so hooks on parameters (``register_hook``,
    #: ``register_post_accumulate_grad_hook``) fire in this order; a plain backward's order is
    #: the one to keep (a hook drawing noise from the global generator must draw it for the
    #: same parameter). ``F.linear``'s ``addmm`` reaches the bias before the weight.
    edge_order: ClassVar[tuple[int, ...] | None] = None

    #: Whether the call is one torch op with no user code in it (``F.linear``, ``F.conv2d``):
    #: its inner graph holds no hooks, so a semiring pass takes the regular gradient by
    #: calling the graph's nodes (``direct_backward``) instead of an engine run per node.
    direct_regular_grads: ClassVar[bool] = False

    @classmethod
    def read_for(cls, needs: tuple[bool, ...]) -> tuple[int, ...]:
        """The positions in ``reads`` whose values the messages read when ``needs`` says which
        inputs want one (default: all of ``reads``). A bilinear call reads each operand only
        for the other's message: a plain backward of a first layer (its input wants nothing)
        does not read the weight, which may then change in place before it."""
        return cls.reads

    #: Per-sample values (``per_sample``): the positions of the inputs that carry the batch,
    #: the dim it is on in them, and the batch dim of each output (None: no batch).
    batched_inputs: ClassVar[tuple[int, ...]] = (0,)
    input_batch_dim: ClassVar[int] = 0
    output_batch_dims: ClassVar[tuple[int | None, ...]] = (0,)

    @staticmethod
    def messages(call: BackwardCall) -> Sequence[State | None]:
        """One semiring state per input (None where none is needed), see ``BackwardCall``."""
        raise NotImplementedError

    @staticmethod
    def sites(output: Any) -> Sites:
        """``(tensor name, dim names)`` for each output of the call, in order."""
        return ()

    @staticmethod
    def keep(outputs: Any) -> tuple[Any, Any]:
        """(what the call returns, what the messages need besides) from the inner outputs."""
        return outputs, None

    @staticmethod
    def draws(inner: InnerGraph, options: Any) -> bool:
        """Whether ``messages`` describe what the call computed: the recorded ``inner`` graph
        (its ``outputs`` from its ``inputs``) under ``options``. An extension whose call runs
        code it does not own (a model file's attention function) checks it here; a False
        answer runs the call plainly, through the generic rules. Default: True."""
        return True

    @classmethod
    def per_sample(cls, call: BackwardCall) -> list[State | None]:
        """Per-sample states ``[N, *input.shape]`` of the inputs ``call.needs`` asks for (the
        parameters): row n is ``messages`` of example n alone. The default runs ``messages``
        once per example (``example``); an extension may fuse it (``LinearFunction``)."""
        n = cls.batch_size(call)
        outs = [cls.messages(cls.example(call, i)) for i in range(n)]
        result: list[State | None] = []
        for j, (need, x) in enumerate(zip(call.needs, call.inputs, strict=True)):
            per = [o[j] for o in outs]
            if not need or x is None or all(p is None for p in per):
                result.append(None)
                continue
            sr = call.semiring
            per = [p if p is not None else sr.zeros(x.shape, x.dtype, x.device) for p in per]
            result.append(tuple(torch.stack(parts) for parts in zip(*per, strict=True)))
        return result

    @classmethod
    def batch_size(cls, call: BackwardCall) -> int:
        """The batch size: from the first output's incoming state that has a batch dim."""
        for state, dim in zip(call.incoming, cls.output_batch_dims, strict=False):
            if state is not None and dim is not None:
                if state[0].dim() <= dim:
                    break
                return state[0].shape[dim]
        raise unbatched(cls, "")

    @classmethod
    def example(cls, call: BackwardCall, i: int) -> BackwardCall:
        """``call`` restricted to example ``i`` (its batch dims kept, of size 1)."""
        inputs = [
            x.narrow(cls.input_batch_dim, i, 1) if j in cls.batched_inputs and x is not None else x
            for j, x in enumerate(call.inputs)
        ]
        incoming = tuple(
            None if st is None or dim is None else tuple(p.narrow(dim, i, 1) for p in st)
            for st, dim in zip(call.incoming, cls.output_batch_dims, strict=False)
        )
        return replace(
            call,
            inputs=inputs,
            incoming=incoming,
            options=cls.example_options(call.options, i),
            kept=cls.example_kept(call.kept, i),
        )

    @staticmethod
    def example_options(options: Any, i: int) -> Any:
        """``options`` for example ``i`` alone (default: the same)."""
        return options

    @staticmethod
    def example_kept(kept: Any, i: int) -> Any:
        """What ``keep`` set aside, for example ``i`` alone (default: the same)."""
        return kept

    @classmethod
    def run(
        cls, fn: Callable[..., Any], inputs: Sequence[Tensor | None], options: Any = None
    ) -> Any:
        """``fn(*inputs)`` through this Function, its node stamped with the sites' names.

        ``inputs`` are the call's differentiable tensors (None allowed); everything else ``fn``
        needs is closed over, and what the messages need besides goes in ``options``. A call
        that records no graph (grad mode off, no input requiring grad) is the plain call.
        """
        if (
            not wants_graph(*inputs)
            or torch._C._are_functorch_transforms_active()
            or _autocast_devices(inputs)
            or under_legacy_backward_hook()
        ):
            # Inside torch.func transforms (vmap, grad, ...) the inner graph's detached aliases
            # cannot be made; under autocast the messages would read the full-precision inputs
            # instead of the copies the call computes with; a legacy module backward hook runs
            # on the module's last node and must find PyTorch's own there. The plain call,
            # whose ops (the casts included) the generic rules carry.
            return cls.keep(fn(*inputs))[0]
        inner = InnerGraph(fn, inputs)
        if inner.escapes or inner.reuses_an_input:
            return cls.keep(inner.plain_outputs())[0]
        if inner.checkpointed is not None:  # before ``draws``, which may save tensors too
            inner.checkpointed.commit()
        if not cls.draws(inner, options):
            return cls.keep(inner.plain_outputs())[0]
        order = cls.edge_order or range(len(inputs))
        out = cls.apply(inner, options, *(inputs[i] for i in order))
        module = current_module()
        stamp(out, tuple(Site(module, name, dims) for name, dims in cls.sites(out)))
        return out

    @staticmethod
    def forward(ctx, inner: InnerGraph, options: Any, *inputs: Tensor | None) -> Any:
        ctx.set_materialize_grads(False)
        returned, ctx.kept = ctx._forward_cls.keep(inner.take_outputs())
        ctx.inner, ctx.options = inner, options
        # The node's state lives on ctx, which the engine does not free; a saved tensor it
        # does free after a backward without retain_graph, so a second one raises PyTorch's
        # own error, as the module's native ops would (it ran again: .grad came out doubled).
        # Not under saved-tensor hooks: a non-reentrant checkpoint counts the saved tensors
        # and its recomputation, which runs no extension, would save one fewer.
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            ctx.save_for_backward(_GRAPH_TOKEN)
        return returned

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        ctx.saved_tensors  # noqa: B018 - raises where the graph was freed, as PyTorch does
        inner: InnerGraph | None = getattr(ctx, "inner", None)
        if inner is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time: a semipack extension "
                "freed its saved state after the first semiring backward. Pass "
                "retain_graph=True to the first backward to keep it."
            )
        regular, incoming, semirings = zip(*map(split_message, grads), strict=True)
        sr = next((s for s in semirings if s is not None), None)
        release = sr is not None and not graph_retained()
        inner.retain = not release
        cls = ctx._forward_cls
        order = cls.edge_order or range(len(ctx.needs_input_grad) - 2)
        if sr is None:  # a plain backward
            if torch.is_grad_enabled():  # create_graph=True: the gradient is differentiated
                plain = inner.differentiable_grads(regular)
            else:
                plain = inner.regular_grads(regular)
            return (None, None, *(plain[i] for i in order))
        needs = _in_input_order(order, ctx.needs_input_grad[2:])
        inner.check_unmodified(cls.read_for(needs))
        values = inner.values()
        with _without_autocast(values):
            states = _messages_per_factor(
                cls, BackwardCall(sr, incoming, values, needs, ctx.options, ctx.kept)
            )
        rows = active_rows()
        if rows is not None and not rows.empty and not in_carry_pass():
            # the node has one edge per tensor argument (options too, if one): None has none
            edges = iter(ctx.next_functions[isinstance(ctx.options, Tensor) :])
            nodes = [None if values[i] is None else next(edges)[0] for i in order]
            params = [
                None if v is None else rows.wants(n)
                for v, n in zip(values, _in_input_order(order, nodes), strict=True)
            ]
            if any(p is not None for p in params):
                wanted = tuple(
                    p is not None and need for p, need in zip(params, needs, strict=True)
                )
                examples = ctx.metadata.get(MERGED_EXAMPLES_KEY)
                call = BackwardCall(sr, incoming, values, wanted, ctx.options, ctx.kept, examples)
                with _without_autocast(values):
                    per = _messages_per_factor(cls, call, per_sample=True)
                for p, state in zip(params, per, strict=True):
                    if p is not None and state is not None:
                        rows.add(p, state)
        with_regular = any(g is not None for g in regular)
        regular = inner.regular_grads(regular, direct=cls.direct_regular_grads)
        out = tuple(
            as_message(r, s, sr, v)
            if s is not None and need and v is not None and _reached(r, s, sr, with_regular, cls)
            else None
            for r, s, v, need in zip(regular, states, values, needs, strict=True)
        )
        if release:
            ctx.__dict__.clear()
        return (None, None, *(out[i] for i in order))


def _in_input_order(order: Sequence[int], per_edge: Sequence[Any]) -> tuple[Any, ...]:
    """Values given per edge (in ``edge_order``) put back in the order of ``run``'s inputs."""
    out: list[Any] = [None] * len(per_edge)
    for value, position in zip(per_edge, order, strict=True):
        out[position] = value
    return tuple(out)


@contextmanager
def _without_autocast(values: Sequence[Tensor | None]) -> Iterator[None]:
    """Autocast off for the messages' own math: a backward run inside an autocast region
    (PyTorch advises against it, AMP loops do it) would compute the semiring products in
    bfloat16 and hand back low-precision states (or fail, mixing them with float32 ones). The
    messages are computed from the call's forward values in the state dtype; the regular
    gradients, outside this block, run as a plain backward's would."""
    with ExitStack() as stack:
        for device in _autocast_devices(values):
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _autocast_devices(tensors: Sequence[Tensor | None]) -> set[str]:
    """The device types of ``tensors`` on which autocast is on. In a forward the call then runs
    in another precision (a float16 copy of an input entry of 1e-9 is exactly 0, no edge),
    which the extensions' messages, computed from the float32 inputs and weights, would not
    see (``run`` steps aside); in a backward it would compute the messages' products in low
    precision (``_without_autocast``)."""
    devices = {t.device.type for t in tensors if t is not None}
    return {device for device in devices if autocast_on(device)}


def _reached(
    regular: Tensor | None,
    state: State,
    sr: Semiring,
    with_regular: bool,
    cls: type[ExtensionFunction],
) -> bool:
    """Whether an input gets a message: in a pass with regular gradients, only an input that a
    plain backward reaches (it has a regular gradient). An input the call's inner graph does
    not connect to any output that got a gradient (the value projection when only the attention
    weights feed the loss) gets none, as in a plain backward: a message without its regular
    gradient would end in the parameter's ``.grad``, or drop the regular gradient it is added
    to. Such an input has no path either; a state with one means the messages and the inner
    graph disagree, which is raised rather than dropped."""
    if regular is not None or not with_regular:
        return True
    if isinstance(state, SparseRows):
        state = state.parts
    if not bool(sr.is_zero(state).all()):
        raise MessageLostError(
            f"{cls.__name__.removesuffix('Function')}: the semiring messages reach an input that "
            "the plain backward of the same call does not reach (a semipack bug: please report "
            "it with the model)"
        )
    return False


def _messages_per_factor(
    cls: type[ExtensionFunction], call: BackwardCall, per_sample: bool = False
) -> list[State | None]:
    """``cls.messages(call)`` (``cls.per_sample(call)`` with ``per_sample``); for a
    ``Product``, once per factor on its slices of the incoming states, joined again (each
    factor keeps its own fused kernels)."""
    compute = cls.per_sample if per_sample else cls.messages
    product = call.semiring
    if not isinstance(product, Product):
        return list(compute(call))
    per_factor = []
    for i, factor in enumerate(product.semirings):
        incoming = tuple(None if st is None else product.split(st)[i] for st in call.incoming)
        per_factor.append(list(compute(replace(call, semiring=factor, incoming=incoming))))
    return [_joined(product, states) for states in zip(*per_factor, strict=True)]


def _joined(product: Product, states: Sequence[State | SparseRows | None]) -> Any:
    """The factors' states of one input as one product state; sparse rows stay sparse when
    every factor kept the same rows (an embedding table's lookups)."""
    if states[0] is None:
        return None
    if all(isinstance(st, SparseRows) for st in states):
        first = states[0]
        if all(torch.equal(st.rows, first.rows) for st in states):
            return replace(first, parts=product.join([st.parts for st in states]))
    dense = [
        st.dense(factor) if isinstance(st, SparseRows) else st
        for st, factor in zip(states, product.semirings, strict=True)
    ]
    return product.join(dense)


def unbatched(cls: type[ExtensionFunction], shape: Any) -> PerSampleError:
    """The error for a call without a batch dim under ``per_sample=True``."""
    what = f" on an input of shape {tuple(shape)}" if shape else ""
    _, module = current_site()
    where = "" if module is None else f" (module '{module}')" if module else " (the root module)"
    return PerSampleError(
        f"per-sample values: {cls.__name__.removesuffix('Function')}{where} was called{what} "
        "without a batch dim; the batch must be dim 0 of its input (the first layer the "
        "backward reaches is named: give the model a batch, x[None] for one example)"
    )


def per_sample_rule(cls: type[ExtensionFunction]) -> type[ExtensionFunction]:
    """Class decorator: register the extension's node (``<Name>Backward``) in the per-sample
    table (``rules.per_sample``): it reports rows for the parameters it is given."""
    register_per_sample(f"{cls.__name__}Backward")
    return cls


def bilinear_reads(needs: Sequence[bool]) -> tuple[int, ...]:
    """``read_for`` of a call bilinear in inputs 0 and 1 (a linear layer, a convolution): each
    is read for the other's message only."""
    return tuple(i for i, other in ((0, 1), (1, 0)) if needs[other])


def split_message(grad: Tensor | None) -> tuple[Tensor | None, State | None, Semiring | None]:
    """(regular gradient, semiring state, semiring) of an incoming gradient or message."""
    if isinstance(grad, Message):
        return grad.regular_grad, grad.parts, grad.semiring
    return grad, None, None


def as_message(regular: Tensor | None, parts: State | None, sr: Semiring, like: Tensor) -> Message:
    """Wrap a computed state (and regular gradient) for the engine, shaped like ``like``."""
    return Message(regular, parts, sr, like.dtype)
