#!/usr/bin/env python3
"""Resume a transformers prompt cache saved with kvpack.hf in a new process.

Protocol (the perplexity text and lengths of tools/eval_ppl.py): text = GPL-3 +
"\\n\\n" + GFDL-1.3, tokenized by the model's tokenizer; prefix = the first 1024
tokens, continuation = the next 512.

  save    one process: prefill the prefix (fp32) and write the cache once per codec
          with kvpack.hf.save to DIR/<model>.<codec>.kvpack (+ DIR/<model>.save.json).
  resume  a NEW process: load the model, recompute the prefix cache (the reference),
          then for each codec load the file with kvpack.hf.load and
          (a) greedy-generate N tokens after the first continuation token and compare
              them with the same generation from the recomputed cache,
          (b) feed the 512 continuation tokens and compute the perplexity (as eval_ppl.py)
              and the top-1 agreement of the logits with the recomputed cache's.
  table   run `save` then `resume` as two child processes and print a markdown table.

Example:
  python tools/hf_resume.py table --model gemma3-270m --out-dir /tmp/hfr \\
      --codec raw --codec bdr128 --codec 'hqmq:s96r4+med3' --codec hqmq:s24r3
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _model as M  # noqa: E402

DEFAULT_CODECS = ["raw", "bdr128", "hqmq:s96r4+med3", "hqmq:s24r3"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["save", "resume", "table"])
    p.add_argument("--model", choices=sorted(M.MODELS), default=M.DEFAULT_MODEL)
    p.add_argument("--codec", action="append", metavar="C",
                   help=f"kvpack codec, repeatable (default: {' '.join(DEFAULT_CODECS)})")
    p.add_argument("--out-dir", type=Path, required=True, help="where the .kvpack files go")
    p.add_argument("--force", action="store_true", help="save: replace existing files")
    p.add_argument("--greedy-tokens", type=int, default=64, help="N greedy tokens compared (default 64)")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="protocol: 1024")
    p.add_argument("--continuation-tokens", type=int, default=512, help="protocol: 512")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--model-dir", type=Path, default=M.DEFAULT_MODEL_DIR, help="Gemma GGUF assembly dir")
    a = p.parse_args(argv)
    a.codec = a.codec or list(DEFAULT_CODECS)
    if len(set(a.codec)) != len(a.codec):
        p.error("a codec is listed twice")
    if a.greedy_tokens < 1 or a.continuation_tokens < 2 or a.prefix_tokens < 1:
        p.error("--greedy-tokens >= 1, --continuation-tokens >= 2, --prefix-tokens >= 1")
    return a


def file_for(a, codec: str) -> Path:
    return a.out_dir / f"{a.model}.{re.sub(r'[^A-Za-z0-9_.+-]', '_', codec)}.kvpack"


def import_hf():
    try:
        import kvpack
        import kvpack.hf as hf
    except ImportError as e:
        raise M.ToolError(f"kvpack.hf is not importable ({e}); `maturin develop --release` in {M.REPO_ROOT}") from e
    return kvpack, hf


def setup(a):
    """(spec, tokenizer, model, prefix ids, continuation ids)."""
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    spec = M.model_spec(a.model)
    t0 = time.time()
    tok, model = M.load_model(a.model_dir, threads=a.threads, model=a.model)
    ids = M.tokenize(tok, M.protocol_text())
    n, c = a.prefix_tokens, a.continuation_tokens
    if len(ids) < n + c:
        raise M.ToolError(f"protocol text has {len(ids)} tokens, need {n + c}")
    log(f"{spec.model_id}: loaded in {time.time() - t0:.1f}s; prefix {n}, continuation {c}")
    return spec, tok, model, ids[:n], ids[n : n + c]


def cmd_save(a) -> int:
    kvpack, hf = import_hf()
    spec, _, model, prefix, _ = setup(a)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    t = time.time()
    cache = M.prefill(model, prefix)
    log(f"prefill {time.time() - t:.1f}s")
    report = {}
    for codec in a.codec:
        path = file_for(a, codec)
        t = time.time()
        try:
            res = hf.save(cache, path, model=model, token_ids=prefix, codec=codec, force=a.force, name=spec.model_id)
        except kvpack.KvpackError as e:
            raise M.ToolError(f"save {codec}: {type(e).__name__}: {e}") from e
        report[codec] = {"file": str(path), "bits_per_element": res.bits_per_element,
                         "bytes": path.stat().st_size, "seconds": time.time() - t}
        log(f"{codec}: {path} {path.stat().st_size} bytes, {res.bits_per_element:.3f} bits/elem")
    (a.out_dir / f"{a.model}.save.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def greedy(model, cache, prefix: list[int], first: int, n: int) -> list[int]:
    """n greedy tokens after prefix + [first], the prefix taken from `cache` (consumed)."""
    import torch

    ids = torch.tensor([prefix + [first]])
    with torch.inference_mode():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prefix) + 1 :].tolist()


def cmd_resume(a) -> int:
    import torch

    kvpack, hf = import_hf()
    spec, _, model, prefix, continuation = setup(a)
    t = time.time()
    ref = M.prefill(model, prefix)  # recomputing the prefix: the reference
    ref_tokens = greedy(model, copy.deepcopy(ref), prefix, continuation[0], a.greedy_tokens)
    ref_logits = M.continue_logits(model, ref, continuation)
    ref_ppl = M.continuation_ppl(ref_logits, continuation)
    ref_top1 = ref_logits.argmax(-1)
    log(f"reference (recomputed prefix) {time.time() - t:.1f}s: ppl {ref_ppl:.4f}")
    rows = [{"codec": "recompute", "ppl": ref_ppl, "greedy_prefix_match": a.greedy_tokens,
             "greedy_positions_match": a.greedy_tokens, "top1_agree": len(continuation),
             "logits_identical": True}]
    for codec in a.codec:
        path = file_for(a, codec)
        t = time.time()
        try:
            ident, ids = hf.read_identity(path)
            if ids != prefix:
                raise M.ToolError(f"{path}: token ids differ from the protocol prefix")
            loaded = hf.load(path, model=model, name=spec.model_id)
        except kvpack.KvpackError as e:
            raise M.ToolError(f"load {path}: {type(e).__name__}: {e}") from e
        toks = greedy(model, copy.deepcopy(loaded), prefix, continuation[0], a.greedy_tokens)
        logits = M.continue_logits(model, loaded, continuation)
        lead = next((i for i, (x, y) in enumerate(zip(toks, ref_tokens)) if x != y), len(toks))
        row = {"codec": codec, "ppl": M.continuation_ppl(logits, continuation),
               "greedy_prefix_match": lead,
               "greedy_positions_match": sum(x == y for x, y in zip(toks, ref_tokens)),
               "top1_agree": int((logits.argmax(-1) == ref_top1).sum()),
               "logits_identical": bool(torch.equal(logits, ref_logits))}
        rows.append(row)
        log(f"{codec}: ppl {row['ppl']:.4f}; greedy {lead}/{a.greedy_tokens} leading tokens match; "
            f"top-1 {row['top1_agree']}/{len(continuation)}; logits identical {row['logits_identical']} "
            f"({time.time() - t:.1f}s)")
    print(json.dumps({"model": spec.model_id, "greedy_tokens": a.greedy_tokens,
                      "continuation_tokens": len(continuation), "rows": rows}, indent=2))
    return 0


def child_args(a, command: str) -> list[str]:
    args = [sys.executable, str(Path(__file__).resolve()), command, "--model", a.model, "--out-dir", str(a.out_dir),
            "--greedy-tokens", str(a.greedy_tokens), "--prefix-tokens", str(a.prefix_tokens),
            "--continuation-tokens", str(a.continuation_tokens), "--model-dir", str(a.model_dir)]
    for c in a.codec:
        args += ["--codec", c]
    if a.threads:
        args += ["--threads", str(a.threads)]
    if a.force and command == "save":
        args.append("--force")
    return args


def run_child(args: list[str]) -> str:
    log("$ " + shlex.join(args))
    r = subprocess.run(args, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise M.ToolError(f"`{shlex.join(args)}` exited with {r.returncode}")
    return r.stdout


def cmd_table(a) -> int:
    run_child(child_args(a, "save"))
    saved = json.loads((a.out_dir / f"{a.model}.save.json").read_text())
    result = json.loads(run_child(child_args(a, "resume")))
    n, c = result["greedy_tokens"], result["continuation_tokens"]
    ref = result["rows"][0]["ppl"]
    print(f"{result['model']}: greedy {n} tokens after prefix + first continuation token; "
          f"perplexity over {c} continuation tokens\n")
    print("| codec | bits/elem | file bytes | perplexity | vs recompute | greedy tokens matched "
          "(leading / positions) | top-1 agreement | logits bit-identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        s = saved.get(r["codec"])
        bits = f"{s['bits_per_element']:.3f}" if s else "32 (fp32)"
        size = str(s["bytes"]) if s else ""
        print(f"| {r['codec']} | {bits} | {size} | {r['ppl']:.4f} | {(r['ppl'] / ref - 1) * 100:+.2f}% | "
              f"{r['greedy_prefix_match']}/{n} / {r['greedy_positions_match']}/{n} | "
              f"{r['top1_agree']}/{c} | {'yes' if r['logits_identical'] else 'no'} |")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return {"save": cmd_save, "resume": cmd_resume, "table": cmd_table}[a.command](a)
    except M.ToolError as e:
        M.die(str(e))


if __name__ == "__main__":
    sys.exit(main())
