"""CUDA: the same values on the GPU as on the CPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import SEMIRINGS
from torch import nn

import semipack
from semipack.kernels.tropical import maxplus, maxplus_argmax

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)


def test_transformer_layer_cuda_matches_cpu(semiring_name: str) -> None:
    make = SEMIRINGS[semiring_name]
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    values = []
    for device in ("cpu", "cuda"):
        model = _block().to(device)
        inp = x.to(device).detach().requires_grad_(True)
        with semipack.extend(model, make()):
            model(inp).pow(2).sum().backward()
        values.append({n: p.semiring_grad for n, p in model.named_parameters()})
    for name, cpu_value in values[0].items():
        gpu_value = values[1][name]
        if isinstance(cpu_value, tuple):
            for a, b in zip(cpu_value, gpu_value, strict=True):
                torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, equal_nan=True)
        elif cpu_value.dtype == torch.bool:
            assert torch.equal(gpu_value.cpu(), cpu_value), name
        else:
            torch.testing.assert_close(
                gpu_value.cpu(), cpu_value, rtol=1e-4, atol=1e-5, equal_nan=True
            )


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 4),
    )


def test_convolutions_cuda_match_cpu(semiring_name: str) -> None:
    make = SEMIRINGS[semiring_name]
    """Conv messages on CUDA (torch convolution backward without cuDNN for the sum-like
    semirings, per-tap semiring matmuls for the others) equal the CPU values."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    values = []
    for device in ("cpu", "cuda"):
        model = _cnn().to(device)
        with semipack.extend(model, make()):
            model(x.to(device)).pow(2).sum().backward()
        values.append({n: p.semiring_grad for n, p in model.named_parameters()})
    for name, cpu_value in values[0].items():
        pairs = (
            zip(cpu_value, values[1][name], strict=True)
            if isinstance(cpu_value, tuple)
            else [(cpu_value, values[1][name])]
        )
        for a, b in pairs:
            if a.dtype == torch.bool:
                assert torch.equal(b.cpu(), a), name
            else:
                torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_compiled_maxplus_on_cuda_matches_reference() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(3, 130, 70, device="cuda", generator=g)
    b = torch.randn(3, 70, 90, device="cuda", generator=g)
    a[0, 5] = float("-inf")
    reference = (a[..., :, :, None] + b[..., None, :, :]).max(-2)
    torch.testing.assert_close(maxplus(a, b), reference.values)
    values, index = maxplus_argmax(a, b)
    torch.testing.assert_close(values, reference.values)
    finite = torch.isfinite(reference.values)
    assert torch.equal(index[finite], reference.indices[finite])


def test_sdpa_cuda_kernel_is_drawn_as_decomposition() -> None:
    q, k, v = (torch.randn(1, 2, 6, 8, device="cuda", requires_grad=True) for _ in range(3))
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    scores = scores.masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool, device="cuda").tril(), -torch.inf
    )
    eager = torch.softmax(scores, -1) @ v
    for make in (semipack.MaxProd, semipack.Entropy):
        got = semipack.grad(fused.sum(), [q, k, v], make(), retain_graph=True)
        want = semipack.grad(eager.sum(), [q, k, v], make(), retain_graph=True)
        for a, b in zip(got, want, strict=True):
            # the first query sees one key: p = 1 has no edge to its score, so q's first row
            # has no path (Entropy's "no path" is NaN), in both drawings
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)


def _assert_same_values(cpu_value, gpu_value, name: str) -> None:
    if isinstance(cpu_value, tuple):
        for a, b in zip(cpu_value, gpu_value, strict=True):
            _assert_same_values(a, b, name)
    elif cpu_value.dtype == torch.bool:
        assert torch.equal(gpu_value.cpu(), cpu_value), name
    else:
        torch.testing.assert_close(gpu_value.cpu(), cpu_value, rtol=1e-4, atol=1e-5, equal_nan=True)


def _tiny_bert():
    import transformers
    from helpers import tiny_bert_config

    torch.manual_seed(0)
    config = tiny_bert_config(vocab_size=300)
    return transformers.BertModel._from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("make", [semipack.MaxProd, semipack.LogSum, semipack.Entropy])
def test_bert_with_its_embedding_table_cuda_matches_cpu(make) -> None:
    """Rows of the word table no token reached are read as "no path" on either device."""
    ids = torch.tensor([[5, 17, 250, 17]])
    values = []
    for device in ("cpu", "cuda"):
        model = _tiny_bert().to(device)
        with semipack.extend(model, make()):
            model(input_ids=ids.to(device)).last_hidden_state.pow(2).sum().backward()
        values.append(
            {n: p.semiring_grad for n, p in model.named_parameters() if hasattr(p, "semiring_grad")}
        )
    assert values[0].keys() == values[1].keys()
    for name, cpu_value in values[0].items():
        _assert_same_values(cpu_value, values[1][name], name)
    table = values[1]["embeddings.word_embeddings.weight"]
    reached = sorted(set(ids.flatten().tolist()))
    assert torch.isfinite(table[reached]).all() and not table[reached].isnan().any()


def test_product_and_monitor_cuda_match_cpu(tmp_path) -> None:
    x = torch.randn(4, 3, 7, 7, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2, 3])
    records = []
    for device in ("cpu", "cuda"):
        model = _cnn().to(device)
        monitor = semipack.Monitor(model, every=1, tensorboard=False)
        with monitor.step(0):
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        records.append({(r.layer, r.quantity): r.value for r in monitor.records})
    assert records[0].keys() == records[1].keys()
    for key, value in records[0].items():
        assert records[1][key] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), key


def test_explain_layers_cuda_matches_cpu() -> None:
    ids = torch.tensor([[1, 7, 3, 9, 2]])
    flows = []
    for device in ("cpu", "cuda"):
        model = _tiny_bert().to(device)
        flows.append(
            semipack.explain_layers(
                model,
                semipack.MaxProd(log=True),
                lambda m=model, d=device: m(input_ids=ids.to(d)).last_hidden_state[0, 0].sum(),
            )
        )
    cpu, gpu = flows
    assert len(cpu.branches) == len(gpu.branches)
    for layer_cpu, layer_gpu in zip(cpu.branches, gpu.branches, strict=True):
        assert layer_cpu.keys() == layer_gpu.keys()
        for name, value in layer_cpu.items():
            _assert_same_values(value, layer_gpu[name], name)


def _normalised_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3),
        nn.BatchNorm2d(4, affine=False),
        nn.Flatten(1),
        nn.LayerNorm(4 * 3 * 3, elementwise_affine=False),
        nn.Linear(4 * 3 * 3, 3),
    )


def test_train_mode_batch_norm_cuda_matches_cpu(semiring_name: str) -> None:
    """Train-mode batch norm on the GPU runs cuDNN's kernel (``cudnn_batch_norm_backward``);
    norms without affine parameters build their unit gains on the input's device."""
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(3))
    _assert_same_values_on_both(lambda: _normalised_cnn().train(), x, SEMIRINGS[semiring_name])


def _assert_same_values_on_both(build, x: torch.Tensor, make) -> None:
    """The model ``build()`` makes (seeded the same way) gives the same ``semiring_grad`` for
    every parameter and for its input ``x`` on the CPU and on the GPU."""
    values = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = build().to(device)
        inp = x.to(device).detach().requires_grad_(True)
        with semipack.extend(model, make()):
            model(inp).pow(2).sum().backward()
        named = {n: p.semiring_grad for n, p in model.named_parameters()}
        values.append({**named, "input": inp.semiring_grad})
    for name, cpu_value in values[0].items():
        _assert_same_values(cpu_value, values[1][name], name)


def test_per_sample_through_eval_batch_norm_cuda_matches_cpu() -> None:
    """Eval-mode batch norm on the GPU is a cuDNN node (``CudnnBatchNormBackward0``)."""
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(4))
    _assert_same_rows_on_both(lambda: _normalised_cnn().eval(), x)


def _assert_same_rows_on_both(build, x: torch.Tensor) -> None:
    """The model ``build()`` makes (seeded the same way) gives the same MaxProd per-sample
    rows for every parameter on the CPU and on the GPU."""
    rows = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = build().to(device)
        with semipack.extend(model, semipack.MaxProd(), per_sample=True):
            model(x.to(device)).pow(2).sum().backward()
        rows.append({n: p.semiring_grad_batch for n, p in model.named_parameters()})
    for name, cpu_value in rows[0].items():
        assert cpu_value.shape[0] == x.shape[0]
        _assert_same_values(cpu_value, rows[1][name], name)


def test_rms_norm_cuda_matches_cpu(semiring_name: str) -> None:
    """``nn.RMSNorm`` on the GPU is one fused node (``FusedRmsNormBackward0``) where the CPU
    records its composite; the rule draws the composite, so the values agree."""
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(5))
    _assert_same_values_on_both(
        lambda: nn.Sequential(nn.Linear(6, 6), nn.RMSNorm(6), nn.Linear(6, 2)),
        x,
        SEMIRINGS[semiring_name],
    )


def test_per_sample_through_rms_norm_cuda_matches_cpu() -> None:
    """The gain of ``nn.RMSNorm`` on the GPU is used by the fused node
    (``FusedRmsNormBackward0``), on the CPU by the composite's product: the same rows."""
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(6))
    _assert_same_rows_on_both(
        lambda: nn.Sequential(nn.Linear(6, 6), nn.RMSNorm(6), nn.Linear(6, 2)), x
    )
