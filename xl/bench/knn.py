"""What the retrieval memory costs (run as python -m xl.bench.knn), in three parts, each timed in interleaved
rounds in one process so that a shared CPU slows every piece alike:

- ``model``: the model at config S (batch 8, segments of 128, ``mem_len`` 128) with ``memory=knn`` (one retrieval
  layer, the default, its store full: 16,384 random entries per row and head) against the same model with the plain
  memory: a training step (forward, backward, AdamW) and an evaluation step (cached keys/values) of each, and the
  ratios. This is the whole retrieval memory as a run uses it.
- ``segment``: the same shape, piece by piece: the search (exact, or faiss), gathering the retrieved entries (into
  fresh tensors in training, which keeps them for its backward pass; into the search's workspace in evaluation), the
  gated attention (forward; forward and backward in training) and writing the entries that left the window (the ring
  buffer; and, for comparison, a store that shifts its entries instead), against the local attention sublayer of
  one layer and against the whole model's segment. The pieces added to the model's segment estimate a model with one
  retrieval layer: that sum over the model's time is printed as the estimated ratio.
- ``crossover``: the exact search against faiss's for stores of 4K to 256K entries (4 heads of 64, batch 16, 32
  queries per segment by default): where faiss becomes the faster one.

Times are medians of the rounds' medians (one warm-up call, then 3 timed calls per round), in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from torch import Tensor

from xl.bench.runner import SegmentRunner, token_stream
from xl.bench.shared import CONFIG_S, cpu_model, interleaved_rates
from xl.memory.knn import store
from xl.memory.knn.attention import default_layers, gated_retrieval, initial_scale
from xl.memory.knn.memory import KnnConfig
from xl.memory.knn.search import Workspace, exact_topk, faiss_topk, gather
from xl.model.config import XLConfig
from xl.model.transformer import TransformerXL
from xl.training.services.console import plain_text

PARTS = ("model", "segment", "crossover")


def full_store(batch: int, n_head: int, size: int, d_head: int, dtype: torch.dtype = torch.float32,
               seed: int = 0) -> list[Tensor]:
    """A store of ``size`` random entries per row and head, every slot filled (the steady state of a long text)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, n_head, size, d_head)
    keys = torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1)
    return [keys.to(dtype), torch.randn(shape, generator=gen).to(dtype), torch.full((batch,), size)]


def recall(state: list[Tensor], queries: Tensor, top_k: int, dtype: torch.dtype) -> float:
    """The share of the entries an exact float32 search retrieves that the same search retrieves from the store
    kept in ``dtype``."""
    exact = exact_topk(queries, state, top_k)
    low = exact_topk(queries, [t.to(dtype) if t.is_floating_point() else t for t in state], top_k)
    hits = (exact.index[..., :, None] == low.index[..., None, :]).any(-1)
    return float(hits.float().mean())


def medians_ms(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds per call of each run over interleaved rounds."""
    rates = interleaved_rates({name: (run, 1.0) for name, run in runs.items()}, rounds)
    return {name: 1000.0 / statistics.median(r) for name, r in rates.items()}


def model_runs(batch: int, tgt_len: int, size: int, top_k: int, search: str,
               dtype: torch.dtype = torch.float32) -> dict[str, Callable[[], object]]:
    """The ``model`` part: a training and an evaluation step of the plain model and of the model with a full
    retrieval store, by name. ``dtype``: both models' ``mem_dtype`` (the cache's, and the store's)."""
    base = {**CONFIG_S, "mem_dtype": str(dtype).removeprefix("torch.")}
    plain = XLConfig(**base)
    knn = XLConfig(**{**base, "memory": KnnConfig(knn_size=size, knn_top_k=top_k, knn_search=search)})
    stream = token_stream(plain, batch, tgt_len, 8)
    runs = {}
    for name, cfg in (("plain", plain), ("knn", knn)):
        for mode in ("train", "eval"):
            torch.manual_seed(0)
            model = TransformerXL(cfg)
            runner = SegmentRunner(model, stream, tgt_len, train=mode == "train")
            runner.run(cfg.mem_len // tgt_len + 1)  # a full cache before timing
            if name == "knn":  # and a full store in the retrieval layer
                n = cfg.n_layer
                runner.mems = runner.mems[:n] + full_store(batch, cfg.n_head, size, cfg.d_head, dtype)
            runs[f"{mode}/{name}"] = lambda r=runner: r.run(1)
    return runs


def report_model(ms: dict[str, float]) -> dict[str, float]:
    """Print the ``model`` part's table and ratios; return both."""
    out = dict(ms)
    print(f"  {'step':<6}  {'plain ms':>9}  {'knn ms':>9}  knn/plain")
    for mode in ("train", "eval"):
        out[f"{mode}/ratio"] = ms[f"{mode}/knn"] / ms[f"{mode}/plain"]
        print(f"  {mode:<6}  {ms[f'{mode}/plain']:>9.1f}  {ms[f'{mode}/knn']:>9.1f}  {out[f'{mode}/ratio']:>8.2f}x")
    return out


def segment_runs(batch: int, tgt_len: int, size: int, top_k: int, search: str,
                 dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The pieces timed in the ``segment`` part (see the module docstring), by name."""
    torch.manual_seed(0)
    cfg = XLConfig(**CONFIG_S)
    H, D, M, L = cfg.n_head, cfg.d_head, cfg.mem_len, tgt_len
    stream = token_stream(cfg, batch, tgt_len, 8)
    train = SegmentRunner(TransformerXL(cfg), stream, tgt_len, train=True)
    evaluate = SegmentRunner(TransformerXL(cfg), stream, tgt_len)
    for runner in (train, evaluate):
        runner.run(M // tgt_len + 1)  # a full memory before timing
    model = TransformerXL(cfg)
    attn = model.layers[default_layers(cfg.n_layer)[0]].attn
    pos_emb, mask = model._context(L, M, cfg.clamp_len, None)
    h, mem = torch.randn(batch, L, cfg.d_model), torch.randn(batch, M, cfg.d_model)
    h_grad = h.clone().requires_grad_()
    with torch.no_grad():
        mem_kv = attn.project_memory(mem)

    def local_eval() -> None:
        with torch.no_grad():
            attn.eval()(h, mem, pos_emb, mask, mem_kv)

    def local_train() -> None:
        attn.train()(h_grad, mem, pos_emb, mask)[0].sum().backward()

    state = full_store(batch, H, size, D, dtype)
    queries, local = torch.randn(batch, H, L, D), torch.randn(batch, H, L, D)
    q_grad, local_grad = queries.clone().requires_grad_(), local.clone().requires_grad_()
    gate = torch.zeros(H, requires_grad=True)
    scale = torch.full((H,), initial_scale(top_k), requires_grad=True)
    workspace = Workspace()

    def find(q: Tensor, s: list[Tensor], k: int):
        return exact_topk(q, s, k, workspace=workspace) if search == "exact" else faiss_topk(q, s, k)

    found = find(queries, state, top_k)
    keys, values = gather(state, found)
    new_k, new_v = torch.randn(batch, H, L, D), torch.randn(batch, H, L, D)

    def attend_eval() -> None:
        with torch.no_grad():
            gated_retrieval(queries, local, keys, values, found.valid, gate, scale)

    def attend_train() -> None:
        gated_retrieval(q_grad, local_grad, keys, values, found.valid, gate, scale).sum().backward()

    def shift() -> None:  # the alternative to the ring: every entry moves back by the n written
        for i, new in ((store.KEYS, new_k), (store.VALUES, new_v)):
            state[i] = torch.cat([state[i][:, :, L:], new.to(state[i].dtype)], 2)  # the store keeps its dtype

    return {
        "train/model": lambda: train.run(1), "eval/model": lambda: evaluate.run(1),
        "train/local attention": local_train, "eval/local attention": local_eval,
        f"search ({search})": lambda: find(queries, state, top_k),
        "train/gather": lambda: gather(state, found), "eval/gather": lambda: gather(state, found, workspace),
        "train/gated attention": attend_train, "eval/gated attention": attend_eval,
        "write (ring)": lambda: store.write(state, new_k, new_v), "write (shift)": shift,
    }


def report_segment(ms: dict[str, float], search: str) -> dict[str, float]:
    """Print the ``segment`` part's table and the estimated ratios; return both."""
    width = max(map(len, ms))
    print(f"  {'piece':<{width}}  {'ms/segment':>10}")
    for name, value in ms.items():
        print(f"  {name:<{width}}  {value:>10.2f}")
    shared = ms[f"search ({search})"] + ms["write (ring)"]
    out = dict(ms)
    for mode in ("train", "eval"):
        extra = shared + ms[f"{mode}/gather"] + ms[f"{mode}/gated attention"]
        out[f"{mode}/ratio"] = (ms[f"{mode}/model"] + extra) / ms[f"{mode}/model"]
        out[f"{mode}/vs local"] = extra / ms[f"{mode}/local attention"]
        print(f"  {mode}: retrieval adds {extra:.1f} ms to the model's {ms[f'{mode}/model']:.1f} ms "
              f"(estimated ratio {out[f'{mode}/ratio']:.2f}x; {out[f'{mode}/vs local']:.2f}x one local attention)")
    return out


def crossover(batch: int, queries: int, sizes: list[int], top_k: int, rounds: int) -> dict[int, dict[str, float]]:
    """Per store size, the median milliseconds of the exact and the faiss search (the ``crossover`` part)."""
    cfg = XLConfig(**CONFIG_S)
    out = {}
    gen = torch.Generator().manual_seed(1)
    for size in sizes:
        keys = torch.nn.functional.normalize(torch.randn(batch, cfg.n_head, size, cfg.d_head, generator=gen), dim=-1)
        state = [keys, keys, torch.full((batch,), size)]  # the values are not searched: the keys stand in for them
        q = torch.randn(batch, cfg.n_head, queries, cfg.d_head, generator=gen)
        workspace = Workspace()
        out[size] = medians_ms({"exact": lambda s=state, q=q, w=workspace: exact_topk(q, s, top_k, workspace=w),
                                "faiss": lambda s=state, q=q: faiss_topk(q, s, top_k)}, rounds)
        del keys, state, workspace
    return out


def report_crossover(times: dict[int, dict[str, float]]) -> int | None:
    """Print the ``crossover`` table; return the smallest size at which faiss is faster (None: none)."""
    print(f"  {'entries':>8}  {'exact ms':>9}  {'faiss ms':>9}  faiss/exact")
    for size, t in times.items():
        print(f"  {size:>8,}  {t['exact']:>9.1f}  {t['faiss']:>9.1f}  {t['faiss'] / t['exact']:>10.2f}x")
    faster = [size for size, t in times.items() if t["faiss"] < t["exact"]]
    first = min(faster) if faster else None
    print(f"  faiss is faster from {first:,} entries" if first else "  faiss is faster at none of these sizes")
    return first


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(prog="python -m xl.bench.knn", description=plain_text(__doc__.splitlines()[0]))
    p.add_argument("--only", choices=PARTS, action="append", help="run only these parts (repeatable); default all")
    p.add_argument("--batch", type=int, default=8, help="model and segment parts: batch rows")
    p.add_argument("--tgt-len", type=int, default=128, help="model and segment parts: segment length")
    p.add_argument("--size", type=int, default=16384, help="model and segment parts: store entries per row and head")
    p.add_argument("--search", choices=("exact", "faiss"), default="exact", help="model and segment parts: the search")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model and segment parts: the store's dtype (a bfloat16 store is searched in bfloat16; "
                        "in the model part, both models' mem_dtype)")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--cross-batch", type=int, default=16, help="crossover part: batch rows")
    p.add_argument("--cross-queries", type=int, default=32, help="crossover part: queries per row and head")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536, 262144],
                   help="crossover part: store sizes")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.batch, args.tgt_len, args.size, args.top_k, args.cross_batch, args.cross_queries, *args.sizes) < 1:
        p.error("sizes, lengths, batches and --top-k must be >= 1")
    parts = args.only or list(PARTS)
    torch.set_num_threads(args.threads)
    if "crossover" in parts or args.search == "faiss":
        import faiss  # the knn extra: pip install -e .[knn]

        faiss.omp_set_num_threads(args.threads)
    print(f"machine: {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
          f"{args.threads} thread(s); {args.rounds} interleaved "
          f"rounds; config S (4 heads of 64), top-k {args.top_k}")
    results: dict[str, object] = {}
    dtype = getattr(torch, args.dtype)
    if "model" in parts:
        print(f"model: batch {args.batch}, segments of {args.tgt_len}, mem_len {CONFIG_S['mem_len']}, memory=knn "
              f"with a full store of {args.size:,} entries per row and head ({args.search} search) against the "
              f"plain memory, mem_dtype {args.dtype}")
        runs = model_runs(args.batch, args.tgt_len, args.size, args.top_k, args.search, dtype)
        results["model"] = report_model(medians_ms(runs, args.rounds))
    if "segment" in parts:
        print(f"segment: batch {args.batch}, segments of {args.tgt_len}, mem_len {CONFIG_S['mem_len']}, "
              f"store of {args.size:,} entries per row and head in {args.dtype}")
        runs = segment_runs(args.batch, args.tgt_len, args.size, args.top_k, args.search, dtype)
        results["segment"] = report_segment(medians_ms(runs, args.rounds), args.search)
        if dtype != torch.float32:
            state = full_store(args.batch, CONFIG_S["n_head"], args.size, CONFIG_S["d_head"])
            queries = torch.randn(args.batch, CONFIG_S["n_head"], args.tgt_len, CONFIG_S["d_head"])
            results["recall"] = recall(state, queries, args.top_k, dtype)
            print(f"  recall of the {args.dtype} search (random entries): {results['recall']:.3f} of the float32 "
                  "search's entries")
    if "crossover" in parts:
        print(f"crossover: batch {args.cross_batch}, {args.cross_queries} queries per row and head")
        times = crossover(args.cross_batch, args.cross_queries, args.sizes, args.top_k, args.rounds)
        results["crossover"] = times
        results["crossover_at"] = report_crossover(times)
    return results


if __name__ == "__main__":
    main()
