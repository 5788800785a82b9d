"""`kie sweep`: throughput vs quality, one row per quantization scheme.

For each scheme: the model in that scheme (a checkpoint converted with `kie convert` and cached in --cache, default
OUT/checkpoints, as <scheme>/; a synthetic ARCH is quantized in memory instead), its decode speed
(kie_moe.bench: tok/s, bytes/token, % of the roofline measured in the same process) and its quality against the
bf16 model, teacher-forced over the same token windows: mean KL(P_bf16 || P_scheme) of the next-token
distributions, top-1 agreement and perplexity (quant/metrics). Quality is computed with the reference decoder over
the scheme's dequantized weights, the values every backend computes with, so it does not depend on --backend, in
float32 where a float32 copy fits (quality_dtype).

Token data: --text FILE (tokenized with the model's tokenizer), else the checkpoint's heldout.txt, else the embedded
demo model's held-out text when this build has one, cut into the windows `kie demo` scores (kie_moe.heldout: by
default 32 windows of 256 tokens spread over the whole text, so both commands report the same numbers), else
random token ids; a preset ARCH (random weights) always uses random ids and says so: there
KL / top-1 only compare the quantized random model with its bf16 self, and perplexity is not reported.

Writes OUT/results.json, results.csv, results.md and tradeoff.png (tok/s against KL, one labelled point per
scheme; the coordinates read back from the plotted artist are kept in results.json["plot"]).
"""
from __future__ import annotations

import csv
import gc
import json
import math
import os
import sys

import torch

from kie_moe.models.errors import ConfigError, InputError, KieError
from kie_moe.models.quantizable import convert_checkpoint

from . import bench as B
from . import heldout as H
from . import roofline as R
from .synthetic import check_scheme, is_checkpoint_dir, open_model, resolve_model

SCHEMA = "kie-sweep/1"
CSV_FIELDS = ("scheme", "backend", "tok_per_s", "ms_per_token", "bytes_per_token", "achieved_gbps", "pct_roofline",
              "kl", "top1", "ppl", "ppl_bf16", "quality_tokens", "model_source", "note", "error")
PLOT_FILE = "tradeoff.png"
_STAMP = "kie_sweep_source.json"     # written into each cached conversion: which source and scheme it came from


# ---- token data ------------------------------------------------------------------------------------------------

RANDOM_MAX_TOKENS = 512               # random-id quality (a preset ARCH): only the quantized model vs its bf16 self


def heldout_file(model_dir: str) -> str | None:
    """The checkpoint's own held-out sample, else the embedded demo model's (when this build ships it)."""
    return H.heldout_file(model_dir)


def check_window_args(window: int, max_tokens: int | None):
    if window < 1:
        raise InputError(f"--window must be at least 1 token, got {window}")
    if max_tokens is not None and max_tokens < 0:
        raise InputError(f"--max-tokens must be >= 0 (0: all of the text), got {max_tokens}")


def read_text(text_file: str, model_dir: str | None) -> str:
    """--text's contents; model_dir None: a preset ARCH, which has no tokenizer to read it with."""
    if model_dir is None:
        raise InputError(f"--text {text_file}: a preset ARCH has random weights and no tokenizer; "
                         f"give a checkpoint directory, or leave --text out")
    try:
        with open(text_file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"--text {text_file}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise InputError(f"--text {text_file}: not UTF-8 text (byte {e.start})") from None


def token_windows(model_dir: str | None, spec, text_file: str | None, window: int, max_tokens: int | None,
                  seed: int = 0) -> tuple[torch.Tensor, str]:
    """-> (windows [n, window + 1] of token ids: inputs [:, :-1], targets [:, 1:]; a label saying where they came
    from). Text is cut into the windows kie demo scores (kie_moe.heldout: evenly spread over the whole text, no BOS);
    max_tokens scored tokens (n = max_tokens // window windows; 0: every window that fits; None: kie demo's
    default for text, RANDOM_MAX_TOKENS for random ids)."""
    check_window_args(window, max_tokens)
    window = min(window, spec.max_position)
    text, label = None, None
    if text_file is not None:
        text = read_text(text_file, model_dir)
        label = f"text {os.path.basename(text_file)}"
    elif model_dir is not None and heldout_file(model_dir) is not None:
        path = heldout_file(model_dir)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        label = f"held-out text {os.path.relpath(path)}"
    if text is not None:
        from kie_moe.tokenizer import Tokenizer, has_tokenizer
        if not has_tokenizer(model_dir):
            raise ConfigError(f"{model_dir}: no tokenizer.json, so {label} cannot be tokenized")
        try:
            ids = H.encode(Tokenizer(model_dir), text, spec.vocab_size)
        except ConfigError as e:
            raise ConfigError(f"{model_dir}: {e} (config.json's vocab_size)") from None
        if len(ids) < 2:
            raise InputError(f"{label}: fewer than 2 tokens after tokenization")
        window = min(window, len(ids) - 1)                    # a short text: one window of all of it
        if max_tokens is None:
            max_tokens = H.DEFAULT_WINDOWS * H.DEFAULT_WINDOW_LEN
        wins = H.windows(ids, max(1, max_tokens // window) if max_tokens else 0, window)
        return wins, (f"{label} ({wins.shape[0] * window} tokens, windows of {window} spread over all "
                      f"{len(ids)} of its tokens)")
    n_win = max(1, (max_tokens or RANDOM_MAX_TOKENS) // window)
    ids = B.prompt_ids(spec.vocab_size, n_win * (window + 1), seed)
    wins = torch.tensor(ids, dtype=torch.long).reshape(n_win, window + 1)
    return wins, f"random token ids ({n_win} x {window}; no text: quality vs bf16 only, no perplexity)"


# ---- quality ---------------------------------------------------------------------------------------------------

def quality_dtype(dev: torch.device, lazy: bool, store) -> torch.dtype:
    """float32 activations (what kie demo uses, so a scheme's numbers measure its weights, not bf16 rounding of
    activations, which alone moves 0.8% of the shipped demo model's argmaxes: top-1 0.992 vs float32 over the default
    8192 held-out tokens on CPU, KL 0.0003; fp8 weights move 2.9%) wherever a float32 copy fits:
    always on the host; on a GPU when it takes under half of the free memory; else bf16 (said in results.json)."""
    if dev.type == "cpu":
        return torch.float32
    n = None if lazy else _float32_bytes(store)
    if n is not None and n < 0.5 * torch.cuda.mem_get_info(dev)[0]:
        return torch.float32
    return torch.bfloat16


def _float32_bytes(store) -> int | None:
    inner = getattr(store, "store", store)
    t = getattr(inner, "tensors", None)
    if isinstance(t, dict):
        return 4 * sum(x.numel() for x in t.values())
    shapes = getattr(getattr(inner, "source", None), "shapes", None)
    if shapes is None:
        return None
    return 4 * sum(math.prod(s) for s in shapes().values())


def _decoder(model, device: torch.device, lazy: bool, dtype: torch.dtype | None):
    from kie_moe.models.registry import adapter_for
    adapter = adapter_for(model.spec.family)
    if hasattr(adapter, "reference_decoder"):
        return adapter.reference_decoder(model.spec, model.weights, device, dtype)
    from kie_moe.models.reference import ReferenceDecoder
    return ReferenceDecoder(model.spec, model.weights, device, dtype, lazy=lazy)


def window_logits(model, windows: torch.Tensor, device: torch.device, lazy: bool = False,
                  dtype: torch.dtype | None = torch.float32) -> list[torch.Tensor]:
    """Teacher-forced logits [window, V] (float32, on the host) over every window's inputs (w[:-1]), each from an
    empty cache."""
    dec = _decoder(model, device, lazy, dtype)
    out = []
    for w in windows:
        dec.reset()
        out.append(dec.forward(w[:-1].to(device)).float().cpu())
    del dec
    return out


def quality(ref: list[torch.Tensor], test: list[torch.Tensor], windows: torch.Tensor, with_ppl: bool) -> dict:
    """Means over every scored position (logits of input t score target t + 1 = windows[:, t + 1]): KL, top-1,
    and perplexity of the targets."""
    from kie_moe.quant.metrics import compare_logits
    r, t = torch.cat(ref), torch.cat(test)
    q = compare_logits(r, t, windows[:, 1:].reshape(-1) if with_ppl else None)
    return {"kl": q.kl, "top1": q.top1, "quality_tokens": int(r.shape[0]), "ppl": q.ppl_test, "ppl_bf16": q.ppl_ref}


# ---- the model in each scheme ----------------------------------------------------------------------------------

def _stamp(src: str, scheme: str, observer: str = "minmax", gptq=None, experts_only: bool = False) -> dict:
    cfg = os.path.join(src, "config.json")
    out = {"source": os.path.abspath(src), "scheme": scheme, "source_config_mtime": os.path.getmtime(cfg)}
    if experts_only:                # stamps written before --experts-only existed stay valid without it
        out["experts_only"] = True
    if observer != "minmax":        # stamps written before observers existed stay valid for minmax
        out["observer"] = observer
    if gptq is not None:
        out["gptq"] = {"calibration": gptq.label, "damp": gptq.damp, "sha1": gptq.fingerprint()}
    return out


def scheme_checkpoint(src: str, scheme: str, cache_dir: str, convert, observer: str = "minmax",
                      gptq=None, experts_only: bool = False) -> tuple[str, str]:
    """-> (directory of `src` in `scheme`, "converted" | "cached"). A cached conversion is reused only when its
    stamp names the same source, scheme, observer, GPTQ calibration (models.calibrate.GptqOptions.fingerprint),
    experts-only choice and source config.json mtime; otherwise it is converted again. GPTQ conversions are cached
    under SCHEME-gptq, experts-only ones under SCHEME[-gptq]-experts."""
    dst = os.path.join(cache_dir, scheme + ("-gptq" if gptq is not None else "") + ("-experts" if experts_only else ""))
    stamp_path = os.path.join(dst, _STAMP)
    want = _stamp(src, scheme, observer, gptq, experts_only)
    if os.path.exists(os.path.join(dst, "config.json")) and os.path.exists(stamp_path):
        try:
            with open(stamp_path) as f:
                if json.load(f) == want:
                    return dst, "cached"
        except ValueError:
            pass
    kw = {"observer": observer} if observer != "minmax" else {}
    if gptq is not None:
        kw["gptq"] = gptq
    if experts_only:
        kw["experts_only"] = True
    convert(src, dst, scheme, force=os.path.exists(dst), progress=False, on_warning=lambda m: None, **kw)
    with open(stamp_path, "w") as f:
        json.dump(want, f)
    return dst, "converted"


# ---- the sweep ---------------------------------------------------------------------------------------------------

def parse_schemes(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out:
        raise InputError("--schemes is empty")
    for x in out:
        check_scheme(x, "--schemes")
    if len(set(out)) != len(out):
        raise InputError(f"--schemes lists a scheme twice: {s}")
    return out


def run(model: str, schemes: list[str], out_dir: str, *, text: str | None = None, backend: str = "auto",
        device: str | None = None, tiny: bool = False, window: int = H.DEFAULT_WINDOW_LEN,
        max_tokens: int | None = None,
        prompt_len: int = 32, new_tokens: int = 64, runs: int = 3, probe_bytes: int | None = None,
        cache_dir: str | None = None, progress: bool = True, argv: list[str] | None = None,
        observer: str = "minmax", gptq: bool = False, calib: str | None = None,
        calib_tokens: int | None = None, damp: float = 0.01, experts_only: bool = False) -> dict:
    from tqdm.auto import tqdm
    from kie_moe.engine import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    model = resolve_model(model)
    ckpt = is_checkpoint_dir(model)
    check_window_args(window, max_tokens)    # the cheap checks before the probe and the reference model
    if text is not None:
        read_text(text, model if ckpt else None)
    if observer != "minmax" and not ckpt:
        raise InputError(f"--observer {observer}: needs a checkpoint (kie convert chooses the scales); {model} is "
                         f"quantized in memory, with minmax scales")
    if gptq and not ckpt:
        raise InputError(f"--gptq: needs a checkpoint with a tokenizer (GPTQ calibrates on text); {model} is "
                         f"quantized in memory, rounded to nearest")
    if experts_only and not ckpt:
        raise InputError(f"--experts-only: needs a checkpoint (kie convert --experts-only); {model} is quantized in "
                         f"memory, every Linear")
    gptq_opts = H.gptq_options(model, calib, calib_tokens, device, damp, enabled=gptq)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out_dir}: cannot create it ({e.strerror})") from None
    bar = tqdm(total=2 * len(schemes) + 2, desc="kie sweep", file=sys.stderr, disable=not progress, leave=False)
    bar.set_postfix_str("read probe")
    res = {"schema": SCHEMA, "model": model, "env": R.environment(dev, argv),
           "read_probe": R.read_probe(dev, probe_bytes)}
    bar.update()

    bar.set_postfix_str("bf16 reference")
    base = open_model(model, dev, tiny=tiny)          # bf16 / float: the reference every scheme is compared with
    if base.scheme != "bf16":
        raise InputError(f"{model}/config.json: the checkpoint is already {base.scheme}; a sweep needs the float "
                         f"(bf16) checkpoint as its reference")
    spec = base.model.spec
    windows, data_label = token_windows(model if ckpt else None, spec, text, window, max_tokens)
    with_ppl = not data_label.startswith("random")
    # A synthetic model on the GPU may be too large for a second (dequantized) copy: then weights are
    # fetched and quantized at every use instead (slow, but memory stays at one weight).
    lazy = dev.type == "cuda" and not ckpt and _model_bytes(base.model.weights) > 0.85 * torch.cuda.mem_get_info(dev)[0]
    qdtype = quality_dtype(dev, lazy, base.model.weights)
    ref = window_logits(base.model, windows, dev, lazy, qdtype)
    bar.update()
    convert = convert_checkpoint if ckpt else None   # kie convert's entry point
    # each row records the backend that ran it (auto moves to the next backend for a scheme the preferred one does
    # not support, e.g. mixed formats in one kind); the title names them, or the request until a row has run
    res.update(quality_data=data_label, quality_dtype=str(qdtype).removeprefix("torch."),
               converter="kie convert" if convert else "in-memory quantization",
               backend=backend, observer=observer, experts_only=experts_only, rows=[],
               gptq=None if gptq_opts is None else {"calibration": gptq_opts.label, "damp": gptq_opts.damp,
                                                    "device": gptq_opts.device})

    for scheme in schemes:
        row = {"scheme": scheme}
        try:
            bar.set_postfix_str(f"{scheme}: model")
            if scheme == "bf16":
                src, origin = base, "bf16 source"
            elif convert is not None:
                from kie_moe.quant.schemes import takes_observer
                d, how = scheme_checkpoint(model, scheme, cache_dir or os.path.join(out_dir, "checkpoints"), convert,
                                           observer if takes_observer(scheme) else "minmax", gptq_opts, experts_only)
                src, origin = open_model(d, dev), f"{how}: {d}"      # its config.json says which modules are quantized
            else:
                src, origin = B.with_scheme(base, scheme), "quantized in memory"
            row["model_source"] = origin
            if src.scheme != scheme:     # kie convert keeps weights a format cannot hold (e.g. < 128 for fp8-block)
                row["note"] = (f"no Linear weight of this model fits {scheme} (shapes); kie convert kept them in "
                               f"float" if src.scheme == "bf16" else f"checkpoint holds {src.scheme}")
            bar.set_postfix_str(f"{scheme}: quality")
            test = ref if scheme == "bf16" else window_logits(src.model, windows, dev, lazy, qdtype)
            row.update(quality(ref, test, windows, with_ppl))
            del test
            bar.update()
            bar.set_postfix_str(f"{scheme}: speed")
            r = B.bench_row(src, backend, dev, res["read_probe"], prompt_len=prompt_len, new_tokens=new_tokens,
                            runs=runs)
            row.update({k: r[k] for k in ("backend", "backend_note", "tok_per_s", "tok_per_s_runs", "spread_pct",
                                          "ms_per_token", "ttft_s", "bytes_per_token", "bytes", "achieved_gbps",
                                          "pct_roofline", "roofline_tok_per_s")})
            bar.update()
        except (KieError, RuntimeError, ValueError, NotImplementedError) as e:
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
            bar.write(f"kie sweep: {scheme}: {row['error']}", file=sys.stderr)
        res["rows"].append(row)
        ran = list(dict.fromkeys(r["backend"] for r in res["rows"] if r.get("backend")))
        res["backend"] = " + ".join(ran) if ran else backend
        # every row on disk as soon as it is measured: a sweep cut short (time limit, OOM) keeps what it has
        res["plot"] = plot(res, os.path.join(out_dir, PLOT_FILE))
        write_outputs(res, out_dir)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return res


def _model_bytes(store) -> int:
    t = getattr(getattr(store, "store", store), "tensors", None)
    return sum(x.numel() * x.element_size() for x in t.values()) if isinstance(t, dict) else 0


# ---- outputs -----------------------------------------------------------------------------------------------------

def _title(res: dict) -> str:
    env = res["env"]
    name = os.path.basename(os.path.normpath(res["model"]))
    return f"kie sweep {name}{' (GPTQ)' if res.get('gptq') else ''}: {res['backend']} backend, {env.get('device')}"


def plot(res: dict, path: str) -> dict:
    """tok/s (y) against mean KL vs bf16 (x), one labelled point per scheme that has both. Returns the points as
    read back from the plotted artist, the file name and its size in pixels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in res["rows"] if r.get("tok_per_s") is not None and r.get("kl") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    sc = ax.scatter([r["kl"] for r in pts], [r["tok_per_s"] for r in pts], s=40, zorder=3)
    for r in pts:
        ax.annotate(r["scheme"], (r["kl"], r["tok_per_s"]), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("mean KL(bf16 || scheme) of next-token distributions [nats]  (lower is better)")
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title(_title(res), fontsize=10)
    fig.text(0.01, 0.01, f"quality data: {res['quality_data']}", fontsize=7, color="0.35")
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.12)                    # room for the labels of the outermost points
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    offsets = sc.get_offsets()
    drawn = [{"scheme": r["scheme"], "x": float(offsets[i][0]), "y": float(offsets[i][1])} for i, r in enumerate(pts)]
    w, h = fig.canvas.get_width_height()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"file": os.path.basename(path), "x": "kl", "y": "tok_per_s", "points": drawn, "size_px": [w, h]}


def _fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def md_table(res: dict) -> str:
    env = res["env"]
    head = ["scheme", "backend", "tok/s", "ms/token", "bytes/token", "GB/s", "% roofline", "KL vs bf16", "top-1",
            "ppl", "model"]
    lines = [f"# kie sweep {res['model']}", "",
             f"{env.get('date')}; {env.get('device')}" + (f", driver {env['driver']}" if env.get("driver") else "")
             + f"; torch {env.get('torch')}, triton {env.get('triton')}; commit {env.get('git_commit')}", "",
             f"Command: `{env.get('command')}`", "",
             f"Read ceiling {res['read_probe']['gbps']:.0f} GB/s ({res['read_probe']['method']}). "
             f"Quality data: {res['quality_data']}; {res.get('quality_dtype', 'float32')} activations. Schemes from: {res['converter']}"
             + (f" (fp4 scales: {res['observer']} observer)" if res.get("observer", "minmax") != "minmax" else "")
             + (f"; codes by GPTQ, calibrated on {res['gptq']['calibration']} (damp {res['gptq']['damp']:g}, "
                f"{res['gptq']['device']})" if res.get("gptq") else "")
             + ("; routed and shared experts only (attention and dense MLPs in float: kie convert --experts-only)"
                if res.get("experts_only") else "") + ".", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['scheme']} | error: {r['error'][:120]} |" + " |" * (len(head) - 2))
            continue
        ppl = "" if r.get("ppl") is None else f"{r['ppl']:.3f} (bf16 {r['ppl_bf16']:.3f})"
        lines.append("| " + " | ".join([
            r["scheme"], r.get("backend", ""), _fmt(r.get("tok_per_s"), ".1f"), _fmt(r.get("ms_per_token"), ".3f"),
            R.fmt_bytes(r["bytes_per_token"]) if r.get("bytes_per_token") else "", _fmt(r.get("achieved_gbps"), ".1f"),
            _fmt(r.get("pct_roofline"), ".1f"), _fmt(r.get("kl"), ".5f"), _fmt(r.get("top1"), ".4f"), ppl,
            r.get("model_source", "")]) + " |")
    notes = sorted({r["backend_note"] for r in res["rows"] if r.get("backend_note")})
    notes += [f"{r['scheme']}: {r['note']}" for r in res["rows"] if r.get("note")]
    lines += [""] + [f"Note: {n}" for n in notes] + ([""] if notes else []) + [f"![tok/s vs KL]({PLOT_FILE})", ""]
    return "\n".join(lines)


def write_outputs(res: dict, out_dir: str):
    B.write_json(res, os.path.join(out_dir, "results.json"))
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in res["rows"]:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md_table(res))


@B.user_errors
def cmd_sweep(a) -> int:
    schemes = parse_schemes(a.schemes)
    if a.out is None:
        a.out = "sweep-" + (os.path.basename(os.path.normpath(a.model)) or "model")
    res = run(a.model, schemes, a.out, text=a.text, backend=a.backend, device=a.device, tiny=a.tiny,
              window=a.window, max_tokens=a.max_tokens, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
              runs=a.runs, probe_bytes=a.probe_mb << 20 if a.probe_mb else None, cache_dir=a.cache,
              progress=not a.quiet, observer=a.observer, gptq=a.gptq, calib=a.calib, calib_tokens=a.calib_tokens,
              damp=a.damp, argv=getattr(a, "argv", None), experts_only=a.experts_only)
    print(md_table(res))
    print(f"[wrote {os.path.join(a.out, 'results.md')}, results.csv, results.json, {PLOT_FILE}]", file=sys.stderr)
    return 1 if any("error" in r for r in res["rows"]) else 0

