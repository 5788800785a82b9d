"""Write the demo model's GPTQ calibration text (kie_moe/assets/demo-moe/calib.txt): `kie convert --gptq` reads a
checkpoint's calib.txt when no --calib FILE is given.

What: the head (up to HEAD_BYTES, cut at a line end) of each standard-library file of the demo model's TRAIN split
(scripts/train_demo_model.py: sha1(relative path) % 50 != 0, the same skips), in sha1(path) order, each under a
`# file: PATH` line like heldout.txt, until BUDGET_BYTES. Heads of many files rather than a few whole ones: GPTQ's
Hessians want the kinds of text the model sees (imports, docstrings, classes, tests), not one module's depth.
No file of heldout.txt is used (checked by name), so `kie sweep`'s quality numbers are never scored on
calibration text. Stdlib of the interpreter running this (3.11 here; the model trained on 3.12's: most files
are the same modules).

    python scripts/make_calib_text.py [OUT]
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

HEAD_BYTES = 3000
BUDGET_BYTES = 96_000
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "kie_moe", "assets", "demo-moe", "calib.txt")


def main() -> None:
    spec = importlib.util.spec_from_file_location("train_demo_model", os.path.join(HERE, "train_demo_model.py"))
    tdm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tdm)
    train, held, root = tdm.stdlib_files(None)
    with open(os.path.join(HERE, "..", "kie_moe", "assets", "demo-moe", "heldout.txt"), encoding="utf-8") as f:
        scored = {line[len("# file: "):].strip() for line in f if line.startswith("# file: ")}
    parts, n = [], 0
    for rel, text in sorted(train, key=lambda rt: hashlib.sha1(rt[0].encode()).hexdigest()):
        if rel in scored or n >= BUDGET_BYTES:
            continue
        head = text[:HEAD_BYTES]
        head = head[: head.rfind("\n") + 1] if "\n" in head else head
        if len(head) < 200:          # near-empty __init__.py files add headers, not text
            continue
        parts.append(f"# file: {rel}\n{head}")
        n += len(parts[-1])
    out = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT
    with open(out, "w", encoding="utf-8") as f:
        f.write("".join(parts))
    print(f"{out}: {len(parts)} files, {n} characters, from {root}")


if __name__ == "__main__":
    main()
