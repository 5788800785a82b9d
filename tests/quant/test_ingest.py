"""QuantizedSource: quantized checkpoints read as logical float tensors, against outside oracles — HF transformers
on a native gpt-oss MXFP4 checkpoint (same greedy tokens), transformers' MXFP4 unpacking, compressed-tensors' FP8
block dequantizer and its compressors (a checkpoint they wrote, llm-compressor style) — plus the WeightStore-level
`quantized()` and the errors a broken checkpoint gives."""
from __future__ import annotations

import json
import os

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from safetensors.torch import load_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kie_moe import cli
from kie_moe.models.errors import CheckpointError, ConfigError
from kie_moe.models.loader import SafetensorsSource, read_config
from kie_moe.models.quantizable import convert_checkpoint
from kie_moe.models.registry import load_model
from kie_moe.quant import ct_scheme
from kie_moe.quant.ingest import QuantizedSource, quantized
from tests.models.hf_tiny import CASES

from quant_ckpt_helpers import make_hf, rewrite, to_gptoss_native_mxfp4, to_native_fp8_block

PROMPT = list(range(3, 23))


def all_tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def qsource(path, dtype=torch.bfloat16):
    return QuantizedSource(SafetensorsSource(path), read_config(path)["quantization_config"], dtype)


def kie_tokens(capsys, path, n=16):
    rc = cli.main(["generate", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(n),
                   "--ignore-eos", "--device", "cpu", "--backend", "reference", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)["token_ids"]


def no_warn(_msg):
    pass


# --------------------------------------------------------------------------------------- gpt-oss MXFP4
@pytest.fixture(scope="module")
def gptoss_native(tmp_path_factory):
    """gpt-oss with I = 64 (so down_proj's in is a multiple of 32, as in the real models), bf16 and native MXFP4."""
    root = tmp_path_factory.mktemp("gptoss")
    bf16 = make_hf("gpt_oss", dict(CASES["gpt_oss"][1], intermediate_size=64), str(root / "bf16"))
    return bf16, to_gptoss_native_mxfp4(bf16, str(root / "native"))


def test_gptoss_native_reads_as_transformers_unpacks_it(gptoss_native, capsys):
    _, native = gptoss_native
    raw = all_tensors(native)
    qs32, qs = qsource(native, torch.float32), qsource(native)
    shapes = qs.shapes()
    for p in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        ref = convert_moe_packed_tensors(raw[p + "_blocks"], raw[p + "_scales"], dtype=torch.float32)  # [E, in, out]
        assert shapes[p] == tuple(ref.shape) and p + "_blocks" not in shapes and p + "_scales" not in shapes
        assert torch.equal(qs32.read(p), ref)
        assert torch.equal(qs.read(p), ref.to(torch.bfloat16))
        assert qs.is_transposed(p) and qs.read_quantized(p).shape == (ref.shape[0], ref.shape[2], ref.shape[1])
    assert qs.read_quantized("model.layers.1.self_attn.q_proj.weight") is None


def test_gptoss_native_generates_what_transformers_generates(gptoss_native, capsys):
    """transformers loads the native checkpoint (dequantizing MXFP4 on CPU); greedy tokens must be identical."""
    from transformers import AutoModelForCausalLM
    _, native = gptoss_native
    hf = AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    assert kie_tokens(capsys, native) == want
    assert len(set(want)) > 2


def test_gptoss_native_to_mxfp4_repacks_the_blocks(gptoss_native, tmp_path, capsys):
    _, native = gptoss_native
    dst = str(tmp_path / "mx")
    rep = convert_checkpoint(native, dst, "mxfp4", progress=False, on_warning=no_warn)
    a, b = all_tensors(native), all_tensors(dst)
    blocks = [n for n in a if n.endswith(("_blocks", "_scales"))]
    assert len(blocks) == 4 * 3
    for n in blocks:
        assert torch.equal(a[n], b[n]), n  # byte for byte: no bf16 round trip
    assert set(rep.repacked) == {n.rsplit("_", 1)[0] for n in blocks}
    assert "model.layers.0.self_attn.q_proj.weight_packed" in b  # attention: compressed-tensors mxfp4
    assert len(kie_tokens(capsys, dst, 6)) == 6   # the CLI runs the result end to end (values checked above)


def test_gptoss_native_to_fp8_requantizes_from_the_mxfp4_values(gptoss_native, tmp_path, capsys):
    from kie_moe.quant import quantize
    _, native = gptoss_native
    dst = str(tmp_path / "f8")
    convert_checkpoint(native, dst, "fp8", progress=False, on_warning=no_warn)
    p = "model.layers.2.mlp.experts.gate_up_proj"
    want = quantize(qsource(native).read_quantized(p).dequantize(torch.float32), "fp8")
    got = qsource(dst).read_quantized(p)
    for k in want.tensors:
        assert torch.equal(want.tensors[k], got.tensors[k]), k
    assert len(kie_tokens(capsys, dst, 6)) == 6   # the CLI runs the result end to end (values checked above)


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4", "mxfp4"])
def test_quantized_applies_the_gptoss_layout(scheme, gptoss_native, tmp_path):
    """take expert / transpose / even-odd rows on the codes give what WeightStore.get gives on the floats."""
    bf16, native = gptoss_native
    path = native if scheme == "mxfp4" else str(tmp_path / scheme)
    if scheme != "mxfp4":
        convert_checkpoint(bf16, path, scheme, progress=False, on_warning=no_warn)
    st = load_model(path).weights
    for c in ("layers.1.moe.experts.4.gate", "layers.1.moe.experts.4.up", "layers.1.moe.experts.0.down",
              "layers.0.attn.k"):
        q = quantized(st, c)
        if c == "layers.0.attn.k" and scheme == "mxfp4":
            assert q is None  # the native checkpoint keeps attention in bf16
            continue
        assert q is not None and q.scheme == scheme and q.shape == tuple(st.get(c).shape), c
        assert torch.equal(q.dequantize(torch.bfloat16), st.get(c)), c
    assert quantized(st, "layers.1.moe.router") is None


def test_quantized_returns_none_where_fp8_blocks_would_be_cut(tmp_path):
    bf16 = make_hf("gpt_oss", dict(CASES["gpt_oss"][1], hidden_size=128, intermediate_size=128, head_dim=32),
                   str(tmp_path / "bf16"))
    dst = str(tmp_path / "fb")
    convert_checkpoint(bf16, dst, "fp8-block", progress=False, on_warning=no_warn)
    st = load_model(dst).weights
    assert quantized(st, "layers.0.moe.experts.2.gate") is None  # even rows of 128-row blocks
    q = quantized(st, "layers.0.moe.experts.2.down")
    assert q is not None and q.scheme == "fp8-block" and torch.equal(q.dequantize(torch.bfloat16),
                                                                      st.get("layers.0.moe.experts.2.down"))


def test_quantized_per_expert_modules_and_lanes(converted, tiny):
    st = load_model(converted("qwen3_moe_norm", "nvfp4")[0]).weights
    for c in ("layers.1.moe.experts.5.gate", "layers.1.moe.experts.5.up", "layers.0.attn.q", "layers.0.mlp.down"):
        q = quantized(st, c)
        assert q.shape == tuple(st.get(c).shape) and torch.equal(q.dequantize(torch.bfloat16), st.get(c)), c
    assert quantized(st, "layers.1.moe.experts.5.down") is None  # in = 40: kept in bf16
    assert quantized(st, "embed") is None
    st = load_model(converted("laneformer", "fp8")[0]).weights
    q = quantized(st, "layers.2.mlp.up")
    assert len(q.shape) == 3 and torch.equal(q.dequantize(torch.bfloat16), st.get("layers.2.mlp.up"))
    assert quantized(load_model(tiny("qwen3")).weights, "layers.0.attn.q") is None  # a float checkpoint
    with pytest.raises(KeyError, match="layers.9.attn.q"):
        quantized(st, "layers.9.attn.q")


# ------------------------------------------------------------------------------------- native FP8 block
@pytest.fixture(scope="module")
def fp8_native(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8native")
    from quant_ckpt_helpers import BLOCK128_CASES
    mt, over = BLOCK128_CASES["deepseek_v3_block128"]
    bf16 = make_hf(mt, over, str(root / "bf16"))
    return bf16, to_native_fp8_block(bf16, str(root / "native"))


def test_native_fp8_block_reads_as_compressed_tensors_dequantizes_it(fp8_native, capsys):
    _, native = fp8_native
    raw = all_tensors(native)
    qs = qsource(native)
    oracle = FP8BlockDequantizer(dtype=torch.bfloat16)
    n = 0
    for name, shape in qs.shapes().items():
        assert not name.endswith("weight_scale_inv")
        if qs.is_quantized(name):
            ref = oracle._create_dequantized_weight(raw[name], raw[name.replace("weight", "weight_scale_inv")])
            assert torch.equal(qs.read(name), ref), name
            n += 1
    assert n > 10
    assert len(kie_tokens(capsys, native, 6)) == 6   # the CLI runs the result end to end (values checked above)


def test_native_fp8_block_to_fp8_block_is_a_repack(fp8_native, tmp_path):
    _, native = fp8_native
    dst = str(tmp_path / "fb")
    rep = convert_checkpoint(native, dst, "fp8-block", progress=False, on_warning=no_warn)
    assert rep.quantized and set(rep.repacked) == set(rep.quantized)
    a, b = all_tensors(native), all_tensors(dst)
    for n, t in a.items():
        if n.endswith("weight_scale_inv"):
            assert torch.equal(b[n.replace("_inv", "")], t), n
            w = n.replace("_scale_inv", "")
            assert torch.equal(b[w].view(torch.uint8), a[w].view(torch.uint8)), w
        else:
            assert torch.equal(b[n], t), n


def test_native_fp8_with_bf16_scales_and_ragged_blocks(tiny, tmp_path, capsys):
    """hf_tiny's 64-wide DeepSeek-V3: every block is ragged; scale_inv stored in bf16 (exactly upcast)."""
    native = to_native_fp8_block(tiny("deepseek_v3"), str(tmp_path / "n"))
    rewrite(native, str(tmp_path / "n16"), lambda t: {k: v.to(torch.bfloat16) if k.endswith("_inv") else v
                                                       for k, v in t.items()})
    a, b = qsource(native), qsource(str(tmp_path / "n16"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert a.is_quantized(name) and a.shapes()[name] == (112, 16)
    assert torch.equal(b.read(name), FP8BlockDequantizer(dtype=torch.bfloat16)._create_dequantized_weight(
        all_tensors(native)[name], all_tensors(str(tmp_path / "n16"))[name.replace("weight", "weight_scale_inv")]))
    assert len(kie_tokens(capsys, str(tmp_path / "n16"), 4)) == 4   # the CLI runs it end to end


# ------------------------------------------------------------------- a checkpoint compressed-tensors wrote
def _ct_compress(w: torch.Tensor, preset: str, bf16_scales: bool):
    """What llm-compressor writes for one Linear: compressed-tensors' qparams and its compressor."""
    qs = preset_name_to_scheme(preset, ["Linear"])
    args = qs.weights
    w32 = w.float()
    if args.num_bits == 8:
        scale = calculate_qparams(w32.amin(-1, keepdim=True), w32.amax(-1, keepdim=True), args)[0]
        if bf16_scales:
            scale = scale.to(torch.bfloat16)  # llm-compressor keeps fp8 scales in the model dtype
        params = {"weight_scale": scale}
    else:
        g = generate_gparam(w32.min(), w32.max())
        groups = w32.reshape(w.shape[0], -1, args.group_size)
        params = {"weight_scale": calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)[0],
                  "weight_global_scale": g}
    fmt = ct_scheme("fp8" if args.num_bits == 8 else "nvfp4").format
    comp = BaseCompressor.get_value_from_registry(fmt)
    qs.format = fmt
    return comp.compress({"weight": w, **params}, qs), comp, qs


def test_reads_a_checkpoint_compressed_tensors_wrote(tiny, tmp_path, capsys):
    """Mixed precision as llm-compressor lays it out: attention FP8_DYNAMIC (bf16 scales), MLP NVFP4 (W4A4: an
    input_global_scale per module, which we hide), kv-cache scales, `lm_head` ignored."""
    src = tiny("qwen3")
    attn, mlp = preset_name_to_scheme("FP8_DYNAMIC", [r"re:.*self_attn\.(q|k|v|o)_proj$"]), \
        preset_name_to_scheme("NVFP4", [r"re:.*mlp\.(gate|up|down)_proj$"])
    qc = QuantizationConfig(config_groups={"group_0": attn, "group_1": mlp}, format="mixed-precision",
                            ignore=["lm_head"], quantization_status="compressed")
    decoded = {}

    def compress(t):
        out = {}
        for n, w in t.items():
            mod = n[: -len(".weight")]
            if n.endswith("_proj.weight"):
                preset = "FP8_DYNAMIC" if "self_attn" in n else "NVFP4"
                c, comp, qs = _ct_compress(w, preset, bf16_scales=True)
                out.update({f"{mod}.{k}": v for k, v in c.items()})
                decoded[n] = comp.decompress(dict(c), qs)["weight"]
                if preset == "NVFP4":
                    out[f"{mod}.input_global_scale"] = torch.tensor([123.0])
                elif n.endswith("k_proj.weight"):
                    out[n.replace("k_proj.weight", "k_scale")] = torch.tensor(0.5)
                    out[n.replace("k_proj.weight", "v_scale")] = torch.tensor(0.5)
            else:
                out[n] = w
        return out

    dst = rewrite(src, str(tmp_path / "ct"), compress, {"quantization_config": {
        "quant_method": "compressed-tensors", **qc.model_dump(mode="json")}})
    assert all_tensors(dst)["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    qs = qsource(dst)
    assert qs.shapes() == SafetensorsSource(src).shapes()  # logical view: no scales, same names and shapes
    for n, ref in decoded.items():
        assert torch.equal(qs.read(n), ref.to(torch.bfloat16)), n
    assert qs.read_quantized("model.layers.1.mlp.up_proj.weight").scheme == "nvfp4"
    assert qs.read_quantized("model.layers.1.self_attn.o_proj.weight").scheme == "fp8"
    assert len(kie_tokens(capsys, dst, 6)) == 6   # the CLI runs the result end to end (values checked above)


# ------------------------------------------------------------------------------------------------- errors
def test_broken_quantized_checkpoints_name_the_culprit(converted, tmp_path, capsys):
    ours = converted("qwen3_moe_norm", "nvfp4")[0]
    cfg = read_config(ours)
    bad = rewrite(ours, str(tmp_path / "m"), lambda t: {k: v for k, v in t.items()
                                                         if k != "model.layers.1.self_attn.q_proj.weight_scale"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight_packed has no .*weight_scale"):
        qsource(bad)
    capsys.readouterr()  # drop what building the fixture printed
    rc = cli.main(["generate", bad, "--prompt-ids", "1,2", "--device", "cpu", "--backend", "reference"])
    err = capsys.readouterr().err
    assert rc == 2 and "q_proj" in err and err.count("\n") == 1

    wrong = rewrite(ours, str(tmp_path / "w"), lambda t: t, {"quantization_config": {**cfg["quantization_config"],
                    "config_groups": {"group_0": {**cfg["quantization_config"]["config_groups"]["group_0"],
                                                  "format": "mxfp4-pack-quantized", "weights": {
                                                      **cfg["quantization_config"]["config_groups"]["group_0"]["weights"],
                                                      "group_size": 32, "scale_dtype": None}}}}})
    with pytest.raises(CheckpointError, match=r"o_proj.*config says mxfp4"):
        qsource(wrong).read("model.layers.0.self_attn.o_proj.weight")

    sparse = rewrite(ours, str(tmp_path / "s"), lambda t: t, {"quantization_config": {
        **cfg["quantization_config"], "sparsity_config": {"format": "sparse-24-bitmask", "targets": ["Linear"]}}})
    with pytest.raises(ConfigError, match="sparsity_config is set"):
        load_model(sparse)
    gptq = rewrite(ours, str(tmp_path / "g"), lambda t: t, {"quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(ConfigError, match=r"config\.json.*'gptq' is not supported"):
        load_model(gptq)


def test_native_fp8_weight_without_scale_is_named(fp8_native, tmp_path):
    _, native = fp8_native
    n = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    bad = rewrite(native, str(tmp_path / "b"), lambda t: {k: v for k, v in t.items() if k != n})
    with pytest.raises(CheckpointError, match=r"up_proj\.weight has no .*weight_scale_inv"):
        load_model(bad)
