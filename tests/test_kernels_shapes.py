"""``kernels.shapes.broadcast_shapes`` is ``torch.broadcast_shapes`` at a fraction of its cost:
same shapes out, same refusal (and message) where shapes do not broadcast."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from semipack.kernels.shapes import broadcast_shapes

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
