"""One request decodes at a time: concurrent clients get exactly what they would alone, waiters are served in
arrival order, a full queue answers 429, and a client that goes away frees the engine at once."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import MODEL, http, metric, openai_client, running_server

LONG = 4000        # tokens a "slow" request asks for: tens of seconds of CPU decoding if nobody cancelled it
PROMPT_IDS = [5, 6, 7, 8]


def ask(client, seed: int) -> str:
    """Odd seeds: streamed chat; even seeds: plain completion. Sampled, so each seed gives its own text."""
    if seed % 2:
        chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"seed {seed}"}],
                                                max_tokens=48, temperature=1.0, seed=seed, stream=True,
                                                extra_body={"ignore_eos": True})
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.completions.create(model=MODEL, prompt="Each expert", max_tokens=48, temperature=1.0, seed=seed,
                                     extra_body={"ignore_eos": True}).choices[0].text


def slow_stream(client):
    """A long streamed completion that has begun decoding (its first chunk has arrived)."""
    s = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=LONG, temperature=1.0, seed=1,
                                  stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    it = iter(s)
    next(it)
    return s, it


def wait_metric(base: str, name: str, value: float, timeout: float = 10.0, **labels) -> str:
    deadline = time.monotonic() + timeout
    with http() as h:
        while True:
            text = h.get(base + "/metrics").text
            if metric(text, name, **labels) == value:
                return text
            assert time.monotonic() < deadline, f"{name} never reached {value}:\n{text}"
            time.sleep(0.02)


def test_concurrent_clients_get_their_lone_text(server, client):
    seeds = list(range(101, 109))
    lone = {s: ask(client, s) for s in seeds}
    assert len(set(lone.values())) == len(seeds)         # the seeds really differ, so a mix-up would show
    clients = [openai_client(server[0]) for _ in seeds]  # one connection each, like separate users
    with ThreadPoolExecutor(len(seeds)) as ex:
        together = dict(zip(seeds, ex.map(ask, clients, seeds)))
    assert together == lone


def test_waiters_run_in_arrival_order_and_loop_stays_responsive(server, client, monkeypatch):
    base, svc = server
    s, _ = slow_stream(client)
    # the oracle is the order the engine starts each prompt in: the order client threads wake up after their
    # answers is the OS scheduler's, and on a busy machine D's 3 tokens can land before C's thread runs
    started, inner = [], svc.engine.stream

    def recording(ids, params):
        started.append(list(ids))
        return inner(ids, params)

    monkeypatch.setattr(svc.engine, "stream", recording)
    tags = {"B": 20, "C": 21, "D": 22}
    threads = []

    def short(tag):
        openai_client(base).completions.create(model=MODEL, prompt=PROMPT_IDS + [tags[tag]], max_tokens=3,
                                               temperature=0)

    try:
        for i, tag in enumerate(tags):
            threads.append(threading.Thread(target=short, args=(tag,)))
            threads[-1].start()
            wait_metric(base, "kie_queue_depth", i + 1)
        # decoding runs on the worker thread: the event loop still answers at once
        with http() as h:
            t0 = time.monotonic()
            assert h.get(base + "/health").status_code == 200
            assert time.monotonic() - t0 < 2.0
        wait_metric(base, "kie_requests_running", 1)
    finally:
        s.close()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert started == [PROMPT_IDS + [tags[t]] for t in "BCD"]


def test_queue_full_429_and_disconnects_free_the_engine(ckpt):
    with running_server(ckpt, max_queue=1) as (base, svc):
        c = openai_client(base)
        a, a_it = slow_stream(c)                     # decoding
        b = c.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=LONG, stream=True,
                                 extra_body={"ignore_eos": True})  # admitted: the response headers have come
        wait_metric(base, "kie_queue_depth", 1)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)

        # the waiting client leaves first: it must never run; then the decoding one leaves mid-stream
        b.close()
        wait_metric(base, "kie_queue_depth", 0)
        got = sum(len(ch.choices[0].model_extra["token_ids"]) for ch, _ in zip(a_it, range(5)))
        assert got == 5
        a.close()

        # a non-streamed request whose client times out is cancelled as well
        with http(timeout=0.5) as h, pytest.raises(httpx.ReadTimeout):
            h.post(base + "/v1/completions", json={"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": LONG,
                                                   "ignore_eos": True})

        t0 = time.monotonic()
        r = c.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        assert time.monotonic() - t0 < 5.0
        text = wait_metric(base, "kie_generations_finished_total", 3, reason="cancelled")
        # had any of the three run to its end, the engine would have produced LONG tokens for it alone
        assert metric(text, "kie_generation_tokens_total") < LONG
        assert metric(text, "kie_requests_running") == 0
        assert metric(text, "kie_requests_total", endpoint="/v1/completions", status="429") == 1
        assert metric(text, "kie_requests_total", endpoint="/v1/chat/completions", status="429") == 1
        assert not svc.sched.active
