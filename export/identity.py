"""Identity of checkpoints and artifacts: file hashes, cache keys, export key.

- ``target_cache_key`` / ``draft_cache_key``: what the contents of a KV cache
  depend on. The target's K/V depend on its weights and dtype; the draft's on
  its weights, the target's (its context comes from the target's taps), the
  tap layers and the dtype. Prefixed by role, so the two always differ.
- ``export_key``: everything an export's output depends on (checkpoint files
  by name/size/mtime, resolved options, tool versions, the exporting code), so
  an unchanged export can be skipped without hashing gigabytes of weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHUNK_BYTES = 8 << 20
CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def file_sha256(path: str | Path) -> str:
    """Streamed: plans and external weight files can be many GB."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint_files(directory: Path) -> list[Path]:
    names = [directory / name for name in CONFIG_FILES if (directory / name).exists()]
    return names + sorted(directory.glob("*.safetensors"))


def checkpoint_digest(directory: str | Path) -> str:
    """sha256 over the names and contents of a checkpoint's config and weight files."""
    digest = hashlib.sha256()
    for path in _checkpoint_files(Path(directory)):
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def checkpoint_fingerprint(directory: str | Path) -> list[list]:
    """Cheap identity of a checkpoint: config contents, weight files by name, size, mtime."""
    entries = []
    for path in _checkpoint_files(Path(directory)):
        stat = path.stat()
        if path.suffix == ".json":
            entries.append([path.name, file_sha256(path)])
        else:
            entries.append([path.name, stat.st_size, stat.st_mtime_ns])
    return entries


def target_cache_key(target_digest: str, dtype: str) -> str:
    return "target-" + _hash(["target", target_digest, dtype])[:32]


def draft_cache_key(draft_digest: str, target_digest: str, tap_layers: tuple[int, ...], dtype: str) -> str:
    return "draft-" + _hash(["draft", draft_digest, target_digest, list(tap_layers), dtype])[:32]


def export_key(target_dir: str | Path, draft_dir: str | Path, settings: dict, code: str) -> str:
    """``settings``: resolved options and tool versions; ``code``: digest of the exporting modules."""
    return _hash(
        {
            "target": checkpoint_fingerprint(target_dir),
            "draft": checkpoint_fingerprint(draft_dir),
            "settings": settings,
            "code": code,
        }
    )


def source_digest(paths: list[str | Path]) -> str:
    """sha256 over source files (the modules whose code shapes the graphs)."""
    digest = hashlib.sha256()
    for path in sorted(str(p) for p in paths):
        digest.update(f"{Path(path).name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
