"""Module extensions free their saved state as a plain backward does (unless retain_graph)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from helpers import SquaresItsGradient, graph_nodes
from torch import nn

import semipack
from semipack.messages.message import Message


class Block(nn.Module):
    """One of every module extension: embedding, linear, conv, layer norm, both attentions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2).tanh()
        h = self.norm(h)
        h = h + self.mha(h, h, h)[0]
        q = self.proj(h).reshape(2, 5, 2, 4).transpose(1, 2)
        # three distinct tensors: a call that uses one tensor twice runs without its extension
        h = F.scaled_dot_product_attention(q, q.flip(-1), q.tanh())
        h = h.transpose(1, 2).reshape(2, 5, 8)
        return self.head(h.tanh())


def _extension_nodes(root: torch.Tensor) -> list:
    """The autograd nodes of semipack's extension Functions reachable from ``root``."""
    return [n for n in graph_nodes(root) if type(n).__name__.endswith("FunctionBackward")]


def _model_and_ids():
    torch.manual_seed(0)
    return Block().eval(), torch.randint(0, 10, (2, 5))


@pytest.mark.parametrize("semiring", [semipack.LogSum, semipack.MaxProd, semipack.Entropy])
def test_contexts_are_freed_after_a_backward_without_retain_graph(semiring) -> None:
    model, ids = _model_and_ids()
    with semipack.extend(model, semiring()):
        loss = model(ids).sum()
        nodes = _extension_nodes(loss)
        names = {type(n).__name__ for n in nodes}
        assert {
            "EmbeddingFunctionBackward",
            "ConvFunctionBackward",
            "LayerNormFunctionBackward",
            "MultiheadAttentionFunctionBackward",
            "LinearFunctionBackward",
            "AttentionFunctionBackward",
        } <= names
        assert all(vars(n) for n in nodes)
        loss.backward()
        assert [vars(n) for n in nodes] == [{}] * len(nodes)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()


def test_retain_graph_keeps_contexts_and_repeats_the_same_values() -> None:
    model, ids = _model_and_ids()
    with semipack.extend(model, semipack.LogSum()):
        loss = model(ids).sum()
        loss.backward(retain_graph=True)
        first = {n: p.semiring_grad.clone() for n, p in model.named_parameters()}
        assert all(vars(n) for n in _extension_nodes(loss))
        loss.backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.semiring_grad, first[name], rtol=0, atol=0)


def test_functional_grad_frees_unless_retained() -> None:
    model, ids = _model_and_ids()
    with semipack.extend(model, semipack.MaxProd()):
        loss = model(ids).sum()
    params = list(model.parameters())
    semipack.grad(loss, params, semipack.MaxProd(), retain_graph=True)
    assert all(vars(n) for n in _extension_nodes(loss))
    semipack.grad(loss, params, semipack.MaxProd())
    assert all(not vars(n) for n in _extension_nodes(loss))


def test_a_plain_backward_inside_extend_keeps_the_context() -> None:
    """Outside a semiring pass nothing is known about retain_graph: the context stays."""
    model, ids = _model_and_ids()
    with semipack.extend(model, semipack.LogSum()):
        loss = model(ids).sum()
        torch.autograd.grad(loss, list(model.parameters()))
        assert all(vars(n) for n in _extension_nodes(loss))


def test_activations_are_released_like_in_a_plain_backward() -> None:
    """The activation between two Linear layers is held by no one after the backward, exactly
    as after a plain backward (the storage's only user left is this test's handle)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    storages = []
    model[1].register_forward_hook(lambda m, i, out: storages.append(out.untyped_storage()))
    x = torch.randn(5, 4)

    def users_after(backward) -> int:
        loss = model(x).sum()
        backward(loss)
        gc.collect()
        storage = storages.pop()  # held while its use count is read
        return torch._C._storage_Use_Count(storage._cdata)

    plain = users_after(lambda loss: loss.backward())
    with semipack.extend(model, semipack.LogSum()):
        freed = users_after(lambda loss: loss.backward())
        kept = users_after(lambda loss: loss.backward(retain_graph=True))
    assert plain == freed == 1
    assert kept > 1


# --- leaf states are read out as they arrive ----------------------------------------------------


def _mlp_and_data(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), torch.randn(5, 4)


def _node_named(root: torch.Tensor, name: str):
    stack, seen = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node.name() == name:
            return node
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    raise LookupError(name)


@pytest.mark.parametrize("semiring", [semipack.MaxProd, semipack.LogSum, semipack.Entropy])
def test_a_parameters_state_is_not_held_once_read_out(semiring) -> None:
    """The head's weight gets its message before the layers below run; from then on no message
    of that shape is alive (its state was read out on arrival, not kept to the pass's end),
    and the values equal a pass that keeps the states (keep_state=True)."""
    model, x = _mlp_and_data()
    alive: list[int] = []

    def count_head_messages(_grads) -> None:
        gc.collect()
        alive.append(sum(1 for o in gc.get_objects() if type(o) is Message and o.shape == (3, 8)))

    for keep_state in (False, True):
        with semipack.extend(model, semiring(), keep_state=keep_state):
            loss = model(x).sum()
            _node_named(loss, "TanhBackward0").register_prehook(count_head_messages)
            loss.backward()
        if not keep_state:
            read_early = [p.semiring_grad.clone() for p in model.parameters()]
    assert alive == [0, 1]  # keep_state needs each state at the pass's end
    for p, value in zip(model.parameters(), read_early, strict=True):
        torch.testing.assert_close(p.semiring_grad, value, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("semiring", [semipack.MaxProd, semipack.Entropy])
def test_a_readout_reuses_the_memory_of_an_earlier_one_nothing_holds(semiring) -> None:
    """As PyTorch reuses a gradient's buffer: the second pass writes into the first pass's
    readouts (same addresses) with the values a fresh model gets; a readout the user holds is
    left as it was and the new one gets new memory."""
    model, x = _mlp_and_data()
    x2 = torch.randn(5, 4)
    fresh, _ = _mlp_and_data()
    with semipack.extend(fresh, semiring()):
        fresh(x2).sum().backward()
    with semipack.extend(model, semiring()):
        model(x).sum().backward()
        addresses = [p.semiring_grad.data_ptr() for p in model.parameters()]
        model(x2).sum().backward()
    assert [p.semiring_grad.data_ptr() for p in model.parameters()] == addresses
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(p.semiring_grad, q.semiring_grad, rtol=0, atol=0)
    held = model[2].weight.semiring_grad
    before = held.clone()
    with semipack.extend(model, semiring()):
        model(x).sum().backward()
    assert torch.equal(held, before)
    assert model[2].weight.semiring_grad.data_ptr() != held.data_ptr()


def test_a_failed_pass_leaves_no_half_new_readout() -> None:
    """The head's readouts are overwritten before the pass fails below them: they are removed;
    the first layer's, which the pass never reached, keep their earlier values."""
    model, x = _mlp_and_data()
    with semipack.extend(model, semipack.MaxProd()):
        model(x).sum().backward()
    earlier = [p.semiring_grad.clone() for p in model[0].parameters()]
    with semipack.extend(model, semipack.MaxProd()), pytest.raises(semipack.UnsupportedOpError):
        # an op without a rule (a custom Function would make the pass read out at its end)
        model[2](torch.xlogy(model[1](model[0](x)), 2.0)).sum().backward()
    assert not any(hasattr(p, "semiring_grad") for p in model[2].parameters())
    for p, value in zip(model[0].parameters(), earlier, strict=True):
        assert torch.equal(p.semiring_grad, value)


def test_a_failed_pass_through_a_custom_function_keeps_every_earlier_readout() -> None:
    """A graph with a custom Function reads its leaves out at the pass's end (its backward
    may run an engine of its own that reaches a leaf again): a pass failing inside it has
    overwritten nothing, the head's readouts included."""
    model, x = _mlp_and_data()
    with semipack.extend(model, semipack.MaxProd()):
        model(x).sum().backward()
    earlier = [p.semiring_grad.clone() for p in model.parameters()]
    with semipack.extend(model, semipack.MaxProd()), pytest.raises(semipack.UnsupportedOpError):
        model[2](SquaresItsGradient.apply(model[1](model[0](x)))).sum().backward()
    for p, value in zip(model.parameters(), earlier, strict=True):
        assert torch.equal(p.semiring_grad, value)


class _FailsOnTableReadout(semipack.MaxProd):
    """MaxProd whose readout fails on a state of ``rows`` rows: an embedding table's, kept as
    its reached rows and read out after the pass (any failure there: a dtype, memory)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def readout_sparse(self, a, into=None):
        if a.shape[0] == self.rows:
            raise RuntimeError("the table's readout failed")
        return super().readout_sparse(a, into)


def _embedding_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    return model, torch.tensor([[1, 2, 2], [3, 4, 1]])


def _address(readout) -> int:
    """Where a readout lives: a tensor's memory, ``Entropy(flow=True)``'s entropy's."""
    return (readout.entropy if hasattr(readout, "entropy") else readout).data_ptr()


@pytest.mark.parametrize(
    "semiring", [semipack.MaxProd, semipack.Entropy, lambda: semipack.Entropy(flow=True)]
)
def test_an_embedding_tables_readout_reuses_its_earlier_memory(semiring) -> None:
    """The table's state is kept as its reached rows and read out after the engine ran, into
    the memory of its earlier readout (a 30k-row table is fresh memory from the OS otherwise):
    the same address, the values of a fresh model's pass; so does every other parameter's,
    read out as its message arrives (``Entropy(flow=True)``'s pair too: it took fresh memory
    at every pass, trial 39)."""
    model, ids = _embedding_model()
    fresh, _ = _embedding_model()
    other = torch.tensor([[5, 6, 7], [8, 9, 5]])
    with semipack.extend(fresh, semiring()):
        fresh(other).sum().backward()
    with semipack.extend(model, semiring()):
        model(ids).sum().backward()
        addresses = [_address(p.semiring_grad) for p in model.parameters()]
        model(other).sum().backward()
    assert [_address(p.semiring_grad) for p in model.parameters()] == addresses
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        _assert_same_readout(p.semiring_grad, q.semiring_grad)


@pytest.mark.parametrize("earlier_pass", [False, True])
def test_a_pass_that_fails_in_its_readouts_changes_no_gradient(earlier_pass: bool) -> None:
    """The table's readout runs after the engine; when it fails, every ``.grad`` is the one
    before the pass (it was committed first and came out doubled, trial 38), no readout of the
    pass is left, and each earlier one is kept unless the pass took its memory (then it is
    removed, not left half new)."""
    model, ids = _embedding_model()
    if earlier_pass:
        with semipack.extend(model, semipack.MaxProd()):
            model(ids).sum().backward()
    else:
        model(ids).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    earlier = {n: p.semiring_grad.clone() for n, p in model.named_parameters() if earlier_pass}
    # PyTorch reports every CUDA tensor as shared memory, which no readout is written into
    reusable = earlier_pass and not model[2].weight.semiring_grad.is_shared()
    failing = semipack.extend(model, _FailsOnTableReadout(rows=10))
    with failing, pytest.raises(RuntimeError, match="the table's readout failed"):
        model(ids).sum().backward()
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    for name, p in model.named_parameters():
        if name not in earlier:
            assert not hasattr(p, "semiring_grad")
        elif hasattr(p, "semiring_grad"):  # the table's memory was handed to its readout
            assert torch.equal(p.semiring_grad, earlier[name]), name
    if reusable:  # the Linear layer's readouts were taken early, into their memory
        assert not hasattr(model[2].weight, "semiring_grad")
    elif earlier_pass:  # each kept as it was
        assert all(hasattr(p, "semiring_grad") for p in model.parameters())
    # and a retry counts the gradient once
    with semipack.extend(model, semipack.MaxProd()):
        model(ids).sum().backward()
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, 2 * g, rtol=0, atol=0)


class _FailsInReadoutInto(semipack.MaxProd):
    """MaxProd whose ``readout_into`` fails when armed: before writing, or after writing into
    the earlier readout's memory (a check of the value, say)."""

    armed: str | None = None

    def readout_into(self, a, into):
        if _FailsInReadoutInto.armed == "before":
            raise RuntimeError("readout_into failed")
        value = super().readout_into(a, into)
        if _FailsInReadoutInto.armed == "after":
            raise RuntimeError("readout_into failed")
        return value


def _assert_old_or_absent(model: nn.Module, earlier: dict) -> list[str]:
    """Each parameter's readout is its earlier value or absent; returns the absent ones."""
    absent = []
    for name, p in model.named_parameters():
        if not hasattr(p, "semiring_grad"):
            absent.append(name)
            continue
        value, want = p.semiring_grad, earlier[name]
        pairs = zip(value, want, strict=True) if isinstance(want, tuple) else [(value, want)]
        for got, old in pairs:
            assert torch.equal(got, old), name
    return absent


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("product", [False, True])
def test_a_readout_that_fails_while_writing_leaves_no_half_new_value(when, product) -> None:
    """A leaf's readout is written into its earlier readout's memory as its message arrives;
    one that fails there, before or after writing (in a Product, after the first factor was
    written), leaves that leaf's readout absent, never half new, and the others as they were
    (trial 39); ``.grad`` is the earlier one."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    failing = _FailsInReadoutInto()
    sr = semipack.Product(semipack.MaxProd(), failing) if product else failing
    _FailsInReadoutInto.armed = None
    with semipack.extend(model, sr):
        model(torch.randn(4, 16)).sum().backward()
    earlier = {
        n: tuple(v.clone() for v in p.semiring_grad) if product else p.semiring_grad.clone()
        for n, p in model.named_parameters()
    }
    grads = [p.grad.clone() for p in model.parameters()]
    # PyTorch reports every CUDA tensor as shared memory, which no readout is written into
    first_written_into = [] if model[2].bias.grad.is_shared() else ["2.bias"]
    _FailsInReadoutInto.armed = when
    try:
        with semipack.extend(model, sr), pytest.raises(RuntimeError, match="readout_into failed"):
            model(5 * torch.randn(4, 16)).sum().backward()
    finally:
        _FailsInReadoutInto.armed = None
    # the first read out (as plain) is removed where its memory was written into
    assert _assert_old_or_absent(model, earlier) == first_written_into
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)


def test_a_retained_tensor_keeps_its_grad_when_a_pass_without_regular_gradients_fails() -> None:
    """With ``regular_grads=False`` the engine still hands a retained tensor its message; a pass
    that fails below it must not leave that message in ``.grad`` (trial 39)."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=True)
    with semipack.extend(model, semipack.MaxProd(), regular_grads=False):
        h = model[0](SquaresItsGradient.apply(x))
        h.retain_grad()
        with pytest.raises(semipack.UnsupportedOpError):
            model[2](h.relu()).sum().backward()
        assert h.grad is None


def test_semipack_grad_sets_paths_only_when_it_returns() -> None:
    """``semipack.grad`` with TopPath stores each input's paths; a call that raises (an unused
    input without ``allow_unused``) leaves the earlier ones (trial 39)."""
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    unused = torch.tensor([5.0], requires_grad=True)
    semipack.grad((a * b).sum(), [a], semipack.TopPath())
    paths = a.semiring_paths
    with pytest.raises(RuntimeError, match="appears to not have been used"):
        semipack.grad((a * a * 10).sum(), [a, unused], semipack.TopPath())
    assert a.semiring_paths is paths


def _assert_same_readout(got, want) -> None:
    if isinstance(want, tuple):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same_readout(g, w)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "semiring",
    [
        semipack.MaxProd(),
        semipack.MaxProd(log=True),
        semipack.LogSum(),
        semipack.LogSum(log=False),
        semipack.LogCount(),
        semipack.Entropy(),
        semipack.Boolean(),
        semipack.KBest(2),
        semipack.SignedMaxProd(),
        semipack.Product(semipack.MaxProd(), semipack.Entropy(), semipack.LogSum(log=False)),
    ],
    ids=repr,
)
@pytest.mark.parametrize("n", [50, 1 << 16])  # eager, and compiled kernels
def test_a_readout_written_into_an_earlier_one_has_the_readouts_bits(semiring, n: int) -> None:
    torch.manual_seed(3)
    w = torch.randn(n)
    w[::5] = 0.0  # no path there
    state = semiring.plus(semiring.lift(w), semiring.lift(torch.randn(n)))
    state = semiring.times(state, semiring.lift(w.flip(0)))
    earlier = semiring.readout(semiring.lift(torch.randn(n)))
    addresses = [t.data_ptr() for t in (earlier if isinstance(earlier, tuple) else (earlier,))]
    got = semiring.readout_into(state, earlier)
    _assert_same_readout(got, semiring.readout(state))
    log = getattr(semiring, "log", False)
    writes = {"MaxProd": not log, "LogSum": not log, "Entropy": True}
    if writes.get(type(semiring).__name__, False):
        assert got.data_ptr() == addresses[0]
    if isinstance(semiring, semipack.Product):  # written factor by factor where each writes
        assert [got[0].data_ptr(), got[1].data_ptr(), got[2].data_ptr()] == addresses


def test_a_second_message_after_a_readout_is_refused_not_dropped() -> None:
    """Read out on arrival, a leaf's state cannot take a later message's paths: a second one
    in the same pass (no engine run sends one) raises instead of replacing the first."""
    from semipack.transport.backward import LeafCaptures

    sr, leaf = semipack.MaxProd(), torch.zeros(3, requires_grad=True)
    captures = LeafCaptures(read_early=True)
    msg = Message(torch.ones(3), sr.lift(torch.ones(3)), sr)
    captures.take(leaf, msg, sr)
    with pytest.raises(semipack.MessageLostError, match="received a second message in one pass"):
        captures.take(leaf, msg, sr)
