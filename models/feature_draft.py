"""A feature draft (EAGLE-style): a few decoder layers that read the target's own hidden states.

At position j the draft's input is `fc([embed(token_j), feature_{j-1}])`, where feature_{j-1} is the
target's last-layer output (before its final norm) at position j - 1, or, past the verified tokens, the
draft's own output there; its output at j, through the target's final norm and head, predicts token j + 1.
It borrows the target's embedding and final norm (shared, not copied) and ships only `fc`, its layers and,
optionally, a reduced draft vocabulary (FR-Spec: the head's rows of the most frequent tokens; logits of the
other ids are the dtype's lowest finite value, so they are never drafted and the draft's distribution stays
a distribution over the full vocabulary: verification, and so exactness, is untouched).

On disk: a directory with `config.json` (`"architectures": ["SpecdecFeatureDraft"]`, the layer shapes, the
fingerprint of the target it was trained for) and `model.safetensors` (`fc.*`, `layers.N.*` in our fused
names, `draft_vocab` int64 ids). docs/api.md has the protocol the runtime relies on.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from . import numerics
from .config import ModelConfig
from .errors import CheckpointError
from .quant import embedding_rows, linear_weight
from .transformer import DecoderLayer, Transformer

ARCHITECTURE = "SpecdecFeatureDraft"
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")


def is_feature_draft(path) -> bool:
    """Whether `path` is a feature-draft directory (its config.json names our architecture)."""
    config = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and ARCHITECTURE in (raw.get("architectures") or [])


def fingerprint_weights(cfg: ModelConfig) -> tuple[str, ...]:
    """The weights `fingerprint` samples (HF names without `model.`)."""
    return ("embed_tokens.weight", "layers.0.mlp.down_proj.weight", f"layers.{cfg.num_layers - 1}.mlp.down_proj.weight")


def fingerprint_rows(rows: int) -> slice:
    """The rows of a weight `fingerprint` samples: about 64, evenly spaced."""
    return slice(None, None, max(1, rows // 64))


def fingerprint(model: Transformer) -> str:
    """sha256 (hex) of a model's config and a fixed sample of its weights rounded to bfloat16: names the
    weights, not the file (a .gguf and its safetensors conversion agree, and so do float32, float64 and
    bfloat16 loads of either). A quantized load (`quantize=`) holds other numbers than the file: its loader
    keeps the sample as the file has it (`model.fingerprint_samples`), so it is recognised as the float load is."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model.cfg), sort_keys=True, default=str).encode())
    samples = getattr(model, "fingerprint_samples", None)
    if samples is None:
        embed, first, last = model.embed_tokens, model.layers[0].mlp.down_proj, model.layers[-1].mlp.down_proj
        samples = [embedding_rows(embed, fingerprint_rows(embed.num_embeddings))]  # only those rows
        samples += [w[fingerprint_rows(w.shape[0])] for w in (linear_weight(first), linear_weight(last))]
    for sample in samples:  # [~64, E] each
        sample = sample.detach().to("cpu", torch.bfloat16).to(torch.float32).contiguous()
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


class FeatureDraft(Transformer):
    """The draft model of the module docstring; meets the model protocol plus `reads_target_hidden`."""

    reads_target_hidden = True

    def __init__(self, cfg: ModelConfig, target: Transformer, draft_vocab: torch.Tensor | None = None):
        # cfg: the target's config with num_layers = the draft's layers. Transformer's constructor sets the config
        # and the runtime state (compiled forward, numerics modes, RoPE table); its parts, built on the meta
        # device (nothing allocated, no random numbers drawn), are replaced by ours below
        with torch.device("meta"):
            super().__init__(cfg, fused=True)
        del self.embed_tokens, self.layers, self.norm, self.lm_head
        E = cfg.hidden_size
        self._borrowed = (target.embed_tokens, target.norm)  # a tuple: shared, not registered as our modules
        self.fc = nn.Linear(2 * E, E, bias=True, dtype=target.dtype, device=target.device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, fused=True) for _ in range(cfg.num_layers)).to(
            dtype=target.dtype, device=target.device)
        head = linear_weight(target.lm_head, target.dtype).detach()  # [V, E] (dequantized if quantized)
        if draft_vocab is not None:
            draft_vocab = draft_vocab.to(device=target.device, dtype=torch.int64)  # [V']
            head = head.index_select(0, draft_vocab)  # [V', E]
        self.lm_head = nn.Linear(E, head.shape[0], bias=False, dtype=target.dtype, device=target.device)
        with torch.no_grad():
            self.lm_head.weight.copy_(head)
        self.lm_head.weight.requires_grad_(False)  # the target's rows: trained with the target, never here
        self.register_buffer("draft_vocab", draft_vocab, persistent=False)
        self.fc_kernel = None  # (x, backend) -> fc(x): `choose_kernels`
        self.choose_kernels()

    def choose_kernels(self) -> None:
        """Transformer's kernels, and fc's."""
        super().choose_kernels()
        self.fc_kernel = numerics.linear_kernel(self.fc, self.batch_invariant, self.packed_linear)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._borrowed[0]

    @property
    def norm(self) -> nn.Module:
        return self._borrowed[1]

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.num_embeddings

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, input_ids, features=None, backend=None):
        """fc([embed(ids), features]) [B, T, E]; no features (a timing forward, or position 0): zeros."""
        e = self.embed_tokens(input_ids)  # [B, T, E]
        f = torch.zeros_like(e) if features is None else features.to(e.dtype)  # [B, T, E]
        return self.fc_kernel(torch.cat([e, f], dim=-1), backend)

    def head(self, h, backend=None):
        """Logits over the full vocabulary [B, T, V]: the draft vocabulary's from the head, the lowest finite
        value for every other id (never drafted; probability 0 after softmax)."""
        logits = self.head_kernel(self.norm(h, backend), backend)  # [B, T, V']
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), torch.finfo(logits.dtype).min)  # [B, T, V]
        return full.index_copy_(-1, self.draft_vocab, logits)

    @torch.no_grad()
    def layer0_kv(self, token_ids, positions, features=None):
        """K/V of layer 0 for tokens [B, T] at positions [B, T] with their features [B, T, E] (invariants)."""
        layer = self.layers[0]
        _, k, v = layer.self_attn.qkv(layer.input_layernorm(self.embed(token_ids, features)),
                                      *self.rope_heads(positions))
        return k, v

    def own_state(self) -> dict[str, torch.Tensor]:
        """What a saved draft holds: fc, the layers and the draft vocabulary (not the borrowed tensors)."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("lm_head.")}
        if self.draft_vocab is not None:
            state["draft_vocab"] = self.draft_vocab
        return state


def layer_config(target_cfg: ModelConfig, num_layers: int) -> ModelConfig:
    return dataclasses.replace(target_cfg, num_layers=num_layers)


def save_feature_draft(draft: FeatureDraft, directory, target: Transformer, meta: dict | None = None) -> None:
    """Write `directory`/config.json and model.safetensors (float32) for a draft of `target`."""
    os.makedirs(directory, exist_ok=True)
    cfg = draft.cfg
    config = {"architectures": [ARCHITECTURE], "num_layers": cfg.num_layers,
              **{f: getattr(cfg, f) for f in LAYER_FIELDS},
              "draft_vocab_size": None if draft.draft_vocab is None else int(draft.draft_vocab.numel()),
              "target_fingerprint": fingerprint(target), **(meta or {})}
    state = {k: (v.float() if v.is_floating_point() else v).contiguous().cpu() for k, v in draft.own_state().items()}
    save_file(state, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def load_feature_draft(directory, target: Transformer) -> FeatureDraft:
    """The feature draft saved in `directory`, attached to `target` (its dtype and device). Raises
    CheckpointError naming the file and field when the draft's layer shapes do not fit the target."""
    directory = os.fspath(directory)
    config_path, weights_path = (os.path.join(directory, f) for f in ("config.json", "model.safetensors"))
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{config_path}: cannot read the feature draft's config ({err})") from None
    for field in LAYER_FIELDS:
        if raw.get(field) != getattr(target.cfg, field):
            raise CheckpointError(f"{config_path}: {field} is {raw.get(field)!r} but the target's is "
                                  f"{getattr(target.cfg, field)!r}; this draft was made for another target")
    num_layers = raw.get("num_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise CheckpointError(f"{config_path}: num_layers must be an integer >= 1, got {num_layers!r}")
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            state = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{weights_path}: cannot read safetensors file ({err})") from None
    vocab = state.pop("draft_vocab", None)
    if vocab is not None and (vocab.dtype != torch.int64 or vocab.dim() != 1 or len(vocab) == 0
                              or int(vocab.min()) < 0 or int(vocab.max()) >= target.vocab_size):
        raise CheckpointError(f"{weights_path}: draft_vocab must be int64 ids in [0, {target.vocab_size})")
    draft = FeatureDraft(layer_config(target.cfg, num_layers), target, vocab)
    expected = {k for k in draft.state_dict() if not k.startswith("lm_head.")}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise CheckpointError(f"{weights_path}: " + (f"missing weight(s) {missing[:3]}" if missing else
                                                     f"unexpected weight(s) {extra[:3]}"))
    draft.load_state_dict({k: v.to(draft.dtype) for k, v in state.items()}, strict=False)
    return draft.eval().requires_grad_(False)
