"""xl.training.services.signals: a signal inside the block is an exception naming it, with the exit status a shell gives
a process that the signal ended; the handlers of before come back."""

from __future__ import annotations

import os
import signal

import pytest

from xl.training.services.signals import Stopped, end_stopped, stop_on_signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_in_the_block_raises_stopped_and_the_handlers_come_back(signum, capsys):
    before = signal.getsignal(signum)
    with pytest.raises(Stopped) as stop, stop_on_signals():
        os.kill(os.getpid(), signum)
        for _ in range(10**6):  # the handler runs at the next bytecode; nothing after it runs
            pass
        pytest.fail("the signal did not stop the block")
    assert (stop.value.name, stop.value.exit_status) == (signal.Signals(signum).name, 128 + signum)
    assert signal.getsignal(signum) == before
    with pytest.raises(SystemExit) as exit_:
        end_stopped(stop.value, f"stopped by {stop.value.name}")
    assert exit_.value.code == 128 + signum
    assert capsys.readouterr().err == f"error: stopped by {stop.value.name}\n"
