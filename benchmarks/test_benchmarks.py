"""pytest-benchmark cases: ``pytest benchmarks/test_benchmarks.py --benchmark-only``.

Each case times one backward pass (plain, or a semiring through the fused or the generic path)
of a benchmark workload; compare them within one run with ``--benchmark-group-by=param:workload``.
The ratios table lives in ``benchmarks/run.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import WORKLOADS
from common import backward_step

import semipack

VARIANTS = {
    "plain": None,
    "MaxProd-fused": (semipack.MaxProd, True),
    "MaxProd-generic": (semipack.MaxProd, False),
    "Entropy-fused": (semipack.Entropy, True),
    "LogSum-fused": (semipack.LogSum, True),
}


@pytest.fixture(scope="module", params=["linear", "bert_layer", "minilm_1x20"])
def workload(request):
    return WORKLOADS[request.param]()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_backward(benchmark, workload, variant: str) -> None:
    spec = VARIANTS[variant]
    if spec is None:
        step = backward_step(workload.model, workload.loss)
    else:
        make, extensions = spec
        step = backward_step(workload.model, workload.loss, make(), extensions)
    step()()  # warm-up and compile
    benchmark.extra_info["workload"] = workload.description
    benchmark.pedantic(lambda backward: backward(), setup=lambda: ((step(),), {}), rounds=3)
