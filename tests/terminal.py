"""A program on the slave side of a pseudo-terminal, driven as a user's terminal drives it (tests/test_chat.py,
tests/test_readme_examples.py)."""
import os
import pty
import re
import select
import signal
import sys
import time

import pytest


class Terminal:
    """A program on the slave side of a pseudo-terminal (its controlling terminal: ^C there is SIGINT), read
    from the master side with a bound on every wait."""

    def __init__(self, argv: list[str], env: dict | None = None):
        """`python *argv` with `env` (default: this environment, OMP_NUM_THREADS=1)."""
        env = dict(os.environ, OMP_NUM_THREADS="1") if env is None else env
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: SIGINT at its default (a background shell may have ignored it)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, *argv], env)
        self.seen = ""  # everything read so far (\r\n as \n)
        self.chunks: list[tuple[float, str]] = []  # (when, text) of every read

    def read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536).decode("utf-8", "replace").replace("\r\n", "\n")
        except OSError:  # the child closed the terminal (exited)
            return False
        self.seen += data
        self.chunks.append((time.monotonic(), data))
        return bool(data)

    def expect(self, pattern: str, start: int, timeout: float = 120) -> re.Match:
        """The first match of `pattern` in what was read after offset `start`, reading until it appears."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.seen, start)
            if m:
                return m
            if time.monotonic() > deadline or not self.read(min(1.0, max(deadline - time.monotonic(), 0.01))) \
                    and time.monotonic() > deadline:
                self.close()
                pytest.fail(f"no {pattern!r} in time; the terminal showed:\n{self.seen[-3000:]}")

    def send(self, text: str) -> int:
        """Type `text`; returns the offset of what was read before (the reply comes after it)."""
        at = len(self.seen)
        os.write(self.fd, text.encode())
        return at

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read(0.1)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        self.close()
        pytest.fail("the chat did not end")

    def close(self) -> None:
        if self.fd is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)
        self.fd = None
