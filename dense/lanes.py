"""Lane plans: how N devices split the L lanes of a Laneformer and which partials they exchange, as plain data.

Device r of N (N divides L) owns the contiguous lanes r*L/N ... (r+1)*L/N - 1 and every weight of those lanes
(lane tensors and per-lane scales sliced on their lane axis; embedding, final norm and lm_head replicated).

What travels. A lane never needs another lane's partial by itself, only the sum over all lanes (DELAYED adds
sum_m p_m(i-d) - p_l(i-d); ALL adds sum_m p_m(i)). So after a sublayer a device pre-sums its own lanes' partials
and sends that one [S, D] vector; the receiver keeps the others' vectors and, for a lane l it owns, adds
total - p_l using its own p_l. Per transfer each device sends D values per token, whatever L/N is.

Transfers, in the order every rank issues them (the same list on every rank, as collectives require):
- after sublayer k of an ALL layer i (i < d, use_early_comm): `all_reduce_sum`, needed at once (consumers (i,)
  plus i + d when layer i + d is DELAYED and reads layer i again);
- after sublayer k of any layer i whose partials a DELAYED layer j = i + d reads (j < num_layers): `all_gather`,
  started after layer i and waited on only before layer j's same sublayer: d layers of weight streaming hide it;
- SCALED layers that no DELAYED layer reads send nothing; nor do the last d layers' partials;
- "final": the lanes' sum before the final norm (pre_norm_lane_agg: of x; else of each lane's normed x),
  `all_reduce_sum`, consumed by the head (layer = num_layers).
A device keeps its own lanes' partials of layer i until the last consumer of that transfer has run.
"""
from __future__ import annotations

from dataclasses import dataclass

from kie_moe.models.errors import ConfigError

from .config import ALL, DELAYED, LaneformerSpec

ALL_REDUCE = "all_reduce_sum"
ALL_GATHER = "all_gather"
SUBLAYERS = ("attn", "ffn")
FINAL = "final"


@dataclass(frozen=True)
class Transfer:
    layer: int                  # whose partials (num_layers for FINAL)
    sublayer: str               # "attn" | "ffn" | "final"
    op: str                     # ALL_REDUCE (result needed at once) | ALL_GATHER (needed d layers later)
    consumers: tuple[int, ...]  # layers whose same sublayer reads the result (its reduce step)
    elements: int               # values each device sends per token (hidden_size)

    @property
    def due(self) -> int:
        """The first layer that must have received it."""
        return min(self.consumers)

    @property
    def slack(self) -> int:
        """Layers of compute between issue and first use (0: on the critical path)."""
        return self.due - self.layer


@dataclass(frozen=True)
class DevicePlan:
    rank: int
    world: int
    lanes: tuple[int, ...]            # the lanes this device owns (contiguous)
    transfers: tuple[Transfer, ...]   # issue order, identical on every rank

    @property
    def lane_slice(self) -> slice:
        return slice(self.lanes[0], self.lanes[-1] + 1)

    def sends_after(self, layer: int, sublayer: str) -> Transfer | None:
        """The transfer this device issues once its lanes' partials of (layer, sublayer) exist."""
        for t in self.transfers:
            if t.layer == layer and t.sublayer == sublayer:
                return t
        return None

    def needs_before(self, layer: int, sublayer: str) -> tuple[Transfer, ...]:
        """Transfers that must have arrived before the reduce step of (layer, sublayer)."""
        return tuple(t for t in self.transfers if t.sublayer == sublayer and layer in t.consumers)


@dataclass(frozen=True)
class LanePlan:
    num_lanes: int
    world: int
    broadcast_delay: int
    devices: tuple[DevicePlan, ...]


def transfers(spec: LaneformerSpec) -> tuple[Transfer, ...]:
    out = []
    for i in range(spec.num_layers):
        cons = spec.consumers(i)
        if not cons:
            continue
        op = ALL_REDUCE if spec.reduce_mode(i) == ALL else ALL_GATHER
        assert op == ALL_REDUCE or all(spec.reduce_mode(j) == DELAYED for j in cons)
        for k in SUBLAYERS:
            out.append(Transfer(i, k, op, cons, spec.hidden_size))
    out.append(Transfer(spec.num_layers, FINAL, ALL_REDUCE, (spec.num_layers,), spec.hidden_size))
    return tuple(out)


def lane_plan(spec: LaneformerSpec, world: int) -> LanePlan:
    L = spec.num_lanes
    if world < 1 or L % world:
        raise ConfigError(f"{world} devices cannot split num_lanes={L} (the device count must divide the lanes)")
    per = L // world
    ts = transfers(spec)
    devs = tuple(DevicePlan(r, world, tuple(range(r * per, (r + 1) * per)), ts) for r in range(world))
    return LanePlan(L, world, spec.broadcast_delay, devs)
