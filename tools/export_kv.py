#!/usr/bin/env python3
"""Export a real Gemma-3-270M KV cache (and the queries that would read it) to safetensors.

Prefills the first N tokens of a text with use_cache=True and writes, for every layer,
exactly what the Hugging Face cache holds:

  past_key_values.{layer}.key / .value   [1, kv_heads, tokens, head_dim]
      (sliding-window layers hold at most sliding_window-1 tokens, global layers all N)
  queries.{layer}                        [1, q_heads, Q, head_dim]
      post q_norm, post RoPE queries of the next Q tokens, i.e. exactly the
      tensor multiplied with K; captured from a second forward pass that runs
      on a copy of the prefix cache.

plus string metadata (kvpack.*). After writing, the file is read back and the
attention output of every layer for the Q query tokens is recomputed from the
file and compared with what the model computed (--no-verify skips this).

Example (the committed fixture):
  python tools/export_kv.py --prefix-tokens 520 --query-tokens 8 --dtype bf16 \\
      -o fixtures/gemma3-270m-gpl3-520.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _model as M  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-tokens", "-n", type=int, default=520, help="N: tokens prefilled into the cache (default 520)")
    p.add_argument("--query-tokens", "-q", type=int, default=8, help="Q: following tokens whose queries are exported (default 8)")
    p.add_argument("--dtype", choices=sorted(M.DTYPES), default="bf16", help="dtype of the written tensors (default bf16)")
    p.add_argument("--text", type=Path, default=M.GPL3, help=f"source text (default {M.GPL3})")
    p.add_argument("-o", "--output", type=Path, required=True, help="output .safetensors")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--model-dir", type=Path, default=M.DEFAULT_MODEL_DIR, help=f"where the GGUF lives / is assembled (default {M.DEFAULT_MODEL_DIR})")
    p.add_argument("--no-verify", action="store_true", help="skip the attention recomputation check")
    a = p.parse_args(argv)
    if a.prefix_tokens < 1:
        p.error("--prefix-tokens must be >= 1")
    if a.query_tokens < 1:
        p.error("--query-tokens must be >= 1")
    return a


def verify(path: Path, records: dict, exported_fp32: dict, facts: dict, n: int, q: int) -> float:
    """Recompute softmax(q K^T * scale) V from the file for every layer and query token.

    K/V of the Q query tokens themselves are not in the file; they come from the
    capture. Returns the worst relative error against the model's attention output.
    """
    import torch

    file, meta = M.load_safetensors(path)
    scale = float(meta["kvpack.attn_scale"])
    window = int(meta["kvpack.sliding_window"])
    layer_types = json.loads(meta["kvpack.layer_types"])
    hq, hkv = facts["num_query_heads"], facts["num_kv_heads"]
    group = hq // hkv
    worst = 0.0
    for layer, kind in enumerate(layer_types):
        K = file[f"past_key_values.{layer}.key"].float()[0]  # [hkv, T, D]
        V = file[f"past_key_values.{layer}.value"].float()[0]
        Qv = file[f"queries.{layer}"].float()[0]  # [hq, Q, D]
        rec = records[layer]
        t = K.shape[1]
        # The second pass really saw the exported cache (fp32, before the dtype cast) ...
        seen_k = rec["key"][0, :, :t]
        seen_v = rec["value"][0, :, :t]
        if not (torch.equal(seen_k, exported_fp32[f"past_key_values.{layer}.key"][0])
                and torch.equal(seen_v, exported_fp32[f"past_key_values.{layer}.value"][0])):
            raise M.ToolError(f"layer {layer}: K/V seen by the query pass differ from the exported cache")
        newk = rec["key"][0, :, t:].float()  # [hkv, Q, D]
        newv = rec["value"][0, :, t:].float()
        assert newk.shape[1] == q, (layer, newk.shape)
        ref = rec["output"][0].float()  # [Q, hq, D]
        pos_prefix = torch.arange(n - t, n)
        got = torch.empty_like(ref)
        for i in range(q):
            pos_q = n + i
            if kind == "sliding_attention":
                vis = pos_prefix > pos_q - window
            else:
                vis = torch.ones(t, dtype=torch.bool)
            for h in range(hq):
                g = h // group
                keys = torch.cat([K[g, vis], newk[g, : i + 1]])
                vals = torch.cat([V[g, vis], newv[g, : i + 1]])
                w = torch.softmax((keys @ Qv[h, i]) * scale, dim=0)
                got[i, h] = w @ vals
        if not torch.isfinite(got).all() or not torch.isfinite(Qv).all():
            raise M.ToolError(f"layer {layer}: non-finite values")
        rel = float((got - ref).norm() / ref.norm())
        worst = max(worst, rel)
        print(f"  layer {layer:2d} {kind:17s} tokens {t:5d}  |K|max {K.abs().max():8.2f}  "
              f"|V|max {V.abs().max():8.2f}  attn-out rel err {rel:.2e}", file=sys.stderr)
    return worst


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except M.ToolError as e:
        M.die(str(e))


def run(a) -> int:
    import torch

    if a.output.exists() and not a.force:
        raise M.ToolError(f"{a.output} exists; pass --force to overwrite")
    dtype = M.torch_dtype(a.dtype)
    t0 = time.time()
    tok, model = M.load_model(a.model_dir)
    facts = M.model_facts(model)
    ids = M.tokenize(tok, M.read_text(a.text))
    n, q = a.prefix_tokens, a.query_tokens
    if len(ids) < n + q:
        raise M.ToolError(f"{a.text} has only {len(ids)} tokens, need {n + q}")
    prefix, nxt = ids[:n], ids[n : n + q]
    print(f"model loaded in {time.time() - t0:.1f}s; text {a.text}: {len(ids)} tokens", file=sys.stderr)

    cache = M.prefill(model, prefix)
    # Snapshot the cache before anything else can touch it.
    exported_fp32 = {k: t.detach().clone() for k, t in M.cache_tensors(cache).items()}
    tensors = {k: t.to(dtype) for k, t in exported_fp32.items()}

    with M.capture_attention(model) as records:
        M.continue_logits(model, M.clone_cache(cache), nxt)
    if sorted(records) != list(range(facts["num_layers"])):
        raise M.ToolError(f"captured attention for layers {sorted(records)}, expected all {facts['num_layers']}")
    for layer in range(facts["num_layers"]):
        qs = records[layer]["query"]
        want = (1, facts["num_query_heads"], q, facts["head_dim"])
        if tuple(qs.shape) != want:
            raise M.ToolError(f"layer {layer}: captured query shape {tuple(qs.shape)}, expected {want}")
        tensors[f"queries.{layer}"] = qs.to(dtype)
    # The query pass ran on a copy: the original cache must be bit-identical to the snapshot.
    for k, t in M.cache_tensors(cache).items():
        if not torch.equal(t, exported_fp32[k]):
            raise M.ToolError(f"{k} changed during the query pass")

    meta = M.kv_metadata(model, prefix, a.text, query_token_ids=nxt)
    M.atomic_save_safetensors(tensors, a.output, meta, a.force)
    counts = [int(exported_fp32[f"past_key_values.{i}.key"].shape[2]) for i in range(facts["num_layers"])]
    print(f"wrote {a.output} ({a.output.stat().st_size} bytes, {a.dtype}); tokens per layer {counts}", file=sys.stderr)

    if not a.no_verify:
        worst = verify(a.output, records, exported_fp32, facts, n, q)
        tol = 1e-4 if a.dtype == "fp32" else 5e-2
        print(f"verify: worst attention-output relative error {worst:.2e} (tolerance {tol:g})", file=sys.stderr)
        if not worst <= tol:
            raise M.ToolError(f"verification failed: relative error {worst:.3e} > {tol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
