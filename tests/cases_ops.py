"""Op cases checked against the brute-force oracle, shared by the oracle tests and the
rule-coverage test (``test_rule_coverage.py``, which runs each case once).

``CASES``: group norm, transposed convolutions, interpolation, F.unfold/F.fold, F.bilinear,
masked_scatter, index_copy/index_fill, channel shuffle, soft/hard shrink, the margin losses,
3-D pooling, nearest(-exact) upsampling, padding, more losses and activations, structural ops,
and hand-written backwards (``_HandWritten``: a user's ``autograd.Function`` applying ops to the
message that PyTorch's own formulas rarely apply to a gradient) (``test_new_op_rules.py``).
``FUNCTIONS``: one-input functions beyond the model zoo (``test_more_ops.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class OpCase:
    """``fn(*leaves)`` on float64 leaves of the given shapes (a share of exact zeros each)."""

    fn: Callable[..., Tensor]
    shapes: tuple[tuple[int, ...], ...]
    zeros: tuple[float, ...] = ()


def _group_norm(groups: int) -> Callable[..., Tensor]:
    return lambda x, *affine: F.group_norm(x, groups, *affine)


def _interpolate(**kwargs) -> Callable[[Tensor], Tensor]:
    return lambda x: F.interpolate(x, **kwargs)


#: A [3, 4] mask with 8 True entries (2, 2 and 4 per row), and a [1, 5] one that broadcasts.
MASK = torch.tensor([[True, False, True, False], [False, True, True, False], [True] * 4])
ROW_MASK = torch.tensor([[False, True, True, False, True]])
#: Class targets for [3, 4] scores; multilabel rows end at the first -1.
TARGETS = torch.tensor([1, 0, 3])
MULTILABEL = torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3], [2, -1, 0, 0]])
CLASS_WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float64)
#: Probability targets for [2, 3] predictions, the ends 0 and 1 included.
BCE_TARGET = torch.tensor([[0.0, 1.0, 0.3], [1.0, 0.5, 0.0]])


def _index_copy(dim: int, index: list[int]) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda x, src: x.index_copy(dim, torch.tensor(index), src)


def _seeded_dropout(x: Tensor) -> Tensor:
    """``native_dropout`` (no generator argument) with the global RNG seeded and restored, so
    every build of the case draws the same mask and no other test's random stream moves."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.native_dropout(x, 0.4, True)[0]


class _HandWritten(torch.autograd.Function):
    """``forward(x)`` with the hand-written backward ``backward(grad, x_shape)``, as a user's
    ``autograd.Function`` would run it: the backward applies its ops to semipack's message.

    Cases built on it reach the rules for ops that PyTorch's own backward formulas apply to
    a gradient rarely or never (in-place arithmetic, fills, fresh buffers, splits, aliases).
    Each backward is the true VJP of its forward; the oracle reads the Jacobian off the same
    backward, so the check is the rule against the op's own values.
    """

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn, ctx.shape = backward, x.shape
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.shape), None, None


def _hand_written(forward, backward) -> Callable[[Tensor], Tensor]:
    return lambda x: _HandWritten.apply(x, forward, backward)


def _into_fresh(make: Callable[[Tensor, torch.Size], Tensor], start: int = 1):
    """Backward of ``x[start:]`` (or of zeroing ``x[:start]``): a fresh buffer from ``make``
    (a zero message), the gradient's tail copied in."""

    def backward(grad: Tensor, shape: torch.Size) -> Tensor:
        out = make(grad, shape)
        out[start:] = grad[-(shape[0] - start) :]
        return out

    return backward


def _zero_head(x: Tensor) -> Tensor:
    return torch.cat([x[:1] * 0, x[1:]])


def _swap_blocks(x: Tensor) -> Tensor:
    """The last three columns, then the first two."""
    return torch.cat([x[:, 2:], x[:, :2]], 1)


def _unswap(split: Callable[[Tensor], tuple[Tensor, ...]]):
    return lambda grad, shape: torch.cat(split(grad)[::-1], 1)


aten = torch.ops.aten
#: Index and mask tensors for the hand-written backwards.
BAGS = torch.tensor([[0, 2, 2], [1, 3, 0]])
INDEX = torch.tensor([2, 0, 2])
GATHER_INDEX = torch.tensor([[0, 2, 0], [1, 1, 1]])
#: Distinct targets per row (a scatter's result is defined), and a mask with two zeros.
SCATTER_INDEX = torch.tensor([[0, 2], [1, 0]])
TWO_ZEROS = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
SCALES = (2.0, -0.5)
DOT_WITH = (1.0, -2.0, 0.5)


CASES: dict[str, OpCase] = {
    # group norm: rows are (sample, group); gains per channel; any spatial rank
    "group_norm_2_groups_1d": OpCase(_group_norm(2), ((2, 4, 3), (4,), (4,))),
    "group_norm_1_group_2d": OpCase(_group_norm(1), ((2, 2, 2, 3), (2,), (2,))),
    "group_norm_per_channel_3d_no_affine": OpCase(_group_norm(4), ((1, 4, 2, 1, 2),)),
    "group_norm_no_spatial_zero_gain": OpCase(
        _group_norm(2), ((3, 6), (6,), (6,)), zeros=(0.0, 0.4, 0.0)
    ),
    # transposed convolutions: stride, padding, output_padding, dilation, groups
    "conv_transpose2d_bias": OpCase(
        lambda x, w, b: F.conv_transpose2d(x, w, b), ((1, 2, 3, 3), (2, 3, 2, 2), (3,))
    ),
    "conv_transpose2d_strided": OpCase(
        lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
        ((1, 2, 3, 2), (2, 2, 3, 2)),
        zeros=(0.2, 0.2),
    ),
    "conv_transpose1d_groups_dilated": OpCase(
        lambda x, w, b: F.conv_transpose1d(
            x, w, b, stride=3, padding=2, output_padding=1, dilation=2, groups=2
        ),
        ((2, 4, 4), (4, 1, 3), (2,)),
        zeros=(0.2, 0.0, 0.0),
    ),
    "conv_transpose2d_cropping_padding": OpCase(
        lambda x, w: F.conv_transpose2d(x, w, padding=(2, 1), dilation=(1, 2)),
        ((2, 1, 4, 3), (1, 2, 3, 2)),
    ),
    "conv_transpose3d": OpCase(
        lambda x, w: F.conv_transpose3d(x, w, stride=(1, 2, 1), padding=(0, 1, 1)),
        ((1, 1, 2, 2, 3), (1, 2, 2, 2, 2)),
    ),
    # interpolation: each output a fixed combination of input entries
    "linear_scale_2": OpCase(_interpolate(scale_factor=2, mode="linear"), ((1, 2, 3),)),
    "linear_align_corners": OpCase(
        _interpolate(size=7, mode="linear", align_corners=True), ((1, 2, 4),)
    ),
    "bilinear_scale_2": OpCase(_interpolate(scale_factor=2, mode="bilinear"), ((1, 2, 3, 3),)),
    "bilinear_down": OpCase(_interpolate(size=(2, 3), mode="bilinear"), ((1, 1, 5, 4),)),
    "bilinear_recomputed_scale": OpCase(
        _interpolate(scale_factor=1.7, mode="bilinear", recompute_scale_factor=True),
        ((1, 1, 3, 2),),
    ),
    "bicubic_size": OpCase(_interpolate(size=(5, 4), mode="bicubic"), ((1, 2, 3, 3),)),
    "bicubic_align_corners": OpCase(
        _interpolate(size=(5, 7), mode="bicubic", align_corners=True), ((1, 1, 3, 4),)
    ),
    "trilinear": OpCase(
        _interpolate(scale_factor=(2, 1.5, 1), mode="trilinear"), ((1, 1, 2, 2, 3),)
    ),
    "bilinear_antialias_down": OpCase(
        _interpolate(size=(2, 3), mode="bilinear", antialias=True), ((1, 2, 5, 5),)
    ),
    "bilinear_antialias_half": OpCase(
        _interpolate(scale_factor=0.5, mode="bilinear", antialias=True), ((1, 1, 4, 6),)
    ),
    "bicubic_antialias_down": OpCase(
        _interpolate(size=(2, 2), mode="bicubic", antialias=True, align_corners=True),
        ((1, 1, 5, 6),),
    ),
    "bicubic_antialias_width_1": OpCase(
        _interpolate(size=(7, 1), mode="bicubic", antialias=True), ((1, 1, 4, 2),)
    ),
    # F.unfold (im2col; its backward is col2im) and F.fold (col2im; its backward is im2col)
    "unfold": OpCase(lambda x: F.unfold(x, 2), ((1, 2, 3, 3),)),
    "unfold_geometry": OpCase(
        lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)), ((2, 1, 4, 5),)
    ),
    "unfold_unbatched": OpCase(lambda x: F.unfold(x, 2, padding=1), ((2, 3, 3),)),
    "fold": OpCase(lambda x: F.fold(x, (3, 3), 2), ((1, 8, 4),)),
    "fold_geometry": OpCase(
        lambda x: F.fold(x, (4, 5), 2, dilation=(2, 1), padding=1, stride=(1, 2)), ((1, 8, 12),)
    ),
    # F.bilinear: aten._trilinear, once per input in the backward; the bias is an add
    "bilinear_layer": OpCase(F.bilinear, ((3, 2), (3, 4), (5, 2, 4), (5,))),
    "bilinear_same_input_twice": OpCase(lambda x, w: F.bilinear(x, x, w), ((2, 3), (2, 3, 3))),
    "bilinear_batched_zeros": OpCase(
        F.bilinear, ((2, 2, 2), (2, 2, 3), (2, 2, 3)), zeros=(0.0, 0.3, 0.2)
    ),
    # masked_scatter: source entries past the mask's True count reach nothing
    "masked_scatter_spare_source": OpCase(lambda x, s: x.masked_scatter(MASK, s), ((3, 4), (10,))),
    "masked_scatter_exact_source": OpCase(
        lambda x, s: x.masked_scatter(MASK, s), ((3, 4), (8,)), zeros=(0.2, 0.2)
    ),
    "masked_scatter_broadcast_mask": OpCase(
        lambda x, s: x.masked_scatter(ROW_MASK, s), ((2, 3, 5), (4, 5))
    ),
    # index_copy: self loses the copied slices, source is gathered back; index_fill likewise
    "index_copy_dim0": OpCase(_index_copy(0, [3, 1]), ((4, 3), (2, 3))),
    "index_copy_dim1_unsorted": OpCase(_index_copy(1, [4, 0, 2]), ((2, 5, 2), (2, 3, 2))),
    "index_copy_scalar_source": OpCase(_index_copy(0, [2]), ((4,), ())),
    "index_fill_scalar": OpCase(lambda x: x.index_fill(1, torch.tensor([0, 2]), 1.5), ((2, 4),)),
    "index_fill_tensor_value": OpCase(
        lambda x, v: x.index_fill(0, torch.tensor([1, 1, 2]), v), ((3, 2), ())
    ),
    # trace: its backward writes the message into the diagonal of a plain zero tensor
    # (index_fill with a message as the value), square and wide
    "trace_of_square": OpCase(lambda x: torch.trace(x @ x), ((3, 3),)),
    "trace_wide": OpCase(lambda x: torch.trace(x.exp()), ((2, 4),)),
    # channel shuffle (ShuffleNet): a permutation of the channels
    "channel_shuffle": OpCase(lambda x: F.channel_shuffle(x, 3), ((2, 6, 2, 1),)),
    "channel_shuffle_module_1d": OpCase(torch.nn.ChannelShuffle(2), ((1, 4, 3),)),
    # shrink activations: derivative 1 outside [-lambd, lambd], no edge inside
    "softshrink": OpCase(lambda x: F.softshrink(x, 0.5), ((3, 5),), zeros=(0.2,)),
    "hardshrink": OpCase(lambda x: F.hardshrink(x, 0.7), ((3, 5),), zeros=(0.2,)),
    # a learnable PReLU weight: one entry shared by every input entry, or one per channel
    "prelu_shared_weight": OpCase(F.prelu, ((3, 5), (1,)), zeros=(0.2,)),
    "prelu_channel_weights": OpCase(F.prelu, ((2, 3, 2, 2), (3,)), zeros=(0.2,)),
    # margin losses: each score feeds its own sample's loss
    "multi_margin_mean": OpCase(lambda x: F.multi_margin_loss(x, TARGETS), ((3, 4),)),
    "multi_margin_p2_weighted_none": OpCase(
        lambda x: F.multi_margin_loss(
            x, TARGETS, p=2, margin=0.5, weight=CLASS_WEIGHTS.to(x.dtype), reduction="none"
        ),
        ((3, 4),),
    ),
    "multi_margin_unbatched": OpCase(
        lambda x: F.multi_margin_loss(x, torch.tensor(2), reduction="sum"), ((5,),)
    ),
    "multilabel_margin_mean": OpCase(lambda x: F.multilabel_margin_loss(x, MULTILABEL), ((3, 4),)),
    "multilabel_margin_none": OpCase(
        lambda x: F.multilabel_margin_loss(x, MULTILABEL, reduction="none"), ((3, 4),)
    ),
    "multilabel_margin_unbatched": OpCase(
        lambda x: F.multilabel_margin_loss(x, torch.tensor([1, -1, 0])), ((3,),)
    ),
    # 3-D pooling: windows over depth, height and width
    "max_pool3d": OpCase(lambda x: F.max_pool3d(x, 2, stride=1), ((1, 1, 2, 3, 3),)),
    "avg_pool3d_padded": OpCase(
        lambda x: F.avg_pool3d(x, 2, stride=1, padding=1), ((1, 1, 2, 2, 2),), zeros=(0.2,)
    ),
    "adaptive_avg_pool3d": OpCase(
        lambda x: F.adaptive_avg_pool3d(x, (1, 2, 1)), ((1, 1, 2, 3, 2),)
    ),
    "adaptive_max_pool3d": OpCase(
        lambda x: F.adaptive_max_pool3d(x, (1, 2, 1)), ((1, 1, 2, 3, 2),)
    ),
    # nearest and nearest-exact upsampling: each output copies one input entry
    "nearest_exact_1d": OpCase(_interpolate(size=5, mode="nearest-exact"), ((1, 2, 3),)),
    "nearest_exact_2d": OpCase(_interpolate(size=(3, 5), mode="nearest-exact"), ((1, 1, 2, 3),)),
    "nearest_exact_3d": OpCase(
        _interpolate(size=(3, 2, 5), mode="nearest-exact"), ((1, 1, 2, 2, 3),)
    ),
    "nearest_3d": OpCase(_interpolate(size=(3, 2, 5), mode="nearest"), ((1, 1, 2, 2, 3),)),
    # padding: reflected and replicated borders meet their source entries; constant is fresh
    "reflect_pad_2d": OpCase(lambda x: F.pad(x, (1, 2, 2, 0), mode="reflect"), ((1, 1, 3, 3),)),
    "reflect_pad_3d": OpCase(
        lambda x: F.pad(x, (1, 0, 0, 1, 1, 1), mode="reflect"), ((1, 1, 2, 2, 3),)
    ),
    "replicate_pad_1d": OpCase(lambda x: F.pad(x, (2, 1), mode="replicate"), ((1, 2, 3),)),
    "replicate_pad_3d": OpCase(
        lambda x: F.pad(x, (1, 0, 0, 1, 1, 1), mode="replicate"), ((1, 1, 2, 2, 2),)
    ),
    "constant_pad": OpCase(lambda x: F.pad(x, (1, 2), value=0.5), ((2, 3),)),
    # losses
    "binary_cross_entropy": OpCase(
        lambda x: F.binary_cross_entropy(torch.sigmoid(x), BCE_TARGET.to(x.dtype)), ((2, 3),)
    ),
    "binary_cross_entropy_weighted_sum": OpCase(
        lambda x: F.binary_cross_entropy(
            torch.sigmoid(x),
            BCE_TARGET.to(x.dtype),
            weight=torch.tensor([0.5, 2.0, 1.0], dtype=x.dtype),
            reduction="sum",
        ),
        ((2, 3),),
    ),
    "huber_loss": OpCase(lambda x, y: F.huber_loss(x, y, delta=0.7), ((2, 3), (2, 3))),
    "smooth_l1_loss": OpCase(
        lambda x, y: F.smooth_l1_loss(x, y, beta=0.7, reduction="sum"), ((2, 3), (2, 3))
    ),
    "nll_loss_2d": OpCase(
        lambda x: F.nll_loss(x.log_softmax(1), torch.tensor([[[0, 1], [2, 2]]])), ((1, 3, 2, 2),)
    ),
    "soft_margin_loss": OpCase(
        lambda x: F.soft_margin_loss(x, torch.tensor([[1.0, -1, 1], [-1, 1, 1]], dtype=x.dtype)),
        ((2, 3),),
    ),
    # activations with flat pieces or saturating tails
    "hardtanh": OpCase(lambda x: F.hardtanh(x, -0.5, 0.8), ((3, 4),)),
    "hardsigmoid": OpCase(lambda x: F.hardsigmoid(x * 3), ((3, 4),)),
    "hardswish": OpCase(lambda x: F.hardswish(x * 3), ((3, 4),)),
    "mish": OpCase(F.mish, ((3, 4),)),
    "log_sigmoid": OpCase(F.logsigmoid, ((3, 4),), zeros=(0.2,)),
    "logit_eps": OpCase(lambda x: torch.logit(torch.sigmoid(x) * 0.9 + 0.05, eps=0.1), ((3, 4),)),
    "native_dropout": OpCase(_seeded_dropout, ((3, 4),)),
    # structural ops and their backward ops
    "diagonal": OpCase(lambda x: x.diagonal(1), ((3, 4),)),
    "diag_embed": OpCase(torch.diag_embed, ((2, 3),)),
    "diagonal_scatter": OpCase(lambda x, s: torch.diagonal_scatter(x, s, 1), ((3, 4), (3,))),
    "select_scatter": OpCase(lambda x, s: torch.select_scatter(x, s, 1, 0), ((2, 3), (2,))),
    "slice_scatter": OpCase(lambda x, s: torch.slice_scatter(x, s, 1, 0, 2), ((2, 3), (2, 2))),
    "roll": OpCase(lambda x: x.roll(1, 1), ((2, 3),)),
    "triu": OpCase(lambda x: x.triu(1), ((3, 3),)),
    "pixel_unshuffle": OpCase(lambda x: F.pixel_unshuffle(x, 2), ((1, 1, 2, 4),)),
    "scatter_add": OpCase(lambda x, s: x.scatter_add(1, GATHER_INDEX, s), ((2, 3), (2, 3))),
    # the overwritten entries of x have no path (aten.scatter.value in the backward)
    "scatter": OpCase(lambda x, s: x.scatter(1, SCATTER_INDEX, s), ((2, 3), (2, 2))),
    "scatter_reduce_sum_without_self": OpCase(
        lambda x, s: x.scatter_reduce(1, SCATTER_INDEX, s, "sum", include_self=False),
        ((2, 3), (2, 2)),
    ),
    # a mean's backward counts the inputs in ones_like(grad) or zeros_like(grad): plain counts
    # (trial 121: refused, or MessageLostError without self)
    "scatter_reduce_mean": OpCase(
        lambda x, s: x.scatter_reduce(1, SCATTER_INDEX, s, "mean"), ((2, 3), (2, 2))
    ),
    "scatter_reduce_mean_without_self": OpCase(
        lambda x, s: x.scatter_reduce(1, SCATTER_INDEX, s, "mean", include_self=False),
        ((2, 3), (2, 2)),
    ),
    "index_reduce_mean": OpCase(
        lambda x, s: x.index_reduce(0, torch.tensor([0, 0, 2]), s, "mean"), ((3, 2), (3, 2))
    ),
    "index_reduce_mean_without_self": OpCase(
        lambda x, s: x.index_reduce(0, torch.tensor([0, 0, 2]), s, "mean", include_self=False),
        ((3, 2), (3, 2)),
    ),
    # PyTorch's backward creates a zero tensor (every partial derivative is 0): no path
    "prod_over_two_zeros": OpCase(lambda x: (x * TWO_ZEROS).prod() + x[1].sum(), ((2, 3),)),
    "pow_zero": OpCase(lambda x: x.pow(0) * 2.0 + x, ((2, 3),)),
    "index_put_accumulate": OpCase(
        lambda x, v: x.index_put((torch.tensor([0, 0]),), v, accumulate=True), ((3, 2), (2, 2))
    ),
    "index_select": OpCase(lambda x: x.index_select(0, INDEX), ((3, 2),)),
    # bags [0, 2, 2] and [1, 3, 0]: row 2 twice in one bag is one Jacobian entry of weight 2
    "embedding_bag_mean": OpCase(lambda w: F.embedding_bag(BAGS, w, mode="mean").tanh(), ((4, 3),)),
    "embedding_bag_max": OpCase(lambda w: F.embedding_bag(BAGS, w, mode="max").tanh(), ((4, 3),)),
    "embedding_bag_weighted": OpCase(
        lambda w, p: F.embedding_bag(BAGS, w, mode="sum", per_sample_weights=p).tanh(),
        ((4, 3), (2, 3)),
    ),
    "mv": OpCase(torch.mv, ((2, 3), (3,))),
    # hand-written backwards (a user's autograd.Function) applying ops to the message
    "hw_add_scalar": OpCase(
        _hand_written(lambda x: x + 0.5, lambda g, s: aten.add.Scalar(g, 0)), ((2, 3),)
    ),
    "hw_sub_scalar": OpCase(
        _hand_written(lambda x: x - 0.5, lambda g, s: aten.sub.Scalar(g, 0)), ((2, 3),)
    ),
    "hw_sub_zero_tensor": OpCase(
        _hand_written(lambda x: x - 0.5, lambda g, s: g - torch.zeros(s, dtype=g.dtype)), ((2, 3),)
    ),
    "hw_add_": OpCase(
        _hand_written(lambda x: x + x.flip(0), lambda g, s: g.clone().add_(g.flip(0))), ((2, 3),)
    ),
    "hw_mul_tensor_": OpCase(
        _hand_written(
            lambda x: x * torch.tensor(SCALES, dtype=x.dtype),
            lambda g, s: g.clone().mul_(torch.tensor(SCALES, dtype=g.dtype)),
        ),
        ((3, 2),),
    ),
    "hw_mul_scalar_": OpCase(
        _hand_written(lambda x: x * 2.5, lambda g, s: aten.mul_.Scalar(g.clone(), 2.5)), ((3, 2),)
    ),
    "hw_div_tensor_": OpCase(
        _hand_written(
            lambda x: x / torch.tensor(SCALES, dtype=x.dtype),
            lambda g, s: g.clone().div_(torch.tensor(SCALES, dtype=g.dtype)),
        ),
        ((3, 2),),
    ),
    "hw_div_scalar_": OpCase(
        _hand_written(lambda x: x / 4.0, lambda g, s: aten.div_.Scalar(g.clone(), 4.0)), ((3, 2),)
    ),
    "hw_neg_": OpCase(_hand_written(lambda x: -x, lambda g, s: g.clone().neg_()), ((3, 2),)),
    "hw_alias": OpCase(_hand_written(lambda x: x * 1, lambda g, s: aten.alias(g)), ((3, 2),)),
    "hw_lift_fresh": OpCase(
        _hand_written(lambda x: x * 1, lambda g, s: aten.lift_fresh(g)), ((3, 2),)
    ),
    # a copying cast (a cast to float32 keeps float32 states, which round: test_float32_exact)
    "hw_to_copy": OpCase(
        _hand_written(lambda x: x * 1, lambda g, s: g.to(torch.float64, copy=True)), ((3, 2),)
    ),
    "hw_detach": OpCase(_hand_written(lambda x: x * 1, lambda g, s: g.detach()), ((3, 2),)),
    "hw_isnan_check": OpCase(
        _hand_written(lambda x: x * 2, lambda g, s: torch.where(torch.isnan(g), 0.0, g) * 2),
        ((3, 2),),
    ),
    "hw_reshape_alias": OpCase(
        _hand_written(lambda x: x.reshape(6), lambda g, s: aten._reshape_alias(g, [3, 2], [2, 1])),
        ((3, 2),),
    ),
    "hw_unfold": OpCase(
        _hand_written(lambda x: x.reshape(6), lambda g, s: g.unfold(0, 2, 2)), ((3, 2),)
    ),
    "hw_dot": OpCase(
        _hand_written(
            lambda x: x * torch.tensor(DOT_WITH, dtype=x.dtype),
            lambda g, s: torch.dot(g, torch.tensor(DOT_WITH, dtype=g.dtype)),
        ),
        ((),),
    ),
    "hw_new_empty_zero_": OpCase(
        _hand_written(lambda x: x[1:], _into_fresh(lambda g, s: g.new_empty(s).zero_())), ((4,),)
    ),
    "hw_new_empty_fill_tensor": OpCase(
        _hand_written(
            lambda x: x[1:], _into_fresh(lambda g, s: g.new_empty(s).fill_(torch.tensor(0.0)))
        ),
        ((4,),),
    ),
    "hw_new_full": OpCase(
        _hand_written(lambda x: x[1:], _into_fresh(lambda g, s: g.new_full(s, 0.0))), ((4,),)
    ),
    "hw_empty_like_fill_": OpCase(
        _hand_written(_zero_head, _into_fresh(lambda g, s: torch.empty_like(g).fill_(0))), ((4,),)
    ),
    "hw_full_like": OpCase(
        _hand_written(_zero_head, _into_fresh(lambda g, s: torch.full_like(g, 0.0))), ((4,),)
    ),
    "hw_index_add": OpCase(
        _hand_written(
            lambda x: x.index_select(0, INDEX), lambda g, s: g.new_zeros(s).index_add(0, INDEX, g)
        ),
        ((3, 2),),
    ),
    "hw_scatter_add_": OpCase(
        _hand_written(
            lambda x: x.gather(1, GATHER_INDEX),
            lambda g, s: g.new_zeros(s).scatter_add_(1, GATHER_INDEX, g),
        ),
        ((2, 3),),
    ),
    "hw_index_fill_tensor": OpCase(
        _hand_written(
            lambda x: x.index_fill(0, INDEX, 0.0),
            lambda g, s: g.index_fill(0, INDEX, torch.tensor(0.0)),
        ),
        ((3, 2),),
    ),
    # a message base filled with a message of one entry (what trace's formula does to zeros)
    "hw_index_fill_message_value": OpCase(
        _hand_written(
            lambda x: torch.cat([x.index_fill(0, torch.tensor([0, 2]), 0.0), x[:1] + x[2:3]]),
            lambda g, s: g[:-1].index_fill(0, torch.tensor([0, 2]), g[-1]),
        ),
        ((4,),),
    ),
    "hw_index_fill_scalar_": OpCase(
        _hand_written(
            lambda x: x.index_fill(0, INDEX, 0.0), lambda g, s: g.clone().index_fill_(0, INDEX, 0.0)
        ),
        ((3, 2),),
    ),
    "hw_index_fill_tensor_": OpCase(
        _hand_written(
            lambda x: x.index_fill(0, INDEX, 0.0),
            lambda g, s: g.clone().index_fill_(0, INDEX, torch.tensor(0.0)),
        ),
        ((3, 2),),
    ),
    "hw_index_put_": OpCase(
        _hand_written(
            lambda x: x.index_fill(0, INDEX, 0.0),
            lambda g, s: g.clone().index_put_((INDEX,), torch.zeros(2, dtype=g.dtype)),
        ),
        ((3, 2),),
    ),
    "hw_masked_fill_tensor": OpCase(
        _hand_written(
            lambda x: x.masked_fill(MASK, 0.0), lambda g, s: g.masked_fill(MASK, torch.tensor(0.0))
        ),
        ((3, 4),),
    ),
    "hw_masked_fill_tensor_": OpCase(
        _hand_written(
            lambda x: x.masked_fill(MASK, 0.0),
            lambda g, s: g.clone().masked_fill_(MASK, torch.tensor(0.0)),
        ),
        ((3, 4),),
    ),
    "hw_repeat": OpCase(
        _hand_written(lambda x: x.reshape(2, 3).sum(0), lambda g, s: g.repeat(2)), ((6,),)
    ),
    "hw_split": OpCase(_hand_written(_swap_blocks, _unswap(lambda g: g.split(3, 1))), ((2, 5),)),
    "hw_split_with_sizes": OpCase(
        _hand_written(_swap_blocks, _unswap(lambda g: g.split([3, 2], 1))), ((2, 5),)
    ),
    "hw_unsafe_split": OpCase(
        _hand_written(_swap_blocks, _unswap(lambda g: g.unsafe_split(3, 1))), ((2, 5),)
    ),
    "hw_unbind": OpCase(
        _hand_written(lambda x: x.flip(0), lambda g, s: torch.stack(g.unbind(0)[::-1])), ((3, 2),)
    ),
    "hw_native_channel_shuffle": OpCase(
        _hand_written(
            lambda x: F.channel_shuffle(x, 2), lambda g, s: torch.native_channel_shuffle(g, 3)
        ),
        ((1, 6, 2),),
    ),
}


def case_leaves(case: OpCase, dtype: torch.dtype = torch.float64) -> list[Tensor]:
    out = []
    for i, shape in enumerate(case.shapes):
        gen = torch.Generator().manual_seed(10 + i)
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        share = case.zeros[i] if i < len(case.zeros) else 0.0
        t = torch.where(torch.rand(shape, generator=gen) < share, 0.0, t)
        out.append(t.to(dtype).requires_grad_(True))
    return out


def weighted_loss(case: OpCase, leaves: list[Tensor]) -> Tensor:
    out = case.fn(*leaves)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return (out * weights.to(out.device, out.dtype)).sum()


# --- one-input functions ----------------------------------------------------------------------


def function_leaf(*shape, seed=0):
    """The float64 input of a ``FUNCTIONS`` entry (or of any test): seeded, requiring grad."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)


def _slice_assign(x):
    y = x * 1.5
    y[:, 1] = x[:, 2] * 2
    return y


FUNCTIONS = {
    "reflect_pad": (lambda x: F.pad(x, (2, 1), mode="reflect"), (1, 2, 4)),
    "replicate_pad_2d": (lambda x: F.pad(x, (1, 2, 2, 0), mode="replicate"), (1, 1, 3, 3)),
    "nearest_upsample": (lambda x: F.interpolate(x, scale_factor=2), (1, 1, 2, 3)),
    "nearest_upsample_odd": (lambda x: F.interpolate(x, size=(5,), mode="nearest"), (1, 2, 3)),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), (1, 4, 2, 2)),
    # rot90's backward is rot90 the other way (trial 54: it had no rule)
    "rot90": (lambda x: torch.rot90(x * x.sum(), 1, (0, 1)), (2, 3)),
    "rot90_thrice": (lambda x: torch.rot90(x, -3, (1, 2)).cumsum(1), (2, 2, 3)),
    "tril": (lambda x: (x @ x.t()).tril(-1), (3, 2)),
    "glu": (lambda x: F.glu(x, -1), (2, 4)),
    "rrelu_eval": (lambda x: F.rrelu(x, 0.1, 0.3), (2, 5)),  # slope 0.2 below 0
    "rrelu_training": (lambda x: F.rrelu(x, 0.1, 0.3, training=True), (3, 4)),  # one per entry
    "prelu": (lambda x: F.prelu(x, torch.tensor([0.3, -2.0], dtype=torch.float64)), (2, 2, 3)),
    "masked_select": (
        lambda x: x.masked_select(torch.tensor([[True, False, True], [False, True, True]])),
        (2, 3),
    ),
    "cumsum": (lambda x: x.cumsum(1), (2, 4)),
    "tensor_unfold": (lambda x: x.unfold(1, 3, 1), (2, 5)),
    "slice_assignment": (_slice_assign, (2, 3)),
    "index_with_slice": (lambda x: x[:, torch.tensor([0, 2, 2])], (2, 3)),
    "integer_division": (lambda x: x / torch.tensor(3), (2, 3)),
    "cumprod": (lambda x: x.cumprod(1), (2, 3)),
    "sort_topk": (lambda x: x.sort(1).values[:, :2] * x.topk(2).values, (2, 4)),
    "norm": (lambda x: x.norm(dim=1), (3, 4)),
    "conv3d": (
        lambda x: F.conv3d(
            x,
            torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(2, 1, 2, 2, 2),
            stride=(1, 2, 1),
            padding=1,
        ),
        (1, 1, 3, 3, 3),
    ),
    "depthwise_conv2d": (
        lambda x: F.conv2d(
            x,
            torch.linspace(-1, 1, 27, dtype=torch.float64).reshape(3, 1, 3, 3),
            padding=1,
            groups=3,
        ),
        (1, 3, 3, 4),
    ),
    "grouped_conv2d": (
        lambda x: F.conv2d(
            x,
            torch.linspace(-1, 2, 32, dtype=torch.float64).reshape(4, 2, 2, 2),
            stride=(1, 2),
            groups=2,
        ),
        (2, 4, 3, 4),
    ),
    "instance_norm": (lambda x: F.instance_norm(x), (2, 2, 5)),
    "rms_norm": (lambda x: F.rms_norm(x, (4,)), (3, 4)),
    "max_pool1d": (lambda x: F.max_pool1d(x, 2, stride=1), (1, 2, 5)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 3, stride=2, padding=1), (1, 2, 6)),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, 2), (1, 1, 3, 5)),
    "elementwise_math": (
        lambda x: x.exp() * x.sin() + x.abs().sqrt() - torch.erf(x) + x.pow(3),
        (2, 3),
    ),
    "reductions": (lambda x: torch.stack([x.prod(1), x.amax(1), x.logsumexp(1), x.std(1)]), (3, 4)),
    # negative dims reach the exact-product path with autograd's unsigned saved dims (3-d, 5-d)
    "logsumexp_negative_dim_3d": (lambda x: x.logsumexp(-1), (2, 3, 2)),
    "logsumexp_two_negative_dims_3d": (lambda x: x.logsumexp((-1, -3)), (2, 3, 2)),
    "logsumexp_negative_dim_5d": (lambda x: x.logsumexp(-2), (1, 2, 1, 3, 2)),
    "clamp_where": (lambda x: x.clamp(-0.5, 0.5) + torch.where(x > 0, x, 0.0), (2, 4)),
}
