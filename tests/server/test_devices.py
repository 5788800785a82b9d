"""`kie serve --devices 2 --device cpu`: rank 0 serves HTTP while both CPU processes decode every request in lockstep
(tensor-parallel reference ranks over KCCL). Its answers equal the one-device server's, including after a request
that rank 0 stopped early (a stop string; a client that left), and SIGTERM stops every process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kie_moe.launch import free_port

from .conftest import MODEL, http, openai_client

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def two_rank_server(ckpt):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kie_moe.cli", "serve", ckpt, "--device", "cpu", "--devices", "2",
                             "--port", str(port), "--served-model-name", MODEL],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with http(timeout=2) as h:
            while True:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the 2-device server did not come up"
                try:
                    if h.get(base + "/health").status_code == 200:
                        break
                except Exception:
                    pass
                time.sleep(0.2)
        yield base, proc
    finally:
        if proc.poll() is None:                 # the test failed before stopping it: everything it started goes
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_two_cpu_ranks_answer_like_one(two_rank_server, client):
    base, proc = two_rank_server
    with http() as h:
        health = h.get(base + "/health").json()
    assert (health["backend"], health["devices"]) == ("tp-reference+kccl", 2)
    two = openai_client(base)

    def greedy(c, prompt="The expert router", n=12):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, **GREEDY)
        return r.choices[0].text, r.choices[0].model_extra["token_ids"]

    want = greedy(client)
    assert greedy(two) == want and len(set(want[1])) > 2
    # a stop string: rank 0 stops after the token that completes it; the other rank stops at the same step
    msgs = [{"role": "user", "content": "Name a small model."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stop=[" "], extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw).choices[0]
    b = two.chat.completions.create(**kw).choices[0]
    assert (b.message.content, b.finish_reason) == (a.message.content, a.finish_reason)
    # a client that leaves mid-stream
    with http() as h, h.stream("POST", base + "/v1/completions",
                               json={"model": MODEL, "prompt": "one two", "max_tokens": 200, "stream": True,
                                     "ignore_eos": True}) as r:
        next(r.iter_lines())
    # sampling: rank 0 samples from the gathered logits with the request's seed
    sampled = dict(model=MODEL, prompt="Kernel cache", max_tokens=10, temperature=1.0, seed=7,
                   extra_body={"ignore_eos": True})
    assert two.completions.create(**sampled).choices[0].text == client.completions.create(**sampled).choices[0].text
    assert greedy(two, "one two", 8) == greedy(client, "one two", 8)      # still in lockstep

    proc.send_signal(signal.SIGTERM)           # the launcher stops rank 0 (graceful), which stops the other rank
    rc = proc.wait(30)
    err = proc.stderr.read()
    assert rc in (0, 128 + signal.SIGTERM) and "Traceback" not in err, err
