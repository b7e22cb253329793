"""A zoo of tiny models for end-to-end tests of semiring backpropagation.

Each case is built by a named factory that seeds the global RNG first, so two calls give bitwise
identical models and inputs. A case bundles the model, its inputs and a loss function; computing
the loss through :meth:`ZooCase.loss` re-seeds the RNG, so dropout masks repeat too.

Everything is float64 and tiny (widths <= 16, sequences <= 6, images <= 8x8, batch <= 3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DTYPE = torch.float64

LossFn = Callable[[nn.Module, tuple[Tensor, ...]], Tensor]


@dataclass
class ZooCase:
    """One model of the zoo: the model, its inputs and how to turn them into a scalar loss."""

    name: str
    model: nn.Module
    inputs: tuple[Tensor, ...]
    loss_fn: LossFn
    covers: tuple[str, ...]
    seed: int = 0

    def loss(self) -> Tensor:
        """Run forward and loss, re-seeding first so that any dropout mask is reproducible."""
        torch.manual_seed(self.seed)
        return self.loss_fn(self.model, self.inputs)

    def named_leaves(self) -> list[tuple[str, Tensor]]:
        """Every parameter that requires grad, then every input that requires grad."""
        params = [(f"param:{n}", p) for n, p in self.model.named_parameters() if p.requires_grad]
        inputs = [(f"input:{i}", x) for i, x in enumerate(self.inputs) if x.requires_grad]
        return params + inputs

    def leaves(self) -> list[Tensor]:
        """The tensors of :meth:`named_leaves`, in the same order."""
        return [t for _, t in self.named_leaves()]


ZOO: dict[str, Callable[[], ZooCase]] = {}


def register(name: str) -> Callable[[Callable[[], ZooCase]], Callable[[], ZooCase]]:
    """Decorator: add a factory to the zoo under ``name``."""

    def decorate(factory: Callable[[], ZooCase]) -> Callable[[], ZooCase]:
        ZOO[name] = factory
        return factory

    return decorate


def build(name: str) -> ZooCase:
    """A fresh, deterministic instance of the named case."""
    return ZOO[name]()


def _randn(*shape: int, grad: bool = False) -> Tensor:
    """A float64 standard-normal tensor, optionally a leaf that requires grad."""
    return torch.randn(*shape, dtype=DTYPE).requires_grad_(grad)


def _randomize_running_stats(model: nn.Module) -> None:
    """Give every batch norm non-trivial running statistics (used in eval mode)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn_like(m.running_mean) * 0.5)
            m.running_var.copy_(torch.rand_like(m.running_var) + 0.5)


# --- multilayer perceptrons -------------------------------------------------------------------


class ResidualMLP(nn.Module):
    """Linear stem, residual Linear-ReLU-Linear blocks, linear head."""

    def __init__(self, d_in: int = 6, width: int = 12, classes: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


@register("residual_mlp")
def residual_mlp() -> ZooCase:
    torch.manual_seed(0)
    model = ResidualMLP().to(DTYPE)
    x = _randn(3, 6, grad=True)
    y = torch.tensor([0, 3, 1])
    return ZooCase(
        "residual_mlp",
        model,
        (x, y),
        lambda m, inp: F.cross_entropy(m(inp[0]), inp[1]),
        ("linear/addmm", "tanh", "relu", "residual add", "cross_entropy"),
    )


class ActivationChain(nn.Module):
    """Linear layers, each followed by a different activation."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        activations: list[nn.Module] = [
            nn.GELU(),
            nn.GELU(approximate="tanh"),
            nn.SiLU(),
            nn.Tanh(),
            nn.Sigmoid(),
            nn.ReLU(),
            nn.Softplus(beta=2.0),
            nn.LeakyReLU(0.1),
            nn.ELU(alpha=0.7),
        ]
        layers: list[nn.Module] = []
        for act in activations:
            layers += [nn.Linear(width, width), act]
        self.body = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


@register("activation_chain")
def activation_chain() -> ZooCase:
    torch.manual_seed(1)
    model = ActivationChain().to(DTYPE)
    x = _randn(3, 8, grad=True)
    target = _randn(3, 8)
    return ZooCase(
        "activation_chain",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        (
            "linear/addmm",
            "gelu(none)",
            "gelu(tanh)",
            "silu",
            "tanh",
            "sigmoid",
            "relu",
            "softplus",
            "leaky_relu",
            "elu",
            "mse_loss",
        ),
    )


@register("dropout_mlp")
def dropout_mlp() -> ZooCase:
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Dropout(0.5),
        nn.Linear(16, 4),
    ).to(DTYPE)
    model.train()
    x = _randn(3, 8, grad=True)
    y = torch.tensor([2, -100, 0])  # the middle row is ignored by the loss

    def loss_fn(m: nn.Module, inp: tuple[Tensor, ...]) -> Tensor:
        return F.cross_entropy(m(inp[0]), inp[1], ignore_index=-100)

    return ZooCase(
        "dropout_mlp",
        model,
        (x, y),
        loss_fn,
        ("dropout(train)", "relu", "gelu", "cross_entropy with ignore_index"),
        seed=123,
    )


@register("label_smoothing_classifier")
def label_smoothing_classifier() -> ZooCase:
    torch.manual_seed(21)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5)).to(DTYPE)
    x = _randn(3, 6, grad=True)
    y = torch.tensor([4, 0, 2])
    return ZooCase(
        "label_smoothing_classifier",
        model,
        (x, y),
        lambda m, inp: F.cross_entropy(m(inp[0]), inp[1], label_smoothing=0.1),
        ("linear", "tanh", "cross_entropy(label_smoothing=0.1)"),
    )


# --- contractions and tensor plumbing ---------------------------------------------------------


class Contractions(nn.Module):
    """mm, broadcasting mul/add, bmm, batched-broadcast matmul and einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.w_mm = nn.Parameter(torch.randn(6, 8))
        self.scale = nn.Parameter(torch.randn(8))
        self.shift = nn.Parameter(torch.randn(1, 8))
        self.w_bmm = nn.Parameter(torch.randn(3, 4, 5))
        self.w_matmul = nn.Parameter(torch.randn(2, 1, 5, 4))
        self.w_einsum = nn.Parameter(torch.randn(4, 6))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.mm(x, self.w_mm)  # [3, 8]
        h = h * self.scale + self.shift  # broadcasting mul and add
        b = torch.bmm(h.view(3, 2, 4), self.w_bmm)  # [3, 2, 5]
        m = torch.matmul(b, self.w_matmul)  # batch dims (3,) and (2, 1) broadcast: [2, 3, 2, 4]
        e = torch.einsum("abik,kj->abij", m, self.w_einsum)  # [2, 3, 2, 6]
        g = torch.einsum("abij,bj->ai", torch.tanh(e), x)  # [2, 2], x used twice
        return g.sum() + e.sigmoid().mean()


@register("contractions")
def contractions() -> ZooCase:
    torch.manual_seed(3)
    model = Contractions().to(DTYPE)
    x = _randn(3, 6, grad=True)
    return ZooCase(
        "contractions",
        model,
        (x,),
        lambda m, inp: m(inp[0]),
        ("mm", "bmm", "matmul(broadcast batch)", "einsum", "broadcast mul/add", "sum", "mean"),
    )


class TensorSurgery(nn.Module):
    """Views, copies, concatenation and every kind of selection applied to one activation."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.randn(1, 4, 1))
        gen = torch.Generator().manual_seed(7)
        self.register_buffer("gather_index", torch.randint(0, 6, (3, 4, 2), generator=gen))
        self.register_buffer("cond", torch.rand(3, 4, 6, generator=gen) > 0.5)
        self.register_buffer("fill_mask", torch.rand(3, 4, 6, generator=gen) > 0.7)
        self.register_buffer("rows", torch.tensor([0, 2, 0]))  # repeated: gradients accumulate
        self.register_buffer("cols", torch.tensor([1, 1, 3]))

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # [3, 4, 6]
        left, right = h.split([2, 4], dim=-1)
        top, bottom = h.chunk(2, dim=1)
        joined = torch.cat([right, left], dim=-1)  # [3, 4, 6]
        stacked = torch.stack([top, bottom], dim=0)  # [2, 3, 2, 6]
        first = h.select(1, 0)  # [3, 6]
        strided = h[:, 1:3, ::2]  # [3, 2, 3]
        picked = h[self.rows, self.cols]  # advanced indexing: [3, 6]
        gathered = torch.gather(h, 2, self.gather_index)  # [3, 4, 2]
        chosen = torch.where(self.cond, h, joined)
        kept = torch.where(self.cond, h, 0.0)
        filled = h.masked_fill(self.fill_mask, -1.0)
        moved = h.permute(2, 0, 1).reshape(6, 12)
        swapped = h.transpose(0, 1).contiguous().view(4, 18)
        expanded = self.bias.expand(3, 4, 6)
        pieces = [
            (joined * expanded).flatten(),
            stacked.tanh().flatten(),
            first.flatten(),
            strided.flatten(),
            picked.flatten(),
            gathered.flatten(),
            chosen.flatten(),
            kept.flatten(),
            filled.flatten(),
            moved.sum(0),
            swapped.mean(1),
        ]
        return torch.cat(pieces)


@register("tensor_surgery")
def tensor_surgery() -> ZooCase:
    torch.manual_seed(4)
    model = TensorSurgery().to(DTYPE)
    x = _randn(3, 4, 6, grad=True)
    with torch.no_grad():
        target = torch.randn(model(x).shape, dtype=DTYPE)
    return ZooCase(
        "tensor_surgery",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        (
            "linear on 3-d input",
            "split",
            "chunk",
            "cat",
            "stack",
            "select",
            "slice(step)",
            "advanced indexing(repeated)",
            "gather",
            "where(tensor, tensor)",
            "where(tensor, scalar)",
            "masked_fill",
            "permute",
            "reshape",
            "transpose",
            "contiguous",
            "view",
            "expand",
            "flatten",
            "sum",
            "mean",
            "mse_loss",
        ),
    )


class TokenPicker(nn.Module):
    """Advanced indexing behind a slice: picks (repeated) time steps and features of a sequence."""

    def __init__(self, width: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)
        self.register_buffer("steps", torch.tensor([0, 2, 2]))
        self.register_buffer("rows", torch.tensor([0, 1, 1]))
        self.register_buffer("features", torch.tensor([5, 0, 5]))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.proj(x))  # [B, T, W]
        picked = h[:, self.steps]  # [B, 3, W]: index list after a full slice
        spots = h[self.rows, :, self.features]  # [3, T]: index lists around a full slice
        return self.head(picked).sum(1) + spots.sum(1, keepdim=True)


@register("token_picker")
def token_picker() -> ZooCase:
    torch.manual_seed(22)
    model = TokenPicker().to(DTYPE)
    x = _randn(3, 4, 6, grad=True)
    target = _randn(3, 3)
    return ZooCase(
        "token_picker",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        ("advanced indexing x[:, idx] (repeated)", "advanced indexing x[idx, :, idx]", "mse"),
    )


class EmbeddingClassifier(nn.Module):
    """Embedding with a padding row, layer norm, mean pooling, log-softmax classifier."""

    def __init__(self, vocab: int = 50, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.norm(self.embed(tokens))
        return F.log_softmax(self.head(h.mean(1)), dim=-1)


@register("embedding_classifier")
def embedding_classifier() -> ZooCase:
    torch.manual_seed(5)
    model = EmbeddingClassifier().to(DTYPE)
    tokens = torch.tensor([[3, 7, 7, 0, 0], [12, 3, 49, 5, 0], [1, 2, 3, 4, 5]])
    y = torch.tensor([4, 0, 2])
    return ZooCase(
        "embedding_classifier",
        model,
        (tokens, y),
        lambda m, inp: F.nll_loss(m(inp[0]), inp[1]),
        ("embedding(padding_idx, repeated ids)", "layer_norm", "mean", "log_softmax", "nll_loss"),
    )


# --- convolutions and pooling -----------------------------------------------------------------


@register("small_cnn")
def small_cnn() -> ZooCase:
    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    ).to(DTYPE)
    model.train()
    x = _randn(2, 1, 8, 8, grad=True)
    y = torch.tensor([1, 2])
    return ZooCase(
        "small_cnn",
        model,
        (x, y),
        lambda m, inp: F.cross_entropy(m(inp[0]), inp[1]),
        (
            "conv2d(padding)",
            "relu",
            "max_pool2d",
            "batch_norm(train)",
            "adaptive_avg_pool2d(1)",
            "flatten",
            "linear",
            "cross_entropy",
        ),
    )


@register("conv1d_net")
def conv1d_net() -> ZooCase:
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Conv1d(4, 8, 3, stride=2, padding=2, dilation=2, groups=2),  # length 6 -> 3
        nn.SiLU(),
        nn.Conv1d(8, 4, 2, padding=1, groups=4),  # length 3 -> 4
        nn.Flatten(),
        nn.Linear(16, 3),
    ).to(DTYPE)
    x = _randn(2, 4, 6, grad=True)
    target = _randn(2, 3)
    return ZooCase(
        "conv1d_net",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        ("conv1d(stride, padding, dilation, groups)", "silu", "flatten", "mse_loss"),
    )


@register("conv2d_grouped_dilated")
def conv2d_grouped_dilated() -> ZooCase:
    torch.manual_seed(8)
    model = nn.Sequential(
        nn.Conv2d(4, 8, 3, stride=2, padding=2, dilation=2, groups=4),  # 6x6 -> 3x3
        nn.Softplus(),
        nn.Conv2d(8, 4, (2, 3), stride=(1, 2), padding=(0, 1), groups=2),  # 3x3 -> 2x2
        nn.Flatten(),
        nn.Linear(16, 2),
    ).to(DTYPE)
    x = _randn(2, 4, 6, 6, grad=True)
    target = _randn(2, 2)
    return ZooCase(
        "conv2d_grouped_dilated",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        ("conv2d(stride, padding, dilation, groups, rectangular kernel)", "softplus", "mse"),
    )


class PoolingNet(nn.Module):
    """Overlapping max pooling, ceil-mode average pooling and overlapping adaptive pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x))  # [B, 4, 8, 8]
        pooled = F.max_pool2d(h, 3, stride=2, padding=1)  # overlapping windows: 4x4
        avg = F.avg_pool2d(
            pooled, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False
        )  # 3x3 (the last window is clipped)
        adaptive = F.adaptive_avg_pool2d(avg, 2)  # 3x3 -> 2x2 with overlapping windows
        plain_avg = F.avg_pool2d(h, 4)  # 2x2, count_include_pad irrelevant
        overall = F.adaptive_avg_pool2d(h, 1)  # 1x1, broadcast over the 2x2 maps below
        features = (adaptive + plain_avg + overall).flatten(1)
        return self.head(features)


@register("pooling_net")
def pooling_net() -> ZooCase:
    torch.manual_seed(9)
    model = PoolingNet().to(DTYPE)
    x = _randn(2, 2, 8, 8, grad=True)
    y = torch.tensor([0, 2])
    return ZooCase(
        "pooling_net",
        model,
        (x, y),
        lambda m, inp: F.cross_entropy(m(inp[0]), inp[1]),
        (
            "max_pool2d(overlapping, padding)",
            "avg_pool2d(ceil_mode, count_include_pad=False)",
            "avg_pool2d(plain)",
            "adaptive_avg_pool2d(overlapping and global)",
            "broadcasting add",
            "cross_entropy",
        ),
    )


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn plus a skip (1x1 conv-bn when shapes change)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return F.relu(out + skip)


@register("resnet_block_train")
def resnet_block_train() -> ZooCase:
    torch.manual_seed(10)
    model = BasicBlock(4, 4).to(DTYPE)
    model.train()
    x = _randn(2, 4, 6, 6, grad=True)
    target = _randn(2, 4, 6, 6)
    return ZooCase(
        "resnet_block_train",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        ("conv2d(no bias)", "batch_norm(train)", "relu", "identity skip add", "mse_loss"),
    )


@register("resnet_block_eval")
def resnet_block_eval() -> ZooCase:
    torch.manual_seed(11)
    model = BasicBlock(4, 6, stride=2).to(DTYPE)
    with torch.no_grad():
        _randomize_running_stats(model)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.normal_()
                m.bias.normal_()
    model.eval()
    x = _randn(2, 4, 6, 6, grad=True)
    target = _randn(2, 6, 3, 3)
    return ZooCase(
        "resnet_block_eval",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        ("conv2d(stride 2)", "batch_norm(eval)", "1x1 conv downsample skip", "relu", "mse"),
    )


# --- attention --------------------------------------------------------------------------------


def _split_heads(t: Tensor, heads: int) -> Tensor:
    batch, length, width = t.shape
    return t.view(batch, length, heads, width // heads).transpose(1, 2)


def _merge_heads(t: Tensor) -> Tensor:
    batch, heads, length, head_dim = t.shape
    return t.transpose(1, 2).contiguous().view(batch, length, heads * head_dim)


class HandAttention(nn.Module):
    """Causal self-attention written out: projections, masked_fill, softmax, matmul."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (_split_heads(proj(x), self.heads) for proj in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        length = x.shape[1]
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return self.out(_merge_heads(torch.matmul(probs, v)))


@register("hand_attention")
def hand_attention() -> ZooCase:
    torch.manual_seed(12)
    model = HandAttention().to(DTYPE)
    x = _randn(2, 5, 8, grad=True)
    target = _randn(2, 5, 8)
    return ZooCase(
        "hand_attention",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        (
            "linear on 3-d input",
            "view",
            "transpose",
            "matmul(4-d)",
            "masked_fill(-inf, causal)",
            "softmax",
            "contiguous",
            "mse_loss",
        ),
    )


class SDPABlock(nn.Module):
    """Packed qkv projection, F.scaled_dot_product_attention with one kind of mask, output."""

    def __init__(self, mask_kind: str, width: int = 8, heads: int = 2, length: int = 5) -> None:
        super().__init__()
        self.heads, self.mask_kind = heads, mask_kind
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        gen = torch.Generator().manual_seed(3)
        if mask_kind == "float":
            self.register_buffer("mask", torch.randn(2, 1, length, length, generator=gen))
        elif mask_kind == "bool":
            keep = torch.rand(2, heads, length, length, generator=gen) > 0.5
            keep |= torch.eye(length, dtype=torch.bool)  # every query keeps at least one key
            self.register_buffer("mask", keep)
        elif mask_kind != "causal":
            raise ValueError(f"unknown mask kind {mask_kind!r}")

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (_split_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        if self.mask_kind == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.out(_merge_heads(y))


def _sdpa_case(name: str, mask_kind: str, seed: int) -> ZooCase:
    torch.manual_seed(seed)
    model = SDPABlock(mask_kind).to(DTYPE)
    x = _randn(2, 5, 8, grad=True)
    target = _randn(2, 5, 8)
    return ZooCase(
        name,
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        ("linear", "chunk", f"scaled_dot_product_attention({mask_kind})", "mse_loss"),
    )


@register("sdpa_float_mask")
def sdpa_float_mask() -> ZooCase:
    return _sdpa_case("sdpa_float_mask", "float", 13)


@register("sdpa_bool_mask")
def sdpa_bool_mask() -> ZooCase:
    return _sdpa_case("sdpa_bool_mask", "bool", 14)


@register("sdpa_causal")
def sdpa_causal() -> ZooCase:
    return _sdpa_case("sdpa_causal", "causal", 15)


class CrossAttention(nn.Module):
    """nn.MultiheadAttention from a query sequence onto a padded memory, weights returned."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.register_buffer(
            "padding", torch.tensor([[False] * 5, [False, False, False, True, True]])
        )

    def forward(self, query: Tensor, memory: Tensor) -> tuple[Tensor, Tensor]:
        return self.attn(query, memory, memory, key_padding_mask=self.padding, need_weights=True)


@register("multihead_attention")
def multihead_attention() -> ZooCase:
    torch.manual_seed(16)
    model = CrossAttention().to(DTYPE)
    query = _randn(2, 4, 8, grad=True)
    memory = _randn(2, 5, 8, grad=True)
    target = _randn(2, 4, 8)
    weight_probe = _randn(2, 4, 5)

    def loss_fn(m: nn.Module, inp: tuple[Tensor, ...]) -> Tensor:
        out, weights = m(inp[0], inp[1])
        return F.mse_loss(out, inp[2]) + (weights * inp[3]).sum()

    return ZooCase(
        "multihead_attention",
        model,
        (query, memory, target, weight_probe),
        loss_fn,
        (
            "nn.MultiheadAttention(cross, key_padding_mask, need_weights)",
            "packed in_proj (linear + chunk/slices)",
            "baddbmm",
            "softmax",
            "bmm",
            "mean over heads",
        ),
    )


@register("multihead_attention_sdpa")
def multihead_attention_sdpa() -> ZooCase:
    """nn.MultiheadAttention without weights: the fused sdpa path, with Lq != Lk."""
    torch.manual_seed(20)
    model = CrossAttention().to(DTYPE)
    query = _randn(2, 4, 8, grad=True)
    memory = _randn(2, 5, 8, grad=True)
    target = _randn(2, 4, 8)

    def loss_fn(m: nn.Module, inp: tuple[Tensor, ...]) -> Tensor:
        out, _ = m.attn(inp[0], inp[1], inp[1], key_padding_mask=m.padding, need_weights=False)
        return F.mse_loss(out, inp[2])

    return ZooCase(
        "multihead_attention_sdpa",
        model,
        (query, memory, target),
        loss_fn,
        (
            "nn.MultiheadAttention(cross, key_padding_mask, need_weights=False)",
            "scaled_dot_product_attention(Lq != Lk, -inf float mask)",
        ),
    )


@register("transformer_encoder_train")
def transformer_encoder_train() -> ZooCase:
    torch.manual_seed(17)
    model = nn.TransformerEncoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
    ).to(DTYPE)
    model.train()
    x = _randn(2, 5, 8, grad=True)
    target = _randn(2, 5, 8)
    return ZooCase(
        "transformer_encoder_train",
        model,
        (x, target),
        lambda m, inp: F.mse_loss(m(inp[0]), inp[1]),
        ("TransformerEncoderLayer(train, post-norm, relu)", "sdpa", "layer_norm", "dropout p=0"),
    )


@register("transformer_encoder_eval")
def transformer_encoder_eval() -> ZooCase:
    torch.manual_seed(18)
    model = nn.TransformerEncoderLayer(
        d_model=8,
        nhead=2,
        dim_feedforward=16,
        dropout=0.1,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    ).to(DTYPE)
    model.eval()
    x = _randn(2, 5, 8, grad=True)
    target = _randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False, False, False, False, True]])
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = may not attend

    def loss_fn(m: nn.Module, inp: tuple[Tensor, ...]) -> Tensor:
        out = m(inp[0], src_mask=causal, src_key_padding_mask=padding)
        return F.mse_loss(out, inp[1])

    return ZooCase(
        "transformer_encoder_eval",
        model,
        (x, target),
        loss_fn,
        (
            "TransformerEncoderLayer(eval, pre-norm, gelu)",
            "causal bool mask + key padding mask",
            "sdpa",
            "layer_norm",
        ),
    )


def _bert_case(name: str, attn_implementation: str) -> ZooCase:
    from transformers import BertConfig, BertModel

    torch.manual_seed(19)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        attn_implementation=attn_implementation,
    )
    model = BertModel(config).to(DTYPE)
    model.eval()
    if model.config._attn_implementation != attn_implementation:
        raise RuntimeError(f"BERT ignored attn_implementation={attn_implementation!r}")
    ids = torch.tensor([[2, 17, 5, 33, 0, 0], [4, 4, 9, 21, 48, 11]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    target = _randn(2, 6, 16)

    def loss_fn(m: nn.Module, inp: tuple[Tensor, ...]) -> Tensor:
        out = m(input_ids=inp[0], attention_mask=inp[1])
        return F.mse_loss(out.last_hidden_state, inp[2]) + out.pooler_output.mean()

    return ZooCase(
        name,
        model,
        (ids, attention_mask, target),
        loss_fn,
        (
            f"BertModel(eval, attn_implementation={attn_implementation})",
            "embedding(padding_idx) x3",
            "layer_norm",
            "gelu",
            "padding attention mask",
            "tanh pooler",
        ),
    )


@register("bert_eager")
def bert_eager() -> ZooCase:
    return _bert_case("bert_eager", "eager")


@register("bert_sdpa")
def bert_sdpa() -> ZooCase:
    return _bert_case("bert_sdpa", "sdpa")


ZOO_NAMES: list[str] = sorted(ZOO)
