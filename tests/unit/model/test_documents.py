"""Memory that stops at document boundaries (xl/model/documents.py), claim by claim.

The reference for the model is the obviously correct one: the same document read alone, from an empty memory, by
the plain model (no document machinery), with its segments cut at the same places. Packed mid-row after other
documents, with ``documents=``, each of its tokens must get the same logits (float64, ~1e-12).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import xl.model.memory
from tests.conftest import compose_config, tiny_overrides
from xl.data import DataError, SegmentDataModule, SegmentLoader, make_tokenizer, sources
from xl.data.cache import open_cache
from xl.model.attention import TrainingAttentionCPU, rel_shift
from xl.model.config import XLConfig
from xl.model.documents import Documents, DocumentStats, bucket_names, positions, split_batch, stream_positions, summary
from xl.model.positions import attention_mask
from xl.model.transformer import TransformerXL
from xl.training.build import build_run
from xl.training.loop.module import XLLitModule

TINY = dict(vocab_size=32, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, dropout=0.0)
PROBE = 13  # length of the probe document


def make_model(seed: int = 0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    return TransformerXL(XLConfig(**{**TINY, **overrides})).double().eval()


def read(model: TransformerXL, tokens: torch.Tensor, cuts: list[int], starts: torch.Tensor | None = None,
         cache_kv: bool = False, **context) -> torch.Tensor:
    """Logits [B, T, V] of rows read in the segments ``cuts`` delimit, memory (and with ``cache_kv`` the keys
    and values) carried; with ``starts`` each segment gets its :class:`Documents`."""
    pos = None if starts is None else positions(starts)
    mems = kv = None
    logits = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        documents = None if pos is None else Documents.from_positions(pos[:, a:b])
        with torch.no_grad():
            out = model(tokens[:, a:b], mems, documents=documents, cache_kv=cache_kv, kv=kv, **context)
        mems, kv = out.mems, out.kv
        logits.append(out.logits)
    return torch.cat(logits, 1)


def grid(length: int, seg_len: int, first: int | None = None) -> list[int]:
    """Segment cuts of a row: every ``seg_len`` tokens, the first segment ``first`` long."""
    first = seg_len if first is None else first
    return sorted({0, *range(first, length, seg_len), length})


def packed_rows(seed: int = 0, offsets: tuple[int, int] = (3, 10)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                             list[int]]:
    """Three rows of 40 tokens: short documents (1-4 tokens: several begin in one segment), then the probe
    document at a different offset in each row (``offsets``), then more; the third row is one document throughout
    (no boundary: it must read as without documents). Returns tokens, starts, the probe and its offsets."""
    g = torch.Generator().manual_seed(seed)
    probe = torch.randint(0, 32, (PROBE,), generator=g)
    rows, starts, offsets = [], [], [*offsets, 0]
    for r, offset in enumerate(offsets):
        row = torch.randint(0, 32, (40,), generator=g)
        flags = torch.zeros(40, dtype=torch.bool)
        if r < 2:
            row[offset:offset + PROBE] = probe
            cut = 0
            while cut < offset:  # documents of 1-4 tokens before the probe
                flags[cut] = True
                cut += int(torch.randint(1, 5, (), generator=g))
            flags[offset] = flags[offset + PROBE] = True
            flags[offset + PROBE + 2] = True
        rows.append(row)
        starts.append(flags)
    return torch.stack(rows), torch.stack(starts), probe, offsets


CONTEXTS = [  # seg_len, mem_len, clamp_len, same_length, pre_lnorm
    (4, 4, -1, False, False),
    (4, 11, -1, False, True),  # memory longer than a segment
    (5, 7, 3, False, False),  # clamp_len
    (4, 9, -1, True, False),  # same_length
    (3, 6, 2, True, True),
    (4, 0, -1, False, False),  # no memory: only the in-segment masking applies
]


@pytest.mark.parametrize("cache_kv", [False, True])
@pytest.mark.parametrize("seg_len,mem_len,clamp_len,same_length,pre_lnorm", CONTEXTS)
def test_a_document_packed_mid_row_reads_as_if_alone(seg_len, mem_len, clamp_len, same_length, pre_lnorm, cache_kv):
    model = make_model(pre_lnorm=pre_lnorm)
    context = {"mem_len": mem_len, "clamp_len": clamp_len, "same_length": same_length}
    tokens, starts, probe, offsets = packed_rows()
    packed = read(model, tokens, grid(40, seg_len), starts, cache_kv, **context)
    for r in (0, 1):  # every row by itself, whatever the other rows hold
        offset = offsets[r]
        alone = read(model, probe[None], grid(PROBE, seg_len, seg_len - offset % seg_len), **context)[0]
        torch.testing.assert_close(packed[r, offset:offset + PROBE], alone, rtol=0, atol=1e-12)
        nll_packed = F.cross_entropy(packed[r, offset:offset + PROBE - 1], probe[1:], reduction="none")
        nll_alone = F.cross_entropy(alone[:-1], probe[1:], reduction="none")
        torch.testing.assert_close(nll_packed, nll_alone, rtol=0, atol=1e-12)
    # The row without a boundary keeps its whole memory: exactly the plain model's reading.
    plain = read(model, tokens, grid(40, seg_len), None, cache_kv, **context)
    torch.testing.assert_close(packed[2], plain[2], rtol=0, atol=1e-12)
    # And a packed row does differ from the plain reading (the test can see a leak).
    assert (packed[1, offsets[1]:offsets[1] + PROBE] - plain[1, offsets[1]:offsets[1] + PROBE]).abs().max() > 1e-6


def test_every_token_its_own_document_sees_only_itself():
    model = make_model(mem_len=6)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4))
    starts = torch.ones(2, 8, dtype=torch.bool)
    packed = read(model, tokens, [0, 4, 8], starts, mem_len=6)
    alone = torch.cat([read(model, tokens[:, t:t + 1], [0, 1], mem_len=6) for t in range(8)], 1)
    assert torch.isfinite(packed).all()  # no query is left without a key
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


def test_a_batch_without_a_boundary_in_reach_uses_the_plain_mask(monkeypatch):
    model = make_model(mem_len=8)
    tokens = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(5))
    mems = model(torch.randint(0, 32, (2, 8)), mem_len=8).mems
    calls = []
    real = xl.model.memory.document_mask
    monkeypatch.setattr(xl.model.memory, "document_mask", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        plain = model(tokens, mems).logits
        # Every row's document began 8 tokens before the segment: the memory holds nothing of another document.
        far = model(tokens, mems, documents=Documents.from_positions(torch.arange(8, 12).repeat(2, 1))).logits
        assert calls == []
        near = model(tokens, mems, documents=Documents.from_positions(torch.arange(7, 11).repeat(2, 1))).logits
        assert calls == [1]
    assert torch.equal(far, plain)
    assert not torch.allclose(near, plain)


def reference_attention_probs(q_w, k, v, pos_scores, mask, scale):
    """softmax(scale · (q_w kᵀ + rel_shift(pos_scores)) + mask) · v by autograd (the math, no hand backward)."""
    scores = (torch.matmul(q_w, k.transpose(-1, -2)) + rel_shift(pos_scores)) * scale + mask
    return torch.matmul(scores.softmax(-1), v)


def test_training_attention_backward_with_a_per_row_mask():
    g = torch.Generator().manual_seed(6)
    B, H, L, M, D = 3, 2, 5, 4, 8
    K = M + L
    tensors = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((B, H, L, D), (B, H, K, D), (B, H, K, D), (B, H, L, K))]
    plain = attention_mask(L, M, None, torch.device("cpu")).double()
    starts = torch.zeros(B, L, dtype=torch.bool)
    starts[0, 2] = starts[1, 0] = starts[1, 3] = True
    pos = positions(starts, torch.tensor([1, 9, 2]))
    mask = xl.model.memory.document_mask(plain, pos, M)
    assert mask.shape == (B, 1, L, K) and torch.isinf(mask).any(-1).any()
    grad_out = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    fast = TrainingAttentionCPU.apply(*tensors, mask, 0.3, None)
    fast_grads = torch.autograd.grad(fast, tensors, grad_out)
    slow = reference_attention_probs(*tensors, mask, 0.3)
    slow_grads = torch.autograd.grad(slow, tensors, grad_out)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)
    for a, b in zip(fast_grads[:3], slow_grads[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # Position scores: only the entries the shift reads (the rest of the padded layout is never used).
    torch.testing.assert_close(rel_shift(fast_grads[3]), rel_shift(slow_grads[3]), rtol=0, atol=1e-12)


def test_training_gradients_of_a_packed_document_are_those_of_the_document_alone():
    """The CPU training path (hand-written backward) with boundaries: the probe's loss gives the same weight
    gradients packed in a row after other documents as read alone (one segment each, no memory)."""
    model = make_model(mem_len=0).train()
    tokens, starts, probe, offsets = packed_rows()
    offset = offsets[1]
    row = tokens[1:2, :offset + PROBE]
    documents = Documents.from_positions(positions(starts[1:2, :offset + PROBE]))
    logits = model(row, documents=documents, mem_len=0).logits[0, offset:offset + PROBE - 1]
    packed = torch.autograd.grad(F.cross_entropy(logits, probe[1:]), list(model.parameters()))
    alone_logits = model(probe[None], mem_len=0).logits[0, :-1]
    alone = torch.autograd.grad(F.cross_entropy(alone_logits, probe[1:]), list(model.parameters()))
    for a, b in zip(packed, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --- decoding -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("same_length", [False, True])
def test_decoder_reset_rows_and_prefill_starts_equal_the_forward_with_documents(same_length):
    model = make_model(mem_len=6, same_length=same_length)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 32, (2, 9), generator=g)
    fed = torch.randint(0, 32, (2, 14), generator=g)
    prompt_starts = torch.zeros(2, 9, dtype=torch.bool)
    prompt_starts[0, 5] = prompt_starts[1, 8] = True
    fed_starts = torch.zeros(2, 14, dtype=torch.bool)
    fed_starts[0, 3] = fed_starts[1, 10] = fed_starts[0, 11] = True
    # Reference: the forward, the prompt in segments of 4, then one token per call, with documents throughout.
    tokens, starts = torch.cat([prompt, fed], 1), torch.cat([prompt_starts, fed_starts], 1)
    reference = read(model, tokens, grid(23, 4, 4)[:3] + list(range(9, 24)), starts, mem_len=6)
    decoder = model.decoder(2, 6)
    got = [decoder.prefill(prompt, 4, prompt_starts)]
    for t in range(14):
        decoder.reset_rows(fed_starts[:, t])
        got.append(decoder.feed(fed[:, t]))
    torch.testing.assert_close(torch.stack(got, 1), reference[:, 8:], rtol=0, atol=1e-12)


def test_a_prompt_that_begins_a_document_starts_that_row_from_an_empty_memory():
    model = make_model(mem_len=5)
    g = torch.Generator().manual_seed(8)
    history = torch.randint(0, 32, (2, 7), generator=g)
    prompt = torch.randint(0, 32, (2, 9), generator=g)
    decoder, fresh, untouched = model.decoder(2, 5), model.decoder(2, 5), model.decoder(2, 5)
    for t in range(7):
        decoder.feed(history[:, t])
        untouched.feed(history[:, t])
    decoder.reset_rows(torch.tensor([True, False]))
    for t in range(9):
        got, new, kept = decoder.feed(prompt[:, t]), fresh.feed(prompt[:, t]), untouched.feed(prompt[:, t])
        torch.testing.assert_close(got[0], new[0], rtol=0, atol=1e-12)  # row 0: as if nothing came before
        torch.testing.assert_close(got[1], kept[1], rtol=0, atol=1e-12)  # row 1: keeps its memory
    with pytest.raises(ValueError, match="one flag per row"):
        decoder.reset_rows(torch.tensor([True]))


# --- data ---------------------------------------------------------------------------------------------------------


def test_stream_positions_match_a_slow_reference():
    doc_starts = np.array([0, 3, 4, 11, 30])
    flat = np.arange(45)
    slow = [i - max(s for s in doc_starts if s <= i) for i in flat]
    assert stream_positions(doc_starts, flat).tolist() == slow
    assert stream_positions(None, flat).tolist() == flat.tolist()
    starts = torch.zeros(1, 45, dtype=torch.bool)
    starts[0, doc_starts] = True
    assert positions(starts)[0].tolist() == slow
    assert positions(starts[:, 5:], torch.tensor([1]))[0].tolist() == slow[5:]


@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_loader_says_where_each_rows_documents_begin(rank, world_size):
    ids = np.arange(203) % 50
    doc_starts = np.array([0, 5, 6, 40, 41, 42, 97, 150, 151])
    loader = SegmentLoader(ids, 3, 7, rank, world_size, doc_starts=doc_starts)
    plain = list(SegmentLoader(ids, 3, 7, rank, world_size))
    row_len = len(ids) // (3 * world_size)
    for t, batch in enumerate(loader):
        x, y, documents = split_batch(batch)
        assert torch.equal(x, plain[t][0]) and torch.equal(y, plain[t][1])  # the stream keeps its order and rows
        for b in range(3):
            first = (rank * 3 + b) * row_len + 7 * t
            flat = range(first, first + x.size(1) + 1)
            slow = [i - max(s for s in doc_starts if s <= i) for i in flat]
            assert documents.pos[b].tolist() == slow[:-1] and documents.target_pos[b].tolist() == slow[1:]
        assert documents.latest_start == int((torch.arange(x.size(1)) - documents.pos).max())
    # Exact resume: the restored loader yields the same documents.
    loader = SegmentLoader(ids, 3, 7, rank, world_size, doc_starts=doc_starts)
    it = iter(loader)
    next(it), next(it)
    resumed = SegmentLoader(ids, 3, 7, rank, world_size, doc_starts=doc_starts)
    resumed.load_state_dict(loader.state_dict())
    a, b = next(it)[2], next(iter(resumed))[2]
    assert torch.equal(a.pos, b.pos) and a.latest_start == b.latest_start


def write(path, text: str):
    path.write_bytes(text.encode("utf-8"))
    return path


def test_stdlib_files_are_documents(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    for i in range(60):
        write(tmp_path / "lib" / f"m{i:02d}.py", f"x = {i}\n" * (i + 1))
    monkeypatch.setattr(sources, "stdlib_dir", lambda: tmp_path / "lib")
    cache = open_cache(sources.StdlibSource(), make_tokenizer("byte"), tmp_path / "cache")
    for split in sources.SPLITS:
        texts = list(sources.StdlibSource().texts(split))
        expected = np.cumsum([0] + [len(t.encode()) for t in texts[:-1]])
        assert cache.docs[split].tolist() == expected.tolist()
        assert cache.meta["splits"][split]["documents"] == len(texts)


def test_a_list_of_files_is_one_document_each_and_empty_ones_are_skipped(tmp_path, caplog):
    files = [write(tmp_path / "a.txt", "alpha\n"), write(tmp_path / "e.txt", ""), write(tmp_path / "b.txt", "beta\n")]
    val, test = write(tmp_path / "v.txt", "val\n"), write(tmp_path / "t.txt", "test\n")
    dm = SegmentDataModule.from_files([str(f) for f in files], str(val), str(test), cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="xl.data.cache"):
        cache = dm.cache
    assert bytes(cache.splits["train"]) == b"alpha\nbeta\n" and cache.docs["train"].tolist() == [0, 6]
    assert cache.meta["splits"]["train"]["empty_documents"] == 1
    assert sum("1 document(s)" in r.message and "skipped" in r.message for r in caplog.records) == 1
    with pytest.raises(DataError, match="data.train files are all empty"):
        SegmentDataModule.from_files([str(files[1])] * 2, str(val), str(test), cache_dir=tmp_path / "c2").prepare_data()


TEXT = "head\n<doc>\none\ntwo\n<doc>\r\nthree\n= Title =\nfour\n<doc>x\n"


@pytest.mark.parametrize("doc_sep,regex,begins", [
    ("<doc>", False, ["<doc>\none", "<doc>\r\nthree"]),
    ("= .* =", True, ["= Title ="]),
    ("<doc>.*", True, ["<doc>\none", "<doc>\r\nthree", "<doc>x"]),
])
def test_doc_sep_begins_documents_at_matching_lines_and_keeps_the_text(tmp_path, doc_sep, regex, begins):
    paths = [write(tmp_path / f"{s}.txt", TEXT) for s in sources.SPLITS]
    plain = SegmentDataModule.from_files(*map(str, paths), cache_dir=tmp_path / "cache")
    cut = SegmentDataModule.from_files(*map(str, paths), cache_dir=tmp_path / "cache", doc_sep=doc_sep,
                                       doc_sep_regex=regex)
    assert cut.cache.folder != plain.cache.folder  # the rule is part of the cache key
    assert bytes(cut.cache.splits["train"]) == TEXT.encode()  # the stream is unchanged
    offsets = [0] + [TEXT.index(b) for b in begins]
    assert cut.cache.docs["train"].tolist() == offsets and plain.cache.docs["train"].tolist() == [0]


def test_a_separator_that_never_occurs_is_logged_once_per_split(tmp_path, caplog):
    paths = [write(tmp_path / f"{s}.txt", TEXT) for s in sources.SPLITS]
    dm = SegmentDataModule.from_files(*map(str, paths), cache_dir=tmp_path / "cache", doc_sep="<nowhere>")
    with caplog.at_level(logging.WARNING, logger="xl.data.sources"):
        docs = dm.cache.docs
    assert docs["train"].tolist() == [0]
    notes = [r.message for r in caplog.records if "matches no line" in r.message]
    assert len(notes) == 3 and all("data.doc_sep='<nowhere>'" in n for n in notes)


def test_a_regex_that_does_not_compile_is_one_sentence_naming_the_setting(tmp_path):
    paths = [write(tmp_path / f"{s}.txt", TEXT) for s in sources.SPLITS]
    with pytest.raises(DataError, match=r"data.doc_sep='\(unclosed' is not a valid regular expression"):
        SegmentDataModule.from_files(*map(str, paths), doc_sep="(unclosed", doc_sep_regex=True)
    # The same text as a literal line is fine.
    SegmentDataModule.from_files(*map(str, paths), cache_dir=tmp_path / "cache", doc_sep="(unclosed")


def test_wikitext_articles_begin_at_title_lines(monkeypatch):
    rows = [" = Valkyria Chronicles = \n", " Senjō no Valkyria . \n", " = = Gameplay = = \n", " text \n", "",
            " = Tower Building = \n", " more \n"]

    class Rows:
        def iter(self, batch_size):
            yield {"text": rows}

    source = sources.HubSource("wikitext-2")
    monkeypatch.setattr(source, "_load", lambda split: Rows())
    pieces = list(source.documents("val"))
    assert "".join(t for _, t in pieces) == "".join(source.texts("val"))
    assert [t.splitlines()[0] for begins, t in pieces if begins] == [" = Valkyria Chronicles = ",
                                                                      " = Tower Building = "]
    assert "headings" in source.identity()


# --- training, evaluation -----------------------------------------------------------------------------------------


def test_lit_passes_documents_only_under_reset_and_accepts_plain_batches(caplog):
    model_cfg = {**TINY, "mem_len": 0}
    with caplog.at_level(logging.INFO, logger="xl.training.loop.module"):
        reset = XLLitModule(model_cfg, doc_boundaries="reset")
    assert any("memory length of 0" in r.message for r in caplog.records)
    ignore = XLLitModule(model_cfg)
    ignore.load_state_dict(reset.state_dict())
    tokens, starts, _, _ = packed_rows()
    pos = positions(starts)
    batch = (tokens[:, :8], tokens[:, 1:9], Documents.from_positions(pos[:, :8], pos[:, 1:9]))
    with torch.no_grad():
        losses = {name: m.eval().segment_loss(b, "val") for name, m, b in
                  [("reset", reset, batch), ("ignore", ignore, batch), ("plain", ignore, batch[:2])]}
        expected = F.cross_entropy(reset.model(tokens[:, :8], mem_len=0, documents=batch[2]).logits.flatten(0, 1),
                                   tokens[:, 1:9].flatten())
    assert torch.equal(losses["ignore"], losses["plain"]) and not torch.equal(losses["reset"], losses["plain"])
    torch.testing.assert_close(losses["reset"], expected)
    with pytest.raises(ValueError, match="memory.doc_boundaries must be reset or ignore"):
        XLLitModule(model_cfg, doc_boundaries="always")


def test_document_stats_match_a_slow_reference():
    g = torch.Generator().manual_seed(9)
    segments = [(torch.rand(2, 5, generator=g, dtype=torch.float64), torch.rand(2, 5, generator=g) < 0.3)
                for _ in range(4)]
    stats = DocumentStats(2, torch.device("cpu"))
    before = torch.tensor([40, 0])
    pieces: list[list[list[float]]] = [[[]], [[]]]
    by_bucket: dict[int, list[float]] = {}
    for nll, starts in segments:
        pos = positions(starts, before)
        before = pos[:, -1] + 1
        stats.update(nll, pos)
        for b in range(2):
            for i in range(5):
                if pos[b, i] == 0 and pieces[b][-1]:
                    pieces[b].append([])
                pieces[b][-1].append(float(nll[b, i]))
                by_bucket.setdefault(int(np.searchsorted([32, 128, 512], int(pos[b, i]), side="right")), []).append(
                    float(nll[b, i]))
    got = summary(stats.finish())
    means = [sum(p) / len(p) for row in pieces for p in row if p]
    assert got["docs"] == len(means) and got["doc_mean"] == pytest.approx(sum(means) / len(means), abs=1e-12)
    names = ["0-31", "32-127", "128-511", "512+"]
    for k, name in enumerate(names):
        values = by_bucket.get(k)
        assert (math.isnan(got[f"pos_{name}"]) if not values
                else got[f"pos_{name}"] == pytest.approx(sum(values) / len(values), abs=1e-12))


SEP = ["data.doc_sep='.*'", "data.doc_sep_regex=true"]  # every line begins a document: boundaries in every segment


def test_resume_mid_epoch_is_exact_with_document_boundaries(tmp_path, corpus):
    from tests.integration.test_resume import STOP_AT, assert_resumed_as_unbroken, fit, resume_cfg

    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole", *SEP))
    assert whole.module.doc_boundaries == "reset" and len(whole.datamodule.cache.docs["train"]) > 1000
    fit(resume_cfg(tmp_path, corpus, "first", *SEP, f"trainer.max_steps={STOP_AT}"))
    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", *SEP,
                                           f"ckpt_path={tmp_path / 'first' / 'run'}"))
    assert_resumed_as_unbroken(whole, whole_losses, second, second_losses)


def test_evaluate_reports_per_document_figures(tmp_path, corpus, capsys):
    from tests.integration.test_evaluate import compose_eval
    from xl.evaluation import evaluate

    cfg = compose_config(*tiny_overrides(tmp_path, corpus), *SEP, "trainer.max_steps=4", "test=false")
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    common = [f"ckpt={tmp_path / 'run'}", "data=text", *(f"data.{s}={corpus[s]}" for s in ("train", "val", "test")),
              f"data.cache_dir={tmp_path / 'cache'}", "data.batch_size=4", "data.tgt_len=16", *SEP,
              f"paths.output_dir={tmp_path / 'eval'}", "+trainer.enable_progress_bar=false",
              "+trainer.enable_model_summary=false", "trainer.limit_val_batches=6", "splits=[val]"]
    results = evaluate(compose_eval(*common, "per_document=true"))["val"]
    plain = evaluate(compose_eval(*common))["val"]
    assert results["val/loss"] == pytest.approx(plain["val/loss"], abs=1e-5)  # the same figure, token-weighted
    assert results["val/docs"] >= 4 and math.isfinite(results["val/doc_mean_bpb"])
    assert math.isfinite(results["val/pos_0-31_bpb"]) and math.isfinite(results["val/pos_32-127_bpb"])
    ignore = evaluate(compose_eval(*common, "memory.doc_boundaries=ignore"))["val"]
    assert ignore["val/loss"] != plain["val/loss"]  # the checkpoint's reset was used, and can be overridden


def test_the_per_document_table_says_what_docs_counts_and_marks_positions_nothing_was_scored_at():
    """A one-file split read as 4 streams with a warm-up: "docs 4" and nan columns, unexplained."""
    from xl.training.eval_results import format_table

    names = bucket_names()
    figures = {"val/loss": 1.0, "val/bpb": 1.5, "val/tokens": 640.0, "val/tok_s": 100.0, "val/docs": 4.0,
               "val/doc_mean_bpb": 1.5, **{f"val/pos_{n}_bpb": math.nan for n in names[:2]},
               **{f"val/pos_{n}_bpb": 1.4 for n in names[2:]}}
    table = format_table({"val": figures}, "bpb")
    assert "nan" not in table
    row = next(line for line in table.splitlines() if line.startswith("  val ") and "1.4000" in line)
    assert row.split()[3:5] == ["-", "-"], row
    assert "docs: document pieces; the split is cut into one stretch per stream" in table
    assert "-: no token scored at those positions (warm-up segments are not scored)" in table
    figures.update({f"val/pos_{n}_bpb": 1.4 for n in names})
    assert "no token scored" not in format_table({"val": figures}, "bpb")


def test_training_with_boundaries_never_waits_for_the_device(tmp_path, corpus):
    """The per-row mask is decided on the host (Documents.latest_start): no device read in a training step."""
    from tests.unit.training.test_lit import HostSyncWatch

    cfg = compose_config(*tiny_overrides(tmp_path, corpus), *SEP, "trainer.max_steps=4", "test=false",
                         "trainer.log_every_n_steps=50", "trainer.val_check_interval=50",
                         "trainer.num_sanity_val_steps=0")
    run = build_run(cfg)
    calls = []
    real = xl.model.memory.document_mask
    xl.model.memory.document_mask = lambda *a: calls.append(1) or real(*a)
    watch = HostSyncWatch()
    run.trainer.callbacks.insert(0, watch)
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule)
    finally:
        xl.model.memory.document_mask = real
    assert run.trainer.global_step == 4 and len(calls) == 4  # every step builds one per-row mask for its layers
    assert watch.reads == [], f"host reads of device values during training steps: {watch.reads}"


def test_vanilla_windows_stop_at_document_starts():
    """The vanilla baseline under reset: one forward per token over its window equals one long segment read with
    the same documents (the window covers the whole prefix)."""
    from xl.evaluation import vanilla_nll

    model = make_model(mem_len=0)
    tokens, starts, _, _ = packed_rows()
    pos = positions(starts)
    context, x, y = tokens[:, :6], tokens[:, 6:12], tokens[:, 7:13]
    with torch.no_grad():
        got = vanilla_nll(model, context, x, y, 64, -1, pos[:, :12])
        full = model(tokens[:, :12], mem_len=0, documents=Documents.from_positions(pos[:, :12])).logits[:, 6:]
        plain = vanilla_nll(model, context, x, y, 64, -1)
    torch.testing.assert_close(got, F.cross_entropy(full.flatten(0, 1), y.flatten(), reduction="sum").float())
    assert not torch.equal(got, plain)


@pytest.mark.parametrize("spans", [(), ((3, 2),), ((2, 4), (3, 2)), ((1, 5), (2, 1), (2, 3))])
def test_key_offsets_of_keys_that_stand_for_several_positions_match_a_slow_reference(spans):
    """Each key's offset is where the oldest position it stands for lies, counted back from the segment: the keys
    written out one by one, newest first, each taking its own width of positions."""
    from xl.model.documents import key_offsets

    singles, q_len = 4, 3
    widths = [width for keys, width in spans for _ in range(keys)] + [1] * singles  # oldest key first
    expected, begin = [], 0
    for width in reversed(widths):
        begin += width
        expected.insert(0, -begin)
    expected += list(range(q_len))
    got = key_offsets(len(widths), q_len, torch.device("cpu"), spans)
    assert got.tolist() == expected
