"""Memory tokens laid out as LM-RMT's models that learnt (memory=lmrmt): the forward pass and gradients against a
float64 reference written from LM-RMT's code, one-token decoding, resume through a Trainer and train.py.

The reference follows github.com/booydar/LM-RMT at commit e2895080868afc390386220f2b68a56c4a218126,
``pytorch/mem_transformer.py`` (``MemTransformerLM._forward``, ``_update_mems``, ``init_mem_tokens``,
``RelMultiHeadAttn._rel_shift``) run as ``pytorch/train.py`` runs it with ``--mem_at_end --read_mem_from_cache``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import Tensor

from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.helpers.reference import position_embedding
from tests.unit.memory.test_memory_tokens import (
    TINY,
    assert_decodes_as_forward,
    assert_gradients_equal_reference,
    forward_logits,
    gradients_through_windows,
    layout_resumes_exactly,
    random_tokens,
)
from xl.memory.lmrmt import LMRMTConfig
from xl.model.config import XLConfig
from xl.model.documents import Documents, positions
from xl.model.transformer import TransformerXL
from xl.training.build import build_run

SEG = 5  # text tokens per segment


def lmrmt_model(n: int = 2, seed: int = 0, mem_len: int = 7, **extra) -> TransformerXL:
    """A float64 model with memory=lmrmt, weights moved off their initial values (the n initial vectors apart)."""
    torch.manual_seed(seed)
    values = {**TINY, "mem_len": mem_len, **extra}
    model = TransformerXL(XLConfig(**values, memory=LMRMTConfig(num_tokens=n, seg_len=SEG))).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def lmrmt_rel_shift(x: Tensor) -> Tensor:
    """``RelMultiHeadAttn._rel_shift`` of LM-RMT on one head's [qlen, klen] scores: a zero column in front, the
    storage viewed as [klen + 1, qlen], its first row dropped, viewed back as [qlen, klen]."""
    padded = torch.cat([x.new_zeros(x.size(0), 1), x], dim=1)
    return padded.view(x.size(1) + 1, x.size(0))[1:].view_as(x)


def lmrmt_hidden(mlen: int, n: int, qlen: int) -> list[list[bool]]:
    """``dec_attn_mask`` of ``_forward`` (True: hidden) for ``mem_at_end`` and ``read_mem_from_cache``: causal
    (``triu(ones, 1 + mlen)``), then the read rows see the read block and the cache, the write rows the write block
    and the cache."""
    klen = mlen + qlen
    hidden = [[j > mlen + i for j in range(klen)] for i in range(qlen)]
    for i in range(n):
        for j in range(mlen, mlen + n):
            hidden[i][j] = False
        for j in range(mlen):
            hidden[i][j] = False  # 1 - int(read_mem_from_cache)
    for i in range(qlen - n, qlen):
        for j in range(klen - n, klen):
            hidden[i][j] = False
        for j in range(mlen):
            hidden[i][j] = False
    return hidden


def lmrmt_layer(layer, x: Tensor, mem: Tensor, hidden: list[list[bool]], clamp_len: int) -> Tensor:
    """``RelPartialLearnableDecoderLayer`` with this project's layer weights, one row: AC by loops, BD against
    ``pos_seq = klen-1 … 0`` then LM-RMT's own rel-shift, hidden scores set to -inf, softmax over keys."""
    attn, ff = layer.attn, layer.ff
    M, Q, d = mem.size(0), x.size(0), x.size(1)
    H, D = attn.n_head, attn.d_head
    K = M + Q
    cat = torch.cat([mem, x])
    normed = attn.layer_norm(cat) if attn.pre_lnorm else cat
    q = attn.q_net(normed[M:]).view(Q, H, D)
    k, v = attn.kv_net(normed).view(K, 2, H, D).unbind(1)
    pos_seq = [K - 1 - c if clamp_len < 0 else min(K - 1 - c, clamp_len) for c in range(K)]
    r = torch.stack([attn.r_net(position_embedding(p, d, x.dtype)).view(H, D) for p in pos_seq])  # [K, H, D]
    heads = []
    for head in range(H):
        BD = torch.stack([torch.stack([(q[i, head] + attn.r_r_bias[head]) @ r[c, head] for c in range(K)])
                          for i in range(Q)])
        BD = lmrmt_rel_shift(BD)
        out = []
        for i in range(Q):
            scores = torch.stack([((q[i, head] + attn.r_w_bias[head]) @ k[j, head] + BD[i, j]) / math.sqrt(D)
                                  for j in range(K)])
            scores = scores.masked_fill(torch.tensor(hidden[i]), float("-inf"))
            weights = torch.softmax(scores, 0)
            out.append(sum(weights[j] * v[j, head] for j in range(K) if not hidden[i][j]))
        heads.append(torch.stack(out))
    out = attn.o_net(torch.cat(heads, dim=1))
    h = x + out if attn.pre_lnorm else attn.layer_norm(x + out)
    fc1, fc2 = ff.net[0], ff.net[3]
    inner = fc2(torch.relu(fc1(ff.layer_norm(h) if ff.pre_lnorm else h)))
    return h + inner if ff.pre_lnorm else ff.layer_norm(h + inner)


def lmrmt_reference(model: TransformerXL, tokens: Tensor, seg_len: int, mem_len: int) -> Tensor:
    """Logits [B, T, vocab] of LM-RMT's recurrence, one row and one segment at a time: the inputs
    ``cat(mem_tokens, word_emb, mem_tokens)``; ``mem_tokens`` the learned initial ones for the first segment
    (``train.py``: ``model.mem_tokens.repeat``), then the last layer's outputs at the write positions
    (``hidden[-num_mem:]``); the cache per layer the last ``mem_len`` layer inputs of ``cache ∘ read ∘ text ∘
    write`` (``_update_mems`` over every position of ``hids``). The logits go through this project's final norm and
    head (LM-RMT's own has none and an adaptive softmax)."""
    n = model.config.memory.num_tokens
    initial = model.memory_tokens.values
    clamp_len = model.config.clamp_len
    B, T = tokens.shape
    rows = []
    for b in range(B):
        cache = [initial[:0] for _ in model.layers]
        memory, logits = initial, []
        for s in range(0, T, seg_len):
            text = tokens[b, s:s + seg_len]
            x = torch.cat([memory, model.embed(text) * model.emb_scale, memory])
            mlen, qlen = cache[0].size(0), x.size(0)
            hidden = lmrmt_hidden(mlen, n, qlen)
            new_cache = []
            for layer, mem in zip(model.layers, cache, strict=True):
                new_cache.append(torch.cat([mem, x])[-mem_len:] if mem_len else mem[:0])
                x = lmrmt_layer(layer, x, mem, hidden, clamp_len)
            cache = new_cache
            logits.append(model.head(model.final_norm(x[n:n + len(text)])))
            memory = x[-n:]
        rows.append(torch.cat(logits))
    return torch.stack(rows)


# ---- the forward pass ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{"mem_len": 7}, {"mem_len": 0}, {"mem_len": 3, "clamp_len": 4},
                                   {"mem_len": 20, "pre_lnorm": True}])
def test_forward_equals_the_reference_written_from_lmrmts_code(extra):
    model = lmrmt_model(**extra)
    tokens = random_tokens(2, 3 * SEG + 2)
    with torch.no_grad():
        ours = forward_logits(model, tokens, SEG)
        reference = lmrmt_reference(model, tokens, SEG, extra["mem_len"])
    torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-10)


def test_evaluation_with_carried_keys_and_values_equals_the_forward():
    """cache_kv (evaluation's path): the keys and values of the cache of read, text and write states, carried from
    segment to segment, give the logits of the forward that projects the cache again."""
    model = lmrmt_model(mem_len=7)
    tokens = random_tokens(2, 4 * SEG)
    with torch.no_grad():
        expected = forward_logits(model, tokens, SEG)
        state = kv = None
        for s in range(0, tokens.size(1), SEG):
            out = model(tokens[:, s:s + SEG], state, cache_kv=True, kv=kv)
            state, kv = out.mems, out.kv
            torch.testing.assert_close(out.logits, expected[:, s:s + SEG], rtol=1e-9, atol=1e-10)


def test_the_initial_memory_is_one_standard_normal_vector_repeated():
    torch.manual_seed(0)
    values = TransformerXL(XLConfig(**TINY, mem_len=4, memory=LMRMTConfig(num_tokens=3, seg_len=SEG))
                           ).memory_tokens.values
    assert values.shape == (3, 16) and torch.equal(values[0], values[1]) and torch.equal(values[0], values[2])
    assert 0.5 < values[0].std() < 2  # N(0, 1), not the embeddings' scale


def test_the_cache_holds_the_write_tokens_as_its_newest_entries():
    model = lmrmt_model(mem_len=20)
    tokens = random_tokens(2, 2 * SEG)
    with torch.no_grad():
        first = model(tokens[:, :SEG], None)
        second = model(tokens[:, SEG:], first.mems)
    # 2 read + 5 text + 2 write positions per segment; the layer-0 inputs of the second segment's write tokens are
    # the memory the first segment wrote.
    assert [m.size(1) for m in second.mems[:-1]] == [18, 18]
    torch.testing.assert_close(second.mems[0][:, -2:], first.mems[-1], rtol=0, atol=0)


def test_gradients_through_k_segments_equal_the_reference():
    """Windows of k segments keep the written memory and the cache in the graph (this project's grad_segments; LM-RMT
    detaches its cache): the reference is run in one graph over the window."""
    k = 3
    model = lmrmt_model(mem_len=7).train()
    tokens, ours = gradients_through_windows(model, k)
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert ours["memory_tokens.values"].abs().sum() > 0

    model.zero_grad()
    logits = lmrmt_reference(model, x, SEG, 7)
    assert_gradients_equal_reference(model, logits, y, k, SEG, ours)


# ---- decoding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mem_len", [0, 7])
def test_one_token_decoding_equals_the_forward_read_in_segments(mem_len):
    assert_decodes_as_forward(lmrmt_model(mem_len=mem_len))


# ---- bad input ----------------------------------------------------------------------------------------------------
def test_documents_are_refused_in_one_sentence():
    model = lmrmt_model()
    tokens = random_tokens(2, SEG)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0, 2] = True
    with pytest.raises(ValueError, match="memory.doc_boundaries=ignore") as err:
        model(tokens, None, documents=Documents.from_positions(positions(starts)))
    assert len(str(err.value)) < 200 and "\n" not in str(err.value)


def test_doc_boundaries_reset_is_refused_before_any_work(tmp_path, corpus):
    from xl.config.rules import ConfigError

    with pytest.raises(ConfigError, match="^memory=lmrmt reads one endless text per row, as LM-RMT; set "
                                          "memory.doc_boundaries=ignore$"):
        build_run(compose_config(*tiny_overrides(tmp_path, corpus), "memory=lmrmt", "memory.doc_boundaries=reset"))


# ---- the path users run ---------------------------------------------------------------------------------------------
LMRMT = ("memory=lmrmt", "memory.mem_len=8", "memory.num_tokens=2")


def test_resume_of_memory_lmrmt_at_a_window_boundary_is_exact(tmp_path, corpus):
    """memory=lmrmt (windows of 2 segments, a cache of read, text and write states): a run stopped at step 7 and
    resumed trains the remaining segments with the unbroken run's losses and ends with its weights."""
    layout_resumes_exactly(tmp_path, corpus, LMRMT, cache=8)


def test_train_py_trains_memory_lmrmt(tmp_path, corpus, monkeypatch):
    from xl import train

    overrides = [*tiny_overrides(tmp_path, corpus), *LMRMT, "trainer.max_steps=2", "trainer.val_check_interval=2"]
    cfg = compose_config(*overrides)
    assert (cfg.memory._target_, cfg.memory.grad_segments, cfg.memory.doc_boundaries) == (
        "xl.memory.lmrmt.LMRMTConfig", 2, "ignore")
    run_hydra_main(train.main, ["train.py", *overrides], monkeypatch)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["memory"], results["mem_len"], results["grad_segments"]) == ("lmrmt(num_tokens=2)", 8, 2)
    assert all(math.isfinite(results[k]) for k in results if k.endswith("loss") and isinstance(results[k], float))
    assert type(build_run(cfg).module.model.memory).__name__ == "LMRMTMemory"
