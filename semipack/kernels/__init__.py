"""Fused kernels behind the semirings and op rules.

Sum-like semirings (Real, LogSum, LogCount, Entropy, Boolean) reduce to BLAS matmuls inside the
semiring classes (LogSum's, LogCount's and Entropy's large float32 ones on oneDNN: ``blas``).
Max-like reductions (MaxProd, SignedMaxProd) and the dense per-row Jacobians of softmax and the
normalisation layers use the kernels here: torch.compile / inductor on CPU and
CUDA, with an eager blocked fallback when compilation is unavailable or switched off
(``SEMIPACK_COMPILE=0`` or ``semipack.kernels.set_compile(False)``).
"""

from .compiled import compile_enabled, compiled, set_compile

__all__ = ["compile_enabled", "compiled", "set_compile"]
