"""The probe's verdict on one GPU: run the probe plan there, compare with the reference, say what to do.

``run_probe`` runs every ``probe_cases`` case through the deserialized
probe engine on ``Site.device``, in a context with specialized kernels and in
one as a first enqueue finds them (``KERNELS``), and compares each output with
``probe_reference.reference``; the ``Verdict`` (engines.json's
``probe.verdicts``) names the GPU, the TensorRT that ran it, and either
what was checked or every difference with the remedy. A probe that cannot
run at all (no context, a failed enqueue) raises ``EngineError`` instead:
nothing was learned about the semantics, so nothing is recorded.

``check_verdict`` refuses a set whose verdict failed, with the reason and
the remedy: attention at fault -> ``--causal mask`` (an explicit mask needs
neither TensorRT's lower-right alignment nor its key/value lengths); the
sampler or the KV write at fault, or a mask set -> another backend.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash_trt.engines.engine_set import PROBE_NAME, Verdict
from dflash_trt.engines.execute import execute
from dflash_trt.engines.flavour import Flavour
from dflash_trt.engines.probe import ProbeSpec, probe_cases, probe_io
from dflash_trt.engines.probe_reference import Problem, check_outputs, reference
from dflash_trt.errors import EngineError
from dflash_trt.export.contract import present_of
from dflash_trt.export.onnx_kernels import CAUSAL_LENGTHS

MASK_REMEDY = (
    "re-export with `dflash-trt export --causal mask` and rebuild (attention then reads an explicit mask, "
    "not TensorRT's lower-right alignment and key/value lengths), or serve with --backend onnxruntime or torch"
)
OTHER_REMEDY = "serve this export with --backend onnxruntime or torch (and report the TensorRT version and GPU)"


@dataclass(frozen=True)
class Site:
    """Where the probe runs: the GPU's name (a verdict's key) and its torch device."""

    gpu: str
    device: torch.device

    @classmethod
    def current(cls) -> Site | None:
        """The current CUDA device, or None without one."""
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return cls(f"{props.name} (sm_{props.major}{props.minor})", torch.device("cuda", index))


# The kernels a context runs: specialized from its first enqueue (what captured run graphs replay),
# or as a chunked run graph's first enqueue finds them (TensorRT-RTX: a generic fallback kernel while
# the specialized one compiles). Full TensorRT has one kind; it runs the cases twice alike.
KERNELS = ((True, "specialized kernels"), (False, "first-run kernels"))


def run_probe(flavour: Flavour, engine, spec: ProbeSpec, site: Site, at: str) -> Verdict:
    """Every case on ``site``, with either kind of kernels; a passing or failing verdict
    (``EngineError`` if it cannot run)."""
    cases = probe_cases(spec)
    aliases = {present_of(s.name): s.name for s in probe_io(spec).cache_inputs}
    problems: list[Problem] = []
    for case in cases:
        want = reference(case.feeds, spec.max_context)
        for specialize, kernels in KERNELS:
            got = execute(flavour, engine, case.feeds, aliases, site.device, name=PROBE_NAME, specialize=specialize)
            problems += check_outputs(replace(case, name=f"{case.name} ({kernels})"), spec.dtype, got, want)
    if not problems:
        detail = (
            f"{len(cases)} cases ({', '.join(c.name for c in cases)}), specialized and first-run kernels: "
            f"KV writes and sampler tokens exact, attention within {spec.dtype} rounding"
        )
        return Verdict(site.gpu, flavour.name, flavour.version, True, detail, at)
    remedy = MASK_REMEDY if spec.causal == CAUSAL_LENGTHS and all(p.attention for p in problems) else OTHER_REMEDY
    detail = "; ".join(p.text for p in problems) + f". Remedy: {remedy}"
    return Verdict(site.gpu, flavour.name, flavour.version, False, detail, at)


def refusal(directory: Path, verdict: Verdict) -> str:
    """The message of a set refused by its probe."""
    return (
        f"engine set {directory}: the semantics probe failed on {verdict.gpu} with {verdict.flavour} {verdict.trt_version} "
        f"(at {verdict.at}): this TensorRT does not compute the exported graphs as ONNX defines them, so the set is not served: "
        f"{verdict.detail}"
    )


def check_verdict(directory: Path, verdict: Verdict) -> None:
    if not verdict.passed:
        raise EngineError(refusal(directory, verdict))
