"""What ranks exchange, in two real gloo processes: each rank's RNG states, and one non-finite decision for all."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xl.checkpoint import gather_rng_states, set_rng_state
from xl.lit import agree_across_ranks


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
        torch.save({"own": own, "states": states, "raised": raised, "quiet": quiet,
                    "restored": torch.get_rng_state()}, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_save_their_own_rng_states_and_agree_on_skipping(tmp_path: Path):
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert not torch.equal(results[0]["own"], results[1]["own"])
    for result in results:
        assert [torch.equal(s["torch"], results[i]["own"]) for i, s in enumerate(result["states"])] == [True, True]
        assert torch.equal(result["restored"], result["own"])  # its own stream, not rank 0's
        assert bool(result["raised"]) and not bool(result["quiet"])
