"""A signal that stops a command which keeps what it finished (``xl.evaluate``; any command that scores in parts).

SIGTERM (a scheduler's stop), SIGINT (Ctrl+C) and SIGUSR1 (SLURM's warning before preemption) stop such a command
the same way: inside :func:`stop_on_signals` the first of them raises :class:`Stopped` wherever the main thread is,
the command keeps what it finished (a results file marked incomplete, say) and ends with :func:`end_stopped`: one
sentence, on the terminal and in the run's log files, and the exit status a shell gives a process that the signal
ended, 128 + the signal's number (143 for SIGTERM, 130 for SIGINT). A second signal ends the process at once.

Inside a Lightning loop Lightning's own SIGTERM handler runs first (it keeps the handler it finds and calls it
after its own), then this one. Training stops otherwise, at a step boundary with a checkpoint:
:class:`xl.training.services.callbacks.PreemptionCheckpoint` and :mod:`xl.training.services.stops`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from xl.training.services.console import to_log_files

SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)


class Stopped(BaseException):
    """A signal asked the command to stop. A ``BaseException``, as ``KeyboardInterrupt`` is, so that no
    ``except Exception`` on its way catches it.

    ``signum``: the signal's number; :attr:`name`: its name (``SIGTERM``); :attr:`exit_status`: 128 + ``signum``.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)


def exit_status(signum: int) -> int:
    """The exit status of a command that ``signum`` stopped: 128 + its number, as a shell reports a process that the
    signal ended (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + int(signum)


def end_now(signum: int) -> NoReturn:
    """End this process the way ``signum`` ends a process that does not handle it."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(exit_status(signum))  # a signal whose default action is not to end the process


@contextlib.contextmanager
def stop_on_signals(signums: tuple[int, ...] = SIGNALS) -> Iterator[None]:
    """Within the block, the first of ``signums`` raises :class:`Stopped` in the main thread; a second one ends the
    process at once (:func:`end_now`), as does any of them in a process forked inside the block. The handlers of
    before are put back when the block ends. Outside the main thread (where Python cannot set handlers) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner, heard = os.getpid(), []

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner or heard:
            end_now(signum)
        heard.append(signum)
        raise Stopped(signum)

    before = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


def end_stopped(stop: Stopped, sentence: str, say: bool = True) -> NoReturn:
    """End the command that ``stop`` stopped: ``error: <sentence>`` on the terminal (standard error) and in the run's
    log files, and the exit status 128 + the signal's number. ``say``: false in the processes of a multi-process run
    other than rank 0, which end without a word."""
    if say:
        to_log_files(f"error: {sentence}")
        print(f"error: {sentence}", file=sys.stderr, flush=True)
    raise SystemExit(stop.exit_status)
