"""The GPU build of the monokernel, checked without a GPU: compile it for sm_90 (H100/H200) with Triton's bundled
ptxas, in a process without TRITON_INTERPRET (the interpreter never sees the inline-PTX branches), and check the
synchronisation instructions kccl.sync promises are in the PTX; the same plan also compiles for an A100 (sm_80).
A fresh Triton cache each time: the kernel's target_info guards are not part of Triton's cache key."""
import os
import shutil
import subprocess
import sys

import pytest
import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

SCRIPT = r"""
import re, sys, torch
from kie_moe.models.registry import load_model
from kie_moe.kernels.monokernel.runtime import MonokernelBackend, compile_offline
from kie_moe.kernels.monokernel import plan as P
from kie_moe.quant.schemes import quantize
for arg in sys.argv[1:]:
    path, scheme = arg.split("@")
    m = load_model(path)
    q = {n: quantize(m.weights.get(n).float(), scheme) for n in m.weights.names() if P.qkind(n) == "attn"}
    be = MonokernelBackend(m, "cpu", offline=True, wdtype=torch.bfloat16, block_k=512, block_t=32, n_sms=132,
                           quantized=q.get)
    assert be.plan.dims.FMT_ATTN > 0
    ptx = compile_offline(be).asm["ptx"]
    for needle in ("ld.global.acquire.gpu", "red.release.gpu.global.add", "st.release.sys.global", "%globaltimer",
                   "ld.volatile.global", "atom.global.gpu.relaxed.add", "cp.async.bulk.prefetch.L2"):
        assert needle in ptx, (path, needle)
    if scheme == "mxfp4":   # its fp4 q|k|v / o_proj tasks on the tensor cores (KIE_MONO_FP4_MMA, the default)
        assert be.mma4 and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx, path
    # the attention task is a called function by default (KIE_ATTN_NOINLINE: its own registers)
    assert re.search(r"\.func .*_attention_task_", ptx) and "call.uni" in ptx, path
    # an A100 (sm_80) takes the same plan: e4m3 buffers as bytes (no fp8e4nv pointer), no sm_90 bulk prefetch
    ptx80 = compile_offline(be, arch=80).asm["ptx"]
    assert "cp.async.bulk" not in ptx80 and "ld.global.acquire.gpu" in ptx80, path
    if scheme == "mxfp4":   # the top-k / top-p variant (SFILTER: sampling.py's tile + final tasks inside)
        assert "ld.global.acquire.gpu" in compile_offline(be, filtered=True).asm["ptx"], path
        # KIE_FUSE_DOWN=1 (gpt-oss: float experts with biases, no shared expert): the experts' down sums go into x
        # as fp32 atomics from the gate / up tasks (fused_down.py; 4-wide on sm_90); the default build has none
        import os
        os.environ["KIE_FUSE_DOWN"] = "1"
        be_f = MonokernelBackend(m, "cpu", offline=True, wdtype=torch.bfloat16, block_k=512, block_t=32, n_sms=132,
                                 quantized=q.get)
        os.environ.pop("KIE_FUSE_DOWN")
        red = r"atom\.global\.gpu\.relaxed\.add(\.v[24])?\.f32"
        assert be_f.fuse_down and re.search(red, compile_offline(be_f).asm["ptx"]) and not re.search(red, ptx), path
    if scheme == "fp8":     # KIE_MONO_FP8_MMA=1: q|k|v, o_proj, expert gate / up and down on the tensor cores (mma8.py)
        import os
        os.environ["KIE_MONO_FP8_MMA"] = "1"
        q = {n: quantize(m.weights.get(n).float(), scheme) for n in m.weights.names() if P.qkind(n) in ("attn", "exp")}
        be = MonokernelBackend(m, "cpu", offline=True, wdtype=torch.bfloat16, block_k=512, block_t=32, n_sms=132,
                               quantized=q.get)
        os.environ.pop("KIE_MONO_FP8_MMA")
        ptx = compile_offline(be).asm["ptx"]
        assert be.mma8 and be.plan.dims.FMT_EXP == 1 and "cvt.rn.f16x2.e4m3x2" in ptx, path
        # 8 per 1-block rows_dot (q|k|v, o_proj, the experts' down), 16 per GLU
        assert ptx.count("mma.sync.aligned.m16n8k16") >= 40, path
        # the trace build (MODE 3) with the tensor-core tasks' loop stamps and the expert's top-k stamp
        assert compile_offline(be, mode=3).asm["ptx"].count("%clock64") > ptx.count("%clock64") + 4, path
        # KIE_ATTN_DOT=tf32x3: attention's dots on the tensor cores (m16n8k8 tf32 mma), none in the default build
        assert ".tf32" not in ptx, path
        # (this build also keeps the router tasks: KIE_ROUTE_IN_O=0, and picks the top-k in every expert gate / up
        # task from their logits: KIE_ROUTE_ONCE=0; lets the down task prefetch its rows itself: KIE_DOWN_L2=0;
        # claims each successor before the wait: KIE_CLAIM=ahead)
        os.environ["KIE_ATTN_DOT"] = "tf32x3"
        os.environ["KIE_ROUTE_IN_O"] = "0"
        os.environ["KIE_ROUTE_ONCE"] = "0"
        os.environ["KIE_DOWN_L2"] = "0"
        os.environ["KIE_CLAIM"] = "ahead"
        be_t = MonokernelBackend(m, "cpu", offline=True, wdtype=torch.bfloat16, block_k=512, block_t=32, n_sms=132,
                                 quantized=q.get)
        ptx_t = compile_offline(be_t).asm["ptx"]
        os.environ.pop("KIE_ATTN_DOT")
        os.environ.pop("KIE_ROUTE_IN_O")
        os.environ.pop("KIE_ROUTE_ONCE")
        os.environ.pop("KIE_DOWN_L2")
        os.environ.pop("KIE_CLAIM")
        assert be.route_in_o and not be.route_once and not be_t.route_in_o and not be_t.route_once, path
        assert be.down_l2 and not be_t.down_l2 and (be.claim, be_t.claim) == (2, 0), path
        # by default one prefetch in the expert gate / up task stands for the down task's TOPK (after its wait), and
        # the o_proj task prefetches its slice of the router (ops.route_partial's rows: one per thread)
        pf = "cp.async.bulk.prefetch.L2"
        assert ptx.count(pf) == ptx_t.count(pf) - be.plan.dims.TOPK + 2, (path, ptx.count(pf), ptx_t.count(pf))
        # the default claims in two places (before the loop, after each signal); "ahead" in every op's branch
        cl = "atom.global.gpu.relaxed.add"
        assert ptx.count(cl) + 10 < ptx_t.count(cl), (path, ptx.count(cl), ptx_t.count(cl))
        # neither build takes the router ticket (the default has no router tasks; this build's ROUTE_ONCE=0); the
        # default's o_proj tasks add the router's partial logits as 64-bit integers (ops.route_partial)
        acq = "atom.global.gpu.acq_rel.add"
        assert ptx.count(acq) == ptx_t.count(acq), path
        assert re.search(r"atom\.global\.gpu\.relaxed\.add\.[us]64", ptx) and not re.search(
            r"atom\.global\.gpu\.relaxed\.add\.[us]64", ptx_t), path
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx_t, path
    print("ok", arg, len(ptx))
"""


@pytest.mark.skipif(not (os.path.exists(PTXAS) or shutil.which("ptxas")), reason="no ptxas in this triton build")
def test_monokernel_compiles_for_sm90(tiny_model, tmp_path):
    # Every op is compiled for every model (the float paths of the router, LM head, experts come along); gpt-oss
    # turns on the most flags; its attention in mxfp4 (the u32-word e2m1 path); qwen2_moe's in fp8 (on sm_80 its
    # codes go in as bytes). (MLA compiles in the GPU run; `python benchmarks/monokernel_bench.py` compiles every
    # format there too.)
    paths = [tiny_model("gpt_oss").path + "@mxfp4", tiny_model("qwen2_moe").path + "@fp8"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    r = subprocess.run([sys.executable, "-c", SCRIPT, *paths], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("ok ") == len(paths)
