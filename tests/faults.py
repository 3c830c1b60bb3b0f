"""Failure drills for the Ray scale-out (tests/test_distributed.py): a replica (specdec.distributed.Replica) that
fails once, after decoding the block holding a given prompt, by raising or by SIGKILLing its own process.

    monkeypatch.setattr(distributed, "Replica", faulty_replica(Fault("kill", 20, marker), ...))

The driver hands `distributed.Replica` to Ray Data, which starts the pool's actors from it. Ray's workers cannot
import this module (tests/ is not on their path), so it is pickled by value (`ray.cloudpickle`).
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from specdec.distributed import Replica


class InjectedFault(RuntimeError):
    """Raised by a "raise" `Fault`."""


@dataclass(frozen=True)
class Fault:
    """Fail one replica once, after it has decoded the block holding prompt `index`: `kind` "raise" raises
    `InjectedFault`, "kill" SIGKILLs the replica's process (as the OOM killer or a lost node would). The
    first replica to create the file `marker` (atomically, on its node) fires; later attempts do not."""

    kind: str
    index: int
    marker: str

    def __post_init__(self):
        if self.kind not in ("raise", "kill"):
            raise ValueError(f"Fault.kind must be 'raise' or 'kill', got {self.kind!r}")

    def fire_once(self, indices: list[int]) -> None:
        if self.index not in indices:
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected fault on the block holding prompt {self.index}")


def faulty_replica(*faults: Fault) -> type:
    """A Replica class whose actors decode each block as Replica does, then fire `faults` (each once per job,
    by its marker) before the block's rows leave the replica."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class FaultyReplica(Replica):
        def __call__(self, batch: dict):
            table = super().__call__(batch)
            indices = [int(i) for i in batch["index"]]
            for fault in faults:
                fault.fire_once(indices)
            return table

    return FaultyReplica
