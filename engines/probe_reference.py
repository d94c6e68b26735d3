"""What the probe must compute, in numpy, and the comparison that decides a verdict.

The ONNX semantics of the probe's nodes (``engines.probe``), written
independently of any backend: ``TensorScatter`` writes rows at each owner's
start; ``Attention`` with ``is_causal`` and ``nonpad_kv_seqlen`` lets query
i of owner o see slot j iff ``j < length[o]`` and ``j <= i + length[o] - S``
(the diagonal anchored at the owner's OWN length); without ``is_causal``,
iff ``j < length[o]``. Float math in float64 over the inputs as fed (already
rounded to the model dtype). The sampler is ``export.sampling.choose`` over
``NumpyOps`` (the same written-once math the graphs are traced from, here on
numpy int64 / float32 arrays).

``check_outputs`` compares an engine's outputs with ``reference``: caches
and tokens exactly, attention outputs within the model dtype's rounding
(the probe's inputs make every misreading of the semantics move an output
by O(1), see ``engines.probe``), and names, per part and owner, what is off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from dflash_trt.engines import probe as p
from dflash_trt.export import sampling

# (rtol, atol) of the attention outputs per model dtype; far below the O(1) a misreading causes.
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (2e-2, 5e-2)}


class NumpyOps:
    """``sampling.TorchOps``' primitives over numpy arrays."""

    column = staticmethod(lambda x, i: x[:, i : i + 1])
    as_column = staticmethod(lambda x: x[:, None])
    tokens = staticmethod(lambda like, vocab: np.arange(vocab, dtype=np.int64)[None, :])
    to_float = staticmethod(lambda x: x.astype(np.float32))
    log = staticmethod(np.log)
    exp = staticmethod(np.exp)
    equal = staticmethod(np.equal)
    where = staticmethod(np.where)
    either = staticmethod(np.logical_or)
    both = staticmethod(np.logical_and)
    row_sum = staticmethod(lambda x: x.sum(axis=-1, keepdims=True))
    top_values = staticmethod(lambda x, k: -np.sort(-x, axis=-1)[:, :k])
    pick = staticmethod(lambda x, index: np.take_along_axis(x, index, axis=1))
    clamp = staticmethod(np.clip)
    argmax = staticmethod(lambda x: np.argmax(x, axis=-1))


NUMPY = NumpyOps()


def scatter(cache: np.ndarray, new: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """cache [n, H, L, D], new [n, H, S, D] -> a copy with new[o] at slots starts[o] .. of owner o."""
    out = cache.copy()
    for owner, start in enumerate(starts):
        out[owner, :, start : start + new.shape[2]] = new[owner]
    return out


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, lengths: np.ndarray, causal: bool) -> np.ndarray:
    """q [n, Hq, S, D], keys/values [n, Hkv, L, D], lengths [n] -> [n, Hq, S, D] (float64; GQA:
    query head h reads key/value head h // (Hq / Hkv))."""
    return attend(q, keys, values, visibility(lengths, q.shape[2], keys.shape[2], causal))


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Softmax attention of q [n, Hq, S, D] over keys/values [n, Hkv, L, D] where ``visible``
    [n, S, L]; each key/value head serves its Hq / Hkv query heads (no repeated copies)."""
    n, heads, tokens, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(n, kv_heads, heads // kv_heads * tokens, dim)  # [n, Hkv, G*S, D]
    scores = (grouped @ np.swapaxes(keys, -1, -2)).reshape(n, heads, tokens, -1) / np.sqrt(dim)  # [n, Hq, S, L]
    scores = np.where(visible[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = (weights / weights.sum(axis=-1, keepdims=True)).reshape(n, kv_heads, heads // kv_heads * tokens, -1)
    return (weights @ values).reshape(n, heads, tokens, dim)


def visibility(lengths: np.ndarray, tokens: int, slots: int, causal: bool) -> np.ndarray:
    """[n, S, L]: query i of owner o sees slot j (see the module docstring)."""
    j = np.arange(slots)[None, None, :]
    visible = j < lengths[:, None, None]
    if causal:
        last = lengths[:, None, None] - tokens + np.arange(tokens)[None, :, None]  # [n, S, 1]
        visible = visible & (j <= last)
    return np.broadcast_to(visible, (len(lengths), tokens, slots))


def _f64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.double().numpy()


def reference(feeds: Mapping[str, torch.Tensor], max_context: int) -> dict[str, np.ndarray]:
    """Every output of the probe for ``feeds`` (caches in float64, tokens int64)."""
    out = {}
    for prefix, layer, causal in (("t_", 0, True), ("d_", 1, False)):
        starts = feeds[prefix + "start"].numpy()
        keys = scatter(_f64(feeds[f"past_key_{layer}"]), _f64(feeds[prefix + "k"]), starts)
        values = scatter(_f64(feeds[f"past_value_{layer}"]), _f64(feeds[prefix + "v"]), starts)
        tokens = feeds[prefix + "q"].shape[2]
        lengths = starts + tokens if causal else np.minimum(starts + tokens, max_context)
        out[prefix + "out"] = attention(_f64(feeds[prefix + "q"]), keys, values, lengths, causal)
        out[f"present_key_{layer}"], out[f"present_value_{layer}"] = keys, values
    with np.errstate(divide="ignore", invalid="ignore"):  # where() evaluates both branches
        out[p.TOKEN] = sampling.choose(*(feeds[name].numpy() for name in _SAMPLER_INPUTS), ops=NUMPY).astype(np.int64)
    return out


_SAMPLER_INPUTS = (p.LOGITS, p.TEMPERATURE, p.TOP_K, p.TOP_P, p.SEEDS, p.POSITION)
PARTS = {
    p.T_OUT: "target attention (causal, per-owner key/value lengths)",
    p.D_OUT: "draft attention (non-causal, key/value lengths)",
    p.TOKEN: "sampler (int64 hash, Gumbel-max, argmax ties)",
}


@dataclass(frozen=True)
class Problem:
    """One output of one case that differs from the reference."""

    output: str
    text: str

    @property
    def attention(self) -> bool:
        """Whether attention (what ``--causal mask`` expresses otherwise) is at fault."""
        return self.output in (p.T_OUT, p.D_OUT)


def check_outputs(case: p.ProbeCase, dtype: str, got: Mapping[str, torch.Tensor], want: Mapping[str, np.ndarray]) -> list[Problem]:
    """One problem per output that differs from the reference, naming the part and the owners at fault."""
    problems = []
    rtol, atol = TOLERANCES[dtype]
    for name, expected in want.items():
        actual = _f64(got[name]) if got[name].is_floating_point() else got[name].numpy()
        if actual.shape != expected.shape:
            problems.append(Problem(name, f"{case.name}: {name} has shape {list(actual.shape)}, the reference {list(expected.shape)}"))
        elif name in (p.T_OUT, p.D_OUT):
            problems.extend(_attention_problems(case, name, actual, expected, rtol, atol))
        elif not np.array_equal(actual, expected):
            what = PARTS.get(name, "KV write (TensorScatter)")
            wrong = np.flatnonzero((actual != expected).reshape(actual.shape[0], -1).any(axis=1))
            problems.append(Problem(name, f"{case.name}: {what}: {name} differs from the reference at rows {wrong.tolist()}"))
    return problems


def _attention_problems(case: p.ProbeCase, name: str, actual, expected, rtol: float, atol: float) -> list[Problem]:
    starts = case.target_starts if name == p.T_OUT else case.draft_starts
    bad = []
    for owner, start in enumerate(starts):
        diff = np.abs(actual[owner] - expected[owner])
        if not np.all(diff <= atol + rtol * np.abs(expected[owner])):
            bad.append(f"owner {owner} (start {start}): max |diff| {diff.max():.3g}")
    if not bad:
        return []
    return [Problem(name, f"{case.name}: {PARTS[name]}: {name} differs beyond rounding (rtol {rtol}, atol {atol}): {'; '.join(bad)}")]
