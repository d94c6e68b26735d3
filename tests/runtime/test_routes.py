"""Routes: each run graph's feeds mapped onto the exported graph that computes it, with literal arrays.

``routes.Route`` is pure bookkeeping over tensors, so it is checked here without
ONNX or a backend: for every run graph of a small contract, the routed feeds
are exactly the exported graph's inputs at the exported shapes, and the extra
feeds are the contract's feeding rules (export/contract.py's docstring), spelled
out below as literal values for DIMS.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt.export import contract as c
from dflash_trt.runtime.backends.routes import RouteConstants, route_of, routes

# P = 3 proposals (P+1 = 4 verify rows) and a shorter verify length 2 (3 rows), B = 4, max_chunk 6 > P+1.
DIMS = c.Dims.of((2, 1, 4), (1, 1, 4), "float32", (2, 3), vocab_size=11, tap_width=8, block_size=4, proposals=3, max_owners=2,
                 max_context=16, max_chunk=6)
# max_chunk 2 < P+1 = 6: the constant counts must cover the verify rows, not only the chunk.
FEW_CHUNKS = c.Dims.of((1, 1, 4), (1, 1, 4), "float32", vocab_size=5, tap_width=4, block_size=7, proposals=5, max_owners=1,
                       max_context=16, max_chunk=2)
N, S, Q, C, T, R = c.OWNERS_DIM, c.STEP_DIM, c.PICKS_DIM, c.CONTEXT_DIM, c.TOKENS_DIM, c.ROWS_DIM

# The contract's feeding rules for DIMS, literally: run graph, its dynamic sizes ->
# (exported graph, the exported graph's dims, the feeds the route adds, feeds renamed {model input: run input}).
RULES = {
    ("target_prefill", 5): (c.TARGET_MODEL, {N: 1, S: 5, Q: 1}, {c.PICKS: [4]}, {}),  # the last row's logits
    ("target_prefill", 1): (c.TARGET_MODEL, {N: 1, S: 1, Q: 1}, {c.PICKS: [0]}, {}),
    ("target_prefill", 6): (c.TARGET_MODEL, {N: 1, S: 6, Q: 1}, {c.PICKS: [5]}, {}),  # T = max_chunk
    ("target_verify_1", None): (c.TARGET_MODEL, {N: 1, S: 4, Q: 4}, {c.PICKS: [0, 1, 2, 3]}, {}),
    ("target_verify_2", None): (c.TARGET_MODEL, {N: 2, S: 4, Q: 4}, {c.PICKS: [0, 1, 2, 3]}, {}),
    ("target_verify_1_p2", None): (c.TARGET_MODEL, {N: 1, S: 3, Q: 3}, {c.PICKS: [0, 1, 2]}, {}),  # verify 2 of 3
    ("target_verify_2_p2", None): (c.TARGET_MODEL, {N: 2, S: 3, Q: 3}, {c.PICKS: [0, 1, 2]}, {}),
    ("target_decode_1", None): (c.TARGET_MODEL, {N: 1, S: 1, Q: 1}, {c.PICKS: [0]}, {}),
    ("target_decode_2", None): (c.TARGET_MODEL, {N: 2, S: 1, Q: 1}, {c.PICKS: [0]}, {}),
    ("draft_context", 3): (c.DRAFT_MODEL, {N: 1, C: 3}, {c.CTX_COUNT: [3], c.ANCHOR: [-1]},
                           {c.CTX_TAPS: c.TAPS, c.CTX_START: c.START}),
    ("draft_context", 6): (c.DRAFT_MODEL, {N: 1, C: 6}, {c.CTX_COUNT: [6], c.ANCHOR: [-1]},
                           {c.CTX_TAPS: c.TAPS, c.CTX_START: c.START}),
    ("draft_1", None): (c.DRAFT_MODEL, {N: 1, C: 4}, {}, {}),
    ("draft_2", None): (c.DRAFT_MODEL, {N: 2, C: 4}, {}, {}),
    ("verify_argmax_1", None): ("verify_argmax_1", {}, {}, {}),
    ("verify_argmax_2", None): ("verify_argmax_2", {}, {}, {}),
    ("verify_sample_1", None): ("verify_sample_1", {}, {}, {}),
    ("verify_sample_2", None): ("verify_sample_2", {}, {}, {}),
    ("verify_argmax_1_p2", None): ("verify_argmax_1_p2", {}, {}, {}),
    ("verify_argmax_2_p2", None): ("verify_argmax_2_p2", {}, {}, {}),
    ("verify_sample_1_p2", None): ("verify_sample_1_p2", {}, {}, {}),
    ("verify_sample_2_p2", None): ("verify_sample_2_p2", {}, {}, {}),
    ("sample", 1): ("sample", {R: 1}, {}, {}),
    ("sample", 7): ("sample", {R: 7}, {}, {}),
}


# The same rules for any dims: kind -> (its T or C, the verify rows k+1) -> the feeds the route adds.
ADDED = {
    c.TARGET_PREFILL: lambda size, rows: {c.PICKS: [size - 1]},
    c.TARGET_VERIFY: lambda size, rows: {c.PICKS: list(range(rows))},
    c.TARGET_DECODE: lambda size, rows: {c.PICKS: [0]},
    c.DRAFT_CONTEXT: lambda size, rows: {c.CTX_COUNT: [size], c.ANCHOR: [c.NO_ANCHOR]},
}


def run_sizes(spec: c.GraphSpec, size: int | None) -> dict[str, int]:
    """The run graph's one dynamic dim (T, C or R) at ``size``; none for a static graph."""
    return {d: size for d in spec.dims}


def literal_feeds(spec: c.GraphSpec, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Every plain input of the run graph, distinct literal values (100 * input index + arange)."""
    plain = [s for s in spec.inputs if not s.name.startswith("past_")]
    feeds = {}
    for i, s in enumerate(plain):
        shape = s.resolve(sizes)
        values = 100 * i + torch.arange(torch.Size(shape).numel())
        feeds[s.name] = values.reshape(shape).to(torch.int64 if s.dtype == c.INT64 else torch.float32)
    return feeds


def test_rules_cover_every_run_graph():
    """Bug: a run graph added to the contract without a feeding rule here would go untested."""
    assert {name for name, _ in RULES} == set(c.graph_names(DIMS.max_owners, DIMS.short_verify))


@pytest.mark.parametrize("name,size", sorted(RULES, key=str))
def test_feeds_follow_the_contracts_feeding_rules(name, size):
    """Bug: a route feeds its exported graph the wrong picks (another row's logits become the
    token), a wrong context count or a real anchor for draft_context (a block written into the
    draft cache), a misnamed or missing input (an engine binding left unset), or copies a feed
    instead of passing it through: routed feeds equal the contract's rules for DIMS, the run
    graph's own feeds are the same tensors, and every exported input is fed at the exported shape."""
    graph, model_sizes, added, renamed = RULES[name, size]
    route, constants = route_of(DIMS, name), RouteConstants(DIMS, torch.device("cpu"))
    sizes = run_sizes(route.run, size)
    feeds = literal_feeds(route.run, sizes)
    routed = route.feeds(feeds, sizes, constants)
    assert route.graph.name == graph and route.sizes(sizes) == model_sizes
    plain = [s for s in route.graph.inputs if not s.name.startswith("past_")]
    assert set(routed) == {s.name for s in plain}
    for s in plain:
        assert routed[s.name].shape == s.resolve(model_sizes), s.name
        assert routed[s.name].dtype == (torch.int64 if s.dtype == c.INT64 else torch.float32), s.name
    for model_input, values in added.items():
        assert routed[model_input].tolist() == values, model_input
    passed = {model_input: renamed.get(model_input, model_input) for model_input in set(routed) - set(added)}
    assert all(routed[model_input] is feeds[run_input] for model_input, run_input in passed.items())


@pytest.mark.parametrize("dims", [DIMS, FEW_CHUNKS], ids=["chunk>rows", "rows>chunk"])
def test_added_feeds_are_views_of_the_constants_at_every_size(dims):
    """Bug: a route allocates or copies its picks / count / anchor per run (a CUDA graph captured over
    a routed run would replay a freed or stale address), or the constants are too short for the
    largest chunk or the P+1 verify rows (a short picks vector: logits of too few rows): at every
    size, each added feed lies inside the constants' memory and holds the rule's values."""
    constants = RouteConstants(dims, torch.device("cpu"))
    memory = {constants.counts.data_ptr(), constants.no_anchor.data_ptr()}  # the two constant tensors
    for name, route in routes(dims).items():
        kind = route.run.kind
        rows = (c.verify_length(name) or dims.proposals) + 1
        chunked = kind in (c.TARGET_PREFILL, c.DRAFT_CONTEXT)
        for size in range(1, dims.max_chunk + 1) if chunked else [1 if route.run.dims else None]:
            sizes = run_sizes(route.run, size)
            routed = route.feeds(literal_feeds(route.run, sizes), sizes, constants)
            want = ADDED[kind](size, rows) if kind in ADDED else {}
            for model_input, values in want.items():
                tensor = routed[model_input]
                assert tensor.tolist() == values, (name, size, model_input)
                assert tensor.untyped_storage().data_ptr() in memory, (name, size, model_input)


def test_outputs_are_views_of_the_exported_outputs_in_the_run_graphs_shapes():
    """Bug: the route hands back the model's shapes (prefill and decode logits keep the picked-row
    axis: [1, 1, V] where the executor indexes [1, V]), copies an output, or passes on outputs the run
    graph does not have (draft_context's unread proposals, the caches)."""
    for name, size in RULES:
        route = route_of(DIMS, name)
        sizes = run_sizes(route.run, size)
        model_sizes = route.sizes(sizes)
        produced = {s.name: torch.arange(torch.Size(s.resolve(model_sizes)).numel()).reshape(s.resolve(model_sizes))
                    for s in route.graph.outputs}
        out = route.outputs(produced, sizes)
        plain = [s for s in route.run.outputs if not s.name.startswith("present_")]
        assert list(out) == [s.name for s in plain], name
        for s in plain:
            assert out[s.name].shape == s.resolve(sizes), (name, s.name)
            assert out[s.name].data_ptr() == produced[s.name].data_ptr(), (name, s.name)  # a view
            assert out[s.name].flatten().tolist() == produced[s.name].flatten().tolist(), (name, s.name)
