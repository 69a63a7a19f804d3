"""The mechanism, claim by claim, against the loop reference in tests/helpers/reference.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.memories import xl_config
from tests.helpers.reference import naive_position_scores, reference_attention, reference_logits
from xl.device.footprint import cache_footprint
from xl.memory.store import nbytes
from xl.model.attention import TrainingAttentionCPU, rel_shift
from xl.model.config import XLConfig
from xl.model.dropout import keep_mask
from xl.model.positions import attention_mask
from xl.model.transformer import TransformerXL, count_parameters

TINY = dict(vocab_size=32, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, dropout=0.0)


def make_model(dtype=torch.float64, seed=0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    return TransformerXL(xl_config(**{**TINY, **overrides})).to(dtype).eval()


def run_segments(model, tokens, seg_len, **kw):
    mems, logits = None, []
    for start in range(0, tokens.size(1), seg_len):
        out = model(tokens[:, start:start + seg_len], mems, **kw)
        mems = out.mems
        logits.append(out.logits)
    return torch.cat(logits, 1), mems


@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize("seg_len", [1, 3, 5, 8])
def test_segmented_equals_full_sequence(pre_lnorm, seg_len):
    total = 24
    model = make_model(pre_lnorm=pre_lnorm, mem_len=total)
    tokens = torch.randint(0, 32, (2, total), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens).logits
        segmented, _ = run_segments(model, tokens, seg_len)
    torch.testing.assert_close(segmented, full, rtol=1e-10, atol=1e-10)


def test_segmented_equals_full_sequence_float32():
    model = make_model(torch.float32, mem_len=64)
    tokens = torch.randint(0, 32, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens).logits
        segmented, _ = run_segments(model, tokens, 16)
    torch.testing.assert_close(segmented, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "seg_len,mem_len,clamp_len,same_length,pre_lnorm",
    [(4, 5, -1, False, False), (4, 3, -1, False, True), (3, 4, 2, False, False),
     (4, 6, -1, True, False), (4, 2, 3, True, True), (5, 0, -1, False, False)],
)
def test_finite_memory_matches_loop_reference(seg_len, mem_len, clamp_len, same_length, pre_lnorm):
    model = make_model(pre_lnorm=pre_lnorm)
    tokens = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast, mems = run_segments(model, tokens, seg_len, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length)
    slow = reference_logits(model, tokens, seg_len, mem_len, clamp_len, same_length)
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-9)
    assert [m.shape for m in mems] == [(2, min(mem_len, 13), 16)] * 2


@pytest.mark.parametrize("m_len,clamp_len", [(0, -1), (5, -1), (5, 3), (7, 1)])
def test_rel_shift_equals_naive_position_scores(m_len, clamp_len):
    model = make_model(clamp_len=clamp_len)
    attn = model.layers[0].attn
    h = torch.randn(2, 4, 16, dtype=torch.float64)
    mem = torch.randn(2, m_len, 16, dtype=torch.float64)
    L, K, H, D = 4, m_len + 4, 2, 8
    pos_emb, _ = model._context(L, m_len, clamp_len, None)
    with torch.no_grad():
        q = attn.q_net(h).view(2, L, H, D)
        r = attn.r_net(pos_emb).view(K, H, D).permute(1, 2, 0)
        shifted = rel_shift(torch.matmul((q + attn.r_r_bias).transpose(1, 2), r))
        naive = naive_position_scores(attn, h, mem, clamp_len)
    visible = ~naive.isnan()
    assert visible.sum() == 2 * H * (L * m_len + L * (L + 1) // 2)
    torch.testing.assert_close(shifted[visible], naive[visible], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("pre_lnorm", "dropout", "train"), [
    (False, 0.0, True), (True, 0.0, True), (False, 0.1, True), (True, 0.1, True), (False, 0.3, True),
    (False, 0.1, False),
])
def test_feed_forward_equals_its_sequential(pre_lnorm, dropout, train):
    """The feed-forward runs its layers by hand (ReLU and the first dropout in place, dropout's scale folded
    into the first product): values and every gradient equal running the ``nn.Sequential`` it holds, with
    the same random draws (p = 0.1 zeroes drawn positions, p = 0.3 multiplies by a mask)."""
    ff = make_model(pre_lnorm=pre_lnorm, dropout=dropout).train(train).layers[0].ff
    h = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, 16, dtype=torch.float64)
    results = []
    for run in (ff, lambda x: ff._residual(x, ff.net(ff.layer_norm(x) if pre_lnorm else x))):
        ff.zero_grad()
        h.grad = None
        torch.manual_seed(7)
        out = run(h)
        out.backward(grad_out)
        results.append([out, h.grad] + [p.grad for p in ff.parameters()])
    # With dropout the Sequential's mask holds 1/(1-p) rounded to float32 (Dropout draws masks in float32).
    tol = 1e-12 if dropout == 0 or not train else 1e-6
    for fast, slow in zip(*results, strict=True):
        torch.testing.assert_close(fast, slow, rtol=tol, atol=tol)


@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_attention_module_matches_reference(pre_lnorm):
    model = make_model(pre_lnorm=pre_lnorm)
    attn = model.layers[1].attn
    h, mem = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 6, 16, dtype=torch.float64)
    pos_emb, mask = model._context(5, 6, -1, None)
    with torch.no_grad():
        torch.testing.assert_close(attn(h, mem, pos_emb, mask)[0], reference_attention(attn, h, mem))


@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize(("clamp_len", "window"), [(-1, None), (3, 4)])
def test_training_attention_gradients_match_reference(pre_lnorm, clamp_len, window, monkeypatch):
    """With gradients on CPU the sublayer runs its hand-written backward: every gradient equals autograd's
    through the score-by-score reference."""
    model = make_model(pre_lnorm=pre_lnorm).train()  # TINY: dropout 0, so train mode is deterministic
    attn = model.layers[1].attn
    h = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(2, 6, 16, dtype=torch.float64)
    pos_emb, mask = model._context(5, 6, clamp_len, window)
    out_grad = torch.randn(2, 5, 16, dtype=torch.float64)
    calls = []
    backward = TrainingAttentionCPU.backward
    monkeypatch.setattr(TrainingAttentionCPU, "backward",
                        staticmethod(lambda ctx, grad: calls.append(True) or backward(ctx, grad)))
    results = []
    for run in (lambda: attn(h, mem, pos_emb, mask)[0], lambda: reference_attention(attn, h, mem, clamp_len, window)):
        attn.zero_grad()
        h.grad = None
        out = run()
        out.backward(out_grad)
        results.append([out.detach(), h.grad] + [p.grad for p in attn.parameters()])
    assert calls == [True], "the hand-written CPU backward ran, once"
    for fast, slow in zip(*results, strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("B", "heads_outer"), [(2, True), (2, False), (1, True)])
def test_training_attention_backward_with_attention_dropout(B, heads_outer):
    """The hand-written backward, attention dropout included, against finite differences; position scores
    in the bmm's layout (heads outermost) and in plain [B, H, L, K] order."""
    torch.manual_seed(0)
    H, L, M, D = 2, 4, 3, 5
    q_w = torch.randn(B, L, H, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, H, M + L, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pos = (torch.randn(H, B, L, M + L, dtype=torch.float64).transpose(0, 1) if heads_outer
           else torch.randn(B, H, L, M + L, dtype=torch.float64)).requires_grad_()
    mask = attention_mask(L, M, None, torch.device("cpu")).double()
    drop = keep_mask((B, H, L, M + L), 0.3, torch.float64, torch.device("cpu"))
    assert torch.autograd.gradcheck(
        lambda *xs: TrainingAttentionCPU.apply(*xs, mask, 0.4, drop), (q_w, k, v, pos))


def test_bf16_autocast_training_step_close_to_fp32():
    model = make_model(torch.float32, mem_len=8).train()
    tokens = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(2))
    grads = []
    for low in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
            mems = model(tokens[:, :8]).mems
            loss = model(tokens[:, 8:16], mems, tokens[:, 9:17]).loss
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.isfinite(grads[1]).all()
    assert (grads[1] - grads[0]).norm() < 0.02 * grads[0].norm()  # measured 0.3%


def test_attention_mask_shapes_the_window():
    mask = attention_mask(3, 2, None, torch.device("cpu"))
    assert (mask == 0).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    same = attention_mask(3, 2, 2, torch.device("cpu"))
    assert (same == 0).tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def test_no_gradient_reaches_the_memory():
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(**TINY, mem_len=8)).train()
    tokens = torch.randint(0, 32, (2, 17))
    fired = []

    def watch(module, args, out):  # any gradient flowing back into segment k-1 would pass here
        out.register_hook(lambda grad: fired.append(grad))

    handle = model.embed.register_forward_hook(watch)
    prev = model(tokens[:, :8], targets=tokens[:, 1:9])
    handle.remove()
    assert all(not m.requires_grad and m.grad_fn is None for m in prev.mems)

    model(tokens[:, 8:16], prev.mems, targets=tokens[:, 9:17]).loss.backward()
    assert fired == []
    assert all(m.grad is None for m in prev.mems)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # The same segment with the memory handed in as fresh constants gives the same gradients.
    model.zero_grad()
    model(tokens[:, 8:16], [m.clone() for m in prev.mems], targets=tokens[:, 9:17]).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=0)


def graph_size(loss: torch.Tensor) -> int:
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return len(seen)


def test_training_memory_does_not_grow_with_segments():
    torch.manual_seed(0)
    model = TransformerXL(XLConfig(**TINY, mem_len=6)).train()
    tokens = torch.randint(0, 32, (2, 8 * 12 + 1))
    mems, sizes, saved_bytes = None, [], []
    for k in range(12):
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens[:, 8 * k:8 * k + 8], mems, targets=tokens[:, 8 * k + 1:8 * k + 9])
        sizes.append(graph_size(out.loss))
        saved_bytes.append(total[0])
        out.loss.backward()
        mems = out.mems
    # Once the memory is full (segment 2 on), each step's graph and saved activations are the same size.
    assert len(set(sizes[1:])) == 1 and len(set(saved_bytes[1:])) == 1
    assert sizes[1] < 2 * sizes[0] + 10


def test_memory_of_layer_n_is_input_of_layer_n():
    model = make_model(mem_len=5)
    seen: dict[int, list] = {}
    hooks = [layer.register_forward_hook(lambda mod, args, out, n=n: seen.setdefault(n, []).append((args, out)))
             for n, layer in enumerate(model.layers)]
    emb = []
    hooks.append(model.embed.register_forward_hook(lambda mod, args, out: emb.append(out * model.emb_scale)))
    tokens = torch.randint(0, 32, (3, 8))
    with torch.no_grad():
        first = model(tokens[:, :4])
        second = model(tokens[:, 4:], first.mems)
    for h in hooks:
        h.remove()
    n_layer = model.config.n_layer
    assert len(second.mems) == n_layer
    for n in range(n_layer):
        # Memory given to layer n in segment 2 = what entered layer n in segment 1 = layer n-1's output.
        produced = emb[0] if n == 0 else seen[n - 1][0][1][0]  # a layer returns (output, (keys, values))
        (h2, [mem2], *_), _ = seen[n][1]  # the memory's pieces: the plain cache is one
        torch.testing.assert_close(mem2, produced)
        # New memory = last 5 of (old memory ∘ segment 2's layer input).
        torch.testing.assert_close(second.mems[n], torch.cat([produced, h2], 1)[:, -5:])
        assert second.mems[n].dtype == torch.float64 and second.mems[n].shape == (3, 5, 16)
    fp = cache_footprint(5, 16, n_layer, 3, torch.float64)
    assert nbytes(second.mems) == fp.bytes == 5 * 16 * n_layer * 3 * 8


@pytest.mark.parametrize("mem_len", [0, 4])
def test_causality_within_and_across_segments(mem_len):
    model = make_model(mem_len=mem_len)
    tokens = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(4))
    changed = tokens.clone()
    changed[0, 9] = (tokens[0, 9] + 1) % 32
    with torch.no_grad():
        a, _ = run_segments(model, tokens, 4)
        b, _ = run_segments(model, changed, 4)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    # A change in segment 1 reaches segment 2 only through the memory.
    early = tokens.clone()
    early[0, 1] = (tokens[0, 1] + 1) % 32
    with torch.no_grad():
        c, _ = run_segments(model, early, 4)
    assert torch.allclose(a[:, 4:8], c[:, 4:8]) == (mem_len == 0)


def test_bf16_autocast_close_to_fp32():
    model = make_model(torch.float32, mem_len=8)
    tokens = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        ref, _ = run_segments(model, tokens, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, mems = run_segments(model, tokens, 8)
    assert low.dtype == torch.bfloat16 and mems[0].dtype == torch.float32
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max()
    assert (low.float().softmax(-1) - ref.softmax(-1)).abs().max() < 0.02


@pytest.mark.parametrize("mem_dtype", ["bfloat16", "float16"])
def test_low_precision_cache_halves_memory_and_rounds_only_the_cache(mem_dtype):
    full = make_model(torch.float32, mem_len=8)
    low = make_model(torch.float32, mem_len=8, mem_dtype=mem_dtype)
    tokens = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, ref_mems = run_segments(full, tokens, 8)
        got, mems = run_segments(low, tokens, 8)
        # The states are computed in float32 and only then rounded for the cache.
        first_full, first_low = full(tokens[:, :8]).mems, low(tokens[:, :8]).mems
    dtype = getattr(torch, mem_dtype)
    for a, b in zip(first_full, first_low, strict=True):
        assert torch.equal(a.to(dtype), b)
    assert all(m.dtype == dtype for m in mems) and got.dtype == torch.float32
    assert nbytes(mems) == nbytes(ref_mems) // 2 == cache_footprint(8, 16, 2, 2, dtype).bytes
    torch.testing.assert_close(got[:, :8], ref[:, :8], rtol=0, atol=0)
    assert 0 < (got - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("seg_len,mem_len,clamp_len,same_length,pre_lnorm",
                         [(4, 6, -1, False, False), (4, 4, 3, True, True), (5, 3, -1, False, False),
                          (3, 0, -1, False, False), (2, 9, -1, False, True)])
def test_cached_keys_and_values_give_the_same_evaluation(seg_len, mem_len, clamp_len, same_length, pre_lnorm):
    model = make_model(pre_lnorm=pre_lnorm)
    tokens = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(5))
    context = dict(mem_len=mem_len, clamp_len=clamp_len, same_length=same_length)
    with torch.no_grad():
        expected, _ = run_segments(model, tokens, seg_len, **context)
        mems, kv, logits = None, None, []
        for start in range(0, tokens.size(1), seg_len):
            out = model(tokens[:, start:start + seg_len], mems, kv=kv, cache_kv=True, **context)
            mems, kv = out.mems, out.kv
            logits.append(out.logits)
            for (k, v), m, layer in zip(kv, mems, model.layers, strict=True):
                # The cached keys/values are exactly the projection of the memory they travel with.
                k_ref, v_ref = layer.attn.project_memory(m)
                torch.testing.assert_close(k, k_ref, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(v, v_ref, rtol=1e-12, atol=1e-12)
        # Starting from a memory without its keys/values projects them once.
        resumed = model(tokens[:, -seg_len:], mems, cache_kv=True, **context).logits
        reference = model(tokens[:, -seg_len:], mems, **context).logits
    torch.testing.assert_close(torch.cat(logits, 1), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(resumed, reference, rtol=1e-10, atol=1e-10)


def test_cached_keys_and_values_are_refused_while_training():
    model = make_model(mem_len=4)
    with pytest.raises(ValueError, match="cache_kv is for evaluation"):
        model(torch.zeros(1, 4, dtype=torch.long), cache_kv=True)
    with torch.no_grad():
        out = model(torch.zeros(1, 4, dtype=torch.long), cache_kv=True)
        with pytest.raises(ValueError, match="kv must be"):
            model(torch.zeros(1, 4, dtype=torch.long), out.mems, kv=out.kv[:1], cache_kv=True)


def test_loss_is_token_mean_cross_entropy():
    model = make_model(mem_len=4)
    tokens = torch.randint(0, 32, (2, 9))
    targets = tokens[:, 1:].clone()
    targets[0, 0] = -100
    out = model(tokens[:, :8], targets=targets)
    logp = out.logits.log_softmax(-1)
    picked = [-logp[b, t, targets[b, t]] for b in range(2) for t in range(8) if targets[b, t] >= 0]
    torch.testing.assert_close(out.loss, torch.stack(picked).mean())
    assert model(tokens[:, :8], targets=targets, return_logits=False).logits is None


def test_memory_batch_mismatch_is_an_error():
    model = make_model(mem_len=4)
    mems = model(torch.zeros(3, 4, dtype=torch.long)).mems
    with pytest.raises(ValueError, match="init_mems"):
        model(torch.zeros(2, 4, dtype=torch.long), mems)


@pytest.mark.parametrize(
    "field,value",
    [("n_layer", 0), ("d_head", -1), ("dropout", 1.0), ("dropatt", -0.1), ("mem_len", -1),
     ("clamp_len", 0), ("d_model", 15), ("vocab_size", 2.5)],
)
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        XLConfig(**{**TINY, field: value})


def test_same_length_without_memory_is_rejected():
    with pytest.raises(ValueError, match="same_length"):
        XLConfig(**TINY, mem_len=0, same_length=True)


def test_init_mems_and_param_count():
    model = make_model()
    assert [m.shape for m in model.init_mems(3)] == [(3, 0, 16)] * 2
    V, d, H, D, inner, n = 32, 16, 2, 8, 32, 2  # TINY, counted by hand (the softmax shares the embedding)
    attention = d * H * D * 4 + d * H * D + 2 * H * D + 2 * d  # q, k, v, r, o projections; u, v; layer norm
    feed_forward = d * inner + inner + inner * d + d + 2 * d
    assert count_parameters(model.config) == V * d + n * (attention + feed_forward) == 5408
    assert sum(p.numel() for p in model.parameters()) == 5408


def test_position_tables_are_reused_and_bounded():
    from xl.model.transformer import CONTEXT_CACHE_SIZE

    model = make_model(mem_len=4)
    first = model._context(4, 4, -1, None)
    assert model._context(4, 4, -1, None) is first  # built once per shape, not per step
    with torch.no_grad():
        for length in range(1, 3 * CONTEXT_CACHE_SIZE):  # a growing window, as the vanilla baseline reads
            model(torch.zeros(1, length, dtype=torch.long), mem_len=0)
    assert len(model._context_cache) == CONTEXT_CACHE_SIZE


def test_the_forward_trusts_the_context_its_config_checked(monkeypatch):
    """XLConfig checks its context once, when it is made; a forward over that context checks nothing again, and one
    given another context with same_length asks the memory once."""
    model = make_model(mem_len=4, same_length=True)
    asked = []
    monkeypatch.setattr(type(model.config.memory), "check_context", lambda self, same_length: asked.append(same_length))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        model(tokens)
        model(tokens, mem_len=4, same_length=True)
        model(tokens, mem_len=2)
    assert asked == [True]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        model.decoder(0)


def test_init_std_scales_every_normal_initial_weight():
    """``init_std`` is the standard deviation of the normal initialisation (linear layers, embeddings, the attention's
    position biases): under one seed, a model with 0.07 has exactly 3.5 times those weights of one with 0.02 (the same
    draws), and the same layer norms and zero biases, bit for bit."""
    shape = dict(vocab_size=50, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, mem_len=4)
    models = {}
    for std in (0.02, 0.07):
        torch.manual_seed(0)
        models[std] = TransformerXL(XLConfig(**shape, init_std=std))
    drawn = {f"{name}.weight" for name, m in models[0.02].named_modules() if isinstance(m, (torch.nn.Linear,
                                                                                        torch.nn.Embedding))}
    drawn |= {name for name, _ in models[0.02].named_parameters() if name.endswith(("r_w_bias", "r_r_bias"))}
    narrow, wide = (dict(models[std].named_parameters()) for std in (0.02, 0.07))
    assert len(drawn & set(narrow)) == 1 + 8 * shape["n_layer"]  # the (tied) embedding; q, kv, r, o, ff x2, 2 biases
    for name, p in narrow.items():
        if name in drawn:
            torch.testing.assert_close(wide[name], p * 3.5, rtol=1e-6, atol=0)
            assert 0.05 < wide[name].std().item() < 0.09, name
        else:
            assert torch.equal(wide[name], p), name
