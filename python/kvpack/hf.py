"""Hugging Face transformers prompt-cache persistence.

Save a transformers ``DynamicCache`` (full-attention and sliding-window layers,
grouped-query attention) to a ``.kvpack`` file together with the model's
identity and the prompt's token ids, and rebuild it in another process as a
cache that ``model.generate(..., past_key_values=cache)`` or a plain forward
call continues from::

    import kvpack.hf
    out = model(input_ids=prompt, use_cache=True)
    kvpack.hf.save(out.past_key_values, "prompt.kvpack", model=model,
                   token_ids=prompt[0].tolist(), codec="bdr128")
    # ... later, in a fresh process
    cache = kvpack.hf.load("prompt.kvpack", model=model)
    model.generate(torch.tensor([prompt_ids + question_ids]), past_key_values=cache)

All compression and decompression goes through :func:`kvpack.compress` and
:func:`kvpack.open`; this module only maps between the transformers cache
object and kvpack's layer list, and records what is needed to rebuild it.

What the file holds:

- one K and one V tensor per layer, ``[batch, kv_heads, tokens, head_dim]``,
  exactly what the layer holds (a sliding-window layer holds at most
  ``sliding_window - 1`` tokens, the most recent ones), in the cache's dtype
  (bf16, fp16 or fp32) before the codec;
- the token ids of the cached prompt (all of them, also for sliding layers)
  and the model name (``kvpack.model``);
- metadata (strings): the reserved ``kvpack.layer_types`` (JSON list),
  ``kvpack.sliding_window``, ``kvpack.num_query_heads`` and, when the model's
  attention modules expose it, ``kvpack.attn_scale``; under ``hf.``: the format
  tag ``hf.format`` (``kvpack.hf/1``), the config facts that decide whether a
  cache fits a model (``hf.config.*``: model type, layer count, query and KV
  heads, head_dim, hidden size, vocabulary size, sliding window, layer types,
  RoPE parameters) and the per-layer cache state ``hf.cache_layers`` (JSON list
  of ``{"sliding": bool, "window": int | null, "seen": int}``, where ``seen`` is
  the number of tokens the layer has processed, i.e. its absolute position;
  for a sliding layer this is its ``cumulative_length``, larger than the
  tokens it holds once the window is full), and, for caches whose layers do
  not hold the config's ``[num_key_value_heads, head_dim]`` (multi-head latent
  attention: transformers 5 caches DeepSeek-V2/V3's compressed latent as K and
  its RoPE part as V, one head each), ``hf.kv_shapes``: per layer ``[K kv_heads,
  K head_dim, V kv_heads, V head_dim]`` (JSON), which :func:`load` checks the
  tensors against.

Only the model's identity is checked on load (name and config facts), not its
weights: two checkpoints with the same config and name (a base model and a
fine-tune saved under one name) are not told apart.

Needs torch and transformers (>= 4.56, the layered ``Cache`` API); tested with
transformers 5.23.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import kvpack

try:
    import torch
    import transformers
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError(f"kvpack.hf needs torch and transformers (pip install torch transformers): {e}") from e

__all__ = ["FORMAT", "ModelIdentity", "identity", "kv_layers", "save", "load", "read_identity"]

#: Value of the ``hf.format`` metadata key written by :func:`save`.
FORMAT = "kvpack.hf/1"

_FORMAT_KEY = "hf.format"
_LAYERS_KEY = "hf.cache_layers"
_SHAPES_KEY = "hf.kv_shapes"
_CONFIG_PREFIX = "hf.config."


def _param_error(msg: str) -> kvpack.ParameterError:
    return kvpack.ParameterError(msg)


# ---------------------------------------------------------------------------
# Model identity


@dataclass(frozen=True)
class ModelIdentity:
    """What a saved cache records about the model that made it.

    Attributes:
        name: model name (``kvpack.model``); ``""`` when unknown.
        facts: config facts, all strings: ``model_type``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
            ``hidden_size``, ``vocab_size``, ``sliding_window`` (``"none"``
            without one), ``layer_types`` (JSON list), ``rope_parameters``
            (JSON, ``"none"`` when the config has none).
    """

    name: str
    facts: dict[str, str]

    def mismatches(self, other: "ModelIdentity", *, check_name: bool = True) -> list[str]:
        """Human-readable differences between ``self`` (saved) and ``other`` (given).

        Names are compared only when ``check_name`` is true and both are non-empty.
        """
        out = []
        if check_name and self.name and other.name and self.name != other.name:
            out.append(f"name: saved {self.name!r}, given {other.name!r}")
        for key in sorted(set(self.facts) | set(other.facts)):
            a, b = self.facts.get(key), other.facts.get(key)
            if a != b:
                out.append(f"{key}: saved {a!r}, given {b!r}")
        return out


def _text_config(model_or_config):
    cfg = getattr(model_or_config, "config", model_or_config)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    return cfg


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _layer_types(cfg) -> list[str]:
    """Per-layer attention type, as transformers' DynamicCache infers it."""
    types = getattr(cfg, "layer_types", None)
    n = int(cfg.num_hidden_layers)
    if types is not None:
        return [str(t) for t in types]
    window = getattr(cfg, "sliding_window", None)
    return ["sliding_attention" if window is not None else "full_attention"] * n


def identity(model_or_config, name: str | None = None) -> ModelIdentity:
    """The :class:`ModelIdentity` of a transformers model or config.

    Args:
        model_or_config: a ``PreTrainedModel`` or a ``PretrainedConfig``
            (multimodal configs: the decoder's text config is used).
        name: the model name to record; default: the config's ``name_or_path``
            (the string given to ``from_pretrained``), else its ``model_type``.

    Raises:
        kvpack.ParameterError: the config lacks ``num_hidden_layers``,
            ``num_attention_heads`` or ``hidden_size``.
    """
    cfg = _text_config(model_or_config)
    try:
        layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
    except (AttributeError, TypeError) as e:
        raise _param_error(f"model config {type(cfg).__name__} lacks a basic attention field: {e}") from None
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    window = getattr(cfg, "sliding_window", None)
    rope = getattr(cfg, "rope_parameters", None)
    facts = {
        "model_type": str(getattr(cfg, "model_type", "")),
        "num_hidden_layers": str(layers),
        "num_attention_heads": str(heads),
        "num_key_value_heads": str(int(kv_heads)),
        "head_dim": str(int(head_dim)),
        "hidden_size": str(hidden),
        "vocab_size": str(getattr(cfg, "vocab_size", "")),
        "sliding_window": "none" if window is None else str(int(window)),
        "layer_types": _json(_layer_types(cfg)),
        "rope_parameters": "none" if rope is None else _json(rope),
    }
    if name is None:
        top = getattr(model_or_config, "config", model_or_config)
        name = str(getattr(top, "name_or_path", "") or facts["model_type"])
    return ModelIdentity(name=name, facts=facts)


def _attn_scale(model) -> float | None:
    """The attention logit scale shared by all layers, if the model exposes one."""
    if not isinstance(model, torch.nn.Module):
        return None
    scales = {float(m.scaling) for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "layer_idx")}
    return scales.pop() if len(scales) == 1 else None


# ---------------------------------------------------------------------------
# Cache <-> layer list


def _layer_state(layer, index: int) -> dict:
    """{"sliding", "window", "seen"} of one cache layer; refuses unsupported kinds."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return {"sliding": True, "window": int(layer.sliding_window), "seen": int(layer.cumulative_length)}
    if type(layer) is DynamicLayer:
        return {"sliding": False, "window": None, "seen": int(layer.get_seq_length())}
    raise _param_error(
        f"cache layer {index} is a {type(layer).__name__}; kvpack.hf saves DynamicCache layers "
        "(DynamicLayer, DynamicSlidingWindowLayer) only"
    )


def kv_layers(cache) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
    """The (keys, values) of every layer of a transformers cache, without copying.

    Args:
        cache: a transformers ``Cache`` with ``cache.layers`` (transformers >= 4.56).

    Returns:
        One ``(K, V)`` pair per layer, each ``[batch, kv_heads, tokens, head_dim]``,
        the tensors the cache holds (same dtype and device).

    Raises:
        kvpack.ParameterError: the cache has no ``layers`` or a layer is empty.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise _param_error(f"{type(cache).__name__} has no .layers (needs transformers >= 4.56)")
    out = []
    for i, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not getattr(layer, "is_initialized", k is not None) or k is None or v is None or k.dim() != 4:
            raise _param_error(f"cache layer {i} holds no keys/values (an empty or shared layer)")
        out.append((k, v))
    return out


def save(
    cache,
    path: str | os.PathLike,
    *,
    model,
    token_ids: Sequence[int],
    codec: str | None = None,
    force: bool = False,
    name: str | None = None,
    **compress_options,
) -> "kvpack.CompressResult":
    """Save a transformers prompt cache to a kvpack file (atomic write).

    Args:
        cache: a ``DynamicCache`` (full-attention ``DynamicLayer`` and
            ``DynamicSlidingWindowLayer`` layers) after a forward pass with
            ``use_cache=True``; K and V of each layer ``[batch, kv_heads,
            tokens, head_dim]``, bf16/fp16/fp32, any device (a GPU cache is
            copied to host memory first). Not modified.
        path: output file; refused if it exists unless ``force``.
        model: the ``PreTrainedModel`` (or its config) that made the cache:
            its identity goes into the file (see :func:`identity`).
        token_ids: the ids of the cached tokens, in order (u32 values); their
            count must equal the tokens every full-attention layer holds and
            every layer's processed-token count.
        codec: a kvpack codec name (``kvpack codecs``), e.g. ``"raw"``
            (lossless, the default unless ``bits`` is given),
            ``"bdr128"``, ``"hqmq:s96r4+med3"``.
        force: replace an existing file.
        name: model name to record; default as in :func:`identity`.
        **compress_options: passed to :func:`kvpack.compress` (``bits``
            for a planned file instead of ``codec``, ``sink``,
            ``recent``, ``page_tokens``, ``zstd_level``, ``metadata``: extra
            string metadata, whose keys must not collide with the ones written here).

    Returns:
        kvpack.CompressResult: codec, pages, element and byte counts, bits per element.

    Raises:
        kvpack.ParameterError: unsupported cache layer kind, empty layer,
            token count mismatch, a metadata key collision, a codec that
            does not fit the shapes (e.g. ``bdr128`` with head_dim 64), or
            an existing ``path`` without ``force``.
        kvpack.KvpackIOError: the file cannot be written.
        kvpack.LimitsError: the cache exceeds a configured limit.
    """
    ids = [int(t) for t in token_ids]
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise _param_error(f"{type(cache).__name__} has no .layers (needs transformers >= 4.56)")
    states = [_layer_state(layer, i) for i, layer in enumerate(layers)]
    for i, st in enumerate(states):
        if st["sliding"] and st["window"] < 2:
            raise _param_error(
                f"cache layer {i} has a sliding window of {st['window']} token(s): it keeps no past "
                "token to save (kvpack.hf needs sliding windows of at least 2)"
            )
    if codec is None and "bits" not in compress_options:
        codec = "raw"
    pairs = kv_layers(cache)
    ident = identity(model, name)
    if len(pairs) != int(ident.facts["num_hidden_layers"]):
        raise _param_error(f"the cache has {len(pairs)} layers, the model {ident.facts['num_hidden_layers']}")
    for i, (state, (k, _)) in enumerate(zip(states, pairs)):
        held = int(k.shape[2])
        if state["seen"] != len(ids):
            raise _param_error(f"layer {i} has processed {state['seen']} tokens but {len(ids)} token ids were given")
        if state["sliding"] and held > state["window"] - 1:
            # A layer recording its past (assisted decoding) may hold more; the
            # next forward only needs the last window - 1.
            pairs[i] = tuple(t[:, :, -(state["window"] - 1) :, :] for t in pairs[i])
    facts_meta = {_CONFIG_PREFIX + k: v for k, v in ident.facts.items()}
    # Per layer [K kv_heads, K head_dim, V kv_heads, V head_dim]: recorded
    # when a layer does not hold the config's (num_key_value_heads,
    # head_dim), as multi-head latent attention caches do (DeepSeek-V2/V3
    # in transformers 5 cache the compressed latent as K and the RoPE part
    # as V, one "head" each); load checks the tensors against these.
    shapes = [[int(k.shape[1]), int(k.shape[3]), int(v.shape[1]), int(v.shape[3])] for k, v in pairs]
    standard = [int(ident.facts["num_key_value_heads"]), int(ident.facts["head_dim"])] * 2
    meta = {
        _FORMAT_KEY: FORMAT,
        _LAYERS_KEY: _json(states),
        "hf.transformers_version": transformers.__version__,
        "kvpack.layer_types": ident.facts["layer_types"],
        "kvpack.num_query_heads": ident.facts["num_attention_heads"],
        **facts_meta,
    }
    if ident.facts["sliding_window"] != "none":
        meta["kvpack.sliding_window"] = ident.facts["sliding_window"]
    if any(sh != standard for sh in shapes):
        meta[_SHAPES_KEY] = _json(shapes)
    scale = _attn_scale(model)
    if scale is not None:
        meta["kvpack.attn_scale"] = repr(scale)
    extra = dict(compress_options.pop("metadata", None) or {})
    clash = sorted(set(extra) & set(meta))
    if clash:
        raise _param_error(f"metadata keys {clash} are written by kvpack.hf.save itself")
    meta.update(extra)
    # kvpack.compress reads host memory in place (no copy for a CPU cache).
    tensors = [(k.detach().cpu().contiguous(), v.detach().cpu().contiguous()) for k, v in pairs]
    return kvpack.compress(
        tensors,
        codec,
        path=os.fspath(path),
        force=force,
        model=ident.name,
        token_ids=ids,
        metadata=meta,
        **compress_options,
    )


# ---------------------------------------------------------------------------
# Load


def _saved_identity(ar) -> ModelIdentity:
    meta = ar.metadata
    facts = {k[len(_CONFIG_PREFIX) :]: v for k, v in meta.items() if k.startswith(_CONFIG_PREFIX)}
    return ModelIdentity(name=ar.model or "", facts=facts)


def _open_hf(path) -> Any:
    ar = kvpack.open(os.fspath(path))
    tag = ar.metadata.get(_FORMAT_KEY)
    if tag != FORMAT:
        raise _param_error(
            f"{os.fspath(path)}: metadata {_FORMAT_KEY} is {tag!r}, expected {FORMAT!r} "
            "(not a cache written by kvpack.hf.save, or a newer version)"
        )
    return ar


def read_identity(path: str | os.PathLike) -> tuple[ModelIdentity, list[int]]:
    """The saved model identity and prompt token ids of a kvpack.hf file.

    Raises:
        kvpack.FormatError: the file is not a valid kvpack file.
        kvpack.ParameterError: it was not written by :func:`save`.
        kvpack.KvpackIOError: it cannot be read.
    """
    ar = _open_hf(path)
    return _saved_identity(ar), list(ar.token_ids)


def _layer_states(ar, where: str) -> list[dict]:
    try:
        states = json.loads(ar.metadata[_LAYERS_KEY])
        ok = isinstance(states, list) and all(
            isinstance(s, dict)
            and isinstance(s.get("sliding"), bool)
            and isinstance(s.get("seen"), int)
            and s["seen"] >= 0
            and (not s["sliding"] or (isinstance(s.get("window"), int) and s["window"] >= 2))
            for s in states
        )
    except (KeyError, ValueError) as e:
        raise kvpack.FormatError(f"{where}: metadata {_LAYERS_KEY} missing or not JSON ({e})") from None
    if not ok:
        raise kvpack.FormatError(f"{where}: metadata {_LAYERS_KEY} is not a list of layer states")
    return states


def _kv_shapes(ar, where: str, layers: int) -> list[list[int]] | None:
    """The per-layer ``[K kv_heads, K head_dim, V kv_heads, V head_dim]``
    recorded by :func:`save` for caches that do not hold the config's
    shape, or None."""
    raw = ar.metadata.get(_SHAPES_KEY)
    if raw is None:
        return None
    try:
        shapes = json.loads(raw)
        ok = (
            isinstance(shapes, list)
            and len(shapes) == layers
            and all(isinstance(sh, list) and len(sh) == 4 and all(type(x) is int and x > 0 for x in sh) for sh in shapes)
        )
    except ValueError:
        ok = False
    if not ok:
        raise kvpack.FormatError(f"{where}: metadata {_SHAPES_KEY} is not a list of {layers} [K heads, K dim, V heads, V dim]")
    return shapes


def _check_layer(where: str, i: int, state: dict, kinfo, vinfo, want_shape: list[int]) -> None:
    """The stored K/V of layer i fit its saved state and the expected
    ``[K kv_heads, K head_dim, V kv_heads, V head_dim]``."""
    want = min(state["seen"], state["window"] - 1) if state["sliding"] else state["seen"]
    for kind, info, (heads, dim) in (("K", kinfo, want_shape[:2]), ("V", vinfo, want_shape[2:])):
        if info.tokens != want:
            raise kvpack.FormatError(f"{where}: layer {i} {kind} holds {info.tokens} tokens, its state says {want}")
        if (heads, dim) != (info.kv_heads, info.head_dim):
            raise _param_error(
                f"{where}: layer {i} {kind} is {info.shape}, the model has {heads} kv heads of head_dim {dim}"
            )
    if kinfo.batch != vinfo.batch:
        raise kvpack.FormatError(f"{where}: layer {i} K has batch {kinfo.batch}, V {vinfo.batch}")


def _empty_cache(states: list[dict], config) -> DynamicCache:
    """A DynamicCache with one empty layer per saved state (from the config when given)."""
    if config is not None:
        cache = DynamicCache(config=config)
        if len(cache.layers) != len(states):
            raise _param_error(f"the model config gives {len(cache.layers)} cache layers, the file {len(states)}")
        for i, (layer, s) in enumerate(zip(cache.layers, states)):
            sliding = isinstance(layer, DynamicSlidingWindowLayer)
            window = int(layer.sliding_window) if sliding else None
            if sliding != s["sliding"] or (sliding and window != s["window"]):
                raise _param_error(
                    f"cache layer {i}: the file holds a {'sliding' if s['sliding'] else 'full'} layer "
                    f"(window {s.get('window')}), the model config a {type(layer).__name__} (window {window})"
                )
        return cache
    spec = [(None, None, torch.tensor(s["window"])) if s["sliding"] else (None, None) for s in states]
    return DynamicCache(ddp_cache_data=spec)


def load(
    path: str | os.PathLike,
    *,
    model=None,
    config=None,
    device: str | "torch.device" = "cpu",
    dtype: "torch.dtype | None" = None,
    name: str | None = None,
    check_name: bool = True,
) -> DynamicCache:
    """Rebuild a ``DynamicCache`` saved by :func:`save`.

    The result continues exactly where the saved cache stopped: each layer
    holds the decoded K and V ``[batch, kv_heads, tokens, head_dim]``, and a
    sliding-window layer's ``cumulative_length`` is the saved number of
    processed tokens, so the next token gets position ``len(token_ids)`` and
    the sliding-window masks cover the right tokens. Pass it as
    ``past_key_values`` to a forward call with the next tokens, or to
    ``model.generate`` with ``input_ids`` = the saved token ids followed by
    new ones (generate feeds only the uncached tail).

    Args:
        path: a file written by :func:`save` (memory-mapped, structure and
            CRCs validated by :func:`kvpack.open`).
        model: the ``PreTrainedModel`` that will continue; its identity must
            match the saved one (config facts, and the name unless
            ``check_name`` is false). Its config also builds the cache layers.
        config: a config instead of ``model`` (ignored when ``model`` is given).
            With neither, the cache is built from the file alone, unchecked.
        device: where the tensors go (default CPU).
        dtype: torch dtype of the tensors; default: the dtype they were saved in.
        name: the expected model name; default as in :func:`identity`.
        check_name: compare the model names (the config facts are always compared).

    Returns:
        transformers ``DynamicCache`` with one layer per model layer.

    Raises:
        kvpack.ParameterError: the file was not written by :func:`save`, or it
            was saved for another model (the message names every differing fact),
            or its tensors do not fit the model's layers.
        kvpack.FormatError: the file is corrupt (bad CRC, structure, or
            missing/invalid ``hf.`` metadata).
        kvpack.KvpackIOError: the file cannot be read.
    """
    where = os.fspath(path)
    ar = _open_hf(path)
    saved = _saved_identity(ar)
    source = model if model is not None else config
    if source is not None:
        diff = saved.mismatches(identity(source, name), check_name=check_name)
        if diff:
            raise _param_error(f"{where} was saved for another model: " + "; ".join(diff))
        config = getattr(model, "config", None) if model is not None else config
    states = _layer_states(ar, where)
    if ar.num_layers != len(states):
        raise kvpack.FormatError(f"{where}: {ar.num_layers} layers in the tensor table, {len(states)} in {_LAYERS_KEY}")
    n_ids = len(ar.token_ids)
    shapes = _kv_shapes(ar, where, len(states))
    try:
        standard = [int(saved.facts["num_key_value_heads"]), int(saved.facts["head_dim"])] * 2
    except (KeyError, ValueError):
        raise kvpack.FormatError(f"{where}: metadata {_CONFIG_PREFIX}num_key_value_heads/head_dim missing or not integers") from None
    cache = _empty_cache(states, config)
    infos = {(t.layer, t.kind): t for t in ar.tensors}
    for i, (layer, s) in enumerate(zip(cache.layers, states)):
        if (i, "K") not in infos or (i, "V") not in infos:
            raise kvpack.FormatError(f"{where}: layer {i} lacks K or V")
        if s["seen"] != n_ids:
            raise kvpack.FormatError(f"{where}: layer {i} has processed {s['seen']} tokens, the file has {n_ids} ids")
        _check_layer(where, i, s, infos[(i, "K")], infos[(i, "V")], shapes[i] if shapes else standard)
        dec = ar.decode(layers=i, dtype=infos[(i, "K")].dtype, output="torch")
        k, v = dec[(i, "K")], dec[(i, "V")]
        k = k.to(device=device, dtype=dtype or k.dtype)
        v = v.to(device=device, dtype=dtype or v.dtype)
        layer.update(k, v)
        if s["sliding"]:
            layer.cumulative_length = s["seen"]
    return cache
