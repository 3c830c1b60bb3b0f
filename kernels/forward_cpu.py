"""The native CPU forward (kernels/cpu/forward.cpp, C++ with OpenMP, built with the quantized matmul as
`specdec.kernels._qmm`): a decoder-only transformer whose linear layers are models/ggml_blocks.py's packed blocks,
run as **one call for a whole step**: the embedding, every layer (RMSNorm; the input quantized once for q/k/v and
once for gate/up; the projections and their biases; q/k norms; RoPE; K and V written into the cache at each row's
own columns; attention of each query over its own row's keys; output projection and residual; SwiGLU MLP and
residual), the final norm and the head, with no Python between the ops and no allocation once the step's sizes
have been seen (the workspace lives with the model).

- `NativeModel`: the C++ model bound to a set of tensors (validated once, when bound: dtype, shape, contiguity,
  device), which it keeps referenced so that the pointers it holds stay valid as long as it lives.
- `NativeModel.forward`: one step of B rows of T tokens over a KV cache given by its storage and per-row (start,
  length, num_new), in either layout (kernels/positions.py's rules), returning the logits (every token's, or each
  row's last real token's) and optionally the last layer's output.
- The reference is the torch forward of models/transformer.py on the same weights (the model's batch-invariant
  path): equal up to float32 rounding (tests/test_native_forward.py).

Exact by construction (forward.cpp's header): every reduction has a fixed order that depends only on the row's own
data, so a token's logits are the same bits alone, in any batch, at any T, at any thread count and on every
instruction set the host runs.
"""
from __future__ import annotations

import ctypes

import torch

from . import qmm_cpu

# linear slots of a layer (kernels/cpu/forward.cpp's specdec_model_add_part) and of the model (layer -1)
QKV, O, GATE_UP, DOWN, HEAD, EMBED = range(6)
# float vector slots (specdec_model_set_vector)
ATTN_NORM, MLP_NORM, Q_NORM, K_NORM, ATTN_POST_NORM, MLP_POST_NORM, FINAL_NORM, EMBED_FLOAT = range(8)
LOGITS_MODES = {None: 0, "all": 1, "last": 2}
HIDDEN_MODES = {None: 0, "all": 1, "last": 2}
CHECK_ITEMS = ("q/k/v projection", "output projection", "gate/up projection", "down projection", "norms")


class NativeBindError(ValueError):
    """A tensor the native forward cannot read as given (one line naming it and what is wrong)."""


def _i64_array(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _check_vector(t: torch.Tensor, name: str, shape: tuple) -> None:
    try:
        qmm_cpu._check_tensor(t, name, torch.float32, shape)
    except qmm_cpu.PackedWeightError as err:
        raise NativeBindError(str(err)) from None


class NativeModel:
    """The C++ model over one set of weights. Build it with the dimensions, then bind every part
    (`add_linear`, `set_vector`), then `finish()` checks that every weight the forward reads is bound.

    dims: hidden E, heads H, KV heads H_kv, head dim D, MLP width I, layers L, vocabulary V, rotary dims R; RoPE
    `interleaved` (pairs (2i, 2i + 1)) or rotate-half; `eps` RMSNorm's."""

    def __init__(self, E: int, H: int, Hkv: int, D: int, I: int, L: int, V: int, R: int, interleaved: bool,
                 eps: float):
        lib, why = qmm_cpu._library()
        if lib is None:
            raise RuntimeError(why)
        self._lib = lib
        self.dims = dict(E=E, H=H, Hkv=Hkv, D=D, I=I, L=L, V=V, R=R)
        self._handle = lib.specdec_model_new(_i64_array([E, H, Hkv, D, I, L, V, R, int(interleaved)]), float(eps))
        if not self._handle:
            raise NativeBindError(f"native forward: unsupported dimensions {self.dims}")
        self._kept: list[torch.Tensor] = []  # every tensor the C++ model points into: alive as long as it is
        self.head_rows = V  # the head's rows: the vocabulary, or a subset of it (models/transformer.py restrict_head)
        self.isa: str | None = None  # None: the host's best; else one of qmm_cpu.ISAS (tests)

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.specdec_model_free(handle)
            self._handle = None

    def __deepcopy__(self, memo):
        raise TypeError("a NativeModel points into its tensors: bind a new one to the copy's (models/native.py)")

    def _keep(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self._kept.append(t)
        return t.data_ptr()

    def timings(self) -> dict[str, float]:
        """The last forward's seconds inside the native call: the embedding, the layers, the final norm and head."""
        return dict(zip(("embedding", "layers", "head"), self._last_step()[:3]))

    def last_threads(self) -> int:
        """The threads the last forward ran on."""
        return int(self._last_step()[3])

    def _last_step(self):
        out = (ctypes.c_double * 4)()
        self._lib.specdec_model_timings(self._handle, out)
        return list(out)

    def add_linear(self, layer: int, slot: int, parts, bias: torch.Tensor | None, name: str) -> None:
        """Bind a linear layer's weight: `parts` [(first row, models/ggml_blocks.Packed)] in row order; `bias` [N]
        float32 or None. `name` names it in errors."""
        from specdec.models.ggml_blocks import TYPES

        n_total = sum(p.n for _, p in parts)
        if slot == HEAD:
            self.head_rows = n_total
        if bias is not None:
            _check_vector(bias, f"{name}.bias", (n_total,))
        for i, (row, p) in enumerate(parts):
            where = f"{name} part {i} ({p.qtype})"
            try:
                qmm_cpu.check_packed(p, where)
            except qmm_cpu.PackedWeightError as err:
                raise NativeBindError(str(err)) from None
            bt = TYPES[p.qtype]
            part_bias = None if bias is None else bias[row:row + p.n]
            code = self._lib.specdec_model_add_part(
                self._handle, layer, slot, bt.id, row, p.n, p.k, self._keep(p.codes), self._keep(p.da),
                self._keep(p.db if bt.has_b else None), self._keep(p.sa if bt.sub else None),
                self._keep(p.sb if bt.sub and bt.has_b else None), self._keep(part_bias))
            if code != 0:
                raise NativeBindError(f"{where}: refused by the native model (layer {layer}, slot {slot})")

    def set_vector(self, layer: int, slot: int, t: torch.Tensor, length: int, name: str) -> None:
        """Bind a float32 vector (a norm's weight) or, slot EMBED_FLOAT, a float32 [V, E] embedding table."""
        shape = (self.dims["V"], self.dims["E"]) if slot == EMBED_FLOAT else (length,)
        _check_vector(t, name, shape)
        if self._lib.specdec_model_set_vector(self._handle, layer, slot, self._keep(t)) != 0:
            raise NativeBindError(f"{name}: refused by the native model (layer {layer}, slot {slot})")

    def finish(self) -> "NativeModel":
        code = self._lib.specdec_model_check(self._handle)
        if code == 0:
            return self
        if code >= 10:
            layer, item = divmod(code - 10, 10)
            raise NativeBindError(f"native forward: layer {layer}'s {CHECK_ITEMS[item]} is missing or inconsistent")
        what = {2: "the final norm", 3: "the head", 4: "the embedding"}.get(code, "the model")
        raise NativeBindError(f"native forward: {what} is missing or inconsistent")

    def forward(self, ids: torch.Tensor, start: list[int], length: list[int], num_new: list[int], left_padded: bool,
                kv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], logits: str | None = "all",
                hidden: str | None = None, threads: int | None = None, layers: int | None = None):
        """One step: ids [B, T] int64; per row `start`, `length` (cached), `num_new` (real tokens) as host lists;
        kv [L, 2, B, H_kv, C, D] float32 (the cache's view of its rows; D contiguous), written in place; rope the
        (cos, sin) [N, R] tables by position. Returns (logits [B, T, head rows] ("all") or [B, 1, head rows] ("last"),
        hidden
        [B, T, E] ("all") / [B, 1, E] (where the logits are) or None). `threads`: default torch's count for this
        thread. `layers`: run the first `layers` layers only, which write their K/V (logits and hidden None)."""
        B, T = ids.shape
        d = self.dims
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = ids.to(torch.int64).contiguous()
        cos, sin = rope
        L, two, Bk, Hkv, C, D = kv.shape
        if (L, two, Bk, Hkv, D) != (d["L"], 2, B, d["Hkv"], d["D"]) or kv.dtype != torch.float32 \
                or kv.stride(5) != 1 or kv.device.type != "cpu":
            raise ValueError(f"native forward: kv must be float32 [{d['L']}, 2, {B}, {d['Hkv']}, C, {d['D']}] on the "
                             f"CPU with D contiguous, got {kv.dtype} {tuple(kv.shape)}")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous() \
                or not sin.is_contiguous() or cos.shape != sin.shape or cos.shape[1] != d["R"]:
            raise ValueError(f"native forward: the RoPE tables must be float32 [N, {d['R']}], contiguous")
        rows_out = 1 if logits == "last" else T
        out = torch.empty(B, rows_out, self.head_rows) if logits else None  # [B, T or 1, head rows]
        hid = None
        if hidden is not None:
            hid = torch.empty(B, T if hidden == "all" else rows_out, d["E"])  # [B, ., E]
        isa = -1 if self.isa is None else qmm_cpu.ISAS.index(self.isa)
        code = self._lib.specdec_model_forward(
            self._handle, ids.data_ptr(), B, T, _i64_array(start), _i64_array(length), _i64_array(num_new),
            int(left_padded), kv.data_ptr(), _i64_array(kv.stride()[:5]), C, cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], LOGITS_MODES[logits], None if out is None else out.data_ptr(), HIDDEN_MODES[hidden],
            None if hid is None else hid.data_ptr(), isa, int(threads or torch.get_num_threads()), int(layers or 0))
        if code == 2:
            raise RuntimeError(f"native forward: this host cannot run instruction set {self.isa!r} "
                               f"(it runs {qmm_cpu.host_isa()!r})")
        if code != 0:
            raise ValueError(f"native forward: a token id outside [0, {d['V']}), or a column or position outside the "
                             f"cache's {C} columns / the RoPE table's {cos.shape[0]} rows")
        return out, hid
