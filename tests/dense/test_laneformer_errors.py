"""Bad input names what is wrong: config fields that do not split over the lanes or heads, lane tensors of the
wrong shape, norms of the wrong kind, positions past the context."""
from __future__ import annotations

import os

import pytest
import torch
from laneformer_helpers import config
from safetensors.torch import load_file, save_file

from kie_moe.dense import adapter
from kie_moe.models.errors import CheckpointError, ConfigError, InputError
from kie_moe.models.families.common import Cfg
from kie_moe.models.registry import load_model, spec_from_config


@pytest.mark.parametrize("over,field", [
    (dict(hidden_size=30), "hidden_size=30 is not divisible by num_lanes=4"),
    (dict(intermediate_size=50), "intermediate_size=50 is not divisible by num_lanes=4"),
    (dict(num_attention_heads=6), "num_attention_heads=6 is not divisible by num_lanes=4"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 is not divisible by num_lanes=4"),
    (dict(num_attention_heads=12, num_key_value_heads=8), "num_attention_heads=12 is not divisible by num_key_value_heads=8"),
    (dict(hidden_size=36, num_attention_heads=8), "hidden_size=36 is not divisible by num_attention_heads=8"),
    (dict(hidden_size=24, intermediate_size=48, num_attention_heads=8), "head_dim=3"),
    (dict(num_lanes=None), "'num_lanes' is missing"),
    (dict(num_lanes=0), "'num_lanes' must be positive"),
    (dict(broadcast_delay=-1), "'broadcast_delay' must be >= 0"),
    (dict(use_comm="yes"), "'use_comm' must be true or false"),
    (dict(lm_head_type="untied"), "lm_head_type 'untied'"),
    (dict(sliding_window_n_layers=9), "sliding_window_n_layers=9"),
    (dict(unclamped_layers=[5]), "unclamped_layers [5]"),
    (dict(head_dim=8), "head_dim=8"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(norm_eps=0), "'norm_eps'"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ConfigError) as e:
        spec_from_config(config(**over), "/m/config.json")
    assert field in str(e.value) and str(e.value).startswith("/m/config.json: ")


def test_bad_dense_config_through_load_model(tmp_path):
    import json
    json.dump(config(intermediate_size=50), open(tmp_path / "config.json", "w"))
    with pytest.raises(ConfigError, match="intermediate_size=50 is not divisible by num_lanes=4"):
        load_model(str(tmp_path))


def _rewrite(model_dir: str, edit):
    path = os.path.join(model_dir, "model.safetensors")
    t = load_file(path)
    edit(t)
    save_file(t, path)


@pytest.mark.parametrize("name,shape", [
    ("model.layers.2.attention.wq.weight", (4, 9, 32)),      # wrong out/L
    ("model.layers.0.attention.wo.weight", (4, 8, 32)),      # stored [L, in/L, D] instead of [L, D, in/L]
    ("model.layers.4.feed_forward.w2.weight", (2, 32, 24)),  # split over 2 lanes, config says 4
    ("model.layers.1.feed_forward.w3.weight", (48, 32)),     # a plain Llama [out, in] matrix
])
def test_mis_shaped_lane_tensor_names_tensor_and_shapes(name, shape, make_model):
    d = make_model(config())
    want = {r.layouts[0].hf_name: r.layouts[0].hf_shape for r in adapter.tensor_refs(adapter.build_spec(Cfg(config())))}[name]

    def edit(t):
        t[name] = torch.zeros(shape)

    _rewrite(d, edit)
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert name in msg and str(list(shape)) in msg and str(list(want)) in msg and "model.safetensors" in msg


def test_shared_norm_where_per_lane_scales_are_expected(make_model):
    d = make_model(config())

    def edit(t):
        t["model.layers.0.attention_norm.weight"] = t.pop("model.layers.0.attention_norm.scale")[0]

    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.0.attention_norm.scale"):
        load_model(d)


def test_positions_past_the_context(make_model):
    m = load_model(make_model(config(max_position_embeddings=10)))
    dec = adapter.reference_decoder(m.spec, m.weights)
    dec.forward(torch.arange(8))
    with pytest.raises(InputError, match="max_position_embeddings=10"):
        dec.forward(torch.arange(3))
