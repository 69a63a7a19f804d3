"""Generation: greedy decoding gives what full recomputation gives; the command runs on real checkpoints,
with or without a memory. (The decoder's exactness past one window: tests/unit/model/test_decoding.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config, run_hydra_main, tiny_overrides
from tests.helpers.paths import FIXTURES, ROOT
from xl.data.words import WordTokenizer
from xl.generate import main
from xl.generation import generate, sample
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.build import build_run
from xl.training.checkpoints.checkpoint import Checkpoint, CheckpointError

FIXTURE = FIXTURES / "transfo_xl"


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


def test_sampling_respects_top_k_top_p_and_seed():
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0, -6.0]]).repeat(500, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample(logits, 1.0, 2, 1.0, gen).tolist()) == {0, 1}
    assert set(sample(logits, 1.0, 0, 0.5, gen).tolist()) == {0}
    assert sample(logits, 0.0, 0, 1.0, gen).eq(0).all()
    a = sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(a, sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(3)))


def test_generate_command_on_a_checkpoint(tmp_path, corpus):
    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "trainer.max_steps=2"))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    data = data_overrides(corpus, tmp_path)
    result = subprocess.run([sys.executable, "-m", "xl.generate", f"ckpt={ckpt}", "prompt='def main('",
                             "max_new_tokens=20", "temperature=0", "warmup_text='import os\n'", *data],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("def main(") and len(result.stdout.rstrip("\n")) >= len("def main(") + 1
    # A tokenizer other than the training one is refused before anything is printed.
    with pytest.raises(CheckpointError, match="vocabulary of 256 but this data gives 300"):
        Checkpoint.open(str(ckpt)).load_model(300)


def data_overrides(corpus: dict[str, Path], tmp_path: Path) -> list[str]:
    return ["data=text", f"data.train={corpus['train']}", f"data.val={corpus['val']}", f"data.test={corpus['test']}",
            f"data.cache_dir={tmp_path / 'cache'}"]


@pytest.fixture(scope="module")
def no_memory_ckpt(tmp_path_factory, corpus) -> Path:
    """A checkpoint trained without memory (mem_len=0) on segments of 16 tokens."""
    tmp = tmp_path_factory.mktemp("no_memory")
    run = build_run(compose_config(*tiny_overrides(tmp, corpus), "memory.mem_len=0", "trainer.max_steps=2"))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return tmp / "run" / "checkpoints" / "last.ckpt"


def generate_in_process(ckpt: Path, corpus, tmp_path, monkeypatch, capsys, *overrides: str) -> tuple[str, str, list]:
    """``python -m xl.generate`` as the command line runs it; returns stdout, stderr and the decoders' windows."""
    windows, make_decoder = [], TransformerXL.decoder

    def decoder(self, batch_size, window=None, **context):
        windows.append(window)
        return make_decoder(self, batch_size, window, **context)

    monkeypatch.setattr(TransformerXL, "decoder", decoder)
    capsys.readouterr()
    run_hydra_main(main, ["xl.generate", f"ckpt={ckpt}", "prompt='def main('", "max_new_tokens=60", "seed=3",
                          *data_overrides(corpus, tmp_path), f"hydra.run.dir={tmp_path / 'gen'}", *overrides],
                   monkeypatch)
    out = capsys.readouterr()
    return out.out, out.err, windows


def expected_text(ckpt: Path, window: int) -> str:
    model = Checkpoint.open(ckpt).load_model()
    prompt = torch.tensor([list(b"def main(")])
    return "def main(" + bytes(generate(model, prompt, 60, window, seed=3)[0].tolist()).decode("utf-8", "replace")


@pytest.mark.parametrize("overrides,window,said", [
    ((), 15, "each new token attends over 16 tokens, the training segment length, data.tgt_len=16"),
    (("same_length=true",), 16, "each new token attends over 16 tokens, the training segment length, data.tgt_len=16"),
    (("mem_len=4",), 4, "decoding with mem_len=4 (mem_len)"),
])
def test_generate_command_on_a_checkpoint_trained_without_memory(no_memory_ckpt, corpus, tmp_path, monkeypatch,
                                                                 capsys, overrides, window, said):
    out, err, windows = generate_in_process(no_memory_ckpt, corpus, tmp_path, monkeypatch, capsys, *overrides)
    assert windows == [window] and said in err and f"decoding with mem_len={window} " in err
    assert out == expected_text(no_memory_ckpt, window) + "\n"


def test_generate_command_without_a_recorded_segment_length_uses_seg_len(no_memory_ckpt, corpus, tmp_path,
                                                                         monkeypatch, capsys):
    state = torch.load(no_memory_ckpt, weights_only=True)
    del state["loops"]  # no train loader position and no recorded length: the training segment length is unknown
    del state["xl"]["train_tgt_len"]
    ckpt = tmp_path / "no_loops.ckpt"
    torch.save(state, ckpt)
    out, err, windows = generate_in_process(ckpt, corpus, tmp_path, monkeypatch, capsys, "seg_len=11")
    assert windows == [10] and "decoding with mem_len=10 (" in err and "seg_len (the checkpoint does not record" in err
    assert out == expected_text(ckpt, 10) + "\n"


def test_generate_command_refuses_an_explicit_zero_memory(no_memory_ckpt, corpus, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="error: incremental decoding needs a memory: set mem_len"):
        generate_in_process(no_memory_ckpt, corpus, tmp_path, monkeypatch, capsys, "mem_len=0")


def test_generate_command_on_a_compressive_checkpoint(tmp_path, corpus, monkeypatch, capsys):
    """A checkpoint with a compressed memory decodes: 60 samples after a 9-byte prompt push states out of a
    16-position window, and the decoder compresses them as it goes, past its 8 slots."""
    run = build_run(compose_config(*tiny_overrides(tmp_path, corpus), "memory=compressive", "memory.mem_len=16",
                                   "memory.cmem_len=8", "memory.cmem_rate=4", "trainer.max_steps=2"))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    decoders, make_decoder = [], TransformerXL.decoder

    def decoder(self, *args, **context):
        decoders.append(make_decoder(self, *args, **context))
        return decoders[-1]

    monkeypatch.setattr(TransformerXL, "decoder", decoder)
    out, err, _ = generate_in_process(ckpt, corpus, tmp_path, monkeypatch, capsys)
    assert "decoding with mem_len=16 (the checkpoint's mem_len)" in err
    assert (9 + 60 - 16) // 4 == 13 and decoders[0].slots == 8  # 13 groups left the window; the newest 8 are kept
    assert out == expected_text(ckpt, 16) + "\n"


def test_a_word_prompt_is_continued_on_its_line_and_log_lines_go_to_stderr(tmp_path, monkeypatch, capsys):
    """With a word vocabulary (a converted model) the prompt's last line stays open: the model reads the prompt's
    words without an end-of-line symbol after them, and the text goes on after a space. Warning lines (the text
    files' words that the vocabulary lacks) go to stderr; stdout is the text alone."""
    from xl.convert import convert

    run = tmp_path / "wt"
    convert(FIXTURE, run)
    prompts, generate_ids = [], generate

    def recording(model, prompt, *args, **kwargs):
        prompts.append(prompt[0].tolist())
        return generate_ids(model, prompt, *args, **kwargs)

    monkeypatch.setattr("xl.generation.generate", recording)
    text = FIXTURE / "text.txt"
    capsys.readouterr()
    run_hydra_main(main, ["xl.generate", f"ckpt={run}", "prompt='The Zürich of'", "max_new_tokens=12",
                          "temperature=0", "data=text", f"data.train={text}", f"data.val={text}", f"data.test={text}",
                          "data.tokenizer=word", f"data.tokenizer_file={run / 'vocab.json'}",
                          f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'gen'}"], monkeypatch)
    out, err = capsys.readouterr()
    tokenizer = WordTokenizer(file=run / "vocab.json")
    assert prompts == [[tokenizer.itos.index(w) for w in ("The", "Zürich", "of")]]  # no <eos> after them
    model = Checkpoint.open(run).load_model()
    new = generate(model, torch.tensor(prompts), 12, temperature=0)[0].tolist()
    expected, words_on_line = "The Zürich of", 3
    for i in new:  # the words after the prompt's on its line, a newline for each <eos>
        word = tokenizer.itos[i]
        expected += "\n" if i == tokenizer.eos_id else (" " if words_on_line else "") + word
        words_on_line = 0 if i == tokenizer.eos_id else words_on_line + 1
    assert out == expected + "\n"
    assert "WARNING" not in out and "read as <unk>" in err and "decoding with mem_len=7" in err
