"""The ``curriculum`` key: stages of training over sample lengths (and tasks), read and checked here.

``curriculum`` is a list of stages, each a mapping::

    curriculum:
      - {length: 0, steps: 2000, metric: val/loss, below: 0.05}
      - {length: 128, steps: 2000}
      - {length: 256}

``length``, ``tasks``, ``train_most_questions``, ``val_most_questions`` and ``train_support`` replace the ``data``
settings of those names for the stage (``train_most_questions``: a curriculum over the number of facts;
``val_most_questions``: the stage validated on stories as long as its own, so that a threshold on ``val/loss`` ends
it once they are learnt; ``train_support``: a stage on the stories whose answers follow from given kinds of facts);
``steps`` is the stage's budget of optimizer steps; ``metric`` with ``below`` (or ``above``) ends it at the first
validation whose value passes. A stage ends at the first validation where either holds; the last stage's end ends
the training. :func:`check_curriculum` refuses a bad list in one sentence before any work;
:mod:`xl.training.loop.curriculum` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from xl.data.babilong.lengths import WORDS as LENGTH_WORDS
from xl.data.babilong.lengths import is_length, parse_length
from xl.data.babilong.tasks import MOST_QUESTIONS, TASKS, is_most_questions, is_train_support
from xl.settings.bounds import is_int, is_number

DATA_KEYS = ("length", "tasks", "train_most_questions", "val_most_questions", "train_support")  # a stage may change
KEYS = (*DATA_KEYS, "steps", "metric", "below", "above")


@dataclass(frozen=True)
class Stage:
    """One stage: its data settings (``data``: ``length``, and ``tasks`` where given), its budget of optimizer steps
    (None: none) and its rule (``metric`` passing ``below`` or ``above``; None: none)."""

    data: dict[str, Any]
    steps: int | None = None
    metric: str = "val/loss"
    below: float | None = None
    above: float | None = None

    def passed(self, value: float) -> bool:
        """Whether the metric's ``value`` ends the stage."""
        return (self.below is not None and value < self.below) or (self.above is not None and value > self.above)

    @property
    def has_rule(self) -> bool:
        return self.below is not None or self.above is not None


def stages(curriculum: Any) -> list[Stage]:
    """The checked stages of a ``curriculum`` node (a list of mappings); [] for none."""
    result = []
    for node in OmegaConf.to_container(curriculum, resolve=True) if OmegaConf.is_config(curriculum) else curriculum:
        data = {k: node[k] for k in DATA_KEYS if k in node}
        result.append(Stage(data, node.get("steps"), node.get("metric") or "val/loss", node.get("below"),
                            node.get("above")))
    return result


def check_stage(i: int, node: Any, metrics: list[str], last: bool) -> None:
    where = f"curriculum stage {i}"
    if not OmegaConf.is_dict(node):
        raise ValueError(f"{where} must be a mapping such as {{length: 128, steps: 1000}}, got {node!r}")
    unknown = sorted(set(node) - set(KEYS))
    if unknown:
        raise ValueError(f"{where} has {', '.join(unknown)}, which is not a stage setting; a stage has "
                         f"{', '.join(KEYS)}")
    if "length" not in node or not is_length(node.length):
        raise ValueError(f"{where} needs length, {LENGTH_WORDS}, got {node.get('length')!r}")
    tasks = node.get("tasks")
    if tasks is not None and not (OmegaConf.is_list(tasks) and len(tasks) and all(t in TASKS for t in tasks)):
        raise ValueError(f"{where}: tasks must be a list of {', '.join(TASKS)}, got {tasks!r}")
    for key in ("train_most_questions", "val_most_questions"):
        most = node.get(key)
        if most is not None and not is_most_questions(most):
            raise ValueError(f"{where}: {key} must be a whole number from 1 to {MOST_QUESTIONS}, got {most!r}")
    support = node.get("train_support")
    if support is not None and not is_train_support(support):
        raise ValueError(f"{where}: train_support must map tasks to lists of what their answers follow from, such as "
                         f"{{qa2: ['get, move']}}, got {support!r}")
    steps = node.get("steps")
    if steps is not None and not (is_int(steps) and steps >= 1):
        raise ValueError(f"{where}: steps must be a whole number >= 1 (optimizer steps), got {steps!r}")
    below, above = node.get("below"), node.get("above")
    for key, value in (("below", below), ("above", above)):
        if value is not None and not is_number(value):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    if below is not None and above is not None:
        raise ValueError(f"{where} has both below and above; give one threshold")
    metric = node.get("metric")
    if metric is not None and metric not in metrics:
        raise ValueError(f"{where}: metric={metric} is not a validation metric of this run; choose one of "
                         f"{', '.join(metrics)}")
    if metric is not None and below is None and above is None:
        raise ValueError(f"{where} names metric={metric} without a threshold; add below=... or above=...")
    if not last and steps is None and below is None and above is None:
        raise ValueError(f"{where} never ends; give it steps=N or a threshold (below=... or above=...)")


def check_curriculum(cfg: Any, metrics: list[str]) -> None:
    """Refuse a bad ``curriculum`` in one sentence (``metrics``: the validation metrics the run logs)."""
    curriculum = cfg.get("curriculum")
    if curriculum is None:
        return
    if not OmegaConf.is_list(curriculum) or not len(curriculum):
        raise ValueError(f"curriculum must be a list of stages such as [{{length: 0, steps: 1000}}, {{length: 128}}] "
                         f"or null, got {curriculum!r}")
    if cfg.data.get("train_samples") != "stream":
        raise ValueError("a curriculum trains on samples made while training; set data=babilong and "
                         "data.train_samples=stream")
    limit, interval = cfg.trainer.get("limit_train_batches"), cfg.trainer.get("val_check_interval")
    if not (is_int(limit) and limit >= 1 and interval in (limit, 1.0) and cfg.trainer.get("check_val_every_n_epoch")
            in (None, 1)):
        raise ValueError("a curriculum changes stage at the end of an epoch, after its validation; set "
                         "trainer.val_check_interval to trainer.limit_train_batches (a count of segments)")
    for i, node in enumerate(curriculum, 1):
        check_stage(i, node, metrics, i == len(curriculum))


def vocabulary(curriculum: Any, tasks: list[str]) -> dict[str, Any]:
    """What every stage fits its char or word vocabulary on, so that the stages share one: the samples of the longest
    stage's length over every stage's tasks (``tasks``: the data group's, for stages that set none)."""
    plan, every = stages(curriculum), []
    for stage in plan:
        every += [t for t in stage.data.get("tasks", tasks) if t not in every]
    return {"length": max((s.data["length"] for s in plan), key=parse_length), "tasks": every}


def final_data(curriculum: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The data group of a curriculum's run as a command that reads the run (evaluation, generation, the scorer) takes
    it: the last stage's length and tasks, and the vocabulary every stage shares."""
    last = stages(curriculum)[-1].data
    tasks = [str(t) for t in data.get("tasks") or []]
    return {**data, **last, "vocabulary": vocabulary(curriculum, tasks)}
