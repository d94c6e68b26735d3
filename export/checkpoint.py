"""Safetensors checkpoints in the Hugging Face layout.

``config.json`` + ``model.safetensors`` or sharded ``model-XXXXX-of-YYYYY``
files listed by ``model.safetensors.index.json``. Loading is strict: every
parameter the module expects must be present with the expected shape, and no
tensor may be left over, so a mismatched checkpoint fails here with the
tensor's name and both shapes instead of producing garbage tokens later.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_trt.errors import CheckpointError, TensorError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    directory = Path(directory)
    if (directory / INDEX).exists():
        weight_map = json.loads((directory / INDEX).read_text()).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
    elif (directory / SINGLE).exists():
        files = [directory / SINGLE]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no safetensors files (expected {SINGLE} or {INDEX})")
    for file in files:
        if not file.exists():
            raise CheckpointError(f"{directory}: {INDEX} names {file.name}, which does not exist")
    return files


def read_tensors(directory: str | Path, strip: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint by name; names starting with a ``strip`` prefix lose it."""
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                key = name
                for prefix in strip:
                    if key.startswith(prefix):
                        key = key[len(prefix):]
                        break
                tensors[key] = handle.get_tensor(name)
    return tensors


def load_into(
    module: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    ignore: Iterable[str] = (),
) -> None:
    """Copy ``tensors`` into ``module``'s parameters, strictly.

    Raises ``TensorError`` naming the first missing, unexpected or mis-shaped
    tensor. ``ignore`` lists checkpoint names that may be present and unused
    (e.g. ``lm_head.weight`` equal to a tied embedding).
    """
    expected = dict(module.named_parameters())
    ignored = set(ignore)
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise TensorError(f"{source}: missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    unexpected = sorted(tensors.keys() - expected.keys() - ignored)
    if unexpected:
        raise TensorError(f"{source}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} unexpected in all)")
    with torch.no_grad():
        for name, parameter in expected.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(parameter.shape):
                raise TensorError(
                    f"{source}: tensor '{name}' has shape {list(tensor.shape)}, expected {list(parameter.shape)}"
                )
            parameter.copy_(tensor.to(parameter.dtype))


def save_checkpoint(
    directory: str | Path,
    config: Mapping,
    tensors: Mapping[str, torch.Tensor],
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ extra text files)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    contiguous = {name: tensor.detach().contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, str(directory / SINGLE), metadata={"format": "pt"})
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text)
    return directory
