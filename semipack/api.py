"""The public entry points: ``extend`` (a context manager) and ``grad`` (functional, the
backward driver's own ``transport.backward.grad``)."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .errors import PerSampleError, SemipackError
from .extensions import FUNCTION_EXTENSIONS, eager_attention_routed
from .graph.provenance import ModuleTracker
from .rules import FORWARD_ROUTES, drawing_routes
from .transport import backward as _bw
from .transport.backward import grad
from .transport.hooks import BlockPreHook, module_hooks_see_gradients
from .transport.interception import SemiringMode
from .transport.passes import collector_paused, forget_interrupted, user_code_eager
from .transport.per_sample import check_semiring

_blocks = threading.local()


def extend(
    model: nn.Module | None,
    semiring: Any,
    *,
    regular_grads: bool = True,
    extensions: bool = True,
    drawing: str = "atomic",
    keep_state: bool = False,
    per_sample: bool = False,
    accumulate: bool = False,
) -> AbstractContextManager[nn.Module | None]:
    """Run every ``backward()`` inside the block as a semiring backward.

    Each leaf tensor reached from the root (parameters and inputs with ``requires_grad``) gets
    ``.semiring_grad``: the semiring's readout of the message that arrived there, same shape as
    the leaf. ``.grad`` is filled exactly as by a plain backward unless ``regular_grads=False``,
    in which case ``.grad`` is left untouched and the regular gradient is not computed.

    The forward may run inside the block or before it; running it inside lets error messages
    and paths name the module an op came from, lets the extensions (fused kernels, named sites)
    take over supported calls, and lets ``retain_grad()`` and tensor hooks registered in the
    block work on intermediate tensors. ``extensions=False`` keeps every op on the generic
    per-op rules: same values, slower. The model objects are not modified; on exit nothing of
    semipack's is left but the results (``semiring_grad``, ``semiring_state``, paths).

    ``drawing`` chooses how composites are drawn (``rules.drawings``): ``"atomic"`` (softmax and
    log_softmax are one op each) or ``"decomposed"`` (softmax as ``exp(s - logsumexp(s))``,
    log_softmax as ``s - logsumexp(s)``, cross-entropy and attention built on them, as the
    paper's framework drew them). Only semirings other than Real see the difference.

    ``keep_state=True`` also keeps each leaf's final semiring state as ``.semiring_state`` (a
    tuple of tensors shaped like the leaf, one per ``semiring.components``), which
    ``semipack.distributed.all_reduce`` combines across processes: readouts alone cannot always
    be combined (Entropy's entropy has lost the path mass). It is off by default because it
    holds the state beside the readout, up to one more leaf-sized tensor per component.

    ``accumulate=True`` adds each backward's values to those of the block's earlier backwards
    (the semiring's plus of their states), as ``.grad`` accumulates: after micro-batches of a
    gradient accumulation, or a GAN's generator and discriminator losses, each tensor holds
    the value of the block's losses summed, and one an earlier backward reached but a later
    one did not keeps its value. By default each backward replaces the values (a parameter it
    does not reach loses them). Each pass then keeps its leaves' states until its end (as
    ``keep_state`` does: up to one more leaf-sized tensor per component), and the block keeps
    the sums until it ends; a tensor whose value is removed or replaced (``del
    p.semiring_grad``, as ``zero_grad()`` empties ``.grad``) starts afresh (a value changed in
    place has no defined effect on the sum: remove it instead). A backward that fails leaves every
    tensor the values of the earlier ones (also where the pass completed and only adding up
    its values failed: its ``.grad`` has then accumulated). Not with ``per_sample`` or a
    path-recording semiring (TopPath, KBest: a path is one pass's).

    ``DistributedDataParallel`` works unchanged: leaves accumulate their gradients in place, as
    in a plain backward, where its reducer reads and averages them, so ``.grad`` is what plain
    DDP gives, ``no_sync`` accumulation and bucket views included, whichever module (the
    wrapper, the model inside it, a part) is given and wherever its forward ran.

    ``per_sample=True`` also gives each parameter of ``model`` that a backward reaches
    ``.semiring_grad_batch``, shaped ``[N, *p.shape]`` (a pair of them where the readout is a
    named pair, ``Extremes`` or ``EntropyFlow``): row n is the semiring sum over the paths
    through example n's entries, the batch being dim 0 of the model input (README "Per-sample
    values"). The semiring sum over the rows is ``semiring_grad``; with ``keep_state`` the rows'
    states are kept as ``.semiring_state_batch``. Parameters must be used by the module
    extensions (Linear, Conv1d/2d, LayerNorm, Embedding, MultiheadAttention with
    ``batch_first=True``) or by a generic row rule (``x * p``, ``x + p``, ``x - p``, batch norm
    in eval mode; ``rules.per_sample``), and the model must not mix examples (batch norm in
    train mode, a reduction over the batch, ``x @ x.T``): anything else raises
    ``PerSampleError`` before the pass. The block follows the batch's dim through every call
    of the forward (``transport.batch_following``), so a layer whose input has the batch off
    dim 0, or a table whose rows are not examples, is refused by name too.

    Blocks do not nest (a second ``extend`` inside a first raises ``SemipackError``); one
    ``extend(...)`` object may be entered again after its block ended, like ``torch.no_grad()``.
    Anything compiled with ``torch.compile`` (the model, or a compiled wrapper of it) runs
    eagerly inside the block.
    """
    for name, flag in (
        ("regular_grads", regular_grads),
        ("extensions", extensions),
        ("keep_state", keep_state),
        ("per_sample", per_sample),
        ("accumulate", accumulate),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"semipack.extend: {name} must be True or False, got {flag!r}")
    if accumulate and per_sample:
        raise ValueError(
            "semipack.extend: accumulate=True and per_sample=True exclude each other (each "
            "backward's rows are its own batch's examples)"
        )
    return _Reusable(
        lambda: _block(
            model,
            semiring,
            regular_grads=regular_grads,
            extensions=extensions,
            drawing=drawing,
            keep_state=keep_state,
            per_sample=per_sample,
            accumulate=accumulate,
        )
    )


class _Reusable(AbstractContextManager):
    """A context manager made afresh by ``make`` at each entry, so that one ``extend(...)``
    object can be entered again once its block has ended (a generator-based one cannot), also
    from several threads at once (each thread closes its own block)."""

    def __init__(self, make: Callable[[], AbstractContextManager]) -> None:
        self._make = make
        self._local = threading.local()

    def __enter__(self) -> Any:
        block = self._make()
        value = block.__enter__()
        self._local.__dict__.setdefault("open", []).append(block)
        _blocks.generator = getattr(block, "gen", None)  # suspended while the block is open
        return value

    def __exit__(self, *exc: Any) -> bool | None:
        _blocks.generator = None
        return self._local.open.pop().__exit__(*exc)


@contextmanager
def _block(
    model: nn.Module | None,
    semiring: Any,
    *,
    regular_grads: bool,
    extensions: bool,
    drawing: str,
    keep_state: bool,
    per_sample: bool,
    accumulate: bool = False,
) -> Iterator[nn.Module | None]:
    """The block ``extend`` describes, entered once."""
    semiring = _bw.require_semiring(semiring)
    if accumulate and semiring.records_paths:
        raise ValueError(
            f"semipack.extend: accumulate=True with {type(semiring).__name__}: its paths are "
            "recorded per backward, and a path of one pass cannot be added to another's; run "
            "one backward per block (or MaxProd, whose values do add up)"
        )
    drawn = drawing_routes(drawing)
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"semipack.extend expects an nn.Module (or None for functional code), "
            f"got {type(model).__name__}"
        )
    active = _clear_interrupted()
    if active is not None:
        raise SemipackError(
            f"semipack.extend blocks cannot be nested: a block for {active!r} is already "
            "active in this thread. Leave it first; for several semirings in one backward use "
            "semipack.Product(...), or run one block per semiring (keep the graph with "
            "retain_graph=True, or run the forward again)."
        )
    if per_sample:
        _check_per_sample(model, semiring, extensions)
    with ExitStack() as stack:
        stack.enter_context(collector_paused())
        _blocks.semiring = semiring
        stack.callback(setattr, _blocks, "semiring", None)
        # Any torch.compile'd callable (the model, a compiled wrapper kept beside it, a compiled
        # loss) runs its original Python eagerly in the block, so its ops reach the semiring
        # rules; each semiring pass switches back to the default stance for semipack's own
        # compiled kernels (transport.passes.semiring_pass).
        stack.enter_context(user_code_eager())
        stack.enter_context(warnings.catch_warnings())
        # the module tracker's global hooks see the compiled wrapper's call and ignore it
        warnings.filterwarnings("ignore", "Using `torch.compile\\(module\\)` when there are global")
        stack.enter_context(ModuleTracker(model).active())
        stack.enter_context(
            module_hooks_see_gradients(model.modules() if model is not None else ())
        )
        reroute = dict(FORWARD_ROUTES)
        if extensions:
            if not drawn:  # attention extensions compute the atomic drawing's messages
                stack.enter_context(eager_attention_routed())
            reroute.update(FUNCTION_EXTENSIONS)
        reroute.update(drawn)
        mode = SemiringMode(
            semiring,
            regular_grads,
            _parameters_now(model),
            reroute,
            keep_state,
            per_sample=per_sample,
            accumulate=accumulate,
        )
        stack.callback(mode.forget_accumulated)
        if per_sample:
            recorder = BlockPreHook(_batch_recorder(mode))
            handle = model.register_forward_pre_hook(recorder, with_kwargs=True)
            stack.callback(handle.remove)
        stack.enter_context(mode)
        stack.callback(setattr, _blocks, "reached", mode.reached)
        yield model


def _check_per_sample(model: nn.Module | None, semiring: Any, extensions: bool) -> None:
    """Refuse per-sample requests that cannot be answered, before anything runs."""
    if model is None:
        raise PerSampleError("per_sample=True needs the model: its parameters get the rows")
    if not extensions:
        raise PerSampleError(
            "per_sample=True needs extensions=True: the module extensions compute the rows"
        )
    check_semiring(semiring)
    for name, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention) and not m.batch_first:
            raise PerSampleError(
                f"per-sample values: nn.MultiheadAttention '{_leaf_name(name)}' has "
                "batch_first=False, so the batch is not dim 0 of the model input; build it "
                "with batch_first=True"
            )


def _batch_recorder(mode: SemiringMode) -> Callable[..., None]:
    """A forward pre-hook for the model: its first tensor input with a dim (positional, else
    keyword, looking into lists, tuples, dicts and dataclasses) is the batch, and its dim-0
    size the one per-sample rows must have. Only that tensor counts as batched (``mode.batched``): a
    second argument of the same dim-0 size (position ids, a shared table of classes) gets a
    provisional mark, confirmed where it meets the batch on its dim
    (``transport.batch_following``)."""

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tensors = [t for t in _tensors_in((args, kwargs)) if t.dim() > 0]
        if tensors:
            mode.batched.add_inputs(tensors)

    return record


def _clear_interrupted() -> Any:
    """This thread's open block's semiring, or None; first, the leftovers of a block that a
    KeyboardInterrupt stopped inside semipack's own entry or exit code are cleared: its mode
    left on torch's stack (every later block then failed: the stale mode met the new block's
    messages), its semiring still marked as open ("cannot be nested" for good), its counts
    (the garbage collector paused, the compile stance forced). Said by a warning."""
    active = getattr(_blocks, "semiring", None)
    generator = getattr(_blocks, "generator", None)
    suspended = generator is not None and (
        inspect.getgeneratorstate(generator) == inspect.GEN_SUSPENDED
    )
    if active is not None and suspended:
        return active  # a block really is open in this thread (its body is running)
    stack = torch.overrides._get_current_function_mode_stack()
    healed = active is not None
    _blocks.semiring = None
    if any(isinstance(m, SemiringMode) for m in stack):
        modes = [torch._C._pop_torch_function_stack() for _ in range(len(stack))][::-1]
        for mode in modes:
            if not isinstance(mode, SemiringMode):
                torch._C._push_on_torch_function_stack(mode)
        healed = True
    healed = forget_interrupted() or healed
    healed = _bw.release_stale_locks() or healed
    if healed:
        warnings.warn(
            "semipack: an earlier extend block of this thread was interrupted inside "
            "semipack's own entry or exit (a KeyboardInterrupt, say); what it left behind "
            "was cleared. A .grad it was writing may be partly updated: check or recompute it",
            RuntimeWarning,
            stacklevel=5,  # the user's `with` (through _Reusable and contextlib's __enter__)
        )
    return None


def open_block_semiring() -> Any:
    """The semiring of the ``extend`` block open in this thread, or None (leftovers of an
    interrupted block are cleared first, as entering a block does)."""
    return _clear_interrupted()


def last_block_reached() -> list[torch.Tensor]:
    """The tensors (still alive) that the passes of this thread's last ``extend`` block gave
    values to: the monitor drops them after recording, also on tensors outside its model
    (a GAN generator's loss runs through the discriminator)."""
    refs = getattr(_blocks, "reached", {})
    return [t for t in (ref() for ref in refs.values()) if t is not None]


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, in order: pytree containers (lists, tuples, dicts, named
    tuples) and dataclass instances, looked into at any depth. A dataclass is no pytree node, so
    a tensor in one (a batch of masks passed as a config-like object) was not seen as an
    argument: mixing its examples went unnoticed (rows without a per-example meaning)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()  # a dataclass that holds itself is looked into once

    def walk(item: Any) -> None:
        for leaf in tree_leaves(item):
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif (
                dataclasses.is_dataclass(leaf)
                and not isinstance(leaf, type)
                and id(leaf) not in seen
            ):
                seen.add(id(leaf))
                walk([getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)])

    walk(value)
    return found


def _parameters_now(
    model: nn.Module | None,
) -> Callable[[], tuple[list[torch.Tensor], dict[int, str]]]:
    """The model's parameters and their names, as a pass sees them (asked at each pass)."""

    def now() -> tuple[list[torch.Tensor], dict[int, str]]:
        named = list(model.named_parameters()) if model is not None else []
        return [p for _, p in named], {id(p): _leaf_name(n) for n, p in named}

    return now


def _leaf_name(name: str) -> str:
    return name.removeprefix("_orig_mod.")


__all__ = ["extend", "grad"]
