"""What ranks exchange, in two real gloo processes (started once for all the tests here): each rank's RNG states, one
non-finite decision for all, and the metrics' sums."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import metric_ranks
from xl.training.checkpoints.checkpoint import gather_rng_states, set_rng_state
from xl.training.loop.nonfinite import agree_across_ranks


def _rank_main(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        torch.manual_seed(100 + rank)  # each rank's dropout draws its own stream
        own = torch.get_rng_state()
        states = gather_rng_states(2)
        # Rank 1 alone sees a non-finite shard of the gradients (as under FSDP), then no rank does.
        raised = agree_across_ranks(torch.tensor(rank == 1))
        quiet = agree_across_ranks(torch.tensor(False))
        torch.manual_seed(7)
        set_rng_state(states[rank])  # what a resumed rank gets back
        restored = torch.get_rng_state()
        metrics = metric_ranks.metrics()
        for batch in metric_ranks.batches(rank):
            metrics.update("val", *batch)
        figures = {k: float(v) for k, v in metrics.compute("val").items()}
        torch.save({"own": own, "states": states, "raised": raised, "quiet": quiet, "restored": restored,
                    "figures": figures}, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank_main, args=(str(folder),), nprocs=2, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_ranks_save_their_own_rng_states_and_agree_on_skipping(ranks):
    results = ranks
    assert not torch.equal(results[0]["own"], results[1]["own"])
    for result in results:
        assert [torch.equal(s["torch"], results[i]["own"]) for i, s in enumerate(result["states"])] == [True, True]
        assert torch.equal(result["restored"], result["own"])  # its own stream, not rank 0's
        assert bool(result["raised"]) and not bool(result["quiet"])


def test_ranks_reduce_the_bytes_spelled_for_unk_into_the_figures_of_one_process(ranks):
    """Each rank scores its own batches (with <unk> and their lengths, a different number per rank); the figures
    every rank computes are those of one process that scored all of them."""
    reference = metric_ranks.metrics()
    for batch in metric_ranks.batches(0) + metric_ranks.batches(1):
        reference.update("val", *batch)
    expected = {k: float(v) for k, v in reference.compute("val").items()}
    for result in ranks:
        assert result["figures"].keys() == expected.keys() and result["figures"]["val/unk_share"] > 0
        assert result["figures"] == pytest.approx(expected, rel=1e-14)
