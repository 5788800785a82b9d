"""`kie preview`: the dense Laneformer-2B preview reproduction (DESIGN.md §1, §5).

Builds the laneformer-2b preset (dense/preset.py: published shape, assumed widths, 2.30B parameters) with random
FP16 weights directly in GPU memory, decodes batch 1 greedily and reports tok/s and % of the read roofline beside
the published number: 2,100 tok/s per request on 8x H200 in FP16.

Roofline for N devices: with the weights split N ways (lanes / tensor parallel), each device reads bytes/N per
token at its own bandwidth, so the ideal is bandwidth / (bytes / N) = N x bandwidth / bytes tok/s. Communication
is assumed hidden (what DTP is for), so this is an upper bound.

Honesty rules: multi-device decoding (KCCL) is not implemented yet, so --devices > 1 stops with exit 2 instead of
extrapolating; a backend that cannot run the laneformer family (the graph backend; the monokernel off the GPU) is
replaced by the reference backend on the same device, and every output line says so. The monokernel runs the
Laneformer itself (kernels/monokernel/lanes.py), in FP16.
"""
from __future__ import annotations

import json
import sys

import torch

from kie_moe.models.errors import InputError, KieError

from . import bench as B
from . import roofline as R
from .synthetic import open_model

PRESET = "laneformer-2b"
PUBLISHED = {"tok_per_s": 2100.0, "devices": 8, "device": "H200", "dtype": "fp16",
             "source": "Kog Laneformer-2B preview: 2,100 tok/s per request on 8x H200 in FP16 (DESIGN.md §1)"}
SCHEMA = "kie-preview/1"


def check_devices(n: int, dev: torch.device):
    if n < 1:
        raise InputError(f"--devices must be at least 1, got {n}")
    if n == 1:
        return
    have = torch.cuda.device_count() if dev.type == "cuda" else 0
    if have < n:
        raise InputError(f"--devices {n}: this machine has {have} GPU{'s' if have != 1 else ''}; multi-GPU "
                         f"decoding (KCCL) is a later issue, so nothing was run (use --devices 1)")
    raise InputError(f"--devices {n}: {have} GPUs are present, but multi-GPU decoding (KCCL) is a later issue; "
                     f"nothing was run (use --devices 1)")


def make_backend(name: str, model, dev: torch.device, dtype: torch.dtype):
    """-> (backend, label). The requested backend, or the reference backend on the same device when the requested
    one does not take the laneformer family yet (the reason goes into the label). The monokernel streams the
    weights in `dtype` (FP16: its float arena and KV cache in the preview's dtype, not its bf16 default)."""
    try:
        if name == "monokernel":
            if dev.type != "cuda":   # (TRITON_INTERPRET would run it, at seconds per token: not a preview)
                raise InputError("the monokernel needs a CUDA GPU")
            from kie_moe.kernels.monokernel.runtime import MonokernelBackend
            return MonokernelBackend(model, dev, wdtype=dtype), name
        return B.build_backend(name, model, dev), name
    except (KieError, NotImplementedError, KeyError, ValueError, RuntimeError) as e:
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    from kie_moe.engine import ReferenceBackend
    return ReferenceBackend(model, dev, dtype), f"reference (fallback: {name} backend failed: {reason})"


def run(*, devices: int = 1, backend: str = "monokernel", device: str | None = None, tiny: bool = False,
        prompt_len: int = 32, new_tokens: int = 128, runs: int = 3, probe_bytes: int | None = None,
        argv: list[str] | None = None) -> dict:
    from kie_moe.engine import resolve_device
    dev = resolve_device(device)
    check_devices(devices, dev)
    if dev.type != "cuda" and not tiny:
        raise InputError("kie preview needs a CUDA GPU (laneformer-2b is 4.6 GB of FP16 weights); "
                         "--tiny --device cpu runs the tiny variant as a smoke test, not the preview")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if backend not in ("monokernel", "graph", "reference"):
        raise InputError(f"--backend must be monokernel, graph or reference, got {backend!r}")
    dtype = torch.float16 if dev.type == "cuda" else torch.float32   # CPU (smoke test): the reference's fp32
    res = {"schema": SCHEMA, "env": R.environment(dev, argv), "read_probe": R.read_probe(dev, probe_bytes),
           "published": PUBLISHED}
    src = open_model(PRESET, dev, tiny=tiny, dtype=dtype)
    be, label = make_backend(backend, src.model, dev, dtype)
    row = B.bench_row(src, be.name, dev, res["read_probe"], prompt_len=prompt_len, new_tokens=new_tokens,
                      runs=runs, be=be)
    del be
    row["backend_label"] = label
    row["weight_dtype"] = str(dtype).replace("torch.", "")
    bw = res["read_probe"]["gbps"] * 1e9
    nbytes = row["bytes_per_token"]
    res["row"] = row
    res["devices"] = devices
    res["tiny"] = tiny
    res["roofline"] = {
        "formula": "N devices each read bytes/N per token: ideal tok/s = bandwidth / (bytes / N)",
        "bytes_per_token": nbytes, "bandwidth_gbps": res["read_probe"]["gbps"],
        "ideal_tok_per_s": {str(n): bw / (nbytes / n) for n in sorted({1, devices, PUBLISHED["devices"]})},
        "measured_pct_of_ideal": 100 * row["tok_per_s"] / (bw / (nbytes / devices)),
        "published_pct_of_ideal_8": 100 * PUBLISHED["tok_per_s"] / (bw / (nbytes / PUBLISHED["devices"])),
        "note": ("the 8-device ideal uses this device's measured bandwidth; the published run's own ceiling is "
                 "not known") if not tiny else "tiny variant: not comparable with the published number",
    }
    return res


def report(res: dict) -> str:
    r, rf, env = res["row"], res["roofline"], res["env"]
    ideal = rf["ideal_tok_per_s"]
    n = res["devices"]
    lines = [f"Laneformer-2B preview ({r['model']}, {r['weight_dtype']}, batch 1) on {n}x {env.get('device')}"
             + (f", driver {env['driver']}" if env.get("driver") else "")
             + f", torch {env.get('torch')}, triton {env.get('triton')}",
             f"  backend       {r['backend_label']}",
             f"  measured      {r['tok_per_s']:.1f} tok/s  ({r['ms_per_token']:.3f} ms/token, {r['runs']} runs, "
             f"spread {r['spread_pct']:.1f}%; TTFT {r['ttft_s'] * 1e3:.1f} ms)",
             f"  bytes/token   {R.fmt_bytes(r['bytes_per_token'])}  (weights {R.fmt_bytes(r['bytes']['weights'])} "
             f"+ KV {R.fmt_bytes(r['bytes']['kv'])} at context "
             f"{r['prompt_len']}..{r['prompt_len'] + r['new_tokens'] - 1})",
             f"  achieved      {R.fmt_gbps(r['achieved_gbps'])} = {r['pct_roofline']:.1f}% of the read ceiling "
             f"{R.fmt_gbps(rf['bandwidth_gbps'])}",
             f"  roofline      {n} device{'s' if n > 1 else ''}: {ideal[str(n)]:.0f} tok/s ideal "
             f"({rf['measured_pct_of_ideal']:.1f}% reached);  8 devices: {ideal['8']:.0f} tok/s "
             f"({rf['formula']})",
             f"  published     {PUBLISHED['tok_per_s']:,.0f} tok/s on 8x H200 (FP16)"
             + ("" if res["tiny"] else f" = {rf['published_pct_of_ideal_8']:.1f}% of that 8-device ideal"),
             f"  note          {rf['note']}"]
    return "\n".join(lines)


@B.user_errors
def cmd_preview(a) -> int:
    res = run(devices=a.devices, backend=a.backend, device=a.device, tiny=a.tiny, prompt_len=a.prompt_len,
              new_tokens=a.new_tokens, runs=a.runs, probe_bytes=a.probe_mb << 20 if a.probe_mb else None,
              argv=getattr(a, "argv", None))
    if a.out:
        B.write_json(res, a.out)
    print(json.dumps(res) if a.json else report(res))
    if res["row"]["backend_label"] != res["row"]["backend"]:
        print(f"kie preview: the {a.backend} backend could not run laneformer-2b here; the number above is the "
              f"reference backend's ({res['row']['backend_label']})", file=sys.stderr)
    return 0
