"""Presets and synthetic checkpoints: every preset's tiny variant writes, loads back through load_model with no
missing or extra tensors, and decodes; full-size specs match the published parameter counts; sharding keeps the
writer's memory bounded; HF transformers reads the same files and computes the same logits."""
import json
import os
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kie_moe.models import presets, synth
from kie_moe.models.errors import ConfigError
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import adapter_for, load_model, spec_from_config

# The built-in nine, fixed at import: providers (dense/presets.py: laneformer-2b, which neither HF transformers nor
# models/reference.py decode; tests/dense covers it) register more at run time, and whether they have by collection
# time depends on which test module imported them first.
NAMES = [n for n, c in presets.PRESETS.items() if c.get("model_type") != "laneformer"]
PROMPT = torch.tensor([1, 5, 7, 9, 11, 3, 2, 8, 4, 6])   # longer than the tiny sliding windows (4)


def features(spec):
    """Structural facts a tiny variant must share with its full-size preset."""
    lay0 = spec.layers[0]
    a = lay0.attn
    moes = [l.moe for l in spec.layers if l.moe is not None]
    m = moes[0] if moes else None
    wins = {l.sliding_window is not None for l in spec.layers}
    return dict(
        family=spec.family, attn=a.kind, gqa=a.num_kv_heads < a.num_heads, q_lora=a.q_lora_rank is not None,
        head_dim_decoupled=a.kind == "gqa" and a.num_heads * a.head_dim != spec.hidden_size,
        qk_norm=a.qk_norm, qkv_bias=a.qkv_bias, o_bias=a.o_bias, sinks=a.sinks, clip=a.clip_qkv is not None,
        rope=(a.rope.style, a.rope.scaling, a.rope.truncate, a.rope.mscale, a.rope.mscale_all_dim),
        tied=spec.tie_word_embeddings, dense_layers=any(l.moe is None for l in spec.layers), moe_layers=bool(moes),
        sliding=tuple(sorted(wins)),
        moe=None if m is None else (m.scoring, m.norm_topk_prob, m.routed_scaling_factor, m.n_group > 1,
                                    m.group_score, m.score_correction_bias, m.router_bias, m.expert_act,
                                    m.expert_bias, m.shared_intermediate_size > 0, m.shared_expert_gate,
                                    m.top_k < m.num_experts))


# ---- presets -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_tiny_keeps_every_structural_feature(name):
    full, small = spec_from_config(presets.preset(name)), spec_from_config(presets.tiny(name))
    assert features(small) == features(full)
    t_total, _ = synth.count_params(small)
    assert t_total < 1_000_000, f"tiny {name} has {t_total} parameters"
    cfg = presets.tiny(name)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = cfg.get(key)
        for i in ids if isinstance(ids, list) else [ids]:
            assert i is None or i < cfg["vocab_size"], f"tiny {name}: {key}={i} outside the vocabulary"


@pytest.mark.parametrize("name", NAMES)
def test_full_size_param_counts_match_published(name):
    spec = spec_from_config(presets.preset(name))
    pub = presets.PUBLISHED[name]
    total, active = synth.count_params(spec, embed_in_active=pub.embed_in_active)
    assert abs(total / pub.total - 1) < 0.03, f"{name}: {total / 1e9:.2f}B total vs published {pub.total / 1e9}B"
    assert abs(active / pub.active - 1) < 0.03, f"{name}: {active / 1e9:.2f}B active vs published {pub.active / 1e9}B"
    # the checkpoint we would write holds exactly the counted parameters
    tensors = synth.plan_tensors(spec, adapter_for(spec.family).tensor_refs(spec))
    assert sum(t.numel for t in tensors) == total


def test_full_size_structure():
    s = {n: spec_from_config(presets.preset(n)) for n in NAMES}
    v3 = s["deepseek-v3"]
    assert [l.moe is None for l in v3.layers[:4]] == [True, True, True, False] and v3.num_layers == 61
    assert v3.layers[3].moe.n_group == 8 and v3.layers[3].moe.topk_group == 4 and v3.layers[0].attn.q_lora_rank == 1536
    lite = s["deepseek-v2-lite"]
    assert lite.layers[0].attn.q_lora_rank is None and lite.layers[0].moe is None and lite.layers[1].moe.top_k == 6
    assert lite.layers[1].moe.shared_intermediate_size == 2 * 1408
    oss = s["gpt-oss-120b"]
    assert [l.sliding_window for l in oss.layers[:2]] == [128, None] and oss.layers[0].attn.rope.scaling == "yarn"
    llama = s["llama-3.2-1b"]
    assert llama.tie_word_embeddings and llama.layers[0].attn.rope.scaling == "llama3"
    assert s["qwen3-30b-a3b"].layers[0].attn.head_dim == 128 and s["qwen3-235b-a22b"].num_layers == 94
    assert s["mixtral-8x7b"].layers[0].moe.num_experts == 8 and s["olmoe-1b-7b"].layers[0].attn.qk_norm == "full"


def test_unknown_preset_names_the_preset():
    with pytest.raises(ConfigError, match="no-such-model"):
        presets.preset("no-such-model")
    with pytest.raises(ConfigError, match="no-such-model"):
        synth.write_synthetic("no-such-model", "/nonexistent", progress=False)


def test_register_preset(tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "PRESETS", dict(presets.PRESETS))
    monkeypatch.setattr(presets, "_TINY", dict(presets._TINY))
    monkeypatch.setattr(presets, "PUBLISHED", dict(presets.PUBLISHED))
    small = presets.tiny("llama-3.2-1b")
    presets.register_preset("my-llama", presets.preset("llama-3.2-1b"), small,
                            presets.Published(1.24e9, 1.24e9))
    assert "my-llama" in presets.preset_names() and presets.tiny("my-llama") == small
    assert synth.published("my-llama").total == 1.24e9
    with pytest.raises(ConfigError, match="already registered"):
        presets.register_preset("my-llama", presets.preset("llama-3.2-1b"))
    presets.register_preset("no-tiny", presets.preset("mixtral-8x7b"))
    with pytest.raises(ConfigError, match="no tiny variant"):
        presets.tiny("no-tiny")
    with pytest.raises(ConfigError, match="model_type"):
        presets.register_preset("bad", {"hidden_size": 3})
    synth.write_synthetic("my-llama", str(tmp_path), tiny=True, progress=False)
    assert load_model(str(tmp_path)).spec.family == "llama"


# ---- write -> load -> decode -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_tiny_writes_loads_and_decodes(name, tmp_path):
    synth.write_synthetic(name, str(tmp_path), tiny=True, progress=False)
    files = sorted(os.listdir(tmp_path))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(files)
    m = load_model(str(tmp_path))                      # raises on any missing / extra / mis-shaped tensor
    refs = adapter_for(m.spec.family).tensor_refs(m.spec)
    assert set(m.weights.names()) == {r.name for r in refs if not r.optional}
    assert m.config["torch_dtype"] == "bfloat16" and "quantization_config" not in m.config

    dec = ReferenceDecoder(m.spec, m.weights)
    logits = dec.forward(PROMPT)                       # prefill
    for _ in range(3):                                 # and a few decode steps
        nxt = dec.forward(logits[-1:].argmax(-1))
        logits = nxt
    assert torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 5               # neither flat nor saturated


def test_dtypes_in_files(tmp_path):
    synth.write_synthetic("deepseek-v3", str(tmp_path), tiny=True, progress=False)
    dtypes = {}
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            with safe_open(str(tmp_path / f), "pt") as h:
                dtypes.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
    assert dtypes.pop("model.layers.2.mlp.gate.e_score_correction_bias") == "F32"   # float32 in the real files too
    assert set(v for k, v in dtypes.items() if not k.endswith("e_score_correction_bias")) == {"BF16"}


def test_float32_and_metadata(tmp_path):
    synth.write_synthetic("gpt-oss-20b", str(tmp_path), tiny=True, dtype=torch.float32, progress=True)
    cfg = json.load(open(tmp_path / "config.json"))
    gen = json.load(open(tmp_path / "generation_config.json"))
    assert cfg["torch_dtype"] == "float32" and gen["eos_token_id"] == cfg["eos_token_id"] < cfg["vocab_size"]
    m = load_model(str(tmp_path))
    assert m.weights.get("embed").dtype == torch.float32
    # gpt-oss stores experts fused: one gate_up_proj per layer, read by 2 * E canonical refs
    assert m.weights.hf_name("layers.0.moe.experts.1.up") == "model.layers.0.mlp.experts.gate_up_proj"


def test_values_deterministic_and_sane(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d, seed in ((a, 0), (b, 0), (c, 1)):
        synth.write_synthetic("qwen3-30b-a3b", str(d), tiny=True, seed=seed, progress=False)
    ta, tb, tc = ({} for _ in range(3))
    for d, t in ((a, ta), (b, tb), (c, tc)):
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                t.update(load_file(str(d / f)))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.layers.0.self_attn.q_proj.weight"], tc["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(ta["model.norm.weight"], torch.ones(48, dtype=torch.bfloat16))
    up = ta["model.layers.0.mlp.experts.3.up_proj.weight"].float()          # [I, D], std 1/sqrt(D)
    assert abs(float(up.std()) * 48 ** 0.5 - 1) < 0.1 and abs(float(up.mean())) < 0.02
    q = ta["model.layers.0.self_attn.q_proj.weight"].float()                 # [Hq*Dh, D], peaked attention
    assert abs(float(q.std()) * 48 ** 0.5 - synth._QK_GAIN) < 0.2
    assert torch.equal(ta["model.layers.1.self_attn.k_norm.weight"], torch.full((16,), synth._QK_GAIN, dtype=torch.bfloat16))
    down = ta["model.layers.1.mlp.experts.0.down_proj.weight"].float()      # [D, I], 1/sqrt(I * 2 * layers)
    assert abs(float(down.std()) * (24 * 2 * 2) ** 0.5 - 1) < 0.1
    # two projections of the same shape are not copies of each other
    assert not torch.equal(ta["model.layers.0.mlp.experts.0.gate_proj.weight"], ta["model.layers.0.mlp.experts.1.gate_proj.weight"])


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "olmoe-1b-7b", "deepseek-v3", "gpt-oss-120b"])
def test_routing_is_not_degenerate(name, monkeypatch):
    # Random transformers give every token's hidden state a shared component (attention mixes values over the
    # prefix), so some experts are favoured (up to ~2.6x the uniform share here); what must not happen is a
    # router that sends every token to the same experts or never uses some of them.
    import kie_moe.models.reference as reference
    spec, store = synth.synth_weights_on_device(name, "cpu", torch.bfloat16, tiny=True)
    picks = []
    orig = reference.route

    def spy(moe, logits, bias):
        ids, w = orig(moe, logits, bias)
        picks.append((moe, ids))
        return ids, w

    monkeypatch.setattr(reference, "route", spy)
    tokens = torch.randint(0, spec.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    ReferenceDecoder(spec, store).forward(tokens)
    assert len(picks) == sum(l.moe is not None for l in spec.layers)
    for moe, ids in picks:
        T = ids.shape[0]
        counts = torch.bincount(ids.flatten(), minlength=moe.num_experts)
        assert (counts > 0).sum() >= moe.num_experts * 3 // 4, f"only {(counts > 0).sum()} experts ever chosen"
        assert counts.max() < 0.75 * T, f"one expert takes {int(counts.max())} of {T} tokens"
        assert len({tuple(sorted(r.tolist())) for r in ids}) > T // 4, "most tokens share one expert set"


# ---- sharding and memory -----------------------------------------------------------------------------------------

def test_plan_shards():
    spec = spec_from_config(presets.tiny("deepseek-v3"))
    tensors = synth.plan_tensors(spec, adapter_for(spec.family).tensor_refs(spec))
    big = max(t.nbytes for t in tensors)
    limit = big // 3
    shards = synth.plan_shards(tensors, limit)
    assert [t for s in shards for t in s] == tensors                    # order kept, nothing lost or doubled
    for s in shards:
        assert len(s) == 1 or sum(t.nbytes for t in s) <= limit         # only a lone oversized tensor may exceed
    assert len(synth.plan_shards(tensors, 2 ** 40)) == 1
    with pytest.raises(ConfigError, match="shard_bytes"):
        synth.plan_shards(tensors, 0)


def test_sharded_write_bounded_memory(tmp_path, monkeypatch):
    # Small chunks, so even tiny tensors stream in several pieces; then check by construction that the writer
    # never holds more than `workers` chunks drawn ahead + the one being written + the one before it.
    monkeypatch.setattr(synth, "_CHUNK_ELEMS", 500)
    orig = synth._chunk
    live: list = []
    peak = [0]
    workers = 3

    def tracking(t, seed, j, device="cpu"):
        held = [r().numel() * r().element_size() for r in list(live) if r() is not None]   # sizes, no refs
        peak[0] = max(peak[0], len(held))
        assert sum(held) <= (workers + 1) * 500 * 4
        c = orig(t, seed, j, device)
        live.append(weakref.ref(c))
        return c

    monkeypatch.setattr(synth, "_chunk", tracking)
    shard_bytes = 16 * 1024
    index = synth.write_synthetic("deepseek-v3", str(tmp_path), tiny=True, shard_bytes=shard_bytes,
                                  progress=False, workers=workers)
    assert peak[0] <= workers + 1 and len(live) > 100

    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]
    on_disk = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert on_disk == index and set(on_disk["weight_map"].values()) == set(shards)
    total = 0
    for f in shards:
        t = load_file(str(tmp_path / f))
        size = sum(x.numel() * x.element_size() for x in t.values())
        assert len(t) == 1 or size <= shard_bytes
        assert all(on_disk["weight_map"][k] == f for k in t)
        total += size
    assert total == on_disk["metadata"]["total_size"]

    # sharding and threads change files, not values (values are seeded per tensor chunk)
    monkeypatch.setattr(synth, "_chunk", orig)
    one = tmp_path / "one"
    synth.write_synthetic("deepseek-v3", str(one), tiny=True, progress=False, workers=1)
    two = tmp_path / "two"
    synth.write_synthetic("deepseek-v3", str(two), tiny=True, shard_bytes=shard_bytes, progress=False, workers=4)
    a, b = load_model(str(one)).weights, load_model(str(two)).weights
    assert len(os.listdir(one)) == 4 and all(torch.equal(a.get(k), b.get(k)) for k in a.names())


def test_refuses_to_clobber(tmp_path):
    synth.write_synthetic("olmoe-1b-7b", str(tmp_path), tiny=True, progress=False, shard_bytes=4096)
    with pytest.raises(ConfigError, match="overwrite=True"):
        synth.write_synthetic("olmoe-1b-7b", str(tmp_path), tiny=True, progress=False)
    synth.write_synthetic("olmoe-1b-7b", str(tmp_path), tiny=True, progress=False, overwrite=True)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == ["model-00001-of-00001.safetensors"]
    load_model(str(tmp_path))
    (tmp_path / "pytorch_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="pytorch_model.safetensors"):
        synth.write_synthetic("olmoe-1b-7b", str(tmp_path), tiny=True, progress=False, overwrite=True)


# ---- in memory ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt-oss-20b", "deepseek-v2-lite", "llama-3.2-1b"])
def test_on_device_store_matches_files(name, tmp_path):
    synth.write_synthetic(name, str(tmp_path), tiny=True, progress=False)
    disk = load_model(str(tmp_path)).weights
    spec, mem = synth.synth_weights_on_device(name, "cpu", torch.bfloat16, tiny=True)
    assert spec == load_model(str(tmp_path)).spec
    assert sorted(mem.names()) == sorted(disk.names())
    for k in disk.names():
        assert torch.equal(mem.get(k), disk.get(k)), k
    assert "embed" in mem and mem.hf_name("embed") == "model.embed_tokens.weight"
    with pytest.raises(KeyError):
        mem.get("nope")


def test_on_device_from_config_dict():
    cfg = presets.tiny("mixtral-8x7b")
    spec, store = synth.synth_weights_on_device(cfg, "cpu", torch.float32)
    assert spec.family == "mixtral" and store.get("embed").dtype == torch.float32
    assert torch.isfinite(ReferenceDecoder(spec, store).forward(PROMPT)).all()
    with pytest.raises(ConfigError, match="preset name"):
        synth.synth_weights_on_device(cfg, "cpu", tiny=True)


# ---- oracle we did not write: HF transformers reads our files and computes the same logits -------------------

@pytest.mark.parametrize("name", NAMES)
def test_hf_transformers_reads_synthetic_checkpoint(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    synth.write_synthetic(name, str(tmp_path), tiny=True, dtype=torch.float32, progress=False)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info                 # no missing / unexpected / mismatched keys
    m = load_model(str(tmp_path))
    ref = ReferenceDecoder(m.spec, m.weights).forward(PROMPT)
    with torch.no_grad():
        out = hf.eval()(PROMPT[None]).logits[0].float()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_lazy_synthetic_store_draws_the_same_values_when_read():
    """lazy=True holds nothing (the source draws a tensor per read) and reads back exactly the eager values."""
    spec, eager = synth.synth_weights_on_device("qwen3-30b-a3b", "cpu", torch.bfloat16, tiny=True)
    _, lazy = synth.synth_weights_on_device("qwen3-30b-a3b", "cpu", torch.bfloat16, tiny=True, lazy=True)
    assert isinstance(lazy.source, synth.SynthSource) and sorted(lazy.names()) == sorted(eager.names())
    for n in sorted(eager.names()):
        assert torch.equal(lazy.get(n), eager.get(n)), n
