"""KBest: the k best path products and the paths themselves, against explicit path enumeration.

The enumerator below lists every root-to-leaf path of the oracle's scalar graph
(``oracle.build_graph``) with its product and the nodes it passes (autograd node name and entry),
so each path KBest returns can be checked to be a real path of the graph, with the product it
claims, distinct from the others, and the k values to be the k largest products.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from cases_extensions import CASES, weighted_loss
from oracle import ScalarGraph, build_graph, topological_nodes
from torch import nn

import semipack

KS = [1, 2, 3, 5]
REL = 1e-9

#: One node of a path: (autograd node name without its Backward suffix, entry index).
Node = tuple[str, tuple[int, ...]]


def _op_name(node: object) -> str:
    name = node.name()  # type: ignore[attr-defined]
    return name.removesuffix("Backward0").removesuffix("Backward1").removesuffix("Backward")


def enumerate_named_paths(
    output: torch.Tensor, graph: ScalarGraph, max_paths: int = 50_000
) -> dict[int, list[list[tuple[float, tuple[Node, ...]]]]]:
    """Per leaf (by ``id``) and flat leaf entry: every root-to-leaf path as (|product|, nodes),
    the nodes listed leaf side first and the leaf itself left out (as ``Path.steps``)."""
    names = [_op_name(n) for n in topological_nodes(output.grad_fn)]
    outgoing: dict = {}
    for block in graph.blocks:
        outgoing.setdefault(block.out_slot, []).append(block)
    found = {slot: [[] for _ in range(graph.slot_size(slot))] for slot in graph.leaf_slots}
    count = 0
    stack = [(graph.root_slot, graph.root_entry, 1.0, ())]
    while stack:
        slot, entry, product, nodes = stack.pop()
        if slot in found:
            found[slot][entry].append((abs(product), nodes))
            count += 1
            assert count <= max_paths, "graph too large to enumerate"
            continue
        shape = graph.slot_shapes[slot]
        index = (
            tuple(int(i) for i in torch.unravel_index(torch.tensor(entry), shape)) if shape else ()
        )
        here = ((names[slot[0]], index), *nodes)
        for block in outgoing.get(slot, []):
            row = block.weights[entry]
            for target in row.nonzero()[0]:
                stack.append((block.in_slot, int(target), product * float(row[target]), here))
    return {id(t): found[slot] for slot, t in graph.leaf_slots.items()}


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()


def _steps(path) -> tuple[Node, ...]:
    return tuple((s.op, tuple(s.index)) for s in path.steps)


def check_against_enumeration(
    output: torch.Tensor,
    leaves: list[torch.Tensor],
    k: int,
    rel: float = REL,
) -> None:
    """KBest(k) through ``semipack.grad``: per leaf entry, the k values are the k largest path
    products; each returned path is a path of the graph with that product; no two are equal
    (``distinct``: the graph has no parallel edges); where the k-th best value is not tied, the
    returned paths are exactly the k best."""
    graph = build_graph(output)
    listed = enumerate_named_paths(output, graph)
    kb = semipack.KBest(k)
    values = semipack.grad(output, leaves, kb, retain_graph=True)
    for leaf, value in zip(leaves, values, strict=True):
        assert value.shape == (*leaf.shape, k)
        per_entry = listed.get(id(leaf), [[] for _ in range(leaf.numel())])
        for flat, paths in enumerate(per_entry):
            index = _unravel(flat, tuple(leaf.shape))
            products = sorted((p for p, _ in paths), reverse=True)
            want = (products + [0.0] * k)[:k]
            got = value[index].tolist()
            assert got == pytest.approx(want, rel=rel, abs=0), (index, got, want)
            returned = kb.paths(leaf, index)
            assert len(returned) == min(k, len(paths))
            by_nodes: dict[tuple[Node, ...], list[float]] = {}
            for nodes_product, nodes in paths:
                by_nodes.setdefault(nodes, []).append(nodes_product)
            for rank, path in enumerate(returned):
                assert path.rank == rank and path.index == index
                assert path.value == pytest.approx(got[rank], rel=rel)
                assert path.steps[-1].log_value == pytest.approx(0.0, abs=1e-12)  # the root
                candidates = by_nodes.get(_steps(path))
                assert candidates is not None, f"{index} rank {rank}: not a path of the graph"
                assert any(c == pytest.approx(path.value, rel=rel) for c in candidates)
            assert len({_steps(p) for p in returned}) == len(returned)
            untied = len(products) <= k or products[k - 1] > products[k] * (1 + 1e-6)
            if untied:
                best = {nodes for p, nodes in paths if p >= products[min(k, len(products)) - 1]}
                assert {_steps(p) for p in returned} == best


def _leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def _mlp(act):
    x, w1, b1, w2 = _leaf(2, 3, seed=1), _leaf(4, 3, seed=2), _leaf(4, seed=3), _leaf(2, 4, seed=4)
    return (act(x @ w1.T + b1) @ w2.T).pow(2).sum(), [x, w1, b1, w2]


def _relu_with_zeros():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, -1.0]], dtype=torch.float64).requires_grad_()
    w = torch.tensor(
        [[1.0, 0.0, -1.0], [2.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64
    ).requires_grad_()
    h = torch.relu(x @ w)  # exact zeros: pre-activations <= 0, and zero weights
    v = _leaf(3, seed=5)
    return (h * v).sum(), [x, w, v]


def _residual():
    x, w = _leaf(2, 3, seed=1), _leaf(3, 3, seed=2)
    y = x + torch.tanh(x @ w)
    return (y * _leaf(2, 3, seed=3).detach()).sum(), [x, w]


def _softmax():
    x, w = _leaf(2, 4, seed=1), _leaf(4, 4, seed=2)
    p = torch.softmax(x @ w, -1)
    return (p * torch.arange(4.0, dtype=torch.float64)).sum(), [x, w]


def _sums_and_broadcasts():
    x, b = _leaf(3, 4, seed=1), _leaf(4, seed=2)
    rows = (x * b).sum(1, keepdim=True)  # [3, 1], broadcast back below
    y = (x - rows * 0.5).abs().mean(0) + x.amax(0) * 0.25
    return (y * _leaf(4, seed=3).detach()).sum(), [x, b]


def _ties():
    """Equal inputs and weights: every path to an entry of x has the same product."""
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    w = torch.full((3, 4), 0.25, dtype=torch.float64)
    h = torch.tanh(x @ w)  # equal pre-activations: equal derivatives everywhere
    return (h @ torch.ones(4, 2, dtype=torch.float64)).sum(), [x]


CASES_ENUM = {
    "mlp_linear": lambda: _mlp(lambda t: t),
    "mlp_tanh": lambda: _mlp(torch.tanh),
    "mlp_relu": lambda: _mlp(torch.relu),
    "relu_exact_zeros": _relu_with_zeros,
    "residual": _residual,
    "softmax": _softmax,
    "sums_broadcasts": _sums_and_broadcasts,
}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("case", list(CASES_ENUM))
def test_k_best_paths_match_enumeration(case: str, k: int) -> None:
    output, leaves = CASES_ENUM[case]()
    check_against_enumeration(output, leaves, k)


@pytest.mark.parametrize("k", KS)
def test_ties_give_distinct_paths_of_equal_value(k: int) -> None:
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    w = torch.full((3, 4), 0.5, dtype=torch.float64)
    out = (x @ w * 3.0) @ torch.ones(4, 2, dtype=torch.float64)
    check_against_enumeration(out.sum(), [x], k)
    # 8 paths of product 1.5 to each x entry: all k values tie and the k paths differ
    kb = semipack.KBest(k)
    (value,) = semipack.grad((x @ w * 3.0 @ torch.ones(4, 2, dtype=torch.float64)).sum(), x, kb)
    torch.testing.assert_close(value, torch.full((3, k), 1.5, dtype=torch.float64))
    assert len({_steps(p) for p in kb.paths(x, 1)}) == k


def test_values_with_ties_in_a_nonlinear_graph() -> None:
    output, leaves = _ties()
    check_against_enumeration(output, leaves, 5)


@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM, nn.RNN])
def test_recurrent_layers_match_enumeration(cell) -> None:
    torch.manual_seed(0)
    rnn = cell(2, 2, batch_first=True).double()
    x = _leaf(1, 3, 2, seed=1)
    out = (rnn(x)[0] * _leaf(1, 3, 2, seed=2).detach()).sum()
    check_against_enumeration(out, [x, *rnn.parameters()], 3)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_fused_lstm_layer_gives_the_k_best_of_its_cells() -> None:
    """A float32 LSTM runs as one fused oneDNN layer, whose rule records every step's states
    as nodes of its own: the same k best values as the separate cell ops, each path with its
    value. (The oracle cannot enumerate paths inside the fused node. Its gates are no nodes
    of the path readout, so two paths through different gates between the same states read
    alike there; through the separate cell ops every path reads differently.)"""
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        lstm = nn.LSTM(2, 3, batch_first=True)
        x = _leaf(2, 3, 2, seed=1).detach().float().requires_grad_()
        with torch.backends.mkldnn.flags(enabled=enabled):
            out = (lstm(x)[0] * _leaf(2, 3, 3, seed=2).detach().float()).sum()
        nodes = {_op_name(n) for n in topological_nodes(out.grad_fn)}
        assert ("MkldnnRnnLayer" in nodes) is (enabled and torch.backends.mkldnn.is_available())
        kb = semipack.KBest(4)
        leaves = [x, *lstm.parameters()]
        values = semipack.grad(out, leaves, kb)
        for leaf, value in zip(leaves, values, strict=True):
            for index in _indices(leaf):
                paths = kb.paths(leaf, index)
                assert [p.value for p in paths] == pytest.approx(value[index].tolist(), rel=1e-6)
                if not enabled:
                    assert len({_steps(p) for p in paths}) == len(paths)
        results.append(values)
    for fused, native in zip(*results, strict=True):
        torch.testing.assert_close(fused, native, rtol=1e-5, atol=1e-7)


def test_hand_computed_two_best_paths() -> None:
    """loss = 3·a + 0.5·(2·a)·b with a = x[0]: x[0] has paths of products 4 and 3."""
    x = torch.tensor([1.0, 4.0], dtype=torch.float64, requires_grad=True)
    kb = semipack.KBest(3)
    (value,) = semipack.grad(3 * x[0] + 0.5 * ((2 * x[0]) * x[1]), x, kb)
    torch.testing.assert_close(
        value, torch.tensor([[4.0, 3.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    )
    best, second = kb.paths(x, 0)
    assert [s.op for s in best.steps] == ["Select", "Mul", "Mul", "Mul", "Add"]
    assert [s.op for s in second.steps] == ["Select", "Mul", "Add"]
    assert (best.value, second.value) == pytest.approx((4.0, 3.0))
    assert str(second).startswith("path 2 from input 0[0]: value 3")
    assert len(kb.paths(x, 1)) == 1
    (log_value,) = semipack.grad(
        3 * x[0] + 0.5 * ((2 * x[0]) * x[1]), x, semipack.KBest(3, log=True)
    )
    assert log_value[0, 2] == -math.inf and log_value[0, 1] == pytest.approx(math.log(3.0))


def test_first_path_is_top_path_and_k1_is_max_prod() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    leaves = [*model.parameters(), x]

    def loss():
        return F.cross_entropy(model(x), torch.tensor([0, 2]))

    tp, kb = semipack.TopPath(), semipack.KBest(3)
    top = semipack.grad(loss(), leaves, tp)
    top_paths = {id(t): [tp.path(t, i) for i in _indices(t)] for t in leaves}
    mp = semipack.grad(loss(), leaves, semipack.MaxProd())
    k1 = semipack.grad(loss(), leaves, semipack.KBest(1))
    values = semipack.grad(loss(), leaves, kb)
    for t, want, one, got, best in zip(leaves, mp, k1, values, top, strict=True):
        torch.testing.assert_close(one[..., 0], want, rtol=1e-12, atol=0)
        torch.testing.assert_close(got[..., 0], best, rtol=1e-12, atol=0)
        assert bool((got[..., :-1] >= got[..., 1:]).all())
        for i, tpath in zip(_indices(t), top_paths[id(t)], strict=True):
            paths = kb.paths(t, i)
            want = [v for v in got[i].tolist() if v > 0]  # fewer paths than k: no more
            assert [p.value for p in paths] == pytest.approx(want, rel=1e-12)
            assert [(s.op, s.index) for s in paths[0].steps] == [
                (s.op, s.index) for s in tpath.steps
            ]


def _indices(t: torch.Tensor) -> list[tuple[int, ...]]:
    return list(itertools.product(*map(range, t.shape)))


def test_paths_need_a_k_best_pass() -> None:
    kb = semipack.KBest(2)
    with pytest.raises(KeyError, match="holds no paths"):
        kb.paths(torch.zeros(1))
    with pytest.raises(ValueError, match="positive integer"):
        semipack.KBest(0)
    assert repr(kb) == "KBest(k=2, log=False)" and kb.trace is None


@pytest.mark.parametrize("extensions", [True, False], ids=["extension", "generic"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extensions_give_the_generic_k_best(case, extensions) -> None:
    """Through every module extension and without: KBest(1) is MaxProd, KBest(3) agrees with
    the generic per-op path, its paths carry its values, and the first is TopPath's."""
    if case.name.startswith("bert"):
        pytest.importorskip("transformers")
    results = {}
    for name, sr, ext in (
        ("max_prod", semipack.MaxProd(), extensions),
        ("top", semipack.TopPath(), extensions),
        ("k1", semipack.KBest(1), extensions),
        ("k3", semipack.KBest(3), extensions),
        ("k3_generic", semipack.KBest(3), False),
    ):
        model = case.build()
        inputs = case.inputs()
        with semipack.extend(model, sr, extensions=ext):
            weighted_loss(model, inputs).backward()
        leaves = [(n, p) for n, p in model.named_parameters() if hasattr(p, "semiring_grad")]
        leaves += [(f"input{i}", t) for i, t in enumerate(t for t in inputs if t.requires_grad)]
        results[name] = {n: (t.semiring_grad, _first_paths(sr, t)) for n, t in leaves}
    for leaf, (want, _) in results["max_prod"].items():
        torch.testing.assert_close(results["k1"][leaf][0][..., 0], want, rtol=1e-9, atol=1e-12)
        k3, paths = results["k3"][leaf]
        torch.testing.assert_close(k3[..., 0], want, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(k3, results["k3_generic"][leaf][0], rtol=1e-9, atol=1e-12)
        top = results["top"][leaf][1]
        index = top.index
        assert [p.value for p in paths] == pytest.approx(
            [v for v in k3[index].tolist() if v > 0], rel=1e-9
        )
        assert paths[0].modules() == top.modules(), leaf


def _first_paths(sr, t):
    if isinstance(sr, semipack.TopPath):
        return sr.path(t)
    if isinstance(sr, semipack.KBest):
        return sr.paths(t)
    return None


@pytest.mark.parametrize("block", [1, 7, 50, 1 << 23])
def test_matmul_blocks_give_the_unblocked_product(block, monkeypatch) -> None:
    """Any block size gives the same values and successors as the broadcast definition (every
    candidate at once through ``times`` and ``sum``)."""
    from semipack.semirings import k_best
    from semipack.semirings.base import blocked_matmul

    kb = semipack.KBest(3)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    w[w.abs() < 0.3] = 0.0
    a = kb.plus(*(kb.lift(torch.randn(2, 6, 5, generator=g, dtype=torch.float64)) for _ in "ab"))
    a = a[:3] + tuple(torch.randint(0, 100, a[0].shape, generator=g) for _ in range(3))
    want = blocked_matmul(kb, a, w)
    monkeypatch.setattr(k_best, "BLOCK_ELEMENTS", block)
    got = kb.matmul(a, w)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_many_candidates_rank_as_a_stable_sort(k: int) -> None:
    """The k best of many candidates (a matmul's inner size times k) come from k first-
    occurrence maxima, not a sort: the values, and the successors of every slot holding a path,
    are those of the stable descending sort (ties: the first candidate first); a slot without a
    path has no successor."""
    gen = torch.Generator().manual_seed(k)
    values = torch.randint(0, 4, (6, 50), generator=gen).double()  # many ties
    values[0, 3:] = float("-inf")  # fewer finite candidates than k in some rows
    values[1] = float("-inf")
    values[3, 1:] = float("-inf")  # one path only
    values[2, 7] = 9.0
    ids = torch.randint(0, 1000, (6, 50), generator=gen)
    kb = semipack.KBest(k)
    got = kb._best(values, ids)
    best, order = torch.sort(values, dim=-1, descending=True, stable=True)
    want_ids = torch.where(best[:, :k] == float("-inf"), -1, ids.gather(-1, order[:, :k]))
    assert torch.equal(torch.stack(got[:k], -1), best[:, :k])
    assert torch.equal(torch.stack(got[k:], -1), want_ids)
