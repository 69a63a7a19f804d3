"""The memory probe's corpus (``data=recall``; ``python -m xl.probe``): recall of one symbol over a known distance.

A synthetic byte stream of episodes ``KKKKKKKK…….?K……``: a key letter ``K`` (A–P) shown ``repeat`` times in a
row, ``d-1`` filler dots, a query mark ``?``, the key again (which the model must predict at the ``?``), then
``gap`` dots before the next episode. The distance d counts from the ``?`` back to the last shown copy of the
key, so the key is visible to the query exactly when d is within its reach. The filler is constant so that the
loss is all about the keys: the task is pure retrieval over a known distance. Why the key is repeated and the
episodes are kept apart is explained in :mod:`xl.probe`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence

import numpy as np

KEYS = b"ABCDEFGHIJKLMNOP"
FILLER = ord(".")
QUERY = ord("?")
SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}


def recall_bytes(distances: Sequence[int], n_episodes: int, seed: int, repeat: int = 8, gap: int = 160) -> bytes:
    """Episodes whose query is ``d`` positions after the key's last copy, d drawn uniformly from ``distances``."""
    if min(distances) < 1:
        raise ValueError(f"recall distances must be >= 1, got {list(distances)}")
    if repeat < 1 or gap < 0:
        raise ValueError(f"recall repeat must be >= 1 and gap >= 0, got repeat={repeat}, gap={gap}")
    rng = np.random.default_rng(seed)
    keys = np.frombuffer(KEYS, dtype=np.uint8)
    parts = []
    for d in rng.choice(np.asarray(distances), size=n_episodes):
        key = rng.choice(keys)
        parts.append(np.concatenate([np.full(repeat, key), np.full(d - 1, FILLER), [QUERY, key],
                                     np.full(gap, FILLER)]).astype(np.uint8))
    return np.concatenate(parts).tobytes()


class RecallSource:
    """The probe's corpus as a data source (``data=recall``): deterministic per split."""

    def __init__(self, distances: Sequence[int], episodes: int = 20000, eval_episodes: int = 2000, seed: int = 0,
                 repeat: int = 8, gap: int = 160):
        self.distances = [int(d) for d in distances]
        self.episodes, self.eval_episodes, self.seed = episodes, eval_episodes, seed
        self.repeat, self.gap = int(repeat), int(gap)

    def identity(self) -> str:
        # The alphabet and layout are part of the identity: a changed generator must not reuse an old token cache.
        spec = json.dumps(["v2", KEYS.decode(), chr(FILLER), self.distances, self.episodes, self.eval_episodes,
                           self.seed, self.repeat, self.gap])
        return "recall-" + hashlib.sha256(spec.encode()).hexdigest()[:16]

    def texts(self, split: str) -> Iterator[str]:
        n = self.episodes if split == "train" else self.eval_episodes
        seed = self.seed * 10 + SPLIT_SEEDS[split]
        yield recall_bytes(self.distances, n, seed, self.repeat, self.gap).decode("ascii")

    def setting(self, split: str) -> str:
        return "data.source.distances"
