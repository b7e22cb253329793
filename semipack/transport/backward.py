"""Running a semiring backward pass through the autograd engine.

The root gets a seed message (the incoming gradient, lifted to the semiring); autograd then
drives the messages through every backward formula. Leaf messages are captured on the way into
the leaves: the regular gradient continues into ``.grad`` exactly as in a plain backward, the
semiring readout is stored as ``.semiring_grad``.

A semiring backward either completes or changes no gradient: if it fails part-way (an op
without a rule, say), every ``.grad`` it touched is put back as it was, so a retry does not
count gradients twice; readouts it had already written into earlier ones are removed
(``LeafCaptures``).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

from ..errors import MessageLostError, PerSampleError, SemipackError
from ..kernels.reuse import same_memory, unheld_value
from ..messages.message import MODULE_HOOK_NODE, Message
from ..messages.paths import PathTrace, attach, records_steps
from ..semirings.base import Semiring, State, check_definition
from .batch_following import BatchedTensors
from .hooks import (
    ModuleHookNodes,
    hooks_need_regular_gradients,
    mark_pass_hook,
    tensor_hooks_see_gradients,
)
from .passes import (
    backward_started,
    carry_pass,
    in_carry_pass,
    own_kernels_compiled,
    semiring_pass,
)
from .per_sample import PerSampleRows, check_graph, check_semiring, collecting, hook_rules

SEMIRING_GRAD = "semiring_grad"
#: Where ``extend(..., keep_state=True)`` keeps a tensor's final semiring state (a tuple of
#: same-shaped component tensors), for consumers that must combine states rather than readouts
#: (``semipack.distributed``).
SEMIRING_STATE = "semiring_state"
#: Where a path-recording pass (TopPath, KBest) stores each tensor's paths.
SEMIRING_PATHS = "semiring_paths"

#: Autograd node of ``torch.utils.checkpoint(..., use_reentrant=True)``: it re-runs the forward
#: inside its backward and starts a nested backward through the recomputed graph.
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"
#: The node of a region ``torch.compile`` compiled (AOT autograd's Function).
COMPILED_NODE = "CompiledFunctionBackward"


def require_semiring(semiring: Any) -> Semiring:
    """The semiring instance, or a TypeError that says how to make one (or what its class
    lacks, ``check_definition``)."""
    if isinstance(semiring, Semiring):
        check_definition(semiring)
        return semiring
    if isinstance(semiring, type) and issubclass(semiring, Semiring):
        raise TypeError(
            f"expected a semiring instance, got the class {semiring.__name__}: "
            f"pass {semiring.__name__}() instead"
        )
    if isinstance(semiring, torch.nn.Module):  # its repr would print the whole model
        raise TypeError(
            "expected a semipack semiring (e.g. semipack.MaxProd()), got a module, "
            f"{type(semiring).__name__}: the model goes first, semipack.extend(model, semiring)"
        )
    shown = repr(semiring)
    if len(shown) > 200:
        shown = f"{shown[:200]}... (a {type(semiring).__name__})"
    raise TypeError(f"expected a semipack semiring (e.g. semipack.MaxProd()), got {shown}")


@dataclass
class GraphScan:
    """What a backward from ``roots`` will reach: leaves, and constructs needing special care
    (reentrant checkpoints, the nodes that run module backward hooks)."""

    leaves: list[Tensor] = field(default_factory=list)
    reentrant_checkpoint: bool = False
    module_hook_nodes: list[torch.autograd.graph.Node] = field(default_factory=list)
    #: nodes of code ``torch.compile`` compiled, recorded by a forward outside any block
    compiled_nodes: int = 0
    #: nodes of users' custom autograd Functions, whose Python backward may run a backward of
    #: its own (Reformer's reversible layers recompute their forward and call
    #: ``torch.autograd.backward``): parameters it reaches are not in the graph seen here
    custom_functions: int = 0

    @property
    def nested_backward(self) -> bool:
        """Whether a node may run a second engine run inside the pass (a reentrant
        checkpoint, a custom Function's backward): leaves the walk cannot see may then receive
        messages, and one leaf may receive several."""
        return self.reentrant_checkpoint or self.custom_functions > 0

    def refuse_compiled(self, where: str) -> None:
        """A compiled region's backward is generated code that takes plain tensors: messages
        cannot pass through it (PyTorch raised about a tensor subclass's metadata). Inside an
        ``extend`` block compiled code runs eagerly and records ordinary nodes."""
        if self.compiled_nodes:
            raise SemipackError(
                f"{where}: the graph holds {self.compiled_nodes} node(s) of torch.compile'd "
                "code (CompiledFunctionBackward), recorded by a forward run outside a "
                "semipack.extend block; their compiled backward cannot carry semiring messages. "
                "Run the forward inside the block: compiled code runs eagerly there, with the "
                "same values"
            )


def scan_graph(roots: Sequence[Tensor]) -> GraphScan:
    """Every leaf tensor with requires_grad reachable from ``roots`` through autograd edges."""
    scan = GraphScan()
    leaves: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    for t in roots:
        if t.grad_fn is None and t.requires_grad:
            leaves[id(t)] = t
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = node.name()
        if name == REENTRANT_CHECKPOINT:
            scan.reentrant_checkpoint = True
        elif name == MODULE_HOOK_NODE:
            scan.module_hook_nodes.append(node)
        elif name == COMPILED_NODE:
            scan.compiled_nodes += 1
        elif _user_function(node):
            scan.custom_functions += 1
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves[id(variable)] = variable
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    scan.leaves = list(leaves.values())
    return scan


def release_stale_locks() -> bool:
    """Release the pass-level locks (the readouts', the hook order's) that this thread holds
    where it runs no pass (the caller opens a block): a KeyboardInterrupt stopped its pass
    between the end of a ``with lock:`` body and the lock's release, and every later pass
    would wait on them forever (trial 59). True if one was released."""
    released = [lock.release_if_mine() for lock in (_READOUT_LOCK, _HOOK_ORDER_LOCK)]
    return any(released)


def _user_function(node: torch.autograd.graph.Node) -> bool:
    """Whether ``node`` runs the Python backward of a custom autograd Function that is not
    semipack's own (an extension's node, marked ``SEMIPACK_EXTENSION``)."""
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return False
    return not getattr(getattr(node, "_forward_cls", None), "SEMIPACK_EXTENSION", False)


def graph_leaves(roots: Sequence[Tensor]) -> list[Tensor]:
    """Every leaf tensor with requires_grad reachable from ``roots``."""
    return scan_graph(roots).leaves


def check_real_valued(tensors: Iterable[Tensor | None], where: str) -> None:
    """Complex graphs have no semiring drawing here: refuse them instead of dropping the
    imaginary part."""
    for t in tensors:
        if t is not None and t.is_complex():
            raise SemipackError(
                f"semipack does not support complex tensors ({where} is {t.dtype}): semiring "
                "values are defined on real local derivatives. Split real and imaginary parts "
                "into real tensors (torch.view_as_real) to analyse such a model."
            )


def seeds(
    outputs: Sequence[Tensor], grad_outputs: Sequence[Tensor | None], sr: Semiring, regular: bool
) -> list[Message]:
    """The root messages: each output's gradient (1 for a scalar when none is given) lifted
    as the weights of the edges from a virtual root."""
    check_real_valued(outputs, "a backward root")
    check_real_valued(grad_outputs, "a gradient given to backward")
    if len(grad_outputs) < len(outputs):  # PyTorch's check and words; more are ignored there
        raise RuntimeError(f"got {len(outputs)} tensors and {len(grad_outputs)} gradients")
    out = []
    for t, g in zip(outputs, grad_outputs[: len(outputs)], strict=True):
        if g is None:
            if t.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(t)
        out.append(Message.seed(g, sr, regular))
    return out


def _check(leaf_msg: Any, leaf: Tensor, sr: Semiring, roots: Sequence[Tensor] = ()) -> Message:
    """The message a leaf received. A plain tensor of exact zeros is "no path": PyTorch's
    backward returns a zero tensor it creates where every partial derivative is 0 (``prod``
    over two zeros, ``pow(x, 0)``), and an edge of weight 0 is no edge. Any other plain tensor
    raises: the paths it carries are unknown."""
    if isinstance(leaf_msg, Message):
        return leaf_msg
    if isinstance(leaf_msg, Tensor) and bool((leaf_msg == 0).all()):
        no_path = sr.zeros(leaf_msg.shape, leaf_msg.dtype, leaf_msg.device)
        return Message(leaf_msg, no_path, sr, leaf_msg.dtype)
    feeders = _nodes_feeding(leaf, roots)
    origin = f" from {', '.join(feeders)}: that" if feeders else ": a"
    raise MessageLostError(
        f"a plain gradient reached a leaf of shape {tuple(leaf.shape)}{origin} "
        "backward function returned a non-zero tensor it created (a custom "
        "autograd.Function's own tensor, say) instead of one computed from its incoming "
        "gradient, so semipack cannot tell which paths it carries"
    )


def _nodes_feeding(leaf: Tensor, roots: Sequence[Tensor]) -> list[str]:
    """Names of the autograd nodes of the graph below ``roots`` that hand ``leaf`` a gradient
    (walked only to name them in an error)."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen, names = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is leaf:
                names.append(node.name())
            stack.append(child)
    return sorted(set(names))


@contextmanager
def path_recording(
    sr: Semiring, roots: Sequence[Tensor], leaf_names: dict[int, str] | None
) -> Iterator[Semiring]:
    """The semiring this pass runs with: ``sr`` itself, or for path-recording semirings
    (TopPath) a copy bound to a fresh trace (``Semiring.bound_to``), with the recording
    pre-hooks attached for the pass. The user's instance is never modified.

    Nodes created while the pass runs (the recomputed forward of a reentrant checkpoint) get
    the recording pre-hook as they are created.
    """
    if not sr.records_paths:
        yield sr
        return
    trace = PathTrace(leaf_names)
    handles = attach(trace, roots)

    def on_creation(node) -> None:
        if records_steps(node):
            handles.append(node.register_prehook(trace.node_prehook(node)))

    try:
        with torch.autograd.graph.node_creation_hook(on_creation):
            yield sr.bound_to(trace)
    finally:
        for h in handles:
            h.remove()


class KeptState(tuple):
    """A leaf's state kept by ``keep_state=True``: the tuple of its components, and the class
    of the semiring whose pass made it (``semipack.distributed.all_reduce`` refuses to read it
    with another semiring: MaxProd's state read as LogSum's has as many components and would
    give a plausible, wrong value)."""

    def __new__(cls, parts, semiring_type: type) -> KeptState:
        kept = super().__new__(cls, parts)
        kept.semiring_type = semiring_type
        return kept

    def __reduce__(self):
        # a tuple subclass pickles as ``cls.__new__(cls, *())`` by default, which lacks both
        # arguments: a checkpoint of a model with kept states was written but could not be read
        return (KeptState, (tuple(self), self.semiring_type))

    def __deepcopy__(self, memo: dict) -> KeptState:
        return KeptState(copy.deepcopy(tuple(self), memo), self.semiring_type)


#: What a pass stores on one tensor: attribute name -> value, None to remove what an earlier
#: pass left there (``set_results``).
Results = dict[str, Any]


def read_results(
    t: Tensor,
    sr: Semiring,
    msg: Message,
    fallback_name: str,
    keep_state: bool,
    overwritten: list[Tensor],
) -> Results:
    """``t``'s results, set on nothing yet: ``semiring_grad`` (the readout), with
    ``keep_state`` ``semiring_state`` (the state itself) and, after a path-recording pass,
    ``semiring_paths``; a pass without them removes what an earlier pass left, so the three
    always describe the same pass. A sparse state's readout may be written into the memory of
    ``t``'s earlier one: ``t`` is then added to ``overwritten`` first (if a later readout of
    the pass fails, that value must not stay half new)."""
    sparse = msg.sparse  # kept as its reached rows: read without building the full state
    if sparse is None:
        value = sr.readout(msg.parts)
    else:
        earlier = unheld_value(t, SEMIRING_GRAD)
        if _any_tensor(earlier):
            overwritten.append(t)
        value = sr.readout_sparse(sparse, into=earlier)
    return {
        SEMIRING_GRAD: value,
        SEMIRING_STATE: KeptState(msg.parts, type(sr)) if keep_state else None,
        SEMIRING_PATHS: (
            sr.trace.capture_leaf(t, msg, fallback_name) if sr.trace is not None else None
        ),
    }


def set_results(t: Tensor, results: Results) -> None:
    """Set ``results`` on ``t`` (``read_results``); a None removes the attribute."""
    for name, value in results.items():
        if value is not None:
            setattr(t, name, value)
        elif hasattr(t, name):
            delattr(t, name)


#: The retained tensors of the pass running in this thread (``carry_down`` keeps their
#: ``.grad``: the engine's retain hooks also fire in its extra passes).
_PASS = threading.local()


class OwnedLock:
    """A lock (``with lock:``) that knows which thread holds it: one held by the thread that
    asks, outside any pass of that thread, was left by an interrupt between the end of a
    ``with`` body and the release (``release_if_mine``). Another thread's lock is never
    taken back: it may be held by a pass starting there (releasing it broke mutual exclusion,
    and that pass's own release then raised "release unlocked lock")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()  # first: an interrupt after it leaves no lock held
        self._owner = None

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return self._lock.locked()

    def release_if_mine(self) -> bool:
        """Release the lock if this thread holds it; True if it did."""
        if self._owner != threading.get_ident() or not self._lock.locked():
            return False
        self._owner = None
        self._lock.release()
        return True


#: Held while a readout picks the memory it is written into (``LeafCaptures.take``).
_READOUT_LOCK = OwnedLock()
#: Held while a pass puts its hook first on a leaf, or removes it (``_first_hook``).
_HOOK_ORDER_LOCK = OwnedLock()


class LeafCaptures:
    """What the pass's leaf hooks take from the messages that reach the leaves.

    A leaf's state is read out as soon as its message arrives (``read_early``) unless the pass
    needs the state itself at its end: ``keep_state``, a path trace, or a second engine run
    that may reach the leaf again (a reentrant checkpoint), whose states are added up. The
    readout goes into the memory of the leaf's earlier ``semiring_grad`` where nothing else
    holds it (``kernels.reuse``), as PyTorch accumulates into a gradient's buffer; the state
    is freed with its message. Held until the pass ended, each parameter's state stood beside
    its regular gradient: a BERT layer's MaxProd pass held 9 MB per feed-forward weight at the
    peak of its backward, Entropy's two components twice that.

    A pass that fails has overwritten those earlier readouts: ``discard`` removes them.
    """

    def __init__(self, read_early: bool) -> None:
        self.read_early = read_early
        self.states: dict[int, Message] = {}  # leaf id -> its state, kept for the pass's end
        self.readouts: dict[int, Any] = {}  # leaf id -> its readout, taken on arrival
        self._overwritten: list[Tensor] = []

    def __contains__(self, leaf_id: int) -> bool:
        return leaf_id in self.states or leaf_id in self.readouts

    def take(self, leaf: Tensor, msg: Message, sr: Semiring) -> None:
        """Record ``msg``'s state for ``leaf`` (plus-ed to an earlier one of this pass)."""
        if id(leaf) in self.readouts:  # read out already: its paths cannot be added to
            raise MessageLostError(
                f"a leaf of shape {tuple(leaf.shape)} received a second message in one pass "
                "after its first was read out (a semipack bug: please report it with the model)"
            )
        if self.read_early and msg.sparse is None and id(leaf) not in self.states:
            # One thread at a time decides whose memory to write into and records it: two
            # threads' passes on a shared parameter must not both take its earlier readout.
            with _READOUT_LOCK:
                earlier = unheld_value(leaf, SEMIRING_GRAD)
                may_write = _any_tensor(earlier)
                if may_write:  # counted as written before the readout writes: a readout
                    self._overwritten.append(leaf)  # failing halfway leaves it half new
                value = sr.readout_into(msg.parts, earlier)
                if may_write and not _written_into(value, earlier):
                    self._overwritten.pop()  # a new memory (ours is the last, under the lock)
                self.readouts[id(leaf)] = value
            return
        # Keep only the semiring state: the regular gradient goes to ``.grad`` (possibly as a
        # copy), and holding it here too would double the gradients' memory.
        state = Message(None, msg.stored_state(), msg.semiring, msg.dtype)
        earlier_state = self.states.get(id(leaf))
        if earlier_state is not None:  # a second engine run reached it (reentrant checkpoint)
            state = Message(None, sr.plus(earlier_state.parts, msg.parts), sr, msg.dtype)
        self.states[id(leaf)] = state

    def results(
        self, t: Tensor, sr: Semiring, fallback_name: str, keep_state: bool
    ) -> Results | None:
        """``t``'s results (``read_results``), or None when no message reached it."""
        if id(t) in self.readouts:  # read out on arrival: no state kept, no trace
            return {
                SEMIRING_GRAD: self.readouts[id(t)],
                SEMIRING_STATE: None,
                SEMIRING_PATHS: None,
            }
        msg = self.states.get(id(t))
        if msg is None:
            return None
        return read_results(t, sr, msg, fallback_name, keep_state, self._overwritten)

    def retained_results(
        self, t: Tensor, sr: Semiring, msg: Message, name: str, keep: bool
    ) -> Results:
        """``read_results`` of a retained non-leaf tensor's message."""
        return read_results(t, sr, msg, name, keep, self._overwritten)

    def discard(self) -> None:
        """The pass failed: the earlier readouts it wrote into are gone, not left half new."""
        for t in self._overwritten:
            if hasattr(t, SEMIRING_GRAD):
                delattr(t, SEMIRING_GRAD)


def _any_tensor(value: Any) -> bool:
    """Whether ``value`` (an earlier readout: a tensor, a tuple of them with None for those
    held elsewhere, or None) has memory a readout may write into."""
    if isinstance(value, tuple):
        return any(_any_tensor(v) for v in value)
    return isinstance(value, Tensor)


def _written_into(value: Any, earlier: Any) -> bool:
    """Whether a readout (a tensor, or a tuple of them) took memory of ``earlier``'s."""
    if isinstance(value, tuple) and isinstance(earlier, tuple):
        return any(_written_into(v, e) for v, e in zip(value, earlier, strict=False))
    return same_memory(value, earlier)


class RetainedTensors:
    """Non-leaf tensors whose ``retain_grad()`` was called inside ``extend``.

    The engine stores a retained tensor's incoming gradient in ``.grad``; after a semiring pass
    that is a Message. It is split like a leaf's: ``.grad`` gets the regular gradient (added to
    what was there, as PyTorch does) and ``.semiring_grad`` the readout.
    """

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Tensor]] = []

    def add(self, tensor: Tensor) -> None:
        """Remember ``tensor`` (weakly) if it is a non-leaf whose gradient the engine retains."""
        if tensor.grad_fn is not None:
            self._refs.append(weakref.ref(tensor))

    def alive(self) -> list[Tensor]:
        """The remembered tensors still alive."""
        self._refs = [r for r in self._refs if r() is not None]
        return [t for t in (r() for r in self._refs) if t is not None]


#: id of a leaf in a running pass -> (the pass's thread, how many of its passes hold it)
_CLAIMED: dict[int, tuple[int, int]] = {}
_CLAIM_LOCK = threading.Lock()


@contextmanager
def _claimed(leaves: Sequence[Tensor], names: dict[int, str] | None) -> Iterator[None]:
    """Hold ``leaves`` for this thread's pass; refuse leaves another thread's pass holds.

    A pass hooks its leaves and keeps their ``.grad`` (``GradLedger``): two threads' passes
    over one parameter (a module shared by two models) handed each other's messages around and
    could crash the process. Passes of one thread may nest (a carry pass inside a readout)."""
    me = threading.get_ident()
    with _CLAIM_LOCK:
        for leaf in leaves:
            holder = _CLAIMED.get(id(leaf))
            if holder is not None and holder[0] != me:
                name = (names or {}).get(id(leaf))
                what = f"'{name}'" if name else f"a tensor of shape {tuple(leaf.shape)}"
                raise SemipackError(
                    f"{what} is in a semiring backward running in another thread: two passes "
                    "at once cannot share a parameter (each hooks it and keeps its .grad). Run "
                    "them one after the other, or give each thread its own copy of the model"
                )
        for leaf in leaves:
            _, count = _CLAIMED.get(id(leaf), (me, 0))
            _CLAIMED[id(leaf)] = (me, count + 1)
    try:
        yield
    finally:
        with _CLAIM_LOCK:
            for leaf in leaves:
                _, count = _CLAIMED[id(leaf)]
                if count == 1:
                    del _CLAIMED[id(leaf)]
                else:
                    _CLAIMED[id(leaf)] = (me, count - 1)


class GradLedger:
    """``.grad`` of every tensor a pass may write, as it was before the pass.

    A leaf accumulates its regular gradient into its ``.grad`` in place, as a plain backward
    does, so whatever reads ``.grad`` during the backward sees PyTorch's values: its
    post-accumulate hooks, and a ``DistributedDataParallel`` reducer, which reads the
    accumulated ``.grad`` (local gradients accumulated under ``no_sync`` are averaged with the
    new ones) and may hold it as a view of its bucket. (A leaf's ``.grad`` used to be set
    aside during the pass and added back after it: a DDP model whose forward ran outside the
    block, a GAN's generator, then averaged the new part alone, and its processes diverged,
    trial 75.) For a failed pass a copy of each leaf's gradient is kept, and written back into
    it. A retained non-leaf's ``.grad`` starts the pass as None, so the engine writes a fresh
    tensor, and gets ``old + new`` when the pass succeeds (PyTorch's retain hook does the same:
    a ``.grad`` the user kept from an earlier backward keeps its values). When the pass fails,
    every ``.grad`` is put back.
    """

    def __init__(self, tensors: Iterable[Tensor]) -> None:
        #: (tensor, its .grad before, swapped out for the pass, copy of its values)
        self.before: list[tuple[Tensor, Tensor | None, bool, Tensor | None]] = []
        seen: set[int] = set()
        for t in tensors:
            if id(t) in seen:
                continue
            seen.add(id(t))
            old = t.grad if t.is_leaf or t.retains_grad else None
            swap = old is not None and not t.is_leaf
            values = old.detach().clone() if old is not None and t.is_leaf else None
            self.before.append((t, old, swap, values))
            if swap:
                t.grad = None

    def commit(self) -> None:
        """The pass succeeded: each swapped-out gradient (a retained non-leaf's) gets the new
        one added, into a new tensor, as PyTorch's retain hook does."""
        for t, old, swap, _ in self.before:
            if not swap:
                continue
            new = t.grad
            if isinstance(new, Message):
                continue  # split by the caller first
            t.grad = old if new is None else old + new

    def roll_back(self) -> None:
        """The pass failed: every ``.grad`` goes back to what it was before it (a leaf's
        tensor itself, with its values as they were). Never raises, so the pass's own error
        is the one the caller sees: a ``.grad`` that cannot be written in place (an expanded
        tensor, which PyTorch accepts as a gradient and then replaces instead of adding into)
        gets the saved values as a tensor of their own (trial 77: the copy failed, hid the
        pass's error and left the gradients after it unrestored)."""
        for t, old, swap, values in self.before:
            try:
                if values is not None and not torch.equal(old, values):
                    with torch.no_grad():
                        old.copy_(values)
                if values is not None or swap or old is None:
                    t.grad = old
            except RuntimeError:
                with contextlib.suppress(RuntimeError):
                    t.grad = values if values is not None else old


def backward(
    tensors: Sequence[Tensor],
    grad_tensors: Sequence[Tensor | None],
    sr: Semiring,
    *,
    regular_grads: bool,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Sequence[Tensor] | None = None,
    leaf_names: dict[int, str] | None = None,
    watched: Sequence[Tensor] = (),
    retained: RetainedTensors | None = None,
    keep_state: bool = False,
    per_sample: dict[int, str] | None = None,
    per_sample_batches: frozenset[int] = frozenset(),
    per_sample_following: BatchedTensors | None = None,
) -> list[Tensor]:
    """``torch.autograd.backward`` that also sets ``leaf.semiring_grad``; returns the leaves
    that received a message, then the retained tensors that did.

    ``per_sample`` (tensor id -> name, the model's parameters) also sets
    ``semiring_grad_batch`` on each of them the pass reaches (``transport.per_sample``); the
    graph is checked for ops without per-sample rules and for mixing before anything runs;
    ``per_sample_batches`` are the dim-0 sizes of the model's inputs, when known, and
    ``per_sample_following`` is the block's batch following (``batch_following``).

    ``watched`` are tensors (the model's parameters) whose messages are captured even when the
    graph walk cannot see them beforehand (a reentrant checkpoint recomputes its graph inside
    the backward). ``keep_state`` also stores each state as ``semiring_state``. Leaves
    accumulate their regular gradients in place, as in a plain backward (``GradLedger``).
    """
    if create_graph:
        raise NotImplementedError(
            "semipack does not support backward(create_graph=True) inside extend yet (no "
            "gradients of semiring values): a gradient penalty or double backprop can take "
            "torch.autograd.grad(..., create_graph=True) inside the block, an ordinary gradient"
        )
    _refuse_transforms(tensors, "A semiring backward")
    backward_started()  # a branch split's values become this backward's (none if unreached)
    if inputs is not None and len(inputs) == 0:
        raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    for i, t in enumerate(tensors):
        if not t.requires_grad:
            raise RuntimeError(
                f"element {i} of tensors does not require grad and does not have a grad_fn"
            )
    scan = scan_graph(tensors)
    scan.refuse_compiled("A semiring backward")
    # each tensor once: PyTorch accepts one listed twice in ``inputs``
    listed = list({id(t): t for t in inputs}.values()) if inputs is not None else scan.leaves
    # A non-leaf input with regular gradients: PyTorch retains its gradient for the call
    # (``retain_grad``), and the pass goes on through it to inputs below: it is read as a
    # retained tensor, whose message travels on (a leaf's hook hands the engine the regular
    # gradient, which then reached the inputs below as a plain one, trial 68). Without
    # regular gradients ``torch.autograd.grad`` returns its message like a leaf's.
    through = [t for t in listed if t.grad_fn is not None] if regular_grads else []
    leaves = [t for t in listed if all(t is not u for u in through)]
    if scan.reentrant_checkpoint and not regular_grads:
        raise SemipackError(
            "torch.utils.checkpoint(..., use_reentrant=True) runs its own backward, which "
            "needs regular gradients: use regular_grads=True or use_reentrant=False"
        )
    if scan.module_hook_nodes and not regular_grads:  # before any hook has run
        raise hooks_need_regular_gradients(
            scan.module_hook_nodes, "semipack.extend(..., regular_grads=False)"
        )
    if scan.nested_backward:  # even beside ``inputs``: an inner run accumulates into all
        known = {id(t) for t in leaves}
        leaves += [p for p in watched if id(p) not in known]
    rows = None
    if per_sample is not None:
        check_semiring(sr)
        if scan.reentrant_checkpoint:
            raise PerSampleError(
                "per-sample values cannot see inside a reentrant checkpoint (its graph is built "
                "during the backward): use torch.utils.checkpoint(..., use_reentrant=False)"
            )
        generic_uses, computed_inputs = check_graph(
            tensors, per_sample, per_sample_batches, per_sample_following
        )
        if per_sample_following is not None and not per_sample_batches:
            raise PerSampleError(
                "per-sample values: the extended model was not called in this block (its "
                "forward pre-hook marks the batch, which the block then follows call by call; "
                "unfollowed, a forward that mixes examples would give rows silently): call the "
                "model itself, model(x), not model.forward(x) or one of its submodules (extend "
                "that submodule instead)"
            )
        rows = PerSampleRows(sr, per_sample, computed_inputs, empty=per_sample_batches == {0})
    kept = retained.alive() if retained is not None else []
    for t in through:
        if all(t is not k for k in kept):
            kept.append(t)
            if retained is not None:  # retained for good (PyTorch's own retain_grad), so a
                retained.add(t)  # later pass of the block treats its .grad as retained
    with path_recording(sr, tensors, leaf_names) as sr, _claimed(leaves, leaf_names):
        ledger = GradLedger([*leaves, *kept]) if regular_grads else None
        kept_grads = [] if regular_grads else [(t, _grad_of(t)) for t in kept]  # else the ledger
        read_early = not (keep_state or sr.trace is not None or scan.nested_backward)
        captured = LeafCaptures(read_early)
        try:
            with ExitStack() as collect:
                collect.enter_context(tensor_hooks_see_gradients([*scan.leaves, *leaves]))
                if rows is not None:
                    collect.enter_context(collecting(rows))
                    for handle in hook_rules([] if rows.empty else generic_uses, rows):
                        collect.callback(handle.remove)
                outer, _PASS.retained = getattr(_PASS, "retained", ()), kept
                inner = InnerRuns(scan.nested_backward)
                collect.enter_context(inner.watching())
                try:
                    _run_backward(
                        tensors,
                        grad_tensors,
                        sr,
                        leaves,
                        regular_grads,
                        retain_graph,
                        inputs,
                        scan,
                        captured,
                    )
                except torch.utils.checkpoint.CheckpointError as exc:
                    if rows is None:
                        raise
                    raise PerSampleError(
                        "per-sample values: a row rule read a tensor that a node inside a "
                        "non-reentrant checkpoint saved, which its own backward may then not "
                        "read again (a factor of x * p where p is computed from a parameter, "
                        "the value F.rms_norm's gain multiplies, a constant divisor, batch "
                        "norm's input, an embedding bag's lookups): run that part of the model "
                        "outside the checkpoint; a parameter used directly by a layer, or as a "
                        f"leaf gain x * p, works inside ({exc})"
                    ) from exc
                finally:
                    _PASS.retained = outer
            # a retained tensor's .grad holds its message by design (``_split_retained``)
            reached = [t for t in [*leaves, *inner.leaves()] if all(t is not k for k in kept)]
            _refuse_stray_messages(reached, regular_grads)
            if rows is not None:
                batched = [t for t in leaves if id(t) in captured and id(t) in per_sample]
                sources = getattr(per_sample_following, "batch_sources", None)
                rows.check(batched, per_sample_batches, sources)
            retained_messages = _split_retained(kept, sr, kept_grads)
            # Every readout before anything is stored or committed: one can still fail.
            with own_kernels_compiled():  # the readouts (Entropy's is a fused kernel)
                results = _read_all(sr, captured, retained_messages, leaves, keep_state)
                if rows is not None:
                    results += rows.results(batched, keep_state)
        except BaseException:
            if ledger is not None:
                ledger.roll_back()
            else:  # no regular gradients: a retained tensor's .grad may hold the message
                for t, old in kept_grads:
                    t.grad = old
            captured.discard()
            raise
        for t, stored in results:
            set_results(t, stored)
        if ledger is not None:
            ledger.commit()
    reached = {id(t) for t, _ in results}
    out = {id(t): t for t in [*leaves, *through, *kept] if id(t) in reached}  # each once
    return list(out.values())


class InnerRuns:
    """The leaves that graphs built during a pass reach: a custom Function's backward that
    runs the forward again and an engine of its own (Reformer's reversible layers) reaches
    tensors the pass's walk of the graph could not see, and such a run stores its messages in
    their ``.grad``. Nodes are collected only where the graph holds such a Function."""

    def __init__(self, active: bool) -> None:
        self.active = active
        #: weak references: a leaf the inner run made itself (a Function's backward detaches
        #: its saved input and reads the message off its ``.grad``) is gone after the pass
        self.reached: dict[int, weakref.ref] = {}

    def _created(self, node: torch.autograd.graph.Node) -> None:
        for nxt, _ in node.next_functions:
            variable = getattr(nxt, "variable", None) if nxt is not None else None
            if variable is not None and id(variable) not in self.reached:
                self.reached[id(variable)] = weakref.ref(variable)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Collect, while the block runs, the leaves that new nodes have edges to."""
        if not self.active:
            yield
            return
        with torch.autograd.graph.node_creation_hook(self._created):
            yield

    def leaves(self) -> list[Tensor]:
        """The leaf tensors, still alive, that nodes created in the pass have edges to."""
        alive = [ref() for ref in self.reached.values()]
        self.reached.clear()
        return [t for t in alive if t is not None]


def _tensors(what: str, given: Any) -> list[Tensor]:
    """``semipack.grad``'s ``outputs`` or ``inputs`` as a list of tensors, refused as
    ``torch.autograd.grad`` refuses others (a module given as the inputs failed deep in the
    pass with an internal TypeError; trial 78)."""
    if isinstance(given, Tensor):
        return [given]
    if isinstance(given, torch.nn.Module):
        raise TypeError(
            f"semipack.grad: {what} must be tensors, got a {type(given).__name__} module "
            "(for its parameters pass list(module.parameters()))"
        )
    if isinstance(given, Mapping):  # a tokenizer's BatchEncoding: list() gives its keys
        raise TypeError(
            f"semipack.grad: {what} must be a tensor or a sequence of tensors, got a "
            f"{type(given).__name__}, a mapping (a tokenizer's output?): pass the tensors "
            "themselves; token ids are integers and have no gradient, so for tokens pass the "
            "embeddings the model reads (model(inputs_embeds=e) with e requiring grad)"
        )
    try:
        found = list(given)
    except TypeError:
        raise TypeError(
            f"semipack.grad: {what} must be a tensor or a sequence of tensors, got "
            f"{type(given).__name__}"
        ) from None
    wrong = [type(t).__name__ for t in found if not isinstance(t, Tensor)]
    if wrong:
        raise TypeError(f"semipack.grad: {what} must be tensors, got a {wrong[0]} among them")
    return found


def _refuse_stray_messages(leaves: Sequence[Tensor], regular_grads: bool) -> None:
    """Raise where a message ended in a ``.grad`` instead of a leaf hook (a backward run
    inside a custom Function's backward reaching a tensor no hook took it from), rather than
    leave a message where the optimizer reads. Such a ``.grad`` was None before (the engine
    would have added a message to a tensor in place, which fails): it is None again."""
    stray = list({id(t): t for t in leaves if isinstance(_grad_of(t), Message)}.values())
    if not stray:
        return
    for t in stray:
        t.grad = None
    shapes = ", ".join(str(tuple(t.shape)) for t in stray[:5])
    why = (
        "reaching tensors outside the model's parameters"
        if regular_grads
        else "under regular_grads=False, where no hook takes its messages: use regular_grads=True"
    )
    raise MessageLostError(
        f"{len(stray)} tensor(s) of shape {shapes} received a semiring message in .grad "
        f"instead of through the pass's leaf hooks (a backward run inside a custom autograd "
        f"Function's backward, {why})"
    )


def _read_all(
    sr: Semiring,
    captured: LeafCaptures,
    retained_messages: Sequence[tuple[Tensor, Message]],
    leaves: Sequence[Tensor],
    keep_state: bool,
) -> list[tuple[Tensor, Results]]:
    """The results of the retained tensors and of the leaves a message reached."""
    out = [
        (t, captured.retained_results(t, sr, msg, f"retained tensor {i}", keep_state))
        for i, (t, msg) in enumerate(retained_messages)
    ]
    for i, leaf in enumerate(leaves):
        results = captured.results(leaf, sr, f"leaf {i}", keep_state)
        if results is not None:
            out.append((leaf, results))
    return out


def _grad_of(t: Tensor) -> Tensor | None:
    """``t.grad`` without PyTorch's warning for a non-leaf that does not retain it (a
    non-leaf ``inputs=`` entry is retained by the engine only once the pass starts)."""
    return t.grad if t.is_leaf or t.retains_grad else None


def _split_retained(
    kept: Sequence[Tensor], sr: Semiring, kept_grads: Sequence[tuple[Tensor, Any]]
) -> list[tuple[Tensor, Message]]:
    """Turn Messages left in retained tensors' ``.grad`` into regular gradients; return the
    messages, whose results are stored once the pass is known to have succeeded. A plain
    tensor of exact zeros there is "no path", as at a leaf (``_check``: ``prod`` over two
    zeros returns one it made; the retained tensor got no ``semiring_grad``, trial 83); without
    regular gradients (``kept_grads``: each tensor's ``.grad`` before the pass) it is no
    regular gradient either, and ``.grad`` is what it was (trial 85)."""
    before = {id(t): old for t, old in kept_grads}
    out = []
    for t in kept:
        msg = t.grad
        if isinstance(msg, Message):
            t.grad = msg.regular_grad
            out.append((t, msg))
        elif isinstance(msg, Tensor) and bool((msg == 0).all()):
            no_path = sr.zeros(msg.shape, msg.dtype, msg.device)
            out.append((t, Message(msg, no_path, sr, msg.dtype)))
            if id(t) in before:
                t.grad = before[id(t)]
    return out


def _run_backward(
    tensors, grad_tensors, sr, leaves, regular_grads, retain_graph, inputs, scan, captured
) -> None:
    """Run the engine from ``tensors``; each leaf's message goes into ``captured``."""
    seed = seeds(tensors, grad_tensors, sr, regular_grads)
    if not regular_grads:
        with semiring_pass(retain_graph):
            got = torch.autograd.grad(
                list(tensors), leaves, seed, retain_graph=retain_graph, allow_unused=True
            )
        for leaf, msg in zip(leaves, got, strict=True):
            if msg is not None:
                captured.take(leaf, _check(msg, leaf, sr, tensors), sr)
        return

    owner = threading.get_ident()

    def capture(leaf: Tensor):
        def hook(grad):
            if in_carry_pass():  # a branch carried down by an explain readout, not this pass
                return None
            if grad is None:  # no gradient reaches the leaf (a Function returned None for it)
                return None
            if (
                not isinstance(grad, Message)
                and leaf.device.type == "cpu"
                and threading.get_ident() != owner
            ):
                # Another thread's plain backward reaching a parameter shared with this pass:
                # the engine runs a CPU leaf's hooks on the thread that called backward. (A
                # message on another thread is this pass's: the engine runs reentrant backwards
                # nested over 60 deep on its pool threads, and two threads' passes cannot share
                # a parameter, ``_claimed``. Leaves on an accelerator run on its device threads.)
                return None
            msg = _check(grad, leaf, sr, tensors)
            captured.take(leaf, msg, sr)
            return msg.regular_grad

        return mark_pass_hook(hook)

    with ExitStack() as stack:
        for leaf in leaves:
            if leaf.requires_grad:
                stack.enter_context(_first_hook(leaf, capture(leaf)))
        # Module backward hooks (BackPACK's among them) see regular gradients: on the nodes
        # there now, and on those a reentrant checkpoint creates while the pass runs.
        hook_nodes = ModuleHookNodes()
        stack.callback(hook_nodes.remove)
        for node in scan.module_hook_nodes:
            hook_nodes.watch(node)
        stack.enter_context(torch.autograd.graph.node_creation_hook(hook_nodes.watch))
        with semiring_pass(retain_graph):
            torch.autograd.backward(
                list(tensors),
                seed,
                retain_graph=retain_graph,
                inputs=list(inputs) if inputs is not None else None,
            )
    return captured


@contextmanager
def _first_hook(leaf: Tensor, hook) -> Iterator[None]:
    """Register ``hook`` on ``leaf`` ahead of the user's own hooks: they then see the regular
    gradient the hook returns, as in a plain backward."""
    with _HOOK_ORDER_LOCK:  # another thread's pass may reorder a shared parameter's hooks
        handle = leaf.register_hook(hook)
        # The engine walks the hook dict in its storage order, which ``move_to_end`` does not
        # change: re-insert the others after ours (same dict object, same keys, so their
        # handles still work).
        hooks = leaf._backward_hooks
        others = [(k, v) for k, v in hooks.items() if k != handle.id]
        for k, _ in others:
            del hooks[k]
        hooks.update(others)
    try:
        yield
    finally:
        with _HOOK_ORDER_LOCK:  # not between another pass's removal and re-insertion
            handle.remove()


def _refuse_transforms(tensors: Sequence[Tensor], what: str) -> None:
    """Raise ``SemipackError`` inside a torch.func transform or a forward-mode AD level: the
    transforms' wrapped tensors hide their storage from the rules ("Cannot access storage of
    TensorWrapper" from inside one), and a dual tensor's tangent meets ops no rule knows
    (an ``UnsupportedOpError`` naming an internal ``aten.to``, whose advice to register a
    rule was wrong)."""
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        raise SemipackError(
            f"{what} cannot run inside a torch.func transform (grad, vmap, jacrev, ...): the "
            "tensors there are torch.func's wrappers. Run it outside the transform, on "
            "tensors the transform does not wrap"
        )
    if forward_ad._current_level >= 0:
        raise SemipackError(
            f"{what} cannot run inside torch.autograd.forward_ad.dual_level(): forward-mode "
            "dual tensors carry tangents the semiring rules do not follow. Run it outside "
            "the dual level"
        )


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    sr: Semiring,
    grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    allow_unused: bool = False,
) -> tuple[Any, ...]:
    """Semiring values of ``inputs`` with respect to ``outputs``, like ``torch.autograd.grad``
    (public as ``semipack.grad``).

    Works on any differentiable function of tensors, no module needed. ``grad_outputs`` (default:
    1 for scalar outputs) are lifted into the semiring as the weights of edges from a virtual
    root. Returns one readout per input, shaped like it (``None`` for unused inputs with
    ``allow_unused=True``). No regular gradient is computed and nothing is stored on the inputs
    but, after a TopPath pass that returns, their ``semiring_paths`` (a call that raises leaves
    the earlier ones). A graph through modules with full
    backward hooks or backward pre-hooks (BackPACK-extended modules, say) raises
    ``SemipackError`` before anything runs: those hooks would get no gradient to see.
    """
    if isinstance(outputs, Semiring) or isinstance(inputs, Semiring):
        place = "first" if isinstance(outputs, Semiring) else "second"
        raise TypeError(
            f"semipack.grad got the semiring as its {place} argument: the order is "
            "semipack.grad(outputs, inputs, semiring), as torch.autograd.grad(outputs, inputs) "
            "with the semiring third"
        )
    sr = require_semiring(sr)
    outputs = _tensors("outputs", outputs)
    inputs = _tensors("inputs", inputs)
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    elif isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs]
    _refuse_transforms([*outputs, *inputs], "semipack.grad")
    scan = scan_graph(outputs)
    scan.refuse_compiled("semipack.grad")
    if scan.module_hook_nodes:  # the hooks would be handed messages (BackPACK would store them)
        raise hooks_need_regular_gradients(scan.module_hook_nodes, "semipack.grad")
    inner = InnerRuns(scan.nested_backward)
    # The engine's retain hooks fire in this pass too: a tensor retained inside the block would
    # take the message into its ``.grad`` (and add it to a gradient it held); this pass has no
    # regular gradient to give it, so its ``.grad`` stays as it was (trial 68)
    retained = [(t, t.grad) for t in _retained_in_open_blocks()]
    for t, _ in retained:
        t.grad = None
    with (
        _grads_put_back(retained),
        path_recording(sr, outputs, None) as sr,
        tensor_hooks_see_gradients([*scan.leaves, *inputs]),
        semiring_pass(retain_graph),
    ):
        seed = seeds(outputs, list(grad_outputs), sr, regular=False)
        with inner.watching():
            got = torch.autograd.grad(
                outputs, inputs, seed, retain_graph=retain_graph, allow_unused=True
            )
        _refuse_stray_messages(inner.leaves(), regular_grads=False)
        # captured while the trace is recording, set only once every readout succeeded
        paths = [
            (t, sr.trace.capture_leaf(t, msg, f"input {i}"))
            for i, (t, msg) in enumerate(zip(inputs, got, strict=True))
            if sr.trace is not None and isinstance(msg, Message)
        ]
    result = []
    for i, (t, msg) in enumerate(zip(inputs, got, strict=True)):
        if msg is None:
            if not allow_unused:
                raise RuntimeError(
                    f"The differentiated Tensor at index {i} appears to not have been used in "
                    "the graph. Set allow_unused=True if this is the desired behavior."
                )
            result.append(None)
            continue
        with own_kernels_compiled():  # inside an extend block too
            result.append(sr.readout(_check(msg, t, sr, outputs).parts))
    for t, recorded in paths:
        setattr(t, SEMIRING_PATHS, recorded)
    return tuple(result)


def _retained_in_open_blocks() -> list[Tensor]:
    """The tensors whose ``retain_grad()`` was called inside the ``extend`` blocks open in this
    thread (their modes hold ``RetainedTensors``; looked up on torch's mode stack, which the
    blocks' own module imports this one)."""
    found: list[Tensor] = []
    for mode in torch.overrides._get_current_function_mode_stack():
        retained = getattr(mode, "retained", None)
        if isinstance(retained, RetainedTensors):
            found += retained.alive()
    return found


@contextmanager
def _grads_put_back(kept: Sequence[tuple[Tensor, Any]]) -> Iterator[None]:
    """Put each tensor's ``.grad`` back to the value given on leaving."""
    try:
        yield
    finally:
        for t, old in kept:
            t.grad = old


def carry_down(
    tensor: Tensor, states: Sequence[State], semiring: Semiring, inputs: Sequence[Tensor]
) -> list[list[State | None]]:
    """For each state in ``states`` (each shaped like ``tensor``): the states at ``inputs`` of
    a semiring pass from ``tensor`` seeded with that state, as if only those paths existed above
    ``tensor``. Runs while the graph below ``tensor`` is alive (from a hook of a running pass, or
    on a retained graph) and keeps it (``retain_graph=True``); no regular gradient is computed.
    Returns, per state, one state per input, shaped like it (None where no path reaches it)."""
    out = []
    # A retained tensor below ``tensor`` would take these passes' messages into its ``.grad``
    # (the engine's retain hooks fire in every pass): its pass's value is put back after them.
    kept = [(t, t.grad) for t in getattr(_PASS, "retained", ())]
    with semiring_pass(retain_graph=True), carry_pass(), _grads_put_back(kept):
        for state in states:
            seed = Message(None, state, semiring, tensor.dtype)
            got = torch.autograd.grad(
                [tensor], list(inputs), [seed], retain_graph=True, allow_unused=True
            )
            out.append(
                [
                    None if m is None else _check(m, t, semiring, [tensor]).parts
                    for m, t in zip(got, inputs, strict=True)
                ]
            )
    return out
