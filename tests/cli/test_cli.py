"""The dflash-trt console command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

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


def test_serve_without_the_serve_extra_shows_its_help_and_names_the_extra():
    """Guards against ``dflash-trt serve --help`` (or ``serve``) crashing with a ModuleNotFoundError traceback
    where uvicorn is not installed (the flags' defaults were read from a module that imported it): the help
    prints, and ``serve`` exits 1 with one line naming the extra to install."""
    code = """
import sys
sys.modules.update(dict.fromkeys(("uvicorn", "fastapi", "h11", "httptools"), None))  # as if the serve extra were missing
from dflash_trt.cli import main
try:
    main(["serve", "--help"])
except SystemExit as done:
    print("help exit", done.code)
print("serve exit", main(["serve", "--port", "0"]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "help exit 0" in done.stdout and "--max-header-bytes" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "serve exit 1" in done.stdout and "Traceback" not in done.stderr, done.stderr[-2000:]
    named = "dflash-trt serve: ServingError: dflash-trt serve needs the serve extra (uvicorn is missing): pip install 'dflash-trt[serve]'"
    assert done.stderr.strip().splitlines() == [named], done.stderr


def usage_error(capsys, argv: list[str]) -> str:
    """Run the command; it must exit 2 with exactly one stderr line naming UsageError (nothing on stdout)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"dflash-trt {argv[0]}: UsageError: " in lines[0], captured.err
    assert captured.out == ""
    return lines[0]


def test_bench_serve_prompts_default_to_the_default_pairs():
    """Guards against ``bench --serve``'s prompt reader failing on its own default (no file given): it
    imported a name the demo module does not have (ImportError); it must read the default pair's held-out
    prompts, the same texts as reading that file by name."""
    from dflash_trt.export import DEFAULT_PAIR_DIR
    from dflash_trt.server.bench import read_prompts

    prompts = read_prompts(None)
    assert len(prompts) == 64 and prompts == read_prompts(DEFAULT_PAIR_DIR / "prompts.jsonl")
    assert all(isinstance(prompt, str) and prompt for prompt in prompts)


@pytest.mark.parametrize(("value", "words"), [("-5", "got -5"), ("0", "got 0"), ("x", "got 'x'")])
def test_generate_refuses_a_bad_token_count_in_one_line(value, words, capsys):
    """Guards against `generate --max-new-tokens -5` crashing with a traceback and `0` still producing a
    token: a count below 1 is a usage error (exit 2), named with the range and the value seen."""
    line = usage_error(capsys, ["generate", "--target", "nowhere", "--prompt", "x", "--max-new-tokens", value])
    assert "--max-new-tokens: must be an int >= 1" in line and words in line


@pytest.mark.parametrize(("flags", "words"), [
    (["--top-k", "-1"], "--top-k: must be an int >= 0, got -1"),
    (["--temperature", "-1"], "temperature must be 0 (greedy) or in [1e-06"),
    (["--top-p", "0"], "top_p must be a real number in"),
    (["--seed", "-3"], "--seed: must be an int >= 0, got -3"),
])
def test_generate_refuses_bad_sampling_flags_before_loading(flags, words, capsys):
    """Guards against sampling flags the verifiers cannot represent failing late (after loading the
    checkpoints) or as a traceback: refused first (the --target here does not even exist)."""
    assert words in usage_error(capsys, ["generate", "--target", "nowhere", "--prompt", "x", *flags])


@pytest.mark.parametrize(("argv", "words"), [
    (["run", "--out", "o", "--max-new-tokens", "0"], "--max-new-tokens: must be an int >= 1, got 0"),
    (["run", "--out", "o", "--backend", "tensorrt"], "--backend tensorrt needs --artifacts ENGINE_DIR"),
    (["bench", "--out", "o", "--artifacts", "a", "--backend", "torch"], "--backend torch with --artifacts needs --target and --draft"),
    (["run", "--out", "o", "--dtype", "fp16"], "--dtype and --max-owners apply to --backend torch without --artifacts"),
    (["bench", "--out", "o", "--no-draft"], "--no-draft does not apply to bench"),
    (["serve", "--max-owners", "2"], "--dtype and --max-owners apply to --backend torch without --artifacts"),
    (["run", "--out", "o", "--kernels", "fast"], "--kernels fast applies to --backend torch (got --backend onnxruntime)"),
    (["serve", "--backend", "torch", "--kernels", "exact"], "--kernels exact runs Triton kernels on a CUDA device: add --device cuda (got --device cpu)"),
    (["serve", "--max-queue", "-1"], "--max-queue: must be an int >= 0, got -1"),
    (["serve", "--port", "70000"], "--port: must be a TCP port in [0, 65535], got 70000"),
    (["bench", "--prompts", "p.jsonl"], "dflash-trt bench needs --out DIR (or --serve URL to measure a running server)"),
    (["demo", "--count", "0"], "--count: must be an int >= 1, got 0"),
    (["run", "--out", "o", "--bogus"], "unrecognized arguments: --bogus"),
    (["export", "--target", "t", "--draft", "d", "--out", "o", "--max-owners", "-1"], "--max-owners: must be an int >= 1, got -1"),
])
def test_commands_refuse_flags_that_cannot_work_in_one_line(argv, words, capsys, tmp_path, monkeypatch):
    """Guards against flag combinations that cannot work failing after minutes of loading or as a
    traceback (a torch backend without checkpoints for its artifacts, TensorRT without plans, --dtype
    where an artifact set fixes it): each is refused first, on one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    assert words in usage_error(capsys, argv)
    assert not (tmp_path / "o").exists()  # nothing was written


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


def _torch_backend_option(monkeypatch, name: str) -> list:
    """The values of keyword ``name`` every ``TorchBackend`` built from here on receives (the backend still built)."""
    from dflash_trt.runtime.backends import torch_backend

    seen = []
    real = torch_backend.TorchBackend.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get(name))
        real(self, *args, **kwargs)

    monkeypatch.setattr(torch_backend.TorchBackend, "__init__", spy)
    return seen


def test_draft_weights_flag_reaches_the_torch_backend(tmp_path, monkeypatch, capsys):
    """Guards against `--draft-weights fp8` being parsed but not passed on (the draft silently left in the model's
    dtype), its choices drifting from the backend's, or it being accepted by a backend that cannot run it."""
    from dflash_trt.runtime import command
    from dflash_trt.runtime.kernels import quant

    assert command.DRAFT_WEIGHTS == quant.DRAFT_WEIGHTS
    seen = _torch_backend_option(monkeypatch, "draft_weights")
    out = tmp_path / "o"
    assert main(["run", "--backend", "torch", "--kernels", "fast", "--draft-weights", "fp8", "--limit", "1", "--max-new-tokens", "4",
                 "--out", str(out)]) == 0
    assert seen == ["fp8"] and (out / "outputs.jsonl").exists()
    assert main(["run", "--draft-weights", "fp8", "--limit", "1", "--out", str(tmp_path / "p")]) == 2  # onnxruntime: refused
    assert "--draft-weights fp8 applies to --backend torch (got --backend onnxruntime)" in capsys.readouterr().err


def test_kernels_flag_reaches_the_torch_backend(tmp_path, monkeypatch):
    """Guards against `--kernels` being parsed but not passed on (the torch backend silently running its
    default kernels, so `--kernels exact` would not give the bf16 guarantee it names), and against the
    flag's choices drifting from the backend's."""
    from dflash_trt.runtime import command
    from dflash_trt.runtime.backends import torch_backend

    assert command.KERNEL_CHOICES == torch_backend.KERNELS
    seen = _torch_backend_option(monkeypatch, "kernels")
    out = tmp_path / "o"
    assert main(["run", "--backend", "torch", "--kernels", "fast", "--limit", "1", "--max-new-tokens", "4", "--out", str(out)]) == 0
    assert seen == ["fast"] and (out / "outputs.jsonl").exists()
