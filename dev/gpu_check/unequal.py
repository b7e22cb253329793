"""Which bitwise comparisons of a CPU test fail on CUDA, and by how much.

A test that asserts ``torch.equal`` stops at its first difference. This runs the named test
functions with CUDA as the default device and ``torch.equal`` replaced by a recorder that
always answers True, so every comparison runs; each one that differs is printed with the test's
line, the count of differing entries, whether NaN and infinity patterns agree, and the largest
distance in units in the last place among entries finite on both sides. Run from the repo root
with check.sh's PYTHONPATH and LD_PRELOAD:

    python3 dev/gpu_check/unequal.py test_kernels_rowwise:test_name:"((300, 200),)"
"""

import ast
import importlib
import sys

import torch

_equal = torch.equal


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest ulp distance between entries finite in both (float32 or float64)."""
    both = a.isfinite() & b.isfinite()
    if not both.any():
        return 0
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t[both].view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)), i)

    return int((ordered(a) - ordered(b)).abs().max())


def _recording_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if _equal(a, b):
        return True
    line = sys._getframe(1).f_lineno
    if a.shape != b.shape or a.dtype != b.dtype:
        print(f"  line {line}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}", flush=True)
        return True
    if a.dtype == torch.bool:
        print(f"  line {line}: masks differ in {int((a != b).sum())} of {a.numel()}", flush=True)
        return True
    differ = a != b
    nan_same = _equal(a.isnan(), b.isnan())
    inf_same = _equal(a.isinf(), b.isinf())
    where = differ.nonzero()[:3].tolist()
    print(
        f"  line {line}: {int(differ.sum())} of {a.numel()} differ, NaN pattern same: "
        f"{nan_same}, infinity pattern same: {inf_same}, max ulps (finite): {_ulps(a, b)}, "
        f"first at {where}: {a[differ][:3].tolist()} vs {b[differ][:3].tolist()}",
        flush=True,
    )
    return True


def main() -> None:
    sys.path.insert(0, "tests")
    torch.set_default_device("cuda" if torch.cuda.is_available() else "cpu")
    torch.equal = _recording_equal
    for spec in sys.argv[1:]:
        module, test, args = spec.split(":", 2)
        print(f"{module}.{test}{args}", flush=True)
        try:
            getattr(importlib.import_module(module), test)(*ast.literal_eval(args))
            print("  ran to the end", flush=True)
        except BaseException as error:  # report and go on
            print(f"  raised {type(error).__name__}: {str(error)[:300]}", flush=True)


if __name__ == "__main__":
    main()
