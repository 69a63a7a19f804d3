"""The compressive memory's compressor and its training loss (Rae et al., 2019, "Compressive Transformers for
Long-Range Sequence Modelling").

Per layer, the states that leave the Transformer-XL memory are compressed ``rate`` to 1 and appended to a
compressed memory (the memory variant is :class:`xl.memory.compressive.CompressiveMemory`). Attention then runs over
``compressed ∘ memory ∘ segment`` as over one longer key sequence: a compressed slot is an ordinary earlier key
position, distances are counted in slots. That is the rule the relative shift already computes (no new position
code, and the path without a compressed memory does no extra work); distances stay monotone in time, since every
compressed slot summarises states older than every memory state, and slot j of the compressed memory stands
``C - j`` slots before the memory's first state.

Compression functions (``cmem_fn``):

- ``mean``: mean pooling of ``rate`` consecutive states (no parameters, nothing to train);
- ``conv``: a 1-D convolution with kernel and stride ``rate`` per layer, initialised as mean pooling and trained
  only by the attention-reconstruction loss (:func:`reconstruction_loss`).

The compressor maps whole groups of ``rate`` states, oldest first, to one slot each (the memory only ever hands it
whole groups); given a last group shorter than ``rate`` it pads it by repeating its newest state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from xl.model.memory import Layers

COMPRESSION_FNS = ("mean", "conv")


class Compressor(nn.Module):
    """One compression function per layer: [B, E, d] evicted states → [B, ceil(E / rate), d] slots."""

    def __init__(self, n_layer: int, d_model: int, rate: int, fn: str) -> None:
        super().__init__()
        if fn not in COMPRESSION_FNS:
            raise ValueError(f"cmem_fn must be one of {', '.join(COMPRESSION_FNS)}, got {fn!r}")
        self.rate, self.fn = rate, fn
        if fn == "conv":
            # Conv1d's layout [out, in, kernel] per layer; starting as mean pooling, the compressed memory is
            # useful from the first step and the reconstruction loss only has to improve on it.
            eye = torch.eye(d_model).expand(n_layer, rate, d_model, d_model).permute(0, 2, 3, 1) / rate
            self.weight = nn.Parameter(eye.contiguous())
            self.bias = nn.Parameter(torch.zeros(n_layer, d_model))

    @property
    def learned(self) -> bool:
        return self.fn == "conv"

    def matrix(self, layer: int) -> Tensor:
        """The convolution (kernel = stride = rate) as the [out, rate·in] matrix that maps a group of rate states,
        read state by state as one vector, to its slot: applied as a matmul, which on a CPU costs several times
        less than a convolution over a few groups. A copy: a caller that applies fixed weights often (the
        decoder) makes it once."""
        weight = self.weight[layer]
        return weight.permute(0, 2, 1).reshape(weight.size(0), -1)

    def forward(self, layer: int, states: Tensor, matrix: Tensor | None = None) -> Tensor:
        """``matrix``: :meth:`matrix` of ``layer``, if already made."""
        B, E, d = states.shape
        if not E:
            return states
        pad = -E % self.rate
        if pad:
            states = torch.cat([states, states[:, -1:].expand(B, pad, d)], dim=1)
        groups = states.reshape(B, -1, self.rate, d)
        if self.fn == "mean":
            return groups.mean(2)
        matrix = self.matrix(layer) if matrix is None else matrix
        return F.linear(groups.flatten(2), matrix.to(states.dtype), self.bias[layer].to(states.dtype))


def reconstruction_loss(layers: Layers, layer_inputs: list[Tensor], evicted: list[Tensor],
                        compressed: list[Tensor]) -> Tensor:
    """The attention-reconstruction loss of Rae et al. (2019): per layer, the mean squared difference between the
    content attention of the segment's queries over the evicted states and over their compression, summed over
    layers. Queries, evicted states and the attention's weights are detached, so only the compressor learns."""
    total = layer_inputs[0].new_zeros(())
    for n, (h, old, new) in enumerate(zip(layer_inputs, evicted, compressed, strict=True)):
        h = h.detach()
        with torch.no_grad():
            target = layers.content_attention(n, h, old.to(h.dtype))
        total = total + (layers.content_attention(n, h, new.to(h.dtype)) - target).pow(2).mean()
    return total
