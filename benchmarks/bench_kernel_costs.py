"""The single-operation costs that semipack's speed work rests on, measured on this machine.

    OMP_NUM_THREADS=1 python benchmarks/bench_kernel_costs.py [--repeats 15] [--only SECTION ...]

Each line is a median of ``--repeats`` timed runs (after a warm-up) on one thread:

* PyTorch's ``log`` of 430k entries without zeros, with half of them exact zeros (a ReLU
  network's activations), and ``log_magnitude_`` on the half-zero tensor (the same bits);
* ``torch.where`` on a boolean mask against ``finite_or_zero``'s float op (the same bits);
* torch's exp and log on 2M entries, ordinary ones, half of them -inf (or 0 for the log) and
  all of them with subnormal exponentials, against ``exp_`` and ``log_magnitude_``
  (``SPECIAL_SAFE_MIN_ELEMENTS``) compiled and by the native float32 loops;
* the weight fingerprint's read speed (``kernels/native/fingerprint.c``) on 40 MB, and for one
  MiniLM feed-forward weight (384 x 1536): its fingerprint, its log|W| and its max-plus product
  with a 20-token message (what the weight cache saves on one sentence);
* Entropy's readout of 7.7k and 147k entries as eager ops and as the fused kernel (where
  ``FUSED_MIN_ELEMENTS`` sits);
* LogSum's plus (``torch.logaddexp``, whose CPU kernel has a scalar log1p) against the fused
  ``log_add_exp``, on one BERT layer's residual state (8 x 128 x 768);
* Entropy's message toward a weight in three sums against two (``stacked_sums``): ResNet-18's
  3x3 convolutions and MiniLM's linear layers on a 20-token sentence;
* ReLU's cut of a log-space message (ResNet-18's stem, 2 x 64 x 112 x 112): ``torch.where`` on
  the bool mask against the rule's ``threshold_backward`` and infinite offset (same bits);
* a fresh 30522 x 384 zero table (MiniLM's vocabulary) against filling one that exists: the
  cost of first touching fresh pages, which the readout reuse avoids;
* the max-plus kernels of one ResNet-18 layer1 convolution tap (batch 2, 64 -> 64 channels,
  56 x 56) through the row table of ``_MaxPlusTaps``: its weight message (gather) and its input
  message (scatter-max), values alone (MaxProd) and with the first argmax (TopPath), in pairs
  per second;
* the native depthwise kernels (``kernels/native/depthwise.c``) on depthwise layers of 96
  channels, batch 2, 3x3 and 5x5 kernels with "same" padding, on 56 x 56 and 14 x 14 planes:
  the input and weight messages, MaxProd and TopPath, in the same pairs per second as the tap
  product above (the issue's "not slower per multiply-add than the dense one");
* both messages of stride-2 depthwise layers (MobileNetV3-small's 16 @ 112 x 112 and
  72 @ 56 x 56 3x3 layers, a 96 @ 28 x 28 5x5 one, batch 2), MaxProd and TopPath, by phases
  (``rules/depthwise.py``: for the input message four stride-1 problems and a strided copy
  each, for the weight message two column copies and two calls) against one kernel call, in
  turns, CPU milliseconds and pairs per second (``--only stride_two``);
* MobileNetV3-small's depthwise layers and two image stems (3 input channels) through the
  convolution rule's entry (``rules/depthwise.py`` since 2026-11-26: phases for strided layers,
  the channels-last kernel for planes under 8 columns, stems as depthwise layers with a
  channel multiplier; lifts and copies included), MaxProd and TopPath, in CPU milliseconds
  and pairs per second (the same script runs on earlier trees for an A/B);
* the max-plus products of one BERT-base layer's MaxProd backward with their real messages,
  through the dispatch that picks the pruned or the dense kernel (``--only bert_products``);
* grouped 3x3 convolutions (128 channels in 32, 16 or 8 groups, and dense): MaxProd's and
  TopPath's extra CPU time per multiply-add through the depthwise kernels with a channel
  multiplier against the per-tap products, in turns (``--only grouped``);
* the normalisation rows' pair reductions (``kernels/native/normalization.c`` visiting every
  pair, ``normalization_sorted.c`` over sorted rows) on a layer norm's rows of MiniLM's and
  BERT's widths (1024 x 384, 1024 x 768) and on train-mode batch-norm channels (8 x 8192):
  LogSum's sums, Entropy's three sums and MaxProd's maxima, all pairs against sorted
  (``--only norm_rows``; where ``SORTED_MIN_ENTRIES`` and its siblings sit);
* MaxProd's gain and bias messages of an eval batch norm at MobileNetV3-small's shapes, the
  compiled reduction against the native loop (``--only affine_max``);
* an extension's regular gradient of one call, an engine run against calling its nodes
  (``--only regular_grads``; ``extensions/direct_backward.py``);
* the fixed cost per autograd node: a backward through 100 small nodes of one kind, plain,
  carrying a minimal tensor subclass (the floor of any message that travels through autograd
  as a subclass) and under ``semipack.extend`` with MaxProd (``--only node_costs``);
* one 5x5 depthwise layer of 96 channels (MobileNet-like, 14 x 14, batch 2): MaxProd backward
  over a plain one in CPU time, with the native depthwise kernel and with it switched off
  (medians of ``--repeats`` backward passes, each after an untimed forward), and MaxProd's
  extra time per multiply-add of the whole layer there against a dense 3x3 convolution of 96
  channels (a layer with 25 multiply-adds per output pays its per-node costs over few of them).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import interleaved
from torch import nn

import semipack
import semipack.rules.convolution as convolution
from semipack.extensions.direct_backward import direct_grads
from semipack.kernels import logspace, tropical
from semipack.kernels.logspace import exp_, finite_or_zero, log_add_exp, log_magnitude_
from semipack.kernels.native import (
    _panels,
    depthwise_f32,
    exp_f32,
    fingerprint,
    max_affine_f32,
    maxplus_f32,
    maxplus_gather_f32,
    maxplus_scatter_max_f32,
    native_available,
    norm_abs_reduce_f32,
    norm_entropy_sums_f32,
    norm_sorted_max_f32,
    norm_sorted_sums_f32,
    pack_panels_f32,
)
from semipack.kernels.tropical import maxplus
from semipack.messages.normalization import compiled_affine_params
from semipack.messages.windows import ConvGeometry
from semipack.rules.pointwise import _ReluCut
from semipack.semirings._log import log_abs
from semipack.semirings.entropy import _entropy_readout


def median_ms(fn: Callable[[], object], repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def elementwise(repeats: int) -> None:
    torch.manual_seed(0)
    x = torch.rand(430_592) + 0.1
    half_zero = x.clone()
    half_zero[torch.rand(x.shape) < 0.5] = 0.0  # at random places, as after a ReLU
    print("log of 430k entries (ms):")
    print(f"  no zeros               {median_ms(lambda: x.log(), repeats):7.3f}")
    print(f"  half exact zeros       {median_ms(lambda: half_zero.log(), repeats):7.3f}")
    normal = median_ms(lambda: log_magnitude_(x.clone()), repeats)
    print(f"  no zeros, zero-safe    {normal:7.3f}  (log_magnitude_, clone included)")
    zero_safe = median_ms(lambda: log_magnitude_(half_zero.clone()), repeats)
    print(f"  half zeros, zero-safe  {zero_safe:7.3f}  (log_magnitude_, clone included)")
    mask = torch.isfinite(half_zero.log())
    zero = torch.zeros(())
    print("select 430k entries (ms):")
    print(f"  torch.where(bool mask) {median_ms(lambda: torch.where(mask, x, zero), repeats):7.3f}")
    print(f"  finite_or_zero         {median_ms(lambda: finite_or_zero(x), repeats):7.3f}")
    special_values(repeats)


@contextlib.contextmanager
def _native_loops_off():
    """The compiled exp and log instead of the native float32 loops (``logspace.native_loops``)."""
    kept = logspace.native_loops
    logspace.native_loops = lambda t: False
    try:
        yield
    finally:
        logspace.native_loops = kept


def special_values(repeats: int) -> None:
    """torch's exp and log against ``exp_`` / ``log_magnitude_`` on 2M entries, compiled and by
    the native float32 loops (``elementwise.c``): on ordinary numbers, with half of them a
    log-space zero (-inf; 0 for the log), and all of them with a subnormal exp (near -90)."""
    torch.manual_seed(0)
    n = 2_000_000
    ordinary = torch.randn(n)
    half = torch.rand(n) < 0.5
    inputs = {
        "ordinary": ordinary,
        "half -inf": torch.where(half, float("-inf"), ordinary),
        "all near -90": -90.0 - torch.rand(n),
    }

    def both(op: Callable[[torch.Tensor], object], v: torch.Tensor) -> tuple[float, float]:
        with _native_loops_off():
            compiled = median_ms(lambda: op(v.clone()), repeats)
        return compiled, median_ms(lambda: op(v.clone()), repeats)

    print("exp of 2M entries (ms): torch.exp | exp_ compiled | exp_ native (clone included)")
    for name, v in inputs.items():
        eager = median_ms(lambda v=v: v.exp(), repeats)
        print(f"  {name:14s} {eager:8.3f} {'{:8.3f} {:8.3f}'.format(*both(exp_, v))}")
    positive = torch.rand(n) + 0.1
    print("log of 2M entries (ms): torch.log | log_magnitude_ compiled | native (clone included)")
    for name, v in {"ordinary": positive, "half zeros": torch.where(half, 0.0, positive)}.items():
        eager = median_ms(lambda v=v: v.log(), repeats)
        print(f"  {name:14s} {eager:8.3f} {'{:8.3f} {:8.3f}'.format(*both(log_magnitude_, v))}")
    print(f"  (a clone alone: {median_ms(lambda: positive.clone(), repeats):.3f})")


def memory(repeats: int) -> None:
    big = torch.randn(10_000_000)
    ms = median_ms(lambda: fingerprint(big), repeats)
    print(f"fingerprint of 40 MB: {ms:.2f} ms, {big.numel() * 4 / ms / 1e6:.1f} GB/s")
    table = torch.zeros(30522, 384)
    fresh = median_ms(lambda: torch.zeros(30522, 384), repeats)
    refill = median_ms(lambda: table.zero_(), repeats)
    print(
        f"30522 x 384 zero table: fresh {fresh:.2f} ms, refilling an existing one {refill:.2f} ms"
    )


def weight_forms(repeats: int) -> None:
    """A one-sentence pass's work per weight matrix: the plain backward's weight gradient (one
    BLAS product over 20 tokens) against the semiring's passes over the weight's entries."""
    torch.manual_seed(0)
    w, message = torch.randn(384, 1536), torch.randn(20, 384)
    lifted = log_abs(w, torch.float32)
    grad_out, x = torch.randn(20, 1536), torch.randn(20, 384)
    readout = torch.empty(384 * 1536)
    print("MiniLM feed-forward weight 384 x 1536 (ms):")
    print(f"  plain weight gradient  {median_ms(lambda: x.t() @ grad_out, repeats):7.3f}")
    print(f"  fingerprint            {median_ms(lambda: fingerprint(w), repeats):7.3f}")
    print(f"  log|W|                 {median_ms(lambda: log_abs(w, torch.float32), repeats):7.3f}")
    product = median_ms(lambda: maxplus(message, lifted), repeats)
    print(f"  max-plus with [20, 384] {product:6.3f}")
    panels = _panels(lifted[None])  # what a pass keeps of a weight across passes
    kept = median_ms(
        lambda: maxplus_f32(message[None], lifted[None], False, lambda t, kind, make: panels),
        repeats,
    )
    print(f"  the same, panels kept  {kept:7.3f}")
    flat = lifted.reshape(-1)
    print(f"  readout exp            {median_ms(lambda: exp_f32(flat, readout), repeats):7.3f}")


def fused_readout(repeats: int) -> None:
    print("Entropy readout (ms): eager, fused")
    for n in (7_680, 147_456):
        log_z, mean = torch.randn(n), torch.randn(n)
        eager = median_ms(lambda a=log_z, b=mean: _entropy_readout.eager(a, b), repeats)
        fused = median_ms(lambda a=log_z, b=mean: _entropy_readout(a, b), repeats)
        print(f"  {n:7d} entries         {eager:7.3f} {fused:7.3f}")


def log_plus(repeats: int) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(8, 128, 768) * 5, torch.randn(8, 128, 768) * 5
    eager = median_ms(lambda: torch.logaddexp(a, b), repeats)
    fused = median_ms(lambda: log_add_exp(a, b), repeats)
    print(f"log(e^a + e^b) of 786k entries (ms): torch.logaddexp {eager:.3f}, fused {fused:.3f}")
    x, part = torch.randn(2, 64, 112, 112), torch.randn(2, 64, 112, 112)
    where = median_ms(lambda: torch.where(x <= 0, float("-inf"), part), repeats)
    cut = median_ms(lambda: _ReluCut(x, 0.0)(part, float("-inf")), repeats)
    print(f"ReLU cut of 1.6M entries (ms): torch.where {where:.3f}, threshold_backward {cut:.3f}")


def stacked_sums(repeats: int) -> None:
    """Entropy's message toward a weight as three sums (e·r |x|, e |x|, e |x| log|x|) against
    two (``semirings.entropy._stacked_sums``: [e·r; e] against [|x|; -|x| log|x|] over twice
    the batch, then e |x|), each with its magnitudes of x: ResNet-18's 3x3 convolutions at
    batch 2 and 224 x 224, and a sentence's 20 tokens through MiniLM's linear layers."""
    from semipack.kernels import blas
    from semipack.messages.shared_shift import _ConvSums

    torch.manual_seed(0)
    print("Entropy's weight message, three sums -> two, magnitudes of x included (ms):")
    for channels, side in ((64, 56), (128, 28), (256, 14), (512, 7)):
        x = torch.randn(2, channels, side, side)
        sums = _ConvSums(x, torch.rand(channels, channels, 3, 3), ConvGeometry.of(2, 1, 1, 1))
        three, two = _weight_sums(x, torch.rand(2, channels, side, side), sums.to_weight)
        print(
            f"  conv {channels} -> {channels}, {side} x {side}  "
            f"{median_ms(three, repeats):7.2f} -> {median_ms(two, repeats):7.2f}"
        )
    for outputs, inputs in ((384, 384), (1536, 384), (384, 1536)):
        x = torch.randn(20, inputs)
        three, two = _weight_sums(x, torch.rand(20, outputs), lambda g, v: blas.matmul(g.t(), v))
        print(
            f"  linear {inputs} -> {outputs}, 20 rows  "
            f"{median_ms(three, repeats):7.2f} -> {median_ms(two, repeats):7.2f}"
        )


def _weight_sums(
    x: torch.Tensor, e: torch.Tensor, over_batch: Callable[[torch.Tensor, torch.Tensor], object]
) -> tuple[Callable[[], object], Callable[[], object]]:
    """The three-sum and the two-sum forms of ``stacked_sums``, each a callable."""
    from semipack.kernels.logspace import abs_and_xlogx, stacked_magnitudes

    e_r = torch.rand_like(e)
    pair = torch.cat([e_r, e])

    def three() -> None:
        mag, mag_log_mag = abs_and_xlogx(x)
        over_batch(e_r, mag), over_batch(e, mag), over_batch(e, mag_log_mag)

    def two() -> None:
        stacked = stacked_magnitudes(x)
        over_batch(e, stacked[: x.shape[0]]), over_batch(pair, stacked)

    return three, two


def max_plus(repeats: int) -> None:
    # ResNet-18 layer1, batch 2: one tap's weight message [64, B*L] x window [B*L, 64] (gather)
    # and its input message [B*L, 64] x tap [64, 64] into the window (scatter-max)
    torch.manual_seed(0)
    batch, side, channels = 2, 56, 64
    padded = side + 2
    x = torch.randn(batch * padded * padded, channels)
    a = torch.randn(channels, batch * side * side)
    panels = pack_panels_f32(x)
    b_idx = torch.arange(batch)[:, None, None] * padded * padded
    rows = (b_idx + torch.arange(side)[None, :, None] * padded + torch.arange(side)).reshape(-1)
    rows = rows.contiguous()
    message = torch.randn(batch * side * side, channels)
    tap = pack_panels_f32(torch.randn(channels, channels))
    dest = torch.full((batch * padded * padded, channels), float("-inf"))
    ids = torch.arange(message.numel()).reshape(message.shape)
    dest_ids = torch.zeros(dest.shape, dtype=torch.int64)
    pairs = a.shape[0] * a.shape[1] * channels
    rates = [
        pairs / median_ms(run, repeats) / 1e6
        for run in (
            lambda: maxplus_gather_f32(a, panels, rows, padded + 1, channels),
            lambda: maxplus_scatter_max_f32(message, tap, dest, rows, padded + 1),
            lambda: maxplus_gather_f32(a, panels, rows, padded + 1, channels, with_index=True),
            lambda: maxplus_scatter_max_f32(message, tap, dest, rows, padded + 1, ids, dest_ids),
        )
    ]
    print(
        f"max-plus tap products [64, 6272] x [6272, 64] (G pairs/s): MaxProd weight message "
        f"{rates[0]:.1f}, input message {rates[1]:.1f}; TopPath weight {rates[2]:.1f}, input "
        f"{rates[3]:.1f}"
    )


def depthwise_rates(repeats: int) -> None:
    """The depthwise kernels' pairs per second, to read against the tap products above."""
    torch.manual_seed(0)
    for kernel, side in ((3, 56), (5, 56), (3, 14), (5, 14)):
        rates = _depthwise_layer_rates(kernel, side, repeats)
        print(
            f"depthwise {kernel}x{kernel}, 96 channels, {side} x {side}, batch 2 (G pairs/s): "
            f"MaxProd weight message {rates[0]:.1f}, input message {rates[1]:.1f}; TopPath "
            f"weight {rates[2]:.1f}, input {rates[3]:.1f}"
        )


def _depthwise_layer_rates(kernel: int, side: int, repeats: int) -> list[float]:
    """G pairs/s of MaxProd's weight and input messages, then TopPath's, of one layer."""
    pad = (kernel - 1) // 2
    m = torch.randn(2, 96, side, side)
    lw = torch.randn(96, kernel, kernel)
    lx = torch.randn(2, 96, side + 2 * pad, side + 2 * pad)
    ids = torch.arange(m.numel()).reshape(m.shape)
    pairs = m.numel() * kernel * kernel
    return [
        pairs
        / median_ms(
            lambda i=i, want=want: depthwise_f32(
                m, lw, lx, (1, 1), (1, 1), want, not want, ids=i, padding=(pad, pad)
            ),
            repeats,
        )
        / 1e6
        for i in (None, ids)
        for want in (False, True)
    ]


def stride_two(repeats: int) -> None:
    """Both messages of stride-2 depthwise layers by phases and in one kernel call, in turns
    (both give the same bits: checked here on the way)."""
    torch.manual_seed(0)
    print("stride-2 depthwise messages, batch 2 (CPU ms, G pairs/s): by phases, one kernel call")
    for channels, side, kernel in ((16, 112, 3), (72, 56, 3), (96, 28, 5)):
        pad = (kernel - 1) // 2
        out = (side + 2 * pad - kernel) // 2 + 1
        m, lw = torch.randn(2, channels, out, out), torch.randn(channels, kernel, kernel)
        lx = torch.randn(2, channels, side + 2 * pad, side + 2 * pad)
        ids = torch.arange(m.numel()).reshape(m.shape)
        for message in ("input", "weight"):
            line = []
            for name, successors in (("MaxProd", None), ("TopPath", ids)):
                forms = _stride_two_forms(message, m, lw, lx, (side, side), pad, successors)
                ms = _in_turns(forms, repeats)
                rates = [m.numel() * kernel * kernel / t / 1e6 for t in ms]
                line.append(f"{name} {ms[0]:.2f} ({rates[0]:.1f}), {ms[1]:.2f} ({rates[1]:.1f})")
            print(
                f"  {kernel}x{kernel}, {channels} channels, {side} x {side}, {message} message: "
                + "; ".join(line)
            )


def _stride_two_forms(
    message: str,
    m: torch.Tensor,
    lw: torch.Tensor,
    lx: torch.Tensor,
    size: tuple[int, int],
    pad: int,
    successors: torch.Tensor | None,
) -> tuple[Callable[[], tuple[torch.Tensor, ...]], ...]:
    """A stride-2 depthwise layer's ``message`` by phases and in one kernel call."""
    from semipack.kernels.native import depthwise_f32, depthwise_input_stride2_f32
    from semipack.rules.depthwise import _input_by_phases, _weight_by_phases

    if message == "input":
        shape = (*m.shape[:2], *size)
        return (
            lambda: _input_by_phases(m, lw, shape, (pad, pad), (2, 2), successors, -1),
            lambda: depthwise_input_stride2_f32(m, lw, shape, (pad, pad), successors, -1),
        )
    return (
        lambda: _weight_by_phases(m, lw.shape, lx, (2, 2), successors),
        lambda: depthwise_f32(m, lw, lx, (2, 2), (1, 1), False, True, successors)[1],
    )


def _in_turns(
    forms: tuple[Callable[[], tuple[torch.Tensor, ...]], ...], repeats: int
) -> list[float]:
    """CPU milliseconds (medians) of ``forms`` timed in turns (``common.interleaved``), after
    checking that they give the same tensors."""
    results = [f() for f in forms]
    assert all(
        all(torch.equal(a, b) for a, b in zip(results[0], r, strict=True)) for r in results[1:]
    )
    rounds = interleaved({str(i): f for i, f in enumerate(forms)}, repeats, clock=time.process_time)
    return [statistics.median(t) * 1e3 for t in rounds.values()]


#: Convolutions the depthwise kernels take, at 224 x 224, batch 2: MobileNetV3-small's
#: depthwise layers (torchvision's blocks in order, repeated shapes once) and two image stems
#: (dense over 3 input channels, weight message only: the input needs none).
#: (input channels, output channels, input side, kernel, stride, groups)
CONV_LAYERS = (
    (16, 16, 112, 3, 2, 16),
    (72, 72, 56, 3, 2, 72),
    (88, 88, 28, 3, 1, 88),
    (96, 96, 28, 5, 2, 96),
    (240, 240, 14, 5, 1, 240),
    (288, 288, 14, 5, 2, 288),
    (576, 576, 7, 5, 1, 576),
    (3, 16, 224, 3, 2, 1),
    (3, 64, 224, 7, 2, 1),
)


def conv_layer_costs(repeats: int) -> None:
    """The messages of each layer in ``CONV_LAYERS`` through the rule's entry
    (``rules.convolution.conv_messages``: the lifts, checks and layout copies included, as a
    backward pays them), MaxProd and TopPath: milliseconds of CPU time, and G pairs/s (one
    forward's multiply-adds per message) to read against the dense tap product above."""
    torch.manual_seed(0)
    for c_in, c_out, side, kernel, stride, groups in CONV_LAYERS:
        pad = (kernel - 1) // 2
        x = torch.randn(2, c_in, side, side)
        w = torch.randn(c_out, c_in // groups, kernel, kernel)
        geometry = ConvGeometry.of(2, (stride, stride), (pad, pad), (1, 1), groups)
        out = torch.nn.functional.conv2d(x, w, None, stride, pad, 1, groups)
        m = torch.randn(out.shape)
        ids = torch.arange(m.numel()).reshape(m.shape)
        mask = (groups > 1, True, False)
        pairs = m.numel() * w[0].numel() * (2 if mask[0] else 1)
        line = []
        for name, state in (("MaxProd", (m,)), ("TopPath", (m, ids))):
            semiring = semipack.MaxProd() if name == "MaxProd" else semipack.TopPath()
            ms = median_ms(
                lambda s=state, sr=semiring, x=x, w=w, g=geometry, mask=mask: (
                    convolution.conv_messages(sr, s, x, w, g, mask)
                ),
                repeats,
                clock=time.process_time,
            )
            line.append(f"{name} {ms:.2f} ms ({pairs / ms / 1e6:.1f})")
        kind = "depthwise" if groups > 1 else "dense stem"
        print(
            f"{kind} {kernel}x{kernel} stride {stride}, {c_in} -> {c_out} channels, {side} x "
            f"{side}, batch 2, {'both messages' if mask[0] else 'weight message'} "
            "(CPU time, G pairs/s): " + ", ".join(line)
        )


def bert_products(repeats: int) -> None:
    """The max-plus products of one BERT-base layer's MaxProd backward (8 x 128 tokens,
    ``cases.bert_layer``), taken with their real messages where they enter the native
    dispatch (``tropical._tropical3``: pruned or dense, the choice's estimate included) and
    timed there again, one line per distinct shape (fastest of ``repeats`` calls, CPU time) and
    their sum over the pass. The layer's weights stay watched by the weight cache after the
    pass, so their packed forms are reused as in a pass; an A/B of the kernels runs this on
    two trees in turns."""
    from cases import WORKLOADS  # the benchmark workloads (this directory)

    work = WORKLOADS["bert_layer"]()
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    dispatch = tropical._tropical3

    def capture(a3: torch.Tensor, bt3: torch.Tensor, with_index: bool):
        captured.append((a3, bt3))
        return dispatch(a3, bt3, with_index)

    tropical._tropical3 = capture
    try:
        with semipack.extend(work.model, semipack.MaxProd()):
            work.loss().backward()
    finally:
        tropical._tropical3 = dispatch
    by_shape: dict[tuple, list[float]] = {}
    for a3, bt3 in captured:
        times = []
        for _ in range(repeats):
            start = time.process_time()
            dispatch(a3, bt3, False)
            times.append(time.process_time() - start)
        by_shape.setdefault((tuple(a3.shape), tuple(bt3.shape)), []).append(min(times) * 1e3)
    total = 0.0
    for (a_shape, bt_shape), times in by_shape.items():
        total += sum(times)
        print(
            f"BERT layer MaxProd product {list(a_shape[1:])} x {[bt_shape[2], bt_shape[1]]} "
            f"(batch {a_shape[0]}, {len(times)} per pass): {statistics.median(times):.1f} ms"
        )
    print(f"BERT layer MaxProd products, sum over the pass: {total:.1f} ms CPU")


def backward_ms(
    conv: nn.Conv2d, x: torch.Tensor, semiring: semipack.Semiring | None, repeats: int
) -> float:
    """Median CPU time of ``conv``'s backward alone (the forward runs untimed before each)."""
    times = []
    for _ in range(repeats + 1):
        conv.zero_grad(set_to_none=True)
        context = semipack.extend(conv, semiring) if semiring else contextlib.nullcontext()
        with context:
            loss = conv(x).square().sum()
            start = time.process_time()
            loss.backward()
            times.append(time.process_time() - start)
    return statistics.median(times[1:]) * 1e3


def depthwise(repeats: int) -> None:
    """The depthwise layer's MaxProd backward over its plain one, with the native kernel and
    per tap; then the semiring's extra time per multiply-add (the messages' products: one
    forward's multiply-adds each for the input and the weight) against a dense 3x3
    convolution of the same channels and size, the issue's "not slower per multiply-add"."""
    torch.manual_seed(0)
    x = torch.randn(2, 96, 14, 14, requires_grad=True)
    conv = nn.Conv2d(96, 96, 5, padding=2, groups=96)
    plain = backward_ms(conv, x, None, repeats)
    native = backward_ms(conv, x, semipack.MaxProd(), repeats)
    kernel = convolution.depthwise_max_plus
    convolution.depthwise_max_plus = lambda *args: None  # the per-tap path
    try:
        per_tap = backward_ms(conv, x, semipack.MaxProd(), repeats)
    finally:
        convolution.depthwise_max_plus = kernel
    print(
        f"depthwise 5x5, 96 channels, 14 x 14, batch 2, backward CPU time: plain {plain:.2f} ms;"
        f" MaxProd {native / plain:.1f}x with the native kernel, {per_tap / plain:.1f}x per tap"
    )
    dense = nn.Conv2d(96, 96, 3, padding=1)
    dense_plain = backward_ms(dense, x, None, repeats)
    dense_max = backward_ms(dense, x, semipack.MaxProd(), repeats)
    positions = 2 * 14 * 14
    per_mac = {
        "depthwise": (native - plain) / (2 * positions * 96 * 25),
        "dense": (dense_max - dense_plain) / (2 * positions * 96 * 96 * 9),
    }
    print(
        "MaxProd's extra CPU time per multiply-add of its messages: depthwise 5x5 "
        f"{per_mac['depthwise'] * 1e6:.2f} ns, dense 3x3 96 -> 96 {per_mac['dense'] * 1e6:.2f} ns "
        f"(plain {dense_plain:.2f} ms, MaxProd {dense_max / dense_plain:.1f}x)"
    )


def grouped(repeats: int) -> None:
    """Grouped 3x3 convolutions of 128 channels on 28 x 28 planes, batch 2 (ResNeXt's 32
    groups of 4 channels, RegNet-like groups of 8 and 16, and a dense layer for reference):
    MaxProd's and TopPath's extra CPU time per multiply-add of their messages over a plain
    backward, through the depthwise kernels with a channel multiplier (``rules/depthwise.py``,
    ``few_channels_max_plus``) and per tap, the two routes in turns (the issue's "not slower
    per multiply-add than the dense one")."""
    import semipack.rules.depthwise as depthwise_rules

    torch.manual_seed(0)
    x = torch.randn(2, 128, 28, 28, requires_grad=True)
    limit = depthwise_rules.FEW_CHANNELS_PER_GROUP
    print("grouped 3x3, 128 channels, 28 x 28, batch 2: extra CPU ns per multiply-add")
    print("  groups  semiring   depthwise route   per tap")
    for groups in (32, 16, 8, 1):
        conv = nn.Conv2d(128, 128, 3, padding=1, groups=groups, bias=False)
        macs = 2 * 2 * 28 * 28 * 128 * (128 // groups) * 9  # input and weight messages
        for semiring in (semipack.MaxProd(), semipack.TopPath()):
            extra = {"route": [], "per tap": []}
            for _ in range(max(1, repeats // 5)):
                plain = backward_ms(conv, x, None, 5)
                for route, cap in (("route", limit), ("per tap", 1)):
                    depthwise_rules.FEW_CHANNELS_PER_GROUP = cap
                    try:
                        spent = backward_ms(conv, x, semiring, 5)
                    finally:
                        depthwise_rules.FEW_CHANNELS_PER_GROUP = limit
                    extra[route].append((spent - plain) / macs * 1e6)
            route, per_tap = (statistics.median(extra[k]) for k in ("route", "per tap"))
            name = type(semiring).__name__
            print(f"  {groups:6d}  {name:8s} {route:12.2f} {per_tap:14.2f}")


def _norm_row_forms(a: torch.Tensor, r: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """Per semiring, its all-pairs and its sorted-row reduction of these rows, as callables."""
    return {
        "LogSum sums": (
            lambda: norm_abs_reduce_f32(a, x_hat, reduce_max=False),
            lambda: norm_sorted_sums_f32(a, x_hat),
        ),
        "Entropy sums": (
            lambda: norm_entropy_sums_f32(a, r, x_hat),
            lambda: norm_sorted_sums_f32(a, x_hat, r, with_log=True),
        ),
        "MaxProd maxima": (
            lambda: norm_abs_reduce_f32(a, x_hat, reduce_max=True),
            lambda: norm_sorted_max_f32(a, x_hat),
        ),
    }


def norm_rows(repeats: int) -> None:
    """The pair reductions of normalisation rows, all pairs against sorted rows (ms)."""
    gen = torch.Generator().manual_seed(0)
    print("normalisation rows (ms): all pairs, sorted")
    for rows, n in ((1024, 384), (1024, 768), (8, 8192)):
        x = torch.randn(rows, n, generator=gen)
        x_hat = (x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True)
        a, r = torch.rand(rows, n, generator=gen), torch.randn(rows, n, generator=gen)
        for name, (pairs, sorted_rows) in _norm_row_forms(a, r, x_hat).items():
            both = median_ms(pairs, repeats), median_ms(sorted_rows, repeats)
            print(f"  {rows:5d} x {n:<5d} {name:15s} {both[0]:9.2f} {both[1]:9.2f}")


def affine_max(repeats: int) -> None:
    """MaxProd's per-channel gain and bias of an eval batch norm: compiled against native."""
    compiled_form = compiled_affine_params(semipack.MaxProd)
    print("MaxProd batch-norm gain and bias (us): compiled, native")
    for shape in ((2, 16, 12544), (2, 72, 3136), (2, 96, 784), (2, 576, 49)):
        m, x = torch.randn(shape), torch.randn(shape)
        mean, invstd = torch.randn(1, shape[1], 1), torch.rand(1, shape[1], 1) + 0.5
        both = (
            median_ms(lambda m=m, x=x, a=mean, b=invstd: compiled_form(m, x, a, b), repeats),
            median_ms(lambda m=m, x=x, a=mean, b=invstd: max_affine_f32(m, x, a, b), repeats),
        )
        print(f"  {shape!s:16s} {both[0] * 1e3:8.0f} {both[1] * 1e3:8.0f}")


def regular_grads(repeats: int) -> None:
    """An extension's regular gradient from its one-op inner graph: ``torch.autograd.grad``
    (an engine run) against calling the graph's nodes (``direct_backward.direct_grads``), in
    microseconds, for a squeeze-excite 1 x 1 convolution, a MiniLM feed-forward linear layer
    and a 3 x 3 convolution (the same gradients; the difference is the engine's fixed cost)."""
    calls = {
        "conv 1x1 576->144, [2, 576, 1, 1]": (
            lambda x, w, b: F.conv2d(x, w, b),
            ((2, 576, 1, 1), (144, 576, 1, 1), (144,)),
        ),
        "linear 384->1536, [20, 384]": (F.linear, ((20, 384), (1536, 384), (1536,))),
        "conv 3x3 64->64, [2, 64, 28, 28]": (
            lambda x, w, b: F.conv2d(x, w, b, padding=1),
            ((2, 64, 28, 28), (64, 64, 3, 3), (64,)),
        ),
    }
    print("regular gradient of one call (us): engine, direct")
    for name, (fn, shapes) in calls.items():
        leaves = [torch.randn(shape).requires_grad_() for shape in shapes]
        out = fn(*leaves)
        grad = torch.randn(out.shape)
        edge = torch.autograd.graph.get_gradient_edge(out)
        with torch.no_grad():  # as inside a backward
            both = (
                median_ms(
                    lambda e=edge, g=grad, ls=leaves: torch.autograd.grad(
                        [e], ls, [g], retain_graph=True
                    ),
                    repeats,
                ),
                median_ms(lambda e=edge, g=grad, ls=leaves: direct_grads(e, g, ls), repeats),
            )
        print(f"  {name:36s} {both[0] * 1e3:8.0f} {both[1] * 1e3:8.0f}")


class _Wrapped(torch.Tensor):
    """The least a message can be while it travels through autograd as a tensor subclass: a
    wrapper whose ``__torch_dispatch__`` runs the op on the tensor inside and wraps the result
    (no semiring, no rule). Its cost per node is the floor under any such design."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )
        out.inner = inner
        return out

    def __init__(self, inner: torch.Tensor) -> None:
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            return a.inner if isinstance(a, _Wrapped) else a

        out = func(*(plain(a) for a in args), **{k: plain(v) for k, v in (kwargs or {}).items()})
        return _Wrapped(out) if isinstance(out, torch.Tensor) else out


#: Chains of 100 nodes of one kind on a [4, 64] tensor (small: the fixed costs, not arithmetic).
_NODE_CHAINS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": lambda h: -h,
    "transpose": lambda h: h.t(),
    "tanh": torch.tanh,
    "scale by 0.5": lambda h: h * 0.5,
}


def node_costs(repeats: int) -> None:
    """Microseconds per autograd node of a backward through a chain of 100 small nodes of one
    kind, in turns: a plain backward, the same backward carrying a minimal tensor subclass
    (``_Wrapped``: the floor of a message that travels through autograd as a subclass, as
    semipack's do) and a MaxProd backward inside ``semipack.extend`` (semipack's rules,
    hooks and readout on top of that floor). On a small model these fixed costs, not its
    arithmetic, set the ratio to a plain backward (BENCHMARKS.md, "Targets")."""
    print("us per node, chain of 100 on [4, 64]: plain, minimal subclass, semipack MaxProd")
    for name, step in _NODE_CHAINS.items():
        model = nn.Module()
        model.w = nn.Parameter(torch.randn(4, 64))

        def forward(w: torch.Tensor, step=step) -> torch.Tensor:
            h = w * 1.0
            for _ in range(100):
                h = step(h)
            return h

        def plain(forward=forward, model=model) -> float:
            out = forward(model.w)
            seed = torch.ones(out.shape)
            start = time.perf_counter()
            torch.autograd.grad(out, model.w, seed)
            return time.perf_counter() - start

        def wrapped(forward=forward, model=model) -> float:
            out = forward(model.w)
            seed = _Wrapped(torch.ones(out.shape))
            start = time.perf_counter()
            torch.autograd.grad(out, model.w, seed)
            return time.perf_counter() - start

        def semiring(forward=forward, model=model) -> float:
            model.w.grad = None
            with semipack.extend(model, semipack.MaxProd()):
                out = forward(model.w).sum()
                start = time.perf_counter()
                out.backward()
                return time.perf_counter() - start

        variants = (plain, wrapped, semiring)
        for run in variants:  # warm-up
            run()
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(repeats):
            for spent, run in zip(times, variants, strict=True):
                spent.append(run())
        per_node = [statistics.median(t) / 100 * 1e6 for t in times]
        print(f"  {name:14s} " + " ".join(f"{v:8.1f}" for v in per_node))


#: The sections, in order; those after the first need the native kernels.
SECTIONS: dict[str, Callable[[int], None]] = {
    "elementwise": elementwise,
    "memory": memory,
    "weight_forms": weight_forms,
    "fused_readout": fused_readout,
    "log_plus": log_plus,
    "stacked_sums": stacked_sums,
    "max_plus": max_plus,
    "depthwise_rates": depthwise_rates,
    "stride_two": stride_two,
    "conv_layer_costs": conv_layer_costs,
    "bert_products": bert_products,
    "depthwise": depthwise,
    "grouped": grouped,
    "norm_rows": norm_rows,
    "affine_max": affine_max,
    "regular_grads": regular_grads,
    "node_costs": node_costs,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--only", nargs="+", choices=list(SECTIONS), default=None, help="run these sections"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, section in SECTIONS.items():
        if args.only is not None and name not in args.only:
            continue
        if name != "elementwise" and not native_available():
            print("native kernels not available here: the remaining lines need them")
            return
        section(args.repeats)


if __name__ == "__main__":
    main()
