#!/usr/bin/env python3
"""Prompt-cache perplexity of a small model through a KV codec (Gemma-3-270M by default).

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
  plan:B      kvpack's planner at B bits/element, everything counted
              (kvpack.compress(..., bits=B): codec, parameters and sink window
              chosen per layer and K/V)
  anything else is a kvpack codec name: the cache goes through the kvpack Python
              package (kvpack.compress, kvpack.open, decode to fp32) in memory.

Examples:
  python tools/eval_ppl.py                                   # none, bf16, py:int4
  python tools/eval_ppl.py --codec bf16 --codec py:int3 --json
  python tools/eval_ppl.py --codec bdr128 --codec 'hqmq:s96r4+med3' --source-dtype bf16
  python tools/eval_ppl.py --model smollm2-135m --codec bf16 --codec bdr64
  python tools/eval_ppl.py --codec plan:3.25 --codec hqmq:s24r3 --json --plot ppl.png
  python tools/eval_ppl.py --plot ppl.png --from-json a.json --from-json b.json   # no model run

--plot FILE (matplotlib) draws bits/element against perplexity: plan:B rows as the
planner's line, every other codec as a labelled point, the bf16 perplexity as a
dashed line; with --from-json it draws earlier --json outputs without running the model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _model as M  # noqa: E402

DEFAULT_CODECS = ["none", "bf16", "py:int4"]
PY_INT = re.compile(r"^py:int([1-8])$")
PLAN = re.compile(r"^plan:([0-9]+(?:\.[0-9]+)?)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", action="append", metavar="C",
                   help=f"codec to evaluate, repeatable (default: {' '.join(DEFAULT_CODECS)})")
    p.add_argument("--model", choices=sorted(M.MODELS), default=M.DEFAULT_MODEL,
                   help=f"model (default {M.DEFAULT_MODEL}; see tools/README.md)")
    p.add_argument("--source-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the K/V handed to kvpack.compress (default fp32)")
    p.add_argument("--page-tokens", type=int, default=None, help="kvpack.compress page_tokens")
    p.add_argument("--sink", type=int, default=None, help="kvpack.compress sink (tokens kept exact at the start)")
    p.add_argument("--recent", type=int, default=None, help="kvpack.compress recent (tokens kept exact at the end)")
    p.add_argument("--zstd-level", type=int, default=None, help="kvpack.compress zstd_level")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list of {codec, bits_per_element, ppl, delta_vs_bf16_pct}")
    p.add_argument("--prefix-tokens", type=int, default=1024,
                   help="prefill length (protocol: 1024; change only for quick experiments)")
    p.add_argument("--continuation-tokens", type=int, default=512,
                   help="continuation length (protocol: 512)")
    p.add_argument("--keep-temp", type=Path, default=None, metavar="DIR",
                   help="also write each codec's .kvpack file under DIR (for `kvpack inspect`)")
    p.add_argument("--model-dir", type=Path, default=M.DEFAULT_MODEL_DIR,
                   help=f"where the GGUF lives / is assembled (default {M.DEFAULT_MODEL_DIR})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE",
                   help="draw bits/element against perplexity into FILE (.png/.svg/.pdf, matplotlib)")
    p.add_argument("--from-json", type=Path, action="append", default=[], metavar="JSON",
                   help="with --plot: rows from earlier --json outputs (repeatable); without --codec "
                        "the model is not run")
    p.add_argument("--title", default=None, help="--plot title (default: the model)")
    a = p.parse_args(argv)
    if a.from_json and a.plot is None:
        p.error("--from-json needs --plot")
    if a.plot is not None and a.plot.suffix == "":
        p.error("--plot needs a file extension (.png, .svg, .pdf)")
    a.plot_only = bool(a.from_json) and not a.codec
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
# kvpack round trip (Python API: kvpack.compress / kvpack.open / decode)


class Kvpack:
    """Round trip of the whole cache through one kvpack codec, in memory or via --keep-temp files."""

    def __init__(self, source_dtype: str, options: dict, keep_dir: Path | None):
        self.source_dtype = source_dtype
        self.options = options  # page_tokens / sink / recent / zstd_level given on the command line
        self.keep_dir = keep_dir

    @staticmethod
    def check():
        """Import the kvpack package or fail with one line (before the slow model load)."""
        try:
            import kvpack
        except ImportError as e:
            raise M.ToolError(
                f"the kvpack Python package is not importable ({e}); build it with "
                f"`maturin develop --release` (or `pip install .`) in {M.REPO_ROOT}") from e
        return kvpack

    def roundtrip(self, codec: str, cache, metadata: dict) -> float:
        """Replace cache's K/V by kvpack's reconstruction; return bits/elem of the compressed file."""
        import torch

        kvpack = self.check()
        meta = dict(metadata)
        model_id = meta.pop("kvpack.model", None)
        token_ids = json.loads(meta.pop("kvpack.token_ids", "[]"))
        dtype = M.torch_dtype(self.source_dtype)
        n = M.num_cache_layers(cache)
        layers = []
        for i in range(n):
            k, v = M.get_kv(cache, i)
            layers.append((k.to(dtype).contiguous(), v.to(dtype).contiguous()))
        path = None
        if self.keep_dir is not None:
            self.keep_dir.mkdir(parents=True, exist_ok=True)
            path = self.keep_dir / (re.sub(r"[^A-Za-z0-9_.+-]", "_", codec) + ".kvpack")
        plan = PLAN.match(codec)
        how = {"bits": float(plan.group(1))} if plan else {"codec": codec}
        try:
            res = kvpack.compress(layers, path=None if path is None else str(path), force=True,
                                  model=model_id, token_ids=token_ids, metadata=meta, **how, **self.options)
            archive = kvpack.open(str(path) if path is not None else res.data)
            decoded = archive.decode(dtype="fp32", output="torch")
        except kvpack.KvpackError as e:
            raise M.ToolError(f"kvpack codec {codec!r}: {type(e).__name__}: {e}") from e
        for i in range(n):
            k, v = decoded[(i, "K")], decoded[(i, "V")]
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise M.ToolError(f"layer {i}: decompressed K/V contain NaN or Inf")
            M.set_kv(cache, i, k, v)
        return float(res.bits_per_element)


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


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Bits/element against perplexity: the planner (plan:B rows) as a line, other codecs as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next((r["ppl"] for r in rows if r["codec"] == "bf16"), None)
    if ref is None and rows:  # delta = ppl / bf16 - 1
        r = rows[0]
        ref = r["ppl"] / (1.0 + r["delta_vs_bf16_pct"] / 100.0)
    lossy = [r for r in rows if r["codec"] not in ("none", "bf16") and r["bits_per_element"] < 9]
    plan = sorted((r for r in lossy if PLAN.match(r["codec"])), key=lambda r: r["bits_per_element"])
    fixed = [r for r in lossy if not PLAN.match(r["codec"])]
    fig, ax = plt.subplots(figsize=(9.6, 6.4), dpi=100)
    fams = sorted({r["codec"].split(":")[0].rstrip("0123456789") for r in fixed})
    cmap = plt.get_cmap("tab10")
    for i, f in enumerate(fams):
        pts = [r for r in fixed if r["codec"].split(":")[0].rstrip("0123456789") == f]
        ax.scatter([r["bits_per_element"] for r in pts], [r["ppl"] for r in pts], color=cmap(i % 10),
                   label=f, zorder=3)
        for r in pts:
            ax.annotate(r["codec"], (r["bits_per_element"], r["ppl"]), fontsize=7, alpha=0.7,
                        xytext=(3, 3), textcoords="offset points")
    if plan:
        ax.plot([r["bits_per_element"] for r in plan], [r["ppl"] for r in plan], "k-^",
                label="planner (bits=B)", zorder=4)
    if ref is not None:
        ax.axhline(ref, color="grey", ls="--", lw=1, label=f"bf16 {ref:.3f}")
        for pct, ls in ((1.0, ":"), (0.3, "-.")):
            ax.axhline(ref * (1 + pct / 100), color="grey", ls=ls, lw=0.8, label=f"bf16 +{pct}%")
    ax.set_yscale("log")
    ax.set_xlabel("bits per element, everything counted")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp" + path.suffix)
    fig.savefig(tmp)
    tmp.replace(path)  # atomic
    plt.close(fig)
    log(f"wrote {path}")


def perplexity(model, cache, continuation: list[int]) -> float:
    return M.continuation_ppl(M.continue_logits(model, cache, continuation), continuation)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except M.ToolError as e:
        M.die(str(e))


def load_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for p in paths:
        try:
            rows.extend(json.loads(p.read_text()))
        except (OSError, ValueError) as e:
            raise M.ToolError(f"--from-json {p}: {e}") from e
    return rows


def run(a) -> int:
    if a.plot_only:
        plot(load_rows(a.from_json), a.plot, a.title or a.model)
        return 0
    import torch

    py_codecs = {"none", "bf16"}
    needs_kvpack = [c for c in a.codec if c not in py_codecs and not c.startswith("py:")]
    kvpack = None
    if needs_kvpack:  # fail before the slow model load
        options = {k: getattr(a, k) for k in ("page_tokens", "sink", "recent", "zstd_level")
                   if getattr(a, k) is not None}
        kvpack = Kvpack(a.source_dtype, options, a.keep_temp)
        kvpack.check()
    for c in a.codec:
        if c.startswith("py:") and not PY_INT.match(c):
            raise M.ToolError(f"unknown Python codec {c!r} (known: none, bf16, py:int1..py:int8)")

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.time()
    spec = M.model_spec(a.model)
    tok, model = M.load_model(a.model_dir, threads=a.threads, model=a.model)
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
    metadata = M.kv_metadata(model, prefix, f"{M.GPL3} + \\n\\n + {M.GFDL13}", model_id=spec.model_id)

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
    if a.plot is not None:
        extra = load_rows(a.from_json)
        ref_row = {"codec": "bf16", "bits_per_element": 16.0, "ppl": ref, "delta_vs_bf16_pct": 0.0}
        plot(extra + rows + [ref_row], a.plot, a.title or a.model)
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
