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


def test_gradient_accumulation_records_each_optimizer_step_once(tmp_path) -> None:
    """One context over an optimizer step's micro-batches, as the monitor's own loop does with
    one block around them: each micro-batch had its own record under the same step, with a
    warning that the step was sampled again (trial 53)."""
    plain, watched = _Classifier(), _Classifier()
    _fit(plain, [], tmp_path / "plain", accumulate=2)
    callback = MonitorCallback(every=2, tensorboard=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Monitor.step")
        _fit(watched, [callback], tmp_path / "watched", accumulate=2)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    # five batches, optimizer steps after batches 2, 4 and 5: global steps 0, 0, 1, 1, 2
    steps = [
        r.step for r in callback.monitor.records if r.layer == "net.0" and r.quantity == "log_flow"
    ]
    assert steps == [0, 2]
    # Lightning divides each batch's loss by 2: the records are the loss's own values. Step 0
    # holds both micro-batches' paths: its best path is the better of two separate passes of
    # the first batches (the weights of step 0) with the whole loss
    best = [
        r.value
        for r in callback.monitor.records
        if r.layer == "net.0" and r.quantity == "log_best_path"
    ]
    separate = []
    for x, y in _batches()[:2]:
        first = _Classifier()
        with semipack.extend(first, semipack.MaxProd(log=True)):
            nn.functional.cross_entropy(first(x), y).backward()
        separate.append(float(first.net[0].weight.semiring_grad.max()))
    assert best[0] == pytest.approx(max(separate), abs=1e-6)


class _GAN(pl.LightningModule):
    """Manual optimization with two optimizers: the discriminator's step, then the
    generator's (or the other way round), each after its own ``manual_backward``."""

    def __init__(self, generator_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator_first = generator_first
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, z = batch
        opt_g, opt_d = self.optimizers()
        fake = self.G(z)

        def discriminator_step():
            loss_d = (
                nn.functional.softplus(-self.D(x)).mean()
                + nn.functional.softplus(self.D(fake.detach())).mean()
            )
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()

        def generator_step():
            opt_g.zero_grad()
            self.manual_backward(nn.functional.softplus(-self.D(fake)).mean())
            opt_g.step()

        steps = [discriminator_step, generator_step]
        for step in steps[::-1] if self.generator_first else steps:
            step()

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.G.parameters(), 0.1),
            torch.optim.SGD(self.D.parameters(), 0.1),
        ]


@pytest.mark.parametrize("generator_first", [False, True])
def test_manual_optimization_records_every_backward_of_the_batch(tmp_path, generator_first) -> None:
    """The context closed at the first optimizer step, so the generator's backward ran plain
    and its layers were never recorded (trial 53). Under manual optimization it spans the
    batch: both models' layers are recorded (trial 115: the generator's were lost when it
    was trained first, the second backward replacing the first's values), and training stays
    exact."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)) for _ in range(3)]
    fitted = []
    for callbacks in ([], [MonitorCallback(every=1, tensorboard=False)]):
        module = _GAN(generator_first)
        trainer = pl.Trainer(
            max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
            default_root_dir=tmp_path / str(len(callbacks)),
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(batches, batch_size=None))
        fitted.append(module)
    for a, b in zip(fitted[0].parameters(), fitted[1].parameters(), strict=True):
        assert torch.equal(a, b)
    monitor = callbacks[0].monitor
    assert {r.layer for r in monitor.records} == {"G.0", "G.2", "D.0", "D.2"}
    assert sorted({r.step for r in monitor.records}) == [0, 2, 4]  # two optimizer steps a batch


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


class _SummedClassifier(_Classifier):
    """The loss summed over the examples: under DDP the processes' values then add up to the
    whole batch's."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y, reduction="sum")


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available",
)
def test_a_ddp_fit_records_the_whole_batch_on_every_process_and_one_file(tmp_path) -> None:
    """Two CPU processes (``ddp_spawn``): the callback holds the LightningModule, not DDP's
    wrapper, so each process recorded its own share of the batch and both wrote one file
    (trial 115). Now process 0's file holds what one process records on the two shares
    joined (step 0, before the processes' training moves the weights), also with
    ``distributed=None`` given (trial 116: taken as given, it recorded one share)."""
    import csv

    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    trainer = pl.Trainer(
        max_steps=1, callbacks=[MonitorCallback(every=1, tensorboard=False, distributed=None)],
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", strategy="ddp_spawn", devices=2, default_root_dir=tmp_path,
    )  # fmt: skip
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_SummedClassifier(), loader)
    files = list(tmp_path.rglob("monitor.csv"))
    assert len(files) == 1
    with open(files[0]) as f:
        got = {(r["layer"], r["quantity"]): float(r["value"]) for r in csv.DictReader(f)}
    whole = _SummedClassifier()  # the same seeded weights; the two shares are the 16 examples
    monitor = semipack.Monitor(whole, every=1, tensorboard=False)
    with monitor.step(0):
        whole.training_step((x, y), 0).backward()
    want = {(r.layer, r.quantity): r.value for r in monitor.records}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"every": 0}, ValueError, r"MonitorCallback\(every=...\) needs a positive integer"),
        ({"every": "3"}, ValueError, r"MonitorCallback\(every=...\) needs a positive integer"),
        ({"bogus": 1}, TypeError, "MonitorCallback got an unknown option 'bogus': it takes"),
        ({"entropy": "no"}, TypeError, r"Monitor\(entropy=...\) must be True or False"),
        ({"flush_secs": -1}, ValueError, r"Monitor\(flush_secs=...\) must be 0 or more"),
        ({"log_dir": 3}, TypeError, r"MonitorCallback\(log_dir=...\) takes a folder"),
        ({"overwrite": True, "resume": True}, ValueError, "exclude each other"),
    ],
)
def test_the_callbacks_options_are_checked_when_it_is_made(options, error, message) -> None:
    """Not once ``fit`` starts, and an unknown option is named as the callback's (trial
    115: ``Monitor.__init__()`` was blamed, at the first fit)."""
    with pytest.raises(error, match=message):
        MonitorCallback(**options)


@pytest.mark.parametrize("option", ["resume", "overwrite"])
def test_a_fit_asked_to_resume_or_overwrite_takes_the_folder_itself(tmp_path, option) -> None:
    """``resume=True`` goes on with the folder's records and ``overwrite=True`` replaces them,
    as ``Monitor``'s options say; the callback moved to ``<log_dir>/fit1`` either way (trial
    117). Without them a second fit still writes into ``fit1``."""
    first = MonitorCallback(every=2, log_dir=tmp_path, tensorboard=False)
    _fit(_Classifier(), [first], tmp_path / "root1")
    earlier = len(first.monitor.records)
    again = MonitorCallback(every=2, log_dir=tmp_path, tensorboard=False, **{option: True})
    _fit(_Classifier(), [again], tmp_path / "root2")
    assert again.monitor.log_dir == tmp_path
    rows = (tmp_path / "monitor.csv").read_text().count("\n") - 1
    if option == "resume":  # the same steps again: the earlier rows from step 0 on dropped
        assert rows == earlier and len(again.monitor.records) == earlier
    else:
        assert rows == len(again.monitor.records) == earlier
    plain = MonitorCallback(every=2, log_dir=tmp_path, tensorboard=False)
    _fit(_Classifier(), [plain], tmp_path / "root3")
    assert plain.monitor.log_dir == tmp_path / "fit1"


def test_a_log_dir_that_is_a_file_is_named_when_the_callback_is_made(tmp_path) -> None:
    (tmp_path / "log").write_text("kept")
    with pytest.raises(semipack.SemipackError, match=r"log_dir=.*log'\) is a file, not a folder"):
        MonitorCallback(log_dir=tmp_path / "log")
    np = pytest.importorskip("numpy")
    assert MonitorCallback(every=np.int64(3)).every == 3  # a NumPy integer is an integer
