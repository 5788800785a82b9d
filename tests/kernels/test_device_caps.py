"""Before sm_89 Triton has no e4m3 type: e4m3 weights (fp8, fp8-block codes, nvfp4 scales) reach the kernels as
their bytes and are decoded from the bits (tiles._as_f32). Checked here: the bytes path equal to the native one
(interpreter, and on the GPU; KIE_E4M3_BITS forces it), against Triton's own compiler for sm_80 offline (fp8e4nv
pointers fail there, the bytes compile); the monokernel's side is in tests/monokernel. Also the error a user gets
when a model does not fit the GPU."""
import pytest
import torch

from kie_moe.kernels import device_caps as DC
from kie_moe.models.errors import KieError

from .helpers import compiled_json

CUDA = torch.device("cuda", 0)


def _gpu(monkeypatch, cap, name):
    monkeypatch.setattr(DC, "_NATIVE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)


def test_e4m3_native_by_capability(monkeypatch):
    """fp8e4nv for the kernels from sm_89 on, not before; the interpreter always; KIE_E4M3_BITS=1 never."""
    for cap, native in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        _gpu(monkeypatch, cap, "GPU")
        assert DC.e4m3_native(CUDA) == native == DC.has_fp8e4nv(CUDA), cap
    assert DC.e4m3_native(torch.device("cpu")) and DC.has_fp8e4nv(None, arch=90) and not DC.has_fp8e4nv(None, 80)
    monkeypatch.setattr(DC, "FORCE_BITS", True)
    assert not DC.e4m3_native(torch.device("cpu")) and not DC.e4m3_native(CUDA)


_SM80 = r"""
import json, os, torch
from kie_moe.kernels.device_caps import offline_target
from kie_moe.kernels import fp4_mma as F, gemv as G
from kie_moe.kernels.weights import random_weight
N, K, out = 64, 256, {}
with offline_target(80):        # compile for an A100, never launch
    for fmt in ("bf16", "fp8", "fp8_block", "nvfp4", "mxfp4"):
        w, fp4 = random_weight(fmt, N, K), G.is_fp4(fmt)
        x = torch.empty(8, K // 8) if fp4 else torch.empty(K, dtype=torch.bfloat16)
        y, part, cnt = torch.empty(N, dtype=torch.bfloat16), torch.empty(4, N), torch.empty(N, dtype=torch.int32)
        c = G.DEFAULT_TILES[fmt]
        try:
            G._gemv_kernel.warmup(x, x, *G.weight_args(w), y, y, y, part, cnt, N, K, K, 1e-6, K // 8, FMT=G.FMT_ID[fmt],
                                  HAS_NW=False, HAS_BIAS=False, HAS_RES=False, SPLIT_K=1, BLOCK_X=256,
                                  BLOCK_N=c.block_n, BLOCK_K=c.block_k, PIPE=c.prefetch, num_warps=c.num_warps,
                                  num_stages=c.num_stages, grid=(1,))
            if fp4:   # the tensor-core GEMV (its scales are u8 views in any case)
                F._fp4_mma_kernel.warmup(torch.empty(K, dtype=torch.float16), w.weight, K // 2, w.scale.view(torch.uint8),
                                         w.scale.stride(0), y, y, y, y, N, K, MX=fmt == "mxfp4", HAS_BIAS=False,
                                         HAS_RES=False, RB=2, NW=4, num_warps=4, grid=(1,), maxnreg=128)
            if fmt == "fp8":  # the prefill's dequantization of fp8 per-row codes (kernels/prefill_weights.py)
                from kie_moe.kernels import prefill_weights as PW
                from kie_moe.kernels.device_caps import e4m3_native
                c3 = w.weight if e4m3_native(w.weight.device) else w.weight.view(torch.uint8)
                o3 = torch.empty(N, K, dtype=torch.bfloat16)
                PW._dequant_fp8_rows_kernel.warmup(c3, w.scale[:, 0], o3, N, K, 4, 0, K, 0, 1, 0, K, BLOCK_R=16,
                                                   BLOCK_C=256, grid=(1,))
            out[fmt] = "ok"
        except Exception as e:
            out[fmt] = str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("bits", [False, True])
def test_sm80_compiles_e4m3_only_as_bytes(bits):
    """Triton's compiler for sm_80: with fp8e4nv pointers (what an sm_89+ GPU gets) the e4m3 formats fail, and only
    they; with the bytes weight_args hands such a GPU (KIE_E4M3_BITS=1 stands in for one here) every format and the
    tensor-core fp4 GEMV compile."""
    pytest.importorskip("triton.backends.nvidia")
    res = compiled_json(["-c", _SM80], KIE_E4M3_BITS="1" if bits else "0")
    failing = sorted(f for f, r in res.items() if r != "ok")
    assert failing == ([] if bits else sorted(DC.E4M3_FORMATS)), res
    assert all("fp8e4nv" in res[f] for f in failing)


_TWO_TARGETS = r"""
import json, torch
from kie_moe.kernels.device_caps import offline_target
from kie_moe.kernels import prefill_weights as PW
w, s, o = torch.empty(64, 256, dtype=torch.uint8), torch.empty(64), torch.empty(64, 256, dtype=torch.bfloat16)
got = []
for arch in (90, 80, 90):
    with offline_target(arch):
        k = PW._dequant_fp8_rows_kernel.warmup(w, s, o, 64, 256, 4, 0, 256, 0, 1, 0, 256, BLOCK_R=16, BLOCK_C=256,
                                               grid=(1,))
        got.append(k.metadata.target.arch)
print(json.dumps(got))
"""


def test_offline_targets_do_not_share_compiled_kernels():
    """Two targets in one process each get a kernel compiled for themselves (Triton keeps compiled kernels per device
    key: with one key for every target, the second target was handed the first one's kernel)."""
    pytest.importorskip("triton.backends.nvidia")
    assert compiled_json(["-c", _TWO_TARGETS]) == [90, 80, 90]


def _native_and_bits(fmt, monkeypatch, dev, N, K, E, I):
    from kie_moe.kernels.fp4_mma import gemv_fp4_mma
    from kie_moe.kernels.gemv import gemv, gemv_glu
    from kie_moe.kernels.moe import moe_experts
    from kie_moe.kernels.weights import random_weight
    g = torch.Generator().manual_seed(5)
    w, wu = random_weight(fmt, N, K, seed=1, device=dev), random_weight(fmt, N, K, seed=2, device=dev)
    eg, eu = (random_weight(fmt, I, K, seed=s, device=dev, experts=E) for s in (3, 4))
    ed = random_weight(fmt, K, I, seed=5, device=dev, experts=E)
    x, nw, b = (torch.randn(n, generator=g).to(dev) for n in (K, K, N))
    ids, wts = torch.tensor([3, 0], dtype=torch.int32, device=dev), torch.tensor([0.7, 0.3], device=dev)

    def run():
        out = [gemv(x, w, bias=b, residual=b, norm_weight=nw), gemv_glu(x, w, wu, norm_weight=nw),
               moe_experts(x, ids, wts, eg, eu, ed, norm_weight=nw, residual=x)]
        if fmt == "nvfp4":
            out.append(gemv_fp4_mma(x, w, norm_weight=nw))
        if fmt == "fp8":     # the prefill's Triton dequantization (the interpreter runs it when asked)
            from kie_moe.kernels.prefill_weights import dequant_into
            out.append(dequant_into(eg, torch.empty(E, I, K, dtype=torch.bfloat16, device=dev), use_triton=True))
        return out

    native = run()
    monkeypatch.setattr(DC, "FORCE_BITS", True)
    return native, run(), (w, x, b, nw)


@pytest.mark.parametrize("fmt", DC.E4M3_FORMATS)
def test_e4m3_from_its_bytes_equals_the_native_path(fmt, monkeypatch):
    """The pre-sm_89 path (e4m3 as bytes, decoded from the bits) gives the native path's results bit for bit: the
    GEMV (norm, bias, residual fused), the GLU, both routed-expert launches; nvfp4 also the tensor-core GEMV, fp8 the
    prefill's dequantization."""
    from kie_moe.kernels.gemv import gemv_ref
    from tests.kernels.helpers import DEV, assert_close
    native, bits, (w, x, b, nw) = _native_and_bits(fmt, monkeypatch, DEV, 256, 256, 4, 128)
    for a, c in zip(native, bits):
        assert torch.equal(a, c), fmt
    assert_close(bits[0], gemv_ref(x, w, bias=b, residual=b, norm_weight=nw), what=f"{fmt} bits vs reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", DC.E4M3_FORMATS)
def test_e4m3_bytes_path_on_the_gpu(fmt, monkeypatch):
    """The same on the GPU at qwen3-30b-a3b's sizes (the inline-PTX and native-cvt paths against the bits decode):
    equal up to fp32 contraction order."""
    from tests.kernels.helpers import assert_close
    native, bits, _ = _native_and_bits(fmt, monkeypatch, "cuda", 4096, 2048, 16, 768)
    for a, c in zip(native, bits):
        assert_close(c, a, rel=1e-6, what=f"{fmt} bits vs native on the GPU")


def test_out_of_memory_while_building_names_the_model_and_the_ways_out(monkeypatch, tmp_path):
    """A model too big for the GPU: one line naming the model, its size, the GPU and what to do (not a traceback
    from deep inside the loader)."""
    from kie_moe import engine
    from kie_moe.models.registry import LoadedModel
    with open(tmp_path / "model.safetensors", "wb") as f:     # sparse: a 2.5 GB size, no disk used
        f.truncate(2_500_000_000)

    def too_big(model, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    class Mod:
        GraphBackend = staticmethod(too_big)

    monkeypatch.setattr(engine.importlib, "import_module", lambda m: Mod)
    monkeypatch.setattr(engine, "_importable", lambda n: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1.5e9, 80e9))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    _gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    model = LoadedModel(str(tmp_path), {}, None, None)
    with pytest.raises(KieError) as e:
        engine.make_backend("graph", model, CUDA)
    msg = str(e.value)
    assert str(tmp_path) in msg and "2.5 GB of weights" in msg and "H100" in msg and "80 GB" in msg
    assert "1.5 GB free" in msg and "--scheme" in msg and "--devices" in msg
