"""A training monitor: semiring summaries of every layer, recorded on sampled steps.

``Monitor`` plugs into an ordinary training loop as a context per step. On a sampled step
(every ``every``-th) the step's own ``loss.backward()`` runs as one semiring backward of a
``Product`` of the monitored semirings: the optimizer sees the exact regular gradient (the
pass computes it bitwise as a plain backward does), and the semiring values of every parameter
come out of the same pass. Other steps run untouched.

Per layer (each module that owns parameters, read at its ``weight``, at the parameter a
computed weight is made from, or at its first trained parameter, see ``_layers``;
the unit dim is the parameter's first dim: a Linear's output neurons, a convolution's output
channels) a sampled step records:

- ``entropy_mean``, ``entropy_max``: mean and max over the entries of the path entropy (nats);
- ``log_best_path``: log of the largest single-path product reaching the layer (MaxProd);
- ``log_flow``: log of the total flow, every path to every entry together (LogSum);
- ``dead_units``: fraction of units no path reaches (no entry of the unit has one);
- ``top_path_changed``: 1 where the entry with the best path differs from the last sampled
  step's, else 0 (its mean over steps is how often the top path moves);
- ``flow_share`` for each module given in ``splits`` (recorded as the layer ``"<split> ->
  <use>"``): the share of the total flow that leaves that module's input by each use, named
  after the module making the call (a block's own forward, where the residual add is, against
  its attention branch, say).

The records go to ``monitor.csv`` and TensorBoard (``torch.utils.tensorboard``) in
``log_dir``; ``plot`` draws one PNG per quantity over steps, one line per layer.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import itertools
import math
import numbers
import os
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parametrize

from .api import extend, last_block_reached, open_block_semiring
from .distributed import all_reduce
from .errors import SemipackError
from .explain.branches import Branches, branches
from .graph.provenance import display_name
from .graph.sites import ROOT_MODULE
from .kernels.summaries import best_entry, count_sum_max_of_numbers, log_sum_exp
from .semirings import Entropy, EntropyFlow, LogSum, MaxProd, Product, Semiring

QUANTITIES = (
    "entropy_mean", "entropy_max", "log_best_path", "log_flow", "dead_units", "top_path_changed",
    "flow_share",
)  # fmt: skip


#: How long a combining step waits for every process to reach its own (a Monitor made on one
#: process alone, or step numbers that differ between processes, would otherwise wait for the
#: others' values until the process group's timeout, 30 minutes by default, and fail with the
#: backend's error).
PEER_TIMEOUT = datetime.timedelta(minutes=5)

#: Numbers the Monitors of this process that combine processes' values, in the order of their
#: first combining step: the processes' monitors meet under the same number.
_COMBINING = itertools.count()


@dataclass(frozen=True)
class Record:
    """One value: a quantity of one layer at one step."""

    step: int
    layer: str
    quantity: str
    value: float


class Monitor:
    """Semiring summaries of ``model``'s layers on every ``every``-th step.

    Use::

        monitor = semipack.Monitor(model, every=10, log_dir="runs/semiring")
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            with monitor.step(step):
                loss = lossfunc(model(x), y)
                loss.backward()        # a semiring backward on sampled steps
            optimizer.step()           # always the exact gradient
        monitor.close()
        monitor.plot("runs/semiring")

    ``splits`` names modules whose input is split by use (``semipack.branches``) to record
    the share of the flow through each use; the forward must then run inside ``step``.
    Under data parallelism (``distributed``, by default on when ``model`` is or holds a
    ``DistributedDataParallel`` of several processes) every sampled step combines the
    processes' values with ``semipack.distributed.all_reduce`` before summarising, so every
    process records the whole batch's summaries (pass the ``DistributedDataParallel``
    wrapper as ``model``, and sum the loss over examples for the values to be the whole
    batch's); ``splits`` stay per process. Every process must then create the Monitor and run
    its steps with the same step numbers (``log_dir=None`` on those that write no files): one
    made on a single process raises at its first sampled step, after ``PEER_TIMEOUT``, and
    step numbers that differ between processes raise at the first sampled step they do.
    The semiring is ``Product(MaxProd(log=True), Entropy(flow=True))``: Entropy's state holds
    the log total flow as well, so no LogSum factor runs beside it. ``entropy=False``
    runs ``Product(MaxProd(log=True), LogSum())`` instead, the cheaper pass without entropies.
    The records reach ``monitor.csv`` and TensorBoard every ``flush_secs`` seconds (writing a
    step at a time costs more than the summaries), and all of them on ``flush()``, ``close()``
    (or leaving ``with Monitor(...) as monitor:``), an exception through ``step`` and at exit;
    steps sampled after ``close()`` are kept in ``records`` only (the first one warns).
    A ``log_dir`` that already holds a ``monitor.csv`` (an earlier run's, or another monitor
    writing there) is refused unless ``overwrite=True``, which replaces that file (TensorBoard
    keeps every run's event files in the folder), or ``resume=True``: a run resumed from a
    checkpoint goes on with the earlier run's records (read back into ``records``, for
    ``series`` and ``plot``); those of the steps from the first one this monitor records on
    (written after the checkpoint) are dropped from the file. The top-path comparison
    starts afresh at that step. ``extensions=False`` runs the sampled steps' backward on the
    generic rules (``extend``'s option): a loss that adds first-order terms to a gradient
    penalty (WGAN-GP) then trains with a plain run's bits, where the extensions' second-order
    gradients are a plain run's up to rounding.
    """

    def __init__(
        self,
        model: nn.Module,
        every: int = 10,
        log_dir: str | Path | None = None,
        splits: dict[str, nn.Module] | None = None,
        entropy: bool = True,
        tensorboard: bool = True,
        distributed: bool | None = None,
        flush_secs: float = 5.0,
        overwrite: bool = False,
        resume: bool = False,
        extensions: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"Monitor expects the model, an nn.Module, got {type(model).__name__} (for "
                "several models, one Monitor each, or an nn.ModuleList of them)"
            )
        every = checked_every(every)
        _check_options(
            entropy=entropy,
            tensorboard=tensorboard,
            overwrite=overwrite,
            resume=resume,
            extensions=extensions,
            distributed=distributed,
            flush_secs=flush_secs,
        )
        if overwrite and resume:
            raise ValueError("Monitor: overwrite=True and resume=True exclude each other")
        _check_log_dir(log_dir)
        self.model, self.every = model, every
        self.splits = _checked_splits(splits)
        flow = Entropy(flow=True) if entropy else LogSum()
        self.semiring = Product(MaxProd(log=True), flow)
        self.distributed = distributed
        self.extensions = extensions
        self.layers = _layers(model)
        self.records: list[Record] = []
        self._best: dict[str, int] = {}
        self._count = 0
        self._closed = False
        self._last_recorded: int | None = None
        #: under data parallelism: the store prefix of this monitor's meetings and their count
        self._meetings: list | None = None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._files: _Files | None = None
        if self.log_dir is not None:
            if self.log_dir.exists() and not self.log_dir.is_dir():
                raise SemipackError(f"Monitor(log_dir={str(log_dir)!r}) is a file, not a folder")
            if (self.log_dir / "monitor.csv").is_dir():
                raise SemipackError(
                    f"Monitor(log_dir={str(log_dir)!r}): its monitor.csv is a folder, not a file"
                )
            earlier = self.log_dir / "monitor.csv"
            if earlier.exists() and not (overwrite or resume):
                raise SemipackError(
                    f"Monitor(log_dir={str(log_dir)!r}): the folder holds a monitor.csv already "
                    "(an earlier run's records, or another monitor's writing there): pass "
                    "another log_dir, resume=True to go on with it, or overwrite=True to "
                    "replace it"
                )
            if resume and earlier.exists():
                self.records = _read_records(earlier)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._files = _Files(self.log_dir, tensorboard, flush_secs, self.records)
            # a monitor dropped, or a run ending, without close() still leaves complete files
            weakref.finalize(self, self._files.close)

    def sampled(self, step: int) -> bool:
        """Whether ``step`` runs a semiring backward."""
        return step % self.every == 0

    def step(self, step: int | None = None, loss_scale: float | None = None) -> _StepBlock:
        """The context of one training step (forward and ``backward()`` inside); yields whether
        the step is sampled. ``step`` defaults to a counter of the blocks entered.

        ``loss_scale``: see ``_step``. A block made and never entered (``monitor.step(i)``
        without ``with``) records nothing and warns when it is dropped."""
        return _StepBlock(self._step(step, loss_scale))

    @contextmanager
    def _step(self, step: int | None = None, loss_scale: float | None = None) -> Iterator[bool]:
        """``step``'s block.

        ``loss_scale``: the factor the backward's root carries (``scaler.get_scale()`` when the
        loop runs ``scaler.scale(loss).backward()`` with a ``GradScaler``). Every path product
        carries it, so ``log_best_path`` and ``log_flow`` are recorded less ``log(loss_scale)``:
        the loss's own values, which do not jump when the scaler changes its scale. The
        entropies, dead units, top-path changes and flow shares do not depend on it."""
        if loss_scale is not None and not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale must be a finite positive number, got {loss_scale!r}")
        step = self._count if step is None else _step_number(step)
        self._count += 1
        sampled = False  # True from the moment this block's semiring pass may give values
        try:
            if not self.sampled(step):
                yield False
                return
            if self._last_recorded is not None and step < self._last_recorded:
                warnings.warn(
                    f"Monitor.step({step}) comes after step {self._last_recorded} was recorded: "
                    "both steps' records are kept (monitor.csv holds the same step twice where "
                    "a step number comes again), and the top path is compared with step "
                    f"{self._last_recorded}'s; number the steps in order (a run restarted from "
                    "a checkpoint: Monitor(..., resume=True) in a new monitor)",
                    stacklevel=4,
                )
            if step == self._last_recorded:
                warnings.warn(
                    f"Monitor.step({step}) is sampled again: each block runs its own semiring "
                    "backward and records it, so the step is recorded twice (and its top path "
                    "compared with itself); for gradient accumulation, open one block around "
                    "the whole step's micro-batches",
                    stacklevel=4,
                )
            combine = self._combines_processes()
            if combine:
                self._meet_peers(step)
            _check_no_open_block(step)
            self._read_layers()
            self._clear()
            sampled = True
            with ExitStack() as stack:
                stack.enter_context(
                    extend(
                        self.model,
                        self.semiring,
                        keep_state=combine,
                        extensions=self.extensions,
                        accumulate=True,  # a step's backwards together (micro-batches, a GAN)
                    )
                )
                splits = {
                    name: stack.enter_context(branches(module))
                    for name, module in self.splits.items()
                }
                yield True
                self._check_splits(step, splits)
            self._check_backward(step)
            if combine:  # every process: the whole batch's values (each layer's plus over them)
                all_reduce(list(self.layers.values()), self.semiring)
            self._record(step, splits, math.log(loss_scale) if loss_scale is not None else 0.0)
            self._last_recorded = step  # a step whose pass failed was not recorded: no warning
            self._drop_values()
        except BaseException as error:
            if sampled:  # a failed step is not recorded: its values leave the parameters too
                self._drop_values()
                if isinstance(error, SemipackError):
                    error.add_note(_failed_step_note(step))
            self.flush()  # the run may end here: every earlier record goes to the files
            raise

    def _read_layers(self) -> None:
        """The layers and the parameter each is read at, as the model is now: a weight frozen
        (or unfrozen) during training moves its layer to its bias (or back), and a layer with
        nothing left to train drops out. A layer read at another parameter than before starts
        its top-path record afresh (an entry index of the other tensor is no comparison)."""
        layers = _layers(self.model)
        for name in list(self._best):
            if layers.get(name) is not self.layers.get(name):
                del self._best[name]
        self.layers = layers

    def _clear(self) -> None:
        """Drop the values an earlier pass left on the monitored parameters, so that only this
        step's backward is read (a backward run after the block would leave none)."""
        _drop_values_of(self.layers.values())

    def _drop_values(self) -> None:
        """Once recorded, the pass's values leave the parameters: the monitor keeps its
        summaries only. Left there, every parameter held three readouts of its size until the
        next sampled step (memory, and a saved model three times larger). Tensors outside
        the model that the step's passes reached (a generator's loss runs through the
        discriminator) lose theirs too."""
        _drop_values_of([*self.model.parameters(), *last_block_reached()])

    def _check_backward(self, step: int) -> None:
        """A sampled step whose backward did not run inside the block, or reached none of the
        model's layers, has nothing to record; the values it gave to other tensors (another
        model's parameters) are dropped as a recorded step's are."""
        if any(hasattr(p, "semiring_grad") for p in self.layers.values()):
            return
        elsewhere = [t for t in last_block_reached() if hasattr(t, "semiring_grad")]
        _drop_values_of(elsewhere)
        if elsewhere:
            raise SemipackError(
                f"Monitor.step({step}): the backward inside the block reached none of the "
                f"monitored model's layers, only {len(elsewhere)} tensor(s) outside it: does "
                "the step run another model than the one given to Monitor (a copy, an EMA "
                "model, a model made again when a checkpoint was loaded)? Give Monitor the "
                "model the step trains"
            )
        raise SemipackError(
            f"Monitor.step({step}): no backward reached the model inside the block; call "
            "loss.backward() inside `with monitor.step(...)` (a backward after the block "
            "is a plain one: the sampled step would have nothing to record)"
        )

    def _check_splits(self, step: int, splits: dict[str, Branches]) -> None:
        """Each split module must be called by the step's forward (inside the block)."""
        for name, split in splits.items():
            if split.split is None:
                module = type(self.splits[name]).__name__
                raise SemipackError(
                    f"Monitor(splits={{{name!r}: {module}}}): the module was not called in step "
                    f"{step}; run the forward inside `with monitor.step(...)`, and split a "
                    "module that the forward calls"
                )

    def _combines_processes(self) -> bool:
        """Whether sampled steps combine every process's values (``distributed``; by default
        when the model is, or holds, a ``DistributedDataParallel`` of several processes: a
        model each process runs on its own data is left alone)."""
        if self.distributed is not None:
            return self.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        return any(isinstance(m, DistributedDataParallel) for m in self.model.modules())

    def _meet_peers(self, step: int) -> None:
        """At every step that combines values, wait (at most ``PEER_TIMEOUT``) until every
        process has reached its own Monitor's sampled step of the same count, and check that
        they all sampled the same step number. Through the process group's store, before any
        collective: a Monitor made on one process only (the usual "log on rank 0") or step
        numbers that differ between processes (a counter per process that one of them skips)
        raise, naming the processes, where the combining collectives would pair with another
        step's (wrong values) or wait until the process group timed out (30 minutes by
        default) and fail with the backend's error."""
        store = dist.distributed_c10d._get_default_store()
        if self._meetings is None:
            self._meetings = [f"semipack/monitor/{next(_COMBINING)}/", 0]
        prefix, count = self._meetings
        rank, world = dist.get_rank(), dist.get_world_size()
        keys = [f"{prefix}{count}/{r}" for r in range(world)]
        store.set(keys[rank], str(step))
        timeout = PEER_TIMEOUT  # a timedelta, or seconds (trial 75 set 5.0: a crash followed)
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        try:
            store.wait(keys, timeout)
        except RuntimeError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            ranks = ", ".join(map(str, missing))
            if count == 0:
                raise SemipackError(
                    f"Monitor: the processes of rank {ranks} did not reach a sampled Monitor "
                    f"step within {timeout.total_seconds():g} s. Under "
                    "DistributedDataParallel every sampled step combines every process's "
                    "values, so every process must create the Monitor and run its steps, with "
                    "the same step numbers: to write files on one process, pass log_dir there "
                    "and log_dir=None on the others; to record one process's own batch alone, "
                    "pass distributed=False"
                ) from None
            raise SemipackError(
                f"Monitor.step({step}): the processes of rank {ranks} did not reach their "
                f"sampled step number {count + 1} within {timeout.total_seconds():g} s "
                f"(this process, rank {rank}, did at step {step}). Under "
                "DistributedDataParallel every process must pass the same step numbers to "
                "monitor.step() (a global step, not a counter of each process's own), so that "
                "they sample the same steps"
            ) from None
        steps = [int(store.get(key)) for key in keys]
        if count > 0:  # every process has read the previous meeting's keys: drop this one's
            store.delete_key(f"{prefix}{count - 1}/{rank}")
        self._meetings[1] = count + 1
        if len(set(steps)) > 1:
            by_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
            raise SemipackError(
                f"Monitor.step({step}): the processes sampled different steps ({by_rank}); "
                "under DistributedDataParallel every process must pass the same step numbers "
                "to monitor.step() (a global step, not a counter of each process's own), so "
                "that their sampled steps combine the same step's values"
            )

    def _record(self, step: int, splits: dict[str, Branches], log_scale: float = 0.0) -> None:
        """Summarise the step's values and write them out: every layer's summaries come to
        the host in one transfer (``_summaries``), and the files get one CSV write and one
        TensorBoard event per step (per-value events cost more than the summaries).
        ``log_scale``: the log of the root's loss scale, taken off the path products' logs."""
        reached = {}
        for name, param in self.layers.items():
            values = getattr(param, "semiring_grad", None)
            if values is not None:  # else this step's backward does not reach the layer
                reached[name] = values
        rows: list[Record] = []
        for name, summary in zip(reached, _summaries(list(reached.values())), strict=True):
            if summary is not None and "best" in summary:  # to compare with the next step's
                best = summary.pop("best")
                if name in self._best:
                    summary["top_path_changed"] = float(best != self._best[name])
                self._best[name] = best
            elif summary is not None:  # NaN values: unknown, the next step compares with the
                # last step that had a best entry
                summary["top_path_changed"] = math.nan
            else:  # in the graph, but no path: only its deadness
                summary = {"dead_units": 1.0}
            for quantity in ("log_best_path", "log_flow"):
                if quantity in summary:
                    summary[quantity] -= log_scale
            rows += [Record(step, name, q, v) for q, v in summary.items()]
        for name, split in splits.items():
            for use, share in _flow_shares(split).items():
                use = _without_wrapper(self.model, use)
                rows.append(Record(step, f"{name} -> {use}", "flow_share", share))
        if self._files is not None and self._files.resumed:  # the earlier run's later steps go
            self.records = [r for r in self.records if r.step < step]
            self._files.rewrite(self.records, step)
        self.records += rows
        if self._files is not None and rows:
            self._files.add(step, rows)

    def series(self, quantity: str) -> dict[str, tuple[list[int], list[float]]]:
        """Layer -> (steps, values) of ``quantity`` over the recorded steps."""
        out: dict[str, tuple[list[int], list[float]]] = {}
        for r in self.records:
            if r.quantity == quantity:
                steps, values = out.setdefault(r.layer, ([], []))
                steps.append(r.step)
                values.append(r.value)
        return out

    def plot(self, out: str | Path | None = None) -> list[Path]:
        """One PNG per recorded quantity (``<quantity>.png``) in ``out``
        (default ``log_dir``): the quantity over steps, one line per layer."""
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        folder = Path(out) if out is not None else self.log_dir
        if folder is None:
            raise SemipackError("Monitor.plot needs a folder: pass out=..., or log_dir")
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for quantity in dict.fromkeys(r.quantity for r in self.records):
            fig, ax = plt.subplots(figsize=(6, 3.4))
            series = self.series(quantity)
            many = len(series) > 10
            for k, (layer, (steps, values)) in enumerate(series.items()):
                style = _line_style(k) if many else {}
                if "marker" not in style:
                    style["marker"] = "." if len(steps) < 30 else None
                ax.plot(steps, values, label=layer, **style)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5 (trial 115)
            ax.set_title(quantity)
            if many:  # outside the axes: a long legend hides the lines; columns of at most
                # _LEGEND_ROWS keep it as tall as the axes (65 layers made it twice as tall,
                # and tight_layout gave up on every picture, trial 130)
                columns = -(-len(series) // _LEGEND_ROWS)
                ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), ncol=columns)
            else:
                ax.legend(fontsize=7, loc="best")
                fig.tight_layout()
            path = folder / f"{quantity}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")  # a long layer name kept whole
            plt.close(fig)
            written.append(path)
        return written

    def flush(self) -> None:
        """Write every record so far to ``monitor.csv`` and TensorBoard's events now (they are
        otherwise written every ``flush_secs``)."""
        if self._files is not None:
            self._files.flush()

    def close(self) -> None:
        """Write every record and close the CSV file and the TensorBoard writer. A monitor
        closed before any ``step`` block was entered warns: its loop never used it (trial
        115: nothing was recorded, in silence)."""
        if self._count == 0 and not self._closed:
            warnings.warn(
                "Monitor.close(): no step block was entered, so nothing was recorded; wrap each "
                "training step in `with monitor.step(step):`, its forward and backward inside",
                RuntimeWarning,
                stacklevel=2,
            )
        self._closed = True
        if self._files is not None:
            self._files.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the files, also when the block ends with an exception (not swallowed)."""
        self.close()


def _step_number(step: object) -> int:
    """``step`` as an int: a Python or NumPy integer, or a tensor holding one (Adam's
    ``state["step"]`` is ``tensor(3.)``, which the CSV wrote as ``tensor(3.)``)."""
    try:
        if isinstance(step, (str, bytes)):
            raise TypeError
        number = int(step)  # type: ignore[call-overload]
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"Monitor.step: step must be an integer, got {step!r}") from None
    if bool(number != step):
        raise ValueError(f"Monitor.step: step must be an integer, got {step!r}")
    return number


def _layers(model: nn.Module) -> dict[str, nn.Parameter]:
    """Module name -> the parameter summarised for it: its ``weight`` if that trains; for a
    weight computed from other parameters, the one holding its entries (a parametrized
    weight's ``original``, an old-style ``spectral_norm``'s ``weight_orig``: the module's only
    matrix); for a frozen weight with trained matrices beside it (LoRA's ``A`` and ``B``), one
    layer per trained matrix, named after it; else its first own parameter that trains (a
    frozen weight with a trained bias is read at the bias). A module without a ``weight`` but
    with several matrices is one layer per trained matrix (``W1``, ``block.W2``); modules with
    no trained parameter of their own are left out (a parametrization's own module too: its
    parameters are its layer's).
    Names are the model's as written: a ``torch.compile``d model's without its ``_orig_mod.``
    prefix, a ``DistributedDataParallel`` (or ``DataParallel``) model's without its
    ``module.``, so a data-parallel run's records have one process's names."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, parametrize.ParametrizationList):
            continue  # read at the module it parametrizes
        own = dict(module.named_parameters(recurse=False))
        weight = own.get("weight")
        if weight is None and parametrize.is_parametrized(module, "weight"):
            weight = _parametrized_original(module)
        if weight is None:  # the old hooks' ``weight_norm`` and ``spectral_norm``
            weight = own.get("weight_v", own.get("weight_orig"))
        # the old hooks' weight norm of another weight (an RNN's ``weight_hh_l0``): its
        # magnitude ``<name>_g`` is read with its direction ``<name>_v``, not as a layer
        own = {n: p for n, p in own.items() if not (n.endswith("_g") and f"{n[:-2]}_v" in own)}
        trained = [p for p in own.values() if p.requires_grad]
        matrices = {n: p for n, p in own.items() if p.dim() >= 2}
        trained_matrices = {n: p for n, p in matrices.items() if p.requires_grad}
        frozen_weight = weight is not None and not weight.requires_grad
        if (weight is None and len(matrices) > 1) or (frozen_weight and trained_matrices):
            # a hand-written module with several weight matrices (``x @ self.W1``, then
            # ``@ self.W2``), or trained matrices beside a frozen weight (LoRA): one layer per
            # trained matrix, named after it (read as one layer, the others went unrecorded)
            for pname, p in trained_matrices.items():
                out[display_name(f"{name}.{pname}" if name else pname)] = p
        elif weight is not None and weight.requires_grad:
            out[display_name(name) or ROOT_MODULE] = weight
        elif trained_matrices and weight is None:  # one matrix (``W``) beside vectors
            out[display_name(name) or ROOT_MODULE] = next(iter(trained_matrices.values()))
        elif trained:
            out[display_name(name) or ROOT_MODULE] = trained[0]
    if not out:
        raise SemipackError(f"Monitor: {type(model).__name__} has no trainable parameters")
    return out


def _parametrized_original(module: nn.Module) -> nn.Parameter:
    """The parameter a parametrized ``weight`` is computed from (``original``), weight norm's
    direction ``original1`` (shaped like the weight; its magnitude ``original0`` may have as
    many entries, in a layer of one input), or of other several the one with the most
    entries. The weight itself is not computed: a spectral norm's power iteration would move
    its buffers."""
    originals = dict(module.parametrizations.weight.named_parameters(recurse=False))
    for name in ("original", "original1"):
        if name in originals:
            return originals[name]
    return max(originals.values(), key=lambda p: p.numel())


def _flow_and_entropy(value: Tensor | EntropyFlow) -> tuple[Tensor, Tensor | None]:
    """(log flow, entropy or None) from the Product's second readout: LogSum's log flow, or
    ``Entropy(flow=True)``'s pair."""
    if isinstance(value, EntropyFlow):
        return value.log_flow.detach(), value.entropy.detach()
    return value.detach(), None


class _StepBlock:
    """``Monitor.step``'s context: the step's own block, and a warning when it is dropped
    without having been entered (``monitor.step(i)`` without ``with`` ran the step plain and
    recorded nothing, silently, trial 110)."""

    def __init__(self, block: Any) -> None:
        self._block = block
        self._entered = False

    def __enter__(self) -> bool:
        self._entered = True
        return self._block.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._block.__exit__(*exc)

    def __del__(self) -> None:
        if self._entered:
            return
        with contextlib.suppress(Exception):  # at interpreter exit warnings may be gone
            warnings.warn(
                "Monitor.step(...) was made but never entered, so the step was not monitored: "
                "use it as a block, `with monitor.step(step): loss.backward()`",
                RuntimeWarning,
                stacklevel=2,
            )


def checked_every(every: Any, owner: str = "Monitor") -> int:
    """``every`` as an int, or a ValueError naming ``owner``'s argument (a NumPy integer is
    an integer; a bool is not)."""
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(f"{owner}(every=...) needs a positive integer, got {every!r}")
    return int(every)


def _check_options(*, distributed: Any, flush_secs: Any, **flags: Any) -> None:
    """A TypeError or ValueError naming an option given a value it does not take: a string
    counted as True (``entropy="no"`` ran with the entropies), and ``flush_secs="5"`` failed
    at the first sampled step with an unrelated comparison error (trial 115)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"Monitor({name}=...) must be True or False, got {_shown(value)}")
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(
            f"Monitor(distributed=...) must be True, False or None (detect DDP), got "
            f"{_shown(distributed)}"
        )
    if isinstance(flush_secs, bool) or not isinstance(flush_secs, numbers.Real):
        raise TypeError(
            f"Monitor(flush_secs=...) takes a number of seconds, got {_shown(flush_secs)}"
        )
    if not flush_secs >= 0:  # NaN too
        raise ValueError(f"Monitor(flush_secs=...) must be 0 or more seconds, got {flush_secs!r}")


def _check_log_dir(log_dir: Any) -> None:
    """A TypeError for a ``log_dir`` that is no folder name (a semiring given third, trial 110:
    pathlib's error named no argument); a ValueError for an empty one (``""`` is the current
    folder to pathlib: the files landed there, trial 119)."""
    if isinstance(log_dir, (str, os.PathLike)):
        name = os.fspath(log_dir)
        if not name.strip():  # "" or spaces: the current folder, or one named by blanks
            raise ValueError(
                f'Monitor(log_dir={name!r}) names no folder: pass a folder name ("." for '
                "the current one) or None for no files"
            )
        return
    if log_dir is None:
        return
    hint = ""
    if isinstance(log_dir, Semiring):
        hint = (
            ": the monitor picks its semirings itself (MaxProd and Entropy; MaxProd and LogSum "
            "with entropy=False), and its third argument is log_dir"
        )
    raise TypeError(
        f"Monitor(log_dir=...) takes a folder, a str or a path, got {type(log_dir).__name__}{hint}"
    )


def _check_no_open_block(step: int) -> None:
    """A sampled step runs its backward in a block of its own: raise, naming the monitor, when
    one is open already in this thread (two monitors' sampled steps nested, or the step inside
    a ``semipack.extend`` block): ``extend``'s error spoke of blocks and ``Product`` only,
    which the user never called (trial 119)."""
    active = open_block_semiring()
    if active is not None:
        raise SemipackError(
            f"Monitor.step({step}) is sampled while a semiring block is already open in this "
            f"thread (for {active!r}): another Monitor's sampled step, or a semipack.extend "
            "block around this one. A backward runs one semiring pass, so two monitors' "
            "sampled steps cannot overlap: monitor the model with one Monitor, or give the "
            "monitors steps that are never sampled together"
        )


def _failed_step_note(step: int) -> str:
    """The note added to a semipack error raised inside a sampled step: the step's backward
    was the semiring pass, so a failure there also left the step without gradients."""
    return (
        f"(raised inside Monitor.step({step}), a sampled step: its backward is the semiring "
        "backward, so where that backward failed the step has no .grad; nothing was recorded, "
        "and the step's values were removed from the parameters)"
    )


def _checked_splits(splits: Any) -> dict[str, nn.Module]:
    """``splits`` as a dict of names to modules, or a TypeError saying what it should be."""
    if splits is None:
        return {}
    if not isinstance(splits, Mapping) or not all(
        isinstance(name, str) and isinstance(module, nn.Module) for name, module in splits.items()
    ):
        raise TypeError(
            "Monitor(splits=...) takes a dict of names to modules, "
            f"{{'block0': model.layers[0]}}, got {_shown(splits)}"
        )
    return dict(splits)


def _shown(value: Any) -> str:
    """A short description of ``value`` for an error message."""
    shown = repr(value)
    return shown if len(shown) <= 120 else f"a {type(value).__name__} of {len(value)} items"


def _summaries(values: list[tuple[Any, ...]]) -> list[dict[str, float | int] | None]:
    """Each layer's summaries from its ``(log best path, log flow or EntropyFlow)`` values: None
    for a layer reached without any path, else the recorded quantities in their order and
    ``best``, the flat index of the entry with the best path.

    The reductions (``kernels.summaries``) are the cheap forms of the plain ones
    (``masked_select``, ``max(0)`` with indices and ``logsumexp``'s temporaries took about a
    quarter more of ResNet-18's 11 million entries; native loops read float32 values on the CPU
    in one or two passes each), equal to them up to the order of float sums
    (``tests/test_monitor.py``). Those left on a device come to the host together
    (``_to_host``: one transfer per device and dtype, where a value at a time waits on the
    device once per value)."""
    pending: list[Any] = []
    has_entropy: list[bool | None] = []
    for layer in values:
        log_best = layer[0].detach()
        log_flow, entropy = _flow_and_entropy(layer[1])
        if not log_best.numel():
            has_entropy.append(None)
            continue  # no entry at all: no path either
        units = log_best.reshape(log_best.shape[0], -1) if log_best.dim() else log_best[None, None]
        # the first best entry; the best path is -inf exactly when no entry has a path, and a
        # unit is dead when its best entry is -inf
        pending += [*best_entry(units), log_sum_exp(log_flow)]
        if entropy is not None:  # the entropy of the entries a path reaches (the others NaN)
            pending += count_sum_max_of_numbers(entropy)
        has_entropy.append(entropy is not None)
    host = iter(_to_host(pending))
    out: list[dict[str, float | int] | None] = []
    for layer, entropy in zip(values, has_entropy, strict=True):
        if not layer[0].numel():
            out.append(None)
            continue
        best_path, dead, best, flow = next(host), next(host), next(host), next(host)
        summary: dict[str, float | int] = {}
        if entropy:
            count, total, top = next(host), next(host), next(host)
            mean, top = (total / count, top) if count else (math.nan, math.nan)
            summary.update(entropy_mean=mean, entropy_max=top)
        if best_path == -math.inf:  # in the graph, but no path: only its deadness
            out.append(None)
            continue
        if math.isnan(best_path):  # a NaN value (a NaN loss): no best entry, deadness unknown
            summary.update(log_best_path=best_path, log_flow=flow, dead_units=math.nan)
            out.append(summary)
            continue
        summary.update(log_best_path=best_path, log_flow=flow, dead_units=dead, best=best)
        out.append(summary)
    return out


def _to_host(tensors: list[Any]) -> list[Any]:
    """The values of 0-dim ``tensors`` (and Python numbers, kept) as Python numbers, in order.
    On the CPU each is read on its own (reading one costs less than a stack); elsewhere each
    device and dtype gives one stack and one ``tolist`` (one wait on the device, where reading
    each value waits once per value; a stack of mixed dtypes would convert)."""
    out: list[Any] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            out[i] = t
        elif t.device.type == "cpu":
            out[i] = t.item()
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for positions in groups.values():
        stacked = torch.stack([tensors[i] for i in positions]).tolist()
        for i, v in zip(positions, stacked, strict=True):
            out[i] = v
    return out


def _without_wrapper(model: nn.Module, use: str) -> str:
    """A use's name as the layers' are (``_layers``): without the ``module.`` of a
    data-parallel wrapper given as the model, so a DDP run's flow shares line up with one
    process's (they kept it, trial 74)."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return use.removeprefix("module.") if use != "module" else ROOT_MODULE
    return use


def _flow_shares(split: Branches) -> dict[str, float]:
    """Each use's share of the total flow at the split tensor (the Product's second factor)."""
    if not split.values:
        return {}
    flows = [_flow_and_entropy(v[1])[0] for v in split.values.values()]
    sums = [log_sum_exp(f) for f in flows]
    logs = dict(zip(split.values, _to_host(sums), strict=True))
    whole = torch.tensor(list(logs.values()), dtype=torch.float64).logsumexp(0)
    return {use: math.exp(v - float(whole)) for use, v in logs.items()}


def _read_records(path: Path) -> list[Record]:
    """The records of a ``monitor.csv`` written by a monitor."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != ["step", "layer", "quantity", "value"]:
            raise SemipackError(f"Monitor(resume=True): {path} is not a monitor's CSV")
        return [
            Record(int(row["step"]), row["layer"], row["quantity"], float(row["value"]))
            for row in reader
        ]


def _drop_values_of(tensors: Iterable[Tensor]) -> None:
    """Remove the semiring values a pass left on ``tensors``."""
    for t in tensors:
        for attribute in ("semiring_grad", "semiring_state"):
            if hasattr(t, attribute):
                delattr(t, attribute)


#: Rows of a plot's legend per column (``Monitor.plot``): as tall as its axes at font size 6.
_LEGEND_ROWS = 18

#: Line styles and markers that tell layers apart beyond a colour map's 20 colours.
_DASHES = ("-", "--", ":", "-.")
_MARKERS = (None, "o", "s", "^", "v", "D", "x", "+")


def _line_style(k: int) -> dict[str, Any]:
    """The ``k``-th layer's line in a plot of more than ten: a colour each of tab20's 20, a
    dash pattern per round of them, a marker per round of those, so no two of the first 640
    layers look alike (the 61st looked like the first, trial 130; matplotlib's 10-colour cycle
    alone repeated at the 11th, trial 78)."""
    import matplotlib.pyplot as plt

    colour = plt.get_cmap("tab20").colors[k % 20]
    style: dict[str, Any] = {"color": colour, "linestyle": _DASHES[k // 20 % len(_DASHES)]}
    marker = _MARKERS[k // (20 * len(_DASHES)) % len(_MARKERS)]
    if marker is not None:
        style.update(marker=marker, markersize=3)
    return style


class _Files:
    """``monitor.csv`` and TensorBoard's events of one monitor, written a batch at a time.

    Each sampled step's records wait in memory and are written out together once
    ``flush_secs`` have passed since the last write (and on ``flush``, ``close``, an exception
    through ``Monitor.step`` and the monitor's collection or the interpreter's exit): rows
    formatted and events queued a step at a time cost several times more, TensorBoard's writer
    thread competing with the training for the interpreter between steps. The records in
    the files, and their order, are those written a step at a time."""

    def __init__(
        self, log_dir: Path, tensorboard: bool, flush_secs: float, earlier: list[Record]
    ) -> None:
        self.events = _Events(log_dir, after_earlier=bool(earlier)) if tensorboard else None
        #: a resumed run's earlier records are in the file until the first new step's come
        self.resumed = bool(earlier)
        self.csv_file = open(log_dir / "monitor.csv", "w", newline="")  # noqa: SIM115
        self.csv = csv.writer(self.csv_file)
        self._rows(earlier)
        self.flush_secs = flush_secs
        self.pending: list[tuple[int, list[Record]]] = []  # (step, its records) per record
        self.written_at = time.monotonic()
        self.closed = False
        self.warned_closed = False  # a sampled step after close was warned about

    def _rows(self, records: list[Record]) -> None:
        """The header and ``records``, flushed to the (emptied) file."""
        self.csv.writerow(["step", "layer", "quantity", "value"])
        self.csv.writerows((r.step, r.layer, r.quantity, r.value) for r in records)
        self.csv_file.flush()

    def rewrite(self, records: list[Record], step: int) -> None:
        """The file anew with ``records`` (a resumed run's earlier records it keeps), and
        TensorBoard told that events from ``step`` on are the new run's: the earlier run's
        later events, in its own event file, no longer read back (trial 130: they stood beside
        the new ones, and the events no longer equalled the CSV)."""
        self.resumed = False
        if self.closed:
            return
        self.csv_file.seek(0)
        self.csv_file.truncate()
        self._rows(records)
        if self.events is not None:
            self.events.restart_at(step)

    def add(self, step: int, rows: list[Record]) -> None:
        """Queue one sampled step's records; write everything out when it is time (after
        ``close`` the records stay in ``Monitor.records`` only, as before)."""
        if self.closed:
            if not self.warned_closed:
                self.warned_closed = True
                warnings.warn(
                    f"Monitor.step({step}) after the monitor was closed (close(), or the end "
                    "of `with Monitor(...)`): its records are kept in monitor.records only, "
                    "not written to monitor.csv or TensorBoard (once per monitor); close the "
                    "monitor after the last step, or make a new one",
                    stacklevel=5,
                )
            return
        self.pending.append((step, rows))
        if time.monotonic() - self.written_at >= self.flush_secs:
            self.write()

    def write(self) -> None:
        """Write the queued records: the CSV rows (flushed to the file) and one TensorBoard
        event per sampled step."""
        pending, self.pending = self.pending, []
        self.written_at = time.monotonic()
        if not pending:
            return
        self.csv.writerows(
            [(r.step, r.layer, r.quantity, r.value) for _, rows in pending for r in rows]
        )
        self.csv_file.flush()
        if self.events is not None:
            for step, rows in pending:
                self.events.write(step, [(f"{r.quantity}/{r.layer}", r.value) for r in rows])

    def flush(self) -> None:
        """Write the queued records and have TensorBoard's writer put its events on disk."""
        if self.closed:
            return
        self.write()
        if self.events is not None:
            self.events.flush()

    def close(self) -> None:
        """Write the queued records and close both files (once; later calls do nothing)."""
        if self.closed:
            return
        self.write()
        self.closed = True
        self.csv_file.close()
        if self.events is not None:
            self.events.close()


def _after_earlier_event_files(log_dir: Path) -> None:
    """Wait, if need be, until the clock's second is past the newest event file's in
    ``log_dir``. TensorBoard reads a folder's event files in name order, and a name holds the
    second it was made, then the process and a counter: a run resumed in the same second by
    the same process (a notebook after an exception) got a name that sorted before the
    earlier run's ("...10" < "...9"), and its restart marker came before the steps it drops
    (the test of ``restart_at`` met it in CI). At most a second and a half, and only then."""
    made = []
    for path in log_dir.glob("events.out.tfevents.*"):
        part = path.name.split(".")[3:4]
        if part and part[0].isdigit():
            made.append(int(part[0]))
    deadline = time.monotonic() + 1.5  # a file from a clock ahead of ours: no endless wait
    while made and int(time.time()) <= max(made) and time.monotonic() < deadline:
        time.sleep(0.05)


class _Events:
    """TensorBoard's event file: each step's scalars go in as one ``Summary`` of one event.

    ``SummaryWriter.add_scalar`` writes one event per value; an event costs a protobuf, a
    queue hand-off and two pure-Python CRCs on TensorBoard's writer thread, which made most of
    the monitor's own cost at ``every=1``. One event holding every value of the step carries
    the same tags, steps and values (read back by ``tests/test_monitor.py``)."""

    def __init__(self, log_dir: Path, after_earlier: bool = False) -> None:
        if after_earlier:
            _after_earlier_event_files(log_dir)
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise SemipackError(
                "Monitor(tensorboard=True) needs the tensorboard package: pip install "
                "tensorboard, or pass tensorboard=False (the CSV and plots need nothing extra)"
            ) from error
        self._summary = Summary
        self.writer = SummaryWriter(str(log_dir))

    def write(self, step: int, scalars: list[tuple[str, float]]) -> None:
        """One event at ``step`` holding each ``(tag, value)`` as ``add_scalar`` stores it
        (``simple_value``, a float32)."""
        value = self._summary.Value
        summary = self._summary(value=[value(tag=tag, simple_value=v) for tag, v in scalars])
        self.writer._get_file_writer().add_summary(summary, step)

    def restart_at(self, step: int) -> None:
        """Mark a restart at ``step``, as ``SummaryWriter(purge_step=step)`` does: TensorBoard
        then drops the events of earlier files from ``step`` on (a crashed run's later steps)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = Event(step=step, session_log=SessionLog(status=SessionLog.START))
        self.writer._get_file_writer().add_event(start)

    def flush(self) -> None:
        """Put every queued event on disk."""
        self.writer.flush()

    def close(self) -> None:
        """Write out every queued event and close the file."""
        self.writer.close()


__all__ = ["QUANTITIES", "Monitor", "Record"]
