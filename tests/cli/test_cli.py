"""The dflash-trt console command."""

from __future__ import annotations

import json
import shutil

import pytest

import tiny_models
from dflash_trt.cli import main
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.tokenizer import Tokenizer
from test_tokenizer import checkpoint  # noqa: F401  (fixture)


def test_generate_prints_the_reference_completion_and_json(checkpoint, tmp_path, capsys):  # noqa: F811
    """Guards against the CLI decoding with different tokens/stop ids than the library oracle."""
    target = tiny_models.write_target(tmp_path / "t", vocab_size=300)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, target / name)
    draft = tiny_models.write_draft(tmp_path / "d", target)
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "12"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    tokenizer = Tokenizer.from_dir(target)
    expected = ReferenceDecoder(*load_pair(target, draft)).generate_target(
        tokenizer.encode("def add(a, b):"), 12, stop=tokenizer.stop_ids
    )
    assert code == 0
    assert "\n".join(lines[:-1]) == "def add(a, b):" + tokenizer.decode(expected.tokens)
    assert summary["tokens"] == len(expected.tokens) and summary["cycles"] >= 1


def test_bad_checkpoint_gives_a_message_not_a_traceback(tmp_path, capsys):
    """Guards against library errors escaping the CLI as tracebacks."""
    assert main(["generate", "--target", str(tmp_path), "--prompt", "x"]) == 1
    assert "TokenizerError" in capsys.readouterr().err


def test_no_command_prints_help():
    """Guards against a bare `dflash-trt` crashing instead of showing usage."""
    assert main([]) == 2


def test_build_of_an_fp32_export_exits_2_with_one_line(exported_pair, tmp_path, capsys):
    """Guards against `dflash-trt build` on an fp32 export (ONNX Runtime's configuration)
    ending in TensorRT's internal Myelin error: it exits 2 with one line naming the graphs
    and the export to make, before TensorRT is looked for, and writes nothing."""
    out = tmp_path / "engines"
    assert main(["build", "--onnx", str(exported_pair.out), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith("dflash-trt build: UnsupportedExportError: target_model, draft_model: float32 attention")
    assert "--dtype bf16" in lines[0] and not out.exists()
