"""Every family against HF transformers' own modeling code: identical greedy tokens through `kie generate
--backend reference --device cpu`, and close logits along the whole prefill + decode path."""
import json

import pytest
import torch

from kie_moe import cli
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import load_model

from .hf_tiny import CASES, make_checkpoint

PROMPT_LEN, NEW = 20, 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(case, dtype=torch.float32):
        key = (case, dtype)
        if key not in made:
            d = tmp_path_factory.mktemp(f"{case}_{str(dtype).split('.')[-1]}")
            made[key] = (str(d), make_checkpoint(case, str(d), dtype))
        return made[key]
    return get


def run_cli(capsys, args):
    rc = cli.main(args)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_hf(case, checkpoints, capsys):
    path, hf = checkpoints(case)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=g)
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, PROMPT_LEN:].tolist()
    got = run_cli(capsys, ["generate", path, "--prompt-ids", ",".join(map(str, prompt.tolist())),
                           "--max-new-tokens", str(NEW), "--ignore-eos", "--device", "cpu",
                           "--backend", "reference", "--json"])
    assert got["backend"] == "reference"
    assert got["token_ids"] == want
    assert len(set(want)) > 2, "degenerate test model: greedy output barely changes"


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_through_kv_cache(case, checkpoints):
    path, hf = checkpoints(case)
    m = load_model(path)
    ref = ReferenceDecoder(m.spec, m.weights)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN + 8,), generator=g)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    got = [ref.forward(ids[:PROMPT_LEN])]
    for t in ids[PROMPT_LEN:]:                      # one token at a time: the decode path
        got.append(ref.forward(t[None]))
    got = torch.cat(got)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-4 * scale + 1e-5


@pytest.mark.parametrize("case", ["qwen3_moe_mixed", "gpt_oss", "deepseek_v3"])
def test_bf16_checkpoint_reads_as_hf_sees_it(case, checkpoints, capsys):
    """bf16 weights on disk are upcast to float32 by the reference decoder, as HF does with dtype=float32."""
    path, hf32 = checkpoints(case, torch.bfloat16)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = list(range(3, 3 + PROMPT_LEN))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, PROMPT_LEN:].tolist()
    got = run_cli(capsys, ["generate", path, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                           str(NEW), "--ignore-eos", "--device", "cpu", "--backend", "reference", "--json"])
    assert got["token_ids"] == want
