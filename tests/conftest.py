"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402

torch.set_num_threads(2)


def _cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a Qwen3 target and a block-8 DFlash draft tapping layers 1 and 3."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_models.write_target(root / "target")
    draft = tiny_models.write_draft(root / "draft", target)
    return target, draft
