"""Memory tokens laid out as the Recurrent Memory Transformer's models (memory=rmt): the forward pass and gradients
against a float64 reference written from RMT's code, one-token decoding, resume through a Trainer and train.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import Tensor

from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.unit.memory.test_memory_tokens import (
    TINY,
    assert_decodes_as_forward,
    assert_gradients_equal_reference,
    forward_logits,
    gradients_through_windows,
    layout_resumes_exactly,
    random_tokens,
    reference_layer,
)
from xl.memory.rmt import RMTConfig
from xl.memory.tokens import TokensConfig
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.build import build_run

SEG = 5  # text tokens per segment


def rmt_model(n: int = 2, seed: int = 0, config: type = RMTConfig, **extra) -> TransformerXL:
    """A float64 model with memory=rmt (or another memory-token config), weights moved off their initial values."""
    torch.manual_seed(seed)
    values = {**TINY, "pre_lnorm": True, "mem_len": 0, **extra}
    model = TransformerXL(XLConfig(**values, memory=config(num_tokens=n, seg_len=SEG))).double()
    with torch.no_grad():  # the biases, the final norm and the initial memory away from their initial values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def rmt_reference(model: TransformerXL, tokens: Tensor, seg_len: int) -> Tensor:
    """Logits [B, T, vocab] of RMT's recurrence as its code writes it, one row and one segment at a time.

    From github.com/booydar/recurrent-memory-transformer at commit 9d0ebe1778687995697fe68e886bc1dcf0e45e1c,
    ``modeling_rmt/language_modeling.py``: ``RecurrentWrapper.forward`` splits the input into segments
    (``split_tensor``, left-aligned: the last one may be shorter) and calls the memory cell on each with the memory
    state the previous call returned (None for the first: ``set_memory`` repeats the learned ``memory`` weights);
    ``MemoryCell.process_input`` makes the inputs ``cat([memory_state, inputs_embeds, memory_state])`` and runs the
    base model on them alone (no past key/values: nothing of a segment's states reaches the next but the memory);
    the base model is a causal decoder (every position sees itself and the positions before it);
    ``process_output`` returns the logits of the segment's own positions and the new memory
    ``hidden_states[-1][:, -num_mem_tokens:]``, the last hidden state, which the base decoders (GPT-2's ``ln_f``,
    GPT-NeoX's ``final_layer_norm``) take after their final layer norm. Here the base model is this project's
    Transformer-XL layer, computed score by score (:func:`reference_layer`), whose relative distances count along
    ``memory ∘ segment ∘ memory`` as the decoders' absolute positions do."""
    n = model.config.memory.num_tokens
    initial = model.memory_tokens.values
    B, T = tokens.shape
    rows = []
    for b in range(B):
        memory, logits = initial, []
        for s in range(0, T, seg_len):
            text = tokens[b, s:s + seg_len]
            x = torch.cat([memory, model.embed(text) * model.emb_scale, memory])
            Q = x.size(0)
            causal = torch.tensor([[j <= i for j in range(Q)] for i in range(Q)])
            for layer in model.layers:
                x = reference_layer(layer, x, x[:0], causal, model.config.clamp_len)
            logits.append(model.head(model.final_norm(x[n:n + len(text)])))
            memory = model.final_norm(x[n + len(text):])
        rows.append(torch.cat(logits))
    return torch.stack(rows)


# ---- the forward pass ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"clamp_len": 4}])
def test_forward_equals_the_reference_written_from_rmts_code(extra):
    model = rmt_model(**extra)
    tokens = random_tokens(2, 3 * SEG + 2)
    with torch.no_grad():
        ours = forward_logits(model, tokens, SEG)
        reference = rmt_reference(model, tokens, SEG)
    torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-10)


def test_the_written_memory_is_the_tokens_memory_through_the_final_norm():
    """The same weights under memory=tokens and memory=rmt: the first segment runs alike, and the memory it leaves is
    the final layer norm of the other's; a post-LN model (no final norm) gives the two layouts the same logits."""
    rmt, tokens_layout = rmt_model(), rmt_model(config=TokensConfig)
    tokens = random_tokens(2, 3 * SEG)
    with torch.no_grad():
        a, b = rmt(tokens[:, :SEG], None), tokens_layout(tokens[:, :SEG], None)
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
        torch.testing.assert_close(a.mems[-1], rmt.final_norm(b.mems[-1]), rtol=0, atol=0)
        assert not torch.allclose(a.mems[-1], b.mems[-1])
        post = [forward_logits(rmt_model(config=c, pre_lnorm=False), tokens, SEG) for c in (RMTConfig, TokensConfig)]
    torch.testing.assert_close(post[0], post[1], rtol=0, atol=0)


def test_gradients_through_k_segments_equal_the_reference():
    k = 3
    model = rmt_model().train()
    tokens, ours = gradients_through_windows(model, k)
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert ours["memory_tokens.values"].abs().sum() > 0 and ours["final_norm.weight"].abs().sum() > 0

    model.zero_grad()
    logits = rmt_reference(model, x, SEG)  # everything in one graph: RMT back-propagates through every segment
    assert_gradients_equal_reference(model, logits, y, k, SEG, ours)


# ---- decoding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mem_len", [0, 7])
def test_one_token_decoding_equals_the_forward_read_in_segments(mem_len):
    assert_decodes_as_forward(rmt_model(mem_len=mem_len))


# ---- the path users run ---------------------------------------------------------------------------------------------
RMT = ("memory=rmt", "memory.mem_len=0", "memory.num_tokens=2", "model.pre_lnorm=true")


def test_resume_of_memory_rmt_at_a_window_boundary_is_exact(tmp_path, corpus):
    """memory=rmt as configured (windows of 2 segments, no cache): a run stopped at step 7 and resumed trains the
    remaining segments with the unbroken run's losses and ends with its weights."""
    layout_resumes_exactly(tmp_path, corpus, RMT, cache=0)


def test_train_py_trains_memory_rmt(tmp_path, corpus, monkeypatch):
    from xl import train

    overrides = [*tiny_overrides(tmp_path, corpus), *RMT, "trainer.max_steps=2", "trainer.val_check_interval=2"]
    cfg = compose_config(*overrides)
    assert (cfg.memory._target_, cfg.memory.grad_segments) == ("xl.memory.rmt.RMTConfig", 2)
    run_hydra_main(train.main, ["train.py", *overrides], monkeypatch)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["memory"], results["mem_len"], results["grad_segments"]) == ("rmt(num_tokens=2)", 0, 2)
    assert all(math.isfinite(results[k]) for k in results if k.endswith("loss") and isinstance(results[k], float))
    assert build_run(cfg).module.model.memory.written.__qualname__ == "RMTMemory.written"
