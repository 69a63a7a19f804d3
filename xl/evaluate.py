"""Evaluate a trained run on val and test: ``python -m xl.evaluate ckpt=RUN [key=value ...]`` (Hydra).

``ckpt``: a run folder (its newest complete checkpoint) or a checkpoint file. The model's shape comes from the
checkpoint, the data from the run's folder (``data=run``, the default; ``data.eval_tgt_len=64`` changes one of its
settings; ``data=text data.train=... data.val=... data.test=...`` scores other data, with the run's segment length
and batch unless the command line sets them, and the output says whose data and segments they are); the evaluation
context (``memory.eval_mem_len``, ``memory.clamp_len``, ``memory.eval_same_length``), the device and the precision
from ``conf/evaluate.yaml`` and its groups, so a checkpoint can be read with a longer memory than it was trained
with, as in the paper; a memory's own settings that shape no weight take a ``+`` (``+memory.NAME=VALUE``,
:func:`eval_model_config`). The results go to
``results.json`` in the output folder and to W&B (the evaluated run's own W&B run when its folder records one);
``-m memory.eval_mem_len=0,128,512`` ends with the sweep's summary table and plot (:mod:`xl.training.services.sweep`).

``warmup=N`` feeds the first N segments of every stream without scoring them, so that every scored token has a
full memory. ``vanilla=true`` is the paper's baseline
(Dai et al., 2019, section 4): no cache, every token predicted by a fresh forward over the
``attn_len`` tokens before it.

Documents: ``memory.doc_boundaries`` (null: the checkpoint's) says whether a token sees earlier documents.
``per_document=true`` also reports the figure per document (how many, and their mean, each document weighing
the same) and by position in document (0-31, 32-127, 128-511, 512+), which shows the cost of a cold start.

A signal (SIGTERM, Ctrl+C, SIGUSR1) stops the command with one sentence and the exit status 128 + the signal's
number (:mod:`xl.training.services.signals`); ``results.json`` keeps the splits finished before it, marked ``"complete":
false``. Under ``-m`` the sweep stops at the job under way.
"""

from __future__ import annotations

from omegaconf import DictConfig

from xl.config.compose import entry_point
from xl.config.rules import check_evaluate_config


@entry_point("evaluate")
def main(cfg: DictConfig) -> None:
    check_evaluate_config(cfg)  # the settings' own rules, before torch and Lightning are imported
    from xl.evaluation import run

    run(cfg)


if __name__ == "__main__":
    main()
