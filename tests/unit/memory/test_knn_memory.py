"""``memory=knn`` in the model, against a float64 reference written here: every layer's full history of inputs kept by
hand, each query's local attention computed key by key, and in a retrieval layer each query's top-k found by sorting
every key of its document that has left the window (the newest ``knn_size`` of them), attended with the gate."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.reference import position_embedding
from xl.memory.knn import store
from xl.memory.knn.attention import RetrievalGate
from xl.memory.knn.memory import KnnConfig, KnnMemory
from xl.model.config import XLConfig
from xl.model.documents import Documents, positions
from xl.model.transformer import TransformerXL

SEG, T, VOCAB = 4, 24, 32


def knn_model(mem_len: int = 3, knn_layers=(0, 1), size: int = 5, top_k: int = 3, seed: int = 0,
              recency: bool = False, age: bool = False) -> TransformerXL:
    torch.manual_seed(seed)
    cfg = XLConfig(n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32, vocab_size=VOCAB, mem_len=mem_len,
                   dropout=0.0, memory=KnnConfig(knn_layers=None if knn_layers is None else list(knn_layers),
                                                 knn_size=size, knn_top_k=top_k, knn_recency=recency,
                                                 knn_age=age))
    model = TransformerXL(cfg).double()
    with torch.no_grad():  # gates, scales and recency biases away from their initial values, different per head
        for gate in model.retrieval:
            gate.gate.copy_(torch.randn(cfg.n_head))
            gate.scale.copy_(torch.rand(cfg.n_head) * 4 + 1)
            if recency:
                gate.order.copy_(torch.randn(gate.order.shape) * 3)
            if age:
                gate.age.copy_(torch.randn(cfg.n_head))
    return model


def document_starts(starts: torch.Tensor | None, B: int) -> list[list[int]]:
    """Per row and position, where the position's document begins."""
    out = []
    for b in range(B):
        first, row = 0, []
        for t in range(T):
            if starts is not None and bool(starts[b, t]):
                first = t
            row.append(first)
        out.append(row)
    return out


def reference_logits(model: TransformerXL, tokens: torch.Tensor, seg_len: int, starts: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The mechanism by definition (see the module docstring), in segments of ``seg_len``; differentiable in the
    weights (the history and the retrieved entries are detached, as the memory is)."""
    cfg, memory = model.config, model.memory
    B, M, N, k = tokens.size(0), cfg.mem_len, memory.settings.knn_size, memory.settings.knn_top_k
    H, D, d = cfg.n_head, cfg.d_head, cfg.d_model
    first = document_starts(starts, B)
    history = [torch.zeros(B, 0, d, dtype=torch.float64) for _ in range(cfg.n_layer)]
    logits = []
    for s0 in range(0, tokens.size(1), seg_len):
        L = min(seg_len, tokens.size(1) - s0)
        h = model.embed(tokens[:, s0:s0 + L]) * model.emb_scale
        for n, layer in enumerate(model.layers):
            attn = layer.attn
            context = torch.cat([history[n], h], 1)  # positions 0 … s0 + L - 1, the earlier ones detached
            history[n] = context.detach()
            keys, values = attn.kv_net(context).view(B, s0 + L, 2, H, D).unbind(2)
            q = attn.q_net(h).view(B, L, H, D)
            heads = []
            for b in range(B):
                for i in range(L):
                    t = s0 + i
                    for head in range(H):
                        local_keys = range(max(first[b][t], s0 - M, 0), t + 1)
                        scores = torch.stack([
                            ((q[b, i, head] + attn.r_w_bias[head]) @ keys[b, j, head]
                             + (q[b, i, head] + attn.r_r_bias[head])
                             @ attn.r_net(position_embedding(t - j, d, torch.float64)).view(H, D)[head]) / math.sqrt(D)
                            for j in local_keys])
                        w = scores.softmax(0)
                        out = sum(w_j * values[b, j, head] for w_j, j in zip(w, local_keys, strict=True))
                        gone = s0 - M  # positions before it left the window before this segment
                        if n in memory.layers and first[b][t] < s0 and gone > first[b][t]:
                            stored = range(max(first[b][t], gone - N), gone)  # the newest N that left
                            qn = F.normalize(q[b, i, head], dim=0)
                            score = {j: qn @ F.normalize(keys[b, j, head].detach(), dim=0) for j in stored}
                            best = sorted(stored, key=lambda j: -float(score[j].detach()))[:k]
                            gate = memory.gates[memory.layers.index(n)]
                            scores = gate.scale[head] * torch.stack([score[j] for j in best])
                            if gate.order is not None:  # the rank by age: retrieved entries at later positions
                                scores = scores + torch.stack([gate.order[head, sum(o > j for o in best)]
                                                               for j in best])
                            if gate.age is not None:  # log(1 + age), age the positions that left after it
                                scores = scores + torch.stack([gate.age[head] * math.log1p(gone - 1 - j)
                                                               for j in best])
                            w = scores.softmax(0)
                            retrieved = sum(w_j * values[b, j, head].detach() for w_j, j in zip(w, best, strict=True))
                            g = torch.sigmoid(gate.gate[head])
                            out = g * retrieved + (1 - g) * out
                        heads.append(out)
            heads = torch.stack(heads).view(B, L, H * D)
            h = layer.ff(attn.layer_norm(h + attn.o_net(heads)))
        logits.append(model.head(model.final_norm(h)))
    return torch.cat(logits, 1)


def model_logits(model: TransformerXL, tokens: torch.Tensor, seg_len: int | list[int],
                 starts: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
    """The model's logits read in segments of ``seg_len`` (or of the lengths listed), and its memory after them."""
    lengths = seg_len if isinstance(seg_len, list) else [seg_len] * math.ceil(tokens.size(1) / seg_len)
    pos = None if starts is None else positions(starts)
    mems, logits, s0 = None, [], 0
    for length in lengths:
        span = slice(s0, s0 + length)
        documents = None if pos is None else Documents.from_positions(pos[:, span])
        out = model(tokens[:, span], mems, documents=documents, targets=None if targets is None else targets[:, span])
        if targets is not None:
            out.loss.backward()
        mems, s0 = out.mems, s0 + length
        logits.append(out.logits)
    return torch.cat(logits, 1), mems


def streams(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # No token twice in a row: layer 0's keys are the tokens' alone (no position), and a tie between two entries at
    # the k-th place would let the search keep either, which an order's bias tells apart.
    tokens = torch.stack([torch.randperm(VOCAB, generator=gen)[:T] for _ in range(2)])
    starts = torch.zeros(2, T, dtype=torch.bool)
    starts[:, 0] = True
    starts[1, 14] = True  # row 1: a second document begins inside a segment
    return tokens, starts


ORDERS = [(False, False), (True, False), (False, True)]  # (knn_recency, knn_age): none, the rank table, the slope


@pytest.mark.parametrize(("recency", "age"), ORDERS)
@pytest.mark.parametrize("mem_len", [3, 0])
@pytest.mark.parametrize("with_documents", [False, True])
def test_the_forward_pass_retrieves_what_the_reference_retrieves(mem_len, with_documents, recency, age):
    model = knn_model(mem_len, recency=recency, age=age).eval()
    tokens, starts = streams()
    starts = starts if with_documents else None
    with torch.no_grad():
        got, mems = model_logits(model, tokens, SEG, starts)
        expected = reference_logits(model, tokens, SEG, starts)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # The retrieval changed the logits (the test would pass vacuously if nothing was ever retrieved).
    if recency or age:  # the order changed them too
        with torch.no_grad():
            for gate in model.retrieval:
                for table in (gate.order, gate.age):
                    if table is not None:
                        table.zero_()
            assert not torch.allclose(model_logits(model, tokens, SEG, starts)[0], got)
    model.memory.settings.knn_top_k, plain = 1, got
    with torch.no_grad():
        assert not torch.allclose(model_logits(model, tokens, SEG, starts)[0], plain)
    assert store.fill(model.memory.stores(mems)[0]).tolist() == [5, 5]


def test_the_same_positions_enter_the_store_whatever_the_segment_lengths():
    model = knn_model().eval()
    tokens, starts = streams()
    with torch.no_grad():
        stores = [model.memory.stores(model_logits(model, tokens, n, starts)[1]) for n in (4, 1, 7)]
    for other in stores[1:]:
        for mine, theirs in zip(stores[0], other, strict=True):
            assert torch.equal(mine[store.COUNT], theirs[store.COUNT])
        # Layer 0's keys and values are projections of the embeddings alone: the same entries in the same slots.
        torch.testing.assert_close(other[0][store.KEYS], stores[0][0][store.KEYS], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(other[0][store.VALUES], stores[0][0][store.VALUES], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("recency", "age"), [*ORDERS, (True, True)])
def test_gradients_match_the_reference_and_none_reaches_the_store(recency, age):
    model = knn_model(recency=recency, age=age).train()  # dropout 0: the CPU training attention, with its own backward
    tokens, starts = streams()
    targets = torch.roll(tokens, -1, 1)
    _, mems = model_logits(model, tokens, SEG, starts, targets)
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert all(not t.requires_grad for t in mems)
    model.zero_grad()
    expected = reference_logits(model, tokens, SEG, starts)
    loss = sum(F.cross_entropy(expected[:, s:s + SEG].flatten(0, 1), targets[:, s:s + SEG].flatten())
               for s in range(0, T, SEG))
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-8, atol=1e-10, msg=name)
    assert got["retrieval.0.gate"].abs().min() > 0 and got["retrieval.1.scale"].abs().min() > 0
    assert not recency or got["retrieval.1.order"].abs().sum() > 0
    assert not age or got["retrieval.1.age"].abs().min() > 0


def test_a_packed_document_reads_as_alone():
    model = knn_model().eval()
    tokens, starts = streams()
    with torch.no_grad():
        packed, _ = model_logits(model, tokens, SEG, starts)
        # Alone, from an empty memory, in the segments the packed row reads it in (a Transformer-XL window depends on
        # where the segments begin).
        alone, _ = model_logits(model, tokens[1:, 14:], [2, 4, 4])
    torch.testing.assert_close(packed[1:, 14:], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("with_documents", "recency", "age"),
                         [(False, False, False), (True, False, False), (True, True, False), (True, False, True)])
def test_one_token_decoding_equals_the_forward(with_documents, recency, age):
    model = knn_model(knn_layers=None, recency=recency, age=age).eval()
    tokens, starts = streams()
    pos = positions(starts) if with_documents else None
    with torch.no_grad():
        prompt = 9  # read in segments of 4, 4 and 1, then fed one token at a time
        expected, _ = model_logits(model, tokens, [4, 4, 1] + [1] * (T - prompt), starts if with_documents else None)
        decoder = model.decoder(2)
        fed = [decoder.prefill(tokens[:, :prompt], SEG, starts[:, :prompt] if with_documents else None)]
        for t in range(prompt, T - 1):
            if with_documents:
                decoder.reset_rows(pos[:, t] == 0)
            fed.append(decoder.feed(tokens[:, t]))
    torch.testing.assert_close(torch.stack(fed, 1), expected[:, prompt - 1:T - 1], rtol=1e-9, atol=1e-10)


def test_the_layers_the_store_and_its_bytes():
    assert knn_model(knn_layers=None).memory.layers == (1,)  # ceil(3 * 2 / 4) - 1
    with pytest.raises(ValueError, match=r"memory.knn_layers=\[2\] names a layer the model lacks"):
        knn_model(knn_layers=(2,))
    memory: KnnMemory = knn_model(mem_len=3, knn_layers=(0, 1), size=5).memory
    state = memory.init(2, torch.device("cpu"), torch.float64)
    assert len(state) == 2 + 2 * 3 and state[2].shape == (2, 2, 5, 8) and state[4].dtype == torch.int64
    # Per row: the cache's 2 × 3 vectors, the stores' 2 layers × keys and values × 2 heads × 5 × 8 values (in
    # vectors of 16, rounded up); with a segment of 4, its scores (2 heads × 4 × 5) and each layer's retrieved keys
    # and values (2 layers × 2 × 2 heads × 4 positions × top-k 3 × 8).
    assert memory.size(3).vectors == 6 + 2 * 2 * 2 * 5 * 8 // 16
    assert memory.size(3, 4).vectors == 6 + math.ceil((2 * 2 * 2 * 5 * 8 + 2 * 4 * 5 + 2 * 2 * 2 * 4 * 3 * 8) / 16)
    assert memory.size(3).keys == 3


def test_one_sentence_refusals():
    with pytest.raises(ValueError, match="set memory.grad_segments=1 with memory=knn"):
        KnnConfig().check_window(2, 128)
    with pytest.raises(ValueError, match="memory.same_length=false"):
        KnnConfig().check_context(True)
    with pytest.raises(ValueError, match="memory.knn_top_k=8 exceeds memory.knn_size=4"):
        KnnConfig(knn_size=4, knn_top_k=8)
    with pytest.raises(ValueError, match="memory.knn_layers must be"):
        KnnConfig(knn_layers=[1, 1])
    with pytest.raises(ValueError, match="memory.knn_search must be"):
        KnnConfig(knn_search="annoy")


# ---- through the entry points -----------------------------------------------------------------------------------
KNN_RUN = ("memory=knn", "memory.knn_size=64", "memory.knn_top_k=4")


@pytest.mark.parametrize(("recency", "age"), ORDERS)
def test_a_run_trains_evaluates_and_is_sized_with_its_stores(tmp_path, corpus, recency, age):
    from tests.conftest import compose_config, tiny_overrides
    from xl.config.machine import run_estimate
    from xl.training.build import build_run

    cfg = compose_config(*tiny_overrides(tmp_path, corpus), *KNN_RUN, "trainer.max_steps=4",
                         "trainer.val_check_interval=4", f"memory.knn_recency={str(recency).lower()}",
                         f"memory.knn_age={str(age).lower()}")
    run = build_run(cfg)
    assert isinstance(run.module.model.memory, KnnMemory) and run.module.model.memory.layers == (1,)  # tiny: 2 layers
    gate = run.module.model.retrieval[0]
    before = [p.detach().clone() for p in gate.parameters()]
    assert (gate.order is not None) == recency and (gate.age is not None) == age
    run.trainer.fit(run.module, datamodule=run.datamodule)
    for old, new in zip(before, gate.parameters(), strict=True):  # the gate, the scale and the order's bias train
        assert not torch.equal(old, new)
    assert math.isfinite(float(run.trainer.callback_metrics["val/loss"]))
    *cache, keys, values, count = run.module.memory.mems["train"]
    assert count.dtype == torch.int64 and int(count.min()) > 0 and not keys.requires_grad
    model = run.module.model.config
    footprint, _ = run_estimate(cfg)
    # The cache, the store (keys and values of 64 entries per head), the exact search's scores and the retrieved keys
    # and values (top-k 4) of a segment of 16, per row.
    per_row = model.n_layer * 16 + math.ceil((2 * model.n_head * 64 * model.d_head + model.n_head * 16 * 64
                                              + 2 * model.n_head * 16 * 4 * model.d_head) / model.d_model)
    assert footprint.train_memory == per_row * model.d_model * 4 * 4  # × batch 4 × float32


def test_resume_is_exact_with_the_stores_in_the_checkpoint(tmp_path, corpus):
    from tests.integration.test_resume import STOP_AT, assert_resumed_as_unbroken, fit, resume_cfg
    from xl.training.checkpoints.checkpoint import Checkpoint

    whole, whole_losses = fit(resume_cfg(tmp_path, corpus, "whole", *KNN_RUN))
    first, _ = fit(resume_cfg(tmp_path, corpus, "first", *KNN_RUN, f"trainer.max_steps={STOP_AT}"))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    packed = Checkpoint.open(ckpt).train_memory
    assert packed[-1].dtype == torch.int64 and int(packed[-1].min()) > 0  # the stores' counts, filled
    second, second_losses = fit(resume_cfg(tmp_path, corpus, "second", *KNN_RUN, f"ckpt_path={ckpt}"))
    assert_resumed_as_unbroken(whole, whole_losses, second, second_losses)


def test_the_settings_compose_from_the_command_line(tmp_path, corpus):
    from tests.conftest import compose_config, tiny_overrides
    from xl.config.rules import ConfigError
    from xl.model.memory_settings import variant
    from xl.training.build import build_run

    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory=knn", "memory.knn_layers=[0,1]",
                         "memory.mem_len=0")
    config = variant(cfg.memory, cfg)
    assert isinstance(config, KnnConfig) and config.knn_layers == [0, 1] and config.knn_size == 65536
    assert config.knn_recency is False
    cfg = compose_config(*tiny_overrides(tmp_path, corpus), "memory=knn", "memory.knn_recency=true")
    assert variant(cfg.memory, cfg).knn_recency is True
    assert config.to_dict()["_target_"] == "xl.memory.knn.memory.KnnConfig"
    for bad, says in (("memory.knn_layers=[1,1]", "memory.knn_layers must be"),
                      ("memory.grad_segments=2", "memory.grad_segments=1 with memory=knn"),
                      ("memory.knn_size=0", "memory.knn_size must be")):
        with pytest.raises(ConfigError, match=says):
            build_run(compose_config(*tiny_overrides(tmp_path, corpus), "memory=knn", bad))


def test_evaluation_in_inference_mode_then_training_share_the_search_buffer():
    """Lightning evaluates under torch.inference_mode: a search buffer grown there still serves training after."""
    model = knn_model()
    tokens, _ = streams()
    wide = torch.cat([tokens, tokens], 0)
    with torch.inference_mode():
        model_logits(model.eval(), wide, SEG)  # 4 rows: a larger buffer than training's 2
    model_logits(model.train(), tokens, SEG, targets=torch.roll(tokens, -1, 1))
    assert model.retrieval[0].gate.grad is not None


def test_a_step_under_bfloat16_autocast():
    model = knn_model().float().train()
    tokens, _ = streams()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, mems = model_logits(model, tokens, SEG, targets=torch.roll(tokens, -1, 1))
    assert mems[2].dtype == torch.float32 and all(torch.isfinite(p.grad).all() for p in model.retrieval.parameters())


def test_a_segment_with_empty_stores_keeps_the_gates_in_the_graph(monkeypatch):
    """No query retrieves in the first segment (the stores are empty), so the layer is the plain one; the gates and
    scales still take part, with zero gradients, as distributed training (DDP) requires of every parameter."""
    model = knn_model().train()
    tokens, _ = streams()
    targets = torch.roll(tokens, -1, 1)[:, :SEG]
    out = model(tokens[:, :SEG], None, targets=targets)
    out.loss.backward()
    for p in model.retrieval.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    monkeypatch.setattr(RetrievalGate, "untouched", lambda self, local: local)  # the local heads as they are
    assert torch.equal(model(tokens[:, :SEG], None, targets=targets).logits, out.logits)
