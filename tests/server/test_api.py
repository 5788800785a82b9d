"""The OpenAI-compatible API, driven by the official `openai` client against a live server."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from .conftest import MODEL, http, metric, openai_client, running_server

SAMPLED = dict(temperature=1.0, seed=7, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def tok(ckpt):
    return AutoTokenizer.from_pretrained(ckpt)


def chat_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_models_and_health(server, client):
    base, svc = server
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with http() as h:
        r = h.get(base + "/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        r = h.get(base + "/v1/models")
        assert r.json()["data"][0]["max_model_len"] == svc.ctx == 4096


def test_completion_text_and_usage(client, tok):
    prompt = "The expert router"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, **SAMPLED)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    # the same prompt as token ids, with the ids returned: same text, and the ids decode to it
    r2 = client.completions.create(model=MODEL, prompt=tok.encode(prompt), max_tokens=20,
                                   **{**SAMPLED, "extra_body": {"ignore_eos": True, "return_token_ids": True}})
    ids = r2.choices[0].model_extra["token_ids"]
    assert r2.choices[0].text == c.text and len(ids) == 20
    assert tok.decode(ids, skip_special_tokens=True) == c.text


def test_completion_default_max_tokens_and_greedy(client):
    a = client.completions.create(model=MODEL, prompt="one two", temperature=0, extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt="one two", temperature=0, extra_body={"ignore_eos": True})
    assert a.usage.completion_tokens == 16 and a.choices[0].text == b.choices[0].text


def _hf_greedy(ckpt, ids, n):
    """HF transformers' own generate() on the same checkpoint (float32, greedy, EOS ignored): the oracle."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_over_the_api_is_hf_transformers_generate(client, ckpt, tok):
    """Greedy text and chat completions through the server (tokenizer, chat template, scheduler, engine) produce
    the tokens HF transformers' generate() produces from the same prompt ids."""
    r = client.completions.create(model=MODEL, prompt="The expert router", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == _hf_greedy(ckpt, tok.encode("The expert router"), 12)
    msgs = [{"role": "user", "content": "Name a small model."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == _hf_greedy(ckpt, chat_ids(tok, msgs), 12)


def test_completion_stream_matches(client):
    full = client.completions.create(model=MODEL, prompt="Kernel cache", max_tokens=24, **SAMPLED)
    chunks = list(client.completions.create(model=MODEL, prompt="Kernel cache", max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streamed_and_not(client, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a small model."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, **SAMPLED)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.message.content
    assert r.usage.prompt_tokens == len(chat_ids(tok, msgs)) and r.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **SAMPLED))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16
    # content given as a list of text parts renders like the plain string
    parts = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Name a "},
                                          {"type": "text", "text": "small model."}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, max_tokens=16, **SAMPLED) \
        .choices[0].message.content == c.message.content


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="Every layer", max_tokens=40, **SAMPLED)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 20
    stop = full[14:17]
    expected = full[:full.find(stop)]
    for stops in (stop, [stop, "never-in-this-text"]):
        r = client.completions.create(stop=stops, **kw)
        assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 40
    chunks = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never shows up changes nothing
    r = client.completions.create(stop=["\x00never"], **kw)
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length"


def test_chat_stop_string(client):
    msgs = [{"role": "user", "content": "Say something."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=30, **SAMPLED)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stop = full[10:12]
    r = client.chat.completions.create(stop=stop, **kw)
    assert r.choices[0].message.content == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_eos_ends_with_stop(client, server):
    # without ignore_eos, sampling eventually draws the eos token: finish_reason "stop", eos not in the text
    svc = server[1]
    eos = svc.engine.tokenizer.eos_token_id
    for seed in range(40):
        r = client.completions.create(model=MODEL, prompt="The", max_tokens=200, temperature=1.5, seed=seed,
                                      extra_body={"return_token_ids": True})
        ids = r.choices[0].model_extra["token_ids"]
        if r.choices[0].finish_reason == "stop":
            assert ids[-1] == eos and "</s>" not in r.choices[0].text
            assert r.usage.completion_tokens == len(ids) < 200
            return
    pytest.skip("no seed hit eos")


def test_sampling_fallbacks_metric(server, client, monkeypatch):
    """kie_sampling_fallback_draws_total adds what the engine's backend reports after a top-p request (the graph /
    monokernel samplers' count; this server's reference backend samples exactly, so a stand-in reports 2 here),
    and nothing after a request without top-k / top-p."""
    base, svc = server
    monkeypatch.setattr(svc.sched.engine.backend, "sampling_fallbacks", lambda: 2, raising=False)
    with http() as h:
        before = metric(h.get(base + "/metrics").text, "kie_sampling_fallback_draws_total")
        client.completions.create(model=MODEL, prompt="red blue", max_tokens=3, top_p=0.9, **SAMPLED)
        after_top_p = metric(h.get(base + "/metrics").text, "kie_sampling_fallback_draws_total")
        client.completions.create(model=MODEL, prompt="red blue", max_tokens=3, **SAMPLED)
        text = h.get(base + "/metrics").text
    assert after_top_p == before + 2 and metric(text, "kie_sampling_fallback_draws_total") == after_top_p
    assert "# TYPE kie_sampling_fallback_draws_total counter" in text


def test_metrics(server, client):
    base = server[0]
    with http() as h:
        before = h.get(base + "/metrics").text
        client.completions.create(model=MODEL, prompt="red blue", max_tokens=5, **SAMPLED)
        text = h.get(base + "/metrics").text
    assert metric(text, "kie_requests_total", endpoint="/v1/completions", status="200") == \
        metric(before, "kie_requests_total", endpoint="/v1/completions", status="200") + 1
    assert metric(text, "kie_generation_tokens_total") == metric(before, "kie_generation_tokens_total") + 5
    assert metric(text, "kie_prompt_tokens_total") > metric(before, "kie_prompt_tokens_total")
    for h_name in ("kie_time_to_first_token_seconds", "kie_time_per_output_token_seconds", "kie_prefill_seconds",
                   "kie_prefill_tokens_per_second"):
        assert metric(text, h_name + "_count") == metric(before, h_name + "_count") + 1
        assert f'{h_name}_bucket{{le="+Inf"}}' in text
    assert "# TYPE kie_queue_depth gauge" in text and metric(text, "kie_queue_depth") == 0
    # the engine's share of the first token (no queueing) is at most the request's
    assert 0 < metric(text, "kie_prefill_seconds_sum") <= metric(text, "kie_time_to_first_token_seconds_sum")


def test_model_without_tokenizer(ckpt_no_tok):
    import openai
    with running_server(ckpt_no_tok, name="ids-only") as (base, _):
        c = openai_client(base)
        r = c.completions.create(model="ids-only", prompt=[3, 4, 5], max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == "" and len(r.choices[0].model_extra["token_ids"]) == 6
        assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 6
        chunks = list(c.completions.create(model="ids-only", prompt=[3, 4, 5], max_tokens=6, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
        streamed = [t for ch in chunks for t in ch.choices[0].model_extra.get("token_ids") or []]
        assert streamed == r.choices[0].model_extra["token_ids"]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="ids-only", messages=[{"role": "user", "content": "hi"}])
        assert "no tokenizer" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="ids-only", prompt="text needs a tokenizer")
        assert e.value.body["param"] == "prompt"


def test_serve_warms_up_on_a_gpu_only(ckpt, monkeypatch, capsys):
    """`kie serve` runs Engine.warmup before answering when the engine is on a GPU (the decode kernels compile
    then, not in a first request), not on the CPU and not with --no-warmup (uvicorn's loop stubbed out)."""
    import types

    import uvicorn

    from kie_moe import server as S
    from kie_moe.engine import Engine
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    for dev, warm, want in (("cuda", True, True), ("cuda", False, False), ("cpu", True, False)):
        eng = Engine(ckpt, device="cpu", backend="reference")
        calls = []
        monkeypatch.setattr(eng, "warmup", lambda: calls.append(1) or ["greedy", "top-k"])
        monkeypatch.setattr(eng, "device", types.SimpleNamespace(type=dev))
        S.serve(ckpt, port=0, engine=eng, warmup=warm)
        assert bool(calls) == want, (dev, warm)
    assert capsys.readouterr().err.count("warm-up done in") == 1
