"""`--output FILE.jsonl`: one JSON line per request, streamed as requests finish, nothing half-written.

What the path names decides how it is written (docs/api.md, "Failure behaviour"):

- a regular file, or a name that does not exist yet (through any symlinks: the link's target is written,
  the link stays): lines are streamed, as requests finish, to a hidden `.NAME.specdec-*.partial` beside
  the target; at the end the file is written in prompt order to a second temporary and renamed into
  place, so the target is either untouched or complete. New files get the user's umask; a replaced
  file keeps its permission bits. If the run fails or is interrupted (Ctrl-C, SIGTERM) after requests have
  finished, the partial file is kept, cut back to whole lines (valid JSONL, one line per finished request),
  and the message says where it is; the target is left as it was. An existing file without write
  permission (e.g. mode 0444) is refused: to replace it, make it writable (`chmod u+w`) or delete it.
- `/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`: the lines go to that open descriptor as
  requests finish (in completion order; each line carries its `index`).
- any other non-regular file (a character device such as `/dev/null`, a FIFO): opened and streamed to
  directly, in completion order; a FIFO blocks until a reader opens it.
- a directory, or a missing or unwritable directory: refused before anything is loaded.

Every failure is an `OutputError` (an OSError) whose message starts with `--output PATH:`. `check_paths`
refuses, before anything is loaded, an --output or --metrics that is an input or the other one, and an
unwritable --metrics.
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
from contextlib import contextmanager, suppress

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


def json_line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode("utf-8")


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
        # (lines, bytes) written whole; one attribute, stored in one step, so that an interrupt between
        # bytecodes sees both counts or neither. A kept partial file is cut back to these bytes.
        self.written = (0, 0)
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
                if sys.stdout is not None:  # None when the process started with stdout closed
                    sys.stdout.flush()
                out.fd, out.stream = os.dup(descriptor), True  # shares the descriptor's offset: no truncation
                return out
            target, info = writable_target("--output", path)
            if info is not None and not stat.S_ISREG(info.st_mode):
                out.fd, out.stream = os.open(target, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)), True
                return out
            out.target = target
            out.mode = stat.S_IMODE(info.st_mode) if info is not None else None
            out.fd, out.partial = _create_exclusive(os.path.dirname(target), os.path.basename(target), "partial",
                                                    out.mode)
        except OutputError:
            raise
        except OSError as err:
            raise out._error(err, "create the output") from None
        return out

    def write(self, output, prompt: str | None) -> None:
        """Stream one finished request's line."""
        self.write_record(record(output, prompt))

    def write_record(self, obj: dict) -> None:
        """Stream one JSON line. A line cut off part-way (disk full, file too large, Ctrl-C or SIGTERM in the
        middle of the write) is not counted, and a kept partial file is cut back to the counted lines."""
        data = json_line(obj)
        try:
            _write_all(self.fd, data)
        except OSError as err:
            raise self._error(err, "write") from None
        self.written = (self.written[0] + 1, self.written[1] + len(data))

    @property
    def lines(self) -> int:
        """Requests written whole."""
        return self.written[0]

    def note(self, event: str = "the error") -> str:
        """After the block: what became of the output, as the end of the one line about an error or an
        interrupt (`event` names it: "the error", "the interrupt")."""
        if self.committed:
            return f"; --output {self.shown} was already complete"
        if self.stream:
            return f"; {self.lines} request(s) were streamed to --output {self.shown}"
        if self.kept is not None:
            return (f"; --output {self.shown} left as it was; the {self.lines} request(s) finished before {event} "
                    f"are in {self.kept}")
        return f"; --output {self.shown} left as it was"

    def commit_streamed(self) -> None:
        """All requests are done and the streamed lines are already in prompt order (the distributed
        runner orders them): rename the partial file into place, no second copy."""
        if self.stream:
            self.committed = True
            return
        try:
            os.fsync(self.fd)
            self._replace_target(self.partial)
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
            _write_all(final_fd, b"".join(json_line(record(o, p)) for o, p in zip(outputs, prompts)))
            os.fsync(final_fd)
            fd, final_fd = final_fd, None
            os.close(fd)
            self._replace_target(final)
        except OSError as err:
            raise self._error(err, "write") from None
        finally:
            if final_fd is not None:
                os.close(final_fd)
            if final is not None and not self.committed:
                _unlink(final)

    def _replace_target(self, path: str) -> None:
        """Rename `path` over the target; the rename and the bookkeeping (the partial file is gone if it was the
        one renamed; committed) happen together or not at all."""
        with signals_deferred():
            os.replace(path, self.target)
            if path == self.partial:
                self.partial = None
            self.committed = True

    def __enter__(self) -> "JsonlOutput":
        return self

    def __exit__(self, kind, err, tb) -> None:
        """Close; without a commit, keep the partial file (whole lines only) if any request finished, for an
        error and an interrupt alike, and record where on the exception (`specdec_partial`)."""
        with signals_deferred():
            keep = self.partial is not None and not self.committed and self.lines > 0
            if self.fd is not None:
                if keep:  # drop a torn last line (shrinking needs no space and passes any size limit)
                    with suppress(OSError):
                        os.ftruncate(self.fd, self.written[1])
                with suppress(OSError):
                    os.close(self.fd)
                self.fd = None
            if self.partial is None:
                return
            if keep:
                self.kept = self.partial
                if err is not None:
                    err.specdec_partial = (self.partial, self.lines)
            else:
                _unlink(self.partial)
            self.partial = None


def _unlink(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def writable_target(flag: str, path: str) -> tuple[str, os.stat_result | None]:
    """The file `path` names through any symlinks, and its stat (None: not there yet). OutputError naming
    `flag` for a directory, a missing directory, or an existing regular file that nobody may write (mode
    0444...) or this user may not: the user makes it writable or deletes it to say that replacing it is meant.
    Any other OSError (from stat) is the caller's to word."""
    target = os.path.realpath(path)
    try:
        info = os.stat(target)
    except FileNotFoundError:
        directory = os.path.dirname(target)
        if not os.path.isdir(directory):
            raise OutputError(errno.ENOENT, f"{flag} {path}: directory {directory} does not exist") from None
        return target, None
    if stat.S_ISDIR(info.st_mode):
        raise OutputError(errno.EISDIR, f"{flag} {path}: is a directory")
    if stat.S_ISREG(info.st_mode) and (not info.st_mode & 0o222 or not os.access(target, os.W_OK)):
        raise OutputError(errno.EACCES, f"{flag} {path}: is read-only (mode {stat.S_IMODE(info.st_mode):04o}); "
                                        f"to replace it, make it writable (chmod u+w) or delete it")
    return target, info


def _identity(path: str) -> tuple:
    """What a path really names: (device, inode) when it exists (hard links, symlinks), else its real path."""
    try:
        info = os.stat(path)
    except OSError:
        return ("path", os.path.realpath(path))
    return ("file", info.st_dev, info.st_ino)


def _input_files(inputs) -> dict[tuple, str]:
    """identity -> path of every input: each file given, and the files directly inside each directory given
    (a checkpoint: config, weights, tokenizer)."""
    found: dict[tuple, str] = {}
    for path in inputs:
        if not path:
            continue
        if os.path.isdir(path):
            try:
                names = sorted(os.listdir(path))
            except OSError:
                continue
            for name in names:
                file = os.path.join(path, name)
                if os.path.isfile(file):
                    found.setdefault(_identity(file), file)
        elif os.path.exists(path):
            found.setdefault(_identity(path), path)
    return found


def check_paths(output: str | None, metrics: str | None, inputs: list[str]) -> None:
    """Before anything is loaded: refuse an --output or --metrics that resolves (through symlinks and hard
    links) to an input — a prompt file, a file of a checkpoint directory — or to each other, and a
    --metrics that cannot be written. Raises OutputError naming the flag."""
    given = _input_files(inputs)
    named = [(flag, path) for flag, path in (("--output", output), ("--metrics", metrics)) if path]
    for flag, path in named:
        if _is_device(path):
            continue  # /dev/null, a terminal: shared harmlessly
        clash = given.get(_identity(path))
        if clash is not None:
            raise OutputError(errno.EEXIST, f"{flag} {path}: is the input file {clash}; writing it would destroy "
                                            f"it, choose another path")
    if output and metrics and not _is_device(output) and _identity(output) == _identity(metrics):
        raise OutputError(errno.EEXIST, f"--metrics {metrics}: is the same file as --output {output}; give them "
                                        f"different paths")
    if metrics:
        check_writable("--metrics", metrics)


def _is_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def check_writable(flag: str, path: str) -> None:
    """That `path` can be written (created, or replaced) now, without writing it: an OutputError naming `flag`
    for a directory, a missing or unwritable directory, or a read-only existing file."""
    try:
        target, info = writable_target(flag, path)
    except OutputError:
        raise
    except OSError as err:
        raise OutputError(err.errno, f"{flag} {path}: cannot write ({err.strerror or err})") from None
    if info is not None:
        if not stat.S_ISREG(info.st_mode) and not os.access(target, os.W_OK):
            raise OutputError(errno.EACCES, f"{flag} {path}: cannot write (Permission denied)")
        return
    directory = os.path.dirname(target)
    try:  # the only true test of a directory (permissions, read-only mounts, quotas): create a file there
        fd, probe = _create_exclusive(directory, os.path.basename(target), "probe", None)
    except OSError as err:
        raise OutputError(err.errno, f"{flag} {path}: cannot create the file ({err.strerror or err})") from None
    os.close(fd)
    _unlink(probe)
