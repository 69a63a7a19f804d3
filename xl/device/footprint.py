"""What a run holds on its device: the memory cache, the evaluation memory, the weights, one step's activations.

The cache is exact: one tensor per layer holds that layer's input for the last ``mem_len`` positions, so it is
``n_layer`` tensors of ``[batch, mem_len, d_model]`` (:func:`cache_footprint`); a compressive memory (Rae et al.,
2019) adds its compressed slots of the same width per layer, ``[batch, mem_len + slots, d_model]``.
:func:`run_footprint` adds the rest of a training run, per device (each rank holds its own batch rows):

* evaluation memory: the same product at ``eval_mem_len`` and the evaluation batch, plus the projected keys and
  values that evaluation carries with it, ``2 × eval_mem_len × n_head × d_head × n_layer × eval batch``; the last
  validation's stays allocated while training goes on;
* parameters, gradients and AdamW's two moments: four copies of the weights;
* activations kept for the backward pass of one training step. Per segment, with ``L`` the positions the layers
  run over (the segment and any positions the memory adds: memory tokens) and ``K`` keys per query (the memory's keys,
  ``mem_len + slots`` for the cache, and ``L``), per layer: the attention probabilities and the position scores, ``2
  × B × H × L × K`` (one more with attention dropout, its mask); keys and values over memory ∘ segment, ``2 × B × K × H
  × D``; content and position queries, ``2 × B × L × H × D``; the feed-forward hidden layer, ``2 × B × L × d_inner``;
  six ``B × L × d_model`` tensors (layer input, attention output, norms, residual sums); the memory's ``M`` states, ``B
  × M × d_model`` (twice with pre-LN), the input of their key/value projection; and the output layer's
  log-probabilities, ``B × T × V`` over the segment's ``T`` tokens. With ``memory.grad_segments`` k a step is a window
  of k segments whose graphs stay joined through the attached memory until its backward, so k segments' worth is kept.
  Once per step, the backward's transients: one more ``B × H × L × K`` for the gradient of one layer's scores, and ``B ×
  T × V`` for the gradient of the log-probabilities. With adaptive input and softmax, V is the head's ``cutoffs[0] +
  tail clusters`` plus the widest tail cluster (each tail scores only the positions whose target falls in it: this is
  the worst case), and each cluster adds ``B × T × d_model`` tensors for its lookup, projection and selected states.
  tests/unit/device/test_footprint.py measures what autograd saves with saved-tensor hooks, for one segment and
  through real windows of 1, 2 and 4 segments: the estimate is at least that and at most 2.5 times it. Activations are
  counted in float32 under the mixed precisions, an upper estimate.

It leaves out the allocator's slack, the CUDA context and library workspaces, so a run estimated near the
device's memory may still not fit: :func:`xl.config.machine.check_fits` warns above 80% and refuses above 100%.
``python -m xl.footprint`` prints the cache table, one cache, or a whole run's estimate (``--run``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from xl.device.headroom import NAMES, SETTINGS, verdict
from xl.model.config import XLConfig
from xl.model.memory import segment_positions
from xl.model.transformer import TransformerXL, count_parameters

MiB = 1024 * 1024
GiB = 1024 * MiB
# Bytes per element of the weights (and their gradients and AdamW moments) and of the activations.
PRECISION_BYTES = {"64-true": (8, 8), "32-true": (4, 4), "bf16-mixed": (4, 4), "16-mixed": (4, 4),
                   "bf16-true": (2, 2), "16-true": (2, 2)}


@dataclass(frozen=True)
class CacheFootprint:
    mem_len: int
    d_model: int
    n_layer: int
    batch_size: int
    dtype: torch.dtype
    slots: int = 0  # vectors per layer a memory keeps beyond mem_len (compressed slots)

    @property
    def elements(self) -> int:
        return (self.mem_len + self.slots) * self.d_model * self.n_layer * self.batch_size

    @property
    def bytes(self) -> int:
        return self.elements * torch.empty((), dtype=self.dtype).element_size()

    @property
    def mib(self) -> float:
        """Mebibytes (2**20 bytes)."""
        return self.bytes / MiB

    @property
    def gib(self) -> float:
        return self.bytes / GiB


def cache_footprint(
    mem_len: int, d_model: int, n_layer: int, batch_size: int, dtype: torch.dtype = torch.float32, slots: int = 0
) -> CacheFootprint:
    return CacheFootprint(mem_len, d_model, n_layer, batch_size, dtype, slots)


@dataclass(frozen=True)
class RunFootprint:
    """Bytes one device holds during training, by what holds them."""

    train_memory: int
    eval_memory: int  # evaluation memory and its cached keys/values
    parameters: int  # weights, gradients, AdamW moments
    activations: int  # one training step's, for the backward pass

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def parts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def largest(self) -> str:
        return max(self.parts(), key=self.parts().get)


def memory_bytes(config: XLConfig, mem_len: int, batch_size: int, dtype: torch.dtype, seg_len: int | None = None
                 ) -> int:
    """Bytes of a full memory of ``config``'s variant (:meth:`xl.model.memory.Memory.size`) for ``batch_size`` rows."""
    vectors = config.memory.memory(config).size(mem_len, seg_len).vectors
    return vectors * config.d_model * batch_size * torch.empty((), dtype=dtype).element_size()


def activation_elements(config: XLConfig, batch: int, tgt_len: int, mem_len: int, grad_segments: int = 1) -> int:
    """Elements autograd keeps for one training step, a window of ``grad_segments`` segments, plus the backward's
    transients (the module docstring)."""
    memory = config.memory.memory(config)
    # Positions a layer runs over (the segment and any the memory adds to it), and the keys each of them sees.
    B, L, H, D, d = batch, segment_positions(memory, tgt_len), config.n_head, config.d_head, config.d_model
    M = memory.size(mem_len, tgt_len).keys
    K = M + L
    scores = B * H * L * K
    # The memory's states, kept as the input of their key/value projection (normed too with pre-LN).
    states = (2 if config.pre_lnorm else 1) * B * M * d
    per_layer = ((3 if config.dropatt else 2) * scores + 2 * B * K * H * D + 2 * B * L * H * D
                 + 2 * B * L * config.d_inner + 6 * B * L * d + states)
    outputs, adaptive = config.vocab_size, 0
    if config.cutoffs:
        bounds = [0, *config.cutoffs, config.vocab_size]
        tails = len(config.cutoffs)
        # The head for every position, and at worst the widest tail cluster; each cluster's embedding lookup
        # and projection, and each tail's selected hidden states.
        outputs = config.cutoffs[0] + tails + max(hi - lo for lo, hi in zip(bounds[1:], bounds[2:], strict=False))
        adaptive = (2 * (tails + 1) + tails) * B * tgt_len * d
    per_segment = config.n_layer * per_layer + B * tgt_len * outputs + adaptive
    transients = scores + B * tgt_len * outputs
    return grad_segments * per_segment + transients


def run_footprint(config: XLConfig, *, batch_size: int, tgt_len: int, eval_batch_size: int, eval_mem_len: int,
                  precision: str = "32-true", grad_segments: int = 1) -> RunFootprint:
    """The estimate of the module docstring for a training run of ``config`` (its ``mem_len`` trains) with windows
    of ``grad_segments`` segments."""
    weight_bytes, act_bytes = PRECISION_BYTES[precision]
    state_dtype = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}[weight_bytes]
    mem_dtype = config.memory_dtype(state_dtype)
    c = config
    train = memory_bytes(c, c.mem_len, batch_size, mem_dtype, tgt_len)
    eval_states = memory_bytes(c, eval_mem_len, eval_batch_size, mem_dtype, tgt_len)
    eval_keys = c.memory.memory(c).size(eval_mem_len, tgt_len).keys
    eval_kv = 2 * eval_keys * c.n_head * c.d_head * c.n_layer * eval_batch_size * act_bytes
    return RunFootprint(
        train_memory=train,
        eval_memory=eval_states + eval_kv,
        parameters=4 * count_parameters(config) * weight_bytes,
        activations=activation_elements(config, batch_size, tgt_len, c.mem_len, grad_segments) * act_bytes,
    )


def available_memory(cuda: bool) -> tuple[int, str]:
    """Bytes free for this run, and where: the current GPU's free memory, or the machine's available RAM."""
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        return free, f"GPU {torch.cuda.get_device_name()}"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "this machine's available RAM"
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's free RAM"


def describe_run(footprint: RunFootprint, available: int, where: str, processes: int = 1) -> str:
    """A table of the estimate, how it compares with the device's memory, and what to lower if it does not fit."""
    lines = [f"{NAMES[name]:<40} {size / GiB:>10.3f} GiB" for name, size in footprint.parts().items()]
    total = footprint.total * processes
    per = f" × {processes} processes" if processes > 1 else ""
    lines.append(f"{'total' + per:<40} {total / GiB:>10.3f} GiB")
    lines.append(f"{'available: ' + where:<40} {available / GiB:>10.3f} GiB ({100 * total / available:.0f}% used)")
    judged = verdict(footprint, available, processes)
    advice = "" if judged == "fits" else f"; lower {SETTINGS[footprint.largest()]}"
    lines.append(f"{judged}{' (above 80%)' if judged == 'close' else ''}{advice}")
    return "\n".join(lines)


def segment_activation_bytes(config: XLConfig, batch_size: int, tgt_len: int) -> int:
    """Bytes autograd saves for the backward of one training segment over a full memory (weights not counted),
    measured by running it on the CPU. A window of ``memory.grad_segments`` k holds k of these until its backward
    (k = 1: one, freed by each step's backward)."""
    model = TransformerXL(config).train()
    x = torch.zeros(batch_size, tgt_len, dtype=torch.long)
    mems = None
    with torch.no_grad():
        for _ in range(-(-config.mem_len // tgt_len)):  # fill the memory
            mems = model(x, mems).mems
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, mems, targets=x, return_logits=False)
    return sum(storages.values())
