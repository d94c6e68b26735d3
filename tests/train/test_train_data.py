"""Corpus split, tokenizer specials and the draft's loss pieces (pure functions, CPU, fast)."""

from __future__ import annotations

import torch

from dflash_trt.train.corpus import Limits, load_corpus
from dflash_trt.train.draft import sample_anchors, slot_weights
from dflash_trt.train.tokenizer import EOS, MASK, encode_documents, load_tokenizer, save_tokenizer, train_tokenizer

CODE = "def f{i}(x):\n    # comment {i}\n    return x * {i} + 1\n\n" * 8


def _tree(root, count=40):
    for i in range(count):
        (root / f"pkg{i % 4}").mkdir(exist_ok=True)
        (root / f"pkg{i % 4}" / f"m{i}.py").write_text(CODE.format(i=i))
    (root / "pkg0" / "copy.py").write_text(CODE.format(i=0))  # duplicate of m0.py
    (root / "pkg0" / "tiny.py").write_text("x = 1\n")  # under min_bytes
    (root / "pkg0" / "minified.py").write_text("x = [" + "1, " * 600 + "]\n")  # one overlong line


def test_corpus_dedupes_filters_and_holds_out_whole_files_stably(tmp_path):
    """Guards against validation leaking into training (a file in both splits, or a duplicate of
    a training file held out), unstable splits across runs, and generated files kept."""
    _tree(tmp_path)
    first = load_corpus([str(tmp_path)], val_fraction=0.25, limits=Limits(min_bytes=50))
    again = load_corpus([str(tmp_path)], val_fraction=0.25, limits=Limits(min_bytes=50))
    names = lambda docs: [d.name for d in docs]  # noqa: E731
    assert names(first.train) == names(again.train) and names(first.val) == names(again.val)
    assert not set(names(first.train)) & set(names(first.val))
    assert len(first.train) + len(first.val) == 40  # copy, tiny and minified dropped
    assert 0 < len(first.val) < 20
    assert names(first.train) == sorted(names(first.train))


def test_tokenizer_reserves_eos_and_mask_and_round_trips(tmp_path):
    """Guards against a mask token that is not a real row of the target's vocabulary (the draft
    would embed garbage), a missing eos (no document boundaries), or lossy byte-level encoding."""
    texts = [CODE.format(i=i) for i in range(30)]
    tokenizer = train_tokenizer(texts, vocab_size=600)
    save_tokenizer(tokenizer, tmp_path, max_length=256)
    loaded = load_tokenizer(tmp_path)
    assert (loaded.token_to_id(EOS), loaded.token_to_id(MASK)) == (0, 1)
    sample = "def g(y):\n\treturn 'ünïcode' + \"\\n\"  # 😀\n"
    assert loaded.decode(loaded.encode(sample, add_special_tokens=False).ids) == sample
    stream = encode_documents(loaded, texts[:2], eos=0)
    assert (stream == 0).sum() == 2 and stream[-1] == 0 and (stream != 1).all()


def test_anchors_leave_context_and_fit_the_block():
    """Guards against anchors at position 0 (a block with no context, never seen at inference)
    or blocks running past the sequence (labels read out of bounds), and repeated anchors."""
    anchors = sample_anchors(64, 40, 16, 24, torch.Generator().manual_seed(0))
    assert anchors.min() >= 1 and anchors.max() <= 40 - 16
    assert all(len(set(row)) == 24 for row in anchors.tolist())
    weights = slot_weights(16, 7.0)
    assert weights.shape == (15,) and weights[0] == 1 and torch.allclose(weights[7], torch.exp(torch.tensor(-1.0)))
