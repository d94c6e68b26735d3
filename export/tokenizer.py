"""Tokenizer, chat template and stop tokens from a checkpoint's own files.

``tokenizer.json`` is read with the ``tokenizers`` library;
``tokenizer_config.json`` gives the named special tokens and the chat
template, which a ``chat_template.jinja`` beside it replaces (as Hugging Face
transformers loads it); stop tokens are the union of ``generation_config.json``
and ``config.json`` ``eos_token_id`` and the tokenizer's ``eos_token``.

Text must be valid Unicode: a lone surrogate (``"a\\ud800"``, which JSON
can carry) is refused with ``TokenizerError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _Tokenizer

from dflash_trt.errors import TokenizerError

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' file name; it wins over tokenizer_config.json's
# Pre-tokenizers that drop characters (whitespace): a text's length then bounds nothing.
DROPPING_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"}
COMPOSED_CODE_POINTS = 4  # a normalizer (NFC, NFKC) composes at most 4 code points into one character


# What ``Tokenizer.from_dir`` reads besides config.json, copied into an export so that the export alone serves text.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The checkpoint's tokenizer files (none without a tokenizer.json)."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        return []
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def copy_tokenizer(source: str | Path, out: str | Path) -> dict[str, str]:
    """Copy ``source``'s tokenizer files into ``out``; {file name: sha256} of the copies (empty: no tokenizer)."""
    import shutil

    from dflash_trt.export.identity import file_sha256

    copied = {}
    for path in tokenizer_files(source):
        target = Path(out) / path.name
        if target.resolve() != path.resolve():
            shutil.copyfile(path, target)
        copied[path.name] = file_sha256(target)
    return copied


def _token_text(value) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _eos_ids(directory: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else [value] if value is not None else []
    return ids


@dataclass
class Tokenizer:
    backend: _Tokenizer
    chat_template: str | None
    stop_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{directory}: tokenizer.json not found")
        backend = _Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        eos = _token_text(config.get("eos_token"))
        stops = _eos_ids(directory)
        if eos is not None:
            eos_id = backend.token_to_id(eos)
            if eos_id is None:
                raise TokenizerError(f"{config_path}: eos_token {eos!r} is not in the vocabulary")
            stops.append(eos_id)
        template_path = directory / CHAT_TEMPLATE_FILE
        template = template_path.read_text(encoding="utf-8") if template_path.is_file() else config.get("chat_template")
        return cls(
            backend=backend,
            chat_template=template,
            stop_ids=tuple(dict.fromkeys(stops)),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=eos,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Runs in ``encode_batch_fast`` (``encode_batch`` where the installed tokenizers
        lacks it), which releases the GIL while it tokenizes (``encode`` holds it: 2 s for 3 MB of code, every
        other thread stalled) and skips the character offsets nobody here reads: 95 against 130 µs for a
        600-character prompt, 0.30 against 0.54 s for 1 MB of code."""
        if not isinstance(text, str):
            msg = f"text to tokenize must be a str, got {type(text).__name__}"
            raise TokenizerError(msg, param="prompt")
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        try:
            return encode([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError as error:  # the Rust side takes valid Unicode only
            at = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF), None)
            if at is None:
                raise
            msg = f"text holds a lone surrogate U+{ord(text[at]):04X} at character {at}: not valid Unicode"
            raise TokenizerError(msg, param="prompt", code="invalid_value") from error

    @cached_property
    def chars_per_token(self) -> int | None:
        """The most characters one token of a text can stand for; None when this tokenizer may drop
        characters (a whitespace pre-tokenizer), so that a text's length bounds nothing.

        Every token decodes to at most the longest vocabulary entry's characters (a byte-level piece
        alone decodes to one U+FFFD); a normalizer (NFC, NFKC) may first compose up to
        ``COMPOSED_CODE_POINTS`` code points into one character.
        """
        spec = json.loads(self.backend.to_str())
        pre = _parts(spec.get("pre_tokenizer"))
        if any(p.get("type") in DROPPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
            return None
        ids = [[i] for i in range(self.vocab_size)]
        longest = max(map(len, self.backend.decode_batch(ids, skip_special_tokens=False)), default=1)
        return longest * (COMPOSED_CODE_POINTS if spec.get("normalizer") else 1)

    def max_chars(self, tokens: int) -> int | None:
        """An upper bound on the characters of a text of at most ``tokens`` tokens (None: no bound):
        a longer text holds more tokens, so a server refuses it without tokenizing it."""
        per_token = self.chars_per_token
        return None if per_token is None else tokens * per_token

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """Render the checkpoint's Jinja chat template (sandboxed), as HF does."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint's tokenizer_config.json has no chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **variables,
        )


def load_tokenizer(*directories: str | Path | None) -> Tokenizer | None:
    """The first directory holding a tokenizer.json, as a ``Tokenizer``; None if none does."""
    for directory in directories:
        if directory is not None and (Path(directory) / "tokenizer.json").is_file():
            return Tokenizer.from_dir(directory)
    return None


def _parts(spec: dict | None) -> list[dict]:
    """A tokenizer.json component and, for a ``Sequence``, its members (recursively)."""
    if not spec:
        return []
    inner = spec.get("pretokenizers") or spec.get("normalizers") or []
    return [spec, *(part for member in inner for part in _parts(member))]
