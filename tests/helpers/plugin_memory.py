"""A memory variant defined outside the package, as a user would write one: the compressive memory with max pooling
(one of the compression functions Rae et al., 2019, compare) instead of the package's mean or learned convolution.
It has no weights of its own, its own name, and reuses the compressive memory's state and slots; the package knows
nothing of it: a run selects it with
``memory=compressive memory._target_=tests.helpers.plugin_memory.MaxPoolConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from xl.memory.compressive import CompressiveConfig, CompressiveMemory


class MaxPool(nn.Module):
    """Each group of ``rate`` states becomes its elementwise maximum (no weights)."""

    learned = False

    def __init__(self, rate: int) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, layer: int, states: Tensor, matrix: Tensor | None = None) -> Tensor:
        B, T, d = states.shape
        return states.reshape(B, T // self.rate, self.rate, d).amax(2)


@dataclass
class MaxPoolConfig(CompressiveConfig):
    name = "maxpool"

    def memory(self, config) -> MaxPoolMemory:
        return MaxPoolMemory(config)


class MaxPoolMemory(CompressiveMemory):
    def build(self) -> dict[str, nn.Module]:
        self.compressor = MaxPool(self.rate)
        return {}
