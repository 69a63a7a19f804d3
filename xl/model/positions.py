"""Relative positions of Transformer-XL: the sinusoidal table of distances and the causal (or same-length) mask."""

from __future__ import annotations

import torch
from torch import Tensor


def sinusoid(positions: Tensor, d_model: int) -> Tensor:
    """Sinusoidal embedding of (relative) positions, as in Vaswani et al. and Dai et al."""
    # float64 so that every dtype gets the correctly rounded table; it is built once per shape.
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device) / d_model))
    angles = positions.double()[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_embeddings(length: int, clamp_len: int, d_model: int, device: torch.device) -> Tensor:
    """Embeddings [length, d] of distances length-1 … 0 (the farthest key first); with ``clamp_len`` > 0,
    distances beyond it share its embedding."""
    distances = torch.arange(length - 1, -1, -1, device=device)
    return sinusoid(distances.clamp(max=clamp_len) if clamp_len > 0 else distances, d_model)


def attention_mask(q_len: int, m_len: int, window: int | None, device: torch.device) -> Tensor:
    """Additive [L, M+L] mask: 0 where query i (at key position M+i) may look, -inf elsewhere.

    Keys after the query are hidden; with ``window`` (same_length) so are keys at or beyond
    ``window`` positions back, so every query sees the same number of keys.
    """
    q_pos = torch.arange(m_len, m_len + q_len, device=device)[:, None]
    k_pos = torch.arange(m_len + q_len, device=device)[None, :]
    masked = k_pos > q_pos
    if window is not None:
        masked |= k_pos <= q_pos - window
    return torch.zeros(masked.shape, device=device).masked_fill(masked, float("-inf"))
