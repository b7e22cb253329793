"""Float32 matrix products of the sum-like semirings, through oneDNN where that is faster.

Why: PyTorch's CPU ``torch.matmul`` calls MKL, which on AMD processors takes its AVX2 path.
On the AMD Zen 5 we benchmark on it ran a [1024, 768] x [768, 3072] product at 50 G
multiply-adds/s per core. oneDNN, the library behind PyTorch's CPU convolutions, picks AVX-512
there and ran the same product at 118 G/s. Its 2-D product is reachable through
``torch.ops.mkldnn._linear_pointwise`` (the op inductor uses for frozen CPU linears). LogSum,
LogCount and Entropy messages are such products of non-negative operands (exponentiated
messages times |W|, |x| or |W| log|W|). The results differ from MKL's by summation order only:
non-negative terms, so nothing cancels and an exact zero (no path) stays one.

The regular gradient never comes here: it is PyTorch's own, bitwise ``torch.autograd``'s.

On a CPU without AVX-512 oneDNN has no such lead: on an AVX2-only AMD Zen 3 (2026-11-28, two
threads) MKL ran BERT's [1024, 768] x [768, 3072] product in 37 ms against oneDNN's 62 ms
(a row-major ``b``, which oneDNN takes transposed), a sentence's [20, 384] x [384, 384] in
93 us against 177 us, and oneDNN was nowhere faster by more than the noise. So the default
follows PyTorch's CPU capability (:func:`default_onednn`): oneDNN where it is an AVX-512 one,
``torch.matmul`` elsewhere. ``SEMIPACK_ONEDNN=1`` or ``=0`` (or :func:`set_onednn`) overrides
it. Products below ``ONEDNN_MIN_MACS`` multiply-adds stay there too: oneDNN's
fixed cost per call (about 13 µs) exceeded MKL's whole product at 64 x 16 x 64.
"""

from __future__ import annotations

import os
import platform
import warnings

import torch
from torch import Tensor

from .switches import switched_on

#: Most entries of a left operand that is not row-major (a weight message's transposed
#: message) copied to row-major so that its product runs on oneDNN. oneDNN would copy it
#: anyway; a BERT layer's [3072, 1024] one (12 MB) raised the backward's peak memory, while
#: its [768, 1024] ones (3 MB) did not, and took the layer's Entropy backward from 4.96x to
#: 4.65x a plain one; a sentence's [1536, 20] one took 76 µs on oneDNN against 572 µs on MKL
#: (whose AVX2 path is slowest with an inner size this short).
ONEDNN_COPY_MAX = 1 << 20
#: Smallest product (n * k * m multiply-adds) sent to oneDNN. At 384 x 20 x 384 (2.9 M) oneDNN
#: took 27 µs against MKL's 32 µs on two threads; at 64 x 16 x 64 (65 k), 13 µs against 3 µs.
ONEDNN_MIN_MACS = 1 << 20


def default_onednn() -> bool:
    """Whether products go to oneDNN unless told otherwise: as ``SEMIPACK_ONEDNN`` says where
    it is set to something (0 / false / no / off: MKL; any other value: oneDNN), else where
    PyTorch's CPU capability is AVX-512 (the only kind of CPU where oneDNN was measured faster
    than MKL; see the module docstring). An empty or blank value counts as unset: clearing the
    variable with ``SEMIPACK_ONEDNN=`` gives the default back (trial 105)."""
    if os.environ.get("SEMIPACK_ONEDNN", "").strip():
        return switched_on("SEMIPACK_ONEDNN")
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


_state = {"enabled": default_onednn()}


def set_onednn(enabled: bool) -> bool:
    """Send large float32 CPU products of the sum-like semirings to oneDNN or keep them all on
    ``torch.matmul`` (the default: :func:`default_onednn`); returns the previous setting.
    ``enabled`` must be a bool: a string such as ``"off"`` is refused rather than read as true
    (trial 105)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_onednn takes True or False, not {enabled!r}")
    previous, _state["enabled"] = _state["enabled"], enabled
    return previous


def _linear_op():
    """oneDNN's 2-D product op, or None where this PyTorch build lacks it or the CPU is not
    x86-64 (the speed measured here is oneDNN's x86 AVX-512 path; elsewhere ``torch.matmul``'s
    own choice stands)."""
    if platform.machine() not in ("x86_64", "AMD64") or not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def _failed(exc: Exception) -> None:
    """oneDNN refused a product: every later one takes ``torch.matmul`` (one warning)."""
    _state["enabled"] = False
    warnings.warn(
        f"semipack: oneDNN's product failed ({type(exc).__name__}: {exc}); using torch.matmul "
        "from now on",
        RuntimeWarning,
        stacklevel=3,
    )


_LINEAR = _linear_op()


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)`` for ``a`` [..., n, k] and ``b`` [k, m], on oneDNN when both are
    float32 CPU tensors without autograd history, the product has at least
    ``ONEDNN_MIN_MACS`` multiply-adds, and oneDNN is available and enabled; ``torch.matmul``
    itself otherwise (any other shapes included). Result [..., n, m], contiguous."""
    if not _on_onednn(a, b):
        return torch.matmul(a, b)
    rows = a.reshape(-1, a.shape[-1]).contiguous()  # copied if not row-major (ONEDNN_COPY_MAX)
    try:
        out = _LINEAR(rows, b.transpose(0, 1), None, "none", [], "")
    except RuntimeError as exc:
        _failed(exc)
        return torch.matmul(a, b)
    return out.reshape(*a.shape[:-1], b.shape[1])


def _on_onednn(a: Tensor, b: Tensor) -> bool:
    """Whether ``matmul(a, b)`` runs on oneDNN (see its conditions)."""
    return (
        _state["enabled"]
        and _LINEAR is not None
        and b.dim() == 2
        and a.dim() >= 2
        and a.dtype == b.dtype == torch.float32
        and a.device.type == b.device.type == "cpu"
        and type(a) is Tensor
        and type(b) is Tensor
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
        and a.shape[-1] == b.shape[0]
        and (a.is_contiguous() or a.numel() <= ONEDNN_COPY_MAX)
        and a.numel() // max(a.shape[-1], 1) * b.shape[0] * b.shape[1] >= ONEDNN_MIN_MACS
    )


def subtract_product(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``c - a @ b`` for 2-D ``a`` [n, k], ``b`` [k, m] and a fresh ``c`` [n, m] the caller
    hands over: oneDNN subtracts ``c`` as it stores the product (``a @ b - c``, then negated in
    place: exact) where ``matmul`` would run there, else BLAS subtracts the product from ``c``
    in place as it accumulates (``addmm_``: no third product-sized tensor)."""
    if c.dim() == 2 and c.dtype == a.dtype and c.is_contiguous() and _on_onednn(a, b):
        try:
            return _LINEAR.binary(a.contiguous(), c, b.transpose(0, 1), None, "sub").neg_()
        except RuntimeError as exc:
            _failed(exc)
    return c.addmm_(a, b, alpha=-1)
