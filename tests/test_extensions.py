"""Module extensions are a speed and naming layer: same values as the generic per-op path.

For every extension and every semiring: the semiring values with extensions on equal those with
extensions off, ``.grad`` is bitwise what a plain backward gives, and the extension really ran
(its autograd node is in the graph, stamped with site names).
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases_extensions import CASES, Case, seeded_leaf, weighted_loss
from helpers import graph_nodes, semiring_names
from torch import nn

import semipack
from semipack.graph.sites import SITE_KEY


def _run(case: Case, sr, extensions: bool):
    model = case.build()
    inputs = case.inputs()
    leaves = [t for t in inputs if t.requires_grad]
    with semipack.extend(model, sr, extensions=extensions):
        loss = weighted_loss(model, inputs)
        nodes = graph_nodes(loss)
        loss.backward()
    values = {n: getattr(p, "semiring_grad", None) for n, p in model.named_parameters()}
    values.update({f"input{i}": t.semiring_grad for i, t in enumerate(leaves)})
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({f"input{i}": t.grad for i, t in enumerate(leaves)})
    return values, grads, nodes


def _plain_grads(case: Case):
    model = case.build()
    inputs = case.inputs()
    weighted_loss(model, inputs).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({f"input{i}": t.grad for i, t in enumerate(t for t in inputs if t.requires_grad)})
    return grads


def _assert_same(a, b, name: str) -> None:
    if a is None or b is None:  # a parameter no path reaches (BERT's pooler here)
        assert a is None and b is None, name
    elif isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y, name)
    elif a.dtype == torch.bool:
        assert torch.equal(a, b), name
    else:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True, msg=name)


# TopPath is left out here: test_paths.py runs these cases with TopPath, extensions on and off,
# and checks its values and its best paths agree.
@pytest.mark.parametrize("semiring_name", semiring_names("top_path"))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extension_equals_generic_path(case: Case, semiring) -> None:
    if case.name.startswith("bert"):
        pytest.importorskip("transformers")
    fast, fast_grads, nodes = _run(case, semiring, extensions=True)
    slow, slow_grads, slow_nodes = _run(case, semiring, extensions=False)
    names = {n.name() for n in nodes}
    assert case.node in names, names
    assert case.node not in {n.name() for n in slow_nodes}
    assert fast.keys() == slow.keys()
    for key in fast:
        _assert_same(fast[key], slow[key], key)
    plain = _plain_grads(case)
    for key, g in plain.items():
        if g is None:
            assert fast_grads[key] is None and slow_grads[key] is None, key
            continue
        assert torch.equal(fast_grads[key], g), key
        assert torch.equal(slow_grads[key], g), key


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extension_names_its_sites(case: Case) -> None:
    if case.name.startswith("bert"):
        pytest.importorskip("transformers")
    model = case.build()
    with semipack.extend(model, semipack.MaxProd()):
        loss = weighted_loss(model, case.inputs())
    stamped = [n for n in graph_nodes(loss) if n.name() == case.node]
    assert stamped
    for node in stamped:
        sites = node.metadata[SITE_KEY]
        assert all(s.dims for s in sites)
        assert all(s.module != "<outside the model>" for s in sites)


def test_extensions_leave_the_modules_untouched() -> None:
    """Extensions route torch functions; the module objects are never modified, not even inside
    the block (so copies, pickles and patched forwards behave as without semipack)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(3, 3)).double()
    from transformers.modeling_utils import AttentionInterface

    before = {n: dict(vars(m)) for n, m in model.named_modules()}
    registry = dict(AttentionInterface._global_mapping)
    get_interface = AttentionInterface.get_interface
    with semipack.extend(model, semipack.MaxProd()):
        inside = {n: dict(vars(m)) for n, m in model.named_modules()}
        assert AttentionInterface.get_interface is not get_interface  # eager attention routed
    after = {n: dict(vars(m)) for n, m in model.named_modules()}
    for state in (inside, after):
        assert state.keys() == before.keys()
        for name in before:
            assert state[name].keys() == before[name].keys(), name
            assert "forward" not in state[name]
    assert AttentionInterface._global_mapping == registry
    assert AttentionInterface.get_interface is get_interface


def test_extend_does_not_import_transformers_for_other_models() -> None:
    """Routing transformers' eager attention only where its models are loaded: a fresh process
    extending a torch model never imports transformers (seconds of a first ``extend``), and
    the backward's values are those of a process that had imported it."""
    import subprocess
    import sys

    code = (
        "import sys, torch, semipack\n"
        "{before}"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU(), torch.nn.Linear(4, 1))\n"
        "with semipack.extend(m, semipack.MaxProd()):\n"
        "    m(torch.randn(2, 3)).sum().backward()\n"
        "print('transformers' in sys.modules, m[0].weight.semiring_grad.tolist())\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code.format(before=before)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split(" ", 1)
        for before in ("", "import transformers.modeling_utils\n")
    ]
    assert [loaded for loaded, _ in runs] == ["False", "True"]
    assert runs[0][1] == runs[1][1]


def test_any_caller_of_an_extended_function_is_extended_with_exact_values() -> None:
    """A subclass with its own forward still calls F.linear: the extension takes the call, and
    the values are those of the drawing (checked against the closed form)."""

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = Doubled(3, 2).double()
    x = seeded_leaf(2, 3)
    with semipack.extend(model, semipack.LogSum()):
        loss = model(x).sum()
        assert "LinearFunctionBackward" in {n.name() for n in graph_nodes(loss)}
        loss.backward()
    # log Σ over the 2 outputs of |2 * W[o, i]|, for each input entry
    expected = (2 * model.weight.abs()).sum(0).log().expand(2, 3)
    torch.testing.assert_close(x.semiring_grad, expected)


def test_plain_backward_through_extended_modules_matches_autograd() -> None:
    """A backward that semipack does not take over (torch.autograd.grad) stays plain."""
    case = CASES[0]
    model = case.build()
    (x,) = case.inputs()
    reference = copy.deepcopy(model)
    want = torch.autograd.grad(reference(x).sum(), [x, *reference.parameters()])
    with semipack.extend(model, semipack.MaxProd()):
        got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    for a, b in zip(got, want, strict=True):
        assert type(a) is torch.Tensor and torch.equal(a, b)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "b_shape", "counts"),
    [
        # path counts by hand: W[o, i] reaches the loss through each of the N rows
        ((3, 4), (3, 4), (1,), {"w": torch.full((3, 4), 3.0), "b": torch.tensor([9.0])}),
        ((2, 5, 4), (4,), (), {"w": torch.full((4,), 10.0), "b": torch.tensor(10.0)}),
        ((3, 4), (4,), None, {"w": torch.full((4,), 3.0)}),
        ((4,), (4,), None, {"w": torch.ones(4)}),
    ],
    ids=["bias_broadcast_over_outputs", "1d_weight_3d_input", "1d_weight", "1d_weight_1d_input"],
)
def test_linear_shapes_the_fused_extension_leaves_to_the_rules(
    x_shape, w_shape, b_shape, counts
) -> None:
    """F.linear takes a 1-D weight and a bias that broadcasts over the outputs; the extension
    once failed on them (a shape error, a wrongly shaped bias state). They now go through the
    per-op rules: the path counts are the hand counts and equal the generic path's."""
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=torch.float64)
    params = nn.ParameterDict({"w": torch.randn(w_shape, dtype=torch.float64)})
    if b_shape is not None:
        params["b"] = torch.randn(b_shape, dtype=torch.float64)
    for extensions in (True, False):
        with semipack.extend(params, semipack.LogCount(log=False), extensions=extensions):
            torch.nn.functional.linear(x, params["w"], params.get("b")).tanh().sum().backward()
        for name, want in counts.items():
            got = params[name].semiring_grad
            torch.testing.assert_close(got, want.double(), rtol=1e-12, atol=0, msg=name)
        params.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_call_that_uses_an_input_twice_keeps_grad_bitwise(dtype: torch.dtype) -> None:
    """``F.linear(w, w)`` beside another use of ``w``: a plain backward adds the three
    gradients of ``w`` in one buffer; an extension would add its two first, in its own
    backward (a last-bit difference). Such a call runs as the plain call (the generic rules),
    so ``.grad`` is plain bit for bit and the values are the generic path's."""
    mismatched = 0
    for seed in range(20):
        torch.manual_seed(seed)
        w = torch.randn(4, 4, dtype=dtype, requires_grad=True)

        def loss(w: torch.Tensor = w) -> torch.Tensor:
            return torch.nn.functional.linear(w, w).tanh().sum() + (w * 2).sum()

        loss().backward()
        plain, w.grad = w.grad, None
        values = {}
        for extensions in (True, False):
            with semipack.extend(None, semipack.MaxProd(), extensions=extensions):
                out = loss()
                assert out.grad_fn is not None
                out.backward()
            mismatched += not torch.equal(w.grad, plain)
            values[extensions], w.grad = w.semiring_grad, None
        assert torch.equal(values[True], values[False])
    assert mismatched == 0


@pytest.mark.parametrize("semiring", [semipack.Real(), semipack.MaxProd(), semipack.LogSum()])
def test_multihead_attention_row_with_every_key_masked_runs_as_pytorch(semiring) -> None:
    """With ``need_weights=True`` a query row whose keys are all masked (padding and the
    attention mask together) is NaN in PyTorch's forward, and so are the gradients through it.
    The extension drew that row as one without paths: finite values, Real's unequal to
    ``.grad`` (trial 45). Such a call now runs through the generic rules: the values equal
    those with extensions off, and Real's equal the gradient, NaN where it is NaN."""
    torch.manual_seed(0)
    base = nn.MultiheadAttention(4, 2, batch_first=True).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    padding = torch.tensor([[False, False, True], [False, True, True]])
    mask = torch.tensor([[False, True, False], [False, False, False], [True, False, False]])
    weights = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(2, 3, 4)
    values = {}
    for extensions in (True, False):
        mha = copy.deepcopy(base)
        with semipack.extend(mha, semiring, extensions=extensions):
            out = mha(x, x, x, need_weights=True, key_padding_mask=padding, attn_mask=mask)[0]
            (out * weights).sum().backward()
        assert out.isnan().any()  # the fully masked row
        values[extensions] = {n: (p.semiring_grad, p.grad) for n, p in mha.named_parameters()}
    for name, (value, grad) in values[True].items():
        other, _ = values[False][name]
        torch.testing.assert_close(value, other, equal_nan=True, msg=name)
        if isinstance(semiring, semipack.Real):
            torch.testing.assert_close(value, grad, equal_nan=True, msg=name)
