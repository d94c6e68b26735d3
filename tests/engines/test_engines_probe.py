"""The semantics probe on the CPU: its numpy reference against ONNX Runtime, its power to tell
the semantics from their misreadings, and the verdict flow through stand-in TensorRT engines.

The probe's plan runs only on a GPU TensorRT supports (tests/test_engines_gpu.py runs it
there); here the same probe graph runs in ONNX Runtime, and the load / build paths run a
stand-in engine that computes the reference (or a misreading) from the bound host buffers.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_trt.engines.attention import BoundAttention, attention_digest, attention_tag
from dflash_trt.engines.bindings import TRT_DTYPES
from dflash_trt.engines.build import _probe_at_build
from dflash_trt.engines.engine_set import ENGINES_JSON, EngineRecord, ProbeRecord, read_engine_set, write_engine_set
from dflash_trt.engines.load import check_engine_set, load_engine_set
from dflash_trt.engines.probe import (
    SAMPLER_ROWS,
    TIE,
    Heads,
    ProbeSpec,
    export_probe,
    probe_cases,
    probe_io,
)
from dflash_trt.engines import probe as p
from dflash_trt.engines.probe_reference import NUMPY, attend, check_outputs, reference, visibility
from dflash_trt.engines.selfcheck import run_reference
from dflash_trt.engines.sources import GraphSource
from dflash_trt.engines.verdict import Site
from dflash_trt.errors import EngineBuildError, EngineError
from dflash_trt.export import sampling
from dflash_trt.export.identity import file_sha256
from dflash_trt.export.torch_dtypes import TORCH_DTYPES
from test_engines_load import CONTRACT, FakeFlavour, FakeEngine, bindings_of, write_set

TINY = ProbeSpec("bfloat16", "lengths", Heads(4, 2, 16), Heads(4, 1, 16), 64, 8, 8, 16)
# The Qwen3-8B pair's geometry: 32 query heads over 8 key/value heads of 128, a 4096-slot cache, blocks of 16.
QWEN3_8B = ProbeSpec("bfloat16", "lengths", Heads(32, 8, 128), Heads(32, 8, 128), 4096, 16, 16, 32)
FAKE_GPU = Site("Fake GPU (sm_89)", torch.device("cpu"))


@pytest.mark.parametrize(("dtype", "causal"), [("float32", "lengths"), ("float16", "lengths"), ("float16", "mask")])
def test_probe_reference_is_what_onnxruntime_computes_from_the_probe_graph(tmp_path, dtype, causal):
    """Guards against a probe whose numpy reference is not the ONNX semantics of its own graph
    (a wrong reference would refuse correct TensorRT engines, or pass wrong ones): the exported
    probe graph, run by ONNX Runtime's CPU provider on every case, matches the reference within
    the dtype's rounding, KV writes and sampler tokens exactly."""
    spec = replace(TINY, dtype=dtype, causal=causal)
    source = GraphSource(p.PROBE_NAME, export_probe(spec, tmp_path), probe_io(spec))
    for case in probe_cases(spec):
        got = run_reference(source, case.feeds)
        assert check_outputs(case, dtype, got, reference(case.feeds, spec.max_context)) == [], case.name


def misread(case: p.ProbeCase, want: dict, spec: ProbeSpec, reading: str) -> tuple[str, np.ndarray]:
    """(output, what it would be) under one misreading of the attention semantics."""
    prefix = "d_" if reading.startswith("draft") else "t_"
    layer = 1 if prefix == "d_" else 0
    q = case.feeds[prefix + "q"].double().numpy()
    keys, values = want[f"present_key_{layer}"], want[f"present_value_{layer}"]
    n, _, tokens, _ = q.shape
    length = spec.max_context
    starts = case.feeds[prefix + "start"].numpy()
    lengths = np.minimum(starts + tokens, length)
    j, i = np.arange(length)[None, None, :], np.arange(tokens)[None, :, None]
    visible = {
        # NvInfer.h's j <= i + (s_kv - s_q) with s_kv the padded length, the owners' lengths kept
        "padded diagonal": (j < lengths[:, None, None]) & (j <= i + length - tokens),
        "upper-left": (j < lengths[:, None, None]) & (j <= i),  # what the parser makes of is_causal
        "lengths dropped": np.broadcast_to(j <= i + length - tokens, (n, tokens, length)),
        "draft lengths dropped": np.ones((n, tokens, length), dtype=bool),
        "draft causal": visibility(lengths, tokens, length, causal=True),
    }[reading]
    return prefix + "out", attend(q, keys, values, visible)


def rounded(outputs: dict, spec: ProbeSpec) -> dict[str, torch.Tensor]:
    """The reference as an engine of the spec's dtype returns it (floats rounded to the dtype)."""
    dtype = TORCH_DTYPES[spec.dtype]
    return {k: torch.from_numpy(v).to(dtype) if v.dtype.kind == "f" else torch.from_numpy(v) for k, v in outputs.items()}


READINGS = ("padded diagonal", "upper-left", "lengths dropped", "draft lengths dropped", "draft causal")


@pytest.mark.parametrize("spec", [TINY, pytest.param(QWEN3_8B, marks=pytest.mark.slow)], ids=["tiny", "qwen3-8b"])
def test_every_misreading_of_attention_moves_an_output_far_beyond_rounding(spec):
    """Guards against a probe too weak to see the bug it exists for: with TensorRT's lower-right
    diagonal anchored at the padded cache length (tokens see later tokens of their own block),
    with is_causal read upper-left, or with the key/value lengths dropped (stale slots seen),
    some owner's output must move by O(1), so the verdict fails; the reference itself, rounded to
    bf16 as an engine returns it, passes. At the tiny and the Qwen3-8B geometry (4096 slots)."""
    for case in probe_cases(spec):
        want = reference(case.feeds, spec.max_context)
        assert check_outputs(case, spec.dtype, rounded(want, spec), want) == [], case.name
        for reading in READINGS:
            name, wrong = misread(case, want, spec, reading)
            worst = max(np.abs(wrong[o] - want[name][o]).max() for o in range(len(wrong)))
            assert worst > 0.5, (case.name, reading, worst)  # bf16 rounding allows 0.05
            problems = check_outputs(case, spec.dtype, rounded({**want, name: wrong}, spec), want)
            assert [x.output for x in problems] == [name] and problems[0].attention, (case.name, reading)


def test_the_cases_are_adversarial_starts_per_owner_and_blocks_at_the_caches_end():
    """Guards against a probe whose owners all start alike (the per-row vs padded reading of
    LOWER_RIGHT would agree) or never reach the cache's end (off-by-one at L unseen)."""
    for spec in (TINY, QWEN3_8B):
        verify, prefill = probe_cases(spec)
        length = spec.max_context
        assert verify.target_starts[0] == 0 and verify.target_starts[-1] == length - spec.verify_tokens
        assert len(set(verify.target_starts)) == 3 and 0 < prefill.target_starts[0] < length - spec.prefill_tokens
        assert verify.draft_starts[-1] == length - spec.block_size and len(set(verify.draft_starts)) == 3


def test_sampler_rows_are_decided_by_the_hash_far_from_float_rounding():
    """Guards against a probe whose sampler rows could flip on a GPU's last-bit log (a correct
    engine refused) or that an int64 hash computed in int32 would not change: the numpy ops
    choose what torch chooses, the tied greedy row takes the first maximum, and every sampled
    row's best score leads the runner-up by far more than float32 rounding."""
    feeds = probe_cases(TINY)[0].feeds
    args = [feeds[name] for name in (p.LOGITS, p.TEMPERATURE, p.TOP_K, p.TOP_P, p.SEEDS, p.POSITION)]
    with np.errstate(divide="ignore", invalid="ignore"):
        ours = sampling.choose(*(a.numpy() for a in args), ops=NUMPY)
        noise = sampling.noise(args[4].numpy(), args[5].numpy()[:, None], p.SAMPLER_VOCAB, NUMPY)
    assert ours.tolist() == sampling.choose(*args).tolist()
    assert ours[0] == TIE[0]
    spread = noise[:, None] != noise[:, :, None]
    assert spread.sum() > 0.99 * spread.size  # distinct noise per token: the hash decides
    for row, (settings, logits, g) in enumerate(zip(SAMPLER_ROWS, args[0].numpy(), noise)):
        if settings.temperature == 0:
            continue
        z = logits / settings.temperature
        kept = z >= np.sort(z)[-settings.top_k] if settings.top_k else np.ones_like(z, dtype=bool)
        scores = np.sort(np.where(kept, z + g, -np.inf))
        assert scores[-1] - scores[-2] > 1e-3, row


# --------------------------------------------------------------------------- the verdict through stand-ins


class ProbeEngine:
    """An ICudaEngine with the probe's IO whose contexts compute the reference from the bound host
    buffers, or with ``reading`` a misreading of the target's attention."""

    def __init__(self, spec: ProbeSpec, reading: str = "", generic_only: bool = False):
        self.spec, self.reading, self.runs = spec, reading, 0
        self.generic_only = generic_only  # the misreading only in contexts whose kernels are not specialized
        self.io = probe_io(spec)
        self.specs = {s.name: s for s in self.io.inputs + self.io.outputs}
        self.names = [s.name for s in self.io.inputs + self.io.outputs]
        self.num_io_tensors = len(self.names)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_dtype(self, name):
        return SimpleNamespace(name={v: k for k, v in TRT_DTYPES.items()}[self.specs[name].dtype])

    def get_aliased_input_tensor(self, name):
        return "past_" + name.removeprefix("present_") if name.startswith("present_") else None

    def create_runtime_config(self):
        return SimpleNamespace()

    def create_execution_context(self, config):
        return ProbeContext(self, getattr(config, "specialize", False))


class ProbeContext:
    def __init__(self, engine: ProbeEngine, specialized: bool = False):
        self.engine, self.shapes, self.addresses = engine, {}, {}
        self.misreads = bool(engine.reading) and not (engine.generic_only and specialized)

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def _sizes(self):
        return {p.OWNERS_DIM: self.shapes[p.T_Q][0], p.STEP_DIM: self.shapes[p.T_Q][2]}

    def get_tensor_shape(self, name):
        return self.engine.specs[name].resolve(self._sizes())

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def _tensor(self, name) -> torch.Tensor:
        spec = self.engine.specs[name]
        shape, dtype = spec.resolve(self._sizes()), TORCH_DTYPES[spec.dtype]
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer((ctypes.c_byte * nbytes).from_address(self.addresses[name]), dtype=dtype).view(shape)

    def execute_async_v3(self, stream):
        self.engine.runs += 1
        feeds = {s.name: self._tensor(s.name).clone() for s in self.engine.io.inputs}
        want = reference(feeds, self.engine.spec.max_context)
        if self.misreads:
            case = p.ProbeCase("run", feeds, (), ())
            name, wrong = misread(case, want, self.engine.spec, self.engine.reading)
            want[name] = wrong
        for name, value in want.items():
            self._tensor(name).copy_(torch.from_numpy(value))
        return True


def probe_set(directory: Path, spec: ProbeSpec = TINY) -> None:
    """A hand-written set (test_engines_load's) whose target engine has a lower-right attention, with a probe."""
    record = write_set(directory)
    plan = directory / "probe.plan"
    plan.write_bytes(b"plan of probe")
    bindings = bindings_of(probe_io(spec))
    engine = EngineRecord("probe", plan.name, file_sha256(plan), plan.stat().st_size, {"probe.onnx": "0" * 64}, bindings, 0.1, ("probe",))
    attention = (BoundAttention("layers.0/attn", "LOWER_RIGHT", "add_3", False),)
    engines = {**record.engines, "prefill": replace(record.engines["prefill"], attention=attention, attention_sha256=attention_digest(attention))}
    write_engine_set(directory, replace(record, engines=engines, probe=ProbeRecord(engine, spec.to_json())))


def flavour_with(probe: ProbeEngine) -> FakeFlavour:
    return FakeFlavour(engines={"prefill": FakeEngine(bindings_of(CONTRACT["prefill"])), "verify_2": FakeEngine(bindings_of(CONTRACT["verify_2"])), "probe": probe})


def test_a_probe_that_passes_records_its_verdict_and_runs_once_per_gpu(tmp_path):
    """Guards against serving a set whose semantics nothing checked on this GPU, and against
    running the probe at every load: the first load runs it, records the verdict with the GPU
    and the TensorRT version in engines.json, and the next load on that GPU reuses it."""
    probe_set(tmp_path)
    probe = ProbeEngine(TINY)
    loaded = load_engine_set(tmp_path, CONTRACT, flavour_with(probe), site=FAKE_GPU)
    assert probe.runs == 4  # the verify and prefill cases, with specialized and first-run kernels
    verdict = read_engine_set(tmp_path).probe.verdicts[0]
    assert (verdict.gpu, verdict.flavour, verdict.trt_version, verdict.passed, verdict.at) == ("Fake GPU (sm_89)", "tensorrt_rtx", "1.7.1.116", True, "load")
    assert loaded.record.probe.verdicts == (verdict,)
    load_engine_set(tmp_path, CONTRACT, flavour_with(probe), site=FAKE_GPU)
    assert probe.runs == 4
    other = Site("Another GPU (sm_120)", torch.device("cpu"))
    load_engine_set(tmp_path, CONTRACT, flavour_with(probe), site=other)
    assert probe.runs == 8 and [v.gpu for v in read_engine_set(tmp_path).probe.verdicts] == [FAKE_GPU.gpu, other.gpu]


def test_a_probe_that_computes_the_padded_diagonal_refuses_the_set_with_the_remedy(tmp_path):
    """Guards against serving a set whose TensorRT anchors LOWER_RIGHT at the padded cache length
    (prefill and verify tokens would see later tokens of their own block): the load is refused
    naming the part, the owners and the remedy (--causal mask); the failed verdict is recorded
    and the next load refuses without running the probe again."""
    probe_set(tmp_path)
    probe = ProbeEngine(TINY, reading="padded diagonal")
    with pytest.raises(EngineError) as caught:
        load_engine_set(tmp_path, CONTRACT, flavour_with(probe), site=FAKE_GPU)
    text = str(caught.value)
    assert "semantics probe failed on Fake GPU (sm_89) with tensorrt_rtx 1.7.1.116" in text
    assert "target attention (causal, per-owner key/value lengths)" in text and "owner 1 (start" in text
    assert "--causal mask" in text and "draft attention" not in text
    verdict = read_engine_set(tmp_path).probe.verdicts[0]
    assert not verdict.passed and "--causal mask" in verdict.detail
    runs = probe.runs
    with pytest.raises(EngineError, match="semantics probe failed"):
        load_engine_set(tmp_path, CONTRACT, flavour_with(ProbeEngine(TINY)), site=FAKE_GPU)
    assert probe.runs == runs


def test_a_mask_set_whose_probe_fails_is_sent_to_another_backend(tmp_path):
    """Guards against advising --causal mask to a set that already uses it."""
    spec = replace(TINY, causal="mask")
    probe_set(tmp_path, spec)
    with pytest.raises(EngineError, match=r"(?s)draft attention.*--backend onnxruntime or torch") as caught:
        load_engine_set(tmp_path, CONTRACT, flavour_with(ProbeEngine(spec, reading="draft lengths dropped")), site=FAKE_GPU)
    assert "--causal mask" not in str(caught.value)


def test_a_set_with_attention_and_no_probe_is_refused(tmp_path):
    """Guards against serving a set built before the probe existed (or with its probe deleted
    from engines.json): nothing proves its attention on any GPU."""
    probe_set(tmp_path)
    path = tmp_path / ENGINES_JSON
    data = json.loads(path.read_text())
    data["probe"] = None
    path.write_text(json.dumps(data))
    with pytest.raises(EngineError, match=r"field 'probe' is null, yet the set's attention relies"):
        check_engine_set(tmp_path, CONTRACT)


def test_the_probe_runs_at_build_where_the_builder_has_a_gpu(tmp_path):
    """Guards against a full-TensorRT build on a GPU that writes a set its probe would refuse:
    a failing probe raises EngineBuildError (no engines.json is written), a passing one is
    recorded as the build's verdict."""
    probe_set(tmp_path)
    record = read_engine_set(tmp_path)
    with pytest.raises(EngineBuildError, match="semantics probe failed .*at build.*--causal mask"):
        _probe_at_build(record, tmp_path, flavour_with(ProbeEngine(TINY, "upper-left")), lambda _line: None, FAKE_GPU)
    lines = []
    built = _probe_at_build(record, tmp_path, flavour_with(ProbeEngine(TINY)), lines.append, FAKE_GPU)
    assert [(v.passed, v.at) for v in built.probe.verdicts] == [(True, "build")] and "passed on Fake GPU" in lines[0]
    assert _probe_at_build(record, tmp_path, flavour_with(ProbeEngine(TINY)), lines.append, None) is record  # no GPU


class NamedEngine(FakeEngine):
    """An engine that reports its network's name (ICudaEngine.name), as the build set it."""

    def __init__(self, bindings, name):
        super().__init__(bindings)
        self.name = name


def test_attention_records_edited_with_their_digest_are_refused_by_the_plan(tmp_path):
    """Guards against a hand edit of engines.json that rewrites an attention record and its
    attention_sha256 together: the plan carries the digest of the attention it was built with
    (its network name), so the deserialized engine refuses records that are not its own; its
    own records load."""
    probe_set(tmp_path)
    record = read_engine_set(tmp_path)
    built = record.engines["prefill"].attention
    engines = {"prefill": NamedEngine(bindings_of(CONTRACT["prefill"]), attention_tag(built)), "verify_2": FakeEngine(bindings_of(CONTRACT["verify_2"]))}
    flavour = FakeFlavour(engines={**engines, "probe": ProbeEngine(TINY)})
    assert sorted(load_engine_set(tmp_path, CONTRACT, flavour, site=FAKE_GPU).engines) == ["prefill", "verify_2"]
    edited = (replace(built[0], lengths="add_4"),)  # another tensor as its lengths: a valid record, not this plan's
    prefill = replace(record.engines["prefill"], attention=edited, attention_sha256=attention_digest(edited))
    write_engine_set(tmp_path, replace(record, engines={**record.engines, "prefill": prefill}))
    check_engine_set(tmp_path, CONTRACT)  # consistent with itself
    with pytest.raises(EngineError, match=r"engine 'prefill': field 'attention' of engines.json is not what the plan was built with"):
        load_engine_set(tmp_path, CONTRACT, flavour, site=FAKE_GPU)


class SpecializingFlavour(FakeFlavour):
    """Hands each context its kernel kind, as TensorRT-RTX's runtime config does."""

    def execution_context(self, engine, cache_dir=None, name="engine", user_memory=False, specialize=False):
        return engine.create_execution_context(SimpleNamespace(specialize=specialize)), None


def test_the_probe_runs_the_first_run_kernels_too(tmp_path):
    """Guards against proving only the specialized kernels while the chunked run graphs (prefill,
    draft context) first run TensorRT-RTX's generic fallback kernels: the probe runs each case
    with both, and a misreading in the generic ones alone refuses the set, naming them."""
    probe_set(tmp_path)
    engines = {"prefill": FakeEngine(bindings_of(CONTRACT["prefill"])), "verify_2": FakeEngine(bindings_of(CONTRACT["verify_2"]))}
    probe = ProbeEngine(TINY, reading="padded diagonal", generic_only=True)
    with pytest.raises(EngineError) as caught:
        load_engine_set(tmp_path, CONTRACT, SpecializingFlavour(engines={**engines, "probe": probe}), site=FAKE_GPU)
    assert "verify (first-run kernels): target attention" in str(caught.value)
    assert "specialized kernels): target" not in str(caught.value)
