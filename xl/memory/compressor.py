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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def content_attention(attn: nn.Module, x: Tensor, mem: Tensor) -> Tensor:
    """Heads' outputs [B, H, L, D] of the content attention (no position term) of queries from ``x`` [B, L, d]
    over keys/values from ``mem`` [B, T, d], with the layer's projections held fixed (detached)."""
    B, L, _ = x.shape
    H, D = attn.n_head, attn.d_head
    if attn.pre_lnorm:
        ln = attn.layer_norm
        x, mem = (F.layer_norm(t, ln.normalized_shape, ln.weight.detach(), ln.bias.detach(), ln.eps) for t in (x, mem))
    q = F.linear(x, attn.q_net.weight.detach()).view(B, L, H, D) + attn.r_w_bias.detach()
    k, v = F.linear(mem, attn.kv_net.weight.detach()).view(B, mem.size(1), 2, H, D).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=attn.scale)


def reconstruction_loss(layers: nn.ModuleList, layer_inputs: list[Tensor], evicted: list[Tensor],
                        compressed: list[Tensor]) -> Tensor:
    """The attention-reconstruction loss of Rae et al. (2019): per layer, the mean squared difference between the
    content attention of the segment's queries over the evicted states and over their compression, summed over
    layers. Queries, evicted states and the attention's weights are detached, so only the compressor learns."""
    total = layer_inputs[0].new_zeros(())
    for layer, h, old, new in zip(layers, layer_inputs, evicted, compressed, strict=True):
        h = h.detach()
        with torch.no_grad():
            target = content_attention(layer.attn, h, old.to(h.dtype))
        total = total + (content_attention(layer.attn, h, new.to(h.dtype)) - target).pow(2).mean()
    return total
