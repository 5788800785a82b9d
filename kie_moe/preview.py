"""`kie preview`: the dense Laneformer-2B preview reproduction (DESIGN.md §1, §5).

Builds the laneformer-2b preset (dense/preset.py: published shape, assumed widths, 2.30B parameters) with random
FP16 weights directly in GPU memory, decodes batch 1 greedily and reports tok/s and % of the read roofline beside
the published number: 2,100 tok/s per request on 8x H200 in FP16.

Roofline for N devices: with the weights split N ways (lanes / tensor parallel), each device reads bytes/N per
token at its own bandwidth, so the ideal is bandwidth / (bytes / N) = N x bandwidth / bytes tok/s. Communication
is assumed hidden (what DTP is for), so this is an upper bound.

--devices N (kie_moe/launch.py + ranks.py): N worker processes, each holding L/N of the lanes, decode in lockstep;
rank 0 measures the read probe (one device's), times the generations and reports. On GPUs the monokernel runs its
tensor-parallel plan (kernels/monokernel/shard.TpRank) where that plan takes the Laneformer (DTP); where it refuses
(NotImplementedError), or on CPU processes (--device cpu --tiny: no symmetric memory there), the run is the DTP
reference in torch (dense/simulate.RankDecoder), the lanes' partials exchanged through KCCL (GpuHeap on GPUs, a
HostHeap in /dev/shm between CPU processes), labelled as the fallback it is. More devices than are visible: one
line, exit 2, nothing run.

Honesty rules: a backend that cannot run the laneformer family here (the graph backend; the monokernel off the GPU
or without a plan for N devices) is replaced by the reference backend on the same devices, and every output line
says so. The monokernel runs the Laneformer itself on one GPU (kernels/monokernel/lanes.py), in FP16.
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


def rank_backend(name: str, model, group, dtype: torch.dtype):
    """--devices N: -> (this rank's backend, label). The requested backend's multi-device path, or the reference
    ranks (DTP lanes over KCCL) when it has none for the laneformer family here. Every rank decides alike: the
    requested path fails before any collective (no CUDA, no DTP plan, no multi-device graph path)."""
    from kie_moe import ranks
    try:
        be = ranks.rank_backend(model, group, name, dtype=dtype)
        return be, be.name
    except (KieError, NotImplementedError) as e:
        reason = f"{type(e).__name__}: {e}".splitlines()[0].split(";")[0][:200]
    be = ranks.rank_backend(model, group, "reference", dtype=dtype)
    return be, f"{be.name} (fallback: {name} backend on {group.world} devices failed: {reason})"


def _dtype(dev: torch.device) -> torch.dtype:
    return torch.float16 if dev.type == "cuda" else torch.float32   # CPU (smoke test): the reference's fp32


def check(device: torch.device | str | None, tiny: bool, backend: str):
    kind = device.type if isinstance(device, torch.device) else ("cpu" if device == "cpu" else "cuda")
    if kind != "cuda" and not tiny:
        raise InputError("kie preview needs a CUDA GPU (laneformer-2b is 4.6 GB of FP16 weights); "
                         "--tiny --device cpu runs the tiny variant as a smoke test, not the preview")
    if backend not in ("monokernel", "graph", "reference"):
        raise InputError(f"--backend must be monokernel, graph or reference, got {backend!r}")


def run(*, devices: int = 1, backend: str = "monokernel", device: str | None = None, tiny: bool = False,
        prompt_len: int = 32, new_tokens: int = 128, runs: int = 3, probe_bytes: int | None = None,
        argv: list[str] | None = None, prepared: tuple | None = None) -> dict:
    """`prepared`: (Source, backend, label) already built (rank 0 of --devices N); else one device, built here."""
    from kie_moe.engine import resolve_device
    dev = resolve_device(device)
    check(dev, tiny, backend)
    if devices != 1 and prepared is None:
        raise InputError(f"--devices {devices}: run through `kie preview --devices N` (kie_moe/launch.py)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = _dtype(dev)
    res = {"schema": SCHEMA, "env": R.environment(dev, argv), "read_probe": R.read_probe(dev, probe_bytes),
           "published": PUBLISHED}
    if prepared is None:
        src = open_model(PRESET, dev, tiny=tiny, dtype=dtype)
        be, label = make_backend(backend, src.model, dev, dtype)
    else:
        src, be, label = prepared
    devices = getattr(be, "world", 1)
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
             f"  backend       {r['backend_label']}"]
    if n > 1:
        lines.append(f"  parallel      {r['parallel']}")
    lines += [f"  measured      {r['tok_per_s']:.1f} tok/s  ({r['ms_per_token']:.3f} ms/token, {r['runs']} runs, "
              f"spread {r['spread_pct']:.1f}%; TTFT {r['ttft_s'] * 1e3:.1f} ms)",
              f"  bytes/token   {R.fmt_bytes(r['bytes_per_token'])}  (weights {R.fmt_bytes(r['bytes']['weights'])} "
              f"+ KV {R.fmt_bytes(r['bytes']['kv'])} at context "
              f"{r['prompt_len']}..{r['prompt_len'] + r['new_tokens'] - 1})",
              f"  achieved      {R.fmt_gbps(r['achieved_gbps'])} = {r['pct_roofline']:.1f}% of "
              + (f"{n} x " if n > 1 else "") + f"the read ceiling "
              f"{R.fmt_gbps(rf['bandwidth_gbps'])}",
              f"  roofline      {n} device{'s' if n > 1 else ''}: {ideal[str(n)]:.0f} tok/s ideal "
              f"({rf['measured_pct_of_ideal']:.1f}% reached);  8 devices: {ideal['8']:.0f} tok/s "
              f"({rf['formula']})",
              f"  published     {PUBLISHED['tok_per_s']:,.0f} tok/s on 8x H200 (FP16)"
              + ("" if res["tiny"] else f" = {rf['published_pct_of_ideal_8']:.1f}% of that 8-device ideal"),
              f"  note          {rf['note']}"]
    if r.get("backend_note"):
        lines.append(f"  note          {r['backend_note']}")
    return "\n".join(lines)


@B.user_errors
def cmd_preview(a) -> int:
    """One device: here. --devices N: N workers (kie_moe/launch.py, ranks.py), rank 0 measures and reports."""
    from kie_moe import ranks
    check(a.device, a.tiny, a.backend)            # before any worker starts

    def prepare(group):
        dtype = _dtype(group.device)
        src = open_model(PRESET, group.device, tiny=a.tiny, dtype=dtype)
        be, label = rank_backend(a.backend, src.model, group, dtype)
        return (src, label), be

    return ranks.launch_ranks(a, lambda: _preview(a), prepare,
                              lambda ctx, be: _preview(a, (ctx[0], be, ctx[1])), check=False)


@B.user_errors
def _preview(a, prepared: tuple | None = None) -> int:
    res = run(devices=a.devices, backend=a.backend, device=a.device, tiny=a.tiny, prompt_len=a.prompt_len,
              new_tokens=a.new_tokens, runs=a.runs, probe_bytes=a.probe_mb << 20 if a.probe_mb else None,
              argv=getattr(a, "argv", None), prepared=prepared)
    if a.out:
        B.write_json(res, a.out)
    print(json.dumps(res) if a.json else report(res))
    if res["row"]["backend_label"] != res["row"]["backend"]:
        print(f"kie preview: the {a.backend} backend could not run laneformer-2b here; the number above is the "
              f"{res['row']['backend']} backend's ({res['row']['backend_label']})", file=sys.stderr)
    return 0
