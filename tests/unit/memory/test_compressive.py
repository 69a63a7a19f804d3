"""Compressive memory (Rae et al., 2019), claim by claim, against references that keep the memories by hand."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.memories import xl_config
from tests.helpers.reference import reference_attention
from tests.unit.model.test_model import TINY, make_model, run_segments
from xl.device.footprint import cache_footprint
from xl.memory.compressive import CompressiveConfig, CompressiveMemory
from xl.memory.compressor import Compressor, reconstruction_loss
from xl.memory.store import MemoryStore, nbytes
from xl.model.memory import Segment
from xl.model.transformer import LayerView, TransformerXL


def compress_by_hand(model: TransformerXL, layer: int, group: torch.Tensor) -> torch.Tensor:
    """One compressed slot from a [B, rate, d] group, from the definition (no conv1d, no pooling op)."""
    comp = model.compressor
    if comp.fn == "mean":
        return sum(group[:, k] for k in range(group.size(1))) / group.size(1)
    weight, bias = comp.weight[layer], comp.bias[layer]  # [out, in, rate], [out]
    return bias + sum(group[:, k] @ weight[:, :, k].T for k in range(group.size(1)))


@torch.no_grad()
def reference_compressive_logits(model: TransformerXL, tokens: torch.Tensor, seg_len: int | list[int]) -> torch.Tensor:
    """Logits of a stream read segment by segment (``seg_len``: one length, or each segment's), from each layer's
    full history of inputs: the states before the last ``mem_len`` are cut into whole groups of ``rate``, oldest
    first; the compressed memory is the last ``cmem_len`` groups' compressions and the memory every state after
    the groups (``mem_len`` of them, and up to ``rate - 1`` more that wait for their group). Each layer attends
    naively over ``compressed ∘ memory ∘ segment``, distances counted in slots."""
    cfg = model.config
    rate = cfg.memory.cmem_rate
    lengths = [seg_len] * -(-tokens.size(1) // seg_len) if isinstance(seg_len, int) else seg_len
    history = [tokens.new_zeros(tokens.size(0), 0, cfg.d_model, dtype=model.dtype) for _ in model.layers]
    logits, start = [], 0
    for length in lengths:
        h = model.embed(tokens[:, start:start + length]) * model.emb_scale
        start += length
        for n, layer in enumerate(model.layers):
            past = history[n]
            groups = max(0, past.size(1) - cfg.mem_len) // rate
            old, mem = past[:, :groups * rate], past[:, groups * rate:]
            slots = [compress_by_hand(model, n, old[:, g * rate:(g + 1) * rate]) for g in range(groups)]
            slots = slots[max(0, len(slots) - cfg.memory.cmem_len):]
            cmem = torch.stack(slots, 1) if slots else mem[:, :0]
            history[n] = torch.cat([past, h], 1)
            h = layer.ff(reference_attention(layer.attn, h, torch.cat([cmem, mem], 1), cfg.clamp_len))
        logits.append(model.head(model.final_norm(h)))
    return torch.cat(logits, 1)


def perturb_compressor(model: TransformerXL, seed: int = 1) -> None:
    """Move a conv compressor away from its mean-pooling start, so that the test sees its weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.compressor.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("fn", ["mean", "conv"])
@pytest.mark.parametrize("seg_len,mem_len,cmem_len,rate", [(4, 4, 3, 2), (2, 4, 2, 2), (4, 0, 3, 4), (6, 6, 3, 3)])
@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_segments_equal_the_reference_that_keeps_both_memories(fn, seg_len, mem_len, cmem_len, rate, pre_lnorm):
    model = make_model(mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate, cmem_fn=fn, pre_lnorm=pre_lnorm)
    if fn == "conv":
        perturb_compressor(model)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 6 * seg_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast, mems = run_segments(model, tokens, seg_len)
    torch.testing.assert_close(fast, reference_compressive_logits(model, tokens, seg_len), rtol=1e-10, atol=1e-10)
    # The stream is long enough to fill the compressed memory: per layer its slots, then the memory's states.
    n_layer = model.config.n_layer
    assert [m.size(1) for m in mems] == [cmem_len] * n_layer + [mem_len] * n_layer


# --- one-token decoding -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn,rate,mem_len,cmem_len,prompt_len,pre_lnorm,clamp_len", [
    ("conv", 2, 4, 3, 0, False, -1),  # no prompt: the decoder fills both memories by itself
    ("conv", 3, 6, 2, 12, True, -1),  # a prompt that already fills the compressed memory
    ("mean", 2, 4, 5, 4, False, 3),
    ("conv", 4, 4, 1, 8, False, -1),  # one slot: each new slot replaces the last
])
def test_every_fed_token_equals_the_reference_that_compresses_whole_groups(fn, rate, mem_len, cmem_len, prompt_len,
                                                                           pre_lnorm, clamp_len):
    """The prompt by the forward (segments the rate divides), then one token at a time, far past both memories
    (the buffers are moved to their front several times): each fed token's logits are the reference's, where
    states leave the memory in whole groups and wait there until their group is complete."""
    model = make_model(mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate, cmem_fn=fn, pre_lnorm=pre_lnorm,
                       clamp_len=clamp_len)
    if fn == "conv":
        perturb_compressor(model)
    fed_len = 6 * (mem_len + rate * cmem_len)
    text = torch.randint(0, TINY["vocab_size"], (2, prompt_len + fed_len), generator=torch.Generator().manual_seed(5))
    decoder = model.decoder(2)
    got = [decoder.prefill(text[:, :prompt_len], rate)] if prompt_len else []
    got += [decoder.feed(text[:, t]) for t in range(prompt_len, text.size(1))]
    want = reference_compressive_logits(model, text, [rate] * (prompt_len // rate) + [1] * fed_len)
    want = want[:, prompt_len - 1:] if prompt_len else want
    torch.testing.assert_close(torch.stack(got, 1), want, rtol=1e-10, atol=1e-10)
    assert decoder.slots == cmem_len


def read_in_segments(model: TransformerXL, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Logits of the model's forward over ``tokens`` read in segments of these lengths, the memory carried."""
    mems, logits, start = None, [], 0
    for length in lengths:
        out = model(tokens[:, start:start + length], mems)
        mems, start = out.mems, start + length
        logits.append(out.logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("fn", ["mean", "conv"])
@pytest.mark.parametrize("rate,mem_len,cmem_len,seg_len", [
    (3, 4, 2, 5),  # neither mem_len nor the segment a multiple of the rate
    (3, 5, 2, 3),
    (2, 3, 3, 4),
    (4, 6, 1, 7),
    (3, 7, 2, 128),  # the whole prompt in one segment (xl.generate's default segment at rate 3)
])
def test_the_decoder_equals_the_forward_pass_for_any_prompt_length(fn, rate, mem_len, cmem_len, seg_len):
    """For every prompt length 1 … 3·rate, with no documents: the prefill's logits and every fed token's are those of
    the model's forward read in the same segments (the prompt's, then one token each), and of the reference that
    keeps the whole history by hand, far past both memories (float64)."""
    model = make_model(mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate, cmem_fn=fn)
    if fn == "conv":
        perturb_compressor(model)
    fed_len = 2 * (mem_len + rate * cmem_len) + rate
    for prompt_len in range(1, 3 * rate + 1):
        text = torch.randint(0, TINY["vocab_size"], (2, prompt_len + fed_len),
                             generator=torch.Generator().manual_seed(prompt_len))
        decoder = model.decoder(2)
        got = [decoder.prefill(text[:, :prompt_len], seg_len)]
        got += [decoder.feed(text[:, t]) for t in range(prompt_len, text.size(1))]
        lengths = [seg_len] * (prompt_len // seg_len) + [prompt_len % seg_len] * bool(prompt_len % seg_len)
        lengths += [1] * fed_len
        with torch.no_grad():
            forward = read_in_segments(model, text, lengths)[:, prompt_len - 1:]
        torch.testing.assert_close(torch.stack(got, 1), forward, rtol=1e-10, atol=1e-10)
        reference = reference_compressive_logits(model, text, lengths)[:, prompt_len - 1:]
        torch.testing.assert_close(forward, reference, rtol=1e-10, atol=1e-10)
        assert decoder.slots == cmem_len


@pytest.mark.parametrize("rate,mem_len,cmem_len,seg_len,prompt_len",
                         [(3, 4, 2, 5, 7), (2, 3, 3, 4, 6), (3, 5, 2, 2, 1)])
def test_the_decoder_equals_the_forward_pass_with_documents(rate, mem_len, cmem_len, seg_len, prompt_len):
    """Documents starting anywhere, in the prompt (``starts``) and while feeding (``reset_rows``): every logit is the
    forward pass's over the same segments with the same document positions (float64)."""
    from xl.model.documents import Documents, positions

    model = make_model(mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate, cmem_fn="conv")
    perturb_compressor(model)
    T = prompt_len + 40
    text = torch.randint(0, TINY["vocab_size"], (2, T), generator=torch.Generator().manual_seed(12))
    starts = torch.zeros(2, T, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [3, 11, 26, 31]] = True
    starts[1, [prompt_len, 20, 21]] = True
    decoder = model.decoder(2)
    got = [decoder.prefill(text[:, :prompt_len], seg_len, starts[:, :prompt_len])]
    for t in range(prompt_len, T):
        decoder.reset_rows(starts[:, t])
        got.append(decoder.feed(text[:, t]))
    pos = positions(starts)
    lengths = [seg_len] * (prompt_len // seg_len) + [prompt_len % seg_len] * bool(prompt_len % seg_len) + [1] * 40
    mems, want, at = None, [], 0
    with torch.no_grad():
        for length in lengths:
            out = model(text[:, at:at + length], mems, documents=Documents.from_positions(pos[:, at:at + length]))
            mems, at = out.mems, at + length
            want.append(out.logits)
    want = torch.cat(want, 1)[:, prompt_len - 1:]
    torch.testing.assert_close(torch.stack(got, 1), want, rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # the documents do hide keys
        assert (read_in_segments(model, text, lengths)[:, prompt_len - 1:] - want).abs().max() > 1e-6


# --- documents ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_kv", [False, True])
@pytest.mark.parametrize("seg_len,mem_len,cmem_len,rate,fn", [(4, 4, 3, 2, "conv"), (4, 8, 2, 4, "mean")])
def test_a_document_packed_mid_row_reads_as_if_alone_with_its_compressed_slots(seg_len, mem_len, cmem_len, rate, fn,
                                                                               cache_kv):
    """With the probe document starting on a group boundary, the packed reading sees exactly the slots of the probe's
    own states: those of the document read alone from an empty memory (float64)."""
    from tests.unit.model.test_documents import PROBE, grid, packed_rows, read

    model = make_model(mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate, cmem_fn=fn)
    if fn == "conv":
        perturb_compressor(model)
    tokens, starts, probe, offsets = packed_rows(offsets=(4, 12))
    packed = read(model, tokens, grid(40, seg_len), starts, cache_kv)
    for r in (0, 1):
        offset = offsets[r]
        alone = read(model, probe[None], grid(PROBE, seg_len, seg_len - offset % seg_len))[0]
        torch.testing.assert_close(packed[r, offset:offset + PROBE], alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed[2], read(model, tokens, grid(40, seg_len), None, cache_kv)[2], rtol=0, atol=1e-12)
    # The probe's last tokens do attend over slots of its own: without a compressed memory they read otherwise.
    plain = make_model(mem_len=mem_len)
    alone_plain = read(plain, probe[None], grid(PROBE, seg_len, seg_len - offsets[0] % seg_len))[0]
    assert (alone[-1] - alone_plain[-1]).abs().max() > 1e-6


def test_a_slot_that_summarises_another_documents_states_is_hidden():
    """Probes that do not start on a group boundary: the slot that mixes the previous document's states with the
    probe's is hidden with the older ones, so the probe's logits do not depend on anything before it."""
    from tests.unit.model.test_documents import PROBE, grid, packed_rows, read

    model = make_model(mem_len=4, cmem_len=3, cmem_rate=2)
    perturb_compressor(model)
    tokens, starts, probe, offsets = packed_rows(offsets=(3, 11))
    other = tokens.clone()
    for r, offset in enumerate(offsets[:2]):
        other[r, :offset] = (other[r, :offset] + 1 + r) % TINY["vocab_size"]
    a, b = (read(model, t, grid(40, 4), starts) for t in (tokens, other))
    plain = read(model, tokens, grid(40, 4))
    for r, offset in enumerate(offsets[:2]):
        probe_logits = slice(offset, offset + PROBE)
        torch.testing.assert_close(a[r, probe_logits], b[r, probe_logits], rtol=0, atol=1e-12)
        assert (a[r, probe_logits] - plain[r, probe_logits]).abs().max() > 1e-6  # the masks do act


@pytest.mark.parametrize("history_len", [8, 7])
def test_decoder_reset_rows_hides_the_earlier_documents_slots(history_len):
    """After ``reset_rows`` a row reads on without anything of its earlier text: with the reset on a group boundary
    exactly as a decoder that starts there (its slots are the new document's), and in any case independently of
    what came before. The other row keeps both its memories."""
    model = make_model(mem_len=4, cmem_len=3, cmem_rate=2)
    perturb_compressor(model)
    g = torch.Generator().manual_seed(11)
    history = torch.randint(0, TINY["vocab_size"], (2, history_len), generator=g)
    text = torch.randint(0, TINY["vocab_size"], (2, 30), generator=g)
    other_history = (history + 1) % TINY["vocab_size"]
    decoders = [model.decoder(2) for _ in range(4)]  # reset, reset after another history, fresh, untouched
    for t in range(history_len):
        for decoder, h in zip(decoders, (history, other_history, None, history), strict=True):
            if h is not None:
                decoder.feed(h[:, t])
    for decoder in decoders[:2]:
        decoder.reset_rows(torch.tensor([True, False]))
    for t in range(30):
        got, other, fresh, kept = (decoder.feed(text[:, t]) for decoder in decoders)
        torch.testing.assert_close(got[0], other[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[1], kept[1], rtol=0, atol=1e-12)
        if history_len % 2 == 0:
            torch.testing.assert_close(got[0], fresh[0], rtol=0, atol=1e-12)
    assert decoders[0].slots == 3


def test_a_fed_token_sees_the_compressed_slots_and_nothing_older():
    """One layer, mean pooling: the last fed token's logits change with a token inside the oldest slot's group,
    and not with the token just before that group (it left the compressed memory)."""
    mem_len, cmem_len, rate = 4, 2, 3
    model = make_model(n_layer=1, mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate, cmem_fn="mean")
    text = torch.randint(0, TINY["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(9))

    def last_logits(text: torch.Tensor) -> torch.Tensor:
        decoder = model.decoder(1)
        return [decoder.feed(text[:, t]) for t in range(text.size(1))][-1]

    # Before the last token: 39 states, the newest 4 plus those of an incomplete group in the memory, whole groups
    # of 3 before them, of which the compressed memory keeps the newest 2.
    history = text.size(1) - 1
    groups = (history - mem_len) // rate
    oldest_group = (groups - cmem_len) * rate  # index of the first token the compressed memory still summarises

    def changed(index: int) -> torch.Tensor:
        other = text.clone()
        other[0, index] = (other[0, index] + 1) % TINY["vocab_size"]
        return other

    assert torch.equal(last_logits(changed(oldest_group - 1)), last_logits(text))
    assert not torch.allclose(last_logits(changed(oldest_group)), last_logits(text), rtol=1e-6, atol=1e-6)


def test_same_seed_gives_the_same_main_weights_and_the_same_logits_until_a_state_is_evicted():
    plain = make_model(mem_len=12)
    comp = make_model(mem_len=12, cmem_len=4, cmem_rate=2)
    main = {k: v for k, v in comp.state_dict().items() if not k.startswith("compressor.")}
    assert main.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in main.items())
    tokens = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, _ = run_segments(plain, tokens, 4)
        b, _ = run_segments(comp, tokens, 4)
    # The first eviction ends the fourth segment: until then there is no compressed slot.
    assert torch.equal(a[:, :16], b[:, :16])
    assert (a[:, 16:] - b[:, 16:]).abs().min() > 0  # then every query attends the compressed slots


def test_mean_of_identical_states_and_the_padded_last_group():
    comp = Compressor(n_layer=1, d_model=4, rate=3, fn="mean").double()
    state = torch.randn(2, 1, 4, dtype=torch.float64)
    assert torch.equal(comp(0, state.expand(2, 3, 4)), state)
    states = torch.randn(2, 5, 4, dtype=torch.float64)  # one group of 3, then 2 states padded by the newest
    out = comp(0, states)
    torch.testing.assert_close(out[:, 0], states[:, :3].mean(1))
    torch.testing.assert_close(out[:, 1], (states[:, 3] + 2 * states[:, 4]) / 3)
    conv = Compressor(n_layer=2, d_model=4, rate=3, fn="conv").double()
    torch.testing.assert_close(conv(1, states), out)  # starts as mean pooling
    assert list(Compressor(1, 4, 3, "mean").parameters()) == []


def test_the_learned_compressor_is_a_convolution_with_kernel_and_stride_rate():
    comp = Compressor(n_layer=2, d_model=4, rate=3, fn="conv").double()
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64))
    states = torch.randn(2, 9, 4, dtype=torch.float64)
    conv = torch.nn.functional.conv1d(states.transpose(1, 2), comp.weight[1], comp.bias[1], stride=3).transpose(1, 2)
    torch.testing.assert_close(comp(1, states), conv, rtol=1e-12, atol=1e-12)


def compressive_memory(mem_len: int, cmem_len: int, rate: int, d: int = 4) -> CompressiveMemory:
    """A one-layer compressive memory with mean pooling, in float64, outside a model."""
    memory = CompressiveMemory(xl_config(n_layer=1, d_model=d, mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate,
                                        cmem_fn="mean"))
    memory.build()
    return memory


def update(memory: CompressiveMemory, state: list, h: torch.Tensor, mem_len: int) -> list:
    return memory.update(state, Segment([h], h, kv=[], layers=None, mem_len=mem_len, dtype=h.dtype)).state


def test_compressed_memory_holds_the_evicted_states_compression_in_order():
    mem_len, cmem_len, rate, seg = 6, 4, 2, 4
    memory = compressive_memory(mem_len, cmem_len, rate)
    state = memory.init(2, torch.device("cpu"), torch.float64)
    seen = []
    for _ in range(7):
        h = torch.randn(2, seg, 4, dtype=torch.float64)
        state = update(memory, state, h, mem_len)
        seen.append(h)
        history = torch.cat(seen, 1)
        old, kept = history[:, :max(0, history.size(1) - mem_len)], history[:, -mem_len:]
        groups = old.view(2, -1, rate, 4).mean(2)[:, -cmem_len:]
        compressed, memory_states = state
        assert torch.equal(memory_states, kept)
        torch.testing.assert_close(compressed, groups, rtol=0, atol=1e-15)
        assert not any(t.requires_grad for t in state)


@pytest.mark.parametrize("mem_len,rate", [(5, 3), (4, 3), (0, 2), (7, 4)])
@pytest.mark.parametrize("lengths", [[1] * 20, [3, 5, 2, 7, 1, 2], [4, 4, 4, 4, 4], [13, 7]])
def test_the_memory_after_a_text_is_the_same_whatever_its_segments(mem_len, rate, lengths):
    """States leave in whole groups counted from the stream's start, so the memory after a text does not depend on how
    it was cut into segments: the reference groups the whole history by hand."""
    cmem_len = 3
    memory = compressive_memory(mem_len, cmem_len, rate)
    history = torch.randn(2, sum(lengths), 4, dtype=torch.float64)
    state, at = memory.init(2, torch.device("cpu"), torch.float64), 0
    for length in lengths:
        state = update(memory, state, history[:, at:at + length], mem_len)
        at += length
        past = history[:, :at]
        groups = max(0, at - mem_len) // rate
        slots = [past[:, g * rate:(g + 1) * rate].mean(1) for g in range(groups)][-cmem_len:]
        assert torch.equal(state[1], past[:, groups * rate:])
        assert state[0].size(1) == len(slots)
        if slots:
            torch.testing.assert_close(state[0], torch.stack(slots, 1), rtol=0, atol=1e-15)


def run_training_segments(model: TransformerXL, steps: int = 4) -> tuple:
    tokens = torch.randint(0, TINY["vocab_size"], (2, 4 * steps + 1), generator=torch.Generator().manual_seed(2))
    mems = None
    for s in range(steps):
        out = model(tokens[:, 4 * s:4 * s + 4], mems, tokens[:, 4 * s + 1:4 * s + 5])
        assert all(not m.requires_grad for m in out.mems)  # both memories are cut from the graph
        mems = out.mems
    return out, mems


def test_reconstruction_loss_trains_only_the_compressor():
    model = make_model(mem_len=4, cmem_len=4, cmem_rate=2, cmem_fn="conv").train()
    out, _ = run_training_segments(model)
    assert out.aux_loss is not None and out.aux_loss > 0
    out.aux_loss.backward()
    assert model.compressor.weight.grad.abs().sum() > 0 and model.compressor.bias.grad.abs().sum() > 0
    main = [(n, p) for n, p in model.named_parameters() if not n.startswith("compressor.")]
    assert all(p.grad is None for _, p in main), [n for n, p in main if p.grad is not None]
    model.zero_grad(set_to_none=True)
    out, _ = run_training_segments(model)
    out.loss.backward()  # the main loss reaches no compressor weight: the compressed memory is detached
    assert model.compressor.weight.grad is None and all(p.grad is not None for _, p in main)


def content_attention_by_hand(attn, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    if attn.pre_lnorm:
        x, mem = attn.layer_norm(x), attn.layer_norm(mem)
    B, L, _ = x.shape
    H, D = attn.n_head, attn.d_head
    q = (attn.q_net(x).view(B, L, H, D) + attn.r_w_bias).transpose(1, 2)
    k, v = attn.kv_net(mem).view(B, mem.size(1), 2, H, D).permute(2, 0, 3, 1, 4)
    return torch.softmax(q @ k.transpose(-1, -2) / D**0.5, -1) @ v


@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_reconstruction_loss_is_the_papers_attention_difference(pre_lnorm):
    model = make_model(mem_len=4, cmem_len=4, cmem_rate=2, cmem_fn="conv", pre_lnorm=pre_lnorm)
    perturb_compressor(model)
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, 3, 16, generator=gen, dtype=torch.float64) for _ in model.layers]
    evicted = [torch.randn(2, 4, 16, generator=gen, dtype=torch.float64) for _ in model.layers]
    compressed = [model.compressor(i, e) for i, e in enumerate(evicted)]
    expected = sum((content_attention_by_hand(layer.attn, h, c) - content_attention_by_hand(layer.attn, h, e))
                   .pow(2).mean() for layer, h, e, c in zip(model.layers, inputs, evicted, compressed, strict=True))
    torch.testing.assert_close(reconstruction_loss(LayerView(model.layers), inputs, evicted, compressed), expected)
    # A compression that loses nothing (rate 1, identity) reconstructs the attention exactly.
    exact = make_model(mem_len=4, cmem_len=4, cmem_rate=1, cmem_fn="conv", pre_lnorm=pre_lnorm)
    same = [exact.compressor(i, e) for i, e in enumerate(evicted)]
    assert reconstruction_loss(LayerView(exact.layers), inputs, evicted, same) < 1e-28


def test_mean_pooling_has_no_reconstruction_loss():
    model = make_model(mem_len=4, cmem_len=4, cmem_rate=2, cmem_fn="mean").train()
    out, _ = run_training_segments(model)
    assert out.aux_loss is None and list(model.compressor.parameters()) == []


@pytest.mark.parametrize("seg_len,mem_len,cmem_len,rate", [(4, 4, 4, 2), (8, 4, 3, 2), (6, 6, 5, 3), (4, 0, 2, 2)])
def test_cached_keys_and_values_give_the_same_evaluation(seg_len, mem_len, cmem_len, rate):
    """The carried keys/values (old slots' and kept states' sliced, new slots' projected) are those of the memory:
    also when a segment makes more slots than the compressed memory holds, or without an uncompressed memory."""
    model = make_model(mem_len=mem_len, cmem_len=cmem_len, cmem_rate=rate, cmem_fn="conv")
    perturb_compressor(model)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 50), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain, _ = run_segments(model, tokens, seg_len)
        mems, kv, cached = None, None, []
        for start in range(0, 50, seg_len):
            out = model(tokens[:, start:start + seg_len], mems, cache_kv=True, kv=kv)
            mems, kv = out.mems, out.kv
            n = model.config.n_layer  # the state: each layer's slots, then each layer's states
            assert all(k.size(2) == c.size(1) + m.size(1) for (k, _), c, m in zip(kv, mems[:n], mems[n:], strict=True))
            cached.append(out.logits)
    torch.testing.assert_close(torch.cat(cached, 1), plain, rtol=1e-12, atol=1e-12)  # the short last segment too


def test_cache_bytes_are_memory_plus_compressed_slots():
    model = make_model(dtype=torch.float32, mem_len=6, cmem_len=5, cmem_rate=2)
    _, mems = run_training_segments(model.eval(), steps=8)
    cfg = model.config
    expected = (6 + 5) * cfg.d_model * cfg.n_layer * 2 * 4
    assert nbytes(mems) == expected == cache_footprint(6, cfg.d_model, cfg.n_layer, 2, torch.float32, 5).bytes


def test_store_pack_unpack_resumes_the_compressive_memory_exactly():
    model = make_model(mem_len=4, cmem_len=4, cmem_rate=2)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole, _ = run_segments(model, tokens, 4)
        store = MemoryStore()
        mems = None
        for start in range(0, 20, 4):
            mems = model(tokens[:, start:start + 4], mems).mems
        store.write("train", mems)
        packed = store.pack(lambda t: t, 1)
        restored = MemoryStore()
        restored.unpack(packed.clone(), 0)
        mems = restored.mems["train"]
        rest = []
        for start in range(20, 40, 4):
            out = model(tokens[:, start:start + 4], mems)
            mems = out.mems
            rest.append(out.logits)
    assert torch.equal(torch.cat(rest, 1), whole[:, 20:])


def test_the_weights_keep_the_names_of_earlier_checkpoints():
    """The memory's own weights are registered on the model under the names checkpoints have always used."""
    model = make_model(mem_len=4, cmem_len=4, cmem_rate=2)
    layer = ["attn.kv_net.weight", "attn.layer_norm.bias", "attn.layer_norm.weight", "attn.o_net.weight",
             "attn.q_net.weight", "attn.r_net.weight", "attn.r_r_bias", "attn.r_w_bias", "ff.layer_norm.bias",
             "ff.layer_norm.weight", "ff.net.0.bias", "ff.net.0.weight", "ff.net.3.bias", "ff.net.3.weight"]
    expected = {"compressor.bias", "compressor.weight", "embed.weight", "head.weight"}
    expected |= {f"layers.{n}.{name}" for n in range(model.config.n_layer) for name in layer}
    assert set(model.state_dict()) == expected
    assert model.compressor.weight.shape == (model.config.n_layer, 16, 16, 2)  # Conv1d's [out, in, kernel] per layer


@pytest.mark.parametrize("field,value", [("cmem_len", 0), ("cmem_rate", 0), ("cmem_fn", "max")])
def test_invalid_compressive_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"memory.{field} must be"):
        CompressiveConfig(**{field: value})


def test_refused_combinations_are_one_sentence():
    with pytest.raises(ValueError, match="same_length would hide the compressed memory"):
        xl_config(**TINY, mem_len=4, cmem_len=4, same_length=True)
    model = make_model(mem_len=4, cmem_len=4, cmem_rate=2)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad(), pytest.raises(ValueError, match="same_length would hide the compressed memory"):
        model(tokens, same_length=True)
    with pytest.raises(ValueError, match="same_length would hide the compressed memory"):
        model.decoder(1, same_length=True)


def test_training_resumes_both_memories_exactly_and_logs_the_reconstruction_loss(tmp_path, corpus):
    """A fit stopped mid-epoch and resumed from its checkpoint gives the unbroken run's losses and weights: the
    checkpoint carries both memories of every layer, and the compressor's weights and optimizer state. Every
    line is a document, so the document masks hide slots in every segment."""
    from tests.integration.test_resume import STOP_AT, assert_resumed_as_unbroken, fit, resume_cfg
    from tests.unit.model.test_documents import SEP

    extra = ("memory=compressive", "memory.cmem_len=8", *SEP)
    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole", *extra))
    assert whole.module.model.compressor.learned and whole.module.doc_boundaries == "reset"
    assert "train/recon_loss" in whole.trainer.callback_metrics
    fit(resume_cfg(tmp_path, corpus, "first", *extra, f"trainer.max_steps={STOP_AT}"))
    saved = torch.load(tmp_path / "first" / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    # Both memories full by then: per layer the slots, then per layer the states, of every rank.
    assert [tuple(t.shape) for t in saved["xl"]["train_memory"]] == [(1, 4, 8, 32)] * 2 + [(1, 4, 16, 32)] * 2
    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", *extra,
                                           f"ckpt_path={tmp_path / 'first' / 'run'}"))
    assert_resumed_as_unbroken(whole, whole_losses, second, second_losses)


def test_resume_with_another_compressed_memory_is_refused(tmp_path, corpus):
    from tests.integration.test_resume import fit, resume_cfg
    from xl.training.build import build_run
    from xl.training.checkpoints.checkpoint import CheckpointError

    fit(resume_cfg(tmp_path, corpus, "first", "memory=compressive", "memory.cmem_len=8", "trainer.max_steps=3",
                   "callbacks.model_checkpoint.every_n_train_steps=3"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    saved = r"memory=compressive\(cmem_len=8, cmem_rate=2, cmem_fn=conv\) \(this run: cache\)"
    with pytest.raises(CheckpointError, match=saved):
        build_run(resume_cfg(tmp_path, corpus, "second", f"ckpt_path={ckpt}"))


def test_the_lightning_module_refuses_same_length_with_a_compressed_memory():
    from xl.training.loop.module import XLLitModule

    model = {**TINY, "mem_len": 4, "memory": CompressiveConfig(cmem_len=4, cmem_rate=2).to_dict()}
    with pytest.raises(ValueError, match="same_length would hide the compressed memory"):
        XLLitModule(model, eval_same_length=True)
    assert XLLitModule(model).model.compressor is not None
