"""Save a trained run as a shared model: ``python -m xl.export ckpt=RUN out=FOLDER [push=ORG/NAME]`` (Hydra).

FOLDER gets what :meth:`xl.hub.PretrainedXL.save_pretrained` writes (``model.safetensors``, ``config.json``, the
tokenizer's file, the model card ``README.md``), whole or not at all; ``push=ORG/NAME`` uploads it to that hub
repository once written. ``ckpt``: a run folder (its ``checkpoints/last.ckpt``) or a checkpoint file; the tokenizer
is the run's (its data settings are read from the run folder; ``data=...`` names others). A push that cannot succeed
(``HF_HUB_OFFLINE`` set, the hub out of reach, no valid repository id) is refused before anything is written.

``PretrainedXL.from_pretrained(FOLDER or "org/name")`` loads it in Python; xl.convert turns it into a run folder
that train.py's ``init_from`` fine-tunes (docs/sharing.md). Example::

    python -m xl.export ckpt=RUN out=shared
"""

from __future__ import annotations

from omegaconf import DictConfig

from xl.config.compose import entry_point
from xl.config.rules import ConfigError
from xl.training.services.console import errors_logged, quiet_warnings

# The hub and the training code (torch) are imported by export(): --help and a bad setting answer without them.


@entry_point("export")
def main(cfg: DictConfig) -> None:
    from xl.hub.access import HubError
    from xl.training.checkpoints.run_folder import RunFolderError

    with errors_logged():
        try:
            export(cfg)
        except (HubError, RunFolderError) as err:
            raise ConfigError(str(err)) from None


def export(cfg: DictConfig) -> None:
    """The command: check where it writes and pushes, read the run and its tokenizer, save, push."""
    from xl.hub import PretrainedXL
    from xl.hub.access import check_hub, check_repo_id
    from xl.training.build import build_datamodule
    from xl.training.checkpoints.checkpoint import Checkpoint
    from xl.training.checkpoints.run_folder import check_new_folder, new_folder
    from xl.training.runs import use_run_data

    quiet_warnings()
    out = check_new_folder(cfg.out, "out")
    if cfg.push:
        check_repo_id(cfg.push, "push")
        check_hub(f"push={cfg.push}", f"leave push unset, and upload {cfg.out} later")
    use_run_data(cfg, cfg.ckpt)  # data=run: the run's tokenizer
    tokenizer = build_datamodule(cfg).tokenizer
    model = PretrainedXL.from_checkpoint(Checkpoint.open(cfg.ckpt, setting="ckpt"), tokenizer)
    with new_folder(out) as work:
        model.save_pretrained(work)
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    if cfg.push:
        print(f"pushed to {cfg.push}: {model.push_to_hub(cfg.push, private=cfg.private or None)}")


if __name__ == "__main__":
    main()
