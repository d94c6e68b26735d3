"""The engine-set loader refuses what does not match; no TensorRT needed.

Engine sets here are written by hand (engines.json + a few bytes standing in
for each plan), so every refusal is exercised on any machine. The
deserialize stage runs against a stand-in runtime with TensorRT's API.
"""

from __future__ import annotations

import enum
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_trt.engines.attention import BoundAttention, attention_digest
from dflash_trt.engines.bindings import TRT_DTYPES, Binding, check_io, input_profiles, io_mismatches
from dflash_trt.engines.engine_set import (
    ENGINES_JSON,
    EngineRecord,
    EngineSetRecord,
    read_engine_set,
    write_engine_set,
)
from dflash_trt.engines.flavour import Flavour, load_flavour
from dflash_trt.engines.load import check_engine_set, check_flavour, engine_bindings, load_engine_set
from dflash_trt.errors import EngineError
from dflash_trt.engines.shared_weights import Lifted, write_shared_weights
from dflash_trt.export.contract import (
    MODEL_KINDS,
    DimRange,
    Dims,
    GraphSpec,
    TensorSpec,
    graph_spec,
    profiles_of,
    shared_weight_specs,
    with_shared_weights,
)
from dflash_trt.export.identity import file_sha256

# A tiny pair's contract: one model engine (5 profiles: prefill, verify_n, decode_n) and one static graph.
DIMS = Dims(
    vocab_size=100, tap_width=32, block_size=4, proposals=3, max_owners=2, max_context=64, max_chunk=16,
    target_layers=1, target_kv_heads=2, target_head_dim=16, draft_layers=1, draft_kv_heads=1, draft_head_dim=16,
    dtype="bfloat16",
)
PREFILL = graph_spec(DIMS, "target_model")
VERIFY = graph_spec(DIMS, "target_verify_2")
CONTRACT = {"prefill": PREFILL, "verify_2": VERIFY}


HIDDEN = 16
SHARED = shared_weight_specs(DIMS.vocab_size, HIDDEN, DIMS.dtype)


def bindings_of(io: GraphSpec) -> tuple[Binding, ...]:
    """What a correct build of ``io`` records (a model's with the shared weights)."""
    io = with_shared_weights({io.name: io}, SHARED)[io.name]
    inputs = tuple(Binding(s.name, "input", _shape(s), s.dtype, input_profiles(io, s)) for s in io.inputs)
    return inputs + tuple(Binding(s.name, "output", _shape(s), s.dtype) for s in io.outputs)


def _shape(spec: TensorSpec) -> tuple[int, ...]:
    return tuple(-1 if isinstance(d, str) else d for d in spec.shape)


def write_set(directory: Path, contract=CONTRACT, flavour="tensorrt_rtx", version="1.7.1.116") -> EngineSetRecord:
    directory.mkdir(parents=True, exist_ok=True)
    models = any(io.kind in MODEL_KINDS for io in contract.values())
    shared = write_shared_weights(directory, Lifted({}, shared_tensors())) if models else None
    engines = {}
    for name, io in contract.items():
        plan = directory / f"{name}.plan"
        plan.write_bytes(f"plan of {name}".encode())
        engines[name] = EngineRecord(
            name, plan.name, file_sha256(plan), plan.stat().st_size, {f"{name}.onnx": "0" * 64}, bindings_of(io), 0.1,
            tuple(p.graph for p in profiles_of(io)),
        )
    record = EngineSetRecord(flavour, version, ("SM89",), {"workspace_mb": None, "version_compatible": False}, engines, shared_weights=shared)
    write_engine_set(directory, record)
    return record


def shared_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=generator).to(torch.bfloat16) for s in SHARED}


def rewrite(directory: Path, edit) -> None:
    """Apply ``edit`` to the parsed engines.json and write it back."""
    path = directory / ENGINES_JSON
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_a_consistent_set_passes_the_file_stage(tmp_path):
    """Guards against the checks refusing a correct set (every refusal test
    below would pass vacuously if the loader refused everything)."""
    written = write_set(tmp_path)
    record = check_engine_set(tmp_path, CONTRACT)
    assert record.engines == written.engines and record.targets == ("SM89",)


def test_plan_whose_hash_differs_from_the_manifest_is_refused(tmp_path):
    """Guards against running a plan that was rebuilt, truncated or swapped
    after engines.json was written."""
    record = write_set(tmp_path)
    (tmp_path / "verify_2.plan").write_bytes(b"plan of verify_X")  # same size, other bytes
    with pytest.raises(EngineError) as caught:
        check_engine_set(tmp_path, CONTRACT)
    text = str(caught.value)
    assert "'verify_2'" in text and "verify_2.plan" in text
    assert record.engines["verify_2"].plan_sha256 in text and file_sha256(tmp_path / "verify_2.plan") in text


def test_plan_of_another_size_is_refused_before_hashing(tmp_path):
    """Guards against a truncated plan (an interrupted copy) being hashed or loaded."""
    write_set(tmp_path)
    (tmp_path / "prefill.plan").write_bytes(b"short")
    with pytest.raises(EngineError, match=r"'prefill'.*5 bytes.*says 15"):
        check_engine_set(tmp_path, CONTRACT)


def test_manifest_naming_a_missing_plan_is_refused(tmp_path):
    """Guards against a crash (FileNotFoundError deep in TensorRT) when a plan
    named by engines.json was not copied along."""
    write_set(tmp_path)
    (tmp_path / "prefill.plan").unlink()
    with pytest.raises(EngineError, match=r"engine 'prefill': plan file 'prefill.plan' .* is missing"):
        check_engine_set(tmp_path, CONTRACT)


def test_plan_name_escaping_the_directory_is_refused(tmp_path):
    """Guards against engines.json pointing the loader at files outside the set."""
    write_set(tmp_path / "set")
    rewrite(tmp_path / "set", lambda d: d["engines"]["verify_2"].update(plan="../verify_2.plan"))
    with pytest.raises(EngineError, match="must be a file name inside"):
        check_engine_set(tmp_path / "set", CONTRACT)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("dtype", "float16", r"input 'tokens' dtype: contract int64, engine float16"),
        ("shape", [2, 6], r"input 'tokens' shape: contract \[2, 4\] \(= \[2, 4\]\), engine \[2, 6\]"),
        ("name", "token_ids", r"input 'token_ids': in the engine, not in the contract"),
    ],
)
def test_recorded_binding_that_differs_from_the_contract_is_refused(tmp_path, field, value, expected):
    """Guards against loading plans whose IO is not the runtime's contract
    (an engine set built from an older export): the message names the engine,
    the binding and both values."""
    write_set(tmp_path)
    rewrite(tmp_path, lambda d: d["engines"]["verify_2"]["bindings"][0].update({field: value}))
    with pytest.raises(EngineError, match=expected) as caught:
        check_engine_set(tmp_path, CONTRACT)
    assert "engine 'verify_2'" in str(caught.value)
    if field == "name":
        assert "input 'tokens': in the contract, missing from the engine" in str(caught.value)


def test_profile_range_that_differs_from_the_manifest_is_refused(tmp_path):
    """Guards against a dynamic engine whose profile stops short of the
    manifest's chunk size (it would fail at runtime on a long prompt)."""
    write_set(tmp_path)
    rewrite(tmp_path, lambda d: d["engines"]["prefill"]["bindings"][0]["profiles"][0].__setitem__(slice(None), [[1, 1], [1, 8], [1, 8]]))
    expected = (
        r"input 'tokens' profile 'target_prefill' min/opt/max: contract \[1, 1\] / \[1, 16\] / \[1, 16\], "
        r"engine \[1, 1\] / \[1, 8\] / \[1, 8\]"
    )
    with pytest.raises(EngineError, match=expected):
        check_engine_set(tmp_path, CONTRACT)


def test_model_engine_with_profiles_in_another_order_is_refused(tmp_path):
    """Guards against a model engine whose profile k serves another run graph than the
    contract's k-th: the runtime selects a run graph's profile by index, so target_verify_1
    would run at the decode shape (or fail to bind)."""
    write_set(tmp_path)
    rewrite(tmp_path, lambda d: d["engines"]["prefill"]["profiles"].reverse())
    with pytest.raises(EngineError, match=r"engine 'prefill' profiles serve \['target_decode_2', .*the contract's are \['target_prefill', 'target_verify_1'"):
        check_engine_set(tmp_path, CONTRACT)


def test_static_contract_against_a_dynamic_engine_is_refused(tmp_path):
    """Guards against a static graph built with a profile (or dynamic dims):
    CUDA-graph replay needs fixed shapes."""
    write_set(tmp_path)
    rewrite(
        tmp_path,
        lambda d: d["engines"]["verify_2"]["bindings"][0].update(shape=[2, -1], profiles=[[[2, 1], [2, 4], [2, 4]]]),
    )
    with pytest.raises(EngineError, match=r"input 'tokens' profiles: contract none \(static\), engine 1"):
        check_engine_set(tmp_path, CONTRACT)


def test_set_missing_an_engine_of_the_contract_is_refused(tmp_path):
    """Guards against a partial engine set (a build that skipped a graph)
    failing later, when the runtime first asks for that engine."""
    write_set(tmp_path, {"prefill": PREFILL})
    with pytest.raises(EngineError, match=r"missing \['verify_2'\], not in the contract \[\]"):
        check_engine_set(tmp_path, CONTRACT)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(format_version=99), r"'format_version' must be 4, got 99"),
        (lambda d: d.update(format="something/else"), r"'format' must be 'dflash-trt/engines'"),
        (lambda d: d["engines"]["prefill"].pop("plan_sha256"), r"malformed field \(KeyError: 'plan_sha256'\)"),
    ],
)
def test_malformed_engines_json_is_refused_naming_the_field(tmp_path, edit, expected):
    """Guards against a KeyError/TypeError traceback instead of a message when
    engines.json is from another format version or hand-edited."""
    write_set(tmp_path)
    rewrite(tmp_path, edit)
    with pytest.raises(EngineError, match=expected):
        read_engine_set(tmp_path)


GREEDY_CONTRACT = {name: graph_spec(DIMS, name) for name in ("target_prefill", "verify_argmax_1", "verify_sample_1")}


def test_set_without_the_sampled_verifier_loads_and_without_another_graph_is_refused(tmp_path):
    """Guards against refusing a whole engine set because verify_sample_n did not build
    (TensorRT caps TopK at 3840: every real vocabulary), and against accepting a set that
    lacks a graph greedy sessions need: a greedy-only set passes both stages and loads
    the engines it has; one without verify_argmax_1 is refused naming it."""
    greedy = {name: io for name, io in GREEDY_CONTRACT.items() if name != "verify_sample_1"}
    write_set(tmp_path / "greedy", greedy)
    assert set(check_engine_set(tmp_path / "greedy", GREEDY_CONTRACT).engines) == set(greedy)
    flavour = FakeFlavour(engines={name: FakeEngine(bindings_of(io)) for name, io in greedy.items()})
    assert sorted(load_engine_set(tmp_path / "greedy", GREEDY_CONTRACT, flavour).engines) == sorted(greedy)
    write_set(tmp_path / "broken", {name: io for name, io in GREEDY_CONTRACT.items() if name != "verify_argmax_1"})
    with pytest.raises(EngineError, match=r"missing \['verify_argmax_1'\]"):
        check_engine_set(tmp_path / "broken", GREEDY_CONTRACT)


def test_engine_recorded_with_tensors_read_by_nothing_is_refused(tmp_path):
    """Guards against loading plans from an older build that allowed tensors nothing
    reads (e.g. Attention's lengths dropped by TensorRT's parser): they compute
    something else than their graphs."""
    write_set(tmp_path)
    rewrite(tmp_path, lambda d: d["engines"]["verify_2"].update(unread_tensors=["add_6"]))
    with pytest.raises(EngineError, match=r"engine 'verify_2' was built leaving tensors read by nothing \(\['add_6'\]\).*rebuild"):
        check_engine_set(tmp_path, CONTRACT)


def test_directory_without_engines_json_is_refused(tmp_path):
    """Guards against pointing the runtime at the ONNX directory by mistake."""
    with pytest.raises(EngineError, match="no engines.json"):
        check_engine_set(tmp_path, CONTRACT)


class FakeFlavour(Flavour):
    """TensorRT's runtime API, minus TensorRT: validity and engines are scripted."""

    name = "tensorrt_rtx"

    def __init__(self, version="1.7.1.116", validity="VALID", diagnostics=0, engines=None):
        super().__init__(SimpleNamespace(__version__=version, EngineInvalidityDiagnostics=Diagnostics))
        self.validity, self.diagnostics, self.engines = validity, diagnostics, engines or {}

    def new_log(self, echo=None):
        return SimpleNamespace(mark=lambda: 0, since=lambda *a: ["deserialize failed: scripted"])

    def new_runtime(self, log, version_compatible=False):
        flavour = self

        class Runtime:
            def get_engine_validity(self, data):
                return SimpleNamespace(name=flavour.validity), flavour.diagnostics

            def deserialize_cuda_engine(self, data):
                return flavour.engines.get(bytes(data).decode().removeprefix("plan of "))

        return Runtime()


class Diagnostics(enum.IntFlag):
    VERSION_MISMATCH = 1
    UNSUPPORTED_CC = 2


class FakeEngine:
    """An ICudaEngine's IO queries over a list of bindings."""

    def __init__(self, bindings):
        self.bindings = list(bindings)
        self.num_io_tensors = len(self.bindings)

    def _get(self, name):
        return next(b for b in self.bindings if b.name == name)

    def get_tensor_name(self, index):
        return self.bindings[index].name

    def get_tensor_mode(self, name):
        return SimpleNamespace(name=self._get(name).mode.upper())

    def get_tensor_shape(self, name):
        return self._get(name).shape

    def get_tensor_dtype(self, name):
        trt_names = {contract: trt for trt, contract in TRT_DTYPES.items()}
        return SimpleNamespace(name=trt_names[self._get(name).dtype])

    @property
    def num_optimization_profiles(self):
        return max((len(b.profiles) for b in self.bindings if b.profiles), default=0)

    def get_tensor_profile_shape(self, name, profile):
        return [list(s) for s in self._get(name).profiles[profile]]


def test_engine_bindings_reads_names_shapes_dtypes_and_profiles():
    """Guards against misreading a deserialized engine's IO (mode, dtype
    names, the profile of dynamic inputs only)."""
    expected = list(bindings_of(PREFILL))
    assert engine_bindings(FakeEngine(expected)) == expected


def test_load_checks_every_deserialized_engine_against_the_contract(tmp_path):
    """Guards against trusting engines.json alone: the deserialized engine's
    own bindings are compared too (here one engine's dtype differs)."""
    write_set(tmp_path)
    wrong = [replace(b, dtype="float16") if b.name == "taps" else b for b in bindings_of(VERIFY)]
    flavour = FakeFlavour(engines={"prefill": FakeEngine(bindings_of(PREFILL)), "verify_2": FakeEngine(wrong)})
    with pytest.raises(EngineError, match=r"(?s)engine 'verify_2': the deserialized plan .*output 'taps' dtype: contract bfloat16, engine float16"):
        load_engine_set(tmp_path, CONTRACT, flavour)
    flavour.engines["verify_2"] = FakeEngine(bindings_of(VERIFY))
    loaded = load_engine_set(tmp_path, CONTRACT, flavour)
    assert sorted(loaded.engines) == ["prefill", "verify_2"]


class AliasingEngine(FakeEngine):
    """An engine that reports which input each output aliases (TensorRT >= 10.15)."""

    def __init__(self, bindings, aliases):
        super().__init__(bindings)
        self.aliases = aliases

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name)


def test_engine_whose_caches_are_not_updated_in_place_is_refused(tmp_path):
    """Guards against binding past_* and present_* to one buffer for an engine that writes the
    new cache elsewhere (TensorRT reports no alias): its reads and writes of the cache would
    race, or the update would be lost. Every present_* must alias its own past_*."""
    write_set(tmp_path)
    in_place = {f"present_{kind}_0": f"past_{kind}_0" for kind in ("key", "value")}
    engines = {"prefill": AliasingEngine(bindings_of(PREFILL), in_place), "verify_2": AliasingEngine(bindings_of(VERIFY), {**in_place, "present_value_0": None})}
    with pytest.raises(EngineError, match=r"engine 'verify_2': .*not update its caches in place: output 'present_value_0' aliases None, expected input 'past_value_0'"):
        load_engine_set(tmp_path, CONTRACT, FakeFlavour(engines=engines))
    engines["verify_2"].aliases = in_place
    assert sorted(load_engine_set(tmp_path, CONTRACT, FakeFlavour(engines=engines)).engines) == ["prefill", "verify_2"]


def test_plan_for_another_gpu_is_refused_with_the_runtimes_reason(tmp_path):
    """Guards against a crash or an opaque None when the plan's compute
    capabilities do not include this GPU (TensorRT-RTX on an H200, SM90)."""
    write_set(tmp_path)
    flavour = FakeFlavour(validity="INVALID", diagnostics=Diagnostics.UNSUPPORTED_CC)
    with pytest.raises(EngineError, match=r"engine 'prefill': .*cannot run here: UNSUPPORTED_CC .*\['SM89'\]"):
        load_engine_set(tmp_path, CONTRACT, flavour)


def test_plan_that_does_not_deserialize_is_refused_not_crashed(tmp_path):
    """Guards against passing a None engine on when TensorRT's deserialization fails."""
    write_set(tmp_path)
    with pytest.raises(EngineError, match=r"could not deserialize 'prefill.plan'.*scripted"):
        load_engine_set(tmp_path, CONTRACT, FakeFlavour(engines={}))


def test_set_from_another_tensorrt_flavour_or_version_is_refused(tmp_path):
    """Guards against handing a plan to a TensorRT that did not build it
    (plans are tied to their version unless built version-compatible)."""
    record = write_set(tmp_path, flavour="tensorrt", version="10.14.1")
    with pytest.raises(EngineError, match=r"built with tensorrt 10.14.1; this loader uses tensorrt_rtx"):
        check_flavour(record, FakeFlavour())
    record = write_set(tmp_path, version="1.6.1.120")
    with pytest.raises(EngineError, match=r"built with tensorrt_rtx 1.6.1.120; installed is tensorrt_rtx 1.7.1.116"):
        load_engine_set(tmp_path, CONTRACT, FakeFlavour())
    compatible = replace(record, build_options={"version_compatible": True})
    check_flavour(compatible, FakeFlavour())


def test_graph_io_needs_a_range_for_every_dynamic_dim():
    """Guards against building or checking a dynamic engine without a valid
    profile range (TensorRT would fail late, without naming the dim)."""
    tokens = (TensorSpec("tokens", (1, "n"), "int64"),)
    with pytest.raises(EngineError, match=r"'g' uses dynamic dims \['n'\] without a min/opt/max range"):
        io_mismatches(GraphSpec("g", "x", None, tokens, ()), [])
    with pytest.raises(EngineError, match=r"dim 'n' range must satisfy .* got 4/2/8"):
        io_mismatches(GraphSpec("g", "x", None, tokens, (), {"n": DimRange(4, 2, 8)}), [])


def test_check_io_lists_every_mismatch_at_once():
    """Guards against fixing one binding per rebuild: all mismatches come in one error."""
    actual = [replace(b, dtype="float16") if b.name in ("start", "logits") else b for b in bindings_of(VERIFY)]
    assert len(io_mismatches(VERIFY, actual)) == 2
    with pytest.raises(EngineError, match=r"(?s)input 'start' dtype.*output 'logits' dtype"):
        check_io("verify_2", VERIFY, actual, "the built network")


def test_missing_tensorrt_is_a_clear_error_not_an_import_traceback(tmp_path, capsys, monkeypatch):
    """Guards against `dflash-trt build --backend tensorrt` on a machine
    without TensorRT dying in an ImportError instead of saying what to install
    (for an export it could build: the export is checked first)."""
    import importlib.util

    from dflash_trt import cli
    from dflash_trt.engines import command

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    monkeypatch.setattr(command, "export_sources", lambda directory: ([], directory / "manifest.json"))
    assert cli.main(["build", "--onnx", str(tmp_path), "--out", str(tmp_path / "e"), "--backend", "tensorrt"]) == 1
    err = capsys.readouterr().err
    assert "needs the Python module 'tensorrt'" in err and "pip install" in err
    with pytest.raises(EngineError, match="unknown TensorRT backend 'trt'"):
        load_flavour("trt")


TARGET_ATTENTION = (
    BoundAttention("layers.0/attn", "LOWER_RIGHT", "add_3", False),
    BoundAttention("layers.1/attn", "LOWER_RIGHT", "add_3", False),
)


def attention_set(directory: Path) -> EngineSetRecord:
    """write_set's set, its model engine with the target's attention records as a build writes them."""
    record = write_set(directory)
    prefill = replace(record.engines["prefill"], attention=TARGET_ATTENTION, attention_sha256=attention_digest(TARGET_ATTENTION))
    record = replace(record, engines={**record.engines, "prefill": prefill})
    write_engine_set(directory, record)
    return record


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda a: a[1].update(causal="UPPER_LEFT"), r"attention\[1\] \(node 'layers.1/attn'\)\.causal is 'UPPER_LEFT'; the build makes 'LOWER_RIGHT' or 'NONE' only"),
        (lambda a: a[0].update(lengths=""), r"attention\[0\] \(node 'layers.0/attn'\)\.lengths is empty and there is no mask"),
        (lambda a: a[0].update(causal="NONE"), r"engine 'prefill': field 'attention' hashes to [0-9a-f]{64}, field 'attention_sha256' says '[0-9a-f]{64}': .*edited after the build"),
    ],
)
def test_a_hand_edited_attention_record_is_refused_naming_the_field(tmp_path, edit, expected):
    """Guards against loading a set whose engines.json says something else about attention than
    its plans compute (a record hand-edited to upper-left or without lengths, or one attention
    turned non-causal): records the build never makes are refused naming the record's field,
    any other edit by the records' digest."""
    attention_set(tmp_path)
    rewrite(tmp_path, lambda d: edit(d["engines"]["prefill"]["attention"]))
    with pytest.raises(EngineError, match=expected):
        check_engine_set(tmp_path, CONTRACT)


class StreamReaderBase:
    """TensorRT's IStreamReaderV2 as the loader sees it (TensorRT's own needs a CUDA driver)."""

    def __init__(self):
        pass


class Seek(enum.Enum):
    SET = 0
    CUR = 1
    END = 2


class StreamingFlavour(FakeFlavour):
    """A runtime that deserializes from a stream reader as TensorRT does: the header, a seek
    back to the start, then the whole plan in chunks of ``chunk`` bytes."""

    def __init__(self, engines, chunk=5):
        super().__init__(engines=engines)
        self.trt.IStreamReaderV2, self.trt.SeekPosition = StreamReaderBase, Seek
        self.chunk, self.readers = chunk, []

    def new_runtime(self, log, version_compatible=False):
        flavour, header = self, 4

        class Runtime:
            engine_header_size = header

            def get_engine_validity(self, data):
                assert len(data) == header  # the header only: the plan is streamed, not read whole
                return SimpleNamespace(name="VALID"), 0

            def deserialize_cuda_engine(self, reader):
                flavour.readers.append(reader)
                reader.read(header, 0)
                assert reader.seek(0, Seek.SET)
                data = b""
                while chunk := reader.read(flavour.chunk, 0):
                    data += chunk
                return flavour.engines.get(data.decode().removeprefix("plan of "))

        return Runtime()


def test_each_plan_is_hashed_once_while_it_streams_into_the_runtime(tmp_path, monkeypatch):
    """Guards against loading reading every plan twice (a hashing pass, then the runtime's read:
    ~30 s for 21 GB) and holding it whole in host memory: the loader hashes the bytes it streams
    to the runtime (a re-read header included once), no separate hashing pass runs, every byte
    leaves the disk once, and a plan changed after the build is still refused."""
    from dflash_trt.engines import load

    write_set(tmp_path)
    monkeypatch.setattr(load, "file_sha256", lambda path: pytest.fail(f"a separate hashing pass over {path}"))
    engines = {"prefill": FakeEngine(bindings_of(PREFILL)), "verify_2": FakeEngine(bindings_of(VERIFY))}
    flavour = StreamingFlavour(engines)
    assert sorted(load_engine_set(tmp_path, CONTRACT, flavour).engines) == ["prefill", "verify_2"]
    sizes = [(tmp_path / name).stat().st_size for name in ("prefill.plan", "verify_2.plan")]
    assert [r.catch_up_bytes for r in flavour.readers] == [0, 0]  # the digest came from what the runtime read
    assert [r.bytes_read for r in flavour.readers] == [size + 4 for size in sizes]  # the plan once, plus the runtime's own header re-read
    (tmp_path / "verify_2.plan").write_bytes(b"plan of verify_X")  # same size, other bytes
    with pytest.raises(EngineError, match=r"engine 'verify_2': plan 'verify_2.plan' sha256 [0-9a-f]{64} differs from engines.json's"):
        load_engine_set(tmp_path, CONTRACT, StreamingFlavour(engines))


def test_a_runtime_that_seeks_around_still_gets_the_digest_of_the_whole_plan(tmp_path):
    """Guards against a digest of what the runtime happened to read (a skip or a jump back
    would hash a different byte string, or leave part of a swapped plan unchecked): whatever
    the order of reads, the digest is the file's, and only skipped bytes are read again."""
    import hashlib

    from dflash_trt.engines.plan_reader import plan_reader_class

    path = tmp_path / "p.plan"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    reader = plan_reader_class(SimpleNamespace(IStreamReaderV2=StreamReaderBase))(path)
    assert reader.read(100) == data[:100] and reader.seek(50, Seek.SET) and reader.read(100) == data[50:150]
    assert reader.seek(1000, Seek.CUR) and reader.read(60) == data[1150:1210]  # a skip: hashed later
    assert reader.seek(-10, Seek.END) and reader.read(100) == data[-10:] and not reader.seek(1, Seek.END)
    assert reader.sha256() == hashlib.sha256(data).hexdigest()
    assert reader.catch_up_bytes == len(data) - 150
    reader.close()


def test_shared_weights_missing_changed_or_misrecorded_are_refused(tmp_path):
    """Guards against model engines served with the wrong embedding or head: a set whose record
    lacks the shared weights, whose shared file changed after the build (hashed at check, and by
    the runtime as it reads it), or whose record says other shapes or names than the models read."""
    from dflash_trt.engines.shared_weights import read_shared_weights

    record = write_set(tmp_path)
    assert [t.name for t in record.shared_weights.tensors] == ["shared_embedding", "shared_head"]
    tensors = read_shared_weights(tmp_path, record.shared_weights)
    assert all(torch.equal(tensors[name], t) for name, t in shared_tensors().items())
    path = tmp_path / record.shared_weights.file
    original = path.read_bytes()
    path.write_bytes(original[:-2] + b"\0\0")
    with pytest.raises(EngineError, match=r"shared weights 'shared_weights.safetensors' sha256 \w+ differs from engines.json's"):
        check_engine_set(tmp_path, CONTRACT)
    with pytest.raises(EngineError, match=r"shared_weights.safetensors has sha256 \w+, engines.json records sha256"):
        read_shared_weights(tmp_path, record.shared_weights)
    path.write_bytes(original)
    edits = {
        "null": (lambda d: d.update(shared_weights=None), r"field 'shared_weights' is null, yet the set has model engines \['prefill'\]"),
        "order": (lambda d: d["shared_weights"]["tensors"].reverse(), r"tensors must be \['shared_embedding', 'shared_head'\], got \['shared_head', 'shared_embedding'\]"),
        "vocab": (
            lambda d: d["shared_weights"]["tensors"][0].update(shape=[99, HIDDEN]),
            r"shared_embedding is \[99, 16\] bfloat16, target_model reads \[100, 16\] bfloat16",
        ),
        "dtype": (lambda d: d["shared_weights"]["tensors"][1].update(dtype="float16"), r"shared_head is \[16, 100\] float16, target_model reads \[16, 100\] bfloat16"),
    }
    for edit, expected in edits.values():
        write_set(tmp_path)
        rewrite(tmp_path, edit)
        with pytest.raises(EngineError, match=expected):
            check_engine_set(tmp_path, CONTRACT)
