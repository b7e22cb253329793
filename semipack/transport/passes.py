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

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..kernels.tropical import shared_pruning_choice

_lock = threading.Lock()
_running = {True: 0, False: 0}  # retain_graph -> number of semiring passes in flight


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
    try:
        with own_kernels_compiled(), shared_pruning_choice():
            yield
    finally:
        with _lock:
            _running[retain] -= 1


@contextmanager
def own_kernels_compiled() -> Iterator[None]:
    """torch.compile's default stance for the block: inside ``semipack.extend`` (which forces
    user code to run eagerly) semipack's own kernels must still run compiled, in a pass and in
    the readouts after it; under the forced stance a compiled kernel would run its fused source
    eagerly, which is slower than its eager form."""
    with torch.compiler.set_stance("default"):
        yield


def graph_retained() -> bool:
    """False only while every running semiring pass frees the graph as it goes."""
    with _lock:
        return _running[True] > 0 or _running[False] == 0


_carry_depth = [0]


@contextmanager
def carry_pass() -> Iterator[None]:
    """Mark the extra passes that carry one part of a message down the graph while the main
    pass is suspended (``backward.carry_down``): they are not the user's backward, so the main
    pass's leaf captures and the user's gradient hooks ignore them."""
    with _lock:
        _carry_depth[0] += 1
    try:
        yield
    finally:
        with _lock:
            _carry_depth[0] -= 1


def in_carry_pass() -> bool:
    """True while a ``carry_pass`` runs."""
    return _carry_depth[0] > 0
