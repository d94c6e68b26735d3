"""Bad checkpoints are refused with a typed error naming the tensor or field and both values."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from dflash_trt.errors import ConfigError, PairError, TensorError
from dflash_trt.export.pair import load_pair
from dflash_trt.export.target import load_target


def _copy(source, destination):
    shutil.copytree(source, destination)
    return destination


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_is_named(tiny_pair, tmp_path):
    """Guards against silently random-initialized weights when a tensor is absent."""
    target = _copy(tiny_pair[0], tmp_path / "t")
    _edit_tensors(target, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(TensorError, match=r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_target(target)


def test_shape_mismatch_names_tensor_and_both_shapes(tiny_pair, tmp_path):
    """Guards against loading a tensor of the wrong shape (wrong config/checkpoint pairing)."""
    target = _copy(tiny_pair[0], tmp_path / "t")
    _edit_tensors(target, lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(TensorError, match=r"'model\.norm\.weight' has shape \[32\], expected \[64\]"):
        load_target(target)


def test_unexpected_tensor_is_named(tiny_pair, tmp_path):
    """Guards against ignoring weights the model does not use (e.g. a different architecture)."""
    target = _copy(tiny_pair[0], tmp_path / "t")
    _edit_tensors(target, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(TensorError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        load_target(target)


def test_unknown_architecture_is_refused(tiny_pair, tmp_path):
    """Guards against running a non-Qwen3/Llama checkpoint with the wrong math."""
    target = _copy(tiny_pair[0], tmp_path / "t")
    _edit_config(target, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unknown architecture: model_type='gpt2'"):
        load_target(target)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_size=32), "draft hidden_size is 32 but the target's is 64"),
        (dict(vocab_size=50), "draft vocab_size is 50 but the target's is 97"),
        (dict(num_target_layers=7), "draft num_target_layers is 7 but the target's is 5"),
        (dict(dflash_config={"target_layer_ids": [1, 5]}), r"within \[0, 4\].*got \[1, 5\]"),
        (dict(dflash_config={"target_layer_ids": [3, 1]}), r"strictly increasing.*got \[3, 1\]"),
        (dict(dflash_config={"mask_token_id": 97}), r"mask_token_id must be in \[0, 96\].*got 97"),
    ],
)
def test_draft_that_does_not_fit_its_target_is_refused(tiny_pair, tmp_path, changes, message):
    """Guards against pairing a draft with the wrong target (sizes, vocabulary, taps, mask row)."""
    draft = _copy(tiny_pair[1], tmp_path / "d")
    _edit_config(draft, **changes)
    with pytest.raises(PairError, match=message):
        load_pair(tiny_pair[0], draft)


def test_missing_config_field_is_named(tiny_pair, tmp_path):
    """Guards against KeyError tracebacks for incomplete configs."""
    target = _copy(tiny_pair[0], tmp_path / "t")
    _edit_config(target, num_hidden_layers=None)
    with pytest.raises(ConfigError, match="required field 'num_hidden_layers' is missing"):
        load_target(target)


def test_unsupported_rope_type_is_refused(tiny_pair, tmp_path):
    """Guards against silently using default RoPE for a scaling type we do not implement."""
    target = _copy(tiny_pair[0], tmp_path / "t")
    _edit_config(target, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ConfigError, match="rope type must be one of .* got 'yarn'"):
        load_target(target)


def test_sharded_checkpoint_loads_like_single_file(tiny_pair, tmp_path):
    """Guards against sharded (index.json) checkpoints losing tensors across shards."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_pair[0])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single, sharded = load_target(tiny_pair[0]), load_target(tmp_path / "sharded")
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name
