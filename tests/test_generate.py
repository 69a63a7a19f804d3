"""Generation: cached one-token decoding gives exactly what full recomputation gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xl.checkpoint import Checkpoint, CheckpointError
from xl.generate import IncrementalDecoder, generate, sample
from xl.model import TransformerXL, XLConfig

ROOT = Path(__file__).resolve().parents[1]


def model(pre_lnorm: bool = False, clamp_len: int = -1, cutoffs: tuple[int, ...] = ()) -> TransformerXL:
    torch.manual_seed(0)
    cfg = XLConfig(vocab_size=40, n_layer=3, n_head=2, d_model=32, d_head=16, d_inner=64, dropout=0.0,
                   mem_len=24, pre_lnorm=pre_lnorm, clamp_len=clamp_len, cutoffs=cutoffs, div_val=2)
    return TransformerXL(cfg).double().eval()


def greedy_by_recomputation(m: TransformerXL, prompt: torch.Tensor, n: int, clamp_len: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(n):
        logits = m(tokens, mem_len=0, clamp_len=clamp_len).logits[:, -1]  # the whole text, every time
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    return tokens[:, prompt.size(1):]


@pytest.mark.parametrize("pre_lnorm,clamp_len,seg_len,cutoffs",
                         [(False, -1, 4, ()), (True, -1, 7, ()), (False, 5, 32, ()), (False, -1, 5, (10, 25))])
def test_cached_greedy_equals_full_recomputation(pre_lnorm, clamp_len, seg_len, cutoffs):
    m = model(pre_lnorm, clamp_len, cutoffs)  # cutoffs: adaptive input and softmax
    prompt = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    window = 24
    n = window + 1 - prompt.size(1)  # prompt and samples fit inside the memory
    cached = generate(m, prompt, n, window, seg_len=seg_len, clamp_len=clamp_len, temperature=0)
    torch.testing.assert_close(cached, greedy_by_recomputation(m, prompt, n, clamp_len), rtol=0, atol=0)


def test_step_logits_match_a_forward_with_memory_beyond_the_window():
    # Past the window, one cached step is a Transformer-XL forward of one token with mem_len = window.
    m = model()
    tokens = torch.randint(0, 40, (2, 40))
    decoder = IncrementalDecoder(m, 2, window=10)
    decoder.prefill(tokens[:, :30], seg_len=8)
    mems = None
    with torch.no_grad():
        for start in range(0, 30, 8):
            mems = m(tokens[:, start:min(start + 8, 30)], mems, mem_len=10).mems
        for t in range(30, 40):
            out = m(tokens[:, t:t + 1], mems, mem_len=10)
            mems = out.mems
            torch.testing.assert_close(decoder.step(tokens[:, t]), out.logits[:, -1], rtol=1e-10, atol=1e-10)


def test_sampling_respects_top_k_top_p_and_seed():
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0, -6.0]]).repeat(500, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample(logits, 1.0, 2, 1.0, gen).tolist()) == {0, 1}
    assert set(sample(logits, 1.0, 0, 0.5, gen).tolist()) == {0}
    assert sample(logits, 0.0, 0, 1.0, gen).eq(0).all()
    a = sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(a, sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(3)))


def test_generate_command_on_a_checkpoint(tmp_path, corpus):
    from tests.conftest import compose_config, tiny_overrides
    from xl.build import build_run

    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=2"))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    data = ["data=text", f"data.train={corpus['train']}", f"data.val={corpus['val']}",
            f"data.test={corpus['test']}", f"data.cache_dir={tmp_path / 'cache'}"]
    result = subprocess.run([sys.executable, "-m", "xl.generate", f"ckpt={ckpt}", "prompt='def main('",
                             "max_new_tokens=20", "temperature=0", "warmup='import os\n'", *data],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("def main(") and len(result.stdout.rstrip("\n")) >= len("def main(") + 1
    # A tokenizer other than the training one is refused before anything is printed.
    with pytest.raises(CheckpointError, match="vocabulary of 256 but this data gives 300"):
        Checkpoint.open(str(ckpt)).load_model(300)
