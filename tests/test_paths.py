"""TopPath: the best path is recovered, its value is MaxProd's, and extensions find the same one."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from cases_extensions import CASES, weighted_loss
from torch import nn

import semipack


def test_hand_computed_best_path() -> None:
    """loss = 3·a + 0.5·(2·a)·b with a = x[0]: paths from x[0] have products 3 and 2·0.5·b."""
    x = torch.tensor([1.0, 4.0], dtype=torch.float64, requires_grad=True)
    a, b = x[0], x[1]
    tp = semipack.TopPath()
    loss = 3 * a + 0.5 * ((2 * a) * b)
    (value,) = semipack.grad(loss, x, tp)
    # x[0]: max(3, 2 * 0.5 * b = 4) = 4 ;  x[1]: 0.5 * (2a) = 1
    assert value.tolist() == pytest.approx([4.0, 1.0])
    path = tp.path(x, 0)
    assert path.value == pytest.approx(4.0)
    ops = [s.op for s in path.steps]
    # x[0] -> select -> (2·a) -> ((2a)·b) -> (·0.5) -> (+) = loss
    assert ops == ["Select", "Mul", "Mul", "Mul", "Add"]
    edges = [
        math.exp(p - s.log_value)
        for p, s in zip(
            [path.log_value] + [s.log_value for s in path.steps], path.steps, strict=False
        )
    ]
    assert edges == pytest.approx([1.0, 2.0, 4.0, 0.5, 1.0])
    assert path.steps[-1].log_value == pytest.approx(0.0)  # the root
    # raising b's use below 3 switches the best path to the direct edge
    x2 = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    semipack.grad(3 * x2[0] + 0.5 * ((2 * x2[0]) * x2[1]), x2, tp)
    assert [s.op for s in tp.path(x2, 0).steps] == ["Select", "Mul", "Add"]


def test_path_value_matches_max_prod_and_edges_multiply_up() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3)
    ).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    tp = semipack.TopPath()
    with semipack.extend(model, tp):
        torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 2])).backward()
    mp = semipack.grad(
        torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 2])),
        list(model.parameters()),
        semipack.MaxProd(),
    )
    for p, want in zip(model.parameters(), mp, strict=True):
        torch.testing.assert_close(p.semiring_grad, want, rtol=1e-10, atol=0)
        for index in [None, tuple(0 for _ in p.shape)]:
            path = tp.path(p, index)
            flat_value = want[path.index] if path.index else want
            assert path.value == pytest.approx(float(flat_value), rel=1e-9)
            # log values fall by log|edge| at each step and reach 0 (the seed) at the root
            assert path.steps[-1].log_value == pytest.approx(0.0, abs=1e-12)
            logs = [path.log_value] + [s.log_value for s in path.steps]
            assert all(math.isfinite(v) for v in logs)


def test_path_requires_a_backward_and_a_leaf() -> None:
    tp = semipack.TopPath()
    with pytest.raises(KeyError, match="holds no top paths"):
        tp.path(torch.zeros(1))
    x = torch.ones(2, requires_grad=True)
    semipack.grad((2 * x).sum(), x, tp)
    with pytest.raises(KeyError, match="was not a leaf, retained tensor or input"):
        tp.path(torch.zeros(1))
    assert tp.path(x).value == pytest.approx(2.0, rel=1e-7)  # float32 leaf


def test_one_top_path_instance_serves_many_passes_and_is_never_modified() -> None:
    """Paths live on the tensors of each pass; the user's semiring keeps no state."""
    tp = semipack.TopPath()
    x = torch.tensor([1.0, 3.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([5.0, 2.0], dtype=torch.float64, requires_grad=True)
    semipack.grad((x * torch.tensor([4.0, 1.0], dtype=torch.float64)).sum(), x, tp)
    semipack.grad((y * 2).sum(), y, tp)
    assert tp.trace is None and vars(tp) == {"log": False}
    assert tp.path(x).index == (0,) and tp.path(x).value == pytest.approx(4.0, rel=1e-15)
    assert tp.path(y).index == (0,) and tp.path(y).value == pytest.approx(2.0, rel=1e-15)
    # a later pass with another semiring replaces the values, and the stale paths go with them
    lin = torch.nn.Linear(2, 1).double()
    with semipack.extend(lin, tp):
        lin(x.detach()).sum().backward()
    assert lin.weight.semiring_paths.name == "weight"
    with semipack.extend(lin, semipack.MaxProd()):
        lin(x.detach()).sum().backward()
    with pytest.raises(KeyError, match="a later pass with another semiring"):
        tp.path(lin.weight)


def test_top_path_passes_in_two_threads_share_one_instance() -> None:
    tp = semipack.TopPath()
    results: dict[int, tuple] = {}

    def run(seed: int) -> None:
        x = torch.arange(1.0, 5.0, dtype=torch.float64).requires_grad_()
        w = torch.zeros(4, dtype=torch.float64)
        w[seed] = 3.0
        for _ in range(20):
            semipack.grad((x * w).sum() + x.sum(), x, tp)
            results[seed] = (tp.path(x).index, round(tp.path(x).value, 12))

    threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the best single path to x[seed] goes through the product with 3 (the other has weight 1)
    assert results == {1: ((1,), 3.0), 2: ((2,), 3.0)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extension_and_generic_path_agree(case) -> None:
    if case.name.startswith("bert"):
        pytest.importorskip("transformers")
    results = []
    for extensions in (True, False):
        model = case.build()
        inputs = case.inputs()
        tp = semipack.TopPath()
        with semipack.extend(model, tp, extensions=extensions):
            weighted_loss(model, inputs).backward()
        leaves = [(n, p) for n, p in model.named_parameters() if hasattr(p, "semiring_grad")]
        leaves += [(f"input{i}", t) for i, t in enumerate(t for t in inputs if t.requires_grad)]
        results.append({n: (t.semiring_grad, tp.path(t)) for n, t in leaves})
    fast, slow = results
    assert fast.keys() == slow.keys()
    for name in fast:
        value_fast, path_fast = fast[name]
        value_slow, path_slow = slow[name]
        torch.testing.assert_close(value_fast, value_slow, rtol=1e-9, atol=1e-12)
        assert path_fast.index == path_slow.index, name
        assert path_fast.log_value == pytest.approx(path_slow.log_value, rel=1e-9, abs=1e-12)
        assert path_fast.modules() == path_slow.modules(), name


@pytest.mark.parametrize("extensions", [True, False], ids=["extension", "generic"])
def test_top_path_through_convolutions_matches_the_window_maps(extensions, monkeypatch) -> None:
    """Per-tap convolution messages carry the same best values and the same successors, step
    by step, as the im2col window maps (and the values are MaxProd's)."""
    from conv_reference import window_map_messages

    from semipack.rules import convolution

    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(2, 4, 3, padding=1),
            torch.nn.Tanh(),
            torch.nn.Conv2d(4, 3, 2, stride=2, dilation=1, groups=1),
            torch.nn.Flatten(),
            torch.nn.Linear(3 * 3 * 3, 2),
        ).double()
        x = torch.randn(2, 2, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        tp = semipack.TopPath()
        with semipack.extend(model, tp, extensions=extensions):
            model(x).pow(2).sum().backward()
        leaves = [*model.parameters(), x]
        return [(t.semiring_grad, tp.path(t)) for t in leaves]

    per_tap = run()
    monkeypatch.setattr(convolution, "per_tap_messages", window_map_messages)
    window_maps = run()
    for (value_a, path_a), (value_b, path_b) in zip(per_tap, window_maps, strict=True):
        torch.testing.assert_close(value_a, value_b, rtol=1e-12, atol=0)
        assert path_a.index == path_b.index
        assert [(s.op, s.index, s.module) for s in path_a.steps] == [
            (s.op, s.index, s.module) for s in path_b.steps
        ]
        assert path_a.log_value == pytest.approx(path_b.log_value, rel=1e-12)


def test_site_names_that_do_not_fit_the_rank_give_way_to_dim_numbers() -> None:
    """A layer norm over a 4-D tensor, ids of three dims, per-head attention weights: the
    extensions' dim names assumed another rank, and a path step was described with another
    entry's names (a trial found 'feature 3' for the entry whose feature is 0)."""
    from semipack.graph.sites import Site

    site = Site("m", "output", ("batch", "feature"))
    assert site.describe((1, 3)) == "m: output [batch 1, feature 3]"
    assert site.describe((1, 3, 4, 0)) == "m: output [dim0 1, dim1 3, dim2 4, dim3 0]"
    torch.manual_seed(0)
    norm, mha = nn.LayerNorm(4), nn.MultiheadAttention(4, 2, batch_first=True)
    x = torch.randn(2, 3, 5, 4, requires_grad=True)
    tp = semipack.TopPath()
    with semipack.extend(nn.ModuleList([norm, mha]), tp):
        h = norm(x)
        _, weights = mha(h[:, 0], h[:, 0], h[:, 0], average_attn_weights=False)
        (h.sum() + weights.sum()).backward()
    for leaf in (x, norm.weight, mha.in_proj_weight):
        path = tp.path(leaf, tuple(0 for _ in leaf.shape))
        for step in path.steps:
            named = step.description.split("[")[-1].rstrip("]")
            values = [int(part.split()[-1]) for part in named.split(", ")] if named else []
            if values:  # every named entry is the step's own index, in order
                assert tuple(values) == tuple(step.index), step.description
    steps = tp.path(mha.in_proj_weight, (0, 0)).steps
    weight_steps = [s for s in steps if "attention weights [" in s.description]
    assert weight_steps and all("head" in s.description for s in weight_steps)


def test_a_zero_width_linear_layer_takes_the_per_op_rules() -> None:
    """``nn.Linear(5, 0)`` (AdaptiveLogSoftmaxWithLoss builds such layers): the fused
    extension failed to reshape its empty messages; the per-op rules take it."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 0))
    x = torch.randn(2, 3)
    with semipack.extend(model, semipack.MaxProd()):
        (model[0](x).sum() + model(x).sum()).backward()
    assert model[1].weight.grad.shape == (0, 5) and model[0].weight.semiring_grad.shape == (5, 3)


def test_a_paths_printed_factors_multiply_to_its_value_with_a_seed() -> None:
    """With ``grad_outputs`` of 3, ``str(path)`` printed ``value 6`` and the one factor 2: the
    seed's edge was missing (trial 55). Its factors now multiply to the value."""
    x = torch.tensor([1.0, 4.0], dtype=torch.float64, requires_grad=True)
    sr = semipack.TopPath()
    semipack.grad(2 * x, x, sr, grad_outputs=torch.tensor([3.0, -0.5], dtype=torch.float64))
    for index, value in ((0, 6.0), (1, 1.0)):
        text = str(sr.path(x, index))
        factors = [float(line.split()[0][1:]) for line in text.splitlines()[1:]]
        assert math.prod(factors) == pytest.approx(value, rel=1e-12), text


def test_path_ranks_and_the_family_of_the_recording_pass_are_checked() -> None:
    """Trial 55: ``path(rank=-1)`` read the last rank silently, a rank past the last gave an
    index error about a dimension, and ``KBest.paths`` read a TopPath pass's single path."""
    a = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    semipack.grad((a * 3).sum(), a, semipack.KBest(2))
    assert a.semiring_paths.path(0, rank=1).rank == 1
    for rank in (-1, 2):
        with pytest.raises(IndexError, match=rf"path\(rank={rank}\): the pass recorded 2 rank"):
            a.semiring_paths.path(0, rank=rank)
    top = semipack.TopPath()
    semipack.grad((a * 3).sum(), a, top)
    assert top.path(a, 0).value == pytest.approx(3.0)
    with pytest.raises(KeyError, match="holds the paths of a TopPath pass, not of a KBest one"):
        semipack.KBest(5).paths(a, 0)


def test_a_path_asked_where_no_path_reaches_says_so() -> None:
    """Every ReLU off: ``path`` printed "best path ... value 0" with no steps, and asking a
    tensor without paths printed its message as a quoted key (trial 57)."""
    layer = nn.Linear(2, 2)
    with torch.no_grad():
        layer.bias.fill_(-10.0)
    sr = semipack.TopPath()
    with semipack.extend(layer, sr):
        torch.relu(layer(torch.ones(1, 2))).sum().backward()
    assert str(sr.path(layer.weight, (0, 0))) == "no path from weight[0, 0] (its value is the zero)"
    with pytest.raises(KeyError) as info:
        sr.path(torch.ones(2))
    assert str(info.value).startswith("this tensor holds no top paths")


def test_a_negative_index_counts_from_the_end_as_tensor_indexing_does() -> None:
    """``tp.path(x, (-1, 0))`` is the path of ``x[-1, 0]`` (trial 110 found it accepted and
    undocumented; the docstring says so now)."""
    x = torch.randn(2, 3, requires_grad=True)
    tp = semipack.TopPath()
    semipack.grad((x * x.flip(0)).sum(), [x], tp)
    for negative, positive in (((-1, 0), (1, 0)), ((0, -1), (0, 2)), ((-2, -3), (0, 0))):
        got, want = tp.path(x, negative), tp.path(x, positive)
        assert str(got) == str(want) and got.value == want.value
    with pytest.raises(IndexError):
        tp.path(x, (-3, 0))
