#!/usr/bin/env python3
"""Planner study: what a change of the `--bits` planner's decisions would do to perplexity.

The perplexity protocol of eval_ppl.py costs a model load per run; a planner study needs many
plans. This tool exports the protocol's bf16 cache once, decodes every codec of interest applied
to every tensor once, and then builds plans from the planner's own measured operating points
(`KVPACK_PLAN_POINTS`, see src/budget/study.rs) with one decision changed, each tensor taking
its chosen codec's reconstruction. `eval` scores many such plans after one model load: perplexity
as eval_ppl.py (bf16 source) and the KL divergence of the next-token distributions from the bf16
cache's, mean over the scored positions.

  export  DIR --model M --text T [--codecs A,B,..]
                                       prefill, write DIR/cache.safetensors (bf16) and the
                                       planner's points DIR/points.json
  decode  DIR CODEC...                 per codec (no windows): DIR/rec/*.safetensors (fp32) and
                                       the tensors' bytes in DIR/decoded.json
  plan    DIR --bits B [--value-weight W] [--codecs A,B,..] [--drop A,B,..] -o MIX.json
                                       the planner's allocation (convex-hull greedy) on
                                       DIR/points.json, value distortions times W
  eval    DIR --model M --text T NAME=FILE...
                                       FILE: a decoded .safetensors or a MIX.json; prints one JSON
                                       line per variant (ppl, delta vs bf16 %, KL)

Texts: `protocol` (GPL-3 + GFDL-1.3, eval_ppl.py's) and `apache` (Apache-2.0 + "\\n\\n" +
MPL-2.0), both prefill 1024 tokens and score the next 512.

Example (Gemma, values' distortion x1/6 at 3.25 bits):
  python tools/plan_study.py export /tmp/g --model gemma3-270m --text protocol
  python tools/plan_study.py decode /tmp/g hqmq:s6r2 hqmq:s12r2 ... raw
  python tools/plan_study.py plan /tmp/g --bits 3.25 --value-weight 0.1667 -o /tmp/g/v6.json
  python tools/plan_study.py eval /tmp/g --model gemma3-270m --text protocol plain=/tmp/g/p.json v6=/tmp/g/v6.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _model as M  # noqa: E402

TEXTS = {
    "protocol": M.protocol_text,
    "apache": lambda: M.read_text(M.LICENSES / "Apache-2.0") + "\n\n" + M.read_text(M.LICENSES / "MPL-2.0"),
}
PREFIX, CONTINUATION = 1024, 512


def safe_name(codec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", codec)


def load_prefilled(model_key: str, text: str, threads: int):
    import torch

    torch.manual_seed(0)
    tok, model = M.load_model(M.DEFAULT_MODEL_DIR, threads=threads, model=model_key)
    ids = M.tokenize(tok, TEXTS[text]())
    if len(ids) < PREFIX + CONTINUATION:
        raise M.ToolError(f"text {text} has {len(ids)} tokens, need {PREFIX + CONTINUATION}")
    return model, M.prefill(model, ids[:PREFIX]), ids[:PREFIX], ids[PREFIX:PREFIX + CONTINUATION]


def run_kvpack(kvpack: str, *args: str, env: dict | None = None) -> bytes:
    return subprocess.run([kvpack, *args], check=True, capture_output=True,
                          env=None if env is None else {**os.environ, **env}).stdout


def cmd_export(a) -> None:
    import torch

    model, cache, prefix, _ = load_prefilled(a.model, a.text, a.threads)
    meta = M.kv_metadata(model, prefix, a.text, model_id=M.model_spec(a.model).model_id)
    tensors = {k: v.to(torch.bfloat16) for k, v in M.cache_tensors(cache).items()}
    src = a.dir / "cache.safetensors"
    M.atomic_save_safetensors(tensors, src, meta, force=a.force)
    # The planner's points (its candidates, or --codecs); --bits only has to be feasible.
    env = {"KVPACK_PLAN_POINTS": str(a.dir / "points.json")}
    if a.codecs:
        env["KVPACK_PLAN_CODECS"] = a.codecs
    run_kvpack(a.kvpack, "compress", str(src), "--bits", "12", "-o", os.devnull, "-f", "-q", env=env)


def cmd_decode(a) -> None:
    out = a.dir / "rec"
    out.mkdir(exist_ok=True)
    index_path = a.dir / "decoded.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    src = a.dir / "cache.safetensors"
    for c in a.codecs:
        kp, st = out / f"{safe_name(c)}.kvpack", out / f"{safe_name(c)}.safetensors"
        run_kvpack(a.kvpack, "compress", str(src), "--codec", c, "--sink", "0", "--recent", "0",
                   "-o", str(kp), "-f", "-q")
        run_kvpack(a.kvpack, "decompress", str(kp), "--dtype", "fp32", "-o", str(st), "-f", "-q")
        info = json.loads(run_kvpack(a.kvpack, "inspect", "--json", str(kp)))
        index[c] = {"path": str(st), "bits_per_element": info["bits_per_element"],
                    "tensors": {t["name"]: t["bytes"] for t in info["tensors"]}}
        print(f"{c}: {info['bits_per_element']:.4f} bits/element", file=sys.stderr)
    index_path.write_text(json.dumps(index, indent=1))


def hull(pts: list[tuple[float, float]]) -> list[int]:
    """Lower convex hull of (bytes, distortion) points, as src/budget/allocate.rs."""
    order = sorted(range(len(pts)), key=lambda i: (pts[i][0], pts[i][1], i))
    h: list[int] = []
    for i in order:
        b, d = pts[i]
        if h and d >= pts[h[-1]][1]:
            continue
        while len(h) >= 2:
            (b0, d0), (b1, d1) = pts[h[-2]], pts[h[-1]]
            if (d1 - d0) * (b - b0) >= (d - d0) * (b1 - b0):
                h.pop()
            else:
                break
        h.append(i)
    return h


def allocate(options: list[list[tuple[float, float]]], budget: float) -> list[int]:
    """One point per tensor minimising summed distortion within `budget` bytes (allocate.rs)."""
    hulls = [hull(o) for o in options]
    at = [0] * len(hulls)
    total = sum(o[h[0]][0] for o, h in zip(options, hulls))
    if total > budget:
        raise M.ToolError(f"the smallest plan needs {total:.0f} bytes, the budget is {budget:.0f}")
    stuck = [False] * len(hulls)
    while True:
        best = None
        for t, h in enumerate(hulls):
            if stuck[t] or at[t] + 1 >= len(h):
                continue
            (b0, d0), (b1, d1) = options[t][h[at[t]]], options[t][h[at[t] + 1]]
            gain = (d0 - d1) / max(b1 - b0, 1e-9)
            if best is None or gain > best[0]:
                best = (gain, t)
        if best is None:
            break
        t = best[1]
        (b0, _), (b1, _) = options[t][hulls[t][at[t]]], options[t][hulls[t][at[t] + 1]]
        if total - b0 + b1 <= budget:
            total += b1 - b0
            at[t] += 1
        else:
            stuck[t] = True
    return [h[i] for i, h in zip(at, hulls)]


def source_elements(path: Path) -> int:
    """Elements of every tensor of a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def cmd_plan(a) -> None:
    points = json.loads((a.dir / "points.json").read_text())
    decoded = json.loads((a.dir / "decoded.json").read_text())
    keep = None if a.codecs is None else set(a.codecs.split(","))
    drop = set() if a.drop is None else set(a.drop.split(","))
    elements = source_elements(a.dir / "cache.safetensors")
    fixed = 8 * 1024  # header with its codec table, index frame and trailer, generously
    options, chosen_from = [], []
    for t in points:
        pts = [p for p in t["points"]
               if (keep is None or p["codec"] in keep) and p["codec"] not in drop
               and (p["codec"] in decoded or p["codec"] == "raw")]
        if not pts:
            raise M.ToolError(f"{t['name']}: no decoded candidate left")
        w = a.value_weight if t["kind"] == "value" else 1.0
        options.append([(p["bytes"], w * p["distortion"]) for p in pts])
        chosen_from.append(pts)
    choice = allocate(options, a.bits * elements / 8 - fixed)
    mix, total = {}, fixed
    for t, i, pts in zip(points, choice, chosen_from):
        p = pts[i]
        total += p["bytes"]
        path = str(a.dir / "cache.safetensors") if p["codec"] == "raw" else decoded[p["codec"]]["path"]
        mix[t["name"]] = {"path": path, "sink": p["sink"], "codec": p["codec"]}
    a.output.write_text(json.dumps(mix, indent=1))
    print(f"{a.output}: about {8 * total / elements:.3f} bits/element", file=sys.stderr)


def cmd_eval(a) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors import safe_open

    model, base, _, cont = load_prefilled(a.model, a.text, a.threads)
    target = torch.tensor(cont[1:], dtype=torch.long)

    def logprobs(cache):
        return F.log_softmax(M.continue_logits(model, cache, cont)[:-1].float(), -1)

    ref_cache = M.clone_cache(base)
    M.map_kv(ref_cache, lambda x: x.to(torch.bfloat16).to(x.dtype))
    ref = logprobs(ref_cache)
    ref_ppl = math.exp(float(F.nll_loss(ref, target)))
    print(json.dumps({"variant": "bf16", "ppl": ref_ppl}), flush=True)

    def tensor(path: str, name: str):
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name).float()

    for v in a.variants:
        name, spec = v.split("=", 1)
        if spec.endswith(".json"):
            mix = json.loads(Path(spec).read_text())
        else:
            with safe_open(spec, framework="pt") as f:
                mix = {k: {"path": spec, "sink": 0} for k in f.keys()}
        cache = M.clone_cache(base)
        for i in range(M.num_cache_layers(cache)):
            kv = []
            for src, tname in zip(M.get_kv(cache, i), (f"past_key_values.{i}.key", f"past_key_values.{i}.value")):
                exact = src.to(torch.bfloat16).float()
                e = mix.get(tname)
                if e is None:
                    kv.append(exact)
                    continue
                x = tensor(e["path"], tname)
                x[:, :, : e["sink"]] = exact[:, :, : e["sink"]]
                kv.append(x)
            M.set_kv(cache, i, *kv)
        lp = logprobs(cache)
        ppl = math.exp(float(F.nll_loss(lp, target)))
        kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
        print(json.dumps({"variant": name, "ppl": ppl, "delta_vs_bf16_pct": (ppl / ref_ppl - 1) * 100,
                          "kl": kl}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvpack", default=str(M.REPO_ROOT / "target" / "release" / "kvpack"),
                   help="the kvpack binary (default: target/release/kvpack)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("export", "eval"):
        s = sub.add_parser(name)
        s.add_argument("dir", type=Path)
        s.add_argument("--model", choices=sorted(M.MODELS), default=M.DEFAULT_MODEL)
        s.add_argument("--text", choices=sorted(TEXTS), default="protocol")
        if name == "export":
            s.add_argument("--force", action="store_true", help="overwrite DIR/cache.safetensors")
            s.add_argument("--codecs", default=None,
                           help="candidates to measure instead of the planner's (comma-separated)")
        else:
            s.add_argument("variants", nargs="+", metavar="NAME=FILE")
    s = sub.add_parser("decode")
    s.add_argument("dir", type=Path)
    s.add_argument("codecs", nargs="+")
    s = sub.add_parser("plan")
    s.add_argument("dir", type=Path)
    s.add_argument("--bits", type=float, required=True)
    s.add_argument("--value-weight", type=float, default=1.0, help="factor on values' distortion")
    s.add_argument("--codecs", default=None, help="only these candidates (comma-separated)")
    s.add_argument("--drop", default=None, help="leave these candidates out (comma-separated)")
    s.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        {"export": cmd_export, "decode": cmd_decode, "plan": cmd_plan, "eval": cmd_eval}[a.cmd](a)
    except (M.ToolError, subprocess.CalledProcessError) as e:
        M.die(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
