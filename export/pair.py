"""Load a target and its DFlash draft together, refusing pairs that do not fit."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.export import DEFAULT_PAIR_DIR  # noqa: F401  (re-exported)
from dflash_trt.export.config import check_pair, load_draft_config, load_target_config
from dflash_trt.export.draft import DraftModel, load_draft
from dflash_trt.export.target import TargetModel, load_target


def load_pair(
    target_dir: str | Path, draft_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[TargetModel, DraftModel]:
    """The target (tapping the draft's ``target_layer_ids``) and the draft, both strict-loaded."""
    target_config, draft_config = load_target_config(target_dir), load_draft_config(draft_dir)
    check_pair(target_config, draft_config)
    target = load_target(target_dir, tap_layers=draft_config.target_layer_ids, dtype=dtype)
    return target, load_draft(draft_dir, dtype=dtype)
