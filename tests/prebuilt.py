"""The suite's expensive artifacts, one builder each, shared by the fixtures and the prebuilder.

Every builder takes ``cache`` (``functools.partial(build_cache.cached_build, root)``)
and returns the cached directory. Fixtures call these functions, and so does
``python tests/prebuilt.py ROOT`` — the background process conftest starts for a
full run, which builds them on the second core while the first runs tests: both
compute the same cache key from the same code, and the cache's lock makes
whichever comes second wait for (or reuse) the other's result.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402
from build_cache import ENGINE_SOURCES, cached_build  # noqa: E402

EXPORT_PROMPT_LENGTHS = (5, 19, 40)  # <= block, > block (drained), long (ends in plain decode)
EXPORT_NEW_TOKENS = (30, 25, 20)
# exported_pair's options (ExportOptions' fields): ONNX Runtime's configuration, live keys included
EXPORTED_PAIR_OPTIONS = dict(max_owners=3, max_context=64, dtype="fp32", shared_weights=True, live_keys=True)
MASK_GRAPHS = ("target_model", "draft_model")  # what --causal mask changes
PRINTED, ERROR = "build.stdout", "build.stderr"  # a cached engine build's captured output
ENGINE_LABELS = ("tiny-fp16-lengths", "default-bf16-lengths", "default-bf16-mask")  # engine sets the tests build


def tiny_pair(cache) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a Qwen3 target and a block-8 DFlash draft tapping layers 1 and 3."""

    def build(root: Path) -> None:
        tiny_models.write_draft(root / "draft", tiny_models.write_target(root / "target"))

    root = cache("tiny_pair", build)
    return root / "target", root / "draft"


def export_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, tiny_models.VOCAB - 1, (n,), generator=generator).tolist() for n in EXPORT_PROMPT_LENGTHS]


def exported_pair(cache) -> Path:
    """fp32 export (max_owners 3, max_context 64, shared weights) of the tiny target and a tuned draft
    (conftest's ``exported_pair`` says why): ``root/graphs``, ``root/draft``."""
    target_dir, random_draft = tiny_pair(cache)
    prompts = export_prompts()

    def build(root: Path) -> None:
        from dflash_trt.export.exporter import ExportOptions, export_pair

        draft_dir = _tuned_draft(target_dir, random_draft, prompts, root / "draft")
        export_pair(target_dir, draft_dir, root / "graphs", ExportOptions(**EXPORTED_PAIR_OPTIONS))

    return cache("exported_pair", build, str(target_dir), str(random_draft), prompts, EXPORT_NEW_TOKENS)


def _tuned_draft(target_dir: Path, random_draft: Path, prompts: list, out: Path) -> Path:
    """The random draft with its mask token and scaled layer outputs (see conftest's ``exported_pair``)."""
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


def default_pair_cache(cache) -> Path:
    """A ``dflash-trt`` cache dir holding the demo's ONNX export of the shipped default pair."""
    import argparse

    from dflash_trt import demo
    from dflash_trt.export import DEFAULT_PAIR_DIR as pair

    def build(root: Path) -> None:
        demo.export_dir(argparse.Namespace(artifacts=None, target=pair / "target", draft=pair / "draft", cache=root))

    return cache("default_pair_demo_export", build, str(pair))


def tiny_export(cache, dtype: str, causal: str) -> Path:
    """The tiny pair exported with max_owners 2 (every graph kind): ``.../graphs``."""
    from dflash_trt.export.exporter import ExportOptions, export_pair

    pair = tiny_pair(cache)
    options = ExportOptions(max_owners=2, max_context=64, dtype=dtype, causal=causal)
    return cache(f"export_{dtype}_{causal}", lambda out: export_pair(*pair, out / "graphs", options), *map(str, pair), options) / "graphs"


def default_export(cache, causal: str) -> Path:
    """The shipped default pair (V 8192) in bf16, max_owners 1: ``.../graphs``."""
    from dflash_trt.export.exporter import ExportOptions, export_pair
    from dflash_trt.export.pair import DEFAULT_PAIR_DIR

    options = ExportOptions(max_owners=1, max_context=128, max_chunk=32, dtype="bf16", causal=causal)
    target, draft = DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft"
    return cache(f"default_pair_{causal}", lambda out: export_pair(target, draft, out / "graphs", options), str(target), str(draft), options) / "graphs"


def default_mask_graphs(cache) -> tuple[Path, object]:
    """The graphs ``--causal mask`` changes, exported one by one (no manifest), and their dims."""
    from dflash_trt.export.manifest import load_manifest

    dims = load_manifest(default_export(cache, "lengths")).dims()
    return cache("default_pair_mask_graphs", lambda out: _export_mask_graphs(out, dims), dims), dims


def _export_mask_graphs(out: Path, dims) -> None:
    from dflash_trt.export import contract
    from dflash_trt.export.exporter import export_graph, kernels_of
    from dflash_trt.export.graph_modules import graph_module
    from dflash_trt.export.onnx_kernels import OnnxKernels
    from dflash_trt.export.pair import DEFAULT_PAIR_DIR, load_pair

    target, draft = load_pair(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", torch.bfloat16)
    with kernels_of([target, draft], OnnxKernels("mask", emit=True)):
        for name in MASK_GRAPHS:
            spec = contract.graph_spec(dims, name)
            export_graph(graph_module(spec, target, draft, dims), spec, out)


def mask_sources(cache) -> list:
    """GraphSources of the default pair's mask graphs (their specs from the lengths export's dims)."""
    from dflash_trt.engines.sources import GraphSource
    from dflash_trt.export import contract

    directory, dims = default_mask_graphs(cache)
    return [GraphSource(name, directory / f"{name}.onnx", contract.graph_spec(dims, name)) for name in MASK_GRAPHS]


def export_of(cache, label: str) -> Path:
    """The export directory of a lengths engine-set label (the mask set has ``mask_sources``)."""
    if label.startswith("tiny"):
        _, dtype, causal = label.split("-")
        return tiny_export(cache, dtype, causal)
    return default_export(cache, "lengths")


def engines(cache, label: str) -> Path:
    """The TensorRT-RTX engine set of ``label`` ("tiny-fp16-lengths", "default-bf16-lengths",
    "default-bf16-mask"): ``.../engines``, the build's printed output and error beside it. An
    export dir goes through ``dflash-trt build``; the mask graphs (no manifest) through
    ``build_engine_set``."""
    if label.endswith("mask"):
        sources = mask_sources(cache)
        build, inputs = functools.partial(_mask_build, sources, mask_probe(cache)), [str(s.onnx_path) for s in sources]
    else:
        source = export_of(cache, label)
        build, inputs = functools.partial(_cli_build, source), [str(source)]
    return cache(f"engines_{label}", build, *inputs, sources=ENGINE_SOURCES) / "engines"


def _cli_build(source: Path, root: Path) -> None:
    from dflash_trt import cli

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["build", "--onnx", str(source), "--backend", "tensorrt_rtx", "--out", str(root / "engines")])
    (root / PRINTED).write_text(stdout.getvalue())
    (root / ERROR).write_text("" if code == 0 else stderr.getvalue())


def mask_probe(cache):
    """The semantics probe of the default pair exported with --causal mask."""
    from dataclasses import replace

    from dflash_trt.engines.probe import ProbeSpec
    from dflash_trt.export.manifest import load_manifest

    return replace(ProbeSpec.from_manifest(load_manifest(default_export(cache, "lengths"))), causal="mask")


def _mask_build(sources: list, probe, root: Path) -> None:
    from dflash_trt.engines.build import build_engine_set
    from dflash_trt.engines.flavour import load_flavour
    from dflash_trt.errors import EngineBuildError

    error = ""
    try:
        build_engine_set(sources, root / "engines", load_flavour("tensorrt_rtx"), probe=probe)
    except EngineBuildError as failure:
        error = str(failure)
    (root / PRINTED).write_text("")
    (root / ERROR).write_text(error)


def _has_rtx() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt_rtx") is not None


def jobs(cache) -> list:
    """What the prebuilder makes: what conftest's LATE_MODULES need (a full run moves them to its
    end), while the run itself makes what the others need (the tiny pair and its fp32 export)."""
    labels = ENGINE_LABELS if _has_rtx() else ()
    return [functools.partial(default_pair_cache, cache), *(functools.partial(engines, cache, label) for label in labels)]


def main(root: str) -> int:
    """Build every job into the cache at ``root``; a failing job is left to its fixture (which
    builds it again and reports the error where a test needs it)."""
    torch.set_num_threads(1)
    cache = functools.partial(cached_build, Path(root))
    for job in jobs(cache):
        try:
            job()
        except Exception:  # noqa: BLE001 - the fixture rebuilds it and fails the tests that need it
            traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
