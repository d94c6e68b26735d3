"""Target logits and taps against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from dflash_trt.export.target import load_target

CASES = {
    "qwen3-gqa2-untied": dict(arch="qwen3"),
    "qwen3-mha-tied": dict(arch="qwen3", num_key_value_heads=4, tie_word_embeddings=True),
    "qwen3-mqa-sliding": dict(
        arch="qwen3",
        num_key_value_heads=1,
        sliding_window=6,
        use_sliding_window=True,
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    "qwen3-linear-rope-bias": dict(
        arch="qwen3", attention_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}
    ),
    "llama3-rope-mqa": dict(arch="llama"),
    "llama-gqa-tied-mlpbias": dict(arch="llama", num_key_value_heads=2, tie_word_embeddings=True, mlp_bias=True),
}


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def _hf(directory):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_prefill_and_cached_decode_match_transformers(case, tmp_path):
    """Guards against wrong RoPE scaling, GQA grouping, q/k norm, tying, windows or cache writes:
    prefill logits, cached one-token decode logits and the taps equal HF (max rel. error <= 1e-4).
    Taps are HF's hidden_states[i + 1], what the DFlash reference feeds its draft: for the LAST
    layer that entry is final-normed (a draft tapping it must not get the un-normed residual)."""
    options = dict(CASES[case])
    arch = options.pop("arch")
    directory = tiny_models.write_target(tmp_path / case, arch=arch, **options)
    ours, reference = load_target(directory, tap_layers=(0, 2, 4)), _hf(directory)
    tokens = torch.randint(0, tiny_models.VOCAB, (1, 19), generator=torch.Generator().manual_seed(3))
    prompt, continuation = tokens[:, :12], tokens[0, 12:]
    cache = ours.new_cache(2, 64)
    row = torch.tensor([1])  # not row 0: rows must be honoured

    hf = reference(prompt, output_hidden_states=True, use_cache=True)
    logits, taps = ours(prompt, torch.tensor([0]), row, *cache)
    assert _relative(logits, hf.logits) <= 1e-4
    assert len(hf.hidden_states) == 6  # embeddings + 5 layers: layer 4 is the last
    hf_taps = torch.cat([hf.hidden_states[1], hf.hidden_states[3], hf.hidden_states[5]], dim=-1)
    assert _relative(taps, hf_taps) <= 1e-4

    past = hf.past_key_values
    for offset, token in enumerate(continuation.tolist()):
        position = 12 + offset
        step = reference(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = step.past_key_values
        logits, _ = ours(torch.tensor([[token]]), torch.tensor([position]), row, *cache)
        assert _relative(logits, step.logits) <= 1e-4, f"decode step at position {position}"


@torch.no_grad()
def test_multi_row_batch_equals_single_rows(tiny_pair):
    """Guards against cache rows leaking into each other: two rows at different positions in one
    call give the same logits as each row run alone."""
    model = load_target(tiny_pair[0])
    torch.manual_seed(0)
    a, b = torch.randint(0, 90, (1, 9)), torch.randint(0, 90, (1, 9))
    batch_cache, alone_cache = model.new_cache(2, 32), model.new_cache(2, 32)
    model(a[:, :5], torch.tensor([0]), torch.tensor([0]), *batch_cache)
    model(a[:, :5], torch.tensor([0]), torch.tensor([0]), *alone_cache)
    model(b[:, :2], torch.tensor([0]), torch.tensor([1]), *batch_cache)
    model(b[:, :2], torch.tensor([0]), torch.tensor([1]), *alone_cache)
    tokens = torch.cat([a[:, 5:8], b[:, 2:5]])
    batched, _ = model(tokens, torch.tensor([5, 2]), torch.tensor([0, 1]), *batch_cache)
    first, _ = model(a[:, 5:8], torch.tensor([5]), torch.tensor([0]), *alone_cache)
    second, _ = model(b[:, 2:5], torch.tensor([2]), torch.tensor([1]), *alone_cache)
    torch.testing.assert_close(batched, torch.cat([first, second]), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_bf16_target_tracks_fp32(tiny_pair):
    """Guards against dtype bugs in the bf16 path (RoPE tables, norms, cache dtype): bf16 logits stay
    within bf16 tolerance of fp32."""
    fp32 = load_target(tiny_pair[0])
    bf16 = load_target(tiny_pair[0], dtype=torch.bfloat16)
    assert bf16.rotary.inv_freq.dtype == torch.float32
    tokens = torch.randint(0, 90, (1, 16), generator=torch.Generator().manual_seed(1))
    start, row = torch.tensor([0]), torch.tensor([0])
    reference, _ = fp32(tokens, start, row, *fp32.new_cache(1, 32))
    logits, _ = bf16(tokens, start, row, *bf16.new_cache(1, 32))
    assert bf16.new_cache(1, 4)[0][0].dtype == torch.bfloat16
    assert _relative(logits, reference) <= 5e-2
