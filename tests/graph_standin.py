"""A CPU stand-in for torch.cuda's graph API (`CUDAGraph`, `graph`, `graph_pool_handle`, `synchronize`), so that
models/graphs.py's bookkeeping -- what a graph captures, when it is replayed, when it is released -- is tested on
every CI run (tests/test_graphs.py; the real capture runs where a GPU is: bench/gpu_check.sh).

A stand-in graph records every aten op run inside `graph(...)` (a TorchDispatchMode) and replays them as a CUDA
graph does: on the same static tensors, each op's fresh output written in place into the tensor recorded at
capture (the graph's pool), never re-reading host values. Tensors from outside the capture (static inputs, the
cache's storage, the RoPE tables, the weights) are held by their storage's *weak* reference, as a CUDA graph
holds a raw pointer: a replay after one of them was freed raises, where a real graph would read freed memory.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


class FreedMemoryRead(RuntimeError):
    """A replay read a tensor freed since the capture (a real CUDA graph would read garbage)."""


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []  # (func, input slots/constants, input spec, output records)
        self.slots: dict[int, int] = {}  # id(tensor) -> slot, during the capture
        self.keep = []  # every tensor seen during the capture (ids stay unique while it runs)
        self.external: dict[int, tuple] = {}  # slot -> (storage weak ref, offset, shape, stride, dtype, device)
        self.count = 0  # slots handed out (an in-place op's output is a new slot of the same tensor)

    def _new_slot(self, t: torch.Tensor) -> int:
        slot = self.slots[id(t)] = self.count
        self.count += 1
        self.keep.append(t)
        return slot

    def _slot(self, t: torch.Tensor) -> int:
        slot = self.slots.get(id(t))
        if slot is None:  # from outside the capture: held weakly, as a pointer
            slot = self._new_slot(t)
            self.external[slot] = (StorageWeakRef(t.untyped_storage()), t.storage_offset(), tuple(t.shape),
                                   t.stride(), t.dtype, t.device)
        return slot

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("stand-in capture: a CUDA graph cannot read a device value on the host")
        flat, spec = tree_flatten((args, kwargs))
        ins = [("slot", self._slot(a)) if isinstance(a, torch.Tensor) else ("const", a) for a in flat]
        in_storages = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        outs = []
        for o in tree_flatten(out)[0]:
            if not isinstance(o, torch.Tensor):
                outs.append(None)
                continue
            slot = self._new_slot(o)
            fresh = o.untyped_storage().data_ptr() not in in_storages  # allocated by the op: the graph's pool
            outs.append((slot, o if fresh else None))
        self.ops.append((func, ins, spec, outs))
        return out


class StandInGraph:
    """torch.cuda.CUDAGraph's `replay` and `reset`, on the CPU."""

    def __init__(self, api: "StandInCapture"):
        self.api = api
        self.recording: _Recorder | None = None
        self.replays = 0
        api._graphs.add(self)

    def replay(self) -> None:
        rec = self.recording
        if rec is None:
            raise RuntimeError("stand-in graph: replay of a graph never captured (or reset)")
        env = {}
        for slot, (ref, offset, shape, stride, dtype, device) in rec.external.items():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                raise FreedMemoryRead("stand-in graph: replay reads a tensor freed since its capture")
            env[slot] = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)
        for func, ins, spec, outs in rec.ops:
            args, kwargs = tree_unflatten([env[v] if kind == "slot" else v for kind, v in ins], spec)
            out = func(*args, **kwargs)
            for o, record in zip(tree_flatten(out)[0], outs):
                if record is None:
                    continue
                slot, owned = record
                if owned is not None:  # the static output: written in place, as a replay does
                    owned.copy_(o)
                    o = owned
                env[slot] = o
        self.replays += 1
        self.api.replays += 1

    def reset(self) -> None:
        self.recording = None


class StandInCapture:
    """The graph API the runner calls (pass it as `use_graphs(capture=...)`); counts captures and replays and
    tells which graphs are still alive."""

    def __init__(self):
        self._graphs: weakref.WeakSet = weakref.WeakSet()
        self.captures = 0
        self.replays = 0

    def CUDAGraph(self) -> StandInGraph:  # noqa: N802 -- torch.cuda's name
        return StandInGraph(self)

    def graph_pool_handle(self):
        return object()

    def synchronize(self, *args) -> None:
        pass

    @contextlib.contextmanager
    def graph(self, cuda_graph: StandInGraph, pool=None, **kwargs):
        recorder = _Recorder()
        with recorder:
            yield
        recorder.keep = []
        recorder.slots = {}
        cuda_graph.recording = recorder
        self.captures += 1

    def live(self) -> list[StandInGraph]:
        """Graphs captured and neither reset nor garbage."""
        gc.collect()
        return [g for g in self._graphs if g.recording is not None]
