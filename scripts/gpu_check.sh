#!/usr/bin/env bash
# GPU check on an NVIDIA GPU: the gpu-marked tests, then one DFlash cycle timed
# with and without CUDA graphs (torch backend). Installs this checkout in
# editable mode first, without dependencies or build isolation (the GPU
# machine's own torch, onnx, onnxruntime and cuda-python are used as they are).
#
#   bash scripts/gpu_check.sh            # log + timing.json under $OUT (default ./gpu_out)
#
# Exit status: pytest's (the timing still runs and is logged when tests fail).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
PY=${PYTHON:-python3}

export PYTHONUNBUFFERED=1
# dflash_trt.* maps onto the top-level folders (pyproject package-dir): an editable install resolves them.
$PY -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" 2>&1 | tee "$LOG"

{
  echo "== environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "onnx", "onnxruntime", "onnxscript", "transformers", "cuda.bindings", "polars", "tensorrt"):
    try:
        module = importlib.import_module(name)
        print(f"{name:14s}", getattr(module, "__version__", "?"))
    except Exception as error:
        print(f"{name:14s} MISSING ({type(error).__name__})")
import onnxruntime
print("ort providers ", onnxruntime.get_available_providers())
from dflash_trt.runtime import device
print("cuda-python sees", device.device_count() if device.cuda_available() else 0, "device(s)")
EOF
} 2>&1 | tee -a "$LOG"

echo "== pytest -m gpu" | tee -a "$LOG"
# Some test modules import polars (absent on some GPU images): keep collecting past them.
$PY -m pytest -q -m gpu --continue-on-collection-errors -p no:cacheprovider -rs tests/ 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}

echo "== cycle timing (torch backend, CUDA graphs off/on)" | tee -a "$LOG"
$PY - "$OUT" "$ROOT/tests" <<'EOF' 2>&1 | tee -a "$LOG"
"""One cycle = draft_n -> target_verify_n -> verify_argmax_n -> verdict to host (as the executor runs it).

Random Qwen3-0.6B-shaped target (28 layers, hidden 1024, vocab 32000) and a
2-layer block-16 draft, bf16, max_context 2048, context ~1000.
"""
import json, sys, tempfile, time
from pathlib import Path

import torch

out_dir, tests = Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, tests)
import tiny_models
from dflash_trt.export import contract as c
from dflash_trt.export.pair import load_pair
from dflash_trt.runtime import device
from dflash_trt.runtime.backends import TorchBackend

root = Path(tempfile.mkdtemp())
shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=4096)
target_dir = tiny_models.write_target(root / "target", std=0.02, **shape)
draft_dir = tiny_models.write_draft(root / "draft", target_dir, block_size=16, layer_ids=(1, 9, 17, 25), layers=2,
                                    intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
target, draft = load_pair(target_dir, draft_dir, dtype=torch.bfloat16)
OWNERS, ROWS = 4, 4
dims = c.Dims(vocab_size=32000, tap_width=target.tap_width, block_size=16, proposals=15, max_owners=OWNERS,
              max_context=2048, max_chunk=512, target_layers=28, target_kv_heads=8, target_head_dim=128,
              draft_layers=2, draft_kv_heads=8, draft_head_dim=128, dtype="bfloat16")


def feeds(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    return dict(
        ctx_taps=torch.randn(n, 16, dims.tap_width, device="cuda", dtype=torch.bfloat16, generator=g),
        ctx_start=torch.full((n,), 1000, device="cuda"), ctx_count=torch.full((n,), 4, device="cuda"),
        anchor=torch.randint(0, 32000, (n,), device="cuda", generator=g), start=torch.full((n,), 1004, device="cuda"),
    )


def cycle(backend, n, f):
    d = backend.run(c.graph_name(c.DRAFT, n), {k: f[k] for k in (c.CTX_TAPS, c.CTX_START, c.CTX_COUNT, c.ANCHOR)}, 0)
    candidates = torch.cat([f[c.ANCHOR][:, None], d[c.PROPOSALS]], dim=1)
    v = backend.run(c.graph_name(c.TARGET_VERIFY, n), {c.TOKENS: candidates, c.START: f[c.START]}, 0)
    verdict = backend.run(c.graph_name(c.VERIFY_ARGMAX, n), {c.LOGITS: v[c.LOGITS], c.CANDIDATES: candidates}, 0)
    return verdict[c.ACCEPTED].cpu()  # host sync: the executor reads the verdict every cycle


results = []
for graphs in (False, True):
    backend = TorchBackend(target, draft, dims, ROWS, device="cuda", cuda_graphs=graphs)
    for n in (1, OWNERS):
        f = feeds(n)
        for _ in range(3):
            cycle(backend, n, f)  # warm-up (and captures)
        start, end = device.Event(), device.Event()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record(backend.stream)
        for _ in range(20):
            cycle(backend, n, f)
        end.record(backend.stream)
        end.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000 / 20
        row = dict(cuda_graphs=graphs, owners=n, wall_ms_per_cycle=round(wall_ms, 3),
                   device_ms_per_cycle=round(start.elapsed_ms(end) / 20, 3))
        print(row)
        results.append(row)
        start.close(); end.close()
    backend.close()
(out_dir / "timing.json").write_text(json.dumps(results, indent=2) + "\n")
EOF

echo "== pytest exit status: $status" | tee -a "$LOG"
exit "$status"
