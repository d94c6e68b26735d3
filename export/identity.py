"""Identity of checkpoints and artifacts: file hashes, cache keys, export key.

- ``target_cache_key`` / ``draft_cache_key``: what the contents of a KV cache
  depend on. The target's K/V depend on its weights and dtype; the draft's on
  its weights, the target's (its context comes from the target's taps), the
  tap layers and the dtype. Prefixed by role, so the two always differ.
- ``export_key``: everything an export's output depends on (checkpoint files
  by name/size/mtime, resolved options, tool versions, the exporting code), so
  an unchanged export can be skipped without hashing gigabytes of weights.
- ``verified_sha256``: a file's sha256, remembered by the file's identity
  (device, inode, size, mtime, ctime) in memory and in the user cache
  directory, so checking an artifact's hashes at every open costs one stat per
  file after the first. sha256 streams at ~0.24 GB/s per core on a Xeon
  without SHA extensions (1.5–2 GB/s with them): 16 GB of weights is a
  minute without the cache. Any write through the filesystem changes mtime
  and ctime (ctime cannot be set back), so an edited file is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
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


VERDICTS_FILE = "sha256-verdicts.json"
MAX_VERDICTS = 4096  # files remembered on disk (oldest forgotten first)
RACY_SECONDS = 2.0  # a file written less than this long ago is hashed every time
_verdicts: dict[str, list] | None = None  # realpath -> [dev, ino, size, mtime_ns, ctime_ns, sha256]
_verdicts_lock = threading.Lock()


def default_cache_dir() -> Path:
    """``$DFLASH_TRT_CACHE``, else ``$XDG_CACHE_HOME/dflash-trt``, else ``~/.cache/dflash-trt``."""
    root = os.environ.get("DFLASH_TRT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-trt"
    return Path(root)


def file_stamp(path: str | Path) -> list[int]:
    """What changes when a file is replaced or rewritten: device, inode, size, mtime and ctime."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def verified_sha256(path: str | Path) -> str:
    """``file_sha256(path)``, computed once per version of the file (see the module docstring)."""
    real = os.path.realpath(path)
    stamp = file_stamp(real)
    with _verdicts_lock:
        known = _load_verdicts().get(real)
    if known is not None and known[:5] == stamp:
        return known[5]
    digest = file_sha256(real)
    # Remembered only if unchanged while read, and not "racy": filesystem timestamps tick coarsely
    # (a jiffy; 2 s on FAT), so a write right after this one could leave the same stamp.
    settled = time.time_ns() - max(stamp[3], stamp[4]) > RACY_SECONDS * 1e9
    if settled and file_stamp(real) == stamp:
        with _verdicts_lock:
            _load_verdicts()[real] = [*stamp, digest]
            _save_verdicts()
    return digest


def _load_verdicts() -> dict[str, list]:
    global _verdicts
    if _verdicts is None:
        try:
            data = json.loads((default_cache_dir() / VERDICTS_FILE).read_text())
            _verdicts = {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 6} if isinstance(data, dict) else {}
        except (OSError, ValueError):  # no cache yet, or unreadable: start empty (it is only a cache)
            _verdicts = {}
    return _verdicts


def _save_verdicts() -> None:
    """Best effort (a read-only home keeps the in-memory verdicts only); atomic replace."""
    verdicts = _verdicts or {}
    for key in list(verdicts)[: max(0, len(verdicts) - MAX_VERDICTS)]:
        del verdicts[key]
    path = default_cache_dir() / VERDICTS_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{VERDICTS_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdicts))
        tmp.replace(path)
    except OSError:
        pass


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
