#!/usr/bin/env python3
"""Experiment (issue 8, session 15): can the rounding of each weight, chosen end to end, take the embedded demo model
past what GPTQ gives? AutoRound / AdaRound-style: every quantized weight gets an offset V (in units of its local
grid step, |V| <= VMAX) before rounding, trained by signed gradient descent (straight-through rounding) to minimise
KL(bf16 || quantized) of HF transformers' Qwen3MoeForCausalLM (float32) over the calibration text (calib.txt);
scored on every held-out window (27,904 tokens) as benchmarks/demo_quant_analysis.py scores. Not a converter
option: it gains little over GPTQ here (benchmarks/NOTES.md, session 15). Settings by environment:

    FMT=fp8|nvfp4  STEPS=300  LR=5e-3  BS=8 (windows per step)  CAL=29184 (calibration tokens)  VMAX=0.5|1.0
    SRCQ=DIR       nvfp4: the kie convert output whose group scales are used (round-to-nearest start)
    INIT=DIR       start from this conversion's codes and scales instead (e.g. kie convert --gptq), VMAX=1.0

    FMT=nvfp4 INIT=/tmp/gptq-nvfp4 VMAX=1.0 CAL=29184 STEPS=300 python benchmarks/demo_kd_rounding.py
"""
import math, os, re, time
import torch, torch.nn.functional as F
from safetensors.torch import load_file
from torch.func import functional_call
from transformers import AutoTokenizer, Qwen3MoeForCausalLM
from kie_moe import demo, heldout as H
from kie_moe.hf_state import qwen3_moe_state

torch.manual_seed(0)
STEPS = int(os.environ.get("STEPS", 200)); LR = float(os.environ.get("LR", 5e-3)); BS = int(os.environ.get("BS", 8))
VMAX = float(os.environ.get("VMAX", 0.5)); CAL_TOK = int(os.environ.get("CAL", 16384)); OPT = os.environ.get("OPT", "sign")
src = demo.DEFAULT_MODEL
tok = AutoTokenizer.from_pretrained(src)
model = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
for p in model.parameters():
    p.requires_grad_(False)
cfg = model.config
base = {k: v.clone() for k, v in model.state_dict().items()}
RAW = load_file(os.path.join(src, "model.safetensors"))
QM = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)")
W = {k[:-7]: v.float() for k, v in RAW.items() if k.endswith(".weight") and QM.fullmatch(k[:-7])}
print(len(W), "modules", flush=True)

def scale(w):
    return w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0

FMT = os.environ.get("FMT", "fp8")
if FMT == "fp8":
    S = {m: scale(w) for m, w in W.items()}
    U = {m: W[m] / S[m] for m in W}
    if os.environ.get("INIT"):   # start from another conversion's codes (e.g. GPTQ): U on its grid points
        from kie_moe.hf_state import ct_decompressed
        _, dec = ct_decompressed(os.environ["INIT"], "fp8")
        sc = {k[:-len(".weight_scale")]: v.float() for k, v in load_file(os.path.join(os.environ["INIT"], "model.safetensors")).items() if k.endswith(".weight_scale")}
        for m in W:
            S[m] = sc[m].reshape(-1, 1)
            U[m] = dec[m] / S[m]
    ULP = {m: torch.exp2(torch.floor(torch.log2(U[m].abs().clamp_min(2.0 ** -6))) - 3) for m in W}
    def QF(t):
        return t.clamp(-448, 448).to(torch.float8_e4m3fn).float()
else:   # nvfp4: group scales (e4m3 / global) of the conversion in SRCQ (or INIT), codes from INIT or rounded from W
    from kie_moe.hf_state import ct_decompressed
    from kie_moe.quant.codecs import decode_e2m1, encode_e2m1
    d = os.environ.get("INIT") or os.environ["SRCQ"]
    _, dec = ct_decompressed(d, "nvfp4")
    raw = load_file(os.path.join(d, "model.safetensors"))
    S, U = {}, {}
    for m in W:
        s = raw[m + ".weight_scale"].float() / raw[m + ".weight_global_scale"].float().reshape(-1)[0]
        S[m] = s.repeat_interleave(16, dim=1)
        U[m] = (dec[m] if os.environ.get("INIT") else W[m]) / S[m]
    ULP = {m: torch.where(U[m].abs() < 2, 0.5, torch.where(U[m].abs() < 4, 1.0, 2.0)) for m in W}
    def QF(t):
        return decode_e2m1(encode_e2m1(t))
    chk = max(float((QF(U[m]) * S[m] - dec[m]).abs().max()) for m in W) if os.environ.get("INIT") is None else 0.0
    print("nvfp4 rtn reproduces the conversion: max diff", chk, flush=True)
V = {m: torch.zeros_like(W[m], requires_grad=True) for m in W}

def e4m3(x):
    return QF(x)

def wq(m, ste=True):
    t = U[m] + V[m] * ULP[m]
    q = e4m3(t)
    return (t + (q - t).detach()) * S[m] if ste else q * S[m]

enc = lambda text: tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
held = H.windows(enc(open(H.heldout_file(src), encoding="utf-8").read()), 0, 256)
cal, lab = H.calibration_windows(src, None, CAL_TOK, cfg.vocab_size)
print("calib", lab, "held", tuple(held.shape), flush=True)

def logits_with(get, Wn, bs=8, grad=False):
    sd = qwen3_moe_state(base, get, cfg.num_hidden_layers, cfg.num_experts)
    out = []
    for i in range(0, len(Wn), bs):
        out.append(functional_call(model, sd, (Wn[i:i + bs, :-1],)).logits.float())
    return torch.cat(out)

with torch.no_grad():
    ref_h = logits_with(lambda m: None, held)
    ref_c = F.log_softmax(logits_with(lambda m: None, cal), -1)

def evaluate(get):
    with torch.no_grad():
        z = logits_with(get, held)
    r, t = ref_h.reshape(-1, ref_h.shape[-1]), z.reshape(-1, z.shape[-1])
    y = held[:, 1:].reshape(-1)
    lp, lq = F.log_softmax(r, -1), F.log_softmax(t, -1)
    return dict(top1=float((r.argmax(-1) == t.argmax(-1)).float().mean()), kl=float((lp.exp() * (lp - lq)).sum(-1).mean()),
                ppl=math.exp(float(F.cross_entropy(t, y))), ppl_ref=math.exp(float(F.cross_entropy(r, y))))

print("start", evaluate(lambda m: wq(m, False).detach() if m in W else None), flush=True)
opt = torch.optim.Adam(list(V.values()), lr=LR) if OPT == "adam" else None
t0 = time.time()
n = cal.shape[0]
for step in range(STEPS):
    idx = torch.randperm(n)[:BS]
    sd = qwen3_moe_state(base, lambda m: wq(m) if m in W else None, cfg.num_hidden_layers, cfg.num_experts)
    z = functional_call(model, sd, (cal[idx, :-1],)).logits.float()
    lq = F.log_softmax(z, -1)
    lp = ref_c[idx]
    loss = (lp.exp() * (lp - lq)).sum(-1).mean()
    for v in V.values():
        v.grad = None
    loss.backward()
    with torch.no_grad():
        if opt is None:
            lr = LR * (1 - step / STEPS)
            for v in V.values():
                v -= lr * v.grad.sign()
        else:
            opt.step()
        for v in V.values():
            v.clamp_(-VMAX, VMAX)
    if step % 25 == 0 or step == STEPS - 1:
        ch = sum(int((e4m3(U[m] + V[m] * ULP[m]) != e4m3(U[m])).sum()) for m in W)
        print(f"step {step} loss {loss.item():.5f} changed {ch} {time.time()-t0:.0f}s", flush=True)
print("opt", evaluate(lambda m: wq(m, False).detach() if m in W else None), flush=True)
