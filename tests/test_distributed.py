"""Data-parallel runs: ``semipack.distributed.all_reduce`` over two gloo processes on the CPU.

Two processes each run the backward on half of a batch; after ``all_reduce`` every process must
hold what one process computes on the whole batch (the loss sums over examples, so the whole
batch's paths are the union of the halves' paths). Under ``DistributedDataParallel`` the regular
gradient must stay exactly plain DDP's averaged gradient.

The two processes are started once (``two_process_report``) and run every check, each recording
"ok" or its traceback, so one start-up (about two seconds of imports) serves them all; a check
that fails still lets the processes reach the same collectives, and a group timeout turns a hang
into a failure.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import json
import math
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import MinProd
from torch import Tensor, nn

import semipack
from semipack import distributed as sd
from semipack.transport.backward import SEMIRING_STATE

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)

WORLD = 2
BATCH = 8  # the whole batch; each process takes BATCH // WORLD consecutive examples

#: The semirings checked across processes, by the name a report uses.
SEMIRINGS: dict[str, Callable[[], semipack.Semiring]] = {
    "MaxProd": semipack.MaxProd,
    "MaxProd(log)": lambda: semipack.MaxProd(log=True),
    "LogSum": semipack.LogSum,
    "LogCount": semipack.LogCount,
    "Entropy": semipack.Entropy,
    "TopPath": semipack.TopPath,
    "KBest": lambda: semipack.KBest(3),
    "Boolean": semipack.Boolean,
    "SignedMaxProd": semipack.SignedMaxProd,
    "Real": semipack.Real,
    "MinProd (user, gather and fold)": MinProd,
    "Product(MaxProd, Entropy, LogSum)": lambda: semipack.Product(
        semipack.MaxProd(), semipack.Entropy(), semipack.LogSum()
    ),
}


def _data() -> tuple[nn.Module, Tensor, Tensor]:
    """The same model and batch in every process (float64: values compared to 1e-12)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4)).double()
    x = torch.randn(BATCH, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (BATCH,))
    return model, x, y


def _half(t: Tensor, rank: int) -> Tensor:
    n = BATCH // WORLD
    return t[rank * n : (rank + 1) * n]


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y, reduction="sum")


def _reference(make: Callable[[], semipack.Semiring]) -> nn.Module:
    """One process on the whole batch: the model after its semiring backward."""
    model, x, y = _data()
    with semipack.extend(model, make()):
        _loss(model, x, y).backward()
    return model


def _assert_same_values(expected: Tensor, actual: Tensor, where: str) -> None:
    if expected.dtype == torch.bool:
        assert torch.equal(expected, actual), where
        return
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-300, msg=where)


def _readouts(p: Tensor) -> list[Tensor]:
    """A readout as a list of tensors (SignedMaxProd's is a named tuple)."""
    value = p.semiring_grad
    return list(value) if isinstance(value, tuple) else [value]


def _check_paths(ref: nn.Module, got: nn.Module, rank: int) -> None:
    """For each parameter, path rank and process: that process's best recorded path is read
    on it, matching the whole batch's path from the same entry (value, modules and the value
    after each step); every other process raises, naming it. Sites name entries of each
    process's own batch, so their descriptions are not compared."""
    for (name, p), q in zip(got.named_parameters(), ref.parameters(), strict=True):
        paths = p.semiring_paths
        for r in range(paths.log_values.shape[0]):
            values = paths.log_values[r].reshape(-1)
            for owner in range(WORLD):
                mine = (paths.owners[r].reshape(-1) == owner) & (values > -math.inf)
                if not bool(mine.any()):
                    continue
                flat = int(torch.where(mine, values, -math.inf).argmax())
                index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), p.shape))
                if owner != rank:
                    with pytest.raises(semipack.SemipackError, match=f"by process {owner},"):
                        paths.path(index, rank=r)
                    continue
                path, expected = paths.path(index, rank=r), q.semiring_paths.path(index, rank=r)
                where = f"{name}{list(index)} rank {r}"
                assert path.log_value == pytest.approx(expected.log_value, rel=1e-12), where
                assert [s.module for s in path.steps] == [s.module for s in expected.steps], where
                assert [s.log_value for s in path.steps] == pytest.approx(
                    [s.log_value for s in expected.steps], rel=1e-12, abs=1e-12
                ), where


def check_semiring(name: str, rank: int, bucket_mb: float = sd.BUCKET_MB) -> None:
    """Each process's half, reduced, equals one process on the whole batch."""
    make = SEMIRINGS[name]
    ref = _reference(make)
    model, x, y = _data()
    sr = make()
    with semipack.extend(model, sr, keep_state=True):
        _loss(model, _half(x, rank), _half(y, rank)).backward()
    reduced = sd.all_reduce(model, sr, bucket_mb=bucket_mb)
    assert [id(t) for t in reduced] == [id(p) for p in model.parameters()]
    for (pname, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        for a, b in zip(_readouts(q), _readouts(p), strict=True):
            _assert_same_values(a, b, f"{name} {pname}")
        assert len(getattr(p, SEMIRING_STATE)) == len(sr.components)
    if sr.records_paths:
        _check_paths(ref, model, rank)


def check_unreached_on_one_process(rank: int) -> None:
    """A parameter only one process's examples reach counts as "no path" on the other: each
    head below serves one half of the batch."""

    def build() -> nn.ModuleDict:
        torch.manual_seed(1)
        return nn.ModuleDict(
            {"body": nn.Linear(5, 6), "a": nn.Linear(6, 3), "b": nn.Linear(6, 3)}
        ).double()

    def loss(m: nn.ModuleDict, x: Tensor, first_half: bool) -> Tensor:
        h = torch.tanh(m["body"](x))
        return (m["a"] if first_half else m["b"])(h).pow(2).sum()

    _, x, _ = _data()
    ref = build()
    with semipack.extend(ref, semipack.Entropy()):
        (loss(ref, _half(x, 0), True) + loss(ref, _half(x, 1), False)).backward()
    model = build()
    with semipack.extend(model, semipack.Entropy(), keep_state=True):
        loss(model, _half(x, rank), rank == 0).backward()
    unused = "b" if rank == 0 else "a"
    assert not hasattr(model[unused].weight, "semiring_grad")
    sd.all_reduce(model, semipack.Entropy())
    for (pname, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        _assert_same_values(q.semiring_grad, p.semiring_grad, pname)


def check_ddp(name: str, rank: int, inner: bool = False, **ddp_options) -> None:
    """Under DistributedDataParallel: ``.grad`` is plain DDP's averaged gradient, bitwise, and
    the reduced semiring values are the whole batch's. A second step without zeroing the
    gradients, part of it under ``no_sync``, must accumulate as plain DDP does. ``inner``:
    ``extend`` is given the module inside the wrapper (a user's slip; with bucket views a
    zeroed ``.grad`` came out doubled, and ``no_sync`` gradients wrong, trial 74)."""
    make = SEMIRINGS[name]
    ref = _reference(make)
    model, x, y = _data()
    xs, ys = _half(x, rank), _half(y, rank)
    plain = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **ddp_options)
    wrapped = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **ddp_options)
    given = wrapped.module if inner else wrapped
    sr = make()
    for ddp in (plain, wrapped):  # zeroed, not None: the gradients stay the buckets' views
        for p in ddp.parameters():
            p.grad = torch.zeros_like(p)
    _loss(plain, xs, ys).backward()
    with semipack.extend(given, sr, keep_state=True):
        _loss(wrapped, xs, ys).backward()
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), "DDP's averaged gradient changed"
    sd.all_reduce(wrapped, sr)
    for (pname, p), q in zip(wrapped.named_parameters(), ref.parameters(), strict=True):
        for a, b in zip(_readouts(q), _readouts(p), strict=True):
            _assert_same_values(a, b, f"DDP {name} {pname}")
    with plain.no_sync():
        _loss(plain, xs, ys).backward()
    _loss(plain, 2 * xs, ys).backward()
    with semipack.extend(given, sr, keep_state=True):
        with wrapped.no_sync():
            _loss(wrapped, xs, ys).backward()
        _loss(wrapped, 2 * xs, ys).backward()
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), "accumulated DDP gradient changed"


def check_second_model_forward_before_the_block(rank: int) -> None:
    """A GAN's step: the generator's DDP forward runs before the block, the discriminator's
    (the module given to ``extend``) inside it, over two micro-batches, the first under both
    models' ``no_sync``. The generator's ``.grad`` was set aside during the pass, so its
    reducer averaged the new micro-batch's part alone: wrong, and different on each process
    (trial 75). Every leaf accumulates in place now: both models' gradients are plain DDP's."""
    torch.manual_seed(0)
    generator, discriminator = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    z = torch.randn(8, 3, generator=torch.Generator().manual_seed(rank))
    grads = []
    for semiring in (None, semipack.MaxProd()):
        g = nn.parallel.DistributedDataParallel(copy.deepcopy(generator))
        d = nn.parallel.DistributedDataParallel(copy.deepcopy(discriminator))
        for micro in (0, 1):
            syncing = contextlib.nullcontext() if micro else contextlib.ExitStack()
            if not micro:
                syncing.enter_context(g.no_sync())
                syncing.enter_context(d.no_sync())
            with syncing:
                fake = g(z[4 * micro : 4 * micro + 4])
                block = (
                    semipack.extend(d.module, semiring) if semiring else contextlib.nullcontext()
                )
                with block:
                    d(fake).sum().backward()
        grads.append([p.grad.clone() for p in [*g.parameters(), *d.parameters()]])
    for plain, extended in zip(*grads, strict=True):
        assert torch.equal(plain, extended), "DDP's averaged gradient changed"


def check_errors(rank: int) -> None:
    """Misuse raises the same error on every process instead of hanging a collective."""
    model, x, y = _data()
    with semipack.extend(model, semipack.MaxProd()):  # no keep_state
        _loss(model, _half(x, rank), _half(y, rank)).backward()
    with pytest.raises(semipack.SemipackError, match="keep_state=True"):
        sd.all_reduce(model, semipack.MaxProd())
    with semipack.extend(model, semipack.MaxProd(), keep_state=True):
        _loss(model, _half(x, rank), _half(y, rank)).backward()
    with pytest.raises(semipack.SemipackError, match="kept by a pass of MaxProd, not of Entropy"):
        sd.all_reduce(model, semipack.Entropy())
    params = list(model.parameters())
    with pytest.raises(semipack.SemipackError, match=r"tensor counts per process: \[4, 3\]"):
        sd.all_reduce(params if rank == 0 else params[:3], semipack.MaxProd())
    sd.all_reduce(model, semipack.MaxProd())
    assert isinstance(model[0].weight.semiring_state, sd.ReducedState)
    with pytest.raises(semipack.SemipackError, match="already holds the reduced state"):
        sd.all_reduce(model, semipack.MaxProd())


def check_monitor(rank: int) -> None:
    """The monitor under DDP records, on every process, what one process records for the
    whole batch (its summaries read the reduced values), and trains exactly as plain DDP."""
    model, x, y = _data()
    alone = semipack.Monitor(copy.deepcopy(model), every=1, tensorboard=False)
    assert not alone._combines_processes()  # no DDP inside: each process's own values
    with alone.step(0):
        _loss(alone.model, x, y).backward()
    wrapped = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    plain = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    monitor = semipack.Monitor(wrapped, every=1, tensorboard=False)
    with monitor.step(0):
        _loss(wrapped, _half(x, rank), _half(y, rank)).backward()
    assert monitor._combines_processes()
    _loss(plain, _half(x, rank), _half(y, rank)).backward()
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), "DDP's averaged gradient changed"
    want = {(r.layer, r.quantity): r.value for r in alone.records}
    got = {(r.layer, r.quantity): r.value for r in monitor.records}  # the same names too
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, nan_ok=True), key


def check_monitor_on_one_process(rank: int) -> None:
    """A Monitor made on rank 0 alone ("log on rank 0") waited at its first sampled step for
    rank 1's values until the group timed out, then failed with gloo's error (trial 61). It
    raises naming rank 1 now, before any collective of its own; both processes then run the
    same plain DDP step, so their collectives still meet."""
    import semipack.monitor as monitoring

    model, x, y = _data()
    wrapped = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    if rank == 0:
        before, monitoring.PEER_TIMEOUT = monitoring.PEER_TIMEOUT, datetime.timedelta(seconds=3)
        try:
            monitor = semipack.Monitor(wrapped, every=1, tensorboard=False)
            with (
                pytest.raises(semipack.SemipackError, match=r"rank 1 did not reach a sampled"),
                monitor.step(0),
            ):
                pass
        finally:
            monitoring.PEER_TIMEOUT = before
        assert not monitor.records
    _loss(wrapped, _half(x, rank), _half(y, rank)).backward()
    assert all(p.grad is not None for p in wrapped.parameters())


def check_monitor_step_numbers(rank: int) -> None:
    """Step numbers that differ between processes (a counter per process that one of them
    skips) made the combining collectives of different steps pair up, or wait until the group
    timed out and fail with gloo's error (trial 74). Each sampled step now meets the others'
    through the store first: different numbers raise on every process, naming them, and a
    process that stops sampling is named after ``PEER_TIMEOUT``."""
    import semipack.monitor as monitoring

    model, x, y = _data()
    wrapped = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    monitor = semipack.Monitor(wrapped, every=1, tensorboard=False)
    for step in (0, 2 + rank):  # rank 1 skipped a step number
        try:
            with monitor.step(step):
                _loss(wrapped, _half(x, rank), _half(y, rank)).backward()
        except semipack.SemipackError as refusal:
            assert step == 2 + rank
            assert str(refusal) == (
                f"Monitor.step({step}): the processes sampled different steps (rank 0: 2, rank "
                "1: 3); under DistributedDataParallel every process must pass the same step "
                "numbers to monitor.step() (a global step, not a counter of each process's "
                "own), so that their sampled steps combine the same step's values"
            )
        else:
            assert step == 0
    assert [r.step for r in monitor.records if r.quantity == "entropy_mean"][:1] == [0]
    if rank == 0:  # rank 1 samples no more steps: named, before any collective
        # seconds as a number work as a timedelta does (trial 75: the message crashed)
        before, monitoring.PEER_TIMEOUT = monitoring.PEER_TIMEOUT, 3
        try:
            with (
                pytest.raises(
                    semipack.SemipackError,
                    match=r"Monitor\.step\(5\): the processes of rank 1 did not reach their "
                    r"sampled step number 3 within 3 s \(this process, rank 0, did at step 5\)",
                ),
                monitor.step(5),
            ):
                pass
        finally:
            monitoring.PEER_TIMEOUT = before
    dist.barrier()


def checks() -> dict[str, Callable[[int], None]]:
    """Every check the processes run, by name."""
    out: dict[str, Callable[[int], None]] = {
        f"reduce {name}": (lambda rank, name=name: check_semiring(name, rank)) for name in SEMIRINGS
    }
    for name in ("Entropy", "TopPath", "KBest"):  # 100-byte buckets: one per parameter
        out[f"reduce {name}, small buckets"] = lambda rank, name=name: check_semiring(
            name, rank, bucket_mb=1e-4
        )
    out["parameter unreached on one process"] = check_unreached_on_one_process
    out["DDP MaxProd"] = lambda rank: check_ddp("MaxProd", rank)
    out["DDP Entropy, bucket views, unused-parameter search"] = lambda rank: check_ddp(
        "Entropy", rank, gradient_as_bucket_view=True, find_unused_parameters=True
    )
    out["DDP TopPath, static graph"] = lambda rank: check_ddp("TopPath", rank, static_graph=True)
    out["DDP, a second model's forward before the block"] = (
        check_second_model_forward_before_the_block
    )
    out["DDP MaxProd, bucket views, the inner module given"] = lambda rank: check_ddp(
        "MaxProd", rank, inner=True, gradient_as_bucket_view=True
    )
    out["monitor under DDP"] = check_monitor
    # before the Monitor made on one process: the processes' Monitors meet under the number of
    # their first combining step, which that one took on rank 0 alone
    out["monitor step numbers differ between processes"] = check_monitor_step_numbers
    out["monitor on one process only"] = check_monitor_on_one_process
    out["errors"] = check_errors
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    report = {}
    try:
        for name, check in checks().items():
            try:
                check(rank)
                report[name] = "ok"
            except Exception:
                report[name] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        gc.collect()  # the checks' DDP reducers go before their process group does
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Run every check in two gloo processes; per check, each process's "ok" or traceback."""
    out = tmp_path_factory.mktemp("distributed")
    torch.multiprocessing.spawn(
        _worker, args=(str(out / "init"), str(out)), nprocs=WORLD, join=True
    )
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {name: [rep.get(name, "not run") for rep in reports] for name in checks()}


def test_two_processes_match_one_process_on_the_whole_batch(
    two_process_report: dict[str, list[str]],
) -> None:
    failed = {
        f"{name} (process {r})": result
        for name, results in two_process_report.items()
        for r, result in enumerate(results)
        if result != "ok"
    }
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())


# --- one process ---------------------------------------------------------------------------------
def test_keep_state_stores_the_state_beside_the_readout() -> None:
    model, x, y = _data()
    sr = semipack.Entropy()
    with semipack.extend(model, sr, keep_state=True):
        _loss(model, x, y).backward()
    for p in model.parameters():
        state = p.semiring_state
        assert len(state) == 2 and all(c.shape == p.shape for c in state)
        torch.testing.assert_close(sr.readout(state), p.semiring_grad, rtol=0, atol=0)
    with semipack.extend(model, sr):  # without keep_state a pass leaves no stale state
        _loss(model, x, y).backward()
    assert not any(hasattr(p, "semiring_state") for p in model.parameters())


def test_state_follows_semiring_grad_when_a_pass_fails_or_misses_a_parameter() -> None:
    model, x, y = _data()
    with semipack.extend(model, semipack.MaxProd(), keep_state=True):
        _loss(model, x, y).backward()
    before = [(p.semiring_grad, p.semiring_state) for p in model.parameters()]

    def fail(*_):
        raise RuntimeError("boom")

    with semipack.extend(model, semipack.MaxProd(), keep_state=True):
        out = model(x)
        out.register_hook(fail)
        with pytest.raises(RuntimeError, match="boom"):
            F.cross_entropy(out, y, reduction="sum").backward()
    for p, (grad, state) in zip(model.parameters(), before, strict=True):
        assert p.semiring_grad is grad and p.semiring_state is state
    with semipack.extend(model, semipack.MaxProd(), keep_state=True):
        model[2](torch.randn(2, 7, dtype=torch.float64)).sum().backward()
    assert not hasattr(model[0].weight, "semiring_state")
    assert not hasattr(model[0].weight, "semiring_grad")
    assert hasattr(model[2].weight, "semiring_state")


def test_all_reduce_needs_an_initialised_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model, _, _ = _data()
    with pytest.raises(semipack.SemipackError, match="init_process_group"):
        sd.all_reduce(model, semipack.MaxProd())


class _MaxProdAddingPaths(semipack.MaxProd):
    """A subclass that changes the plus: the parent's MAX collective would be wrong for it."""

    def plus(self, a, b):
        return (torch.logaddexp(a[0], b[0]),)


def test_each_semiring_gets_the_collective_of_its_plus() -> None:
    expected = {
        semipack.MaxProd(): sd._max,
        semipack.TopPath(): sd._argmax,
        semipack.LogSum(): sd._log_sum_exp,
        semipack.LogCount(): sd._log_sum_exp,
        semipack.Entropy(): sd._expectation,
        semipack.Boolean(): sd._any,
        semipack.SignedMaxProd(): sd._extremes,
        semipack.Real(): sd._sum,
        semipack.KBest(2): sd._gather_and_fold,
        semipack.Product(semipack.MaxProd(), semipack.Entropy()): sd._per_factor,
        MinProd(): sd._gather_and_fold,
        _MaxProdAddingPaths(): sd._gather_and_fold,
    }
    for sr, reducer in expected.items():
        assert sd._reducer_for(sr) is reducer, sr


def test_buckets_split_by_size_and_keep_dtypes_apart() -> None:
    def state(n: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
        return (torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=torch.int64))

    states = [state(10), state(10), state(30), state(5, torch.float64), state(10)]
    # 12 bytes per entry: 120, 120, 360, 60, 120 bytes against a limit of 250
    assert sd._buckets(states, 250) == [[0, 1], [2], [4], [3]]
    assert sd._buckets(states, 10**6) == [[0, 1, 2, 4], [3]]


def test_kbest_states_of_float32_parameters_with_odd_sizes_reduce() -> None:
    """KBest's float32 values and int64 successor ids travel as one byte buffer: with
    parameters of 6, 3, 3 and 1 entries and k = 3 a chunk of ids starts at a byte offset that is
    no multiple of 8, and viewing it as int64 failed (a trial found it). One process: the
    reduced readouts equal the pass's own."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        kb = semipack.KBest(3)
        with semipack.extend(model, kb, keep_state=True):
            model(torch.randn(4, 2)).sum().backward()
        before = [p.semiring_grad.clone() for p in model.parameters()]
        semipack.distributed.all_reduce(model, kb)
        for want, p in zip(before, model.parameters(), strict=True):
            assert torch.equal(p.semiring_grad, want)
    finally:
        dist.destroy_process_group()


def test_a_state_is_reduced_only_with_the_semiring_that_kept_it() -> None:
    """MaxProd's kept state has LogSum's one float component: read as LogSum's it gave a
    plausible, wrong semiring_grad (a trial found it). The state names the semiring of its
    pass, and another one is refused."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, x, y = _data()
        with semipack.extend(model, semipack.MaxProd(), keep_state=True):
            _loss(model, x, y).backward()
        before = [p.semiring_grad.clone() for p in model.parameters()]
        message = "state was kept by a pass of MaxProd, not of LogSum"
        with pytest.raises(semipack.SemipackError, match=message):
            semipack.distributed.all_reduce(model, semipack.LogSum())
        for want, p in zip(before, model.parameters(), strict=True):
            assert torch.equal(p.semiring_grad, want)
        semipack.distributed.all_reduce(model, semipack.MaxProd(log=True))  # its own class
    finally:
        dist.destroy_process_group()


def test_bucket_sizes_and_an_empty_reduction_are_named() -> None:
    """``bucket_mb`` that is no positive number raises naming it (a string failed with an
    integer-conversion error, and 0 or less ran as tiny buckets); a reduction before any
    backward, where no tensor holds a state on any process, warns instead of returning [] in
    silence (trial 115)."""
    model, _, _ = _data()
    bads = (("25", TypeError), (0, ValueError), (-1.0, ValueError), (True, TypeError))
    for bad, error in (*bads, (float("inf"), ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match=r"all_reduce\(bucket_mb=...\)"):
            semipack.distributed.all_reduce(model, semipack.MaxProd(), bucket_mb=bad)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.warns(RuntimeWarning, match="none of the tensors holds a semiring_state"):
            assert semipack.distributed.all_reduce(model, semipack.MaxProd()) == []
    finally:
        dist.destroy_process_group()
