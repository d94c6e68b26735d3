"""The export stage: checkpoints (Qwen3 / Llama targets, DFlash drafts), ONNX graphs and their manifest."""

from pathlib import Path

# The shipped pair: target/ (with tokenizer files), draft/, prompts.jsonl (``export.pair`` loads it). Here, not
# in export.pair, so a command line or an HTTP front finds it without importing torch.
DEFAULT_PAIR_DIR = Path(__file__).resolve().parent / "default_pair"
