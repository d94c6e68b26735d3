"""Shared fixtures: tiny random checkpoints and exports built once per code version (build_cache.py),
in the background during a full run (prebuilt.py)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import interpreted  # noqa: E402
import prebuilt  # noqa: E402
from build_cache import cache_root, cached_build  # noqa: E402
from prebuilt import EXPORT_NEW_TOKENS  # noqa: E402

torch.set_num_threads(1)  # tiny models: thread sync costs more than it saves


def _cuda() -> bool:
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False, help="also run the long reliability runs (marker 'long')")
    parser.addoption("--long-examples", type=int, default=10_000, help="random API sequences of the --long state-machine run")


PREBUILD_MIN_TESTS = 100  # a full run: worth building its artifacts on the second core
LATE_MODULES = ("test_demo.py", "test_defaults.py", "test_engines_export.py", "test_server.py")  # need what the prebuilder makes


def pytest_configure(config):
    """The artifact cache's root for this run (build_cache.py: a private temporary one under CI)."""
    config.dflash_cold_cache = Path(tempfile.mkdtemp(prefix="dflash-trt-build-cache-")) if os.environ.get("CI") else None
    config.dflash_cache_root = cache_root(config.dflash_cold_cache)
    config.dflash_prebuilder = None


def _interpreted_modules(items) -> dict:
    """By name, the modules of ``items`` whose tests use an ``interpreted`` fixture fed by ``interpreted_scripts()``
    (checks run under Triton's interpreter, tests/interpreted.py)."""
    return {item.module.__name__: item.module for item in items
            if "interpreted" in getattr(item, "fixturenames", ()) and hasattr(item.module, "interpreted_scripts")}


def pytest_collection_finish(session):
    """The interpreted kernel checks start in the background, niced (tests/interpreted.py); a full run also builds
    its expensive artifacts (tests/prebuilt.py) in a background process, so the second core exports and compiles
    while the first runs tests."""
    for name, module in _interpreted_modules(session.items).items():
        interpreted.start(name, module.interpreted_scripts())
    config = session.config
    if len(session.items) < PREBUILD_MIN_TESTS or os.environ.get("DFLASH_TRT_TEST_PREBUILD") == "0":
        return
    root = config.dflash_cache_root
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_TRT_CACHE": str(root / "prebuilder-cache")}
    with open(root / "prebuild.log", "a") as log:
        config.dflash_prebuilder = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("prebuilt.py")), str(root)], stdout=log, stderr=subprocess.STDOUT, env=env
        )


def pytest_unconfigure(config):
    interpreted.stop()  # a cut-short run's background checks
    prebuilder = getattr(config, "dflash_prebuilder", None)
    if prebuilder is not None and prebuilder.poll() is None:
        prebuilder.terminate()  # a cut-short run: whatever it had not finished is never published
        prebuilder.wait()
    if getattr(config, "dflash_cold_cache", None) is not None:
        shutil.rmtree(config.dflash_cold_cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if len(items) >= PREBUILD_MIN_TESTS:
        # A full run: the interpreted checks' modules late (their background processes get the idle core longest),
        # the modules needing prebuilt artifacts last.
        late = _interpreted_modules(items)
        items.sort(key=lambda item: 2 if item.path.name in LATE_MODULES else int(getattr(item, "module", None) in late.values()))
    if not config.getoption("--long"):
        skip_long = pytest.mark.skip(reason="long run: pass --long")
        for item in items:
            if "long" in item.keywords:
                item.add_marker(skip_long)
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Tests never read or write the user's cache (``DFLASH_TRT_CACHE``: hash verdicts, demo exports)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_TRT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="session")
def build_cache(request):
    """``build(name, fn, *inputs) -> Path``: an expensive artifact made once per code version (build_cache.py)."""
    return functools.partial(cached_build, request.config.dflash_cache_root)


@pytest.fixture(scope="session")
def tiny_pair(build_cache) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a Qwen3 target and a block-8 DFlash draft tapping layers 1 and 3.

    Cached like the exports made from it: their keys fingerprint these files (mtimes included)."""
    return prebuilt.tiny_pair(build_cache)


class ExportedPair(NamedTuple):
    target_dir: Path
    draft_dir: Path
    out: Path
    manifest: object
    prompts: list
    new_tokens: tuple


@pytest.fixture(scope="session")
def exported_pair(tiny_pair, build_cache):
    """fp32 export (max_owners 3, max_context 64, one shared weights.data) of the tiny target and a
    draft tuned to agree with it.

    Returns an ``ExportedPair`` (target_dir, draft_dir, out, manifest, prompts, new_tokens). The draft is
    tiny_pair's with its layer outputs scaled down (each slot then proposes
    about argmax head(norm(embed(mask)))) and the mask chosen so that this is
    the token the target's greedy continuations of ``prompts`` repeat most:
    generation tests then see cycles with 0, some and all proposals accepted.
    """
    from dflash_trt.export.manifest import load_manifest

    root = prebuilt.exported_pair(build_cache)
    manifest = load_manifest(root / "graphs")
    return ExportedPair(tiny_pair[0], root / "draft", root / "graphs", manifest, prebuilt.export_prompts(), EXPORT_NEW_TOKENS)


@pytest.fixture(scope="session")
def default_pair_cache(build_cache) -> Path:
    """A ``dflash-trt`` cache dir holding the demo's ONNX export of the shipped default pair (made by
    ``demo.export_dir``, once per code version): ``dflash-trt serve --cache`` finds it there unchanged,
    the demo test serves its ``export/`` dir. Read-only for tests."""
    return prebuilt.default_pair_cache(build_cache)


@pytest.fixture(scope="module")
def tiny(exported_pair, request):
    """``executor_fixtures.Tiny`` over the exported pair with the module's ``TINY_ROWS`` cache rows
    (16 if it sets none), torch on one thread while the module runs (tiny models: 2 spin-waiting
    threads on a loaded 2-core machine are ~40x slower)."""
    from executor_fixtures import Tiny

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    tiny = Tiny(exported_pair, rows=getattr(request.module, "TINY_ROWS", 16))
    yield tiny
    tiny.close()
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def oracle(tiny):
    """The target-only reference decoder over the tiny target (``executor_fixtures.Oracle``)."""
    from executor_fixtures import Oracle

    return Oracle(tiny.target, tiny.dims.max_context)


@pytest.fixture
def export_copy(exported_pair, tmp_path):
    """(directory, edit): a private copy of the exported pair's graphs (they are small) and
    ``edit(change)``, which applies ``change(data)`` to its manifest JSON."""
    import json

    from dflash_trt.export.manifest import MANIFEST_FILE

    out = tmp_path / "graphs"
    shutil.copytree(exported_pair.out, out)

    def edit(change) -> None:
        path = out / MANIFEST_FILE
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return out, edit
