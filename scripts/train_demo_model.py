#!/usr/bin/env python3
"""Train the embedded demo model (kie_moe/assets/demo-moe): a small Qwen3-MoE that writes Python.

Data: the running interpreter's standard-library sources (*.py under sysconfig's stdlib dir: real text that every
machine has offline), minus site-packages and the generated `encodings` tables. A file is held out when
sha1(relative path) % 50 == 0 (about 2%, independent of file order and of which other files exist), so the split
is the same on any machine with the same Python version.
Tokenizer: byte-level BPE trained here with `tokenizers` on the train split (all 256 bytes in the alphabet, so any
text encodes), wrapped as PreTrainedTokenizerFast with <|bos|> prepended on encode and <|endoftext|> as eos.
Model: transformers' Qwen3MoeForCausalLM, float32 master weights, bf16 autocast on CUDA, AdamW, linear warmup then
cosine to 10%. Saved with save_pretrained in bf16, plus TRAINING.md (the recipe and the measured numbers) and
heldout.txt (held-out text for quality sweeps). The output folder holds 7 files, each under 16 MiB.

    python scripts/train_demo_model.py --out OUT_DIR --device cuda            # the real run (~3 min on an H200)
    python scripts/train_demo_model.py --out /tmp/d --device cpu --tiny --steps 20   # end-to-end check on CPU
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

BOS, EOS = "<|bos|>", "<|endoftext|>"
SPECIALS = [EOS, BOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]  # EOS = id 0, BOS = id 1
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings"}  # third-party code; generated tables
MAX_FILE_BYTES = 400_000  # larger stdlib .py files are generated data (unicode tables, test vectors)
HELDOUT_MOD = 50          # 1 file in 50 -> test split
HELDOUT_TXT_BYTES = 256_000

# the real model: 4 layers, 8 experts top-2; moe_intermediate 192 (not 256) keeps bf16 weights under 16 MiB
MODEL = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192, intermediate_size=512)
TINY = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128)


# ------------------------------------------------------------------------------------------------ data
def stdlib_files(max_mb: float | None) -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """-> (train [(relpath, text)], heldout [...], stdlib dir), each sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                if os.path.getsize(p) <= MAX_FILE_BYTES:
                    found.append(os.path.relpath(p, root))
    if not found:
        sys.exit(f"train_demo_model: no *.py files under {root} (sysconfig stdlib dir)")
    train, held = [], []
    for rel in sorted(found):
        try:
            text = open(os.path.join(root, rel), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately in other encodings
        h = int(hashlib.sha1(rel.encode()).hexdigest(), 16)
        (held if h % HELDOUT_MOD == 0 else train).append((rel, text))
    if max_mb is not None:  # CPU smoke runs: a deterministic prefix by hash order, not the first directories
        budget = max_mb * 1e6
        train = sorted(train, key=lambda rt: hashlib.sha1(rt[0].encode()).hexdigest())
        keep, n = [], 0
        for rt in train:
            if n >= budget:
                break
            keep.append(rt)
            n += len(rt[1])
        train = sorted(keep)
    return train, held, root


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    # encode() prepends <|bos|>, as every training document starts with it
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                      chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    return tok, wrapped


def encode_docs(tok, texts: list[str]) -> torch.Tensor:
    """Documents as one int32 stream: <|bos|> text <|endoftext|> <|bos|> text ..."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out += [bos, *enc.ids, eos]
    return torch.tensor(out, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------ model
def make_model(shape: dict, vocab: int, bos: int, eos: int, seq_len: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**{**shape, "vocab_size": vocab}, max_position_embeddings=max(2048, seq_len),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                         router_aux_loss_coef=0.01, output_router_logits=True, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=eos, initializer_range=0.02, use_cache=False)
    return Qwen3MoeForCausalLM(cfg)


def pick_experts_impl(model, batch_fn, device) -> str:
    """grouped_mm where one forward+backward works (fp32 masters under bf16 autocast are not supported by every
    torch/GPU pair), else transformers' eager per-expert loop."""
    if device.type != "cuda":
        model.set_experts_implementation("eager")
        return "eager"
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            x, y = batch_fn()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = step_loss(model, x[:2], y[:2])
            loss.backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return impl
        except Exception as e:  # noqa: BLE001 -- any failure means: try the next implementation
            print(f"experts implementation {impl} failed ({type(e).__name__}: {str(e)[:200]}); trying the next",
                  file=sys.stderr)
            model.zero_grad(set_to_none=True)
    raise SystemExit("train_demo_model: no experts implementation ran a training step")


def step_loss(model, x, y):
    out = model(input_ids=x, output_router_logits=True)
    lm = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1))
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=x.device)
    return lm + model.config.router_aux_loss_coef * aux, lm.detach()


@torch.no_grad()
def heldout_ppl(model, data: torch.Tensor, seq_len: int, batch: int, device, max_windows: int) -> tuple[float, int]:
    """Teacher-forced perplexity over consecutive non-overlapping windows of the held-out stream."""
    model.eval()
    n_win = min((len(data) - 1) // seq_len, max_windows)
    nll, count = 0.0, 0
    for i in range(0, n_win, batch):
        idx = torch.arange(i, min(i + batch, n_win))[:, None] * seq_len + torch.arange(seq_len + 1)[None]
        w = data[idx].to(device, torch.long)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=w[:, :-1]).logits
        nll += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                     reduction="sum"))
        count += w[:, 1:].numel()
    model.train()
    return math.exp(nll / max(count, 1)), count


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (created; files in it are replaced)")
    ap.add_argument("--steps", type=int, default=4000, help="optimizer steps (the time budget may stop earlier)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop the training loop after this many seconds; the lr schedule follows whichever of "
                         "steps or time runs out first, so a time-bound run still ends at the low lr")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=150, help="linear warmup steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (default 4096; 1024 with --tiny)")
    ap.add_argument("--max-data-mb", type=float, default=None, help="use only this many MB of training text")
    ap.add_argument("--eval-windows", type=int, default=2048, help="held-out windows of --seq-len to score")
    ap.add_argument("--tiny", action="store_true", help="a very small model (CPU checks, test placeholder)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (off by default: compiling eats a large share of a 3-minute run)")
    ap.add_argument("--log-every", type=int, default=100)
    a = ap.parse_args(argv)
    t_start = time.time()
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("train_demo_model: --device cuda but no CUDA GPU is available")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    shape = dict(TINY if a.tiny else MODEL)
    vocab = a.vocab_size or shape["vocab_size"]

    # data + tokenizer
    train_files, held_files, root = stdlib_files(a.max_data_mb)
    t0 = time.time()
    raw_tok, tok = train_tokenizer([t for _, t in train_files], vocab)
    t_tok = time.time() - t0
    vocab = raw_tok.get_vocab_size()
    train_data = encode_docs(raw_tok, [t for _, t in train_files])
    held_data = encode_docs(raw_tok, [t for _, t in held_files])
    train_bytes = sum(len(t.encode()) for _, t in train_files)
    held_bytes = sum(len(t.encode()) for _, t in held_files)
    print(f"data: {len(train_files)} train files ({train_bytes / 1e6:.1f} MB, {len(train_data) / 1e6:.2f} M tokens), "
          f"{len(held_files)} held out ({held_bytes / 1e6:.2f} MB, {len(held_data) / 1e3:.0f} k tokens) from {root}; "
          f"tokenizer {vocab} tokens in {t_tok:.1f} s", flush=True)
    if len(train_data) <= a.seq_len + 1 or len(held_data) <= a.seq_len + 1:
        sys.exit(f"train_demo_model: too little text for --seq-len {a.seq_len}")

    bos, eos = raw_tok.token_to_id(BOS), raw_tok.token_to_id(EOS)
    model = make_model(shape, vocab, bos, eos, a.seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    data_dev = train_data.to(device)
    gen = torch.Generator(device=device).manual_seed(a.seed)
    ar = torch.arange(a.seq_len + 1, device=device)

    def batch_fn():
        off = torch.randint(0, len(data_dev) - a.seq_len - 1, (a.batch, 1), device=device, generator=gen)
        w = data_dev[off + ar].long()  # [B, T+1]
        return w[:, :-1], w[:, 1:]

    impl = pick_experts_impl(model, batch_fn, device)
    gen.manual_seed(a.seed)  # the probe step above drew a batch: restart the stream so runs stay comparable
    fwd = model
    compiled = False
    if a.compile:
        try:
            fwd = torch.compile(model)
            compiled = True
        except Exception as e:  # noqa: BLE001
            print(f"torch.compile failed ({e}); running eager", file=sys.stderr)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    def lr_at(step: int, progress: float) -> float:
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    print(f"model: {n_params / 1e6:.2f} M params, experts {impl}{', compiled' if compiled else ''}; "
          f"{a.steps} steps x {a.batch} x {a.seq_len} on {device}", flush=True)
    model.train()
    t_loop = time.time()
    recent: list[torch.Tensor] = []
    log: list[str] = []
    step, progress = 0, 0.0
    while step < a.steps:
        elapsed = time.time() - t_loop
        progress = max(step / a.steps, elapsed / a.time_budget_s if a.time_budget_s else 0.0)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress)
        x, y = batch_fn()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            try:
                loss, lm = step_loss(fwd, x, y)
            except Exception as e:  # noqa: BLE001 -- a compile error surfaces at the first call
                if not compiled:
                    raise
                print(f"compiled model failed ({type(e).__name__}: {str(e)[:200]}); running eager", file=sys.stderr)
                fwd, compiled = model, False
                loss, lm = step_loss(fwd, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [lm])[-50:]
        step += 1
        if step % a.log_every == 0 or step == 1:
            cur = float(torch.stack(recent).mean())  # the only host sync in the loop
            line = (f"step {step:6d}  loss {cur:.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
                    f"{time.time() - t_loop:6.1f} s  {step * a.batch * a.seq_len / (time.time() - t_loop) / 1e3:.0f} "
                    f"k tok/s")
            print(line, flush=True)
            log.append(line)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_train = time.time() - t_loop
    final_loss = float(torch.stack(recent).mean()) if recent else float("nan")
    stopped = "time budget" if step < a.steps else "step count"
    ppl, n_eval = heldout_ppl(model, held_data, a.seq_len, max(1, a.batch // 2), device, a.eval_windows)
    print(f"done: {step} steps in {t_train:.1f} s ({stopped}); train loss {final_loss:.3f} (mean of last "
          f"{len(recent)} steps); held-out ppl {ppl:.2f} over {n_eval} tokens", flush=True)

    save(a, model, tok, held_files, dict(
        root=root, n_train=len(train_files), n_held=len(held_files), train_bytes=train_bytes, held_bytes=held_bytes,
        train_tokens=len(train_data), held_tokens=len(held_data), vocab=vocab, n_params=n_params, impl=impl,
        compiled=compiled, steps=step, stopped=stopped, t_train=t_train, final_loss=final_loss, ppl=ppl,
        n_eval=n_eval, t_tok=t_tok, wall=time.time() - t_start, log=log, shape=shape, device=device))
    return 0


def save(a, model, tok, held_files, m: dict) -> None:
    from transformers import GenerationConfig
    os.makedirs(a.out, exist_ok=True)
    model.config.output_router_logits = False
    model.config.use_cache = True
    model = model.to(torch.bfloat16).cpu()
    model.save_pretrained(a.out)
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
                     pad_token_id=model.config.pad_token_id, do_sample=False).save_pretrained(a.out)
    # the chat template inside tokenizer_config.json, not a separate .jinja: one file fewer to ship
    tok.save_pretrained(a.out, save_jinja_files=False)
    tc_path = os.path.join(a.out, "tokenizer_config.json")
    tc = json.load(open(tc_path))
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # what transformers 4.x loaders (vLLM, SGLang) know too
    json.dump(tc, open(tc_path, "w"), indent=2)
    # heldout.txt: whole held-out files in path order, each under a `# file:` line, up to HELDOUT_TXT_BYTES
    parts, n = [], 0
    for rel, text in held_files:
        chunk = f"# file: {rel}\n{text}\n"
        if n + len(chunk.encode()) > HELDOUT_TXT_BYTES and parts:
            break
        parts.append(chunk)
        n += len(chunk.encode())
    open(os.path.join(a.out, "heldout.txt"), "w", encoding="utf-8").write("".join(parts))
    open(os.path.join(a.out, "TRAINING.md"), "w").write(training_md(a, m, len(parts)))
    for f in sorted(os.listdir(a.out)):
        print(f"  {f:24s} {os.path.getsize(os.path.join(a.out, f)) / 1e6:8.3f} MB")


def training_md(a, m: dict, n_heldout_txt: int) -> str:
    dev = m["device"]
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{os.cpu_count()}-core CPU"
    placeholder = a.tiny or dev.type == "cpu"
    status = ("**PLACEHOLDER**: a short CPU/tiny run, so that `kie demo` and its tests have a real checkpoint; to "
              "be replaced by the GPU-trained model: `python scripts/train_demo_model.py --out DIR --device cuda "
              "--steps 20000 --time-budget-s 180` (about 3 minutes on one H200)." if placeholder else
              "The trained demo model (the GPU run).")
    s = m["shape"]
    cmd = " ".join(["python", "scripts/train_demo_model.py"] + sys.argv[1:])
    return f"""# demo-moe: how this model was made

{status}

Made by `scripts/train_demo_model.py`:

    {cmd}

| | |
| --- | --- |
| data | Python {platform.python_version()} standard-library sources: `*.py` under `{m['root']}` minus site-packages, dist-packages, `encodings/` and files over {MAX_FILE_BYTES // 1000} KB (undecodable files skipped){f'; train text capped at {a.max_data_mb} MB' if a.max_data_mb else ''} |
| split | held out when sha1(path relative to the stdlib dir) % {HELDOUT_MOD} == 0: {m['n_held']} files, {m['held_bytes'] / 1e6:.2f} MB, {m['held_tokens']:,} tokens; train {m['n_train']} files, {m['train_bytes'] / 1e6:.1f} MB, {m['train_tokens']:,} tokens |
| tokenizer | byte-level BPE (`tokenizers`), {m['vocab']} tokens incl. {len(SPECIALS)} specials, trained on the train split in {m['t_tok']:.1f} s; `<|bos|>` prepended on encode, `<|endoftext|>` = eos; documents are `<|bos|> file <|endoftext|>` |
| model | Qwen3-MoE (`Qwen3MoeForCausalLM`): {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, {s['num_attention_heads']} q / {s['num_key_value_heads']} kv heads x {s['head_dim']}, {s['num_experts']} experts top-{s['num_experts_per_tok']} (moe_intermediate {s['moe_intermediate_size']}, norm_topk_prob), untied lm_head, RoPE theta 1e4; {m['n_params'] / 1e6:.2f} M parameters, saved in bf16 |
| training | {m['steps']} steps (stopped by the {m['stopped']}) x batch {a.batch} x seq {a.seq_len} = {m['steps'] * a.batch * a.seq_len / 1e6:.1f} M tokens, random windows of the token stream; AdamW (betas 0.9/0.95, wd 0.1 on matrices), peak lr {a.lr:g}, {a.warmup} warmup steps then cosine to 10% (schedule progress = max(step/steps, time/budget)); grad clip 1.0; router aux loss 0.01; {'bf16 autocast, ' if dev.type == 'cuda' else ''}experts {m['impl']}{', torch.compile' if m['compiled'] else ''}; seed {a.seed} |
| device | {dev_name} ({dev.type}), torch {torch.__version__}, transformers {__import__('transformers').__version__} |
| wall time | training loop {m['t_train']:.1f} s; whole script {m['wall']:.1f} s |
| final train loss | {m['final_loss']:.4f} (cross-entropy, mean of the last 50 steps) |
| held-out perplexity | {m['ppl']:.3f} ({m['n_eval']:,} tokens, non-overlapping windows of {a.seq_len}) |

`heldout.txt`: the first {n_heldout_txt} held-out files (in path order, each after a `# file: PATH` line), at most
{HELDOUT_TXT_BYTES // 1000} KB: text the model never trained on, for `kie demo` and quality sweeps.

Training log:

```
{chr(10).join(m['log'])}
```
"""


if __name__ == "__main__":
    sys.exit(main())
