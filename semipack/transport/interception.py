"""Turning the user's own ``loss.backward()`` into a semiring backward inside ``extend``.

``Tensor.backward`` and ``torch.autograd.backward`` both consult torch-function modes, so a mode
active for the duration of the block can take over exactly those calls and pass every other call
straight through. Nothing global is patched, and the mode ends with the block. The same mode
wraps tensor hooks registered in the block (they see regular gradients, ``hooks.py``), records
``retain_grad()`` calls (their tensors get a ``semiring_grad`` too), and routes the functions
that have extensions to them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..errors import PerSampleError
from ..graph.batch_dims import call_name
from ..graph.saved_inputs import run_recording_inputs
from ..kernels.weight_cache import WEIGHTS
from ..rules.per_sample import INSIDE_CALL_KEY
from ..semirings.base import Semiring
from . import backward as bw
from . import per_sample
from .batch_following import BatchedTensors, share_batch_with_inner_nodes, share_layer_marks
from .hooks import TensorHook
from .passes import autocast_on


def name_inner_nodes(func, created: list, result) -> None:
    """Stamp the nodes a call made besides its results' own with the call's name
    (``INSIDE_CALL_KEY``): the block follows the call, not its inner ops, and an error about
    one of them names the call."""
    own = {id(t.grad_fn) for t in tree_leaves(result) if isinstance(t, Tensor)}
    name = call_name(func)
    for node in created:
        if id(node) not in own:
            node.metadata.setdefault(INSIDE_CALL_KEY, name)


def _autocast_of(args: tuple) -> str | None:
    """The device type of the first tensor argument when autocast is on there, else None."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    if first is None:
        return None
    device = first.device.type
    return device if autocast_on(device) else None


class SemiringMode(TorchFunctionMode):
    """Takes over backward calls, hook registrations and extended functions in the block."""

    def __init__(
        self,
        sr: Semiring,
        regular_grads: bool,
        parameters: Callable[[], tuple[list[Tensor], dict[int, str]]] = lambda: ([], {}),
        reroute: Mapping[Callable, Callable] | None = None,
        keep_state: bool = False,
        per_sample: bool = False,
        accumulate: bool = False,
    ) -> None:
        super().__init__()
        #: ``extend(..., accumulate=True)``: each pass's states are added (the semiring's
        #: plus) to those the block's earlier passes left; by tensor id, (the tensor, its
        #: added state, the readout stored on it)
        self.accumulate = accumulate
        self._accumulated: dict[int, tuple[Tensor, tuple, object]] = {}
        #: the model's parameters and their names as they are now, asked at each pass (a
        #: parameter unfrozen or replaced inside the block, fixed at its entry, was not
        #: watched: it kept a stale value, and got no per-sample rows)
        self.parameters = parameters
        self.per_sample = per_sample
        #: with ``per_sample``: the model's batched inputs and what the block computes from
        #: them (a per-sample row rule asks whether its other operand is one)
        self.batched = BatchedTensors()
        self.sr = sr
        self.regular_grads = regular_grads
        self.keep_state = keep_state
        self.reroute = dict(reroute or {})
        self.retained = bw.RetainedTensors()
        #: with ``per_sample``: the device type on which a call of the block's forward ran
        #: under autocast (its rows are refused, by name), None while none has
        self.autocast_seen: str | None = None
        #: every tensor a pass of the block gave values to (weakly: id -> reference), for
        #: those who clean up after the block (the monitor drops its passes' values)
        self.reached: dict[int, weakref.ref] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        if func is torch.autograd.backward:
            return self._autograd_backward(*args, **kwargs)
        if func is torch.Tensor.register_hook:
            return self._register_hook(*args, **kwargs)
        if func is torch.Tensor.retain_grad:
            result = func(*args, **kwargs)
            self.retained.add(args[0])
            return result
        if not self.per_sample:
            return self._call(func, args, kwargs)
        if self.autocast_seen is None:
            self.autocast_seen = _autocast_of(args)
        created: list[torch.autograd.graph.Node] = []
        with torch.autograd.graph.node_creation_hook(created.append):
            result = self._call(func, args, kwargs)
        name_inner_nodes(func, created, result)
        self.batched.follow(func, args, kwargs, result)
        share_batch_with_inner_nodes(func, created, result)
        share_layer_marks(created, result)
        return result

    def _call(self, func, args, kwargs):
        replacement = self.reroute.get(func)
        if replacement is not None:
            return replacement(*args, **kwargs)
        return run_recording_inputs(func, args, kwargs)  # exact derivatives of tanh, softmax...

    @staticmethod
    def _register_hook(tensor: Tensor, hook: Callable):
        return torch.Tensor.register_hook(tensor, TensorHook(hook))

    def _backward(self, tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        self._run([tensor], [gradient], retain_graph, create_graph, inputs)

    @contextmanager
    def _restored_on_failure(self) -> Iterator[None]:
        """``accumulate``: a pass that fails leaves every tensor the block's earlier passes
        reached with their values, as a failed pass leaves ``.grad`` as it was (it may have
        written or removed some readouts before it failed)."""
        try:
            yield
        except BaseException:
            for t, state, readout in self._accumulated.values():
                setattr(t, bw.SEMIRING_GRAD, readout)  # held here: no readout wrote into it
                if self.keep_state:
                    setattr(t, bw.SEMIRING_STATE, state)
            raise

    def _forget_removed_values(self) -> None:
        """``accumulate``: a tensor whose value was removed or replaced since the last pass
        (``del p.semiring_grad``, as ``zero_grad()`` empties ``.grad``) starts afresh; a
        block around several optimizer steps had no way to start again (trial 116)."""
        for key, (t, _, readout) in list(self._accumulated.items()):
            if getattr(t, bw.SEMIRING_GRAD, None) is not readout:
                del self._accumulated[key]

    def forget_accumulated(self) -> None:
        """The block ended: let go of the states ``accumulate`` kept (and their tensors)."""
        self._accumulated.clear()

    def _add_to_earlier_passes(self, reached: list[Tensor]) -> None:
        """``accumulate``: each tensor this pass reached gets the semiring's plus of its state
        and the state the block's earlier passes left on it (their paths together: the value
        of the passes' losses summed, as ``.grad`` accumulates), read out again; the state
        itself stays on the tensor only with ``keep_state``. The pass ran with its states kept
        (``semiring_state``), since a readout cannot always be added to (Entropy's)."""
        added = []  # everything computed before anything is stored: a failure stores nothing
        for t in reached:
            state = getattr(t, bw.SEMIRING_STATE, None)
            if state is None:
                continue
            earlier = self._accumulated.get(id(t))
            readout = getattr(t, bw.SEMIRING_GRAD)
            if earlier is not None and earlier[0] is t:
                state = bw.KeptState(self.sr.plus(tuple(earlier[1]), tuple(state)), type(self.sr))
                readout = self.sr.readout(tuple(state))
            added.append((t, state, readout))
        for t, state, readout in added:
            setattr(t, bw.SEMIRING_GRAD, readout)
            self._accumulated[id(t)] = (t, state, readout)
            if self.keep_state:
                setattr(t, bw.SEMIRING_STATE, state)
            else:
                delattr(t, bw.SEMIRING_STATE)

    def _autograd_backward(
        self,
        tensors,
        grad_tensors=None,
        retain_graph=None,
        create_graph=False,
        grad_variables=None,
        inputs=None,
    ):
        tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if grad_tensors is None:
            grad_tensors = grad_variables
        if grad_tensors is None:
            grad_tensors = [None] * len(tensors)
        elif isinstance(grad_tensors, Tensor):
            grad_tensors = [grad_tensors]
        self._run(tensors, list(grad_tensors), retain_graph, create_graph, inputs)

    def _run(self, tensors, grads, retain_graph, create_graph, inputs) -> None:
        if isinstance(inputs, Tensor):
            inputs = [inputs]
        elif inputs is not None:
            inputs = list(inputs)
        if self.per_sample and self.autocast_seen is not None:
            device, self.autocast_seen = self.autocast_seen, None
            raise PerSampleError(
                f"per-sample values do not run under torch.autocast ({device}): the forward's "
                "calls ran on low-precision copies made by casts, and the layers' extensions "
                "step aside under autocast, so no layer computes rows (the pass would refuse "
                "each parameter's cast). Run the forward of a per_sample=True block without "
                "autocast"
            )
        parameters, names = self.parameters()
        watched = [p for p in parameters if p.requires_grad]
        if self.per_sample:
            self.batched.mark_nodes()
        # the parameters' lifted forms may be kept for the next pass (kernels.weight_cache)
        if self.accumulate:
            self._forget_removed_values()
        with WEIGHTS.watching(watched), self._restored_on_failure():
            reached = bw.backward(
                tensors,
                grads,
                self.sr,
                regular_grads=self.regular_grads,
                retain_graph=retain_graph,
                create_graph=create_graph,
                inputs=inputs,
                leaf_names=names,
                watched=watched,
                retained=self.retained,
                keep_state=self.keep_state or self.accumulate,
                per_sample=(
                    {id(p): names.get(id(p), "?") for p in watched} if self.per_sample else None
                ),
                per_sample_batches=frozenset(self.batched.sizes),
                per_sample_following=self.batched,
            )
            if self.accumulate:
                self._add_to_earlier_passes(reached)
        for t in reached:
            self.reached.setdefault(id(t), weakref.ref(t))
        # A parameter this backward did not reach (frozen ones too) must not keep a stale value,
        # nor stale paths: a TopPath's ``path(p)`` read an earlier pass's (trial 114). With
        # ``accumulate`` one an earlier pass of the block reached keeps that pass's values.
        reached_ids = {id(t) for t in reached}
        for p in parameters:
            if id(p) in self._accumulated:
                continue
            if id(p) not in reached_ids:
                for name in (bw.SEMIRING_GRAD, bw.SEMIRING_STATE, bw.SEMIRING_PATHS):
                    if hasattr(p, name):
                        delattr(p, name)
            if id(p) not in reached_ids or not self.per_sample:
                per_sample.clear(p)
