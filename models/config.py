"""Model configuration read from an HF checkpoint's `config.json` (and `generation_config.json`).

One dataclass covers the three supported families; the per-family differences are flags:

- Llama / Vicuna (`LlamaForCausalLM`): NeoX rotate-half RoPE, GQA, SwiGLU, RMSNorm.
- Qwen3 (`Qwen3ForCausalLM`): explicit `head_dim`, per-head q/k RMSNorm before RoPE, tied embeddings.
- GLM-4-0414 (`Glm4ForCausalLM`): q/k/v biases, partial interleaved RoPE, fused `gate_up_proj`,
  extra post-attention / post-MLP norms.
"""
from __future__ import annotations

import json
import math
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
    def from_dict(cls, raw: dict, source: str = "config.json", generation: dict | None = None,
                  generation_source: str = "generation_config.json") -> "ModelConfig":
        """Build from the parsed `config.json`; `source` (and `generation_source` for `generation`) names the
        file in every error. Every field used is checked for its kind and range: counts are integers >= 1,
        real numbers finite (and > 0 where zero is meaningless), flags booleans, the top level an object."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object at the top level, got {json_kind(raw)}")
        if generation is not None and not isinstance(generation, dict):
            raise CheckpointError(f"{generation_source}: expected a JSON object at the top level, got "
                                  f"{json_kind(generation)}")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise CheckpointError(f"{source}: 'architectures' must be a list of class names, got {shown(archs)}")
        model_type = raw.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise CheckpointError(f"{source}: 'model_type' must be a string, got {shown(model_type)}")
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

        if raw.get("use_sliding_window") or (raw.get("sliding_window") and family != "qwen3"):
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act != "silu":
            raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        def count(key, default=None, holder=raw, name=None):
            """An integer >= 1 (an integral float such as 4096.0 is taken as its integer)."""
            value = holder.get(key)
            if value is None:
                if default is None:
                    raise CheckpointError(f"{source}: missing required key {name or key!r}")
                return default
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{source}: {name or key!r} must be an integer >= 1, got {shown(value)}")
            return value

        def real(key, default, holder=raw, name=None, at_most=None):
            """A finite number > 0 (and <= `at_most`)."""
            value = holder.get(key)
            if value is None:
                return float(default)
            number = as_float(value)
            if not math.isfinite(number) or number <= 0 or (at_most is not None and number > at_most):
                bound = f"in (0, {at_most}]" if at_most is not None else "> 0"
                raise CheckpointError(f"{source}: {name or key!r} must be a finite number {bound}, got {shown(value)}")
            return number

        def flag(key, default):
            value = raw.get(key)
            if value is None:
                return default
            if not isinstance(value, bool):
                raise CheckpointError(f"{source}: {key!r} must be true or false, got {shown(value)}")
            return value

        def table(key):
            value = raw.get(key)
            if value is None:
                return {}
            if not isinstance(value, dict):
                raise CheckpointError(f"{source}: {key!r} must be an object, got {shown(value)}")
            return value

        hidden = count("hidden_size")
        heads = count("num_attention_heads")
        kv_heads = count("num_key_value_heads", default=heads)  # absent means MHA
        head_dim = count("head_dim", default=0) or None
        if head_dim is None:
            if hidden % heads:
                raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                                      f"{heads}, and there is no head_dim")
            head_dim = hidden // heads
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads {heads} not a multiple of num_key_value_heads "
                                  f"{kv_heads}")

        rope = table("rope_parameters")
        legacy_scaling = table("rope_scaling")
        if "rope_theta" in rope:
            theta = real("rope_theta", 10000.0, holder=rope, name="rope_parameters.rope_theta")
        else:
            theta = real("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type", "default")))
        factor = 1.0
        if rope_type == "linear":
            holder, name = (rope, "rope_parameters") if "factor" in rope else (legacy_scaling, "rope_scaling")
            factor = real("factor", 1.0, holder=holder, name=f"{name}.factor")
        elif rope_type not in ("default", None):
            raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only default and linear)")
        if "partial_rotary_factor" in rope:
            partial = real("partial_rotary_factor", 1.0, holder=rope, name="rope_parameters.partial_rotary_factor",
                           at_most=1)
        else:
            partial = real("partial_rotary_factor", 0.5 if family == "glm4" else 1.0, at_most=1)

        eos = set()
        for holder, name in ((raw, source), (generation or {}, generation_source)):
            value = holder.get("eos_token_id")
            values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise CheckpointError(f"{name}: 'eos_token_id' must be a token id (an integer >= 0) or a list "
                                          f"of them, got {shown(value)}")
                eos.add(v)
        bos = raw.get("bos_token_id", (generation or {}).get("bos_token_id"))

        return cls(
            family=family,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=real("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_linear_factor=factor,
            partial_rotary_factor=partial,
            rope_interleaved=family == "glm4",
            attention_bias=flag("attention_bias", family == "glm4"),
            attention_out_bias=family != "glm4" and flag("attention_bias", False),
            mlp_bias=flag("mlp_bias", False),
            qk_norm=family == "qwen3",
            sandwich_norms=family == "glm4",
            fused_gate_up=family == "glm4",
            tie_word_embeddings=flag("tie_word_embeddings", False),
            max_position_embeddings=count("max_position_embeddings", default=4096),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
            eos_token_ids=tuple(sorted(eos)),
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """Read `config.json` (and `generation_config.json` when present) of a checkpoint directory."""
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: checkpoint directory does not exist")
        config_path = os.path.join(path, "config.json")
        raw = read_json(config_path, required=True)
        generation_path = os.path.join(path, "generation_config.json")
        generation = read_json(generation_path, required=False)
        return cls.from_dict(raw, source=config_path, generation=generation, generation_source=generation_path)


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


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words: for messages about the wrong kind of value."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def as_float(value) -> float:
    """A JSON number as a float; NaN for anything else (a string, a boolean, an integer too large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.nan


def shown(value) -> str:
    """A config value for a one-line message: its repr, cut short, with its JSON kind when not a number."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return text if json_kind(value) == "a number" else f"{text} ({json_kind(value)})"
