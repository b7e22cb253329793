"""Hand-written AVX2 / AVX-512 max-plus kernels, compiled with the system C compiler on first use.

Why not only inductor: the max-plus product is bound by the two vector ports that run its add
and max, and a hand register-blocked loop keeps them busy (about 39 G pairs/s on two Zen 3
cores vs about 26 for the compiled loop in :mod:`..tropical`). The source is plain C with no
PyTorch headers, so it builds in well under a second; it is loaded with :mod:`ctypes`, which
releases the GIL, and a small thread pool splits the work across ``torch.get_num_threads()``.

The kernel is optional: without a C compiler, on a CPU without AVX2, on other platforms or with
``SEMIPACK_NATIVE=0`` (or :func:`set_native(False) <set_native>`) :func:`maxplus_f32` is not
available and callers use the compiled or eager kernels, which give the same values.

Two builds of the same sources: with AVX2 and FMA, and with AVX-512 as well, where the max-plus
kernels hold 16 lanes in one register instead of two (``vec16.h``). A core that runs 512-bit
operations at full width does twice the max-plus pairs per cycle with it. The wider build is
loaded where PyTorch reports AVX-512 (:func:`torch.backends.cpu.get_cpu_capability`) and it
builds; ``SEMIPACK_NATIVE_AVX512=0`` (or :func:`set_avx512(False) <set_avx512>`) keeps the AVX2
one. The max-plus kernels of both give the same bits (lane-wise exact operations only); Entropy's
all-pairs normalisation sums (``normalization.c``) group their partial sums over 16 lanes in the
wider build, so they round differently.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..shapes import dense_block
from ..switches import switched_on

_SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "maxplus.c",
        "normalization.c",
        "normalization_sorted.c",
        "softmax.c",
        "fingerprint.c",
        "elementwise.c",
        "depthwise.c",
        "depthwise_channels.c",
        "log_derivatives.c",
        "log_space.c",
        "summaries.c",
    )
)
#: Headers the sources include (part of the build's cache key).
_HEADERS = tuple(Path(__file__).with_name(name) for name in ("vector_math.h", "vec16.h"))
_FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c11", "-fopenmp", "-shared", "-fPIC")
#: Added for the AVX-512 build (``vec16.h`` then holds 16 lanes in one register).
_AVX512_FLAGS = ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw")
#: Columns of a packed panel of ``b`` in maxplus.c.
PANEL_COLS = 16
#: Below this many pairs one thread does the whole product.
THREADED_MIN_PAIRS = 1 << 20
#: Candidates per row whose pairs give the pruned kernel its lower bounds (phase 1).
PRUNE_TOP = 32
#: Indices are carried as float32 inside the kernel: exact below this.
MAX_INDEX_K = 1 << 24

_INF = float("inf")

T = TypeVar("T")
#: ``memo(t, kind, make)``: ``make()``, a form named ``kind`` of the operand ``t``, or the one a
#: caller kept from an earlier call (``computed``: none kept).
Memo = Callable[[Tensor, str, Callable[[], Any]], Any]

#: ctypes codes of the C signatures below: a pointer, an int64_t, an int, a float, a double.
_C_TYPES = {
    "p": ctypes.c_void_p,
    "q": ctypes.c_int64,
    "i": ctypes.c_int,
    "f": ctypes.c_float,
    "d": ctypes.c_double,
}
#: Each exported function: (return type or None for void, parameter types), in those codes.
_SIGNATURES: dict[str, tuple[str | None, str]] = {
    "semipack_maxplus_f32": (None, "pqqqpppqqqqqqi"),
    "semipack_maxplus_pruned_f32": ("q", "pqppppqqqqqi"),
    "semipack_maxplus_pruned_count_f32": ("i", "pqpqqpqqqqp"),
    "semipack_pack_panels_f32": (None, "pqqqpqqqi"),
    "semipack_norm_entropy_sums_f32": ("i", "pppqqpppi"),
    "semipack_softmax_log_sum_f32": ("i", "ppqqpi"),
    "semipack_norm_abs_reduce_f32": (None, "ppqqpii"),
    "semipack_norm_sorted_max_f32": ("i", "ppqqppi"),
    "semipack_norm_sorted_sums_f32": ("i", "pppqqpppi"),
    "semipack_fingerprint": (None, "pqp"),
    "semipack_below_inf_f32": ("i", "pq"),
    "semipack_max_affine_f32": (None, "ppppqqqppi"),
    "semipack_exp_f32": (None, "ppqfi"),
    "semipack_log_plus_f32": (None, "ppqqqqi"),
    "semipack_sign_changing_log_derivative_f32": (None, "ippppqpqpqfffi"),
    "semipack_abs_xlogx_f32": (None, "pppqii"),
    "semipack_entropy_mean_f32": (None, "pppqqi"),
    "semipack_entropy_readout_f32": (None, "pppqi"),
    "semipack_log_add_exp_f32": (None, "pppqi"),
    "semipack_entropy_plus_f32": (None, "ppppppqi"),
    "semipack_nonzero_abs_min_f32": ("f", "pq"),
    "semipack_affine_log_sums_f32": (None, "pppppqqqfpppppi"),
    "semipack_norm_readout_f32": (None, "ipppppqqi"),
    "semipack_entropy_rows_f32": (None, "pppppqqi"),
    "semipack_entropy_readout_of_sums_f32": (None, "pppppppfppqqi"),
    "semipack_cut_below_f32": (None, "pppqffi"),
    "semipack_maxplus_gather_f32": (None, "pqqpqpppqqqqi"),
    "semipack_maxplus_scatter_max_f32": (None, "pqqpppqppqqqi"),
    "semipack_depthwise_input_f32": (None, "ppp" + "q" * 15 + "i"),
    "semipack_depthwise_weight_f32": (None, "ppp" + "q" * 13 + "i"),
    "semipack_depthwise_input_ids_f32": (None, "ppppp" + "q" * 16 + "i"),
    "semipack_depthwise_weight_ids_f32": (None, "ppppp" + "q" * 13 + "i"),
    "semipack_depthwise_input_stride2_f32": (None, "ppppp" + "q" * 11 + "i"),
    "semipack_depthwise_channels_input_f32": (None, "ppppp" + "q" * 15 + "i"),
    "semipack_depthwise_channels_weight_f32": (None, "ppppp" + "q" * 12 + "i"),
    "semipack_best_entries_f32": (None, "pqqpppi"),
    "semipack_log_sum_exp_f32": ("d", "pqi"),
    "semipack_number_stats_f32": (None, "pqpppi"),
}

_state = {
    "enabled": switched_on("SEMIPACK_NATIVE"),
    "avx512": switched_on("SEMIPACK_NATIVE_AVX512"),
}
#: One build at a time: threads of one process would share the partial file's name, and the
#: cache of ``_build`` keeps whichever result a thread reached first.
_building = threading.Lock()


def set_native(enabled: bool) -> None:
    """Use (or stop using) the hand-written kernel for the whole process."""
    _state["enabled"] = bool(enabled)


def set_avx512(enabled: bool) -> bool:
    """Use the AVX-512 build of the kernels where the CPU has AVX-512 (the default), or the
    AVX2 build everywhere: the same values, for comparing the two. Returns the previous
    setting."""
    previous, _state["avx512"] = _state["avx512"], bool(enabled)
    return previous


def native_width() -> int | None:
    """Float lanes per vector register of the kernels in use: 16 (AVX-512), 8 (AVX2), or None
    where no native kernel can run (builds only the library that is in use)."""
    if not _state["enabled"]:
        return None
    if _wants_avx512() and _build(True) is not None:
        return 16
    return 8 if _build(False) is not None else None


def _wants_avx512() -> bool:
    return _state["avx512"] and _cpu_capability() == "AVX512"


def no_nan_or_posinf(*tensors: Tensor) -> bool:
    """Whether no operand holds NaN or ``+inf``, as every kernel here requires (their max does
    not propagate NaN; ``-inf`` means "no edge"): each operand's maximum is below ``+inf``.
    A float32 CPU tensor whose entries are one block of memory is read by one native loop
    (``semipack_below_inf_f32``, a few microseconds on a message of a small model, where
    torch's reduction and its read back took about 30); any other by that reduction."""
    return all(_below_plus_inf(t) for t in tensors)


def _below_plus_inf(t: Tensor) -> bool:
    if t.numel() == 0:
        return True
    if (
        t.dtype == torch.float32
        and t.is_cpu
        and _state["enabled"]
        and dense_block(t)
        and not torch.compiler.is_compiling()
    ):
        lib = _library()
        if lib is not None:  # entries fill one block from data_ptr (strides are >= 0)
            return bool(lib.semipack_below_inf_f32(t.data_ptr(), t.numel()))
    return bool(t.amax() < _INF)


def native_available() -> bool:
    """Whether :func:`maxplus_f32` can run here (enabled, x86-64 with AVX2, compiler found)."""
    return _state["enabled"] and _library() is not None


def _cache_dir() -> Path:
    configured = os.environ.get("SEMIPACK_CACHE_DIR")
    if configured:
        return Path(configured)
    home = Path.home() / ".cache" / "semipack"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:
        return Path(tempfile.gettempdir()) / "semipack"


def _library() -> ctypes.CDLL | None:
    """The kernels' library for this CPU (AVX-512 where it has it, see :func:`set_avx512`);
    ``None`` where no build can run."""
    if _wants_avx512():
        wide = _build(True)
        if wide is not None:
            return wide
    return _build(False)


@functools.cache
def _cpu_capability() -> str:
    """PyTorch's vector ISA for this CPU ("AVX2", "AVX512", ...), read once."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def _build(avx512: bool) -> ctypes.CDLL | None:
    """Build (once per source version and width) and load the kernels; ``None`` where they
    cannot run."""
    with _building:
        return _build_locked(avx512)


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[bool]:
    """Hold the cache folder's build lock for the block, giving whether it holds it: best
    effort, a file system without locks builds without one (as before the lock: each process
    builds, the atomic rename keeps the library whole)."""
    with open(folder / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            yield False
        else:
            yield True


def _sweep_interrupted_builds(folder: Path) -> None:
    """Remove what an interrupted build left in the cache folder (its objects' folder, a
    partial library): called holding the build lock, so no build is running (trial 133: a
    first build stopped by a signal left its objects there for good)."""
    for left in folder.glob(_BUILD_PREFIX + "*"):
        shutil.rmtree(left, ignore_errors=True)
    for left in folder.glob("kernels-*.partial.so"):
        left.unlink(missing_ok=True)


#: The name of a build's folder of objects in the cache folder (``_compile``).
_BUILD_PREFIX = "build-"


def _compile(compiler: Sequence[str], flags: Sequence[str], out: Path) -> None:
    """Compile the sources into the shared library ``out``: one object per source, as many at
    once as the CPU has cores, then one link. The build runs once per source version (a few
    tens of seconds to minutes, most of it ``depthwise.c``); it says so on stderr, since a
    first call that waits that long in silence looked hung (trial 128)."""
    print(
        f"semipack: building the native kernels for this CPU, once per version (cached in "
        f"{out.parent}); this takes up to a few minutes",
        file=sys.stderr,
        flush=True,
    )
    compile_flags = [f for f in flags if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix=_BUILD_PREFIX, dir=out.parent) as folder:
        objects = [Path(folder) / f"{source.stem}.o" for source in _SOURCES]

        def one(source: Path, obj: Path) -> None:
            command = [*compiler, *compile_flags, "-c", str(source), "-o", str(obj)]
            subprocess.run(command, check=True, capture_output=True, timeout=600)

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            for done in [pool.submit(one, s, o) for s, o in zip(_SOURCES, objects, strict=True)]:
                done.result()  # the first failure raises here
        link = [*compiler, *flags, *map(str, objects), "-o", str(out), "-lm"]
        subprocess.run(link, check=True, capture_output=True, timeout=300)


def _build_locked(avx512: bool) -> ctypes.CDLL | None:
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return None
    if _cpu_capability() not in ("AVX2", "AVX512"):
        return None
    # CC may carry arguments ("ccache gcc", "gcc -O2"), as make reads it (trial 133)
    given = shlex.split(os.environ.get("CC", ""))
    compiler = given or [found for found in (shutil.which("cc") or shutil.which("gcc"),) if found]
    if not compiler:
        return None
    flags = (*_FLAGS, *_AVX512_FLAGS) if avx512 else _FLAGS
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{digest}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # one build at a time per cache folder: processes started together (test workers)
            # wait for the first one's library instead of each building it (trial 133)
            with _build_lock(target.parent) as alone:
                if not target.exists():
                    if alone:  # no other build runs: what is there was interrupted
                        _sweep_interrupted_builds(target.parent)
                    tag = f"{os.getpid()}.{threading.get_ident()}"
                    partial = target.with_name(f"{target.stem}.{tag}.partial.so")
                    _compile(compiler, flags, partial)
                    os.replace(partial, target)  # atomic: the library appears whole
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        instead = "the AVX2 build" if avx512 else "the compiled kernels"
        warnings.warn(
            f"semipack: building the native max-plus kernel{' with AVX-512' * avx512} failed "
            f"({exc}; {detail.decode(errors='replace')[:500]}); using {instead} instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    for name, (result, params) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = _C_TYPES[result] if result is not None else None
        fn.argtypes = [_C_TYPES[code] for code in params]
    return lib


def fingerprint(t: Tensor) -> tuple[int, ...] | None:
    """256 bits that change with any single changed word of a contiguous CPU tensor's memory
    (see fingerprint.c), or None where the native library is not available."""
    lib = _library() if _state["enabled"] else None
    if lib is None or t.device.type != "cpu" or not t.is_contiguous():
        return None
    out = (ctypes.c_uint64 * 4)()
    lib.semipack_fingerprint(t.data_ptr(), t.numel() * t.element_size(), ctypes.addressof(out))
    return tuple(out)


def pack_panels_f32(b: Tensor) -> Tensor:
    """``b`` [K, m] float32 as [panels, K, 16] column panels, ``-inf`` padded: the packed form
    ``maxplus_gather_f32`` reads rows of."""
    return _panels(b[None])[0]


def maxplus_gather_f32(
    a: Tensor, panels: Tensor, rows: Tensor, offset: int, m: int, with_index: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``out[i, j] = max_k a[i, k] + b[offset + rows[k], j]``, float32 [n, m], for ``b`` [K, m]
    packed by :func:`pack_panels_f32` and ``rows`` int64 [k] (``offset + rows`` within K), and
    with ``with_index`` the first k attaining each max (int64 [n, m]; 0 without a finite pair).
    ``a`` [n, k] is read with unit stride along k (made so if it is not). The caller checks that
    neither operand holds NaN or ``+inf``."""
    lib = _library()
    assert lib is not None and a.dtype == panels.dtype == torch.float32
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    if a.stride(-1) != 1:
        a = a.contiguous()
    n, k = a.shape
    if with_index and k >= MAX_INDEX_K:
        raise ValueError(f"maxplus_gather_f32: argmax needs k < 2**24, got {k}")
    out = torch.empty((n, m), dtype=torch.float32, device="cpu")
    index = torch.empty((n, m), dtype=torch.int64, device="cpu") if with_index else None
    lib.semipack_maxplus_gather_f32(
        a.data_ptr(),
        a.stride(0),
        1,
        panels.data_ptr() + offset * PANEL_COLS * panels.element_size(),
        panels.shape[1] * PANEL_COLS,
        rows.data_ptr(),
        out.data_ptr(),
        None if index is None else index.data_ptr(),
        m,
        n,
        k,
        m,
        _threads(n * k * m),
    )
    return out, index


def maxplus_scatter_max_f32(
    a: Tensor,
    panels: Tensor,
    out: Tensor,
    rows: Tensor,
    offset: int,
    ids: Tensor | None = None,
    out_ids: Tensor | None = None,
) -> None:
    """``out[offset + rows[i], j] = max(that, max_k a[i, k] + b[k, j])`` in place, for ``out``
    [R, m] contiguous float32, ``b`` [k, m] packed by :func:`pack_panels_f32` and distinct
    ``offset + rows`` (int64 [n]) within R. With ``ids`` (int64 [n, k]) and ``out_ids`` (int64
    like ``out``), an entry that a strictly larger candidate replaces takes the id of the
    candidate's first argmax k. The caller checks that no operand holds NaN or ``+inf``."""
    lib = _library()
    assert lib is not None and a.dtype == panels.dtype == out.dtype == torch.float32
    assert rows.dtype == torch.int64 and rows.is_contiguous() and out.is_contiguous()
    if a.stride(-1) != 1:
        a = a.contiguous()
    n, k = a.shape
    m = out.shape[1]
    if ids is not None:
        assert out_ids is not None and out_ids.is_contiguous() and out_ids.shape == out.shape
        ids = ids.contiguous()
        if k >= MAX_INDEX_K:
            raise ValueError(f"maxplus_scatter_max_f32: argmax needs k < 2**24, got {k}")
    lib.semipack_maxplus_scatter_max_f32(
        a.data_ptr(),
        a.stride(0),
        1,
        panels.data_ptr(),
        out.data_ptr() + offset * m * out.element_size(),
        rows.data_ptr(),
        m,
        None if ids is None else ids.data_ptr(),
        None if out_ids is None else out_ids.data_ptr() + offset * m * out_ids.element_size(),
        n,
        k,
        m,
        _threads(n * k * m),
    )


def depthwise_f32(
    m: Tensor,
    lw: Tensor,
    lx: Tensor,
    stride: tuple[int, int],
    dilation: tuple[int, int],
    want_input: bool,
    want_weight: bool,
    ids: Tensor | None = None,
    no_successor: int = -1,
    padding: tuple[int, int] = (0, 0),
) -> tuple[tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
    """MaxProd messages of a 2-D depthwise convolution (see depthwise.c): to the padded input,
    ``[B, C, Hp, Wp]``, and to the weight, ``[C * M, KH, KW]``, each as a 1-tuple. ``m``
    [B, C * M, Ho, Wo], ``lw`` [C * M, KH, KW], ``lx`` [B, C, Hp, Wp] (log|x| of the zero-padded
    input), all float32 CPU; the caller checks that none holds NaN or ``+inf``. With ``ids``
    (int64 like ``m``: TopPath's successor ids) each message is (values, ids), the ids of the
    first candidates attaining the maxima (``no_successor`` where an input has none).
    ``padding``: rows and columns on each side of ``lx`` that are the convolution's zero
    padding, no input; their input message is no value to read (MaxProd's stride-1 kernel
    leaves it ``-inf`` without computing it), so the caller crops it. Only the messages asked
    for read their operand: ``lw`` only for the input message, ``lx`` only for the weight
    message; the other counts for its shape alone (an expanded tensor will do)."""
    lib = _library()
    assert lib is not None and m.dtype == lw.dtype == lx.dtype == torch.float32
    m = m.contiguous()
    lw = lw.contiguous() if want_input else lw
    lx = lx.contiguous() if want_weight else lx
    batch, channels, hp, wp = lx.shape
    mult = m.shape[1] // channels
    ho, wo = m.shape[2:]
    kh, kw = lw.shape[1:]
    sizes = (batch, channels, mult, ho, wo, hp, wp, kh, kw, *stride, *dilation)
    threads = _threads(m.numel() * kh * kw * 16)
    to_input = to_weight = None
    if ids is not None:
        ids = ids.expand(m.shape).contiguous()
    # the TopPath kernels take the ids beside the message and give ids beside each result
    with_ids = () if ids is None else (ids.data_ptr(),)
    suffix = "_f32" if ids is None else "_ids_f32"
    if want_input:
        out = _message_buffers((batch, channels, hp, wp), ids is not None)
        kernel = getattr(lib, "semipack_depthwise_input" + suffix)
        tail = () if ids is None else (out[1].data_ptr(), no_successor)
        crop = tuple(padding)
        kernel(
            m.data_ptr(), *with_ids, lw.data_ptr(), out[0].data_ptr(), *tail, *sizes, *crop, threads
        )
        to_input = tuple(out)
    if want_weight:
        out = _message_buffers((channels * mult, kh, kw), ids is not None)
        kernel = getattr(lib, "semipack_depthwise_weight" + suffix)
        tail = () if ids is None else (out[1].data_ptr(),)
        kernel(m.data_ptr(), *with_ids, lx.data_ptr(), out[0].data_ptr(), *tail, *sizes, threads)
        to_weight = tuple(out)
    return to_input, to_weight


def depthwise_input_stride2_f32(
    m: Tensor,
    lw: Tensor,
    shape: Sequence[int],
    padding: tuple[int, int],
    ids: Tensor | None = None,
    no_successor: int = -1,
) -> tuple[Tensor, ...]:
    """MaxProd's input message of a 2-D depthwise convolution of stride 2 and dilation 1, one
    output channel per input channel, straight into the unpadded input's ``shape`` [B, C, H, W]
    (W >= 16) as a 1-tuple; with ``ids`` (TopPath's successor ids, int64 like ``m``), (values,
    ids), ``no_successor`` where an input has no path (depthwise.c). ``m`` [B, C, Ho, Wo], ``lw``
    [C, KH, KW] float32 CPU, without NaN or ``+inf`` (the caller checks); ``padding`` (rows,
    columns) on each side."""
    lib = _library()
    assert lib is not None and m.dtype == lw.dtype == torch.float32
    m, lw = m.contiguous(), lw.contiguous()
    batch, channels, height, width = shape
    (ho, wo), (kh, kw) = m.shape[2:], lw.shape[1:]
    pad_h, pad_w = padding
    out = _message_buffers((batch, channels, height, width), ids is not None)
    if ids is not None:
        ids = ids.expand(m.shape).contiguous()
    lib.semipack_depthwise_input_stride2_f32(
        m.data_ptr(),
        None if ids is None else ids.data_ptr(),
        lw.data_ptr(),
        out[0].data_ptr(),
        None if ids is None else out[1].data_ptr(),
        no_successor,
        batch,
        channels,
        ho,
        wo,
        height + 2 * pad_h,
        width + 2 * pad_w,
        kh,
        kw,
        pad_h,
        pad_w,
        _threads(m.numel() * kh * kw * 16),
    )
    return tuple(out)


def _message_buffers(shape: tuple[int, ...], with_ids: bool) -> list[Tensor]:
    """A kernel's result buffers: float32 values and, for TopPath, int64 successor ids, on the
    CPU whatever the default dtype and device."""
    out = [torch.empty(shape, dtype=torch.float32, device="cpu")]
    if with_ids:
        out.append(torch.empty(shape, dtype=torch.int64, device="cpu"))
    return out


#: Most taps the channels-last kernel takes (its per-position tap list lives on the stack).
CHANNELS_MAX_TAPS = 64


def channels_kernel_fits(m: Tensor, lw: Tensor, planes: int) -> bool:
    """Whether ``depthwise_channels_f32`` takes a depthwise convolution with output message
    ``m`` [B, C * M, Ho, Wo], lifted weight ``lw`` [C * M, KH, KW] over ``planes`` input
    channels: one output channel per input channel, whole vectors of channels, few enough taps
    (at most 8 per kernel row) and positions exact as floats."""
    batch, outputs, ho, wo = m.shape
    kh, kw = lw.shape[1:]
    return (
        outputs == planes
        and planes % 8 == 0
        and kh * kw <= CHANNELS_MAX_TAPS
        and kw <= 8
        and batch * ho * wo < 2**24
    )


def depthwise_channels_f32(
    m: Tensor,
    lw: Tensor,
    lx: Tensor,
    stride: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
    want_input: bool,
    want_weight: bool,
    ids: Tensor | None = None,
    no_successor: int = -1,
) -> tuple[tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
    """``depthwise_f32``'s messages from the channels-last kernel (depthwise_channels.c), which
    vectorises over channels instead of a plane's columns: the kernel for small planes. Same
    operands and results, except that the input message is of the unpadded input
    [B, C, H, W] (``padding`` is taken off ``lx``'s plane). ``channels_kernel_fits`` says
    which convolutions it takes. The channels-last copies in and out are the price: for a
    7 x 7 plane they cost less than the scalar loops the plane kernels take there."""
    lib = _library()
    assert lib is not None and m.dtype == lw.dtype == lx.dtype == torch.float32
    # the kernel reads whole vectors of channels and keeps the taps on its stack
    assert channels_kernel_fits(m, lw, lx.shape[1]), "outside the channels-last kernel's range"
    batch, channels, ho, wo = m.shape
    kh, kw = lw.shape[1:]
    hp, wp = lx.shape[2:]
    ph, pw = padding
    last = (0, 2, 3, 1)
    m_last = m.permute(last).contiguous()
    ids_last = None if ids is None else ids.expand(m.shape).permute(last).contiguous()
    ids_ptr = None if ids_last is None else ids_last.data_ptr()
    geometry = (kh, kw, *stride, *dilation)
    threads = _threads(m.numel() * kh * kw * 16)
    to_input = to_weight = None
    if want_input:
        height, width = hp - 2 * ph, wp - 2 * pw
        out = _message_buffers((batch, height, width, channels), ids is not None)
        lw_last = lw.permute(1, 2, 0).contiguous()  # held: the kernel reads its memory
        lib.semipack_depthwise_channels_input_f32(
            m_last.data_ptr(), ids_ptr, lw_last.data_ptr(),
            out[0].data_ptr(), out[1].data_ptr() if ids is not None else None, no_successor,
            batch, channels, ho, wo, height, width, *geometry, ph, pw, threads,
        )  # fmt: skip
        to_input = tuple(t.permute(0, 3, 1, 2).contiguous() for t in out)
    if want_weight:
        out = _message_buffers((kh, kw, channels), ids is not None)
        lx_last = lx.permute(last).contiguous()
        lib.semipack_depthwise_channels_weight_f32(
            m_last.data_ptr(), ids_ptr, lx_last.data_ptr(),
            out[0].data_ptr(), out[1].data_ptr() if ids is not None else None,
            batch, channels, ho, wo, hp, wp, *geometry, threads,
        )  # fmt: skip
        to_weight = tuple(t.permute(2, 0, 1).contiguous() for t in out)
    return to_input, to_weight


def _threads(pairs: int) -> int:
    return torch.get_num_threads() if pairs >= THREADED_MIN_PAIRS else 1


#: Below this many entries one thread runs an elementwise loop (``exp_f32``, ``log_plus_f32``):
#: waking the other threads costs more than the few microseconds the loop takes.
ELEMENTWISE_THREADED_MIN = 1 << 16


def _elementwise_threads(entries: int) -> int:
    return torch.get_num_threads() if entries >= ELEMENTWISE_THREADED_MIN else 1


def exp_f32(x: Tensor, out: Tensor, shift: float = 0.0) -> Tensor:
    """``out = exp(x - shift)`` over two 1-D contiguous float32 CPU tensors of one size (``out``
    may be ``x``; ``shift`` a float32 number, subtracted as torch's ``x - shift``), within one
    ulp, subnormal results kept, specials as torch's (elementwise.c)."""
    lib = _library()
    assert lib is not None and x.dtype == out.dtype == torch.float32
    assert x.dim() == out.dim() == 1 and x.is_contiguous() and out.is_contiguous()
    assert x.numel() == out.numel() and x.device.type == out.device.type == "cpu"
    lib.semipack_exp_f32(
        x.data_ptr(), out.data_ptr(), x.numel(), shift, _elementwise_threads(x.numel())
    )
    return out


def exp_block_f32(x: Tensor, out: Tensor) -> None:
    """``out = exp(x)`` over the memory of two float32 CPU tensors of one shape and strides
    whose entries are one dense block (any order of dims; ``out`` may be ``x``). No checks:
    the caller (``kernels.logspace``) has made them, so that a tensor of a few entries pays a
    ctypes call and not the checked wrappers' tens of microseconds."""
    n = x.numel()
    _library().semipack_exp_f32(x.data_ptr(), out.data_ptr(), n, 0.0, _elementwise_threads(n))


def log_block_f32(mag: Tensor, shift: Tensor | None = None) -> None:
    """``mag = log(mag)`` (``+ shift``, one float32 CPU entry, where given) in place over the
    memory of a float32 CPU tensor whose entries are one dense block, unchecked as
    ``exp_block_f32`` (the checked ``log_plus_f32`` and its flat views cost 20-40 us a call,
    a hundred calls in a small model's LogSum pass)."""
    n = mag.numel()
    _library().semipack_log_plus_f32(
        mag.data_ptr(),
        None if shift is None else shift.data_ptr(),
        1,
        n,
        0,
        0,
        _elementwise_threads(n),
    )


def max_affine_f32(m: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> tuple[Tensor, Tensor]:
    """MaxProd's per-channel (gain, bias) messages of an affine map: ``max (m + log|x̂|)`` and
    ``max m`` over dims 0 and 2 of contiguous float32 CPU ``m``, ``x`` [A, C, B], with
    ``x̂ = (x - mean) * invstd`` and ``mean``, ``invstd`` [C] (``kernels/affine_params.py``
    ``max_plus``'s values: NaN and infinities as torch's amax gives them; elementwise.c).
    Returns two [C] float32 tensors."""
    lib = _library()
    assert lib is not None and m.shape == x.shape and m.dim() == 3
    outer, channels, inner = x.shape
    mean, invstd = (t.to(torch.float32).reshape(channels).contiguous() for t in (mean, invstd))
    gain = torch.empty(channels, dtype=torch.float32)
    bias = torch.empty(channels, dtype=torch.float32)
    lib.semipack_max_affine_f32(
        m.data_ptr(),
        x.data_ptr(),
        mean.data_ptr(),
        invstd.data_ptr(),
        outer,
        channels,
        inner,
        gain.data_ptr(),
        bias.data_ptr(),
        _elementwise_threads(x.numel()),
    )
    return gain, bias


def norm_readout_block_f32(
    kind: int, a: Tensor, shift: Tensor, x_hat: Tensor, total: Tensor, out: Tensor
) -> None:
    """A normalisation's MaxProd (``kind`` 0) or LogSum (1) readout of its row sums over
    contiguous [rows, n] float32 tensors and ``shift`` [rows, 1] (log_space.c); unchecked."""
    rows, n = a.shape
    _library().semipack_norm_readout_f32(
        kind,
        a.data_ptr(),
        shift.data_ptr(),
        x_hat.data_ptr(),
        total.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        _elementwise_threads(a.numel()),
    )


def entropy_rows_block_f32(
    log_z: Tensor, surprisal: Tensor, a: Tensor, shift: Tensor, r: Tensor
) -> None:
    """Entropy's shifted row masses ``a``, their shifts [rows, 1] and the surprisal where they
    have mass ``r``, over contiguous [rows, n] float32 tensors (log_space.c); unchecked."""
    rows, n = log_z.shape
    _library().semipack_entropy_rows_f32(
        log_z.data_ptr(),
        surprisal.data_ptr(),
        a.data_ptr(),
        shift.data_ptr(),
        r.data_ptr(),
        rows,
        n,
        _elementwise_threads(log_z.numel()),
    )


def entropy_readout_of_sums_block_f32(
    a: Tensor,
    r: Tensor,
    shift: Tensor,
    x_hat: Tensor,
    sums: tuple[Tensor, Tensor, Tensor],
    log_n: float,
    log_z: Tensor,
    mean: Tensor,
) -> None:
    """Entropy's (log Z, mean surprisal) from a normalisation's native row sums, over
    contiguous [rows, n] float32 tensors and ``shift`` [rows, 1] (log_space.c); unchecked."""
    rows, n = a.shape
    s_c, t_c, u_c = sums
    _library().semipack_entropy_readout_of_sums_f32(
        a.data_ptr(),
        r.data_ptr(),
        shift.data_ptr(),
        x_hat.data_ptr(),
        s_c.data_ptr(),
        t_c.data_ptr(),
        u_c.data_ptr(),
        log_n,
        log_z.data_ptr(),
        mean.data_ptr(),
        rows,
        n,
        _elementwise_threads(a.numel()),
    )


def affine_log_sums_f32(
    m: Tensor, r: Tensor | None, x: Tensor, mean: Tensor, invstd: Tensor, floor: float
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """LogSum's (``r`` None) or Entropy's per-channel (gain, bias) states of an affine map and
    the channels to recompute (``kernels/affine_params.py`` ``log_sum`` and ``entropy``; see
    log_space.c): contiguous float32 CPU ``m``, ``r``, ``x`` [A, C, B], ``mean`` and ``invstd``
    [C] entries. Returns ([C] states: (log,) or (log, mean surprisal)) and a [C] bool tensor."""
    lib = _library()
    assert lib is not None and m.shape == x.shape and m.dim() == 3
    assert r is None or r.shape == x.shape
    outer, channels, inner = x.shape
    mean, invstd = (t.to(torch.float32).reshape(channels).contiguous() for t in (mean, invstd))
    gain_log, bias_log, gain_mean, bias_mean = (
        torch.empty(channels, dtype=torch.float32) for _ in range(4)
    )
    recompute = torch.empty(channels, dtype=torch.bool)
    lib.semipack_affine_log_sums_f32(
        m.data_ptr(),
        None if r is None else r.data_ptr(),
        x.data_ptr(),
        mean.data_ptr(),
        invstd.data_ptr(),
        outer,
        channels,
        inner,
        floor,
        gain_log.data_ptr(),
        bias_log.data_ptr(),
        gain_mean.data_ptr(),
        bias_mean.data_ptr(),
        recompute.data_ptr(),
        _elementwise_threads(x.numel()),
    )
    if r is None:
        return (gain_log,), (bias_log,), recompute
    return (gain_log, gain_mean), (bias_log, bias_mean), recompute


def cut_below_f32(part: Tensor, x: Tensor, out: Tensor, threshold: float, zero: float) -> None:
    """``out = where(x <= threshold, zero, part)`` over three 1-D contiguous float32 CPU
    tensors of one size (``out`` may be ``part``); NaN in ``x`` keeps ``part`` (elementwise.c).
    ``threshold`` and ``zero`` are float32 numbers (a ReLU's threshold, the semiring's zero)."""
    lib = _library()
    assert lib is not None and part.dtype == x.dtype == out.dtype == torch.float32
    assert part.dim() == x.dim() == out.dim() == 1
    assert part.is_contiguous() and x.is_contiguous() and out.is_contiguous()
    assert part.numel() == x.numel() == out.numel()
    assert part.device.type == x.device.type == out.device.type == "cpu"
    n = part.numel()
    lib.semipack_cut_below_f32(
        part.data_ptr(), x.data_ptr(), out.data_ptr(), n, threshold, zero, _elementwise_threads(n)
    )


# --- log_space.c: Entropy's and LogSum's elementwise steps. Unchecked, as ``exp_block_f32``:
# every tensor is float32 on the CPU, of one shape and strides, its entries one dense block
# (``kernels.log_space_native`` checks that once per call).
def abs_xlogx_block_f32(w: Tensor, mag: Tensor | None, out: Tensor, negate: bool) -> None:
    """``mag = |w|`` and ``out = ±xlogx(|w|)`` (0 log 0 = 0, 0 at NaN; negated: ``-xlogx``);
    without ``mag``, ``out = xlogx(w)`` of magnitudes ``w``."""
    n = w.numel()
    _library().semipack_abs_xlogx_f32(
        w.data_ptr(),
        None if mag is None else mag.data_ptr(),
        out.data_ptr(),
        n,
        int(negate),
        _elementwise_threads(n),
    )


def entropy_mean_block_f32(total: Tensor, weighted: Tensor, less: Tensor, per_entry: bool) -> None:
    """``weighted = (weighted - less) / total`` where ``total > 0``, else 0 (``less``: one
    entry per entry of ``total``, or with ``per_entry`` False one for all)."""
    n = total.numel()
    _library().semipack_entropy_mean_f32(
        total.data_ptr(),
        weighted.data_ptr(),
        less.data_ptr(),
        int(per_entry),
        n,
        _elementwise_threads(n),
    )


def entropy_readout_block_f32(log_z: Tensor, mean: Tensor, out: Tensor) -> None:
    """``out = log_z + mean`` where ``log_z`` is finite, else NaN (``out`` may be either)."""
    n = log_z.numel()
    _library().semipack_entropy_readout_f32(
        log_z.data_ptr(), mean.data_ptr(), out.data_ptr(), n, _elementwise_threads(n)
    )


def log_add_exp_block_f32(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = log(e^a + e^b)`` in the fused form's terms (``logspace.fused_log_add_exp``)."""
    n = a.numel()
    _library().semipack_log_add_exp_f32(
        a.data_ptr(), b.data_ptr(), out.data_ptr(), n, _elementwise_threads(n)
    )


def entropy_plus_block_f32(
    log_a: Tensor, r_a: Tensor, log_b: Tensor, r_b: Tensor, log_z: Tensor, r: Tensor
) -> None:
    """Entropy's plus of (log_a, r_a) and (log_b, r_b) into (log_z, r)."""
    n = log_a.numel()
    _library().semipack_entropy_plus_f32(
        log_a.data_ptr(),
        r_a.data_ptr(),
        log_b.data_ptr(),
        r_b.data_ptr(),
        log_z.data_ptr(),
        r.data_ptr(),
        n,
        _elementwise_threads(n),
    )


def nonzero_abs_min_block_f32(x: Tensor) -> float:
    """The smallest non-zero ``|x|`` (``inf`` where none, NaN where ``x`` holds NaN)."""
    return _library().semipack_nonzero_abs_min_f32(x.data_ptr(), x.numel())


def best_entries_f32(units: Tensor) -> tuple[int, float, int]:
    """Of a contiguous float32 CPU ``units`` [U, S] (S > 0): the flat index of the first largest
    entry (a NaN counting as largest, as ``torch.argmax``), that entry, and how many units hold
    only ``-inf`` (summaries.c)."""
    at, top, dead = ctypes.c_int64(), ctypes.c_float(), ctypes.c_int64()
    _library().semipack_best_entries_f32(
        units.data_ptr(),
        units.shape[0],
        units.shape[1],
        ctypes.addressof(at),
        ctypes.addressof(top),
        ctypes.addressof(dead),
        _elementwise_threads(units.numel()),
    )
    return at.value, top.value, dead.value


def log_sum_exp_f32(x: Tensor) -> float:
    """``log Σ exp`` over the entries of a float32 CPU tensor that fill one block, shifted by
    the largest (the sum in float64); the largest where it is infinite, NaN at a NaN."""
    return _library().semipack_log_sum_exp_f32(
        x.data_ptr(), x.numel(), _elementwise_threads(x.numel())
    )


def number_stats_f32(x: Tensor) -> tuple[int, float, float]:
    """How many entries of a float32 CPU tensor that fill one block are not NaN, their sum in
    float64 (infinities included) and the largest of them (``-inf`` where none)."""
    count, total, top = ctypes.c_int64(), ctypes.c_double(), ctypes.c_float()
    _library().semipack_number_stats_f32(
        x.data_ptr(),
        x.numel(),
        ctypes.addressof(count),
        ctypes.addressof(total),
        ctypes.addressof(top),
        _elementwise_threads(x.numel()),
    )
    return count.value, total.value, top.value


#: The derivatives ``sign_changing_log_derivative_f32`` knows (log_derivatives.c's KIND_*).
SIGN_CHANGING_KINDS = {"gelu": 0, "silu": 1}


def sign_changing_log_derivative_f32(
    kind: str,
    x: Tensor,
    out: Tensor,
    near: Tensor,
    root: tuple[float, float],
    window: float,
    signs: bool,
    mills: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(log|d(x)|, sign)`` of GELU's or SiLU's derivative (``kind``) by one native loop
    (log_derivatives.c), the log written into ``out``. For GELU ``out`` must hold erf(x / sqrt
    2) on entry (torch's erf, computed by the caller) and ``mills`` the Mills ratio's Chebyshev
    coefficients; SiLU reads neither.

    ``x``, ``out``: contiguous float32 CPU tensors of one shape; ``near``: the bracket's
    polynomial near its root (constant first), float32 [k] with k <= 32 (as ``mills``);
    ``root``: (hi, lo), the root split in two floats; ``window``: the half-width around it where
    the polynomial is used. The sign (+1, -1, or 0 for a zero or NaN value, as torch.sign) only
    with ``signs``."""
    lib = _library()
    code = SIGN_CHANGING_KINDS[kind]
    assert lib is not None and x.dtype == out.dtype == torch.float32
    assert x.shape == out.shape and x.is_contiguous() and out.is_contiguous()
    assert x.device.type == out.device.type == "cpu"
    assert near.dtype == torch.float32 and near.is_contiguous() and 0 < near.numel() <= 32
    if kind == "gelu":
        assert mills is not None and mills.dtype == torch.float32 and mills.is_contiguous()
        assert 0 < mills.numel() <= 32
    sign = torch.empty_like(x) if signs else None
    n = x.numel()
    lib.semipack_sign_changing_log_derivative_f32(
        code,
        x.data_ptr(),
        out.data_ptr() if kind == "gelu" else None,
        out.data_ptr(),
        sign.data_ptr() if sign is not None else None,
        n,
        near.data_ptr(),
        near.numel(),
        mills.data_ptr() if mills is not None else None,
        mills.numel() if mills is not None else 0,
        root[0],
        root[1],
        window,
        _elementwise_threads(n),
    )
    return out, sign


def log_plus_f32(mag: Tensor, shift: Tensor | None) -> Tensor:
    """``mag = log(mag) + shift`` in place, ``mag`` a contiguous float32 CPU tensor [rows, cols]
    of magnitudes (>= 0 or NaN; log 0 = -inf), ``shift`` None, one entry, [rows, 1] or
    [rows, cols] contiguous float32; the log within one ulp (elementwise.c)."""
    lib = _library()
    assert lib is not None and mag.dtype == torch.float32 and mag.dim() == 2
    assert mag.is_contiguous() and mag.device.type == "cpu"
    rows, cols = mag.shape
    strides = (0, 0)
    if shift is not None:
        assert shift.dtype == torch.float32 and shift.is_contiguous()
        assert shift.device.type == "cpu"
        if shift.numel() != 1:
            strides = (1, 0) if tuple(shift.shape) == (rows, 1) else (cols, 1)
            assert tuple(shift.shape) in ((rows, 1), (rows, cols))
    lib.semipack_log_plus_f32(
        mag.data_ptr(),
        None if shift is None else shift.data_ptr(),
        rows,
        cols,
        *strides,
        _elementwise_threads(mag.numel()),
    )
    return mag


def _panels(b: Tensor) -> Tensor:
    """``b`` [S, k, m] (any strides) as [S, panels, k, 16] column panels, ``-inf`` padded."""
    s, k, m = b.shape
    panels = torch.empty((s, -(-m // PANEL_COLS), k, PANEL_COLS), dtype=torch.float32, device="cpu")
    lib = _library()
    assert lib is not None
    lib.semipack_pack_panels_f32(
        b.data_ptr(), *b.stride(), panels.data_ptr(), s, k, m, _threads(s * k * m * 64)
    )
    return panels


def computed(t: Tensor, kind: str, make: Callable[[], T]) -> T:
    """The default ``memo`` of the kernels below: ``make()``, computed now."""
    return make()


def maxplus_f32(
    a: Tensor, b: Tensor, with_index: bool, memo: Memo = computed
) -> tuple[Tensor, Tensor | None]:
    """``out[s, i, j] = max_k a[s, i, k] + b[s, k, j]``, float32 CPU tensors [S, n, k], [S, k, m].

    ``a`` is made contiguous along ``k`` if it is not; ``b`` is packed into 16-column panels (a
    copy the size of ``b``), through ``memo(b, "panels", make)``: a caller that keeps forms of
    a weight's ``log|W|`` across passes (``kernels.weight_cache``) packs it once.
    The caller checks :func:`native_available` and that no input holds NaN or ``+inf``.
    """
    lib = _library()
    assert lib is not None and a.dtype == b.dtype == torch.float32
    if b.shape[2] < PANEL_COLS < a.shape[1]:  # few columns would leave panel lanes idle:
        values, index = maxplus_f32(b.transpose(1, 2), a.transpose(1, 2), with_index, memo)
        values = values.transpose(1, 2).contiguous()
        return values, None if index is None else index.transpose(1, 2).contiguous()
    if a.stride(-1) != 1:  # strided broadcasts ran up to 1.7x slower than one O(n k) copy
        a = a.contiguous()
    s, n, k = a.shape
    m = b.shape[2]
    if with_index and k >= MAX_INDEX_K:
        raise ValueError(f"maxplus_f32: argmax needs k < 2**24, got {k}")
    panels = memo(b, "panels", lambda: _panels(b))
    out = torch.empty((s, n, m), dtype=torch.float32, device="cpu")
    index = torch.empty((s, n, m), dtype=torch.int64, device="cpu") if with_index else None
    lib.semipack_maxplus_f32(
        a.data_ptr(),
        *a.stride(),
        panels.data_ptr(),
        out.data_ptr(),
        index.data_ptr() if index is not None else None,
        out.stride(0),
        out.stride(1),
        s,
        n,
        k,
        m,
        _threads(s * n * k * m),
    )
    return out, index


def maxplus_pruned_counts_f32(
    a: Tensor, b: Tensor, bmax: Tensor, top: int = PRUNE_TOP
) -> tuple[int, int]:
    """The candidates :func:`maxplus_pruned_f32` would keep for ``a`` [n, k] against ``b``
    [k, m] (any strides; ``bmax`` [k] its row maxima): (phase 2, phase 1), summed over the rows,
    without computing the product. The same bounds, candidates and pair sums as the kernel, so
    the phase-2 count equals the kernel's. For choosing between the pruned and the dense kernel
    from a few sampled rows (``tropical.kept_fraction``). The caller checks that neither
    operand holds NaN or ``+inf``."""
    lib = _library()
    assert lib is not None and a.dtype == b.dtype == bmax.dtype == torch.float32
    if a.stride(-1) != 1:
        a = a.contiguous()
    bmax = bmax.contiguous()
    n, k = a.shape
    counts = (ctypes.c_int64 * 2)()
    failed = lib.semipack_maxplus_pruned_count_f32(
        a.data_ptr(),
        a.stride(0),
        b.data_ptr(),
        b.stride(0),
        b.stride(1),
        bmax.data_ptr(),
        n,
        k,
        b.shape[1],
        top,
        ctypes.addressof(counts),
    )
    if failed:
        raise MemoryError("maxplus_pruned_counts_f32: the kernel could not allocate its buffers")
    return int(counts[0]), int(counts[1])


def maxplus_pruned_f32(
    a: Tensor, b: Tensor, with_index: bool, top: int = PRUNE_TOP, memo: Memo = computed
) -> tuple[Tensor, Tensor | None, int]:
    """``maxplus_f32`` of one [n, k] x [k, m] product from the pairs that can still win.

    Same values and argmax as the dense kernel (the C source explains the bound); the speed
    depends on the data. Also returns how many (row, k) candidates survived the pruning.
    ``b``'s panels and row maxima come through ``memo`` (see :func:`maxplus_f32`).
    """
    lib = _library()
    assert lib is not None and a.dtype == b.dtype == torch.float32
    n, k = a.shape
    m = b.shape[1]
    if with_index and k >= MAX_INDEX_K:
        raise ValueError(f"maxplus_pruned_f32: argmax needs k < 2**24, got {k}")
    a = a.contiguous()
    panels = memo(b, "panels", lambda: _panels(b[None])[0])
    bound = memo(b, "row_max", lambda: b.amax(1).contiguous())
    out = torch.empty((n, m), dtype=torch.float32, device="cpu")
    index = torch.empty((n, m), dtype=torch.int64, device="cpu") if with_index else None
    kept = lib.semipack_maxplus_pruned_f32(
        a.data_ptr(),
        a.stride(0),
        bound.data_ptr(),
        panels.data_ptr(),
        out.data_ptr(),
        index.data_ptr() if index is not None else None,
        out.stride(0),
        n,
        k,
        m,
        top,
        _threads(n * k * m),
    )
    if kept < 0:
        raise MemoryError("maxplus_pruned_f32: the kernel could not allocate its work buffers")
    return out, index, kept


def norm_entropy_sums_f32(a: Tensor, r: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row and output j: ``S = Σ_i a_i c_ij``, ``T = Σ_i a_i c_ij r_i`` and
    ``U = Σ_i a_i c_ij log c_ij`` with ``c_ij = |1 + x̂_i x̂_j|``, for [rows, n] float32 inputs
    (the O(n²) part of Entropy messages through layer/batch norm; see normalization.c)."""
    lib = _library()
    assert lib is not None
    a, r, x_hat = (t.to(torch.float32).contiguous() for t in (a, r, x_hat))
    rows, n = x_hat.shape
    s, t, u = (torch.empty((rows, n), dtype=torch.float32, device="cpu") for _ in range(3))
    status = lib.semipack_norm_entropy_sums_f32(
        a.data_ptr(),
        r.data_ptr(),
        x_hat.data_ptr(),
        rows,
        n,
        s.data_ptr(),
        t.data_ptr(),
        u.data_ptr(),
        _threads(rows * n * n * 8),
    )
    if status != 0:
        raise MemoryError("norm_entropy_sums_f32: the kernel could not allocate its work buffers")
    return s, t, u


def norm_abs_reduce_f32(a: Tensor, x_hat: Tensor, reduce_max: bool) -> Tensor:
    """Per row and output j: ``Σ_i a_i c_ij`` (or ``max_i`` with ``reduce_max``), with
    ``c_ij = |1 + x̂_i x̂_j|``, for [rows, n] float32 inputs (LogSum's and MaxProd's O(n²) part
    through layer/batch norm; see normalization.c). ``a`` must be >= 0 for the max."""
    lib = _library()
    assert lib is not None
    a, x_hat = (t.to(torch.float32).contiguous() for t in (a, x_hat))
    rows, n = x_hat.shape
    out = torch.empty((rows, n), dtype=torch.float32, device="cpu")
    lib.semipack_norm_abs_reduce_f32(
        a.data_ptr(),
        x_hat.data_ptr(),
        rows,
        n,
        out.data_ptr(),
        int(reduce_max),
        _threads(rows * n * n),
    )
    return out


def norm_sorted_max_f32(
    a: Tensor, x_hat: Tensor, with_index: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``norm_abs_reduce_f32(a, x_hat, reduce_max=True)`` in O(n log n) per row: two upper
    envelopes of the lines ``±(a_i + a_i x̂_i t)`` evaluated at the sorted ``t = x̂_j`` (see
    normalization_sorted.c). [rows, n] float32 inputs, ``a >= 0``; values within float32 rounding
    of the all-pairs kernel's (the products are formed in double). With ``with_index`` also an
    i attaining each maximum ([rows, n] int64; -1 where every term is 0; among exact ties any)."""
    lib = _library()
    assert lib is not None
    a, x_hat = (t.to(torch.float32).contiguous() for t in (a, x_hat))
    rows, n = x_hat.shape
    out = torch.empty((rows, n), dtype=torch.float32, device="cpu")
    index = torch.empty((rows, n), dtype=torch.int64, device="cpu") if with_index else None
    status = lib.semipack_norm_sorted_max_f32(
        a.data_ptr(),
        x_hat.data_ptr(),
        rows,
        n,
        out.data_ptr(),
        index.data_ptr() if index is not None else None,
        _threads(rows * n * 64),
    )
    if status != 0:
        raise MemoryError("norm_sorted_max_f32: the kernel could not allocate its work buffers")
    return out, index


def norm_sorted_sums_f32(
    a: Tensor, x_hat: Tensor, r: Tensor | None = None, with_log: bool = False
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``S = Σ_i a_i c_ij`` (LogSum's part, ``norm_abs_reduce_f32`` with a sum), and with ``r``
    also ``T = Σ_i a_i c_ij r_i`` and with ``with_log`` ``U = Σ_i a_i c_ij log c_ij``
    (``norm_entropy_sums_f32``'s three sums), ``c_ij = |1 + x̂_i x̂_j|``, in O(n log n) per row:
    prefix sums over the sorted x̂ for S and T, a tree with series far fields for U (see
    normalization_sorted.c for the error bounds). [rows, n] float32 inputs with ``a >= 0``."""
    lib = _library()
    assert lib is not None
    a, x_hat = (t.to(torch.float32).contiguous() for t in (a, x_hat))
    rows, n = x_hat.shape
    r = r.to(torch.float32).contiguous() if r is not None else None
    s = torch.empty((rows, n), dtype=torch.float32, device="cpu")
    t = torch.empty((rows, n), dtype=torch.float32, device="cpu") if r is not None else None
    u = torch.empty((rows, n), dtype=torch.float32, device="cpu") if with_log else None
    status = lib.semipack_norm_sorted_sums_f32(
        a.data_ptr(),
        r.data_ptr() if r is not None else None,
        x_hat.data_ptr(),
        rows,
        n,
        s.data_ptr(),
        t.data_ptr() if t is not None else None,
        u.data_ptr() if u is not None else None,
        _threads(rows * n * (256 if with_log else 16)),
    )
    if status != 0:
        raise MemoryError("norm_sorted_sums_f32: the kernel could not allocate its work buffers")
    return s, t, u


def softmax_log_sum_f32(m: Tensor, log_probs: Tensor) -> Tensor:
    """LogSum messages through softmax rows: ``out_j = log Σ_i exp(m_i) |p_i (δ_ij - p_j)|``
    with ``p = exp(log_probs)``, for [rows, n] float32 inputs without NaN (see softmax.c).
    The probabilities enter as logarithms, so one that underflows float32 still has its edges."""
    lib = _library()
    assert lib is not None
    m, log_probs = (t.to(torch.float32).contiguous() for t in (m, log_probs))
    rows, n = log_probs.shape
    out = torch.empty((rows, n), dtype=torch.float32, device="cpu")
    status = lib.semipack_softmax_log_sum_f32(
        m.data_ptr(), log_probs.data_ptr(), rows, n, out.data_ptr(), _threads(rows * n * 64)
    )
    if status != 0:
        raise MemoryError("softmax_log_sum_f32: the kernel could not allocate its work buffers")
    return out
