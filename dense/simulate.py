"""CPU simulation of Laneformer across N ranks: each rank holds only its lanes (lanes.DevicePlan) and exchanges
partials only through a `Collective`, the interface KCCL implements on GPUs. Ranks run in threads, so every rank's
code is what one GPU would run; the result must equal the single-device LaneformerDecoder (tests/dense).

On a GPU an ALL_GATHER transfer is asynchronous: issued after layer i, waited on before layer i + d. Here the
in-process collective completes at issue time and the result waits in the rank's inbox until the consumer layer
reads it; `needs_before` is checked at every reduce, so a plan that forgets a transfer fails loudly.
"""
from __future__ import annotations

import threading
from typing import Protocol

import torch

from .config import ALL, SCALED, LaneformerSpec
from .lanes import ALL_GATHER, ALL_REDUCE, FINAL, DevicePlan, Transfer, lane_plan
from .reference import aggregate_lanes, check_positions, lane_attention, lane_ffn, lane_rms_norm, layer_weights


class Collective(Protocol):
    """What a rank may use to talk to the others. Every rank calls the same methods in the same order."""
    rank: int
    world: int

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """t [...] on every rank -> elementwise sum over ranks [...] on every rank."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """t [...] on every rank -> [world, ...] stacked in rank order on every rank."""
        ...


class InProcessGroup:
    """N ranks in one process (threads): a shared slot per rank and a barrier. `timeout` bounds every wait, so a
    rank that died or a mismatched call sequence raises instead of hanging (the watchdog rule, DESIGN.md §3)."""

    def __init__(self, world: int, timeout: float = 60.0):
        self.world = world
        self._slots: list[torch.Tensor | None] = [None] * world
        self._barrier = threading.Barrier(world, timeout=timeout)

    def handle(self, rank: int) -> "InProcessCollective":
        return InProcessCollective(self, rank)

    def abort(self):
        self._barrier.abort()

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = t.clone()
        self._barrier.wait()                  # everyone has written
        got = list(self._slots)
        self._barrier.wait()                  # everyone has read: slots may be reused
        return got


class InProcessCollective:
    def __init__(self, group: InProcessGroup, rank: int):
        self.group, self.rank, self.world = group, rank, group.world

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        got = self.group._exchange(self.rank, t)
        out = got[0].clone()
        for g in got[1:]:                    # rank order: every rank gets bit-identical sums
            out += g
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.group._exchange(self.rank, t))


class RankDecoder:
    """One device's share: its lanes' residual copies, weights and KV cache. forward(ids [S]) -> logits [S, V]
    (every rank computes the same logits: the head input is all-reduced). `device`: where its tensors live (the CPU
    in the thread simulation; its GPU in a `--devices N` worker, kie_moe/ranks.py)."""

    def __init__(self, spec: LaneformerSpec, weights, plan: DevicePlan, coll: Collective, dtype=torch.float32,
                 device="cpu"):
        self.spec, self.plan, self.coll = spec, plan, coll
        self.device = torch.device(device)
        get = lambda n: weights.get(n).to(self.device, dtype)
        self.embed = get("embed")
        fn = get("final_norm")
        self.final_norm = fn[plan.lane_slice] if fn.dim() > 1 else fn
        self.lm_head = get("lm_head") if "lm_head" in weights else self.embed
        self.layers = layer_weights(spec, get, plan.lane_slice)
        self.reset()

    def reset(self):
        self.cache = [None] * self.spec.num_layers
        self.pos = 0

    def _issue(self, t: Transfer, local_sum: torch.Tensor) -> torch.Tensor:
        """local_sum [S, D]: this device's lanes summed -> the all-lanes total [S, D] (gathered pieces summed in
        rank order when the transfer is an all-gather)."""
        if t.op == ALL_REDUCE:
            return self.coll.all_reduce_sum(local_sum)
        assert t.op == ALL_GATHER
        return self.coll.all_gather(local_sum).sum(0)       # [N, S, D] -> [S, D]

    def _sublayer_done(self, i: int, kind: str, p: torch.Tensor) -> torch.Tensor:
        """p [S, l, D] this device's partials of (i, kind) -> what its lanes add."""
        spec, plan = self.spec, self.plan
        t = plan.sends_after(i, kind)
        if t is not None:
            self.inbox[(kind, i)] = self._issue(t, p.sum(1))
            self.own[(kind, i)] = p
        mode = spec.reduce_mode(i)
        if mode == SCALED:
            delta = spec.lane_scale * p
        else:
            need = plan.needs_before(i, kind)
            src = i if mode == ALL else i - spec.broadcast_delay
            if [n.layer for n in need] != [src] or (kind, src) not in self.inbox:
                raise RuntimeError(f"rank {plan.rank}: layer {i} {kind} ({mode}) needs layer {src}'s partials; "
                                   f"plan provides {[n.layer for n in need]}")
            total = self.inbox[(kind, src)][:, None, :]     # [S, 1, D]
            delta = total.expand_as(p) if mode == ALL else p + (total - self.own[(kind, src)])
        for key in [k for k in self.inbox if k[0] == kind]:  # drop what no later layer reads
            if max(plan.sends_after(key[1], kind).consumers) <= i:
                del self.inbox[key], self.own[key]
        return delta

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        spec, start, S = self.spec, self.pos, ids.shape[0]
        check_positions(spec, start, S)
        nl = len(self.plan.lanes)
        x = self.embed[ids.to(self.device)][:, None, :].repeat(1, nl, 1)    # [S, l, D]: this device's lanes only
        self.inbox: dict[tuple[str, int], torch.Tensor] = {}  # (sublayer, layer) -> all-lanes total [S, D]
        self.own: dict[tuple[str, int], torch.Tensor] = {}    # (sublayer, layer) -> own partials [S, l, D]
        for i, w in enumerate(self.layers):
            h = lane_rms_norm(x, w["attn_norm"], spec.norm_eps)
            p, self.cache[i] = lane_attention(spec, h, w["attn.q"], w["attn.k"], w["attn.v"], w["attn.o"],
                                              self.cache[i], start, spec.windows[i])
            x = x + self._sublayer_done(i, "attn", p)
            h = lane_rms_norm(x, w["mlp_norm"], spec.norm_eps)
            x = x + self._sublayer_done(i, "ffn", lane_ffn(h, w["mlp.gate"], w["mlp.up"], w["mlp.down"]))
        assert not self.inbox, f"rank {self.plan.rank}: received partials nobody read: {sorted(self.inbox)}"
        self.pos += S
        final = self.plan.sends_after(spec.num_layers, FINAL)
        h = aggregate_lanes(spec, x, self.final_norm, lambda t: self._issue(final, t.sum(1)))
        return (h @ self.lm_head.T).float()


class SimulatedDecoder:
    """N RankDecoders in threads behind the single-device contract: forward(ids [S]) -> logits [S, V], reset().
    Checks that every rank produced the same logits and returns rank 0's."""

    def __init__(self, spec: LaneformerSpec, weights, world: int, timeout: float = 60.0):
        self.spec, self.world = spec, world
        self.plan = lane_plan(spec, world)
        self.group = InProcessGroup(world, timeout)
        self.ranks = [RankDecoder(spec, weights, d, self.group.handle(d.rank)) for d in self.plan.devices]

    def reset(self):
        for r in self.ranks:
            r.reset()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: list[torch.Tensor | None] = [None] * self.world
        errors: list[BaseException] = []

        def run(r: int):
            try:
                out[r] = self.ranks[r].forward(ids)
            except BaseException as e:       # wake the others (their barrier breaks) and report the first cause
                errors.append(e)
                self.group.abort()

        threads = [threading.Thread(target=run, args=(r,), name=f"lane-rank-{r}") for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        for r in range(1, self.world):
            if not torch.equal(out[r], out[0]):
                raise RuntimeError(f"rank {r}'s logits differ from rank 0's")
        return out[0]
