"""Brute-force oracle for semiring backpropagation, written independently of semipack.

The oracle rebuilds the *scalar* computation graph behind a PyTorch output: one vertex per entry
of every tensor an autograd node produced (plus the leaf tensors), one edge per non-zero local
partial derivative. Local Jacobians are read off by calling each autograd node's backward with
one-hot gradients (a Python ``autograd.Function``'s own backward included), so the oracle trusts
nothing but PyTorch's own derivative formulas, with two
exceptions (``exact_local_derivatives``) where those formulas lose their digits even in
float64: the diagonal of softmax and log_softmax Jacobians (1 - p for p near 1) and GELU's
derivative below x = -6 (Phi(x) as (1 + erf(x / sqrt 2)) / 2).

On that graph every semiring is computed twice, in plain float64 NumPy:

* by dynamic programming over the DAG (``dynamic_programming``), and
* for tiny graphs, by listing every root-to-leaf path (``enumerate_paths``) and evaluating each
  quantity straight from its definition (``values_from_paths``).

The tests check the two against each other before trusting either against semipack.
Nothing here imports semipack.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

#: A group of scalar vertices: (position of the autograd node in topological order, output index).
SlotKey = tuple[int, int]

#: The semirings the oracle knows, by the names the tests use.
SEMIRING_NAMES: tuple[str, ...] = (
    "real",
    "max_prod",
    "signed_max_prod",
    "log_sum",
    "log_count",
    "boolean",
    "entropy",
)

#: A readout: one tensor, or (largest, smallest) for ``signed_max_prod``.
Readout = Tensor | tuple[Tensor, Tensor]


class PathLimitExceeded(RuntimeError):
    """Raised by ``enumerate_paths`` when a graph has more root-to-leaf paths than allowed."""


@dataclass
class JacobianBlock:
    """The edges one use of a tensor contributes: ``weights[k, i] = d out_k / d in_i``.

    ``out_slot`` is the op output (nearer the root), ``in_slot`` the op input (nearer the
    leaves). Two uses of the same tensor by one op give two blocks, i.e. parallel edges.
    """

    out_slot: SlotKey
    in_slot: SlotKey
    weights: np.ndarray


@dataclass
class ScalarGraph:
    """The scalar DAG behind a scalar output, grouped into slots and Jacobian blocks.

    ``blocks`` is ordered so that every block leaving a slot comes after every block entering
    it: a single forward sweep over ``blocks`` is a valid DP schedule from the root.
    """

    slot_shapes: dict[SlotKey, tuple[int, ...]]
    blocks: list[JacobianBlock]
    root_slot: SlotKey
    root_entry: int
    leaf_slots: dict[SlotKey, Tensor] = field(default_factory=dict)

    def slot_size(self, slot: SlotKey) -> int:
        return math.prod(self.slot_shapes[slot])

    def slot_of_leaf(self, leaf: Tensor) -> SlotKey | None:
        """The slot holding ``leaf``'s entries, or None when the output does not use it."""
        for slot, tensor in self.leaf_slots.items():
            if tensor is leaf:
                return slot
        return None


# --------------------------------------------------------------------------------------------
# Building the graph
# --------------------------------------------------------------------------------------------


def _is_leaf_node(node: object) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def topological_nodes(root: object) -> list[object]:
    """Autograd nodes reachable from ``root``, every node before all nodes it feeds into.

    "Feeds into" follows the backward direction: a node comes before its ``next_functions``.
    Iterative DFS post-order, reversed, so deep graphs cannot hit the recursion limit.
    """
    order: list[object] = []
    visited: set[int] = set()
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        for child, _ in node.next_functions:  # type: ignore[attr-defined]
            if child is not None and id(child) not in visited:
                stack.append((child, False))
    order.reverse()
    return order


def node_output_shapes(node: object) -> list[tuple[int, ...]]:
    """Shapes of the forward outputs of ``node``'s op (= the grads its backward takes)."""
    return [tuple(meta.shape) for meta in node._input_metadata]  # type: ignore[attr-defined]


def node_jacobians(node: object) -> list[list[np.ndarray | None]]:
    """Local Jacobians of one autograd node, read off its backward with one-hot gradients.

    Returns ``result[o][j]``: a ``(numel of output o, numel of input j)`` float64 matrix for
    every forward output ``o`` and every ``next_functions`` entry ``j`` (None where that input
    is not differentiable). A backward may hand back a gradient still in the broadcast shape
    (addmm's bias does); the engine sums such a gradient down to the input's shape, so we do too.
    """
    shapes = node_output_shapes(node)
    metas = node._input_metadata  # type: ignore[attr-defined]
    edges = node.next_functions  # type: ignore[attr-defined]
    in_shapes = [
        None if child is None else tuple(child._input_metadata[input_nr].shape)
        for child, input_nr in edges
    ]
    # a C++ node is called; a Python ``autograd.Function``'s node runs its backward via apply
    backward = node if callable(node) else node.apply  # type: ignore[attr-defined]
    result: list[list[np.ndarray | None]] = []
    for out_index, out_shape in enumerate(shapes):
        n_out = math.prod(out_shape)
        matrices: list[np.ndarray | None] = [
            None if in_shape is None else np.zeros((n_out, math.prod(in_shape)))
            for in_shape in in_shapes
        ]
        for k in range(n_out):
            grads = [
                torch.zeros(shape, dtype=meta.dtype, device=meta.device)
                for shape, meta in zip(shapes, metas, strict=True)
            ]
            grads[out_index].view(-1)[k] = 1
            with torch.no_grad():
                returned = backward(*grads)
            if isinstance(returned, Tensor) or returned is None:
                returned = (returned,)
            for j, in_shape in enumerate(in_shapes):
                grad = returned[j]
                if in_shape is None or grad is None:
                    continue  # not differentiable, or no dependence at all: the row stays 0
                if tuple(grad.shape) != in_shape:
                    grad = grad.sum_to_size(in_shape)
                matrices[j][k] = grad.detach().to(torch.float64).reshape(-1).cpu().numpy()  # type: ignore[index]
        result.append(matrices)
    return result


def exact_local_derivatives(node: object, matrices: list[np.ndarray | None]) -> None:
    """Replace, in place, the entries of a node's Jacobian that PyTorch's formulas compute with
    a cancellation by their exact values (semipack takes them exactly; the oracle must not be
    the rounded one):

    * softmax / log_softmax diagonals d y_j / d x_j = p_j (1 - p_j) and 1 - p_j, with 1 - p_j
      the sum of the *other* probabilities of the row. PyTorch subtracts p_j from 1, which in
      float64 loses every digit once 1 - p_j < 1e-16 (a logit gap of 37) and ~1e-16 / (1 - p_j)
      of them before. The off-diagonal entries (-p_i p_j, -p_j) are products and stay.
    * GELU (exact form): gelu'(x) = Phi(x) + x phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2;
      PyTorch's (1 + erf(x / sqrt 2)) / 2 is off by 1e-16 absolute, 1% of gelu'(-8.5).
    """
    if matrices[0] is None:
        return
    name = type(node).__name__
    if name == "GeluBackward0" and node._saved_approximate == "none":  # type: ignore[attr-defined]
        x = node._saved_self.detach().to(torch.float64).reshape(-1)  # type: ignore[attr-defined]
        phi = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        exact = 0.5 * torch.special.erfc(-x / math.sqrt(2.0)) + x * phi
        index = np.arange(x.numel())
        matrices[0][index, index] = exact.numpy()
        return
    if name not in ("SoftmaxBackward0", "LogSoftmaxBackward0"):
        return
    result = node._saved_result.detach().to(torch.float64)  # type: ignore[attr-defined]
    dim = node._saved_dim  # type: ignore[attr-defined]
    dim = (dim - (1 << 64) if dim >= 1 << 63 else dim) % max(result.dim(), 1)
    probs = (result.exp() if name == "LogSoftmaxBackward0" else result).movedim(dim, -1)
    n = probs.shape[-1]
    others = (probs[..., None, :] * (1.0 - torch.eye(n, dtype=torch.float64))).sum(-1)
    diagonal = others if name == "LogSoftmaxBackward0" else probs * others
    flat = diagonal.movedim(-1, dim).reshape(-1).numpy()
    index = np.arange(flat.size)
    matrices[0][index, index] = flat


def build_graph(output: Tensor) -> ScalarGraph:
    """The scalar DAG from the scalar ``output`` down to every leaf it depends on.

    Calling a backward node directly keeps its saved tensors, so the graph stays usable for a
    later ``backward`` / ``semipack.grad`` (with ``retain_graph=True`` there if called twice).
    """
    if output.numel() != 1:
        raise ValueError("the oracle's root must be a scalar")
    if output.grad_fn is None:
        raise ValueError("the output has no grad_fn: nothing to differentiate")
    nodes = topological_nodes(output.grad_fn)
    position = {id(node): i for i, node in enumerate(nodes)}
    slot_shapes: dict[SlotKey, tuple[int, ...]] = {}
    leaf_slots: dict[SlotKey, Tensor] = {}
    blocks: list[JacobianBlock] = []
    for i, node in enumerate(nodes):
        for out_index, shape in enumerate(node_output_shapes(node)):
            slot_shapes[(i, out_index)] = shape
        if _is_leaf_node(node):
            leaf_slots[(i, 0)] = node.variable  # type: ignore[attr-defined]
            continue
        jacobians = node_jacobians(node)
        exact_local_derivatives(node, jacobians[0])
        for out_index, per_input in enumerate(jacobians):
            for j, (child, input_nr) in enumerate(node.next_functions):  # type: ignore[attr-defined]
                matrix = per_input[j]
                if child is None or matrix is None:
                    continue
                blocks.append(
                    JacobianBlock((i, out_index), (position[id(child)], input_nr), matrix)
                )
    root_slot = (0, output.output_nr)
    return ScalarGraph(slot_shapes, blocks, root_slot, 0, leaf_slots)


# --------------------------------------------------------------------------------------------
# Dynamic programming, one small class per semiring
# --------------------------------------------------------------------------------------------

State = tuple[np.ndarray, ...]


class _OracleSemiring:
    """A semiring as vectorised steps: the empty state, the root's state, one push, a readout.

    ``push`` adds to ``into`` (the state of a block's input slot) the contribution of every
    path that reaches the block's output slot (state ``source``) and then takes one edge of
    ``weights``. Entries with weight exactly 0 are no edge at all.
    """

    def empty(self, n: int) -> State:
        raise NotImplementedError

    def root(self, n: int, entry: int) -> State:
        raise NotImplementedError

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        raise NotImplementedError

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        raise NotImplementedError


def _as_tensor(values: np.ndarray, shape: tuple[int, ...]) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape)


class _RealOracle(_OracleSemiring):
    """Signed sum of path products: the plain gradient."""

    def empty(self, n: int) -> State:
        return (np.zeros(n),)

    def root(self, n: int, entry: int) -> State:
        value = np.zeros(n)
        value[entry] = 1.0
        return (value,)

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        return (into[0] + weights.T @ source[0],)

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        return _as_tensor(state[0], shape)


class _MaxProdOracle(_OracleSemiring):
    """Largest |path product|; 0 stands for "no path" since real paths have products > 0."""

    def empty(self, n: int) -> State:
        return (np.zeros(n),)

    def root(self, n: int, entry: int) -> State:
        value = np.zeros(n)
        value[entry] = 1.0
        return (value,)

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        if weights.shape[0] == 0:
            return into
        candidates = source[0][:, None] * np.abs(weights)
        return (np.maximum(into[0], candidates.max(axis=0)),)

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        return _as_tensor(state[0], shape)


class _SignedMaxProdOracle(_OracleSemiring):
    """Largest and smallest signed path product, tracked as (hi, lo) with ±inf for "no path"."""

    def empty(self, n: int) -> State:
        return (np.full(n, -np.inf), np.full(n, np.inf))

    def root(self, n: int, entry: int) -> State:
        hi, lo = self.empty(n)
        hi[entry] = lo[entry] = 1.0
        return (hi, lo)

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        if weights.shape[0] == 0:
            return into
        hi, lo = source
        reached = np.isfinite(hi)
        edge = (weights != 0) & reached[:, None]
        safe_hi = np.where(reached, hi, 0.0)[:, None] * weights
        safe_lo = np.where(reached, lo, 0.0)[:, None] * weights
        # A negative weight swaps which end of [lo, hi] becomes the new maximum.
        best = np.where(edge, np.maximum(safe_hi, safe_lo), -np.inf).max(axis=0)
        worst = np.where(edge, np.minimum(safe_hi, safe_lo), np.inf).min(axis=0)
        return (np.maximum(into[0], best), np.minimum(into[1], worst))

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        hi, lo = state
        reached = np.isfinite(hi)
        return (
            _as_tensor(np.where(reached, hi, 0.0), shape),
            _as_tensor(np.where(reached, lo, 0.0), shape),
        )


class _LogSumOracle(_OracleSemiring):
    """Sum of |path products| kept linear (tiny graphs cannot overflow), read out as a log."""

    def empty(self, n: int) -> State:
        return (np.zeros(n),)

    def root(self, n: int, entry: int) -> State:
        value = np.zeros(n)
        value[entry] = 1.0
        return (value,)

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        return (into[0] + np.abs(weights).T @ source[0],)

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        with np.errstate(divide="ignore"):
            return _as_tensor(np.log(state[0]), shape)


class _LogCountOracle(_OracleSemiring):
    """Exact integer path counts (int64), read out as a log."""

    def empty(self, n: int) -> State:
        return (np.zeros(n, dtype=np.int64),)

    def root(self, n: int, entry: int) -> State:
        value = np.zeros(n, dtype=np.int64)
        value[entry] = 1
        return (value,)

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        return (into[0] + (weights != 0).astype(np.int64).T @ source[0],)

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        with np.errstate(divide="ignore"):
            return _as_tensor(np.log(state[0].astype(np.float64)), shape)

    def counts(self, state: State, shape: tuple[int, ...]) -> Tensor:
        """The exact counts themselves, for tests that compare integers."""
        return _as_tensor(state[0], shape)


class _BooleanOracle(_OracleSemiring):
    """Whether any path exists."""

    def empty(self, n: int) -> State:
        return (np.zeros(n, dtype=bool),)

    def root(self, n: int, entry: int) -> State:
        value = np.zeros(n, dtype=bool)
        value[entry] = True
        return (value,)

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        if weights.shape[0] == 0:
            return into
        return (into[0] | ((weights != 0) & source[0][:, None]).any(axis=0),)

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        return _as_tensor(state[0], shape)


class _EntropyOracle(_OracleSemiring):
    """Expectation semiring: Z = Σ w and Y = Σ w·(-log w) over paths, w = |path product|.

    Appending an edge of weight v to every path into a vertex maps (Z, Y) to
    (v·Z, v·Y + v·(-log v)·Z). The entropy of p = w / Z is then log Z + Y / Z.
    """

    def empty(self, n: int) -> State:
        return (np.zeros(n), np.zeros(n))

    def root(self, n: int, entry: int) -> State:
        z = np.zeros(n)
        z[entry] = 1.0
        return (z, np.zeros(n))

    def push(self, source: State, weights: np.ndarray, into: State) -> State:
        z, y = source
        magnitude = np.abs(weights)
        with np.errstate(divide="ignore", invalid="ignore"):
            surprisal = np.where(magnitude > 0, -magnitude * np.log(magnitude), 0.0)
        return (
            into[0] + magnitude.T @ z,
            into[1] + magnitude.T @ y + surprisal.T @ z,
        )

    def readout(self, state: State, shape: tuple[int, ...]) -> Readout:
        z, y = state
        with np.errstate(divide="ignore", invalid="ignore"):
            entropy = np.where(z > 0, np.log(z) + y / z, np.nan)
        return _as_tensor(entropy, shape)


_ORACLES: dict[str, Callable[[], _OracleSemiring]] = {
    "real": _RealOracle,
    "max_prod": _MaxProdOracle,
    "signed_max_prod": _SignedMaxProdOracle,
    "log_sum": _LogSumOracle,
    "log_count": _LogCountOracle,
    "boolean": _BooleanOracle,
    "entropy": _EntropyOracle,
}


def _propagate(graph: ScalarGraph, semiring: _OracleSemiring) -> dict[SlotKey, State]:
    """One sweep from the root over the blocks (already in a valid order)."""
    states: dict[SlotKey, State] = {
        slot: semiring.empty(graph.slot_size(slot)) for slot in graph.slot_shapes
    }
    states[graph.root_slot] = semiring.root(graph.slot_size(graph.root_slot), graph.root_entry)
    for block in graph.blocks:
        states[block.in_slot] = semiring.push(
            states[block.out_slot], block.weights, states[block.in_slot]
        )
    return states


def dynamic_programming(
    graph: ScalarGraph, leaves: Sequence[Tensor], semiring_name: str
) -> list[Readout]:
    """Readouts of ``semiring_name`` for each leaf (the "no path" value for unused leaves)."""
    semiring = _ORACLES[semiring_name]()
    states = _propagate(graph, semiring)
    readouts: list[Readout] = []
    for leaf in leaves:
        slot = graph.slot_of_leaf(leaf)
        shape = tuple(leaf.shape)
        state = states[slot] if slot is not None else semiring.empty(math.prod(shape))
        readouts.append(semiring.readout(state, shape))
    return readouts


def path_counts(graph: ScalarGraph, leaves: Sequence[Tensor]) -> list[Tensor]:
    """Exact number of root-to-leaf paths of each leaf entry (int64)."""
    semiring = _LogCountOracle()
    states = _propagate(graph, semiring)
    counts: list[Tensor] = []
    for leaf in leaves:
        slot = graph.slot_of_leaf(leaf)
        shape = tuple(leaf.shape)
        state = states[slot] if slot is not None else semiring.empty(math.prod(shape))
        counts.append(semiring.counts(state, shape))
    return counts


# --------------------------------------------------------------------------------------------
# Explicit path enumeration
# --------------------------------------------------------------------------------------------


def enumerate_paths(
    graph: ScalarGraph, max_paths: int = 20_000
) -> dict[SlotKey, list[list[float]]]:
    """Every root-to-leaf path's signed product, listed per leaf slot and leaf entry.

    A depth-first walk over single scalar edges, deliberately sharing no code with the DP.
    Raises ``PathLimitExceeded`` once more than ``max_paths`` paths have been found.
    """
    outgoing: dict[SlotKey, list[JacobianBlock]] = {}
    for block in graph.blocks:
        outgoing.setdefault(block.out_slot, []).append(block)
    found: dict[SlotKey, list[list[float]]] = {
        slot: [[] for _ in range(graph.slot_size(slot))] for slot in graph.leaf_slots
    }
    total = 0
    stack: list[tuple[SlotKey, int, float]] = [(graph.root_slot, graph.root_entry, 1.0)]
    while stack:
        slot, entry, product = stack.pop()
        if slot in found:
            found[slot][entry].append(product)
            total += 1
            if total > max_paths:
                raise PathLimitExceeded(f"more than {max_paths} paths")
            continue
        for block in outgoing.get(slot, []):
            row = block.weights[entry]
            for target_entry in np.flatnonzero(row):
                stack.append((block.in_slot, int(target_entry), product * float(row[target_entry])))
    return found


def _value_from_path_list(products: list[float], semiring_name: str) -> tuple[float, ...]:
    """One leaf entry's semiring value straight from the definition, given its path products."""
    magnitudes = [abs(p) for p in products]
    if semiring_name == "real":
        return (math.fsum(products),)
    if semiring_name == "max_prod":
        return (max(magnitudes, default=0.0),)
    if semiring_name == "signed_max_prod":
        return (max(products, default=0.0), min(products, default=0.0))
    if semiring_name == "log_sum":
        return (math.log(math.fsum(magnitudes)) if products else -math.inf,)
    if semiring_name == "log_count":
        return (math.log(len(products)) if products else -math.inf,)
    if semiring_name == "boolean":
        return (float(bool(products)),)
    if semiring_name == "entropy":
        if not products:
            return (math.nan,)
        total = math.fsum(magnitudes)
        return (-math.fsum(m / total * math.log(m / total) for m in magnitudes),)
    raise ValueError(f"unknown semiring {semiring_name!r}")


def values_from_paths(
    graph: ScalarGraph,
    paths: dict[SlotKey, list[list[float]]],
    leaves: Sequence[Tensor],
    semiring_name: str,
) -> list[Readout]:
    """Readouts computed from an explicit path list, shaped like the DP's readouts."""
    readouts: list[Readout] = []
    for leaf in leaves:
        slot = graph.slot_of_leaf(leaf)
        shape = tuple(leaf.shape)
        per_entry = paths[slot] if slot is not None else [[] for _ in range(math.prod(shape))]
        columns = list(
            zip(*(_value_from_path_list(p, semiring_name) for p in per_entry), strict=True)
        )
        tensors = [torch.tensor(column, dtype=torch.float64).reshape(shape) for column in columns]
        if semiring_name == "boolean":
            readouts.append(tensors[0].bool())
        elif semiring_name == "signed_max_prod":
            readouts.append((tensors[0], tensors[1]))
        else:
            readouts.append(tensors[0])
    return readouts
