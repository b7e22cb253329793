"""Hooks on parameters fire in a plain backward's order inside ``semipack.extend``.

A hook with an order-dependent effect (noise drawn from the global generator per parameter, a
norm summed in hooks) made a monitored training run leave the plain run's trajectory: the
Linear and MultiheadAttention extensions reached their parameters in another order than
PyTorch's ops do (trial 61). The extensions' edges are ordered so that the engine runs the
parameters' gradient nodes as a plain backward does; these tests compare the orders directly
in several graphs and the trajectory of a training run with noise-drawing hooks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_bert_config
from torch import nn

import semipack


def _cases() -> dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]]:
    """name -> (model maker, loss of a forward)."""
    x2, x3 = torch.randn(4, 6), torch.randn(2, 5, 6)
    xg = torch.randn(2, 5, 6, requires_grad=True)
    ids = torch.tensor([[1, 4, 2, 7, 3]])
    return {
        "mlp": (
            lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)),
            lambda m: m(x2).pow(2).sum(),
        ),
        "linear on tokens, no bias": (
            lambda: nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 2)),
            lambda m: m(x3).pow(2).sum(),
        ),
        "attention, input without grad": (
            lambda: nn.MultiheadAttention(6, 2, batch_first=True),
            lambda m: m(x3, x3, x3)[0].pow(2).sum(),
        ),
        "attention, input with grad": (
            lambda: nn.MultiheadAttention(6, 2, batch_first=True),
            lambda m: m(xg, x3, x3)[0].pow(2).sum(),
        ),
        "encoder": (
            lambda: nn.TransformerEncoder(
                nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True),
                2,
                enable_nested_tensor=False,
            ),
            lambda m: m(xg).pow(2).sum(),
        ),
        "cnn": (
            lambda: nn.Sequential(
                nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2)
            ),
            lambda m: m(torch.randn(2, 1, 4, 4)).pow(2).sum(),
        ),
        "bert": (
            lambda: _bert(),
            lambda m: m(input_ids=ids).last_hidden_state.pow(2).sum(),
        ),
        "gpt2": (  # Conv1D's addmm with its weight as the right operand
            lambda: _gpt2(),
            lambda m: m(input_ids=ids).last_hidden_state.pow(2).sum(),
        ),
    }


def _bert() -> nn.Module:
    from transformers import BertModel

    return BertModel(tiny_bert_config(num_hidden_layers=2))


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=20, n_embd=8, n_layer=2, n_head=2, n_positions=8, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2Model(config)


CASES = _cases()


def _orders(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], semiring) -> list:
    """The names of the parameters in the order their tensor hooks and post-accumulate hooks
    fire in one backward (plain where ``semiring`` is None)."""
    order: list[str] = []
    handles = []
    for name, p in model.named_parameters():
        handles.append(p.register_hook(lambda g, name=name: order.append(name)))
        handles.append(
            p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(f"{name}+"))
        )
    model.zero_grad(set_to_none=True)
    if semiring is None:
        loss(model).backward()
    else:
        with semipack.extend(model, semiring):
            loss(model).backward()
    for handle in handles:
        handle.remove()
    return order


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("semiring", [semipack.MaxProd, semipack.Entropy, semipack.TopPath])
def test_parameter_hooks_fire_in_a_plain_backwards_order(name: str, semiring) -> None:
    make, loss = CASES[name]
    torch.manual_seed(0)
    model = make()
    plain = _orders(model, loss, None)
    assert len(plain) >= 4  # BERT's pooler is not reached: its hooks do not fire
    assert _orders(model, loss, semiring()) == plain


def _noisy_run(monitored: bool) -> list[torch.Tensor]:
    """Three SGD steps of a small transformer classifier whose parameter hooks add noise from
    the global generator (one draw per parameter, in hook order)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(30, 3),
    )
    for p in model.parameters():
        p.register_hook(lambda g: g + 1e-3 * torch.randn_like(g))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = semipack.Monitor(model, every=1, tensorboard=False) if monitored else None
    torch.manual_seed(1)
    for step in range(3):
        x, y = torch.randn(4, 5, 6), torch.randint(0, 3, (4,))
        optimizer.zero_grad()
        if monitor is None:
            F.cross_entropy(model(x), y).backward()
        else:
            with monitor.step(step):
                F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_training_with_noise_drawing_hooks_keeps_its_trajectory_under_the_monitor() -> None:
    for a, b in zip(_noisy_run(False), _noisy_run(True), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
