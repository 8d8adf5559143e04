#!/usr/bin/env python3
"""Prompt-cache perplexity of Gemma-3-270M through a KV codec (ANCHORS.md section A).

Protocol: text = GPL-3 + "\\n\\n" + GFDL-1.3 (Debian's /usr/share/common-licenses),
tokenized by the model's tokenizer (BOS included); prefill the first 1024 tokens in
fp32 with use_cache=True; replace every layer's K and V in the cache by the codec's
reconstruction; feed the next 512 tokens with that cache; perplexity =
exp(mean cross-entropy of continuation tokens 2..512, each predicted from the
previous position), i.e. logits at continuation positions 1..511 score tokens 2..512.
(Token 1 is predicted by the prefill's last position, which no codec touches.)
One prefill is shared by all codecs; each codec works on a deep copy of it.

Codecs:
  none        the fp32 cache as is (baseline)
  bf16        K, V cast to bf16 and back
  py:intB     naive token-wise asymmetric INT-B (per token, per head, over head_dim;
              fp32 scale and zero): a Python reference oracle, B in 1..8
  anything else is a kvpack codec name: the cache goes through
              `kvpack compress` / `inspect --json` / `decompress` via temp files.

Examples:
  python tools/eval_ppl.py                                   # none, bf16, py:int4
  python tools/eval_ppl.py --codec bf16 --codec py:int3 --json
  python tools/eval_ppl.py --codec bdr128 --codec 'hqmq:s96r4+med3' --source-dtype bf16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _model as M  # noqa: E402

DEFAULT_CODECS = ["none", "bf16", "py:int4"]
DEFAULT_KVPACK = M.REPO_ROOT / "target" / "release" / "kvpack"
PY_INT = re.compile(r"^py:int([1-8])$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", action="append", metavar="C",
                   help=f"codec to evaluate, repeatable (default: {' '.join(DEFAULT_CODECS)})")
    p.add_argument("--kvpack", type=Path, default=DEFAULT_KVPACK,
                   help="kvpack binary (default: target/release/kvpack under the repo root)")
    p.add_argument("--extra-args", default="", metavar="ARGS",
                   help="extra arguments appended to `kvpack compress` (one shell-quoted string)")
    p.add_argument("--source-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the safetensors handed to kvpack compress (default fp32)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list of {codec, bits_per_element, ppl, delta_vs_bf16_pct}")
    p.add_argument("--prefix-tokens", type=int, default=1024,
                   help="prefill length (protocol: 1024; change only for quick experiments)")
    p.add_argument("--continuation-tokens", type=int, default=512,
                   help="continuation length (protocol: 512)")
    p.add_argument("--keep-temp", type=Path, default=None, metavar="DIR",
                   help="keep the kvpack temp files for each codec under DIR (for debugging)")
    p.add_argument("--model-dir", type=Path, default=M.DEFAULT_MODEL_DIR,
                   help=f"where the GGUF lives / is assembled (default {M.DEFAULT_MODEL_DIR})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a = p.parse_args(argv)
    a.codec = a.codec or list(DEFAULT_CODECS)
    if len(set(a.codec)) != len(a.codec):
        p.error("a codec is listed twice")
    if a.continuation_tokens < 2:
        p.error("--continuation-tokens must be >= 2")
    return a


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Codecs implemented in Python


def naive_int(x, bits: int):
    """Token-wise asymmetric INT-b over the last axis (head_dim); fp32 scale and zero."""
    import torch

    x32 = x.float()
    levels = float(2**bits - 1)
    lo = x32.amin(dim=-1, keepdim=True)
    hi = x32.amax(dim=-1, keepdim=True)
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant row: exact anyway
    zero = -lo / scale
    q = torch.clamp(torch.round(x32 / scale + zero), 0.0, levels)
    return ((q - zero) * scale).to(x.dtype)


def bf16_roundtrip(x):
    import torch

    return x.to(torch.bfloat16).to(x.dtype)


# ---------------------------------------------------------------------------
# kvpack round trip


class Kvpack:
    def __init__(self, binary: Path, extra_args: str, source_dtype: str, keep_dir: Path | None):
        self.binary = binary
        self.extra = shlex.split(extra_args)
        self.source_dtype = source_dtype
        self.keep_dir = keep_dir

    def check(self) -> None:
        b = self.binary
        if not b.exists():
            raise M.ToolError(
                f"kvpack binary not found at {b}; build it with `cargo build --release` "
                f"in {M.REPO_ROOT} or pass --kvpack PATH")
        if not (b.is_file() and os.access(b, os.X_OK)):
            raise M.ToolError(f"{b} is not an executable file")

    def _run(self, args: list[str]) -> str:
        cmd = [str(self.binary), *args]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise M.ToolError(f"cannot run {shlex.join(cmd)}: {e}") from e
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip()[-2000:]
            raise M.ToolError(f"`{shlex.join(cmd)}` exited with {r.returncode}:\n{tail}")
        return r.stdout

    def roundtrip(self, codec: str, cache, metadata: dict) -> float:
        """Replace cache's K/V by kvpack's reconstruction; return bits/elem from inspect."""
        if self.keep_dir is not None:
            work = self.keep_dir / re.sub(r"[^A-Za-z0-9_.+-]", "_", codec)
            work.mkdir(parents=True, exist_ok=True)
            return self._roundtrip_in(work, codec, cache, metadata)
        with tempfile.TemporaryDirectory(prefix="kvpack-eval-") as d:
            return self._roundtrip_in(Path(d), codec, cache, metadata)

    def _roundtrip_in(self, work: Path, codec: str, cache, metadata: dict) -> float:
        import torch

        src, packed, back = work / "cache.safetensors", work / "cache.kvpack", work / "roundtrip.safetensors"
        dtype = M.torch_dtype(self.source_dtype)
        tensors = {k: t.to(dtype) for k, t in M.cache_tensors(cache).items()}
        M.atomic_save_safetensors(tensors, src, metadata, force=True)
        self._run(["compress", str(src), "--codec", codec, "-o", str(packed), "--force", *self.extra])
        out = self._run(["inspect", str(packed), "--json"])
        try:
            info = json.loads(out)
            bits = float(info["bits_per_element"])
        except (ValueError, KeyError, TypeError) as e:
            raise M.ToolError(f"`kvpack inspect --json` gave no top-level bits_per_element ({e}): {out[:500]!r}") from e
        self._run(["decompress", str(packed), "-o", str(back), "--dtype", "fp32", "--force"])
        rt, _ = M.load_safetensors(back)
        missing = sorted(set(tensors) - set(rt))
        if missing:
            raise M.ToolError(f"decompressed file lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
        for i in range(M.num_cache_layers(cache)):
            k, v = rt[f"past_key_values.{i}.key"], rt[f"past_key_values.{i}.value"]
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise M.ToolError(f"layer {i}: decompressed K/V contain NaN or Inf")
            M.set_kv(cache, i, k.float(), v.float())
        return bits


# ---------------------------------------------------------------------------


def apply_codec(codec: str, cache, head_dim: int, kvpack: Kvpack | None, metadata: dict) -> float:
    """Replace the cache's K and V in place; return bits per element."""
    if codec == "none":
        return 32.0
    if codec == "bf16":
        M.map_kv(cache, bf16_roundtrip)
        return 16.0
    m = PY_INT.match(codec)
    if m:
        bits = int(m.group(1))
        M.map_kv(cache, lambda t: naive_int(t, bits))
        return bits + 64.0 / head_dim  # fp32 scale + fp32 zero per token per head
    if codec.startswith("py:"):
        raise M.ToolError(f"unknown Python codec {codec!r} (known: none, bf16, py:int1..py:int8)")
    assert kvpack is not None
    return kvpack.roundtrip(codec, cache, metadata)


def perplexity(model, cache, continuation: list[int]) -> float:
    import torch
    import torch.nn.functional as F

    logits = M.continue_logits(model, cache, continuation)  # [T, vocab]
    target = torch.tensor(continuation[1:], dtype=torch.long)
    ce = F.cross_entropy(logits[:-1].float(), target, reduction="mean")
    return math.exp(float(ce))


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except M.ToolError as e:
        M.die(str(e))


def run(a) -> int:
    import torch

    py_codecs = {"none", "bf16"}
    needs_kvpack = [c for c in a.codec if c not in py_codecs and not c.startswith("py:")]
    kvpack = None
    if needs_kvpack:  # fail before the slow model load
        kvpack = Kvpack(a.kvpack, a.extra_args, a.source_dtype, a.keep_temp)
        kvpack.check()
    for c in a.codec:
        if c.startswith("py:") and not PY_INT.match(c):
            raise M.ToolError(f"unknown Python codec {c!r} (known: none, bf16, py:int1..py:int8)")

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.time()
    tok, model = M.load_model(a.model_dir, threads=a.threads)
    facts = M.model_facts(model)
    ids = M.tokenize(tok, M.protocol_text())
    n, c = a.prefix_tokens, a.continuation_tokens
    if len(ids) < n + c:
        raise M.ToolError(f"protocol text has {len(ids)} tokens, need {n + c}")
    prefix, continuation = ids[:n], ids[n : n + c]
    log(f"model loaded in {time.time() - t0:.1f}s (torch threads {torch.get_num_threads()}); "
        f"text {len(ids)} tokens; prefix {n}, continuation {c}")

    t1 = time.time()
    base = M.prefill(model, prefix)
    counts = [int(M.get_kv(base, i)[0].shape[2]) for i in range(M.num_cache_layers(base))]
    log(f"prefill {time.time() - t1:.1f}s; cache tokens per layer {counts}")
    metadata = M.kv_metadata(model, prefix, f"{M.GPL3} + \\n\\n + {M.GFDL13}")

    codecs = list(a.codec)
    if "bf16" not in codecs:
        codecs.append("bf16")  # reference for delta_vs_bf16_pct, not reported as a row
    results = {}
    for codec in codecs:
        t = time.time()
        cache = M.clone_cache(base)
        bits = apply_codec(codec, cache, facts["head_dim"], kvpack, metadata)
        ppl = perplexity(model, cache, continuation)
        results[codec] = (bits, ppl)
        log(f"{codec}: bits/elem {bits:.4f}  ppl {ppl:.4f}  ({time.time() - t:.1f}s)")

    ref = results["bf16"][1]
    rows = [
        {"codec": codec, "bits_per_element": results[codec][0], "ppl": results[codec][1],
         "delta_vs_bf16_pct": (results[codec][1] / ref - 1.0) * 100.0}
        for codec in a.codec
    ]
    log(f"total {time.time() - t0:.1f}s")
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        w = max(len("codec"), *(len(r["codec"]) for r in rows))
        print(f"{'codec':<{w}}  {'bits/elem':>9}  {'perplexity':>10}  {'vs bf16':>8}")
        for r in rows:
            print(f"{r['codec']:<{w}}  {r['bits_per_element']:>9.3f}  {r['ppl']:>10.3f}  "
                  f"{r['delta_vs_bf16_pct']:>+7.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
