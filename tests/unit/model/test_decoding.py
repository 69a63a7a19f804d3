"""Incremental decoding (``TransformerXL.decoder``): every token fed gets exactly the logits of the model's
forward of that one token over the memory carried (``mem_len = window``), well past one window."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CONF_DIR, compose_config
from xl.config.rules import model_values
from xl.model.config import XLConfig
from xl.model.decoding import Decoder
from xl.model.transformer import TransformerXL

WINDOW = 8
VOCAB = 40


def model(pre_lnorm: bool = False, clamp_len: int = -1, same_length: bool = False, cutoffs: tuple[int, ...] = (),
          n_layer: int = 3) -> TransformerXL:
    torch.manual_seed(0)
    cfg = XLConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=2, d_model=32, d_head=16, d_inner=64, dropout=0.0,
                   mem_len=WINDOW, pre_lnorm=pre_lnorm, clamp_len=clamp_len, same_length=same_length,
                   cutoffs=cutoffs, div_val=2)
    return TransformerXL(cfg).double().eval()


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def forward_token_by_token(m: TransformerXL, prompt: torch.Tensor, fed: torch.Tensor, seg_len: int,
                           clamp_len: int, same_length: bool) -> torch.Tensor:
    """The reference: the model's forward over the prompt in segments, then over one token per call, carrying
    ``out.mems`` (mem_len = WINDOW). The logits after the prompt (if any) and after each fed token."""
    context = {"mem_len": WINDOW, "clamp_len": clamp_len, "same_length": same_length}
    mems, logits = None, []
    for start in range(0, prompt.size(1), seg_len):
        out = m(prompt[:, start:start + seg_len], mems, **context)
        mems = out.mems
    if prompt.size(1):
        logits.append(out.logits[:, -1])
    for t in range(fed.size(1)):
        out = m(fed[:, t:t + 1], mems, **context)
        mems = out.mems
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def decoded(decoder, prompt: torch.Tensor, fed: torch.Tensor, seg_len: int) -> torch.Tensor:
    logits = [decoder.prefill(prompt, seg_len)] if prompt.size(1) else []
    return torch.stack(logits + [decoder.feed(fed[:, t]) for t in range(fed.size(1))], 1)


# No prompt; one shorter than the window, as long, longer.
@pytest.mark.parametrize("prompt_len", [0, 5, WINDOW, 21])
@pytest.mark.parametrize("pre_lnorm,clamp_len,same_length,cutoffs", [
    (False, -1, False, ()), (True, -1, False, ()), (False, 3, False, ()), (False, -1, False, (10, 25)),
    (False, -1, True, ()), (True, 3, True, (10, 25)),
])
def test_every_fed_token_equals_a_one_token_forward_over_the_memory(prompt_len, pre_lnorm, clamp_len, same_length,
                                                                    cutoffs):
    # 3 windows and more: the keys/values buffers (2 windows long) are moved to their front several times.
    m = model(pre_lnorm, clamp_len, same_length, cutoffs)  # cutoffs: adaptive input and softmax
    prompt, fed = tokens(2, prompt_len), tokens(2, 3 * WINDOW + 3, seed=2)
    got = decoded(m.decoder(2), prompt, fed, seg_len=5)  # the config's window, clamp_len and same_length
    want = forward_token_by_token(m, prompt, fed, 5, clamp_len, same_length)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("config,decoding", [
    ((-1, False), (3, True)), ((3, True), (-1, False)), ((-1, False), (-1, True)), ((5, False), (2, False)),
])
def test_the_decoders_context_holds_for_prefill_and_feed_alike(config, decoding):
    # A model trained with one clamp_len/same_length, decoded with another: both prefill and feed use the decoder's.
    m = model(clamp_len=config[0], same_length=config[1])
    clamp_len, same_length = decoding
    prompt, fed = tokens(2, 19), tokens(2, 2 * WINDOW + 1, seed=2)
    got = decoded(m.decoder(2, WINDOW, clamp_len=clamp_len, same_length=same_length), prompt, fed, seg_len=7)
    torch.testing.assert_close(got, forward_token_by_token(m, prompt, fed, 7, clamp_len, same_length),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("same_length", [False, True])
def test_a_fed_token_attends_over_the_window_and_no_further(same_length):
    # One layer: the logits depend on exactly the tokens the new one attends to. It sees the last WINDOW
    # positions and itself; with same_length, WINDOW keys with itself among them.
    m = model(same_length=same_length, n_layer=1)
    span = WINDOW if same_length else WINDOW + 1  # keys seen, the fed token's own included
    text = tokens(1, 30)

    def last_logits(text: torch.Tensor) -> torch.Tensor:
        decoder = m.decoder(1)
        decoder.prefill(text[:, :11], seg_len=4)
        return torch.stack([decoder.feed(text[:, t]) for t in range(11, text.size(1))])[-1]

    def changed(back: int) -> torch.Tensor:  # the token `back` positions before the last one, replaced
        other = text.clone()
        other[0, -1 - back] = (other[0, -1 - back] + 1) % VOCAB
        return other

    assert torch.equal(last_logits(changed(span)), last_logits(text))
    assert not torch.allclose(last_logits(changed(span - 1)), last_logits(text), rtol=1e-6, atol=1e-6)


def test_decoder_refuses_what_it_cannot_decode():
    m = model()
    with pytest.raises(ValueError, match="needs a memory: set mem_len"):
        m.decoder(1, 0)
    decoder = m.decoder(2)
    with pytest.raises(ValueError, match=r"prefill needs tokens \[2, T >= 1\]"):
        decoder.prefill(tokens(3, 4), seg_len=2)
    with pytest.raises(ValueError, match=r"prefill needs tokens"):
        decoder.prefill(tokens(2, 0), seg_len=2)
    with pytest.raises(ValueError, match=r"feed takes one token per row, \[2\]"):
        decoder.feed(tokens(1))


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF_DIR / "memory").glob("*.yaml")))
def test_every_memory_decodes_through_the_one_decoder_interface(option):
    """Each conf/memory option's decoder is a :class:`Decoder`: the same three methods, their arguments refused in
    the same sentences, whatever the variant (the checks live in the base class alone)."""
    cfg = compose_config(f"memory={option}", "model=tiny", "data.tgt_len=4")
    m = TransformerXL(XLConfig.from_dict(model_values(cfg, vocab_size=VOCAB))).eval()
    window = max(cfg.memory.mem_len, 4)
    decoder = m.decoder(2, window)
    assert isinstance(decoder, Decoder)
    with pytest.raises(ValueError, match=r"prefill needs tokens \[2, T >= 1\]"):
        decoder.prefill(tokens(3, 5), 4)
    with pytest.raises(ValueError, match="feed takes one token per row"):
        decoder.feed(tokens(3))
    with pytest.raises(ValueError, match="reset_rows takes one flag per row"):
        decoder.reset_rows(torch.zeros(3, dtype=torch.bool))
    assert decoder.prefill(tokens(2, 9), 4).shape == decoder.feed(tokens(2)).shape == (2, VOCAB)


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF_DIR / "memory").glob("*.yaml")))
def test_every_memory_checks_a_given_state_against_its_own_layout(option):
    """``Memory.adopt`` (the base class's, from :meth:`Memory.init`'s layout) takes a state the model returned and
    refuses, in one sentence naming init_mems, a state with a tensor missing, a row too many, a wrong width, an integer
    tensor where a floating one belongs, or layers of different lengths."""
    cfg = compose_config(f"memory={option}", "model=tiny", "data.tgt_len=4")
    m = TransformerXL(XLConfig.from_dict(model_values(cfg, vocab_size=VOCAB))).eval()
    with torch.no_grad():
        state = m(tokens(2, 4), None).mems
        state = m(tokens(2, 4, seed=2), state).mems
    assert m.memory.adopt(state, 2, cfg.memory.mem_len) is state
    broken = {
        "a tensor missing": state[:-1],
        "a row too many": [torch.cat([t, t[:1]]) for t in state],
        "a wrong width": [t[..., :-1] if t.is_floating_point() and t.dim() == 3 else t for t in state],
        "an integer tensor": [t.long() if t.is_floating_point() else t for t in state],
    }
    growing = [i for i, t in enumerate(m.memory.init(2, torch.device("meta"), torch.float32))
               if t.dim() >= 2 and t.size(1) == 0]
    if growing and state[growing[0]].size(1):
        broken["layers of different lengths"] = [t[:, 1:] if i == growing[0] else t for i, t in enumerate(state)]
    for what, wrong in broken.items():
        with pytest.raises(ValueError, match=r"init_mems\(2\)") as error:
            m.memory.adopt(wrong, 2, cfg.memory.mem_len)
        assert len(str(error.value)) < 200, what
