"""A DFlash draft for a frozen target (docs/design.md §1 Training).

Per step: the frozen target runs over ``[b, T]`` sequences and gives the taps
of every position; ``n`` anchors per sequence are drawn from ``[1, T - B]``;
block ``j`` is ``[x_{a_j}, MASK × (B-1)]`` at positions ``a_j .. a_j+B-1``,
embedded with the target's (frozen) embedding; ``draft_forward`` runs all
blocks of a sequence at once; the target's (frozen) lm_head scores slots
``1..B-1`` against ``x[a_j + k]`` with weights ``exp(-(k-1)/γ)``.

Works for any target ``load_target`` reads: only the draft trains. The draft
config is the z-lab layout (``block_size``, ``num_target_layers``,
``dflash_config.{target_layer_ids, mask_token_id}``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_trt.export.checkpoint import save_checkpoint
from dflash_trt.export.config import TargetConfig, check_pair, load_draft_config
from dflash_trt.export.draft import DraftModel
from dflash_trt.export.target import TargetModel
from dflash_trt.train.forward import draft_forward, target_forward
from dflash_trt.train.loop import Schedule, TokenStream, TrainLog, adamw, autocast, seed_everything, train
from dflash_trt.train.target import bf16_state


@dataclass(frozen=True)
class DraftShape:
    num_layers: int = 2
    block_size: int = 16
    num_taps: int = 3
    tap_layers: tuple[int, ...] = ()  # explicit ids; default: TargetConfig.default_tap_layers(num_taps)
    intermediate_size: int = 0  # 0: the target's
    init_from_target: bool = True  # copy the target's last layers where shapes allow


@dataclass(frozen=True)
class DraftTraining:
    batch_size: int = 32
    seq_len: int = 1024
    anchors: int = 64  # blocks per sequence
    gamma: float = 0.0  # slot-weight decay; 0: 7 for B >= 16, else 4 (docs/design.md §1)
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    max_steps: int = 100_000
    time_budget_s: float = 150.0
    seed: int = 1
    amp: bool = True


def draft_config(target: TargetConfig, target_raw: dict, shape: DraftShape, mask_token_id: int) -> dict:
    """z-lab DFlash draft config.json for ``target`` (Qwen3 fields + DFlash fields)."""
    # De-duplicated: on shallow targets the default formula repeats ids.
    taps = sorted(set(shape.tap_layers or target.default_tap_layers(shape.num_taps)))
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": shape.intermediate_size or target.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope.theta,
        "rope_scaling": target_raw.get("rope_scaling"),
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": shape.block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": mask_token_id},
        "torch_dtype": "bfloat16",
    }


def slot_weights(block: int, gamma: float) -> torch.Tensor:
    """[B-1] loss weights of slots 1..B-1: exp(-(k-1)/γ)."""
    k = torch.arange(1, block, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(batch: int, length: int, block: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, count] distinct anchors per row in [1, length - block] (>= 1 context row; block fits)."""
    choices = length - block
    count = min(count, choices)
    order = torch.rand(batch, choices, generator=generator, device=generator.device).argsort(dim=1)[:, :count]
    return order + 1


def block_loss(
    draft: DraftModel, target: TargetModel, tokens: torch.Tensor, anchors: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """tokens [b, T], anchors [b, n] -> weighted CE, plus slot-1 accuracy and τ against the data."""
    block = draft.config.block_size
    with torch.no_grad():
        _, taps = target_forward(target, tokens, draft.config.target_layer_ids)
        ids = tokens.gather(1, anchors)[..., None].repeat(1, 1, block)  # [b, n, B]
        ids[..., 1:] = draft.config.mask_token_id
        embeds = target.embed(ids.flatten(1))
    hidden = draft_forward(draft, taps, embeds, anchors)
    hidden = hidden.unflatten(1, (anchors.shape[1], block))[:, :, 1:]  # [b, n, B-1, H]
    label_positions = anchors[..., None] + torch.arange(1, block, device=tokens.device)
    labels = tokens.gather(1, label_positions.flatten(1)).view_as(label_positions)  # [b, n, B-1]
    logits = target.head(hidden)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    loss = (ce * weights).sum(-1).mean() / weights.sum()
    with torch.no_grad():
        correct = logits.argmax(-1) == labels
        tau = 1 + correct.long().cumprod(-1).sum(-1).float().mean()
    return loss, {"acc1": correct[..., 0].float().mean(), "tau_data": tau}


def init_from_target(draft: DraftModel, target: TargetModel) -> bool:
    """Copy the target's last decoder layers into the draft's where every shape matches."""
    states = [layer.state_dict() for layer in list(target.model.layers)[-len(draft.layers) :]]
    shapes = lambda state: {name: tensor.shape for name, tensor in state.items()}  # noqa: E731
    if any(shapes(state) != shapes(layer.state_dict()) for state, layer in zip(states, draft.layers)):
        return False
    with torch.no_grad():
        for state, layer in zip(states, draft.layers):
            layer.load_state_dict({k: v.float() for k, v in state.items()})
    return True


# The projections that end a decoder layer's two residual branches: zero, the layer adds exactly nothing.
_BRANCH_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grown_state(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A draft's tensors with layers appended after its last, each a copy of that layer with its two
    branch outputs (attention o_proj, MLP down_proj) zero: x + 0 is x exactly, so the grown draft
    starts as the same function (bit for bit) and training gives the new layers their part, instead of
    starting a deeper draft from scratch and losing what the shallow one learned."""
    present = 1 + max(int(name.split(".")[1]) for name in state if name.startswith("layers."))
    if num_layers < present:
        raise ValueError(f"num_layers must be >= the draft's {present} layers to grow it, got {num_layers}")
    last = {name[len(f"layers.{present - 1}.") :]: tensor for name, tensor in state.items()
            if name.startswith(f"layers.{present - 1}.")}
    grown = dict(state)
    for index in range(present, num_layers):
        for name, tensor in last.items():
            grown[f"layers.{index}.{name}"] = torch.zeros_like(tensor) if name in _BRANCH_OUTPUTS else tensor.clone()
    return grown


def train_draft(
    target: TargetModel,
    target_raw: dict,
    train_stream: TokenStream,
    out_dir: Path,
    mask_token_id: int,
    shape: DraftShape = DraftShape(),
    training: DraftTraining = DraftTraining(),
    log_path: Path | None = None,
    init_state: dict[str, torch.Tensor] | None = None,
) -> tuple[DraftModel, dict]:
    """Train a draft against the frozen ``target`` (already on the stream's device); save to ``out_dir``.

    ``train_stream`` is a ``TokenStream`` or a ``regenerate.SequenceBank``;
    ``init_state`` (a draft's tensors) warm-starts training from an earlier draft.
    """
    device = train_stream.device
    generator = seed_everything(training.seed, device)
    config = draft_config(target.config, target_raw, shape, mask_token_id)
    save_checkpoint(out_dir, config, {})  # config.json first: the model is built by the real loader
    draft_cfg = load_draft_config(out_dir)
    check_pair(target.config, draft_cfg)
    target.requires_grad_(False).eval()
    draft = DraftModel(draft_cfg).to(device)
    if init_state is not None:
        draft.load_state_dict({k: v.float() for k, v in init_state.items()})
        initialized = "draft"
    else:
        initialized = shape.init_from_target and init_from_target(draft, target)
    gamma = training.gamma or (7.0 if shape.block_size >= 16 else 4.0)
    weights = slot_weights(shape.block_size, gamma).to(device)
    optimizer = adamw(draft, training.lr, training.weight_decay)
    schedule = Schedule(training.lr, training.max_steps, training.time_budget_s, training.warmup_steps)

    def step(_: int):
        tokens = train_stream.batch(training.batch_size, training.seq_len - 1, generator)
        anchors = sample_anchors(training.batch_size, training.seq_len, shape.block_size, training.anchors, generator)
        with autocast(device, training.amp):
            return block_loss(draft, target, tokens, anchors, weights)

    log = TrainLog(log_path, "draft", training.max_steps)
    params = sum(p.numel() for p in draft.parameters())
    log.write({"shape": asdict(shape), "training": asdict(training), "gamma": gamma, "params": params,
               "init_from_target": initialized})
    record = train(draft.train(), optimizer, schedule, step, log)
    log.close()
    save_checkpoint(out_dir, config, bf16_state(draft))
    return draft.eval(), record
