"""What a training run records about itself: the command that reproduces it, the machine, file hashes."""
from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import sys

PROGRAM = "python -m specdec.train"


def command_line(argv=None) -> str:
    """The command that reproduces this run, e.g. 'python -m specdec.train feature --target m.gguf'."""
    return " ".join([PROGRAM] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])


def git_revision() -> str:
    """The short git revision of the working directory, or '' outside a repository."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict:
    """Where and when a run ran: CPU, torch threads, versions, git revision, date, load average now."""
    import torch

    return {"git": git_revision(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "loadavg": list(os.getloadavg()),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def file_sha256(path, n: int = 12) -> str:
    """The first n hex digits of a file's sha256 (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:n]
