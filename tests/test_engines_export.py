"""Every graph of a real export of the tiny pair compiles with TensorRT-RTX (CPU).

The tiny pair (conftest's ``tiny_pair``) is exported by the exporter itself
in the two engine dtypes, one per attention formulation (bf16 with masks,
fp16 with lengths; max_owners 2: 10 graphs each), then built. Export takes
~17-45 s per dtype on 2 cores; a build of the 10 graphs ~5 s.

Known, checked rather than hidden: (1) TensorRT-RTX 1.7's ONNX parser
ignores Attention's ``nonpad_kv_seqlen``: the strict build refuses it,
naming the dead node, and may refuse nothing else; with
``--allow-unread-tensors`` the graphs build. (2) ``KNOWN_FAILURES``: graphs
that do not build for a known reason; the test checks every other graph,
then xfails naming the reasons, and fails on any other build failure.
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


@pytest.fixture(scope="module", params=[("bf16", "mask"), ("fp16", "lengths")], ids=["bf16-mask", "fp16-lengths"])
def export_dir(request, tiny_pair, build_cache):
    """(dtype, directory) of an export of the tiny pair."""
    pytest.importorskip("tensorrt_rtx")
    from dflash_trt.export.exporter import ExportOptions, export_pair

    dtype, causal = request.param
    options = ExportOptions(max_owners=2, max_context=64, dtype=dtype, causal=causal)
    root = build_cache(f"export_{dtype}_{causal}", lambda out: export_pair(*tiny_pair, out / "graphs", options), *map(str, tiny_pair), options)
    return dtype, root / "graphs"


# (graph name prefix, text of TensorRT's message, why): build failures with a known cause.
KNOWN_FAILURES = (
    (
        "draft_",
        "must be a network output",
        "export: draft_{n} writes each draft cache twice (context rows, then the block: chained "
        "TensorScatter); TensorRT's KV-cache update needs its output to be a graph output",
    ),
    (
        "target_prefill",
        "Graph contains more than one op named",
        "TensorRT-RTX 1.7 (Myelin IR verifier) fails on the bf16 prefill with causal masks, dynamic T",
    ),
)


def known_failures(error: str) -> dict[str, str] | None:
    """{graph: why} if every failure in a build's message is a known one, else None."""
    blocks: list[str] = []  # one per failure: "  graph: ..." plus its deeper-indented continuation lines
    for line in error.splitlines():
        if line.startswith("   ") and blocks:
            blocks[-1] += "\n" + line
        elif line.startswith("  "):
            blocks.append(line.strip())
    found = {}
    for block in blocks:
        graph = block.split(":")[0]
        why = next((w for prefix, text, w in KNOWN_FAILURES if graph.startswith(prefix) and text in block), None)
        if why is None:
            return None
        found[graph] = why
    return found or None


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
    only find out on a GPU. Runs the CLI end to end. Graphs that fail for a
    known reason (KNOWN_FAILURES) are left out and the others checked, then
    the test xfails naming the reasons."""
    from dflash_trt.export.contract import graph_specs
    from dflash_trt.export.manifest import load_manifest

    dtype, directory = export_dir
    specs = graph_specs(load_manifest(directory).dims())
    argv = ["build", "--onnx", str(directory), "--backend", "tensorrt_rtx", "--allow-unread-tensors"]
    if cli.main([*argv, "--out", str(tmp_path / "all")]) == 0:
        check_built_set(tmp_path / "all", specs, dtype, directory, capsys.readouterr().out)
        return
    error = capsys.readouterr().err
    known = known_failures(error)
    if known is None:
        pytest.fail(error)
    buildable = {name: spec for name, spec in specs.items() if name not in known}
    only = [arg for name in buildable for arg in ("--only", name)]
    assert cli.main([*argv, "--out", str(tmp_path / "some"), *only]) == 0, capsys.readouterr().err
    check_built_set(tmp_path / "some", buildable, dtype, directory, capsys.readouterr().out)
    pytest.xfail("; ".join(f"{graph}: {why}" for graph, why in sorted(known.items())))


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
    profiles = {
        name: {b.name: b.profile for b in engine.bindings if b.profile} for name, engine in record.engines.items()
    }
    assert {name for name, p in profiles.items() if p} == {"target_prefill", "draft_context"} & set(specs)
    if "target_prefill" in profiles:  # T in 1..max_chunk (64)
        assert profiles["target_prefill"] == {"tokens": ((1, 1), (1, 64), (1, 64))}
    if "draft_context" in profiles:  # C in 1..max_chunk
        assert {name: p[0][1] for name, p in profiles["draft_context"].items()} == {"taps": 1}
    assert read_engine_set(out).source_manifest["file"] == "manifest.json" and (out / "manifest.json").is_file()
    assert sum(" built in " in line for line in printed.splitlines()) == len(specs)
