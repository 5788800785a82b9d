"""`kie`: the one command-line entry point. Each subcommand parses its options here and calls the product code;
every user error (KieError) prints one line on stderr and exits 2, never a traceback."""
from __future__ import annotations

import argparse
import json
import os
import sys

from kie_moe.models.errors import InputError, KieError


def _device_args(p: argparse.ArgumentParser):
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where to run (default: cuda when a GPU is present, else cpu)")
    p.add_argument("--backend", default="auto",
                   help="auto | reference | graph | monokernel (auto: graph on CUDA, the monokernel for the Laneformer "
                        "and --devices N; reference on CPU)")


def _gptq_args(p: argparse.ArgumentParser):
    p.add_argument("--gptq", action="store_true",
                   help="choose each weight's codes by GPTQ (as llm-compressor's GPTQModifier: same scales, same "
                        "format, codes that cancel each other's error on calibration text) instead of rounding "
                        "to nearest; runs the model over the calibration text, layer by layer")
    p.add_argument("--calib", default=None, metavar="FILE",
                   help="GPTQ calibration text (default: the checkpoint's calib.txt; the embedded demo model ships "
                        "one, disjoint from its heldout.txt)")
    # default None -> kie_moe.heldout.DEFAULT_CALIB_TOKENS (not imported here: it would load torch for --help)
    p.add_argument("--calib-tokens", type=int, default=None, metavar="N",
                   help="calibration tokens, in windows of 256 spread over the text (default 16384)")
    p.add_argument("--damp", type=float, default=0.01,
                   help="GPTQ dampening: this fraction of the Hessian's mean diagonal is added to it (default 0.01)")


def _parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise KieError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None


def cmd_generate(a) -> int:
    """One device: here. --devices N: N workers (kie_moe/launch.py), each decoding its shard in lockstep
    (kie_moe/ranks.py); rank 0 prints, through the same _generate as one device."""
    from kie_moe import ranks
    from kie_moe.synthetic import resolve_model
    a.model = resolve_model(a.model)      # `demo`: the embedded model, as kie bench / sweep / convert take it

    def prepare(group):
        from kie_moe.models.registry import load_model
        m = load_model(a.model)
        return m, ranks.rank_backend(m, group, a.backend, expert_split=a.expert_split)

    def lead(m, be):
        from kie_moe.engine import Engine
        return _generate(a, Engine(a.model, device=str(be.device), model=m, backend_impl=be))

    return ranks.launch_ranks(a, lambda: _generate(a), prepare, lead)


def _generate(a, eng=None) -> int:
    from kie_moe.engine import Engine
    from kie_moe.sampling import SamplingParams
    from kie_moe.tokenizer import IncrementalDecoder

    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, ignore_eos=a.ignore_eos)
    if a.chat and a.prompt_ids is not None:
        raise InputError("--chat wraps --prompt TEXT in the chat template; --prompt-ids are used as given")
    eng = Engine(a.model, device=a.device, backend=a.backend) if eng is None else eng
    if a.prompt_ids is not None:
        ids = _parse_ids(a.prompt_ids)
    elif a.chat:
        if eng.tokenizer is None:
            raise KieError(f"{a.model}: --chat needs the model's tokenizer files")
        ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
    else:
        ids = eng.encode(a.prompt)
    on_token = None
    if not a.json and eng.tokenizer is not None:
        dec = IncrementalDecoder(eng.tokenizer)
        if a.prompt is not None and not a.chat:
            sys.stdout.write(a.prompt)
        on_token = lambda t: (sys.stdout.write(dec.push(t)), sys.stdout.flush())
    res = eng.generate(ids, params, on_token)
    if a.json:
        print(json.dumps({"token_ids": res.token_ids, "text": res.text, "tokens_per_s": res.tokens_per_s,
                          "backend": eng.backend_name, "devices": eng.devices, "prompt_tokens": res.prompt_tokens,
                          "ttft_s": res.ttft_s, "finish_reason": res.finish_reason,
                          "sampling_fallbacks": res.sampling_fallbacks}))
    else:
        if eng.tokenizer is None:
            print(",".join(map(str, res.token_ids)))
        else:
            print()
        rate = (f"{res.tokens_per_s:.1f} tok/s decode, {res.ttft_s * 1e3:.0f} ms to first token"
                if res.tokens_per_s is not None else    # the interpreted monokernel hands over all tokens at its end
                f"{res.ttft_s + res.decode_s:.1f} s in all, one interpreted launch: no per-token rate")
        print(f"[{len(res.token_ids)} tokens, {rate}, backend {eng.backend_name}, {eng.device}"
              + (f", {eng.devices} devices" if eng.devices > 1 else "") + "]", file=sys.stderr)
    if res.sampling_fallbacks:
        print(f"kie generate: note: {res.sampling_fallbacks} of {len(res.token_ids)} draws were plain temperature "
              f"samples, not top-k / top-p: the nucleus was wider than the candidates the {eng.backend_name} "
              f"backend's GPU sampler keeps (--backend reference samples top-p exactly)", file=sys.stderr)
    return 0


def cmd_convert(a) -> int:
    from tqdm import tqdm
    from kie_moe.models.quantizable import convert_checkpoint
    say = (lambda m: None) if a.quiet else (lambda m: tqdm.write(f"kie convert: {m}", file=sys.stderr))
    from kie_moe.heldout import gptq_options
    from kie_moe.synthetic import resolve_model
    a.src = resolve_model(a.src)      # `demo`: the embedded model, as kie bench / sweep / demo take it
    gptq = gptq_options(a.src, a.calib, a.calib_tokens, a.device, a.damp, enabled=a.gptq)
    if gptq is not None:
        say(f"GPTQ calibration on {gptq.device}: {gptq.label}")
    rep = convert_checkpoint(a.src, a.dst, a.scheme, force=a.force, experts_only=a.experts_only, ignore=a.ignore,
                             quantize_lm_head=a.quantize_lm_head, progress=not a.quiet, observer=a.observer,
                             on_warning=lambda m: tqdm.write(f"kie convert: warning: {m}", file=sys.stderr),
                             gptq=gptq, on_progress=say)
    print(rep.dst)
    solved = f"; {rep.gptq_slices} [out, in] slices by GPTQ, the rest rounded to nearest" if a.gptq else ""
    print(f"[{rep.scheme}: {len(rep.quantized)} weights quantized ({len(rep.repacked)} re-packed as stored{solved}), "
          f"{len(rep.kept)} Linear weights kept in float, {rep.bytes_written / 1e6:.1f} MB]", file=sys.stderr)
    return 0


def cmd_synth(a) -> int:
    import torch
    from kie_moe.models import synth
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    out = synth.write_synthetic(a.arch, a.out_dir, tiny=a.tiny, dtype=dtype, seed=a.seed, progress=not a.quiet,
                                overwrite=a.force)
    print(out if isinstance(out, str) else a.out_dir)
    return 0


def cmd_serve(a) -> int:
    """One device: here. --devices N: rank 0 binds the port and serves HTTP, every rank decodes each request in
    lockstep (kie_moe/ranks.py)."""
    from kie_moe import ranks
    from kie_moe.server import bind, serve
    from kie_moe.synthetic import resolve_model
    kw = dict(host=a.host, port=a.port, api_key=a.api_key, max_queue=a.max_queue, max_model_len=a.max_model_len,
              served_model_name=a.served_model_name or a.model,   # `demo` stays the name clients send
              warmup=not a.no_warmup)
    a.model = resolve_model(a.model)

    def prepare(group):
        from kie_moe.models.registry import load_model
        sock = bind(a.host, a.port) if group.rank == 0 else None   # a taken port fails before the model loads
        try:
            m = load_model(a.model)
            return (sock, m), ranks.rank_backend(m, group, a.backend, expert_split=a.expert_split)
        except BaseException:
            if sock is not None:
                sock.close()
            raise

    def lead(ctx, be):
        from kie_moe.engine import Engine
        sock, m = ctx
        serve(a.model, **kw, sock=sock, engine=Engine(a.model, device=str(be.device), model=m, backend_impl=be),
              on_shutdown=be.stop)
        return 0

    def single():
        serve(a.model, **kw, device=a.device, backend=a.backend)
        return 0

    return ranks.launch_ranks(a, single, prepare, lead)


def cmd_demo(a) -> int:
    from kie_moe import demo
    if a.windows < 0:
        raise InputError(f"--windows must be >= 0 (0: every window that fits), got {a.windows}")
    schemes = tuple(x for x in a.schemes.replace(" ", "").split(",") if x)
    log = lambda m: print(f"kie demo: {m}", file=sys.stderr)
    on_text = None if a.json else (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    res = demo.run_demo(a.model, a.out, device=a.device, backend=a.backend, schemes=schemes,
                        max_new_tokens=a.max_new_tokens, windows=a.windows, window_len=a.window_len,
                        on_text=on_text, log=log, gptq=a.gptq, calib=a.calib, calib_tokens=a.calib_tokens,
                        damp=a.damp)
    if a.json:
        print(json.dumps(res.to_dict()))
    else:
        print()
        demo.print_table(res)
    return 0


def cmd_bench(a) -> int:
    from kie_moe.bench import cmd_bench as run
    return run(a)


def cmd_sweep(a) -> int:
    from kie_moe.sweep import cmd_sweep as run
    return run(a)


def cmd_preview(a) -> int:
    from kie_moe.preview import cmd_preview as run
    return run(a)


EXPERT_SPLIT_HELP = ("with --devices N on GPUs, how a MoE's experts are split: tp (columns of every expert on every "
                     "rank: 1/N of each active expert's bytes, the batch-1 choice), ep (whole experts per rank), "
                     "auto (default: tp where the expert width splits into whole scale groups of the weight format, "
                     "else ep)")
DEVICES_HELP = ("N devices (default 1): N worker processes, one per GPU (--device cpu: N CPU processes), each "
                "decoding its shard in lockstep; rank 0 prints / serves")


def _measure_args(p: argparse.ArgumentParser, new_tokens: int):
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=new_tokens, help=f"tokens decoded per run (default {new_tokens})")
    p.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up; the median is reported")
    p.add_argument("--probe-mb", type=int, default=None, help=argparse.SUPPRESS)  # tests: a smaller CPU read probe


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kie", description="KIE-MoE: batch-1 LLM inference for MoE checkpoints")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate one completion, streamed",
                       description="Generate one completion from MODEL (an HF-format checkpoint directory).")
    g.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json + *.safetensors), or demo "
                   "(the embedded model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer files)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template as a user turn")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--json", action="store_true",
                   help='print one JSON object: {"token_ids", "text", "tokens_per_s", "backend", ...}')
    g.add_argument("--devices", type=int, default=1,
                   help=DEVICES_HELP)
    _device_args(g)
    g.add_argument("--expert-split", default=None, choices=["auto", "tp", "ep"], help=EXPERT_SPLIT_HELP)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert an HF checkpoint to fp8 / fp8-block / nvfp4 / mxfp4",
                       description="Write SRC's weights quantized to DST (compressed-tensors format), shard by shard. "
                                   "Attention, dense MLP and expert Linears are quantized; routers, embeddings, norms "
                                   "and lm_head stay as stored.")
    c.add_argument("src", metavar="SRC", help="checkpoint directory (float, or already FP8 / MXFP4), or demo (the "
                   "embedded model)")
    c.add_argument("dst", metavar="DST", help="output directory (must not exist unless --force)")
    c.add_argument("--scheme", required=True, help="fp8 | fp8-block | nvfp4 | mxfp4")
    c.add_argument("--force", action="store_true", help="replace DST if it exists (only once the new one is complete)")
    c.add_argument("--experts-only", action="store_true", help="quantize only the routed and shared experts")
    c.add_argument("--ignore", nargs="+", action="extend", default=[], metavar="REGEX",
                   help="keep modules whose name matches REGEX in float (re.match, anchored at the end)")
    c.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too")
    c.add_argument("--observer", default="minmax", choices=["minmax", "mse"],
                   help="how nvfp4 / mxfp4 pick each group's scale: minmax (amax -> the largest code; "
                        "compressed-tensors' default) or mse (the candidate scale with the least squared error, as "
                        "llm-compressor's MSE observer; slower to convert, same format)")
    _gptq_args(c)
    c.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where --gptq calibrates and solves (default: cuda when a GPU is present, else cpu)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_convert)

    s = sub.add_parser("synth", help="write a random-weight checkpoint with a real architecture's shapes",
                       description="Write an HF-format checkpoint (config + sharded safetensors) with ARCH's shapes "
                                   "and random weights, shard by shard.")
    s.add_argument("arch", help="preset name, e.g. qwen3-30b-a3b, gpt-oss-120b, deepseek-v3, llama-3.2-1b")
    s.add_argument("out_dir", metavar="OUT_DIR")
    s.add_argument("--tiny", action="store_true", help="a small variant of the same family (for tests)")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--force", action="store_true", help="replace a checkpoint already in OUT_DIR")
    s.set_defaults(fn=cmd_synth)

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       description="Serve MODEL_DIR over an OpenAI-compatible HTTP API, one request decoding at a "
                                   "time (others wait in FIFO order). Also /health and /metrics (Prometheus).")
    v.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json + *.safetensors), or demo "
                   "(the embedded model)")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    v.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $KIE_API_KEY, else none)")
    v.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while one decodes; more get HTTP 429 (default 64)")
    v.add_argument("--max-model-len", type=int, default=None,
                   help="context limit for prompt + generated tokens (default: the model's)")
    v.add_argument("--served-model-name", default=None,
                   help="model name clients send and /v1/models lists (default: MODEL_DIR as given)")
    v.add_argument("--no-warmup", action="store_true",
                   help="answer at once instead of compiling the GPU decode kernels first (the first greedy and the "
                        "first top-k / top-p request then wait for their compile)")
    v.add_argument("--devices", type=int, default=1, help=DEVICES_HELP)
    _device_args(v)
    v.add_argument("--expert-split", default=None, choices=["auto", "tp", "ep"], help=EXPERT_SPLIT_HELP)
    v.set_defaults(fn=cmd_serve)

    d = sub.add_parser("demo", help="the embedded demo model end to end: convert, generate, compare with bf16",
                       description="Convert the embedded demo model (a small Qwen3-MoE trained on Python source: the "
                                   "standard library and site-packages) to each scheme, complete a Python prompt "
                                   "with each, and print a table: weight bytes, decode tok/s, and top-1 agreement / "
                                   "KL vs bf16 and perplexity, teacher-forced on held-out text.")
    d.add_argument("--model", default=None, metavar="MODEL_DIR",
                   help="another checkpoint with tokenizer files (default: the embedded kie_moe/assets/demo-moe)")
    d.add_argument("--out", default=None, metavar="DIR",
                   help="where converted checkpoints are cached (default: ~/.cache/kie-moe/demo)")
    d.add_argument("--schemes", default="fp8,nvfp4", help="comma-separated quantized schemes (default fp8,nvfp4)")
    d.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per scheme (default 48)")
    d.add_argument("--windows", type=int, default=32,
                   help="held-out windows scored per scheme, spread over the whole text (default 32; 0: all that fit; "
                        "the same windows as kie sweep's defaults)")
    d.add_argument("--window-len", type=int, default=256, help="scored tokens per held-out window (default 256)")
    _gptq_args(d)
    d.add_argument("--json", action="store_true", help="print one JSON object (rows: scheme, bytes, tokens_per_s, "
                                                       "top1, kl, ppl, text, ...) instead of the table")
    _device_args(d)
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="decode tok/s, GB/s and %% of the read-bandwidth roofline",
                       description="Time batch-1 greedy decoding of MODEL (a checkpoint directory, or a preset ARCH "
                                   "built with random weights on the device) beside a read-bandwidth probe run in "
                                   "the same process. Reports tok/s (median, spread), ms/token, TTFT, bytes/token "
                                   "(active weights + scales + KV), GB/s and % of the roofline.")
    b.add_argument("model", metavar="MODEL", nargs="?",
                   help="checkpoint directory, preset name (see kie synth), or demo (the embedded model)")
    b.add_argument("--all", action="store_true", help="the standard matrix of presets x schemes x GPU backends")
    b.add_argument("--archs", default=None, metavar="A,B",
                   help="with --all: only the matrix rows of these presets (the suite in several sittings)")
    b.add_argument("--scheme", default="bf16", choices=["bf16", "fp8", "fp8-block", "nvfp4", "mxfp4"],
                   help="quantize a float model's Linear weights in memory first (default bf16: as stored)")
    b.add_argument("--quantize-lm-head", action="store_true",
                   help="with --scheme: quantize the lm_head too (as `kie convert --quantize-lm-head`)")
    b.add_argument("--tiny", action="store_true", help="a preset's tiny variant (tests, CPU)")
    _measure_args(b, 128)
    b.add_argument("--context-len", type=int, default=None,
                   help="start decoding at this context length instead of --prompt-len")
    b.add_argument("--context-fill", default="auto", choices=["auto", "prefill", "synthetic"],
                   help="how --context-len is reached: random KV values (graph, monokernel) or a real prefill "
                        "(default auto: random values where the backend allows)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="time sampled decoding instead of greedy (seed 0); with --top-k / --top-p the filtered "
                        "sampler (the monokernel's SFILTER variant)")
    b.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0 = off)")
    b.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (1 = off)")
    b.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    b.add_argument("--out", default=None, metavar="FILE", help="also write the JSON result to FILE")
    b.add_argument("--devices", type=int, default=1, help=DEVICES_HELP + "; the roofline is N devices' (each "
                                                          "reads bytes/N)")
    _device_args(b)
    b.add_argument("--expert-split", default=None, choices=["auto", "tp", "ep"], help=EXPERT_SPLIT_HELP)
    b.set_defaults(fn=cmd_bench)

    w = sub.add_parser("sweep", help="throughput vs quality per quantization scheme: table + plot",
                       description="For each scheme: convert MODEL (cached in --cache), measure decode speed, and "
                                   "compare with the bf16 model teacher-forced over text (mean KL, top-1 agreement, "
                                   "perplexity). Writes results.md, results.csv, results.json and tradeoff.png.")
    w.add_argument("model", metavar="MODEL", help="float checkpoint directory, demo (the embedded model), or a "
                                                  "preset ARCH (speed of real shapes; quality only vs its bf16 self "
                                                  "on random ids)")
    w.add_argument("--schemes", default="bf16,fp8,fp8-block,nvfp4,mxfp4", help="comma-separated (default: all)")
    w.add_argument("--text", default=None, metavar="FILE", help="text to score (default: the model's heldout.txt, "
                                                                "else the embedded demo model's, else random ids)")
    w.add_argument("--out", default=None, metavar="DIR", help="results.{md,csv,json} and tradeoff.png go here "
                                                              "(default: ./sweep-MODEL, MODEL's last path part)")
    w.add_argument("--cache", default=None, metavar="DIR",
                   help="converted checkpoints, reused across runs (default: OUT/checkpoints)")
    w.add_argument("--tiny", action="store_true", help="a preset's tiny variant (tests, CPU)")
    w.add_argument("--observer", default="minmax", choices=["minmax", "mse"],
                   help="how the nvfp4 / mxfp4 conversions pick their scales (kie convert --observer)")
    w.add_argument("--experts-only", action="store_true",
                   help="quantize only the routed and shared experts (kie convert --experts-only)")
    _gptq_args(w)
    w.add_argument("--window", type=int, default=256, help="scored tokens per teacher-forced window (default 256)")
    w.add_argument("--max-tokens", type=int, default=None,
                   help="tokens scored per scheme, in windows spread over the whole text (default 8192, kie demo's "
                        "windows; 0: all of the text; 512 with random ids)")
    _measure_args(w, 64)
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    _device_args(w)
    w.set_defaults(fn=cmd_sweep)

    pv = sub.add_parser("preview", help="the dense Laneformer-2B preview reproduction (FP16, batch 1)",
                        description="Build laneformer-2b with random FP16 weights on the GPU, decode, and print tok/s "
                                    "and % of the roofline beside the published 2,100 tok/s on 8x H200.")
    pv.add_argument("--devices", type=int, default=1,
                    help="devices to decode on (default 1): N worker processes, the lanes split N ways (Laneformer "
                         "DTP ranks over KCCL; with --device cpu --tiny, N CPU processes)")
    pv.add_argument("--backend", default="monokernel", choices=["monokernel", "graph", "reference"],
                    help="monokernel (default) or graph; falls back to the reference backend, labelled, when the "
                         "backend does not run the laneformer family yet")
    pv.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default cuda (cpu only with --tiny)")
    pv.add_argument("--tiny", action="store_true", help="laneformer-tiny: a smoke test, not the preview")
    _measure_args(pv, 128)
    pv.add_argument("--json", action="store_true", help="print the JSON result instead of the report")
    pv.add_argument("--out", default=None, metavar="FILE", help="also write the JSON result to FILE")
    pv.set_defaults(fn=cmd_preview)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)   # recorded with bench / sweep / preview results
    try:
        return args.fn(args)
    except KieError as e:
        if os.environ.get("KIE_WORKER") != "1" or os.environ.get("RANK", "0") == "0":   # rank 0 speaks for all
            print(f"kie {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kie {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
