"""Per-sample semiring values: ``extend(..., per_sample=True)`` and ``p.semiring_grad_batch``.

Oracles, all independent of the per-sample code:

- the semiring sum over the rows (from ``semiring_state_batch``, and for Real, MaxProd and
  LogSum by the readouts' own sum, max and logsumexp) equals the batch's ``semiring_grad``;
- each row equals a plain semipack pass over that example alone, on the generic per-op rules
  (``extensions=False``), with a loss whose reduction weights match the batch's;
- Real's rows equal per-example gradients from ``torch.autograd``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import SEMIRINGS, assert_readout_matches, semiring_names, tiny_bert_config
from torch import nn
from torch.nn.utils import prune
from torch.utils.checkpoint import checkpoint

import semipack
from semipack import PerSampleError

#: TopPath records one path per pass: per-sample values refuse it (test_path_semirings_refused).
NAMES = semiring_names("top_path")


class TokenModel(nn.Module):
    """Embedding (with padding) -> LayerNorm -> Linear on [N, T] ids, then a head on [N, T, d]."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.norm(self.emb(ids)))))


class AttentionModel(nn.Module):
    """nn.MultiheadAttention (batch first, key padding mask) between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x, padding=None):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, key_padding_mask=padding)
        return self.out(a + h)


class Affine(nn.Module):
    """A hand-written gain and bias (generic row rules for mul, add and sub)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(width))
        self.bias = nn.Parameter(torch.randn(width))
        self.shift = nn.Parameter(torch.randn(1, width))

    def forward(self, x):
        return (self.gain * x + self.bias) - self.shift


def _batch_mlp():
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3))
    return model, (torch.randn(5, 4),)


def _sequence_mlp():
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    return model, (torch.randn(4, 3, 3),)


def _conv2d():
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, groups=2), nn.ReLU(), nn.Conv2d(4, 2, 2), nn.Flatten(),
        nn.Linear(2 * 3 * 3, 3),
    )  # fmt: skip
    return model, (torch.randn(3, 2, 4, 4),)


def _conv1d():
    model = nn.Sequential(nn.Conv1d(2, 3, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(9, 2))
    return model, (torch.randn(3, 2, 7),)


def _conv_padding_words():
    """padding="same" (an even kernel: one more zero on the right; a dilated one) and "valid"
    (SigLIP's patch embedding): refused as a call without a per-sample rule before trial 66."""
    model = nn.Sequential(
        nn.Conv2d(2, 3, 4, padding="same"), nn.ReLU(),
        nn.Conv2d(3, 2, (2, 3), padding="same", dilation=(3, 2)), nn.Tanh(),
        nn.Conv2d(2, 2, 3, padding="valid"), nn.Conv1d(2, 2, 2, padding="same"), nn.Flatten(),
        nn.Linear(2 * 3 * 3, 2),
    )  # fmt: skip
    return _ImagesAsRows(model), (torch.randn(3, 2, 5, 5),)


class _ImagesAsRows(nn.Module):
    """Runs ``layers[:5]`` on images, then the Conv1d on each image's rows as positions."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x):
        h = self.layers[:5](x)  # [N, 2, 3, 3]
        h = self.layers[5](h.flatten(2))  # [N, 2, 9]: Conv1d with "same" padding
        return self.layers[7](h.flatten(1))


def _tokens():
    ids = torch.tensor([[1, 2, 0, 3], [4, 4, 5, 0], [6, 1, 2, 3]])
    return TokenModel(), (ids,)


def _attention():
    padding = torch.tensor([[False, False, True], [False, False, False], [False, True, True]])
    return AttentionModel(), (torch.randn(3, 3, 3), padding)


def _encoder_layer():
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0, batch_first=True)
    return nn.Sequential(layer, nn.Linear(4, 2)), (torch.randn(2, 3, 4),)


def _affine():
    model = nn.Sequential(nn.Linear(3, 4), Affine(4), nn.Tanh(), nn.Linear(4, 2))
    return model, (torch.randn(3, 5, 3),)


class InputGain(nn.Module):
    """A gain on the model's raw input: the mul's other factor is the input itself."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.gain


def _gain_on_the_input():
    model = nn.Sequential(InputGain(3), nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, (torch.randn(3, 5, 3),)


class ComputedFromParameters(nn.Module):
    """Parameters used through values computed from them alone: a gain ``1 + w.clone()`` (as
    Gemma's RMSNorm's ``1 + w.float()``, without its rounding to float32), a transposed,
    negated, reshaped and scaled shift, a pruned weight (``weight_orig * mask``, a forward
    pre-hook) and a weight used transposed by F.linear; squeezed, unsqueezed and expanded
    parameters (Mamba's ``conv1d.weight.squeeze(1)``; an expand that broadcasts one entry to
    every token: its row is the semiring sum over them; these were refused, trial 60), also
    ``expand_as`` of a tensor computed from the input, which gives the shape only (refused,
    trial 62)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        prune.l1_unstructured(self.inp, "weight", 0.5)
        self.gain = nn.Parameter(0.3 * torch.randn(4))
        self.shift = nn.Parameter(torch.randn(4, 1))
        self.column = nn.Parameter(1.0 + 0.2 * torch.randn(1, 4))
        self.lift = nn.Parameter(torch.randn(4, 1))
        self.squeezed = nn.Parameter(torch.randn(1, 4, 1))
        self.offset = nn.Parameter(torch.randn(1, 4))  # expand_as(h[0]): h gives the shape
        self.tied = nn.Parameter(torch.randn(4, 5))
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        h = self.inp(x) * (1.0 + self.gain.clone()) * self.column.expand(x.shape[1], 4)
        h = h + self.lift.squeeze(-1).unsqueeze(0).squeeze(0) - self.squeezed.squeeze()
        h = h + self.offset.expand_as(h[0])
        h = torch.tanh(h - (-self.shift.t()).reshape(4) / 3)
        return self.out(torch.tanh(F.linear(h, self.tied.t())))


def _computed_from_parameters():
    return ComputedFromParameters(), (torch.randn(3, 5, 3),)


class MatrixProducts(nn.Module):
    """Projections written as matrix products with parameters: Falcon's ``x @ W.T`` on
    ``[N, T, k]`` tokens (``matmul`` merges the batch with the tokens: refused before the
    extension took it), ``torch.matmul(x, P / 2)`` (a value computed from one parameter, as
    ``F.linear`` takes one) and a bias added after."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(4))
        self.proj = nn.Parameter(torch.randn(4, 2))

    def forward(self, x):
        h = torch.tanh(x @ self.weight.T + self.bias)
        return torch.matmul(h, self.proj / 2)


def _matrix_products():
    return MatrixProducts(), (torch.randn(3, 5, 3),)


def _batch_norm_eval():
    model = nn.Sequential(
        nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(), nn.Linear(27, 2)
    )
    model.train()(torch.randn(6, 2, 4, 4))  # running statistics (the model is then in eval)
    return model, (torch.randn(3, 2, 4, 4),)


def _group_norm():
    """GroupNorm normalises each example's channel groups by their own statistics: the layer
    per-example training puts where batch norm would mix the batch."""
    model = nn.Sequential(
        nn.Conv2d(2, 4, 2), nn.GroupNorm(2, 4), nn.Tanh(), nn.Conv2d(4, 4, 1),
        nn.GroupNorm(4, 4), nn.Flatten(), nn.Linear(36, 2),
    )  # fmt: skip
    return model, (torch.randn(3, 2, 4, 4),)


def _instance_norm():
    """InstanceNorm normalises each example's channels by their own statistics (or by running
    ones, tracked in train mode): PyTorch runs it as a batch norm over the N·C channels of one
    reshaped example, with γ and β repeated N times. Refused until the thirty-second session
    ("RepeatBackward0 ... has no per-sample rule")."""
    model = nn.Sequential(
        nn.Conv2d(2, 4, 2), nn.InstanceNorm2d(4, affine=True), nn.Tanh(), nn.Conv2d(4, 3, 1),
        nn.InstanceNorm2d(3, affine=True, track_running_stats=True), nn.Flatten(),
        nn.Unflatten(1, (3, 9)), nn.InstanceNorm1d(3, affine=True), nn.Flatten(),
        nn.Linear(27, 2),
    )  # fmt: skip
    model.train()(torch.randn(6, 2, 4, 4))  # running statistics (the model is then in eval)
    return model, (torch.randn(3, 2, 4, 4),)


def _rms_norm():
    """``nn.RMSNorm`` (``F.rms_norm``) on tokens: its gain multiplies ``x · rsqrt(mean(x²) +
    eps)``, a value made inside the call; the product, the call's result, has the batch on dim
    0, so the value has it too. Refused until the thirty-second session ("computed inside
    'rms_norm'")."""
    model = nn.Sequential(
        nn.Linear(3, 4), nn.RMSNorm(4), nn.Tanh(), nn.Linear(4, 4), nn.RMSNorm((2, 4)),
        nn.Flatten(), nn.Linear(8, 2),
    )  # fmt: skip
    return model, (torch.randn(3, 2, 3),)


class ExpandedToTheBatch(nn.Module):
    """Parameters expanded to the batch and met by it on dim 0: a class token concatenated
    before the tokens (ViT's ``cls.expand(N, -1, -1)``), a learned query added (Perceiver's
    decoder), a bias viewed and expanded as the activations (``expand_as``), a gain
    broadcast with ``torch.broadcast_to`` and multiplied in. They were refused ("a parameter of
    shape (N, ...) spans the batch dim"; trial 73) although each example reads its own
    entries only."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.cls = nn.Parameter(torch.randn(1, 1, width))
        self.query = nn.Parameter(torch.randn(1, width))
        self.bias = nn.Parameter(torch.randn(width))
        self.gain = nn.Parameter(torch.rand(width) + 0.5)
        self.head = nn.Linear(width, 2)

    def forward(self, x):  # x: [N, T, 3]
        h = self.embed(x)
        n = h.shape[0]
        h = torch.cat([self.cls.expand(n, -1, -1), h], dim=1)  # [N, T + 1, width]
        h = torch.tanh(h + self.query.expand(n, -1, -1))
        h = h + self.bias.view(1, 1, -1).expand_as(h)
        h = h * torch.broadcast_to(self.gain, (n, 1, h.shape[-1]))
        return self.head(h)


def _expanded_to_the_batch():
    return ExpandedToTheBatch(), (torch.randn(3, 2, 3),)


class MergedBatch(nn.Module):
    """Layers run on the batch merged with the tokens, ``[N * T, d]``, the batch the outer
    factor: OPT's feed-forward (a LayerNorm and Linear layers on ``h.reshape(-1, d)``),
    Hugging Face's ``Conv1D`` (GPT-2: ``torch.addmm(b, h.view(-1, d), W)``), a product with a
    weight; split back out for the next layer, or not at all (the output stays merged). Both
    were refused ("a batch of N * T rows"); each layer's rows now sum its examples' blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(3)
        self.fc = nn.Linear(3, 4)
        self.conv1d_weight = nn.Parameter(torch.randn(4, 4))  # Conv1D's layout: [in, out]
        self.conv1d_bias = nn.Parameter(torch.randn(4))
        self.proj = nn.Parameter(torch.randn(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # x: [N, T, 3]
        n, t, d = x.shape
        h = torch.tanh(self.fc(self.norm(x.reshape(-1, d))))
        h = torch.tanh(torch.addmm(self.conv1d_bias, h, self.conv1d_weight))
        h = (h.view(n, t, -1) @ self.proj.T).flatten(0, 1)  # merged again, x @ W.T
        return self.head(h)  # [N * T, 2]


def _merged_batch():
    return MergedBatch(), (torch.randn(3, 4, 3),)


class Bags(nn.Module):
    """``nn.EmbeddingBag`` over ids [N, L] (one bag per example; row 0 pads), then a head."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=0)
        self.head = nn.Linear(4, 3)

    def forward(self, ids, weights=None):
        return self.head(torch.tanh(self.bag(ids, per_sample_weights=weights)))


#: Example 0 looks up row 3 twice (one Jacobian entry of weight 2), example 2 only padding (an
#: empty bag), examples 1 and 3 share rows 2 and 4.
BAG_IDS = torch.tensor([[1, 3, 3, 0], [2, 5, 0, 4], [0, 0, 0, 0], [4, 8, 2, 3]])


def _bags(mode: str, weighted: bool = False):
    def build():
        inputs = (BAG_IDS, torch.rand(BAG_IDS.shape)) if weighted else (BAG_IDS,)
        return Bags(mode), inputs

    return build


MODELS = {
    "mlp": _batch_mlp,
    "sequence_mlp": _sequence_mlp,
    "conv2d_groups": _conv2d,
    "conv1d": _conv1d,
    "conv_padding_words": _conv_padding_words,
    "embedding_layernorm": _tokens,
    "multihead_attention": _attention,
    "encoder_layer": _encoder_layer,
    "hand_written_affine": _affine,
    "gain_on_the_input": _gain_on_the_input,
    "batch_norm_eval": _batch_norm_eval,
    "group_norm": _group_norm,
    "instance_norm": _instance_norm,
    "rms_norm": _rms_norm,
    "computed_from_parameters": _computed_from_parameters,
    "matrix_products": _matrix_products,
    "expanded_to_the_batch": _expanded_to_the_batch,
    "merged_batch": _merged_batch,
    "embedding_bag_sum": _bags("sum", weighted=True),
    "embedding_bag_mean": _bags("mean"),
    "embedding_bag_max": _bags("max"),
}


def _build(name: str):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    return model.double().eval(), tuple(x.double() if x.is_floating_point() else x for x in inputs)


def _loss(out):
    """A per-example sum (reduction weight 1 per entry, alone or in the batch)."""
    return (out.tanh() * torch.linspace(0.5, 1.5, out.shape[-1], dtype=out.dtype)).sum()


def _example(inputs, i):
    return tuple(x[i : i + 1] for x in inputs)


def _assert_real_rows_are_per_example_gradients(model, inputs) -> None:
    """``per_sample=True`` under Real: every trainable parameter's row ``i`` equals the
    autograd gradient of example ``i``'s loss alone."""
    with semipack.extend(model, semipack.Real(), per_sample=True):
        _loss(model(*inputs)).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        for i in range(inputs[0].shape[0]):
            alone = tuple(t[i : i + 1] for t in inputs)
            expected = torch.autograd.grad(_loss(model(*alone)), p)[0]
            torch.testing.assert_close(p.semiring_grad_batch[i], expected, msg=f"{name} {i}")


def _per_sample(model, inputs, sr, **kwargs):
    for p in model.parameters():
        p.grad = None
    with semipack.extend(model, sr, per_sample=True, **kwargs):
        _loss(model(*inputs)).backward()
    return dict(model.named_parameters())


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("semiring_name", NAMES)
def test_rows_sum_to_semiring_grad(model_name, semiring_name):
    model, inputs = _build(model_name)
    sr = SEMIRINGS[semiring_name]()
    params = _per_sample(model, inputs, sr, keep_state=True)
    n = inputs[0].shape[0]
    for name, p in params.items():
        rows = p.semiring_state_batch
        assert all(part.shape == (n, *p.shape) for part in rows), name
        total = sr.readout(sr.sum(rows, [0]))
        assert_readout_matches(semiring_name, p.semiring_grad, total, f"{model_name} {name}")


@pytest.mark.parametrize("model_name", ["mlp", "sequence_mlp", "multihead_attention"])
def test_readout_sums(model_name):
    """The sum over rows in the readouts' own terms: Real adds, MaxProd maxes, LogSum
    log-sum-exps; and p.grad stays the plain gradient."""
    model, inputs = _build(model_name)
    _loss(model(*inputs)).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    for sr, total in (
        (semipack.Real(), lambda r: r.sum(0)),
        (semipack.MaxProd(), lambda r: r.amax(0)),
        (semipack.LogSum(), lambda r: r.logsumexp(0)),
    ):
        rows = {}
        for name, p in _per_sample(model, inputs, sr).items():
            assert torch.equal(p.grad, plain[name]), name
            rows[name] = p.semiring_grad_batch
            assert p.semiring_grad_batch.shape == (inputs[0].shape[0], *p.shape)
            torch.testing.assert_close(total(p.semiring_grad_batch), p.semiring_grad)
        for name, p in _per_sample(model, inputs, sr, regular_grads=False).items():
            assert p.grad is None  # the same rows without the regular gradient
            torch.testing.assert_close(p.semiring_grad_batch, rows[name], rtol=0, atol=0)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("semiring_name", NAMES)
def test_rows_equal_single_examples(model_name, semiring_name):
    model, inputs = _build(model_name)
    sr = SEMIRINGS[semiring_name]()
    rows = {n: p.semiring_grad_batch for n, p in _per_sample(model, inputs, sr).items()}
    for i in range(inputs[0].shape[0]):
        with semipack.extend(model, sr, extensions=False):
            _loss(model(*_example(inputs, i))).backward()
        for name, p in model.named_parameters():
            row = rows[name]
            row = type(row)(*(r[i] for r in row)) if isinstance(row, tuple) else row[i]
            assert_readout_matches(semiring_name, p.semiring_grad, row, f"{name} example {i}")


@pytest.mark.parametrize("model_name", list(MODELS))
def test_real_rows_are_per_example_gradients(model_name):
    model, inputs = _build(model_name)
    rows = {
        n: p.semiring_grad_batch for n, p in _per_sample(model, inputs, semipack.Real()).items()
    }
    params = list(model.parameters())
    for i in range(inputs[0].shape[0]):
        grads = torch.autograd.grad(_loss(model(*_example(inputs, i))), params)
        for (name, _), g in zip(model.named_parameters(), grads, strict=True):
            torch.testing.assert_close(rows[name][i], g, rtol=1e-10, atol=1e-12)


def test_mean_reduction_weights_are_in_the_rows():
    """With a mean loss each row carries the 1/N edge: it equals example n alone with its
    loss divided by N (Real: BackPACK's grad_batch convention)."""
    model, (x,) = _build("mlp")
    y = torch.tensor([0, 2, 1, 1, 0])
    for sr in (semipack.Real(), semipack.MaxProd(), semipack.LogSum()):
        with semipack.extend(model, sr, per_sample=True):
            F.cross_entropy(model(x), y).backward()
        rows = {n: p.semiring_grad_batch for n, p in model.named_parameters()}
        for i in range(len(x)):
            with semipack.extend(model, sr, extensions=False):
                (F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]) / len(x)).backward()
            for name, p in model.named_parameters():
                torch.testing.assert_close(rows[name][i], p.semiring_grad, rtol=1e-10, atol=1e-12)


def test_entropy_rows_combine_with_logsum_masses():
    """The path distribution of the batch is the mixture of the examples' distributions with
    weights w_n = Z_n / Z (LogSum's rows): H = Σ_n w_n (H_n - log w_n)."""
    model, inputs = _build("sequence_mlp")
    entropy = {
        n: p.semiring_grad_batch for n, p in _per_sample(model, inputs, semipack.Entropy()).items()
    }
    total = {n: p.semiring_grad.clone() for n, p in model.named_parameters()}
    mass = {
        n: p.semiring_grad_batch for n, p in _per_sample(model, inputs, semipack.LogSum()).items()
    }
    for name in total:
        log_w = mass[name] - mass[name].logsumexp(0, keepdim=True)
        mixed = (log_w.exp() * (entropy[name] - log_w)).sum(0)
        torch.testing.assert_close(mixed, total[name])


def test_template_default_runs_messages_per_example():
    """An extension without a per_sample of its own gets ExtensionFunction's: its messages
    once per example. A Linear routed to such an extension gives the fused rows."""
    from semipack.extensions.base import ExtensionFunction, extending, per_sample_rule
    from semipack.extensions.linear import LinearFunction

    calls = []

    @per_sample_rule
    class LoopLinear(LinearFunction):
        @classmethod
        def per_sample(cls, call):
            calls.append(cls.batch_size(call))
            return ExtensionFunction.per_sample.__func__(cls, call)

    def handler(input, weight, bias=None):
        return LoopLinear.run(F.linear, [input, weight, bias])

    model, inputs = _build("sequence_mlp")
    for sr in (semipack.MaxProd(), semipack.Entropy()):
        fused = {n: p.semiring_grad_batch for n, p in _per_sample(model, inputs, sr).items()}
        with extending(handler, F.linear):
            looped = _per_sample(model, inputs, sr)
        for name, p in looped.items():
            torch.testing.assert_close(p.semiring_grad_batch, fused[name], equal_nan=True)
    assert calls == [4, 4, 4, 4]  # two layers, two semirings, batch of 4


def test_bert():
    """A tiny Hugging Face BERT (eager attention, padding mask) with position ids given per
    example: rows sum to semiring_grad and equal each example alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel._from_config(tiny_bert_config(), attn_implementation="eager")
    model = model.double().eval()
    ids = torch.tensor([[1, 5, 7, 2], [1, 9, 2, 0], [1, 3, 3, 2]])
    mask = (ids != 0).long()
    pos = torch.arange(4).expand(3, 4)

    def run(sl, sr, **kwargs):
        with semipack.extend(model, sr, **kwargs):
            out = model(ids[sl], attention_mask=mask[sl], position_ids=pos[sl])
            out.last_hidden_state.pow(2).sum().backward()

    for sr in (semipack.MaxProd(), semipack.LogSum(), semipack.Entropy(), semipack.Real()):
        run(slice(None), sr, per_sample=True, keep_state=True)
        # the pooler is not on the way to last_hidden_state
        named = {n: p for n, p in model.named_parameters() if not n.startswith("pooler.")}
        assert not any(hasattr(p, "semiring_grad_batch") for p in model.pooler.parameters())
        rows = {n: p.semiring_grad_batch for n, p in named.items()}
        assert rows["embeddings.word_embeddings.weight"].shape == (3, 20, 8)
        for p in named.values():
            total = sr.readout(sr.sum(p.semiring_state_batch, [0]))
            torch.testing.assert_close(total, p.semiring_grad, equal_nan=True)
        for i in range(3):
            run(slice(i, i + 1), sr, extensions=False)
            for name, p in named.items():
                torch.testing.assert_close(rows[name][i], p.semiring_grad, equal_nan=True)


def _rows_of_single_examples(model, loss, sr, n: int) -> dict:
    """Per-sample rows of ``loss(slice(None))``, each checked against a pass over that example
    alone (``loss(slice(i, i + 1))``, generic path) and, for Real, autograd's gradient."""
    with semipack.extend(model, sr, per_sample=True):
        loss(slice(None)).backward()
    rows = {name: p.semiring_grad_batch for name, p in model.named_parameters()}
    for i in range(n):
        with semipack.extend(model, sr, extensions=False):
            loss(slice(i, i + 1)).backward()
        for name, p in model.named_parameters():
            # Entropy reads NaN where no path reaches (an embedding row no token looked up)
            torch.testing.assert_close(rows[name][i], p.semiring_grad, msg=name, equal_nan=True)
            if isinstance(sr, semipack.Real):
                want = torch.autograd.grad(loss(slice(i, i + 1)), p)[0]
                torch.testing.assert_close(rows[name][i], want, msg=name)
    return rows


def test_falcon_projections_written_as_matrix_products():
    """Falcon's linear layers compute ``input @ self.weight.T``: its per-sample values were
    refused (the merged-batch ``mm``). Rows equal each example alone (the generic path, no
    extension), and Real's rows are the per-example gradients autograd gives."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        new_decoder_architecture=False, parallel_attn=True, bias=True,
    )  # fmt: skip
    model = transformers.FalconModel._from_config(config, attn_implementation="eager")
    model = model.double().eval()
    ids = torch.tensor([[1, 5, 7, 2], [4, 9, 2, 3], [1, 3, 3, 2]])

    def loss(sl):
        return model(ids[sl]).last_hidden_state.pow(2).sum()

    for sr in (semipack.MaxProd(), semipack.LogSum(), semipack.Real()):
        rows = _rows_of_single_examples(model, loss, sr, 3)
        assert rows["h.0.self_attention.dense.weight"].shape == (3, 8, 8)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_gpt2_and_opt_layers_on_the_merged_batch(family):
    """GPT-2's projections are Hugging Face's ``Conv1D`` (``torch.addmm`` on ``h.view(-1, d)``),
    OPT's feed-forward runs LayerNorm and Linear layers on ``h.reshape(-1, d)``: both were
    refused. Rows equal each example alone (the generic path) with a padding mask, and Real's
    rows are the per-example gradients autograd gives."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=30, n_embd=8, n_layer=2, n_head=2, n_positions=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2Model._from_config(config, attn_implementation="eager")
        ffn = "h.1.mlp.c_fc.weight"
    else:
        config = transformers.OPTConfig(
            vocab_size=30, hidden_size=8, num_hidden_layers=2, ffn_dim=12, num_attention_heads=2,
            max_position_embeddings=16, word_embed_proj_dim=8, dropout=0.0,
        )  # fmt: skip
        # sdpa: OPT's eager attention takes its softmax in float32 (1e-7 from float64 values)
        model = transformers.OPTModel._from_config(config, attn_implementation="sdpa")
        ffn = "decoder.layers.1.fc1.weight"
    model = model.double().eval()
    ids = torch.tensor([[1, 5, 7, 2, 6], [4, 9, 2, 3, 3], [1, 3, 3, 0, 0]])
    mask = (ids != 0).long()
    pos = torch.arange(5).expand(3, 5)

    def loss(sl):
        out = model(ids[sl], attention_mask=mask[sl], position_ids=pos[sl])
        return out.last_hidden_state.tanh().sum()

    for sr in (semipack.MaxProd(), semipack.Entropy(), semipack.Real()):
        rows = _rows_of_single_examples(model, loss, sr, 3)
        assert rows[ffn].shape == (3, *dict(model.named_parameters())[ffn].shape)


def test_mobilevit_patches_merged_with_the_batch():
    """Hugging Face's MobileViT folds each image into patches merged with the batch
    (``[N * P, T, d]``) for its transformer layers: the batch is the merged dim's outer factor,
    so its rows are each image's own (the README once listed it as refused; trial 109)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MobileViTConfig(
        image_size=32, patch_size=2, hidden_sizes=[8, 12, 16],
        neck_hidden_sizes=[4, 4, 8, 8, 12, 12, 16], num_attention_heads=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.MobileViTModel(config).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)

    def loss(sl):
        return model(pixel_values=x[sl]).pooler_output.pow(2).sum()

    rows = _rows_of_single_examples(model, loss, semipack.LogSum(), 2)
    name = "encoder.layer.2.transformer.layer.0.attention.attention.query.weight"
    assert rows[name].shape == (2, *dict(model.named_parameters())[name].shape)


def test_bert_sdpa_rows_equal_eager_rows():
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([[1, 5, 7, 2], [1, 9, 2, 0]])
    rows = {}
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = transformers.BertModel._from_config(tiny_bert_config(), attn_implementation=impl)
        model = model.double().eval()
        with semipack.extend(model, semipack.LogSum(), per_sample=True):
            out = model(
                ids, attention_mask=(ids != 0).long(), position_ids=torch.arange(4).expand(2, 4)
            )
            out.pooler_output.sum().backward()
        rows[impl] = {n: p.semiring_grad_batch for n, p in model.named_parameters()}
    for name, row in rows["eager"].items():
        torch.testing.assert_close(rows["sdpa"][name], row)


def test_bert_position_ids_broadcast_refused():
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel._from_config(tiny_bert_config(), attn_implementation="eager")
    ids = torch.tensor([[1, 5, 7, 2], [1, 9, 2, 0]])
    with semipack.extend(model.eval(), semipack.MaxProd(), per_sample=True):
        loss = model(ids).last_hidden_state.sum()
        with pytest.raises(
            PerSampleError, match=r"'embeddings.position_embeddings.weight' \(1 row\)"
        ) as e:
            loss.backward()
    assert "pass position_ids of shape [N, T]" in str(e.value)
    assert "bucket table" not in str(e.value)
    assert all(p.grad is None for p in model.parameters())  # nothing written


class _RelativeBias(nn.Module):
    """A bias looked up from a [T, T] table of relative positions (T5's and MPNet's buckets),
    added to scores [N, T, T]: the table holds no examples."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.bias = nn.Embedding(9, 1)

    def forward(self, x):
        t = x.shape[1]
        buckets = torch.arange(t)[None, :] - torch.arange(t)[:, None] + 4
        h = self.proj(x)
        return (h @ h.transpose(1, 2) + self.bias(buckets)[..., 0]).softmax(-1).sum((1, 2))


def test_a_relative_position_table_is_named_as_the_cause():
    """With T != N the table's rows have T entries where the others have N: the refusal names
    a table built from positions (trial 66: MPNet's said to pass position_ids [N, T], which
    changed nothing)."""
    model = _RelativeBias().double()
    with semipack.extend(model, semipack.Real(), per_sample=True):
        loss = model(torch.randn(2, 5, 3, dtype=torch.float64)).sum()
        with pytest.raises(PerSampleError) as refused:
            loss.backward()
    message = str(refused.value)
    assert (
        "the model's first tensor argument, of shape (2, 5, 3) has 2 examples in dim 0 (the "
        "batch), but 'bias.weight' (5 rows) did not" in message
    )
    assert "relative-position bucket table" in message and "position_ids" not in message
    assert all(p.grad is None for p in model.parameters())


def test_product_rows_per_factor():
    model, inputs = _build("sequence_mlp")
    factors = (semipack.MaxProd(), semipack.Entropy(), semipack.LogSum())
    product = _per_sample(model, inputs, semipack.Product(*factors))
    rows = {n: p.semiring_grad_batch for n, p in product.items()}
    for k, sr in enumerate(factors):
        for name, p in _per_sample(model, inputs, sr).items():
            torch.testing.assert_close(rows[name][k], p.semiring_grad_batch, equal_nan=True)


def test_later_pass_without_per_sample_removes_rows():
    model, inputs = _build("mlp")
    _per_sample(model, inputs, semipack.MaxProd())
    with semipack.extend(model, semipack.MaxProd()):
        _loss(model(*inputs)).backward()
    assert not any(hasattr(p, "semiring_grad_batch") for p in model.parameters())


def test_shared_layer_used_twice():
    """A layer applied twice: its rows add both uses, example by example."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    model = nn.Sequential(lin, nn.Tanh(), lin)
    x = torch.randn(4, 3, dtype=torch.float64)
    for sr, name in ((semipack.MaxProd(), "max_prod"), (semipack.Entropy(), "entropy")):
        rows = {n: p.semiring_grad_batch for n, p in _per_sample(model, (x,), sr).items()}
        for i in range(4):
            with semipack.extend(model, sr, extensions=False):
                _loss(model(x[i : i + 1])).backward()
            for n, p in model.named_parameters():
                assert_readout_matches(name, p.semiring_grad, rows[n][i], f"{n} {i}")


# --- refusals ----------------------------------------------------------------------------------


def _refused(model, inputs, match, sr=None, **kwargs):
    for p in model.parameters():
        p.grad = None
    with semipack.extend(model, sr or semipack.MaxProd(), per_sample=True, **kwargs):
        loss = _loss(model(*inputs))
        with pytest.raises(PerSampleError, match=match):
            loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert not any(hasattr(p, "semiring_grad_batch") for p in model.parameters())


def test_batch_norm_in_train_mode_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2))
    _refused(
        model.train(),
        (torch.randn(5, 3),),
        r"NativeBatchNormBackward0 \(created by module '1'\) mixes them: batch norm in train "
        r"mode normalises over the batch \(use eval mode\)$",
    )


def test_every_batch_norm_in_train_mode_is_named():
    """Each layer that mixes the examples is one the user must change: the refusal names the
    others too (trial 120: it named the last batch norm alone)."""
    model = nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)
    )
    _refused(
        model.train(),
        (torch.randn(5, 3),),
        r"NativeBatchNormBackward0 \(created by module '3'\) mixes them: batch norm in train "
        r"mode normalises over the batch \(use eval mode\); the model has 1 more such node: "
        r"NativeBatchNormBackward0 \(created by module '1'\)$",
    )


def test_batch_norm_that_hides_its_mode_is_mixing():
    """cuDNN's batch norm node does not record train or eval mode: refused, never guessed."""
    from semipack.rules.per_sample import mixing_reason

    class CudnnNode:
        def name(self):
            return "CudnnBatchNormBackward0"

    assert "does not record whether it ran in train mode" in mixing_reason(CudnnNode())


class Centred(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_reduction_over_the_batch_refused():
    model = nn.Sequential(nn.Linear(3, 4), Centred(), nn.Linear(4, 2))
    _refused(
        model,
        (torch.randn(5, 3),),
        r"MeanBackward1 \(created by module '1'\) mixes them: it reduces over dim 0 \(the "
        r"batch\) of a tensor of shape \(5, 4\)",
    )


class Gram(nn.Module):
    def forward(self, x):
        return (x @ x.T) @ x


def test_gram_matrix_over_the_batch_refused():
    model = nn.Sequential(nn.Linear(3, 4), Gram(), nn.Linear(4, 2))
    _refused(
        model,
        (torch.randn(5, 3),),
        r"MmBackward0 \(created by module '1'\) mixes them: it multiplies a batch by its own "
        r"transpose \(x @ x.T\)",
    )


class MatrixProduct(nn.Module):
    """``torch.mm`` with a parameter: no extension takes it (``x @ w`` is a linear layer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return torch.mm(x, self.w)


class OffsetBags(nn.Module):
    """``nn.EmbeddingBag`` over flat ids and offsets, with ``order`` saying which of the two
    the model takes first (the block's batch)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.bag = nn.EmbeddingBag(9, 4, mode="sum").double()
        self.head = nn.Linear(4, 3).double()

    def forward(self, first, second):
        ids, offsets = (first, second) if self.order == "ids first" else (second, first)
        return self.head(torch.tanh(self.bag(ids, offsets)))


#: Three bags over flat ids: [1, 3, 3], [2, 5], [4, 8, 2, 3].
FLAT_IDS, BAG_OFFSETS = torch.tensor([1, 3, 3, 2, 5, 4, 8, 2, 3]), torch.tensor([0, 3, 5])


@pytest.mark.parametrize("semiring_name", ["real", "max_prod", "log_sum", "entropy"])
def test_embedding_bag_offsets_that_carry_the_batch_give_rows(semiring_name):
    """Offsets [N] as the model's batch: bag n is example n, each row the pass over that bag
    alone (its ids, offsets [0])."""
    torch.manual_seed(0)
    model, sr = OffsetBags("offsets first"), SEMIRINGS[semiring_name]()
    params = _per_sample(model, (BAG_OFFSETS, FLAT_IDS), sr)
    rows = {name: p.semiring_grad_batch for name, p in params.items()}
    ends = [*BAG_OFFSETS.tolist()[1:], FLAT_IDS.numel()]
    for i, (start, end) in enumerate(zip(BAG_OFFSETS.tolist(), ends, strict=True)):
        with semipack.extend(model, sr, extensions=False):
            _loss(model(torch.tensor([0]), FLAT_IDS[start:end])).backward()
        for name, p in model.named_parameters():
            row = rows[name]
            row = type(row)(*(r[i] for r in row)) if isinstance(row, tuple) else row[i]
            assert_readout_matches(semiring_name, p.semiring_grad, row, f"{name} bag {i}")


class DenseAndBags(nn.Module):
    """DLRM's layout: dense features first (the batch), then flat ids and their offsets [N]."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(3, 4).double()
        self.bag = nn.EmbeddingBag(9, 4, mode="sum").double()
        self.head = nn.Linear(4, 2).double()

    def forward(self, features, ids, offsets):
        return self.head(torch.tanh(self.dense(features) + self.bag(ids, offsets)))


def test_embedding_bag_offsets_beside_dense_features_give_rows():
    """Offsets [N] as a later argument: their mark meets the batch at the add, so bag n is
    example n (trial 127 found ids [N, L] there working, and the README saying otherwise)."""
    torch.manual_seed(0)
    model, sr = DenseAndBags(), semipack.MaxProd()
    features = torch.randn(3, 3, dtype=torch.float64)
    rows = _per_sample(model, (features, FLAT_IDS, BAG_OFFSETS), sr)["bag.weight"]
    rows = rows.semiring_grad_batch
    ends = [*BAG_OFFSETS.tolist()[1:], FLAT_IDS.numel()]
    for i, (start, end) in enumerate(zip(BAG_OFFSETS.tolist(), ends, strict=True)):
        with semipack.extend(model, sr, extensions=False):
            _loss(model(features[i : i + 1], FLAT_IDS[start:end], torch.tensor([0]))).backward()
        assert_readout_matches("max_prod", model.bag.weight.semiring_grad, rows[i], f"bag {i}")


def test_embedding_bag_rows_inside_a_checkpoint_are_refused_by_name():
    """The bag's row rule reads the lookups its node saved; inside a non-reentrant checkpoint
    the node's own backward could not read them again: refused, naming the bag."""
    torch.manual_seed(0)
    bags = Bags("mean").double()

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = bags

        def forward(self, ids):
            return checkpoint(self.inner, ids, use_reentrant=False)

    model = Checkpointed()
    with semipack.extend(model, semipack.MaxProd(), per_sample=True):
        loss = _loss(model(BAG_IDS))
        with pytest.raises(PerSampleError, match="an embedding bag's lookups"):
            loss.backward()


def test_embedding_bag_over_flat_ids_as_the_batch_refused():
    """Flat ids as the model's first argument: one entry per lookup, not per bag."""
    torch.manual_seed(0)
    _refused(
        OffsetBags("ids first"),
        (FLAT_IDS, BAG_OFFSETS),
        re.escape(
            "parameter 'bag.weight' (or a value computed from it alone) is used by "
            "EmbeddingBagBackward0, created by module 'bag', where an embedding bag's bags are "
            "known to be its examples with ids of shape [N, L] whose dim 0 is the batch"
        ),
    )


def test_op_without_per_sample_rule_refused():
    model = nn.Sequential(nn.Linear(3, 4), MatrixProduct(), nn.Linear(4, 2))
    _refused(
        model,
        (torch.randn(5, 3),),
        r"parameter '1.w' is used by MmBackward0, created by module '1', which has no "
        r"per-sample rule",
    )


class RmsNormOfPermuted(nn.Module):
    """``F.rms_norm`` of examples put in another order: its input lost the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.gain = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):
        return F.rms_norm(self.proj(x)[torch.tensor([1, 0, 2])], (6,), self.gain)


def _readouts_as_float(value):
    """A readout as float32 tensors (SignedMaxProd's is a pair), for comparing half-precision
    models' rows, whose state is float32."""
    if isinstance(value, tuple):
        return tuple(v.float() for v in value)
    return value.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("semiring_name", NAMES)
def test_an_rms_norm_in_half_precision_has_rows(dtype, semiring_name):
    """In bfloat16 and float16 ``F.rms_norm`` computes in float32 and casts back, so its
    gain's product is the value under the result's cast, not the result (refused until the
    thirty-third session, trial 113). A cast moves no entry: the product has the batch where
    the result has it, and the gain's rows are each example's own, equal to a pass over that
    example alone; Real's are autograd's per-example gradients (float32 state, so up to the
    rounding of the half-precision gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    sr = SEMIRINGS[semiring_name]()
    with semipack.extend(model, sr, per_sample=True):
        model(x).float().square().sum().backward()
    rows = {name: p.semiring_grad_batch for name, p in model.named_parameters()}
    assert rows["1.weight"] is not None
    for i in range(3):
        model.zero_grad()
        with semipack.extend(model, sr, extensions=False):
            model(x[i : i + 1]).float().square().sum().backward()
        for name, p in model.named_parameters():
            row = rows[name]
            row = type(row)(*(r[i] for r in row)) if isinstance(row, tuple) else row[i]
            torch.testing.assert_close(
                _readouts_as_float(row),
                _readouts_as_float(p.semiring_grad),
                rtol=1e-5,
                atol=1e-6,
                equal_nan=True,
                msg=lambda m, name=name, i=i: f"{name} example {i}: {m}",
            )
            if semiring_name == "real":
                torch.testing.assert_close(row, p.grad.float(), rtol=1e-2, atol=1e-3)


def test_an_rms_norm_of_a_lost_batch_names_the_cause():
    """The refusal names the layer and how its input lost the batch; it blamed "a value
    computed inside 'rms_norm'" (trial 113)."""
    _refused(
        RmsNormOfPermuted().double(),
        (torch.randn(3, 4, dtype=torch.float64),),
        r"parameter 'gain' is used by RMSNorm \(the root module\) on an input of shape \(3, 6\) "
        r"computed from the model's input in which no dim holds one example per index "
        r"\(indexing picked or reordered examples\)",
    )


def test_every_node_of_an_rms_norm_off_the_batch_names_the_layer():
    """``F.rms_norm`` of ``h.transpose(0, 1)`` is a layer on an input whose batch is on dim 1:
    every node the call made carries the problem (``MISPLACED_KEY``), the one using the gain
    whatever it is: the CPU's composite product, or a GPU's fused node, which no other check
    would stop (it reads any dim 0 as the batch)."""
    from semipack.rules.per_sample import INSIDE_CALL_KEY
    from semipack.transport.batch_following import MISPLACED_KEY

    model = SequenceFirstRmsNorm().double()
    with semipack.extend(model, semipack.MaxProd(), per_sample=True):
        out = model(torch.randn(3, 3, 4, dtype=torch.float64))
        made, stack, seen = [], [out.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.metadata.get(INSIDE_CALL_KEY) == "rms_norm":
                made.append(node)
            stack.extend(n for n, _ in node.next_functions)
        assert {n.name() for n in made} >= {"MulBackward0", "RsqrtBackward0", "PowBackward0"}
        for node in made:
            assert node.metadata[MISPLACED_KEY].startswith("RMSNorm (the root module) on an input")


@pytest.mark.parametrize("semiring_name", ["real", "max_prod", "log_sum", "entropy"])
def test_fused_rms_norm_rows_are_the_composites(semiring_name):
    """The gain's rows through a GPU's fused RMS norm node (``FusedRmsNormBackward0``: a
    stand-in object with its saved tensors here, the node exists on a GPU only) equal the rows
    of the CPU's composite, whose gain is a factor of its ``MulBackward0``."""
    from semipack.rules.per_sample import row_rule

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    gain = torch.tensor([1.5, -0.5, 0.0, 2.0], dtype=torch.float64)
    weights = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    sr = SEMIRINGS[semiring_name]()
    model = nn.RMSNorm(4, eps=1e-6).double()
    with torch.no_grad():
        model.weight.copy_(gain)
    with semipack.extend(model, sr, per_sample=True, keep_state=True):
        (model(x) * weights).sum().backward()
    want = model.weight.semiring_state_batch
    want = want if isinstance(want, tuple) else (want,)

    class FusedNode:
        _saved_input = x
        _saved_result1 = (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
        _saved_normalized_shape = (4,)

        def name(self) -> str:
            return "FusedRmsNormBackward0"

    node = FusedNode()
    rows = row_rule(node)(sr, node, sr.lift(weights), 1)
    for a, b in zip(rows, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)
    with pytest.raises(PerSampleError, match="rms_norm's input is no parameter's use"):
        row_rule(node)(sr, node, sr.lift(weights), 0)


class Repeated(nn.Module):
    """A gain repeated by hand: a repeat has rows only as instance norm's inner op."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.randn(2))

    def forward(self, x):
        return x * self.g.repeat(2)


def test_a_repeat_outside_instance_norm_refused():
    _refused(
        nn.Sequential(nn.Linear(3, 4), Repeated()),
        (torch.randn(5, 3),),
        r"parameter '1.g' is used by RepeatBackward0, created by module '1', which has no "
        r"per-sample rule",
    )


class InstanceNormOfTheChannels(nn.Module):
    """An instance norm of ``h.transpose(0, 1)``: its "examples" are the channels. With as many
    channels as examples the rows had the batch's count and came out silently (the norm's
    problem sat on its output node, not on the repeat of its parameters that the check reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 1)
        self.norm = nn.InstanceNorm1d(3, affine=True)
        self.head = nn.Linear(5, 1)

    def forward(self, x):  # x: [N, 2, 5]
        h = self.conv(x).transpose(0, 1)  # [3, N, 5]
        return self.head(self.norm(h).transpose(0, 1))


def test_instance_norm_off_the_batch_refused():
    _refused(
        InstanceNormOfTheChannels(),
        (torch.randn(3, 2, 5),),
        r"parameter 'norm.bias' is used by InstanceNorm \(module 'norm'\) on an input of shape "
        r"\(3, 3, 5\) computed from the model's input in which the batch is on dim 1",
    )


def test_parameter_spanning_the_batch_refused():
    class PerRow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.ones(5, 4))

        def forward(self, x):
            return x + self.table

    _refused(
        nn.Sequential(nn.Linear(3, 4), PerRow()),
        (torch.randn(5, 3),),
        r"parameter '1\.table' \(or a value computed from it alone\) is used by AddBackward0, "
        r"created by module '1', where its value, of shape \(5, 4\), spans the batch dim of the "
        r"output, of shape \(5, 4\)",
    )


def test_a_bias_expanded_as_the_batched_input_has_rows():
    """``b.view(1, C, 1, 1).expand_as(h)`` broadcasts the bias over the batch dim too; each
    example reads its own entries of the expanded value, so the expand gives the rows (it was
    refused as spanning the batch, trial 62's message; trial 73 asked for rows)."""

    class ExpandedBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3)
            self.bias = nn.Parameter(torch.randn(3))

        def forward(self, x):
            h = self.conv(x)
            return torch.tanh(h + self.bias.view(1, 3, 1, 1).expand_as(h)).flatten(1)

    torch.manual_seed(0)
    model = ExpandedBias().double()
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    for sr in (semipack.Real(), semipack.MaxProd(), semipack.Entropy()):
        _rows_of_single_examples(model, lambda rows: _loss(model(x[rows])), sr, 4)


def test_a_parameter_expanded_to_as_many_tokens_as_examples_is_no_batch():
    """``x + p.expand(T, d)`` on ``x`` of shape [N, T, d] with T == N: the expanded dim 0 has
    the batch's size but lands on the tokens, so it is no batch dim (its provisional mark is
    refuted), and the add's rule sums the rows over the tokens as for any broadcast parameter."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 4)
            self.position = nn.Parameter(torch.randn(4))

        def forward(self, x):
            h = self.embed(x)
            return torch.tanh(h + self.position.expand(h.shape[1], -1))

    torch.manual_seed(0)
    model = Positions().double()
    x = torch.randn(3, 3, 2, dtype=torch.float64)  # 3 examples of 3 tokens
    for sr in (semipack.Real(), semipack.MaxProd()):
        _rows_of_single_examples(model, lambda rows: _loss(model(x[rows])), sr, 3)


class BufferTimesGain(nn.Module):
    """A weight computed from a fixed buffer and a trainable gain, ``proj * gain``."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(outputs, inputs))
        self.gain = nn.Parameter(torch.rand(inputs) + 0.5)

    def forward(self, x):
        return F.linear(x, self.proj * self.gain)


def test_a_weight_computed_from_a_buffer_is_refused_even_when_its_rows_match_the_batch():
    """``proj * gain`` meets the gain with a buffer of shape [O, I]: the generic mul rule would
    read O as the batch. With O equal to the batch size it did, and gave each "example" an
    output unit's paths (rows 0 and 2 of 3 were wrong); now the pass is refused, naming the
    parameter, the op, the module and the factor, for any batch size."""
    for batch in (3, 5):
        model = nn.Sequential(BufferTimesGain(4, 3), nn.Tanh())
        _refused(
            model,
            (torch.randn(batch, 4),),
            r"parameter '0.gain' is used by MulBackward0, created by module '0', with a factor "
            r"of shape \(3, 4\) whose dim 0 is not the batch \(not computed from the model's "
            r"input, or with its batch moved off dim 0\): that operand need not carry the batch",
        )


class GemmaGain(nn.Module):
    """Gemma's RMSNorm gain ``x * (1 + w.float())`` in a float64 model: the gain is rounded to
    float32 on the way, and the rows round where the pass's messages do."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.weight = nn.Parameter(0.3 * torch.randn(4))

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x) * (1.0 + self.weight.float())))


@pytest.mark.parametrize("semiring_name", ["real", "max_prod", "log_sum", "entropy"])
def test_a_gain_computed_through_a_cast_has_each_examples_rows(semiring_name):
    """Refused before (trial 38: Gemma's per-sample values): the rows of ``1 + w.float()`` go
    back to ``w`` through the add and the cast, and each equals a pass on its example alone."""
    torch.manual_seed(3)
    model, x = GemmaGain().double(), torch.randn(4, 3, dtype=torch.float64)
    sr = SEMIRINGS[semiring_name]()
    rows = {n: p.semiring_grad_batch.clone() for n, p in _per_sample(model, (x,), sr).items()}
    for i in range(4):
        with semipack.extend(model, sr):
            _loss(model(x[i : i + 1])).backward()
        for name, p in model.named_parameters():
            assert_readout_matches(semiring_name, rows[name][i], p.semiring_grad, f"{name} {i}")


class NegativeDims(nn.Module):
    """Values computed from parameters with negative dims, a view PyTorch serves as an alias
    and a division by a Python number (trial 41: autograd saves a negative dim as an unsigned
    integer, and 1/3 was rounded to float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Parameter(torch.randn(3, 3, 3))
        self.mt = nn.Parameter(torch.randn(3, 3, 3))
        self.gain = nn.Parameter(torch.randn(3))
        self.square = nn.Parameter(torch.randn(5, 5))

    def forward(self, x):  # x: [N, 3, 5]
        h = F.conv1d(x, self.conv.transpose(-1, -2), padding=1)
        h = h + F.conv1d(x, self.mt.permute(0, -1, -2), padding=1)
        h = torch.tanh(h * self.gain.unsqueeze(-1))  # a gain per channel
        h = F.linear(h, self.square.permute(1, 0).reshape(5, 5) / 3.0)
        return h


def test_negative_dims_views_and_a_number_divisor_give_each_examples_rows():
    torch.manual_seed(8)
    model, x = NegativeDims().double(), torch.randn(4, 3, 5, dtype=torch.float64)
    with semipack.extend(model, semipack.Real(), per_sample=True):
        _loss(model(x)).backward()
    for name, p in model.named_parameters():
        for i in range(4):
            want = torch.autograd.grad(_loss(model(x[i : i + 1])), p)[0]
            torch.testing.assert_close(
                p.semiring_grad_batch[i], want, rtol=1e-13, atol=1e-15, msg=f"{name} {i}"
            )


def test_a_computed_value_inside_a_checkpoint_is_refused_by_name():
    """Inside a non-reentrant checkpoint a saved tensor may be unpacked once: a row rule that
    reads a factor there would break the node's own backward (``CheckpointError``). The pass
    raises ``PerSampleError`` instead and changes nothing (trial 41)."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(3, 4)
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            gain = lambda h: h * (1.0 + self.w)  # noqa: E731
            return checkpoint(gain, self.inp(x), use_reentrant=False).sum(-1)

    model = Checkpointed()
    block = semipack.extend(model, semipack.MaxProd(), per_sample=True)
    with block, pytest.raises(PerSampleError, match="inside a non-reentrant checkpoint"):
        model(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_value_computed_from_a_parameter_is_refused_where_a_use_has_no_rule():
    """Every use of a value computed from a parameter alone must be a rule's: one matmul
    beside the gain would leave its share out of the rows."""

    class TwoUses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(3, 4)
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            g = 1.0 + self.w
            return self.inp(x) * g + self.inp(x) @ torch.diag(g)

    _refused(
        TwoUses(),
        (torch.randn(2, 3),),
        r"parameter 'w' goes through AddBackward0, and the value computed from it is used by "
        r"DiagEmbedBackward0, which has no per-sample rule",
    )


def _refused_at_entry(model, sr, match, **kwargs):
    with (
        pytest.raises(PerSampleError, match=match),
        semipack.extend(model, sr, per_sample=True, **kwargs),
    ):
        pass


def test_path_semirings_refused():
    model = nn.Linear(2, 2)
    _refused_at_entry(model, semipack.TopPath(), "not supported for TopPath: its paths")
    _refused_at_entry(model, semipack.KBest(2), "not supported for KBest")


def test_sequence_first_attention_refused():
    model = nn.Sequential(nn.MultiheadAttention(4, 2))
    _refused_at_entry(model, semipack.MaxProd(), "'0' has batch_first=False")


def test_needs_model_and_extensions():
    _refused_at_entry(None, semipack.MaxProd(), "needs the model")
    _refused_at_entry(
        nn.Linear(2, 2), semipack.MaxProd(), "needs extensions=True", extensions=False
    )


class _Mixer(nn.Module):
    """A Linear whose output goes through ``mix`` (a function of the whole batch)."""

    def __init__(self, mix) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l, self.mix = nn.Linear(3, 4), mix

    def forward(self, x):
        return self.mix(self.l(x))


MIXING = {
    "amax(0)": lambda h: h - h.amax(0),
    "std(0)": lambda h: h / h.std(0),
    "var(0)": lambda h: h * h.var(0),
    "logsumexp(0)": lambda h: h - torch.logsumexp(h, 0),
    "norm(dim=0)": lambda h: h / h.norm(dim=0),
    "softmax(0)": lambda h: h.softmax(0),
    "log_softmax(0)": lambda h: h.log_softmax(0),
    "cumsum(0)": lambda h: h.cumsum(0),
    "sort(0)": lambda h: h.sort(0).values,
    "max(0)": lambda h: h - h.max(0).values,
    "mean()": lambda h: h - h.mean(),
    "amax()": lambda h: h / h.abs().amax(),
}
EXCHANGES = {
    "flip(0)": lambda h: h + h.flip(0),
    "roll(1, 0)": lambda h: h * h.roll(1, 0),
    "roll(1)": lambda h: h.roll(1),
}


@pytest.mark.parametrize("mix", list(MIXING))
def test_mixing_through_any_batch_reduction_is_refused(mix):
    """Each of these makes an example's output depend on the others': rows would be wrong
    (they still sum to semiring_grad), so the pass must refuse, naming the node."""
    _refused(_Mixer(MIXING[mix]), (torch.randn(5, 3),), r"mixes them: it reduces over")


@pytest.mark.parametrize("mix", list(EXCHANGES))
def test_exchanging_entries_along_the_batch_is_refused(mix):
    _refused(_Mixer(EXCHANGES[mix]), (torch.randn(5, 3),), r"mixes them: it moves entries along")


def test_flipping_features_is_not_mixing():
    model, x = _Mixer(lambda h: h.flip(1).roll(1, 1)).double(), torch.randn(4, 3).double()
    with semipack.extend(model, semipack.Real(), per_sample=True):
        _loss(model(x)).backward()
    for i in range(4):
        expected = torch.autograd.grad(_loss(model(x[i : i + 1])), model.l.weight)[0]
        torch.testing.assert_close(model.l.weight.semiring_grad_batch[i], expected)


@pytest.mark.parametrize("scaled", [False, True], ids=["sum", "sum / 3 + 1"])
def test_a_loss_computed_by_the_model_is_not_mixing(scaled: bool):
    """A model that returns its own scalar loss (a sum over the batch, the root) mixes no
    examples: the rows equal single examples' gradients. Also scaled after its reduction
    (``e.sum() / 3``, ViTMAE's ``(loss * mask).sum() / mask.sum()``): the reduction was
    refused as mixing the batch because the division, not the sum, is the root (trial 84)."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.hidden, self.out = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            loss = self.out(self.hidden(x).tanh()).tanh().sum()
            # (trial 87: a view of the scalar, ``unsqueeze(0).squeeze()``, was refused)
            return (loss / 3.0 + 1.0).unsqueeze(0).squeeze() if scaled else loss

    model, x = WithLoss().double(), torch.randn(5, 3, dtype=torch.float64)
    with semipack.extend(model, semipack.Real(), per_sample=True):
        model(x).backward()
    for p in model.parameters():
        for i in range(5):
            expected = torch.autograd.grad(model(x[i : i + 1]), p)[0]
            torch.testing.assert_close(p.semiring_grad_batch[i], expected)


@pytest.mark.parametrize(
    "tail", ["square", "product", "reciprocal", "variance", "plus a maximum", "plus an entry"]
)
def test_a_nonlinear_function_of_the_models_reduced_loss_mixes_the_examples(tail: str):
    """``e.sum() ** 2`` or ``e.sum() * e.mean()`` after the reduction mixes the examples'
    terms: accepted with the scaled loss, its rows differed from single examples' silently
    (trial 86). Refused, naming the reduction."""

    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            e = self.lin(x).pow(2)
            if tail == "reciprocal":  # trial 87: a quotient is linear in its numerator only
                return torch.tensor(3.0, dtype=x.dtype) / e.sum()
            if tail == "variance":  # trial 88: a reduction other than the loss's sum or mean
                return e.var()
            if tail == "plus a maximum":
                return e.sum() + e.amax()
            if tail == "plus an entry":  # example 0's entry: picked, no reduction at all
                return e.sum() + e[0, 0]
            return e.sum() ** 2 if tail == "square" else e.sum() * e.mean()

    model = Tail().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with semipack.extend(model, semipack.Real(), per_sample=True):
        loss = model(x)
        with pytest.raises(PerSampleError, match=r"mixes them|picked or reordered"):
            loss.backward()


class _PositionsSelected(nn.Module):
    """Positions computed from the ids, looked up in a table with ``index_select`` on the
    flattened positions and split back (M2M100's sinusoidal positions)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin = nn.Embedding(20, 4), nn.Linear(4, 2)
        self.register_buffer("table", torch.randn(16, 4))

    def forward(self, ids):
        n, t = ids.shape
        positions = torch.cumsum(ids.ne(0).long(), 1)
        table = self.table.index_select(0, positions.view(-1)).view(n, t, -1)
        return self.lin(self.emb(ids) + table)


def test_a_table_selected_by_positions_computed_from_the_batch_keeps_its_rows():
    """``table.index_select(0, pos.view(-1))`` with positions computed from the ids was
    refused ("'index_select' mixed, split or picked the examples", trial 84), where
    ``table[pos]`` had rows: the index picks rows of the table for each of its own entries."""
    model = _PositionsSelected().double()
    ids = torch.tensor([[3, 5, 7, 2, 6], [4, 9, 2, 0, 0], [1, 3, 3, 8, 1]])
    with semipack.extend(model, semipack.Real(), per_sample=True):
        model(ids).pow(2).sum().backward()
    for i in range(3):
        grads = torch.autograd.grad(model(ids[i : i + 1]).pow(2).sum(), list(model.parameters()))
        for (name, p), want in zip(model.named_parameters(), grads, strict=True):
            torch.testing.assert_close(p.semiring_grad_batch[i], want, msg=f"{name} {i}")


def test_a_layer_whose_dim_0_is_not_the_batch_is_refused():
    """The rows follow dim 0 of each layer's input: a sequence-first layer inside a
    batch-first model would give one row per token, silently."""

    class SequenceFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 4)

        def forward(self, x):
            return self.l(x.transpose(0, 1)).transpose(0, 1)

    for tokens in (5, 2):  # with 2 tokens, dim 0 has the batch's size
        _refused(
            SequenceFirst(),
            (torch.randn(2, tokens, 3),),
            rf"Linear \(module 'l'\) on an input of shape \({tokens}, 2, 3\) computed from the "
            r"model's input in which the batch is on dim 1",
        )

    class ProductSequenceFirst(nn.Module):
        """The same layers as matrix products with the weight (``x @ W.T``, Falcon's form):
        the matmul extension reads the batch off dim 0 as a Linear does, and was not asked
        where the batch is (one row per token, silently)."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return (x.transpose(0, 1) @ self.w.T).transpose(0, 1)

    _refused(
        ProductSequenceFirst(),
        (torch.randn(2, 2, 3),),
        r"Linear \(the root module\) on an input of shape \(2, 2, 3\) computed from the "
        r"model's input in which the batch is on dim 1",
    )


def test_a_forward_run_before_the_block_is_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    loss = _loss(model(torch.randn(5, 3)))
    outside = r"created outside a semipack.extend\(\.\.\., per_"
    with (
        pytest.raises(PerSampleError, match=outside),
        semipack.extend(model, semipack.Real(), per_sample=True),
    ):
        loss.backward()


def test_an_input_without_a_batch_dim_names_the_layer():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    _refused(
        model,
        (torch.randn(3),),
        r"Linear \(module '2'\) was called on an input of shape \(4,\) without a batch dim",
    )


class _SharedPositions(nn.Module):
    """A nanoGPT-style model: token embeddings plus position embeddings looked up with ids
    ``arange(T)`` shared by the whole batch (1-D ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(7, 4), nn.Embedding(3, 4), nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))


def test_one_dimensional_ids_are_refused_even_when_they_match_the_batch():
    """Position ids ``arange(T)`` shared by a batch of T examples look like one id per example;
    taking them so gave every row of the position table wrong values, silently. Ids must be
    ``[N, ...]``; the error says how to write both cases."""
    torch.manual_seed(0)
    model = _SharedPositions()
    idx = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 1, 2]])  # N = T = 3
    with (
        pytest.raises(
            PerSampleError, match=r"ids of shape \(3,\) has no batch dim.*ids\[:, None\]"
        ),
        semipack.extend(model, semipack.MaxProd(), per_sample=True),
    ):
        model(idx).sum().backward()


def test_a_gain_on_an_input_that_requires_grad_keeps_its_rows():
    """The raw input asked for its own ``semiring_grad`` is a leaf of the graph, not a saved
    factor: still the batch (it was refused as "another parameter or leaf", trial 31)."""
    model, inputs = _build("gain_on_the_input")
    x = inputs[0].clone().requires_grad_()
    sr = semipack.MaxProd()
    rows = _per_sample(model, (x,), sr)["0.gain"].semiring_grad_batch
    assert x.semiring_grad.shape == x.shape
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        with semipack.extend(model, sr):
            _loss(model(x[i : i + 1].detach())).backward()
        torch.testing.assert_close(rows[i], model[0].gain.semiring_grad, rtol=1e-12, atol=0)


class TableFromBuffer(nn.Module):
    """Activations plus a [T, D] table computed from a buffer, a gain and a bias."""

    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("table", torch.randn(tokens, width))
        self.gain = nn.Parameter(torch.rand(width) + 0.5)
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return self.lin(x) + (self.table * self.gain + self.bias)


def test_a_value_computed_from_a_buffer_alone_is_not_batched():
    """``h + (table * gain + bias)`` with the table's T equal to the batch size N: the add's
    other operand is computed, but from a buffer and parameters alone, so its dim 0 is not
    the batch. Rows had been returned, wrong (trial 31); the pass is refused, naming the
    parameter and what it meets."""
    _refused(
        TableFromBuffer(5, 4),
        (torch.randn(5, 4),),
        r"parameter '(bias|gain)' is used by (AddBackward0|MulBackward0), created by the root "
        r"module, with (a value MulBackward0 computed without the model's input|a factor of "
        r"shape \(5, 4\) not computed from the model's input)",
    )


class GainOnAKeyedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 3)

    def forward(self, batch: dict):
        return self.lin(batch["x"] * self.scale)


def test_an_input_inside_a_dict_is_the_batch():
    """The model's input found inside a dict argument carries the batch (``batch["x"] * p``
    was refused as not the model's input, trial 31): rows equal single-example runs."""
    torch.manual_seed(0)
    model = GainOnAKeyedInput().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    sr = semipack.MaxProd()
    with semipack.extend(model, sr, per_sample=True):
        _loss(model({"x": x})).backward()
    rows = model.scale.semiring_grad_batch
    for i in range(5):
        with semipack.extend(model, sr):
            _loss(model({"x": x[i : i + 1]})).backward()
        torch.testing.assert_close(rows[i], model.scale.semiring_grad, rtol=1e-12, atol=0)


class TableCast(TableFromBuffer):
    """``table.to(x)`` hands the buffer back unchanged: still not the batch."""

    def forward(self, x):
        return self.lin(x) + (self.table.to(x) * self.gain + self.bias)


class SharedClasses(nn.Module):
    """Scores against a table of classes passed in beside the batch, as many as examples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.g = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x, classes):
        return self.lin(x) @ (classes * self.g).T


def test_a_buffer_handed_back_or_a_second_argument_of_the_batch_size_is_not_the_batch():
    """Two ways trial 32 found to make a non-batched value look batched, each giving wrong
    rows: a no-op ``.to(x)`` returning the buffer itself, and a second model argument whose
    dim 0 happened to equal the batch size. Both are refused."""
    _refused(TableCast(5, 4), (torch.randn(5, 4),), r"parameter '(gain|bias)'")
    _refused(SharedClasses(), (torch.randn(5, 4), torch.randn(5, 4)), r"parameter 'g'")


class SliceAssigned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.g = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        out = torch.zeros_like(x)
        out[:, :2] = self.lin(x)[:, :2]
        return out * self.g


def test_a_slice_assignment_carries_the_batch_into_its_target():
    """``out[:, :2] = f(x)`` writes the batch into ``out`` (its ``__setitem__`` returns
    None): rows equal single-example runs."""
    torch.manual_seed(0)
    model = SliceAssigned().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    sr = semipack.MaxProd()
    rows = _per_sample(model, (x,), sr)["g"].semiring_grad_batch
    for i in range(3):
        with semipack.extend(model, sr):
            _loss(model(x[i : i + 1])).backward()
        torch.testing.assert_close(rows[i], model.g.semiring_grad, rtol=1e-12, atol=0)


class TransposedGain(nn.Module):
    """A gain written on a sequence-first view, ``(h.transpose(0, 1) * g).transpose(0, 1)``:
    the generic rule reads dim 0 of ``h.transpose(0, 1)``, which is the token."""

    def __init__(self, width: int, computed: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.g = nn.Parameter(torch.rand(width) + 0.5)
        self.computed = computed

    def forward(self, x):
        h = self.lin(x) if self.computed else x
        return (h.transpose(0, 1) * self.g).transpose(0, 1)


def test_a_gain_on_a_transposed_operand_is_refused_when_tokens_match_examples():
    """With as many tokens as examples the rows came back wrong, silently (a README limit
    since trial 32): the block now follows the batch to dim 1 and refuses the use."""
    for computed in (False, True):
        _refused(
            TransposedGain(4, computed),
            (torch.randn(3, 3, 4),),
            r"parameter 'g' is used by MulBackward0, created by the root module, with (a "
            r"factor of shape \(3, 3, 4\) whose dim 0 is not the batch|a value "
            r"TransposeBackward0 computed from the model's input with the batch on dim 1)",
        )


class SequenceFirstRoundTrip(nn.Module):
    """A batch-first model that runs a token mixer sequence-first and comes back: layers
    see the batch on dim 0 again, and the roll along dim 0 is along the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.g = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        s = self.inp(x).transpose(0, 1)  # [T, N, d]
        s = torch.tanh(s + s.roll(1, 0).cumsum(0)).softmax(0)
        return self.out(s.transpose(0, 1) * self.g)


def test_a_sequence_first_round_trip_with_as_many_tokens_as_examples_keeps_its_rows():
    """T == N: dim 0 has the batch's size all along. The roll, cumsum and softmax along the
    tokens were refused as mixing the batch (dim 0); the block follows the batch to dim 1
    and back, and every row equals a run of that example alone."""
    torch.manual_seed(0)
    model = SequenceFirstRoundTrip().double()
    x = torch.randn(3, 3, 3, dtype=torch.float64)
    sr = semipack.MaxProd()
    rows = {n: p.semiring_grad_batch.clone() for n, p in _per_sample(model, (x,), sr).items()}
    for i in range(3):
        with semipack.extend(model, sr):
            _loss(model(x[i : i + 1])).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(rows[name][i], p.semiring_grad, rtol=1e-12, atol=0)


PERM = torch.tensor([2, 0, 1, 4, 3])
#: mixing the node types of ``mixing_reason`` do not show; each gave rows silently.
UNSEEN_MIXING = {
    "h @ (h.T @ h)": lambda h: h @ (h.T @ h),
    "ones(N, N) @ h": lambda h: torch.ones(5, 5, dtype=h.dtype) @ h,
    "einsum bi,bj->ij": lambda h: h @ torch.einsum("bi,bj->ij", h, h),
    "h[perm]": lambda h: h[PERM],
    "cat of swapped slices": lambda h: torch.cat([h[1:], h[:1]]),
    "unbind reversed": lambda h: torch.stack(h.unbind(0)[::-1]),
    "h.t().mean(-1)": lambda h: h - h.t().mean(-1),
    "softmax(h.t(), -1)": lambda h: torch.softmax(h.t(), -1).t(),
    "layer_norm(h.t(), (N,))": lambda h: F.layer_norm(h.t(), (5,)).t(),
    "reshape(-1, d).mean(0)": lambda h: h - h.reshape(-1, 2).mean(0).repeat(2),
    "einsum nd->d": lambda h: h - torch.einsum("nd->d", h),
    "diff(dim=0)": lambda h: torch.cat([h[:1], h.diff(dim=0)]),
    "quantile over the batch": lambda h: h - h.quantile(0.5, dim=0),
    "attention over a 2-D input": lambda h: F.scaled_dot_product_attention(h, h, h),
}


@pytest.mark.parametrize("mix", list(UNSEEN_MIXING))
def test_mixing_the_node_types_miss_is_refused(mix):
    """The README listed these as mixing nobody detected: the rows had no per-example
    meaning, silently. The block follows the batch through each call and refuses a value
    inside the model in which no dim holds one example per index, naming the call."""
    _refused(
        _Mixer(UNSEEN_MIXING[mix]),
        (torch.randn(5, 3),),
        r"need examples that do not mix, but \w+ \(created by the root module.*\) (computes a "
        r"value in which no dim holds one example per index: ('\w+' (mixed, split or picked "
        r"the examples|merged the batch with other dims)|indexing picked or reordered)|"
        r"mixes them: it reduces over dim 1 \(the batch\))",
    )


def test_mixing_on_the_raw_input_is_refused():
    """``x - x.mean(0)`` on an input that needs no grad makes no node; the layer after it
    reads rows off a mixed value. Refused, naming the layer and the call."""
    model = nn.Sequential(Centred(), nn.Linear(3, 2))
    _refused(
        model,
        (torch.randn(5, 3),),
        r"parameter '1.weight' is used by Linear \(module '1'\) on an input of shape \(5, 3\) "
        r"computed from the model's input in which no dim holds one example per index "
        r"\('mean' mixed",
    )


class CheckpointedGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.g = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return self.out(checkpoint(lambda h: self.lin(h) * self.g, x, use_reentrant=False))


def test_a_gain_inside_a_non_reentrant_checkpoint_keeps_its_rows():
    """The row rule read the node's saved factor, and the node's own backward unpacked it
    again: PyTorch's CheckpointError (a README limit). The block keeps the factors of
    ``x * p`` itself; rows equal single-example runs."""
    torch.manual_seed(0)
    model = CheckpointedGain().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    sr = semipack.MaxProd()
    rows = {n: p.semiring_grad_batch.clone() for n, p in _per_sample(model, (x,), sr).items()}
    for i in range(5):
        with semipack.extend(model, sr):
            _loss(model(x[i : i + 1])).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(rows[name][i], p.semiring_grad, rtol=1e-12, atol=0)


class _Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1 - x.tanh() ** 2)


class _Centre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x - x.mean(0)

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0)


class CustomThenGain(nn.Module):
    def __init__(self, function) -> None:
        super().__init__()
        self.lin, self.function = nn.Linear(3, 4), function
        self.g = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return self.function.apply(self.lin(x)) * self.g


def test_a_custom_function_is_followed_through_the_calls_of_its_forward():
    """A custom ``autograd.Function`` returns the tensor its forward computed; the block
    followed the calls inside. An activation keeps the batch, so a gain after it has rows
    (it was refused as "computed without the model's input"); a forward that centres over
    the batch is refused as mixing."""
    torch.manual_seed(0)
    model = CustomThenGain(_Tanh).double()
    _assert_real_rows_are_per_example_gradients(model, (torch.randn(5, 3, dtype=torch.float64),))
    _refused(
        CustomThenGain(_Centre),
        (torch.randn(5, 3),),
        r"parameter 'g' is used by MulBackward0, created by the root module, with a value "
        r"_CentreBackward computed from the model's input in which no dim holds one example",
    )


class _Between(nn.Module):
    """Linear -> ``between`` (a function of the hidden batch and the input) -> Linear."""

    def __init__(self, between, width: int = 4) -> None:
        super().__init__()
        self.first, self.second, self.between = nn.Linear(4, width), nn.Linear(width, 2), between
        self.recurrent = nn.GRU(4, 4).requires_grad_(False)  # sequence first, frozen
        self.batch_first = nn.GRU(4, 4, batch_first=True).requires_grad_(False)

    def forward(self, x):
        return self.second(self.between(self, self.first(x), x))


def _permuted_into(h):
    out = torch.zeros(h.shape, dtype=h.dtype)
    out[torch.tensor([1, 2, 3, 0])] = h
    return out


def _first_token_written(h):
    out = torch.zeros(h.shape, dtype=h.dtype)
    out[:, 0] = h[:, 0]
    return out.transpose(0, 1)  # sequence first into the second layer


def _through_a_view(h):
    h = h * 1
    h.narrow(0, 0, 1).add_(h.narrow(0, 1, 1))
    return h


class _KernelIntoEmptyLike(torch.autograd.Function):
    """A kernel below Python (numpy here, a CUDA or Triton kernel elsewhere) writing each
    example's average with the one before it into ``torch.empty_like(x)`` (trial 113)."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        values = x.detach().numpy()
        out.numpy()[:] = 0.5 * (values + np.roll(values, 1, 0))
        return out

    @staticmethod
    def backward(ctx, g):
        return 0.5 * (g + torch.roll(g, -1, 0))


class _HiddenRoll(torch.autograd.Function):
    """A forward that writes into its result by ops the block does not see (under
    ``DisableTorchFunction``): each example's row moves to the next (trial 113)."""

    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        with torch._C.DisableTorchFunction():
            out.copy_(torch.roll(x, 1, 0))
        return out

    @staticmethod
    def backward(ctx, g):
        return torch.roll(g, -1, 0)


SQUARE = torch.randn(4, 4, dtype=torch.float64)
#: each gave rows without a per-example meaning, silently (trial 33; the custom Functions:
#: trial 113); N = T = 4
REFUSED_BETWEEN = {
    "a kernel writing into empty_like": lambda m, h, x: _KernelIntoEmptyLike.apply(h),
    "a hidden write into a custom Function's result": lambda m, h, x: _HiddenRoll.apply(h),
    "out[perm] = h": lambda m, h, x: _permuted_into(h),
    "index_put at permuted rows": lambda m, h, x: torch.zeros_like(h).index_put(
        (torch.tensor([1, 2, 3, 0]),), h
    ),
    "as_strided transpose": lambda m, h, x: h.as_strided((4, 4, 4), (4, 16, 1)),
    "in-place add through a view": lambda m, h, x: _through_a_view(h),
    "a sequence-first GRU on batch-first data": lambda m, h, x: m.recurrent(h)[0],
    "a negative pad of the batch": lambda m, h, x: F.pad(h, (0, 0, 0, 0, 1, -1)),
    "out[:, 0] = h[:, 0] then sequence first": lambda m, h, x: _first_token_written(h),
    "tensordot over the batch": lambda m, h, x: torch.tensordot(SQUARE, h, dims=([1], [0])),
    "linalg.matmul over the batch": lambda m, h, x: torch.linalg.matmul(SQUARE, h[:, 0])[
        :, None
    ].expand(4, 4, 4),
    "diff with prepend along the batch": lambda m, h, x: torch.diff(
        h, dim=0, prepend=torch.zeros(1, 4, 4, dtype=h.dtype)
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_BETWEEN))
def test_calls_that_move_or_mix_examples_without_a_node_type_are_refused(case):
    _refused(
        _Between(REFUSED_BETWEEN[case]).double(),
        (torch.randn(4, 4, 4, dtype=torch.float64),),
        r"per-sample values( need examples that do not mix|: parameter '(first|second)\.)",
    )


def _relu_view_in_place(h):
    h = h * 1
    F.relu(h[:, 1:], inplace=True)  # a seen write: h's node is made again, its batch kept
    return h


def _last_token(m, h, x):
    last = (x[:, :, 0] > 0).long().sum(1).clamp(max=3)
    return h[torch.arange(h.shape[0]), last]


def _class_token_doubled(m, h, x):
    out = h.clone()
    out[:, 0] = 2 * h[:, 0]
    return out


KEPT_BETWEEN = {
    "h[arange(N), last]": _last_token,
    "gather by a batched index": lambda m, h, x: h.gather(
        1, (x[:, :1, :1] > 0).long().expand(-1, 1, 4)
    ),
    "a batch-first GRU": lambda m, h, x: m.batch_first(h)[0],
    "an in-place ReLU on a view": lambda m, h, x: _relu_view_in_place(h),
    "out[:, 0] = 2 * h[:, 0]": _class_token_doubled,
    "tensordot over the features": lambda m, h, x: torch.tensordot(h, SQUARE, dims=1),
    "diagonal of the last dims": lambda m, h, x: h.diagonal(0, 1, 2)[:, None].expand(-1, 4, -1),
}


@pytest.mark.parametrize("case", list(KEPT_BETWEEN))
def test_calls_that_keep_each_example_on_its_row_have_its_rows(case):
    """The pooling of Hugging Face's decoder classifiers (``h[arange(N), last]``) and the
    other forms here keep example n on row n: Real's rows equal per-example gradients
    (each was refused, or would be refused, by a batch following that lost the batch)."""
    torch.manual_seed(0)
    model = _Between(KEPT_BETWEEN[case]).double()
    _assert_real_rows_are_per_example_gradients(model, (torch.randn(4, 4, 4, dtype=torch.float64),))


class BucketBias(nn.Module):
    """Self-attention scores plus a bias looked up in a table by relative-position buckets
    of shape [T, T] (T5's and MPNet's relative attention bias), then a Linear."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.bias = nn.Embedding(2 * tokens, 1)
        self.tokens = tokens

    def forward(self, x):
        h = self.inp(x)
        t = torch.arange(self.tokens)
        buckets = t[None, :] - t[:, None] + self.tokens  # [T, T], not from the batch
        scores = h @ h.transpose(1, 2) + self.bias(buckets)[..., 0]
        return self.out(scores.softmax(-1) @ h)


def test_a_table_looked_up_by_buckets_is_refused_when_its_size_is_the_batchs():
    """T = N: the bucket table's dim 0 has the batch's size, and the Embedding's rows were
    taken for examples, silently (T5 and MPNet, trial 34). Its dim 0 lands on the query dim
    of the scores, not the batch's: refused, naming the table."""
    _refused(
        BucketBias(4).double(),
        (torch.randn(4, 4, 3, dtype=torch.float64),),
        r"parameter 'bias.weight' is used by Embedding \(module 'bias'\), whose input's batch "
        r"dim has the batch's size but was not computed from the model's input: .* lands on dim 1 "
        r"where the batch is on dim 0",
    )


class EncoderDecoder(nn.Module):
    """A decoder input beside the batch (ids [N, S]) attending to an encoded batch."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.emb = nn.Linear(3, 4), nn.Embedding(9, 4)
        self.norm, self.out = nn.LayerNorm(4), nn.Linear(4, 2)
        self.gain = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x, decoder_ids):
        memory = self.enc(x)  # [N, T, 4]
        d = self.emb(decoder_ids) * self.gain  # [N, S, 4]
        attended = (d @ memory.transpose(1, 2)).softmax(-1) @ memory
        return self.out(self.norm(d + attended))


def test_a_decoder_input_beside_the_batch_has_rows_where_it_meets_the_batch():
    """The second argument's dim 0 has the batch's size and meets the encoded batch on it
    (cross-attention): its Embedding, the gain on it and the layers after have rows equal
    to single examples (the gain was refused as "computed without the model's input")."""
    torch.manual_seed(0)
    model = EncoderDecoder().double()
    inputs = (torch.randn(3, 3, 3, dtype=torch.float64), torch.randint(0, 9, (3, 3)))
    _assert_real_rows_are_per_example_gradients(model, inputs)


class ClassTable(nn.Module):
    """Features scored against a table of classes passed beside the batch, projected by a
    Linear: the table's rows are classes, not examples."""

    def __init__(self) -> None:
        super().__init__()
        self.feat, self.proj = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, classes):
        return self.feat(x) @ self.proj(classes).T


def test_a_table_of_as_many_classes_as_examples_gets_no_rows():
    """``proj(classes)`` with as many classes as examples: its rows would be classes. The
    projected table meets the batch on the columns of the scores: refused."""
    _refused(
        ClassTable().double(),
        (torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)),
        r"parameter 'proj\.(weight|bias)' is used by Linear \(module 'proj'\), whose input's "
        r"batch dim has the batch's size but was not computed from the model's input",
    )


class MergedHeads(nn.Module):
    """Attention with the heads merged into the batch for ``bmm`` and split out again."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(4, 12), nn.Linear(4, 2)

    def forward(self, x):
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 2, 2).permute(2, 0, 3, 1, 4)  # [n, heads, t, 2]
        q, k, v = (a.reshape(n * 2, t, 2) for a in (q, k, v))
        o = torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v)
        return self.out(o.view(n, 2, t, 2).transpose(1, 2).reshape(n, t, 4))


def test_a_batch_merged_with_the_heads_and_split_out_again_has_rows():
    """Bloom's layout (``[N * H, T, d]`` for ``bmm``): the batch is followed through the
    merge and the split, and every row equals a single example's (it was refused)."""
    torch.manual_seed(0)
    model = MergedHeads().double()
    _assert_real_rows_are_per_example_gradients(model, (torch.randn(4, 4, 4, dtype=torch.float64),))


class _Beside(nn.Module):
    """``x`` [N, H, D] and a second argument ``y`` [N, D] combined by ``how`` (N = H)."""

    def __init__(self, how) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(3, 3), nn.Linear(3, 3), how

    def forward(self, x, y):
        return self.a(self.how(self, x, y))


def _into_a_buffer(m, x, y):
    buf = torch.zeros(x.shape[0], 3, dtype=x.dtype)
    buf[:] = m.b(y)
    return x + buf.unsqueeze(0)  # y's dim 0 lands on H


def _one_example_overwritten(m, x, y):
    h = x.clone()
    h[0] = 0.0  # a pass over any example alone overwrites that example
    return h + m.b(y).unsqueeze(1)


#: trial 35: each gave wrong rows silently
REFUSED_BESIDE = {
    "a mark meeting only a merged batch": lambda m, x, y: (
        x.reshape(-1, 3) + m.b(y).repeat(x.shape[1], 1)
    ).reshape(x.shape),
    "a mark written into a buffer": _into_a_buffer,
    "an example overwritten by index": _one_example_overwritten,
    "a layer reading a mark moved off its dim": lambda m, x, y: (
        x + m.b(y[:, None].expand(-1, 3, -1).transpose(0, 1)).transpose(0, 1)
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_BESIDE))
def test_second_arguments_that_do_not_meet_the_batch_on_its_dim_are_refused(case):
    _refused(
        _Beside(REFUSED_BESIDE[case]).double(),
        (torch.randn(3, 3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)),
        r"per-sample values(: parameter '(a|b)\.| need examples)",
    )


def test_a_second_argument_added_on_the_batchs_dim_has_rows():
    """The aligned form of the cases above: ``b(y)`` broadcast over H on the batch's dim."""
    torch.manual_seed(0)
    model = _Beside(lambda m, x, y: x + m.b(y).unsqueeze(1)).double()
    inputs = (torch.randn(3, 3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64))
    _assert_real_rows_are_per_example_gradients(model, inputs)


def test_a_scripted_transpose_before_a_layer_is_refused():
    """The block cannot see inside ``torch.jit.script``: a layer whose input was computed
    from the batch there (a transpose, with as many tokens as examples) gave one row per
    token; the graph shows the unseen node between two seen ones."""

    @torch.jit.script
    def swap(h):
        return h.transpose(0, 1)

    class Scripted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            return self.second(swap(self.first(x)))

    _refused(
        Scripted().double(),
        (torch.randn(3, 3, 3, dtype=torch.float64),),
        r"parameter 'second\.(weight|bias)' is used by LinearFunctionBackward on an input "
        r"\(TransposeBackward0\) computed from the model's input by calls the block did not see",
    )


class TableBranch(nn.Module):
    """A Linear on a buffer of as many rows as examples, returned beside the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.proj = nn.Linear(3, 2), nn.Linear(3, 2)
        self.register_buffer("table", torch.randn(4, 3))

    def forward(self, x):
        return self.lin(x), self.proj(self.table)


def test_a_table_branch_that_never_meets_the_batch_is_refused():
    """The table's rows are summed into the loss apart from the examples: a pass over one
    example takes the whole table, so no row of ``proj`` is an example's."""
    model = TableBranch().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with (
        pytest.raises(
            PerSampleError, match=r"parameter 'proj\.(weight|bias)' .* never met the batch"
        ),
        semipack.extend(model, semipack.Real(), per_sample=True),
    ):
        out, table = model(x)
        (_loss(out) + table.sum()).backward()


def _marked_partly_written(m, x, y):
    y2 = y.clone()
    y2[0] = 0.0  # a pass over any example alone writes that example
    return x + m.b(y2).unsqueeze(1)


def _written_through_an_alias(m, x, y):
    h = x * 1
    alias = h.detach()
    alias.copy_(alias.flip(0))  # h's memory: examples exchanged
    return h + m.b(y).unsqueeze(1)


def _scripted_write(m, x, y):
    h = m.b(x)
    _flip_in_place(h)  # the block does not see it; h's version counter moved
    return h


@torch.jit.script
def _flip_in_place(h: torch.Tensor) -> None:
    h.copy_(h.detach().flip(0))


def _written_with_out(m, x, y):
    buf = torch.empty_like(y)
    torch.cumsum(y, 0, out=buf)  # over the examples, into a buffer given as out=
    return x + m.b(buf).unsqueeze(1)


def _written_through_a_view(m, x, y):
    n, d = y.shape
    buf = torch.zeros(d, n, dtype=y.dtype)
    buf.t()[:] = m.b(y)  # a view of a fresh buffer; the buffer read in another layout
    return x + buf.reshape(n, d).unsqueeze(1)


def _copied_by_new_tensor(m, x, y):
    return x + m.b(x.new_tensor(y.flip(0))).unsqueeze(1)  # new_tensor copies its data


#: trial 36 (the first four) and trial 47: each gave wrong rows silently
REFUSED_BESIDE_TOO = {
    "a write with out=": _written_with_out,
    "a write through a view of a fresh buffer": _written_through_a_view,
    "a copy made by new_tensor": _copied_by_new_tensor,
    "a write the block did not see": _scripted_write,
    "a second argument mixed over its dim 0": lambda m, x, y: (
        x + m.b(y.flip(0)).unsqueeze(1) + y.flip(0).unsqueeze(1)
    ),
    "a second argument written at one example": _marked_partly_written,
    "a write through a detached alias": _written_through_an_alias,
}


class _TwoBranches(nn.Module):
    """The batch's branch and a second argument's, returned side by side (they never meet)."""

    def __init__(self, pre, post) -> None:
        super().__init__()
        self.a, self.b, self.d = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 5)
        self.pre, self.post = pre, post

    def forward(self, x, y):
        return self.a(x), self.d(self.post(torch.tanh(self.b(self.pre(y)))))


@pytest.mark.parametrize(
    ("pre", "post"),
    [
        (lambda y: y - y.mean(0), lambda h: h),
        (lambda y: y + y.flip(0), lambda h: h),
        (lambda y: y, lambda h: h + h[0]),
        (lambda y: y, lambda h: h @ (h.T @ h)),
    ],
    ids=["minus its mean", "plus its flip", "plus its first row", "a gram product"],
)
def test_a_second_argument_mixed_on_a_branch_apart_is_refused(pre, post):
    """A second argument's examples mixed on a branch that never meets the batch: its mark
    came in on dim 0 and lost (the same mark, two places) and still counted as on dim 0, so
    the branch's layers gave rows silently (trial 47). A mark on two places has none now."""
    torch.manual_seed(1)
    model = _TwoBranches(pre, post).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with semipack.extend(model, semipack.Real(), per_sample=True):
        a, d = model(x, y)
        with pytest.raises(PerSampleError, match=r"parameter 'd\.(weight|bias)' is used by"):
            (_loss(a) + _loss(d)).backward()


@dataclasses.dataclass
class _Extra:
    """A config-like object that carries a tensor of the batch's size beside the batch."""

    scale: torch.Tensor


class _ScaledByExtra(nn.Module):
    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.lin, self.mix = nn.Linear(3, 2), mix

    def forward(self, x, extra: _Extra):
        return self.lin(x) * (extra.scale.flip(0) if self.mix else extra.scale)


def test_a_second_argument_inside_a_dataclass_is_an_argument():
    """A tensor inside a dataclass argument was not marked as a model argument (pytree does
    not look into dataclasses): flipping its examples gave rows silently (trial 47). Mixed, it
    is refused as the same tensor passed bare is; unmixed, the rows are each example's own."""
    torch.manual_seed(0)
    x, scale = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    model = _ScaledByExtra(mix=True).double()
    with semipack.extend(model, semipack.MaxProd(), per_sample=True):
        out = model(x, _Extra(scale))
        with pytest.raises(PerSampleError, match=r"no dim holds one example per index: 'mul'"):
            out.sum().backward()
    model = _ScaledByExtra(mix=False).double()
    with semipack.extend(model, semipack.Real(), per_sample=True):
        _loss(model(x, _Extra(scale))).backward()
    for i in range(4):
        expected = torch.autograd.grad(
            _loss(model(x[i : i + 1], _Extra(scale[i : i + 1]))), model.lin.weight
        )[0]
        torch.testing.assert_close(model.lin.weight.semiring_grad_batch[i], expected)


class _ZerosThroughAMask(nn.Module):
    """Zeros written into the activations through a padding mask given beside the batch: the
    mask itself, widened to the features, or, as Wav2Vec2 builds its feature-level mask, a
    fresh tensor with a one written at each example's last position (``zeros[(arange(N),
    lengths - 1)] = 1``) and filled back along the tokens."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how

    def forward(self, x, mask):  # x: [N, T, 4], mask: [N, T] bool
        h = self.a(x)
        if self.how == "mask":
            h[~mask] = 0
        elif self.how == "widened":
            h[~mask[..., None].repeat(1, 1, h.shape[-1])] = 0
        elif self.how == "flipped":  # another example's mask: mixes them
            h[~mask.flip(0)] = 0
        else:
            rows = torch.arange(mask.shape[0])
            rows = rows.flip(0) if self.how == "rebuilt from other rows" else rows
            built = torch.zeros(mask.shape, dtype=torch.long)
            built[(rows, mask.sum(-1) - 1)] = 1
            h[~built.flip([-1]).cumsum(-1).flip([-1]).bool()] = 0
        return self.b(h)


@pytest.mark.parametrize(
    "how", ["mask", "widened", "rebuilt", "flipped", "rebuilt from other rows"]
)
def test_zeros_written_through_a_padding_mask_keep_each_example_on_its_row(how):
    """``h[~mask] = 0`` with a mask given beside the batch was refused as "an indexed
    assignment wrote examples into other places" (trial 80: Wav2Vec2 with an attention mask),
    although a constant written where each example's own mask says moves nothing. Its rows
    are now each example's gradients; a mask whose rows are other examples' is still refused."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 4:] = False
    model = _ZerosThroughAMask(how).double()
    if how in ("flipped", "rebuilt from other rows"):
        _refused(model, (x, mask), r"an indexed assignment wrote examples into other places")
        return
    with semipack.extend(model, semipack.Real(), per_sample=True):
        _loss(model(x, mask)).backward()
    for i in range(3):
        grads = torch.autograd.grad(
            _loss(model(x[i : i + 1], mask[i : i + 1])), list(model.parameters())
        )
        for (name, p), want in zip(model.named_parameters(), grads, strict=True):
            torch.testing.assert_close(p.semiring_grad_batch[i], want, msg=f"{name} {i}")


def test_wav2vec2_with_a_padding_mask_has_each_examples_rows():
    """Hugging Face's Wav2Vec2 zeroes padded frames through a mask it builds from the lengths
    in ``attention_mask`` (trial 80: refused). The convolutional feature encoder and the
    weight-normed positional convolution are frozen (their rows are not supported: group norm,
    weight norm); the other parameters' rows are each example's gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        conv_dim=(4, 4), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, feat_extract_norm="layer", do_stable_layer_norm=True,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
    )  # fmt: skip
    model = transformers.Wav2Vec2Model._from_config(config, attn_implementation="sdpa")
    model = model.double().eval()
    model.feature_extractor.requires_grad_(False)
    model.encoder.pos_conv_embed.requires_grad_(False)
    audio = torch.randn(3, 120, dtype=torch.float64)
    mask = torch.ones(3, 120, dtype=torch.long)
    mask[1, 70:] = 0

    def loss(sl):
        return model(audio[sl], attention_mask=mask[sl]).last_hidden_state.tanh().sum()

    with semipack.extend(model, semipack.Real(), per_sample=True):
        loss(slice(None)).backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for i in range(3):
        grads = torch.autograd.grad(loss(slice(i, i + 1)), [p for _, p in trained])
        for (name, p), want in zip(trained, grads, strict=True):
            if name.endswith("k_proj.bias"):  # no path changes the loss: rounding noise only
                continue
            torch.testing.assert_close(p.semiring_grad_batch[i], want, msg=f"{name} {i}")


@pytest.mark.parametrize("case", list(REFUSED_BESIDE_TOO))
def test_second_arguments_and_writes_that_mix_examples_are_refused(case):
    _refused(
        _Beside(REFUSED_BESIDE_TOO[case]).double(),
        (torch.randn(3, 3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)),
        r"per-sample values(: parameter '(a|b)\.| need examples)",
    )


class InPlaceScale(nn.Module):
    """timm's ``LayerScale(inplace=True)``: ``h.mul_(gamma)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return self.out(self.lin(x).mul_(self.gamma))


def test_an_in_place_gain_has_its_rows():
    """The row rule read the factor kept from the forward, which the in-place product had
    overwritten with itself times the gain: rows off by the gain, silently (trial 37)."""
    torch.manual_seed(0)
    model = InPlaceScale().double()
    _assert_real_rows_are_per_example_gradients(model, (torch.randn(5, 3, dtype=torch.float64),))


def test_a_transformer_with_a_target_beside_the_batch_has_rows():
    """``nn.Transformer(src, tgt)``: the target is a model argument beside the batch, marked
    and confirmed where its queries meet the encoded batch; its transposes inside the
    attention were taken for calls the block did not see (trial 37)."""
    torch.manual_seed(0)
    model = nn.Transformer(4, 2, 1, 1, 8, dropout=0.0, batch_first=True).double().eval()
    inputs = (torch.randn(3, 3, 4, dtype=torch.float64), torch.randn(3, 3, 4, dtype=torch.float64))
    _assert_real_rows_are_per_example_gradients(model, inputs)


class SequenceFirstRmsNorm(nn.Module):
    """``F.rms_norm`` of ``h.transpose(0, 1)``: its gain's product has the batch on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.gain = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):  # x: [N, T, 4]
        h = self.proj(x).transpose(0, 1)  # [T, N, 6]
        return F.rms_norm(h, (6,), self.gain).transpose(0, 1)


def test_a_parameter_used_inside_a_call_the_block_sees_whole_is_named_by_that_call():
    """torch's ``F.rms_norm`` multiplies its gain inside the call: the block sees ``rms_norm``,
    not its inner product, and the refusal blamed a custom Function or a scripted function;
    it names the call now, as a layer whose input has the batch on dim 1. (With the batch on
    dim 0 the gain has rows: ``test_rows_equal_single_examples[rms_norm-...]``.)"""
    _refused(
        SequenceFirstRmsNorm().double(),
        (torch.randn(3, 5, 4, dtype=torch.float64),),
        r"parameter 'gain' is used by RMSNorm \(the root module\) on an input of shape "
        r"\(5, 3, 6\) computed from the model's input in which the batch is on dim 1",
    )


def test_a_forward_under_autocast_is_refused_by_name():
    """Under autocast every layer runs on cast copies and the extensions step aside: the
    refusal named a cast weight's AddmmBackward0 ("no per-sample rule"), even for a model of
    Linear layers, and never autocast (trial 46). It names autocast now, before the pass."""
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    x = torch.randn(4, 6)
    with semipack.extend(model, semipack.MaxProd(), per_sample=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).sum()
        with pytest.raises(PerSampleError, match=r"do not run under torch.autocast \(cpu\)"):
            loss.backward()
        model(x).pow(2).sum().backward()  # the next forward, without autocast, has its rows
    assert model[0].weight.semiring_grad_batch.shape == (4, 12, 6)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("family", ["falcon", "bloom"])
def test_alibi_models_with_a_padding_mask_have_each_examples_rows(family: str):
    """Falcon's and Bloom's ALiBi tables are built from the padding mask (a model argument
    beside the batch) as ``[N * heads, 1, T]``: its mark was lost in the merge, so meeting
    the batch read as examples mixed and the model was refused with a mask (trial 46). Marks
    now follow merges and splits as the batch does. Rows equal each example alone (with its
    own mask row), and Real's are the per-example gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "falcon":
        config = transformers.FalconConfig(
            vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            alibi=True, new_decoder_architecture=False, parallel_attn=False, bias=True,
        )  # fmt: skip
        model = transformers.FalconModel._from_config(config, attn_implementation="eager")
    else:
        config = transformers.BloomConfig(
            vocab_size=30, hidden_size=8, n_layer=1, n_head=2, hidden_dropout=0.0,
            attention_dropout=0.0,
        )  # fmt: skip
        model = transformers.BloomModel._from_config(config, attn_implementation="eager")
    model = model.double().eval()
    ids = torch.tensor([[1, 5, 7, 2, 4], [4, 9, 2, 3, 3], [1, 3, 3, 2, 8]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])

    def loss(sl):
        out = model(ids[sl], attention_mask=mask[sl]).last_hidden_state
        return (out.pow(2) * mask[sl, :, None]).sum()

    for sr in (semipack.MaxProd(), semipack.Real()):
        _rows_of_single_examples(model, loss, sr, 3)


class _GainAfterSort(nn.Module):
    """A gain ``h * g`` on a value whose examples a sort along the batch mixed (mixture-of-
    experts routing sorts tokens by expert), with the batch lost before the gain."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):
        return self.lin(x).sort(0).values * self.gain


def test_a_gain_on_a_mixed_value_names_the_call_that_mixed_it() -> None:
    """Qwen2-MoE's refusal named the last norm's gain only: "the examples were mixed, split
    or picked" (trial 52). The call that lost the batch is named, as the layer checks do."""
    model = _GainAfterSort().double()
    with semipack.extend(model, semipack.MaxProd(), per_sample=True):
        out = model(torch.randn(4, 3, dtype=torch.float64))
        with pytest.raises(
            PerSampleError, match=r"parameter 'gain' .*\('sort' mixed, split or picked the"
        ):
            out.sum().backward()


class _FlipsBetweenLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).flip(0))  # examples mixed between the layers


def test_a_forward_that_bypasses_the_models_call_is_refused() -> None:
    """``model.forward(x)`` or a submodule called directly never reached the model's pre-hook:
    the batch was not followed and a forward that flips examples gave rows silently (trial 58);
    ``model(x)`` refuses that forward."""
    torch.manual_seed(0)
    model = _FlipsBetweenLayers().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    bypassed = r"the extended model was not called in this block .* not model.forward\(x\)"
    for run in (lambda: model.forward(x), lambda: model.b(torch.tanh(model.a(x)).flip(0))):
        with semipack.extend(model, semipack.MaxProd(), per_sample=True):
            out = run()
            with pytest.raises(PerSampleError, match=bypassed):
                out.sum().backward()
    with semipack.extend(model, semipack.MaxProd(), per_sample=True):
        out = model(x)
        with pytest.raises(PerSampleError, match="FlipBackward0"):
            out.sum().backward()


def test_recurrent_weights_are_named_as_such_in_float64() -> None:
    """In float64 an LSTM runs as visible ops, and its bias's refusal spoke of pruned or masked
    weights (trial 58): it says recurrent layers have no per-sample rows."""
    torch.manual_seed(0)
    model = _LastState().double()
    x = torch.randn(3, 6, 4, dtype=torch.float64)
    with semipack.extend(model, semipack.MaxProd(), per_sample=True):
        out = model(x)
        with pytest.raises(PerSampleError, match=r"recurrent layers \(RNN, LSTM, GRU\) have no"):
            out.sum().backward()


class _LastState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.r, self.l = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x):
        return self.l(self.r(x)[0][:, -1])


@pytest.mark.parametrize(
    ("layers", "shape"),
    [
        (lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3)),
         (0, 4)),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)),
         (0, 3, 6, 6)),
    ],
    ids=["mlp with layer norm", "cnn with flatten"],
)  # fmt: skip
def test_an_empty_batch_has_empty_rows(layers, shape) -> None:
    """A batch of no examples crashed in the rules' reshapes (sizes inferred from zero
    entries) and in the batch following's flatten (trial 57); a plain pass takes it."""
    model = layers().double()
    with semipack.extend(model, semipack.Entropy(), per_sample=True):
        model(torch.randn(shape, dtype=torch.float64)).sum().backward()
    for p in model.parameters():
        assert p.semiring_grad_batch.shape == (0, *p.shape)


def test_a_padding_word_pytorch_refuses_is_refused_as_plain():
    """ "same" with a stride and an unknown word raise PyTorch's own errors inside ``extend``."""
    x = torch.randn(1, 2, 5, 5)
    for conv in (nn.Conv2d(2, 2, 3, stride=2), nn.Conv2d(2, 2, 3)):
        conv.padding = "same" if conv.stride == (2, 2) else "full"
        with pytest.raises((ValueError, RuntimeError)) as plain:
            conv(x)
        refused = pytest.raises(type(plain.value), match=re.escape(str(plain.value)))
        with semipack.extend(conv, semipack.MaxProd(), per_sample=True), refused:
            conv(x)


def test_siglip_vision_rows_with_its_position_table_frozen():
    """SigLIP's vision tower (without its pooling head, whose learned probe is repeated over
    the batch: no per-sample rule): a ``padding="valid"`` patch embedding (trial 66) and a position
    table read from a buffer shared by the batch, whose forward takes no position_ids: the
    refusal says to freeze the table (trial 69: it said to pass position_ids); frozen, Real's
    rows are the per-example gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=8, patch_size=4, num_channels=3, vision_use_head=False,
    )  # fmt: skip
    # sdpa: eager attention takes its softmax in float32 (see "Limits": float32 steps)
    model = transformers.SiglipVisionModel._from_config(cfg, attn_implementation="sdpa")
    model = model.double().eval()
    images = torch.randn(3, 3, 8, 8, dtype=torch.float64)

    def loss(pixels):
        return _loss(model(pixel_values=pixels).last_hidden_state)

    with semipack.extend(model, semipack.Real(), per_sample=True):
        out = loss(images)
        with pytest.raises(PerSampleError, match=r"freeze that embedding, requires_grad_\(False\)"):
            out.backward()
    model.embeddings.position_embedding.weight.requires_grad_(False)
    with semipack.extend(model, semipack.Real(), per_sample=True):
        loss(images).backward()
    rows = {n: p.semiring_grad_batch for n, p in model.named_parameters() if p.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(3):
        grads = torch.autograd.grad(loss(images[i : i + 1]), params, allow_unused=True)
        for (name, row), g in zip(rows.items(), grads, strict=True):
            want = torch.zeros_like(row[i]) if g is None else g
            torch.testing.assert_close(row[i], want, rtol=1e-9, atol=1e-12, msg=name)


def _torchvision_vit():
    import torchvision

    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16,
        num_classes=3,
    ), lambda model, x: model(x)  # fmt: skip


def _hf_vision(name: str):
    import transformers

    config = getattr(transformers, f"{name}Config")(
        image_size=32, patch_size=16, num_channels=3, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_labels=3,
        **({"mlp_ratio": 2} if name == "Dinov2" else {"intermediate_size": 16}),
    )  # fmt: skip
    cls = getattr(transformers, f"{name}ForImageClassification")
    model = cls._from_config(config, attn_implementation="eager")
    return model, lambda model, x: model(pixel_values=x).logits


@pytest.mark.parametrize(
    ("family", "batch"), [("torchvision ViT", 3), ("torchvision ViT", 1), ("ViT", 3), ("Dinov2", 3)]
)
def test_vision_transformers_class_token_rows_are_per_example_gradients(family, batch):
    """A class token expanded to the batch and concatenated before the patches (and DINOv2's
    mask token, unused here): Real's rows are each example's autograd gradient; ViT families
    were refused before (trial 73), and a batch of one after that (trial 75)."""
    torch.manual_seed(0)
    model, run = _torchvision_vit() if family == "torchvision ViT" else _hf_vision(family)
    model = model.double().eval()
    x = torch.randn(batch, 3, 32, 32, dtype=torch.float64)
    with semipack.extend(model, semipack.Real(), per_sample=True):
        _loss(run(model, x)).backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for i in range(batch):
        grads = torch.autograd.grad(
            _loss(run(model, x[i : i + 1])), [p for _, p in trained], allow_unused=True
        )
        for (name, p), want in zip(trained, grads, strict=True):
            if want is None:  # not in the graph (DINOv2's mask token): no rows either
                assert not hasattr(p, "semiring_grad_batch"), name
                continue
            # Hugging Face's eager attention takes its softmax in float32
            torch.testing.assert_close(p.semiring_grad_batch[i], want, msg=f"{name} {i}")


def test_a_layer_on_the_batch_merged_with_the_tokens_is_named_as_such():
    """A refusal for a layer on ``h.reshape(N * T, ...)`` offered only a position table or a
    sequence-first layout as causes (trial 73, OPT's feed-forward, whose Linear layers now
    have rows: ``MergedBatch``); a multiple of the batch's size names the merge first, and
    the layers that do split it."""

    class MergedConvolution(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 4)
            self.fc = nn.Conv1d(4, 4, 1)

        def forward(self, x):  # x: [N, T, 2]
            h = self.embed(x)
            return self.fc(h.reshape(-1, h.shape[-1], 1)).reshape(h.shape)

    _refused(
        MergedConvolution(),
        (torch.randn(2, 3, 2),),
        r"'fc\.bias' \(6 rows\), 'fc\.weight' \(6 rows\) did not: .* A multiple of the batch's "
        r"size \(6 = 2 x 3\): the batch merged with another dim by a reshape "
        r"\(\[N \* T, \.\.\.\]\): Linear and LayerNorm layers, x @ W and torch\.addmm split it "
        r"out again",
    )


@pytest.mark.parametrize("loss", ["cross entropy / 2", "mse + z-loss", "bce * 1"])
def test_a_fused_loss_inside_the_model_scaled_after_has_rows(loss: str):
    """A fused loss (``NllLossBackward0``...) inside the model followed by a scale or an added
    term (``.loss / accum_steps``, a z-loss) was refused by this session's tail (trial 89)."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y):
            o = self.lin(x)
            if loss == "cross entropy / 2":
                return F.cross_entropy(o, y, reduction="sum") / 2
            if loss == "mse + z-loss":
                return F.mse_loss(o, torch.zeros_like(o), reduction="sum") + 0.1 * (o**2).sum()
            return F.binary_cross_entropy_with_logits(o, torch.ones_like(o), reduction="sum") * 1.0

    torch.manual_seed(0)
    model = WithLoss().double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1])
    with semipack.extend(model, semipack.Real(), per_sample=True):
        model(x, y).backward()
    for i in range(4):
        want = torch.autograd.grad(model(x[i : i + 1], y[i : i + 1]), model.lin.weight)[0]
        torch.testing.assert_close(model.lin.weight.semiring_grad_batch[i], want)


def test_a_forward_that_turns_grad_on_inside_no_grad_has_rows():
    """A forward that enables grad itself, called under ``torch.no_grad()``, records its graph;
    its batch must be followed (trial 88: a fix that skipped no-grad calls refused it)."""

    class EnablesGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

        def forward(self, x):
            with torch.enable_grad():
                return self.net(x)

    model, x = EnablesGrad().double(), torch.randn(4, 3, dtype=torch.float64)
    with semipack.extend(model, semipack.Real(), per_sample=True):
        with torch.no_grad():
            out = model(x)
        out.pow(2).sum().backward()
    for i in range(4):
        want = torch.autograd.grad(model(x[i : i + 1]).pow(2).sum(), model.net[0].weight)[0]
        torch.testing.assert_close(model.net[0].weight.semiring_grad_batch[i], want)


def test_rows_are_checked_against_the_batch_of_the_call_the_backward_reached():
    """Every parameter's rows on a merged batch (10 rows for 2 examples) are refused, and a
    batch of one run earlier in the block (a no-grad metric) neither makes a position table's
    single row pass beside the others' three nor marks that table as one example's row
    (trial 85: the message blamed an add for mixing the examples)."""
    merged = nn.Sequential(nn.Flatten(0, 1), nn.Conv1d(3, 2, 1))
    _refused(merged, (torch.randn(2, 5, 3, 4),), r"'1\.bias' \(10 rows\), '1\.weight' \(10 rows\)")

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos, self.lin = nn.Embedding(10, 4), nn.Embedding(5, 4), nn.Linear(4, 2)

        def forward(self, ids, pos):
            return self.lin(self.tok(ids) + self.pos(pos))

    model, ids, pos = Positions(), torch.randint(0, 10, (3, 5)), torch.arange(5)[None]
    message = (
        r"the model's first tensor argument, of shape \(3, 5\) has 3 examples in dim 0 "
        r"\(the batch\), but 'pos.weight' \(1 row"
    )
    for no_grad_call_first in (True, False):  # the message names the batch's own call's input
        with semipack.extend(model, semipack.Real(), per_sample=True):
            if no_grad_call_first:
                with torch.no_grad():
                    model(ids[:1], pos)
            loss = model(ids, pos).sum()
            if not no_grad_call_first:  # a later call on a batch of one (trial 92)
                with torch.no_grad():
                    model(ids[:1], pos)
            with pytest.raises(PerSampleError, match=message):
                loss.backward()


class _BroadcastWithTheBatch(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.q = nn.Parameter(torch.randn(1, 2, 4))
        self.p = nn.Parameter(torch.randn(1, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):  # x: [N, 2, 4]
        h = self.lin(x)
        if self.mode == "broadcast_tensors":
            a, b = torch.broadcast_tensors(self.q, h)
            return a * b
        n = x.shape[0]  # the batch merged with the tokens, and p expanded to match
        return (h.reshape(n * 2, 4) * self.p.expand(n * 2, 4)).reshape(n, 2, 4)


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        (
            "broadcast_tensors",
            r"parameter 'q' is used by ExpandBackward0, created by the root module, together "
            r"with a value that carries the batch \(torch\.broadcast_tensors\(p, x\)",
        ),
        (
            "merged",
            r"parameter 'p' goes through ExpandBackward0, and the value computed from it is used "
            r"by MulBackward0 with a value ViewBackward0 computed from the model's input in which "
            r"no dim holds one example per index \('reshape' merged the batch",
        ),
    ],
)
def test_a_parameter_broadcast_with_the_batch_or_onto_a_merged_batch_is_named(mode, match):
    """Both were refused with messages that contradicted themselves (an expand "has no
    per-sample rule", while expands are supported) or hid the cause (the merged batch the same
    model without the expand names; trial 75)."""
    _refused(_BroadcastWithTheBatch(mode), (torch.randn(3, 2, 4),), match, semipack.Real())


def test_refusals_inside_the_pass_and_parameters_without_rows_are_named():
    """Two refusals read "a parameter of shape (3, 3, 4) spans the batch dim" (no parameter had
    that shape) and "no rows reached parameter 'q'" with no cause (trial 75)."""

    class Moved(nn.Module):  # the expanded query transposed before it meets the batch
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Parameter(torch.randn(1, 3, 4))
            self.lin = nn.Linear(4, 4)

        def forward(self, x):  # x: [3, 3, 4], as many tokens as examples
            return self.lin(x) + self.q.expand(x.shape[0], -1, -1).transpose(0, 1)

    class Projected(nn.Module):  # the query is a Linear's input, not its weight
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Parameter(torch.randn(1, 4))
            self.proj = nn.Linear(4, 4)
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + self.proj(self.q).expand(x.shape[0], -1, -1)

    _refused(
        Moved(),
        (torch.randn(3, 3, 4),),
        r"parameter 'q' \(or a value computed from it alone\) is used by AddBackward0, created "
        r"by the root module, where its value, of shape \(3, 3, 4\), spans the batch dim",
    )
    _refused(
        Projected(),
        (torch.randn(3, 2, 4),),
        r"no rows reached parameter 'q', although the backward did: it is used where no rule "
        r"computes its rows \(as the input of a layer, proj\(p\)",
    )


def test_vit_masked_image_modelling_rows_are_per_example_gradients():
    """Hugging Face ViT's masked image modelling blends a mask token expanded to the batch
    with the patches by ``bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)``: the cast to
    another tensor's dtype read as a lost batch, so the model was refused (trial 78). Real's
    rows, the mask token's included, are each example's autograd gradient."""
    import transformers

    config = transformers.ViTConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        image_size=32, patch_size=16, encoder_stride=16,
    )  # fmt: skip
    torch.manual_seed(0)
    vit = transformers.ViTForMaskedImageModeling._from_config(config, attn_implementation="eager")
    vit = vit.double().eval()

    class Reconstruct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = vit

        def forward(self, x, masked):
            return self.vit(pixel_values=x, bool_masked_pos=masked).reconstruction

    model = Reconstruct()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    masked = torch.tensor([[True, False, False, True], [False, False, True, False], [True] * 4])
    with semipack.extend(model, semipack.Real(), per_sample=True):
        _loss(model(x, masked)).backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert hasattr(vit.vit.embeddings.mask_token, "semiring_grad_batch")
    for i in range(3):
        grads = torch.autograd.grad(
            _loss(model(x[i : i + 1], masked[i : i + 1])), [p for _, p in trained],
            allow_unused=True,
        )  # fmt: skip
        for (name, p), want in zip(trained, grads, strict=True):
            if want is None:
                assert not hasattr(p, "semiring_grad_batch"), name
                continue
            # the eager attention's softmax runs in float32 (README: float32 steps)
            torch.testing.assert_close(
                p.semiring_grad_batch[i], want, rtol=1e-6, atol=1e-6, msg=f"{name} {i}"
            )


def test_a_sliced_parameter_has_rows():
    """``pos[:, :T]`` (YOLOS cuts its position table to the tokens), a strided and a negative
    slice, and one row of a stacked table (``w[1]``): the rows of each go back to its entries
    of the parameter, the others get no path (refused as a slice or a select without a rule;
    trial 78)."""

    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 4)
            self.pos = nn.Parameter(torch.randn(1, 6, 4))
            self.gain = nn.Parameter(torch.rand(8) + 0.5)
            self.stacked = nn.Parameter(torch.rand(3, 4) + 0.5)  # one row per use: w[i]

        def forward(self, x):  # x: [N, 3, 2]
            h = self.embed(x) + self.pos[:, : x.shape[1]]
            h = torch.tanh(h * self.gain[::2]) + self.pos[:, -3:]
            return h * self.gain[1::2] * self.stacked[1]

    torch.manual_seed(0)
    model = Sliced().double()
    x = torch.randn(3, 3, 2, dtype=torch.float64)
    # (Entropy reads NaN where no path is, rows 0 and 2 of the stacked table: not compared)
    for sr in (semipack.Real(), semipack.MaxProd(), semipack.LogSum()):
        rows = _rows_of_single_examples(model, lambda r: _loss(model(x[r])), sr, 3)
        assert rows["pos"].shape == (3, 1, 6, 4) and rows["stacked"].shape == (3, 3, 4)


class _TableFirst(nn.Module):
    """A model whose first tensor argument is not the batch: a position table, or a
    temperature of shape [1]."""

    def __init__(self, combine: str) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.combine = combine

    def forward(self, first: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + first) if self.combine == "add" else self.lin(x) * first


@pytest.mark.parametrize(
    ("combine", "first", "x"),
    [("add", (4, 5), (3, 4, 5)), ("scale", (1,), (3, 5))],
    ids=["position table first", "temperature first"],
)
def test_refusals_name_the_argument_taken_as_the_batch(combine, first, x):
    """The batch is dim 0 of the model's first tensor argument: where that is not the batch,
    the refusal says which tensor it took (it blamed the real batch's layout, trial 91)."""
    model = _TableFirst(combine)
    args = (torch.randn(first), torch.randn(x))
    shape = re.escape(f"the model's first tensor argument, of shape {first}")
    block = semipack.extend(model, semipack.Real(), per_sample=True)
    with pytest.raises(semipack.PerSampleError, match=shape), block:
        model(*args).square().sum().backward()


def test_an_rms_norm_over_the_batch_names_its_mixing() -> None:
    """``nn.RMSNorm((N, D))`` on an ``[N, D]`` input normalises over the examples: refused as
    the call's mixing (trial 116: the message blamed a call the block does not follow)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.RMSNorm((5, 4))).double()
    _refused(
        model,
        (torch.randn(5, 3, dtype=torch.float64),),
        r"parameter '1.weight' is used by MulBackward0, created by module '1', with a value "
        r"MulBackward0 computed from the model's input in which no dim holds one example per "
        r"index \('rms_norm' mixed, split or picked the examples\): that operand holds no row "
        r"per example on dim 0",
    )


class _NodeAggregation(nn.Module):
    """A batch of graphs ``[N, nodes, F]`` whose messages move along the node dim (dim 1):
    examples never mix. ``how`` picks the aggregation."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3).double()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        dst = torch.tensor([1, 2, 1])
        rows = torch.arange(h.shape[0])[:, None]
        out = torch.zeros_like(h)
        if self.how == "index_add":
            return out.index_add(1, dst, h)
        if self.how == "index_add_negative_dim":
            return out.index_add(-2, dst, h)
        if self.how == "index_copy":
            return out.index_copy(1, torch.tensor([2, 0, 1]), h)
        if self.how == "index_reduce":
            return out.index_reduce(1, dst, h, "amax", include_self=False)
        if self.how == "index_put_":
            return out.index_put_((rows, dst[None]), h)
        if self.how == "index_put_accumulate":
            return out.index_put_((rows, dst[None]), h, accumulate=True)
        if self.how == "index_add_over_the_batch":  # examples land in other examples' places
            return out.index_add(0, torch.tensor([1, 0, 1]), h)
        if self.how == "index_put_over_the_batch":
            return out.index_put_((torch.tensor([1, 0, 1]),), h)
        raise AssertionError(self.how)


@pytest.mark.parametrize(
    "how",
    [
        "index_add",
        "index_add_negative_dim",
        "index_copy",
        "index_reduce",
        "index_put_",
        "index_put_accumulate",
    ],
)
def test_graph_aggregation_along_the_node_dim_keeps_the_examples(how: str) -> None:
    """``index_add``, ``index_copy`` and ``index_reduce`` along the node dim, and
    ``index_put_`` with the batch indexed by ``arange(N)``, keep each example's rows: they were
    refused as mixing while ``scatter_reduce`` and ``h[rows, dst] = ...`` were accepted
    (trial 121). Rows equal single-example passes."""
    model = _NodeAggregation(how)
    x = torch.randn(3, 3, 4, dtype=torch.float64)
    for sr in (semipack.MaxProd(), semipack.LogSum()):
        _rows_of_single_examples(model, lambda part: _loss(model(x[part])), sr, 3)


@pytest.mark.parametrize(
    ("how", "node"),
    [("index_add_over_the_batch", "IndexAddBackward0"), ("index_put_over_the_batch", "IndexPut")],
)
def test_graph_aggregation_over_the_batch_dim_is_refused(how: str, node: str) -> None:
    _refused(_NodeAggregation(how), (torch.randn(3, 3, 4, dtype=torch.float64),), node)


class _LeftProduct(nn.Module):
    """``W @ unfold(x)``, an im2col written by hand: PyTorch computes ``(uᵀ Wᵀ)ᵀ``, so ``W``
    reaches the product through a transpose, which has no rows; ``rewritten`` is the form
    the refusal suggests."""

    def __init__(self, rewritten: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(2, 4, dtype=torch.float64))
        self.fc = nn.Linear(2, 2).double()
        self.rewritten = rewritten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.unfold(x, 2)
        if self.rewritten:
            h = F.linear(u.transpose(-1, -2), self.w).transpose(-1, -2)
        else:
            h = self.w @ u
        return self.fc(h.mean(-1))


def test_a_parameter_on_the_left_of_a_product_is_refused_with_a_form_that_has_rows() -> None:
    """The refusal named a transpose the user never wrote (trial 120); it now says what the
    product is and how to write it, and that form's rows equal single-example passes."""
    x = torch.randn(3, 1, 5, 5, dtype=torch.float64)
    _refused(
        _LeftProduct(False),
        (x,),
        r"a parameter on the left of a product, W @ x, is computed as \(xᵀ Wᵀ\)ᵀ: write "
        r"F.linear\(x.transpose\(-1, -2\), W\).transpose\(-1, -2\) for its rows",
    )
    model = _LeftProduct(True)
    _rows_of_single_examples(model, lambda part: _loss(model(x[part])), semipack.MaxProd(), 3)


@pytest.mark.parametrize("accumulate", [False, True])
def test_an_out_of_place_index_put_is_followed_as_its_in_place_form(accumulate: bool) -> None:
    """``z.index_put(...)`` (and ``torch.index_put``) is the indexed assignment into a copy of
    ``z``: refused while ``index_put_`` was followed (trial 122). Rows equal single-example
    passes; a write over the batch dim stays refused."""
    dst, src = torch.tensor([1, 2, 0, 0, 3, 3]), torch.tensor([0, 1, 2, 3, 4, 0])

    class Gnn(nn.Module):
        def __init__(self, over_the_batch: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(3, 3).double()
            self.over_the_batch = over_the_batch

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x).tanh()
            z = torch.zeros_like(h)
            if self.over_the_batch:
                return torch.index_put(z, (torch.tensor([1, 0, 1]),), h, accumulate)
            rows = torch.arange(h.shape[0])[:, None]
            return z.index_put((rows, dst[None]), h[:, src], accumulate=accumulate).sum(1)

    x = torch.randn(3, 5, 3, dtype=torch.float64)
    model = Gnn()
    _rows_of_single_examples(model, lambda part: _loss(model(x[part])), semipack.MaxProd(), 3)
    _refused(Gnn(over_the_batch=True), (x,), "an indexed assignment wrote examples")
