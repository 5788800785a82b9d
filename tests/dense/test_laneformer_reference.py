"""Our Laneformer (registry -> adapter -> WeightStore -> reference decoder) against the independent oracle."""
from __future__ import annotations

import json
import os

import pytest
import torch
from laneformer_helpers import EIGHT_LANES, PROMPT, config
from laneformer_oracle import OracleLaneformer

from kie_moe.dense import adapter
from kie_moe.dense.config import ALL, DELAYED, SCALED
from kie_moe.dense.preset import PRESETS, preset
from kie_moe.dense.reference import greedy
from kie_moe.models.families.common import Cfg
from kie_moe.models.registry import load_model

# Every switch: early comm on/off, use_comm on/off, per-lane / shared norms, both final aggregations, windows
# (first n, last |n|, all, with unclamped layers, none) shorter than the prompt, delays 0, 1, 2 and > layers.
CASES = {
    "early-comm_lane-norms_pre-agg_d2_first3": config(),
    "no-early_shared-norm_replicate_d1_last2-unclamped": config(
        use_early_comm=False, replicated_rmsn_scale=True, pre_norm_lane_agg=False, broadcast_delay=1,
        sliding_window_n_layers=-2, unclamped_layers=[-1]),
    "early_no-comm_lane-norms_replicate_d2_no-window": config(
        use_comm=False, pre_norm_lane_agg=False, sliding_window=None),
    "no-comm-at-all_shared-norm_pre-agg_d1_all-but-0": config(
        use_comm=False, use_early_comm=False, replicated_rmsn_scale=True, broadcast_delay=1, sliding_window=4,
        sliding_window_n_layers=None, unclamped_layers=[0]),
    "8-lanes_tied_lane-norms_replicate_d2": config(
        **EIGHT_LANES, tie_word_embeddings=True, pre_norm_lane_agg=False, sliding_window_n_layers=2),
    "delay0_plain-tp_lane-norms_pre-agg-scale": config(broadcast_delay=0, sliding_window_n_layers=-3),
    "delay-past-last-layer_no-early_mha": config(broadcast_delay=7, use_early_comm=False, replicated_rmsn_scale=True,
                                                 num_key_value_heads=8),
    # 4 q heads over 2 kv heads per lane: catches a wrong q -> kv head grouping inside a lane
    "2-lanes_gqa2_lane-norms_pre-agg_d1": config(num_lanes=2, num_key_value_heads=4, broadcast_delay=1,
                                                 rope_theta=500.0),
}


def ours(model_dir: str):
    m = load_model(model_dir)                 # through the registry's EXTERNAL_FAMILIES entry
    assert m.spec.family == "laneformer"
    return m, adapter.reference_decoder(m.spec, m.weights)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_independent_oracle(name, make_model):
    cfg = CASES[name]
    d = make_model(cfg)
    _, dec = ours(d)
    tokens, logits = greedy(dec, torch.tensor(PROMPT), 6)
    want_tokens, want_logits = OracleLaneformer(d).greedy(PROMPT, 6)
    assert tokens == want_tokens
    assert len(set(tokens)) >= 3, f"degenerate greedy output {tokens}: raise the init"
    assert len(logits) == len(want_logits)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")


def test_switches_change_the_output(make_model):
    """Guard against the oracle and us agreeing because a switch does nothing."""
    base = config(sliding_window=None)
    outs = {}
    for name, over in {"base": {}, "no-early": dict(use_early_comm=False), "no-comm": dict(use_comm=False),
                       "replicate": dict(pre_norm_lane_agg=False), "d1": dict(broadcast_delay=1),
                       "window": dict(sliding_window=3)}.items():
        _, dec = ours(make_model(dict(base, **over), seed=3))
        outs[name] = dec.forward(torch.tensor(PROMPT))
    for name, out in outs.items():
        if name != "base":
            assert not torch.allclose(out, outs["base"], atol=1e-3), name


def test_decode_in_chunks_equals_one_prefill(make_model):
    _, dec = ours(make_model(config()))
    whole = dec.forward(torch.tensor(PROMPT))
    dec.reset()
    parts = torch.cat([dec.forward(torch.tensor(PROMPT[:4])), dec.forward(torch.tensor(PROMPT[4:5])),
                       dec.forward(torch.tensor(PROMPT[5:]))])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    assert dec.pos == len(PROMPT) and dec.cache[0][0].shape == (4, len(PROMPT), 1, 4)   # [L, T, Hkv/L, Dh]


def test_sharded_checkpoint_loads_the_same(make_model):
    cfg = config()
    one = make_model(cfg, seed=5)
    many = make_model(cfg, seed=5, shard_bytes=20_000)
    files = sorted(f for f in os.listdir(many) if f.endswith(".safetensors"))
    assert len(files) > 2 and os.path.exists(os.path.join(many, "model.safetensors.index.json"))
    index = json.load(open(os.path.join(many, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(files)
    a = ours(one)[1].forward(torch.tensor(PROMPT))
    b = ours(many)[1].forward(torch.tensor(PROMPT))
    assert torch.equal(a, b)


def test_spec_fields_and_modes():
    s = adapter.build_spec(Cfg(config(broadcast_delay=2, sliding_window_n_layers=-2, unclamped_layers=[4])))
    assert (s.family, s.num_layers, s.hidden_size, s.vocab_size, s.max_position) == ("laneformer", 5, 32, 97, 64)
    assert s.eos_token_ids == (2,) and s.bos_token_id == 1 and not s.tie_word_embeddings
    assert (s.head_dim, s.lane_q_heads, s.lane_kv_heads, s.lane_ffn) == (4, 2, 1, 12)
    assert s.rope.style == "pair" and s.windows == (None, None, None, 3, None)
    assert [s.reduce_mode(i) for i in range(5)] == [ALL, ALL, DELAYED, DELAYED, DELAYED]
    assert s.consumers(0) == (0, 2) and s.consumers(2) == (4,) and s.consumers(3) == ()
    s = adapter.build_spec(Cfg(config(use_early_comm=False, use_comm=False)))
    assert [s.reduce_mode(i) for i in range(5)] == [SCALED] * 5 and all(s.consumers(i) == () for i in range(5))
    assert len(s.layers) == 5 and s.layers[0].attn.num_heads == 8 and s.layers[0].sliding_window == 3
    s = adapter.build_spec(Cfg(config(sliding_window_n_layers=None)))
    assert s.windows == (3,) * 5


def test_tensor_refs_lane_shapes_and_linear_weights():
    s = adapter.build_spec(Cfg(config()))
    shapes = {r.layouts[0].hf_name: r.layouts[0].hf_shape for r in adapter.tensor_refs(s)}
    assert shapes["model.layers.0.attention.wq.weight"] == (4, 8, 32)
    assert shapes["model.layers.0.attention.wk.weight"] == (4, 4, 32)
    assert shapes["model.layers.0.attention.wo.weight"] == (4, 32, 8)
    assert shapes["model.layers.0.feed_forward.w1.weight"] == (4, 12, 32)
    assert shapes["model.layers.0.feed_forward.w2.weight"] == (4, 32, 12)
    assert shapes["model.layers.0.attention_norm.scale"] == (4, 32)
    final = [r for r in adapter.tensor_refs(s) if r.name == "final_norm"][0]
    # pre_norm_lane_agg: the final norm sees one summed stream, so [D] under either name
    assert [(x.hf_name, x.hf_shape) for x in final.layouts] == [("model.norm.scale", (32,)), ("model.norm.weight", (32,))]
    lin = adapter.linear_weights(s)
    assert len(lin) == 7 * 5 and all(len(shapes[n]) == 3 for n in lin)
    assert "lm_head.weight" not in lin and "model.tok_embeddings.weight" not in lin
    groups = adapter.fused_partners(s)
    assert groups[0] == tuple(f"model.layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv"))
    assert all(n in lin for g in groups for n in g)
    s = adapter.build_spec(Cfg(config(pre_norm_lane_agg=False, replicated_rmsn_scale=True)))
    shapes = {r.layouts[0].hf_name: r.layouts[0].hf_shape for r in adapter.tensor_refs(s)}
    assert shapes["model.norm.weight"] == (32,) and shapes["model.layers.3.ffn_norm.weight"] == (32,)


def test_2b_preset_matches_the_published_shape():
    s = adapter.build_spec(Cfg(preset("laneformer-2b")))
    assert (s.num_layers, s.num_lanes, s.num_heads, s.num_kv_heads, s.broadcast_delay) == (15, 8, 32, 16, 2)
    assert s.windows[:10] == (1024,) * 10 and s.windows[10:] == (None,) * 5
    assert 2.25e9 < s.num_params < 2.35e9 and 4.5e9 < 2 * s.num_params < 4.7e9
    refs = adapter.tensor_refs(s)
    total = sum(torch.Size(r.layouts[0].hf_shape).numel() for r in refs if not r.optional or not s.tie_word_embeddings)
    assert total == s.num_params
    assert set(PRESETS) == {"laneformer-2b", "laneformer-tiny"}


def test_tiny_preset_runs(make_model):
    d = make_model(preset("laneformer-tiny"), init_std=0.2)
    m, dec = ours(d)
    tokens, _ = greedy(dec, torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]), 4)
    assert len(tokens) == 4 and all(0 <= t < 256 for t in tokens)
    assert json.load(open(os.path.join(d, "config.json")))["torch_dtype"] == "float32"


def test_registered_as_a_models_preset():
    """dense/presets.py is the provider models/presets.py imports lazily."""
    from kie_moe.models import presets, synth
    from kie_moe.models.registry import spec_from_config
    assert "laneformer-2b" in presets.preset_names()
    spec = spec_from_config(presets.preset("laneformer-2b"))
    assert synth.count_params(spec)[0] == spec.num_params
    assert presets.tiny("laneformer-2b") == PRESETS["laneformer-tiny"]
