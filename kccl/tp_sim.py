"""N-rank CPU simulations whose ranks talk only through KCCL's one-shot algorithms (kccl/collectives.py):

- `kccl_laneformer(spec, weights, world)`: dense/simulate.py's SimulatedDecoder (Laneformer DTP lane plans) with
  its in-process group swapped for KCCL over a HostPool.
- `TpSimulatedDecoder`: a MoE without DTP, plain tensor + expert parallel. Rank r of N owns 1/N of every layer's
  query heads (with the kv heads those heads read: kv heads are duplicated when there are fewer than N), 1/N of
  the dense MLP / shared-expert columns, the routed experts e with e*N // E == r, and a 1/N vocab piece of lm_head.
  The router runs on every rank (replicated). Per sublayer each rank's output is a partial sum of the full
  output, so `x += all_reduce_sum(partial)`; the logits pieces are all-gathered. Biases of row-split outputs
  (o, down) are added by rank 0 only (else N times).

Ranks reuse models/reference.py's ReferenceDecoder pieces (attention, swiglu, routing, experts) on their slices.
Ranks are threads here; on GPUs the same rank code runs one per process (kie_moe/launch.py) with GpuHeap.
"""
from __future__ import annotations

import threading

import torch

from kie_moe.models.errors import ConfigError
from kie_moe.models.reference import ReferenceDecoder, linear, rms_norm
from kie_moe.models.spec import ModelSpec

from .collectives import KcclThreadGroup
from .symm import KcclAborted


def kccl_laneformer(spec, weights, world: int, timeout: float = 60.0, capacity_bytes: int = 1 << 16):
    """dense/simulate.SimulatedDecoder whose ranks exchange partials through KCCL instead of InProcessGroup."""
    from kie_moe.dense.simulate import SimulatedDecoder
    sim = SimulatedDecoder(spec, weights, world, timeout)
    sim.group = KcclThreadGroup(world, timeout, capacity_bytes)
    for r in sim.ranks:
        r.coll = sim.group.handle(r.plan.rank)
    return sim


# ---- tensor / expert parallel split of a ModelSpec ----------------------------------------------------------------

def head_split(a, rank: int, world: int) -> tuple[slice, slice]:
    """-> (q head slice, kv head slice) of `rank`: whole GQA groups, or a share of one group (its kv head
    duplicated). Shared by this simulation and the tensor-parallel monokernel (kernels/monokernel/shard.py)."""
    if a.kind != "gqa":
        raise ConfigError(f"tensor parallel: {a.kind!r} attention is not split yet (gqa only)")
    if a.qk_norm == "full":
        raise ConfigError("tensor parallel: qk_norm='full' normalises the whole projection across heads")
    if a.num_heads % world:
        raise ConfigError(f"tensor parallel: {world} ranks cannot split num_heads={a.num_heads}")
    hq, rep = a.num_heads // world, a.num_heads // a.num_kv_heads
    if hq % rep and rep % hq:
        raise ConfigError(f"tensor parallel: {world} ranks: {hq} q heads per rank straddle kv groups of {rep}")
    q0 = rank * hq
    return slice(q0, q0 + hq), slice(q0 // rep, (q0 + hq - 1) // rep + 1)


def col_split(n: int, rank: int, world: int, what: str) -> slice:
    """Columns of `rank` when `world` ranks split n evenly (ConfigError naming `what` otherwise)."""
    if n % world:
        raise ConfigError(f"tensor parallel: {world} ranks cannot split {what} of {n} columns")
    return slice(rank * n // world, (rank + 1) * n // world)


def owns_expert(e: int, num_experts: int, rank: int, world: int) -> bool:
    return e * world // num_experts == rank


def vocab_piece(vocab: int, rank: int, world: int) -> slice:
    """Contiguous pieces of ceil(V/N) rows (the last may be short or empty: all-gather pads it)."""
    per = -(-vocab // world)
    return slice(min(rank * per, vocab), min((rank + 1) * per, vocab))


def rank_weights(spec: ModelSpec, weights, rank: int, world: int, device="cpu",
                 dtype=torch.float32) -> tuple[ModelSpec, dict]:
    """-> (rank's spec; name -> tensor of the rank's slices only, on `device`): the tensor-parallel monokernel's own
    split (kernels/monokernel/shard.shard) with whole experts per rank (expert parallel: owns_expert), and the LM
    head cut to this rank's vocab piece. The reference decoder below runs GQA only."""
    from kie_moe.kernels.monokernel.shard import shard
    if any(lay.attn.kind != "gqa" for lay in spec.layers):
        raise ConfigError(f"tensor parallel: {spec.layers[0].attn.kind!r} attention is not split yet in the torch "
                          "reference ranks (gqa only; the GPU monokernel splits MLA)")
    rspec, store = shard(spec, weights, rank, world, experts="ep" if any(lay.moe for lay in spec.layers) else None)
    w = {n: store.get(n).to(device, dtype) for n in store.names()}
    w["lm_head"] = w.get("lm_head", w["embed"])[vocab_piece(spec.vocab_size, rank, world)]
    return rspec, w


class _DictWeights:
    def __init__(self, d: dict):
        self.d = d

    def names(self):
        return list(self.d)

    def get(self, name):
        return self.d[name]


class TpRankDecoder(ReferenceDecoder):
    """One rank: ReferenceDecoder on its slices, with an all-reduce after each sublayer. forward(ids [S]) ->
    logits [S, V] (identical on every rank: the pieces are all-gathered)."""

    def __init__(self, spec: ModelSpec, weights, rank: int, world: int, coll, device="cpu", dtype=None):
        self.full_spec, self.rank, self.world, self.coll = spec, rank, world, coll
        dtype = dtype or (torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16)
        rspec, w = rank_weights(spec, weights, rank, world, device, dtype)
        super().__init__(rspec, _DictWeights(w), device, dtype)

    def _expert(self, i, moe, e, x):
        if not owns_expert(e, moe.num_experts, self.rank, self.world):
            return torch.zeros(x.shape[0], self.spec.hidden_size, dtype=x.dtype, device=x.device)   # another rank adds it
        return super()._expert(i, moe, e, x)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        spec, start = self.spec, self.pos
        x = self.w["embed"][ids.to(self.device)]                              # [S, D], replicated
        for i, lay in enumerate(spec.layers):
            h = rms_norm(x, self.p(i, "attn_norm"), spec.norm_eps)
            x = x + self.coll.all_reduce_sum(self._gqa(i, lay, h, start))    # partial over this rank's heads
            h = rms_norm(x, self.p(i, "mlp_norm"), spec.norm_eps)
            part = self._moe(i, lay.moe, h) if lay.moe is not None else self._swiglu(i, "mlp", h)
            x = x + self.coll.all_reduce_sum(part)                            # partial over columns / experts
        self.pos += ids.shape[0]
        x = rms_norm(x, self.w["final_norm"], spec.norm_eps)
        piece = linear(x, self.w["lm_head"]).float()                          # [S, V/N piece]
        per = -(-spec.vocab_size // self.world)
        pad = torch.nn.functional.pad(piece, (0, per - piece.shape[1]))       # equal shapes for the gather
        got = self.coll.all_gather(pad)                                       # [N, S, per]
        return got.permute(1, 0, 2).reshape(ids.shape[0], -1)[:, :spec.vocab_size]


class TpSimulatedDecoder:
    """N TpRankDecoders in threads over KCCL: forward(ids [S]) -> logits [S, V], reset(); checks every rank got
    bit-identical logits and returns rank 0's."""

    def __init__(self, spec: ModelSpec, weights, world: int, timeout: float = 60.0, capacity_bytes: int = 1 << 16):
        self.spec, self.world = spec, world
        self.group = KcclThreadGroup(world, timeout, capacity_bytes)
        self.ranks = [TpRankDecoder(spec, weights, r, world, self.group.handle(r)) for r in range(world)]

    def reset(self):
        for r in self.ranks:
            r.reset()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: list = [None] * self.world
        errors: list[BaseException] = []

        def run(r: int):
            try:
                out[r] = self.ranks[r].forward(ids)
            except BaseException as e:           # wake the others (their waits abort) and report the first cause
                errors.append(e)
                self.group.abort()

        threads = [threading.Thread(target=run, args=(r,), name=f"tp-rank-{r}") for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise ([e for e in errors if not isinstance(e, KcclAborted)] or errors)[0]
        for r in range(1, self.world):
            if not torch.equal(out[r], out[0]):
                raise RuntimeError(f"rank {r}'s logits differ from rank 0's")
        return out[0]
