"""The TensorRT path end to end on a GPU: export, build, selfcheck, serve — equal to ONNX Runtime.

The README's TensorRT check is this module (``python -m pytest -q -m gpu -rs
tests/engines/test_engines_gpu.py``). It needs a CUDA GPU that an installed TensorRT
(``tensorrt``, else ``tensorrt_rtx``) runs plans on; elsewhere it is skipped
saying which is missing. fp16: TensorRT builds it and ONNX Runtime's CPU
provider runs it, so both serve the same exported graphs.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt import cli
from dflash_trt.engines.command import AUTO, pick_flavour
from dflash_trt.engines.engine_set import read_engine_set
from dflash_trt.engines.load import load_engine_set
from dflash_trt.engines.verdict import Site
from dflash_trt.engines.sources import export_sources
from dflash_trt.errors import EngineError

pytestmark = pytest.mark.gpu


def _tensorrt_or_skip():
    try:
        return pick_flavour(AUTO)
    except EngineError as error:
        pytest.skip(f"needs TensorRT or TensorRT-RTX: {error}")


def _runs_here_or_skip(engines, onnx_dir) -> None:
    """Skip when this GPU cannot run the plans (TensorRT-RTX refuses Hopper); fail on any other refusal."""
    sources, _ = export_sources(onnx_dir)
    try:
        load_engine_set(engines, {s.name: s.io for s in sources}).close()
    except EngineError as error:
        if "cannot run here" in str(error):
            pytest.skip(f"needs a CUDA GPU the installed TensorRT runs plans on: {error}")
        raise


def _serve(backend: str, artifacts, prompts, out) -> list[list[int]]:
    argv = ["run", "--artifacts", str(artifacts), "--backend", backend, "--prompts", str(prompts), "--out", str(out)]
    assert cli.main([*argv, "--max-new-tokens", "24", "--max-sessions", "3"]) == 0
    return [json.loads(line)["tokens"] for line in (out / "outputs.jsonl").read_text().splitlines()]


def test_tensorrt_serves_what_onnxruntime_serves(exported_pair, tmp_path, capsys):
    """Guards against a TensorRT engine set that builds but computes something else than its
    graphs (attention over stale cache slots, upper-left causal, or lower-right anchored at
    the padded cache length; caches not updated in place; a wrong profile): the semantics
    probe must pass on this GPU and be recorded with its TensorRT version, every engine must
    pass selfcheck against ONNX Runtime at every profile with a different start per owner, and
    `dflash-trt run --backend tensorrt` must emit ONNX Runtime's tokens, token for token."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    flavour = _tensorrt_or_skip()
    from dflash_trt.export.exporter import ExportOptions, export_pair

    onnx_dir, engines = tmp_path / "fp16", tmp_path / "engines"
    export_pair(exported_pair.target_dir, exported_pair.draft_dir, onnx_dir, ExportOptions(max_owners=3, max_context=64, dtype="fp16"))
    assert cli.main(["build", "--onnx", str(onnx_dir), "--out", str(engines), "--backend", flavour.name]) == 0
    _runs_here_or_skip(engines, onnx_dir)  # the first load on this GPU runs the semantics probe (or the build did)
    verdicts = read_engine_set(engines).probe.verdicts
    here = [v for v in verdicts if (v.gpu, v.flavour, v.trt_version) == (Site.current().gpu, flavour.name, flavour.version)]
    assert len(here) == 1 and here[0].passed, verdicts
    capsys.readouterr()
    # Every profile, prefill and verify included, at a different start per owner (the last at the cache's end).
    assert cli.main(["selfcheck", "--engines", str(engines), "--onnx", str(onnx_dir)]) == 0, capsys.readouterr().out
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in exported_pair.prompts))
    ours = _serve("tensorrt", engines, prompts, tmp_path / "trt")
    theirs = _serve("onnxruntime", onnx_dir, prompts, tmp_path / "ort")
    assert ours == theirs
    assert all(len(tokens) > 0 for tokens in ours)
