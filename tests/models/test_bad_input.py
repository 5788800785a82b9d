"""Bad input gets one clear line on stderr and exit code 2, never a traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kie_moe import cli

from .hf_tiny import make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    make_checkpoint("qwen3_moe_mixed", str(d))
    return str(d)


def clone(good, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(good, d)
    return str(d)


def fails(capsys, args, *needles):
    rc = cli.main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "\n" not in err and "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


def gen(path, ids="1,2,3", *extra):
    return ["generate", path, "--prompt-ids", ids, "--device", "cpu", "--max-new-tokens", "2", *extra]


def test_missing_directory(capsys, tmp_path):
    fails(capsys, gen(str(tmp_path / "nope")), "no such model directory")


def test_missing_config(capsys, tmp_path):
    fails(capsys, gen(str(tmp_path)), "config.json", "missing")


def test_unsupported_model_type_lists_supported(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    cfg = json.load(open(f"{d}/config.json"))
    cfg["model_type"] = "bert"
    json.dump(cfg, open(f"{d}/config.json", "w"))
    fails(capsys, gen(d), "'bert'", "qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral")


def test_missing_field_named(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    cfg = json.load(open(f"{d}/config.json"))
    del cfg["hidden_size"]
    json.dump(cfg, open(f"{d}/config.json", "w"))
    fails(capsys, gen(d), "hidden_size")


def _edit_tensors(d, fn):
    f = f"{d}/model.safetensors"
    t = load_file(f)
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


def test_missing_tensor_named(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.experts.4.up_proj.weight"))
    fails(capsys, gen(d), "missing tensor", "model.layers.1.mlp.experts.4.up_proj.weight")


def test_extra_tensor_named(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    _edit_tensors(d, lambda t: t.__setitem__("model.layers.1.mlp.experts.9.up_proj.weight", torch.zeros(40, 64)))
    fails(capsys, gen(d), "unexpected tensor", "model.layers.1.mlp.experts.9.up_proj.weight")


def test_misshaped_tensor_names_both_shapes(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)))
    fails(capsys, gen(d), "model.layers.0.self_attn.k_proj.weight", "[16, 64]", "[32, 64]")


def test_truncated_safetensors(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    f = f"{d}/model.safetensors"
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    fails(capsys, gen(d), "model.safetensors", "truncated")


def test_prompt_id_outside_vocab(capsys, good):
    fails(capsys, gen(good, "1,2,211"), "211", "outside the vocabulary")


def test_prompt_longer_than_context(capsys, good):
    fails(capsys, gen(good, ",".join(["1"] * 600)), "600 tokens", "context is 512")


def test_prompt_plus_new_tokens_over_context(capsys, good):
    fails(capsys, gen(good, ",".join(["1"] * 500), "--max-new-tokens", "20"), "exceeds", "512")


def test_text_prompt_without_tokenizer(capsys, good):
    fails(capsys, ["generate", good, "--prompt", "hello", "--device", "cpu"], "tokenizer")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_file_is_named(capsys, tmp_path, name):
    from kie_moe.synthetic import EMBEDDED_DEMO
    d = tmp_path / "demo"
    shutil.copytree(EMBEDDED_DEMO, d)
    (d / name).write_text('{"truncated": ')
    fails(capsys, ["generate", str(d), "--prompt", "hello", "--device", "cpu", "--max-new-tokens", "1"],
          str(d / name), "cannot load the tokenizer")


def test_bad_sampling_options(capsys, good):
    fails(capsys, gen(good, "1,2", "--temperature", "-1"), "temperature")
    fails(capsys, gen(good, "1,2", "--top-p", "0"), "top_p")


def test_console_script_prints_no_traceback(good, tmp_path):
    """The installed `kie` entry point, as a user runs it."""
    kie = os.path.join(os.path.dirname(sys.executable), "kie")
    r = subprocess.run([kie, "generate", str(tmp_path / "missing"), "--prompt-ids", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no such model directory" in r.stderr
    r = subprocess.run([kie, "generate", good, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json",
                        "--device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 4 and out["text"] is None and out["backend"] == "reference"
    assert out["tokens_per_s"] > 0


# ---- session 15's bad-input audit: each of these ran silently wrong or ended in a traceback before ----------------

def _edit_config(d, **kv):
    cfg = json.load(open(f"{d}/config.json"))
    cfg.update(kv)
    json.dump(cfg, open(f"{d}/config.json", "w"))


def _rewrite(d, fn):
    p = f"{d}/model.safetensors"
    save_file(fn(load_file(p)), p)


def test_integer_weight_in_a_float_checkpoint_is_named(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    _rewrite(d, lambda t: {**t, name: t[name].to(torch.int32)})
    fails(capsys, gen(d), "model.safetensors", name, "I32")


def test_two_shards_with_one_tensor_and_no_index(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    save_file({name: load_file(f"{d}/model.safetensors")[name]}, f"{d}/z-model.safetensors")
    fails(capsys, gen(d), "z-model.safetensors", name, "also in")


@pytest.mark.parametrize("cfg,needles", [
    ([1, 2], ("config.json", "JSON object")),
    (dict(rms_norm_eps=-1.0), ("rms_norm_eps", "positive")),
    (dict(rms_norm_eps="abc"), ("config.json", "abc")),
    (dict(num_experts_per_tok=20), ("num_experts_per_tok", "20")),
    (dict(rope_parameters={"rope_type": "warp", "rope_theta": 1e4}), ("config.json", "warp")),
    (dict(eos_token_id=10**6), ("config.json", "eos_token_id", "1000000", "vocab_size")),
    (dict(eos_token_id=[2, "x"]), ("config.json", "eos_token_id", "'x'")),
])
def test_config_settings_that_break_the_math_are_named(capsys, good, tmp_path, cfg, needles):
    d = clone(good, tmp_path)
    if isinstance(cfg, list):
        json.dump(cfg, open(f"{d}/config.json", "w"))
    else:
        _edit_config(d, **cfg)
    fails(capsys, gen(d), *needles)


def test_generation_config_eos_outside_vocab_is_named(capsys, good, tmp_path):
    d = clone(good, tmp_path)
    json.dump({"eos_token_id": [1, 99999]}, open(f"{d}/generation_config.json", "w"))
    fails(capsys, gen(d), "generation_config.json", "eos_token_id", "99999")


@pytest.mark.parametrize("backend", ["reference", "graph", "monokernel"])
def test_nan_weights_are_not_a_silent_eos(capsys, good, tmp_path, backend):
    d = clone(good, tmp_path)
    _rewrite(d, lambda t: {**t, "model.norm.weight": torch.full_like(t["model.norm.weight"], float("nan"))})
    fails(capsys, gen(d, "1,2,3", "--backend", backend), "not finite", "step 0")


@pytest.mark.parametrize("backend", ["graph", "monokernel"])
def test_top_k_beyond_the_device_samplers_candidates(capsys, good, backend):
    """The GPU backends' samplers keep 64 candidates per vocab tile: a larger top-k is one line, exit 2 (the graph
    backend raised a ValueError traceback; the monokernel refused top-k altogether)."""
    fails(capsys, gen(good, "1,2,3", "--backend", backend, "--temperature", "1", "--top-k", "100"), "top_k 100",
          "64 candidates")


@pytest.mark.parametrize("extra,needle", [(("--temperature", "nan"), "temperature"),
                                          (("--temperature", "inf"), "temperature"),
                                          (("--chat",), "--chat")])
def test_sampling_and_chat_flags(capsys, good, extra, needle):
    fails(capsys, gen(good, "1,2,3", *extra), needle)


def test_unwritable_destinations(capsys, good, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fails(capsys, ["convert", good, str(blocker / "out"), "--scheme", "fp8"], "cannot create", str(blocker))
    fails(capsys, ["synth", "qwen3-30b-a3b", str(blocker / "x"), "--tiny", "--quiet"], "cannot create")
