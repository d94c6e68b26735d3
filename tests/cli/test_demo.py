"""`dflash-trt run` and `dflash-trt demo` end to end over the exported tiny pair (ONNX Runtime, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from dflash_trt.cli import main
from dflash_trt import demo
from dflash_trt.runtime.stats import CYCLE_SCHEMA, EXECUTE_SCHEMA
from executor_fixtures import Oracle, pair, single_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_thread()


@pytest.fixture
def prompt_file(tmp_path, exported_pair) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"name": f"p{i}", "tokens": p} for i, p in enumerate(exported_pair.prompts)]
    rows.append({"tokens": [7, 8, 9], "max_new_tokens": 3})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def test_run_command_writes_reference_outputs_and_stats(exported_pair, prompt_file, tmp_path, capsys):
    """Guards against the serving command dropping prompts, per-line limits, stop tokens or stats
    files: outputs must be the reference's, both Parquet tables readable with their schemas."""
    out = tmp_path / "run"
    code = main(["run", "--artifacts", str(exported_pair.out), "--prompts", str(prompt_file), "--out", str(out), "--max-new-tokens", "20", "--max-sessions", "2", "--threads", "1"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["p0", "p1", "p2", "3"]
    target, _ = pair(exported_pair.target_dir, exported_pair.draft_dir)
    oracle = Oracle(target, exported_pair.manifest.max_context)
    stops = tuple(exported_pair.manifest.special_tokens.stop)
    for row, p, limit in zip(rows, [*exported_pair.prompts, [7, 8, 9]], [20, 20, 20, 3]):
        reference = oracle.continuation(p)[:limit]
        cut = next((i + 1 for i, t in enumerate(reference) if t in stops), len(reference))
        assert row["tokens"] == reference[:cut] and row["prompt_tokens"] == len(p)
    cycles, executes = pl.read_parquet(out / "stats.parquet"), pl.read_parquet(out / "stats.executes.parquet")
    assert cycles.schema == pl.Schema(CYCLE_SCHEMA) and executes.schema == pl.Schema(EXECUTE_SCHEMA)
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["prompts"] == 4 and figures["tokens"] == sum(len(r["tokens"]) for r in rows) and figures["tau"] > 1
    assert figures["mode"] == "dflash" and figures["device_s"] <= figures["seconds"]
    # The same run through `dflash-trt report`: the same tokens, span, rate, τ, cycles and calls.
    assert main(["report", str(out / "stats.parquet")]) == 0
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("tokens", "tokens_per_s", "tau", "cycles", "calls"):
        assert headline[key] == figures[key], key
    assert headline["wall_s"] == figures["seconds"] and headline["name"] == "dflash"


def test_bench_runs_both_modes_on_the_same_prompts_and_report_compares_them(exported_pair, prompt_file, tmp_path, capsys):
    """Guards against the AR baseline and DFlash being measured differently (other prompts, limits or
    stats) or the baseline drafting: both write outputs + stats, plain decoding logs only target rows
    and gives the same greedy tokens, and `report --baseline` renders the speedup from the two files."""
    out = tmp_path / "bench"
    args = ["bench", "--artifacts", str(exported_pair.out), "--prompts", str(prompt_file), "--out", str(out),
            "--max-new-tokens", "12", "--max-sessions", "2", "--threads", "1", "--no-warmup"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical_outputs"] == result["prompts"] == 4  # fp32 greedy: the same tokens
    plain, dflash = result["plain"], result["dflash"]
    assert (plain["mode"], dflash["mode"]) == ("plain", "dflash") and plain["tau"] is None and dflash["tau"] > 1
    assert result["speedup"] == pytest.approx(dflash["tokens_per_s"] / plain["tokens_per_s"], rel=1e-2)
    plain_rows, dflash_rows = (pl.read_parquet(out / mode / "stats.parquet") for mode in ("plain", "dflash"))
    assert set(plain_rows["mode"]) == {"target"} and set(dflash_rows["mode"]) > {"target"}
    assert plain["tokens"] == dflash["tokens"] == plain_rows["emitted"].sum() == dflash_rows["emitted"].sum()
    assert main(["report", str(out / "dflash" / "stats.parquet"), "--baseline", str(out / "plain" / "stats.parquet")]) == 0
    printed = capsys.readouterr().out
    headline = json.loads(printed.strip().splitlines()[-1])
    # One set of numbers: the report's figures of the same files are bench's.
    assert (headline["name"], headline["speedup"], headline["baseline_tokens_per_s"]) == ("dflash", result["speedup"], plain["tokens_per_s"])
    for key in ("tokens", "tokens_per_s", "tau", "cycles", "calls"):
        assert headline[key] == dflash[key], key
    assert "| plain " in printed and "draft_ms is 0" in printed  # runs named by mode; the loop's timing explained


def test_run_command_refuses_text_without_tokenizer(exported_pair, tmp_path, capsys):
    """Guards against a traceback (instead of a message naming the line and the fix) for text prompts
    when no tokenizer.json is found."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    assert main(["run", "--artifacts", str(exported_pair.out), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 1
    assert "p.jsonl:1: a text prompt needs a tokenizer" in capsys.readouterr().err


def test_demo_exports_to_the_cache_then_serves(exported_pair, prompt_file, tmp_path, monkeypatch, capsys):
    """Guards against the demo skipping its export step, exporting a dtype ONNX Runtime's CPU provider
    cannot run or without its CPU configuration (live keys, at most 7 proposals), or not writing stats and
    the report. (The export itself is stubbed with the session's
    tiny export: export_pair's own skip-when-unchanged logic is the exporter's and tested there.)"""
    from dflash_trt.export import exporter

    calls = []

    def fake_export(target, draft, out, options, **_):
        calls.append((Path(target), Path(draft), Path(out), options))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        if not Path(out).exists():
            Path(out).symlink_to(exported_pair.out, target_is_directory=True)
        return exported_pair.manifest

    monkeypatch.setattr(exporter, "export_pair", fake_export)
    cache = tmp_path / "cache"
    args = ["demo", "--target", str(exported_pair.target_dir), "--draft", str(exported_pair.draft_dir), "--prompts", str(prompt_file)]
    args += ["--cache", str(cache), "--count", "3", "--max-new-tokens", "12", "--threads", "1"]
    assert main(args) == 0
    (target, draft, out, options), = calls
    assert (target, draft) == (exported_pair.target_dir, exported_pair.draft_dir) and out.parent == cache / "export"
    assert options.dtype == "fp32" and options.max_owners == demo.DEMO_MAX_OWNERS
    assert options.live_keys and options.proposals == demo.DEMO_PROPOSALS  # ONNX Runtime's configuration (the tiny draft's block 8)
    printed = capsys.readouterr().out
    assert "τ (tokens per draft/verify cycle) =" in printed and "plain decoding" in printed and "speedup" in printed
    for mode in ("dflash", "plain"):
        assert (cache / "demo-run" / mode / "stats.parquet").is_file() and (cache / "demo-run" / mode / "stats.executes.parquet").is_file()
    assert "Runs side by side" in (cache / "demo-run" / "report" / "summary.md").read_text()
    figures = json.loads(printed.strip().splitlines()[-1])
    assert figures["prompts"] == 3 and figures["speedup"] == round(figures["tokens_per_s"] / figures["plain_tokens_per_s"], 2)


def test_real_demo_on_the_shipped_pair_is_lossless_and_accepts(default_pair_cache, tmp_path, capsys):
    """Guards against the README's main job breaking on a fresh machine: the real export of the
    shipped pair, served by ONNX Runtime, must give the reference decoder's greedy tokens and
    accept real proposals (τ well above 1)."""
    from dflash_trt.export.pair import DEFAULT_PAIR_DIR, load_pair
    from dflash_trt.export.reference import ReferenceDecoder
    from dflash_trt.export.tokenizer import Tokenizer

    # The export (conftest default_pair_cache) is demo.export_dir's own; here the demo finds it unchanged.
    args = ["demo", "--cache", str(default_pair_cache), "--out", str(tmp_path / "run"), "--count", "2", "--max-new-tokens", "24", "--threads", "1"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prompts"] == 2 and summary["tau"] > 1.5 and summary["plain_tokens_per_s"] > 0
    outputs = [json.loads(line) for line in (tmp_path / "run" / "dflash" / "outputs.jsonl").read_text().splitlines()]
    plain = [json.loads(line) for line in (tmp_path / "run" / "plain" / "outputs.jsonl").read_text().splitlines()]
    assert [o["tokens"] for o in plain] == [o["tokens"] for o in outputs]  # the baseline decodes the same tokens
    tokenizer = Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
    decoder = ReferenceDecoder(load_pair(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft")[0])
    for output in outputs:
        expected = decoder.generate_target(output["prompt_ids"], 24, stop=tokenizer.stop_ids).tokens
        assert output["tokens"] == expected
