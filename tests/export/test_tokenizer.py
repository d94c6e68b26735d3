"""Tokenizer, chat template and stop tokens against Hugging Face transformers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_trt.errors import TokenizerError
from dflash_trt.export.tokenizer import Tokenizer as CheckpointTokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n", "class A:\n    pass\n"] * 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXT, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return directory


def test_encode_decode_and_chat_match_transformers(checkpoint):
    """Guards against prompts tokenized or templated differently from the reference tokenizer,
    which would silently change every generation."""
    import transformers

    ours = CheckpointTokenizer.from_dir(checkpoint)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    text = "def mul(x, y):\n    return x * y  # ünïcode\n"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "write add"}, {"role": "assistant", "content": "ok"}]
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert ours.apply_chat(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_stop_tokens_come_from_every_config_file(checkpoint):
    """Guards against missing a stop token (generation running past end-of-turn)."""
    ours = CheckpointTokenizer.from_dir(checkpoint)
    im_end = ours.backend.token_to_id("<|im_end|>")
    assert set(ours.stop_ids) == {0, im_end}


def test_missing_tokenizer_file_is_refused(tmp_path):
    """Guards against a bare FileNotFoundError for checkpoints without tokenizer.json."""
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        CheckpointTokenizer.from_dir(tmp_path)
