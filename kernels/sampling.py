"""On-device sampling of one logits vector [V]: greedy, temperature (Gumbel-max), top-k, top-p. No host sync.

Two program kinds (two launches here, two task kinds in the monokernel):

  tile   (vocab tile t, draw d): over BLOCK_V logits -> the tile's (max, argmax) for greedy; with temperature T > 0
         the tile's argmax of y + g (y = logits / T, g = Gumbel noise) and its (max y, sum e^(y - max)) for the
         softmax normaliser; with FILTER its top-K_CAND logits as packed int64 keys (tl.topk, a bitonic top-k).
  final  (draw d): reduces the tiles -> token id into out[d] (+ ring[step % R]), and advances the step.

Greedy ties go to the lowest index, like torch.argmax (tl.argmax breaks ties left in a tile, and the tile reduction
prefers the lowest tile). A NaN or +inf logit anywhere makes the token -1 (greedy and sampled alike): the tile
marks its argmax -1 and the final program passes that on, so a broken model is never read as a real token (argmax
over NaN would be some index, often an EOS); the caller stops there (engine.Engine.stream raises). -inf is a
valid logit (a masked token).

Temperature sampling is Gumbel-max: argmax_i(y_i + g_i) with g_i = -log(-log u_i) is distributed as softmax(y), so
sampling is a max-reduction like greedy, with no sort and no normalisation. u_i comes from Philox keyed by the
seed with counter (i, step): reproducible per (seed, step), independent across steps, and the same u_i whichever
program computes it. seed and step live in a device int64 [2] tensor (`rng`), T / top_p / top_k in a device
float32 [3] tensor (`params`), so one CUDA graph serves every request; the final program bumps the step.

Top-k / top-p (FILTER=True), in-kernel. The final program sorts the union of the tiles' top-K_CAND candidates
(n_tiles * K_CAND keys). Exact cases:
  * top-k with k <= K_CAND (the global top k lie in the union), optionally followed by top-p within them;
  * top-p alone whenever the nucleus lies in the part of the union that is known complete: every logit above
    t* = max over tiles of the tile's K_CAND-th largest logit is in the union, so if the union's sorted prefix
    above t* already holds top_p of the mass (normaliser over the whole vocab from the tile sums), the cut is exact.
    Always true when the nucleus has <= K_CAND tokens; usually true far beyond.
Otherwise (a nucleus wider than the candidates, or k > K_CAND) the draw falls back to plain temperature sampling
over the whole vocab and atomically counts one in `status[0]`; a caller that needs exact top-p there uses
`sample_probs_ref` + torch.multinomial on the host (a torch.sort path, not capturable in a CUDA graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kie_moe.models.errors import InputError

from .pdl import launch_kw, pdl_begin

__all__ = ["DeviceSampler", "sample_tokens", "sample_probs_ref", "sample_tile_task", "sample_final_task",
           "next_step_inputs", "next_step_inputs_ref"]


# ---- device helpers ----------------------------------------------------------------------------------------------

@triton.jit
def _gumbel(seed, ctr, idx):
    """Gumbel(0, 1) noise, [DRAWS, N]: Philox(seed; counter = (vocab id, step lo, step hi, 0)).

    ctr [DRAWS, 1] int64 steps, idx [1, N] int32 vocab ids; the same (seed, step, id) always gives the same noise.
    """
    c0 = (idx + ctr * 0).to(tl.uint32)
    c1 = ((ctr & 0xFFFFFFFF) + idx * 0).to(tl.uint32)
    c2 = ((ctr >> 32) + idx * 0).to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, c0 * 0)
    u = tl.random.uint_to_uniform_float(r)          # [0, 1): u == 0 gives -inf noise, never picked
    return -tl.log(-tl.log(u))


@triton.jit
def _pack(x, idx):
    """fp32 x, int32 idx -> int64 keys whose descending order is (x descending, idx ascending)."""
    b = x.to(tl.int32, bitcast=True)
    o = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)          # monotone signed int image of the float
    return (o.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _unpack(key):
    o = (key >> 32).to(tl.int32)
    b = tl.where(o >= 0, o, o ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True), 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32)


# ---- program shares ----------------------------------------------------------------------------------------------
# Draws: a program handles DRAWS consecutive steps (ctr = step + draw) of the same logits. Decode uses DRAWS = 1;
# tests draw thousands of samples in one program to check the distribution (the interpreter is per-program slow).
# Buffers: part_f [n_tiles, 3] fp32 = (max x, max y, sum e^(y - max y)), part_i [n_tiles] int32 = argmax x,
# cand [n_tiles, K_CAND] int64 packed keys: none depend on the draw, so draw block 0 writes them;
# gum_f / gum_i [num_draws, n_tiles] = per draw, the tile's max of y + g and its argmax.

@triton.jit
def sample_tile_task(tile, draw_block, logits_ptr, V, params_ptr, rng_ptr, part_f_ptr, part_i_ptr, cand_ptr,
                     gum_f_ptr, gum_i_ptr, n_tiles, n_draws, step_off, FILTER: tl.constexpr, K_CAND: tl.constexpr,
                     DRAWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One vocab tile of logits [V] (any float dtype) for draws [draw_block * DRAWS, +DRAWS); the noise of draw d
    is keyed by step rng[1] + step_off + d (step_off: the monokernel's step within its launch, which never writes
    rng; the graph's launches pass 0 and advance rng[1] instead)."""
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    x = tl.load(logits_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    temp = tl.load(params_ptr)
    y = x / tl.where(temp > 0, temp, 1.0)
    ymax = tl.max(y, axis=0)
    if draw_block == 0:
        bad = tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), axis=0) > 0     # NaN or +inf in this tile
        tl.store(part_f_ptr + tile * 3, tl.max(x, axis=0))
        tl.store(part_i_ptr + tile, tl.where(bad, -1, tile * BLOCK_V + tl.argmax(x, axis=0, tie_break_left=True)))
    if temp > 0:
        if draw_block == 0:
            tl.store(part_f_ptr + tile * 3 + 1, ymax)
            tl.store(part_f_ptr + tile * 3 + 2, tl.sum(tl.where(mask, tl.exp(y - ymax), 0.0), axis=0))
            if FILTER:
                top = tl.topk(_pack(x, offs), K_CAND)                               # [K_CAND], descending
                tl.store(cand_ptr + tile * K_CAND + tl.arange(0, K_CAND), top)
        draws = draw_block * DRAWS + tl.arange(0, DRAWS)
        ctr = (tl.load(rng_ptr + 1) + step_off + draws)[:, None]                   # [DRAWS, 1]
        z = tl.where(mask[None, :], y[None, :] + _gumbel(tl.load(rng_ptr), ctr, offs[None, :]), -float("inf"))
        dmask = draws < n_draws
        tl.store(gum_f_ptr + draws * n_tiles + tile, tl.max(z, axis=1), mask=dmask)
        tl.store(gum_i_ptr + draws * n_tiles + tile, tile * BLOCK_V + tl.argmax(z, axis=1, tie_break_left=True),
                 mask=dmask)


@triton.jit
def sample_final_task(draw_block, params_ptr, rng_ptr, part_f_ptr, part_i_ptr, cand_ptr, gum_f_ptr, gum_i_ptr,
                      out_ptr, ring_ptr, status_ptr, n_tiles, n_draws, ring_size, step_off, FILTER: tl.constexpr,
                      K_CAND: tl.constexpr, HAS_RING: tl.constexpr, ADVANCE: tl.constexpr, DRAWS: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Reduce the tiles -> out[draw] int32 for DRAWS draws (also returned: [DRAWS]). BLOCK_T >= n_tiles, BLOCK_C >=
    n_tiles * K_CAND; step_off as in sample_tile_task."""
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tiles
    draws = draw_block * DRAWS + tl.arange(0, DRAWS)
    dmask = draws < n_draws
    gmax = tl.load(part_f_ptr + offs_t * 3, mask=mask_t, other=-float("inf"))
    gidx = tl.load(part_i_ptr + offs_t, mask=mask_t, other=0)
    gbest = tl.argmax(gmax, axis=0, tie_break_left=True)            # lowest tile among equal maxima
    token = tl.zeros([DRAWS], tl.int32) + tl.sum(tl.where(offs_t == gbest, gidx, 0), axis=0)
    temp = tl.load(params_ptr)
    step = tl.load(rng_ptr + 1) + step_off
    if temp > 0:
        m2 = dmask[:, None] & mask_t[None, :]
        zmax = tl.load(gum_f_ptr + draws[:, None] * n_tiles + offs_t[None, :], mask=m2, other=-float("inf"))
        zidx = tl.load(gum_i_ptr + draws[:, None] * n_tiles + offs_t[None, :], mask=m2, other=0)
        zbest = tl.argmax(zmax, axis=1, tie_break_left=True)                      # [DRAWS]
        token = tl.sum(tl.where(offs_t[None, :] == zbest[:, None], zidx, 0), axis=1)
        if FILTER:
            top_p = tl.load(params_ptr + 1)
            top_k = tl.load(params_ptr + 2).to(tl.int32)
            if (top_k > 0) | (top_p < 1.0):
                token = _filtered_draw(token, temp, top_p, top_k, step + draws, tl.sum(dmask.to(tl.int32), axis=0),
                                       rng_ptr, part_f_ptr, mask_t, cand_ptr, status_ptr, n_tiles,
                                       K_CAND, BLOCK_T, BLOCK_C)
    token = tl.where(tl.min(gidx, axis=0) < 0, -1, token)   # a tile saw NaN / +inf (masked tiles read 0)
    tl.store(out_ptr + draws, token, mask=dmask)
    if HAS_RING:
        tl.store(ring_ptr + (step + draws) % ring_size, token, mask=dmask)
    if ADVANCE:
        tl.store(rng_ptr + 1, step + 1)
    return token


@triton.jit
def _filtered_draw(fallback, temp, top_p, top_k, ctr, n_draws_here, rng_ptr, part_f_ptr, mask_t, cand_ptr, status_ptr,
                   n_tiles, K_CAND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Top-k then top-p over the sorted candidate union, then Gumbel-max over the kept set (see module doc).

    fallback [DRAWS]: the unfiltered temperature draws, used when the filter cannot be applied exactly.
    """
    offs_c = tl.arange(0, BLOCK_C)
    n_cand = n_tiles * K_CAND
    keys = tl.load(cand_ptr + offs_c, mask=offs_c < n_cand, other=-9223372036854775807 - 1)
    keys = tl.sort(keys, descending=True)
    x, idx = _unpack(keys)                       # padding sorts last and unpacks to NaN: masked by `valid`
    valid = (offs_c < n_cand) & (x > -float("inf"))
    x = tl.where(valid, x, -float("inf"))
    y = x / temp
    ymax = tl.max(y, axis=0)                      # the global max is always a candidate
    kth = tl.sum(tl.where(offs_c == top_k - 1, x, 0.0), axis=0)
    kth = tl.where((top_k > 0) & (top_k <= n_cand), kth, -float("inf"))
    keep = valid & (x >= kth)                     # ties at the k-th value are kept, as in the reference
    e = tl.where(keep, tl.exp(y - ymax), 0.0)
    # normaliser: over the top-k set, or (top-p alone) over the whole vocab from the tile sums
    t_max = tl.load(part_f_ptr + tl.arange(0, BLOCK_T) * 3 + 1, mask=mask_t, other=-float("inf"))
    t_sum = tl.load(part_f_ptr + tl.arange(0, BLOCK_T) * 3 + 2, mask=mask_t, other=0.0)
    z_full = tl.sum(tl.where(mask_t, t_sum * tl.exp(t_max - ymax), 0.0), axis=0)
    Z = tl.where(top_k > 0, tl.sum(e, axis=0), z_full)
    p = e / Z
    cum = tl.cumsum(p, axis=0)
    keep = keep & (cum - p < top_p)              # smallest prefix reaching top_p; the first token always stays
    # exactness: the union is complete above t* = max over tiles of the tile's K_CAND-th logit
    last = tl.load(cand_ptr + tl.arange(0, BLOCK_T) * K_CAND + K_CAND - 1, mask=mask_t,
                   other=-9223372036854775807 - 1)
    t_last, _ = _unpack(last)
    t_star = tl.max(tl.where(mask_t, t_last, -float("inf")), axis=0)
    covered = tl.sum(tl.where(valid & (x > t_star), p, 0.0), axis=0) >= top_p
    exact = ((top_k > 0) & (top_k <= K_CAND)) | ((top_k == 0) & covered)
    z = tl.where(keep[None, :], y[None, :] + _gumbel(tl.load(rng_ptr), ctr[:, None], idx[None, :]),
                 -float("inf"))                                                     # [DRAWS, BLOCK_C]
    best = tl.argmax(z, axis=1, tie_break_left=True)
    token = tl.sum(tl.where(offs_c[None, :] == best[:, None], idx[None, :], 0), axis=1)
    tl.atomic_add(status_ptr, tl.where(exact, 0, n_draws_here))
    return tl.where(exact, token, fallback)


@triton.jit
def _sample_tile_kernel(logits_ptr, V, params_ptr, rng_ptr, part_f_ptr, part_i_ptr, cand_ptr, gum_f_ptr, gum_i_ptr,
                        n_tiles, n_draws, FILTER: tl.constexpr, K_CAND: tl.constexpr, DRAWS: tl.constexpr,
                        BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    sample_tile_task(tl.program_id(0), tl.program_id(1), logits_ptr, V, params_ptr, rng_ptr, part_f_ptr, part_i_ptr,
                     cand_ptr, gum_f_ptr, gum_i_ptr, n_tiles, n_draws, 0, FILTER, K_CAND, DRAWS, BLOCK_V)


@triton.jit
def _sample_final_kernel(params_ptr, rng_ptr, part_f_ptr, part_i_ptr, cand_ptr, gum_f_ptr, gum_i_ptr, out_ptr,
                         ring_ptr, status_ptr, n_tiles, n_draws, ring_size, FILTER: tl.constexpr,
                         K_CAND: tl.constexpr, HAS_RING: tl.constexpr, ADVANCE: tl.constexpr, DRAWS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    sample_final_task(tl.program_id(0), params_ptr, rng_ptr, part_f_ptr, part_i_ptr, cand_ptr, gum_f_ptr, gum_i_ptr,
                      out_ptr, ring_ptr, status_ptr, n_tiles, n_draws, ring_size, 0, FILTER, K_CAND, HAS_RING,
                      ADVANCE, DRAWS, BLOCK_T, BLOCK_C)


# ---- host side ---------------------------------------------------------------------------------------------------

def needs_filter(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether a draw takes the top-k / top-p path (FILTER): greedy ignores both."""
    return temperature > 0 and (top_k > 0 or top_p < 1.0)


class DeviceSampler:
    """Device-resident sampling state for one stream of decode steps; `__call__` only launches.

    params f32 [3] = (temperature, top_p, top_k); rng i64 [2] = (seed, step); out i32 [num_draws]; ring i32 [R]
    (optional: token of step s lands in ring[s % R]; host_ring: the ring in pinned host memory the kernel writes
    through, so the host reads tokens without a copy launch); status i32 [1] counts draws whose top-k / top-p could
    not be applied exactly in-kernel (see the module doc). `configure` writes params / rng from the host (outside any
    graph); each call advances rng[1] on the device when num_draws == 1.
    """

    def __init__(self, vocab_size: int, device, *, filter: bool = True, k_cand: int = 64, block_v: int | None = None,
                 ring_size: int = 0, num_draws: int = 1, draws_per_prog: int = 16, host_ring: bool = False):
        if vocab_size < 1 or num_draws < 1:
            raise ValueError(f"vocab_size and num_draws must be >= 1, got {vocab_size}, {num_draws}")
        # greedy / plain temperature want many small tiles (parallel reads); the filter wants fewer, larger tiles
        # (the final program sorts n_tiles * k_cand candidates)
        block_v = block_v or (8192 if filter else 2048)
        for name, val in (("k_cand", k_cand), ("block_v", block_v)):
            if val < 1 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two, got {val}")
        self.V, self.device = vocab_size, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N; compare exactly
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.block_v = min(block_v, triton.next_power_of_2(vocab_size))
        self.filter, self.num_draws = filter, num_draws
        self.k_cand = min(k_cand, self.block_v)
        self.n_tiles = triton.cdiv(vocab_size, self.block_v)
        dev = self.device
        self.params = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float32, device=dev)
        self.rng = torch.zeros(2, dtype=torch.int64, device=dev)
        self.out = torch.zeros(num_draws, dtype=torch.int32, device=dev)
        self.status = torch.zeros(1, dtype=torch.int32, device=dev)
        if host_ring and ring_size < 1:
            raise ValueError("host_ring needs ring_size >= 1")
        self.ring = (torch.zeros(ring_size, dtype=torch.int32, pin_memory=True) if host_ring and dev.type == "cuda"
                     else torch.zeros(max(ring_size, 1), dtype=torch.int32, device=dev))
        self.ring_size = ring_size
        self.part_f = torch.empty(self.n_tiles, 3, dtype=torch.float32, device=dev)
        self.part_i = torch.empty(self.n_tiles, dtype=torch.int32, device=dev)
        self.gum_f = torch.empty(num_draws, self.n_tiles, dtype=torch.float32, device=dev)
        self.gum_i = torch.empty(num_draws, self.n_tiles, dtype=torch.int32, device=dev)
        self.cand = torch.empty(self.n_tiles, self.k_cand if filter else 1, dtype=torch.int64, device=dev)
        # draws per program: 1 for decode; a block for many-draw calls (tests), capped at 16K noise values per
        # program on the GPU so [DRAWS, BLOCK_V] / [DRAWS, BLOCK_C] stay in registers (the interpreter has no cap)
        cap = 1 << 30 if dev.type == "cpu" else max(1, 16384 // max(self.block_v, self.n_tiles * self.k_cand))
        dpp = 1 if num_draws == 1 else min(triton.next_power_of_2(num_draws), max(1, draws_per_prog), cap)
        self.draws_per_prog = 1 << (dpp.bit_length() - 1)                  # tl.arange needs a power of two

    @property
    def block_t(self) -> int:
        """The final task's BLOCK_T (>= n_tiles)."""
        return triton.next_power_of_2(self.n_tiles)

    @property
    def block_c(self) -> int:
        """The final task's BLOCK_C (>= the n_tiles * k_cand candidates; 1 without the filter)."""
        return triton.next_power_of_2(self.n_tiles * self.k_cand) if self.filter else 1

    def configure(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  step: int = 0) -> "DeviceSampler":
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
        if needs_filter(temperature, top_k, top_p) and not self.filter:
            raise ValueError("top_k / top_p need a DeviceSampler built with filter=True")
        if top_k > self.k_cand and temperature > 0:   # a user's option: one line, exit 2 (greedy ignores it)
            raise InputError(f"top_k {top_k}: the GPU sampler keeps {self.k_cand} candidates per vocab tile, so "
                             f"top-k above {self.k_cand} is not supported on the GPU backends (--backend reference "
                             f"takes any k)")
        self.params.copy_(torch.tensor([temperature, top_p, float(top_k)], dtype=torch.float32))
        self.rng.copy_(torch.tensor([seed & ((1 << 63) - 1), step], dtype=torch.int64))
        self.status.zero_()          # counts this request's fallback draws (fallbacks())
        return self

    def fallbacks(self) -> int:
        """Draws since configure() that fell back to plain temperature sampling (a top-p nucleus wider than the
        candidates): the host reads status, so this waits for the draws queued so far."""
        return int(self.status[0])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] fp32 / bf16 / fp16 on the sampler's device -> self.out (int32 [num_draws]; -1 where the
        logits hold a NaN or +inf: module docstring)."""
        if logits.dim() != 1 or logits.shape[0] != self.V or logits.device != self.device or logits.stride(0) != 1:
            raise ValueError(f"logits: expected a contiguous [{self.V}] vector on {self.device}, got "
                             f"{tuple(logits.shape)} on {logits.device}")
        if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"logits: dtype {logits.dtype} is not fp32 / bf16 / fp16")
        D, DR = self.num_draws, self.draws_per_prog
        grid_d = triton.cdiv(D, DR)
        _sample_tile_kernel[(self.n_tiles, grid_d)](
            logits, self.V, self.params, self.rng, self.part_f, self.part_i, self.cand, self.gum_f, self.gum_i,
            self.n_tiles, D, FILTER=self.filter, K_CAND=self.k_cand, DRAWS=DR, BLOCK_V=self.block_v, num_warps=8,
            **launch_kw(self.device))
        _sample_final_kernel[(grid_d,)](
            self.params, self.rng, self.part_f, self.part_i, self.cand, self.gum_f, self.gum_i, self.out, self.ring,
            self.status, self.n_tiles, D, max(self.ring_size, 1), FILTER=self.filter, K_CAND=self.k_cand,
            HAS_RING=self.ring_size > 0, ADVANCE=D == 1, DRAWS=DR, BLOCK_T=self.block_t, BLOCK_C=self.block_c,
            num_warps=8,
            **launch_kw(self.device))
        return self.out


@triton.jit
def _next_step_kernel(out_ptr, token_ptr, pos_ptr, embed_ptr, stride_e, x_ptr, D, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """grid (cdiv(D, BLOCK),): token = max(out[0], 0); x[D] = embed[token] (fp32); program 0 stores token and bumps
    pos. out keeps -1 (non-finite logits) for the host; the next step embeds a valid id."""
    pdl_begin(PDL)
    tok = tl.maximum(tl.load(out_ptr), 0)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(embed_ptr + tok.to(tl.int64) * stride_e + offs, mask=offs < D, other=0.0)
    tl.store(x_ptr + offs, v.to(tl.float32), mask=offs < D)
    if pid == 0:
        tl.store(token_ptr, tok)
        tl.store(pos_ptr, tl.load(pos_ptr) + 1)


def next_step_inputs(out: torch.Tensor, token: torch.Tensor, pos: torch.Tensor, embed: torch.Tensor,
                     x: torch.Tensor, block: int = 1024) -> None:
    """A decode step's tail in one launch (the graph backend): the draw out[0] becomes the next step's token (-1,
    non-finite logits, embeds as 0), x = embed[token] in fp32, pos += 1. out / token / pos: device int32 [1];
    embed [V, D] with unit column stride; x fp32 [D]. Launches only (next_step_inputs_ref: the same in torch)."""
    if embed.dim() != 2 or embed.stride(1) != 1:
        raise ValueError(f"next_step_inputs: embed must be [V, D] with unit column stride, got {tuple(embed.shape)} "
                         f"strides {embed.stride()}")
    D = embed.shape[1]
    for name, t, dt, n in (("out", out, torch.int32, None), ("token", token, torch.int32, 1),
                           ("pos", pos, torch.int32, 1), ("x", x, torch.float32, D)):
        if (t.dtype != dt or t.device != embed.device or not t.is_contiguous()
                or (t.numel() != n if n else t.numel() < 1)):
            raise ValueError(f"next_step_inputs: {name} must be a contiguous {dt} tensor with {n or 'at least 1'} "
                             f"element(s) on {embed.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    block = min(block, triton.next_power_of_2(D))
    _next_step_kernel[(triton.cdiv(D, block),)](out, token, pos, embed, embed.stride(0), x, D, BLOCK=block,
                                                **launch_kw(embed.device))


def next_step_inputs_ref(out: torch.Tensor, token: torch.Tensor, pos: torch.Tensor, embed: torch.Tensor,
                         x: torch.Tensor) -> None:
    """next_step_inputs in torch (four launches: clamp, add, gather, copy)."""
    torch.clamp(out[:1], min=0, out=token)
    pos.add_(1)
    x.copy_(embed.index_select(0, token.long()).view(-1))


def sample_tokens(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, step: int = 0, num_draws: int = 1, k_cand: int = 64,
                  block_v: int | None = None, draws_per_prog: int = 16) -> torch.Tensor:
    """Convenience: draws for steps step .. step + num_draws - 1 from one logits vector -> int32 [num_draws]."""
    s = DeviceSampler(logits.shape[-1], logits.device, filter=bool(top_k or top_p < 1), k_cand=k_cand,
                      block_v=block_v, num_draws=num_draws, draws_per_prog=draws_per_prog)
    s.configure(temperature, top_k, top_p, seed, step)
    return s(logits).clone()


def sample_probs_ref(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution that sampling draws from, by kie_moe.sampling's rules (torch.sort path) -> probs [V].

    temperature == 0: one-hot at torch.argmax (lowest index among ties).
    """
    if temperature == 0:
        return torch.nn.functional.one_hot(torch.argmax(logits.float()), logits.shape[-1]).float()
    x = logits.float() / temperature
    if top_k:
        kth = torch.topk(x, min(top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)
