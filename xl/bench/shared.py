"""What the benchmarks and the tools around the model share: config S, the machine's name, timing, the config."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

CONFIG_S = dict(vocab_size=256, n_layer=4, n_head=4, d_model=256, d_head=64, d_inner=1024, dropout=0.1, mem_len=128)


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (the figures mean little without it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report_ratios(result: dict[str, list[float]], modes: tuple[str, ...], names: list[str]) -> dict[str, float]:
    """Print, per mode and name, the median tokens/s of interleaved rounds (``result["<mode>/<name>"]``) and the
    median time per token against ``names[0]`` in the same rounds; return those ratios by ``"<mode>/<name>"``."""
    width = max(map(len, names))
    summary = {}
    for mode in modes:
        base = result[f"{mode}/{names[0]}"]
        for name in names:
            rates = result[f"{mode}/{name}"]
            ratios = [b / r for b, r in zip(base, rates, strict=True)]
            summary[f"{mode}/{name}"] = statistics.median(ratios)
            print(f"  {mode:<6} {name:<{width}} {statistics.median(rates):>9,.0f} tok/s   time vs {names[0]} "
                  f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    return summary


def median_rate(run: Callable[[], object], work: float, warmup: int, repeats: int) -> float:
    """Median of ``work / seconds`` over ``repeats`` timed calls of ``run``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        rates.append(work / (time.perf_counter() - start))
    return statistics.median(rates)


def interleaved_rates(runs: dict[str, tuple[Callable[[], object], float]], rounds: int, warmup: int = 1,
                      repeats: int = 3) -> dict[str, list[float]]:
    """Per named ``(run, work)``, the rate of each round (:func:`median_rate`: ``warmup`` untimed calls, the median of
    ``repeats`` timed ones), the runs taking turns round by round so that a shared CPU slows them alike (with one
    timed call and no warm-up per round, they alternate call by call)."""
    out: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (run, work) in runs.items():
            out[name].append(median_rate(run, work, warmup, repeats))
    return out
