"""The BABILong scoring command: scores a trained run on BABILong-style tasks (:mod:`xl.babilong.score`, run as
this package's ``__main__``; its report :mod:`xl.babilong.report`). The tasks and samples are the library's
(:mod:`xl.data.babilong`)."""

from omegaconf import DictConfig

from xl.config.compose import entry_point


@entry_point("babilong")
def main(cfg: DictConfig) -> None:
    """``python -m xl.babilong``: --help and a misspelt setting answer before the scorer imports torch."""
    from xl.babilong.score import run

    run(cfg)
