"""The footprint estimate: the cache formula is exact, the evaluation keys/values and the weights are counted
from real tensors, and the activation estimate bounds what autograd really saves for one training step."""

import pytest
import torch

from tests.helpers.memories import xl_config
from xl.device.footprint import (
    GiB,
    RunFootprint,
    activation_elements,
    available_memory,
    cache_footprint,
    describe_run,
    run_footprint,
)
from xl.footprint import main
from xl.memory.store import nbytes
from xl.memory.tokens import TokensConfig
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL, count_parameters

TABLE = [
    ((512, 768, 12, 8), 37_748_736, 144.0, 0.14),
    ((512, 1024, 24, 8), 100_663_296, 384.0, 0.38),
    ((1024, 1024, 24, 8), 201_326_592, 768.0, 0.75),
    ((2048, 2048, 36, 4), 603_979_776, 2304.0, 2.25),
]
TINY = dict(n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, dropout=0.0)


@pytest.mark.parametrize("config,floats,mib,gib", TABLE)
def test_cache_table(config, floats, mib, gib):
    fp = cache_footprint(*config)
    assert fp.elements == floats
    assert fp.bytes == floats * 4
    assert fp.mib == mib
    assert round(fp.gib, 2) == gib
    assert cache_footprint(*config, dtype=torch.bfloat16).mib == mib / 2


def test_command_prints_table_and_params(capsys):
    main([])
    assert "144.0" in capsys.readouterr().out
    main(["--mem-len", "128", "--d-model", "256", "--n-layer", "4", "--batch", "8",
          "--n-head", "4", "--d-head", "64", "--d-inner", "1024", "--vocab", "256"])
    out = capsys.readouterr().out
    assert "3,484,672" in out
    fp32, bf16 = [line for line in out.splitlines() if line.startswith("128m")]
    assert "float32" in fp32 and " 4.0 " in fp32 and "bfloat16" in bf16 and " 2.0 " in bf16


@pytest.mark.parametrize("mem_dtype,precision", [("float32", "32-true"), ("bfloat16", "32-true"),
                                                 ("float32", "bf16-true")])
def test_memories_and_keys_values_are_what_the_model_holds(mem_dtype, precision):
    """The training and evaluation parts equal the bytes of the memories and keys/values real forwards return."""
    config = XLConfig(vocab_size=50, mem_len=6, mem_dtype=mem_dtype, **TINY)
    model = TransformerXL(config).eval()
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    B, eval_mem_len = 3, 9
    x = torch.randint(0, 50, (B, 5))
    with torch.no_grad():
        train = model(x, model(x).mems)  # the training context, memory full
        out = model(x, mem_len=eval_mem_len, cache_kv=True)
        out = model(x, out.mems, mem_len=eval_mem_len, cache_kv=True, kv=out.kv)
    assert train.mems[0].size(1) == config.mem_len and out.mems[0].size(1) == eval_mem_len
    keys_values = sum(t.numel() * t.element_size() for pair in out.kv for t in pair)
    estimate = run_footprint(config, batch_size=B, tgt_len=5, eval_batch_size=B, eval_mem_len=eval_mem_len,
                             precision=precision)
    assert estimate.train_memory == nbytes(train.mems)
    assert estimate.eval_memory == nbytes(out.mems) + keys_values


def test_compressed_slots_are_counted_in_the_cache_and_the_command(capsys):
    """(mem_len + cmem_len) × d_model × n_layer × batch × bytes: what a full compressive memory holds."""
    config = xl_config(vocab_size=50, mem_len=6, cmem_len=4, cmem_rate=2, **TINY)
    model = TransformerXL(config).eval()
    B, eval_mem_len = 3, 8
    x = torch.randint(0, 50, (B, 4))
    with torch.no_grad():
        train = eval_ = None
        for _ in range(6):  # enough segments to fill both memories, in both contexts
            train = model(x, None if train is None else train.mems)
            eval_ = model(x, None if eval_ is None else eval_.mems, mem_len=eval_mem_len, cache_kv=True,
                          kv=None if eval_ is None else eval_.kv)
    n = config.n_layer  # the state: each layer's compressed slots, then each layer's states
    assert [m.size(1) for m in train.mems] == [4] * n + [6] * n
    assert [m.size(1) for m in eval_.mems] == [4] * n + [eval_mem_len] * n
    keys_values = sum(t.numel() * t.element_size() for pair in eval_.kv for t in pair)
    estimate = run_footprint(config, batch_size=B, tgt_len=4, eval_batch_size=B, eval_mem_len=eval_mem_len)
    assert estimate.train_memory == nbytes(train.mems) == (6 + 4) * config.d_model * config.n_layer * B * 4
    assert estimate.eval_memory == nbytes(eval_.mems) + keys_values
    main(["--mem-len", "768", "--slots", "768", "--d-model", "1024", "--n-layer", "24", "--dtype", "float32"])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("768m+768s")]
    assert "37,748,736" in row and " 144.0 " in row


def test_parameters_count_weights_gradients_and_both_adamw_moments():
    config = XLConfig(vocab_size=50, **TINY)
    model = TransformerXL(config)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 50, (2, 4)), targets=torch.randint(0, 50, (2, 4))).loss.backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    fp = run_footprint(config, batch_size=2, tgt_len=4, eval_batch_size=2, eval_mem_len=0)
    assert fp.parameters == weights + grads + state == 16 * count_parameters(config)
    bf16 = run_footprint(config, batch_size=2, tgt_len=4, eval_batch_size=2, eval_mem_len=0, precision="bf16-true")
    assert bf16.parameters == fp.parameters // 2


def saved_bytes(config: XLConfig, batch: int, tgt_len: int, mem_len: int) -> int:
    """Bytes autograd keeps for the backward pass of one training step (distinct storages, weights excluded)."""
    torch.manual_seed(0)
    model = TransformerXL(config).train()
    x = torch.randint(0, config.vocab_size, (batch, tgt_len))
    mems = [torch.randn(batch, mem_len, config.d_model) for _ in range(config.n_layer)]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, mems, targets=x, return_logits=False, mem_len=mem_len)
    return sum(storages.values())


@pytest.mark.parametrize("shape,batch,tgt_len,mem_len", [
    (TINY, 4, 16, 16),
    (dict(n_layer=4, n_head=4, d_model=256, d_head=64, d_inner=1024, dropout=0.1), 16, 32, 128),  # the main job
    (dict(n_layer=3, n_head=4, d_model=64, d_head=16, d_inner=256, dropout=0.1, dropatt=0.1), 8, 32, 32),
    (dict(n_layer=2, n_head=8, d_model=64, d_head=8, d_inner=256, dropout=0.1), 4, 64, 0),
    ({**TINY, "vocab_size": 3000}, 4, 16, 16),
    ({**TINY, "vocab_size": 3000, "cutoffs": (100, 1000), "div_val": 2}, 4, 16, 16),
])
def test_activation_estimate_bounds_what_autograd_saves(shape, batch, tgt_len, mem_len):
    config = XLConfig(**{"vocab_size": 256, **shape, "mem_len": mem_len})
    saved = saved_bytes(config, batch, tgt_len, mem_len)
    estimate = 4 * activation_elements(config, batch, tgt_len, mem_len)  # float32
    assert saved <= estimate <= 2.5 * saved, (saved, estimate)


WINDOW_SHAPES = {
    "cache": dict(vocab_size=256, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, dropout=0.1, mem_len=16),
    "tokens on the cache": dict(vocab_size=256, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, dropout=0.1,
                                mem_len=16, memory=TokensConfig(num_tokens=3, seg_len=8).to_dict()),
    "tokens alone": dict(vocab_size=256, n_layer=3, n_head=4, d_model=32, d_head=8, d_inner=64, dropout=0.1,
                         dropatt=0.1, mem_len=0, memory=TokensConfig(num_tokens=2, seg_len=8).to_dict()),
}


@pytest.mark.parametrize("memory", list(WINDOW_SHAPES))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_activation_estimate_bounds_the_peak_of_real_windows_of_k_segments(memory, k):
    """A Lightning fit with memory.grad_segments=k: the most bytes autograd held saved at once (a window's k segments,
    joined by the attached memory, until its backward) is at most the estimate, and the estimate at most 2.5 times
    it."""
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.unit.training.test_tbptt import SavedBytesPeak, stream_segments
    from xl.training.loop.module import XLLitModule

    shape, batch, tgt_len = WINDOW_SHAPES[memory], 4, 8
    L.seed_everything(0, verbose=False)
    peak = SavedBytesPeak()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[peak])
    trainer.fit(XLLitModule(model=shape, grad_segments=k),
                DataLoader(stream_segments(batch, tgt_len, 2 + 2 * k, 256), batch_size=None))
    estimate = 4 * activation_elements(XLConfig(**shape), batch, tgt_len, shape["mem_len"], grad_segments=k)
    assert peak.peak <= estimate <= 2.5 * peak.peak, (peak.peak, estimate)


def test_the_run_estimate_and_its_fit_check_count_the_window(capsys):
    """python -m xl.footprint --run memory=tokens memory.grad_segments=K: the activations grow with K, as the run's
    estimate (what train.py checks) does."""
    from xl.config.compose import compose
    from xl.config.machine import run_estimate

    activations = [run_estimate(compose("config", ["memory=tokens", f"memory.grad_segments={k}"]))[0].activations
                   for k in (1, 2, 8)]
    config = xl_config(vocab_size=256, n_layer=4, n_head=4, d_model=256, d_head=64, d_inner=1024, mem_len=128,
                      num_tokens=4, tokens_seg_len=32)
    one = 4 * activation_elements(config, 16, 32, 128)
    per_segment = 4 * activation_elements(config, 16, 32, 128, grad_segments=2) - one
    assert activations == [one, one + per_segment, one + 7 * per_segment]
    main(["--run", "memory=tokens", "memory.grad_segments=8"])
    (line,) = [row for row in capsys.readouterr().out.splitlines() if row.startswith("one training step")]
    assert f"{activations[2] / GiB:.3f} GiB" in line


def test_largest_part_and_description():
    fp = RunFootprint(train_memory=3 * GiB, eval_memory=GiB, parameters=2 * GiB, activations=0)
    assert fp.total == 6 * GiB and fp.largest() == "train_memory"
    text = describe_run(fp, 12 * GiB, "a test machine", processes=2)
    assert "total × 2 processes" in text and "12.000 GiB (100% used)" in text
    assert text.splitlines()[-1] == "close (above 80%); lower memory.mem_len or data.batch_size"
    assert describe_run(fp, 11 * GiB, "x", processes=2).splitlines()[-1].startswith("too big; lower memory.mem_len")
    assert describe_run(fp, 16 * GiB, "x").splitlines()[-1] == "fits"


def test_available_memory_on_cpu_is_at_most_the_machines():
    available, where = available_memory(cuda=False)
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < available <= total and "RAM" in where


def test_run_command_itemises_the_main_job(capsys):
    main(["--run", "model=tiny", "memory.mem_len=64", "data.batch_size=4"])
    out = capsys.readouterr().out
    config = XLConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, mem_len=64)
    cache = cache_footprint(64, 32, 2, 4).bytes
    assert f"{cache / GiB:.3f} GiB" in out.splitlines()[0] and out.splitlines()[0].startswith("training memory")
    fp = run_footprint(config, batch_size=4, tgt_len=32, eval_batch_size=4, eval_mem_len=64)
    assert f"{fp.total / GiB:.3f} GiB" in out and "available" in out and out.splitlines()[-1] == "fits"
