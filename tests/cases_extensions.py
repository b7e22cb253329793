"""The module-extension cases: small models, each with the extension autograd node it must use.

Shared by ``test_extensions.py`` (extensions on = extensions off, for every semiring) and
``test_paths.py`` (TopPath finds the same best path either way), and part of the rule-coverage
corpus (``test_rule_coverage.py``) run with extensions off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    node: str  # name of the extension's autograd node that must appear in the graph


def seeded_generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seeded_leaf(*shape, seed=1, grad=True):
    return torch.randn(
        *shape, generator=seeded_generator(seed), dtype=torch.float64
    ).requires_grad_(grad)


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


class Projections(nn.Module):
    """Matrix products with parameters: ``x @ W.T`` (Falcon's linear layer) and
    ``torch.matmul(x, P)``, on a 3-D input and after it a 2-D one."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 5))
        self.proj = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        h = torch.tanh(x @ self.weight.T)
        h = torch.linalg.matmul(torch.matmul(h, self.proj), self.proj.T)
        return h.flatten(0, 1).matmul(self.proj)


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
        "linear_2d",
        _seeded(lambda: nn.Linear(5, 4)),
        lambda: (seeded_leaf(3, 5),),
        "LinearFunctionBackward",
    ),
    Case(
        "linear_3d_nobias",
        _seeded(lambda: nn.Linear(5, 4, bias=False)),
        lambda: (seeded_leaf(2, 3, 5),),
        "LinearFunctionBackward",
    ),
    Case(
        "matmul_parameter",
        _seeded(Projections),
        lambda: (seeded_leaf(2, 3, 5),),
        "MatmulFunctionBackward",
    ),
    Case(
        "conv1d",
        _seeded(lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2)),
        lambda: (seeded_leaf(2, 4, 9),),
        "ConvFunctionBackward",
    ),
    Case(
        "conv2d",
        _seeded(lambda: nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=1)),
        lambda: (seeded_leaf(2, 2, 6, 5),),
        "ConvFunctionBackward",
    ),
    Case(
        "conv2d_unbatched",
        _seeded(lambda: nn.Conv2d(2, 2, 2)),
        lambda: (seeded_leaf(2, 4, 4),),
        "ConvFunctionBackward",
    ),
    Case(  # "same" with an even kernel: PyTorch adds one zero on the right (trial 66)
        "conv2d_same_even_kernel",
        _seeded(lambda: nn.Conv2d(2, 3, (4, 3), padding="same", dilation=(1, 2))),
        lambda: (seeded_leaf(2, 2, 6, 5),),
        "ConvFunctionBackward",
    ),
    Case(
        "conv2d_same_unbatched",
        _seeded(lambda: nn.Conv2d(2, 2, 2, padding="same")),
        lambda: (seeded_leaf(2, 4, 3),),
        "ConvFunctionBackward",
    ),
    Case(
        "conv1d_valid",
        _seeded(lambda: nn.Conv1d(3, 2, 2, padding="valid")),
        lambda: (seeded_leaf(2, 3, 5),),
        "ConvFunctionBackward",
    ),
    Case(
        "layer_norm",
        _seeded(lambda: nn.LayerNorm(6)),
        lambda: (seeded_leaf(2, 3, 6),),
        "LayerNormFunctionBackward",
    ),
    Case(
        "layer_norm_plain",
        _seeded(lambda: nn.LayerNorm([2, 3], elementwise_affine=False)),
        lambda: (seeded_leaf(4, 2, 3),),
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
        lambda: (seeded_leaf(2, 4, 8),),
        "AttentionFunctionBackward",
    ),
    Case(
        "sdpa_causal_gqa",
        _seeded(lambda: SdpaBlock(heads=4, kv_heads=2, causal=True)),
        lambda: (seeded_leaf(2, 4, 8),),
        "AttentionFunctionBackward",
    ),
    Case(
        "sdpa_bool_mask",
        _seeded(lambda: SdpaBlock(masked=True)),
        lambda: (seeded_leaf(1, 5, 8),),
        "AttentionFunctionBackward",
    ),
    Case(
        "mha",
        _seeded(lambda: nn.MultiheadAttention(8, 2, batch_first=True)),
        lambda: (seeded_leaf(2, 3, 8),) * 3,
        "MultiheadAttentionFunctionBackward",
    ),
    Case(
        "mha_cross_seq_first",
        _seeded(lambda: nn.MultiheadAttention(8, 4)),
        lambda: (seeded_leaf(3, 2, 8), seeded_leaf(4, 2, 8, seed=2), seeded_leaf(4, 2, 8, seed=3)),
        "MultiheadAttentionFunctionBackward",
    ),
    Case(
        "transformer_layer",
        _seeded(lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)),
        lambda: (seeded_leaf(2, 3, 8),),
        "MultiheadAttentionFunctionBackward",
    ),
    Case("bert_eager", lambda: BertHead("eager"), lambda: (IDS,), "AttentionFunctionBackward"),
    Case("bert_sdpa", lambda: BertHead("sdpa"), lambda: (IDS,), "AttentionFunctionBackward"),
]


def weighted_loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """The model's output against fixed random weights, summed."""
    if isinstance(model, nn.MultiheadAttention):
        out = model(*inputs, need_weights=False)[0]
    else:
        out = model(*inputs)
    weights = torch.randn(out.shape, generator=seeded_generator(7), dtype=out.dtype)
    return (out * weights).sum()
