"""``explain_layers`` / ``LayerFlow`` and ``layer_routes``: checked against tensors retained in
plain semiring runs (no split), against TopPath's own values, and on hand-made paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_bert_config

import semipack
from semipack.explain import AttentionLayer, attention_layers, layer_routes, plot_routes
from semipack.messages.paths import Path as SemiringPath
from semipack.messages.paths import PathStep

transformers = pytest.importorskip("transformers")
IDS = torch.tensor([[2, 5, 7, 9, 3]])


def _bert(layers: int = 2):
    torch.manual_seed(0)
    cfg = tiny_bert_config(num_hidden_layers=layers)
    return transformers.BertModel._from_config(cfg, attn_implementation="eager").eval().double()


def _target(model):
    return lambda: model(input_ids=IDS).last_hidden_state[0, 1:3].sum()


def _retained(model, semiring):
    """Each attention layer's input and each output projection's input, retained in a plain
    run (no branch split): their ``semiring_grad`` is every path to them."""
    inputs, contexts, handles = [], [], []
    for layer in model.encoder.layer:
        handles.append(layer.attention.register_forward_pre_hook(
            lambda m, a: inputs.append(a[0]) or a[0].retain_grad()))  # fmt: skip
        handles.append(layer.attention.output.register_forward_pre_hook(
            lambda m, a: contexts.append(a[0]) or a[0].retain_grad()))  # fmt: skip
    with semipack.extend(model, semiring):
        _target(model)().backward()
    for h in handles:
        h.remove()
    return [x.semiring_grad for x in inputs], [c.semiring_grad for c in contexts]


@pytest.mark.parametrize(
    ("semiring", "union"),
    [
        (semipack.MaxProd(), lambda v, d: v.amax(d)),
        (semipack.LogSum(), lambda v, d: v.logsumexp(d)),
    ],
)
def test_totals_and_heads_are_every_path_to_the_retained_tensors(semiring, union) -> None:
    model = _bert()
    flow = semipack.explain_layers(model, type(semiring)(), _target(model))
    inputs, contexts = _retained(model, type(semiring)())
    assert flow.layers == ["encoder.layer.0.attention", "encoder.layer.1.attention"]
    for i in range(2):
        torch.testing.assert_close(flow.total[i], union(inputs[i], -1), rtol=1e-10, atol=0)
        heads = contexts[i].reshape(1, 5, 2, 4)
        torch.testing.assert_close(flow.heads[i], union(heads, -1), rtol=1e-10, atol=0)
        # the branches together are every path: MaxProd's max, LogSum's log-sum-exp
        stacked = torch.stack(list(flow.branches[i].values()))
        torch.testing.assert_close(union(stacked, 0), flow.total[i], rtol=1e-10, atol=0)
        assert set(flow.branches[i]) == {"query", "key", "value", "residual"}


def test_shares_tables_and_best_branches() -> None:
    model = _bert()
    best = semipack.explain_layers(model, semipack.MaxProd(), _target(model), tokens=list("abcde"))
    flow = semipack.explain_layers(model, semipack.LogSum(), _target(model))
    for i, layer in enumerate(best.branches):
        names = list(layer)
        winners = [names[int(k)] for k in torch.stack(list(layer.values()))[:, 0].argmax(0)]
        assert [row[i] for row in best.best_branch()] == winners
        want = {n: winners.count(n) / 5 for n in names}
        assert best.branch_shares()[i] == pytest.approx(want)
        # LogSum: each branch's flow over all tokens, over the flow of every branch
        logs = {n: float(v[0].logsumexp(0)) for n, v in flow.branches[i].items()}
        whole = float(torch.tensor(list(logs.values())).logsumexp(0))
        got = flow.branch_shares()[i]
        assert got == pytest.approx(
            {n: torch.tensor(v - whole).exp().item() for n, v in logs.items()}
        )
        head_flow = flow.heads[i, 0].logsumexp(0)
        assert flow.head_shares()[i] == pytest.approx(
            (head_flow - head_flow.logsumexp(0)).exp().tolist()
        )
    table = best.table().splitlines()
    assert table[1].split()[:5] == ["layer", "query", "key", "value", "residual"]
    assert table[2].split()[1:5] == [
        f"{best.branch_shares()[0][n]:.1%}" for n in ("query", "key", "value", "residual")
    ]
    assert best.token_table().splitlines()[1].split() == ["a", *best.best_branch()[0]]
    with pytest.raises(
        semipack.SemipackError, match="best_branch needs MaxProd or TopPath, not LogSum"
    ):
        flow.best_branch()


def test_entropy_of_a_token_is_the_entropy_of_the_union_of_its_units(tmp_path: Path) -> None:
    """Independent route to the union: add a zero ``z[token]`` broadcast over the hidden units
    to the layer's input; its paths are exactly the union of the token's units' paths (each
    extended by an edge of weight 1), read by the broadcast rule, not by ``aggregate``."""
    model = _bert()
    flow = semipack.explain_layers(model, semipack.Entropy(), _target(model))
    for i, layer in enumerate(model.encoder.layer):
        z = torch.zeros(1, 5, 1, dtype=torch.float64, requires_grad=True)
        hook = layer.attention.register_forward_pre_hook(lambda m, a, z=z: (a[0] + z, *a[1:]))
        with semipack.extend(model, semipack.Entropy(), regular_grads=False):
            _target(model)().backward()
        hook.remove()
        torch.testing.assert_close(flow.total[i], z.semiring_grad[..., 0], rtol=1e-9, atol=1e-12)
    assert flow.table().startswith("Entropy: mean over tokens of each branch's Entropy value")
    flow.plot_heatmap(tmp_path / "heat.png")
    best = semipack.explain_layers(model, semipack.MaxProd(), _target(model))
    best.plot_branch_shares(tmp_path / "shares.png")
    for name in ("heat.png", "shares.png"):
        assert (tmp_path / name).stat().st_size > 1000


def _step(module: str, index: tuple[int, ...]) -> PathStep:
    return PathStep(f"{module} {index}", module, "op", index, 0.0)


def test_routes_follow_hand_made_paths() -> None:
    """Module names and entries decide each hop: the projection's token is where the path
    enters, its unit // head_dim the head, the layer's last entry where it leaves."""
    layers = [AttentionLayer(f"enc.layer.{i}.attention", None, None, 2, 4) for i in range(3)]
    steps = [
        _step("emb", (0, 1, 3)),
        _step("enc.layer.0.attention.self.key", (0, 1, 6)),  # unit 6: head 1
        _step("enc.layer.0.attention.self", (0, 1, 4, 1)),  # [b, heads, q, k]
        _step("enc.layer.0.output.LayerNorm", (0, 4, 2)),
        _step("enc.layer.1.attention.output", (0, 4, 2)),  # no projection: residual
        _step("enc.layer.1.output.LayerNorm", (0, 4, 5)),
        _step("enc.layer.2.attention.self.value", (0, 4, 1)),
        _step("enc.layer.2.output.LayerNorm", (0, 0, 1)),
    ]
    path = SemiringPath("x", (0, 1, 3), -1.0, steps)
    (route,) = layer_routes([path], layers)
    got = [(h.layer, h.token_in, h.token_out, h.branch, h.head) for h in route.hops]
    assert got == [(0, 1, 4, "key", 1), (1, 4, 4, "residual", None), (2, 4, 0, "value", 0)]
    assert route.describe(list("abcde")) == (
        f"{route.value:.4g}  from b: L0 key head 1: b -> e, L1 residual, L2 value head 0: e -> a"
    )


def test_each_tokens_top_path_read_layer_by_layer(tmp_path: Path) -> None:
    model = _bert(layers=2)
    words = model.embeddings.word_embeddings(IDS).detach().requires_grad_()
    top = semipack.TopPath()
    with semipack.extend(model, top, regular_grads=False):
        model(inputs_embeds=words).last_hidden_state[0, 1:3].sum().backward()
    units = words.semiring_grad[0].argmax(-1)
    paths = [top.path(words, (0, t, int(u))) for t, u in enumerate(units)]
    routes = layer_routes(paths, attention_layers(model))
    for t, route in enumerate(routes):
        assert route.value == pytest.approx(float(words.semiring_grad[0, t, units[t]]), rel=1e-12)
        assert [h.layer for h in route.hops] == [0, 1]
        assert route.hops[0].token_in == t
        assert route.hops[0].token_out == route.hops[1].token_in  # the path is continuous
        assert route.hops[1].token_out in (1, 2)  # the target reads tokens 1 and 2
        for hop in route.hops:
            assert (hop.branch == "residual") == (hop.head is None)
    plot_routes(routes, list("abcde"), 2, tmp_path / "paths.png")
    assert (tmp_path / "paths.png").stat().st_size > 1000


def test_llama_layers_and_unknown_models() -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=16, max_position_embeddings=8,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaModel._from_config(cfg, attn_implementation="sdpa").double()
    found = attention_layers(llama)
    assert [(a.name, a.num_heads, a.head_dim) for a in found] == [
        ("layers.0.self_attn", 2, 4),
        ("layers.1.self_attn", 2, 4),
    ]
    flow = semipack.explain_layers(
        llama, semipack.MaxProd(), lambda: llama(input_ids=IDS).last_hidden_state.sum()
    )
    assert all(set(layer) == {"query", "key", "value"} for layer in flow.branches)
    assert flow.heads.shape == (2, 1, 5, 2)
    with pytest.raises(semipack.SemipackError, match="no attention layers found in Sequential"):
        attention_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(semipack.SemipackError, match="target\\(\\) must return a scalar"):
        semipack.explain_layers(llama, semipack.MaxProd(), lambda: llama(input_ids=IDS)[0])
