"""Which semiring backward passes are running, and whether any of them keeps the graph.

A plain backward frees each node's saved tensors as soon as the node has run (unless
``retain_graph``). Module extensions keep their inner graph on the autograd context, which the
engine does not free before the whole graph is gone; they free it themselves once the running
passes have said they will not come back (``graph_retained()`` is False).

The passes are counted in module-level state rather than a thread-local: on CUDA the engine runs
backward functions on its device threads, not on the thread that called ``backward``. When in
doubt (no pass known, or any pass retaining) the graph is kept: a wrong guess can only cost
memory, never a value.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from ..kernels.tropical import shared_pruning_choice

_lock = threading.Lock()
_running = {True: 0, False: 0}  # retain_graph -> number of semiring passes in flight

#: What each thread's open contexts added to the counts here (thread id -> kind -> count): a
#: KeyboardInterrupt that lands between a context's entry and the registration of its exit
#: leaves its count behind, which ``forget_interrupted`` takes back (the collector would
#: otherwise stay paused, the stance forced, the graph kept, for the rest of the process).
_mine: dict[int, dict[str, int]] = {}


def _note(kind: str, change: int) -> None:
    """Record this thread's share of a count (called with the count's lock held)."""
    mine = _mine.setdefault(threading.get_ident(), {})
    mine[kind] = mine.get(kind, 0) + change


@contextmanager
def semiring_pass(retain_graph: bool | None) -> Iterator[None]:
    """Mark a semiring backward pass as running for the duration of the block.

    The pass runs in torch.compile's default stance: ``semipack.extend`` forces user code
    compiled with ``torch.compile`` to run eagerly (so its ops reach the rules), but semipack's
    own kernels (``kernels.compiled``) stay compiled. One switch per pass: ``set_stance`` costs
    about a millisecond, far too much per kernel call.

    Max-plus products of the same operand shapes within the pass share one choice of pruned or
    dense kernel (``shared_pruning_choice``): a transformer's layers repeat their shapes, and
    each estimate read a whole weight (0.2 ms for a MiniLM feed-forward product of one sentence,
    a quarter of the product). The choice decides speed only, never a value.
    """
    retain = bool(retain_graph)
    with _lock:
        _running[retain] += 1
        _note(f"running {retain}", 1)
    try:
        with own_kernels_compiled(), shared_pruning_choice(), collector_paused():
            yield
    finally:
        with _lock:
            _running[retain] -= 1
            _note(f"running {retain}", -1)


_collector = {"passes": 0, "was_enabled": False}


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while ``extend`` blocks and semiring passes
    run.

    A block's forward and backward hold thousands of small Python objects (the recorded
    calls, messages, rule records) alive until the pass ends. Every collection of the young
    generations meanwhile moved them on to the oldest one, where they died soon after; once
    enough had moved, Python ran a full collection, which walks every object of the process
    (half a million after importing transformers): a pause of 0.2-0.6 s about every 75 passes
    of a MiniLM sentence, and a young collection every 20 ms. Paused, they die young, freed by
    their reference counts; the few cycles a pass leaves (under ten objects) go in the first
    young collection after the block. Counted over threads (the collector is the process's);
    the last one out restores the collector's state as the first one in found it (a user's
    ``gc.disable()`` stays)."""
    with _lock:
        if _collector["passes"] == 0:
            _collector["was_enabled"] = gc.isenabled()
            gc.disable()
        _collector["passes"] += 1
        _note("collector", 1)
    try:
        yield
    finally:
        with _lock:
            _collector["passes"] -= 1
            _note("collector", -1)
            if _collector["passes"] == 0 and _collector["was_enabled"]:
                gc.enable()


# torch.compile's stance is process-wide, while blocks and passes run per thread: one place
# counts both and sets the stance they need (nested ``set_stance`` contexts of two threads
# restored each other's stances out of order: a compiled model ran compiled inside a block).
_stance_lock = threading.Lock()
_stance_counts = {"blocks": 0, "passes": 0}
_user_stance: list[Any] = []  # the stance before the first block or pass, restored after


def _set_stance() -> None:
    """The stance the open blocks and running passes need (called with ``_stance_lock``)."""
    blocks, passes = _stance_counts["blocks"], _stance_counts["passes"]
    if not blocks and not passes:
        if _user_stance:
            before = _user_stance.pop()
            torch.compiler.set_stance(
                before.stance,
                skip_guard_eval_unsafe=before.skip_guard_eval_unsafe,
                force_backend=before.backend,
            )
        return
    current = torch._dynamo.eval_frame._stance
    if not _user_stance:
        _user_stance.append(current)
    wanted = "default" if passes else "force_eager"
    # set_stance costs about 0.1 ms: a pass and its nested readouts would set the same stance
    # again and again (several times per backward, a tenth of a small model's monitor step)
    if (current.stance, current.skip_guard_eval_unsafe, current.backend) != (wanted, False, None):
        torch.compiler.set_stance(wanted)


@contextmanager
def _counted(kind: str) -> Iterator[None]:
    with _stance_lock:
        _stance_counts[kind] += 1
        _note(f"stance {kind}", 1)
        _set_stance()
    try:
        yield
    finally:
        with _stance_lock:
            _stance_counts[kind] -= 1
            _note(f"stance {kind}", -1)
            _set_stance()


def forget_interrupted() -> bool:
    """Take back what this thread's contexts left counted (call it where the thread has no
    block open and no pass running: an interrupted block's leftovers); True if there was any.
    The collector, the compile stance and the graph-keeping flag then follow the other
    threads' open contexts alone."""
    mine = _mine.pop(threading.get_ident(), {})
    if not any(mine.values()):
        return False
    with _lock:
        for retain in (True, False):
            _running[retain] -= mine.get(f"running {retain}", 0)
        _collector["passes"] -= mine.get("collector", 0)
        if _collector["passes"] == 0 and _collector["was_enabled"]:
            gc.enable()
    with _stance_lock:
        for kind in ("blocks", "passes"):
            _stance_counts[kind] -= mine.get(f"stance {kind}", 0)
        _set_stance()
    return True


def user_code_eager() -> AbstractContextManager[None]:
    """torch.compile's ``force_eager`` stance while an ``extend`` block is open (in any thread):
    compiled user code then runs its ops one by one, so that they reach the rules; running
    passes (``own_kernels_compiled``) take precedence."""
    return _counted("blocks")


def own_kernels_compiled() -> AbstractContextManager[None]:
    """torch.compile's default stance while a pass (or its readouts) runs in any thread: inside
    ``semipack.extend`` (which forces user code to run eagerly) semipack's own kernels must
    still run compiled; under the forced stance a compiled kernel would run its fused source
    eagerly, which is slower than its eager form."""
    return _counted("passes")


def graph_retained() -> bool:
    """False only while every running semiring pass frees the graph as it goes."""
    with _lock:
        return _running[True] > 0 or _running[False] == 0


#: thread ident -> open carry passes started on that thread
_carry_threads: dict[int, int] = {}


@contextmanager
def carry_pass() -> Iterator[None]:
    """Mark the extra passes that carry one part of a message down the graph while the main
    pass is suspended (``backward.carry_down``): they are not the user's backward, so the main
    pass's leaf captures and the user's gradient hooks ignore them. Marked per thread: another
    thread's backward running meanwhile is a user's backward (read as a carry pass, its leaves
    kept semiring messages in ``.grad``)."""
    ident = threading.get_ident()
    with _lock:
        _carry_threads[ident] = _carry_threads.get(ident, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _carry_threads[ident] -= 1
            if not _carry_threads[ident]:
                del _carry_threads[ident]


#: Objects told when a backward of this thread starts (``watch_backwards``): branch splits,
#: whose values are the last backward's, even one that does not reach them.
_backward_watchers: dict[int, weakref.WeakSet] = {}


def watch_backwards(watcher: Any) -> None:
    """Call ``watcher.backward_started()`` at the start of each later semiring backward of
    this thread (``semipack.extend``'s, not ``semipack.grad``'s or a carry pass), while the
    watcher lives."""
    _backward_watchers.setdefault(threading.get_ident(), weakref.WeakSet()).add(watcher)


def backward_started() -> None:
    """Tell this thread's watchers that a semiring backward starts."""
    for watcher in list(_backward_watchers.get(threading.get_ident(), ())):
        watcher.backward_started()


def in_carry_pass() -> bool:
    """True while a ``carry_pass`` runs on this thread. A carry pass runs on the thread that
    starts it (a reentrant backward stays on its thread); the hooks of a pass started on a
    device's engine thread (CUDA) run there too, but those threads cannot be told from the
    ones running another thread's pass, so on them any open carry pass counts."""
    if threading.get_ident() in _carry_threads:
        return True
    return bool(_carry_threads) and isinstance(threading.current_thread(), threading._DummyThread)


def autocast_on(device: str) -> bool:
    """``torch.is_autocast_enabled(device)``, False for a device type autocast does not know
    (the meta device: PyTorch raises "unknown device type for autocast" there)."""
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:
        return False
