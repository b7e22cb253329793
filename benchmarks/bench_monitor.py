"""What ``semipack.Monitor`` adds to the wall time of training the example CNN.

Variants, each training the CNN of ``examples/monitor_training.py`` for ``--steps`` steps from
the same start: no monitor; the monitor at ``every=10``; at ``every=10`` without its Entropy
factor (``entropy=False``, the cheaper configuration); at ``every=1``; and every step's
backward run directly as the Monitor's semiring backward (``semipack.extend`` with the same
``Product``, nothing recorded): the semiring backward's own cost, which ``every=1`` should not
exceed by much. The variants take turns within every round; the line gives the median of the
rounds and the ratios to no monitor. The last line isolates the monitor's own recording (its
summaries and files, which the difference of two whole runs drowns in the backward's noise):
the time inside ``Monitor._record`` and ``close`` in the ``every=1`` runs, per sampled step.
A final line splits a plain step into forward, backward and optimizer step.

``--model resnet18`` trains torchvision's ResNet-18 (train mode, 8 x 3 x 64 x 64 random images,
random weights) instead: a step of about a hundred milliseconds, where the example CNN's step
takes about one, so the monitor's fixed costs per node weigh less against the arithmetic.

Run: ``python benchmarks/bench_monitor.py --steps 100 --rounds 5`` (the example CNN) and
``python benchmarks/bench_monitor.py --model resnet18 --steps 20 --rounds 3``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import semipack

ROOT = Path(__file__).resolve().parent.parent


def _example():
    spec = importlib.util.spec_from_file_location(
        "monitor_training", ROOT / "examples" / "monitor_training.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("monitor_training", module)
    spec.loader.exec_module(module)
    return module


def task(name: str, steps: int) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (seeded) and ``steps`` batches of the task ``name``."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if name == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(weights=None, num_classes=10).train()
        batches = [
            (
                torch.randn(8, 3, 64, 64, generator=generator),
                torch.randint(0, 10, (8,), generator=generator),
            )
            for _ in range(steps)
        ]
        return model, batches
    example = _example()
    model = example.small_cnn()
    return model, [example.quadrant_images(32, generator) for _ in range(steps)]


def run(
    variant: str,
    steps: int,
    folder: str,
    recording: list[float] | None = None,
    model_name: str = "example",
) -> float:
    """Seconds to train ``steps`` steps in ``variant``; with ``recording``, appends the seconds
    the monitor spent recording (``Monitor._record`` and ``close``) per sampled step."""
    model, batches = task(model_name, steps)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    lossfunc = nn.CrossEntropyLoss()
    monitor = None
    if variant.startswith("every="):
        every = int(variant.split("=")[1].split()[0])
        entropy = "no entropy" not in variant
        monitor = semipack.Monitor(
            model,
            every=every,
            entropy=entropy,
            log_dir=f"{folder}/{variant.replace(' ', '_')}",
            overwrite=True,  # each round writes the variant's folder again
        )
        spent = [0.0, 0]  # seconds recording, sampled steps
        record = monitor._record

        def timed(*args: Any) -> None:
            start = time.perf_counter()
            record(*args)
            spent[0] += time.perf_counter() - start
            spent[1] += 1

        monitor._record = timed  # the instance's own: Monitor.step calls self._record
    product = semipack.Monitor(model, every=1).semiring
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        if monitor is not None:
            with monitor.step(step):
                lossfunc(model(x), y).backward()
        elif variant == "semiring backward":
            with semipack.extend(model, product):
                lossfunc(model(x), y).backward()
        else:
            lossfunc(model(x), y).backward()
        optimizer.step()
    if monitor is not None:
        closing = time.perf_counter()
        monitor.close()
        spent[0] += time.perf_counter() - closing
        if recording is not None:
            recording.append(spent[0] / spent[1])
    return time.perf_counter() - start


def plain_phases(steps: int, model_name: str = "example") -> tuple[float, float, float]:
    """Median seconds of a plain step's forward, backward and optimizer step: the budget the
    monitor's target leaves, against the semiring products' arithmetic floor."""
    model, batches = task(model_name, 1)
    x, y = batches[0]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    lossfunc = nn.CrossEntropyLoss()
    phases: list[list[float]] = [[], [], []]
    for i in range(steps + 10):
        t0 = time.perf_counter()
        loss = lossfunc(model(x), y)
        t1 = time.perf_counter()
        optimizer.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i >= 10:  # warmed up
            for times, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times.append(seconds)
    forward, backward, step = (statistics.median(t) for t in phases)
    return forward, backward, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", choices=["example", "resnet18"], default="example")
    args = parser.parse_args()
    variants = ["plain", "every=10", "every=10 no entropy", "every=1", "semiring backward"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    recording: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        for v in variants:
            run(v, 5, folder, model_name=args.model)  # warm-up
        for _ in range(args.rounds):
            for v in variants:
                kept = recording if v == "every=1" else None
                times[v].append(run(v, args.steps, folder, kept, args.model))
    median = {v: statistics.median(t) for v, t in times.items()}
    for v in variants:
        print(f"{v:>18}: {median[v]:.3f} s ({median[v] / median['plain']:.2f}x no monitor)")
    print(
        f"every=1 over the semiring backward alone: "
        f"{median['every=1'] / median['semiring backward']:.2f}"
    )
    print(
        f"recording at every=1 (Monitor._record and close): "
        f"{statistics.median(recording) * 1e3:.3f} ms per sampled step"
    )
    forward, backward, step = plain_phases(args.steps, args.model)
    print(
        f"plain step: forward {forward * 1e3:.2f} ms, backward {backward * 1e3:.2f} ms, "
        f"optimizer {step * 1e3:.2f} ms (medians of {args.steps})"
    )


if __name__ == "__main__":
    main()
