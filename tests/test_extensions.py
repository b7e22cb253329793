"""Module extensions are a speed and naming layer: same values as the generic per-op path.

For every extension and every semiring: the semiring values with extensions on equal those with
extensions off, ``.grad`` is bitwise what a plain backward gives, and the extension really ran
(its autograd node is in the graph, stamped with site names).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import semipack
from semipack.graph.sites import SITE_KEY

SEMIRINGS = [
    semipack.Real(),
    semipack.MaxProd(),
    semipack.SignedMaxProd(),
    semipack.LogSum(),
    semipack.Entropy(),
    semipack.Boolean(),
    semipack.LogCount(),
]


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    node: str  # name of the extension's autograd node that must appear in the graph


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _x(*shape, seed=1, grad=True):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).requires_grad_(grad)


class SdpaBlock(nn.Module):
    """A hand-rolled multi-head block that calls F.scaled_dot_product_attention."""

    def __init__(self, dim=8, heads=2, kv_heads=2, causal=False, masked=False):
        super().__init__()
        self.heads, self.kv_heads, self.causal, self.masked = heads, kv_heads, causal, masked
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim * kv_heads // heads)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q = self.q(x).view(b, t, self.heads, hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, hd).permute(2, 0, 3, 1, 4)
        mask = None
        if self.masked:
            mask = torch.ones(t, t, dtype=torch.bool).tril(1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=self.kv_heads != self.heads
        )
        return self.o(out.transpose(1, 2).reshape(b, t, d))


def _bert(impl: str) -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=30,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = impl
    torch.manual_seed(0)
    return BertModel(config).double().eval()


class BertHead(nn.Module):
    def __init__(self, impl: str) -> None:
        super().__init__()
        self.bert = _bert(impl)

    def forward(self, ids):
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state


def _seeded(module_fn):
    def build():
        torch.manual_seed(0)
        return module_fn().double()

    return build


IDS = torch.tensor([[1, 4, 7, 2, 9], [3, 3, 8, 0, 1]])

CASES = [
    Case(
        "linear_2d", _seeded(lambda: nn.Linear(5, 4)), lambda: (_x(3, 5),), "LinearFunctionBackward"
    ),
    Case(
        "linear_3d_nobias",
        _seeded(lambda: nn.Linear(5, 4, bias=False)),
        lambda: (_x(2, 3, 5),),
        "LinearFunctionBackward",
    ),
    Case(
        "conv1d",
        _seeded(lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2)),
        lambda: (_x(2, 4, 9),),
        "ConvFunctionBackward",
    ),
    Case(
        "conv2d",
        _seeded(lambda: nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=1)),
        lambda: (_x(2, 2, 6, 5),),
        "ConvFunctionBackward",
    ),
    Case(
        "conv2d_unbatched",
        _seeded(lambda: nn.Conv2d(2, 2, 2)),
        lambda: (_x(2, 4, 4),),
        "ConvFunctionBackward",
    ),
    Case(
        "layer_norm",
        _seeded(lambda: nn.LayerNorm(6)),
        lambda: (_x(2, 3, 6),),
        "LayerNormFunctionBackward",
    ),
    Case(
        "layer_norm_plain",
        _seeded(lambda: nn.LayerNorm([2, 3], elementwise_affine=False)),
        lambda: (_x(4, 2, 3),),
        "LayerNormFunctionBackward",
    ),
    Case(
        "embedding",
        _seeded(lambda: nn.Embedding(10, 4, padding_idx=0)),
        lambda: (torch.tensor([[1, 0, 3, 1], [2, 2, 9, 0]]),),
        "EmbeddingFunctionBackward",
    ),
    Case(
        "sdpa_block",
        _seeded(lambda: SdpaBlock()),
        lambda: (_x(2, 4, 8),),
        "AttentionFunctionBackward",
    ),
    Case(
        "sdpa_causal_gqa",
        _seeded(lambda: SdpaBlock(heads=4, kv_heads=2, causal=True)),
        lambda: (_x(2, 4, 8),),
        "AttentionFunctionBackward",
    ),
    Case(
        "sdpa_bool_mask",
        _seeded(lambda: SdpaBlock(masked=True)),
        lambda: (_x(1, 5, 8),),
        "AttentionFunctionBackward",
    ),
    Case(
        "mha",
        _seeded(lambda: nn.MultiheadAttention(8, 2, batch_first=True)),
        lambda: (_x(2, 3, 8),) * 3,
        "MultiheadAttentionFunctionBackward",
    ),
    Case(
        "mha_cross_seq_first",
        _seeded(lambda: nn.MultiheadAttention(8, 4)),
        lambda: (_x(3, 2, 8), _x(4, 2, 8, seed=2), _x(4, 2, 8, seed=3)),
        "MultiheadAttentionFunctionBackward",
    ),
    Case(
        "transformer_layer",
        _seeded(lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)),
        lambda: (_x(2, 3, 8),),
        "MultiheadAttentionFunctionBackward",
    ),
    Case("bert_eager", lambda: BertHead("eager"), lambda: (IDS,), "AttentionFunctionBackward"),
    Case("bert_sdpa", lambda: BertHead("sdpa"), lambda: (IDS,), "AttentionFunctionBackward"),
]


def _loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
    if isinstance(model, nn.MultiheadAttention):
        out = model(*inputs, need_weights=False)[0]
    else:
        out = model(*inputs)
    weights = torch.randn(out.shape, generator=_gen(7), dtype=out.dtype)
    return (out * weights).sum()


def _graph_nodes(t: torch.Tensor) -> list:
    seen, stack, out = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return out


def _run(case: Case, sr, extensions: bool):
    model = case.build()
    inputs = case.inputs()
    leaves = [t for t in inputs if t.requires_grad]
    with semipack.extend(model, sr, extensions=extensions):
        loss = _loss(model, inputs)
        nodes = _graph_nodes(loss)
        loss.backward()
    values = {n: getattr(p, "semiring_grad", None) for n, p in model.named_parameters()}
    values.update({f"input{i}": t.semiring_grad for i, t in enumerate(leaves)})
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({f"input{i}": t.grad for i, t in enumerate(leaves)})
    return values, grads, nodes


def _plain_grads(case: Case):
    model = case.build()
    inputs = case.inputs()
    _loss(model, inputs).backward()
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


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("sr", SEMIRINGS, ids=[s.name for s in SEMIRINGS])
def test_extension_equals_generic_path(case: Case, sr) -> None:
    if case.name.startswith("bert"):
        pytest.importorskip("transformers")
    fast, fast_grads, nodes = _run(case, sr, extensions=True)
    slow, slow_grads, slow_nodes = _run(case, sr, extensions=False)
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
        loss = _loss(model, case.inputs())
    stamped = [n for n in _graph_nodes(loss) if n.name() == case.node]
    assert stamped
    for node in stamped:
        sites = node.metadata[SITE_KEY]
        assert all(s.dims for s in sites)
        assert all(s.module != "<outside the model>" for s in sites)


def test_extensions_leave_the_modules_untouched() -> None:
    """Extensions route torch functions; the module objects are never modified, not even inside
    the block (so copies, pickles and patched forwards behave as without semipack)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(3, 3)).double()
    before = {n: dict(vars(m)) for n, m in model.named_modules()}
    with semipack.extend(model, semipack.MaxProd()):
        inside = {n: dict(vars(m)) for n, m in model.named_modules()}
        from transformers.modeling_utils import AttentionInterface

        assert "eager" in AttentionInterface._global_mapping
    after = {n: dict(vars(m)) for n, m in model.named_modules()}
    for state in (inside, after):
        assert state.keys() == before.keys()
        for name in before:
            assert state[name].keys() == before[name].keys(), name
            assert "forward" not in state[name]
    assert "eager" not in AttentionInterface._global_mapping


def test_any_caller_of_an_extended_function_is_extended_with_exact_values() -> None:
    """A subclass with its own forward still calls F.linear: the extension takes the call, and
    the values are those of the drawing (checked against the closed form)."""

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = Doubled(3, 2).double()
    x = _x(2, 3)
    with semipack.extend(model, semipack.LogSum()):
        loss = model(x).sum()
        assert "LinearFunctionBackward" in {n.name() for n in _graph_nodes(loss)}
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
