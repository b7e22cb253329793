"""Branch readouts (``semipack.branches``) against brute-force enumeration of the paths that
leave the split tensor through each use.

The oracle of a branch is the same model with its uses *untied*: each consumer of the split
tensor ``h`` reads its own copy (same values, a separate leaf), so the oracle's value at copy b
enumerates exactly the paths through use b. Carried down to the input, the oracle of branch b is
the model in which only use b reads ``h(x)`` and the other uses read a constant copy.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from helpers import assert_readout_matches, oracle_readouts, tiny_bert_config
from oracle import build_graph
from torch import Tensor, nn

import semipack


def _generator() -> torch.Generator:
    """On the default device: the GPU check (``dev/gpu_check``) runs these tests on CUDA."""
    return torch.Generator(torch.get_default_device())


F64 = torch.float64
pytestmark = pytest.mark.usefixtures("single_thread")
USES = ("block.q", "block.k", "block.v", "block")


class Block(nn.Module):
    """One attention-like block: query, key and value projections of h and a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(3, 3) for _ in range(3))

    def forward(self, h: Tensor, copies: dict[str, Tensor] | None = None) -> Tensor:
        use = (lambda name: copies[name]) if copies else (lambda name: h)
        scores = self.q(use("block.q")) @ self.k(use("block.k")).transpose(-1, -2)
        return torch.softmax(scores, -1) @ self.v(use("block.v")) + use("block")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.block = nn.Linear(2, 3), Block()

    def forward(self, x: Tensor, copies: dict[str, Tensor] | None = None) -> Tensor:
        return self.block(torch.tanh(self.emb(x)), copies)


def _net() -> Net:
    torch.manual_seed(0)
    net = Net().double()
    with torch.no_grad():
        net.emb.weight[0, 1] = 0.0  # an exact zero: a cut edge below the split
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def _loss(out: Tensor) -> Tensor:
    return (out * torch.randn(out.shape, generator=_generator().manual_seed(1), dtype=F64)).sum()


def _x() -> Tensor:
    return torch.randn(4, 2, generator=_generator().manual_seed(2), dtype=F64).requires_grad_()


@pytest.mark.parametrize("extensions", [True, False], ids=["extensions", "generic"])
def test_branch_values_equal_the_untied_oracle(
    semiring_name: str, semiring, extensions: bool
) -> None:
    net, x = _net(), _x()
    carried = semiring_name != "top_path"  # TopPath branches are read at the split only
    with semipack.extend(net, semiring, extensions=extensions):
        with semipack.branches(net.block, inputs=[x] if carried else []) as split:
            out = net(x)
        _loss(out).backward()
    assert split.names == list(USES)
    # the split tensor's branches: one copy of h per use
    h = torch.tanh(net.emb(x)).detach()
    copies = {name: h.clone().requires_grad_() for name in USES}
    want = oracle_readouts(build_graph(_loss(net(x, copies))), list(copies.values()), semiring_name)
    for name, expected in zip(USES, want, strict=True):
        assert_readout_matches(semiring_name, expected, split.values[name], f"at h, {name}")
    # carried down to x: only use b reads h(x)
    for name in USES if carried else ():
        x_b = x.detach().clone().requires_grad_()
        h_b = torch.tanh(net.emb(x_b))
        tied = {other: (h_b if other == name else h) for other in USES}
        (expected,) = oracle_readouts(build_graph(_loss(net(x_b, tied))), [x_b], semiring_name)
        (got,) = split.at_inputs[name]
        assert_readout_matches(semiring_name, expected, got, f"at x, {name}")


def test_the_branches_combine_to_the_whole_value() -> None:
    """MaxProd: the value at x is the max over branches; LogSum: their log-sum-exp."""
    for sr, combine in [
        (semipack.MaxProd(), lambda t: t.amax(0)),
        (semipack.LogSum(), lambda t: t.logsumexp(0)),
    ]:
        net, x = _net(), _x()
        with semipack.extend(net, sr), semipack.branches(net.block, inputs=[x]) as split:
            _loss(net(x)).backward()
        per_branch = torch.stack([split.at_inputs[name][0] for name in USES])
        torch.testing.assert_close(combine(per_branch), x.semiring_grad)
        x_plain = x.detach().clone().requires_grad_()
        (plain,) = torch.autograd.grad(_loss(net(x_plain)), x_plain)
        torch.testing.assert_close(x.grad, plain, rtol=1e-15, atol=1e-15)  # .grad untouched


def test_mistakes_say_what_to_do() -> None:
    net, x = _net(), _x()
    not_called = pytest.raises(semipack.SemipackError, match="Block was not called inside")
    with not_called, semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block):
        pass
    constant = pytest.raises(semipack.SemipackError, match="splits a tensor that requires grad")
    with constant, semipack.extend(net, semipack.MaxProd()), semipack.branches(torch.zeros(2)):
        pass
    with pytest.raises(TypeError, match="splits at a module or a tensor"), semipack.branches("b"):
        pass
    for recording in (semipack.TopPath(), semipack.KBest(2)):  # KBest's was named TopPath
        kind = type(recording).__name__
        top = pytest.raises(
            semipack.SemipackError,
            match=f"cannot carry {kind} branches down .*; read {kind} at the split tensor",
        )
        with top, semipack.extend(net, recording):
            with semipack.branches(net.block, inputs=[x]):
                out = net(x)
            _loss(out).backward()
        assert x.grad is None  # the failed pass left nothing behind
    leaf = torch.ones(4, 3, dtype=F64, requires_grad=True)
    below_leaf = pytest.raises(semipack.SemipackError, match="which is a leaf here")
    split = semipack.branches(leaf, inputs=[x])
    with below_leaf, semipack.extend(net, semipack.MaxProd()), split:
        pass


def test_a_bert_layer_splits_into_query_key_value_and_the_residual() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = tiny_bert_config()
    ids = torch.tensor([[3, 5, 7, 2]])
    layer = "encoder.layer.0.attention"
    want = [f"{layer}.self.query", f"{layer}.self.key", f"{layer}.self.value", f"{layer}.output"]
    values = {}
    for attention in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = transformers.BertModel._from_config(cfg, attn_implementation=attention).double()
        with semipack.extend(model, semipack.MaxProd()):
            with semipack.branches(model.encoder.layer[0].attention) as split:
                out = model(input_ids=ids).last_hidden_state
            out.pow(2).sum().backward()
        assert split.names == want
        values[attention] = split.values
        whole = torch.stack(list(split.values.values())).amax(0)
        assert whole.shape == (1, 4, 8) and (whole > 0).all()
    for name in want:
        torch.testing.assert_close(values["eager"][name], values["sdpa"][name])


def test_per_token_aggregation_is_the_union_of_the_tokens_paths(
    semiring_name: str, semiring
) -> None:
    """``aggregate(-1)``: each (row, branch) over all its units. Oracle: the untied model whose
    copy of h for use b is ``c + z_b[..., None]`` with a leaf ``z_b`` per row, so every path to
    ``z_b[r]`` passes through exactly one unit ``h[r, u]`` and extends it by an edge of weight 1:
    the paths to ``z_b[r]`` are the union of the paths to the row's units."""
    net, x = _net(), _x()
    with semipack.extend(net, semiring), semipack.branches(net.block) as split:
        _loss(net(x)).backward()
    got = split.aggregate(-1)
    h = torch.tanh(net.emb(x)).detach()
    rows = {name: torch.zeros(h.shape[0], dtype=F64, requires_grad=True) for name in USES}
    copies = {name: h + rows[name][:, None] for name in USES}
    want = oracle_readouts(build_graph(_loss(net(x, copies))), list(rows.values()), semiring_name)
    for name, expected in zip(USES, want, strict=True):
        assert_readout_matches(semiring_name, expected, got[name], f"rows of {name}")
    with pytest.raises(TypeError, match=r"aggregate\(at=\.\.\.\) takes the index of an input"):
        split.aggregate(-1, at=x)  # a tensor, not its index (trial 48: a bare TypeError)


def test_llama_and_transformer_encoder_layers_split_by_use() -> None:
    """A Llama layer's attention input is used by the q/k/v projections; nn.MultiheadAttention
    receives it once per argument (query, key, value); the encoder layer adds it back."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=16, max_position_embeddings=8,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaModel._from_config(cfg, attn_implementation="sdpa").double()
    with semipack.extend(llama, semipack.LogSum()):
        with semipack.branches(llama.layers[0].self_attn) as split:
            out = llama(input_ids=torch.tensor([[1, 4, 6]])).last_hidden_state
        out.sum().backward()
    assert split.names == [f"layers.0.self_attn.{p}_proj" for p in "qkv"]
    # causal attention: the first query sees one key, so its softmax is constant and no path
    # leaves token 0 through the query projection; every other entry has paths
    query = split.values["layers.0.self_attn.q_proj"]
    assert query[:, 0].isneginf().all() and query[:, 1:].isfinite().all()
    assert all(v.isfinite().all() for k, v in split.values.items() if not k.endswith("q_proj"))

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0).double()
    x = torch.randn(3, 1, 4, dtype=F64, requires_grad=True)
    for extensions in (True, False):
        with semipack.extend(layer, semipack.MaxProd(), extensions=extensions):
            with semipack.branches(x, inputs=[]) as split:
                out = layer(x)
            out.sum().backward()
        uses = ["self_attn:query", "self_attn:key", "self_attn:value", "<root module>"]
        assert split.names == uses
        whole = torch.stack(list(split.values.values())).amax(0)
        torch.testing.assert_close(whole, x.semiring_grad)  # MaxProd: max over the uses


def test_a_split_whose_forward_records_no_graph_says_why() -> None:
    """A reentrant activation checkpoint runs its forward without autograd (and again in the
    backward, after the block): no use of the split tensor gets an alias there. The split is
    then an error naming the cause, not an empty ``names`` (a new-user trial met both kinds: a
    split tensor that requires grad but is used only under no_grad, and a module input made
    without grad)."""
    from torch.utils.checkpoint import checkpoint

    net, x = _net(), _x()
    for p in net.parameters():
        p.requires_grad_(True)
    cause = "reentrant activation checkpoint"
    with semipack.extend(net, semipack.MaxProd()):
        h = torch.tanh(net.emb(x))
        for module, run in (
            (net.block, lambda: checkpoint(net.block, h, use_reentrant=True)),
            # an input made in the checkpoint
            (net.block.v, lambda: checkpoint(lambda t: net.block.v(t * 2), h, use_reentrant=True)),
        ):
            name = type(module).__name__
            without_grad = pytest.raises(
                semipack.SemipackError,
                match=f"{name} was called only where autograd records nothing.*{cause}",
            )
            with without_grad, semipack.branches(module):
                run()
        unused = pytest.raises(semipack.SemipackError, match="used only where")
        with unused, torch.no_grad(), semipack.branches(h):
            net.block(h)


@pytest.mark.parametrize("where", ["branches", "per_sample"])
def test_a_copy_or_checkpoint_made_inside_the_block_carries_no_live_hook(where: str) -> None:
    """``branches(module)`` and ``extend(..., per_sample=True)`` put a forward pre-hook on a
    module for the block. A deepcopy (an EMA copy) or ``torch.save`` made inside the block
    copies the hook table: the copy's hook does nothing and is gone after the copy's first
    call (a copied closure kept splitting for the block, so the copy's no-grad evaluation
    raised; a local function could not be pickled at all)."""
    import copy
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    x = torch.randn(2, 3)
    hooked = model[1] if where == "branches" else model
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            semipack.extend(model, semipack.MaxProd(), per_sample=where == "per_sample")
        )
        split = stack.enter_context(semipack.branches(model[1])) if where == "branches" else None
        out = model(x)
        ema = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        out.pow(2).sum().backward()
    assert len(hooked._forward_pre_hooks) == 0  # the block removed its own
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (ema, loaded):
        target = copied[1] if where == "branches" else copied
        assert len(target._forward_pre_hooks) == 1
        with torch.no_grad():
            got = copied(x)
        assert torch.equal(got, model(x).detach())
        assert len(target._forward_pre_hooks) == 0
        assert len(target._forward_pre_hooks_with_kwargs) == 0
    if split is not None:
        assert split.calls == 1  # the copies' calls are not the block's


class _ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.v = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, h: Tensor) -> Tensor:
        return self.q(h) * self.v(h) + h


@pytest.mark.parametrize("semiring", [semipack.Real, semipack.LogSum])
def test_carrying_branches_down_leaves_retained_tensors_as_one_pass_does(semiring) -> None:
    """``inputs=[x]`` runs one more pass per branch from the split tensor down; a tensor whose
    ``retain_grad()`` was called below it took those passes' messages too (Real's value came
    out doubled, its ``.grad`` None: trial 43). Both equal a run without the split."""
    torch.manual_seed(0)
    emb, block = nn.Linear(2, 3).double(), _ResidualBlock().double()
    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    runs = []
    for inputs in ([], [x]):
        model = nn.Sequential(emb, block)
        with semipack.extend(model, semiring()):
            with semipack.branches(block, inputs=inputs) if inputs else contextlib.nullcontext():
                h = torch.tanh(emb(x))
                h.retain_grad()
                out = block(h)
            out.sum().backward()
        runs.append((h.semiring_grad.clone(), h.grad.clone()))
    (value, grad), (carried_value, carried_grad) = runs
    torch.testing.assert_close(carried_value, value, rtol=1e-14, atol=0)
    torch.testing.assert_close(carried_grad, grad, rtol=0, atol=0)


class _ListedAndInPlaceUses(nn.Module):
    """The split tensor used inside ``torch.cat``'s and ``torch.stack``'s lists and as the
    other argument of an in-place add, beside a plain use."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, h: Tensor) -> Tensor:
        y = self.a(h)
        y.add_(h)
        joined = torch.cat([h, 3 * h], dim=-1).sum(-1, keepdim=True)
        stacked = torch.stack([h, h]).tanh().sum(0)
        return y * joined + stacked


@pytest.mark.parametrize("semiring", [semipack.Real, semipack.MaxProd, semipack.LogSum])
def test_uses_in_a_list_and_in_an_in_place_op_are_branches(semiring) -> None:
    """Such uses were in no branch, silently (trial 43): the branches combine to the value at
    the tensor, which a pass without the split gives at the retained tensor."""
    torch.manual_seed(2)
    emb, block = nn.Linear(2, 3).double(), _ListedAndInPlaceUses().double()
    model = nn.Sequential(emb, block)
    x = torch.randn(4, 2, dtype=torch.float64)
    with semipack.extend(model, semiring()):
        with semipack.branches(block) as split:
            h = torch.tanh(emb(x))
            h.retain_grad()
            out = block(h)
        out.sum().backward()
    assert len(split.names) == 6  # block.a, add_'s argument, two in cat, two in stack
    torch.testing.assert_close(split.total([]), h.semiring_grad, rtol=1e-12, atol=1e-12)


def test_a_frozen_model_and_a_module_called_twice_are_named() -> None:
    """A frozen model's block input does not require grad with grad mode on: the error blamed
    no_grad and checkpoints, now the frozen parameters. A module called twice in one
    backward's graph is split at the call the backward reaches first (the other call's paths
    are in no branch): that was silent, now a warning says so; one call gives none."""
    net, x = _net(), _x().detach()  # frozen parameters, an input without grad
    frozen = pytest.raises(semipack.SemipackError, match=r"Block's input does not.*a frozen model")
    with frozen, semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block):
        net(x)
    x = _x()
    twice = pytest.warns(UserWarning, match="one backward reached 2 calls of Block; only the call")
    with semipack.extend(net, semipack.MaxProd()), twice:  # said by the backward after it
        with semipack.branches(net.block) as split:
            h = torch.tanh(net.emb(x))
            inner = net.block(h)
            out = net.block(inner)
        _loss(out).backward()
    # the backward reaches the outer call first: its input is the split
    assert split.calls == 2 and split.split is inner and split.names == [*USES[:3], "block"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block) as once:
            net(x)
    assert once.calls == 1


class _NoOpBlock(nn.Module):
    """A block whose forward passes its input through a call that hands it back (Hugging Face
    Llama's RMSNorm: ``hidden_states.to(torch.float32)`` of a float32 tensor)."""

    def __init__(self, noop) -> None:
        super().__init__()
        self.ff, self.noop = nn.Linear(8, 8), noop

    def forward(self, h):
        g = self.noop(h)
        return h + self.ff(g * g.pow(2).mean(-1, keepdim=True).rsqrt())


@pytest.mark.parametrize(
    "noop",
    [lambda h: h.to(torch.float32), lambda h: h.float(), lambda h: h.contiguous(), lambda h: h],
    ids=["to", "float", "contiguous", "none"],
)
def test_a_call_that_hands_the_split_tensor_back_keeps_grad_bitwise(noop) -> None:
    """Through the alias such a call returned, its later uses were summed at the alias before
    reaching the split tensor: another order than a plain backward's, so ``.grad`` below the
    split was one rounding off (every Llama, Qwen2 and Mistral layer, and the Monitor's splits,
    trial 46). Its uses are each a branch of the split tensor now, as without the call."""
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(4, 8), _NoOpBlock(noop), nn.Linear(8, 3))
    x = torch.randn(6, 4)
    plain = copy.deepcopy(base)
    plain(x).pow(2).sum().backward()
    model = copy.deepcopy(base)
    with semipack.extend(model, semipack.LogSum()):
        with semipack.branches(model[1]) as split:
            h = model[0](x)
            h.retain_grad()
            out = model[2](model[1](h))
        out.pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert split.names == ["1", "1#2", "1#3"]  # the residual add, the pow, the product
    joined = torch.stack(list(split.values.values())).logsumexp(0)
    torch.testing.assert_close(joined, h.semiring_grad, rtol=1e-6, atol=1e-6)


def test_a_checkpoints_recomputation_is_not_a_second_call() -> None:
    """Under a non-reentrant activation checkpoint the split module runs again in the backward:
    the recomputations were counted as calls, and a Monitor's ``splits`` warned that the
    module "was called 7 times", pointing into contextlib (trial 61). One call, no warning,
    the branches of the run without a checkpoint; a real second call still warns, at the
    user's line."""
    from torch.utils.checkpoint import checkpoint

    net, x = _net(), _x()
    shares = []
    for checkpointed in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block) as split:
                h = torch.tanh(net.emb(x))
                out = (
                    checkpoint(net.block, h, use_reentrant=False) if checkpointed else net.block(h)
                )
                _loss(out).backward()
        assert split.calls == 1
        shares.append(split.values)
    assert shares[0].keys() == shares[1].keys()
    for name in shares[0]:
        torch.testing.assert_close(shares[1][name], shares[0][name], rtol=0, atol=0)
    twice = pytest.warns(UserWarning, match="one backward reached 2 calls of Block")
    with twice as caught, semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block):
        _loss(net.block(net.block(torch.tanh(net.emb(x))))).backward()
    assert caught[0].filename == __file__


# --- trial 67: micro-batches, forwards without grad, listed inputs, touches --------------------


def _copies_oracle(net: Net, x: Tensor, sr: semipack.Semiring) -> dict[str, Tensor]:
    """Each use of the block's input as a leaf of its own: its value is that use's branch."""
    h = torch.tanh(net.emb(x)).detach()
    copies = {use: h.clone().requires_grad_() for use in USES}
    with semipack.extend(net, sr):
        _loss(net.block(h, copies)).backward()
    return {use: c.semiring_grad for use, c in copies.items()}


def test_a_module_called_again_after_a_backward_is_split_afresh() -> None:
    """Gradient accumulation inside one block (forward, backward, forward, backward): each
    backward replaces ``semiring_grad``, and the split follows it: the values are the last
    micro-batch's, with no "called 2 times" warning (trial 67: the first call stayed split,
    so a Monitor's flow shares were the first micro-batch's and its other values the last's).
    Forwards under torch.no_grad (validation) are no calls of the split module."""
    net = _net()
    x1, x2 = _x(), (_x() * 0.5 + 0.25).detach().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block) as split:
            with torch.no_grad():
                net(x2)  # validation before the step's forwards
            _loss(net(x1)).backward()
            with torch.no_grad():
                net(x1)  # and between them
            _loss(net(x2)).backward()
    assert split.calls == 1 and split.names == list(USES)
    want = _copies_oracle(net, x2, semipack.MaxProd())
    assert set(split.values) == set(USES)
    for use in USES:
        torch.testing.assert_close(split.values[use], want[use], rtol=1e-12, atol=0)
    # carried down to the input: the second micro-batch's, as a block with it alone gives
    with semipack.extend(net, semipack.LogSum()):
        with semipack.branches(net.block, inputs=[x1]) as first:
            _loss(net(x1)).backward()
        with semipack.branches(net.block, inputs=[x2]) as both:
            _loss(net(x1)).backward()
            _loss(net(x2)).backward()
        with semipack.branches(net.block, inputs=[x2]) as alone:
            _loss(net(x2)).backward()
    assert set(first.at_inputs) == set(both.at_inputs) == set(alone.at_inputs) == set(USES)
    for use in USES:
        torch.testing.assert_close(both.at_inputs[use][0], alone.at_inputs[use][0], rtol=0, atol=0)
        assert not torch.equal(both.at_inputs[use][0], first.at_inputs[use][0])


def test_a_module_called_only_without_grad_is_named_so() -> None:
    net = _net()
    without_grad = pytest.raises(
        semipack.SemipackError, match="Block was called only where autograd records nothing"
    )
    block = semipack.branches(net.block)
    with without_grad, semipack.extend(net, semipack.MaxProd()), block, torch.no_grad():
        net(_x())


class _CatLayer(nn.Module):
    """Takes a list of features, as DenseNet's layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, features: list[Tensor]) -> Tensor:
        return self.lin(torch.cat(features, -1))


def test_a_module_given_a_list_is_split_at_its_first_tensor() -> None:
    """Trial 67: a module whose first argument is a list (DenseNet's ``_DenseLayer``) read as
    never called. The split is the list's first tensor; its uses after the call are branches,
    each equal to the value of its use alone (the others detached)."""
    torch.manual_seed(0)
    emb, layer = nn.Linear(2, 3).double(), _CatLayer().double()
    x = _x()

    def forward(detach: str | None = None) -> tuple[Tensor, Tensor]:
        h = torch.tanh(emb(x))
        if detach is None:
            return h, layer([h, 2 * torch.tanh(emb(x))]).sum(-1) + h.sum(-1)
        keep = h.detach().requires_grad_() if detach == "layer" else h
        other = h.detach().requires_grad_() if detach == "add" else h
        return h, layer([keep, 2 * torch.tanh(emb(x))]).sum(-1) + other.sum(-1)

    with semipack.extend(nn.ModuleList([emb, layer]), semipack.MaxProd()):
        with semipack.branches(layer) as split:
            h, out = forward()
        _loss(out).backward()
    assert split.split is h and split.ops == {"1": "cat", "<outside the model>": "sum"}
    values = split.values
    for detached, use in (("add", split.names[0]), ("layer", split.names[1])):
        with semipack.extend(nn.ModuleList([emb, layer]), semipack.MaxProd()):
            h, out = forward(detached)
            h.retain_grad()
            _loss(out).backward()
        torch.testing.assert_close(values[use], h.semiring_grad, rtol=1e-12, atol=0)


def test_touches_that_add_no_edge_are_no_uses_before_the_module() -> None:
    """``retain_grad``, ``detach``, ``isfinite`` and ``register_hook`` on the split tensor
    before the module's call add no edge from it (trial 67: each was reported as a use whose
    paths are in no branch)."""
    net = _net()
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block) as split:
            h = torch.tanh(net.emb(x))
            h.retain_grad()
            assert torch.isfinite(h.detach()).all() and torch.isfinite(h).all()
            h.register_hook(lambda g: None)
            _loss(net.block(h)).backward()
    assert split.used_before == [] and split.names == list(USES)
    want = _copies_oracle(net, x, semipack.MaxProd())
    for use in USES:
        torch.testing.assert_close(split.values[use], want[use], rtol=1e-12, atol=0)


class _TouchedInside(nn.Module):
    """The block, whose output then reads its input's dtype, shape or values without an edge
    from it (Gemma's RMSNorm ends in ``output.type_as(x)``)."""

    def __init__(self, touch: str) -> None:
        super().__init__()
        self.block, self.touch = Block(), touch

    def forward(self, h: Tensor) -> Tensor:
        out = self.block(h)
        if self.touch == "type_as":
            return out.type_as(h)
        if self.touch == "to":
            return out.to(h)
        if self.touch == "zeros_like":
            return out + torch.zeros_like(h)
        if self.touch == "new_zeros":
            return out + h.new_zeros(h.shape)
        if self.touch == "argmax":
            return out * (h.argmax(-1, keepdim=True) >= 0)
        return out * (h > -100)  # a comparison


@pytest.mark.parametrize("touch", ["type_as", "to", "zeros_like", "new_zeros", "argmax", ">"])
def test_touches_that_add_no_edge_inside_the_module_are_no_branches(touch: str) -> None:
    """Inside the split module the same touches were named branches that no message reached:
    ``names`` listed them and ``values`` had no entry (``KeyError`` in the README's loop), and
    a token-type table showed an empty column (trial 80, Gemma's ``type_as``)."""
    torch.manual_seed(0)
    outer = _TouchedInside(touch).double()
    for p in outer.parameters():
        p.requires_grad_(False)
    h = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
    with semipack.extend(outer, semipack.MaxProd()):
        with semipack.branches(outer) as split:
            out = outer(h)
        _loss(out).backward()
    assert split.names == list(USES)
    assert set(split.values) == set(USES)
    # the oracle: each use of h a leaf of its own (the touches multiply by ones or add zeros)
    copies = {use: h.detach().clone().requires_grad_() for use in USES}
    with semipack.extend(outer.block, semipack.MaxProd()):
        _loss(outer.block(h.detach(), copies)).backward()
    for use in USES:
        torch.testing.assert_close(split.values[use], copies[use].semiring_grad, rtol=1e-12, atol=0)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _WithAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, h: Tensor) -> Tensor:
        return self.lin(h) + _Square.apply(h)


@pytest.mark.parametrize("backward_inside", [True, False])
def test_a_use_by_a_custom_function_is_named_as_in_no_branch(backward_inside: bool) -> None:
    """``Function.apply`` goes through no torch function mode: a custom Function's use of the
    split tensor got no alias, and its paths were missing from every branch with no word
    (trial 82: the branches fell short of the split tensor's value). It warns now, naming the
    node, and ``unseen_uses`` lists it; a module's backward hooks, whose identity node PyTorch
    makes the same way, are no such use."""
    torch.manual_seed(0)
    block = _WithAFunction().double()
    h = torch.randn(4, 3, dtype=F64, requires_grad=True)
    warned = pytest.warns(UserWarning, match=r"used by _SquareBackward, made by a call the block")
    with warned, semipack.extend(block, semipack.Real()):
        with semipack.branches(block) as split:
            out = block(h)
            if backward_inside:
                out.pow(2).sum().backward()
        if not backward_inside:
            out.pow(2).sum().backward()
    assert split.names == ["lin"] and split.unseen_uses == ["_SquareBackward"]
    block.register_full_backward_hook(lambda *_: None)  # behind two hook copies (trial 86)
    block.lin.register_full_backward_hook(lambda *_: None)
    hooked = pytest.warns(UserWarning, match=r"used by _SquareBackward")
    with hooked, semipack.extend(block, semipack.Real()), semipack.branches(block) as split:
        block(h).pow(2).sum().backward()
    assert split.unseen_uses == ["_SquareBackward"]
    block._backward_hooks.clear()
    block.lin._backward_hooks.clear()
    # a hooked module's other input used by a custom Function is no use of the split tensor
    # (trial 87: the hook node's outputs were not told apart)
    two = _WithAFunction().double()
    two.forward = lambda h, g: two.lin(h) + _Square.apply(g)  # type: ignore[method-assign]
    two.register_full_backward_hook(lambda *_: None)
    g = torch.randn(4, 3, dtype=F64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with semipack.extend(two, semipack.Real()), semipack.branches(two) as split:
            two(h, g).pow(2).sum().backward()
    assert split.unseen_uses == []
    tensor_split = pytest.warns(UserWarning, match=r"the split tensor was used by _SquareBackward")
    with tensor_split, semipack.extend(block, semipack.Real()):
        g = h * 1.0
        with semipack.branches(g) as split:
            block(g).pow(2).sum().backward()
    hooked = _WithAFunction().double()
    hooked.forward = lambda h: hooked.lin(h) * h  # type: ignore[method-assign]
    hooked.register_full_backward_hook(lambda *_: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with semipack.extend(hooked, semipack.Real()):
            with semipack.branches(hooked) as split:
                out = hooked(h)
            out.pow(2).sum().backward()
    assert split.names == ["lin", "<root module>"] and split.unseen_uses == []
    total = split.values["lin"] + split.values["<root module>"]  # Real: the branches add up
    torch.testing.assert_close(total, torch.autograd.grad(hooked(h).pow(2).sum(), h)[0])


def test_backward_hooks_on_the_split_module_and_a_submodule_keep_every_branch() -> None:
    """Full backward hooks on the split module and on a submodule put two identity nodes in a
    row before the submodule's input: its use was in no branch, silently (trial 85; BackPACK's
    extended modules, and BERT's attention with its self-attention, the same)."""
    torch.manual_seed(0)
    block = _WithAFunction().double()
    block.forward = lambda h: block.lin(h) * h  # type: ignore[method-assign]
    block.register_full_backward_hook(lambda *_: None)
    block.lin.register_full_backward_hook(lambda *_: None)
    x = torch.randn(3, 3, dtype=F64, requires_grad=True)
    with semipack.extend(block, semipack.Real()), semipack.branches(block) as split:
        h = x * 1.0
        h.retain_grad()
        block(h).pow(2).sum().backward()
    assert split.names == ["lin", "<root module>"]
    torch.testing.assert_close(split.values["lin"] + split.values["<root module>"], h.grad)


def test_an_aten_op_given_the_split_tensor_twice_names_its_arguments() -> None:
    """``torch.ops.aten.mul.Tensor(h, h)``: its signature is ``(*args, **kwargs)``, and the two
    uses were named ``:args`` and ``:kwargs`` although both are positional (trial 85). The
    op's schema names them."""
    torch.manual_seed(0)
    block = _WithAFunction().double()
    block.forward = lambda h: block.lin(h) + torch.ops.aten.mul.Tensor(h, h)  # type: ignore
    x = torch.randn(3, 3, dtype=F64, requires_grad=True)
    with semipack.extend(block, semipack.Real()), semipack.branches(block) as split:
        h = x * 1.0
        h.retain_grad()
        block(h).pow(2).sum().backward()
    assert split.names == ["lin", "<root module>:self", "<root module>:other"]
    torch.testing.assert_close(sum(split.values.values()), h.grad)


def test_a_forward_no_backward_follows_keeps_the_last_backwards_values() -> None:
    """A forward after the last backward (a train-accuracy metric with grad mode on) starts a
    new split, but the last backward's values stay until a backward reaches it (trial 69: they
    were emptied, and a Monitor step recorded no flow shares)."""
    net = _net()
    x = _x()
    with semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block) as split:
        _loss(net(x)).backward()
        net(x * 2)  # a metric: no backward follows
    want = _copies_oracle(net, x, semipack.MaxProd())
    assert set(split.values) == set(USES)
    for use in USES:
        torch.testing.assert_close(split.values[use], want[use], rtol=1e-12, atol=0)


class _MaskFirst(nn.Module):
    """A block called as ``block(mask, h)``: its first tensor requires no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(3, 3)

    def forward(self, mask: Tensor, h: Tensor) -> Tensor:
        return h + self.q(h) * mask


def test_the_split_is_the_first_tensor_that_requires_grad() -> None:
    """``block(mask, h)``: ``h`` is split, not the mask (trial 69: refused as a frozen model)."""
    torch.manual_seed(0)
    emb, block = nn.Linear(2, 3).double(), _MaskFirst().double()
    x, mask = _x(), torch.ones(4, 3, dtype=F64)
    with semipack.extend(nn.ModuleList([emb, block]), semipack.MaxProd()):
        with semipack.branches(block) as split:
            h = torch.tanh(emb(x))
            out = block(mask, h)
        _loss(out).backward()
    assert split.split is h and split.names == ["1.q", "1"]


class _Gated(nn.Module):
    """A gate computed from the block's input before the block: a use with paths."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.net.emb(x))
        gate = torch.sigmoid(h.sum(-1, keepdim=True))
        return self.net.block(h) * gate


def test_each_backward_reads_the_call_it_reaches() -> None:
    """Trial 70: a forward with grad on between micro-batches (a metric) took the split, so
    the next micro-batch's call was not split and the values stayed the first one's; a grad-mode
    forward before the training one left a Monitor step without shares; a gate before the block
    in the second micro-batch was not seen; a split tensor read by two backwards kept both's
    branches. Now each backward reads the call it reaches."""
    net = _net()
    x1, x3 = _x(), (_x() * 0.5 + 0.25).detach().requires_grad_()
    with semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block) as split:
        _loss(net(x1)).backward()
        net(x1 * 3)  # a metric: grad mode on, no backward
        net(x3 * 2)  # a second one
        _loss(net(x3)).backward()
    want = _copies_oracle(net, x3, semipack.MaxProd())
    assert split.calls == 1 and set(split.values) == set(USES)
    for use in USES:
        torch.testing.assert_close(split.values[use], want[use], rtol=1e-12, atol=0)
    gated = _Gated(net)
    before = pytest.warns(UserWarning, match=r"used before the module was called \(by sum\)")
    with before, semipack.extend(gated, semipack.MaxProd()), semipack.branches(net.block) as split:
        _loss(gated(x1)).backward()
        gated(x1 * 3)  # a metric (trial 71: the next micro-batch's gate went unseen)
        _loss(gated(x3)).backward()
    assert split.used_before == ["sum"]
    h = torch.tanh(net.emb(x3))
    with semipack.extend(net, semipack.MaxProd()), semipack.branches(h) as tensor_split:
        _loss(net.block(h)).backward(retain_graph=True)
        _loss(net.block(h) * 2).backward()
    assert len(tensor_split.names) == 8 and len(tensor_split.values) == 4  # the last backward's


def test_a_module_applied_twice_with_inputs_reads_the_outer_call() -> None:
    """``block(block(h))`` with ``inputs=[x]``: the carry passes down to ``x`` reached the inner
    call's aliases as a new backward, which took it over (trial 71: values of the inner call,
    ``at_inputs`` of neither, no warning). Now the outer call's branches, at the split and at
    ``x``, equal those of a model whose outer call is a copy of the block; the backward
    after the block warns. And inside a block, a backward that does not reach the split leaves
    no values (trial 71: an earlier micro-batch's stayed)."""
    net = _net()
    x = _x()
    outer = copy.deepcopy(net.block)
    with semipack.extend(net, semipack.LogSum()):
        with semipack.branches(net.block, inputs=[x]) as shared:
            inner = net.block(torch.tanh(net.emb(x)))
            out = net.block(inner)
        with pytest.warns(UserWarning, match="one backward reached 2 calls of Block"):
            _loss(out).backward()
    model = nn.ModuleList([net, outer])
    with semipack.extend(model, semipack.LogSum()):
        with semipack.branches(outer, inputs=[x]) as apart:
            out = outer(net.block(torch.tanh(net.emb(x))))
        _loss(out).backward()
    assert shared.split is inner and len(shared.values) == len(apart.values) == 4
    for got, want in zip(shared.values.values(), apart.values.values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for got, want in zip(shared.at_inputs.values(), apart.at_inputs.values(), strict=True):
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
    with semipack.extend(net, semipack.MaxProd()), semipack.branches(net.block) as split:
        _loss(net(x)).backward()
        assert split.values
        _loss(torch.tanh(net.emb(x))).backward()  # does not reach the block
        assert split.values == {}


def test_two_splits_of_one_tensor_each_get_the_uses() -> None:
    """The same module split by two blocks (a Monitor's split and the user's), or a module and
    its parent given the same input: each split names its branches after the consumers, with
    the values of one split alone (trial 72: the outer split's branches were the inner one's
    aliases, ``view_as:arg0`` and ``:arg1``, half of them empty)."""
    net, x = _net(), _x()
    with semipack.extend(net, semipack.MaxProd()):
        with semipack.branches(net.block) as alone:
            out = net(x)
        _loss(out).backward()
    for outer_at in (net.block, net):  # the same module, then its parent (whose input is x)
        with semipack.extend(net, semipack.MaxProd()):
            with semipack.branches(outer_at) as outer, semipack.branches(net.block) as inner:
                out = net(x)
            _loss(out).backward()
        assert inner.names == alone.names == list(USES)
        for use in USES:
            torch.testing.assert_close(inner.values[use], alone.values[use], rtol=0, atol=0)
        if outer_at is net.block:
            assert outer.names == list(USES)
            for use in USES:
                torch.testing.assert_close(outer.values[use], alone.values[use], rtol=0, atol=0)


def test_bad_inputs_and_a_split_outside_extend_are_named() -> None:
    """Trial 72: ``inputs=`` entries that are no tensors requiring grad failed inside the
    backward with torch's words; ``aggregate(at=...)`` out of range raised a bare IndexError; a
    split outside ``extend`` gave no values without a word."""
    net, x = _net(), _x()
    for bad, words in ((3, "entry 0 is int"), (torch.ones(2), "entry 0 is a tensor without grad")):
        refused = pytest.raises(TypeError, match=words)
        with semipack.extend(net, semipack.MaxProd()), refused:
            semipack.branches(net.block, inputs=[bad]).__enter__()
    with semipack.extend(net, semipack.MaxProd()):
        with semipack.branches(net.block, inputs=[x]) as split:
            out = net(x)
        _loss(out).backward()
    assert split.aggregate(-1, at=-1).keys() == set(USES)
    with pytest.raises(IndexError, match=r"aggregate\(at=1\): the branches were carried down to 1"):
        split.aggregate(-1, at=1)
    outside = pytest.warns(UserWarning, match="semipack.branches outside semipack.extend")
    with outside, semipack.branches(net.block):
        net(x)


def test_a_split_of_the_first_layer_names_the_input_that_needs_grad() -> None:
    """The first layer's input is the batch itself, which does not require grad in a model
    that is not frozen: the error named a frozen model (trial 115); it names
    ``x.requires_grad_()`` first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    with (
        pytest.raises(semipack.SemipackError, match=r"call x\.requires_grad_\(\) on it"),
        semipack.extend(model, semipack.MaxProd()),
        semipack.branches(model[0]),
    ):
        model(x)
    x.requires_grad_()
    with semipack.extend(model, semipack.MaxProd()), semipack.branches(model[0]) as split:
        model(x).sum().backward()
    assert split.names
