"""What the batched prefill (kernels/prefill.py) reads: the weights a decode backend already holds, in whatever
format it holds them, plus just-in-time dequantization into reusable scratch buffers (never a float copy of the
model).

Three views share one small interface (`PrefillWeights`):
  GraphWeights  the graph backend's HandleStore: WeightHandles (float, or fp8 / fp8-block / nvfp4 / mxfp4 codes
                + scales exactly as loaded), expert stacks [E, out, in], its fused q|k|v handle
  PlanWeights   the monokernel's plan: float arena views, quantized Linears rebuilt as WeightHandle views of the
                qarena buffers (codes, scales, row factors: no copy), expert groups as stacks
  StoreWeights  any WeightStore (names / get / in), float tensors on the device: tests and the CPU

Dequantization (`dequant_into`): fp8 with per-row scales (the common FP8_DYNAMIC checkpoint and kie convert's
fp8) goes through one Triton pass on the GPU (1 byte read, 2 written per weight, scale applied in fp32 exactly as
the reference's dequantize then rounds); every other format through kernels.weights.dequantize in slices of
bounded fp32 size, copied into the scratch.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kie_moe.models.spec import canonical

from .device_caps import e4m3_arg
from .tiles import _as_f32
from .weights import FP8_BLOCK, WeightHandle, dequantize

FLOAT_FMTS = ("bf16", "fp16", "fp32")
_SLICE_ELEMS = 1 << 25            # fp32 temporaries of the generic dequantization: 128 MB at most


# ---- dequantization ----------------------------------------------------------------------------------------------

@triton.jit
def _dequant_fp8_rows_kernel(w_ptr, s_ptr, o_ptr, R, C, n_rblocks, stride_wg, stride_wr, stride_sg, stride_sr,
                             stride_og, stride_or, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """o[g, r, c] = (float(w[g, r, c]) * s[g, r]) rounded to o's dtype; grid (G * row blocks, column blocks). w: e4m3,
    or its bytes before sm_89 (device_caps)."""
    pid = tl.program_id(0)
    g = (pid // n_rblocks).to(tl.int64)
    rows = (pid % n_rblocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < R
    m = rmask[:, None] & (cols[None, :] < C)
    r64 = rows.to(tl.int64)
    w = tl.load(w_ptr + g * stride_wg + r64[:, None] * stride_wr + cols[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + g * stride_sg + r64 * stride_sr, mask=rmask, other=0.0)
    out = _as_f32(w) * s[:, None]
    tl.store(o_ptr + g * stride_og + r64[:, None] * stride_or + cols[None, :],
             out.to(o_ptr.dtype.element_ty),
             mask=m)


def dequant_fp8_rows(h: WeightHandle, out: torch.Tensor) -> torch.Tensor:
    """Triton: fp8 per-row handle ([out, in] or [G, out, in], rows contiguous) -> `out` (same shape, any float
    dtype, rows contiguous; may be a strided view such as half of a fused gate|up scratch)."""
    w = e4m3_arg(h.weight)                     # GPUs before sm_89 have no fp8e4nv type: the codes go as bytes
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    o3 = out if out.dim() == 3 else out.unsqueeze(0)
    s = h.scale.float()
    s3 = (s if s.dim() == 3 else s.unsqueeze(0))[..., 0]          # [G, out] (stride 0 rows: per-tensor)
    G, R, C = w3.shape
    if o3.shape != w3.shape or o3.stride(-1) != 1 or w3.stride(-1) != 1:
        raise ValueError(f"dequant_fp8_rows: out {tuple(out.shape)} / weight {tuple(w.shape)} need equal shapes and "
                         "contiguous rows")
    BR, BC = 16, 256
    nrb = triton.cdiv(R, BR)
    _dequant_fp8_rows_kernel[(G * nrb, triton.cdiv(C, BC))](
        w3, s3, o3, R, C, nrb, w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1), o3.stride(0), o3.stride(1),
        BLOCK_R=BR, BLOCK_C=BC)
    return out


def dequant_into(h: WeightHandle, out: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """The float weight of `h` ([.., out, in]) written into `out` (same shape; its dtype). Float handles are a
    cast copy; fp8 per-row on CUDA is one Triton pass; the rest (and the CPU) use kernels.weights.dequantize
    (fp32 math, the oracle's) over slices of at most _SLICE_ELEMS elements."""
    if h.fmt in FLOAT_FMTS:
        return out.copy_(h.weight)
    if use_triton is None:
        use_triton = h.weight.device.type == "cuda"
    if h.fmt == "fp8" and use_triton:
        return dequant_fp8_rows(h, out)
    if h.num_experts:                                  # one slice = some experts
        per = h.out_features * h.in_features
        step = max(1, _SLICE_ELEMS // per)
        for e0 in range(0, h.num_experts, step):
            e1 = min(h.num_experts, e0 + step)
            out[e0:e1].copy_(dequantize(expert_range(h, e0, e1)))
        return out
    step = max(FP8_BLOCK, _SLICE_ELEMS // h.in_features // FP8_BLOCK * FP8_BLOCK)   # rows; fp8-block aligned
    for r0 in range(0, h.out_features, step):
        r1 = min(h.out_features, r0 + step)
        out[r0:r1].copy_(dequantize(h.rows(r0, r1) if (r0, r1) != (0, h.out_features) else h))
    return out


def expert_range(h: WeightHandle, e0: int, e1: int) -> WeightHandle:
    """Experts e0:e1 of a stacked handle, still stacked (views)."""
    return dataclasses.replace(h, weight=h.weight[e0:e1], scale=None if h.scale is None else h.scale[e0:e1],
                               global_scale=None if h.global_scale is None else h.global_scale[e0:e1])


def float_view(h: WeightHandle, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight itself when it is already float of `dtype` (no scratch needed), else None."""
    return h.weight if h.fmt in FLOAT_FMTS and h.weight.dtype == dtype else None


# ---- the interface -------------------------------------------------------------------------------------------------

class PrefillWeights:
    """canonical name -> what the prefill needs. Subclasses override the lookups."""

    def linear(self, name: str) -> WeightHandle | None:
        """A Linear weight [out, in] in any format, or None when the model has no such tensor."""
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor | None:
        """A float tensor on the device (norms, biases, sinks, router, embed), or None."""
        raise NotImplementedError

    def experts(self, i: int, part: str) -> WeightHandle:
        """Layer i's routed experts' `part` ("gate", "up", "down") as one stacked handle [E, out, in]."""
        raise NotImplementedError

    def expert_bias(self, i: int, part: str, E: int) -> torch.Tensor | None:
        """[E, out] biases of the routed experts' `part`, or None."""
        bs = [self.tensor(canonical(i, f"moe.experts.{e}.{part}_bias")) for e in range(E)]
        return None if bs[0] is None else torch.stack(bs)

    def qkv(self, i: int) -> tuple[WeightHandle, torch.Tensor | None] | None:
        """Layer i's q|k|v rows as one handle (+ the fused bias) when the backend keeps them fused, else None."""
        return None

    def lm_head(self) -> WeightHandle:
        return self.linear("lm_head") or self.linear("embed")


class StoreWeights(PrefillWeights):
    """Any WeightStore (names / get / in): float tensors moved to `device` on use (tests, the CPU)."""

    def __init__(self, store, device: torch.device | str = "cpu"):
        self.store, self.device = store, torch.device(device)
        self.names = set(store.names())

    def tensor(self, name):
        return self.store.get(name).to(self.device) if name in self.names else None

    def linear(self, name):
        t = self.tensor(name)
        return None if t is None else WeightHandle.from_dense(t.contiguous())

    def experts(self, i, part):
        E = sum(1 for n in self.names if n.startswith(canonical(i, "moe.experts.")) and n.endswith(f".{part}"))
        return WeightHandle.from_dense(torch.stack([self.tensor(canonical(i, f"moe.experts.{e}.{part}"))
                                                    for e in range(E)]))


class GraphWeights(PrefillWeights):
    """The graph backend's buffers (kernels/graph.py): its HandleStore and per-layer dicts, read in place."""

    def __init__(self, backend):
        self.be, self.W = backend, backend.W

    def tensor(self, name):
        if name in self.W.dense:
            return self.W.dense[name]
        h = self.W.h.get(name)
        if h is not None and h.fmt in FLOAT_FMTS:
            return h.weight
        return self.W.vec(name)          # norms, biases, sinks: fp32 on the device, kept by the HandleStore

    def linear(self, name):
        h = self.W.h.get(name)
        if h is not None:
            return h
        if name in self.W.dense:
            t = self.W.dense[name]
            return WeightHandle.from_dense(t) if t.dim() == 2 else None
        if name not in self.W.store:
            return None
        return self.W.handle(name)

    def experts(self, i, part):
        return self.W.h[canonical(i, f"moe.{part}_stack")]

    def expert_bias(self, i, part, E):
        return self.be.layers[i].get("eb_" + part)

    def qkv(self, i):
        L = self.be.layers[i]
        return (L["qkv"], L["qkv_bias"]) if L.get("qkv") is not None else None

    def lm_head(self):
        return self.be.lm_head


class PlanWeights(PrefillWeights):
    """The monokernel plan's buffers (kernels/monokernel/plan.py + qarena.py) as views: float arena tensors, and
    quantized Linears as WeightHandles over the packed codes / scales / row factors (fp4 codes in packing "mma"
    where the plan stored them so: qarena.packed)."""

    def __init__(self, plan):
        self.plan = plan
        self.qa, self.qb = plan.qarena, plan.qbufs

    def _arena(self, name, n: int = 1):
        """Arena view of `name` (n > 1: n consecutive equal-shaped tensors from `name` on, stacked)."""
        off, shape = self.plan.arena.entries[name]
        numel = 1
        for s in shape:
            numel *= s
        t = self.plan.weights[off:off + n * numel]
        return t.view(*((n,) if n > 1 else ()), *shape)

    def _q(self, name, n: int = 1) -> WeightHandle:
        """WeightHandle over the qarena entry `name` (n > 1: that and the next n - 1 entries of its group, which
        sit back to back with equal shapes: an expert stack)."""
        from .monokernel.qarena import row_bytes, scale_cols
        w_off, s_off, f_off, out, inp = self.qa.entries[name]
        fmt, qb = self.qa.fmt, self.qb
        lead = (n,) if n > 1 else ()
        rows = n * out
        codes = qb["qw"][w_off:w_off + rows * row_bytes(fmt, inp)].view(*lead, out, row_bytes(fmt, inp))
        if fmt == 1:
            scale = qb["qf32"][f_off:f_off + rows].view(*lead, out, 1)
            return WeightHandle("fp8", codes.view(torch.float8_e4m3fn), scale, None, out, inp)
        if fmt == 2:   # scales expanded to one row per weight row: every 128th row is the block's
            nkb = scale_cols(2, inp)
            s = qb["qf32"][s_off:s_off + rows * nkb].view(*lead, out, nkb)[..., ::FP8_BLOCK, :]
            return WeightHandle("fp8_block", codes.view(torch.float8_e4m3fn), s, None, out, inp)
        g = 16 if fmt == 3 else 32
        packing = "mma" if name in self.qa.packed else "checkpoint"   # (plan.fp4_packed: a stack packs as one)
        sc = qb["qs8"][s_off:s_off + rows * (inp // g)].view(*lead, out, inp // g)
        if fmt == 3:   # row factor = 2^14 / global scale (qarena.fill), one per row
            gs = 16384.0 / qb["qf32"][f_off:f_off + rows].view(n, out)[:, 0]
            return WeightHandle("nvfp4", codes, sc.view(torch.float8_e4m3fn), gs if n > 1 else gs.reshape(1),
                                out, inp, packing)
        return WeightHandle("mxfp4", codes, sc, None, out, inp, packing)

    def tensor(self, name):
        return self._arena(name) if name in self.plan.arena.entries else None

    def linear(self, name):
        if self.qa is not None and name in self.qa.entries:
            return self._q(name)
        if name in self.plan.arena.entries:
            t = self._arena(name)
            return WeightHandle.from_dense(t) if t.dim() == 2 else None
        return None

    def experts(self, i, part):
        first = canonical(i, f"moe.experts.0.{part}")
        E = self.plan.dims.E
        if self.qa is not None and first in self.qa.entries:
            return self._q(first, E)
        return WeightHandle.from_dense(self._arena(first, E))

    def expert_bias(self, i, part, E):
        first = canonical(i, f"moe.experts.0.{part}_bias")
        return self._arena(first, E) if first in self.plan.arena.entries else None

    def qkv(self, i):
        q = canonical(i, "attn.q")
        if self.plan.dims.MLA:
            return None
        d = self.plan.dims
        n = d.HQ * d.DH + 2 * d.HKV * d.DH
        if self.qa is not None and q in self.qa.entries:
            if self.qa.fmt != 1:            # only per-row scales stay meaningful across the q|k|v seam
                return None
            w_off, _, f_off, _, inp = self.qa.entries[q]
            qb = self.qb
            h = WeightHandle("fp8", qb["qw"][w_off:w_off + n * inp].view(n, inp).view(torch.float8_e4m3fn),
                             qb["qf32"][f_off:f_off + n].view(n, 1), None, n, inp)
        else:
            off, (_, inp) = self.plan.arena.entries[q]
            h = WeightHandle.from_dense(self.plan.weights[off:off + n * inp].view(n, inp))
        qb_name = canonical(i, "attn.q_bias")
        b = None
        if qb_name in self.plan.arena.entries:
            off, _ = self.plan.arena.entries[qb_name]
            b = self.plan.weights[off:off + n]
        return h, b

    def lm_head(self):
        return self.linear("lm_head") if "lm_head" in self.plan.arena.entries else self.linear("embed")
