"""Expensive test artifacts (ONNX exports, TensorRT-RTX engine sets) built once per distinct code and kept between runs.

``cached_build(name, build, *inputs)`` returns a directory that ``build(path)``
filled. The key is a digest of every source file an export can depend on (export/,
dflash_trt/ and the tests' model factory), the tool versions and ``inputs``;
any edit there makes a new key, so a stale artifact is never used (edits in
runtime/, engines/ or analysis/ cannot change an export and keep the cache; an
engine set's key also covers engines/, ``sources=ENGINE_SOURCES``).
Concurrent test runs serialize on a lock file; a half-written directory is
never published (built under a temporary name, then renamed).

A full run also starts ``tests/prebuilt.py`` in the background (conftest), which
builds the same artifacts through the same functions on the second core; the lock
makes a fixture wait for, or reuse, what it built (``DFLASH_TRT_TEST_PREBUILD=0`` turns it off;
the modules needing its artifacts run last in a full run).

Where: ``$DFLASH_TRT_TEST_CACHE``, else ``~/.cache/dflash-trt/tests``. Under
CI (``CI`` set) the cache lives in the run's temporary directory, so CI
measures a cold build every time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("dflash_trt", "export")
ENGINE_SOURCES = (*SOURCES, "engines")  # an engine build also depends on the builder's code
TOOLS = ("torch", "onnx", "onnxscript", "onnxruntime", "onnx-ir", "tensorrt_rtx_cu13")


def _digest(name: str, inputs: tuple, sources: tuple[str, ...]) -> str:
    digest = hashlib.sha256(f"{name}\0{inputs!r}\n".encode())
    files = [p for folder in sources for p in sorted((ROOT / folder).rglob("*.py"))]
    for path in [*files, ROOT / "tests" / "tiny_models.py"]:
        digest.update(f"{path.relative_to(ROOT)}\0".encode() + path.read_bytes())
    for tool in TOOLS:
        try:
            digest.update(f"{tool}={metadata.version(tool)}\n".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{tool}=absent\n".encode())
    return digest.hexdigest()[:20]


def cache_root(fallback: Path) -> Path:
    if os.environ.get("CI"):
        return fallback
    return Path(os.environ.get("DFLASH_TRT_TEST_CACHE", "~/.cache/dflash-trt/tests")).expanduser()


def cached_build(root: Path, name: str, build: Callable[[Path], None], *inputs, sources: tuple[str, ...] = SOURCES) -> Path:
    """``root/<name>-<key>``, made by ``build(directory)`` unless a finished one exists (the key:
    ``sources``' Python files, the tools' versions and ``inputs``)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{_digest(name, inputs, sources)}"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run building the same artifact: wait for it
        if not final.exists():
            scratch = root / f"{final.name}.building-{os.getpid()}"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            build(scratch)
            scratch.rename(final)
    return final
