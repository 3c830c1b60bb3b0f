"""Model configuration read from an HF checkpoint's `config.json` (and `generation_config.json`).

One dataclass covers the three supported families; what sets each apart is its `FamilySpec` in `FAMILIES`:

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


@dataclass(frozen=True)
class FamilySpec:
    """What sets one family apart: the names config.json gives it, and the ModelConfig fields it fixes or
    defaults. Everything else is read from config.json the same way for every family (`ModelConfig.from_dict`)."""

    architecture: str  # its class name in `architectures`
    model_type: str  # its `model_type`, which names it when `architectures` is absent
    sliding_window_allowed: bool = False  # may write `sliding_window` (Qwen3 does, with use_sliding_window false)
    partial_rotary_factor: float = 1.0  # when config.json does not say
    rope_interleaved: bool = False
    attention_bias: bool = False  # q/k/v biases when config.json has no `attention_bias`
    attention_bias_on_output: bool = True  # `attention_bias` also gives o_proj a bias (GLM-4: never)
    qk_norm: bool = False
    sandwich_norms: bool = False
    fused_gate_up: bool = False


FAMILIES = {
    "llama": FamilySpec("LlamaForCausalLM", "llama"),
    "qwen3": FamilySpec("Qwen3ForCausalLM", "qwen3", sliding_window_allowed=True, qk_norm=True),
    "glm4": FamilySpec("Glm4ForCausalLM", "glm4", partial_rotary_factor=0.5, rope_interleaved=True,
                       attention_bias=True, attention_bias_on_output=False, sandwich_norms=True, fused_gate_up=True),
}
SUPPORTED_ARCHITECTURES = {spec.architecture: family for family, spec in FAMILIES.items()}
SUPPORTED_MODEL_TYPES = {spec.model_type: family for family, spec in FAMILIES.items()}  # without `architectures`


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
        family = family_of(raw, source)
        spec = FAMILIES[family]
        if raw.get("use_sliding_window") or (raw.get("sliding_window") and not spec.sliding_window_allowed):
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act != "silu":
            raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        keys = ConfigKeys(raw, source)
        hidden, heads, kv_heads, head_dim = attention_shape(keys)
        theta, factor, partial = rope_settings(keys, spec)
        bos, eos = special_tokens(raw, source, generation or {}, generation_source)
        return cls(
            family=family,
            vocab_size=keys.count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=keys.count("intermediate_size"),
            num_layers=keys.count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=keys.real("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_linear_factor=factor,
            partial_rotary_factor=partial,
            rope_interleaved=spec.rope_interleaved,
            attention_bias=keys.flag("attention_bias", spec.attention_bias),
            attention_out_bias=spec.attention_bias_on_output and keys.flag("attention_bias", spec.attention_bias),
            mlp_bias=keys.flag("mlp_bias", False),
            qk_norm=spec.qk_norm,
            sandwich_norms=spec.sandwich_norms,
            fused_gate_up=spec.fused_gate_up,
            tie_word_embeddings=keys.flag("tie_word_embeddings", False),
            max_position_embeddings=keys.count("max_position_embeddings", default=4096),
            bos_token_id=bos,
            eos_token_ids=eos,
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


def family_of(raw: dict, source: str) -> str:
    """The family config.json names: by its `architectures`, or without them by its `model_type`."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{source}: 'architectures' must be a list of class names, got {shown(archs)}")
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"{source}: 'model_type' must be a string, got {shown(model_type)}")
    if "auto_map" in raw or model_type == "chatglm":
        raise CheckpointError(
            f"{source}: remote-code checkpoint (model_type={model_type!r}, "
            f"architectures={archs}) is not supported; convert it to Glm4ForCausalLM / HF format first"
        )
    if archs:
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    else:  # as transformers does: without `architectures`, `model_type` says what the model is
        family = SUPPORTED_MODEL_TYPES.get(model_type)
    if family is None:
        raise CheckpointError(
            f"{source}: unsupported architectures {archs!r} (model_type {model_type!r}); supported: "
            f"architectures {sorted(SUPPORTED_ARCHITECTURES)}, or without architectures a model_type in "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return family


class ConfigKeys:
    """Reads config.json's keys, each checked for its kind and range; every error names `source` and the key."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def count(self, key, default=None, holder=None, name=None) -> int:
        """An integer >= 1 (an integral float such as 4096.0 is taken as its integer)."""
        value = (self.raw if holder is None else holder).get(key)
        if value is None:
            if default is None:
                raise CheckpointError(f"{self.source}: missing required key {name or key!r}")
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{self.source}: {name or key!r} must be an integer >= 1, got {shown(value)}")
        return value

    def real(self, key, default, holder=None, name=None, at_most=None) -> float:
        """A finite number > 0 (and <= `at_most`)."""
        value = (self.raw if holder is None else holder).get(key)
        if value is None:
            return float(default)
        number = as_float(value)
        if not math.isfinite(number) or number <= 0 or (at_most is not None and number > at_most):
            bound = f"in (0, {at_most}]" if at_most is not None else "> 0"
            raise CheckpointError(f"{self.source}: {name or key!r} must be a finite number {bound}, got "
                                  f"{shown(value)}")
        return number

    def flag(self, key, default) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.source}: {key!r} must be true or false, got {shown(value)}")
        return value

    def table(self, key) -> dict:
        value = self.raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise CheckpointError(f"{self.source}: {key!r} must be an object, got {shown(value)}")
        return value


def attention_shape(keys: ConfigKeys) -> tuple[int, int, int, int]:
    """(hidden_size, heads, kv heads, head_dim): kv heads default to heads (MHA), head_dim to hidden_size / heads."""
    hidden = keys.count("hidden_size")
    heads = keys.count("num_attention_heads")
    kv_heads = keys.count("num_key_value_heads", default=heads)
    head_dim = keys.count("head_dim", default=0) or None
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"{keys.source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                                  f"{heads}, and there is no head_dim")
        head_dim = hidden // heads
    if heads % kv_heads:
        raise CheckpointError(f"{keys.source}: num_attention_heads {heads} not a multiple of num_key_value_heads "
                              f"{kv_heads}")
    return hidden, heads, kv_heads, head_dim


def rope_settings(keys: ConfigKeys, spec: FamilySpec) -> tuple[float, float, float]:
    """(theta, linear factor, partial rotary factor), from `rope_parameters` (transformers 5) where it has
    them, else the top-level keys and the legacy `rope_scaling`. Only default and linear RoPE are supported."""
    rope = keys.table("rope_parameters")
    legacy_scaling = keys.table("rope_scaling")
    if "rope_theta" in rope:
        theta = keys.real("rope_theta", 10000.0, holder=rope, name="rope_parameters.rope_theta")
    else:
        theta = keys.real("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type", "default")))
    factor = 1.0
    if rope_type == "linear":
        holder, name = (rope, "rope_parameters") if "factor" in rope else (legacy_scaling, "rope_scaling")
        factor = keys.real("factor", 1.0, holder=holder, name=f"{name}.factor")
    elif rope_type not in ("default", None):
        raise CheckpointError(f"{keys.source}: rope type {rope_type!r} is not supported (only default and linear)")
    if "partial_rotary_factor" in rope:
        partial = keys.real("partial_rotary_factor", 1.0, holder=rope, name="rope_parameters.partial_rotary_factor",
                            at_most=1)
    else:
        partial = keys.real("partial_rotary_factor", spec.partial_rotary_factor, at_most=1)
    return theta, factor, partial


def special_tokens(raw: dict, source: str, generation: dict, generation_source: str) -> tuple[int | None, tuple]:
    """(BOS id or None, the sorted EOS ids): config.json's and generation_config.json's EOS ids together."""
    eos = set()
    for holder, name in ((raw, source), (generation, generation_source)):
        value = holder.get("eos_token_id")
        values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CheckpointError(f"{name}: 'eos_token_id' must be a token id (an integer >= 0) or a list "
                                      f"of them, got {shown(value)}")
            eos.add(v)
    bos = raw.get("bos_token_id", generation.get("bos_token_id"))
    return (bos if isinstance(bos, int) and not isinstance(bos, bool) else None), tuple(sorted(eos))


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
