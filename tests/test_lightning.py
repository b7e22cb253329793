"""``semipack.lightning.MonitorCallback``: the monitor inside a Lightning ``Trainer``.

The callback must leave training exact (the parameters after fitting equal a fit without it,
bitwise: sampled steps compute the regular gradient as a plain backward does) and record what
a hand-written loop with ``Monitor.step`` records on the same batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pl = pytest.importorskip("pytorch_lightning")

import semipack  # noqa: E402
from semipack.lightning import MonitorCallback  # noqa: E402


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(5)
    ]


def _fit(module: pl.LightningModule, callbacks: list, folder, accumulate: int = 1) -> None:
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=folder,
        accumulate_grad_batches=accumulate,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(module, DataLoader(_batches(), batch_size=None))  # the batches as given


def test_training_under_the_callback_is_exact_and_records_sampled_steps(tmp_path) -> None:
    plain, watched = _Classifier(), _Classifier()
    _fit(plain, [], tmp_path / "plain")
    callback = MonitorCallback(every=2, log_dir=tmp_path / "monitor")
    _fit(watched, [callback], tmp_path / "watched")
    for (name, a), b in zip(plain.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b), name
    records = callback.monitor.records
    assert sorted({r.step for r in records}) == [0, 2, 4]
    assert {r.layer for r in records} == {"net.0", "net.2"}
    assert (tmp_path / "monitor" / "monitor.csv").read_text().count("\n") == len(records) + 1


def test_the_callback_records_what_a_hand_written_loop_records(tmp_path) -> None:
    callback = MonitorCallback(every=2, tensorboard=False)
    _fit(_Classifier(), [callback], tmp_path)
    by_hand = _Classifier()
    monitor = semipack.Monitor(by_hand, every=2, tensorboard=False)
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_batches()):
        optimizer.zero_grad()
        with monitor.step(step):
            nn.functional.cross_entropy(by_hand(x), y).backward()
        optimizer.step()
    got = [(r.step, r.layer, r.quantity, r.value) for r in callback.monitor.records]
    expected = [(r.step, r.layer, r.quantity, r.value) for r in monitor.records]
    assert got == expected
    assert callback.log_dir is None and (tmp_path / "semipack" / "monitor.csv").exists()


def test_gradient_accumulation_monitors_each_batch_of_a_sampled_step(tmp_path) -> None:
    plain, watched = _Classifier(), _Classifier()
    _fit(plain, [], tmp_path / "plain", accumulate=2)
    callback = MonitorCallback(every=2, tensorboard=False)
    _fit(watched, [callback], tmp_path / "watched", accumulate=2)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    # five batches, optimizer steps after batches 2, 4 and 5: global steps 0, 0, 1, 1, 2
    steps = [
        r.step for r in callback.monitor.records if r.layer == "net.0" and r.quantity == "log_flow"
    ]
    assert steps == [0, 0, 2]
    # Lightning divides each batch's loss by 2: the records are the loss's own values, those
    # of a separate pass of the first batches (the weights of step 0) with the whole loss
    best = [
        r.value
        for r in callback.monitor.records
        if r.layer == "net.0" and r.quantity == "log_best_path"
    ]
    for value, (x, y) in zip(best[:2], _batches()[:2], strict=True):
        first = _Classifier()
        with semipack.extend(first, semipack.MaxProd(log=True)):
            nn.functional.cross_entropy(first(x), y).backward()
        assert value == pytest.approx(float(first.net[0].weight.semiring_grad.max()), abs=1e-6)


class _Skipping(_Classifier):
    """Skips its first batch, as Lightning documents: training_step returns None."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 0 else super().training_step(batch, batch_idx)


def test_a_skipped_batch_is_left_unrecorded(tmp_path) -> None:
    callback = MonitorCallback(every=1, tensorboard=False)
    _fit(_Skipping(), [callback], tmp_path)
    steps = sorted({r.step for r in callback.monitor.records})
    assert steps == [1, 2, 3, 4]  # five batches, the first skipped (it still counts a step)


def test_each_fit_gets_its_own_monitor_and_folder(tmp_path) -> None:
    callback = MonitorCallback(every=2, log_dir=tmp_path / "m", tensorboard=False)
    first, second = _Classifier(), _Classifier()
    _fit(first, [callback], tmp_path / "a")
    _fit(second, [callback], tmp_path / "b")
    assert [m.model for m in callback.monitors] == [first, second]
    assert callback.monitor is callback.monitors[1]
    for monitor, folder in zip(callback.monitors, ("m", "m/fit1"), strict=True):
        assert sorted({r.step for r in monitor.records}) == [0, 2, 4]
        lines = (tmp_path / folder / "monitor.csv").read_text().count("\n")
        assert lines == len(monitor.records) + 1
    # another callback (another run of the script) on the same folder keeps both runs' files
    later = MonitorCallback(every=2, log_dir=tmp_path / "m", tensorboard=False)
    _fit(_Classifier(), [later], tmp_path / "c")
    assert later.monitor.log_dir == tmp_path / "m" / "fit2"
    for folder in ("m", "m/fit1"):
        assert (tmp_path / folder / "monitor.csv").read_text().count("\n") > 1


def test_a_mixed_precision_fits_loss_scale_reaches_the_monitor() -> None:
    """With a GradScaler (``precision="16-mixed"``) each batch's root carries its scale: the
    callback passes it to the monitor step; without one, none."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    from semipack.lightning import _loss_scale

    class Fit:
        precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        accumulate_grad_batches = 1

    Fit.precision_plugin.scaler.scale(torch.ones(()))  # the scaler's scale is set lazily
    module = _Classifier()
    assert _loss_scale(Fit(), module) == 65536.0
    Fit.accumulate_grad_batches = 4  # Lightning divides the loss by it
    assert _loss_scale(Fit(), module) == 65536.0 / 4
    module.automatic_optimization = False  # a manual loop's loss is its own
    assert _loss_scale(Fit(), module) == 65536.0
    assert _loss_scale(pl.Trainer(accelerator="cpu", logger=False), _Classifier()) is None
