"""The memory probe: how far back can the model recall one symbol, for each memory length?

A synthetic byte stream of episodes ``K..…. ? K``: a key letter ``K`` (A–P), ``d-1`` filler dots, a query
mark ``?``, and the key again, which the model must predict at the ``?``. The filler is constant so that
the loss is all about the keys: the task is pure retrieval over a known distance d. The seed chapter on the limits of
recurrent memory puts the reach at about ``n_layer × mem_len`` tokens back; in practice one attention hop
sees ``mem_len`` + (position in segment) tokens, and further reach needs the model to relay the key through
the cached states of intermediate positions. ``python -m xl.probe`` trains briefly for several memory lengths
and writes accuracy against d (a table and a plot).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

KEYS = b"ABCDEFGHIJKLMNOP"
FILLER = ord(".")
QUERY = ord("?")
SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}
# Small enough for a CPU; 2 layers and width 64 learn the retrieval in ~2,000 steps (width 32 did not in 600).
PROBE_MODEL = ("model=tiny", "model.d_model=64", "model.n_head=4", "model.d_inner=256", "optim.lr=3e-3")


def recall_bytes(distances: Sequence[int], n_episodes: int, seed: int) -> bytes:
    """Episodes with the key ``d`` positions before its query, d drawn uniformly from ``distances``."""
    if min(distances) < 1:
        raise ValueError(f"recall distances must be >= 1, got {list(distances)}")
    rng = np.random.default_rng(seed)
    keys = np.frombuffer(KEYS, dtype=np.uint8)
    parts = []
    for d in rng.choice(np.asarray(distances), size=n_episodes):
        key = rng.choice(keys)
        parts.append(np.concatenate([[key], np.full(d - 1, FILLER), [QUERY, key]]).astype(np.uint8))
    return np.concatenate(parts).tobytes()


class RecallSource:
    """The probe's corpus as a data source (``data=recall``): deterministic per split."""

    def __init__(self, distances: Sequence[int], episodes: int = 20000, eval_episodes: int = 2000, seed: int = 0):
        self.distances = [int(d) for d in distances]
        self.episodes, self.eval_episodes, self.seed = episodes, eval_episodes, seed

    def identity(self) -> str:
        # The alphabet is part of the identity: a change to the generator must not reuse an old token cache.
        spec = json.dumps([KEYS.decode(), chr(FILLER), self.distances, self.episodes, self.eval_episodes, self.seed])
        return "recall-" + hashlib.sha256(spec.encode()).hexdigest()[:16]

    def texts(self, split: str) -> Iterator[str]:
        n = self.episodes if split == "train" else self.eval_episodes
        yield recall_bytes(self.distances, n, self.seed * 10 + SPLIT_SEEDS[split]).decode("ascii")

    def setting(self, split: str) -> str:
        return "data.source.distances"


def query_distances(row: np.ndarray) -> np.ndarray:
    """For each position of one stream row: distance back to the last key letter (-1 where there is none)."""
    is_key = np.isin(row, np.frombuffer(KEYS, dtype=np.uint8))
    positions = np.arange(len(row))
    last_key = np.maximum.accumulate(np.where(is_key, positions, -1))
    return np.where(last_key >= 0, positions - last_key, -1)


@torch.no_grad()
def recall_accuracy(model, rows: np.ndarray, seg_len: int, mem_len: int) -> dict[int, tuple[int, int]]:
    """Read the rows segment by segment with memory; count correct key predictions at each query, per d."""
    model.eval()
    x_all = torch.from_numpy(rows[:, :-1].astype(np.int64))
    y_all = rows[:, 1:]
    predictions = []
    mems = None
    for start in range(0, x_all.size(1), seg_len):
        out = model(x_all[:, start:start + seg_len], mems, mem_len=mem_len)
        mems = out.mems
        predictions.append(out.logits.argmax(-1).numpy())
    predicted = np.concatenate(predictions, axis=1)
    counts: dict[int, tuple[int, int]] = {}
    for b in range(rows.shape[0]):
        dist = query_distances(rows[b, :-1])
        for p in np.flatnonzero(rows[b, :-1] == QUERY):
            if dist[p] > 0:
                hit, total = counts.get(int(dist[p]), (0, 0))
                counts[int(dist[p])] = (hit + int(predicted[b, p] == y_all[b, p]), total + 1)
    return counts


def run_probe(mem_lens: Sequence[int], distances: Sequence[int], steps: int, out_dir: Path,
              overrides: Sequence[str] = ()) -> dict[int, dict[int, float]]:
    """Train one tiny model per memory length on the recall stream, then measure accuracy against d."""
    from hydra import compose, initialize_config_dir

    from xl.build import build_run
    from xl.callbacks import exit_if_preempted

    conf_dir = Path(__file__).resolve().parents[1] / "conf"
    results: dict[int, dict[int, float]] = {}
    for mem_len in mem_lens:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = compose("config", overrides=[
                "data=recall", *PROBE_MODEL, "logger=none", "test=false", f"memory.mem_len={mem_len}",
                f"data.source.distances=[{','.join(map(str, distances))}]", f"trainer.max_steps={steps}",
                f"trainer.val_check_interval={steps}", f"paths.output_dir={out_dir / f'mem{mem_len}'}", *overrides,
            ])
        run = build_run(cfg)
        run.trainer.fit(run.module, datamodule=run.datamodule)
        exit_if_preempted(run.trainer)
        rows = np.asarray(run.datamodule.val_dataloader().rows)
        counts = recall_accuracy(run.module.model, rows, cfg.data.tgt_len, mem_len)
        results[mem_len] = {d: hit / total for d, (hit, total) in sorted(counts.items())}
    return results


def write_report(results: dict[int, dict[int, float]], distances: Sequence[int], out_dir: Path) -> str:
    """Markdown table and PNG plot of accuracy against distance, one line per memory length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header = "| mem_len | " + " | ".join(f"d={d}" for d in distances) + " |"
    lines = [header, "|" + "---|" * (len(distances) + 1)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mem_len, acc in results.items():
        lines.append(f"| {mem_len} | " + " | ".join(f"{acc.get(d, float('nan')):.2f}" for d in distances) + " |")
        ax.plot(distances, [acc.get(d, np.nan) for d in distances], marker="o", label=f"mem_len={mem_len}")
    ax.axhline(1 / len(KEYS), color="grey", linestyle=":", label="chance")
    ax.set(xlabel="distance d from key to query (tokens)", ylabel="recall accuracy", ylim=(0, 1.02),
           title="Memory probe: recall against distance")
    ax.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "probe.png", dpi=120)
    table = "\n".join(lines)
    (out_dir / "probe.md").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Recall accuracy against distance for several memory lengths.")
    parser.add_argument("--mem-lens", type=int, nargs="+", default=[0, 32, 64])
    parser.add_argument("--distances", type=int, nargs="+", default=[4, 16, 28, 40, 56, 72, 96, 128])
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--out", type=Path, default=Path("outputs/probe"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model.n_layer=3")
    args = parser.parse_args(argv)
    results = run_probe(args.mem_lens, args.distances, args.steps, args.out, args.overrides)
    print(write_report(results, args.distances, args.out))
    print(f"plot: {args.out / 'probe.png'}")


if __name__ == "__main__":
    main()
