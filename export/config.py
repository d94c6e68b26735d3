"""Model configs read from Hugging Face ``config.json`` files.

Two frozen dataclasses describe everything the PyTorch modules, the exporter
and the runtime need: ``TargetConfig`` (Qwen3 / Llama) and ``DraftConfig``
(the z-lab DFlash layout: Qwen3Config fields + ``block_size``,
``num_target_layers``, ``dflash_config.{target_layer_ids, mask_token_id}``).
Unsupported features are refused here, with the field and value named, rather
than silently mis-modelled later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.checks import is_int
from dflash_trt.errors import ConfigError, PairError

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
ROPE_KINDS = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters`` / ``rope_scaling``)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class AttentionConfig:
    """Shape of a Qwen3/Llama decoder stack (shared by target and draft)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Per layer: 0 = full attention, w > 0 = sliding window of w positions.
    windows: tuple[int, ...]


@dataclass(frozen=True)
class TargetConfig(AttentionConfig):
    arch: str = "qwen3"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def default_tap_layers(self, count: int) -> tuple[int, ...]:
        """docs/design.md §1: m == 1 → [N // 2]; else round(1 + i * (N - 4) / (m - 1))."""
        n = self.num_layers
        if count == 1:
            return (n // 2,)
        return tuple(int(round(1 + i * (n - 4) / (count - 1))) for i in range(count))


@dataclass(frozen=True)
class DraftConfig(AttentionConfig):
    block_size: int = 16
    num_target_layers: int = 0
    target_layer_ids: tuple[int, ...] = ()
    mask_token_id: int = 0
    embedding_scale: float = 1.0


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"{path}: file not found") from error
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from error


def _field(raw: dict, name: str, kind: type, path: Path, default: Any = ...):
    value = raw.get(name, default)
    if value is ...:
        raise ConfigError(f"{path}: required field '{name}' is missing")
    if value is None and default is None:
        return None
    if kind is float and is_int(value):
        value = float(value)
    if not (is_int(value) if kind is int else isinstance(value, kind)):
        raise ConfigError(f"{path}: field '{name}' must be {kind.__name__}, got {value!r}")
    if kind is int and value <= 0 and name not in _MAY_BE_ZERO:
        raise ConfigError(f"{path}: field '{name}' must be > 0, got {value}")
    return value


_MAY_BE_ZERO = {"bos_token_id", "pad_token_id", "mask_token_id", "sliding_window"}


def _rope(raw: dict, path: Path) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: 'rope_parameters' must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{path}: per-layer-type 'rope_parameters' are not supported")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ConfigError(f"{path}: rope type must be one of {ROPE_KINDS}, got {kind!r}")
    if raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{path}: 'partial_rotary_factor' must be 1.0 (partial RoPE unsupported)")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _windows(raw: dict, arch: str, layers: int, path: Path) -> tuple[int, ...]:
    """Per-layer sliding windows from ``layer_types`` / ``sliding_window``."""
    window = raw.get("sliding_window")
    if arch == "qwen3" and not raw.get("use_sliding_window", False) and "layer_types" not in raw:
        window = None
    types = raw.get("layer_types")
    if types is None:
        if window is None:
            types = ["full_attention"] * layers
        else:
            first = raw.get("max_window_layers", layers) if arch == "qwen3" else 0
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ConfigError(f"{path}: 'layer_types' has {len(types)} entries, num_hidden_layers is {layers}")
    result = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            result.append(0)
        elif kind == "sliding_attention":
            if not is_int(window) or window <= 0:
                raise ConfigError(f"{path}: layer {i} is sliding but 'sliding_window' is {window!r}")
            result.append(window)
        else:
            raise ConfigError(f"{path}: layer_types[{i}] must be full_attention or sliding_attention, got {kind!r}")
    return tuple(result)


def _stack(raw: dict, arch: str, path: Path) -> dict[str, Any]:
    hidden = _field(raw, "hidden_size", int, path)
    heads = _field(raw, "num_attention_heads", int, path)
    kv_heads = _field(raw, "num_key_value_heads", int, path, heads)
    layers = _field(raw, "num_hidden_layers", int, path)
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise ConfigError(f"{path}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}: 'hidden_act' must be 'silu', got {raw.get('hidden_act')!r}")
    return dict(
        vocab_size=_field(raw, "vocab_size", int, path),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, path),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=_field(raw, "rms_norm_eps", float, path, 1e-6),
        rope=_rope(raw, path),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        windows=_windows(raw, arch, layers, path),
    )


def _arch(raw: dict, path: Path) -> str:
    model_type = raw.get("model_type")
    names = raw.get("architectures") or []
    for arch, cls in ARCHITECTURES.items():
        if model_type == arch or cls in names:
            return arch
    raise ConfigError(
        f"{path}: unknown architecture: model_type={model_type!r}, architectures={names!r}; "
        f"supported: {sorted(ARCHITECTURES)} / {sorted(ARCHITECTURES.values())}"
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def load_target_config(directory: str | Path) -> TargetConfig:
    """Read a Qwen3 / Llama ``config.json`` (+ ``generation_config.json``)."""
    path = Path(directory) / "config.json"
    raw = read_json(path)
    arch = _arch(raw, path)
    generation = Path(directory) / "generation_config.json"
    eos = _ids(raw.get("eos_token_id"))
    if generation.exists():
        eos = tuple(dict.fromkeys(eos + _ids(read_json(generation).get("eos_token_id"))))
    return TargetConfig(
        **_stack(raw, arch, path),
        arch=arch,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=raw.get("pad_token_id"),
    )


def load_draft_config(directory: str | Path) -> DraftConfig:
    """Read a z-lab DFlash draft ``config.json``."""
    path = Path(directory) / "config.json"
    raw = read_json(path)
    dflash = raw.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if not isinstance(layer_ids, list) or not layer_ids or not all(is_int(i) for i in layer_ids):
        raise ConfigError(f"{path}: 'dflash_config.target_layer_ids' must be a non-empty list of ints, got {layer_ids!r}")
    mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
    if not is_int(mask):
        raise ConfigError(f"{path}: 'dflash_config.mask_token_id' must be an int, got {mask!r}")
    block = dflash.get("block_size", raw.get("block_size", 16))
    if not is_int(block) or block < 3:
        raise ConfigError(f"{path}: 'block_size' must be an int >= 3, got {block!r}")
    stack = _stack(raw, "qwen3", path)
    if any(stack["windows"]):
        raise ConfigError(f"{path}: sliding-window draft layers are not supported, layer windows {stack['windows']}")
    return DraftConfig(
        **stack,
        block_size=block,
        num_target_layers=int(raw.get("num_target_layers", 0)),
        target_layer_ids=tuple(layer_ids),
        mask_token_id=mask,
        embedding_scale=float(dflash.get("input_embedding_scale", raw.get("input_embedding_scale", 1.0))),
    )


def check_pair(target: TargetConfig, draft: DraftConfig) -> None:
    """Refuse a draft that does not fit its target, naming the field and both values."""
    checks = [
        ("hidden_size", draft.hidden_size, target.hidden_size),
        ("vocab_size", draft.vocab_size, target.vocab_size),
    ]
    if draft.num_target_layers:
        checks.append(("num_target_layers", draft.num_target_layers, target.num_layers))
    for name, got, want in checks:
        if got != want:
            raise PairError(f"draft {name} is {got} but the target's is {want}")
    ids = draft.target_layer_ids
    if list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= target.num_layers:
        raise PairError(
            f"draft target_layer_ids must be strictly increasing within [0, {target.num_layers - 1}] "
            f"(the target's layers), got {list(ids)}"
        )
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise PairError(
            f"draft mask_token_id must be in [0, {target.vocab_size - 1}] (a row of the target's embedding), "
            f"got {draft.mask_token_id}"
        )
