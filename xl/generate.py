"""Sample text from a trained run: ``python -m xl.generate ckpt=RUN 'prompt="def main("' [key=value ...]`` (Hydra).

``ckpt``: a run folder (its newest complete checkpoint) or a checkpoint file; the tokenizer is the run's (its data
settings are read from the run folder; ``data=...`` names others). The shell's single quotes keep Hydra's double
quotes: Hydra reads ``prompt="def main("`` as a quoted string, which may hold parentheses, commas and spaces.

``warmup=PATH`` names a text file that is read first to fill the memory (a cold start leaves the first tokens
without context; a path that is not a file is refused), ``warmup_text="..."`` gives that text itself; the prompt
follows, then the samples, one token per step through the model's incremental decoder
(:meth:`xl.model.transformer.TransformerXL.decoder`): each sampled token gets the logits of the model's forward of that
token over the memory carried (``mem_len``), computed against cached keys and values.

Example, with RUN the run folder train.py printed::

    python -m xl.generate ckpt=RUN 'prompt="def main("' max_new_tokens=200 temperature=0.8
"""

from __future__ import annotations

from omegaconf import DictConfig

from xl.config.compose import entry_point
from xl.config.rules import check_generate_config


@entry_point("generate")
def main(cfg: DictConfig) -> None:
    check_generate_config(cfg)  # the settings' own rules, before torch and Lightning are imported
    from xl.generation import run

    run(cfg)


if __name__ == "__main__":
    main()
