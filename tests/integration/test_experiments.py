"""The paper's experiments as configs: they compose, and our parameter counts match the paper's."""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, compose_config
from tests.helpers.paths import ROOT
from xl.config.rules import check_config, model_values
from xl.model.config import XLConfig
from xl.model.transformer import count_parameters

WT103_VOCAB = 267_735  # words of the WikiText-103 training split, with <eos> (Dai et al., 2019)
# (experiment, vocabulary of its tokenizer, parameters reported by Dai et al., 2019)
PAPER = [("enwik8_base", 256, 41e6), ("enwik8_large", 256, 277e6), ("text8_large", 28, 277e6),
         ("wt103_base", WT103_VOCAB, 151e6)]


def test_every_experiment_is_listed():
    listed = {name for name, *_ in PAPER} | {"wt103_large", "enwik8_compressive", "wt103_published", "babilong",
                                               "babilong_curriculum", "babilong_facts", "babilong_bytes",
                                               "babilong_long", "babilong_gpu"}
    assert {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")} == listed


@pytest.mark.parametrize("name,vocab,paper", PAPER)
def test_experiment_composes_and_matches_the_papers_size(name, vocab, paper):
    cfg = compose_config(f"experiment={name}")
    config = XLConfig.from_dict(model_values(cfg, vocab))  # validates every field
    params = count_parameters(config)  # on the meta device: nothing allocated
    assert abs(params - paper) / paper < 0.03, f"{name}: {params:,} parameters vs the paper's {paper:,.0f}"
    assert cfg.memory.eval_mem_len > cfg.memory.mem_len and cfg.memory.eval_same_length
    check_config(cfg)  # every range and relation holds



def test_the_papers_table_shows_these_counts():
    """docs/paper.md's "parameters (ours)" column is the count of each experiment's config, in millions."""
    vocab = {name: v for name, v, _ in PAPER} | {"wt103_large": WT103_VOCAB}
    rows = [line.split("|")[1:-1] for line in (ROOT / "docs" / "paper.md").read_text().splitlines()
            if line.startswith("| ") and "`" in line]
    shown = {cells[1].strip().strip("`"): cells[3].strip() for cells in rows}
    configs = {name: XLConfig.from_dict(model_values(compose_config(f"experiment={name}"), v))
               for name, v in vocab.items()}
    assert shown == {name: f"{count_parameters(c) / 1e6:.1f}M" for name, c in configs.items()}


def closed_form_parameters(c: XLConfig) -> int:
    """Parameters of a tied adaptive-softmax model, counted from the architecture by hand (not from modules)."""
    d, inner = c.d_model, c.n_head * c.d_head
    attention = 4 * d * inner + inner * d + 2 * inner + 2 * d  # q, k, v, r; o; u and v; layer norm
    feed_forward = d * c.d_inner + c.d_inner + c.d_inner * d + d + 2 * d
    bounds = [0, *c.cutoffs, c.vocab_size]
    widths = [d // c.div_val**i for i in range(len(bounds) - 1)]
    embedding = sum((hi - lo) * w + (w * d if w != d else 0)
                    for lo, hi, w in zip(bounds, bounds[1:], widths, strict=False))
    softmax = c.vocab_size + len(c.cutoffs) * (widths[0] + 1)  # word biases; the tail clusters' head entries
    return c.n_layer * (attention + feed_forward) + embedding + softmax


def test_wt103_large_has_the_size_its_published_hyperparameters_give():
    """The paper reports 257M, but its released hyperparameters (18 × 1024, d_inner 4096, div_val 4) give 283M."""
    cfg = compose_config("experiment=wt103_large")
    config = XLConfig.from_dict(model_values(cfg, WT103_VOCAB))
    params = count_parameters(config)
    assert params == closed_form_parameters(config) == 283_108_170
    assert params / 257e6 - 1 == pytest.approx(0.10, abs=0.005)  # the gap the README documents
    base = XLConfig.from_dict(model_values(compose_config("experiment=wt103_base"), WT103_VOCAB))
    assert count_parameters(base) == closed_form_parameters(base)


def test_enwik8_compressive_is_enwik8_large_with_the_papers_memories():
    """Rae et al. (2019) report 277M parameters for enwik8: the main network's size; the learned compressor adds one
    [d, d, rate] convolution and a bias per layer."""
    cfg = compose_config("experiment=enwik8_compressive")
    check_config(cfg)
    config = XLConfig.from_dict(model_values(cfg, 256))
    memory = config.memory
    assert (config.mem_len, memory.cmem_len, memory.cmem_rate, memory.cmem_fn, cfg.data.tgt_len) == (
        768, 768, 3, "conv", 768)
    plain = XLConfig.from_dict(model_values(compose_config("experiment=enwik8_large"), 256))
    main = count_parameters(plain)
    assert abs(main - 277e6) / 277e6 < 0.03
    compressor = config.n_layer * (config.memory.cmem_rate * config.d_model**2 + config.d_model)
    assert count_parameters(config) == main + compressor == main + 75_522_048



@pytest.mark.parametrize(("memory", "target", "mem_len"), [
    (None, "xl.memory.cache.CacheConfig", 192),
    ("none", "xl.memory.cache.CacheConfig", 0),
    ("tokens", "xl.memory.tokens.TokensConfig", 128),
])
def test_a_memory_chosen_beside_the_babilong_experiment_replaces_its_memory_whole(memory, target, mem_len):
    """experiment=babilong_bytes memory=none trained with the experiment's 192 positions of memory: the experiment's
    memory is a memory option now, which a memory on the command line replaces, in whichever order they come."""
    from xl.config.compose import compose

    chosen = [f"memory={memory}"] if memory else []
    for overrides in (["experiment=babilong_bytes", *chosen], [*chosen, "experiment=babilong_bytes"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of the memory is kept over the choice
            cfg = compose("config", overrides)
        assert (cfg.memory._target_, cfg.memory.mem_len) == (target, mem_len)


def test_an_experiment_that_sets_memory_values_says_which_it_keeps_over_a_chosen_memory():
    from xl.config.compose import compose

    with pytest.warns(UserWarning, match=r"^experiment=enwik8_base sets memory.doc_boundaries=ignore, "
                                         r"memory.mem_len=512, memory.eval_mem_len=2100, .* over memory=none's own "
                                         r"values; set them on the command line to change them$"):
        cfg = compose("config", ["experiment=enwik8_base", "memory=none"])
    assert cfg.memory.mem_len == 512
    with pytest.warns(UserWarning) as record:
        compose("config", ["experiment=enwik8_base", "memory=none", "memory.mem_len=0"])
    assert "memory.mem_len" not in str(record[0].message), "a value set on the command line is not named"


BIND = ("experiment=babilong_facts", "model.d_model=64", "model.d_head=16", "model.d_inner=256",
        "data.batch_size=16", "data.tgt_len=128", "trainer.gradient_clip_val=1.0", "trainer.max_steps=10000")
ONE_STAGE = ("curriculum=[{length:0,train_most_questions:1,steps:6000},{length:0}]", "trainer.limit_train_batches=1000",
             "trainer.val_check_interval=1000")
STAGES = ("curriculum=[{length:0,train_most_questions:1,val_most_questions:1,steps:5000,below:0.05},"
          "{length:0,train_most_questions:2,val_most_questions:2,steps:2000,below:0.05},"
          "{length:0,train_most_questions:3,val_most_questions:3,steps:2000,below:0.05},{length:0}]",
          "trainer.limit_train_batches=500", "trainer.val_check_interval=500")


@pytest.mark.parametrize("shown,measured", [
    ((), (*BIND, "model.init_std=0.1", "data.train_questions=end", *STAGES)),
    (("data.train_questions=every",), (*BIND, "model.init_std=0.1", *STAGES)),
    (("model.init_std=0.07", "data.train_questions=every", *ONE_STAGE), (*BIND, "model.init_std=0.07", *ONE_STAGE)),
    (("data.train_questions=every", *ONE_STAGE), (*BIND, "model.init_std=0.1", *ONE_STAGE)),
])
def test_babilong_and_its_variants_are_the_measured_commands(shown, measured):
    """experiment=babilong, and with the overrides docs/babilong.md shows for each earlier recipe, composes to the
    config of the command whose runs that page reports (experiment=babilong_facts with explicit settings)."""
    assert OmegaConf.to_container(compose_config("experiment=babilong", *shown)) == OmegaConf.to_container(
        compose_config(*measured))


def test_babilong_long_is_the_measured_command_of_the_study():
    """experiment=babilong_long with a start and a memory composes to the command the study's runs used."""
    start = ("init_from=runs/start", "data.tokenizer_file=runs/start/vocab.json", "memory=knn",
             "memory.knn_size=16384", "memory.mem_len=192", "seed=2")
    measured = ("experiment=babilong", *start, "data.tokenizer_kwargs=null", "data.train_questions=end",
                "curriculum=[{length:256,steps:1000},{length:512,steps:1000},{length:1k}]", "trainer.max_steps=3000")
    assert OmegaConf.to_container(compose_config("experiment=babilong_long", *start)) == OmegaConf.to_container(
        compose_config(*measured))


def test_the_study_memories_compose_with_babilong_long_as_the_page_lists_them():
    """docs/babilong.md's table of the study's memories: each row's overrides beside experiment=babilong_long compose,
    pass the config rules, and select the row's memory with the numbers the row says it holds."""
    from xl.config.rules import check_config

    page = (CONF_DIR.parent / "docs" / "babilong.md").read_text()
    table = page.split("The memories, each with the overrides of its runs:")[1].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[3:]]
    kinds = {"none": "CacheConfig", "cache": "CacheConfig", "compressive": "CompressiveConfig",
             "memory tokens": "TokensConfig", "retrieval": "KnnConfig", "retrieval+recency": "KnnConfig",
             "2-layer-retrieval+recency": "KnnConfig", "2-layer-retrieval+age": "KnnConfig"}
    assert [r[0] for r in rows] == list(kinds)
    for name, overrides, holds in rows:
        cfg = compose_config("experiment=babilong_long", "init_from=runs/start",
                             "data.tokenizer_file=runs/start/vocab.json", *overrides.strip("`").split())
        check_config(cfg, shape=False)
        assert cfg.memory._target_.endswith(kinds[name]) and (cfg.memory.mem_len == 0) == (name == "none"), name
        assert cfg.memory.get("knn_recency", False) == name.endswith("+recency"), name
        assert cfg.memory.get("knn_age", False) == name.endswith("+age"), name
        assert (list(cfg.memory.get("knn_layers") or []) == [1, 2]) == name.startswith("2-layer"), name
        for key in ("mem_len", "cmem_len", "knn_size", "num_tokens"):
            if cfg.memory.get(key):
                assert f"{cfg.memory[key]:,}" in holds, (name, key)


def test_babilong_gpu_scales_the_study_for_one_gpu_and_its_first_steps_train(tmp_path):
    """experiment=babilong_gpu (docs/babilong.md, "On one GPU"): the recipe's stages at length 0, then 1K to 64K
    of PG-19 with the retrieval memory in two layers and its bias by log age, a wider model; its config passes every
    rule, and its first steps train through a real Trainer at a tiny size (the embedded corpus for PG-19, which needs
    the hub)."""
    from xl.config.curriculum import stages
    from xl.training.build import build_run

    cfg = compose_config("experiment=babilong_gpu")
    check_config(cfg, shape=False)
    assert cfg.data.background._target_.endswith("PG19Source") and cfg.memory.knn_age is True
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.data.tasks) == (6, 256, ["qa1", "qa2"])
    assert [s.data["length"] for s in stages(cfg.curriculum)][-4:] == ["1k", "4k", "16k", "64k"]
    assert (cfg.data.batch_size, cfg.data.tgt_len, cfg.trainer.max_steps, cfg.model.init_std) == (32, 256, 40000, 0.05)
    assert (cfg.memory.mem_len, cfg.memory.knn_size, cfg.data.tokenizer_kwargs.max_size) == (256, 131072, 16000)
    assert list(cfg.memory.knn_layers) == [3, 4]  # two retrieval layers, as the CPU study's best
    # docs/babilong.md's table of it says what the config holds
    page = (CONF_DIR.parent / "docs" / "babilong.md").read_text()
    table = page.split("| | the CPU study | `experiment=babilong_gpu` |")[1].split("\n\n")[0]
    for says in ("6 layers of 256, 4 heads of 64", "32 × 256", "1K, 4K, 16K and 64K, 40,000 steps", "16,000",
                 "a cache of 256, a store of 131,072 entries in layers 3 and 4, bias by log age",
                 "0, 1K, 4K, 16K, 64K, 128K"):
        assert says in table, says
    tiny = compose_config("experiment=babilong_gpu", "data/background=stdlib", "model.n_layer=2", "model.d_model=32",
                          "model.n_head=2", "model.d_head=16", "model.d_inner=64", "memory.mem_len=16",
                          "memory.knn_size=256", "memory.knn_layers=[0,1]", "data.batch_size=2", "data.tgt_len=16",
                          "data.eval_samples=4",
                          "trainer.max_steps=2", "trainer.limit_train_batches=2", "trainer.val_check_interval=2",
                          "trainer.limit_val_batches=2", "trainer.num_sanity_val_steps=0", "logger=none",
                          "curriculum=[{length:0,steps:2},{length:300}]", "precision=32-true",
                          f"paths.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
                          "callbacks.progress_bar.refresh_rate=0", "+trainer.enable_model_summary=false")
    run = build_run(tiny)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 2 and all(gate.age is not None for gate in run.module.model.retrieval)
    assert len(run.module.model.retrieval) == 2
