"""Memory tokens (memory=tokens; Bulatov et al., 2022): the forward pass, gradients over k segments, documents,
resume and one-token decoding, each against a slow reference written here."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.conftest import compose_config, tiny_overrides
from tests.helpers.memories import xl_config
from tests.helpers.reference import position_embedding
from xl.config.compose import compose
from xl.config.rules import ConfigError
from xl.model.documents import Documents, positions
from xl.model.transformer import TransformerXL
from xl.training.build import build_run
from xl.training.services.sweep import columns

TINY = dict(vocab_size=23, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, dropout=0.0)
SEG = 5  # text tokens per segment


def token_model(mem_len: int, n: int = 2, seed: int = 0, **extra) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(xl_config(**{**TINY, **extra}, mem_len=mem_len, num_tokens=n, tokens_seg_len=SEG)).double()
    with torch.no_grad():  # r_w_bias / r_r_bias and the initial memory away from their small initial scale
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


# ---- the reference: one row at a time, every score by hand, over an explicit visibility mask ----------------------
def reference_layer(layer, x: Tensor, mem: Tensor, visible: Tensor, clamp_len: int = -1) -> Tensor:
    """One layer over queries ``x`` [Q, d] whose keys are ``mem ∘ x`` [M+Q, d]; query i sits at key M+i and sees key j
    where ``visible[i, j]``; the relative distance is M+i-j."""
    attn, ff = layer.attn, layer.ff
    M, Q, d = mem.size(0), x.size(0), x.size(1)
    H, D = attn.n_head, attn.d_head
    keys = torch.cat([mem, x])
    normed = attn.layer_norm(keys) if attn.pre_lnorm else keys
    q = attn.q_net(normed[M:]).view(Q, H, D)
    k, v = attn.kv_net(normed).view(M + Q, 2, H, D).unbind(1)
    heads = []
    for i in range(Q):
        seen = [j for j in range(M + Q) if visible[i, j]]
        per_head = []
        for head in range(H):
            scores = []
            for j in seen:
                dist = M + i - j if clamp_len < 0 else min(M + i - j, clamp_len)
                r = attn.r_net(position_embedding(dist, d, x.dtype)).view(H, D)[head]
                scores.append(((q[i, head] + attn.r_w_bias[head]) @ k[j, head]
                               + (q[i, head] + attn.r_r_bias[head]) @ r) / math.sqrt(D))
            weights = torch.softmax(torch.stack(scores), 0)
            per_head.append(sum(w * v[j, head] for w, j in zip(weights, seen, strict=True)))
        heads.append(torch.cat(per_head))
    out = attn.o_net(torch.stack(heads))
    h = x + out if attn.pre_lnorm else attn.layer_norm(x + out)
    fc1, fc2 = ff.net[0], ff.net[3]
    inner = fc2(torch.relu(fc1(ff.layer_norm(h) if ff.pre_lnorm else h)))
    return h + inner if ff.pre_lnorm else ff.layer_norm(h + inner)


def reference_logits(model: TransformerXL, tokens: Tensor, seg_len: int, mem_len: int,
                     starts: Tensor | None = None) -> Tensor:
    """Logits [B, T, vocab] of a stream read in segments of ``seg_len``, row by row, with the scheme written out:
    the layers run over ``read ∘ text ∘ write`` after a cache of the last ``mem_len`` text states; every position has
    the absolute index of its text (read: the segment's first token; write: its last) and each query sees the earlier
    positions at or after its document's start (``starts`` [B, T]: where documents begin; the row's first token always
    begins one). Read tokens: the previous segment's write outputs, or the initial values where a document begins at
    the segment's first token; write tokens take the read tokens' input, or the initial values where the segment's
    last document began after its first token."""
    n = model.config.memory.num_tokens
    initial = model.memory_tokens.values
    B, T = tokens.shape
    rows = []
    for b in range(B):
        begins = [t == 0 or (starts is not None and bool(starts[b, t])) for t in range(T)]
        doc = [max(s for s in range(t + 1) if begins[s]) for t in range(T)]  # each token's document start
        cache = [(torch.zeros(0, model.config.d_model, dtype=initial.dtype), []) for _ in model.layers]
        memory, logits = initial, []
        for s in range(0, T, seg_len):
            text = range(s, min(T, s + seg_len))
            read = initial if doc[s] == s else memory
            write = initial if doc[text[-1]] > s else read
            x = torch.cat([read, model.embed(tokens[b, s:text[-1] + 1]) * model.emb_scale, write])
            query_doc = [doc[s]] * n + [doc[t] for t in text] + [doc[text[-1]]] * n
            own_index = [s] * n + list(text) + [text[-1]] * n
            new_cache = []
            for layer, (mem, mem_index) in zip(model.layers, cache, strict=True):
                key_index = mem_index + own_index
                M = len(mem_index)
                visible = torch.tensor([[j <= M + i and key_index[j] >= query_doc[i] for j in range(len(key_index))]
                                        for i in range(len(own_index))])
                states = torch.cat([mem, x[n:n + len(text)]])[-mem_len:] if mem_len else mem[:0]
                new_cache.append((states, (mem_index + list(text))[-mem_len:] if mem_len else []))
                x = reference_layer(layer, x, mem, visible, model.config.clamp_len)
            cache = new_cache
            logits.append(model.head(model.final_norm(x[n:n + len(text)])))
            memory = x[n + len(text):]
        rows.append(torch.cat(logits))
    return torch.stack(rows)


def forward_logits(model: TransformerXL, tokens: Tensor, seg_len: int, starts: Tensor | None = None,
                   **kwargs) -> Tensor:
    """The model's forward read in segments, the memory carried."""
    pos = None if starts is None else positions(starts)
    state, out = None, []
    for s in range(0, tokens.size(1), seg_len):
        documents = None if pos is None else Documents.from_positions(pos[:, s:s + seg_len])
        result = model(tokens[:, s:s + seg_len], state, documents=documents, **kwargs)
        state = result.mems
        out.append(result.logits)
    return torch.cat(out, 1)


def random_tokens(B: int, T: int, seed: int = 1) -> Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


# ---- the forward pass ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mem_len, extra", [(0, {}), (3, {}), (8, {}), (8, {"pre_lnorm": True, "clamp_len": 4})])
def test_forward_equals_the_reference_over_several_segments(mem_len, extra):
    model = token_model(mem_len, **extra)
    tokens = random_tokens(2, 3 * SEG + 2)
    with torch.no_grad():
        ours = forward_logits(model, tokens, SEG)
        reference = reference_logits(model, tokens, SEG, mem_len)
    torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-10)


def test_the_memory_carries_the_written_tokens_and_only_text_into_the_cache():
    model = token_model(8, n=3)
    with torch.no_grad():
        out = model(random_tokens(2, SEG), None)
    *cache, memory = out.mems
    assert len(cache) == TINY["n_layer"] and all(c.shape == (2, SEG, TINY["d_model"]) for c in cache)
    assert memory.shape == (2, 3, TINY["d_model"]) and out.logits.shape == (2, SEG, TINY["vocab_size"])


def test_evaluation_with_another_memory_length_and_cached_keys_equals_the_reference():
    model = token_model(4)
    tokens = random_tokens(2, 4 * SEG)
    with torch.no_grad():
        state = kv = None
        logits = []
        for s in range(0, tokens.size(1), SEG):
            out = model(tokens[:, s:s + SEG], state, mem_len=9, cache_kv=True, kv=kv)
            state, kv = out.mems, out.kv
            logits.append(out.logits)
        reference = reference_logits(model, tokens, SEG, 9)
    torch.testing.assert_close(torch.cat(logits, 1), reference, rtol=1e-9, atol=1e-10)


# ---- gradients through k segments ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mem_len", [0, 6])
def test_gradients_through_k_segments_equal_the_hand_unrolled_reference(mem_len):
    k = 3
    model = token_model(mem_len).train()
    tokens, ours = gradients_through_windows(model, k)
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert ours["memory_tokens.values"].abs().sum() > 0

    model.zero_grad()
    logits = reference_logits(model, x, SEG, mem_len)  # everything in one graph: nothing detached
    assert_gradients_equal_reference(model, logits, y, k, SEG, ours)


@pytest.mark.parametrize("mem_len", [0, 6])
def test_the_next_segments_loss_reaches_the_write_token_inputs_only_inside_a_window(mem_len):
    """d loss(t+1) / d (segment t's inputs at its write positions): non-zero when segment t's memory stays in the
    graph (a window of k = 2), absent when it is detached (k = 1). Its read and text positions get one too, through
    the write tokens that attend to them (and the attached cache)."""
    n = 2
    grads = {}
    for attached in (True, False):
        model = token_model(mem_len, n=n).train()
        tokens = random_tokens(2, 2 * SEG + 1, seed=4)
        captured = []
        handle = model.layers[0].register_forward_pre_hook(lambda module, args, kept=captured: kept.append(args[0]))
        first = model(tokens[:, :SEG], None, tokens[:, 1:SEG + 1], detach_memory=not attached)
        captured[0].retain_grad()
        second = model(tokens[:, SEG:2 * SEG], first.mems, tokens[:, SEG + 1:])
        handle.remove()
        second.loss.backward()
        grads[attached] = captured[0].grad
    write = grads[True][:, n + SEG:]
    assert write.shape == (2, n, TINY["d_model"]) and (write.abs().sum(-1) > 0).all()
    assert (grads[True][:, :n + SEG].abs().sum(-1) > 0).all()
    assert grads[False] is None  # nothing of segment t is in the graph of segment t+1's loss


def test_a_detached_memory_gives_the_write_tokens_no_gradient():
    model = token_model(0).train()
    tokens = random_tokens(2, 2 * SEG + 1, seed=4)
    grads = []
    for attached in (True, False):
        model.zero_grad()
        first = model(tokens[:, :SEG], None, tokens[:, 1:SEG + 1], detach_memory=not attached)
        second = model(tokens[:, SEG:2 * SEG], first.mems, tokens[:, SEG + 1:])
        second.loss.backward()
        grads.append(model.layers[-1].ff.net[0].weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


# ---- documents ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mem_len", [0, 7])
def test_packed_documents_equal_the_reference_and_documents_alone(mem_len):
    model = token_model(mem_len)
    first, second = 2 * SEG, 2 * SEG + 3  # the second document begins at a segment's first token
    tokens = random_tokens(2, first + second, seed=5)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0, first] = True
    starts[1, 7] = starts[1, 13] = True  # inside segments
    with torch.no_grad():
        packed = forward_logits(model, tokens, SEG, starts)
        torch.testing.assert_close(packed, reference_logits(model, tokens, SEG, mem_len, starts), rtol=1e-9,
                                   atol=1e-10)
        alone = forward_logits(model, tokens[:1, first:], SEG)
    torch.testing.assert_close(packed[:1, first:], alone, rtol=1e-9, atol=1e-10)


def test_a_document_that_begins_inside_a_segment_reads_nothing_before_it():
    model = token_model(7)
    tokens = random_tokens(1, 4 * SEG, seed=6).repeat(2, 1)
    tokens[1, :8] = random_tokens(1, 8, seed=7)  # another text before the document that begins at 8
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 8] = True
    with torch.no_grad():
        logits = forward_logits(model, tokens, SEG, starts)
    assert not torch.allclose(logits[0, :8], logits[1, :8])
    torch.testing.assert_close(logits[0, 8:], logits[1, 8:], rtol=1e-9, atol=1e-10)


# ---- decoding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mem_len", [0, 7])
def test_one_token_decoding_equals_the_forward_read_in_segments(mem_len):
    assert_decodes_as_forward(token_model(mem_len))


def layout_resumes_exactly(tmp_path, corpus, overrides: tuple[str, ...], cache: int) -> None:
    """A token layout's run stopped at step 7 and resumed equals the unbroken run (resumed_at_step_7); its
    checkpoint holds each layer's cache of ``cache`` positions, then the memory tokens ([ranks, rows, positions,
    d_model]; tiny model, 4 rows, 2 tokens)."""
    from tests.unit.training.test_tbptt import resumed_at_step_7

    _, whole_losses, ckpt = resumed_at_step_7(tmp_path, corpus, *overrides)
    assert all(math.isfinite(loss) for loss, _ in whole_losses.values())
    memory = torch.load(ckpt, weights_only=True)["xl"]["train_memory"]
    assert [tuple(t.shape) for t in memory] == [(1, 4, cache, 32)] * 2 + [(1, 4, 2, 32)]


def assert_gradients_equal_reference(model: TransformerXL, logits: Tensor, y: Tensor, k: int, seg: int,
                                     ours: dict[str, Tensor]) -> None:
    """The reference's gradients (its logits, k segments of ``seg`` in one graph, the losses summed) equal ours."""
    sum(F.cross_entropy(logits[:, i * seg:(i + 1) * seg].flatten(0, 1), y[:, i * seg:(i + 1) * seg].flatten())
        for i in range(k)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-8, atol=1e-10, msg=name)


def gradients_through_windows(model: TransformerXL, k: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Random tokens (2 rows, ``k`` segments of ``SEG`` and one) and the gradients of the ``k`` segments' summed
    losses, the memory kept in the graph inside the window (detached after its last segment)."""
    tokens = random_tokens(2, k * SEG + 1, seed=3)
    x, y = tokens[:, :-1], tokens[:, 1:]
    state, losses = None, []
    for i in range(k):
        out = model(x[:, i * SEG:(i + 1) * SEG], state, y[:, i * SEG:(i + 1) * SEG], detach_memory=i == k - 1)
        state = out.mems
        losses.append(out.loss)
    torch.stack(losses).sum().backward()
    return tokens, {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_decodes_as_forward(model: TransformerXL) -> None:
    """Tokens fed one by one, and after prompts that end inside the first segment, on a boundary and after two, give
    the logits of the forward pass read in segments of ``SEG`` (float64)."""
    tokens = random_tokens(3, 4 * SEG + 2, seed=8)
    with torch.no_grad():
        expected = forward_logits(model, tokens, SEG)
        decoder = model.decoder(3)
        fed = torch.stack([decoder.feed(tokens[:, t]) for t in range(tokens.size(1))], 1)
        torch.testing.assert_close(fed, expected, rtol=1e-9, atol=1e-10)
        for prompt in (SEG - 2, 2 * SEG, 2 * SEG + 3):  # inside the first segment, on a boundary, after two
            decoder = model.decoder(3)
            last = decoder.prefill(tokens[:, :prompt], 128)
            torch.testing.assert_close(last, expected[:, prompt - 1], rtol=1e-9, atol=1e-10)
            fed = torch.stack([decoder.feed(tokens[:, t]) for t in range(prompt, tokens.size(1))], 1)
            torch.testing.assert_close(fed, expected[:, prompt:], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mem_len", [0, 7])
def test_decoding_with_documents_equals_the_forward(mem_len):
    model = token_model(mem_len)
    tokens = random_tokens(2, 4 * SEG, seed=9)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0, 2 * SEG] = True  # at a segment's first token
    starts[1, 7] = starts[1, 3 * SEG + 1] = True  # inside segments
    with torch.no_grad():
        expected = forward_logits(model, tokens, SEG, starts)
        prompt = SEG + 1
        decoder = model.decoder(2)
        last = decoder.prefill(tokens[:, :prompt], SEG, starts[:, :prompt])
        torch.testing.assert_close(last, expected[:, prompt - 1], rtol=1e-9, atol=1e-10)
        for t in range(prompt, tokens.size(1)):
            decoder.reset_rows(starts[:, t])
            torch.testing.assert_close(decoder.feed(tokens[:, t]), expected[:, t], rtol=1e-9, atol=1e-10)


# ---- bad input ----------------------------------------------------------------------------------------------------
def test_combinations_that_cannot_work_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="same_length=false"):
        xl_config(**TINY, num_tokens=2, tokens_seg_len=SEG, same_length=True)
    with pytest.raises(ValueError, match="seg_len"):
        xl_config(**TINY, num_tokens=2)
    with pytest.raises(ValueError, match="same_length=false"):
        token_model(4)(random_tokens(1, SEG), None, same_length=True)
    with pytest.raises(ConfigError, match="memory.cmem_len is not a setting of this memory but of memory=compressive"):
        compose("config", ["memory=tokens", "memory.cmem_len=8"])


@pytest.mark.parametrize("overrides, setting", [
    (["memory.eval_same_length=true"], "memory.eval_same_length=false"),
])
def test_a_config_that_cannot_work_is_refused_before_any_work(tmp_path, corpus, overrides, setting):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory=tokens", *overrides)
    with pytest.raises(ConfigError, match=setting):
        build_run(cfg)


# ---- the path users run ---------------------------------------------------------------------------------------------
def test_train_py_memory_tokens_trains_evaluates_and_resumes_exactly(tmp_path, corpus):
    from tests.integration.test_resume import STOP_AT, assert_resumed_as_unbroken, fit, resume_cfg

    extra = ("memory=tokens", "memory.num_tokens=2", "memory.grad_segments=1", "memory.eval_mem_len=24")
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole", *extra))
    assert all(math.isfinite(v) for v in whole_losses.values())
    first, _ = fit(resume_cfg(tmp_path, corpus, "first", *extra, f"trainer.max_steps={STOP_AT}"))
    saved = torch.load(tmp_path / "first" / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    packed = saved["xl"]["train_memory"]
    assert [tuple(t.shape) for t in packed][-1] == (1, 4, 2, 32)  # [ranks, rows, memory tokens, d_model]
    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", *extra,
                                           f"ckpt_path={tmp_path / 'first' / 'run'}"))
    assert_resumed_as_unbroken(whole, whole_losses, second, second_losses)


def test_resume_at_a_window_boundary_of_memory_tokens_is_exact(tmp_path, corpus):
    """memory=tokens as configured (windows of 2 segments, the cache beneath): a run stopped at step 7 and resumed
    trains the remaining segments with the unbroken run's losses and ends with its weights."""
    from tests.unit.training.test_tbptt import resumed_at_step_7

    resumed_at_step_7(tmp_path, corpus, "memory=tokens", "memory.num_tokens=2")


def test_windows_of_k_segments_train_through_lightning(tmp_path, corpus):
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory=tokens", "memory.mem_len=0",
                         "trainer.max_steps=4", "trainer.val_check_interval=4")
    run = build_run(cfg)
    L.seed_everything(0, verbose=False)
    before = run.module.model.memory_tokens.values.detach().clone()
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 4 and run.trainer.accumulate_grad_batches == 1
    assert not torch.equal(before, run.module.model.memory_tokens.values)
    assert math.isfinite(float(run.trainer.callback_metrics["val/loss"]))
    results = json.loads((tmp_path / "run" / "results.json").read_text())  # the job summary, a sweep's row
    assert (results["memory"], results["mem_len"], results["grad_segments"]) == ("tokens(num_tokens=4)", 0, 2)
    assert "memory" in columns([results])


def test_a_window_keeps_the_written_memory_attached_until_its_last_segment(tmp_path, corpus):
    """Through a real Trainer (memory=tokens as configured, k = 2): the memory written by a window's first segment is
    in the graph when the next segment reads it, the one its last segment writes is detached."""

    class Attached(L.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[bool, bool]] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            *cache, tokens = module.memory.mems["train"]
            self.seen.append((tokens.requires_grad, cache[0].requires_grad))

    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory=tokens", "trainer.max_steps=3",
                         "trainer.val_check_interval=6")
    run = build_run(cfg)
    attached = Attached()
    run.trainer.callbacks.append(attached)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert attached.seen == [(True, True), (False, False)] * 3


def test_generate_and_evaluate_commands_on_a_memory_token_checkpoint(tmp_path, corpus, monkeypatch, capsys):
    """Memory tokens alone (mem_len=0): xl.generate decodes with no cache, as the model trained, and its samples are
    those of the decoder API; xl.evaluate scores the checkpoint with a cache it never had (eval_mem_len) and refuses
    the vanilla baseline."""
    from tests.integration.test_evaluate import compose_eval, eval_overrides
    from tests.integration.test_generate import expected_text, generate_in_process
    from xl.evaluation import evaluate

    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "memory=tokens", "memory.mem_len=0",
                                   "trainer.max_steps=2"))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    out, err, windows = generate_in_process(ckpt, corpus, tmp_path, monkeypatch, capsys)
    assert windows == [0] and "decoding with mem_len=0 (the checkpoint's mem_len)" in err
    assert out == expected_text(ckpt, 0) + "\n"
    trained = {"tmp": tmp_path, "run": tmp_path / "run"}
    results = evaluate(compose_eval(*eval_overrides(trained, corpus, "memory.eval_mem_len=8",
                                                    "trainer.limit_val_batches=3", "trainer.limit_test_batches=3")))
    assert results and all(math.isfinite(v) for row in results.values() for v in row.values()
                           if isinstance(v, float))
    with pytest.raises(ConfigError, match="set vanilla=false"):
        evaluate(compose_eval(*eval_overrides(trained, corpus, "vanilla=true")))
    with pytest.raises(ConfigError, match="same_length=false"):
        evaluate(compose_eval(*eval_overrides(trained, corpus, "memory.eval_mem_len=8",
                                              "memory.eval_same_length=true")))
