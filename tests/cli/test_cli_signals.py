"""The command line ends quietly: Ctrl-C prints one line and exits 130, a reader that closes the
pipe (`| head`) ends it without a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

# As a shell starts it: SIGINT neither blocked nor ignored. A child inherits both from the test's
# process, which earlier tests of its worker may have left changed (a SIGINT ignored at start-up
# gets no KeyboardInterrupt handler): the full suite's worker once ran a child deaf to Ctrl-C.
AS_FROM_A_SHELL = (
    "import runpy, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); sys.argv = ['kvcache', *sys.argv[1:]]; "
    "runpy.run_module('kvcache', run_name='__main__')"
)
# without a cache each token recomputes the whole context, so the run lasts a minute or more: the
# signal and the closed pipe always meet it generating, however late a loaded machine delivers them
COMMAND = [sys.executable, "-c", AS_FROM_A_SHELL, "generate", "--prompt", "The", "--max-new-tokens", "1000",
           "--threads", "1", "--cache", "none"]


def test_ctrl_c_exits_130_with_one_line():
    process = subprocess.Popen(COMMAND, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.read(8)  # it is generating
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert b"interrupted" in err and b"Traceback" not in err


def test_a_closed_pipe_ends_it_without_a_traceback():
    process = subprocess.Popen(COMMAND, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.read(8)
    process.stdout.close()  # what `| head -c 8` does
    err = process.stderr.read()
    process.wait(60)
    assert process.returncode == 141
    assert b"Traceback" not in err and b"BrokenPipe" not in err
