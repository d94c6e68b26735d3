"""Every graph of a real export of the tiny pair compiles with TensorRT-RTX (CPU).

The tiny pair (conftest's ``tiny_pair``) is exported by the exporter itself
in the two engine dtypes, one per attention formulation (bf16 with lengths,
fp16 with a mask; max_owners 2: 10 graphs each), then built. Export takes
~17 s per dtype on 2 cores; a build of the 10 graphs ~1.5 s.

Known, checked rather than hidden: (1) TensorRT-RTX 1.7's ONNX parser
ignores Attention's ``nonpad_kv_seqlen``: the strict build refuses it,
naming the dead node, and may refuse nothing else; with
``--allow-unread-tensors`` the graphs build. (2) ``draft_{n}`` chains two
TensorScatter writes on one cache, which TensorRT refuses: the test
xfails on exactly that failure and fails on any other.
"""

from __future__ import annotations

import pytest

from dflash_trt import cli
from dflash_trt.engines.build import build_engine_set
from dflash_trt.engines.engine_set import read_engine_set
from dflash_trt.engines.flavour import load_flavour
from dflash_trt.engines.load import check_engine_set
from dflash_trt.engines.sources import export_sources, load_graph
from dflash_trt.errors import EngineBuildError

NONPAD_KV_SEQLEN = 6  # input slot of ONNX Attention-24


@pytest.fixture(scope="module", params=[("bf16", "lengths"), ("fp16", "mask")], ids=["bf16-lengths", "fp16-mask"])
def export_dir(request, tiny_pair, tmp_path_factory):
    """(dtype, directory) of an export of the tiny pair."""
    pytest.importorskip("tensorrt_rtx")
    from dflash_trt.export.exporter import ExportOptions, export_pair

    dtype, causal = request.param
    out = tmp_path_factory.mktemp(f"export_{dtype}") / "graphs"
    export_pair(*tiny_pair, out, ExportOptions(max_owners=2, max_context=64, dtype=dtype, causal=causal))
    return dtype, out


CHAINED_WRITES = (
    "export: draft_{n} writes each draft cache twice (context rows, then the block: chained TensorScatter); "
    "TensorRT's KV-cache update needs its output to be a graph output, so draft_{n} does not build"
)


def _only_chained_draft_writes(error: str) -> bool:
    """Whether a failed build's message lists only draft_{n} graphs, each for chained cache writes."""
    failures = [line.strip() for line in error.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    return bool(failures) and all(
        line.startswith("draft_") and "must be a network output" in line for line in failures
    )


def attention_lengths(path) -> set[str]:
    """Names of the tensors a graph feeds to Attention's nonpad_kv_seqlen."""
    nodes = load_graph(path).graph.node
    return {n.input[NONPAD_KV_SEQLEN] for n in nodes if n.op_type == "Attention" and len(n.input) > NONPAD_KV_SEQLEN}


def test_strict_build_refuses_nothing_but_the_ignored_attention_lengths(export_dir, tmp_path):
    """Guards against TensorRT dropping any other part of an exported graph
    unnoticed (and against the strict check refusing live layers): whatever
    the strict build refuses must be a tensor fed to nonpad_kv_seqlen."""
    _dtype, directory = export_dir
    sources, manifest = export_sources(directory)
    lengths = {(s.name, t) for s in sources for t in attention_lengths(s.onnx_path)}
    try:
        build_engine_set(sources, tmp_path / "strict", load_flavour("tensorrt_rtx"), source_manifest=manifest)
    except EngineBuildError as error:
        refused = {(f.graph, f.tensor) for f in error.failures}
        assert all(f.tensor for f in error.failures), [str(f) for f in error.failures if not f.tensor]
        assert refused <= lengths, sorted(refused - lengths)


def test_every_exported_graph_builds_with_the_io_of_the_contract(export_dir, tmp_path, capsys):
    """Guards against an exported graph that TensorRT cannot compile, or that
    compiles to an engine whose bindings (names, shapes, dtypes, profile
    ranges of the dynamic T/C dims) are not the contract's: the runtime would
    only find out on a GPU. Runs the CLI end to end. While draft_{n} cannot
    build (CHAINED_WRITES), the other graphs are checked, then it xfails."""
    from dflash_trt.export.contract import graph_specs
    from dflash_trt.export.manifest import load_manifest

    dtype, directory = export_dir
    specs = graph_specs(load_manifest(directory).dims())
    argv = ["build", "--onnx", str(directory), "--backend", "tensorrt_rtx", "--allow-unread-tensors"]
    if cli.main([*argv, "--out", str(tmp_path / "all")]) == 0:
        check_built_set(tmp_path / "all", specs, dtype, directory, capsys.readouterr().out)
        return
    error = capsys.readouterr().err
    if not _only_chained_draft_writes(error):
        pytest.fail(error)
    buildable = {name: spec for name, spec in specs.items() if spec.kind != "draft"}
    only = [arg for name in buildable for arg in ("--only", name)]
    assert cli.main([*argv, "--out", str(tmp_path / "some"), *only]) == 0, capsys.readouterr().err
    check_built_set(tmp_path / "some", buildable, dtype, directory, capsys.readouterr().out)
    pytest.xfail(CHAINED_WRITES)


def check_built_set(out, specs, dtype, directory, printed: str) -> None:
    """The set in ``out`` has exactly ``specs``' engines, each with the contract's IO."""
    from dflash_trt.export.contract import DTYPES

    record = check_engine_set(out, specs)  # recorded bindings == contract, plans hash-checked
    assert set(record.engines) == set(specs)
    for name, engine in record.engines.items():
        spec = specs[name]
        expected = {("input", s.name) for s in spec.inputs} | {("output", s.name) for s in spec.outputs}
        assert {(b.mode, b.name) for b in engine.bindings} == expected
        assert {b.dtype for b in engine.bindings} <= {DTYPES[dtype], "float32", "int64"}
        assert set(engine.unread_tensors) <= attention_lengths(directory / f"{name}.onnx")
    prefill_profile = {b.name: b.profile for b in record.engines["target_prefill"].bindings if b.profile}
    assert prefill_profile == {"tokens": ((1, 1), (1, 64), (1, 64))}  # T in 1..max_chunk
    context_profile = {b.name: b.profile[0][1] for b in record.engines["draft_context"].bindings if b.profile}
    assert context_profile == {"taps": 1}  # C's min
    assert read_engine_set(out).source_manifest["file"] == "manifest.json" and (out / "manifest.json").is_file()
    assert sum(" built in " in line for line in printed.splitlines()) == len(specs)
