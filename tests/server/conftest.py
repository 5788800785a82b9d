"""Fixtures for the server tests: tiny checkpoints (with and without a tokenizer) and real uvicorn servers on
127.0.0.1, each in a background thread of this process, bound to a free port. Clients never honour proxy
settings from the environment (trust_env=False), so nothing leaves loopback."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from .tiny_chat import make_chat_checkpoint

MODEL = "tiny-chat"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's ops are far too small to split; with two intra-op threads on a busy 2-core machine,
    OpenMP's spin-waiting made decoding ~60x slower. Restored after each module, so other folders are unaffected."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> str:
    return make_chat_checkpoint(str(tmp_path_factory.mktemp("chat_ckpt")))


@pytest.fixture(scope="session")
def ckpt_no_tok(tmp_path_factory) -> str:
    return make_chat_checkpoint(str(tmp_path_factory.mktemp("ids_ckpt")), with_tokenizer=False)


@contextmanager
def running_server(model_dir: str, name: str = MODEL, **kw):
    """Yield (base_url, Service) of a live server on its own Engine; stop it on exit."""
    import uvicorn

    from kie_moe.engine import Engine
    from kie_moe.server import bind, create_app

    app = create_app(Engine(model_dir, device="cpu", backend="reference"), name, **kw)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app.service
    finally:
        server.should_exit = True
        th.join(10)


def openai_client(base: str, api_key: str = "unused", timeout: float = 60.0):
    from openai import OpenAI
    return OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=timeout,
                  http_client=httpx.Client(trust_env=False, timeout=timeout))


def http(timeout: float = 60.0) -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=timeout)


def metric(text: str, name: str, **labels) -> float:
    """Value of one sample in Prometheus text (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def server(ckpt):
    with running_server(ckpt) as (base, svc):
        yield base, svc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[0])
