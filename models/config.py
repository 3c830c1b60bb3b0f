"""Model configuration read from an HF checkpoint's `config.json` (and `generation_config.json`).

One dataclass covers the three supported families; the per-family differences are flags:

- Llama / Vicuna (`LlamaForCausalLM`): NeoX rotate-half RoPE, GQA, SwiGLU, RMSNorm.
- Qwen3 (`Qwen3ForCausalLM`): explicit `head_dim`, per-head q/k RMSNorm before RoPE, tied embeddings.
- GLM-4-0414 (`Glm4ForCausalLM`): q/k/v biases, partial interleaved RoPE, fused `gate_up_proj`,
  extra post-attention / post-MLP norms.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Glm4ForCausalLM": "glm4",
}
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "glm4": "glm4"}  # used when `architectures` is absent


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen3" | "glm4"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0  # Llama-style linear position scaling
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated
    rope_interleaved: bool = False  # GLM-4 rotates (0,1),(2,3).. pairs instead of halves
    attention_bias: bool = False  # q/k/v projections
    attention_out_bias: bool = False  # o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    sandwich_norms: bool = False  # GLM-4 post_self_attn_layernorm / post_mlp_layernorm
    fused_gate_up: bool = False  # GLM-4 gate_up_proj (gate first)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", generation: dict | None = None) -> "ModelConfig":
        """Build from the parsed `config.json`; `source` names the file in every error."""
        archs = raw.get("architectures") or []
        if "auto_map" in raw or raw.get("model_type") == "chatglm":
            raise CheckpointError(
                f"{source}: remote-code checkpoint (model_type={raw.get('model_type')!r}, "
                f"architectures={archs}) is not supported; convert it to Glm4ForCausalLM / HF format first"
            )
        if archs:
            family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        else:  # as transformers does: without `architectures`, `model_type` says what the model is
            family = SUPPORTED_MODEL_TYPES.get(raw.get("model_type"))
        if family is None:
            raise CheckpointError(
                f"{source}: unsupported architectures {archs!r} (model_type {raw.get('model_type')!r}); supported: "
                f"architectures {sorted(SUPPORTED_ARCHITECTURES)}, or without architectures a model_type in "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key):
            if key not in raw:
                raise CheckpointError(f"{source}: missing required key {key!r}")
            return raw[key]

        if raw.get("use_sliding_window") or (raw.get("sliding_window") and family != "qwen3"):
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act != "silu":
            raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = raw.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else int(kv_heads)  # absent means MHA
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}")

        rope = dict(raw.get("rope_parameters") or {})
        legacy_scaling = raw.get("rope_scaling") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type", "default")))
        factor = 1.0
        if rope_type == "linear":
            factor = float(rope.get("factor", legacy_scaling.get("factor", 1.0)))
        elif rope_type not in ("default", None):
            raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only default and linear)")
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if partial is None:
            partial = 0.5 if family == "glm4" else 1.0

        eos = set()
        for holder in (raw, generation or {}):
            value = holder.get("eos_token_id")
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, (list, tuple)):
                eos.update(int(v) for v in value)
        bos = raw.get("bos_token_id", (generation or {}).get("bos_token_id"))

        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_linear_factor=factor,
            partial_rotary_factor=float(partial),
            rope_interleaved=family == "glm4",
            attention_bias=bool(raw.get("attention_bias", family == "glm4")),
            attention_out_bias=family != "glm4" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sandwich_norms=family == "glm4",
            fused_gate_up=family == "glm4",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            bos_token_id=bos if isinstance(bos, int) else None,
            eos_token_ids=tuple(sorted(eos)),
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """Read `config.json` (and `generation_config.json` when present) of a checkpoint directory."""
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: checkpoint directory does not exist")
        config_path = os.path.join(path, "config.json")
        raw = read_json(config_path, required=True)
        generation = read_json(os.path.join(path, "generation_config.json"), required=False)
        return cls.from_dict(raw, source=config_path, generation=generation)


def read_json(path: str, required: bool) -> dict | None:
    """Parse a JSON file; a missing required file or bad JSON raises CheckpointError naming it."""
    if not os.path.exists(path):
        if required:
            raise CheckpointError(f"{path}: file not found")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot parse JSON ({err})") from None
