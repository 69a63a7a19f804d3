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

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from xl.memory.knn.store import COUNT, KEYS, VALUES, fill, flat_rows

SEARCHES = ("exact", "faiss")


@dataclass
class Retrieved:
    """The slots ``index`` [B, H, L, k] (int64) of each query's best entries, best first, and ``valid`` [B, H, L, k]
    (False: no entry there; its slot is 0)."""

    index: Tensor
    valid: Tensor


def search(kind: str, queries: Tensor, state: list[Tensor], k: int, visible: Tensor | None = None,
           limit: int | None = None, workspace: Workspace | None = None) -> Retrieved:
    """The k best entries of ``state`` for each query [B, H, L, D] (``kind``: one of :data:`SEARCHES`). ``visible``
    [B, L]: queries that may see their row's store (None: all). ``limit``: slots that may hold an entry in any row, a
    host-side bound that spares searching a store still filling (None: all). ``workspace``: the exact search's
    scores buffer, kept by the caller from one search to the next (:class:`Workspace`)."""
    if kind == "exact":
        return exact_topk(queries, state, k, visible, limit, workspace)
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


GROUP = 32  # slots whose best score the exact search's first pass keeps together (see _topk)


class Workspace:
    """Buffers kept from one search to the next: the exact search's scores (B·H·L·N values, 256 MiB at config S with
    16,384 entries) and, for :func:`gather` without gradient, the retrieved keys and values (32 MiB each there). A
    CPU allocates a fresh tensor of such a size by mapping new pages and faulting each one in, which costs about as
    much as filling it: four times the gather's own time at config S."""

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A tensor of ``shape`` in the buffer ``name``, its contents undefined; what an earlier call returned for
        that name becomes invalid."""
        need = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            # An ordinary tensor even under torch.inference_mode (Lightning evaluates in it), so that training can
            # write into it afterwards.
            with torch.inference_mode(False):
                self.buffers[name] = buf = torch.empty(need, dtype=dtype, device=device)
        return buf[:need].view(shape)


def _topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest scores of each row of ``scores`` [R, N] and their columns, largest first (ties in any order).

    Two passes instead of one ``topk`` over N: the rows' k best groups of GROUP columns by their maxima, then the k
    best columns of those k·GROUP. Exact: the k-th largest group maximum T has k columns at or above it, so every
    column among the k largest is at least T, and lies in a group whose maximum is at least T.

    A group is GROUP adjacent columns for float32 and float64 scores, and GROUP columns N / GROUP apart for 16-bit
    ones: torch's CPU kernels reduce a 16-bit innermost dimension of 32 several times slower than the same values
    across rows (``python -m xl.bench.knn --only segment --dtype bfloat16``), and for 32-bit values the
    adjacent groups' candidates are cheaper to gather.
    """
    R, N = scores.shape
    G = N // GROUP
    if N % GROUP or G <= k:
        return scores.topk(k, dim=-1)
    if scores.element_size() < 4:  # group j: columns j, j + G, ..., j + (GROUP - 1)·G
        spread = scores.view(R, GROUP, G)
        groups = spread.amax(1).topk(k, dim=-1, sorted=False).indices  # [R, k]
        candidates = spread.gather(2, groups[:, None, :].expand(R, GROUP, k)).view(R, GROUP * k)
        values, j = candidates.topk(k, dim=-1)
        return values, (j // k) * G + groups.gather(-1, j % k)
    groups = scores.view(R, G, GROUP).amax(-1).topk(k, dim=-1, sorted=False).indices  # [R, k]
    rows = (torch.arange(R, device=scores.device)[:, None] * G + groups).flatten()
    candidates = scores.view(R * G, GROUP).index_select(0, rows).view(R, k * GROUP)
    values, j = candidates.topk(k, dim=-1)
    return values, groups.gather(-1, j // GROUP) * GROUP + j % GROUP


@torch.no_grad()
def exact_topk(queries: Tensor, state: list[Tensor], k: int, visible: Tensor | None = None,
               limit: int | None = None, workspace: Workspace | None = None) -> Retrieved:
    """Exact top-k by one batched product (see the module docstring); ``workspace`` keeps the scores' buffer."""
    _check(queries, state, k)
    keys = state[KEYS]
    N = keys.size(2) if limit is None else max(0, min(limit, keys.size(2)))
    B, H, L, _ = queries.shape
    index = torch.zeros(B, H, L, k, dtype=torch.long, device=keys.device)
    valid = torch.zeros(B, H, L, k, dtype=torch.bool, device=keys.device)
    best = min(k, N)
    if best:
        shape = (B, H, L, N)
        out = torch.empty(shape, dtype=keys.dtype, device=keys.device) if workspace is None else \
            workspace.get("scores", shape, keys.dtype, keys.device)
        scores = torch.matmul(queries.to(keys.dtype), keys[:, :, :N].transpose(-1, -2), out=out)
        fills = fill(state)
        # Slots past a row's fill hold nothing (or a forgotten document): hidden. On the CPU, reading whether any
        # row is short costs nothing and spares a pass over the scores in the steady state.
        if keys.device.type != "cpu" or bool((fills < N).any()):
            scores.masked_fill_((torch.arange(N, device=keys.device) >= fills[:, None])[:, None, None], float("-inf"))
        values, top = _topk(scores.view(B * H * L, N), best)
        found = (values > float("-inf")).view(B, H, L, best)
        if visible is not None:
            found &= visible[:, None, :, None]
        index[..., :best] = torch.where(found, top.view(B, H, L, best), 0)
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
def entry_ages(state: list[Tensor], retrieved: Retrieved) -> Tensor:
    """Each retrieved entry's age, the entries written to its row after it, [B, H, L, k] int64; a place with no entry
    gets ``N`` plus its index, older than any entry. The entry written m-th to a row sits in slot ``m % N``
    (:mod:`xl.memory.knn.store`), so a slot's age is ``(count - 1 - slot) mod N``: no position is stored."""
    N = state[KEYS].size(2)
    count = state[COUNT].view(-1, 1, 1, 1)
    age = torch.remainder(count - 1 - retrieved.index, N)
    return torch.where(retrieved.valid, age, N + torch.arange(retrieved.index.size(-1), device=age.device))


@torch.no_grad()
def recency_ranks(ages: Tensor) -> Tensor:
    """Each retrieved entry's rank by age among its query's retrieved entries, from :func:`entry_ages`, [B, H, L, k]
    int64: 0 the newest, the places with no entry last."""
    return ages.argsort(-1).argsort(-1)


@torch.no_grad()
def gather(state: list[Tensor], retrieved: Retrieved, workspace: Workspace | None = None) -> tuple[Tensor, Tensor]:
    """The retrieved keys and values, each [B, H, L, k, D] in the store's dtype, without gradient (copies: writing
    the store afterwards leaves them as they are). ``workspace``: written into its buffers, valid until the next
    gather with it (for evaluation; a training step keeps them for its backward pass, so it passes none)."""
    keys, values = state[KEYS], state[VALUES]
    B, H, N, D = keys.shape
    index = retrieved.index
    rows = flat_rows(B, H, N, index)
    shape = (*index.shape, D)
    out = [None, None] if workspace is None else \
        [workspace.get(name, (rows.numel(), D), keys.dtype, keys.device) for name in ("keys", "values")]
    return (torch.index_select(keys.reshape(B * H * N, D), 0, rows, out=out[0]).view(shape),
            torch.index_select(values.reshape(B * H * N, D), 0, rows, out=out[1]).view(shape))
