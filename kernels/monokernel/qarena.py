"""Quantized weights of the monokernel: one format per model (fp8, fp8-block, nvfp4 or mxfp4, kernels/tiles.py's
FMT_ID), packed into three device buffers beside the float arena:

  qw   u8   codes: e4m3 bytes [out, in] or packed e2m1 [out, in/2] (rows of a fused group back to back; the fp4
            Linears only tensor-core tasks read in packing "mma", kernels/weights.mma_bytes: `packed`)
  qs8  u8   fp4 group scales [out, in/G]: e4m3 bytes (nvfp4, G=16) or E8M0 (mxfp4, G=32)
  qf32 fp32 fp8-block scales expanded to one row per weight row [out, ceil(in/128)] (the kernel may then tile
            rows anywhere; +3% bytes), and per-row factors: fp8's row scale, nvfp4's 2^14 / global scale

Offsets (layer table): codes in bytes, fp4 scales in bytes, fp32 entries in elements; every group starts on a
128-byte / 64-element boundary so the kernel can say so (tl.multiple_of) and vectorise its loads.
Quantized tensors come as quant.schemes.QuantizedTensor (compressed-tensors layout: weight / weight_packed,
weight_scale, weight_global_scale); `dequant` gives the float weight back for the torch prefill and the tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..weights import checkpoint_bytes, mma_bytes

FMT_ID = {"fp8": 1, "fp8-block": 2, "fp8_block": 2, "nvfp4": 3, "mxfp4": 4}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


def row_bytes(fmt: int, k: int) -> int:
    return k // 2 if fmt >= 3 else k


def scale_cols(fmt: int, k: int) -> int:
    return {2: -(-k // 128), 3: k // 16, 4: k // 32}.get(fmt, 0)


@dataclass
class QArena:
    fmt: int
    w: int = 0          # bytes of qw
    s8: int = 0         # bytes of qs8
    f32: int = 0        # elements of qf32
    entries: dict = field(default_factory=dict)   # name -> (w_off, s_off, f_off, out, in)
    packed: frozenset = frozenset()                # fp4 Linears whose codes are stored in packing "mma"

    def add(self, names_shapes: list[tuple[str, tuple[int, int]]]) -> tuple[int, int, int]:
        """Place a fused group (q|k|v, gate|up, an expert stack: all with one `in`) back to back; -> offsets of
        its first row's (codes, scales, factors): scales in bytes of qs8 (fp4) or elements of qf32 (fp8-block)."""
        fmt = self.fmt
        k = names_shapes[0][1][1]
        n_rows = sum(shape[0] for _, shape in names_shapes)
        w0 = _up(self.w, 128)
        if fmt == 2:
            s0 = _up(self.f32, 64)
            f0 = _up(s0 + n_rows * scale_cols(2, k), 64)
        elif fmt >= 3:
            s0, f0 = _up(self.s8, 128), _up(self.f32, 64)
        else:
            s0, f0 = 0, _up(self.f32, 64)
        w, s_off, f = w0, s0, f0
        for name, (out, inp) in names_shapes:
            if inp != k:
                raise ValueError(f"monokernel: {name} in={inp} differs from its fused group's {k}")
            if fmt >= 3 and inp % (16 if fmt == 3 else 32):
                raise ValueError(f"monokernel: {name} in={inp} is not a multiple of the fp4 group")
            self.entries[name] = (w, s_off, f, out, inp)
            w += out * row_bytes(fmt, inp)
            s_off += out * scale_cols(fmt, inp)
            f += out if fmt in (1, 3) else 0
        self.w = w
        if fmt >= 3:
            self.s8 = s_off
        self.f32 = max(self.f32, s_off if fmt == 2 else 0, f)
        return w0, s0, f0

    def allocate(self, device) -> dict:
        return dict(qw=torch.zeros(_up(max(self.w, 16), 16), dtype=torch.uint8, device=device),
                    qs8=torch.zeros(_up(max(self.s8, 16), 16), dtype=torch.uint8, device=device),
                    qf32=torch.zeros(max(self.f32, 4), dtype=torch.float32, device=device))

    def fill(self, bufs: dict, name: str, qt) -> None:
        """Copy one QuantizedTensor (compressed-tensors names) into its place."""
        w_off, s_off, f_off, out, inp = self.entries[name]
        t = qt.tensors
        fmt = self.fmt
        if FMT_ID.get(qt.scheme) != fmt:
            raise ValueError(f"monokernel: {name} is {qt.scheme}, the plan packs format {fmt}")
        codes = t["weight_packed"] if fmt >= 3 else t["weight"].view(torch.uint8)
        if name in self.packed:
            codes = mma_bytes(codes)
        bufs["qw"][w_off:w_off + codes.numel()].copy_(codes.reshape(-1))
        if fmt == 1:
            bufs["qf32"][f_off:f_off + out].copy_(t["weight_scale"].reshape(out).float())
        elif fmt == 2:
            nkb = scale_cols(2, inp)
            s = t["weight_scale"].float().repeat_interleave(128, dim=0)[:out]          # [out, nkb]
            bufs["qf32"][s_off:s_off + out * nkb].copy_(s.reshape(-1))
        else:
            sc = t["weight_scale"]
            sc = sc.view(torch.uint8) if sc.dtype != torch.uint8 else sc
            bufs["qs8"][s_off:s_off + sc.numel()].copy_(sc.reshape(-1))
            if fmt == 3:
                bufs["qf32"][f_off:f_off + out].fill_(16384.0 / float(t["weight_global_scale"].reshape(-1)[0]))

    def dequant(self, bufs: dict, name: str) -> torch.Tensor:
        """fp32 [out, in] from the packed buffers (torch ops; the oracle is quant.schemes' own dequantize)."""
        w_off, s_off, f_off, out, inp = self.entries[name]
        fmt = self.fmt
        codes = bufs["qw"][w_off:w_off + out * row_bytes(fmt, inp)].view(out, row_bytes(fmt, inp))
        if fmt <= 2:
            w = codes.view(torch.float8_e4m3fn).float()
            if fmt == 1:
                return w * bufs["qf32"][f_off:f_off + out].view(out, 1)
            nkb = scale_cols(2, inp)
            s = bufs["qf32"][s_off:s_off + out * nkb].view(out, nkb).repeat_interleave(128, dim=1)[:, :inp]
            return w * s
        if name in self.packed:
            codes = checkpoint_bytes(codes)
        lut = torch.tensor(_E2M1, dtype=torch.float32, device=codes.device)
        q = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).reshape(out, inp)
        g = 16 if fmt == 3 else 32
        sc = bufs["qs8"][s_off:s_off + out * inp // g].view(out, inp // g)
        if fmt == 3:
            s = sc.view(torch.float8_e4m3fn).float() * (bufs["qf32"][f_off:f_off + out].view(out, 1) / 16384.0)
        else:
            s = torch.exp2(sc.float() - 127.0)
        return q * s.repeat_interleave(g, dim=1)
