"""LingConfig: the Ling-3.0 (BailingMoeV3) hyper-parameters, read from and written to config.json.

Field names are the checkpoint's own `config.json` keys (docs/architecture.md in shared/, section 1).
`from_json` refuses anything that is not a Ling-3 checkpoint (other architectures, Ling 2.x
`bailing_hybrid`) and any value the model cannot run, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURE = "BailingMoeV3ForCausalLM"
MODEL_TYPE = "bailing_hybrid"


class ConfigError(ValueError):
    """A config.json that lingc cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class LingConfig:
    # sizes
    vocab_size: int = 157184
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    layer_group_size: int = 4              # last layer of each group is MLA, the rest KDA
    first_k_dense_replace: int = 1         # layers i < this use the dense SwiGLU MLP
    intermediate_size: int = 4608          # dense MLP width
    num_attention_heads: int = 16          # MLA heads and KDA heads
    num_key_value_heads: int = 16          # not used by MLA or KDA; kept for round trips
    head_dim: int = 128                    # KDA head dim
    # KDA
    short_conv_kernel_size: int = 4
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    linear_silu: bool = True
    use_qk_norm: bool = True               # the KDA L2 norm of q and k
    num_kv_heads_for_linear_attn: int = 0  # 0 means KDA uses num_attention_heads
    group_norm_size: int = 1
    # MLA
    q_lora_rank: int | None = 256          # None: a single q_proj (Flash); else q_a -> norm -> q_b
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    gated_attention_proj_granularity_type: str = "head_wise"
    rope_theta: float = 6_000_000.0
    rope_interleave: bool = True
    partial_rotary_factor: float = 0.5     # informational: the rotary width is qk_rope_head_dim
    rope_scaling: dict | None = None
    max_position_embeddings: int = 131072
    # MoE
    num_experts: int = 128
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 512
    moe_shared_expert_intermediate_size: int = 512
    n_group: int = 8
    topk_group: int = 4
    score_function: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_router_enable_expert_bias: bool = True
    router_dtype: str = "fp32"
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    expert_swiglu_limit_list: tuple[float, ...] | None = None        # per layer, 0 = no clamp
    share_expert_swiglu_limit_list: tuple[float, ...] | None = None
    # MTP
    num_nextn_predict_layers: int = 0
    mtp_use_kda: bool = False
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_qkv_bias: bool = False
    use_bias: bool = False
    eos_token_id: int | tuple[int, ...] | None = 156895
    pad_token_id: int | None = 156892
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # config.json keys lingc does not use, kept so a round trip loses nothing
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list", "eos_token_id"):
            if isinstance(getattr(self, name), list):                  # lists from JSON -> hashable tuples
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _validate(self)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_heads(self) -> int:
        return self.num_kv_heads_for_linear_attn or self.num_attention_heads

    @property
    def kda_dim(self) -> int:
        """P = H * D, the width of KDA q/k/v/f/g."""
        return self.kda_heads * self.head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per MLA layer: normed c_kv then rotated k_rope (576 at real size)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_mla_layer(self, i: int) -> bool:
        """Layer i is MLA if it ends a group or lies in the final incomplete group; MTP layers are MLA."""
        if i >= self.num_hidden_layers:
            return not self.mtp_use_kda
        g = self.layer_group_size
        return (i + 1) % g == 0 or i >= (self.num_hidden_layers // g) * g

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def expert_limit(self, i: int) -> float:
        """SwiGLU clamp of routed experts in layer i; 0 = none (also past the end of the list)."""
        return _limit(self.expert_swiglu_limit_list, i)

    def shared_limit(self, i: int) -> float:
        return _limit(self.share_expert_swiglu_limit_list, i)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    # ---- json ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        # derived keys real checkpoints carry, for other readers (transformers, vLLM)
        d["qk_head_dim"] = self.qk_head_dim
        d["rotary_dim"] = self.qk_rope_head_dim
        d["hidden_act"] = "silu"
        d["use_kda_lora"] = not self.no_kda_lora
        d["n_shared_experts"] = self.num_shared_experts
        d["scoring_func"] = self.score_function
        for k, v in self.extra.items():
            d.setdefault(k, v)
        return d

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "LingConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: top level must be a JSON object, got {type(d).__name__}")
        _check_architecture(d, source)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in d.items():
            if k in names:
                kwargs[k] = tuple(v) if isinstance(v, list) else v
            elif k not in _DERIVED_KEYS:
                extra[k] = v
        if "score_function" not in d and "scoring_func" in d:
            kwargs["score_function"] = d["scoring_func"]
        rope_params = d.get("rope_parameters")
        rope_type = rope_params.get("rope_type", "default") if isinstance(rope_params, dict) else "default"
        if rope_type != "default":                                    # transformers 5 spelling of rope_scaling
            raise ConfigError(f"{source}: field 'rope_parameters' has rope_type {rope_type!r}, want 'default' "
                              "(Ling-3 uses no RoPE scaling)")
        if "torch_dtype" not in d and isinstance(d.get("dtype"), str):
            kwargs["torch_dtype"] = d["dtype"]
        try:
            cfg = cls(**kwargs, extra=extra)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None
        derived = (("qk_head_dim", cfg.qk_head_dim), ("rotary_dim", cfg.qk_rope_head_dim),
                   ("use_kda_lora", not cfg.no_kda_lora), ("scoring_func", cfg.score_function),
                   ("n_shared_experts", cfg.num_shared_experts), ("hidden_act", "silu"))
        for k, want in derived:
            if k in d and d[k] != want:
                raise ConfigError(f"{source}: field '{k}' is {d[k]!r}, want {want!r} "
                                  "(must agree with the other fields)")
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "LingConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: no such file (a checkpoint directory needs a config.json)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        return cls.from_dict(d, source=str(path))

    def replace(self, **changes: Any) -> "LingConfig":
        return dataclasses.replace(self, **changes)


_DERIVED_KEYS = {"architectures", "model_type", "qk_head_dim", "rotary_dim", "hidden_act", "use_kda_lora",
                 "n_shared_experts", "scoring_func", "dtype", "auto_map", "transformers_version"}


def _limit(limits: tuple[float, ...] | None, i: int) -> float:
    if not limits or i >= len(limits):
        return 0.0
    return float(limits[i])


def _check_architecture(d: dict[str, Any], source: str) -> None:
    arch = d.get("architectures")
    mt = d.get("model_type")
    if mt != MODEL_TYPE:
        raise ConfigError(f"{source}: field 'model_type' is {mt!r}; lingc runs only '{MODEL_TYPE}' (Ling-3.0)")
    if arch != [ARCHITECTURE]:
        raise ConfigError(
            f"{source}: field 'architectures' is {arch!r}; lingc runs only [{ARCHITECTURE!r}]. "
            "Ling 2.x checkpoints share model_type 'bailing_hybrid' but use Lightning/GLA attention, not KDA.")
    for marker in ("no_kda_lora", "kda_safe_gate"):
        if marker not in d:
            raise ConfigError(f"{source}: field '{marker}' is missing; every Ling-3 (KDA) config has it. "
                              "Is this a Ling 2.x bailing_hybrid checkpoint?")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(cond: bool, name: str, value: Any, want: str) -> None:
    if not cond:
        raise ConfigError(f"field '{name}' is {value!r}, want {want}")


def _validate(c: LingConfig) -> None:
    ints = ["vocab_size", "hidden_size", "num_hidden_layers", "layer_group_size", "intermediate_size",
            "num_attention_heads", "head_dim", "short_conv_kernel_size", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "n_group", "topk_group", "max_position_embeddings", "num_shared_experts",
            "moe_shared_expert_intermediate_size"]
    for name in ints:
        v = getattr(c, name)
        _need(_is_int(v) and v > 0, name, v, "a positive integer")
    for name in ("first_k_dense_replace", "num_nextn_predict_layers", "num_kv_heads_for_linear_attn"):
        v = getattr(c, name)
        _need(_is_int(v) and v >= 0, name, v, "an integer >= 0")
    _need(c.q_lora_rank is None or (_is_int(c.q_lora_rank) and c.q_lora_rank > 0),
          "q_lora_rank", c.q_lora_rank, "null or a positive integer")
    _need(c.no_kda_lora is True, "no_kda_lora", c.no_kda_lora, "true (Ling-3 uses full-rank f_proj/g_proj)")
    _need(c.kda_safe_gate is True, "kda_safe_gate", c.kda_safe_gate, "true (Ling-3 uses the bounded gate)")
    _need(isinstance(c.kda_lower_bound, (int, float)) and c.kda_lower_bound < 0, "kda_lower_bound",
          c.kda_lower_bound, "a negative number")
    _need(c.gated_attention_proj_granularity_type == "head_wise", "gated_attention_proj_granularity_type",
          c.gated_attention_proj_granularity_type, "'head_wise'")
    _need(c.score_function == "sigmoid", "score_function", c.score_function, "'sigmoid'")
    _need(c.topk_method == "noaux_tc", "topk_method", c.topk_method, "'noaux_tc' (grouped, bias-for-selection routing)")
    # the reference model always does these; a config that turns one off describes another model
    for name in ("moe_router_enable_expert_bias", "norm_topk_prob", "linear_silu", "use_qk_norm"):
        _need(getattr(c, name) is True, name, getattr(c, name), "true (lingc implements only that)")
    _need(c.router_dtype in ("fp32", "float32"), "router_dtype", c.router_dtype, "'fp32'")
    _need(c.rope_interleave is True, "rope_interleave", c.rope_interleave, "true")
    _need(c.rope_scaling is None, "rope_scaling", c.rope_scaling, "null (Ling-3 uses no RoPE scaling)")
    _need(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", c.qk_rope_head_dim, "an even number")
    _need(c.tie_word_embeddings is False, "tie_word_embeddings", c.tie_word_embeddings, "false")
    _need(c.use_qkv_bias is False, "use_qkv_bias", c.use_qkv_bias, "false (no biases)")
    _need(c.use_bias is False, "use_bias", c.use_bias, "false (no biases)")
    _need(c.mtp_use_kda is False, "mtp_use_kda", c.mtp_use_kda, "false (the MTP mixer is MLA)")
    _need(c.num_experts % c.n_group == 0, "n_group", c.n_group, f"a divisor of num_experts={c.num_experts}")
    _need(c.num_experts // c.n_group >= 2, "n_group", c.n_group,
          "groups of at least 2 experts (group score = top-2 sum)")
    _need(c.topk_group <= c.n_group, "topk_group", c.topk_group, f"<= n_group={c.n_group}")
    _need(c.num_experts_per_tok <= c.topk_group * (c.num_experts // c.n_group), "num_experts_per_tok",
          c.num_experts_per_tok, "at most topk_group * experts per group")
    _need(c.first_k_dense_replace <= c.num_hidden_layers, "first_k_dense_replace", c.first_k_dense_replace,
          f"<= num_hidden_layers={c.num_hidden_layers}")
    _need(isinstance(c.rms_norm_eps, (int, float)) and c.rms_norm_eps > 0, "rms_norm_eps", c.rms_norm_eps, "> 0")
    _need(isinstance(c.rope_theta, (int, float)) and c.rope_theta > 0, "rope_theta", c.rope_theta, "> 0")
    _need(isinstance(c.routed_scaling_factor, (int, float)) and math.isfinite(c.routed_scaling_factor),
          "routed_scaling_factor", c.routed_scaling_factor, "a finite number")
    _need(c.torch_dtype in ("bfloat16", "float16", "float32"), "torch_dtype", c.torch_dtype,
          "'bfloat16', 'float16' or 'float32'")
    eos = c.eos_token_id
    _need(eos is None or _is_int(eos) or (isinstance(eos, tuple) and all(_is_int(x) for x in eos)),
          "eos_token_id", eos, "an integer, a list of integers or null")
    _need(c.pad_token_id is None or _is_int(c.pad_token_id), "pad_token_id", c.pad_token_id, "an integer or null")
    for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        v = getattr(c, name)
        if v is None:
            continue
        _need(isinstance(v, tuple), name, v, "a list of numbers or null")
        _need(all(isinstance(x, (int, float)) and x >= 0 for x in v), name, v, "a list of numbers >= 0")
        n = c.num_hidden_layers + c.num_nextn_predict_layers
        _need(len(v) <= n, name, f"<{len(v)} entries>", f"at most {n} entries (one per layer, MTP included)")
