"""A byte-level BPE tokenizer for code (the ``tokenizers`` library).

Pre-tokenization splits with the cl100k-style pattern (letters, up to three
digits, punctuation runs, newline runs, whitespace runs kept whole so
indentation merges), then maps bytes to the byte-level alphabet: every input
round-trips. Special tokens come first: ``EOS`` (id 0) ends each document;
``MASK`` (id 1) is reserved for DFlash blocks, a real row of the target's
embedding. Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (+
``special_tokens_map.json``) so Hugging Face's ``AutoTokenizer`` reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_trt.errors import TokenizerError

EOS = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, MASK)
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    if not 512 <= vocab_size <= 65535:
        raise TokenizerError(f"vocab_size must be in [512, 65535] (token ids are stored as uint16), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """{'eos': id, 'mask': id}; refuses a tokenizer without them."""
    ids = {"eos": tokenizer.token_to_id(EOS), "mask": tokenizer.token_to_id(MASK)}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise TokenizerError(f"tokenizer has no {missing[0]} token ({EOS if missing[0] == 'eos' else MASK})")
    return ids


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path, max_length: int) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    specials = {"eos_token": EOS, "pad_token": EOS, "mask_token": MASK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise TokenizerError(f"{path}: file not found (a checkpoint's tokenizer is its tokenizer.json)")
    return Tokenizer.from_file(str(path))


def _batches(texts: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(texts), size):
        yield texts[start : start + size]


def encode_documents(tokenizer: Tokenizer, texts: list[str], eos: int | None, batch: int = 512) -> np.ndarray:
    """One uint16/int32 stream: each document's ids followed by ``eos`` (if given)."""
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 65536 else np.int32
    parts = []
    for chunk in _batches(texts, batch):
        for encoding in tokenizer.encode_batch(chunk, add_special_tokens=False):
            parts.append(np.asarray(encoding.ids, dtype=dtype))
            if eos is not None:
                parts.append(np.asarray([eos], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
