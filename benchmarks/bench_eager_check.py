"""What the eager attention check (``semipack/extensions/reference_check.py``) adds to a forward.

A Hugging Face eager attention call inside ``semipack.extend`` is drawn by the fused attention
backward only after its graph, values and backward are checked against the decomposition; the
check runs in the forward. This times the forward of one BERT-base layer (8 x 128 tokens, eager
attention, random weights) under ``extend`` with the check and with it switched off
(``AttentionFunction.draws`` answering True), interleaved, and prints the medians.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_eager_check.py --rounds 7``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import semipack
from semipack.extensions.attention import AttentionFunction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=768, num_hidden_layers=1, num_attention_heads=12, intermediate_size=3072
    )
    model = transformers.BertModel._from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(0, 1000, (8, 128))
    checked = AttentionFunction.draws

    def unchecked(inner, spec) -> bool:
        return True

    def forward(check: bool) -> float:
        AttentionFunction.draws = checked if check else staticmethod(unchecked)
        try:
            with semipack.extend(model, semipack.MaxProd()):
                start = time.perf_counter()
                model(input_ids=ids)
                return time.perf_counter() - start
        finally:
            AttentionFunction.draws = checked

    for check in (True, False):  # warm-up
        forward(check)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for check in (True, False):
            times[check].append(forward(check))
    with_check, without = (statistics.median(times[c]) for c in (True, False))
    print(
        f"BERT-base layer, 8 x 128 tokens, eager, forward under extend: with the check "
        f"{with_check * 1e3:.1f} ms, without {without * 1e3:.1f} ms "
        f"({with_check / without:.2f}x; medians of {args.rounds} interleaved rounds)"
    )


if __name__ == "__main__":
    main()
