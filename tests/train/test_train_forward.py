"""The training forwards equal the cache-path modules they train (tiny random models, fp32, CPU)."""

from __future__ import annotations

import torch

import tiny_models
from dflash_trt.export.draft import load_draft
from dflash_trt.export.target import load_target
from dflash_trt.train.forward import block_mask, draft_forward, target_forward

ATOL = 1e-5


@torch.no_grad()
def test_target_training_forward_equals_cache_forward(tmp_path):
    """Guards against a training forward that drifts from TargetModel.forward (RoPE positions,
    GQA grouping, causal vs. window masking, tap indexing): a model trained through it would
    mean something else when served through the KV cache."""
    layer_types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    directory = tiny_models.write_target(
        tmp_path / "t", num_key_value_heads=1, sliding_window=5, use_sliding_window=True, layer_types=layer_types
    )
    model = load_target(directory, tap_layers=(1, 3))
    tokens = torch.randint(0, tiny_models.VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    hidden, taps = target_forward(model, tokens, model.tap_layers)
    cache = model.new_cache(2, 32)
    logits, cache_taps = model(tokens, torch.zeros(2, dtype=torch.int64), torch.arange(2), *cache)
    torch.testing.assert_close(model.head(hidden), logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(taps, cache_taps, atol=ATOL, rtol=0)


@torch.no_grad()
def test_draft_training_forward_equals_write_context_then_block(tiny_pair):
    """Guards against the block-sparse training mask leaking (context at or after the anchor,
    or another block's slots) or differing from inference: every block's hidden states equal
    DraftModel.write_context(taps before the anchor) + DraftModel.forward(block)."""
    target_dir, draft_dir = tiny_pair
    draft = load_draft(draft_dir)
    target = load_target(target_dir, tap_layers=draft.config.target_layer_ids)
    block, length = draft.config.block_size, 30
    tokens = torch.randint(0, tiny_models.VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    _, taps = target_forward(target, tokens, target.tap_layers)
    anchors = torch.tensor([[1, 9, 13], [22, 4, 7]])  # overlapping blocks, any order
    ids = tokens.gather(1, anchors)[..., None].repeat(1, 1, block)
    ids[..., 1:] = draft.config.mask_token_id
    hidden = draft_forward(draft, taps, target.embed(ids.flatten(1)), anchors)  # [2, 3*B, H]

    for row in range(2):
        for j, anchor in enumerate(anchors[row].tolist()):
            cache = draft.new_cache(1, length + block)
            draft.write_context(taps[row : row + 1, :anchor], torch.tensor([0]), torch.tensor([0]), *cache)
            expected = draft(target.embed(ids[row : row + 1, j]), torch.tensor([anchor]), torch.tensor([0]), *cache)
            torch.testing.assert_close(hidden[row, j * block : (j + 1) * block], expected[0], atol=ATOL, rtol=0)


def test_block_mask_context_is_strictly_before_the_anchor():
    """Guards against `<=` instead of `<` on the context (the anchor's own taps visible while
    drafting), which trains a draft that collapses at inference time."""
    mask = block_mask(torch.tensor([[3, 0]]), context=6, block=2)[0, 0]
    assert mask[:2, :6].tolist() == [[True, True, True, False, False, False]] * 2
    assert not mask[2:, :6].any()
    assert mask[:, 6:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


@torch.no_grad()
def test_regenerated_greedy_rows_are_the_targets_greedy_decode(tiny_pair):
    """Guards against batched regeneration (one cache row per sequence, positions per row)
    writing the wrong rows or positions: the draft would then train on text the target never
    writes. Greedy rows must equal ReferenceDecoder.generate_target token for token."""
    from dflash_trt.export.reference import ReferenceDecoder
    from dflash_trt.train.regenerate import continue_rows

    target = load_target(tiny_pair[0])
    prompts = torch.randint(0, tiny_models.VOCAB, (3, 7), generator=torch.Generator().manual_seed(2))
    out = continue_rows(target, prompts, 9, torch.tensor([True, False, True]), torch.Generator().manual_seed(0))
    decoder = ReferenceDecoder(target)
    for row in (0, 2):
        assert out[row, 7:].tolist() == decoder.generate_target(prompts[row].tolist(), 9).tokens
    assert out[:, :7].equal(prompts)


@torch.no_grad()
def test_a_grown_draft_starts_as_the_same_function(tiny_pair, tmp_path):
    """Guards against growing a draft (`train draft --init-draft D --draft-layers N`) into a different
    function: a new layer whose branch outputs are not exactly zero (a wrong tensor name, a copy of the
    output projections) throws away what the shallow draft learned. The grown draft's hidden states must
    equal the original's bit for bit, and its new layers must still carry gradient."""
    import json

    from dflash_trt.export.checkpoint import save_checkpoint
    from dflash_trt.train.draft import grown_state

    target_dir, draft_dir = tiny_pair
    draft = load_draft(draft_dir)
    target = load_target(target_dir, tap_layers=draft.config.target_layer_ids)
    config = json.loads((draft_dir / "config.json").read_text())
    layers = config["num_hidden_layers"] + 2
    save_checkpoint(tmp_path / "grown", {**config, "num_hidden_layers": layers}, grown_state(draft.state_dict(), layers))
    grown = load_draft(tmp_path / "grown")
    assert len(grown.layers) == layers

    tokens = torch.randint(0, tiny_models.VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    _, taps = target_forward(target, tokens, target.tap_layers)
    anchors = torch.tensor([[2, 11], [5, 14]])
    ids = tokens.gather(1, anchors)[..., None].repeat(1, 1, draft.config.block_size)
    embedded = target.embed(ids.flatten(1))
    assert torch.equal(draft_forward(grown, taps, embedded, anchors), draft_forward(draft, taps, embedded, anchors))

    with torch.enable_grad():
        draft_forward(grown, taps, embedded, anchors).square().sum().backward()
    assert grown.layers[-1].mlp.down_proj.weight.grad.abs().sum() > 0
    assert grown.layers[-1].self_attn.o_proj.weight.grad.abs().sum() > 0


def test_a_draft_never_shrinks_on_warm_start(tiny_pair):
    """Guards against `--draft-layers` below the --init-draft's count being ignored (the earlier draft's
    shape silently winning) or cutting layers: a typed error naming the flag, the bound and the value."""
    import pytest

    from dflash_trt.errors import InputError
    from dflash_trt.train.command import _warm_start
    from dflash_trt.train.draft import DraftShape

    _, draft_dir = tiny_pair
    present = len(load_draft(draft_dir).layers)
    with pytest.raises(InputError, match=rf"--draft-layers must be >= the --init-draft's {present} layers.*got 0"):
        _warm_start(draft_dir, DraftShape(), 0)
    shape, _, state = _warm_start(draft_dir, DraftShape(), present + 1)
    assert shape.num_layers == present + 1 and f"layers.{present}.mlp.down_proj.weight" in state
