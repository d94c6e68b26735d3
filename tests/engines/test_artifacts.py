"""Artifacts verified and confined by default: every bad artifact is a typed error naming the file."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from dflash_trt.engines.engine_set import ENGINES_JSON
from dflash_trt.engines.load import check_engine_set
from dflash_trt.errors import EngineError, ManifestError
from dflash_trt.export.identity import file_sha256, verified_sha256
from dflash_trt.export.manifest import MANIFEST_FILE, load_manifest
from dflash_trt.runtime.backends.ort_backend import OrtBackend
from test_engines_load import CONTRACT, rewrite, write_set


def _graph_file(name: str, value: str):
    return lambda d: d["graphs"][name].update(file=value)


def _data_file(value: str):
    def change(d):
        for graph in d["graphs"].values():
            if graph["data_files"]:
                graph["data_files"] = {value: next(iter(graph["data_files"].values()))}

    return change


def _set(key, value):
    return lambda d: d.update({key: value})


MANIFEST_EDITS = {
    # case: (edit of the manifest JSON, words the error must contain)
    "parent-graph-path": (_graph_file("draft_model", "../draft_model.onnx"), ["graphs.draft_model.file", "'../draft_model.onnx'", "file name inside"]),
    "absolute-graph-path": (_graph_file("draft_model", "/etc/hostname"), ["graphs.draft_model.file", "'/etc/hostname'"]),
    "nested-graph-path": (_graph_file("draft_model", "sub/draft_model.onnx"), ["'sub/draft_model.onnx'", "no directories"]),
    "parent-data-path": (_data_file("../weights.data"), ["data_files", "'../weights.data'"]),
    "huge-max-owners": (_set("max_owners", 10**5), ["max_owners 100000 needs 200003 graphs", "'graphs' lists"]),
    "huger-max-owners": (_set("max_owners", 3 * 10**7), ["max_owners 30000000 needs"]),
    "vocab-past-int32": (_set("vocab_size", 10**12), ["vocab_size must be in [1, 2147483647]", "1000000000000"]),
    "context-past-int32": (_set("max_context", 2**40), ["max_context must be in [1, 2147483647]"]),
    "negative-sessions": (_set("max_sessions", -5), ["max_sessions must be in [1, 2147483647]", "-5"]),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_manifest_paths_confined_and_numbers_bounded_before_use(export_copy, case):
    """Guards against a manifest reaching outside its directory (`../x.onnx`, absolute paths loaded
    even with hash checks) and against unbounded numbers (max_owners 10^5 gave an 8 MB message,
    3·10^7 an untyped MemoryError after a minute): refused at the default open, short message, fast."""
    out, edit = export_copy
    change, words = MANIFEST_EDITS[case]
    edit(change)
    listing = sorted(os.listdir(out))
    with pytest.raises(ManifestError) as error:
        OrtBackend.from_export(out)
    message = str(error.value)
    assert all(word in message for word in words), message
    assert len(message) < 600 and str(out / MANIFEST_FILE) in message
    assert sorted(os.listdir(out)) == listing  # opening never writes into the artifact directory


def _not_utf8(path):
    path.write_bytes(b'{"schema_version": 1, "dtype": "\xff\xfe"}')


def _directory(path):
    path.unlink()
    path.mkdir()


def _binary(path):
    path.write_bytes(bytes(range(256)) * 4)


def _deep(path):
    path.write_text("[" * 200_000 + "]" * 200_000)


def _huge(path):
    with open(path, "r+b") as handle:
        handle.truncate(65 << 20)  # sparse: nothing is written


def _not_an_object(path):
    path.write_text("[1, 2, 3]")


BROKEN_FILES = {
    "not-utf8": (_not_utf8, "not UTF-8"),
    "directory": (_directory, "cannot be read (IsADirectoryError"),
    "binary": (_binary, "not UTF-8"),
    "nested-too-deep": (_deep, "not valid JSON (RecursionError"),
    "huge": (_huge, "more than any manifest"),
    "json-array": (_not_an_object, "must hold a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_unreadable_manifest_is_a_manifest_error_naming_the_file(export_copy, case):
    """Guards against raw UnicodeDecodeError / IsADirectoryError / RecursionError escaping the loader
    for a non-UTF-8, binary, directory or absurd manifest."""
    out, _ = export_copy
    damage, words = BROKEN_FILES[case]
    damage(out / MANIFEST_FILE)
    with pytest.raises(ManifestError, match="manifest.json") as error:
        load_manifest(out, verify="none")
    assert words in str(error.value)
    with pytest.raises(ManifestError):
        load_manifest(out / "draft_model.onnx")  # a file where the directory should be


def test_default_open_checks_hashes_and_remembers_verdicts(export_copy):
    """Guards against the default open (`dflash-trt run`, the demo) serving corrupted weights: 2,000
    flipped bytes in weights.data opened and generated different text. Verdicts are remembered per
    file version, and any write makes the file hashed again."""
    out, _ = export_copy
    weights = out / "weights.data"
    OrtBackend.from_export(out, lazy=True).close()  # hashes everything (and remembers)
    data = bytearray(weights.read_bytes())
    for i in range(0, 2000 * 97, 97):
        data[i % len(data)] ^= 0xFF
    with open(weights, "r+b") as handle:  # in place: same inode and size
        handle.write(data)
    with pytest.raises(ManifestError, match=r"sha256 of 'weights.data' is [0-9a-f]{64} in the manifest but [0-9a-f]{64} on disk"):
        OrtBackend.from_export(out, lazy=True)


def test_verdict_cache_hits_unchanged_files_and_misses_rewritten_ones(tmp_path, monkeypatch):
    """Guards against the remembered hash hiding a change: a file rewritten in place with its mtime
    set back is hashed again (ctime moved), while an unchanged file is not hashed twice."""
    from dflash_trt.export import identity

    monkeypatch.setattr(identity, "RACY_SECONDS", 0.0)
    path = tmp_path / "weights.data"
    path.write_bytes(b"a" * 4096)
    first = verified_sha256(path)
    with monkeypatch.context() as patch:
        patch.setattr(identity, "file_sha256", lambda p: pytest.fail("hashed an unchanged file again"))
        assert verified_sha256(path) == first
    stat = path.stat()
    time.sleep(0.05)  # past the filesystem's timestamp tick
    with open(path, "r+b") as handle:
        handle.write(b"b")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime: only ctime tells
    assert verified_sha256(path) == file_sha256(path) != first
    monkeypatch.setattr(identity, "RACY_SECONDS", 3600.0)
    fresh = tmp_path / "fresh.data"
    fresh.write_bytes(b"c")
    verified_sha256(fresh)
    with monkeypatch.context() as patch:  # just written: never remembered, hashed every time
        patch.setattr(identity, "file_sha256", lambda p: "hashed again")
        assert verified_sha256(fresh) == "hashed again"


def test_engine_set_tied_to_its_manifest(tmp_path, exported_pair):
    """Guards against a TensorRT engine set served with another export's manifest beside it (the
    backend sizes everything from that manifest, read with verify='none'): the recorded
    source_manifest hash must match the file, and a manifest must not sit beside an untied set."""
    directory = tmp_path / "engines"
    write_set(directory)
    check_engine_set(directory, CONTRACT)  # no manifest, none recorded: dims must come from the caller
    shutil.copy(exported_pair.out / MANIFEST_FILE, directory)
    with pytest.raises(EngineError, match="records no source_manifest, yet .*manifest.json is present"):
        check_engine_set(directory, CONTRACT)
    digest = file_sha256(directory / MANIFEST_FILE)
    rewrite(directory, lambda d: d.update(source_manifest={"file": MANIFEST_FILE, "sha256": digest}))
    check_engine_set(directory, CONTRACT)
    with open(directory / MANIFEST_FILE, "a") as handle:
        handle.write(" ")
    with pytest.raises(EngineError, match=f"records {digest}: the manifest beside the plans is not the one"):
        check_engine_set(directory, CONTRACT)
    (directory / MANIFEST_FILE).unlink()
    with pytest.raises(EngineError, match="manifest.json .* which is missing"):
        check_engine_set(directory, CONTRACT)
    for bad in ({"file": "../manifest.json", "sha256": digest}, "manifest.json", {"file": MANIFEST_FILE}):
        rewrite(directory, lambda d: d.update(source_manifest=bad))
        with pytest.raises(EngineError, match="field 'source_manifest' must be"):
            check_engine_set(directory, CONTRACT)


ENGINE_JSON_DAMAGE = {
    "not-utf8": (lambda p: p.write_bytes(b'{"format": "\xff"}'), "not UTF-8"),
    "binary": (lambda p: p.write_bytes(bytes(range(256))), "not UTF-8"),
    "truncated": (lambda p: p.write_text(p.read_text()[:50]), "not valid JSON"),
    "nested-too-deep": (lambda p: p.write_text("[" * 200_000 + "]" * 200_000), "not valid JSON: RecursionError"),
    "huge": (_huge, "more than any engines.json"),
    "engines-a-list": (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "engines": []})), "malformed field"),
    "plan-bytes-text": (
        lambda p: p.write_text(json.dumps(_edit_engine(json.loads(p.read_text()), plan_bytes="many"))),
        "malformed field",
    ),
    "plan-outside": (lambda p: p.write_text(json.dumps(_edit_engine(json.loads(p.read_text()), plan="../prefill.plan"))), "must be a file name inside"),
    "plan-dotdot": (lambda p: p.write_text(json.dumps(_edit_engine(json.loads(p.read_text()), plan=".."))), "missing"),
}


def _edit_engine(data: dict, **fields) -> dict:
    data["engines"]["prefill"].update(fields)
    return data


@pytest.mark.parametrize("case", sorted(ENGINE_JSON_DAMAGE))
def test_damaged_engines_json_is_an_engine_error_naming_the_file(tmp_path, case):
    """Guards against UnicodeDecodeError / RecursionError / TypeError escaping the engine-set reader."""
    write_set(tmp_path)
    damage, words = ENGINE_JSON_DAMAGE[case]
    damage(tmp_path / ENGINES_JSON)
    with pytest.raises(EngineError) as error:
        check_engine_set(tmp_path, CONTRACT)
    assert words in str(error.value) and (ENGINES_JSON in str(error.value) or "prefill" in str(error.value)), str(error.value)


def test_pools_that_cannot_fit_are_refused_before_allocating(exported_pair):
    """Guards against max_sessions = 10^8 reaching the allocator (an untyped RuntimeError, or the OOM
    killer after zeroing gigabytes): the pools' size is checked against available memory first."""
    with pytest.raises(EngineError, match=r"cache pools for max_sessions 100000000 need .* GiB .* available on cpu"):
        OrtBackend.from_export(exported_pair.out, max_sessions=10**8, verify="none", lazy=True)
