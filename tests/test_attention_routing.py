"""Which attention calls the fused extension draws, and that every other one keeps its values.

The fused backward draws softmax(Q Kᵀ·scale + mask) V. A Hugging Face eager function that adds
a relative position bias (T5), or any other term, must run through the generic rules instead:
found by its own arguments or, failing that, by comparing its outputs with the decomposition.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import assert_readout_matches, graph_nodes, oracle_readouts
from oracle import build_graph
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import semipack

FUSED = "AttentionFunctionBackward"


def node_names(root: Tensor) -> set[str]:
    return {n.name() for n in graph_nodes(root)}


def assert_matches_autograd_and_oracle(loss_of, leaf: Tensor) -> None:
    """Real equals autograd and MaxProd the brute-force oracle on ``loss_of(leaf)``."""
    x = leaf.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss_of(x), x)
    (max_prod,) = oracle_readouts(build_graph(loss_of(x)), [x], "max_prod")
    for semiring, want in ((semipack.Real(), expected), (semipack.MaxProd(), max_prod)):
        x = leaf.detach().clone().requires_grad_()
        with semipack.extend(None, semiring):
            loss_of(x).backward()
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-12)
        name = "real" if isinstance(semiring, semipack.Real) else "max_prod"
        assert_readout_matches(name, want, x.semiring_grad, "input")


# --- Hugging Face eager attention -------------------------------------------------------------


def t5_encoder() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=30,
        d_model=8,
        d_kv=4,
        d_ff=16,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=4,
        relative_attention_max_distance=6,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.T5EncoderModel._from_config(cfg, attn_implementation="eager")
    return model.double().eval().requires_grad_(False)


def test_a_frozen_t5_position_bias_is_drawn() -> None:
    """T5 adds a relative position bias to the scores; frozen, it used to be left out of the
    fused backward (Real off autograd by 0.1). It now runs through the generic rules."""
    model = t5_encoder()
    embeddings = torch.randn(
        1, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )

    def loss_of(e: Tensor) -> Tensor:
        return model(inputs_embeds=e).last_hidden_state[0, 0].sum()

    with semipack.extend(model, semipack.MaxProd()):
        names = node_names(loss_of(embeddings.clone().requires_grad_()))
    assert FUSED not in names
    assert_matches_autograd_and_oracle(loss_of, embeddings)


def test_extend_wraps_the_eager_function_the_model_passes() -> None:
    """A model file may hold several eager functions (text and vision ones): the one the model
    hands to ``get_interface`` is the one that runs, and the registry is as before after."""

    def my_eager(*args, **kwargs):
        raise AssertionError("not called")

    with semipack.extend(None, semipack.MaxProd()):
        routed = ALL_ATTENTION_FUNCTIONS.get_interface("eager", my_eager)
        assert routed.keywords["eager"] is my_eager
        assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", my_eager) is not routed
        assert ALL_ATTENTION_FUNCTIONS.get_interface("eager", None) is None  # nothing to wrap
    assert ALL_ATTENTION_FUNCTIONS.get_interface("eager", my_eager) is my_eager


def reference_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """A standard eager function under another name than ``eager_attention_forward``."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def biased_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Adds a term of its own to the scores, with no argument that says so."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    lq, lk = scores.shape[-2:]
    scores = scores + 0.3 * torch.arange(lk, dtype=scores.dtype).expand(lq, lk)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def own_argument_eager(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_bias=None, **kw
):
    """T5's form: a bias of its own, passed as an argument."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class Attention(nn.Module):
    """One attention layer that resolves its function as transformers' models do."""

    def __init__(self, eager, mask: Tensor | None = None, **kwargs) -> None:
        super().__init__()
        self.eager, self.mask, self.kwargs = eager, mask, kwargs
        self.training = False

    def forward(self, x: Tensor) -> Tensor:
        q = k = v = x.unflatten(-1, (2, 3)).transpose(1, 2)  # [batch, heads, tokens, 3]
        attend = ALL_ATTENTION_FUNCTIONS.get_interface("eager", self.eager)
        out, _ = attend(self, q, k * 0.7, v * 1.3, self.mask, scaling=0.5, **self.kwargs)
        return out.flatten(-2)


def small_weight_eager(module, query, key, value, attention_mask, scaling=None, dropout=0, **kw):
    """Multiplies the last key's weight by 10 (its mask makes it about 1e-7): within an
    absolute tolerance of the largest weights, far outside a relative one."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask
    scores = scores + torch.tensor([0.0, 0.0, 0.0, math.log(10.0)], dtype=scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def straight_through_eager(
    module, query, key, value, attention_mask, scaling=None, dropout=0, **kw
):
    """The reference forward, with scores' gradient 1.5 times theirs: no value shows it."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores + 0.5 * (scores - scores.detach())
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def doubled_gradient_eager(
    module, query, key, value, attention_mask, scaling=None, dropout=0, **kw
):
    """``2s - s.detach()``: each result used once, the reference's forward bits, the scores'
    gradient doubled (no graph check sees it: the backward is probed)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores * 2.0 + (-1.0) * scores.detach()
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def partly_stopped_eager(module, query, key, value, attention_mask, scaling=None, dropout=0, **kw):
    """No gradient through the scores of the upper triangle: ``where(keep, s, s.detach())``."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    weights = torch.softmax(torch.where(keep, scores, scores.detach()), dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def detached_key_eager(module, query, key, value, attention_mask, scaling=None, dropout=0, **kw):
    """The reference forward with no gradient to the keys (it raised "a semipack bug")."""
    return reference_eager(module, query, key.detach(), value, attention_mask, scaling)


BIAS = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64).reshape(4, 4)

CASES = {
    "reference under another name": (reference_eager, {}, True),
    "a term of its own": (biased_eager, {}, False),
    "an argument of its own": (own_argument_eager, {"position_bias": BIAS}, False),
    "a small weight scaled": (
        small_weight_eager,
        {"mask": torch.tensor([0.0, 0.0, 0.0, -16.0], dtype=torch.float64)},
        False,
    ),
    "a term only the backward sees": (straight_through_eager, {}, False),
    "a detached key": (detached_key_eager, {}, False),
    "a doubled gradient, each result used once": (doubled_gradient_eager, {}, False),
    "a partial stop-gradient": (partly_stopped_eager, {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_only_the_reference_decomposition_is_fused(case: str) -> None:
    eager, kwargs, fused = CASES[case]
    layer = Attention(eager, **kwargs)
    x = torch.randn(2, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss_of(t: Tensor) -> Tensor:
        return layer(t).pow(2).sum()

    with semipack.extend(layer, semipack.MaxProd()):
        names = node_names(loss_of(x.clone().requires_grad_()))
    assert (FUSED in names) == fused
    assert_matches_autograd_and_oracle(loss_of, x)


def test_a_hidden_term_is_found_in_bfloat16_too() -> None:
    """bfloat16 weights are rounded by 0.4%: the check runs the function again in float32, or
    a bias of that size (here up to 0.3 x 3 on the scores) would pass as rounding."""
    layer = Attention(biased_eager)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2)).bfloat16()
    values = []
    for extensions in (True, False):
        leaf = x.clone().requires_grad_()
        with semipack.extend(layer, semipack.MaxProd(), extensions=extensions):
            loss = layer(leaf).float().pow(2).sum()
            if extensions:
                assert FUSED not in node_names(loss)
            loss.backward()
        values.append(leaf.semiring_grad)
    assert torch.equal(*values)


def bfloat16_only_eager(module, query, key, value, attention_mask, scaling=None, dropout=0, **kw):
    """Adds a bias in 16 bits only: the float32 run used for the check is the reference."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if scores.dtype == torch.bfloat16:
        scores = scores + torch.linspace(0.0, 2.0, scores.shape[-1], dtype=scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def test_a_term_only_16_bit_runs_add_is_found() -> None:
    layer = Attention(bfloat16_only_eager)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2)).bfloat16()
    with semipack.extend(layer, semipack.MaxProd()):
        assert FUSED not in node_names(layer(x.clone().requires_grad_()).float().sum())
    with semipack.extend(layer, semipack.MaxProd()):  # the reference code stays fused in 16 bits
        layer.eager = reference_eager
        assert FUSED in node_names(layer(x.clone().requires_grad_()).float().sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_standard_models_stay_fused_in_every_dtype(dtype: torch.dtype) -> None:
    """The outputs check must pass the standard eager functions at their own rounding (bf16
    weights are rounded after a float32 softmax), or the fusion would silently be lost."""
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaModel._from_config(cfg, attn_implementation="eager").to(dtype).eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    with semipack.extend(model, semipack.MaxProd()):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert FUSED in node_names(hidden.float().sum())


# --- scaled_dot_product_attention --------------------------------------------------------------


def test_sdpa_with_a_broadcast_batch_takes_the_generic_path() -> None:
    """One key/value set for three query batches is legal SDPA; the fused messages assumed
    equal batches (a StateShapeError)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 3, 4, dtype=torch.float64, generator=g)
    kv = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=g)

    def loss_of(k: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, k * 0.5, scale=1 / math.sqrt(4)).pow(2).sum()

    assert_matches_autograd_and_oracle(loss_of, kv)


@pytest.mark.parametrize("heads", [(1, 3), (3, 1)])
def test_sdpa_with_broadcast_heads(heads: tuple[int, int]) -> None:
    """Query heads broadcast over key heads (1 against 3) raised inside the fused messages; key
    heads broadcast over query heads (3 against 1) are grouped-query attention."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, heads[0], 3, 4, dtype=torch.float64, generator=g)
    kv = torch.randn(2, heads[1], 5, 4, dtype=torch.float64, generator=g)

    def loss_of(k: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(q, k, k * 0.5, scale=0.5)
        return (out.pow(2) * torch.linspace(0.5, 1.5, out.shape[1])[:, None, None]).sum()

    x = kv.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss_of(x), x)
    for extensions in (True, False):
        x = kv.clone().requires_grad_()
        with semipack.extend(None, semipack.Real(), extensions=extensions):
            loss_of(x).backward()
        torch.testing.assert_close(x.semiring_grad, want, rtol=1e-10, atol=1e-12)


def scaled_gradient_eager(module, query, key, value, attention_mask, scaling=None, dropout=0, **kw):
    """The scores' gradient times 1.1 (``1.1 s - 0.1 s.detach()``), in 16-bit runs only when
    the module says so."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if not module.only_16_bit or scores.dtype != torch.float32:
        scores = scores * module.factor + (1.0 - module.factor) * scores.detach()
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class Heads(nn.Module):
    """Attention on given Q, K, V, resolved as transformers' models do."""

    def __init__(self, eager, factor: float, only_16_bit: bool) -> None:
        super().__init__()
        self.eager, self.factor, self.only_16_bit = eager, factor, only_16_bit

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        attend = ALL_ATTENTION_FUNCTIONS.get_interface("eager", self.eager)
        return attend(self, q, k, v, None, scaling=0.5)[0]


def _fused(heads: Heads, q: Tensor, k: Tensor, v: Tensor) -> bool:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with semipack.extend(heads, semipack.Real()):
        return FUSED in node_names(heads(*leaves).float().sum())


def test_a_gradient_10_percent_off_is_found_beside_outlier_dimensions() -> None:
    """The scores' bound was max|q|·max|k|·scale: an outlier dimension (300 in different
    dimensions of q and k, so no score changes) made it 4.5e4 and a 10% larger gradient passed.
    The bound is now the largest score itself."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=gen) for _ in range(3))
    q[..., 0], k[..., 0], q[..., 1], k[..., 1] = 300.0, 0.0, 0.0, 300.0
    assert _fused(Heads(scaled_gradient_eager, 1.0, False), q, k, v)
    assert not _fused(Heads(scaled_gradient_eager, 1.1, False), q, k, v)


def test_a_gradient_changed_only_in_bfloat16_is_found() -> None:
    """In bfloat16 the backward was held to the float32 run entry by entry at 8 ulps per nat of
    the largest score: a gradient 25% larger only in 16 bits passed; the norm of the difference
    is held to 2 ulps per nat."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=gen).bfloat16() for _ in range(3))
    assert _fused(Heads(scaled_gradient_eager, 1.0, True), q, k, v)
    assert not _fused(Heads(scaled_gradient_eager, 1.25, True), q, k, v)


def test_float16_rows_masked_everywhere_stay_fused_and_empty_calls_run() -> None:
    """In float16 a padding row's -65504 swamps its scores (uniform weights) where the float32
    run of the check does not: such rows are left out of the comparison. An empty batch runs
    plainly (the check raised on it)."""
    layer = transformers.BertModel._from_config(
        transformers.BertConfig(
            vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32,
        ),
        attn_implementation="eager",
    ).half().eval()  # fmt: skip
    ids = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1] = 0  # a row of padding only
    with semipack.extend(layer, semipack.MaxProd()):
        hidden = layer(input_ids=ids, attention_mask=mask).last_hidden_state
        assert FUSED in node_names(hidden.float().sum())
    empty = [torch.randn(0, 2, 4, 8, requires_grad=True) for _ in range(3)]
    with semipack.extend(None, semipack.MaxProd()):
        assert Heads(reference_eager, 1.0, False)(*empty).shape == (0, 4, 2, 8)
