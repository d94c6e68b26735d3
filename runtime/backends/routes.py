"""How each run graph executes on the exported graph that computes it.

The runtime runs contract graphs by name (``target_verify_3``); the export
holds one network per model (``target_model``, ``draft_model``), each
computing several run graphs at different shapes (its profiles), and the
small graphs as they are (``export.contract``). A ``Route`` turns a run
graph's feeds into its exported graph's, following the contract's feeding
rules (``picks``; ``draft_context``'s count and absent anchor), and the
exported graph's outputs back into the run graph's (logits of one picked row
seen without that axis, proposals nobody reads dropped).

The extra feeds are views of two constant device tensors made once per
backend (``RouteConstants``): stable addresses, nothing allocated or copied
per run, so routed runs can be captured into CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dflash_trt.export import contract as c
from dflash_trt.export.contract import Dims, GraphSpec, Profile


class RouteConstants:
    """``counts[i] == i`` (picks and context counts are slices of it) and the absent anchor."""

    def __init__(self, dims: Dims, device: torch.device) -> None:
        self.counts = torch.arange(max(dims.max_chunk, dims.proposals + 1) + 1, dtype=torch.int64, device=device)
        self.no_anchor = torch.full((1,), c.NO_ANCHOR, dtype=torch.int64, device=device)

    def count(self, value: int) -> torch.Tensor:
        """[value] as a 1-element view."""
        return self.counts[value : value + 1]


@dataclass(frozen=True)
class Route:
    """Run graph ``run`` as profile ``profile`` (index ``index``) of exported graph ``graph``."""

    run: GraphSpec
    graph: GraphSpec
    index: int
    profile: Profile

    @property
    def max_sizes(self) -> dict[str, int]:
        """The exported graph's dims at their largest for this run graph (buffer sizes)."""
        return self.profile.sizes({d: r.max for d, r in self.run.dims.items()})

    def sizes(self, run_sizes: Mapping[str, int]) -> dict[str, int]:
        """The exported graph's dims for one run (T -> S, C -> C, R -> R; the rest fixed)."""
        return self.profile.sizes(run_sizes)

    def feeds(self, feeds: Mapping[str, torch.Tensor], run_sizes: Mapping[str, int], constants: RouteConstants) -> dict[str, torch.Tensor]:
        """The exported graph's plain inputs for the run graph's ``feeds``."""
        kind = self.run.kind
        if kind == c.TARGET_PREFILL:
            return {**feeds, c.PICKS: constants.count(run_sizes[c.TOKENS_DIM] - 1)}  # the last row
        if kind in (c.TARGET_VERIFY, c.TARGET_DECODE):
            rows = self.profile.shape[c.PICKS_DIM]
            return {**feeds, c.PICKS: constants.counts[:rows]}  # every row: 0..P, or [0]
        if kind == c.DRAFT_CONTEXT:
            count = constants.count(run_sizes[c.CONTEXT_DIM])
            return {c.CTX_TAPS: feeds[c.TAPS], c.CTX_START: feeds[c.START], c.CTX_COUNT: count, c.ANCHOR: constants.no_anchor}
        return dict(feeds)

    def outputs(self, outputs: Mapping[str, torch.Tensor], run_sizes: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """The run graph's plain outputs, as views of the exported graph's."""
        return {s.name: outputs[s.name].view(s.resolve(run_sizes)) for s in self.run.outputs if not s.name.startswith("present_")}


def route_of(dims: Dims, name: str) -> Route:
    """How run graph ``name`` executes (a name outside the contract raises ``ValueError``)."""
    graph, index, profile = c.profile_of(dims, name)
    return Route(c.graph_spec(dims, name), graph, index, profile)


def routes(dims: Dims) -> dict[str, Route]:
    """Every run graph's route, by name."""
    return {name: route_of(dims, name) for name in c.graph_names(dims.max_owners, dims.short_verify)}
