"""Monitor semiring quantities while training: a small CNN and a small transformer.

Both train on synthetic data made here (nothing is downloaded): the CNN tells which quadrant of
a noisy 12 x 12 image holds a bright square, the transformer whether the first token of a
sequence comes back later. ``semipack.Monitor`` runs every ``--every``-th step's backward as a
semiring backward (MaxProd and Entropy with its log flow, in one pass) and records per-layer
path entropy, best path, total flow, dead units, top-path changes and, for the transformer, the
share of the flow through the first layer's residual add against its attention branch.

Run::

    python examples/monitor_training.py --out docs/monitor --every 10

writes ``cnn/`` and ``transformer/`` folders with ``monitor.csv``, TensorBoard events and one
PNG per quantity.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import semipack


def quadrant_images(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 1, 12, 12]`` noise with a bright 4 x 4 square in one quadrant; label = quadrant."""
    labels = torch.randint(0, 4, (n,), generator=generator)
    images = 0.5 * torch.randn(n, 1, 12, 12, generator=generator)
    rows, cols = (labels // 2) * 6 + 1, (labels % 2) * 6 + 1
    for i in range(n):
        images[i, 0, rows[i] : rows[i] + 4, cols[i] : cols[i] + 4] += 2.0
    return images, labels


def repeat_sequences(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 8]`` tokens 1-15; label 1 when the first token appears again."""
    tokens = torch.randint(1, 16, (n, 8), generator=generator)
    labels = torch.randint(0, 2, (n,), generator=generator)
    for i in range(n):
        rest = tokens[i, 1:]
        rest[rest == tokens[i, 0]] = tokens[i, 0] % 15 + 1  # no copy by chance
        if labels[i]:
            rest[int(torch.randint(0, 7, (1,), generator=generator))] = tokens[i, 0]
    return tokens, labels


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 9, 4),
    )  # fmt: skip


class SmallTransformer(nn.Module):
    """Embeddings, two encoder layers (width 16, 2 heads), a classifier on the first position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 16)
        self.position = nn.Parameter(0.1 * torch.randn(8, 16))
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position)[:, 0])


def train(
    model: nn.Module,
    data: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    monitor: semipack.Monitor | None,
    steps: int,
    lr: float,
    seed: int = 0,
    desc: str = "training",
) -> float:
    """``steps`` Adam steps on fresh batches of 32; returns the accuracy on 512 new examples."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    lossfunc = nn.CrossEntropyLoss()
    for step in tqdm(range(steps), desc=desc, leave=False):
        x, y = data(32, generator)
        optimizer.zero_grad()
        if monitor is None:
            lossfunc(model(x), y).backward()
        else:
            with monitor.step(step):
                lossfunc(model(x), y).backward()
        optimizer.step()
    x, y = data(512, generator)
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="monitor_out")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cnn = small_cnn()
    out = Path(args.out)
    # the script rewrites its folder on every run
    monitor = semipack.Monitor(cnn, every=args.every, log_dir=out / "cnn", overwrite=True)
    accuracy = train(cnn, quadrant_images, monitor, args.steps, 3e-3, desc="CNN")
    monitor.close()
    print(f"CNN: test accuracy {accuracy:.1%}; plots: {len(monitor.plot())} in {out / 'cnn'}")
    torch.manual_seed(0)
    model = SmallTransformer()
    splits = {"encoder.layers.0": model.encoder.layers[0]}
    monitor = semipack.Monitor(
        model, every=args.every, log_dir=out / "transformer", splits=splits, overwrite=True
    )
    accuracy = train(model, repeat_sequences, monitor, 2 * args.steps, 2e-3, desc="transformer")
    monitor.close()
    pictures = monitor.plot()
    folder = out / "transformer"
    print(f"transformer: test accuracy {accuracy:.1%}; plots: {len(pictures)} in {folder}")


if __name__ == "__main__":
    main()
