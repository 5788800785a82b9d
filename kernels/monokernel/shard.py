"""Tensor-parallel monokernel: one model over N ranks (GPUs), each running the same persistent kernel on its shard,
exchanging partial sums through KCCL inside the kernel (no host round trip, no kernel boundary).

Split (plain TP, for models that cannot be retrained for DTP): rank r of N owns
- attention: query heads [r*Hq/N, (r+1)*Hq/N) with the kv heads they read (duplicated when Hkv < N), its
  columns of o_proj; its KV cache holds only those kv heads. MLA (DeepSeek): its heads' rows of q (or q_b) and
  kv_b and columns of o_proj; the latent projections (q_a, kv_a, their norms) replicated, so every rank computes
  the same latent and keeps its own latent cache;
- dense MLP, shared expert and (expert_split "tp", the batch-1 choice) every routed expert: columns
  [r*I/N, (r+1)*I/N) of gate / up (rows) and down (columns): tensor parallelism within each expert, so every rank
  streams 1/N of each active expert's bytes whatever the router picks; or (expert_split "ep", where I/N does not
  split into whole scale groups of the stored format, or on request) whole experts [lo, lo + n) per rank
  (`expert_range`): a slot routed elsewhere streams nothing here, its owner adds it through the same all-reduce;
- a quantized checkpoint's codes and scales cut like the float slices (QuantizedTensor.narrow; a cut inside a
  scale group is a ConfigError naming the tensor);
- biases of row-split outputs (o, down, expert down) only on rank 0 (zeros elsewhere: added once);
- the router, norms and embeddings replicated; the LM head whole, but each rank streams only its vocab piece.
A Laneformer is split by lanes instead (Delayed Tensor Parallelism, lanes.shard_lanes and lanes.py's docstring):
rank r owns lanes [r L/N, (r+1) L/N) and puts its pre-summed partials after each sublayer; a layer waits for the
other ranks' partials only d layers later (and for the same layer's only where the architecture says so).

In the kernel (kernel.py, TP constexpr), o_proj / down / expert_down tiles write their partial into this rank's
row of every rank's symmetric `recv` buffer (its own included) and signal that rank's KCCL counter of the tile; a
REDUCE task per tile waits for the N signals and adds the N rows to x in rank order, so x stays bit-identical on
every rank, and each tile's all-reduce starts as soon as that tile's partial exists while the other programs
already stream the next op's weights. LM-head tiles put their (max, argmax) the same way; every rank's sampler
picks the same token. With N = 1 the same tasks run (a put into its own region): tokens equal the unsharded
plan's bit for bit.

Ranks and memory:
- `ShardedMonokernel(model, world)`: all N ranks in this process over plain tensors of one device -- the CPU
  under TRITON_INTERPRET=1 (tests), or one GPU (N = 1). Under the interpreter a rank's launch leaves at a KCCL wait
  its peers have not satisfied yet (kernel.WAIT_YIELD); `generate` runs the ranks round robin until every one
  finished, and names the stuck tasks if a full round makes no progress.
- `TpRank` (one process per GPU, kie_moe/launch.py; one rank in one process on one GPU runs the same code): this
  rank only, its region in torch symmetric memory, peers mapped over NVLink.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from kie_moe.models.errors import ConfigError, InputError
from kie_moe.kccl.tp_sim import col_split, head_split
from kie_moe.models.spec import ModelSpec, canonical

from . import plan as P
from .runtime import MonokernelBackend

EXPERT_SPLITS = ("tp", "ep")


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of the experts rank `rank` owns under expert parallelism: contiguous blocks, as
    kccl.tp_sim.owns_expert (e * world // E == rank)."""
    lo = -(-rank * num_experts // world)
    return lo, -(-(rank + 1) * num_experts // world) - lo


def _tp_cut_unit(scheme: str | None) -> int:
    """Columns a within-expert TP cut must be a multiple of, for an expert down projection stored in `scheme`
    (its scale groups / blocks; gate / up rows: fp8-block's 128-row blocks too)."""
    return {None: 1, "fp8": 1, "fp8-block": 128, "nvfp4": 16, "mxfp4": 32}[scheme]


def expert_split(spec: ModelSpec, world: int, scheme: str | None = None, want: str | None = None) -> str:
    """How a MoE's experts are split over `world` ranks: "tp" (columns of every expert on every rank) or "ep"
    (whole experts per rank). Batch 1 streams top_k experts per layer: within-expert TP reads bytes / N on every
    rank; expert parallelism reads the chosen experts on the ranks that own them, so the slowest rank reads up to
    min(top_k, E / N) whole experts (top_k / N only when the router spreads them perfectly), and the others wait
    for it at the all-reduce. So TP is the choice wherever it can cut: each expert's intermediate size must split
    into whole scale groups of the stored format (`scheme`: 128-column blocks for fp8-block, 16 / 32 for nvfp4 /
    mxfp4); EP where it cannot (e.g. I = 768 over 8 ranks in fp8-block: 96 columns). `want` "tp" / "ep" forces one
    (an impossible one raises ConfigError naming why); None or "auto" lets it choose."""
    if want == "auto":
        want = None
    moes = [lay.moe for lay in spec.layers if lay.moe is not None]
    if not moes or world == 1:
        return want or "tp"
    m = moes[0]
    unit = _tp_cut_unit(scheme)
    tp_why = None
    if m.intermediate_size % world or (m.intermediate_size // world) % unit:
        tp_why = (f"expert intermediate size {m.intermediate_size} over {world} ranks is not a multiple of "
                  f"{unit} columns{f' ({scheme} scale groups)' if unit > 1 else ''}")
    ep_why = None if m.num_experts >= world else f"{m.num_experts} experts cannot give each of {world} ranks one"
    if want not in (None, *EXPERT_SPLITS):
        raise ConfigError(f"expert split must be one of {EXPERT_SPLITS}, got {want!r}")
    choice = want or ("tp" if tp_why is None else "ep")
    why = tp_why if choice == "tp" else ep_why
    if why:
        raise ConfigError(f"tensor parallel ({choice}): {why}")
    return choice


class DictStore:
    """A WeightStore over a dict (names(), get(), `in`): a rank's shard for build_plan. Of a quantized checkpoint
    it also hands out the shard's codes (`quantized_tensor`, which kernels.weights.stored_codes asks): the source's
    QuantizedTensor of each name cut like its float slice (`cuts`: name -> None whole, or (dim, start, length)).
    experts: (first, count) under expert parallelism (build_plan's `experts`), else None."""

    def __init__(self, d: dict, path: str = "<tensor-parallel shard>", codes=None, cuts: dict | None = None,
                 experts: tuple[int, int] | None = None):
        self.d, self.path, self.codes, self.cuts, self.experts = d, path, codes, cuts or {}, experts

    def quantized_tensor(self, name: str):
        q = self.codes(name) if self.codes is not None and name in self.d else None
        cut = self.cuts.get(name)
        if cut == "float":     # read as float by the plan (MLA's Linears): no codes
            return None
        return q if q is None or cut is None else q.narrow(*cut, what=name)

    def names(self) -> list[str]:
        return list(self.d)

    def __contains__(self, name: str) -> bool:
        return name in self.d

    def get(self, name: str) -> torch.Tensor:
        return self.d[name]


def shard(spec: ModelSpec, weights, rank: int, world: int, experts: str | None = None) -> tuple[ModelSpec, DictStore]:
    """-> (rank `rank`'s spec: its heads and intermediate sizes; a store of its slices: float tensors, and the cut
    codes of a quantized checkpoint's Linears). experts: "tp" / "ep" / None (expert_split decides)."""
    if not 0 <= rank < world:
        raise InputError(f"rank {rank} outside world {world}")
    from .plan import _default_quantized
    codes = _default_quantized(weights)
    names = set(weights.names())
    get = weights.get
    scheme = None
    if codes is not None:
        q = next((codes(n) for n in sorted(names) if ".moe.experts." in n and n.endswith(".down")), None)
        scheme = q.scheme if q is not None else None
    how = expert_split(spec, world, scheme, experts)
    cuts: dict = {}

    def cut(name, dim, sl):   # a float slice and the same cut of its codes
        cuts[name] = (dim, sl.start, sl.stop - sl.start)
        t = get(name)
        return t[sl] if dim == 0 else t[:, sl]
    w = {n: get(n) for n in ("embed", "final_norm", "lm_head") if n in names}
    layers = []
    for i, lay in enumerate(spec.layers):
        a = lay.attn
        n = lambda s: canonical(i, s)  # noqa: E731
        if a.kind == "mla":
            w.update(_mla_shard(a, i, get, names, rank, world, cuts))
            qs = _mla_heads(a, rank, world)
            ks = qs
        else:
            qs, ks = head_split(a, rank, world)
        Dh = a.head_dim
        rows = lambda s: slice(s.start * Dh, s.stop * Dh)  # noqa: E731
        for nm in ("attn_norm", "mlp_norm", "attn.q_norm", "attn.k_norm", "moe.router", "moe.router_bias",
                   "moe.score_bias", "moe.shared_gate"):
            if n(nm) in names:
                w[n(nm)] = get(n(nm))                                        # replicated
        for nm, sl in (("attn.q", qs), ("attn.k", ks), ("attn.v", ks)) if a.kind == "gqa" else ():
            w[n(nm)] = cut(n(nm), 0, rows(sl))                               # [heads*Dh, D] rows
            if n(nm + "_bias") in names:
                w[n(nm + "_bias")] = get(n(nm + "_bias"))[rows(sl)]
        if a.kind == "gqa":
            w[n("attn.o")] = cut(n("attn.o"), 1, rows(qs))                   # [D, heads*Dh] columns
        if n("attn.o_bias") in names:                                        # added once: rank 0
            b = get(n("attn.o_bias"))
            w[n("attn.o_bias")] = b if rank == 0 else torch.zeros_like(b)
        if n("attn.sinks") in names:
            w[n("attn.sinks")] = get(n("attn.sinks"))[qs]
        mlp, moe = lay.mlp, lay.moe
        groups = []                                                          # (prefix, intermediate size)
        if mlp is not None:
            groups.append(("mlp", mlp.intermediate_size))
            mlp = dataclasses.replace(mlp, intermediate_size=mlp.intermediate_size // world)
        if moe is not None:
            if how == "tp":
                groups += [(f"moe.experts.{e}", moe.intermediate_size) for e in range(moe.num_experts)]
            else:                                                            # whole experts, biases included
                lo, cnt = expert_range(moe.num_experts, rank, world)
                for e in range(lo, lo + cnt):
                    for nm in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
                        if n(f"moe.experts.{e}.{nm}") in names:
                            w[n(f"moe.experts.{e}.{nm}")] = get(n(f"moe.experts.{e}.{nm}"))
                            cuts[n(f"moe.experts.{e}.{nm}")] = None
            if moe.shared_intermediate_size:
                groups.append(("moe.shared", moe.shared_intermediate_size))
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // (world if how == "tp" else 1),
                                      shared_intermediate_size=moe.shared_intermediate_size // world)
        for pre, size in groups:                                             # column-split (GLU) MLPs
            c = col_split(size, rank, world, f"layer {i} {pre}")
            for nm in ("gate", "up"):
                w[n(f"{pre}.{nm}")] = cut(n(f"{pre}.{nm}"), 0, c)
                if n(f"{pre}.{nm}_bias") in names:
                    w[n(f"{pre}.{nm}_bias")] = get(n(f"{pre}.{nm}_bias"))[c]
            w[n(f"{pre}.down")] = cut(n(f"{pre}.down"), 1, c)
            if n(f"{pre}.down_bias") in names:
                b = get(n(f"{pre}.down_bias"))
                w[n(f"{pre}.down_bias")] = b if rank == 0 else torch.zeros_like(b)
        attn = dataclasses.replace(a, num_heads=qs.stop - qs.start,
                                   num_kv_heads=(ks.stop - ks.start) if a.kind == "gqa" else qs.stop - qs.start)
        layers.append(dataclasses.replace(lay, attn=attn, mlp=mlp, moe=moe))
    ex = None
    if how == "ep" and any(lay.moe is not None for lay in spec.layers):
        ex = expert_range(next(lay.moe for lay in spec.layers if lay.moe is not None).num_experts, rank, world)
    store = DictStore({k: v.contiguous() for k, v in w.items()}, codes=codes, cuts=cuts, experts=ex)
    return dataclasses.replace(spec, layers=tuple(layers)), store


def _mla_heads(a, rank: int, world: int) -> slice:
    if a.num_heads % world:
        raise ConfigError(f"tensor parallel: {world} ranks cannot split num_heads={a.num_heads}")
    h = a.num_heads // world
    return slice(rank * h, (rank + 1) * h)


def _mla_shard(a, i: int, get, names, rank: int, world: int, cuts: dict) -> dict:
    """Multi-head Latent Attention of layer i, split by heads: the latent projections (q_a, kv_a and their norms)
    replicated (every rank computes the same latent and writes its own cache copy), q (or q_b), kv_b rows and
    o_proj columns of this rank's heads. The monokernel keeps MLA's Linears float: no codes are cut ("float")."""
    hs = _mla_heads(a, rank, world)
    per = lambda k: slice(hs.start * k, hs.stop * k)  # noqa: E731
    out = {}
    for nm, sl, dim in (("attn.q", per(a.head_dim), 0), ("attn.q_b", per(a.head_dim), 0),
                        ("attn.kv_b", per(a.qk_nope_head_dim + a.v_head_dim), 0), ("attn.o", per(a.v_head_dim), 1),
                        ("attn.q_a", None, 0), ("attn.q_a_norm", None, 0), ("attn.kv_a", None, 0),
                        ("attn.kv_a_norm", None, 0)):
        name = canonical(i, nm)
        if name not in names:
            continue
        t = get(name)
        out[name] = t if sl is None else (t[sl] if dim == 0 else t[:, sl])
        cuts[name] = "float"
    return out


def peer_offsets(addrs: list[int], rank: int) -> torch.Tensor:
    """[N] int64: the distance in 4-byte words from rank `rank`'s region to each rank's (kccl.sync.peer)."""
    for q, a in enumerate(addrs):
        if (a - addrs[rank]) % 4:
            raise RuntimeError(f"symmetric regions of ranks {rank} and {q} are not 4-byte aligned to each other")
    return torch.tensor([(a - addrs[rank]) // 4 for a in addrs], dtype=torch.int64)


def rank_backend(model, rank: int, world: int, device, **opts) -> MonokernelBackend:
    """Rank `rank`'s MonokernelBackend: its shard's plan with the KCCL tasks; in-kernel prefill (a torch prefill
    would need the other ranks' heads)."""
    plan_keys = {"wdtype", "n_sms", "block_k", "tile_elems", "block_t", "min_task_bytes", "x_bcast",
                 "max_task_bytes", "programs_per_sm", "num_stages"}
    experts = opts.pop("expert_split", None)
    plan_opts = {k: v for k, v in opts.items() if k in plan_keys}
    be_opts = {k: v for k, v in opts.items() if k not in plan_keys}
    if model.spec.family == "laneformer":   # Delayed Tensor Parallelism: whole lanes per rank (lanes.py)
        from .lanes import shard_lanes
        rspec, store = shard_lanes(model.spec, model.weights, rank, world)
    else:
        rspec, store = shard(model.spec, model.weights, rank, world, experts)
    plan = P.build_plan(rspec, store, device, tp=(rank, world), experts=getattr(store, "experts", None),
                        **plan_opts)
    return MonokernelBackend(None, device, plan=plan, prefill="kernel", **be_opts)


class ShardedMonokernel:
    """N tensor-parallel ranks in this process (tests on the CPU interpreter; N = 1 on one GPU). Backend contract
    of kie_moe.engine: `.name`, `generate(prompt_ids, SamplingParams, eos_ids)`; every rank must produce the same
    tokens (checked)."""
    name = "monokernel-tp"

    def __init__(self, model, world: int, device="cpu", **opts):
        self.world, self.device = world, torch.device(device)
        self.ranks = [rank_backend(model, r, world, self.device, **opts) for r in range(world)]
        if world > 1 and not self.ranks[0].interpret:
            raise InputError("ShardedMonokernel: several ranks in one process run only under the interpreter "
                             "(tests); on GPUs start one process per GPU (kie ... --devices N)")
        addrs = [be.sym.data_ptr() for be in self.ranks]
        for r, be in enumerate(self.ranks):
            be.attach_symmetric(be.sym, peer_offsets(addrs, r).to(self.device))
        self.spec = model.spec

    def generate(self, prompt_ids: list[int], p, eos_ids) -> Iterator[int]:
        for be in self.ranks:        # counters only grow within a launch: every region is zeroed before any rank runs
            be.sym.zero_()
        if self.world == 1:          # one GPU (or the CPU): the ordinary launch + stream, nothing to interleave
            yield from self.ranks[0].generate(prompt_ids, p, eos_ids)
            return
        if not p.greedy and (p.top_k or p.top_p < 1.0):
            raise InputError("monokernel backend: top-k / top-p sampling is not supported (greedy or temperature)")
        n = p.max_new_tokens
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2 ** 31 - 1, (1,)))
        eos = set() if p.ignore_eos else set(eos_ids)
        for be in self.ranks:        # each runs until its first KCCL wait its peers cannot have satisfied yet
            be.launch(0, 0, n, eos, ignore_eos=p.ignore_eos, temperature=p.temperature, seed=seed,
                      forced=list(prompt_ids))
        while True:
            waiting = [(be, be.yielded_at()) for be in self.ranks if be.yielded_at() is not None]
            if not waiting:
                break
            moved = False
            for be, t in waiting:
                be.resume()
                moved |= be.yielded_at() != t
            if not moved:
                raise RuntimeError("tensor-parallel deadlock: " + "; ".join(
                    f"rank {be.plan.tp_rank} waits at {self._where(be, t)}" for be, t in waiting))
        outs = []
        for be in self.ranks:
            be.check_error()
            cnt = int(be.ring[0])
            outs.append([int(v) for v in be.ring[1:1 + cnt]])
        for r, o in enumerate(outs[1:], 1):
            if o != outs[0]:
                raise RuntimeError(f"tensor parallel: rank {r} sampled {o}, rank 0 {outs[0]}")
        yield from outs[0]

    @staticmethod
    def _where(be: MonokernelBackend, t: int) -> str:
        tasks = be._launch_tasks
        step, row = divmod(t, tasks.shape[0])
        return f"task {row} ({P.describe_task(tasks, row)}) of step {step}"


class TpRank:
    """This process's rank of a tensor-parallel monokernel on GPUs (one process per GPU, a torch.distributed group
    already initialised, e.g. kie_moe.launch.init_process_group; one rank works too, through the same code). The
    symmetric region lives in torch symmetric memory (multicast never used); the peer distances come from the
    mapped addresses of every rank's region. Backend contract: `.name`, `generate(...)` (every rank must call it
    with the same arguments; rank 0's stream is the output, the others return the same tokens)."""
    name = "monokernel-tp"

    def __init__(self, model, group=None, **opts):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        if not dist.is_initialized():
            raise InputError("TpRank needs an initialised torch.distributed group (kie ... --devices N starts one)")
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.be = rank_backend(model, self.rank, self.world, self.device, **opts)
        words = self.be.plan.sym_layout()["words"]
        # older torch needs this call; newer torch registers every group itself and deprecates it (its cache
        # would hand a group re-created under the same name the destroyed group's store)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):
            enable(self.group.group_name)
        buf = symm_mem.empty(words, dtype=torch.int32, device=self.device)
        self._hdl = symm_mem.rendezvous(buf, self.group)
        addrs = [self._hdl.get_buffer(q, (words,), torch.int32).data_ptr() for q in range(self.world)]
        self.be.attach_symmetric(buf, peer_offsets(addrs, self.rank).to(self.device))
        self.spec = model.spec

    def generate(self, prompt_ids: list[int], p, eos_ids) -> Iterator[int]:
        """Every rank: zero its region, wait for all (no rank may put before every region is zero), run the launch.
        Tokens stream as the kernel writes them. The host stop flag is per rank, so a consumer that stops early on
        rank 0 alone would leave the others waiting for its puts: the inner stream is never closed early (no
        `yield from`, which would close it), it is drained to its end on every rank instead."""
        import torch.distributed as dist
        self.be.sym.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(self.group)
        stream = self.be.generate(prompt_ids, p, eos_ids)
        try:
            for tok in stream:
                yield tok
        finally:
            for _ in stream:           # the rest of this rank's launch (nothing left after a normal end)
                pass
            torch.cuda.synchronize(self.device)
            dist.barrier(self.group)   # nobody zeroes its region for the next launch while a peer still puts
