"""Bad requests get a 400 with an OpenAI-style error body and the server keeps serving; the API key; the CLI."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from kie_moe import cli

from .conftest import MODEL, http, openai_client

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 4}

BAD = [  # (endpoint, body, param the error should name)
    ("completions", {**COMP, "model": "gpt-4"}, "model"),
    ("completions", {**COMP, "max_tokens": -1}, "max_tokens"),
    ("completions", {**COMP, "max_tokens": 0}, "max_tokens"),
    ("completions", {**COMP, "max_tokens": 10**12}, "max_tokens"),
    ("completions", {**COMP, "max_tokens": 4096}, "max_tokens"),  # prompt + max_tokens over the 4096 context
    ("completions", {**COMP, "max_tokens": "ten"}, "max_tokens"),
    ("completions", {**COMP, "max_tokens": 4.5}, "max_tokens"),
    ("completions", {**COMP, "temperature": "hot"}, "temperature"),
    ("completions", {**COMP, "temperature": -1}, "temperature"),
    ("completions", {**COMP, "top_p": 0}, "top_p"),
    ("completions", {**COMP, "seed": "x"}, "seed"),
    ("completions", {**COMP, "seed": 2**70}, "seed"),
    ("completions", {**COMP, "stop": 5}, "stop"),
    ("completions", {**COMP, "stream": "yes"}, "stream"),
    ("completions", {**COMP, "n": 2}, "n"),
    ("completions", {**COMP, "prompt": 42}, "prompt"),
    ("completions", {**COMP, "prompt": ""}, "prompt"),
    ("completions", {**COMP, "prompt": []}, "prompt"),
    ("completions", {**COMP, "prompt": ["a", "b"]}, "prompt"),
    ("completions", {**COMP, "prompt": [1, 2, 10**6]}, "prompt"),
    ("completions", {**COMP, "prompt": [1] * 5000}, "prompt"),
    ("completions", {"model": MODEL}, "prompt"),
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}, {"role": "assistant"},
                                               {"role": "user", "content": "b"}]}, "messages.1.content"),
    ("chat/completions", {**CHAT, "max_completion_tokens": -5}, "max_tokens"),
    ("chat/completions", {**CHAT, "model": "other"}, "model"),
    ("chat/completions", {**CHAT, "n": 3}, "n"),
    ("chat/completions", {**CHAT, "logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_request_is_400(server, endpoint, body, param):
    with http() as h:
        r = h.post(f"{server[0]}/v1/{endpoint}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"just a string"', b"\xff\xfe"])
def test_invalid_json_is_400(server, raw):
    with http() as h:
        r = h.post(f"{server[0]}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_server_keeps_serving_after_bad_requests(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="nope", prompt="x", max_tokens=3)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                       max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    with http() as h:
        assert h.get(server[0] + "/v1/nothing").json()["error"]["message"]


def test_engine_failure_fails_one_request_only(server, client):
    """A backend that raises mid-generation: that request gets a 500 (or an error event when streamed), the
    worker thread survives, and the next request is served."""
    eng = server[1].engine
    real = eng.stream

    def broken(ids, p):
        yield 3
        raise RuntimeError("simulated kernel fault")

    eng.stream = broken
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=5)
        assert "simulated kernel fault" in e.value.body["message"] and e.value.body["type"] == "server_error"
        with pytest.raises(openai.APIError, match="simulated kernel fault"):
            list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=5, stream=True))
    finally:
        eng.stream = real
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_max_model_len(ckpt):
    from .conftest import running_server
    with running_server(ckpt, max_model_len=32) as (base, _):
        c = openai_client(base)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt=[1] * 20, max_tokens=13)
        assert e.value.body["code"] == "context_length_exceeded"
        r = c.completions.create(model=MODEL, prompt=[1] * 20, max_tokens=12, extra_body={"ignore_eos": True})
        assert r.usage.total_tokens == 32


def _free_port_holder():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_cli_errors_are_one_line(ckpt, capsys, tmp_path):
    def fails(args, needle):
        assert cli.main(["serve", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err and needle in err, err
    fails([str(tmp_path / "missing")], "missing")
    fails([ckpt, "--max-model-len", "100000"], "--max-model-len")
    fails([ckpt, "--max-queue", "-1"], "--max-queue")
    fails([ckpt, "--port", "70000"], "--port")
    holder = _free_port_holder()
    try:
        fails([ckpt, "--port", str(holder.getsockname()[1])], "cannot listen")
    finally:
        holder.close()


def test_cli_serve_with_api_key(ckpt, tmp_path):
    """`kie serve` as a real process: port 0, API key; /v1 needs the key, /health does not."""
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "KIE_API_KEY"}
    env["OMP_NUM_THREADS"] = "1"  # see conftest.one_torch_thread
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kie_moe.cli", "serve", ckpt, "--port", "0",
                                 "--api-key", "s3cret", "--served-model-name", "keyed", "--device", "cpu"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        base, deadline = None, time.monotonic() + 60
        while base is None:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            for line in log.read_text().splitlines():
                if "on http://127.0.0.1:" in line:
                    base = "http://" + line.split("on http://")[1].split()[0]
            time.sleep(0.05)
        with http() as h:  # uvicorn may still be starting after our line
            while True:
                try:
                    if h.get(base + "/health").status_code == 200:
                        break
                except Exception:
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.05)
            r = h.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai_client(base, api_key="wrong").models.list()
        good = openai_client(base, api_key="s3cret")
        assert [m.id for m in good.models.list().data] == ["keyed"]
        r = good.chat.completions.create(model="keyed", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        # Ctrl-C with a stream open: the stream ends at once with an error event, and the process exits cleanly
        it = iter(good.completions.create(model="keyed", prompt=[1, 2, 3], max_tokens=4000, stream=True,
                                          extra_body={"ignore_eos": True}))
        next(it)
        proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shut down"):
            for _ in it:
                pass
        assert proc.wait(30) in (0, 130)
        out = log.read_text()
        assert "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(15)
