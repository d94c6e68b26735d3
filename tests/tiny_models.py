"""Tiny random checkpoints in the Hugging Face layouts, written by the tests.

Targets are made by transformers itself (``Qwen3ForCausalLM`` /
``LlamaForCausalLM`` + ``save_pretrained``), so the loader is checked against
the real on-disk format; drafts use the z-lab DFlash config layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 97


def qwen3_config(**overrides) -> dict:
    config = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=2,
    )
    config.update(overrides)
    return config


def llama_config(**overrides) -> dict:
    config = qwen3_config(num_key_value_heads=1, head_dim=16)
    config.pop("head_dim")
    config.update(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    config.update(overrides)
    return config


def write_target(directory: Path, arch: str = "qwen3", seed: int = 0, std: float = 0.08, **overrides) -> Path:
    """Random HF target checkpoint. ``std`` > HF's 0.02 keeps logits peaked enough to be interesting."""
    import transformers

    torch.manual_seed(seed)
    if arch == "qwen3":
        config = transformers.Qwen3Config(**qwen3_config(initializer_range=std, **overrides))
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**llama_config(initializer_range=std, **overrides))
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return Path(directory)


def draft_config(target: dict, block_size: int = 8, layer_ids=(1, 3), layers: int = 2, **overrides) -> dict:
    config = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=target["vocab_size"],
        hidden_size=target["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        block_size=block_size,
        num_target_layers=target["num_hidden_layers"],
        dflash_config={"target_layer_ids": list(layer_ids), "mask_token_id": target["vocab_size"] - 1},
    )
    config.update(overrides)
    return config


def write_draft(directory: Path, target_dir: Path, seed: int = 1, **overrides) -> Path:
    """Random z-lab-layout draft checkpoint for the target in ``target_dir``."""
    import json

    from dflash_trt.export.checkpoint import save_checkpoint
    from dflash_trt.export.config import load_draft_config
    from dflash_trt.export.draft import DraftModel

    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = draft_config(target, **overrides)
    save_checkpoint(directory, config, {})
    torch.manual_seed(seed)
    model = DraftModel(load_draft_config(directory))
    save_checkpoint(directory, config, model.state_dict())
    return Path(directory)
