"""Engine-set size against the weights: one copy of each model in the plans.

Makes a random-weight pair of a real shape (default: Qwen3-8B — 36 layers,
hidden 4096, 32/8 heads x 128, MLP 12288, V 151,936, untied head — and a
5-layer block-16 DFlash draft tapping layers 1, 9, 17, 25, 33) as Hugging
Face checkpoints, exports it (bf16, max_owners 4, max_context 4096, chunks of
512, shared weights) and builds the engine set with TensorRT-RTX for one
compute capability, on the CPU (no GPU needed). Reports the weight bytes
(target + draft checkpoints), every plan's bytes, profiles and build
seconds, the shared weights' file (the target's embedding and head, which
both model engines read: ``engines.shared_weights``), and the ratio of all
of the set's bytes (plans + shared file) to the weight bytes.

Scratch bytes per profile are a property of a deserialized engine: they are
reported by ``TensorRTBackend.scratch.needs`` on a GPU TensorRT-RTX runs on,
and are "n/a" here when none is visible.

Stages keep their results in ``--work`` so that a long run can be split over
several processes (``--stages make export``, then ``--stages build report``).
``--graphs target_model draft_model`` exports (``export_graph``, shared
weights, no manifest) and builds those graphs only, for a quicker look at
the models' plans; the report then covers them alone. Random weights are
drawn on the GPU when there is one (the CPU takes minutes for 8B values).

    python benchmarks/engine_size.py --work /tmp/size [--stages make export build report]
        [--graphs NAME ...] [--target SM89] [--layers 36] [--pair export/default_pair] [--record]

``--pair DIR`` measures an existing pair (DIR/target, DIR/draft; e.g. the
shipped default pair, a quick look on a small machine) instead of random
weights of the Qwen3-8B shape.

Prints a table and ends with one JSON line; ``--record`` appends it to
benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

import record  # benchmarks/record.py: results.jsonl

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("make", "export", "build", "report")
TAP_LAYERS = (1, 9, 17, 25, 33)


def target_config(layers: int) -> dict:
    """Qwen3-8B's config.json fields (``layers`` may shrink it for a quick run)."""
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    )


def draft_config(target: dict) -> dict:
    """The z-lab DFlash layout: 5 layers of the target's width, block 16."""
    layers = target["num_hidden_layers"]
    taps = [t for t in TAP_LAYERS if t < layers] or [layers - 1]
    return dict(
        target,
        architectures=["DFlashDraftModel"],
        num_hidden_layers=5,
        block_size=16,
        num_target_layers=layers,
        dflash_config={"target_layer_ids": taps, "mask_token_id": 151669},
    )


def random_checkpoint(directory: Path, config: dict, build) -> int:
    """Write ``config`` and random bf16 weights of ``build(config dir)``'s model; returns the weight bytes."""
    from dflash_trt.export.checkpoint import save_checkpoint

    save_checkpoint(directory, config, {})
    with torch.device("meta"):
        model = build(directory)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    tensors = {}
    for name, parameter in model.state_dict().items():
        tensor = torch.empty(parameter.shape, dtype=torch.bfloat16, device=device)
        tensor = tensor.fill_(1.0) if "norm" in name else tensor.normal_(0.0, 0.02, generator=generator)
        tensors[name] = tensor.cpu()
    save_checkpoint(directory, config, tensors)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def make(work: Path, layers: int, pair: Path | None = None) -> dict:
    from dflash_trt.export.config import load_draft_config, load_target_config
    from dflash_trt.export.draft import DraftModel
    from dflash_trt.export.target import TargetModel

    if pair is not None:  # an existing pair (e.g. the shipped default one): its weights as they are
        from dflash_trt.export.checkpoint import read_tensors

        sizes = [sum(t.numel() * t.element_size() for t in read_tensors(pair / kind).values()) for kind in ("target", "draft")]
        return {"pair": str(pair), "target_weight_bytes": sizes[0], "draft_weight_bytes": sizes[1], "make_seconds": 0.0}
    target = target_config(layers)
    started = time.perf_counter()
    target_bytes = random_checkpoint(work / "target", target, lambda d: TargetModel(load_target_config(d)))
    draft_bytes = random_checkpoint(work / "draft", draft_config(target), lambda d: DraftModel(load_draft_config(d)))
    return {"target_weight_bytes": target_bytes, "draft_weight_bytes": draft_bytes, "make_seconds": time.perf_counter() - started}


OPTIONS = dict(max_owners=4, max_chunk=512, dtype="bf16", shared_weights=True)


def export(work: Path, graphs: list[str], pair: Path) -> dict:
    from dflash_trt.export.exporter import ExportOptions, export_pair

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    if graphs:
        export_some(work, graphs, seconds, pair)
    else:
        export_pair(pair / "target", pair / "draft", work / "graphs", ExportOptions(**OPTIONS), progress=True,
                    on_graph=lambda name, _graph, s: seconds.__setitem__(name, round(s, 1)))
    onnx_bytes = sum(f.stat().st_size for f in (work / "graphs").iterdir() if f.is_file())
    return {"export_seconds": time.perf_counter() - started, "export_graph_seconds": seconds, "onnx_bytes": onnx_bytes}


def export_some(work: Path, graphs: list[str], seconds: dict[str, float], pair: Path) -> None:
    """``graphs`` alone, as export_pair writes them (shared weights), without a manifest."""
    from dflash_trt.export import contract
    from dflash_trt.export.exporter import ExportOptions, contract_dims, export_graph, kernels_of
    from dflash_trt.export.graph_modules import graph_module
    from dflash_trt.export.onnx_kernels import OnnxKernels
    from dflash_trt.export.pair import load_pair
    from dflash_trt.export.weights import SharedWeights

    options = ExportOptions(**OPTIONS).resolve(pair / "target", pair / "draft")
    target, draft = load_pair(pair / "target", pair / "draft", torch.bfloat16)
    dims = contract_dims(target, draft, options)
    (work / "graphs").mkdir(exist_ok=True)
    with SharedWeights(work / "graphs") as weights, kernels_of([target, draft], OnnxKernels(emit=True)):
        for name in graphs:
            started, spec = time.perf_counter(), contract.graph_spec(dims, name)
            export_graph(graph_module(spec, target, draft, dims), spec, work / "graphs", weights)
            seconds[name] = round(time.perf_counter() - started, 1)
    (work / "graphs" / "dims.json").write_text(json.dumps(dims.to_json()))


def sources_of(work: Path, graphs: list[str]) -> tuple[list, Path | None]:
    from dflash_trt.engines.sources import GraphSource, export_sources
    from dflash_trt.export import contract

    if not graphs:
        return export_sources(work / "graphs")
    dims = contract.Dims(**json.loads((work / "graphs" / "dims.json").read_text()))
    return [GraphSource(name, work / "graphs" / f"{name}.onnx", contract.graph_spec(dims, name)) for name in graphs], None


def build(work: Path, target: str, graphs: list[str]) -> dict:
    from dflash_trt.engines.build import BuildOptions, build_engine_set
    from dflash_trt.engines.flavour import load_flavour

    shutil.rmtree(work / "target", ignore_errors=True)  # the checkpoints are not needed past the export: disk
    shutil.rmtree(work / "draft", ignore_errors=True)
    sources, manifest = sources_of(work, graphs)
    started = time.perf_counter()
    record = build_engine_set(sources, work / "engines", load_flavour("tensorrt_rtx"), BuildOptions(targets=(target,)),
                              progress=lambda line: print(line, flush=True), source_manifest=manifest)
    engines = {
        name: {"plan_bytes": e.plan_bytes, "build_seconds": round(e.build_seconds, 1), "profiles": list(e.profiles)}
        for name, e in [*record.engines.items(), *([("probe", record.probe.engine)] if record.probe else [])]
    }
    shared = record.shared_weights.bytes if record.shared_weights else 0  # the models' embedding and head, once
    return {"build_seconds": time.perf_counter() - started, "engines": engines, "shared_weights_bytes": shared,
            "flavour": f"{record.flavour} {record.trt_version}", "targets": list(record.targets)}


def scratch_per_profile(work: Path) -> dict | str:
    """Each run graph's scratch bytes, from the engines on a GPU TensorRT-RTX runs on; else why not."""
    if not torch.cuda.is_available():
        return "n/a: needs a CUDA GPU TensorRT-RTX runs on"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) == (9, 0):
        return "n/a: TensorRT-RTX does not run on Hopper (compute capability 9.0)"
    from dflash_trt.runtime.backends.trt_backend import TensorRTBackend

    with TensorRTBackend(work / "engines") as backend:
        return dict(backend.scratch.needs)


def report(results: dict, work: Path) -> dict:
    weights = results["target_weight_bytes"] + results["draft_weight_bytes"]
    shared = results.get("shared_weights_bytes", 0)
    plans = sum(e["plan_bytes"] for e in results["engines"].values()) + shared  # every byte the set loads
    print(f"{'engine':<18} {'profiles':>8} {'plan GB':>9} {'build s':>8}")
    for name, e in results["engines"].items():
        print(f"{name:<18} {len(e['profiles']):>8} {e['plan_bytes'] / 1e9:>9.3f} {e['build_seconds']:>8.1f}")
    print(f"{'shared weights':<18} {'':>8} {shared / 1e9:>9.3f} {'':>8}")
    print(f"weights {weights / 1e9:.3f} GB (target {results['target_weight_bytes'] / 1e9:.3f}, draft {results['draft_weight_bytes'] / 1e9:.3f})")
    print(f"set     {plans / 1e9:.3f} GB = {plans / weights:.3f} x the weights (plans and shared weights; goal <= 1.08)"
          + (f" -- of {', '.join(results['engines'])} only" if results.get("graphs") else ""))
    return {
        "benchmark": "engine_size",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "weight_bytes": weights,
        "plan_bytes": plans,  # the plans and the shared weights' file
        "plans_over_weights": round(plans / weights, 4),
        "scratch_bytes_per_profile": scratch_per_profile(work),
        **results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for checkpoints, graphs, engines and stage results")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--target", default="SM89", help="compute capability the plans are built for")
    parser.add_argument("--layers", type=int, default=36, help="target layers (36: Qwen3-8B)")
    parser.add_argument("--pair", type=Path, help="an existing pair (DIR/target, DIR/draft) instead of random weights, e.g. export/default_pair")
    parser.add_argument("--graphs", nargs="+", default=[], help="export and build only these graphs (default: the whole set)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    state = args.work / "results.json"
    results = json.loads(state.read_text()) if state.is_file() else {}
    for stage in STAGES:
        if stage not in args.stages:
            continue
        started = time.perf_counter()
        print(f"== {stage}", flush=True)
        if stage == "make":
            results |= make(args.work, args.layers, args.pair)
        elif stage == "export":
            results |= export(args.work, args.graphs, Path(results.get("pair") or args.work)) | {"graphs": args.graphs}
        elif stage == "build":
            results |= build(args.work, args.target, args.graphs)
        else:
            line = report(results, args.work)
            print(json.dumps(line))
            if args.record:
                record.append_rows([line])
        state.write_text(json.dumps(results, indent=2))
        print(f"== {stage} done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
