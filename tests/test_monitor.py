"""``semipack.Monitor``: training with it is bitwise training without it, and every recorded
summary equals the same summary computed from separate single-semiring passes."""

from __future__ import annotations

import csv
import gc
import itertools
import math
import warnings
from dataclasses import astuple
from pathlib import Path

import pytest
import torch
from torch import nn

import semipack

F64 = torch.float64


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.inner(h)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), Residual(), nn.Linear(6, 3)).double()
    with torch.no_grad():  # unit 2 of the first layer is off for every input: a dead unit
        model[0].weight[2] = 0.0
        model[0].bias[2] = -1.0
    return model


def _batches(n: int):
    g = torch.Generator(torch.get_default_device()).manual_seed(1)  # the GPU check runs on CUDA
    return [(torch.randn(5, 4, generator=g, dtype=F64), torch.randint(0, 3, (5,), generator=g))
            for _ in range(n)]  # fmt: skip


def _train(model, batches, monitor=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        if monitor is None:
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            with monitor.step(step):
                nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_training_with_the_monitor_is_training_without_it(tmp_path: Path) -> None:
    batches = _batches(6)
    plain, watched = _model(), _model()
    _train(plain, batches)
    monitor = semipack.Monitor(watched, every=2, log_dir=tmp_path)
    _train(watched, batches, monitor)
    monitor.close()
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    assert sorted({r.step for r in monitor.records}) == [0, 2, 4]


class _CheckpointedBatchNorm(nn.Module):
    """A region with a batch norm under a non-reentrant checkpoint, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.region = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.region, x, use_reentrant=False))


def test_training_through_a_non_reentrant_checkpoint_is_training_without_the_monitor() -> None:
    """Every sampled step recomputed the checkpointed region once more per extension in it:
    the batch norm's statistics drifted from the plain run's (trial 81)."""
    batches = _batches(3)
    plain, watched = _CheckpointedBatchNorm().double(), _CheckpointedBatchNorm().double()
    _train(plain, batches)
    _train(watched, batches, semipack.Monitor(watched, every=1, tensorboard=False))
    assert int(watched.region[1].num_batches_tracked) == 6  # a forward and a recomputation
    pairs = zip(plain.state_dict().items(), watched.state_dict().values(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b), name


def _independent(model, x, y, semiring):
    for p in model.parameters():
        p.grad = None
    with semipack.extend(model, semiring, regular_grads=False):
        nn.functional.cross_entropy(model(x), y).backward()
    return {name: m.weight.semiring_grad for name, m in (("0", model[0]), ("3", model[3]))}


def _flow_shares(model, x, y) -> dict[str, float]:
    """Each use's share of the total flow at the residual block's input, from one LogSum
    pass with ``branches`` (the monitor's flow shares, computed independently)."""
    with semipack.extend(model, semipack.LogSum(), regular_grads=False):
        with semipack.branches(model[2]) as split:
            out = model(x)
        nn.functional.cross_entropy(out, y).backward()
    logs = {use: v.logsumexp((0, 1)) for use, v in split.values.items()}
    whole = torch.stack(list(logs.values())).logsumexp(0)
    return {use: math.exp(float(value - whole)) for use, value in logs.items()}


def test_each_summary_equals_separate_passes(tmp_path: Path) -> None:
    model = _model()
    splits = {"residual block": model[2]}
    monitor = semipack.Monitor(model, every=1, log_dir=tmp_path, splits=splits)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    best_before: dict[str, int] = {}
    for step, (x, y) in enumerate(_batches(3)):
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        with monitor.step(step):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        twin = _model()
        twin.load_state_dict(snapshot)
        best = _independent(twin, x, y, semipack.MaxProd(log=True))
        flow = _independent(twin, x, y, semipack.LogSum())
        entropy = _independent(twin, x, y, semipack.Entropy())
        got = {(r.layer, r.quantity): r.value for r in monitor.records if r.step == step}
        for layer in ("0", "3"):
            assert got[layer, "log_best_path"] == float(best[layer].max())
            assert got[layer, "log_flow"] == pytest.approx(float(flow[layer].exp().sum().log()))
            reached = entropy[layer][~entropy[layer].isnan()]
            assert got[layer, "entropy_mean"] == pytest.approx(float(reached.mean()))
            assert got[layer, "entropy_max"] == pytest.approx(float(reached.max()))
            dead = sum(bool(row.isneginf().all()) for row in best[layer]) / best[layer].shape[0]
            assert got[layer, "dead_units"] == dead
            top = int(best[layer].flatten().argmax())
            if layer in best_before:
                assert got[layer, "top_path_changed"] == float(top != best_before[layer])
            else:
                assert (layer, "top_path_changed") not in got
            best_before[layer] = top
        assert best["0"][2].isneginf().all()  # the unit switched off above has no path
        assert got["0", "dead_units"] >= 1 / 6
        # the residual block's input: flow through the add against flow through the branch
        for use, share in _flow_shares(twin, x, y).items():
            assert got[f"residual block -> {use}", "flow_share"] == pytest.approx(share)
    monitor.close()
    with open(tmp_path / "monitor.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(monitor.records)
    assert [float(r["value"]) for r in rows] == pytest.approx(
        [r.value for r in monitor.records], nan_ok=True
    )
    assert list(tmp_path.glob("events.out.tfevents.*"))
    pictures = monitor.plot()
    names = {p.name for p in pictures}
    assert {"log_flow.png", "dead_units.png", "entropy_mean.png"} <= names
    assert all(p.stat().st_size > 1000 for p in pictures)


def test_mistakes_are_named() -> None:
    with pytest.raises(ValueError, match=r"Monitor\(every=...\) needs a positive integer, got 0"):
        semipack.Monitor(_model(), every=0)
    # options given values they do not take (trial 115: a string counted as True, and
    # flush_secs="5" failed at the first sampled step with an unrelated comparison error)
    for options, error, message in (
        ({"entropy": "no"}, TypeError, r"Monitor\(entropy=...\) must be True or False, got 'no'"),
        ({"tensorboard": 1}, TypeError, r"Monitor\(tensorboard=...\) must be True or False"),
        ({"distributed": "yes"}, TypeError, r"must be True, False or None \(detect DDP\)"),
        ({"flush_secs": "5"}, TypeError, r"Monitor\(flush_secs=...\) takes a number of seconds"),
        ({"flush_secs": -1}, ValueError, r"Monitor\(flush_secs=...\) must be 0 or more"),
        ({"flush_secs": math.nan}, ValueError, r"Monitor\(flush_secs=...\) must be 0 or more"),
    ):
        with pytest.raises(error, match=message):
            semipack.Monitor(_model(), **options)
    with pytest.raises(semipack.SemipackError, match="Monitor: ReLU has no trainable parameters"):
        semipack.Monitor(nn.ReLU())
    monitor = semipack.Monitor(_model(), every=1)
    with pytest.raises(semipack.SemipackError, match=r"Monitor\.plot needs a folder"):
        monitor.plot()


def test_a_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "log").write_text("kept")
    with pytest.raises(semipack.SemipackError, match=r"log_dir=.*log'\) is a file, not a folder"):
        semipack.Monitor(_model(), log_dir=tmp_path / "log", tensorboard=False)
    assert (tmp_path / "log").read_text() == "kept"


def test_an_empty_log_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``""`` is the current folder to pathlib: the files landed there unasked (trial 119)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"Monitor\(log_dir=''\) names no folder"):
        semipack.Monitor(_model(), log_dir="")
    with pytest.raises(ValueError, match=r"Monitor\(log_dir=' '\) names no folder"):
        semipack.Monitor(_model(), log_dir=" ")  # a folder named by a blank (trial 122)
    assert list(tmp_path.iterdir()) == []


def test_a_step_that_raises_leaves_no_values_and_no_record() -> None:
    """A sampled step whose block raises after its backward is not recorded; its values left
    the parameters all the same (they stayed there until the next sampled step, trial 119).
    A semipack error from the semiring backward itself says the step has no gradient."""
    model, ((x, y),) = _model(), _batches(1)
    monitor = semipack.Monitor(model, every=1)
    with pytest.raises(KeyError), monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
        assert all(hasattr(p, "semiring_grad") for p in model.parameters())
        raise KeyError("the user's step failed")
    assert not any(hasattr(p, "semiring_grad") for p in model.parameters())
    assert monitor.records == []

    model.zero_grad(set_to_none=True)
    with pytest.raises(semipack.UnsupportedOpError) as raised, monitor.step(1):
        logits = torch.fft.fft(model(x)).abs()  # complex: refused, named by its op
        nn.functional.cross_entropy(logits, y).backward()
    note = "raised inside Monitor.step(1), a sampled step: its backward is the semiring backward"
    assert any(note in n for n in raised.value.__notes__)
    assert all(p.grad is None for p in model.parameters())
    assert not any(hasattr(p, "semiring_grad") for p in model.parameters())
    assert monitor.records == []
    with monitor.step(2):  # the monitor goes on
        nn.functional.cross_entropy(model(x), y).backward()
    assert {r.step for r in monitor.records} == {2}


def test_two_monitors_sampled_together_are_named() -> None:
    """Nested sampled steps of two monitors raised ``extend``'s nesting error, which spoke of
    blocks and Product (trial 119); one after the other they both record."""
    model, ((x, y),) = _model(), _batches(1)
    first, second = semipack.Monitor(model, every=1), semipack.Monitor(model, every=2)
    message = r"Monitor\.step\(0\) is sampled while a semiring block is already open"
    with pytest.raises(semipack.SemipackError, match=message), first.step(0), second.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    inside_extend = pytest.raises(semipack.SemipackError, match=message)
    with inside_extend, semipack.extend(model, semipack.MaxProd()), second.step(0):
        pass
    with first.step(1), second.step(1):  # second's step 1 is not sampled: no block of its own
        nn.functional.cross_entropy(model(x), y).backward()
    with first.step(2):
        nn.functional.cross_entropy(model(x), y).backward()
    with second.step(2):
        nn.functional.cross_entropy(model(x), y).backward()
    # the same values (the first monitor also compares its top paths with step 1's)
    assert [r for r in first.records if r.step == 2 and r.quantity != "top_path_changed"] == (
        second.records
    )


def test_a_log_dir_with_a_monitor_csv_is_kept_unless_overwrite(tmp_path: Path) -> None:
    """A second monitor on the same folder (another run of the script, or a monitor writing
    there now) used to empty the first one's ``monitor.csv`` without a word."""
    model, batches = _model(), _batches(2)
    first = semipack.Monitor(model, every=1, log_dir=tmp_path, tensorboard=False)
    _train(model, batches, first)
    first.close()
    kept = (tmp_path / "monitor.csv").read_text()
    assert kept.count("\n") > 1
    with pytest.raises(semipack.SemipackError, match=r"holds a monitor\.csv already.*overwrite"):
        semipack.Monitor(model, every=1, log_dir=tmp_path, tensorboard=False)
    assert (tmp_path / "monitor.csv").read_text() == kept
    again = semipack.Monitor(model, every=1, log_dir=tmp_path, tensorboard=False, overwrite=True)
    with pytest.warns(RuntimeWarning, match="no step block was entered"):
        again.close()
    assert (tmp_path / "monitor.csv").read_text() == "step,layer,quantity,value\n"


def test_a_monitor_csv_that_is_a_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "monitor.csv").mkdir()
    for overwrite in (False, True):
        with pytest.raises(semipack.SemipackError, match=r"monitor\.csv is a folder, not a file"):
            semipack.Monitor(_model(), log_dir=tmp_path, tensorboard=False, overwrite=overwrite)


def test_a_layer_with_a_frozen_weight_is_read_at_its_trained_bias() -> None:
    """A frozen weight with a trained bias (a head fine-tuned by its bias, bias-only training)
    used to leave the layer out, and a model training only biases was refused as having no
    trainable parameters. The layer's values are read at the bias."""
    model = _model()
    model[3].weight.requires_grad_(False)
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    assert monitor.layers["3"] is model[3].bias
    assert monitor.layers["0"] is model[0].weight
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    assert list(monitor.layers) == ["0", "2.inner.0", "3"]
    assert all(p is dict(m.named_parameters())["bias"] for m, p in (
        (model[0], monitor.layers["0"]), (model[2].inner[0], monitor.layers["2.inner.0"]),
        (model[3], monitor.layers["3"]),
    ))  # fmt: skip
    _train(model, _batches(2), monitor)
    assert {r.layer for r in monitor.records} == {"0", "2.inner.0", "3"}


def test_a_backward_after_the_step_block_is_refused_not_read_stale() -> None:
    """Step 0 records; step 1's backward runs after its block: nothing of step 0 is recorded
    again under step 1, the step raises saying where the backward belongs."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    (x, y), _ = _batches(2)
    with monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    recorded = list(monitor.records)
    message = r"Monitor\.step\(1\): no backward reached"
    with pytest.raises(semipack.SemipackError, match=message), monitor.step(1):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert monitor.records == recorded
    with monitor.step(2):  # the next step records as usual
        nn.functional.cross_entropy(model(x), y).backward()
    assert {r.step for r in monitor.records} == {0, 2}


def test_a_step_that_trains_another_model_is_named_and_leaves_it_no_values() -> None:
    """Monitor given model A, the step trains B (an EMA copy, a model made again from a
    checkpoint): the step said "no backward reached the model ... call loss.backward() inside",
    although it was called there, and left B's parameters holding the pass's values (trial 74).
    """
    a, b = _model(), _model()
    monitor = semipack.Monitor(a, every=1, tensorboard=False)
    (x, y), _ = _batches(2)
    count = len(list(b.parameters()))
    message = (
        r"Monitor\.step\(0\): the backward inside the block reached none of the monitored "
        rf"model's layers, only {count} tensor\(s\) outside it: does the step run another model"
    )
    with pytest.raises(semipack.SemipackError, match=message), monitor.step(0):
        nn.functional.cross_entropy(b(x), y).backward()
    assert not any(hasattr(p, "semiring_grad") for p in b.parameters())
    assert all(p.grad is not None for p in b.parameters())  # its training step stays plain
    assert not monitor.records


def test_a_step_after_close_warns_once_that_its_records_stay_in_memory(tmp_path) -> None:
    """Steps after ``close()`` (a second epoch after ``with Monitor(...)``) recorded into
    ``monitor.records`` and silently nowhere else (trial 74): the first one warns."""
    model = _model()
    (x, y), _ = _batches(2)
    monitor = semipack.Monitor(model, every=1, log_dir=tmp_path, tensorboard=False)
    with monitor, monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    closed = r"Monitor\.step\(1\) after the monitor was closed"
    with pytest.warns(UserWarning, match=closed), monitor.step(1):
        nn.functional.cross_entropy(model(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per monitor
        with monitor.step(2):
            nn.functional.cross_entropy(model(x), y).backward()
    assert {r.step for r in monitor.records} == {0, 1, 2}
    with open(tmp_path / "monitor.csv") as f:
        assert {row["step"] for row in csv.DictReader(f)} == {"0"}


def test_only_layers_the_backward_reaches_are_recorded() -> None:
    """``unused`` is not called; ``silenced`` is called but its output is multiplied by 0 (in
    the graph, no path): it records only that it is dead."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"used": nn.Linear(4, 3), "silenced": nn.Linear(4, 3), "unused": nn.Linear(4, 3)}
    ).double()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    x = torch.randn(2, 4, dtype=F64)
    for step in range(2):
        with monitor.step(step):
            (model["used"](x) + 0.0 * model["silenced"](x)).sum().backward()
    layers = {(r.layer, r.quantity) for r in monitor.records}
    assert {layer for layer, _ in layers} == {"used", "silenced"}
    assert [(r.step, r.quantity, r.value) for r in monitor.records if r.layer == "silenced"] == [
        (0, "dead_units", 1.0),
        (1, "dead_units", 1.0),
    ]


def test_a_data_parallel_wrapper_records_one_process_names_for_flow_shares_too() -> None:
    """Layer rows drop a data-parallel wrapper's ``module.`` prefix; the flow shares' use names
    kept it (``res -> module.2.inner.0``; trial 74), so the CSVs did not line up. The root
    module's own uses (``module``) read as the model's root's."""

    class Root(nn.Module):  # a use in the root's own forward: h + model[2](h)
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.net[1](self.net[0](x))
            return self.net[3](h + self.net[2](h))

    x, y = _batches(1)[0]
    names = []
    for wrap in (False, True):
        torch.manual_seed(0)
        root = Root()
        model = nn.DataParallel(root) if wrap else root  # on the CPU: calls root itself
        monitor = semipack.Monitor(
            model, every=1, splits={"h": root.net[2].inner[0]}, tensorboard=False
        )
        with monitor.step(0):
            nn.functional.cross_entropy(model(x), y).backward()
        names.append(sorted({r.layer for r in monitor.records}))
    assert names[0] == names[1]
    assert {n for n in names[0] if "->" in n} == {
        "h -> <root module>",  # the root's h + ...
        "h -> net.2",  # the residual's h + ...
        "h -> net.2.inner.0",
    }


def test_split_shares_are_the_last_micro_batchs_and_skip_validation(tmp_path: Path) -> None:
    """Gradient accumulation (two backwards in a step) with a forward under torch.no_grad
    before and after them (validation): the flow shares are the last backward's (a split is
    read per backward; the other values add the step's backwards up, below) (trial 67: they
    were the first micro-batch's; a validation forward first raised, one after warned of a
    second call)."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, splits={"res": model[2]}, tensorboard=False)
    (x1, y1), (x2, y2) = _batches(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.step(0):
            with torch.no_grad():
                model(x2)
            model(x1)  # a grad-mode forward no backward follows (trial 70: no shares at all)
            for x, y in ((x1, y1), (x2, y2)):
                nn.functional.cross_entropy(model(x), y).backward()
                model(x1)  # a metric
            with torch.no_grad():
                model(x1)
    got = {r.layer: r.value for r in monitor.records if r.quantity == "flow_share"}
    want = _flow_shares(model, x2, y2)
    assert set(got) == {f"res -> {use}" for use in want}
    for use, share in want.items():
        assert got[f"res -> {use}"] == pytest.approx(share, rel=1e-12)


def _records(monitor) -> dict[tuple[str, str], float]:
    return {(r.layer, r.quantity): r.value for r in monitor.records}


def test_a_steps_backwards_are_recorded_together() -> None:
    """Two micro-batches' backwards in one step record what one backward over their summed
    loss records (trial 115: the last micro-batch's values alone were recorded)."""
    (x1, y1), (x2, y2) = _batches(2)
    model = _model()
    accumulated = semipack.Monitor(model, every=1, tensorboard=False)
    with accumulated.step(0):
        for x, y in ((x1, y1), (x2, y2)):
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    whole = semipack.Monitor(model, every=1, tensorboard=False)
    with whole.step(0):
        loss = nn.functional.cross_entropy(model(torch.cat([x1, x2])), torch.cat([y1, y2]))
        (loss * 10).backward()  # the summed loss over the 10 examples
    got, want = _records(accumulated), _records(whole)
    assert set(got) == set(want) and len(got) > 10
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("generator_first", [True, False])
def test_a_gans_two_backwards_are_both_recorded(generator_first: bool) -> None:
    """A step that trains a generator and a discriminator, in either order: every layer of
    both is recorded, with the values of both losses' paths (trial 115: the generator trained
    first lost its records, and the discriminator kept the last loss's values alone)."""
    torch.manual_seed(0)
    gan = nn.ModuleDict(
        {
            "g": nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
            "d": nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)),
        }
    ).double()
    g, d = gan["g"], gan["d"]
    gen = torch.Generator().manual_seed(3)
    z, x = torch.randn(5, 3, generator=gen, dtype=F64), torch.randn(5, 2, generator=gen, dtype=F64)

    def generator_loss():
        return nn.functional.softplus(-d(g(z))).sum()

    def discriminator_loss():
        fake = g(z).detach()
        return (nn.functional.softplus(-d(x)) + nn.functional.softplus(d(fake))).sum()

    losses = [generator_loss, discriminator_loss]
    if not generator_first:
        losses.reverse()
    monitor = semipack.Monitor(gan, every=1, tensorboard=False)
    with monitor.step(0):
        for loss in losses:
            loss().backward()
    both = semipack.Monitor(gan, every=1, tensorboard=False)
    with both.step(0):
        (generator_loss() + discriminator_loss()).backward()
    got, want = _records(monitor), _records(both)
    assert {layer for layer, _ in got} == {"g.0", "g.2", "d.0", "d.2"}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_a_split_module_the_forward_never_calls_is_named() -> None:
    model = _model()
    spare = nn.Linear(6, 6)
    monitor = semipack.Monitor(model, every=1, splits={"spare": spare}, tensorboard=False)
    (x, y), _ = _batches(2)
    named = r"Monitor\(splits=\{'spare': Linear\}\): the module was not called in step 0"
    with pytest.raises(semipack.SemipackError, match=named), monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()


def _csv_rows(folder: Path) -> list[tuple[int, str, str, float]]:
    with open(folder / "monitor.csv") as f:
        return [(int(r["step"]), r["layer"], r["quantity"], float(r["value"]))
                for r in csv.DictReader(f)]  # fmt: skip


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> (step, value) of each scalar in the folder's TensorBoard events, in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep them all
    events.Reload()
    return {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}


def _as_events(rows) -> dict[str, list[tuple[int, float]]]:
    """The scalars a CSV's rows make in TensorBoard (``<quantity>/<layer>``, float32 values)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for step, layer, quantity, value in rows:
        out.setdefault(f"{quantity}/{layer}", []).append((step, float(torch.tensor(value))))
    return out


def _nan_equal(rows) -> list[tuple]:
    """Rows (or records) as tuples that compare equal where both values are NaN (the CSV
    holds each value's ``repr``, which reads back as the same float)."""
    out = []
    for r in rows:
        step, layer, quantity, value = r if isinstance(r, tuple) else astuple(r)
        out.append((step, layer, quantity, "nan" if math.isnan(value) else value))
    return out


def _same(a: dict[str, list[tuple[int, float]]], b: dict[str, list[tuple[int, float]]]) -> bool:
    """Equal tags, steps and values (NaN equal to NaN)."""

    def key(pairs):
        return [(s, "nan" if math.isnan(v) else v) for s, v in pairs]

    return a.keys() == b.keys() and all(key(a[t]) == key(b[t]) for t in a)


def test_tensorboard_holds_what_the_csv_holds(tmp_path: Path) -> None:
    """One event per sampled step carries the tags, steps and values that ``add_scalar``, a
    value at a time, writes; both equal the CSV's rows and ``monitor.records``."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    model = _model()
    monitor = semipack.Monitor(model, every=2, log_dir=tmp_path / "run", splits={"res": model[2]})
    _train(model, _batches(7), monitor)
    monitor.close()
    rows = _csv_rows(tmp_path / "run")
    records = [(r.step, r.layer, r.quantity, r.value) for r in monitor.records]
    assert _nan_equal(rows) == _nan_equal(records) and len(rows) == 4 * (3 * 6 + 2) - 3
    written = _events(tmp_path / "run")
    assert _same(written, _as_events(rows))
    reference = SummaryWriter(str(tmp_path / "one_value_at_a_time"))
    for r in monitor.records:
        reference.add_scalar(f"{r.quantity}/{r.layer}", r.value, r.step)
    reference.close()
    assert _same(written, _events(tmp_path / "one_value_at_a_time"))
    assert {"flow_share/res -> 2", "entropy_mean/0", "top_path_changed/3"} <= written.keys()


def test_records_wait_for_flush_secs_and_reach_the_files_on_flush_and_close(tmp_path) -> None:
    model = _model()
    monitor = semipack.Monitor(model, every=1, log_dir=tmp_path, flush_secs=3600)
    _train(model, _batches(3), monitor)
    assert _csv_rows(tmp_path) == []  # the header only: nothing written a step at a time
    monitor.flush()
    assert len(_csv_rows(tmp_path)) == len(monitor.records) > 0
    assert _same(_events(tmp_path), _as_events(_csv_rows(tmp_path)))
    with pytest.warns(UserWarning, match=r"Monitor.step\(0\) comes after step 2 was recorded"):
        _train(model, _batches(2), monitor)  # steps 0 and 1 again
    monitor.close()
    monitor.close()  # a second close does nothing
    rows = _csv_rows(tmp_path)
    assert _nan_equal(rows) == _nan_equal(monitor.records)
    assert _same(_events(tmp_path), _as_events(rows))
    eager = tmp_path / "eager"  # flush_secs=0 writes every step at once
    monitor = semipack.Monitor(model, every=1, log_dir=eager, tensorboard=False, flush_secs=0)
    _train(model, _batches(1), monitor)
    assert len(_csv_rows(eager)) == len(monitor.records) > 0
    monitor.close()


def test_files_are_complete_when_a_with_block_or_a_step_ends_in_an_exception(tmp_path) -> None:
    model = _model()
    batches = _batches(4)
    monitor = semipack.Monitor(model, every=1, log_dir=tmp_path / "a", flush_secs=3600)
    with pytest.raises(RuntimeError, match="diverged"), monitor:
        _train(model, batches, monitor)
        raise RuntimeError("diverged")
    rows = _csv_rows(tmp_path / "a")
    assert len(rows) == len(monitor.records) > 0 and {r[0] for r in rows} == {0, 1, 2, 3}
    assert _same(_events(tmp_path / "a"), _as_events(rows))
    # an exception through a step (never closed): every earlier record is in the files
    monitor = semipack.Monitor(model, every=1, log_dir=tmp_path / "b", flush_secs=3600)
    _train(model, batches[:2], monitor)
    with pytest.raises(RuntimeError, match="loss is NaN"), monitor.step(2):
        raise RuntimeError("loss is NaN")
    rows = _csv_rows(tmp_path / "b")
    assert len(rows) == len(monitor.records) > 0 and {r[0] for r in rows} == {0, 1}
    assert _same(_events(tmp_path / "b"), _as_events(rows))
    monitor.close()


def test_a_monitor_dropped_without_close_leaves_complete_files(tmp_path) -> None:
    model = _model()
    monitor = semipack.Monitor(model, every=1, log_dir=tmp_path, flush_secs=3600)
    _train(model, _batches(3), monitor)
    expected = len(monitor.records)
    del monitor
    gc.collect()
    rows = _csv_rows(tmp_path)
    assert len(rows) == expected > 0
    assert _same(_events(tmp_path), _as_events(rows))


def test_summaries_equal_the_layer_by_layer_reductions() -> None:
    """The summaries' cheap reductions (batched to the host) equal the plain ones: maxima and
    the dead fraction exactly, sums up to their order."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    x, y = _batches(1)[0]
    with monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    # the monitor keeps its summaries only: the values leave the parameters (a trial found
    # three readouts per parameter held until the next sampled step, in every checkpoint)
    assert not any(hasattr(p, "semiring_grad") for p in model.parameters())
    with semipack.extend(model, monitor.semiring):  # the same pass, on the same weights
        nn.functional.cross_entropy(model(x), y).backward()
    got = {(r.layer, r.quantity): r.value for r in monitor.records}
    for name in ("0", "2.inner.0", "3"):
        best, (entropy, flow) = model.get_submodule(name).weight.semiring_grad
        reached = entropy[~entropy.isnan()]
        assert got[name, "log_best_path"] == float(best.max())
        assert got[name, "log_flow"] == pytest.approx(float(flow.logsumexp((0, 1))), rel=1e-6)
        assert got[name, "dead_units"] == float(best.isneginf().all(1).double().mean())
        assert got[name, "entropy_mean"] == pytest.approx(float(reached.mean()), rel=1e-6)
        assert got[name, "entropy_max"] == float(reached.max())
    assert model[0].weight.semiring_grad[1].entropy.isnan().any()  # the dead unit: NaN entropy


def test_a_loss_scale_is_taken_off_the_path_products_logs() -> None:
    """``scaler.scale(loss).backward()`` multiplies every path by the scale: with
    ``loss_scale`` the records equal the unscaled loss's (logs less log(scale)); the
    scale-free quantities are unchanged."""
    (x, y), scale = _batches(1)[0], 1024.0
    records = []
    for factor, given in ((1.0, None), (scale, scale)):
        monitor = semipack.Monitor(_model(), every=1)
        with monitor.step(0, loss_scale=given):
            (factor * nn.functional.cross_entropy(monitor.model(x), y)).backward()
        records.append({(r.layer, r.quantity): r.value for r in monitor.records})
    unscaled, scaled = records
    assert unscaled.keys() == scaled.keys()
    assert {q for _, q in unscaled} >= {"log_best_path", "log_flow", "entropy_mean"}
    for key, value in unscaled.items():
        assert scaled[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    monitor = semipack.Monitor(_model(), every=1)
    for bad in (0.0, -2.0, math.inf, math.nan):
        refused = pytest.raises(ValueError, match="loss_scale must be a finite positive number")
        with refused, monitor.step(0, loss_scale=bad):
            pass


def test_a_compiled_model_records_under_the_models_own_names() -> None:
    """``torch.compile`` wraps the model (its modules gain an ``_orig_mod.`` prefix); the
    records keep the names of the model as written, and the values of the uncompiled one."""
    plain = semipack.Monitor(_model(), every=1, tensorboard=False)
    _train(plain.model, _batches(2), plain)
    compiled_model = torch.compile(_model(), backend="eager")
    compiled = semipack.Monitor(compiled_model, every=1, tensorboard=False)
    _train(compiled_model, _batches(2), compiled)
    got = {(r.step, r.layer, r.quantity): r.value for r in compiled.records}
    want = {(r.step, r.layer, r.quantity): r.value for r in plain.records}
    assert got.keys() == want.keys()
    assert {layer for _, layer, _ in got} == {"0", "2.inner.0", "3"}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, nan_ok=True, rel=1e-12, abs=1e-12)


def test_a_weight_frozen_during_training_moves_its_layer_to_the_bias() -> None:
    """Layers are read as the model is at each sampled step: a weight frozen at step 1 is read
    at its bias from then on (as a layer frozen before the monitor is), with the values of a
    separate MaxProd pass at the bias and no top-path comparison with the weight's index;
    unfrozen again, the layer goes back to its weight."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    x, y = _batches(1)[0]
    for step, frozen in enumerate([False, True, True, False]):
        model[0].weight.requires_grad_(not frozen)
        model.zero_grad()
        with monitor.step(step):
            nn.functional.cross_entropy(model(x), y).backward()
    got = {(r.step, r.layer, r.quantity): r.value for r in monitor.records}
    assert {layer for (step, layer, _) in got if step == 1} == {"0", "2.inner.0", "3"}
    twin = _model()
    twin[0].weight.requires_grad_(False)
    with semipack.extend(twin, semipack.MaxProd(log=True)):
        nn.functional.cross_entropy(twin(x), y).backward()
    assert got[1, "0", "log_best_path"] == float(twin[0].bias.semiring_grad.max())
    assert (1, "0", "top_path_changed") not in got  # the weight's index is no comparison
    assert (2, "0", "top_path_changed") in got  # bias against bias
    assert (3, "0", "top_path_changed") not in got  # back at the weight: starts afresh


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_summary_reductions_keep_infinities_and_sum_16_bit_values_wide(native: bool) -> None:
    """The shifted exp-sum gave NaN for a +inf flow (logsumexp gives inf); a float16 sum of
    200k entropies of 1.0 overflowed to inf. Both forms: the native loops (float32) and
    torch's reductions."""
    from semipack.kernels.native import set_native
    from semipack.kernels.summaries import count_sum_max_of_numbers, log_sum_exp

    inf = math.inf
    set_native(native)
    try:
        assert float(log_sum_exp(torch.tensor([0.0, inf]))) == inf
        assert float(log_sum_exp(torch.full((3,), -inf))) == -inf
        assert math.isnan(float(log_sum_exp(torch.tensor([0.0, math.nan, inf]))))
        x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
        assert float(log_sum_exp(x)) == pytest.approx(float(x.logsumexp(0)), rel=1e-6)
        for dtype in (torch.float16, torch.float32):
            entropy = torch.ones(200_000, dtype=dtype)
            entropy[:5] = math.nan
            count, total, top = (float(v) for v in count_sum_max_of_numbers(entropy))
            assert (count, total / count, top) == (199_995, 1.0, 1.0)
        infinite = torch.tensor([1.0, inf, math.nan])  # nan_to_num made inf the largest float
        assert [float(v) for v in count_sum_max_of_numbers(infinite)] == [2, inf, inf]
        nothing = torch.full((9,), math.nan)
        assert [float(v) for v in count_sum_max_of_numbers(nothing)] == [0, 0.0, -inf]
    finally:
        set_native(True)


def _summary_cases() -> dict[str, torch.Tensor]:
    """[units, entries] float32 values for the best-entry reduction: random, ties, dead units,
    NaN (first one wins), all -inf, one entry, and sizes past the native loops' blocks."""
    gen = torch.Generator().manual_seed(3)
    inf = math.inf
    cases = {"random": torch.randn(64, 147, generator=gen)}
    ties = torch.randint(0, 4, (40, 33), generator=gen).float()
    ties[[3, 17]] = -inf  # dead units
    cases["ties_and_dead_units"] = ties
    nan = torch.randn(30, 21, generator=gen)
    nan[7, 5] = nan[2, 20] = math.nan
    nan[1, 3] = inf
    cases["nan_first_one_wins"] = nan
    cases["all_minus_inf"] = torch.full((5, 9), -inf)
    cases["one_entry"] = torch.tensor([[-2.5]])
    wide = torch.randn(3, 70_001, generator=gen)
    wide[2, 69_999] = 40.0  # the best in the last block of a wide unit
    cases["wide_units"] = wide
    many = torch.randn(20_000, 9, generator=gen)
    many[:, :] = -inf
    many[13_001, 4] = many[19_000, 2] = 1.0  # ties across blocks of units: the first wins
    cases["many_small_units"] = many
    return cases


@pytest.mark.parametrize("name", list(_summary_cases()))
def test_native_summaries_equal_torchs_reductions(name: str) -> None:
    """The native summaries (best entry, dead fraction, index; log flow; count, sum and max of
    the numbers) equal torch's: indices, maxima and counts exactly, sums up to their order."""
    from semipack.kernels.native import native_available, set_native
    from semipack.kernels.summaries import best_entry, count_sum_max_of_numbers, log_sum_exp

    if not native_available():
        pytest.skip("no native kernels here")
    units = _summary_cases()[name]
    flat = units.reshape(-1)
    native = [*best_entry(units), log_sum_exp(flat), *count_sum_max_of_numbers(flat)]
    assert all(not isinstance(v, torch.Tensor) for v in native)  # the native loops ran
    set_native(False)
    try:
        plain = [*best_entry(units), log_sum_exp(flat), *count_sum_max_of_numbers(flat)]
    finally:
        set_native(True)
    assert all(isinstance(v, torch.Tensor) for v in plain)
    plain = [v.item() for v in plain]
    # the independent reference: torch's own argmax, amax, logsumexp, isnan
    assert native[2] == int(flat.argmax()) == plain[2]
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    assert same(native[0], float(flat.max())) and same(native[0], plain[0])
    assert native[1] == plain[1] == float((units.amax(1) == -math.inf).double().mean())
    expected_flow = float(flat.double().logsumexp(0))
    for got in (native[3], plain[3]):
        assert same(got, expected_flow) or got == pytest.approx(expected_flow, rel=1e-6)
    numbers = flat[~flat.isnan()]
    assert native[4] == plain[4] == numbers.numel()
    assert native[5] == pytest.approx(float(numbers.double().sum()), rel=1e-12, nan_ok=True)
    assert native[5] == pytest.approx(plain[5], rel=1e-12, nan_ok=True)
    expected_max = float(numbers.max()) if numbers.numel() else -math.inf
    assert native[6] == plain[6] == expected_max


def test_a_step_number_held_in_a_tensor_is_written_as_a_number(tmp_path: Path) -> None:
    """Adam keeps its step as ``tensor(3.)``; handed to ``Monitor.step`` it went into the CSV
    as the text ``tensor(3.)`` (trial 46). Steps are integers: a tensor or NumPy number holding
    one is taken, anything else is refused."""
    import numpy as np

    model = _model()
    monitor = semipack.Monitor(model, every=1, log_dir=tmp_path, tensorboard=False)
    for step, (x, y) in zip((torch.tensor(3.0), np.int64(4)), _batches(2), strict=True):
        with monitor.step(step):
            nn.functional.cross_entropy(model(x), y).backward()
    monitor.close()
    assert {r.step for r in monitor.records} == {3, 4}
    assert all(type(r.step) is int for r in monitor.records)
    with open(tmp_path / "monitor.csv") as f:
        assert {row["step"] for row in csv.DictReader(f)} == {"3", "4"}
    for bad, error in ((torch.tensor(1.5), ValueError), ("7", TypeError)):
        with pytest.raises(error, match="step must be an integer"), monitor.step(bad):
            pass


def test_a_resumed_run_goes_on_with_the_earlier_records(tmp_path: Path) -> None:
    """A run resumed from a checkpoint (trial 46 found no way but ``overwrite=True``, which
    dropped the earlier rows): ``resume=True`` reads them back, keeps those before the first
    step it records and drops the later ones (written after the checkpoint)."""
    batches = _batches(4)
    first = semipack.Monitor(_model(), every=1, log_dir=tmp_path, tensorboard=False)
    for step, (x, y) in enumerate(batches[:3]):  # steps 0, 1, 2; the checkpoint is at step 2
        with first.step(step):
            nn.functional.cross_entropy(first.model(x), y).backward()
    first.close()
    kept = [r for r in first.records if r.step < 2]
    with pytest.raises(ValueError, match="exclude each other"):
        semipack.Monitor(_model(), log_dir=tmp_path, overwrite=True, resume=True)
    again = semipack.Monitor(_model(), every=1, log_dir=tmp_path, tensorboard=False, resume=True)
    assert again.records == first.records  # read back, for series and plots
    for step, (x, y) in zip((2, 3), batches[2:], strict=True):
        with again.step(step):
            nn.functional.cross_entropy(again.model(x), y).backward()
    again.close()
    assert again.records[: len(kept)] == kept
    assert {r.step for r in again.records} == {0, 1, 2, 3}
    # step 2 again, from the same weights: the same values, but no top-path change yet (its
    # comparison starts afresh)
    redone = {(r.layer, r.quantity): r.value for r in again.records if r.step == 2}
    before = {(r.layer, r.quantity): r.value for r in first.records if r.step == 2}
    assert redone == {k: v for k, v in before.items() if k[1] != "top_path_changed"}
    with open(tmp_path / "monitor.csv") as f:
        rows = [(int(r["step"]), r["layer"], r["quantity"], float(r["value"]))
                for r in csv.DictReader(f)]  # fmt: skip
    assert rows == [(r.step, r.layer, r.quantity, r.value) for r in again.records]


def test_a_resumed_run_s_events_read_back_as_its_csv(tmp_path: Path) -> None:
    """The earlier run's events after the resumed run's first step are dropped from what
    TensorBoard reads, as its CSV rows are (trial 130: both runs' values stood at steps 2 and
    up, and the events no longer equalled the CSV)."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer

    # the two runs' files numbered 9 and 10 by the process's counter of event files, as in
    # CI: by name, "10" sorts before "9"
    counter = event_file_writer._global_uid
    while counter._value % 10 != 9:  # the next file's number
        counter.get()
    batches = _batches(4)
    first = semipack.Monitor(_model(), every=1, log_dir=tmp_path)
    for step, (x, y) in enumerate(batches):  # steps 0-3; the checkpoint is at step 2
        with first.step(step):
            nn.functional.cross_entropy(first.model(x), y).backward()
    first.close()
    # at once, in the same process: the new event file's name must still sort after the
    # first's (TensorBoard reads them in name order; within one second a counter decides, and
    # "10" sorts before "9": the resumed run's file was read first, in CI)
    again = semipack.Monitor(_model(), every=1, log_dir=tmp_path, resume=True)
    for step, (x, y) in zip((2, 3), batches[2:], strict=True):
        with again.step(step):
            nn.functional.cross_entropy(again.model(x) * 2, y).backward()  # new values
    again.close()
    with open(tmp_path / "monitor.csv") as f:
        rows = [(int(r["step"]), r["layer"], r["quantity"], float(r["value"]))
                for r in csv.DictReader(f)]  # fmt: skip
    assert {step for step, *_ in rows} == {0, 1, 2, 3}
    assert _events(tmp_path) == _as_events(rows)


def test_a_step_sampled_twice_warns() -> None:
    """One block per micro-batch with the same step number records the step twice and
    compares its top path with itself (trial 46): said by a warning."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    (x, y), _ = _batches(2)
    with monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match=r"Monitor.step\(0\) is sampled again"), monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()


def test_a_step_retried_after_a_failed_pass_does_not_warn() -> None:
    """A sampled step whose pass failed records nothing: running it again is no second record
    (it warned that the step was sampled again, trial 53)."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    (x, y), _ = _batches(2)
    handle = model[0].weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("no")))
    with pytest.raises(RuntimeError, match="no"), monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    handle.remove()
    assert monitor.records == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.step(0):
            nn.functional.cross_entropy(model(x), y).backward()
    assert {r.step for r in monitor.records} == {0}


def test_values_on_tensors_outside_the_model_are_dropped_too() -> None:
    """A monitor on a generator whose loss runs through a discriminator: the discriminator's
    parameters kept the pass's readouts (trial 53); every tensor the step's passes reached
    loses them once recorded."""
    generator, critic = _model(), nn.Sequential(nn.Linear(3, 1)).double()
    monitor = semipack.Monitor(generator, every=1, tensorboard=False)
    (x, _), _ = _batches(2)
    with monitor.step(0):
        critic(generator(x)).sum().backward()
    assert monitor.records
    for p in [*generator.parameters(), *critic.parameters()]:
        assert not hasattr(p, "semiring_grad") and p.grad is not None


class _HandWritten(nn.Module):
    """An MLP of parameters on the root module: ``x @ W1 + b1``, then ``@ W2 + b2``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W1 = nn.Parameter(torch.randn(4, 6, generator=g, dtype=F64))
        self.b1 = nn.Parameter(torch.zeros(6, dtype=F64))
        self.W2 = nn.Parameter(torch.randn(6, 3, generator=g, dtype=F64))
        self.b2 = nn.Parameter(torch.zeros(3, dtype=F64))

    def forward(self, x):
        return torch.relu(x @ self.W1 + self.b1) @ self.W2 + self.b2


def test_a_module_with_several_weight_matrices_records_each() -> None:
    """All of a hand-written MLP's parameters sit on the root module: it was one layer, read at
    W1, and W2 went unrecorded without a word (trial 49). Each matrix is a layer now; its
    records equal the summaries of a separate pass read at that matrix."""
    model = _HandWritten()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    ((x, y),) = _batches(1)
    with monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    assert {r.layer for r in monitor.records} == {"W1", "W2"}
    got = {(r.layer, r.quantity): r.value for r in monitor.records}
    with semipack.extend(model, monitor.semiring):
        nn.functional.cross_entropy(model(x), y).backward()
    for name in ("W1", "W2"):
        best, (_, flow) = getattr(model, name).semiring_grad
        assert got[name, "log_best_path"] == float(best.max())
        assert got[name, "log_flow"] == pytest.approx(float(flow.logsumexp((0, 1))), rel=1e-6)
    model.W1.requires_grad_(False)  # frozen: W2 keeps its name (it was read at b1, trial 50)
    with monitor.step(1):
        nn.functional.cross_entropy(model(x), y).backward()
    assert {r.layer for r in monitor.records if r.step == 1} == {"W2"}


class _LoRA(nn.Module):
    """A frozen base weight with a trained low-rank update ``A @ B`` (written by hand)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.weight = nn.Parameter(torch.randn(6, 4, generator=g, dtype=F64), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(6, dtype=F64))
        self.A = nn.Parameter(0.1 * torch.randn(6, 2, generator=g, dtype=F64))
        self.B = nn.Parameter(0.1 * torch.randn(2, 4, generator=g, dtype=F64))

    def forward(self, x):
        return nn.functional.linear(x, self.weight + self.A @ self.B, self.bias)


def _reparametrized(kind: str) -> tuple[nn.Module, dict[str, str]]:
    """A model whose first layer's weight is computed from other parameters; its layer names
    and the parameters they must be read at."""
    torch.manual_seed(0)
    first = nn.Linear(4, 6).double()
    if kind == "old spectral_norm":
        first = nn.utils.spectral_norm(first)
        expected = {"0": "0.weight_orig"}
    elif kind == "old weight_norm":  # weight_g [6, 1] and weight_v [6, 4]: one layer
        first = nn.utils.weight_norm(first)
        expected = {"0": "0.weight_v"}
    elif kind == "old weight_norm of another weight":  # an RNN's weight_hh_l0: _g and _v
        first = nn.utils.weight_norm(nn.RNNCell(4, 6).double(), name="weight_hh")
        expected = {"0.weight_ih": "0.weight_ih", "0.weight_hh_v": "0.weight_hh_v"}
    elif kind == "weight_norm of one input":  # magnitude and direction both [6, 1]
        first = nn.utils.parametrizations.weight_norm(nn.Linear(1, 6).double())
        expected = {"0": "0.parametrizations.weight.original1"}
    elif kind == "spectral_norm":
        first = nn.utils.parametrizations.spectral_norm(first)
        expected = {"0": "0.parametrizations.weight.original"}
    elif kind == "weight_norm":
        first = nn.utils.parametrizations.weight_norm(first)
        expected = {"0": "0.parametrizations.weight.original1"}  # the direction, [6, 4]
    else:
        first = _LoRA()
        expected = {"0.A": "0.A", "0.B": "0.B"}
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(6, 3).double())
    return model, {**expected, "2": "2.weight"}


@pytest.mark.parametrize(
    "kind",
    [
        "old spectral_norm",
        "old weight_norm",
        "old weight_norm of another weight",
        "spectral_norm",
        "weight_norm",
        "weight_norm of one input",
        "LoRA",
    ],
)
def test_a_layer_whose_weight_is_computed_is_read_at_its_own_entries(kind: str) -> None:
    """A weight computed from other parameters (spectral or weight norm, old and new style; a
    LoRA update over a frozen weight) was recorded at the layer's bias under the layer's name,
    and the parameters holding the weight went unrecorded or got a second name (trial 61).
    Each is read at the parameter holding the weight's entries now; the records equal the
    summaries of a separate pass read there."""
    model, expected = _reparametrized(kind)
    names = {id(p): n for n, p in model.named_parameters()}
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    assert {layer: names[id(p)] for layer, p in monitor.layers.items()} == expected
    ((x, y),) = _batches(1)
    x = x[:, :1] if kind == "weight_norm of one input" else x
    state = {k: v.clone() for k, v in model.state_dict().items()}  # power iteration buffers
    with monitor.step(0):
        nn.functional.cross_entropy(model(x), y).backward()
    assert {r.layer for r in monitor.records} == set(expected)
    got = {(r.layer, r.quantity): r.value for r in monitor.records}
    model.load_state_dict(state)
    params = dict(model.named_parameters())
    with semipack.extend(model, monitor.semiring):
        nn.functional.cross_entropy(model(x), y).backward()
    for layer, pname in expected.items():
        best, (_, flow) = params[pname].semiring_grad
        if (layer, "log_best_path") not in got:  # the RNN cell's weight_hh meets a zero state
            assert float(best.max()) == -math.inf and got[layer, "dead_units"] == 1.0
            continue
        assert got[layer, "log_best_path"] == float(best.max())
        assert got[layer, "log_flow"] == pytest.approx(
            float(flow.logsumexp(tuple(range(flow.dim())))), rel=1e-6
        )


def test_a_step_with_nan_values_records_unknowns_not_a_moved_top_path() -> None:
    """A NaN in the input makes a sampled step's values NaN: its dead units and top-path change
    were recorded as 0.0 and 1.0 (a comparison with NaN, an argmax that picks the NaN), and the
    next step compared its best entry with that NaN step's (trial 61). They are NaN now, and the
    next step compares with the last step that had a best entry."""
    model = _model()
    ((x0, y0),) = _batches(1)
    x2, y2 = x0, y0  # step 2 repeats step 0: its top path has not moved
    x1 = x0.clone()
    x1[0, 0] = math.nan
    with_nan = semipack.Monitor(model, every=1, tensorboard=False)
    for step, (x, y) in enumerate([(x0, y0), (x1, y0), (x2, y2)]):
        with with_nan.step(step):
            nn.functional.cross_entropy(model(x), y).backward()
    without = semipack.Monitor(model, every=1, tensorboard=False)
    for step, (x, y) in [(0, (x0, y0)), (2, (x2, y2))]:  # no optimizer: the model is unchanged
        with without.step(step):
            nn.functional.cross_entropy(model(x), y).backward()
    got = {(r.step, r.layer, r.quantity): r.value for r in with_nan.records}
    want = {(r.step, r.layer, r.quantity): r.value for r in without.records}
    for layer in with_nan.layers:
        assert math.isnan(got[1, layer, "log_best_path"])
        assert math.isnan(got[1, layer, "dead_units"])
        assert math.isnan(got[1, layer, "top_path_changed"])
        assert got[2, layer, "top_path_changed"] == want[2, layer, "top_path_changed"]
    assert {want[2, layer, "top_path_changed"] for layer in with_nan.layers} == {0.0}


def _critic_run(monitor_options: dict | None) -> list[torch.Tensor]:
    """Four Adam steps of a WGAN-GP critic: the loss adds the first-order terms to a gradient
    penalty (``create_graph=True``)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)).double()
    optimizer = torch.optim.Adam(critic.parameters(), 1e-3)
    monitor = None
    if monitor_options is not None:
        monitor = semipack.Monitor(critic, every=1, tensorboard=False, **monitor_options)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        real = torch.randn(8, 6, generator=g, dtype=F64) + 1
        fake = torch.randn(8, 6, generator=g, dtype=F64)
        eps = torch.rand(8, 1, generator=g, dtype=F64)
        mixed = (eps * real + (1 - eps) * fake).requires_grad_()
        optimizer.zero_grad()
        with monitor.step(step) if monitor is not None else warnings.catch_warnings():
            (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
            penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
            (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
        optimizer.step()
    return [p.detach().clone() for p in critic.parameters()]


def test_a_gradient_penalty_trains_with_plain_bits_under_extensions_false() -> None:
    """Monitor(extensions=False) runs the generic rules: a WGAN-GP critic's training (the case
    the README names as rounding apart through the extensions) is the plain run's, bitwise
    (trial 61: the Monitor had no such option)."""
    plain = _critic_run(None)
    for a, b in zip(plain, _critic_run({"extensions": False}), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    monitor = semipack.Monitor(nn.Linear(2, 1), extensions=False, tensorboard=False)
    assert monitor.extensions is False


def test_mistakes_in_the_model_argument_are_named() -> None:
    """``Monitor([m1, m2])`` failed with an AttributeError, ``semipack.grad(loss, model)``
    with an internal TypeError (trial 78)."""
    with pytest.raises(TypeError, match=r"Monitor expects the model, an nn\.Module, got list"):
        semipack.Monitor([_model(), _model()])
    model = _model()
    x, _ = _batches(1)[0]
    loss = model(x).sum()
    with pytest.raises(
        TypeError,
        match=r"semipack\.grad: inputs must be tensors, got a "
        r"Sequential module \(for its parameters pass list\(module\.parameters",
    ):
        semipack.grad(loss, model, semipack.MaxProd())
    with pytest.raises(TypeError, match=r"inputs must be tensors, got a str among them"):
        semipack.grad(loss, [model[0].weight, "bias"], semipack.MaxProd())
    # a tokenizer's output is a mapping: list() of it gave its keys, "a str among them"
    # (trial 124)
    with pytest.raises(
        TypeError,
        match=r"semipack\.grad: inputs must be a tensor or a sequence of tensors, got a dict, a "
        r"mapping \(a tokenizer's output\?\): pass the tensors themselves",
    ):
        semipack.grad(loss, {"weight": model[0].weight}, semipack.MaxProd())
    # explain_layers met None's missing modules() (trial 124)
    for call in (
        lambda: semipack.explain_layers(None, semipack.MaxProd(), lambda: loss),
        lambda: semipack.explain.attention_layers(None),
    ):
        with pytest.raises(TypeError, match=r"expects the model, an nn\.Module, as its first "):
            call()


def test_a_plot_of_many_layers_gives_each_its_own_colour(tmp_path) -> None:
    """Past matplotlib's 10-colour cycle two layers shared a colour (trial 78)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for layers in (12, 65):  # past tab20's 20 colours x 3 dashes too (trial 130)
        model = nn.Sequential(*[nn.Linear(3, 3, dtype=F64) for _ in range(layers)])
        folder = tmp_path / str(layers)
        monitor = semipack.Monitor(model, every=1, log_dir=folder, tensorboard=False)
        x = torch.randn(4, 3, dtype=F64)
        for step in range(2):
            with monitor.step(step):
                model(x).pow(2).sum().backward()
        figures = []
        original = plt.close
        plt.close = lambda fig=None, figures=figures: figures.append(fig)  # kept to look at
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "Tight layout not applied" for every picture
                monitor.plot()
        finally:
            plt.close = original
        axes = figures[0].axes[0]
        lines = axes.get_lines()
        assert len(lines) == layers
        looks = {
            (matplotlib.colors.to_hex(line.get_color()), line.get_linestyle(), line.get_marker())
            for line in lines
        }
        assert len(looks) == layers
        # the legend, in columns, is no taller than the axes
        renderer = figures[0].canvas.get_renderer()
        legend = axes.get_legend().get_window_extent(renderer)
        assert legend.height <= axes.get_window_extent(renderer).height * 1.05
        for figure in figures:
            plt.close(figure)


def test_arguments_a_new_user_gets_wrong_are_named() -> None:
    """A semiring given as the third positional argument (log_dir) and splits given as a list
    raised pathlib's and dict's errors, naming no argument (trial 110)."""
    model = _model()
    with pytest.raises(TypeError) as caught:
        semipack.Monitor(model, 10, semipack.MaxProd())
    assert str(caught.value) == (
        "Monitor(log_dir=...) takes a folder, a str or a path, got MaxProd: the monitor picks "
        "its semirings itself (MaxProd and Entropy; MaxProd and LogSum with entropy=False), "
        "and its third argument is log_dir"
    )
    with pytest.raises(TypeError, match=r"Monitor\(log_dir=...\) takes a folder, .* got int$"):
        semipack.Monitor(model, log_dir=3)
    for splits in ([model[0]], {"first": "0"}, {0: model[0]}):
        with pytest.raises(TypeError, match=r"Monitor\(splits=...\) takes a dict of names to mod"):
            semipack.Monitor(model, splits=splits)
    assert semipack.Monitor(model, splits={"first": model[0]}).splits == {"first": model[0]}


def test_a_step_block_never_entered_warns_and_records_nothing() -> None:
    """``monitor.step(i)`` without ``with`` ran the step plain and recorded nothing, silently
    (trial 110); now the dropped block warns."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    x, y = _batches(1)[0]
    with pytest.warns(RuntimeWarning, match=r"Monitor.step\(...\) was made but never entered"):
        monitor.step(0)  # dropped at once
        gc.collect()
    nn.functional.cross_entropy(model(x), y).backward()
    assert monitor.records == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an entered block warns about nothing
        with monitor.step(0):
            nn.functional.cross_entropy(model(x), y).backward()
        gc.collect()
    assert {r.step for r in monitor.records} == {0}


def test_step_numbers_that_go_back_warn() -> None:
    """Steps 0, 1, 2, 1: the second step 1 is recorded beside the first and its top path
    compared with step 2's; that now warns (trial 110: silent), in order it does not."""
    model = _model()
    monitor = semipack.Monitor(model, every=1, tensorboard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, _batches(3), monitor)
    x, y = _batches(1)[0]
    with (
        pytest.warns(UserWarning, match=r"Monitor.step\(1\) comes after step 2 was recorded"),
        monitor.step(1),
    ):
        nn.functional.cross_entropy(model(x), y).backward()
    steps = [r.step for r in monitor.records if r.quantity == "log_best_path"]
    assert [step for step, _ in itertools.groupby(steps)] == [0, 1, 2, 1]


def test_a_monitor_closed_without_any_step_warns(tmp_path: Path) -> None:
    """A loop that never enters ``monitor.step`` records nothing: closing says so once (trial
    115: silent); a monitor that ran a step closes quietly."""
    unused = semipack.Monitor(_model(), every=1, log_dir=tmp_path / "unused")
    with pytest.warns(RuntimeWarning, match="no step block was entered, so nothing was recorded"):
        unused.close()
    used = semipack.Monitor(_model(), every=1, log_dir=tmp_path / "used")
    ((x, y),) = _batches(1)
    with used.step(0):
        nn.functional.cross_entropy(used.model(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        used.close()
        unused.close()  # said once
