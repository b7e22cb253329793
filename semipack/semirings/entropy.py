"""Entropy of the path distribution, via the expectation semiring kept in normalised log form."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kernels import affine_params, blas, log_space_native
from ..kernels.affine_params import AffineParams
from ..kernels.compiled import FUSED_MIN_ELEMENTS, compiled
from ..kernels.exclusive import exclusive_logsumexp
from ..kernels.logspace import (
    abs_and_xlogx,
    batch_stacked,
    exp_,
    finite_surprisal,
    flat_on_host,
    flat_views,
    fused_log_add_exp,
    log_magnitude_plus_,
    native_loops,
    shaped_like,
    stacked_magnitudes,
)
from ..kernels.native import exp_f32
from ..kernels.normalization import ENTROPY, CentredPairsKernel
from ..kernels.shared_shift import ConvolutionSums, global_shift
from ..kernels.weight_cache import WEIGHTS
from ._log import can_overwrite, finite_or_zero, log_magnitude_, shifted_exp
from .base import (
    Products,
    Semiring,
    Sign,
    State,
    checked_flag,
    fits,
    index_reduce,
    on_memory_of,
    repair_underflow,
    uses_methods_of,
)
from .log_sum import column_scaled

#: ``(g, x) -> Σ g·x`` over some dims: a matmul, a convolution's sums.
Contraction = Callable[[Tensor, Tensor], Tensor]


def _shared_shift(m: State) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(e, e·r, shift)`` with ``e = exp(log Z - shift)`` for the state ``(log Z, r)`` of a
    message, or None where its finite entries span too many nats for one shift."""
    shifted = _shared_shift_stacked(m, stacked=False)
    return None if shifted is None else shifted[:3]


def _shared_shift_stacked(
    m: State, stacked: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
    """``_shared_shift``'s ``(e, e·r, shift)`` and, with ``stacked``, ``[e·r; e]``: both in
    one tensor of [2N, ...] (``batch_stacked``; None where the message's layout has no such
    form), e·r and e its halves. A convolution's weight message then sums e·r |x| and
    e |x| log|x| over the batch in one call (``_stacked_sums``)."""
    log_z, surprisal = m
    shift = global_shift(log_z)
    if shift is None:
        return None
    pair = None
    if stacked and log_z.dim() > 0 and log_z.shape[0] > 0:
        # in the message's layout, else in the standard one (a train-mode batch norm hands its
        # messages over channel-major): then by the eager ops, not the one-loop kernel
        pair = batch_stacked(log_z)
        if pair is None:
            pair = log_z.new_empty((2 * log_z.shape[0], *log_z.shape[1:]))
    if pair is not None:
        n = log_z.shape[0]
        e_r, e = pair[:n], pair[n:]
    else:  # tensors of the message's own layout (empty_like keeps a dense tensor's strides)
        e, e_r = torch.empty_like(log_z), torch.empty_like(log_z)
    flat = None
    if log_z.numel() >= FUSED_MIN_ELEMENTS and shift.dtype == log_z.dtype:
        flat = flat_on_host(log_z, surprisal)
    out = None
    if flat is not None and e.stride() == log_z.stride():  # flat views in one memory order
        out = flat_views(e, e_r)
    if out is not None and native_loops(log_z):  # the bits exp_(log_z - shift) gives
        exp_f32(flat[0], out[0], float(shift))
        torch.mul(out[0], flat[1], out=out[1])
    elif out is not None:  # written over their flat memory, in one loop
        _shifted_pair(*flat, *out, shift.reshape(()))
    else:
        exp_(torch.sub(log_z, shift, out=e))  # the ops (and bits) of exp_(log_z - shift)
        torch.mul(e, surprisal, out=e_r)
    return e, e_r, shift, pair


def _shifted_pair_eager(
    log_z: Tensor, surprisal: Tensor, e: Tensor, e_r: Tensor, shift: Tensor
) -> None:
    torch.exp(log_z - shift, out=e)
    torch.mul(e, surprisal, out=e_r)


def _shifted_pair_fused(
    log_z: Tensor, surprisal: Tensor, e: Tensor, e_r: Tensor, shift: Tensor
) -> None:
    shifted = torch.exp(log_z - shift)
    e.copy_(shifted)
    e_r.copy_(shifted * surprisal)


#: ``e = exp(log Z - shift)`` and ``e * R`` of a message in one loop (eagerly three passes, the
#: exponential a compiled call of its own).
_shifted_pair = compiled(_shifted_pair_eager, _shifted_pair_fused, min_elements=FUSED_MIN_ELEMENTS)


class EntropyFlow(NamedTuple):
    """``Entropy(flow=True)``'s readout: both values its state already holds."""

    entropy: Tensor  #: path entropy in nats, NaN where no path reaches
    log_flow: Tensor  #: log Z, LogSum's value: log of the sum of the path products, -inf: none


class Entropy(Semiring):
    """Shannon entropy (nats) of p(path) ∝ product of |local derivatives| along the path.

    The expectation semiring pairs ``<Z, Y>`` (Z = Σ w, Y = Σ w·(-log w) over paths). We store
    ``L = log Z`` and ``R = Y / Z`` (the mean path surprisal), which turns ``times`` into plain
    addition and keeps every number finite on deep graphs. Entropy is ``R + L``; it is NaN where
    no path exists (the distribution is empty).

    ``L`` is LogSum's value (the same paths, the same weights), so ``flow=True`` reads it out
    too: ``readout`` then gives ``EntropyFlow(entropy, log_flow)``, and a run that needs both
    needs no ``Product`` with ``LogSum`` (a second semiring in every product of the pass).
    """

    components = ("log_normalizer", "mean_surprisal")
    zero = (float("-inf"), 0.0)
    one = (0.0, 0.0)
    flow = False  # a class default: a subclass whose __init__ skips ours still reads out

    def __init__(self, flow: bool = False) -> None:
        self.flow = checked_flag(flow, "Entropy", "flow")

    def __repr__(self) -> str:
        return f"{self.name}(flow=True)" if self.flow else f"{self.name}()"

    def lift_cache_key(self) -> tuple | None:
        return (Entropy,) if uses_methods_of(self, Entropy, "lift") else None

    def lift(self, w: Tensor) -> State:
        log_w = log_magnitude_(w.to(self.state_dtype(w.dtype)).abs())
        return (log_w, finite_surprisal(log_w))

    def scale_owned(self, a: State, w: Tensor) -> State:
        if not can_overwrite(w, a[0]):
            return self.scale(a, w)
        log_w = log_magnitude_(w.abs_())
        surprisal = finite_surprisal(log_w)
        return (log_w.add_(a[0]), surprisal.add_(a[1]))

    def lift_log(self, log_abs: Tensor, sign: Sign = 1.0) -> State:
        log_w = log_abs.to(self.state_dtype(log_abs.dtype))
        return (log_w, finite_surprisal(log_w))

    def scale_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        return (a[0] + log_abs, a[1] + finite_surprisal(log_abs))

    def scale_log_owned(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        if not can_overwrite(log_abs, a[0]):
            return self.scale_log(a, log_abs, sign)
        surprisal = finite_surprisal(log_abs)
        return (log_abs.add_(a[0]), surprisal.add_(a[1]))

    def matmul_log(self, a: State, log_abs: Tensor, sign: Sign = 1.0) -> State:
        """``matmul`` with the weights' columns scaled to a maximum of 1 (see LogSum's)."""
        e, m = shifted_exp(a[0], -1)
        log_w = log_abs.to(e.dtype)
        scaled, c = column_scaled(log_w)
        # |w| log|w| = e^c w' log|w|: the common factor e^c cancels in the mean surprisal.
        scaled_log = torch.where(scaled > 0, scaled * log_w, 0.0)
        s = blas.matmul(e, scaled)
        mean = _mean_surprisal(s, blas.matmul(e * a[1], scaled), blas.matmul(e, scaled_log))
        out = (log_magnitude_(s).add_(m).add_(c), mean)
        return repair_underflow(self, a, lambda: self.lift_log(log_w), out, shift=m + c)

    def uses_edge_signs(self) -> bool:
        return False

    def plus(self, a: State, b: State) -> State:
        return _entropy_plus(a[0], a[1], b[0], b[1])

    def times(self, a: State, b: State) -> State:
        return (a[0] + b[0], a[1] + b[1])

    def sum(self, a: State, dims: list[int], keepdim: bool = False) -> State:
        big = torch.logsumexp(a[0], dims, keepdim=True)
        weights = exp_(a[0] - finite_or_zero(big))
        mean = (weights * a[1]).sum(dims, keepdim=keepdim)
        return (big if keepdim else big.squeeze(dims), mean)

    def is_zero(self, a: State) -> Tensor:
        # Only the normaliser decides: a zero-mass state may carry any mean surprisal.
        return a[0] == float("-inf")

    def readout(self, a: State) -> Tensor | EntropyFlow:
        flat = flat_views(a[0], a[1]) if a[0].numel() >= FUSED_MIN_ELEMENTS else None
        if flat is not None and a[1].dtype == a[0].dtype:  # compiled once, whatever the shape
            entropy = shaped_like(_entropy_readout(*flat), a[0])
        else:
            entropy = _entropy_readout(a[0], a[1])
        return EntropyFlow(entropy, a[0]) if self.flow else entropy

    def readout_into(self, a: State, into: Any) -> Any:
        earlier = into.entropy if self.flow and isinstance(into, EntropyFlow) else into
        if (
            (self.flow and not isinstance(into, EntropyFlow))
            or not fits(earlier, a[0])
            or a[1].dtype != a[0].dtype
            or not uses_methods_of(self, Entropy, "readout")
        ):
            return super().readout_into(a, into)
        entropy = on_memory_of(earlier)
        flat = flat_views(a[0], a[1], entropy) if a[0].numel() >= FUSED_MIN_ELEMENTS else None
        if flat is not None:
            _entropy_readout_into(*flat)
        else:
            entropy = _entropy_readout_into(a[0], a[1], entropy)
        return EntropyFlow(entropy, a[0]) if self.flow else entropy

    def matmul(self, a: State, w: Tensor) -> State:
        # Σ_k e_k|w_kj| (R_k - log|w_kj|) = (e∘R) @ |w| - e @ (|w| log|w|): three BLAS calls.
        e, m = shifted_exp(a[0], -1)
        mag, mag_log_mag = _magnitudes(w.to(e.dtype))
        s = blas.matmul(e, mag)
        out = _entropy_pair(s, blas.matmul(e * a[1], mag), m, blas.matmul(e, mag_log_mag))
        return repair_underflow(self, a, lambda: self.lift(w), out, shift=m)

    def index_plus(self, dest: State, dim: int, index: Tensor, src: State) -> State:
        peak = finite_or_zero(index_reduce(dest[0], dim, index, src[0], "amax"))
        e_dest = exp_(dest[0] - peak)
        e_src = exp_(src[0] - peak.index_select(dim, index))
        # e_dest and the products are fresh: the sums are added into them in place
        weighted = torch.mul(e_dest, dest[1]).index_add_(dim, index, e_src.mul(src[1]))
        total = e_dest.index_add_(dim, index, e_src)
        mean = _mean_surprisal(total, weighted, torch.zeros((), dtype=total.dtype))
        return (log_magnitude_plus_(total, peak), mean)

    # --- fast paths of the message math -------------------------------------------------------
    def lift_is_multiplicative(self) -> bool:
        return True

    def exclusive_plus(self, a: State) -> State | None:
        # ⊕ of (L_i, R_i): L = log Σ exp(L_i), R = Σ exp(L_i) R_i / Σ exp(L_i).
        lse, mean = exclusive_logsumexp(a[0], a[1])
        return (lse, mean)

    def compiles_rowwise(self) -> bool:
        return True

    def normalization_kernel(self) -> CentredPairsKernel | None:
        return ENTROPY

    def affine_params_kernel(self) -> Callable[..., AffineParams] | None:
        return affine_params.entropy

    def shared_shift_products(
        self,
        m: State,
        right: Tensor | None = None,
        left: Tensor | None = None,
        want_sum: bool = False,
        left_log: Tensor | None = None,
    ) -> Products | None:
        # a linear layer's rows stacked ([e·r; e]) where they are few (``_stacked_sums``); many
        # rows (a BERT layer's 1024) gain nothing, and e·r freed early keeps the peak lower
        rows, outputs = m[0].shape[-2:]
        stack = left is not None and m[0].dim() == 2 and 4 * rows <= min(outputs, left.shape[-1])
        shifted = _shared_shift_stacked(m, stacked=stack)
        if shifted is None:
            return None
        e, e_r, shift, pair = shifted
        del shifted
        by_right = by_left = total = None
        if want_sum:
            total = _entropy_pair(e.sum(-2), e_r.sum(-2), shift)
        # The product with ``left`` first: a layer's input is no model weight, so its |x| and
        # |x| log|x| are made here (``_magnitudes``), and they are gone before the other
        # product's states exist (a BERT feed-forward layer's Entropy backward peaked with
        # both, 24 MB of them, beside the input's message). Before it, e·r's product with
        # ``right`` (for a linear layer, toward its input), so that the left product frees
        # e·r once read: the first feed-forward layer's weight message then never stands
        # beside e and e·r (12 MB each) at once. The peak of a BERT layer's Entropy backward:
        # 129 -> 123 MB as ``benchmarks/run.py`` measures it (66 MB for a plain backward).
        right_weighted = right_mags = None
        if right is not None and (left is not None or left_log is not None):
            right_mags = _magnitudes(right)
            right_weighted = blas.matmul(e_r, right_mags[0])
        e_t = e.transpose(-1, -2)
        if left_log is not None:
            by_left = _entropy_product_log(e_t, e_r.transpose(-1, -2), left_log, shift)
        elif left is not None:
            if pair is not None:
                by_left = _stacked_sums(e, pair, left, shift, _rows_product)
            if by_left is None:
                handed_over = [e_r.transpose(-1, -2)]  # e·r's last read: freed once read
                del e_r
                by_left = _entropy_product(e_t, handed_over, left, shift)
        del e_t, pair
        if right is not None:
            handed_over = []
            if right_weighted is None:  # the only product: e·r is freed once read
                handed_over.append(e_r)
                del e_r
            by_right = _entropy_product(
                e, handed_over, right, shift, weighted=right_weighted, mags=right_mags
            )
        return by_right, by_left, total

    def shared_shift_conv(
        self, m: State, sums: ConvolutionSums, mask: Sequence[bool]
    ) -> Products | None:
        shifted = _shared_shift_stacked(m, stacked=bool(mask[1]))
        if shifted is None:
            return None
        e, e_r, shift, pair = shifted
        to_in = _entropy_product(e, e_r, sums.w, shift, sums.to_input) if mask[0] else None
        to_w = None
        if mask[1]:
            to_w = _stacked_sums(e, pair, sums.x, shift, sums.to_weight)
            if to_w is None:
                to_w = _entropy_product(e, e_r, sums.x, shift, sums.to_weight)
        bias = None
        if mask[2]:
            dims = [d for d in range(e.dim()) if d != 1]
            bias = _entropy_pair(e.sum(dims), e_r.sum(dims), shift)
        return to_in, to_w, bias


# --- shared-shift products (see ``kernels.shared_shift``) ----------------------------------------
def _plus_eager(log_a: Tensor, r_a: Tensor, log_b: Tensor, r_b: Tensor) -> State:
    big = torch.logaddexp(log_a, log_b)
    safe = finite_or_zero(big)
    return big, (log_a - safe).exp() * r_a + (log_b - safe).exp() * r_b


def _plus_fused(log_a: Tensor, r_a: Tensor, log_b: Tensor, r_b: Tensor) -> State:
    big = fused_log_add_exp(log_a, log_b)
    safe = finite_or_zero(big)
    return big, torch.exp(log_a - safe) * r_a + torch.exp(log_b - safe) * r_b


#: The plus: log Z = logaddexp and the mean surprisal weighted by each side's share, in one loop
#: (the eager form makes seven passes over the state, its logaddexp a slow one).
_entropy_plus = compiled(
    _plus_eager, _plus_fused, min_elements=FUSED_MIN_ELEMENTS, native=log_space_native.entropy_plus
)


def _readout_eager(log_z: Tensor, mean: Tensor) -> Tensor:
    return (log_z + mean).masked_fill_(~torch.isfinite(log_z), float("nan"))  # a fresh sum


def _readout_fused(log_z: Tensor, mean: Tensor) -> Tensor:
    return torch.where(torch.isfinite(log_z), log_z + mean, float("nan"))


#: Entropy = log Z + mean surprisal, NaN where no path reaches (one loop over large states).
_entropy_readout = compiled(
    _readout_eager,
    _readout_fused,
    min_elements=FUSED_MIN_ELEMENTS,
    native=log_space_native.entropy_readout,
)


def _readout_into_eager(log_z: Tensor, mean: Tensor, out: Tensor) -> Tensor:
    return torch.add(log_z, mean, out=out).masked_fill_(~torch.isfinite(log_z), float("nan"))


def _readout_into_fused(log_z: Tensor, mean: Tensor, out: Tensor) -> Tensor:
    return out.copy_(torch.where(torch.isfinite(log_z), log_z + mean, float("nan")))


#: The readout written into an earlier one's memory (``Semiring.readout_into``): one loop, no
#: readout-sized temporary and no copy of it.
_entropy_readout_into = compiled(
    _readout_into_eager,
    _readout_into_fused,
    min_elements=FUSED_MIN_ELEMENTS,
    native=log_space_native.entropy_readout_into,
)


def _mean_eager(total: Tensor, weighted: Tensor, less: Tensor) -> Tensor:
    return weighted.sub_(less).div_(total).masked_fill_(~(total > 0), 0.0)


def _mean_fused(total: Tensor, weighted: Tensor, less: Tensor) -> Tensor:
    # written into ``weighted``, as the eager form does: no third message-sized tensor
    return weighted.copy_(torch.where(total > 0, (weighted - less) / total, 0.0))


#: The mean surprisal (weighted - less) / total, 0 where the total is 0, in one loop (the
#: eager form's four passes over a weight-sized message cost as much as its products).
_mean_kernel = compiled(
    _mean_eager, _mean_fused, min_elements=FUSED_MIN_ELEMENTS, native=log_space_native.entropy_mean
)


def _mean_surprisal(total: Tensor, weighted: Tensor, less: Tensor) -> Tensor:
    """``_mean_kernel``, written into ``weighted``, over flat views (``flat_views``) where the
    operands share a layout (``less`` may be a number, 0-d): called on the tensors themselves,
    each rank and each operand made by another compiled kernel (which carries other dispatch
    keys) was a variant of its own, seven in one process of the benchmark workloads, one short
    of torch.compile's recompilation limit."""
    if total.numel() >= FUSED_MIN_ELEMENTS:
        scalar = less.dim() == 0
        flat = flat_views(total, weighted) if scalar else flat_views(total, weighted, less)
        if flat is not None:
            _mean_kernel(flat[0], flat[1], less if scalar else flat[2])
            return weighted
    return _mean_kernel(total, weighted, less)


def _pair_eager(total: Tensor, weighted: Tensor, less: Tensor, shift: Tensor) -> State:
    mean = _mean_eager(total, weighted, less)
    return log_magnitude_plus_(total, shift), mean


def _pair_fused(total: Tensor, weighted: Tensor, less: Tensor, shift: Tensor) -> State:
    mean = torch.where(total > 0, (weighted - less) / total, 0.0)
    return total.copy_(torch.log(total) + shift), weighted.copy_(mean)


#: Both halves of a product's state, the mean surprisal and log Z, in one loop over the sums,
#: written into them (the two compiled calls before read ``total`` twice and paid two calls'
#: guards: a 384 x 384 weight message's pair 0.13 -> 0.11 ms, a 1536 x 384 one's 0.39 -> 0.31
#: ms, on one core).
_pair = compiled(_pair_eager, _pair_fused, min_elements=FUSED_MIN_ELEMENTS)


def _entropy_pair(
    total: Tensor, weighted: Tensor, shift: Tensor, less: Tensor | None = None
) -> State:
    """(log Z, mean surprisal) from the shifted sums Σ e w and Σ e w R (less Σ e w log w when
    given); ``weighted`` may be overwritten, ``total`` is. Host tensors of one layout with one
    shift (the shared-shift products) take the one-loop kernel over their flat memory, except
    float32 ones where the native loops run (``native_loops``): there the mean's kernel and
    the native log (``log_magnitude_plus_``) are faster than the compiled log in one loop, and
    log Z has the bits every other float32 log-space sum gets."""
    less = torch.zeros((), dtype=total.dtype) if less is None else less
    flat = None
    # below FUSED_MIN_ELEMENTS the kernel's eager form would run; where the native loops run,
    # the native log (log_magnitude_plus_'s) is faster than the kernel
    if total.numel() >= FUSED_MIN_ELEMENTS and not native_loops(total):
        pieces = (total, weighted) if less.numel() == 1 else (total, weighted, less)
        flat = flat_on_host(*pieces)
    if (
        flat is not None
        and isinstance(shift, Tensor)
        and shift.numel() == 1
        and shift.dtype == total.dtype
        and shift.device == total.device
        and less.dtype == total.dtype
    ):
        if less.numel() == 1:
            flat.append(less.reshape(()))
        _pair(*flat, shift.reshape(()))
        return (total, weighted)
    mean = _mean_surprisal(total, weighted, less)
    return (log_magnitude_plus_(total, shift), mean)


def _entropy_product(
    e: Tensor,
    e_r: Tensor | list[Tensor] | None,
    w: Tensor,
    shift: Tensor,
    contract: Callable[[Tensor, Tensor], Tensor] = blas.matmul,
    weighted: Tensor | None = None,
    mags: tuple[Tensor, Tensor] | None = None,
) -> State:
    """(log Z, mean surprisal) of ``e ⊗ w`` with ``e_r = e * R``: three products ``contract``
    (a matmul, or a convolution's sums) of the shifted message with |w| and |w| log|w|.

    Elementwise steps run in place on fresh tensors (same values as the out-of-place
    expressions): the temporaries beside the products are one |w| and one |w| log|w|. By
    matmul the third product is subtracted as BLAS accumulates (``_less_product``). ``e_r``
    given as a one-element list hands over the only reference to it: it is freed once its
    product is taken, before the other two (a linear layer's weight message: a BERT
    feed-forward layer then no longer holds e, e·r and both weight-sized products at once,
    12 MB less at the peak of its Entropy backward). ``weighted``: e·r's product, taken by
    the caller already (``e_r`` is then not read), with ``mags``, ``_magnitudes(w)``.
    """
    mag, mag_log_mag = _magnitudes(w) if mags is None else mags
    if weighted is None:
        weighted = contract(e_r.pop() if isinstance(e_r, list) else e_r, mag)
    total = contract(e, mag)
    if contract is blas.matmul:
        return _entropy_pair(total, _less_product(weighted, e, mag_log_mag), shift)
    return _entropy_pair(total, weighted, shift, contract(e, mag_log_mag))


def _stacked_sums(
    e: Tensor, pair: Tensor | None, x: Tensor, shift: Tensor, over_batch: Contraction
) -> State | None:
    """The message toward the operand that meets ``x`` summed over the batch dim 0 (a linear
    layer's weight: its rows; a convolution's weight: examples and positions) in two sums,
    not three: ``Σ e·r |x| - Σ e |x| log|x|`` is one sum over 2N rows, ``pair = [e·r; e]``
    against ``[|x|; -|x| log|x|]`` (``stacked_magnitudes``), then ``Σ e |x|``. Why: sums over
    few rows (a sentence's 20 tokens, ResNet-18's last stage of 2 x 7 x 7 positions) run far
    below the machine's peak, bound by writing their results, and one sum over twice the rows
    costs little more than one (``benchmarks/bench_kernel_costs.py --only stacked_sums``). Within
    float rounding of the three sums (the terms are added in another order). None where
    ``pair`` or ``x`` has no batch-stacked form. ``over_batch(g, x)``: Σ over dim 0 of g·x."""
    stacked = stacked_magnitudes(x) if pair is not None else None
    if stacked is None:
        return None
    mag = stacked[: x.shape[0]]
    return _entropy_pair(over_batch(e, mag), over_batch(pair, stacked), shift)


def _rows_product(g: Tensor, x: Tensor) -> Tensor:
    """Σ over rows of g·x: ``gᵀ @ x`` ([N, O], [N, I] -> [O, I])."""
    return blas.matmul(g.t(), x)


def _less_product(weighted: Tensor, e: Tensor, right: Tensor) -> Tensor:
    """``weighted - e @ right`` written into ``weighted`` (a fresh product): for matrices (and
    batches of them) BLAS subtracts the product as it accumulates, so no third product-sized
    tensor is built (a BERT feed-forward weight's 9 MB beside the two others at the peak of its
    Entropy backward). The sums round in another order than a separate product and subtraction,
    within float rounding of them."""
    if weighted.dim() == e.dim() == right.dim() == 2:
        return blas.subtract_product(weighted, e, right)
    if weighted.dim() == e.dim() == right.dim() == 3 and e.shape[0] == right.shape[0]:
        return weighted.baddbmm_(e, right, alpha=-1)
    return weighted.sub_(torch.matmul(e, right))


def _magnitudes(w: Tensor) -> tuple[Tensor, Tensor]:
    """``(|w|, |w| log|w|)`` with 0 log 0 = 0, kept across passes for model weights
    (``kernels.weight_cache``): shared, read only."""

    def make() -> tuple[Tensor, Tensor]:
        return abs_and_xlogx(w)

    return WEIGHTS.derived(w, "entropy magnitudes", make)


def _entropy_product_log(e: Tensor, e_r: Tensor, log_w: Tensor, shift: Tensor) -> State:
    """``_entropy_product`` for non-negative weights given as logarithms [..., k, j]: each
    column is scaled to a maximum of 1 first (``|w| = e^c w'``; e^c cancels in the mean)."""
    scaled, c = column_scaled(log_w)
    total, weighted = blas.matmul(e, scaled), blas.matmul(e_r, scaled)
    scaled_log = torch.where(scaled > 0, scaled * log_w, 0.0)
    return _entropy_pair(total, _less_product(weighted, e, scaled_log), shift + c)
