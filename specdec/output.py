"""`--output FILE.jsonl`: one JSON line per request, streamed as requests finish, nothing half-written.

What the path names decides how it is written (docs/api.md, "Failure behaviour"):

- a regular file, or a name that does not exist yet (through any symlinks: the link's target is written,
  the link stays): lines are streamed, as requests finish, to a hidden `.NAME.specdec-*.partial` beside
  the target; at the end the file is written in prompt order to a second temporary and renamed into
  place, so the target is either untouched or complete. New files get the user's umask; a replaced
  file keeps its permission bits. If the run fails after requests have finished, the partial file is
  kept and the error says where it is. Interrupted (Ctrl-C, SIGTERM): both temporaries are removed.
- `/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`: the lines go to that open descriptor as
  requests finish (in completion order; each line carries its `index`).
- any other non-regular file (a character device such as `/dev/null`, a FIFO): opened and streamed to
  directly, in completion order; a FIFO blocks until a reader opens it.
- a directory, or a missing or unwritable directory: refused before anything is loaded.

Every failure is an `OutputError` (an OSError) whose message starts with `--output PATH:`.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import signal
import stat
import sys
from contextlib import contextmanager

OPEN_DESCRIPTOR = re.compile(r"^/(?:dev/fd|proc/self/fd)/(\d+)$")
STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}


class OutputError(OSError):
    """The output cannot be created or written; the message names the path and says what is kept."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def record(output, prompt: str | None) -> dict:
    """The JSON object of one finished request."""
    return {"index": output.index, "prompt": prompt, "text": output.text, "token_ids": output.token_ids,
            "prompt_token_ids": output.prompt_token_ids, "finish_reason": output.finish_reason,
            "accepted_counts": output.accepted_counts, "speculative_tokens": output.speculative_tokens,
            "latency_s": round(output.latency_s, 6),
            "time_to_first_token_s": round(output.time_to_first_token_s, 6)}


@contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM while the block runs (a rename plus an unlink must not be split by Ctrl-C);
    Python runs their handlers as soon as the block ends."""
    can_block = hasattr(signal, "pthread_sigmask")
    if can_block:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        if can_block:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _create_exclusive(directory: str, name: str, suffix: str, mode: int | None) -> tuple[int, str]:
    """A new file `.NAME.specdec-XXXX.SUFFIX` in `directory`, created with the umask (or chmod-ed to `mode`)."""
    for _ in range(100):
        path = os.path.join(directory, f".{name}.specdec-{secrets.token_hex(4)}.{suffix}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        try:
            if mode is not None:
                os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        return fd, path
    raise FileExistsError(errno.EEXIST, "could not create a temporary file", directory)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class JsonlOutput:
    """Use as `with JsonlOutput.open(path) as out:` around the run; `out.write(output, prompt)` as each
    request finishes, `out.commit(outputs, prompts)` when all have. Leaving the block without a commit
    removes the temporaries (interrupt) or keeps the partial file (any other error; `kept` says where)."""

    def __init__(self, shown: str):
        self.shown = shown  # the path as the user gave it, for messages
        self.fd: int | None = None  # where lines are streamed
        self.stream = False  # writing straight to a descriptor/device: no temporaries, no rename
        self.target: str | None = None  # the regular file that the commit replaces
        self.partial: str | None = None  # streamed lines, completion order
        self.mode: int | None = None  # permission bits of the file being replaced
        self.lines = 0
        self.committed = False
        self.kept: str | None = None  # the partial file left behind after a failure

    def _error(self, err: OSError, doing: str) -> OutputError:
        return OutputError(err.errno, f"--output {self.shown}: cannot {doing} ({err.strerror or err})")

    @classmethod
    def open(cls, path: str) -> "JsonlOutput":
        """Check that the output can be written and open its streaming destination (before decoding)."""
        out = cls(path)
        absolute = os.path.abspath(path)
        descriptor = STANDARD_STREAMS.get(absolute)
        match = OPEN_DESCRIPTOR.match(absolute)
        if match:
            descriptor = int(match.group(1))
        try:
            if descriptor is not None:
                sys.stdout.flush()
                out.fd, out.stream = os.dup(descriptor), True  # shares the descriptor's offset: no truncation
                return out
            target = os.path.realpath(path)
            try:
                info = os.stat(target)
            except FileNotFoundError:
                info = None
            if info is not None and stat.S_ISDIR(info.st_mode):
                raise OutputError(errno.EISDIR, f"--output {path}: is a directory")
            if info is not None and not stat.S_ISREG(info.st_mode):
                out.fd, out.stream = os.open(target, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)), True
                return out
            directory = os.path.dirname(target)
            if not os.path.isdir(directory):
                raise OutputError(errno.ENOENT, f"--output {path}: directory {directory} does not exist")
            out.target = target
            out.mode = stat.S_IMODE(info.st_mode) if info is not None else None
            out.fd, out.partial = _create_exclusive(directory, os.path.basename(target), "partial", out.mode)
        except OutputError:
            raise
        except OSError as err:
            raise out._error(err, "create the output") from None
        return out

    def write(self, output, prompt: str | None) -> None:
        """Stream one finished request's line."""
        self.write_record(record(output, prompt))

    def write_record(self, obj: dict) -> None:
        """Stream one JSON line."""
        try:
            _write_all(self.fd, (json.dumps(obj) + "\n").encode("utf-8"))
        except OSError as err:
            raise self._error(err, "write") from None
        self.lines += 1

    def commit_streamed(self) -> None:
        """All requests are done and the streamed lines are already in prompt order (the distributed
        runner orders them): rename the partial file into place, no second copy."""
        if self.stream:
            self.committed = True
            return
        try:
            os.fsync(self.fd)
            with signals_deferred():  # the rename and the bookkeeping happen together or not at all
                os.replace(self.partial, self.target)
                self.partial = None
                self.committed = True
        except OSError as err:
            raise self._error(err, "write") from None

    def commit(self, outputs, prompts) -> None:
        """All requests are done: streams are complete as they are; a file is written in prompt order to a
        second temporary and renamed over the target."""
        if self.stream:
            self.committed = True
            return
        final_fd, final = None, None
        try:
            final_fd, final = _create_exclusive(os.path.dirname(self.target), os.path.basename(self.target),
                                                "jsonl", self.mode)
            _write_all(final_fd, b"".join((json.dumps(record(o, p)) + "\n").encode("utf-8")
                                          for o, p in zip(outputs, prompts)))
            os.fsync(final_fd)
            fd, final_fd = final_fd, None
            os.close(fd)
            with signals_deferred():
                os.replace(final, self.target)
                final = None
                self.committed = True
        except OSError as err:
            raise self._error(err, "write") from None
        finally:
            if final_fd is not None:
                os.close(final_fd)
            if final is not None:
                _unlink(final)

    def __enter__(self) -> "JsonlOutput":
        return self

    def __exit__(self, kind, err, tb) -> None:
        with signals_deferred():
            if self.fd is not None:
                try:
                    os.close(self.fd)
                except OSError:
                    pass
                self.fd = None
            if self.partial is None:
                return
            interrupted = kind is not None and not issubclass(kind, Exception)
            if self.committed or interrupted or self.lines == 0:
                _unlink(self.partial)
            else:
                self.kept = self.partial
                if err is not None:
                    err.specdec_partial = (self.partial, self.lines)
            self.partial = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
