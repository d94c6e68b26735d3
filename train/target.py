"""A small Qwen3 target for code, trained from scratch.

The config is written in the Hugging Face Qwen3 layout first and read back
through ``load_target_config``, so the module trained is exactly what
``load_target`` builds. Weights train in fp32 under bf16 autocast and ship as
bf16 safetensors; embeddings are tied (``lm_head.weight`` is not stored).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from dflash_trt.export.checkpoint import save_checkpoint
from dflash_trt.export.config import load_target_config
from dflash_trt.export.target import TargetModel
from dflash_trt.train.forward import target_forward
from dflash_trt.train.loop import Schedule, TokenStream, TrainLog, adamw, autocast, seed_everything, train
from dflash_trt.train.tokenizer import save_tokenizer, special_ids


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int = 320
    num_layers: int = 8
    num_heads: int = 5
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 896
    context: int = 1024
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TargetTraining:
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 100
    max_steps: int = 100_000
    time_budget_s: float = 240.0
    seed: int = 0
    amp: bool = True


def target_config(shape: TargetShape, vocab_size: int, eos_id: int) -> dict:
    """config.json of a Qwen3ForCausalLM (the keys transformers writes)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.context,
        "rms_norm_eps": 1e-6,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_layers,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def init_weights(model: TargetModel, std: float = 0.02) -> None:
    """GPT-2 style: N(0, std), residual output projections scaled by 1/sqrt(2 * layers)."""
    residual_std = std / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.normal_(0.0, residual_std)
            elif parameter.ndim >= 2:
                parameter.normal_(0.0, std)
            else:
                parameter.fill_(1.0)  # RMSNorm weights (no biases in this shape)


def lm_loss(model: TargetModel, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [b, T + 1] windows."""
    hidden, _ = target_forward(model, tokens[:, :-1])
    logits = model.head(hidden)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def bf16_state(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Persistent tensors as bf16 on CPU (shared tensors once: named_parameters de-duplicates)."""
    return {n: p.detach().to("cpu", torch.bfloat16) for n, p in model.named_parameters() if n not in skip}


def save_target(model: TargetModel, config: dict, tokenizer: Tokenizer, directory: Path) -> Path:
    eos = config["eos_token_id"]
    generation = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False}
    save_checkpoint(
        directory,
        config,
        bf16_state(model),
        extra_files={"generation_config.json": json.dumps(generation, indent=2) + "\n"},
    )
    save_tokenizer(tokenizer, directory, max_length=config["max_position_embeddings"])
    return directory


def train_target(
    tokenizer: Tokenizer,
    train_stream: TokenStream,
    out_dir: Path,
    shape: TargetShape = TargetShape(),
    training: TargetTraining = TargetTraining(),
    log_path: Path | None = None,
) -> tuple[TargetModel, dict]:
    """Train from scratch on ``train_stream``; writes the checkpoint (+ tokenizer) to ``out_dir``."""
    device = train_stream.device
    generator = seed_everything(training.seed, device)
    config = target_config(shape, tokenizer.get_vocab_size(), special_ids(tokenizer)["eos"])
    save_checkpoint(out_dir, config, {})  # config.json first: the model is built by the real loader
    model = TargetModel(load_target_config(out_dir)).to(device)
    init_weights(model)
    optimizer = adamw(model, training.lr, training.weight_decay)
    schedule = Schedule(training.lr, training.max_steps, training.time_budget_s, training.warmup_steps)

    def step(_: int):
        tokens = train_stream.batch(training.batch_size, shape.context, generator)
        with autocast(device, training.amp):
            return lm_loss(model, tokens), {}

    log = TrainLog(log_path, "target", training.max_steps)
    log.write({"shape": asdict(shape), "training": asdict(training), "params": _count(model)})
    record = train(model.train(), optimizer, schedule, step, log)
    record["tokens_seen"] = record["step"] * training.batch_size * shape.context
    log.close()
    save_target(model.eval(), config, tokenizer, out_dir)
    return model, record


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
