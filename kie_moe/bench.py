"""`kie bench`: batch-1 decode speed of one model on one backend, beside the read ceiling measured in the same
process: tok/s (median of --runs and their spread), ms/token, time to first token, bytes per token (active
weights + scales + the KV cache read at that context), achieved GB/s and % of the roofline.

MODEL is a checkpoint directory or a preset ARCH (kie_moe.synthetic: weights built on the device, quantized there
for --scheme, nothing on disk). `kie bench --all` runs the standard matrix the committed results use.

JSON (--json prints it, --out writes it): {"schema": "kie-bench/1", "env": {...}, "read_probe": {...},
"rows": [row, ...]}; a row's fields are listed in ROW_FIELDS (a failed row of --all has "error" instead of the
measurements).

--devices N (kie_moe/launch.py + ranks.py): N worker processes decode one model's shards in lockstep; rank 0
measures the read probe (one device's), times the generations and prints. The roofline is N devices': each reads
bytes/N per token, so ideal tok/s = N x probe / bytes, and achieved GB/s counts every device's bytes; "parallel"
names the path that ran. token_ids (the last timed run's greedy tokens) let any two paths be compared.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch

from kie_moe.models.errors import InputError, KieError

from . import roofline as R
from .synthetic import Source, open_model

SCHEMA = "kie-bench/1"
ROW_FIELDS = ("model", "source", "family", "scheme", "backend", "backend_note", "device", "devices", "parallel",
              "prompt_len", "context_len", "sampling", "context_fill", "new_tokens", "runs", "tok_per_s", "tok_per_s_runs",
              "spread_pct", "ms_per_token", "ttft_s", "ttft_s_runs", "prefill_tok_per_s", "bytes_per_token", "bytes",
              "bytes_per_device", "backend_bytes_per_token", "achieved_gbps", "read_probe_gbps", "pct_roofline",
              "roofline_tok_per_s", "token_ids")

# `kie bench --all`: (preset, scheme, backends): issue 6's shapes and formats on both GPU backends. gpt-oss-120b
# does not fit the device in bf16: its preset is drawn tensor by tensor and only the MXFP4 codes stay resident
# (attention is quantized too here, unlike the released checkpoint's bf16 attention: 3% of its active bytes).
BOTH = ("graph", "monokernel")
SUITE = (
    ("llama-3.2-1b", "bf16", BOTH),
    ("qwen3-30b-a3b", "bf16", BOTH),
    ("qwen3-30b-a3b", "fp8", BOTH),
    ("qwen3-30b-a3b", "fp8-block", BOTH),
    ("qwen3-30b-a3b", "nvfp4", BOTH),
    ("qwen3-30b-a3b", "mxfp4", BOTH),
    ("gpt-oss-120b", "mxfp4", BOTH),
)
# backends whose decode step reads the quantized codes + scales (the others dequantize to float at load time)
STREAMS_CODES = {"graph", "monokernel"}


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly (a fixed seed): real ids, never all the same one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def build_backend(name: str, model, device: torch.device):
    from kie_moe.engine import make_backend
    try:
        return make_backend(name, model, device)
    except NotImplementedError as e:        # the monokernel planner's "not supported yet"
        raise InputError(f"backend {name}: {e}") from None


def working_dtypes(be) -> tuple[torch.dtype, torch.dtype]:
    """(float weight dtype, KV cache dtype) the backend streams; they set the float bytes counted."""
    if hasattr(be, "working_dtypes"):                           # a --devices N rank (kie_moe/ranks.py)
        return be.working_dtypes()
    if hasattr(be, "plan"):                                     # monokernel
        return be.plan.wdtype, getattr(be, "kv_dtype", be.plan.wdtype)
    if hasattr(be, "decoder"):                                  # reference
        dt = getattr(be.decoder, "dtype", torch.bfloat16)
        return dt, dt
    dt = getattr(be, "dtype", torch.bfloat16)                   # graph
    return dt, dt


def backend_bytes(be) -> int | None:
    """The backend's own count of the weight bytes one step streams, where it keeps one."""
    if isinstance(getattr(be, "bytes_per_token", None), int):
        return be.bytes_per_token
    plan = getattr(be, "plan", None)
    if plan is not None and hasattr(plan, "weight_bytes_per_token"):
        return int(plan.weight_bytes_per_token())
    return None


def synthetic_prefill(be):
    """A prefill that fills the first n KV positions with random values instead of computing them (long contexts
    without an O(n^2) reference prefill: the bytes decode reads do not depend on the values). None for a backend
    whose cache layout is not known here. Both known backends allocate their cache before calling prefill:
    graph `caches` (per layer (K, V) [T, Hkv, Dh] or an MLA latent [T, r]), monokernel `kv` [L, 2, Hkv, T, Dh]."""
    if be.name not in ("graph", "monokernel"):
        return None

    def prefill(ids):
        n = len(ids)
        if hasattr(be, "caches"):
            for c in be.caches:
                for t in (c if isinstance(c, tuple) else (c,)):
                    t[:n].normal_()
        elif hasattr(be, "kv"):
            be.kv[..., :n, :].normal_()
        else:
            raise RuntimeError(f"{be.name} backend: no KV cache allocated before prefill (kie bench's "
                               f"synthetic fill expects `caches` or `kv`); use --context-fill prefill")
    return prefill


def bench_row(src: Source, backend: str, device: torch.device, probe: dict, *, prompt_len: int = 32,
              new_tokens: int = 128, context_len: int | None = None, runs: int = 3,
              context_fill: str = "auto", seed: int = 0, be=None, sampling: dict | None = None) -> dict:
    """One measured row. `be`: an already built backend (preview's fallback); else `backend` is built here.
    sampling: SamplingParams fields (temperature, top_k, top_p) of the timed generations; None: greedy."""
    spec = src.model.spec
    # "auto" is resolved when the backend is built (engine.make_backend: a backend that does not support this
    # model hands over to the next one, and says so in the row's backend_note)
    name = backend if be is None else be.name
    n_prompt = context_len if context_len else prompt_len
    if n_prompt < 1:
        raise InputError(f"--prompt-len / --context-len must be at least 1, got {n_prompt}")
    if new_tokens < 2 or runs < 1:
        raise InputError(f"--new-tokens must be at least 2 (got {new_tokens}) and --runs at least 1 (got {runs})")
    if n_prompt + new_tokens > spec.max_position:
        raise InputError(f"context {n_prompt} + --new-tokens {new_tokens} exceeds the model's max_position "
                         f"({spec.max_position})")
    be = build_backend(name, src.model, device) if be is None else be
    fill = "prefill"
    if context_len and context_fill in ("auto", "synthetic"):
        pre = synthetic_prefill(be)
        if pre is not None:
            be.prefill, fill = pre, "synthetic"
        elif context_fill == "synthetic":
            raise InputError(f"--context-fill synthetic: the {be.name} backend's KV cache layout is not known "
                             f"to kie bench (use --context-fill prefill)")
    t = R.measure(be, prompt_ids(spec.vocab_size, n_prompt, seed), new_tokens, runs, device, sampling=sampling)
    from kie_moe.kernels.sampling import needs_filter
    if sampling and needs_filter(**sampling) and callable(getattr(be, "sampling_fallbacks", None)):
        # the last timed run's draws that were plain temperature samples (a nucleus wider than the GPU sampler's
        # candidates: random weights give flat logits, so a --top-p row may time that path, not the filter)
        sampling = {**sampling, "fallback_draws": be.sampling_fallbacks(), "draws": new_tokens}

    wdt, kvdt = working_dtypes(be)
    streams = be.name in STREAMS_CODES or bool(getattr(be, "streams_quantized", False))
    note = getattr(be, "auto_note", "")
    if not getattr(be, "streams_tokens", True):
        note = (note + "; " if note else "") + ("interpreted: every token arrives at the launch's end, so tok/s is "
                                                "the tokens over the whole generation, prefill included")
    scheme_of = src.scheme_of
    if src.scheme != "bf16" and not streams:
        scheme_of = lambda n: "bf16"          # noqa: E731  (dequantized at load: float bytes are what it reads)
        note = (note + "; " if note else "") + (
            f"{be.name} dequantizes {src.scheme} weights to {str(wdt).replace('torch.', '')} at load: "
            f"{src.scheme} quality, float bytes")
    b = R.weight_bytes(spec, scheme_of, wdt.itemsize)
    b.kv = R.kv_bytes_mean(spec, n_prompt, new_tokens - 1, kvdt.itemsize)
    total = b.total
    gbps = t.tok_per_s * total / 1e9
    world = getattr(be, "world", 1)                   # --devices N: each device reads bytes / N per token
    if world > 1 and device.type == "cpu":
        note = "; ".join(x for x in (note, f"{world} CPU processes share one memory system: the {world}-device "
                                           f"roofline ({world} x the read probe) is nominal") if x)
    row = {"model": src.name, "source": src.kind, "family": spec.family, "scheme": src.scheme,
           "lm_head_scheme": src.scheme_of("lm_head"), "backend": be.name,
           "backend_note": note, "device": str(device), "devices": world, "parallel": getattr(be, "path", ""),
           "prompt_len": n_prompt, "context_len": context_len, "sampling": sampling or {"temperature": 0.0},
           "context_fill": fill, "new_tokens": new_tokens, "runs": len(t.tok_per_s_runs),
           "tok_per_s": t.tok_per_s, "tok_per_s_runs": t.tok_per_s_runs, "spread_pct": t.spread_pct,
           "ms_per_token": t.ms_per_token, "ttft_s": t.ttft_s, "ttft_s_runs": t.ttft_s_runs,
           # prompt tokens over the time to first token (the prefill and one decode step); None when the context
           # was filled synthetically
           "prefill_tok_per_s": n_prompt / t.ttft_s if fill == "prefill" and t.ttft_s > 0 else None,
           "bytes_per_token": total, "bytes": b.as_dict(), "bytes_per_device": total / world,
           "backend_bytes_per_token": backend_bytes(be) if world == 1 else None,
           "achieved_gbps": gbps, "read_probe_gbps": probe["gbps"],
           "pct_roofline": 100 * gbps / (world * probe["gbps"]),
           "roofline_tok_per_s": world * probe["gbps"] * 1e9 / total, "token_ids": t.token_ids}
    del be
    _free(device)
    return row


def _free(device: torch.device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(model: str | None, *, backend: str = "auto", device: str | None = None, scheme: str = "bf16",
        tiny: bool = False, all_: bool = False, archs: list[str] | None = None, prompt_len: int = 32,
        new_tokens: int = 128,
        context_len: int | None = None, runs: int = 3, context_fill: str = "auto", probe_bytes: int | None = None,
        argv: list[str] | None = None, log=None, prepared: tuple | None = None, out: str | None = None,
        quantize_lm_head: bool = False, sampling: dict | None = None) -> dict:
    """`prepared`: (Source, backend) already opened and built (rank 0 of --devices N: its backend leads the
    other ranks); else MODEL is opened and `backend` built here. `out` (with --all): the JSON so far is rewritten
    after every row, so a suite cut short (a time limit, a crash) keeps the rows it measured."""
    from kie_moe.engine import resolve_device
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if (model is None) == (not all_):
        raise InputError("give MODEL (a checkpoint directory or preset) or --all, not both")
    if quantize_lm_head and all_:
        raise InputError("--quantize-lm-head applies to one MODEL, not to the --all matrix")
    res = {"schema": SCHEMA, "env": R.environment(dev, argv), "read_probe": R.read_probe(dev, probe_bytes), "rows": []}
    kw = dict(prompt_len=prompt_len, new_tokens=new_tokens, context_len=context_len, runs=runs,
              context_fill=context_fill, sampling=sampling)
    if prepared is not None:
        src, be = prepared
        res["rows"].append(bench_row(src, be.name, dev, res["read_probe"], be=be, **kw))
        return res
    if not all_:
        src = open_model(model, dev, scheme=scheme, tiny=tiny, quantize_lm_head=quantize_lm_head)
        res["rows"].append(bench_row(src, backend, dev, res["read_probe"], **kw))
        return res
    base = None                              # one bf16 synthetic model per arch, wrapped per scheme
    suite = [r for r in SUITE if not archs or r[0] in archs]
    if archs and not suite:
        raise InputError(f"--archs {','.join(archs)}: none of these is in the --all matrix "
                         f"({', '.join(sorted({r[0] for r in SUITE}))})")
    for arch, sch, backends in suite:
        try:
            if base is None or base[0] != arch:
                base = None
                _free(dev)
                base = (arch, open_model(arch, dev, tiny=tiny))
            src = with_scheme(base[1], sch)
        except (KieError, RuntimeError) as e:    # e.g. out of memory: every row of this entry says so
            msg = f"{type(e).__name__}: {e}"[:1500]
            res["rows"] += [{"model": arch, "scheme": sch, "backend": b, "error": msg} for b in backends]
            continue
        for b in backends:
            msg = None
            try:
                row = bench_row(src, b, dev, res["read_probe"], **kw)
            except Exception as e:           # a suite row that fails is recorded, the next one still runs
                msg = f"{type(e).__name__}: {e}"[:1500]
            if msg is not None:              # outside the except block: its traceback no longer pins the backend
                row = {"model": src.name, "scheme": sch, "backend": b, "error": msg}
                _free(dev)
            res["rows"].append(row)
            if out:
                write_json(res, out)
            if log is not None:
                log(row)
        del src
    return res


def with_scheme(src: Source, scheme: str) -> Source:
    """A float Source's model with its Linear weights quantized to `scheme` in memory (same spec, same store)."""
    from kie_moe.models.registry import LoadedModel
    from .synthetic import QuantizingStore, _scheme_fn
    if scheme == src.scheme:
        return src
    if src.scheme != "bf16":
        raise InputError(f"{src.name} is already {src.scheme}; it cannot be re-quantized to {scheme}")
    m = src.model
    return Source(LoadedModel(m.path, m.config, m.spec, QuantizingStore(m.weights, scheme)), src.kind, src.name,
                  scheme, _scheme_fn(scheme), src.note)


# ---- output ----------------------------------------------------------------------------------------------------

def _versions(env: dict) -> str:
    parts = [env.get("device") or "?"]
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    parts += [f"torch {env.get('torch')}", f"triton {env.get('triton')}"]
    return ", ".join(parts)


def table(res: dict) -> str:
    env, probe = res["env"], res["read_probe"]
    lines = [f"{_versions(env)}; read ceiling {probe['gbps']:.0f} GB/s "
             f"({probe['method']}, {R.fmt_bytes(probe['bytes'])})"]
    rows = res["rows"]
    if len(rows) == 1 and "error" not in rows[0]:
        r, b = rows[0], rows[0]["bytes"]
        runs = r["tok_per_s_runs"]
        ctx = f"context {r['prompt_len']}..{r['prompt_len'] + r['new_tokens'] - 1}"
        devs = r.get("devices", 1)
        smp = r.get("sampling") or {}
        lines += [f"{r['model']}  scheme {r['scheme']}{_head(r)}  backend {r['backend']}  {r['device']}"
                  + (f"  x{devs} devices" if devs > 1 else "")
                  + ("  sampling " + " ".join(f"{k}={v}" for k, v in smp.items()) if smp.get("temperature") else "")]
        if devs > 1:
            lines.append(f"  parallel      {r['parallel']}")
        lines += [f"  tok/s         {r['tok_per_s']:.1f}   ({r['runs']} runs {min(runs):.1f}-{max(runs):.1f}, "
                  f"spread {r['spread_pct']:.1f}%)",
                  f"  ms/token      {r['ms_per_token']:.3f}",
                  f"  TTFT          {r['ttft_s'] * 1e3:.1f} ms   "
                  f"(prompt {r['prompt_len']} tokens, {r['context_fill']}"
                  + (f": {r['prefill_tok_per_s']:.0f} prompt tok/s)" if r.get("prefill_tok_per_s") else ")"),
                  f"  bytes/token   {R.fmt_bytes(r['bytes_per_token'])}   (weights {R.fmt_bytes(b['weights'])} + "
                  f"scales {R.fmt_bytes(b['scales'])} + KV {R.fmt_bytes(b['kv'])} at {ctx})",
                  f"  achieved      {R.fmt_gbps(r['achieved_gbps'])}" + (f" ({devs} devices together)" if devs > 1 else ""),
                  f"  roofline      {r['pct_roofline']:.1f}% of "
                  + (f"{devs} x " if devs > 1 else "") + f"{R.fmt_gbps(r['read_probe_gbps'])} "
                  f"(ceiling {r['roofline_tok_per_s']:.0f} tok/s"
                  + (f": {devs} devices each read {R.fmt_bytes(r['bytes_per_device'])}/token)" if devs > 1 else ")")]
        if r["backend_note"]:
            lines.append(f"  note          {r['backend_note']}")
        return "\n".join(lines)
    lines.append(f"{'model':<22} {'scheme':<9} {'backend':<10} {'tok/s':>9} {'ms/tok':>8} {'TTFT ms':>8} "
                 f"{'bytes/tok':>10} {'GB/s':>8} {'%roof':>6}")
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<22} {r['scheme']:<9} {r['backend']:<10} error: {r['error'][:90]}")
            continue
        lines.append(f"{r['model']:<22} {r['scheme']:<9} {r['backend']:<10} {r['tok_per_s']:9.1f} "
                     f"{r['ms_per_token']:8.3f} {r['ttft_s'] * 1e3:8.1f} {R.fmt_bytes(r['bytes_per_token']):>10} "
                     f"{r['achieved_gbps']:8.1f} {r['pct_roofline']:6.1f}")
    return "\n".join(lines)


def _head(r: dict) -> str:
    """' (lm_head SCHEME)' where the lm_head is quantized too."""
    h = r.get("lm_head_scheme", "bf16")
    return "" if h == "bf16" else f" (lm_head {h})"


def write_json(res: dict, path: str):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def user_errors(fn):
    """Library errors that mean "this model / scheme / backend combination cannot run" (a shape a format cannot
    hold, a family a backend lacks) reach the user as one line (exit 2), like every KieError."""
    def wrap(*args, **kw):
        try:
            return fn(*args, **kw)
        except (ValueError, NotImplementedError) as e:
            raise KieError(f"{type(e).__name__}: {e}") from None
    return wrap


@user_errors
def cmd_bench(a) -> int:
    """One device: here. --devices N: N workers (kie_moe/launch.py, ranks.py), rank 0 measures and prints."""
    from kie_moe import ranks
    if getattr(a, "devices", 1) > 1:
        if a.all:
            raise InputError("--all measures the single-device matrix; --devices N takes one MODEL")
        if a.model is None:
            raise InputError("give MODEL (a checkpoint directory or preset) with --devices N")

    def prepare(group):
        src = open_model(a.model, group.device, scheme=a.scheme, tiny=a.tiny,
                         quantize_lm_head=getattr(a, "quantize_lm_head", False))
        return src, ranks.rank_backend(src.model, group, a.backend,
                                           expert_split=getattr(a, "expert_split", None))

    return ranks.launch_ranks(a, lambda: _bench(a), prepare, lambda src, be: _bench(a, (src, be)))


def sampling_of(a) -> dict | None:
    """kie bench's --temperature / --top-k / --top-p, checked as SamplingParams checks them; None: greedy."""
    from kie_moe.sampling import SamplingParams
    opts = dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    SamplingParams(**opts)
    if a.temperature == 0 and (a.top_k or a.top_p < 1):
        raise InputError("--top-k / --top-p need --temperature > 0 (greedy decoding ignores them)")
    return opts if a.temperature > 0 else None


def _progress(r: dict):
    what = f"error {r['error'][:100]}" if "error" in r else f"{r['tok_per_s']:.1f} tok/s"
    print(f"  {r['model']} {r['scheme']} {r['backend']}: {what}", file=sys.stderr, flush=True)


@user_errors
def _bench(a, prepared: tuple | None = None) -> int:
    log = _progress if a.all else None          # progress on stderr: the suite takes minutes on a GPU
    res = run(a.model, backend=a.backend, device=a.device, scheme=a.scheme, tiny=a.tiny, all_=a.all,
              archs=[x for x in a.archs.split(",") if x] if a.archs else None,
              prompt_len=a.prompt_len, new_tokens=a.new_tokens, context_len=a.context_len, runs=a.runs,
              context_fill=a.context_fill, probe_bytes=a.probe_mb << 20 if a.probe_mb else None,
              argv=getattr(a, "argv", None), log=log, prepared=prepared, out=a.out,
              quantize_lm_head=getattr(a, "quantize_lm_head", False), sampling=sampling_of(a))
    if a.out:
        write_json(res, a.out)
    print(json.dumps(res) if a.json else table(res))
    return 1 if any("error" in r for r in res["rows"]) else 0
