"""Sweeps: each job's results.json, the summary table and plot, W&B runs per job, the sweeper configs."""

from __future__ import annotations

import csv
import json
import runpy
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, compose_config, run_hydra_main, tiny_overrides
from tests.helpers.paths import ROOT
from xl.training.hydra_callbacks import FinishWandbRun
from xl.training.services.sweep import write_summary

PNG = b"\x89PNG\r\n\x1a\n"


def run_train(argv: list[str], monkeypatch) -> None:
    """train.py as the command line runs it (as __main__, so Hydra finds conf/ next to it), in this process."""
    run_hydra_main(lambda: runpy.run_path(str(ROOT / "train.py"), run_name="__main__"), argv, monkeypatch)


def fake_job(sweep: Path, name: str, overrides: list[str], results: dict | None) -> None:
    (sweep / name / ".hydra").mkdir(parents=True)
    (sweep / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if results is not None:
        (sweep / name / "results.json").write_text(json.dumps(results))


def test_summary_table_plot_and_wandb_run(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    common = ["model=tiny", "data.tgt_len=64"]
    for i, mem_len in enumerate((128, 0, 64)):
        fake_job(sweep, f"{i}_memory.mem_len={mem_len}", [*common, f"memory.mem_len={mem_len}"], {
            "mem_len": mem_len, "unit": "bpb", "val/loss": 1.0 - mem_len / 1000, "val/bpb": 1.5 - mem_len / 1000,
            "test/loss": 1.1, "test/bpb": 1.6, "train_tok_s": 2000.0 - mem_len, "cache_mb": mem_len / 64,
            "params": 27200, "wall_s": 3.5})
    fake_job(sweep, "3_memory.mem_len=256", [*common, "memory.mem_len=256"], None)  # a job that wrote nothing

    import wandb

    inits = []
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kwargs: inits.append(kwargs) or real_init(**kwargs))
    rows = write_summary(sweep, {"project": "xl-test", "offline": True, "tags": ["t"]})

    assert [r["job"] for r in rows] == [f"memory.mem_len={m}" for m in (0, 64, 128, 256)]
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["mem_len"] for r in table] == ["0", "64", "128", ""]
    assert list(table[0]) == ["job", "mem_len", "val/loss", "val/bpb", "test/loss", "test/bpb", "train_tok_s",
                              "cache_mb", "params", "wall_s", "status"]
    assert table[3]["status"] == "no results.json"
    md = (sweep / "summary.md").read_text().splitlines()
    assert md[0].startswith("| job | mem_len |") and md[2].startswith("| memory.mem_len=0 | 0 |") and len(md) == 6
    assert (sweep / "summary.png").read_bytes().startswith(PNG)
    # One offline W&B run in the sweep folder, in the sweep's group (run_identity's: the sweep folder).
    (init,) = inits
    assert (init["group"], init["dir"]) == (str(sweep), str(sweep))
    assert (init["job_type"], init["mode"], init["project"]) == ("summary", "offline", "xl-test")
    (run,) = (sweep / "wandb").glob("offline-run-*")
    (table_json,) = run.glob("files/media/table/summary_*.table.json")
    assert json.loads(table_json.read_text())["columns"] == list(table[0])
    assert len(list(run.glob("files/media/images/summary_plot_*.png"))) == 1


def sweep_argv(tmp_path: Path, corpus, *extra: str) -> list[str]:
    """A tiny multirun; each job writes into its own numbered folder of the sweep (and its results.json there)."""
    overrides = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith(("paths.", "memory."))]
    return ["train.py", "-m", *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "hydra.sweep.subdir=${hydra.job.num}", *extra]


def test_two_job_sweep_writes_summary(tmp_path, corpus, monkeypatch):
    sweep = tmp_path / "sweep"
    run_train(sweep_argv(tmp_path, corpus, "memory.mem_len=0,16"), monkeypatch)

    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["job"], r["mem_len"]) for r in table] == [("memory.mem_len=0", "0"), ("memory.mem_len=16", "16")]
    assert all(float(r["test/bpb"]) > 0 and float(r["train_tok_s"]) > 0 for r in table)
    assert float(table[0]["cache_mb"]) == 0 < float(table[1]["cache_mb"])
    assert (sweep / "summary.md").is_file() and (sweep / "summary.png").read_bytes().startswith(PNG)


def test_finish_wandb_run_closes_the_job_run(tmp_path):
    import wandb

    wandb.init(mode="offline", dir=str(tmp_path), project="xl-test")
    FinishWandbRun().on_job_end(OmegaConf.create(), job_return=None)
    assert wandb.run is None


def test_each_sweep_job_logs_to_its_own_wandb_run(tmp_path, corpus, monkeypatch):
    """Two tiny jobs in one process with offline W&B, then the summary's run in the same folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    sweep = tmp_path / "sweep"
    argv = [a for a in sweep_argv(tmp_path, corpus, "memory.mem_len=0,16") if a != "logger=none"]
    run_train([*argv, "logger=wandb"], monkeypatch)
    for job in ("0", "1"):  # without FinishWandbRun, Lightning's WandbLogger would reuse job 0's run
        assert len(list((sweep / job / "wandb").glob("offline-run-*"))) == 1
    assert len(list((sweep / "wandb").glob("offline-run-*"))) == 1


def test_optuna_sweeper_config_composes():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install hydra-optuna-sweeper")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/sweeper=optuna_mem"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "minimize"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed == cfg.seed
    assert set(sweeper.params) == {"memory.mem_len", "optim.lr"}
    for key in sweeper.params:
        assert OmegaConf.select(cfg, key) is not None, key


def test_optuna_search_runs_two_trials(tmp_path, corpus, monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install hydra-optuna-sweeper")
    sweep = tmp_path / "sweep"
    run_train(sweep_argv(tmp_path, corpus, "hydra/sweeper=optuna_mem", "hydra.sweeper.n_trials=2"), monkeypatch)

    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert set(best.best_params) == {"memory.mem_len", "optim.lr"} and best.best_value > 0
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 and all("optim.lr=" in r["job"] for r in table)
    assert min(float(r["val/loss"]) for r in table) == pytest.approx(best.best_value)


def test_a_search_whose_objective_is_never_computed_is_refused_before_any_trial_trains(tmp_path, corpus, monkeypatch):
    """Optuna minimises each job's val/loss: with no validation within max_steps every trial returned None and the
    sweep ended in Optuna's traceback "No trials are completed yet" after training them all."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install hydra-optuna-sweeper")
    search = ["hydra/sweeper=optuna_mem", "hydra.sweeper.n_trials=3"]
    with pytest.raises(SystemExit, match=r"^error: the sweeper minimises each job's val/loss, but no validation runs "
                                         r"within trainer.max_steps=5; set trainer.val_check_interval to at most 5$"):
        run_train(sweep_argv(tmp_path, corpus, *search, "trainer.max_steps=5"), monkeypatch)
    with pytest.raises(SystemExit, match=r"^error: the sweeper minimises each job's val/loss, which "
                                         r"trainer.limit_val_batches=0 never computes; set trainer.limit_val_batches"):
        run_train(sweep_argv(tmp_path, corpus, *search, "trainer.limit_val_batches=0"), monkeypatch)
    assert not list((tmp_path / "sweep").rglob("*.ckpt")) and not list((tmp_path / "sweep").rglob("results.json"))


def test_wandb_sweep_config_is_valid_for_train_py():
    spec = yaml.safe_load((ROOT / "sweeps" / "mem_len.yaml").read_text())
    assert (ROOT / spec["program"]).is_file() and spec["method"] in ("bayes", "grid", "random")
    assert "${args_no_hyphens}" in spec["command"] and "${program}" in spec["command"]
    assert spec["metric"] == {"name": "val/loss", "goal": "minimize"}
    extra = [c for c in spec["command"] if "=" in c]  # fixed overrides after the swept ones
    for name, param in spec["parameters"].items():
        values = param.get("values") or [param["min"], param["max"]]
        for value in values:
            cfg = compose_config(*extra, f"{name}={value}")  # fails on an unknown key or a bad value
            assert OmegaConf.select(cfg, name) == pytest.approx(value), name


def test_summary_columns_name_every_memory_setting_and_bits_per_byte_once():
    from xl.training.services.sweep import columns

    rows = [{"job": "0", "mem_len": 64, "grad_segments": 2, "memory": "cache", "unit": "ppl", "val/ppl": 30.0,
             "val/bpb": 1.2}, {"job": "1", "mem_len": 64, "grad_segments": 1, "unit": "ppl"}]
    assert columns(rows) == ["job", "mem_len", "memory", "grad_segments", "val/ppl", "val/bpb"]
    byte_rows = [{"job": "0", "unit": "bpb", "val/bpb": 2.5, "test/bpb": 2.3}]
    assert columns(byte_rows) == ["job", "val/bpb", "test/bpb"]


def test_jobs_of_several_tokenizers_are_tabled_with_their_own_figures_and_plotted_in_bits_per_byte():
    """A sweep over data.tokenizer: every job's own figure and bpb are columns, the <unk> share beside them, and the
    plot shows bpb, the figure they share (the first job's unit, ppl, would leave the byte job out, and would put a
    word model's ppl beside a subword model's)."""
    from xl.training.services.sweep import columns, plotted_unit

    rows = [{"job": "word", "mem_len": 64, "unit": "ppl", "val/ppl": 40.0, "val/bpb": 2.9, "val/unk_share": 0.4},
            {"job": "byte", "mem_len": 64, "unit": "bpb", "val/bpb": 2.5}]
    assert columns(rows) == ["job", "mem_len", "val/ppl", "val/bpb", "val/unk_share"]
    assert plotted_unit(rows) == plotted_unit(rows[:1]) == "bpb"
    assert plotted_unit([{"job": "0", "mem_len": 64, "unit": "ppl", "val/ppl": 40.0}]) == "ppl"  # no bpb reported


def drawn_figure(rows: list[dict], tmp_path: Path, monkeypatch):
    """The figure write_plot draws for ``rows``, kept open to be read."""
    import matplotlib.pyplot as plt

    from xl.training.services.sweep import write_plot

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    write_plot(rows, tmp_path)
    (figure,) = figures
    return figure


def lines_of(axes) -> dict[str, list[tuple]]:
    return {line.get_label(): list(zip(line.get_xdata(), line.get_ydata(), strict=True)) for line in axes.get_lines()}


def test_the_plot_puts_what_the_sweep_varies_on_its_x_axis(tmp_path, monkeypatch):
    """A sweep over memory.grad_segments at one mem_len: the plot's x-axis is grad_segments, one point per job (not
    three points stacked at mem_len 128)."""
    sweep = tmp_path / "sweep"
    for i, segments in enumerate((4, 1, 2)):
        fake_job(sweep, str(i), ["model=tiny", f"memory.grad_segments={segments}"], {
            "mem_len": 128, "grad_segments": segments, "unit": "bpb", "val/bpb": 2.0 - segments / 10,
            "test/bpb": 1.9, "train_tok_s": 1000.0 / segments, "cache_mb": 1.0})
    rows = write_summary(sweep)
    assert [r["varied"] for r in rows] == [{"memory.grad_segments": s} for s in (1, 2, 4)]
    assert (sweep / "summary.png").read_bytes().startswith(PNG)
    quality, cost, rate = drawn_figure(rows, tmp_path, monkeypatch).axes
    assert quality.get_xlabel() == cost.get_xlabel() == "memory.grad_segments"
    assert lines_of(quality)["val"] == [(1, 1.9), (2, 1.8), (4, 1.6)]
    assert list(rate.get_lines()[0].get_xdata()) == [1, 2, 4]


def test_a_grid_over_two_settings_draws_one_line_per_value_of_the_second(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    for i, (segments, lr) in enumerate([(s, lr) for s in (1, 2) for lr in (1e-3, 2e-3)]):
        fake_job(sweep, str(i), [f"memory.grad_segments={segments}", f"optim.lr={lr}"], {
            "mem_len": 64, "unit": "bpb", "val/bpb": segments + lr, "cache_mb": 1.0})
    quality, _ = drawn_figure(write_summary(sweep), tmp_path, monkeypatch).axes[:2]
    assert quality.get_xlabel() == "memory.grad_segments"
    assert lines_of(quality) == {"val (optim.lr=0.001)": [(1, 1.001), (2, 2.001)],
                                 "val (optim.lr=0.002)": [(1, 1.002), (2, 2.002)]}


def test_a_search_plots_its_points_against_the_first_setting_each_named_by_the_others(tmp_path, monkeypatch):
    """An Optuna search (memory length and learning rate both chosen per trial): points against mem_len, each
    annotated with its learning rate, which the plot would otherwise hide."""
    sweep = tmp_path / "sweep"
    for i, (mem_len, lr) in enumerate([(64, 3e-4), (0, 1e-3), (64, 2e-3)]):
        fake_job(sweep, str(i), [f"memory.mem_len={mem_len}", f"optim.lr={lr}"], {
            "mem_len": mem_len, "unit": "bpb", "val/bpb": 2.0 + lr, "cache_mb": mem_len / 64})
    quality, _ = drawn_figure(write_summary(sweep), tmp_path, monkeypatch).axes[:2]
    assert quality.get_xlabel() == "memory.mem_len"
    assert sorted(lines_of(quality)["val"]) == [(0, 2.001), (64, 2.0003), (64, 2.002)]
    assert quality.get_lines()[0].get_linestyle() == "None"  # points: no line joins two trials
    assert sorted(text.get_text() for text in quality.texts) == ["optim.lr=0.0003", "optim.lr=0.001",
                                                                 "optim.lr=0.002"]


def test_a_search_labels_its_points_rounded_and_inside_the_panel(tmp_path, monkeypatch):
    """Optuna draws learning rates such as 0.000312878...: each label shows three significant digits, and the labels
    of points right of the middle extend to the left, so that none runs off the panel."""
    sweep = tmp_path / "sweep"
    for i, (mem_len, lr) in enumerate([(0, 0.000312878123456), (512, 0.0027531234), (512, 0.00101010101)]):
        fake_job(sweep, str(i), [f"memory.mem_len={mem_len}", f"optim.lr={lr}"], {
            "mem_len": mem_len, "unit": "bpb", "val/bpb": 2.0 + i / 10, "cache_mb": mem_len / 64})
    quality = drawn_figure(write_summary(sweep), tmp_path, monkeypatch).axes[0]
    labels = {text.get_text(): text for text in quality.texts}
    assert set(labels) == {"optim.lr=0.000313", "optim.lr=0.00275", "optim.lr=0.00101"}
    assert labels["optim.lr=0.000313"].get_horizontalalignment() == "left"
    assert labels["optim.lr=0.00275"].get_horizontalalignment() == "right"
    fig = quality.figure
    fig.canvas.draw()
    panel = quality.get_window_extent()
    for text in quality.texts:
        box = text.get_window_extent()
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1, text.get_text()


def test_the_quality_axis_states_the_spread_and_does_not_blow_noise_up(tmp_path, monkeypatch):
    """Five jobs within 0.0013 bpb of one another: the title says so, and the axis spans at least 2% of the values,
    so that noise does not fill the panel as a trend; a real difference is drawn at its own scale."""
    from xl.training.services.sweep import MIN_SPAN

    sweep = tmp_path / "sweep"
    values = [1.2000, 1.2013, 1.2004, 1.2009, 1.2001]
    for i, (mem_len, bpb) in enumerate(zip((0, 64, 128, 256, 512), values, strict=True)):
        fake_job(sweep, str(i), [f"memory.mem_len={mem_len}"], {
            "mem_len": mem_len, "unit": "bpb", "val/bpb": bpb, "cache_mb": mem_len / 64})
    quality = drawn_figure(write_summary(sweep), tmp_path, monkeypatch).axes[0]
    assert quality.get_title().splitlines() == ["bpb against memory.mem_len",
                                                "spread over jobs: val 0.0013 bpb (at most 0.11%)"]
    low, high = quality.get_ylim()
    assert high - low >= MIN_SPAN * sum(values) / len(values) and low < min(values) and max(values) < high

    wide = tmp_path / "wide"
    for i, (mem_len, bpb) in enumerate(zip((0, 64), (1.2, 1.5), strict=True)):
        fake_job(wide, str(i), [f"memory.mem_len={mem_len}"], {
            "mem_len": mem_len, "unit": "bpb", "val/bpb": bpb, "cache_mb": mem_len / 64})
    low, high = drawn_figure(write_summary(wide), tmp_path, monkeypatch).axes[0].get_ylim()
    assert high - low < 0.5  # matplotlib's own limits, a margin around 1.2-1.5
