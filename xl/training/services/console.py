"""What a run prints: progress, results, real warnings, and a bad setting's one sentence, which reaches the run's
log file too (:func:`errors_logged`). Notices that tell the user nothing about their run are left out.

Each notice is switched off through the library's public settings, in one place:

- Lightning's info lines (the litlogger tip, "GPU available", "Restoring states ...", "Initializing distributed")
  and model summary (a table whose FLOPs column reads 0 for a model without an example input): the
  ``lightning.pytorch`` and ``lightning.fabric`` loggers at WARNING in the entry points' ``hydra.job_logging``
  (conf/hydra/job_logging/quiet.yaml), which :func:`quiet_libraries` applies again once Lightning is imported
  (Lightning sets its loggers to INFO on import), and ``enable_model_summary=False`` (:data:`TRAINER_DEFAULTS`);
  train.py's results name the parameter count instead. Lightning's warnings still show, and go to the run's log
  file too. The probe, which is not a Hydra job, takes the same levels from the same file.
- The other processes of a multi-process run (DDP): their warnings repeat rank 0's and are not shown
  (:func:`quiet_libraries`, by Lightning's ``rank_zero_only.rank``); train.py's results are printed by rank 0.
- W&B's banner, its "anonymous setting" notice and its run summary: ``wandb.Settings(silent=True)`` through
  ``wandb.setup`` (:func:`quiet_wandb`); train.py says where the W&B run is.
- Warnings about a library's own internals (a Lightning call that torch deprecates; ThroughputMonitor's request
  for a FLOP count, which only its FLOPs column would use): :func:`quiet_warnings`.
- Optuna's database (alembic) lines: the ``alembic`` logger at WARNING in the same logging configs.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from xl.config.compose import CONF_DIR, user_errors

QUIET_LOGGING = CONF_DIR / "hydra" / "job_logging" / "quiet.yaml"  # the entry points' job logging

# Trainer arguments the entry points pass unless the trainer group sets them.
TRAINER_DEFAULTS = {"enable_model_summary": False}

# (message regex, category, module regex): warnings about library internals, not about the user's run.
INTERNAL_WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning, ""),
    (r"When using the `ThroughputMonitor`, you need to define a `flops_per_batch`", Warning, ""),
)


def plain_text(doc: str) -> str:
    """A docstring as a command's ``--help`` shows it: reST's literals and roles (double backquotes, ``:mod:``) go."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", doc)


def quiet_warnings() -> None:
    for message, category, module in INTERNAL_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def quiet_libraries() -> None:
    """Once Lightning is imported: its loggers at the levels of the running job's logging config (outside a Hydra job,
    of :data:`QUIET_LOGGING`), and, in a process other than rank 0, no warnings (rank 0 shows them once)."""
    from lightning.pytorch.utilities import rank_zero_only

    loggers = (HydraConfig.get().job_logging if HydraConfig.initialized() else OmegaConf.load(QUIET_LOGGING)).get(
        "loggers") or {}
    for name, spec in loggers.items():
        if spec.get("level"):
            logging.getLogger(name).setLevel(spec.level)
    if rank_zero_only.rank > 0:
        warnings.simplefilter("ignore")


def quiet_wandb(offline: bool) -> None:
    """Silence W&B's console output for this process (the run's files and logging are unchanged). ``offline``:
    the logger's mode, set here too, since these settings are fixed at the first set-up."""
    import wandb

    settings = {"silent": True, **({"mode": "offline"} if offline else {})}
    wandb.setup(wandb.Settings(**settings))


@contextlib.contextmanager
def errors_logged() -> Iterator[None]:
    """A bad setting's sentence (:func:`xl.config.compose.user_errors`), which the entry point prints as ``error: ...``,
    is also written to the run's log files (Hydra's ``<command>.log``), so a run folder says why its run stopped."""
    try:
        yield
    except user_errors() as err:
        to_log_files(f"error: {err}")
        raise


def to_log_files(message: str) -> None:
    """Write ``message`` to the run's log files only (the terminal gets it as the command's closing line). A log
    file that cannot be written (a full disk) is left as it is, without a traceback."""
    record = logging.LogRecord("xl", logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            with contextlib.suppress(OSError, ValueError):  # ValueError: a file already closed
                handler.flush()
                with open(handler.baseFilename, "a", encoding=handler.encoding or "utf-8") as f:
                    f.write(handler.format(record) + handler.terminator)
