"""Every scheme against compressed-tensors as the oracle, on ragged shapes, 2-D and stacked 3-D:

1. our scales == compressed-tensors' calculate_qparams / generate_gparam on the same min / max;
2. our codes == its compressor's ``compress`` (its round-to-nearest) given our scales, >= 99.9% of elements;
3. its compressor's ``decompress`` of our tensors == our ``dequantize``, bit for bit;
4. its ``fake_quantize`` with our scales == our ``dequantize`` in float32, >= 99.9% of elements.
"""

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from kie_moe.quant import (
    SCHEMES,
    NotQuantizable,
    QuantizedTensor,
    ct_scheme,
    decode_e8m0,
    get_scheme,
    nvfp4_global_scale,
    quantize,
    shared_global_scale,
    unpack_nibbles,
    with_observer,
)

MIN_AGREEMENT = 0.999


def make_weight(shape, seed=0, dtype=torch.bfloat16):
    """Row magnitudes spread over decades, a zero row, a zero 32-run, an outlier: what real layers have."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 1.5) * 0.02
    w[..., 0, :] = 0.0
    w[..., 1, :32] = 0.0
    w[..., 2, 5] = 50 * w.abs().max()
    return w.to(dtype)


def tie_weight():
    """[2, 64]: groups whose scale is exactly 1, so the scaled values sit exactly on every e2m1 tie."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    grid = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    row = torch.tensor(mids + grid + [-v for v in mids + grid] + [-0.0, 0.1, -0.1])
    row = torch.cat([row, torch.zeros(32 - row.numel())])
    return torch.stack([torch.cat([row, row.flip(0)]), torch.cat([-row, row])])


SHAPES_2D = [(37, 96), (37, 160), (37, 288)]
SHAPES_FP8_EXTRA = [(257, 300), (130, 129)]  # several ragged row and column blocks for fp8-block
CASES = (
    [(s, shape) for s in SCHEMES for shape in SHAPES_2D]
    + [(s, (3, 37, 160)) for s in SCHEMES]
    + [(s, shape) for s in ("fp8", "fp8-block") for shape in SHAPES_FP8_EXTRA]
    + [("fp8-block", (2, 130, 288))]
)


def _block_minmax(w, block=(128, 128)):
    # Independent of the implementation's reshape: loop over blocks (tiny shapes only).
    bo, bi = block
    ob, ib = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    mins, maxs = torch.zeros(ob, ib), torch.zeros(ob, ib)
    for i in range(ob):
        for j in range(ib):
            blk = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            mins[i, j], maxs[i, j] = blk.min(), blk.max()
    return mins, maxs


def _ct_scales(w32, name, gs):
    """compressed-tensors' scales for a 2-D slice, as the uncompressed (float) state dict holds them."""
    args = ct_scheme(name).weights
    if name == "fp8":
        return {"weight_scale": calculate_qparams(w32.amin(-1, keepdim=True), w32.amax(-1, keepdim=True), args)[0]}
    if name == "fp8-block":
        return {"weight_scale": calculate_qparams(*_block_minmax(w32), args)[0]}
    groups = w32.reshape(w32.shape[0], -1, gs)
    if name == "nvfp4":
        g = generate_gparam(w32.min(), w32.max())
        s = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)[0]
        return {"weight_scale": s, "weight_global_scale": g}
    return {"weight_scale": calculate_qparams(groups.amin(-1), groups.amax(-1), args)[0]}


def _our_float_scales(q: QuantizedTensor):
    """Our written tensors in the uncompressed form compressed-tensors' ``compress`` takes."""
    t = dict(q.tensors)
    if q.scheme == "mxfp4":
        return {"weight_scale": decode_e8m0(t["weight_scale"])}
    out = {"weight_scale": t["weight_scale"].float()}
    if q.scheme == "nvfp4":
        out["weight_global_scale"] = t["weight_global_scale"]
    return out


def _codes(q_tensors, name):
    if name in ("fp8", "fp8-block"):
        return q_tensors["weight"].view(torch.uint8)
    return unpack_nibbles(q_tensors["weight_packed"])


def _check_slice(w, q: QuantizedTensor, name):
    sch = get_scheme(name)
    cts = ct_scheme(name)
    comp = BaseCompressor.get_value_from_registry(cts.format)
    w32 = w.float()
    ours = _our_float_scales(q)

    # 1. scales
    ref = _ct_scales(w32, name, getattr(sch, "group_size", None))
    for k, v in ref.items():
        assert torch.equal(ours[k], v.to(ours[k].dtype)), f"{name} {k} differs from compressed-tensors'"

    # 2. codes: compressed-tensors' compress of the original weight with our scales
    ct_out = comp.compress({"weight": w, **ours}, cts)
    agree = (_codes(ct_out, name) == _codes(q.tensors, name)).float().mean().item()
    assert agree >= MIN_AGREEMENT, f"{name}: only {agree:.5f} of codes agree with compressed-tensors"
    assert set(ct_out) == set(q.tensors), f"{name}: compressed-tensors writes {sorted(ct_out)}"
    for k in ct_out:
        if k != sch.weight_name:
            assert torch.equal(ct_out[k], q.tensors[k]) and ct_out[k].dtype == q.tensors[k].dtype, k

    # 3. decompress of what we wrote
    dec = comp.decompress(dict(q.tensors), cts)["weight"]
    assert dec.shape == w.shape
    assert torch.equal(dec, q.dequantize(dec.dtype)), f"{name}: compressed-tensors decompresses our tensors differently"

    # 4. fake-quantize with our scales, in float32
    fq = fake_quantize(
        x=w32,
        scale=ours["weight_scale"],
        zero_point=None,
        args=cts.weights,
        global_scale=ours.get("weight_global_scale"),
    )
    agree = (fq == q.dequantize(torch.float32)).float().mean().item()
    assert agree >= MIN_AGREEMENT, f"{name}: fake_quantize agrees on only {agree:.5f}"


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_matches_compressed_tensors(name, shape):
    w = make_weight(shape, seed=sum(shape))
    q = quantize(w, name, name="model.layers.0.mlp.down_proj.weight")
    assert q.shape == shape and q.dtype == torch.bfloat16 and q.scheme == name
    for n, (s, dt) in get_scheme(name).tensor_specs(shape).items():
        assert tuple(q.tensors[n].shape) == s and q.tensors[n].dtype == dt
    if len(shape) == 3:
        parts = q.unstack()
        assert len(parts) == shape[0]
        full = q.dequantize()
        for e, part in enumerate(parts):
            assert torch.equal(part.dequantize(), full[e])
            _check_slice(w[e], part, name)
    else:
        _check_slice(w, q, name)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_exact_ties_match_compressed_tensors(name):
    w = tie_weight()
    q = quantize(w, name)
    if name == "mxfp4":  # amax 5 -> power of two 4 -> scale 2^0, so scaled values are the ties themselves
        assert q.tensors["weight_scale"].tolist() == [[127, 127], [127, 127]]
    _check_slice(w, q, name)
    cts = ct_scheme(name)
    ct_out = BaseCompressor.get_value_from_registry(cts.format).compress({"weight": w, **_our_float_scales(q)}, cts)
    assert torch.equal(ct_out["weight_packed"], q.tensors["weight_packed"])  # every tie, bit for bit


def test_float32_input_and_quantization_error_bounds():
    w = make_weight((37, 288), seed=5, dtype=torch.float32)
    for name, tol in [("fp8", 0.07), ("fp8-block", 0.07), ("nvfp4", 0.35), ("mxfp4", 0.6)]:
        q = quantize(w, name)
        assert q.dtype == torch.float32
        err = (q.dequantize() - w).abs()
        # relative to the row amax of the nonzero rows: a loose sanity bound, the oracle tests are exact
        rel = (err.amax(-1) / w.abs().amax(-1).clamp_min(1e-30))[1:]
        assert float(rel.max()) < tol, (name, float(rel.max()))
        assert torch.equal(q.dequantize()[0], torch.zeros(288)), name  # zero row stays zero


def test_unknown_scheme_lists_known_ones():
    with pytest.raises(ValueError) as e:
        quantize(torch.randn(4, 32), "int3")
    for known in ("fp8", "fp8-block", "nvfp4", "mxfp4"):
        assert known in str(e.value)
    assert "int3" in str(e.value)
    with pytest.raises(ValueError, match="nvfp4"):
        get_scheme("nvfp8")


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_raise_value_error_naming_the_tensor(name, bad):
    w = torch.randn(8, 64)
    w[3, 7] = bad
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.up_proj\.weight.*(NaN|Inf)") as e:
        quantize(w.to(torch.bfloat16), name, name="layers.3.mlp.up_proj.weight")
    assert not isinstance(e.value, NotQuantizable)


@pytest.mark.parametrize("name,inp,group", [("nvfp4", 40, 16), ("nvfp4", 100, 16), ("mxfp4", 48, 32), ("mxfp4", 80, 32)])
def test_fp4_ragged_in_is_not_quantizable(name, inp, group):
    w = torch.randn(5, inp)
    with pytest.raises(NotQuantizable, match=rf"lm_head\.weight.*in={inp}.*{group}") as e:
        quantize(w, name, name="lm_head.weight")
    assert e.value.name == "lm_head.weight" and e.value.scheme == name
    # The oracle cannot write it either: there is no compressed-tensors layout to target.
    cts = ct_scheme(name)
    scale = torch.ones(5, -(-inp // group))
    extra = {"weight_global_scale": torch.ones(1)} if name == "nvfp4" else {}
    with pytest.raises(ValueError):
        BaseCompressor.get_value_from_registry(cts.format).compress({"weight": w, "weight_scale": scale, **extra}, cts)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_wrong_rank_is_not_quantizable(name):
    with pytest.raises(NotQuantizable, match="model.norm.weight"):
        quantize(torch.randn(64), name, name="model.norm.weight")
    with pytest.raises(NotQuantizable):
        quantize(torch.randn(2, 2, 2, 64), name)


def test_integer_weight_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(4, 32, dtype=torch.int32), "fp8")


def test_global_scale_only_for_nvfp4():
    with pytest.raises(ValueError, match="global_scale only applies to nvfp4"):
        quantize(torch.randn(4, 32), "mxfp4", global_scale=1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize(torch.randn(4, 32), "nvfp4", global_scale=0.0)


def test_shared_global_scale_for_fused_partners_2d():
    gate = make_weight((37, 96), seed=1)
    up = make_weight((37, 96), seed=2) * 3
    g = shared_global_scale([gate, up])
    assert g.shape == (1,) and g.dtype == torch.float32
    both = torch.cat([gate, up]).float()
    assert torch.equal(g, generate_gparam(both.min(), both.max()))
    assert torch.equal(g, torch.minimum(nvfp4_global_scale(gate), nvfp4_global_scale(up)))
    qg, qu = quantize(gate, "nvfp4", g), quantize(up, "nvfp4", g)
    assert torch.equal(qg.tensors["weight_global_scale"], qu.tensors["weight_global_scale"])
    for w, q in ((gate, qg), (up, qu)):  # still exact against the oracle with a shared (not own) global
        cts = ct_scheme("nvfp4")
        args = cts.weights
        groups = w.float().reshape(37, -1, 16)
        s = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)[0]
        assert torch.equal(q.tensors["weight_scale"].float(), s)
        dec = BaseCompressor.get_value_from_registry(cts.format).decompress(dict(q.tensors), cts)["weight"]
        assert torch.equal(dec, q.dequantize(torch.bfloat16))


def test_shared_global_scale_stacked_is_per_expert():
    gate = make_weight((4, 37, 96), seed=3)
    up = make_weight((4, 37, 96), seed=4)
    up[2] *= 10
    g = shared_global_scale([gate, up])
    assert g.shape == (4, 1)
    for e in range(4):
        assert torch.equal(g[e], shared_global_scale([gate[e], up[e]]))
    q = quantize(up, "nvfp4", g)
    assert torch.equal(q.tensors["weight_global_scale"], g)
    for e, part in enumerate(q.unstack()):
        assert torch.equal(part.dequantize(), quantize(up[e], "nvfp4", g[e]).dequantize())
    # a scalar global applies to every expert
    q1 = quantize(up, "nvfp4", 123.0)
    assert q1.tensors["weight_global_scale"].flatten().tolist() == [123.0] * 4
    with pytest.raises(ValueError, match="same number of experts"):
        shared_global_scale([gate, up[:3]])
    with pytest.raises(ValueError, match="2-D or all be 3-D"):
        shared_global_scale([gate, up[0]])
    with pytest.raises(ValueError, match=r"weights\[1\].*NaN"):
        shared_global_scale([gate[0], torch.full((3, 16), float("nan"))])


def test_all_zero_weight():
    for name in SCHEMES:
        q = quantize(torch.zeros(3, 64), name)
        assert torch.equal(q.dequantize(), torch.zeros(3, 64)), name
    assert quantize(torch.zeros(3, 64), "nvfp4").tensors["weight_global_scale"].item() == 1.0  # generate_gparam's fallback


def test_quantized_tensor_validates_layout():
    q = quantize(torch.randn(8, 64), "nvfp4")
    t = dict(q.tensors)
    with pytest.raises(ValueError, match="weight_scale.*expected"):
        QuantizedTensor("nvfp4", {**t, "weight_scale": t["weight_scale"][:, :2]}, (8, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="missing.*weight_global_scale"):
        QuantizedTensor("nvfp4", {k: v for k, v in t.items() if k != "weight_global_scale"}, (8, 64), torch.bfloat16)
    named = q.named("model.layers.0.self_attn.q_proj")
    assert set(named) == {f"model.layers.0.self_attn.q_proj.{k}" for k in t}
    assert q.nbytes == 8 * 32 + 8 * 4 + 4
    with pytest.raises(ValueError, match="3-D"):
        q.unstack()


def test_nvfp4_rounding_boundaries_match_compressed_tensors_exactly():
    """Weights placed on the rounding boundaries, where the order of operations decides the result:
    group amaxes whose scale global * amax / 6 lands on an e4m3 midpoint, and elements whose scaled value
    lands on an e2m1 midpoint. Scales and codes must equal compressed-tensors' bit for bit."""
    g = generate_gparam(torch.tensor(-3.0), torch.tensor(3.0))
    e4m3 = torch.arange(8, 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # positive normals
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    amax = (mids * 6 / g).unsqueeze(-1)  # [M, 1]
    steps = [amax]
    for direction in (torch.inf, 0.0):
        x = amax
        for _ in range(2):
            x = torch.nextafter(x, torch.full_like(x, direction))
            steps.append(x)
    amax = torch.cat(steps).flatten()  # ties +- 2 ulp
    amax = amax[amax < 3.0]
    args = ct_scheme("nvfp4").weights
    s = calculate_qparams(amax, amax, args, global_scale=g)[0]  # the oracle's scale for each group
    eff = (s / g).unsqueeze(-1)  # [M, 1]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = ties * eff
    near = torch.cat([x, torch.nextafter(x, torch.zeros_like(x)), torch.nextafter(x, torch.full_like(x, 9.0))], dim=-1)
    near = torch.cat([near, torch.zeros(near.shape[0], 30 - near.shape[1])], dim=-1)  # [M, 30]
    sign = torch.where(torch.arange(30) % 2 == 0, 1.0, -1.0)
    w = torch.cat([amax[:, None], (near * sign)[:, :15], amax[:, None], (near * sign)[:, 15:]], dim=-1)  # [M, 32]
    assert float(w.abs().amax()) < 3.0
    q = quantize(w, "nvfp4", g)
    ref_s = calculate_qparams(w.reshape(-1, 2, 16).amin(-1), w.reshape(-1, 2, 16).amax(-1), args, global_scale=g)[0]
    assert torch.equal(q.tensors["weight_scale"].float(), ref_s)
    cts = ct_scheme("nvfp4")
    ct_out = BaseCompressor.get_value_from_registry(cts.format).compress({"weight": w, **_our_float_scales(q)}, cts)
    assert torch.equal(ct_out["weight_packed"], q.tensors["weight_packed"])
    dec = BaseCompressor.get_value_from_registry(cts.format).decompress(dict(q.tensors), cts)["weight"]
    assert torch.equal(dec, q.dequantize(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SCHEMES))
def test_cuda_gives_the_same_bits_as_cpu(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = make_weight((3, 257, 288), seed=9)
    cpu, gpu = quantize(w, name), quantize(w.cuda(), name)
    for k, t in cpu.tensors.items():
        g = gpu.tensors[k].cpu()
        assert g.dtype == t.dtype, k
        if t.element_size() == 1:  # compare fp8 / packed codes as raw bytes
            g, t = g.view(torch.uint8), t.view(torch.uint8)
        assert torch.equal(g, t), k
    assert torch.equal(gpu.dequantize(torch.bfloat16).cpu(), cpu.dequantize(torch.bfloat16))


@pytest.mark.parametrize("scheme", ["fp8", "fp8-block", "nvfp4", "mxfp4"])
def test_transposed_view_quantizes_to_contiguous_codes(scheme):
    # gpt-oss experts are stored [in, out] and reach quantize() as transposed views; with in == out (gpt-oss-120b:
    # 2880 x 2880) the codes kept the view's strides and the graph backend's WeightHandle refused them.
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(3))
    q_view, q_copy = quantize(w.t(), scheme), quantize(w.t().contiguous(), scheme)
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731 (fp8: no torch.equal)
    for k, t in q_view.tensors.items():
        assert t.is_contiguous(), (scheme, k, t.stride())
        assert torch.equal(bits(t), bits(q_copy.tensors[k])), (scheme, k)


# ---- observer "mse": other scale values, the same format --------------------------------------------------------
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_mse_observer_never_loses_to_minmax_and_compressed_tensors_reads_it(name):
    """Each group keeps the minmax scale unless a candidate reconstructs it with less squared error, so no group
    gets worse and the whole tensor gets better; compressed-tensors' own decompressor (the one vLLM runs) reads
    the codes and scales exactly as our dequantize does, and the config it is given says observer "mse"."""
    w = make_weight((37, 256), seed=5).float()
    mm, ms = quantize(w, name), quantize(w, with_observer(name, "mse"))
    assert ms.scheme == name and set(ms.tensors) == set(mm.tensors)
    gs = 16 if name == "nvfp4" else 32
    err = {k: (q.dequantize(torch.float32) - w).reshape(37, -1, gs).square().sum(-1) for k, q in
           (("minmax", mm), ("mse", ms))}
    assert bool((err["mse"] <= err["minmax"]).all())
    # on a plain Gaussian layer (no outlier row dominating the sum): nvfp4 loses ~14% less squared error; mxfp4's
    # power-of-two scales (one candidate below the minmax exponent) only ~0.3%, but never more
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    ratio = float((quantize(g, with_observer(name, "mse")).dequantize() - g).square().sum()
                  / (quantize(g, name).dequantize() - g).square().sum())
    assert ratio < (0.9 if name == "nvfp4" else 1.0), ratio
    assert not torch.equal(ms.tensors["weight_scale"], mm.tensors["weight_scale"])
    cts = ct_scheme(with_observer(name, "mse"))
    assert cts.weights.observer == "mse" and ct_scheme(name).weights.observer is None
    dec = BaseCompressor.get_value_from_registry(cts.format).decompress(dict(ms.tensors), cts)["weight"]
    assert torch.equal(dec, ms.dequantize(dec.dtype))


def test_observer_choices():
    assert with_observer("nvfp4", "minmax") == get_scheme("nvfp4")
    assert with_observer("fp8", "minmax") is get_scheme("fp8")
    with pytest.raises(ValueError, match="fp4 schemes"):
        with_observer("fp8-block", "mse")
    with pytest.raises(ValueError, match="unknown observer"):
        with_observer("nvfp4", "percentile")
