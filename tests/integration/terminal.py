"""A user's terminal for the front-door tests: an interactive bash (job control on) in a pseudo-terminal.

What a person does, and what reaches the processes: typing a command runs it as the terminal's foreground
process group; Ctrl-C (``ctrl_c``) makes the terminal send SIGINT to that whole group (make, dvc, the stage
and make's output filters alike); ``signal_group`` sends a signal to it as ``kill -TERM -<pgid>`` does;
``hang_up`` closes the terminal (a window closed, an ssh session dropped): bash gets SIGHUP and sends it
to its jobs. A background job (``&``) or ``subprocess`` with a pipe behaves otherwise (the shell makes a
background job ignore SIGINT), which is why these tests go through a terminal. Not a test module.
"""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import time
from pathlib import Path


class Terminal:
    """``bash --norc -i`` in a pseudo-terminal in ``cwd`` with ``env``; ``output`` holds everything shown."""

    def __init__(self, cwd: Path, env: dict) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: a session leader whose controlling terminal is the pty
            try:
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # as a terminal starts its shell, also
                    signal.signal(s, signal.SIG_DFL)  # when these tests run under nohup or as a background job
                os.chdir(cwd)
                # Before each prompt bash prints the last command's exit status (also after Ctrl-C, which
                # abandons the rest of a typed command line).
                os.execve("/bin/bash", ["bash", "--norc", "--noprofile", "-i"],
                          {**env, "TERM": "dumb", "PS1": "$ ", "PROMPT_COMMAND": "echo __EXIT=$?"})
            finally:
                os._exit(127)
        self.pid, self.fd, self.output = pid, fd, ""
        self._seen = 0  # output already matched by read_until
        self._stopped_job: int | None = None  # the process group a signal was sent to
        self.exit_status(timeout=60)  # the first prompt's

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the terminal is closed
            return False
        self.output += data.decode(errors="replace").replace("\r\n", "\n")
        return bool(data)

    def read_until(self, pattern: str, timeout: float = 300) -> re.Match:
        """Read until ``pattern`` (a regex) appears in the output shown since the last match."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern, re.M).search(self.output, self._seen)
            if m:
                self._seen = m.end()
                return m
            if time.monotonic() > deadline or not self._read(min(1.0, max(0.0, deadline - time.monotonic()))):
                raise AssertionError(f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.output[-6000:]}")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def run(self, command: str, timeout: float = 600) -> int:
        """Type ``command`` and wait for its exit status."""
        self.start(command)
        return self.exit_status(timeout)

    def start(self, command: str) -> None:
        """Type ``command`` without waiting (then :meth:`read_until`, a signal, :meth:`exit_status`)."""
        self.type(f"{command}\n")

    def exit_status(self, timeout: float = 300) -> int:
        """The exit status of the command typed last (bash's ``$?``, e.g. 130 after Ctrl-C), once every
        process of a job that was sent a signal is gone: a signal that ends a parent first leaves its
        children to the machine's init, and until init reaps them DVC counts them as holding its locks."""
        status = int(self.read_until(r"^__EXIT=(\d+)$", timeout).group(1))
        deadline = time.monotonic() + 60
        while self._stopped_job is not None and time.monotonic() < deadline:
            try:
                os.killpg(self._stopped_job, 0)  # succeeds while any process of the group, a zombie too, is left
                time.sleep(0.2)
            except ProcessLookupError:
                self._stopped_job = None
        return status

    def ctrl_c(self) -> None:
        self._stopped_job = os.tcgetpgrp(self.fd)
        self.type("\x03")

    def signal_group(self, signum: int) -> None:
        """``signum`` to the terminal's foreground process group (the running command's whole job)."""
        self._stopped_job = os.tcgetpgrp(self.fd)
        os.killpg(self._stopped_job, signum)

    def hang_up(self, timeout: float = 120) -> None:
        """Close the terminal: bash gets SIGHUP, sends it to its jobs and exits. Returns once every process of the
        job that was running is gone, as :meth:`exit_status` waits after a signal (a `dvc exp run` still exiting
        holds DVC's lock: the next command in another terminal found the project busy on a loaded machine)."""
        job = os.tcgetpgrp(self.fd)
        os.close(self.fd)
        os.waitpid(self.pid, 0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(job, 0)  # succeeds while any process of the job, a zombie too, is left
                time.sleep(0.2)
            except ProcessLookupError:
                return
        raise AssertionError(f"the job of the closed terminal was still running {timeout:.0f} s later")

    def close(self) -> None:
        try:
            self.type("exit\n")
            os.close(self.fd)
        except OSError:
            pass
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ChildProcessError, ProcessLookupError):
            pass
