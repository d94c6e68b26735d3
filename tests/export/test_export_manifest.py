"""manifest.json: its facts, its refusals, the export key, and the ``dflash-trt export`` command."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields

import onnx
import pytest

from dflash_trt.cli import main
from dflash_trt.errors import ManifestError
from dflash_trt.export import contract
from dflash_trt.export.contract import Dims
from dflash_trt.export.exporter import ExportOptions, contract_dims, up_to_date
from dflash_trt.export.identity import file_sha256
from dflash_trt.export.manifest import load_manifest
from dflash_trt.export.pair import load_pair

import prebuilt

OPTIONS = ExportOptions(**prebuilt.EXPORTED_PAIR_OPTIONS)


def test_manifest_records_the_facts_the_runtime_needs(exported_pair):
    """Guards against a manifest missing or misstating a fact the runtime checks (block size,
    proposals bounds, mask, taps, geometry, distinct cache keys, hashes, versions)."""
    m, draft_config = exported_pair.manifest, json.loads((exported_pair.draft_dir / "config.json").read_text())
    assert (m.schema_version, m.opset, m.dtype, m.causal) == (1, 24, "fp32", "lengths")
    assert m.ir_version <= 13
    assert (m.block_size, m.proposals, m.min_proposals, m.max_proposals) == (8, 7, 2, 7)
    assert m.mask_token_id == draft_config["dflash_config"]["mask_token_id"]
    assert (m.tap_layer_ids, m.tap_width, m.vocab_size) == ((1, 3), 2 * 64, 97)
    assert (m.max_owners, m.max_sessions, m.max_context, m.max_chunk) == (3, 3, 64, 56)  # chunk + block fit the cache
    assert (m.special_tokens.bos, m.special_tokens.eos, m.special_tokens.stop) == (2, (1,), (1,))
    assert (m.target.layers, m.target.kv_heads, m.target.head_dim, m.target.windows) == (5, 2, 16, (0,) * 5)
    assert (m.draft.layers, m.draft.kv_heads, m.draft.head_dim, m.draft.windows) == (2, 2, 16, (0, 0))
    assert m.target.cache_key.startswith("target-") and m.draft.cache_key.startswith("draft-")
    assert {"torch", "onnx", "onnxruntime", "onnxscript", "dflash_trt"} <= set(m.versions)
    for name, graph in m.graphs.items():
        assert graph.sha256 == file_sha256(exported_pair.out / graph.file)
        shared = {"weights.data": file_sha256(exported_pair.out / "weights.data")}
        assert dict(graph.data_files) in (shared, {})  # small tensors stay inline
        weightless = graph.io.kind.startswith("verify") or graph.io.kind == "sample"  # token choice only
        assert weightless or dict(graph.data_files) == shared
        assert graph.io == contract.graph_spec(m.dims(), name)


def test_exporter_and_manifest_build_the_same_dims(exported_pair):
    """Bug: the exporter's dims (from the models and options) and the manifest's (from its facts)
    drift apart (a field taken from the wrong model, a size one of them does not set): for the
    same pair and options both are equal, and every Dims field is a size, a stack field, the dtype or the verify lengths."""
    target, draft = load_pair(exported_pair.target_dir, exported_pair.draft_dir)
    options = OPTIONS.resolve(exported_pair.target_dir, exported_pair.draft_dir)
    assert contract_dims(target, draft, options) == exported_pair.manifest.dims()
    stacks = [f"{model}_{name}" for model in ("target", "draft") for name in contract.STACK_FIELDS]
    assert [f.name for f in fields(Dims)] == [*contract.SIZE_FIELDS, *stacks, "dtype", "verify_proposals"]
    sizes = {name: getattr(exported_pair.manifest, name) for name in contract.SIZE_FIELDS}
    assert Dims.of((5, 2, 16), (2, 2, 16), "float32", (3, 7), **sizes) == exported_pair.manifest.dims()
    with pytest.raises(ValueError, match="shorter"):
        Dims.of((5, 2), (2, 2, 16), "float32", **sizes)  # a stack without its head_dim


def _set(key, value):
    def change(data):
        data[key] = value

    return change


def _relabel_proposals(data):
    """Edit proposals AND every recorded IO consistently: only the graph files can tell."""
    data["proposals"] = 5
    data["verify_proposals"] = [3, 5]
    dims = Dims.of((5, 2, 16), (2, 2, 16), "float32", (3, 5), **{k: data[k] for k in contract.SIZE_FIELDS})
    for name, graph in data["graphs"].items():
        graph.update(contract.graph_spec(dims, name).io_json())


def _same_cache_keys(data):
    data["draft"]["cache_key"] = data["target"]["cache_key"]


REFUSALS = {
    # case: (edit of the manifest JSON, words the error must contain)
    "edited-block-size": (_set("block_size", 16), ["max_proposals", "7", "block_size - 1", "15"]),
    "edited-proposals": (_set("proposals", 5), ["proposals", "5", "7", "draft_model"]),
    "edited-proposals-and-io": (_relabel_proposals, ["proposals", "5", "7", "file of graph", "draft_model"]),
    "edited-dtype": (_set("dtype", "bf16"), ["dtype", "bfloat16", "float32"]),
    "edited-vocab": (_set("vocab_size", 98), ["vocab_size", "98", "97"]),
    "unknown-schema": (_set("schema_version", 2), ["schema_version", "2", "1"]),
    "malformed-field": (_set("block_size", "8"), ["block_size", "must be an int", "'8'"]),
    "unknown-field": (_set("blok_size", 8), ["blok_size", "unknown field"]),
    "graph-entry-missing": (lambda d: d["graphs"].pop("verify_argmax_3"), ["graphs lacks 'verify_argmax_3'", "max_owners 3"]),
    "short-graph-missing": (lambda d: d["graphs"].pop("verify_sample_2_p3"), ["graphs lacks 'verify_sample_2_p3'"]),
    "verify-lengths-past-proposals": (_set("verify_proposals", [3, 9]), ["verify_proposals", "[3, 9]", "end at proposals 7"]),
    "verify-lengths-unordered": (_set("verify_proposals", [7, 3]), ["verify_proposals", "[7, 3]", "increasing"]),
    "verify-length-unlisted": (_set("verify_proposals", [5, 7]), ["graphs lacks 'verify_argmax_1_p5'"]),
    "wrong-hash": (lambda d: d["graphs"]["draft_model"].update(sha256="0" * 64), ["draft_model", "sha256", "0" * 64]),
    "same-cache-keys": (_same_cache_keys, ["cache_key", "must differ"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_manifest_disagreeing_with_its_graphs_is_refused_naming_field_and_values(export_copy, case):
    """Guards against serving an artifact set whose manifest lies about its graphs (the runtime
    would size buffers or blocks wrongly): each edit is refused with ManifestError naming the field
    and both values."""
    out, edit = export_copy
    change, words = REFUSALS[case]
    edit(change)
    with pytest.raises(ManifestError) as error:
        load_manifest(out)
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_a_manifest_without_verify_lengths_loads_as_offering_p_only(export_copy):
    """Guards against refusing (or misreading) artifact sets exported before verify lengths existed: a
    manifest without ``verify_proposals`` and without the ``_p{k}`` graphs loads, its dims offering
    P alone; the same manifest listing a ``_p{k}`` graph it does not offer is refused, naming it."""
    from dflash_trt.runtime.backends.ort_backend import OrtBackend

    out, edit = export_copy

    def older(data):
        del data["verify_proposals"]
        for name in [n for n in data["graphs"] if "_p" in n]:
            del data["graphs"][name]

    edit(older)
    manifest = load_manifest(out)
    assert manifest.verify_proposals == (7,) and manifest.dims().verify_proposals == (7,) and manifest.dims().short_verify == ()
    assert not any(contract.verify_length(name) for name in manifest.graphs)
    with OrtBackend.from_export(out, verify="none", threads=1, lazy=True) as backend:
        assert backend.graph_names == contract.graph_names(3)  # runs P only
    edit(lambda d: d["graphs"].update(verify_argmax_1_p3=d["graphs"]["verify_argmax_1"]))
    with pytest.raises(ManifestError, match="graphs has 'verify_argmax_1_p3', not a graph of max_owners 3"):
        load_manifest(out, verify="none")


def test_tokenizer_files_the_manifest_names_are_checked(export_copy):
    """Guards against an export serving text with a tokenizer other than its target's (a file replaced
    after export) or naming one that is gone, and against a tokenizer entry escaping the directory."""
    from dflash_trt.export.identity import file_sha256

    out, edit = export_copy
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    digest = file_sha256(out / "tokenizer.json")
    edit(lambda d: d.update(tokenizer={"tokenizer.json": digest}))
    assert load_manifest(out).tokenizer == {"tokenizer.json": digest}
    (out / "tokenizer.json").write_text('{"version": "2.0"}')
    with pytest.raises(ManifestError, match=r"tokenizer sha256 of 'tokenizer.json' is [0-9a-f]{64} in the manifest but [0-9a-f]{64} on disk"):
        load_manifest(out)
    (out / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match=r"tokenizer names file 'tokenizer.json', which is missing"):
        load_manifest(out, verify="io")
    edit(lambda d: d.update(tokenizer={"../tokenizer.json": digest}))
    with pytest.raises(ManifestError, match=r"field 'tokenizer.../tokenizer.json' must be a file name inside"):
        load_manifest(out, verify="none")
    edit(lambda d: d.pop("tokenizer"))
    assert load_manifest(out).tokenizer == {}  # a manifest written before the field: no tokenizer


def test_missing_or_changed_graph_file_is_refused(export_copy, exported_pair):
    """Guards against a graph or weights file deleted or replaced after export (stale or partial copies)."""
    out, _ = export_copy
    model = onnx.load(str(out / "verify_argmax_2.onnx"))
    model.doc_string = "changed after export"
    onnx.save(model, str(out / "verify_argmax_2.onnx"))
    with pytest.raises(ManifestError, match=r"verify_argmax_2 sha256 of 'verify_argmax_2.onnx' is [0-9a-f]{64} in the manifest but [0-9a-f]{64} on disk"):
        load_manifest(out)
    load_manifest(out, verify="io")  # same IO: only the hash tells
    shutil.copy(exported_pair.out / "verify_argmax_2.onnx", out)
    with open(out / "weights.data", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ManifestError, match=r"sha256 of 'weights.data' is [0-9a-f]{64} in the manifest but [0-9a-f]{64} on disk"):
        load_manifest(out)
    (out / "draft_model.onnx").unlink()
    with pytest.raises(ManifestError, match=r"graphs.draft_model names file 'draft_model.onnx', which is missing"):
        load_manifest(out, verify="io")
    assert load_manifest(out, verify="none").block_size == 8  # a manifest copied beside engines


def test_export_key_skips_only_unchanged_inputs(exported_pair, tmp_path):
    """Guards against the demo re-exporting unchanged inputs, or worse, reusing an export after the
    checkpoint or options changed."""
    target, out = exported_pair.target_dir, exported_pair.out
    draft = tmp_path / "draft"
    shutil.copytree(exported_pair.draft_dir, draft)  # copy2 keeps mtimes: same fingerprint
    assert up_to_date(target, draft, out, OPTIONS) == exported_pair.manifest
    assert up_to_date(target, draft, out, ExportOptions(max_owners=3, max_context=64, dtype="fp32", proposals=5)) is None
    weights = draft / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert up_to_date(target, draft, out, OPTIONS) is None


def test_cli_export_is_a_no_op_when_up_to_date_and_refuses_bad_options(exported_pair, capsys):
    """Guards against the command re-exporting (or touching files) when nothing changed, and
    against a bad option failing late or with a traceback instead of a named range."""
    out = exported_pair.out
    common = ["export", "--target", str(exported_pair.target_dir), "--draft", str(exported_pair.draft_dir), "--out", str(out)]
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main([*common, "--max-owners", "3", "--max-context", "64", "--dtype", "fp32", "--shared-weights"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    assert main([*common, "--max-context", "64", "--proposals", "9"]) == 2  # a usage error, refused before any work
    assert "UsageError: export option proposals must be an int [2, 7], got 9" in capsys.readouterr().err
