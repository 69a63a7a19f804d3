"""What the CPU computes natively, as the operating system reports it: the basis of ``precision=auto`` on a CPU.

Linux lists each core's feature flags in ``/proc/cpuinfo``. A CPU with ``amx_bf16`` (Intel's AMX tiles, Sapphire
Rapids and later) or ``avx512_bf16`` (bfloat16 dot products: Intel Cooper Lake and later, AMD Zen 4 and later)
multiplies bfloat16 matrices in hardware, and oneDNN, which torch's CPU matrix products use, runs bf16 autocast
there faster than float32 (docs/gpu.md has the figures). Without them bf16 products are emulated and far slower. Other
operating systems and architectures report no flags here, which reads as "no native bfloat16".
"""

from __future__ import annotations

import os

CPUINFO = "/proc/cpuinfo"
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # either one: bfloat16 matrix products in hardware


def cpu_flags(cpuinfo: str | os.PathLike | None = None) -> frozenset[str]:
    """The feature flags of the first CPU that ``cpuinfo`` (default :data:`CPUINFO`) lists; none where the file is
    missing or lists none."""
    try:
        with open(cpuinfo or CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_bf16(flags: frozenset[str] | set[str]) -> list[str]:
    """The flags among ``flags`` that say the CPU multiplies bfloat16 in hardware (empty: it does not)."""
    return [flag for flag in BF16_FLAGS if flag in flags]
