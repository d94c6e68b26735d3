"""The first hour: defaults that compose (export -> run without --tokenizer, dtypes the backend runs,
checkpoints without an export) and the README's embedding snippet, run as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import prebuilt
from dflash_trt.cli import main
from dflash_trt.export.pair import DEFAULT_PAIR_DIR
from executor_fixtures import single_thread

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_thread()


@pytest.fixture(scope="module")
def default_export(default_pair_cache) -> Path:
    """The demo's fp32 ONNX export of the shipped pair (conftest ``default_pair_cache``)."""
    (export,) = (default_pair_cache / "export").iterdir()
    return export


def text_prompts(path: Path, count: int = 2) -> Path:
    rows = [json.loads(line) for line in (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines()[:count]]
    path.write_text("".join(json.dumps({"name": r["name"], "prompt": r["prompt"][-400:]}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("command", ["run", "bench", "serve"])
def test_a_bf16_export_is_refused_on_onnx_runtime_cpu_before_loading(command, build_cache, tmp_path, capsys, monkeypatch):
    """Guards against `dflash-trt export`'s bf16 meeting ONNX Runtime's CPU provider as an opaque
    NOT_IMPLEMENTED Mul(14) at the first run: run, bench and serve name the dtype, the device and the
    fix on one line (exit 2) before any session loads."""
    from dflash_trt.runtime.backends import ort_backend

    monkeypatch.setattr(ort_backend.OrtBackend, "__init__", lambda *a, **k: pytest.fail("loaded before refusing"))
    bf16 = prebuilt.default_export(build_cache, "lengths")  # the shipped pair in bf16 (the engine tests' export)
    argv = [command, "--artifacts", str(bf16)] + ([] if command == "serve" else ["--out", str(tmp_path / "o")])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"dflash-trt {command}: UsageError: --artifacts {bf16}: ONNX Runtime's CPU provider cannot run a bf16 export" in err[0]
    assert "--dtype fp32" in err[0] and not (tmp_path / "o").exists()


def test_export_picks_its_dtype_from_the_backend_it_is_for(tmp_path, monkeypatch):
    """Guards against `dflash-trt export` defaulting to a dtype the default `run` cannot execute (bf16 on
    ONNX Runtime's CPU): onnxruntime (the default) gets fp32, tensorrt bf16, --dtype wins."""
    from dflash_trt.export import command

    class Chosen(Exception):
        """The export would start here: the options are final."""

    seen = []

    def fake_export(target, draft, out, options, **_):
        seen.append(options.dtype)
        raise Chosen

    monkeypatch.setattr(command, "up_to_date", lambda *a: None)
    monkeypatch.setattr(command, "export_pair", fake_export)
    pair = ["export", "--target", str(DEFAULT_PAIR_DIR / "target"), "--draft", str(DEFAULT_PAIR_DIR / "draft"), "--out", str(tmp_path)]
    for extra in ([], ["--backend", "tensorrt"], ["--backend", "tensorrt", "--dtype", "fp16"]):
        with pytest.raises(Chosen):
            main([*pair, *extra])
    assert seen == ["fp32", "bf16", "fp16"]


def test_export_records_the_tokenizer_so_run_needs_no_tokenizer_flag(default_export, tmp_path, capsys):
    """Guards against an export without its tokenizer (text prompts then need --tokenizer): the manifest
    names the copied files with their hashes, and `run` on text prompts finds them in the export."""
    from dflash_trt.export.identity import file_sha256
    from dflash_trt.export.manifest import load_manifest
    from dflash_trt.export.tokenizer import Tokenizer

    manifest = load_manifest(default_export)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(manifest.tokenizer)
    for name, digest in manifest.tokenizer.items():
        assert file_sha256(default_export / name) == digest == file_sha256(DEFAULT_PAIR_DIR / "target" / name)
    ours, theirs = Tokenizer.from_dir(default_export), Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
    assert ours.stop_ids == theirs.stop_ids and ours.encode("def f(x):\n") == theirs.encode("def f(x):\n")
    out = tmp_path / "run"
    prompts = text_prompts(tmp_path / "p.jsonl")
    assert main(["run", "--artifacts", str(default_export), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8", "--threads", "1"]) == 0
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["text"] == theirs.decode(r["tokens"]) and r["tokens"] for r in rows)


@pytest.mark.parametrize("command", ["run", "bench"])
def test_torch_backend_runs_from_the_checkpoints_without_an_export(command, default_export, tmp_path, capsys):
    """Guards against `run` / `bench --backend torch` demanding an export (`serve` runs the checkpoints
    directly): from the shipped pair's checkpoints, on the CPU, the outputs are the ONNX Runtime export's."""
    prompts = text_prompts(tmp_path / "p.jsonl")
    common = ["--prompts", str(prompts), "--max-new-tokens", "8", "--threads", "1"]
    extra = ["--no-warmup"] if command == "bench" else []
    assert main([command, "--backend", "torch", "--out", str(tmp_path / "torch"), *common, *extra]) == 0
    assert main(["run", "--artifacts", str(default_export), "--out", str(tmp_path / "ort"), *common]) == 0
    torch_dir = tmp_path / "torch" / ("dflash" if command == "bench" else "")
    tokens = [[json.loads(line)["tokens"] for line in (d / "outputs.jsonl").read_text().splitlines()] for d in (torch_dir, tmp_path / "ort")]
    assert tokens[0] == tokens[1] and all(tokens[0])


def readme_snippet(title: str) -> str:
    """The first ```python block after the README heading ``title``."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(f"\n## {title}\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_embedding_snippet_runs_as_written(default_export, tmp_path):
    """Guards against the README's first code a newcomer copies failing: its `artifacts/` folder is what
    the README's export command makes (here the same export of the shipped pair), and the snippet runs
    unchanged in a fresh interpreter, printing completions and the stats table."""
    (tmp_path / "artifacts").symlink_to(default_export, target_is_directory=True)
    code = readme_snippet("Embedding the runtime")
    assert 'open_backend("onnxruntime", "artifacts/", torch_threads=1)' in code
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cycle_id" in done.stdout and len(done.stdout.splitlines()) > 5
