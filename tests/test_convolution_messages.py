"""Convolution messages one tap at a time equal the im2col window-map reference, every semiring."""

from __future__ import annotations

import math

import pytest
import torch
from conv_reference import window_map_messages
from torch import nn

import semipack
from semipack.messages.windows import ConvGeometry
from semipack.rules.convolution import per_tap_messages

SEMIRINGS = [
    semipack.Real(),
    semipack.MaxProd(),
    semipack.SignedMaxProd(),
    semipack.LogSum(),
    semipack.LogCount(),
    semipack.Entropy(),
    semipack.Boolean(),
]

GEOMETRIES = {
    "conv2d_padded": dict(x=(2, 4, 6, 5), w=(6, 4, 3, 3), stride=1, padding=1, dilation=1),
    "strided_dilated_groups": dict(
        x=(2, 4, 9, 8), w=(6, 2, 3, 2), stride=(2, 1), padding=(2, 0), dilation=(2, 3), groups=2
    ),
    "conv1d": dict(x=(3, 2, 11), w=(5, 2, 4), stride=3, padding=2, dilation=1),
    "depthwise": dict(x=(2, 3, 5, 5), w=(3, 1, 3, 3), stride=1, padding=0, dilation=1, groups=3),
    "depthwise_multiplier": dict(
        x=(2, 3, 6, 5), w=(6, 1, 3, 2), stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=3
    ),
    "conv3d": dict(x=(1, 2, 4, 5, 3), w=(3, 2, 2, 3, 2), stride=1, padding=(1, 0, 1), dilation=1),
}


def _tensors(geometry: dict, dtype: torch.dtype, sr):
    gen = torch.Generator().manual_seed(11)

    def draw(shape):
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        return torch.where(torch.rand(shape, generator=gen) < 0.2, 0.0, t).to(dtype)

    x, w = draw(geometry["x"]), draw(geometry["w"])
    conv = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d}.get(
        x.dim(), torch.nn.functional.conv3d
    )
    groups = geometry.get("groups", 1)
    out = conv(x, w, None, geometry["stride"], geometry["padding"], geometry["dilation"], groups)
    # An output message: the lift of random edge weights (zeros: entries without a path).
    m = sr.lift(draw(out.shape) * 3)
    return x, w, m, groups


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_tap_messages_equal_the_window_maps(semiring, geometry: str, dtype) -> None:
    g = GEOMETRIES[geometry]
    x, w, m, groups = _tensors(g, dtype, semiring)
    geometry = ConvGeometry.of(x.dim() - 2, g["stride"], g["padding"], g["dilation"], groups)
    args = (semiring, m, x, w, geometry, (True, True, True))
    exact = isinstance(semiring, (semipack.MaxProd, semipack.SignedMaxProd, semipack.Boolean))
    tol = {} if not exact else {"rtol": 0, "atol": 0}
    if not exact and dtype == torch.float32:
        tol = {"rtol": 1e-5, "atol": 1e-5}
    for got, want in zip(per_tap_messages(*args), window_map_messages(*args), strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            if isinstance(semiring, semipack.Entropy) and a is got[1]:
                live = torch.isfinite(got[0])
                a, b = a[live], b[live]
            torch.testing.assert_close(a, b, equal_nan=True, **tol)


@pytest.mark.parametrize(
    "geometry", ["strided_dilated_groups", "depthwise", "depthwise_multiplier"]
)
def test_grouped_top_path_successors_equal_the_window_maps(geometry: str) -> None:
    """TopPath through grouped convolutions: the best value and the successor id it came from
    agree with the window maps wherever a path exists (successor ids are distinct per entry)."""
    sr = semipack.TopPath()
    g = GEOMETRIES[geometry]
    x, w, m, groups = _tensors(g, torch.float64, sr)
    m = (m[0], torch.arange(m[0].numel()).reshape(m[0].shape))
    geometry = ConvGeometry.of(x.dim() - 2, g["stride"], g["padding"], g["dilation"], groups)
    args = (sr, m, x, w, geometry, (True, True, True))
    for got, want in zip(per_tap_messages(*args), window_map_messages(*args), strict=True):
        (value, successor), (want_value, want_successor) = got, want
        assert torch.equal(value, want_value)
        live = torch.isfinite(value)
        assert torch.equal(
            successor.expand(value.shape)[live], want_successor.expand(value.shape)[live]
        )


@pytest.mark.parametrize(("c_g", "matmuls"), [(2, 1), (1, 0)])
def test_grouped_convolution_takes_one_matmul_per_tap(monkeypatch, c_g: int, matmuls: int):
    """A grouped convolution's messages are batched over its groups: one semiring matmul per
    kernel tap and direction (input, weight), however many groups. (One per group and tap made
    MobileNetV3's MaxProd backward 13 s instead of 0.2 s.) A depthwise one (one input channel
    per group) takes none: its products are elementwise (a matmul of inner size 1 cost as much
    as a dense convolution 96 times larger)."""
    sr = semipack.MaxProd()
    calls = []
    for name in ("matmul", "matmul_lifted"):  # both directions multiply by lifted W and x
        product = getattr(sr, name)
        monkeypatch.setattr(
            sr, name, lambda a, b, product=product, name=name: calls.append(name) or product(a, b)
        )
    channels, kernel = 16, (3, 3)
    x = torch.randn(2, channels, 6, 6)
    w = torch.randn(channels, c_g, *kernel)
    m = sr.lift(torch.randn(2, channels, 6, 6))
    geometry = ConvGeometry.of(2, 1, 1, 1, channels // c_g)
    per_tap_messages(sr, m, x, w, geometry, (True, True, False))
    taps = kernel[0] * kernel[1]
    assert calls.count("matmul") == 0
    assert calls.count("matmul_lifted") == 2 * matmuls * taps


#: name -> (x shape, w shape, stride, padding, dilation)
DEPTHWISE = {
    "3x3_padded": ((2, 5, 9, 11), (5, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    "5x5_wide_rows": ((1, 4, 14, 21), (4, 1, 5, 5), (1, 1), (2, 2), (1, 1)),
    "rows_of_40_multiplier": ((1, 2, 5, 38), (4, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    "strided_rows_only": ((1, 3, 11, 19), (3, 1, 3, 3), (2, 1), (1, 1), (1, 1)),
    "nine_taps_per_row": ((1, 2, 4, 20), (2, 1, 1, 9), (1, 1), (0, 4), (1, 1)),
    "strided": ((2, 3, 13, 12), (3, 1, 3, 3), (2, 2), (1, 1), (1, 1)),
    "dilated_multiplier": ((2, 3, 10, 19), (6, 1, 3, 2), (1, 1), (2, 1), (2, 3)),
    "strided_columns_only": ((1, 2, 8, 17), (4, 1, 2, 3), (1, 2), (0, 1), (1, 1)),
    # rows whose last columns take one to four vectors of the gather (33 = 32 + 1 column:
    # a single vector ending at the row's end; 9, 17, 25, 31: two, three, four, four)
    "gather_tail_33": ((2, 3, 6, 31), (3, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    "gather_tail_9": ((1, 2, 5, 7), (4, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    "gather_tail_17": ((1, 2, 5, 13), (2, 1, 5, 5), (1, 1), (2, 2), (1, 1)),
    "gather_tail_25_multiplier": ((1, 2, 4, 23), (6, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    "gather_tail_31_dilated": ((1, 2, 9, 27), (2, 1, 3, 3), (1, 1), (2, 2), (2, 2)),
    # every tap count of a kernel row that the weight kernel unrolls, rows of 16+ columns
    "seven_taps_per_row": ((2, 2, 6, 40), (2, 1, 2, 7), (1, 1), (0, 3), (1, 1)),
    "eight_taps_per_row": ((1, 3, 5, 37), (3, 1, 1, 8), (1, 1), (0, 0), (1, 1)),
    "six_taps_dilated": ((1, 2, 5, 50), (2, 1, 2, 6), (1, 1), (0, 5), (1, 2)),
    # strided layers run as stride-1 problems, one per phase (rules/depthwise.py): phases with
    # rows of 8+ columns, unused last rows and columns, more phases than kernel taps (the 1 x 1
    # and 2 x 1 kernels at stride 2 and 3 leave phases no tap reads), odd and even kernels
    "strided_5x5_wide": ((2, 3, 29, 37), (3, 1, 5, 5), (2, 2), (2, 2), (1, 1)),
    "strided_3x3_wide_multiplier": ((1, 2, 20, 41), (4, 1, 3, 3), (2, 2), (1, 1), (1, 1)),
    "strided_3x3_unused_edge": ((2, 3, 12, 36), (3, 1, 3, 3), (2, 2), (0, 0), (1, 1)),
    "strided_1x1": ((1, 3, 9, 34), (3, 1, 1, 1), (2, 2), (0, 0), (1, 1)),
    "stride_3_kernel_2x1": ((1, 2, 13, 52), (2, 1, 2, 1), (3, 3), (1, 0), (1, 1)),
    "stride_3_by_2_kernel_4x4": ((1, 2, 17, 45), (2, 1, 4, 4), (3, 2), (1, 2), (1, 1)),
    "strided_dilated": ((1, 2, 15, 40), (2, 1, 3, 3), (2, 2), (2, 2), (2, 2)),
    "strided_one_row": ((2, 2, 1, 30), (2, 1, 3, 3), (2, 2), (1, 1), (1, 1)),
    # stride 2, one output channel per input channel, rows of 16+ inputs: the stride-2 input
    # kernel (an even kernel, rows of exactly 16, a 7 x 7 kernel on odd sizes)
    "stride_2_even_kernel_4x4": ((1, 2, 18, 19), (2, 1, 4, 4), (2, 2), (1, 2), (1, 1)),
    "stride_2_rows_of_16": ((2, 2, 7, 16), (2, 1, 3, 3), (2, 2), (1, 1), (1, 1)),
    "stride_2_7x7_odd_sizes": ((1, 3, 21, 23), (3, 1, 7, 7), (2, 2), (3, 3), (1, 1)),
    # small planes with whole vectors of channels take the channels-last kernel
    # (depthwise_channels.c): two vectors at a time and a last single one (24 channels),
    # strides, dilations, eight taps in a row, a tall kernel
    "channels_7x7_5x5": ((2, 24, 7, 7), (24, 1, 5, 5), (1, 1), (2, 2), (1, 1)),
    "channels_strided": ((2, 16, 9, 11), (16, 1, 3, 3), (2, 2), (1, 1), (1, 1)),
    "channels_dilated_strided": ((1, 8, 10, 6), (8, 1, 3, 2), (2, 1), (2, 1), (2, 3)),
    "channels_eight_taps": ((2, 32, 5, 12), (32, 1, 1, 8), (1, 1), (0, 3), (1, 1)),
    "channels_tall_kernel": ((1, 40, 13, 4), (40, 1, 7, 1), (1, 1), (3, 0), (1, 1)),
    "channels_with_multiplier": ((1, 8, 6, 6), (16, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
}


@pytest.mark.parametrize("data", ["random", "ties"])
@pytest.mark.parametrize("semiring", [semipack.MaxProd(), semipack.TopPath()], ids=repr)
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, False)])
@pytest.mark.parametrize("name", DEPTHWISE)
def test_native_depthwise_max_plus_equals_the_per_tap_path(
    name: str, mask, semiring, data: str
) -> None:
    """The native depthwise kernel gives the per-tap path's MaxProd and TopPath messages bit for
    bit, TopPath's successor ids included, with exact zeros in x and w (no edge) and messages
    without a path (-inf). With "ties", x and w take a few powers of two and m integers, so most
    maxima are reached by several candidates (taps, multiplier channels, positions): the ids
    must be those of the first candidate in the per-tap path's order."""
    from semipack.kernels.native import native_available
    from semipack.rules.convolution import depthwise_max_plus

    if not native_available():
        pytest.skip("no native kernels here")
    x, w, geometry, state = _native_case(DEPTHWISE[name], True, data, semiring, seed=5)
    native = depthwise_max_plus(semiring, state, x, w, geometry, mask)
    _assert_same_messages(native, per_tap_messages(semiring, state, x, w, geometry, mask))


def _native_case(case, depthwise: bool, data: str, semiring, seed: int):
    """x, w, geometry and an output state of one convolution ``case`` (x shape, w shape,
    stride, padding, dilation) for the native paths' tests: exact zeros in x and w (no edge),
    a channel of x without edges (its weight taps have no path: TopPath's id at position 0),
    integer messages (ties) with some -inf (no path). With "ties", x and w take a few powers
    of two, so their logarithms are few and sums tie often."""
    x_shape, w_shape, stride, padding, dilation = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=gen)
    x[x.abs() < 0.3] = 0.0
    w = torch.randn(w_shape, generator=gen)
    w.view(-1)[:: 7 if depthwise else 5] = 0.0
    if data == "ties":
        x = x.sign() * 2.0 ** torch.randint(-1, 2, x_shape, generator=gen).float()
        w = w.sign() * 2.0 ** torch.randint(-1, 2, w_shape, generator=gen).float()
    x[:, -1] = 0.0
    groups = x.shape[1] // w.shape[1]  # depthwise: one input channel per group
    geometry = ConvGeometry.of(2, stride, padding, dilation, groups)
    out = torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, groups)
    m = (torch.randn(out.shape, generator=gen) * 3).round()
    m[m < -2.5] = float("-inf")
    state = (m, _ids(m.shape)) if isinstance(semiring, semipack.TopPath) else (m,)
    return x, w, geometry, state


def _assert_same_messages(native, reference) -> None:
    """The native path's (input, weight, bias) messages equal the reference's, bit for bit."""
    assert native is not None
    for got, want in zip(native, reference, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert len(got) == len(want)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


#: name -> (x shape, w shape, stride, padding, dilation) of dense convolutions over few input
#: channels, which take the depthwise kernels with a channel multiplier
FEW_CHANNELS = {
    "rgb_stem_7x7_strided": ((2, 3, 20, 22), (8, 3, 7, 7), (2, 2), (3, 3), (1, 1)),
    "two_channels_3x3": ((1, 2, 9, 17), (5, 2, 3, 3), (1, 1), (1, 1), (1, 1)),
    "four_channels_dilated": ((2, 4, 11, 12), (3, 4, 3, 2), (1, 1), (2, 1), (2, 2)),
    "patches_4x4": ((1, 3, 16, 20), (6, 3, 4, 4), (4, 4), (0, 0), (1, 1)),
    "three_channels_narrow_plane": ((1, 3, 6, 6), (16, 3, 3, 3), (1, 1), (1, 1), (1, 1)),
    # grouped: k input and M output channels per group (ResNeXt's 4 per group, RegNet's 8 and
    # 16), strided and dilated, more outputs than inputs per group, a narrow plane
    "groups_of_4_resnext": ((2, 16, 9, 12), (16, 4, 3, 3), (1, 1), (1, 1), (1, 1)),
    "groups_of_2_strided": ((1, 8, 13, 19), (12, 2, 3, 3), (2, 2), (1, 1), (1, 1)),
    "groups_of_8_dilated": ((1, 16, 10, 17), (6, 8, 3, 2), (1, 1), (2, 1), (2, 2)),
    "groups_of_16": ((1, 32, 6, 9), (4, 16, 3, 3), (1, 1), (1, 1), (1, 1)),
    "groups_of_3_narrow_plane": ((2, 6, 5, 5), (16, 3, 3, 3), (1, 1), (1, 1), (1, 1)),
}


@pytest.mark.parametrize("data", ["random", "ties"])
@pytest.mark.parametrize("semiring", [semipack.MaxProd(), semipack.TopPath()], ids=repr)
@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False), (True, False, True)])
@pytest.mark.parametrize("name", FEW_CHANNELS)
def test_dense_convolutions_over_few_channels_equal_the_per_tap_path(
    name: str, mask, semiring, data: str
) -> None:
    """A dense convolution over up to four input channels (an image stem), or a grouped one
    over up to 16 per group, runs as a depthwise one with a channel multiplier: the same
    values and TopPath ids as the per-tap products, bit for bit, with ties, exact zeros and
    messages without a path."""
    from semipack.kernels.native import native_available
    from semipack.rules.depthwise import few_channels_max_plus

    if not native_available():
        pytest.skip("no native kernels here")
    x, w, geometry, state = _native_case(FEW_CHANNELS[name], False, data, semiring, seed=7)
    native = few_channels_max_plus(semiring, state, x, w, geometry, mask)
    _assert_same_messages(native, per_tap_messages(semiring, state, x, w, geometry, mask))


def test_dense_convolutions_the_few_channels_route_declines() -> None:
    """Where the per-tap products are the better route (or the only one): more than four
    input channels, more than 16 per group, a stride of more than 16 phases (a ViT's 16 x 16
    patches), a stride with dilation (no phases), another algebra."""
    from semipack.rules.depthwise import few_channels_max_plus

    def declined(x_shape, w_shape, stride, dilation, groups=1, sr=None) -> bool:
        x, w = torch.randn(x_shape), torch.randn(w_shape)
        geometry = ConvGeometry.of(2, stride, 0, dilation, groups)
        out = torch.nn.functional.conv2d(x, w, None, stride, 0, dilation, groups)
        state = (torch.randn(out.shape),)
        mask = (True, True, False)
        return few_channels_max_plus(sr or semipack.MaxProd(), state, x, w, geometry, mask) is None

    assert declined((1, 5, 8, 8), (4, 5, 3, 3), 1, 1)
    assert declined((1, 34, 8, 8), (4, 17, 3, 3), 1, 1, groups=2)
    assert not declined((1, 4, 8, 8), (4, 2, 3, 3), 1, 1, groups=2)
    assert not declined((1, 32, 8, 8), (4, 16, 3, 3), 1, 1, groups=2)
    assert declined((1, 3, 32, 32), (8, 3, 16, 16), 16, 1)
    assert declined((1, 3, 12, 12), (4, 3, 3, 3), 2, 2)
    assert declined((1, 3, 8, 8), (4, 3, 3, 3), 1, 1, sr=semipack.LogSum())
    assert not declined((1, 3, 16, 16), (4, 3, 4, 4), 4, 1)


def test_small_planes_with_whole_vectors_of_channels_take_the_channels_last_kernel(
    monkeypatch,
) -> None:
    """Which depthwise layers reach the channels-last kernel: small planes whose channels fill
    vectors, one output channel per input channel (the values are compared above)."""
    import semipack.rules.depthwise as depthwise
    from semipack.kernels.native import native_available

    if not native_available():
        pytest.skip("no native kernels here")
    calls: list[tuple[int, ...]] = []
    kernel = depthwise.depthwise_channels_f32
    monkeypatch.setattr(
        depthwise,
        "depthwise_channels_f32",
        lambda m, *rest: (calls.append(tuple(m.shape)), kernel(m, *rest))[1],
    )
    mask = (True, True, False)
    for name in ("channels_7x7_5x5", "channels_with_multiplier", "3x3_padded", "5x5_wide_rows"):
        x_shape, w_shape, stride, padding, dilation = DEPTHWISE[name]
        x, w = torch.randn(x_shape), torch.randn(w_shape)
        geometry = ConvGeometry.of(2, stride, padding, dilation, x.shape[1])
        out = torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, x.shape[1])
        depthwise.depthwise_max_plus(
            semipack.MaxProd(), (torch.randn(out.shape),), x, w, geometry, mask
        )
    assert calls == [(2, 24, 7, 7), (2, 24, 7, 7)]  # the input and the weight message


def test_native_depthwise_declines_what_it_does_not_cover() -> None:
    """Other algebras, NaN or +inf operands and non-depthwise convolutions take the per-tap
    path (None here)."""
    from semipack.rules.convolution import depthwise_max_plus

    x, w = torch.randn(1, 3, 6, 6), torch.randn(3, 1, 3, 3)
    geometry = ConvGeometry.of(2, 1, 1, 1, 3)
    m = torch.randn(1, 3, 6, 6)
    mask = (True, True, True)
    assert depthwise_max_plus(semipack.LogSum(), (m,), x, w, geometry, mask) is None
    assert depthwise_max_plus(semipack.KBest(2), (m,), x, w, geometry, mask) is None
    nan = m.clone()
    nan[0, 1, 2, 3] = float("nan")
    assert depthwise_max_plus(semipack.MaxProd(), (nan,), x, w, geometry, mask) is None
    dense = ConvGeometry.of(2, 1, 1, 1, 1)
    assert (
        depthwise_max_plus(semipack.MaxProd(), (m,), x, torch.randn(3, 3, 3, 3), dense, mask)
        is None
    )


@pytest.mark.parametrize("semiring", [semipack.MaxProd(), semipack.TopPath()], ids=repr)
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, False)])
@pytest.mark.parametrize("geometry", ["conv2d_padded", "conv1d", "conv3d", "strided_wide"])
def test_max_plus_taps_without_copies_equal_the_per_tap_products(
    monkeypatch, geometry: str, mask, semiring
) -> None:
    """MaxProd's and TopPath's messages with the input packed once and every tap's window
    addressed through one row-offset table (``_MaxPlusTaps``) equal the per-tap products' bit
    for bit, successor ids included (ties between taps keep the earlier one), with zeros in x
    and w (no edge), messages without a path, and channel counts below and above one 16-column
    panel."""
    import semipack.rules.convolution as conv
    from semipack.kernels.native import native_available

    if not native_available():
        pytest.skip("no native kernels here")
    shapes = dict(GEOMETRIES, strided_wide=dict(
        x=(2, 21, 11, 9), w=(5, 21, 3, 2), stride=(2, 3), padding=(1, 2), dilation=(2, 1)
    ))[geometry]  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shapes["x"], generator=gen)
    x[x.abs() < 0.4] = 0.0
    w = torch.randn(shapes["w"], generator=gen)
    w.view(-1)[::5] = 0.0
    spatial = x.dim() - 2
    args = (shapes.get("stride", 1), shapes.get("padding", 0), shapes.get("dilation", 1))
    geo = ConvGeometry.of(spatial, *args, shapes.get("groups", 1))
    forward = getattr(torch.nn.functional, f"conv{spatial}d")
    out = forward(x, w, None, *args)
    m = torch.randn(out.shape, generator=gen) * 3
    m[m < -2.5] = float("-inf")
    m = m.round()  # ties between taps and between candidates
    sr = semiring
    state = (m, _ids(m.shape)) if isinstance(sr, semipack.TopPath) else (m,)
    made = []
    make = conv._MaxPlusTaps.make

    def spy(*a):
        taps = make(*a)
        made.append(taps is not None)
        return taps

    monkeypatch.setattr(conv._MaxPlusTaps, "make", staticmethod(spy))
    got = per_tap_messages(sr, state, x, w, geo, mask)
    monkeypatch.setattr(conv._MaxPlusTaps, "make", staticmethod(lambda *a: None))
    want = per_tap_messages(sr, state, x, w, geo, mask)
    assert made == [True]
    for g, e in zip(got, want, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            assert len(g) == len(e) and all(torch.equal(a, b) for a, b in zip(g, e, strict=True))


def test_kept_row_tables_are_shared_read_only_and_equal_fresh_ones() -> None:
    """Small convolutions keep their row tables across passes (``_kept_output_rows``): two
    passes of a model whose two convolutions share a geometry give the same MaxProd and TopPath
    values, paths included, as a pass after the cache is cleared; the kept table is one object
    for both layers, and after the passes it still equals a freshly built one (the kernels only
    read it). Tables above ``KEPT_ROWS_MAX_POSITIONS`` positions are built each time."""
    import semipack.rules.convolution as conv
    from semipack.kernels.native import native_available

    if not native_available():
        pytest.skip("no native kernels here")
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.Flatten()
    )
    x = torch.randn(2, 6, 7, 9)

    def values(sr):
        model.zero_grad()
        with semipack.extend(model, sr):
            model(x).sum().backward()
        got = [p.semiring_grad.clone() for p in model.parameters()]
        if isinstance(sr, semipack.TopPath):
            got.append(torch.tensor([sr.path(model[0].weight, (1, 2, 0, 1)).value]))
        return got

    for sr in (semipack.MaxProd(), semipack.TopPath()):
        conv._kept_output_rows.cache_clear()
        first = values(sr)
        info = conv._kept_output_rows.cache_info()
        assert info.misses == 1 and info.hits >= 1  # one geometry, both layers
        second = values(sr)
        assert conv._kept_output_rows.cache_info().misses == 1
        conv._kept_output_rows.cache_clear()
        fresh = values(sr)
        for a, b, c in zip(first, second, fresh, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    key = ((2, 9, 11), (7, 9), (1, 1))
    kept = conv._kept_output_rows(*key)
    assert kept is conv._kept_output_rows(*key)
    assert torch.equal(kept, conv._output_rows(*key))
    # every output position's row of the padded grid, from first principles
    want = [b * 99 + r * 11 + c for b in range(2) for r in range(7) for c in range(9)]
    assert kept.tolist() == want
    assert conv.KEPT_ROWS_MAX_POSITIONS >= 2 * 7 * 9
    before = conv._kept_output_rows.cache_info()
    large = conv._MaxPlusTaps([1, 131, 130], [129, 128], [1, 1], ids=False)
    assert large.rows.numel() == 129 * 128 > conv.KEPT_ROWS_MAX_POSITIONS
    assert conv._kept_output_rows.cache_info() == before  # built, not kept


def _ids(shape) -> torch.Tensor:
    """Distinct successor ids for a message of ``shape`` (TopPath's second component)."""
    return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape) + 100


def test_native_depthwise_top_path_ids_stay_exact_on_very_wide_rows() -> None:
    """The TopPath input kernel keeps where each lane's id lies as a float: a tall dilated
    kernel over a row of a million outputs puts those offsets past 2^24, where floats skip
    integers. Such a layer takes the scalar loop, and every id equals the per-tap path's
    (364k of 19M had come from the neighbouring position, one read past the ids)."""
    from semipack.kernels.native import native_available, set_native
    from semipack.rules.convolution import depthwise_max_plus

    if not native_available():
        pytest.skip("no native kernels here")
    wo, kh, kw, dh = 1_000_001, 7, 2, 3
    gen = torch.Generator().manual_seed(0)
    x = torch.ones(1, 1, 1 + (kh - 1) * dh, wo + kw - 1)
    w = 2.0 ** torch.randint(-1, 2, (1, 1, kh, kw), generator=gen).float()
    geometry = ConvGeometry.of(2, 1, 0, (dh, 1), 1)
    m = torch.randn(1, 1, 1, wo, generator=gen).round()
    state = (m, torch.arange(m.numel()).reshape(m.shape) + 100)
    sr = semipack.TopPath()
    got = depthwise_max_plus(sr, state, x, w, geometry, (True, False, False))[0]
    set_native(False)
    try:
        want = per_tap_messages(sr, state, x, w, geometry, (True, False, False))[0]
    finally:
        set_native(True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("semiring", [semipack.MaxProd(), semipack.TopPath()], ids=repr)
def test_a_depthwise_convolution_of_an_empty_batch_runs(semiring) -> None:
    """An empty batch through a depthwise convolution: the weight message has no path (TopPath's
    native kernel read the id of an empty message and killed the process)."""
    conv = nn.Conv2d(2, 2, 3, padding=1, groups=2)
    x = torch.randn(0, 2, 6, 20)
    with semipack.extend(conv, semiring):
        conv(x).sum().backward()
    generic = nn.Conv2d(2, 2, 3, padding=1, groups=2)
    generic.load_state_dict(conv.state_dict())
    with semipack.extend(generic, semiring, extensions=False):
        generic(x).sum().backward()
    for p, q in zip(conv.parameters(), generic.parameters(), strict=True):
        assert torch.equal(p.semiring_grad, q.semiring_grad)
        assert torch.equal(p.grad, torch.zeros_like(p)) and torch.equal(q.grad, p.grad)


@pytest.mark.parametrize("default", ["float64 dtype", "meta device"])
@pytest.mark.parametrize(
    "name", ["channels_7x7_5x5", "strided_5x5_wide", "3x3_padded", "rgb_stem_7x7_strided"]
)
def test_native_messages_ignore_the_default_dtype_and_device(name: str, default: str) -> None:
    """Every buffer the native paths allocate is float32 on the CPU, whatever
    ``torch.set_default_dtype`` or ``set_default_device`` say: under a float64 default the
    shape-only operands failed an assert and the channels-last weight message came back as
    float64 holding float32 bits (trial 30)."""
    from semipack.kernels.native import native_available
    from semipack.rules.depthwise import depthwise_max_plus, few_channels_max_plus

    if not native_available():
        pytest.skip("no native kernels here")
    few = name in FEW_CHANNELS
    x_shape, w_shape, stride, padding, dilation = (FEW_CHANNELS if few else DEPTHWISE)[name]
    groups = 1 if few else x_shape[1]
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(x_shape, generator=gen), torch.randn(w_shape, generator=gen)
    geometry = ConvGeometry.of(2, stride, padding, dilation, groups)
    out = torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, groups)
    m = torch.randn(out.shape, generator=gen)
    mask = (True, True, False)
    rule = few_channels_max_plus if few else depthwise_max_plus
    for sr, state in ((semipack.MaxProd(), (m,)), (semipack.TopPath(), (m, _ids(m.shape)))):
        want = per_tap_messages(sr, state, x, w, geometry, mask)
        if default == "float64 dtype":
            torch.set_default_dtype(torch.float64)
        else:
            torch.set_default_device("meta")
        try:
            got = rule(sr, state, x, w, geometry, mask)
        finally:
            torch.set_default_dtype(torch.float32)
            torch.set_default_device(None)
        for message, expected in zip(got[:2], want[:2], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(message, expected, strict=True))


def test_grouped_convolutions_repeat_no_large_message(monkeypatch) -> None:
    """The depthwise route repeats the message for each input channel of a group: past
    ``REPEATED_MESSAGE_MAX_BYTES`` it is left to the per-tap products, unless the groups have
    at most ``FEW_CHANNELS`` channels (a stem's or ResNeXt's repeat is at most fourfold)."""
    import semipack.rules.depthwise as depthwise_rules

    def routed(x_shape, w_shape, groups) -> bool:
        x, w = torch.randn(x_shape), torch.randn(w_shape)
        geometry = ConvGeometry.of(2, 1, 1, 1, groups)
        out = torch.nn.functional.conv2d(x, w, None, 1, 1, 1, groups)
        state = (torch.randn(out.shape),)
        found = depthwise_rules.few_channels_max_plus(
            semipack.MaxProd(), state, x, w, geometry, (True, True, False)
        )
        return found is not None

    # 8 channels per group: the message [1, 16, 6, 6] float32 (2304 bytes) repeated 8 times
    monkeypatch.setattr(depthwise_rules, "REPEATED_MESSAGE_MAX_BYTES", 8 * 2304)
    assert routed((1, 16, 6, 6), (16, 8, 3, 3), 2)
    monkeypatch.setattr(depthwise_rules, "REPEATED_MESSAGE_MAX_BYTES", 8 * 2304 - 1)
    assert not routed((1, 16, 6, 6), (16, 8, 3, 3), 2)
    assert routed((1, 16, 6, 6), (16, 4, 3, 3), 4)  # four channels per group: always
