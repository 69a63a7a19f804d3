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

One attention hop at position p of a segment (0-based) sees ``mem_len + p`` tokens back; relayed through the
layers' cached states, the reach grows to about ``n_layer × mem_len`` (Dai et al., 2019, section 3.2: the
longest dependency grows as O(N × L) with N layers). ``python -m xl.probe`` trains briefly for several memory
lengths and writes accuracy against d (a table and a plot), next to what one hop and ``n_layer`` relayed hops
would see (:func:`reach_accuracy`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xl.bench.runner import SegmentRunner
from xl.config.compose import compose, exit_on_user_error
from xl.data.recall import KEYS, QUERY

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


def reach_accuracy(d: int, mem_len: int, seg_len: int, hops: int = 1) -> float:
    """Expected accuracy if the model recalls whatever ``hops`` chained attention hops can see, and guesses otherwise.

    Position s attends back to the start of its window, ``s - mem_len - (s mod seg_len)`` (its memory and its own
    segment so far); a relay through a layer's cached states starts the next hop there. Queries are spread evenly
    over the segment positions.
    """
    seen = 0
    for p in range(seg_len):
        query = start = 1000 * (mem_len + seg_len) * hops + p  # far from the stream's start: the memory is full
        for _ in range(hops):
            start -= mem_len + start % seg_len
        seen += query - start >= d
    fraction = seen / seg_len
    return fraction + (1.0 - fraction) / len(KEYS)


def recall_accuracy(model: torch.nn.Module, rows: np.ndarray, seg_len: int, mem_len: int
                    ) -> dict[int, tuple[int, int]]:
    """Read the rows segment by segment with memory; count correct key predictions at each query, per d."""
    inputs = torch.from_numpy(rows[:, :-1].astype(np.int64))
    runner = SegmentRunner(model, inputs, seg_len, targets=False, mem_len=mem_len, return_logits=True)
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
    settings (another store size: :func:`xl.memory.settings.for_evaluation`); ConfigError in one sentence for an
    override that would change the trained run (anything but the episodes, ``data.source.*``, and those settings)."""
    from xl.config.rules import ConfigError
    from xl.memory import settings

    before, after = flat(cfg), flat(scored_cfg)
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    other = [k for k in changed if not k.startswith(("data.source.", "memory."))]
    if other:
        raise ConfigError(f"--score {other[0]}={changed[other[0]]} would change the trained run; --score changes the "
                          "episodes (data.source.*) and the memory's evaluation settings only")
    given = {k.removeprefix("memory."): v for k, v in changed.items() if k.startswith("memory.")}
    try:
        return settings.for_evaluation(settings.variant_config(cfg.memory, cfg), given)
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
              overrides: Sequence[str] = (), score: Sequence[str] = ()) -> tuple[dict[int, dict[int, float]], int, int]:
    """Train one tiny model per memory length on the recall stream, then measure accuracy against d.

    Returns the accuracies, the segment length and the number of layers. The gap between episodes is set to
    ``n_layer ×`` the largest memory plus one segment (unless ``data.source.gap`` is overridden), beyond even a
    relayed reach, so no query can see an earlier episode's key. ``score``: overrides of the scoring only (other
    episodes, another store size: :func:`scoring`), checked before any training.
    """
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from xl.training.build import build_run
    from xl.training.console import quiet_libraries, quiet_warnings

    quiet_libraries()
    quiet_warnings()
    results: dict[int, dict[int, float]] = {}
    seg_len = n_layer = 0
    runs = []  # every run's config, and its scoring's, checked before the first training
    for mem_len in mem_lens:
        cfg = probe_config(mem_len, max(mem_lens), distances, steps, out_dir, overrides)
        scored_cfg = probe_config(mem_len, max(mem_lens), distances, steps, out_dir, [*overrides, *score])
        runs.append((mem_len, cfg, scored_cfg, scored_memory(cfg, scored_cfg) if score else None))
    for mem_len, cfg, scored_cfg, memory in runs:
        seg_len, n_layer = cfg.data.tgt_len, cfg.model.n_layer
        start = time.time()
        run = build_run(cfg)
        try:
            run.trainer.fit(run.module, datamodule=run.datamodule)
        except SIGTERMException as err:  # a signal (xl.training.callbacks.PreemptionCheckpoint): the probe stops
            sys.exit(f"error: {err or 'stopped by a signal'}; the probe's runs are in {out_dir}")
        model, rows = (run.module.model, np.asarray(run.datamodule.val_dataloader().rows)) if not score else \
            scoring(run.module.model, memory, scored_cfg)
        counts = recall_accuracy(model, rows, seg_len, mem_len)
        results[mem_len] = {d: hit / total for d, (hit, total) in sorted(counts.items())}
        print(f"mem_len={mem_len}: trained and scored in {time.time() - start:.0f} s", flush=True)
    return results, seg_len, n_layer


def write_report(results: dict[int, dict[int, float]], distances: Sequence[int], out_dir: Path,
                 seg_len: int, n_layer: int) -> str:
    """Markdown table and PNG plot of accuracy against distance, one line per memory length.

    Each memory length also gets the predictions of :func:`reach_accuracy` for one hop (a row and a dashed
    line) and for ``n_layer`` relayed hops (a row and a dotted line).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header = "| mem_len | " + " | ".join(f"d={d}" for d in distances) + " |"
    lines = [header, "|" + "---|" * (len(distances) + 1)]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for mem_len, acc in results.items():
        one = [reach_accuracy(d, mem_len, seg_len, 1) for d in distances]
        relayed = [reach_accuracy(d, mem_len, seg_len, n_layer) for d in distances]
        lines.append(f"| {mem_len} | " + " | ".join(f"{acc.get(d, float('nan')):.2f}" for d in distances) + " |")
        lines.append(f"| {mem_len}: one hop | " + " | ".join(f"{p:.2f}" for p in one) + " |")
        lines.append(f"| {mem_len}: {n_layer} hops | " + " | ".join(f"{p:.2f}" for p in relayed) + " |")
        line, = ax.plot(distances, [acc.get(d, np.nan) for d in distances], marker="o", label=f"mem_len={mem_len}")
        ax.plot(distances, one, linestyle="--", color=line.get_color(), alpha=0.6)
        ax.plot(distances, relayed, linestyle=":", color=line.get_color(), alpha=0.6)
    ax.axhline(1 / len(KEYS), color="grey", linewidth=0.8, label="chance")
    ax.plot([], [], linestyle="--", color="black", alpha=0.6, label="prediction: one hop")
    ax.plot([], [], linestyle=":", color="black", alpha=0.6, label=f"prediction: {n_layer} hops (relayed)")
    ax.set(xlabel="distance d from key to query (tokens)", ylabel="recall accuracy", ylim=(0, 1.02),
           title=f"Memory probe: recall against distance (segment {seg_len})")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "probe.png", dpi=120)
    plt.close(fig)
    table = "\n".join(lines)
    (out_dir / "probe.md").write_text(table + "\n")
    (out_dir / "probe.json").write_text(json.dumps({str(m): acc for m, acc in results.items()}, indent=1) + "\n")
    return table


def scored_distances(score: Sequence[str]) -> list[int] | None:
    """The distances ``--score`` sets (``data.source.distances=[...]``), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = [o.value() for o in OverridesParser.create().parse_overrides(list(score))
             if o.key_or_group == "data.source.distances"]
    return [int(d) for d in found[-1]] if found else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Recall accuracy against distance for several memory lengths.")
    parser.add_argument("--mem-lens", type=int, nargs="+", default=[0, 32, 64])
    parser.add_argument("--distances", type=int, nargs="+", default=[4, 16, 32, 48, 64, 80, 96, 128, 144, 160])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("outputs/probe"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a tiny model runs best on one)")
    parser.add_argument("--score", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="score the trained models on other episodes (data.source.gap=4200 "
                             "data.source.distances=[1024,4096]) or with other memory evaluation settings; the table's "
                             "columns are then the scored distances; given twice, both count")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, before the options (--mem-lens and "
                        "--distances take every number after them), e.g. model.n_layer=3 seed=1")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    with exit_on_user_error():
        results, seg_len, n_layer = run_probe(args.mem_lens, args.distances, args.steps, args.out, args.overrides,
                                              args.score)
    columns = scored_distances(args.score) or args.distances
    print(write_report(results, columns, args.out, seg_len, n_layer))
    print(f"plot: {args.out / 'probe.png'}; wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
