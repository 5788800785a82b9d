"""Every kernel variant compiles for the H200 (sm_90) on a machine without a GPU, and keeps its registers (no local
memory spills). Triton's interpreter runs the kernels' math but not the compiler: constexpr globals, layouts, inline
asm, register pressure are only checked here. Runs itself in a subprocess without TRITON_INTERPRET (the kernels of
this process are interpreter wrappers), with a stand-in driver that answers "sm_90" and compiles without launching.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _compile_all(arch: int = 90, formats=("bf16", "fp8", "fp8_block", "nvfp4", "mxfp4")) -> list[dict]:
    import torch
    import triton
    from kie_moe.kernels import gemv as G
    from kie_moe.kernels import moe as M
    from kie_moe.kernels.weights import random_weight

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cuobjdump = shutil.which("cuobjdump") or (str(bin_dir / "cuobjdump") if (bin_dir / "cuobjdump").exists() else None)
    out = []

    def record(name, k):
        row = {"name": name, "local_bytes": None, "regs": None}
        if cuobjdump:
            path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kie_{os.getpid()}.cubin"
            path.write_bytes(k.asm["cubin"])
            res = subprocess.run([cuobjdump, "-res-usage", str(path)], capture_output=True, text=True).stdout
            path.unlink()
            for tok in res.replace(",", " ").split():
                if tok.startswith("REG:"):
                    row["regs"] = int(tok[4:])
                if tok.startswith("LOCAL:"):
                    row["local_bytes"] = int(tok[6:])
        out.append(row)

    H, I, E, N = 2048, 768, 8, 4096
    x = torch.empty(H, dtype=torch.bfloat16)
    y = torch.empty(N, dtype=torch.bfloat16)
    part, cnt = torch.empty(4, N), torch.empty(N, dtype=torch.int32)
    for fmt in formats:
        cfg = G.DEFAULT_TILES[fmt]
        fid = G.FMT_ID[fmt]
        fp4 = G.is_fp4(fmt)
        w = random_weight(fmt, N, H)
        xin = torch.empty(8, H // 8) if fp4 else x
        common = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PIPE=cfg.prefetch, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, grid=(1,))
        for split in (1, 3):
            k = G._gemv_kernel.warmup(xin, xin, *G.weight_args(w), y, y, y, part, cnt, N, H, H, 1e-6, H // 8,
                                      FMT=fid, HAS_NW=not fp4, HAS_BIAS=True, HAS_RES=True, SPLIT_K=split,
                                      BLOCK_X=1024, **common)
            record(f"gemv[{fmt},split={split}]", k)
        if fmt == "bf16" and arch >= 90:   # the graph backend's launches on sm_90: griddepcontrol.wait first (pdl.py)
            k = G._gemv_kernel.warmup(xin, xin, *G.weight_args(w), y, y, y, part, cnt, N, H, H, 1e-6, H // 8,
                                      FMT=fid, HAS_NW=True, HAS_BIAS=True, HAS_RES=True, SPLIT_K=1, BLOCK_X=1024,
                                      PDL=True, launch_pdl=True, **common)
            assert "griddepcontrol.wait" in k.asm["ptx"]
            record("gemv[bf16,pdl]", k)
            # rstd's loads before the tile loop (tiles.rstd_early_steps)
            k = G._gemv_kernel.warmup(xin, xin, *G.weight_args(w), y, y, y, part, cnt, N, H, H, 1e-6, H // 8,
                                      FMT=fid, HAS_NW=True, HAS_BIAS=True, HAS_RES=True, SPLIT_K=1, BLOCK_X=1024,
                                      NX=2, **common)
            record("gemv[bf16,rstd early]", k)
        if fmt == "fp8" and arch >= 90:    # kernels/fp8_mma.py: e4m3 converts are sm_89+; one grid, one persistent
            from kie_moe.kernels.fp8_mma import _fp8_mma_kernel
            xh = torch.empty(H, dtype=torch.float16)
            for nw, persist in ((4, False), (8, True)):
                k = _fp8_mma_kernel.warmup(xh, w.weight.view(torch.uint8), H, w.scale, 1, y, y, y, N, H, 64,
                                           HAS_BIAS=True, HAS_RES=True, RB=2, NW=nw, PERSIST=persist, num_warps=nw,
                                           grid=(1,))
                assert k.asm["ptx"].count("mma.sync.aligned.m16n8k16") == 16   # 2 pieces x 2 blocks x 4 words
                record(f"fp8_mma[w{nw}{',persist' if persist else ''}]", k)
        gcfg = G.DEFAULT_GLU_TILES[fmt]
        gl = dict(BLOCK_N=gcfg.block_n, BLOCK_K=gcfg.block_k, PIPE=gcfg.prefetch, num_warps=gcfg.num_warps,
                  num_stages=gcfg.num_stages, grid=(1,))
        k = G._glu_kernel.warmup(xin, xin, *G.weight_args(w), *G.weight_args(w), y, 2, y, 2, y, N, H, 1e-6, 7.0,
                                 1.702, H // 8, FMT=fid, HAS_NW=not fp4, HAS_BIAS=True, ACT=1, BLOCK_X=1024, **gl)
        record(f"glu[{fmt}]", k)
        if fp4:      # the GLU writing its output as x8 for an fp4 down projection (graph backend, KIE_SHARE_X8)
            k = G._glu_kernel.warmup(xin, xin, *G.weight_args(w), *G.weight_args(w), y, 2, y, 2, torch.empty(8, N // 8),
                                     N, H, 1e-6, 7.0, 1.702, H // 8, FMT=fid, HAS_NW=False, HAS_BIAS=True, ACT=0,
                                     BLOCK_X=1024, Y_X8=True, **gl)
            record(f"glu[{fmt},x8 out]", k)
        wg, wd = random_weight(fmt, I, H, experts=E), random_weight(fmt, H, I, experts=E)
        ids = torch.empty(4, dtype=torch.int32)
        h = torch.empty(4, I)
        b2 = torch.empty(E, I, dtype=torch.bfloat16)
        ecfg = M.DEFAULT_EXPERT_TILES[fmt]      # the routed-expert launches' own defaults (fp8: 2 warps)
        gl = dict(BLOCK_N=ecfg.block_n, BLOCK_K=ecfg.block_k, PIPE=ecfg.prefetch, num_warps=ecfg.num_warps,
                  num_stages=ecfg.num_stages, grid=(1,))
        k = M._expert_glu_kernel.warmup(xin, xin, ids, *M._expert_args(wg), *M._expert_args(wg), b2, I, 1, b2, I, 1, h,
                                        I, H, 1e-6, 7.0, 1.702, H // 8, FMT=fid, HAS_NW=not fp4, HAS_BIAS=True,
                                        ACT=0, H_X8=fp4, BLOCK_X=1024, **gl)
        record(f"expert_glu[{fmt}]", k)
        k = M._expert_down_kernel.warmup(h, ids, h, *M._expert_args(wd), b2, H, y, y, part, cnt, H, I, 2, FMT=fid,
                                         HAS_BIAS=True, HAS_RES=True, TOP_K=4, SPLIT=2, **gl)
        record(f"expert_down[{fmt}]", k)
        if fmt == "fp8":   # the default atomic sum (a relaxed red.add) beside the ordered one above
            k = M._expert_down_kernel.warmup(h, ids, h, *M._expert_args(wd), b2, H, y, y, part, cnt, H, I, 2,
                                             FMT=fid, HAS_BIAS=True, HAS_RES=True, TOP_K=4, SPLIT=2, ATOMIC=True, **gl)
            record(f"expert_down[{fmt},atomic]", k)
    wr = torch.empty(256, 7168, dtype=torch.bfloat16)
    xr = torch.empty(7168, dtype=torch.bfloat16)
    part = torch.empty(4, 256)
    ids, wts, lg = torch.empty(8, dtype=torch.int32), torch.empty(8), torch.empty(256)
    cnt = torch.empty(1, dtype=torch.int32)
    for score, groups in ((0, 1), (1, 8), (2, 1)):
        k = M._router_kernel.warmup(xr, xr, wr, 7168, part, part, part, cnt, lg, ids, wts, torch.empty(8, 896),
                                    256, 7168, 2048, 1e-6, 2.5, WRITE_X8=True, HAS_NW=True, HAS_BIAS=True,
                                    HAS_CORR=score == 1, SCORE=score, NORM_TOPK=True, N_GROUP=groups,
                                    GROUP_SIZE=256 // groups, TOPK_GROUP=min(4, groups), GROUP_TOP2=True, TOP_K=8,
                                    SPLIT_K=4, BLOCK_N=8, BLOCK_K=512, BLOCK_X=1024,
                                    BLOCK_G=triton.next_power_of_2(groups), BLOCK_S=256 // groups, BLOCK_TOPK=8,
                                    PER_ROUND=M.TOPK_PER_ROUND, PIPE=True, num_warps=4, grid=(1,))
        record(f"router[score={score},groups={groups}]", k)
    # the expert GLU picking the top-k itself from the router's partial logits (route(defer=True), moe_experts(select=);
    # qwen3-30b-a3b: 128 experts, top-8, 4 splits), fp8 with gate / up in one loop as the graph backend runs it
    fid, ecfg = G.FMT_ID["fp8"], M.DEFAULT_EXPERT_TILES["fp8"]
    wg, h = random_weight("fp8", I, H, experts=E), torch.empty(8, I)
    sel = torch.empty(4 * 129)
    k = M._expert_glu_kernel.warmup(x, x, ids, *M._expert_args(wg), *M._expert_args(wg), h, 0, 0, h, 0, 0, h, I, H, 1e-6,
                                    7.0, 1.702, H // 8, FMT=fid, HAS_NW=True, HAS_BIAS=False, ACT=0, H_X8=False,
                                    BLOCK_X=1024, BLOCK_N=ecfg.block_n, BLOCK_K=ecfg.block_k, PIPE=ecfg.prefetch,
                                    PAIR=True, num_warps=ecfg.num_warps, grid=(1,), rpart_ptr=sel, rb_ptr=sel,
                                    rcorr_ptr=sel, logits_ptr=torch.empty(128), wts_ptr=wts, scaling=1.0, E=128,
                                    SELECT=True, SEL_NW=True,
                                    **M._select_meta(M.RouterConfig(top_k=8), 128, 4, False))
    record("expert_glu[fp8,select]", k)
    # the same, after gemv_route (KIE_ROUTER_FOLD): the scale of x computed in front of the top-k (SEL_NW 2), 6 splits
    # ... and with one pick per block-wide reduction (KIE_TOPK_PER_ROUND=1; the default takes 4 per tl.reduce)
    for tag, per_round in (("", {}), (",1 per round", {"PER_ROUND": 1})):
        k = M._expert_glu_kernel.warmup(x, x, ids, *M._expert_args(wg), *M._expert_args(wg), h, 0, 0, h, 0, 0, h, I, H,
                                        1e-6, 7.0, 1.702, H // 8, FMT=fid, HAS_NW=True, HAS_BIAS=False, ACT=0,
                                        H_X8=False, BLOCK_X=1024, BLOCK_N=ecfg.block_n, BLOCK_K=ecfg.block_k,
                                        PIPE=ecfg.prefetch, PAIR=True, num_warps=ecfg.num_warps, grid=(1,),
                                        rpart_ptr=sel, rb_ptr=sel, rcorr_ptr=sel, logits_ptr=torch.empty(128),
                                        wts_ptr=wts, scaling=1.0, E=128, rx_ptr=x, SELECT=True, SEL_NW=2,
                                        **{**M._select_meta(M.RouterConfig(top_k=8), 128, 6, False), **per_round})
        record(f"expert_glu[fp8,select,own scale{tag}]", k)
    # o_proj with the router's rows folded in (moe.gemv_route; qwen3-30b-a3b: [2048, 4096], 128 experts), fp8 and
    # bf16 o_proj in the graph backend's rows-first tiles (4 x 1024), router rows 8 x 512; bf16 as gpt-oss's: a bias,
    # and nw * y written as its fp4 experts' x8
    for fmt in ("fp8", "bf16"):
        wo, a = random_weight(fmt, H, 4096), torch.empty(4096, dtype=torch.bfloat16)
        wr, wf = torch.empty(128, H, dtype=torch.bfloat16), torch.empty(128, 4096, dtype=torch.bfloat16)
        xf, u8 = torch.empty(H), torch.empty(8, H // 8)
        t = G.TileConfig(4, 1024, prefetch=G.DEFAULT_TILES[fmt].prefetch)
        k = M._gemv_route_kernel.warmup(a, *G.weight_args(wo), xf, xf, xf, wf, 4096, wr, H, x, sel, sel, u8, H, 4096,
                                        128, 16, 96, 4, 1024, FMT=G.FMT_ID[fmt], HAS_BIAS=fmt == "bf16",
                                        WRITE_U8=fmt == "bf16", BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                        PIPE=t.prefetch, R_BLOCK_N=8, R_BLOCK_K=512, R_PIPE=True, num_warps=4,
                                        grid=(1,))
        record(f"gemv_route[{fmt}]", k)
    # mxfp4 experts after it (gpt-oss-120b: 128 experts of 2880, top-4): the GLU on the unscaled x8, its sums scaled
    wm = random_weight("mxfp4", 2880, 2880, experts=E)
    mcfg = M.DEFAULT_EXPERT_TILES["mxfp4"]
    xm, hm, ym = torch.empty(8, 360), torch.empty(4, 2880), torch.empty(2880)
    oss = M.RouterConfig(top_k=4, scoring="softmax_topk")

    def mxfp4_select_glu(split, **kw):
        return M._expert_glu_kernel.warmup(xm, xm, ids, *M._expert_args(wm), *M._expert_args(wm), hm, 0, 0, hm, 0, 0,
                                           hm, 2880, 2880, 1e-6, 7.0, 1.702, 360, FMT=G.FMT_ID["mxfp4"], HAS_NW=False,
                                           ACT=1, H_X8=True, BLOCK_N=mcfg.block_n, BLOCK_K=mcfg.block_k,
                                           PIPE=mcfg.prefetch, num_warps=mcfg.num_warps, grid=(1,), rpart_ptr=sel,
                                           rb_ptr=sel, rcorr_ptr=sel, logits_ptr=torch.empty(128), wts_ptr=wts,
                                           scaling=1.0, E=128, SELECT=True, **M._select_meta(oss, 128, split, False),
                                           **kw)
    record("expert_glu[mxfp4,select,scaled x8]", mxfp4_select_glu(8, HAS_BIAS=False, BLOCK_X=4096, rx_ptr=ym,
                                                                   SEL_NW=2, SCALE_GLU=True))
    # gpt-oss's mxfp4 GLU picking the top-k from the router launch's 6 splits, under its register cap
    # (EXPERT_GLU_MAXNREG: 84 uncapped, which leaves 5 programs per SM for 720: a second wave)
    record("expert_glu[mxfp4,select,capped]", mxfp4_select_glu(6, HAS_BIAS=True, BLOCK_X=1024, SEL_NW=1,
                                                                SEL_BIAS=True,
                                                                maxnreg=M.EXPERT_GLU_MAXNREG["mxfp4"]))
    k = G._x8_kernel.warmup(x, x, torch.empty(8, H // 8), H, 1e-6, HAS_NW=True, BLOCK=1024, BLOCK_X=1024, grid=(1,))
    record("x8", k)
    from kie_moe.kernels import sampling as S   # the graph step's tail (next_step_inputs): bf16 embedding rows
    one = torch.empty(1, dtype=torch.int32)
    k = S._next_step_kernel.warmup(one, one, one, torch.empty(151936, H, dtype=torch.bfloat16), H, torch.empty(H), H,
                                   BLOCK=1024, grid=(1,))
    record("next_step", k)
    # RoPE + KV append + decode attention in one launch (qwen3-30b-a3b: 32 q / 4 kv heads of 128, per-head norm)
    from kie_moe.kernels import attention as A
    qh, kh, dh = torch.empty(32, 128, dtype=torch.bfloat16), torch.empty(4, 128, dtype=torch.bfloat16), 128
    kc = torch.empty(256, 4, dh, dtype=torch.bfloat16)
    cs = torch.empty(256, 64)
    nw = torch.empty(dh, dtype=torch.bfloat16)
    po = torch.empty(32, 2, dh)
    k = A._rope_gqa_split_kernel.warmup(qh, kh, kh, kc, kc, cnt, cs, cs, nw, nw, cs, qh, po, cs, 256, 0, 0.1, 1e-6,
                                        0.0, dh, dh, dh, 4 * dh, dh, 4 * dh, dh, 64, dh, 2 * dh, dh, 2,
                                        DH=dh, ROT=dh, PAIR=False, NORM=1, CLIP=False, REP=8, NUM_SPLITS=2,
                                        HAS_WINDOW=False, HAS_SINKS=False, DOT_DTYPE=A._TL_DTYPE[torch.bfloat16],
                                        DOT_PREC="tf32", BLOCK_R=16, BLOCK_N=64, BLOCK_D=128, num_warps=4,
                                        grid=(1,))
    record("rope_gqa_split[head norm]", k)
    k = A._rope_gqa_split_kernel.warmup(qh, kh, kh, kc, kc, cnt, cs, cs, nw, nw, cs, torch.empty(8, 32 * dh // 8), po,
                                        cs, 256, 0, 0.1, 1e-6, 0.0, dh, dh, dh, 4 * dh, dh, 4 * dh, dh, 64, dh,
                                        2 * dh, dh, 2, DH=dh, ROT=dh, PAIR=False, NORM=1, CLIP=False, REP=8,
                                        NUM_SPLITS=1, HAS_WINDOW=False, HAS_SINKS=False,
                                        DOT_DTYPE=A._TL_DTYPE[torch.bfloat16], DOT_PREC="tf32", BLOCK_R=16,
                                        BLOCK_N=64, BLOCK_D=128, X8=32 * dh // 8, num_warps=4, grid=(1,))
    record("rope_gqa_split[one split, x8 out]", k)
    k = A._gqa_combine_kernel.warmup(cnt, cs, torch.empty(8, 32 * dh // 8), po, cs, 256, 0, dh, 2 * dh, dh, 2,
                                     DH=dh, NUM_SPLITS=2, HAS_WINDOW=False, HAS_SINKS=False, SPLIT_BLOCK_N=64,
                                     BLOCK_S=2, BLOCK_D=128, X8=32 * dh // 8, num_warps=1, grid=(1,))
    record("gqa_combine[x8 out]", k)      # an fp4 o_proj's input written by the attention launch
    return out


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    from tests.kernels.helpers import compiled_json    # not at the top: this file also runs as a script
    rows = compiled_json([__file__], KIE_GPU_TESTS="1")
    assert len(rows) == 5 * 5 + 2 + 2 + 1 + 1 + 1 + 1 + 3 + 1 + 4 + 1 + 1 + 1 + 1 + 1 + 1
    spills = [r for r in rows if r["local_bytes"]]
    assert not spills, f"register spills to local memory: {spills}"
    heavy = [r for r in rows if r["regs"] and r["regs"] > 128]
    assert not heavy, f"> 128 registers per thread (< 4 programs of 128 threads per SM): {heavy}"
    capped = [r for r in rows if r["name"] == "expert_glu[mxfp4,select,capped]"]
    assert len(capped) == 1 and (capped[0]["regs"] is None or capped[0]["regs"] <= 80), \
        f"the cap did not hold: {capped}"


def test_graph_kernels_compile_for_sm80():
    """An A100 (sm_80) builds the same kernel variants in every format, e4m3 as its bytes there
    (kernels/device_caps.py; KIE_E4M3_BITS=1 stands in for such a GPU): no fp8e4nv, no sm_90-only PTX in them."""
    pytest.importorskip("triton.backends.nvidia")
    from tests.kernels.helpers import compiled_json
    rows = compiled_json([__file__, "80", "bf16,fp8,fp8_block,nvfp4,mxfp4"], KIE_E4M3_BITS="1")
    assert len(rows) == 5 * 5 + 2 + 1 + 1 + 3 + 1 + 4 + 1 + 1 + 1 + 1 + 1 + 1


if __name__ == "__main__":
    from kie_moe.kernels.device_caps import offline_target
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    with offline_target(arch):           # compile for sm_`arch`, never launch
        print(json.dumps(_compile_all(arch, *([sys.argv[2].split(",")] if len(sys.argv) > 2 else []))))
