"""``kernels.shapes.broadcast_shapes`` is ``torch.broadcast_shapes`` at a fraction of its cost:
same shapes out, same refusal (and message) where shapes do not broadcast."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from semipack.kernels.shapes import broadcast_shapes, dense_block

dims = st.lists(st.sampled_from([0, 1, 2, 3]), max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(st.lists(dims, max_size=4))
def test_agrees_with_torch(shapes) -> None:
    try:
        want = torch.broadcast_shapes(*shapes)
    except RuntimeError as refusal:
        with pytest.raises(RuntimeError) as got:
            broadcast_shapes(*shapes)
        assert str(got.value) == str(refusal)
        return
    got = broadcast_shapes(*shapes)
    assert type(got) is torch.Size
    assert got == want


def test_takes_sizes_and_tuples_mixed() -> None:
    assert broadcast_shapes(torch.Size([4, 1]), (3,), [1, 1, 1]) == torch.Size([1, 4, 3])


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 13)), min_size=0, max_size=4),
    st.integers(0, 3),
)
def test_dense_block_means_the_entries_fill_one_block(dims, offset) -> None:
    """``dense_block`` against its meaning: the view's entries, read from a buffer of their
    own offsets, are ``numel`` consecutive offsets, each once."""
    sizes = [size for size, _ in dims]
    strides = [stride for _, stride in dims]
    span = offset + sum((size - 1) * stride for size, stride in dims if size > 0) + 1
    view = torch.arange(span, dtype=torch.float32).as_strided(sizes, strides, offset)
    entries = sorted(int(v) for v in view.reshape(-1))
    fills = not entries or entries == list(range(entries[0], entries[0] + len(entries)))
    assert dense_block(view) == fills
