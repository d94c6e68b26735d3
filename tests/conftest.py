"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402
from build_cache import cache_root, cached_build  # noqa: E402

torch.set_num_threads(1)  # tiny models: thread sync costs more than it saves


def _cuda() -> bool:
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False, help="also run the long reliability runs (marker 'long')")
    parser.addoption("--long-examples", type=int, default=10_000, help="random API sequences of the --long state-machine run")


def pytest_collection_modifyitems(config, items):
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
def build_cache(tmp_path_factory):
    """``build(name, fn, *inputs) -> Path``: an expensive artifact made once per code version (build_cache.py)."""
    root = cache_root(tmp_path_factory.getbasetemp() / "build-cache")
    return lambda name, fn, *inputs: cached_build(root, name, fn, *inputs)


@pytest.fixture(scope="session")
def tiny_pair(build_cache) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a Qwen3 target and a block-8 DFlash draft tapping layers 1 and 3.

    Cached like the exports made from it: their keys fingerprint these files (mtimes included)."""

    def build(root: Path) -> None:
        tiny_models.write_draft(root / "draft", tiny_models.write_target(root / "target"))

    root = build_cache("tiny_pair", build)
    return root / "target", root / "draft"


class ExportedPair(NamedTuple):
    target_dir: Path
    draft_dir: Path
    out: Path
    manifest: object
    prompts: list
    new_tokens: tuple


EXPORT_PROMPT_LENGTHS = (5, 19, 40)  # <= block, > block (drained), long (ends in plain decode)
EXPORT_NEW_TOKENS = (30, 25, 20)


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

    target_dir, random_draft = tiny_pair
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tiny_models.VOCAB - 1, (n,), generator=generator).tolist() for n in EXPORT_PROMPT_LENGTHS]

    def build(root: Path) -> None:
        from dflash_trt.export.exporter import ExportOptions, export_pair

        draft_dir = _tuned_draft(target_dir, random_draft, prompts, root / "draft")
        export_pair(target_dir, draft_dir, root / "graphs", ExportOptions(max_owners=3, max_context=64, dtype="fp32", shared_weights=True))

    root = build_cache("exported_pair", build, str(target_dir), str(random_draft), prompts, EXPORT_NEW_TOKENS)
    manifest = load_manifest(root / "graphs")
    return ExportedPair(target_dir, root / "draft", root / "graphs", manifest, prompts, EXPORT_NEW_TOKENS)


def _tuned_draft(target_dir: Path, random_draft: Path, prompts: list, out: Path) -> Path:
    """The random draft with its mask token and scaled layer outputs (see ``exported_pair``)."""
    import collections
    import json

    from dflash_trt.export.checkpoint import read_tensors, save_checkpoint
    from dflash_trt.export.draft import load_draft
    from dflash_trt.export.reference import ReferenceDecoder
    from dflash_trt.export.target import load_target

    draft = load_draft(random_draft)
    target = load_target(target_dir, tap_layers=draft.config.target_layer_ids)
    decoder = ReferenceDecoder(target, max_context=64)
    counts = collections.Counter(t for p, n in zip(prompts, EXPORT_NEW_TOKENS) for t in decoder.generate_target(p, n).tokens)
    with torch.no_grad():
        slot_choice = target.head(draft.norm(target.embed(torch.arange(tiny_models.VOCAB)))).argmax(-1).tolist()
    mask = next((m for token, _ in counts.most_common() for m, c in enumerate(slot_choice) if c == token), 0)
    config = json.loads((random_draft / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = mask
    scaled = {k: v * 0.1 if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in read_tensors(random_draft).items()}
    return save_checkpoint(out, config, scaled)


@pytest.fixture(scope="session")
def default_pair_cache(build_cache) -> Path:
    """A ``dflash-trt`` cache dir holding the demo's ONNX export of the shipped default pair (made by
    ``demo.export_dir``, once per code version): ``dflash-trt serve --cache`` finds it there unchanged,
    the demo test serves its ``export/`` dir. Read-only for tests."""
    import argparse

    from dflash_trt import demo

    pair = demo._default_pair()

    def build(root: Path) -> None:
        demo.export_dir(argparse.Namespace(artifacts=None, target=pair / "target", draft=pair / "draft", cache=root))

    return build_cache("default_pair_demo_export", build, str(pair))
