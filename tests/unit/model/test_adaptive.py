"""Adaptive input and adaptive softmax: exact probabilities, a slow reference, no [N, vocab] in the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.model.test_model import run_segments
from xl.model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL, count_parameters

V, D = 50, 16
WORDS = dict(vocab_size=V, n_layer=2, n_head=2, d_model=D, d_head=8, d_inner=32, dropout=0.0, cutoffs=(10, 20, 35))


def softmax_pair(cutoffs, div_val, seed=0, **layout):
    torch.manual_seed(seed)
    emb = AdaptiveEmbedding(V, D, cutoffs, div_val, **layout).double()
    out = AdaptiveLogSoftmax(V, D, cutoffs, div_val, **layout).double()
    for p in list(emb.parameters()) + list(out.parameters()):
        torch.nn.init.normal_(p, 0.0, 0.5)
    return emb, out


@pytest.mark.parametrize("cutoffs,div_val", [((10,), 1), ((10, 20, 35), 1), ((10, 20, 35), 2), ((5, 45), 4)])
def test_probabilities_sum_to_one_over_the_vocabulary(cutoffs, div_val):
    _, out = softmax_pair(cutoffs, div_val)
    logp = out(torch.randn(3, 7, D, dtype=torch.float64))
    assert logp.shape == (3, 7, V)
    torch.testing.assert_close(logp.logsumexp(-1), torch.zeros(3, 7, dtype=torch.float64), rtol=0, atol=1e-12)


def test_single_cluster_is_the_full_softmax():
    _, out = softmax_pair((), 1)
    hidden = torch.randn(4, 6, D, dtype=torch.float64)
    table = out.tables[0]
    full = F.log_softmax(hidden @ table.weight.T + table.bias, dim=-1)
    torch.testing.assert_close(out(hidden), full, rtol=1e-12, atol=1e-12)
    targets = torch.randint(0, V, (4, 6))
    torch.testing.assert_close(out.nll(hidden, targets), F.cross_entropy(full.flatten(0, 1), targets.flatten()))


def reference_log_prob(out: AdaptiveLogSoftmax, h: torch.Tensor, word: int) -> torch.Tensor:
    """One position, one word, by the definition: p(word) = p_head(its cluster) · p_cluster(word)."""
    bounds = out.bounds
    cluster = max(i for i in range(len(bounds) - 1) if bounds[i] <= word)

    def scores(i):
        proj = out.projs[i]
        x = h if isinstance(proj, torch.nn.Identity) else proj.weight.T @ h
        return out.tables[i].weight @ x + out.tables[i].bias

    head = scores(0)
    if out.cluster is not None:
        head = torch.cat([head, out.cluster.weight @ (h if isinstance(out.projs[0], torch.nn.Identity)
                                                      else out.projs[0].weight.T @ h) + out.cluster.bias])
    head = head.log_softmax(0)
    if cluster == 0:
        return head[word]
    return head[bounds[1] + cluster - 1] + scores(cluster).log_softmax(0)[word - bounds[cluster]]


# The original Transformer-XL's layouts: every cluster projected (also one d_model wide), a first cluster narrower or
# wider than d_model.
LAYOUTS = [dict(proj_all=True), dict(d_embed=8), dict(d_embed=24, proj_all=True)]


@pytest.mark.parametrize("div_val,layout", [(1, {}), (2, {}), *((d, lay) for d in (1, 2) for lay in LAYOUTS)])
def test_log_probs_and_loss_match_the_definition(div_val, layout):
    _, out = softmax_pair((10, 20, 35), div_val, **layout)
    hidden = torch.randn(2, 5, D, dtype=torch.float64)
    targets = torch.tensor([[0, 9, 10, 19, 20], [34, 35, 49, -100, 3]])
    logp = out(hidden)
    expected = []
    for b in range(2):
        for t in range(5):
            if targets[b, t] >= 0:
                ref = reference_log_prob(out, hidden[b, t], int(targets[b, t]))
                torch.testing.assert_close(logp[b, t, targets[b, t]], ref, rtol=1e-12, atol=1e-12)
                expected.append(-ref)
    torch.testing.assert_close(out.nll(hidden, targets), torch.stack(expected).mean(), rtol=1e-12, atol=1e-12)


def test_loss_gradient_equals_the_full_log_prob_gradient():
    _, out = softmax_pair((10, 20, 35), 2)
    hidden = torch.randn(16, D, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (16,))
    g_nll = torch.autograd.grad(out.nll(hidden, targets), [hidden, *out.parameters()])
    g_full = torch.autograd.grad(-out(hidden).gather(1, targets[:, None]).mean(), [hidden, *out.parameters()])
    for a, b in zip(g_nll, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cutoffs,div_val,layout", [((10, 20, 35), 1, {}), ((10, 20, 35), 2, {}), ((5, 45), 4, {}),
                                                    *(((10, 20, 35), d, lay) for d in (1, 2) for lay in LAYOUTS)])
def test_adaptive_embedding_matches_a_per_token_lookup(cutoffs, div_val, layout):
    emb, _ = softmax_pair(cutoffs, div_val, **layout)
    ids = torch.arange(V).view(5, 10)
    got = emb(ids)
    for word in range(V):
        i = max(c for c in range(len(cutoffs) + 1) if emb.bounds[c] <= word)
        vector = emb.tables[i].weight[word - emb.bounds[i]]
        if not isinstance(emb.projs[i], torch.nn.Identity):
            vector = emb.projs[i].weight @ vector
        torch.testing.assert_close(got.view(V, D)[word], vector, rtol=1e-12, atol=1e-12)


def test_tied_model_shares_word_vectors_and_projections():
    model = TransformerXL(XLConfig(**WORDS, div_val=2))
    for out_table, in_table in zip(model.head.tables, model.embed.tables, strict=True):
        assert out_table.weight is in_table.weight
    assert model.head.projs[1].weight is model.embed.projs[1].weight
    untied = count_parameters(XLConfig(**WORDS, div_val=2, tie_projs=False))
    assert untied - count_parameters(XLConfig(**WORDS, div_val=2)) == D * (8 + 4 + 2)


@pytest.mark.parametrize("div_val", [1, 2])
def test_adaptive_model_segments_equal_full_sequence(div_val):
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(**WORDS, div_val=div_val, mem_len=24)).double().eval()
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens).logits
        segmented, _ = run_segments(model, tokens, 8)
        out = model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False)
    torch.testing.assert_close(segmented, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full.logsumexp(-1), torch.zeros(2, 24, dtype=torch.float64), rtol=0, atol=1e-10)
    expected = -model(tokens[:, :-1]).logits.gather(-1, tokens[:, 1:, None]).mean()
    torch.testing.assert_close(out.loss, expected, rtol=1e-10, atol=1e-10)
    assert out.logits is None


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


def test_training_loss_never_materialises_positions_times_vocabulary():
    vocab, cutoffs = 20000, (200, 2000)
    model = TransformerXL(XLConfig(**{**WORDS, "vocab_size": vocab, "cutoffs": cutoffs}, div_val=2)).train()
    x = torch.randint(0, vocab, (4, 16))
    y = torch.randint(0, 200, (4, 16))  # mostly frequent words, as in real text
    y[0, :4] = torch.tensor([300, 1999, 5000, 19999])  # and a few from each tail cluster
    with LargestTensor() as watch:
        out = model(x, targets=y, return_logits=False)
        out.loss.backward()
    n = x.numel()
    assert watch.largest < n * vocab / 10, f"largest tensor {watch.largest:,} elements vs N×V = {n * vocab:,}"
    assert watch.largest >= n * (200 + 2)  # the head's scores are there: the watch does see the loss


@pytest.mark.parametrize("field,value", [("cutoffs", (20, 10)), ("cutoffs", (0, 10)), ("cutoffs", (10, 50)),
                                         ("div_val", 0), ("div_val", 64)])
def test_invalid_adaptive_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        XLConfig(**{**WORDS, field: value})


def test_every_parameter_gets_a_gradient_even_when_a_cluster_has_no_targets():
    """DDP (without find_unused_parameters) needs every parameter in every step's graph."""
    model = TransformerXL(XLConfig(**WORDS, div_val=2, tie_weights=False))
    x = torch.randint(0, V, (2, 6))
    model(x, targets=torch.zeros(2, 6, dtype=torch.long)).loss.backward()  # every target in the head cluster
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []


def old_layout(config: XLConfig) -> dict[str, tuple[int, ...]]:
    """The weights' names and shapes of an adaptive model as every earlier checkpoint has them, written out: cluster i
    is d_model // div_val**i wide, projected only where that differs from d_model, tied as tie_weights and tie_projs
    say."""
    d, bounds = config.d_model, [0, *config.cutoffs, config.vocab_size]
    names = {}
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        w = d // config.div_val**i
        names[f"embed.tables.{i}.weight"] = names[f"head.tables.{i}.weight"] = (hi - lo, w)
        names[f"head.tables.{i}.bias"] = (hi - lo,)
        if w != d:
            names[f"embed.projs.{i}.weight"] = names[f"head.projs.{i}.weight"] = (d, w)
    names["head.cluster.weight"], names["head.cluster.bias"] = (len(bounds) - 2, d), (len(bounds) - 2,)
    return names


@pytest.mark.parametrize("div_val,tie_weights,tie_projs", [(1, True, True), (2, True, True), (2, True, False),
                                                           (2, False, True), (2, False, False)])
def test_earlier_checkpoints_keep_their_weight_names_and_shapes(div_val, tie_weights, tie_projs):
    """Configs without d_embed or proj_all (every earlier checkpoint's) build the weights they were saved with, and a
    saved config without the new fields reads as before; its weights load."""
    old = dict(WORDS, div_val=div_val, tie_weights=tie_weights, tie_projs=tie_projs)
    model = TransformerXL(XLConfig.from_dict(old))
    state = model.state_dict()
    adaptive = {k: tuple(v.shape) for k, v in state.items() if k.startswith(("embed.", "head."))}
    assert adaptive == old_layout(model.config)
    fresh = TransformerXL(XLConfig.from_dict(old))
    fresh.load_state_dict(state)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    assert (model.head.projs[1] is model.embed.projs[1]) == (tie_weights and tie_projs)
    assert (model.head.tables[1].weight is model.embed.tables[1].weight) == tie_weights


def test_the_original_layout_projects_every_cluster_and_ties_per_cluster():
    """proj_all: the first cluster is projected too; tie_projs per cluster ties exactly those marked; div_val 1 has one
    input projection for all clusters (the original's one table), and the softmax one per cluster."""
    model = TransformerXL(XLConfig(**WORDS, div_val=2, proj_all=True, tie_projs=(False, True, True, False)))
    embed, head = model.embed, model.head
    assert [tuple(p.weight.shape) for p in embed.projs] == [(D, 16), (D, 8), (D, 4), (D, 2)]
    assert [head.projs[i] is embed.projs[i] for i in range(4)] == [False, True, True, False]
    assert all(head.tables[i].weight is embed.tables[i].weight for i in range(4))
    expected = count_parameters(XLConfig(**WORDS, div_val=2)) + D * 16 + D * 16 + D * 2  # two of cluster 0, one
    assert count_parameters(model.config) == expected  # untied of cluster 3
    shared = TransformerXL(XLConfig(**WORDS, d_embed=8, tie_projs=(False, True, False, True)))
    assert all(p is shared.embed.projs[0] for p in shared.embed.projs)
    assert [shared.head.projs[i] is shared.embed.projs[0] for i in range(4)] == [False, True, False, True]
    assert [t.weight.shape[1] for t in shared.embed.tables] == [8] * 4
    # the rest of the model: an untied d_model-wide model less its word vectors, biases and cluster scores
    layers = count_parameters(XLConfig(**WORDS, tie_weights=False)) - (2 * V * D + V + 3 * D + 3)
    # word vectors 8 wide (shared), the biases, the cluster scores, one input and two output projections
    assert count_parameters(shared.config) == layers + V * 8 + V + 3 * 8 + 3 + 3 * D * 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_original_layout_model_segments_equal_full_sequence(layout):
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(**WORDS, div_val=2, mem_len=24, tie_projs=(False, True, True, True),
                                   **layout)).double().eval()
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens).logits
        segmented, _ = run_segments(model, tokens, 8)
    torch.testing.assert_close(segmented, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full.logsumexp(-1), torch.zeros(2, 24, dtype=torch.float64), rtol=0, atol=1e-10)


@pytest.mark.parametrize("values,named", [
    (dict(tie_projs=(True, False)), "tie_projs"), (dict(tie_projs=(True, False, 1, True)), "tie_projs"),
    (dict(cutoffs=(), d_embed=8), "d_embed=8 needs"), (dict(cutoffs=(), proj_all=True), "proj_all=true needs"),
    (dict(d_embed=0), "d_embed"), (dict(d_embed=4, div_val=8), "div_val"),
])
def test_invalid_projection_settings_name_the_field(values, named):
    with pytest.raises(ValueError, match=named):
        XLConfig(**{**WORDS, **values})
