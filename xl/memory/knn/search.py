"""Top-k search of a retrieval store (:mod:`xl.memory.knn.store`) and the retrieved entries.

Each query of a row and head is matched against that row's and head's entries by inner product with the unit keys
(the query's own length does not change which entries win, so queries need not be normalised here). Two searches
return the same entries (:data:`SEARCHES`, ``memory.knn_search``):

- ``exact``: one batched product of the queries with every slot that may hold an entry, then ``topk``. Empty slots
  and queries that may not see their store (:func:`xl.memory.knn.store.sees_store`) are masked. Runs on the store's
  device, in the store's dtype (a bfloat16 store is searched in bfloat16: faster where the hardware computes it
  natively, and no longer exact).
- ``faiss``: faiss's brute-force inner-product search (what ``IndexFlatIP`` runs), one call per row and head (faiss
  searches one database per call), in float32 on the CPU.

Both return the k best entries of each query in descending order of score (ties in any order); a query with fewer
than k visible entries gets the rest marked invalid. Neither carries a gradient: the store takes none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xl.memory.knn.store import KEYS, VALUES, fill

SEARCHES = ("exact", "faiss")


@dataclass
class Retrieved:
    """The slots ``index`` [B, H, L, k] (int64) of each query's best entries, best first, and ``valid`` [B, H, L, k]
    (False: no entry there; its slot is 0)."""

    index: Tensor
    valid: Tensor


def search(kind: str, queries: Tensor, state: list[Tensor], k: int, visible: Tensor | None = None,
           limit: int | None = None) -> Retrieved:
    """The k best entries of ``state`` for each query [B, H, L, D] (``kind``: one of :data:`SEARCHES`). ``visible``
    [B, L]: queries that may see their row's store (None: all). ``limit``: slots that may hold an entry in any row, a
    host-side bound that spares searching a store still filling (None: all)."""
    if kind == "exact":
        return exact_topk(queries, state, k, visible, limit)
    if kind == "faiss":
        return faiss_topk(queries, state, k, visible, limit)
    raise ValueError(f"unknown retrieval search {kind!r}; set memory.knn_search to one of {', '.join(SEARCHES)}")


def _check(queries: Tensor, state: list[Tensor], k: int) -> None:
    keys = state[KEYS]
    if queries.dim() != 4 or queries.shape[:2] != keys.shape[:2] or queries.size(3) != keys.size(3):
        raise ValueError(f"queries must be [B, H, L, D] = [{keys.size(0)}, {keys.size(1)}, L, {keys.size(3)}] like "
                         f"the store, got {tuple(queries.shape)}")
    if k < 1:
        raise ValueError(f"memory.knn_top_k must be >= 1, got {k}")


@torch.no_grad()
def exact_topk(queries: Tensor, state: list[Tensor], k: int, visible: Tensor | None = None,
               limit: int | None = None) -> Retrieved:
    """Exact top-k by one batched product (see the module docstring)."""
    _check(queries, state, k)
    keys = state[KEYS]
    N = keys.size(2) if limit is None else max(0, min(limit, keys.size(2)))
    B, H, L, _ = queries.shape
    scores = torch.matmul(queries.to(keys.dtype), keys[:, :, :N].transpose(-1, -2))  # [B, H, L, N]
    hidden = (torch.arange(N, device=keys.device) >= fill(state)[:, None])[:, None, None, :]  # empty slots
    if visible is not None:
        hidden = hidden | ~visible[:, None, :, None]
    scores.masked_fill_(hidden, float("-inf"))
    best = min(k, N)
    top = scores.topk(best, dim=-1) if best else None
    index = torch.zeros(B, H, L, k, dtype=torch.long, device=keys.device)
    valid = torch.zeros(B, H, L, k, dtype=torch.bool, device=keys.device)
    if top is not None:
        found = top.values > float("-inf")
        index[..., :best] = torch.where(found, top.indices, 0)
        valid[..., :best] = found
    return Retrieved(index, valid)


@torch.no_grad()
def faiss_topk(queries: Tensor, state: list[Tensor], k: int, visible: Tensor | None = None,
               limit: int | None = None) -> Retrieved:
    """faiss's exact inner-product search, one row and head at a time (see the module docstring)."""
    import faiss  # an optional dependency: pip install faiss-cpu (the project's knn extra)

    _check(queries, state, k)
    keys = state[KEYS]
    if keys.device.type != "cpu":
        raise ValueError("memory.knn_search=faiss searches a store on the CPU; this one is on "
                         f"{keys.device.type}: use memory.knn_search=exact")
    B, H, L, D = queries.shape
    fills = fill(state).tolist()
    if limit is not None:
        fills = [min(f, max(0, limit)) for f in fills]
    q = queries.detach().to(torch.float32).contiguous().numpy()
    base = keys.to(torch.float32).contiguous().numpy()  # a view when the store is float32
    index = torch.zeros(B, H, L, k, dtype=torch.long)
    found = torch.zeros(B, H, L, k, dtype=torch.bool)
    for b in range(B):
        if not fills[b]:
            continue
        for h in range(H):
            _, ids = faiss.knn(q[b, h], base[b, h, :fills[b]], k, faiss.METRIC_INNER_PRODUCT)
            ids = torch.from_numpy(ids)
            index[b, h] = ids.clamp(min=0)
            found[b, h] = ids >= 0
    if visible is not None:
        found &= visible[:, None, :, None].cpu()
        index.masked_fill_(~found, 0)
    return Retrieved(index.to(keys.device), found.to(keys.device))


@torch.no_grad()
def gather(state: list[Tensor], retrieved: Retrieved) -> tuple[Tensor, Tensor]:
    """The retrieved keys and values, each [B, H, L, k, D] in the store's dtype, without gradient (copies: writing
    the store afterwards leaves them as they are)."""
    keys, values = state[KEYS], state[VALUES]
    B, H, N, D = keys.shape
    index = retrieved.index
    rows = (torch.arange(B * H, device=index.device).view(B, H, 1, 1) * N + index).flatten()
    shape = (*index.shape, D)
    return (keys.reshape(B * H * N, D).index_select(0, rows).view(shape),
            values.reshape(B * H * N, D).index_select(0, rows).view(shape))
