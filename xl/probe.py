"""The memory probe: how far back can the model recall one symbol, for each memory length?

The corpus (:mod:`xl.data.recall`, ``data=recall``) is a byte stream of episodes ``KKKKKKKK…….?K……``: a key
letter shown ``repeat`` times, ``d-1`` filler dots, a query mark ``?``, the key again (which the model must
predict at the ``?``), then ``gap`` dots before the next episode; d counts from the ``?`` back to the key's last
copy, so the key is visible to the query exactly when d is within its reach.

Two choices make it learnable in a few minutes on a CPU. The repeated key gives the untrained model's
near-uniform attention ``repeat`` times more weight on the key than a single letter would: with one key letter
(and the gap) the same 2-layer model and optimiser reached at most 27% after 2,500 steps with mem_len 32 and
stayed at chance after 6,000 steps with mem_len 64; shown 8 times, the key is recalled perfectly within reach after
3,000. The gap keeps earlier episodes' keys out of every query's window (the probe sets it to ``n_layer ×`` its
largest memory + one segment, beyond even a relayed reach), so "the letter in view" is always the right one, or
there is none. Without a gap (and with one key) the previous episode's answer sits one position behind the
key, and the model stayed at chance at every distance.

One attention hop at position p of a segment (0-based) sees ``mem_len + p`` tokens back with the plain cache, and
``held + p`` with a memory that keeps more (:meth:`xl.model.memory_settings.MemoryConfig.held`, per layer: compressed
slots, a retrieval store, memory tokens); relayed through the layers' cached states, the reach grows to about
``n_layer × held`` (Dai et al., 2019, section 3.2: the longest dependency grows as O(N × L) with N layers).
``python -m xl.probe`` trains briefly for several memory lengths (and seeds) and writes accuracy against d (a table,
a JSON file and a plot), next to what one hop and ``n_layer`` relayed hops would see (:func:`reach_accuracy`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from xl.config.compose import compose, exit_on_user_error
from xl.data.recall import KEYS, QUERY
from xl.model import memory_settings

# Small enough for a CPU; 2 layers and width 64 learn the retrieval within 3,000 steps (width 32 did not in 600).
# float32 whatever the CPU (precision=auto would train bf16-mixed where the CPU computes bfloat16): what a run
# learns is a fork in the road (relay or not), and bfloat16 rounding moves it, so the figures would depend on the CPU.
PROBE_MODEL = ("model=tiny", "model.d_model=64", "model.n_head=4", "model.d_inner=256", "optim.lr=3e-3",
               "precision=32-true")


def query_distances(row: np.ndarray) -> np.ndarray:
    """For each position of one stream row: distance back to the last key letter (-1 where there is none)."""
    is_key = np.isin(row, np.frombuffer(KEYS, dtype=np.uint8))
    positions = np.arange(len(row))
    last_key = np.maximum.accumulate(np.where(is_key, positions, -1))
    return np.where(last_key >= 0, positions - last_key, -1)


def reach_accuracy(d: int, held: Sequence[float], seg_len: int) -> float:
    """Expected accuracy if the model recalls whatever a chain of attention hops can see, and guesses otherwise.

    ``held``: per hop, the query's first, how many positions before its segment that hop's keys reach
    (:meth:`~xl.model.memory_settings.MemoryConfig.held` of the hop's layer; ``math.inf``: every position). Position s
    attends back to ``s - held - (s mod seg_len)`` (its memory and its own segment so far); a relay through a layer's
    cached states starts the next hop there. The memory is full (positions before the stream's start count as
    text), and queries are spread evenly over the segment positions.
    """
    seen = 0
    for p in range(seg_len):
        start = p
        for reach in held:
            start = start - reach - start % seg_len if reach < math.inf else -math.inf
        seen += p - start >= d
    fraction = seen / seg_len
    return fraction + (1.0 - fraction) / len(KEYS)


def above(hits: int, total: int, predicted: float) -> bool:
    """Whether ``hits`` of ``total`` queries beat the ``predicted`` accuracy by more than two standard errors (of
    ``total`` draws at the predicted rate): more than sampling noise."""
    return hits / total > predicted + 2 * (predicted * (1 - predicted) / total) ** 0.5


@dataclass
class Row:
    """One memory length's runs: per layer what its memory holds (``held``), and per seed the hits and queries at
    each distance."""

    mem_len: int
    held: list[float]
    counts: list[dict[int, tuple[int, int]]] = field(default_factory=list)

    def predictions(self, d: int, seg_len: int) -> dict[str, float]:
        """One hop (the layer that holds most), ``n_layer`` relayed hops (the top layer's first) and one hop over the
        cache alone (``mem_len`` positions), which the seeds are counted against."""
        return {"one_hop": reach_accuracy(d, [max(self.held)], seg_len),
                "relayed": reach_accuracy(d, self.held[::-1], seg_len),
                "cache_one_hop": reach_accuracy(d, [self.mem_len], seg_len)}

    def cell(self, d: int, seg_len: int) -> dict[str, Any]:
        """Distance ``d`` over the seeds: the mean accuracy, the seeds above the cache's one-hop prediction
        (:func:`above`), each seed's accuracy and queries, and the predictions."""
        runs = [c[d] for c in self.counts if c.get(d, (0, 0))[1]]
        cache = reach_accuracy(d, [self.mem_len], seg_len)
        return {"mean": float(np.mean([h / t for h, t in runs])) if runs else float("nan"),
                "above_cache": sum(above(h, t, cache) for h, t in runs), "seeds": len(runs),
                "accuracy": [h / t for h, t in runs], "queries": [t for _, t in runs],
                **self.predictions(d, seg_len)}


def recall_accuracy(model: Any, rows: np.ndarray, seg_len: int, mem_len: int, clamp_len: int | None = None,
                    same_length: bool | None = None) -> dict[int, tuple[int, int]]:
    """Read the rows segment by segment with memory (``model``: a :class:`~xl.model.transformer.TransformerXL`) in
    the context ``mem_len``, ``clamp_len``, ``same_length`` (None: the model's); count correct key predictions at each
    query, per d."""
    import torch

    from xl.bench.runner import SegmentRunner

    inputs = torch.from_numpy(rows[:, :-1].astype(np.int64))
    runner = SegmentRunner(model, inputs, seg_len, targets=False, mem_len=mem_len, clamp_len=clamp_len,
                           same_length=same_length, return_logits=True)
    predicted = torch.cat([runner.step().logits.argmax(-1) for _ in range(runner.n_segments)], dim=1).numpy()
    y_all = rows[:, 1:]
    counts: dict[int, tuple[int, int]] = {}
    for b in range(rows.shape[0]):
        dist = query_distances(rows[b, :-1])
        for p in np.flatnonzero(rows[b, :-1] == QUERY):
            if dist[p] > 0:
                hit, total = counts.get(int(dist[p]), (0, 0))
                counts[int(dist[p])] = (hit + int(predicted[b, p] == y_all[b, p]), total + 1)
    return counts


def probe_config(mem_len: int, largest: int, distances: Sequence[int], steps: int, out_dir: Path,
                 overrides: Sequence[str] = ()) -> Any:
    """The composed config of the probe's run for one memory length (``largest``: the largest memory length probed,
    which sets the gap between episodes unless ``overrides`` set ``data.source.gap``; the overrides come last)."""
    base = ["data=recall", *PROBE_MODEL, "logger=none", "test=false", f"memory.mem_len={mem_len}",
            f"memory.eval_mem_len={mem_len}", f"data.source.distances=[{','.join(map(str, distances))}]",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
            f"paths.output_dir={out_dir / f'mem{mem_len}'}"]
    shape = compose("config", [*base, *overrides])
    return compose("config", [*base, f"data.source.gap={shape.model.n_layer * largest + shape.data.tgt_len}",
                              *overrides])


def flat(node: Any) -> dict[str, Any]:
    """A composed config as ``{"data.source.gap": 600, ...}``."""
    from omegaconf import OmegaConf

    def walk(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, f"{prefix}{key}.")
        else:
            yield prefix[:-1], value

    return dict(walk(OmegaConf.to_container(node, resolve=True), ""))


def scored_memory(cfg: Any, scored_cfg: Any) -> Any:
    """The memory the trained model is scored with: the run's, with the ``--score`` overrides of its evaluation
    settings (another store size: :func:`xl.model.memory_settings.for_evaluation`); ConfigError in one sentence for an
    override that would change the trained run (anything but the episodes, ``data.source.*``, and those settings)."""
    from xl.config.rules import ConfigError

    before, after = flat(cfg), flat(scored_cfg)
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    other = [k for k in changed if not k.startswith(("data.source.", "memory."))]
    if other:
        raise ConfigError(f"--score {other[0]}={changed[other[0]]} would change the trained run; --score changes the "
                          "episodes (data.source.*) and the memory's evaluation settings only")
    given = {k.removeprefix("memory."): v for k, v in changed.items() if k.startswith("memory.")}
    try:
        return memory_settings.for_evaluation(memory_settings.variant(cfg.memory, cfg), given)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def scoring(trained: Any, memory: Any, scored_cfg: Any) -> tuple[Any, np.ndarray]:
    """The trained model with ``memory``'s settings (:func:`scored_memory`) and the validation rows of
    ``scored_cfg``'s episodes."""
    import dataclasses

    from xl.model.transformer import TransformerXL
    from xl.training.build import build_datamodule

    model = TransformerXL(dataclasses.replace(trained.config, memory=memory))
    model.load_state_dict(trained.state_dict())
    datamodule = build_datamodule(scored_cfg)
    datamodule.setup("validate")
    return model.eval(), np.asarray(datamodule.val_dataloader().rows)


def run_probe(mem_lens: Sequence[int], distances: Sequence[int], steps: int, out_dir: Path,
              overrides: Sequence[str] = (), score: Sequence[str] = (), seeds: Sequence[int] = ()
              ) -> tuple[list[Row], list[int], int, int]:
    """Train one tiny model per memory length and seed on the recall stream, then measure accuracy against d.

    Returns a :class:`Row` per memory length, the seeds, the segment length and the number of layers. ``seeds``:
    one run each (none given: one run with the config's ``seed``), one after another. The gap between episodes is set
    to ``n_layer ×`` the largest memory plus one segment (unless ``data.source.gap`` is overridden), beyond even a
    relayed reach, so no query can see an earlier episode's key. ``score``: overrides of the scoring only (other
    episodes, another store size: :func:`scoring`), checked before any training; the predictions are the scored
    memory's.
    """
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from xl.training.build import build_run
    from xl.training.services.console import quiet_libraries, quiet_warnings

    quiet_libraries()
    quiet_warnings()
    runs = []  # every run's config, and its scoring's, checked before the first training
    rows = []
    for mem_len in mem_lens:
        for seed in seeds or [None]:
            own = [*overrides, f"seed={seed}"] if seed is not None else list(overrides)
            folder = out_dir / (f"mem{mem_len}" if seed is None else f"mem{mem_len}-seed{seed}")
            cfg = probe_config(mem_len, max(mem_lens), distances, steps, folder, own)
            scored_cfg = probe_config(mem_len, max(mem_lens), distances, steps, folder, [*own, *score])
            memory = scored_memory(cfg, scored_cfg)
            runs.append((len(rows), cfg, scored_cfg, memory if score else None))
        held = memory.held(mem_len, cfg.memory.grad_segments, cfg.model.n_layer)
        rows.append(Row(mem_len, held))
    for index, cfg, scored_cfg, memory in runs:
        mem_len, start = rows[index].mem_len, time.time()
        run = build_run(cfg)
        try:
            run.trainer.fit(run.module, datamodule=run.datamodule)
        except SIGTERMException as err:  # a signal (services.callbacks.PreemptionCheckpoint): the probe stops
            sys.exit(f"error: {err or 'stopped by a signal'}; the probe's runs are in {out_dir}")
        model, val_rows = (run.module.model, np.asarray(run.datamodule.val_dataloader().rows)) if not score else \
            scoring(run.module.model, memory, scored_cfg)
        context = memory_settings.evaluation(cfg.memory).attention()
        counts = recall_accuracy(model, val_rows, cfg.data.tgt_len, **context)  # the run's evaluation context
        rows[index].counts.append(dict(sorted(counts.items())))
        print(f"mem_len={mem_len} seed={cfg.seed}: trained and scored in {time.time() - start:.0f} s", flush=True)
    cfg = runs[-1][1]
    return rows, list(seeds) or [cfg.seed], cfg.data.tgt_len, cfg.model.n_layer


def table(rows: Sequence[Row], distances: Sequence[int], seg_len: int, n_layer: int, seeds: Sequence[int]) -> str:
    """The Markdown table: per memory length its measured row (the mean; with several seeds also how many of them
    beat the cache's one-hop prediction), its one-hop and ``n_layer``-hop predictions, and the cache's one hop where
    the memory holds more."""
    header = "| mem_len | " + " | ".join(f"d={d}" for d in distances) + " |"
    lines = [header, "|" + "---|" * (len(distances) + 1)]

    def line(label: str, values: Sequence[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    for row in rows:
        cells = [row.cell(d, seg_len) for d in distances]
        line(str(row.mem_len), [f"{c['mean']:.2f}" + (f" ({c['above_cache']}/{c['seeds']})" if len(seeds) > 1 else "")
                                for c in cells])
        line(f"{row.mem_len}: one hop", [f"{c['one_hop']:.2f}" for c in cells])
        line(f"{row.mem_len}: {n_layer} hops", [f"{c['relayed']:.2f}" for c in cells])
        if max(row.held) != row.mem_len:
            line(f"{row.mem_len}: cache alone, one hop", [f"{c['cache_one_hop']:.2f}" for c in cells])
    if len(seeds) > 1:
        lines.append(f"\nMean over seeds {', '.join(map(str, seeds))}; (k/n): the seeds whose accuracy beats the "
                     "cache's one-hop prediction by more than two standard errors.")
    return "\n".join(lines)


def write_report(rows: Sequence[Row], distances: Sequence[int], out_dir: Path, seg_len: int, n_layer: int,
                 seeds: Sequence[int]) -> str:
    """:func:`table` into ``probe.md``, every cell into ``probe.json`` and a plot of accuracy against distance into
    ``probe.png``: one line per memory length (the mean over seeds), its one-hop prediction dashed and its
    ``n_layer``-hop prediction dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4))
    for row in rows:
        cells = [row.cell(d, seg_len) for d in distances]
        line, = ax.plot(distances, [c["mean"] for c in cells], marker="o", label=f"mem_len={row.mem_len}")
        ax.plot(distances, [c["one_hop"] for c in cells], linestyle="--", color=line.get_color(), alpha=0.6)
        ax.plot(distances, [c["relayed"] for c in cells], linestyle=":", color=line.get_color(), alpha=0.6)
    ax.axhline(1 / len(KEYS), color="grey", linewidth=0.8, label="chance")
    ax.plot([], [], linestyle="--", color="black", alpha=0.6, label="prediction: one hop")
    ax.plot([], [], linestyle=":", color="black", alpha=0.6, label=f"prediction: {n_layer} hops (relayed)")
    seeds_note = f", mean over {len(seeds)} seeds" if len(seeds) > 1 else ""
    ax.set(xlabel="distance d from key to query (tokens)", ylabel="recall accuracy", ylim=(0, 1.02),
           title=f"Memory probe: recall against distance (segment {seg_len}{seeds_note})")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "probe.png", dpi=120)
    plt.close(fig)
    text = table(rows, distances, seg_len, n_layer, seeds)
    (out_dir / "probe.md").write_text(text + "\n")
    results = {"seeds": list(seeds), "seg_len": seg_len, "n_layer": n_layer,
               "rows": [{"mem_len": row.mem_len, "held": [h if h < math.inf else None for h in row.held],
                         "cells": {str(d): row.cell(d, seg_len) for d in distances}} for row in rows]}
    (out_dir / "probe.json").write_text(json.dumps(results, indent=1) + "\n")
    return text


def override_keys(overrides: Sequence[str]) -> list[str]:
    """The keys (or groups) that Hydra overrides set, in order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))]


def scored_distances(score: Sequence[str]) -> list[int] | None:
    """The distances ``--score`` sets (``data.source.distances=[...]``), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = [o.value() for o in OverridesParser.create().parse_overrides(list(score))
             if o.key_or_group == "data.source.distances"]
    return [int(d) for d in found[-1]] if found else None


def output_folder(out: Path | None, overrides: Sequence[str], seeds: Sequence[int]) -> Path:
    """The probe's own folder: ``out``, which must be new or empty, or ``outputs/probe/<date>/<time>`` (with a
    suffix if a probe started in the same second); ConfigError in one sentence for seeds given twice or a folder in
    use."""
    from xl.config.rules import ConfigError

    if seeds and "seed" in override_keys(overrides):
        raise ConfigError("give the seeds with --seeds only: remove the seed= override")
    if len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, seeds))} names a seed twice; name each once")
    if out is not None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {out} is not an empty folder; name a new one (without --out each probe gets "
                              "outputs/probe/<date>/<time>)")
        return out
    stamp = Path("outputs/probe") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    folder, n = stamp, 1
    while folder.exists():
        folder, n = stamp.with_name(f"{stamp.name}-{n}"), n + 1
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Recall accuracy against the distance d from a key to its query, for several memory lengths (one "
                    "small model trained per memory length and seed), beside what one attention hop and n_layer "
                    "relayed hops of the memory can see. Writes probe.md, probe.json and probe.png.",
        epilog="Hydra overrides (the memory, the model, the episodes: memory=knn model.n_layer=3 data.source.gap=400) "
               "go before the options, since --mem-lens, --distances, --seeds and --score take every word after them.")
    parser.add_argument("--mem-lens", type=int, nargs="+", default=[0, 32, 64], metavar="N",
                        help="the memory lengths (memory.mem_len and memory.eval_mem_len), one model each "
                             "(default: 0 32 64)")
    parser.add_argument("--distances", type=int, nargs="+", default=[4, 16, 32, 48, 64, 80, 96, 128, 144, 160],
                        metavar="D", help="the distances of the training and scoring episodes (data.source.distances), "
                                          "the table's columns (default: 4 16 32 48 64 80 96 128 144 160)")
    parser.add_argument("--steps", type=int, default=3000, help="training steps per model (trainer.max_steps; it "
                                                                "validates once, at the end; default: 3000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[], metavar="S",
                        help="train each memory length once per seed, one after another, and report per cell the "
                             "mean and how many seeds beat the cache's one-hop prediction (default: the config's "
                             "seed, once)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="the folder of this probe's runs and results, new or empty (default: "
                             "outputs/probe/<date>/<time>)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a tiny model runs best on one; "
                                                               "default: 1)")
    parser.add_argument("--score", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="score the trained models on other episodes (data.source.gap=4200 "
                             "data.source.distances=[1024,4096]) or with other memory evaluation settings; the table's "
                             "columns are then the scored distances; given twice, both count")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of every run, before the options, e.g. "
                                                     "memory=compressive model.n_layer=3")
    args = parser.parse_args(argv)
    start = time.time()
    with exit_on_user_error():
        out = output_folder(args.out, args.overrides, args.seeds)
        import torch  # after the command line's checks: --help and a refusal need none of it

        torch.set_num_threads(args.threads)
        rows, seeds, seg_len, n_layer = run_probe(args.mem_lens, args.distances, args.steps, out, args.overrides,
                                                  args.score, args.seeds)
    columns = scored_distances(args.score) or args.distances
    print(write_report(rows, columns, out, seg_len, n_layer, seeds))
    print(f"results: {out}/ (probe.md, probe.json, probe.png); wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
