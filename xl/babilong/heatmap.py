"""The scorer's heatmap, as BABILong's leaderboard draws it (its ``notebooks/draw_evals.ipynb``): tasks down, context
lengths across, the accuracy in percent in each cell, coloured from red (0) through yellow to green (100).

Each cell also shows, in small type, the best of the rules that need no memory of the asked entity
(:mod:`xl.babilong.baselines`) on the same samples; the colour bar marks each rule's mean over the cells. The title
says how many samples each cell counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xl.babilong.baselines import RULES

CELL_INCHES = (1.1, 0.75)  # width and height of one cell
DPI = 100


def grid(values: dict[str, Any]) -> list[list[float]]:
    """Accuracy in percent, a row per task, a column per length (NaN where a cell is missing)."""
    return [[100 * values["accuracy"].get(t, {}).get(n, float("nan")) for n in values["lengths"]]
            for t in values["tasks"]]


def best_rule(values: dict[str, Any], task: str, length: str) -> tuple[str, float] | None:
    """The rule of highest accuracy on the cell's samples, and that accuracy in percent."""
    rules = values.get("baselines", {}).get(task, {})
    scored = [(rule, 100 * rules[rule][length]) for rule in RULES if length in rules.get(rule, {})]
    return max(scored, key=lambda s: s[1]) if scored else None


def rule_means(panels: list[tuple[str, dict[str, Any]]]) -> dict[str, float]:
    """Each rule's mean accuracy in percent over every cell of every panel."""
    values: dict[str, list[float]] = {}
    for _, panel in panels:
        for rules in panel.get("baselines", {}).values():
            for rule, by_length in rules.items():
                values.setdefault(rule, []).extend(100 * a for a in by_length.values())
    return {rule: sum(v) / len(v) for rule in RULES if (v := values.get(rule))}


def samples_per_cell(values: dict[str, Any]) -> str:
    counts = sorted({c["samples"] for c in values["cells"]})
    if not counts:
        return "no cell scored"
    return f"{counts[0]:,} samples per cell" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,} samples per cell"


def draw_heatmaps(path: Path, panels: list[tuple[str, dict[str, Any]]]) -> Path:
    """:func:`figure`, written to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(panels)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def figure(panels: list[tuple[str, dict[str, Any]]]) -> Any:
    """One heatmap per (title, results) side by side and one colour bar, marked at each rule's mean."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    colours = LinearSegmentedColormap.from_list("ryg", ["red", "yellow", "green"], N=256)
    width = max(len(v["lengths"]) for _, v in panels)
    height = max(len(v["tasks"]) for _, v in panels)
    size = (max(CELL_INCHES[0] * width, 3.2) * len(panels) + 2.6, max(CELL_INCHES[1] * height, 1.5) + 1.9)
    fig, axes = plt.subplots(1, len(panels), figsize=size, squeeze=False, constrained_layout=True)
    image = None
    for ax, (title, values) in zip(axes[0], panels, strict=True):
        cells = grid(values)
        image = ax.imshow(cells, cmap=colours, vmin=0, vmax=100, aspect="auto")
        for i, task in enumerate(values["tasks"]):
            for j, length in enumerate(values["lengths"]):
                if cells[i][j] != cells[i][j]:  # not scored
                    continue
                best = best_rule(values, task, length)
                ax.text(j, i - (0.12 if best else 0), f"{cells[i][j]:.0f}", ha="center", va="center", fontsize=13,
                        fontweight="bold")
                if best:
                    ax.text(j, i + 0.25, f"{best[0]} {best[1]:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(values["lengths"])), values["lengths"])
        ax.set_yticks(range(len(values["tasks"])), values["tasks"])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("task")
        incomplete = "" if values.get("complete", True) else ", incomplete"
        ax.set_title(f"{title}\naccuracy %, {samples_per_cell(values)}{incomplete}", fontsize=10)
    bar = fig.colorbar(image, ax=axes[0].tolist(), fraction=0.05, pad=0.02)
    bar.set_label("accuracy (%)")
    means = rule_means(panels)
    for rule, mean in means.items():
        bar.ax.axhline(mean, color="black", linewidth=1.5, label=rule)
    if means:  # labels beside the bar, spread apart where rules are close
        placed: list[float] = []
        for rule, mean in sorted(means.items(), key=lambda item: item[1]):
            y = max(mean, placed[-1] + 6) if placed else mean
            placed.append(y)
            bar.ax.annotate(f"{rule} {mean:.0f}", xy=(1.0, mean), xycoords=("axes fraction", "data"),
                            xytext=(-0.9, y), textcoords=("axes fraction", "data"), fontsize=7, ha="right",
                            va="center", arrowprops={"arrowstyle": "-", "linewidth": 0.5})
    return fig
