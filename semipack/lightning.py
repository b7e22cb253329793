"""``MonitorCallback``: ``semipack.Monitor`` inside a PyTorch Lightning ``Trainer``.

Lightning owns the training loop, so the monitor's per-step context is opened when a training
batch starts (before its forward) and closed once the optimizer step's backwards are done: at
``on_before_optimizer_step`` under automatic optimization (the optimizer then steps on the
exact gradient, as in the plain loop). With ``accumulate_grad_batches > 1`` the context stays
open over the step's micro-batches, whose backwards are recorded together (one record per
optimizer step, as the monitor's own loop does with one block around them). Under manual
optimization (``training_step`` calls ``manual_backward`` and steps its optimizers itself,
a GAN's two) it closes at the batch's end: every backward of the batch is recorded, the
generator's as well as the discriminator's. A batch whose ``training_step`` returns None
(Lightning's way to skip it: no backward) is left unrecorded. The records use Lightning's
``global_step`` (which counts every optimizer's steps: two per batch with two optimizers).
Each fit gets its own ``Monitor`` (``callback.monitors``, the latest as ``callback.monitor``);
a fit whose ``log_dir`` already holds a monitor's files (a second fit, another callback, an
earlier run) writes into the first free ``<log_dir>/fit<k>``. Under a ``DDPStrategy`` of
several processes every process records the whole batch's values (``distributed=True``,
unless given as False) and process 0 alone writes the files; with ``ddp_spawn`` the monitors
live in the spawned processes (``callback.monitors`` stays empty in the launching one: read
process 0's files).

Needs ``pytorch_lightning`` (or the ``lightning`` package); ``import semipack`` does not import
this module.
"""

from __future__ import annotations

import inspect
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

try:  # the standalone package first, then the unified one
    from pytorch_lightning import Callback, LightningModule, Trainer
    from pytorch_lightning.strategies import DDPStrategy
except ImportError:  # pragma: no cover - depends on what is installed
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy

from .errors import SemipackError
from .monitor import Monitor, checked_every

__all__ = ["MonitorCallback"]


class _Skipped(Exception):
    """Thrown into a monitor step to leave it without recording (the batch was skipped)."""


class MonitorCallback(Callback):
    """Record ``semipack.Monitor`` summaries of the LightningModule every ``every`` batches.

    ``log_dir`` defaults to ``<trainer.log_dir or default_root_dir>/semipack``; the other
    arguments are ``Monitor``'s. After fitting, ``callback.monitor`` holds the records
    (``monitor.plot()`` draws them). Use::

        trainer = pl.Trainer(callbacks=[semipack.lightning.MonitorCallback(every=10)])
        trainer.fit(module, loader)
    """

    def __init__(self, every: int = 10, log_dir: str | Path | None = None, **monitor: Any) -> None:
        super().__init__()
        _check_monitor_options(every, log_dir, monitor)
        self.every, self.log_dir, self.options = int(every), log_dir, monitor
        self.monitors: list[Monitor] = []
        self._open: AbstractContextManager[bool] | None = None
        self._backward_ran = False

    @property
    def monitor(self) -> Monitor | None:
        """The latest fit's monitor (None before the first fit)."""
        return self.monitors[-1] if self.monitors else None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        log_dir = self.log_dir
        if log_dir is None:
            log_dir = Path(trainer.log_dir or trainer.default_root_dir) / "semipack"
        used = {m.log_dir for m in self.monitors}
        base, k = Path(log_dir), 0
        log_dir = base
        # the same folder again (another fit, another callback, an earlier run of the script):
        # keep the earlier files, this fit writes into the first free <log_dir>/fit<k>; one
        # asked to resume or overwrite them takes the folder itself (trial 117: both were
        # ignored, so a fit resumed from a checkpoint could not go on with its records)
        takes_it = self.options.get("resume") or self.options.get("overwrite")
        while not takes_it and (log_dir in used or (log_dir / "monitor.csv").exists()):
            k += 1
            log_dir = base / f"fit{k}"
        options = dict(self.options)
        # The callback holds the LightningModule, not the strategy's DDP wrapper, so the
        # Monitor cannot see the data parallelism: each process recorded its own share of
        # the batch, all into one file (trial 115). A DDP fit of several processes combines.
        if options.get("distributed") is None:  # None, as not given: detect (trial 116)
            options["distributed"] = combines_processes(trainer)
        if trainer.global_rank != 0:  # one process writes the files (they hold the same)
            log_dir = None
        self.monitors.append(Monitor(pl_module, every=self.every, log_dir=log_dir, **options))

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.monitor is not None, "setup() runs before the first batch"
        if self._open is not None:  # accumulating: the optimizer step's context is open
            return
        scale = _loss_scale(trainer, pl_module)
        self._open = self.monitor.step(trainer.global_step, loss_scale=scale)
        self._open.__enter__()
        self._backward_ran = False

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._backward_ran = True

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer):
        if pl_module.automatic_optimization:
            self._close()  # manual optimization: at the batch's end, after every backward

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx
    ) -> None:
        # Automatic optimization closes at the optimizer step: a batch that did not step
        # (a micro-batch of an accumulation, a skipped batch) leaves the context open for the
        # next, which runs before the same global step.
        if not pl_module.automatic_optimization:
            self._close()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception) -> None:
        if self._open is not None:  # leave the model un-extended, without recording
            self._open.__exit__(type(exception), exception, exception.__traceback__)
            self._open = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()
        if self.monitor is not None:
            self.monitor.close()

    def _close(self) -> None:
        """Leave the open step: recording a sampled one whose backward ran, leaving one whose
        batch was skipped (no backward) without a record; nothing when none is open."""
        if self._open is not None:
            context, self._open = self._open, None
            if self._backward_ran:
                context.__exit__(None, None, None)
            else:
                context.__exit__(_Skipped, _Skipped(), None)


def _check_monitor_options(every: Any, log_dir: Any, options: dict[str, Any]) -> None:
    """The callback's arguments checked when it is made, as ``Monitor`` checks them (they
    were checked only once ``fit`` started, and an unknown one was blamed on
    ``Monitor.__init__``, trial 115): a monitor of a stand-in module, writing no files."""
    checked_every(every, "MonitorCallback")
    unknown = sorted(set(options) - _MONITOR_OPTIONS)
    if unknown:
        raise TypeError(
            f"MonitorCallback got an unknown option {unknown[0]!r}: it takes every, log_dir "
            f"and Monitor's {', '.join(sorted(_MONITOR_OPTIONS))}"
        )
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(
            f"MonitorCallback(log_dir=...) takes a folder, a str or a path, got "
            f"{type(log_dir).__name__}"
        )
    if log_dir is not None and Path(log_dir).exists() and not Path(log_dir).is_dir():
        raise SemipackError(f"MonitorCallback(log_dir={str(log_dir)!r}) is a file, not a folder")
    Monitor(torch.nn.Linear(1, 1), every=every, log_dir=None, **options)


#: ``Monitor``'s options besides the model, ``every`` and ``log_dir``.
_MONITOR_OPTIONS = frozenset(inspect.signature(Monitor).parameters) - {"model", "every", "log_dir"}


def combines_processes(trainer: Trainer) -> bool | None:
    """The Monitor's ``distributed`` for this fit: True for a ``DDPStrategy`` over several
    processes (``strategy="ddp"``, ``"ddp_spawn"``, ...: every process then records the whole
    batch's values); None (the Monitor's own detection) otherwise."""
    if isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1:
        return True
    return None


def _loss_scale(trainer: Trainer, pl_module: LightningModule) -> float | None:
    """The factor the batch's backward root carries: a mixed-precision fit's ``GradScaler``
    scale (``precision="16-mixed"``), divided by ``accumulate_grad_batches`` where Lightning
    divides the loss by it (automatic optimization); None where it is 1."""
    scale = 1.0
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is not None and scaler.is_enabled():
        scale = float(scaler.get_scale())
    if pl_module.automatic_optimization:
        scale /= trainer.accumulate_grad_batches
    return None if scale == 1.0 else scale
