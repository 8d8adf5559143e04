"""kvpack.hf: save / load of transformers prompt caches.

Uses tiny randomly initialised models built from configs (nothing is
downloaded): a 2-layer Gemma-3 text model (one sliding-window layer with a
4-token window, one full-attention layer, 4 query heads on 2 KV heads,
head_dim 16), a 2-layer Llama with grouped-query attention (6 query heads
on 2 KV heads, head_dim 8) and a 2-layer DeepSeek-V3 (multi-head latent
attention, whose cache layers are not [num_key_value_heads, head_dim]). Skipped, with the reason printed by
``pytest -rs``, when torch or transformers is not installed.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="kvpack.hf tests need torch (pip install torch)")
transformers = pytest.importorskip("transformers", reason="kvpack.hf tests need transformers")

import kvpack  # noqa: E402
import kvpack.hf as hf  # noqa: E402

WINDOW = 4


def gemma3_config(**over):
    cfg = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
        attn_implementation="eager",
    )
    cfg.update(over)
    return transformers.Gemma3TextConfig(**cfg)


def llama_config(**over):
    cfg = dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        attn_implementation="eager",
    )
    cfg.update(over)
    return transformers.LlamaConfig(**cfg)


def mla_config(**over):
    """DeepSeek-V3's multi-head latent attention: transformers 5 caches the
    compressed latent (kv_lora_rank) as K and the RoPE part
    (qk_rope_head_dim) as V, one head each, not the config's
    [num_key_value_heads, head_dim]."""
    cfg = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=64,
        attn_implementation="eager",
    )
    cfg.update(over)
    return transformers.DeepseekV3Config(**cfg)


def build(kind: str, **over):
    torch.manual_seed(1234)
    if kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(gemma3_config(**over))
    elif kind == "mla":
        model = transformers.DeepseekV3ForCausalLM(mla_config(**over))
    else:
        model = transformers.LlamaForCausalLM(llama_config(**over))
    return model.eval()


def prefill(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values


def continue_logits(model, cache, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0]


PROMPT = [5, 17, 33, 2, 71, 44, 9, 90, 13, 61, 27]  # 11 tokens: the sliding layer keeps the last 3
NEXT = [8, 40, 77, 3, 55]


@pytest.fixture(params=["gemma3", "llama", "mla"])
def kind(request):
    return request.param


def test_raw_round_trip_continues_bit_exactly(kind, tmp_path):
    model = build(kind)
    cache = prefill(model, PROMPT)
    reference = copy.deepcopy(cache)
    path = tmp_path / "prompt.kvpack"
    res = hf.save(cache, path, model=model, token_ids=PROMPT, codec="raw", name="tiny")
    assert res.codec == "raw" and path.is_file()

    loaded = hf.load(path, model=model, name="tiny")
    assert type(loaded) is transformers.DynamicCache
    assert len(loaded.layers) == 2
    for a, b in zip(reference.layers, loaded.layers):
        assert type(a) is type(b)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.get_seq_length() == b.get_seq_length() == len(PROMPT)
        assert a.get_mask_sizes(1) == b.get_mask_sizes(1)

    want = continue_logits(model, reference, NEXT)
    got = continue_logits(model, loaded, NEXT)
    assert torch.equal(want, got)
    # The continued caches advanced identically (sliding layer cut to the window again).
    for a, b in zip(reference.layers, loaded.layers):
        assert torch.equal(a.keys, b.keys) and a.get_seq_length() == b.get_seq_length()


def test_generate_resumes_like_the_original_cache(kind, tmp_path):
    model = build(kind)
    cache = prefill(model, PROMPT)
    path = tmp_path / "prompt.kvpack"
    hf.save(cache, path, model=model, token_ids=PROMPT)
    ids = torch.tensor([PROMPT + NEXT[:1]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(ids, past_key_values=copy.deepcopy(cache), **kw)
        got = model.generate(ids, past_key_values=hf.load(path, model=model), **kw)
    assert want.shape == (1, len(PROMPT) + 1 + 6)
    assert torch.equal(want, got)


def test_file_records_identity_tokens_and_layer_state(tmp_path):
    model = build("gemma3")
    cache = prefill(model, PROMPT)
    path = tmp_path / "prompt.kvpack"
    hf.save(cache, path, model=model, token_ids=PROMPT, name="tiny-gemma3")
    ar = kvpack.open(str(path))
    assert ar.model == "tiny-gemma3"
    assert list(ar.token_ids) == PROMPT
    meta = ar.metadata
    assert meta["hf.format"] == hf.FORMAT
    assert meta["hf.config.model_type"] == "gemma3_text"
    assert meta["hf.config.num_key_value_heads"] == "2"
    assert meta["hf.config.head_dim"] == "16"
    assert meta["kvpack.sliding_window"] == str(WINDOW)
    assert meta["kvpack.layer_types"] == '["sliding_attention","full_attention"]'
    assert meta["kvpack.num_query_heads"] == "4"
    assert float(meta["kvpack.attn_scale"]) == model.model.layers[0].self_attn.scaling
    assert meta["hf.cache_layers"] == (
        '[{"seen":11,"sliding":true,"window":4},{"seen":11,"sliding":false,"window":null}]'
    )
    shapes = {(t.layer, t.kind): (t.shape, t.dtype) for t in ar.tensors}
    assert shapes == {
        (0, "K"): ((1, 2, WINDOW - 1, 16), "fp32"), (0, "V"): ((1, 2, WINDOW - 1, 16), "fp32"),
        (1, "K"): ((1, 2, 11, 16), "fp32"), (1, "V"): ((1, 2, 11, 16), "fp32"),
    }
    ident, ids = hf.read_identity(path)
    assert ident == hf.identity(model, "tiny-gemma3") and ids == PROMPT


def test_short_prompt_inside_the_window(tmp_path):
    model = build("gemma3")
    prompt = PROMPT[:2]  # fewer tokens than the window: the sliding layer holds them all
    cache = prefill(model, prompt)
    path = tmp_path / "short.kvpack"
    hf.save(cache, path, model=model, token_ids=prompt)
    loaded = hf.load(path, model=model)
    assert loaded.layers[0].keys.shape[2] == 2 and loaded.layers[0].cumulative_length == 2
    assert torch.equal(continue_logits(model, cache, NEXT), continue_logits(model, loaded, NEXT))


def test_load_without_model_rebuilds_layers_from_the_file(tmp_path):
    model = build("gemma3")
    cache = prefill(model, PROMPT)
    path = tmp_path / "prompt.kvpack"
    hf.save(cache, path, model=model, token_ids=PROMPT)
    loaded = hf.load(path)
    assert [type(layer).__name__ for layer in loaded.layers] == ["DynamicSlidingWindowLayer", "DynamicLayer"]
    assert loaded.layers[0].sliding_window == WINDOW
    assert torch.equal(continue_logits(model, cache, NEXT), continue_logits(model, loaded, NEXT))


def test_dtype_is_kept_and_can_be_changed(tmp_path):
    model = build("llama")
    cache = prefill(model, PROMPT)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.to(torch.bfloat16), layer.values.to(torch.bfloat16)
    path = tmp_path / "bf16.kvpack"
    hf.save(cache, path, model=model, token_ids=PROMPT)
    assert {t.dtype for t in kvpack.open(str(path)).tensors} == {"bf16"}
    same = hf.load(path, model=model)
    assert same.layers[1].keys.dtype == torch.bfloat16
    assert torch.equal(same.layers[1].keys, cache.layers[1].keys)
    wide = hf.load(path, model=model, dtype=torch.float32)
    assert wide.layers[1].values.dtype == torch.float32
    assert torch.equal(wide.layers[1].values, cache.layers[1].values.float())


def test_lossy_codec_round_trip_is_close_not_exact(tmp_path):
    model = build("gemma3")
    cache = prefill(model, PROMPT)
    path = tmp_path / "int8.kvpack"
    res = hf.save(cache, path, model=model, token_ids=PROMPT, codec="int8")
    assert res.codec == "int8" and "int8" in kvpack.open(str(path)).codecs  # (896 elements: headers dominate the size)
    loaded = hf.load(path, model=model)
    for a, b in zip(cache.layers, loaded.layers):
        assert a.keys.shape == b.keys.shape and a.get_seq_length() == b.get_seq_length()
        rel = float((a.keys - b.keys).norm() / a.keys.norm())
        assert 0 < rel < 0.02, rel
    want, got = continue_logits(model, cache, NEXT), continue_logits(model, loaded, NEXT)
    assert not torch.equal(want, got)
    assert float((want - got).abs().max()) < 0.05 * float(want.abs().max())


def test_mismatched_model_is_refused(tmp_path):
    model = build("llama")
    cache = prefill(model, PROMPT)
    path = tmp_path / "prompt.kvpack"
    hf.save(cache, path, model=model, token_ids=PROMPT, name="tiny")
    other = build("llama", num_key_value_heads=3, num_attention_heads=6)
    with pytest.raises(kvpack.ParameterError, match="num_key_value_heads: saved '2', given '3'"):
        hf.load(path, model=other, name="tiny")
    with pytest.raises(kvpack.ParameterError, match="name: saved 'tiny', given 'other'"):
        hf.load(path, model=model, name="other")
    hf.load(path, model=model, name="other", check_name=False)  # facts still match
    with pytest.raises(kvpack.ParameterError, match="model_type"):
        hf.load(path, config=gemma3_config(num_key_value_heads=2), check_name=False)


def test_save_refuses_bad_input(tmp_path):
    model = build("gemma3")
    cache = prefill(model, PROMPT)
    path = tmp_path / "prompt.kvpack"
    with pytest.raises(kvpack.ParameterError, match="11 tokens but 10 token ids"):
        hf.save(cache, path, model=model, token_ids=PROMPT[:-1])
    assert not path.exists()
    hf.save(cache, path, model=model, token_ids=PROMPT)
    with pytest.raises(kvpack.KvpackError):
        hf.save(cache, path, model=model, token_ids=PROMPT)  # exists, no force
    hf.save(cache, path, model=model, token_ids=PROMPT, force=True)
    with pytest.raises(kvpack.ParameterError, match="written by kvpack.hf.save itself"):
        hf.save(cache, tmp_path / "x.kvpack", model=model, token_ids=PROMPT, metadata={"hf.format": "x"})
    static = transformers.StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(kvpack.ParameterError, match="StaticSlidingWindowLayer"):
        hf.save(static, tmp_path / "s.kvpack", model=model, token_ids=PROMPT)


def test_load_refuses_a_file_not_written_by_kvpack_hf(tmp_path):
    k = torch.zeros(1, 2, 3, 16)
    path = tmp_path / "plain.kvpack"
    kvpack.compress([(k, k)], "raw", path=str(path))
    with pytest.raises(kvpack.ParameterError, match="hf.format"):
        hf.load(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run on the GPU machine)")
def test_cuda_cache_saves_and_loads_onto_the_gpu(tmp_path):
    model = build("gemma3").to("cuda")
    with torch.inference_mode():
        cache = model(input_ids=torch.tensor([PROMPT], device="cuda"), use_cache=True).past_key_values
    path = tmp_path / "gpu.kvpack"
    hf.save(cache, path, model=model, token_ids=PROMPT)
    loaded = hf.load(path, model=model, device="cuda")
    assert loaded.layers[1].keys.device.type == "cuda"
    for a, b in zip(cache.layers, loaded.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    nxt = torch.tensor([NEXT], device="cuda")
    with torch.inference_mode():
        want = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
        got = model(input_ids=nxt, past_key_values=loaded, use_cache=True).logits
    assert torch.equal(want, got)


def test_bits_plans_the_file_without_naming_a_codec(tmp_path):
    model = build("llama")
    cache = prefill(model, PROMPT)
    path = tmp_path / "planned.kvpack"
    # 11 tokens of an fp32 cache: the container alone costs about 8
    # bits/element here.
    res = hf.save(cache, path, model=model, token_ids=PROMPT, bits=48.0)
    assert res.codec.startswith("plan:") and res.bits_per_element <= 48.0
    loaded = hf.load(path, model=model)
    assert loaded.get_seq_length() == len(PROMPT)


def test_a_sliding_window_of_one_token_is_refused_on_save(tmp_path):
    model = build("gemma3", sliding_window=1)
    cache = prefill(model, PROMPT)
    with pytest.raises(kvpack.ParameterError, match="sliding window of 1"):
        hf.save(cache, tmp_path / "w1.kvpack", model=model, token_ids=PROMPT)
    assert not (tmp_path / "w1.kvpack").exists()
