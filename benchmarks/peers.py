"""Same-shape peers on the same GPU: HF transformers (eager, and static cache + torch.compile) beside our graph
backend, batch 1, random weights with a real architecture's shapes (models/presets.py), greedy, EOS ignored.

    python benchmarks/peers.py --out peers.json                                  # default shapes and modes
    python benchmarks/peers.py --arch qwen3-30b-a3b --modes compile --out peers-qwen3.json
    python benchmarks/peers.py --join R/peers*.json R/graph.json R/bench.json --out R/peers-vs-ours.json  # CPU

Every measurement runs in its own subprocess (a segfault, e.g. inductor's CUDA-graph path, kills only that child:
the row records the signal and the log tail, and the run goes on). Per shape:

- hf eager: model.generate with the default DynamicCache, no compile.
- hf compile: generate(past_key_values=StaticCache, compile_config=CompileConfig(mode=M)): transformers 5.x
  compiles the decode forward itself (prefill stays eager, so the StaticCache is allocated and its addresses
  marked static outside the compiled region; one cache for all calls, reset in place in between, so the CUDA
  graphs keep their addresses) -- the old script's torch.compile(model.forward) also compiled the
  prefill, where the cache is created inside the traced region, and segfaulted under mode="reduce-overhead"
  (results/2026-12-02-h200-peers-compile-segfault.log; pytorch/pytorch#192748 is that crash). M is tried in the
  order of --compile-modes (reduce-overhead, then default, then max-autotune-no-cudagraphs) until one child
  succeeds; the row says which mode produced the number and what happened to the ones before it.
- hf static (not by default): the same StaticCache without compile (generate(disable_compile=True)).
- ours (--ours graph): `kie bench ARCH --backend graph` (kie_moe.bench.run, bf16, same prompt and token counts);
  --ours-schemes bf16,fp8 adds a row per scheme (the peers stay bf16).

Timing, identical for peers and ours: one warm-up generation of the same shape, then --runs timed generations;
tok/s = (tokens - 1) / (time of the last token - time of the first token), median (the first token is the
prefill's; a streamer stamps each token after a device sync, which HF's generate does per step anyway). TTFT and
end-to-end tok/s (new tokens / whole call, the metric of DESIGN.md §6's earlier numbers) are recorded too.

JSON: {"schema": "kie-peers/1", "meta": {...}, "rows": [...], "ratios": [...]}, written after every child. A row:
arch, peer ("hf-transformers" | "kie"), mode (eager | static | compile | graph), compile_mode, tok_per_s,
e2e_tok_per_s, ttft_s, runs, error / signal / log_tail, attempts (compile fallbacks). "ratios" joins each peer row
with our graph backend's row of the same shape in each scheme (bf16 always; this run's, else one from --join
files): ours / peer.
HF has no Laneformer model class (a custom family, dense/): its peer rows say so instead of a number.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

DEFAULT_ARCHS = ["llama-3.2-1b", "qwen3-30b-a3b", "gpt-oss-20b", "laneformer-2b"]
COMPILE_MODES = ["reduce-overhead", "default", "max-autotune-no-cudagraphs"]
SCHEMA = "kie-peers/1"
_HERE = os.path.dirname(os.path.abspath(__file__))


# ---- HF side (runs in a child) ---------------------------------------------------------------------------------

def hf_config(arch: str, layers: int | None = None, tiny: bool = False):
    """(transformers config, None) for preset `arch` (its tiny variant with `tiny`), or (None, reason) when
    transformers cannot build the family."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kie_moe.models.presets import preset
    from kie_moe.models.presets import tiny as tiny_preset
    cfg_d = tiny_preset(arch) if tiny else preset(arch)
    mt = cfg_d.pop("model_type")
    if mt not in CONFIG_MAPPING:
        return None, (f"transformers {__import__('transformers').__version__} has no model_type {mt!r} (a custom "
                      f"family implemented in this repository only): no HF peer of this shape")
    if layers:
        cfg_d["num_hidden_layers"] = layers
        if "layer_types" in cfg_d:
            cfg_d["layer_types"] = cfg_d["layer_types"][:layers]
    drop = ("architectures", "quantization_config", "auto_map", "torch_dtype", "dtype", "transformers_version")
    return AutoConfig.for_model(mt, **{k: v for k, v in cfg_d.items() if k not in drop}), None


def _median(xs):
    return statistics.median(xs) if xs else None


def hf_peer(arch: str, mode: str, compile_mode: str | None, prompt_len: int, new_tokens: int, runs: int,
            layers: int | None = None, device: str = "cuda", tiny: bool = False) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    cfg, why = hf_config(arch, layers, tiny)
    if cfg is None:
        return {"skipped": why}
    dev = torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    class Clock(BaseStreamer):
        """Host time of each put() after a device sync. put #0 is the prompt; #1 the first new token."""
        def __init__(self):
            self.t = []

        def put(self, value):
            sync()
            self.t.append(time.perf_counter())

        def end(self):
            pass

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with dev:                                # random init straight in device memory (qwen3-30b-a3b: 61 GB)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():                    # never time on the init's values alone; norms stay at their init
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    sync()
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=dev)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    cache = None
    if mode in ("static", "compile"):
        # One StaticCache for every call, reset in place in between (transformers' documented reuse): a fresh
        # cache per generate() would give the compiled decode new static addresses, i.e. CUDA-graph re-recording
        # inside each timed run.
        from transformers import StaticCache
        cache = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
    if mode == "static":
        kw["disable_compile"] = True
    if mode == "compile":
        from transformers import CompileConfig
        kw["compile_config"] = CompileConfig(mode=compile_mode)

    def timed():
        clock = Clock()
        extra = {}
        if cache is not None:
            cache.reset()
            extra["past_key_values"] = cache
        sync()
        t_call = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, streamer=clock, **kw, **extra)
        sync()
        t_end = time.perf_counter()
        n = len(clock.t) - 1                 # new tokens streamed
        dec = clock.t[-1] - clock.t[1] if n > 1 else 0.0
        return dict(n=n, tok_per_s=(n - 1) / dec if dec > 0 else 0.0, ttft_s=clock.t[1] - t_call,
                    e2e_tok_per_s=n / (t_end - t_call))

    t0 = time.perf_counter()
    warm = timed()                           # compiles (compile mode), CUDA-graph records, allocator warm-up
    warm_s = time.perf_counter() - t0
    res = [timed() for _ in range(runs)]
    row = dict(params=sum(p.numel() for p in model.parameters()), layers=cfg.num_hidden_layers,
               build_s=build_s, warmup_s=warm_s, warmup_tok_per_s=warm["tok_per_s"],
               tokens=res[-1]["n"], tok_per_s=_median([r["tok_per_s"] for r in res]),
               tok_per_s_runs=[r["tok_per_s"] for r in res], ttft_s=_median([r["ttft_s"] for r in res]),
               e2e_tok_per_s=_median([r["e2e_tok_per_s"] for r in res]),
               attn_implementation=getattr(model.config, "_attn_implementation", None),
               cache="StaticCache (one, reset between calls)" if cache is not None else "DynamicCache",
               transformers=transformers.__version__, torch=torch.__version__)
    if mode == "compile":                    # did generate really compile, and did inductor keep its CUDA graphs?
        from torch._dynamo.utils import counters
        row.update(compiled=hasattr(model, "_compiled_call"),
                   dynamo_unique_graphs=int(counters["stats"].get("unique_graphs", 0)),
                   graph_breaks=int(sum(counters["graph_break"].values())),
                   cudagraph_skips=int(counters["inductor"].get("cudagraph_skips", 0)))
        if not row["compiled"]:              # never report an uncompiled run as the compiled peer
            row["not_compiled_tok_per_s"] = row.pop("tok_per_s")
            row["error"] = "generate did not compile the forward (transformers' auto-compile criteria not met)"
    return row


def ours_row(arch: str, backend: str, prompt_len: int, new_tokens: int, runs: int, scheme: str = "bf16") -> dict:
    """Our backend through `kie bench` (kie_moe.bench.run): synthetic weights built on the device, in `scheme`."""
    from kie_moe.bench import run
    res = run(arch, backend=backend, device="cuda", scheme=scheme, prompt_len=prompt_len, new_tokens=new_tokens,
              runs=runs, argv=["bench", arch, "--backend", backend, "--scheme", scheme])
    r = res["rows"][0]
    keep = ("tok_per_s", "tok_per_s_runs", "spread_pct", "ttft_s", "bytes_per_token", "achieved_gbps",
            "pct_roofline", "read_probe_gbps", "backend_note")
    return {k: r[k] for k in keep if k in r}


def child_main(spec: dict, result_path: str) -> int:
    try:
        if spec["kind"] == "selftest":       # tests/test_peers.py: how the parent sees a crash / a hang / a result
            if spec["action"] == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if spec["action"] == "hang":
                time.sleep(3600)
            out = {"tok_per_s": 1.0}
        elif spec["kind"] == "hf":
            out = hf_peer(spec["arch"], spec["mode"], spec.get("compile_mode"), spec["prompt_len"],
                          spec["new_tokens"], spec["runs"], spec.get("layers"), spec.get("device", "cuda"),
                          spec.get("tiny", False))
        else:
            out = ours_row(spec["arch"], spec["backend"], spec["prompt_len"], spec["new_tokens"], spec["runs"],
                           spec.get("scheme", "bf16"))
    except BaseException as e:               # noqa: BLE001 -- the parent records whatever went wrong
        out = {"error": f"{type(e).__name__}: {e}"[:1500], "trace": traceback.format_exc()[-3000:]}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, result_path)
    return 0


# ---- the parent: children, fallbacks, deadline ----------------------------------------------------------------

_CURRENT: list[subprocess.Popen] = []


def _kill_current():
    for p in list(_CURRENT):
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the child's session: inductor's compile workers go with it
        except (ProcessLookupError, PermissionError):
            pass


def _tail(path: str, n: int = 2500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_child(spec: dict, timeout: float, log_path: str) -> dict:
    """Run one measurement in a fresh interpreter -> its result dict + rc / signal / log tail on failure."""
    fd, res_path = tempfile.mkstemp(prefix="peer-", suffix=".json")
    os.close(fd)
    os.unlink(res_path)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--result", res_path]
    t0 = time.time()
    timed_out = False
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _CURRENT.append(p)
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_current()
            rc = p.wait()
        finally:
            _CURRENT.remove(p)
    out: dict = {}
    if os.path.exists(res_path):
        with open(res_path) as f:
            out = json.load(f)
        os.unlink(res_path)
    out["child_s"] = round(time.time() - t0, 1)
    out["log"] = log_path
    if rc != 0:
        out["rc"] = rc
        if rc < 0:
            out["signal"] = signal.Signals(-rc).name
        if timed_out:
            out["timed_out_s"] = round(timeout)
    ok = "tok_per_s" in out or "skipped" in out
    if not ok:
        out.setdefault("error", ("timed out" if timed_out else
                                 f"child died with {out.get('signal', f'exit code {rc}')} before a result"))
        out["log_tail"] = _tail(log_path)
    elif rc != 0:                            # measured, then crashed on the way out: keep the number, say so
        out["exit_after_result"] = out.get("signal", rc)
    out["ok"] = "tok_per_s" in out
    return out


class Runner:
    def __init__(self, a, spawn=None):
        self.a = a
        self.spawn = spawn or run_child      # tests pass a fake
        self.t0 = time.time()
        self.logs = a.logs or (os.path.join(os.path.dirname(os.path.abspath(a.out)), "peers-logs") if a.out
                               else tempfile.mkdtemp(prefix="peers-logs-"))
        os.makedirs(self.logs, exist_ok=True)
        self.res = {"schema": SCHEMA, "meta": self.meta(), "rows": [], "ratios": []}

    def meta(self) -> dict:
        m = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv[1:], "python": sys.version.split()[0]}
        for mod in ("torch", "transformers", "triton"):
            try:
                m[mod] = __import__(mod).__version__
            except ImportError:
                m[mod] = None
        return m

    def left(self) -> float:
        return (self.a.budget_s - (time.time() - self.t0)) if self.a.budget_s else float("inf")

    def save(self):
        self.res["ratios"] = ratios(self.res["rows"], [])
        self.res["meta"]["seconds"] = round(time.time() - self.t0, 1)
        if self.a.out:
            tmp = self.a.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.res, f, indent=1)
            os.replace(tmp, self.a.out)

    def child(self, spec: dict, name: str) -> dict:
        budget = min(self.a.child_timeout, self.left() - 15)
        if budget < 30:
            return {"ok": False, "error": f"skipped: {self.left():.0f} s left of --budget-s {self.a.budget_s}"}
        print(f"--- {name} (timeout {budget:.0f} s)", flush=True)
        return self.spawn(spec, budget, os.path.join(self.logs, f"{name}.log"))

    def add(self, row: dict):
        row = {k: v for k, v in row.items() if k != "trace" or "tok_per_s" not in row}
        self.res["rows"].append(row)
        shown = {k: v for k, v in row.items() if k not in ("trace", "log_tail", "tok_per_s_runs")}
        print(json.dumps(shown), flush=True)
        if row.get("log_tail"):
            print("    log tail:\n" + "\n".join("    | " + ln for ln in row["log_tail"].splitlines()[-15:]), flush=True)
        self.save()

    def run(self):
        a = self.a
        base = dict(prompt_len=a.prompt_len, new_tokens=a.new_tokens, runs=a.runs)
        for arch in a.arch or DEFAULT_ARCHS:
            try:                              # on the host: a family transformers lacks needs no child
                why = hf_config(arch)[1]
            except Exception as e:            # unknown preset, bad config: every row of this shape says so
                why = f"cannot build a transformers config: {type(e).__name__}: {e}"[:500]
            for mode in [m for m in a.modes.split(",") if m]:
                spec = dict(base, kind="hf", arch=arch, mode=mode, layers=a.layers)
                row = dict(arch=arch, peer="hf-transformers", mode=mode)
                if why:
                    row.update(ok=False, skipped=why)
                elif mode != "compile":
                    row.update(self.child(spec, f"{arch}-hf-{mode}"))
                else:
                    attempts = []
                    for cm in [m for m in a.compile_modes.split(",") if m]:
                        r = self.child(dict(spec, compile_mode=cm), f"{arch}-hf-compile-{cm}")
                        r["compile_mode"] = cm
                        if r["ok"] or "skipped" in r:
                            row.update(r)
                            break
                        attempts.append({k: r.get(k) for k in ("compile_mode", "error", "rc", "signal",
                                                               "timed_out_s", "child_s", "log", "log_tail")})
                        print(f"    compile mode {cm} failed ({r.get('signal') or r.get('error', '')[:120]}); "
                              "trying the next one", flush=True)
                    else:
                        row.update(ok=False, error="every compile mode failed: " + "; ".join(
                            f"{t['compile_mode']}: {t.get('signal') or (t.get('error') or '')[:200]}"
                            for t in attempts))
                    row["attempts"] = attempts
                self.add(row)
            if a.ours != "none" and a.layers:
                print("--layers cuts the peers only: no 'ours' row (a ratio against a full model would be wrong)")
            elif a.ours != "none":
                for scheme in [s for s in a.ours_schemes.split(",") if s]:
                    spec = dict(base, kind="ours", arch=arch, backend=a.ours, scheme=scheme)
                    tag = f"{arch}-kie-{a.ours}" + ("" if scheme == "bf16" else f"-{scheme}")
                    self.add(dict(arch=arch, peer="kie", mode=a.ours, scheme=scheme, **self.child(spec, tag)))
        extra = load_ours(a.join) if a.join else []
        self.res["ratios"] = ratios(self.res["rows"], extra)
        self.res["meta"]["seconds"] = round(time.time() - self.t0, 1)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(self.res, f, indent=1)
        print(table(self.res["rows"], self.res["ratios"]))


# ---- join: peers x our graph backend -> ratio table ------------------------------------------------------------

def _rows_of(path: str) -> list[dict]:
    with open(path) as f:
        d = json.load(f)
    return d if isinstance(d, list) else d.get("rows", [])


def load_ours(paths: list[str]) -> list[dict]:
    """Our bf16 graph-backend rows from peers JSON (peer "kie"), graph_bench JSON (arch/fmt/backend) or kie bench
    JSON (model/scheme/backend) files -> [{arch, backend, tok_per_s, source}]."""
    out = []
    for p in paths:
        for r in _rows_of(p):
            if not isinstance(r, dict) or not r.get("tok_per_s"):
                continue
            if r.get("peer") == "kie":
                out.append(dict(arch=r["arch"], backend=r.get("mode"), scheme=r.get("scheme", "bf16"),
                                tok_per_s=r["tok_per_s"], source=p))
            elif "fmt" in r and r.get("fmt") == "bf16":
                out.append(dict(arch=r["arch"], backend=r.get("backend"), scheme="bf16", tok_per_s=r["tok_per_s"],
                                source=p))
            elif r.get("scheme") == "bf16" and "model" in r and not r.get("context_len"):
                out.append(dict(arch=r["model"], backend=r.get("backend"), scheme="bf16", tok_per_s=r["tok_per_s"],
                                source=p))
    return out


def load_peers(paths: list[str]) -> list[dict]:
    """Peer rows from peers JSON files, new ("kie-peers/1") or old (a list with peer = hf-transformers-MODE)."""
    out = []
    for p in paths:
        for r in _rows_of(p):
            peer = r.get("peer", "")
            if peer.startswith("hf-transformers"):
                r = dict(r)
                if peer != "hf-transformers":        # old format: the mode lives in the peer name
                    r["peer"], r["mode"] = "hf-transformers", peer.rsplit("-", 1)[-1]
                r.setdefault("source", p)
                out.append(r)
    return out


def ratios(rows: list[dict], extra_ours: list[dict], backend: str = "graph") -> list[dict]:
    """Each peer row x our `backend` row of the same arch in every scheme measured (this run's first, else
    extra_ours): bf16 always (its absence is said), then each other scheme of this run (issue 5's fp8 target is
    ours in fp8 over the bf16 peer)."""
    ours = {}                                 # (arch, scheme) -> (tok/s, source)
    for r in rows:
        if r.get("peer") == "kie" and r.get("mode") == backend and r.get("tok_per_s"):
            ours.setdefault((r["arch"], r.get("scheme", "bf16")), (r["tok_per_s"], "same run"))
    for r in extra_ours:
        if r.get("backend") == backend:
            ours.setdefault((r["arch"], r.get("scheme", "bf16")), (r["tok_per_s"], r["source"]))
    out = []
    for r in rows:
        if not str(r.get("peer", "")).startswith("hf-transformers"):
            continue
        schemes = ["bf16"] + sorted({s for a, s in ours if a == r["arch"] and s != "bf16"})
        for scheme in schemes:
            o = ours.get((r["arch"], scheme))
            x = dict(arch=r["arch"], peer_mode=r.get("mode"), compile_mode=r.get("compile_mode"),
                     peer_tok_per_s=r.get("tok_per_s"), ours_backend=backend, ours_scheme=scheme,
                     ours_tok_per_s=o[0] if o else None, ours_source=o[1] if o else None)
            if r.get("tok_per_s") and o:
                x["ours_over_peer"] = o[0] / r["tok_per_s"]
            else:
                x["why_no_ratio"] = (r.get("skipped") or r.get("error") or "") if not r.get("tok_per_s") else \
                    f"no {backend} {scheme} row for {r['arch']}"
            out.append(x)
    return out


def table(rows: list[dict], rats: list[dict]) -> str:
    lines = ["| shape | peer | mode | tok/s | TTFT s | e2e tok/s | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mode = r.get("mode", "") + (f" ({r['compile_mode']})" if r.get("compile_mode") else "")
        tps = f"{r['tok_per_s']:.1f}" if r.get("tok_per_s") else "-"
        ttft = f"{r['ttft_s']:.3f}" if r.get("ttft_s") else ""
        e2e = f"{r['e2e_tok_per_s']:.1f}" if r.get("e2e_tok_per_s") else ""
        note = r.get("skipped") or r.get("error") or ""
        if r.get("attempts"):
            note = "after " + ", ".join(f"{t['compile_mode']} {t.get('signal') or 'failed'}" for t in r["attempts"]) \
                + ("; " + note if note else "")
        lines.append(f"| {r.get('arch')} | {r.get('peer')} | {mode} | {tps} | {ttft} | {e2e} | "
                     f"{note[:160].replace('|', '/').replace(chr(10), ' ')} |")
    lines += ["", "| shape | peer mode | peer tok/s | ours | ours tok/s | ours / peer | ours from |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for x in rats:
        mode = (x["peer_mode"] or "") + (f" ({x['compile_mode']})" if x.get("compile_mode") else "")
        peer = f"{x['peer_tok_per_s']:.1f}" if x.get("peer_tok_per_s") else "-"
        ours = f"{x['ours_tok_per_s']:.1f}" if x.get("ours_tok_per_s") else "-"
        ratio = f"{x['ours_over_peer']:.2f}x" if x.get("ours_over_peer") else (x.get("why_no_ratio") or "")[:80]
        what = f"{x.get('ours_backend', 'graph')} {x.get('ours_scheme', 'bf16')}"
        lines.append(f"| {x['arch']} | {mode} | {peer} | {what} | {ours} | {ratio} | {x.get('ours_source') or ''} |")
    return "\n".join(lines)


def join_main(paths: list[str], out: str | None) -> int:
    peers = load_peers(paths)
    ours_rows = [r for p in paths for r in _rows_of(p) if isinstance(r, dict) and r.get("peer") == "kie"]
    rats = ratios(peers + ours_rows, load_ours(paths))
    res = {"schema": SCHEMA + "-join", "inputs": paths, "rows": peers, "ratios": rats}
    text = table(peers, rats)
    print(text)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(text + "\n")
    return 0


# ---- CLI -------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--arch", action="append", help=f"preset name, repeatable (default: {', '.join(DEFAULT_ARCHS)})")
    ap.add_argument("--modes", default="eager,compile", help="comma list of eager, static, compile")
    ap.add_argument("--compile-modes", default=",".join(COMPILE_MODES),
                    help="torch.compile modes to try in order until one works (default: %(default)s)")
    ap.add_argument("--ours", default="graph", help="our backend measured beside the peers (graph | monokernel | none)")
    ap.add_argument("--ours-schemes", default="bf16",
                    help="comma list of schemes our backend runs in (bf16 first; e.g. bf16,fp8 for issue 5's fp8 "
                         "target, which compares ours in fp8 with the bf16 peer)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="cut every model to N layers (quick checks only)")
    ap.add_argument("--child-timeout", type=float, default=480, help="seconds one measurement may take")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run: children are cut to fit and the JSON is always written")
    ap.add_argument("--join", nargs="+", default=None,
                    help="JSON files (peers / graph_bench / kie bench): with no --arch, only join them into the "
                         "ratio table (no GPU); with a run, add their graph rows where this run has none")
    ap.add_argument("--logs", default=None, help="directory of the children's logs (default: OUT's dir/peers-logs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(json.loads(a.child), a.result)
    if a.join and not a.arch:
        return join_main(a.join, a.out)
    for m in a.modes.split(","):
        if m and m not in ("eager", "static", "compile"):
            raise SystemExit(f"peers: unknown mode {m!r} (eager, static, compile)")
    r = Runner(a)

    def on_term(signum, frame):              # the stage's timeout: stop the child, keep what was measured
        _kill_current()
        r.res["meta"]["interrupted"] = signal.Signals(signum).name
        r.save()
        print(table(r.res["rows"], r.res["ratios"]), flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    r.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
