"""kvpack.cuda: decode into and encode out of vLLM-style paged KV caches on
the GPU (FlashAttention, FlashInfer and HND layouts, bf16 and fp16), bit
for bit against the CPU decoder and byte for byte against kvpack.compress.

Needs torch; the GPU tests also need a CUDA device and a kvpack build with
the `cuda` cargo feature (`maturin build -F cuda`), and skip otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvpack
import kvpack.cuda

torch = pytest.importorskip("torch", reason="kvpack.cuda takes torch tensors; torch is not installed")

HAVE_CUDA = torch.cuda.is_available() and kvpack.cuda.available()
cuda_only = pytest.mark.skipif(
    not HAVE_CUDA,
    reason="needs a CUDA GPU and a kvpack build with the cuda feature (maturin build -F cuda)",
)

LAYOUTS = ["flash_attn", "flashinfer", "hnd"]
DTYPES = [torch.bfloat16, torch.float16]
# Every codec family the GPU decodes.
DECODE_CODECS = [
    "raw",
    "int4",
    "bdr64",
    "hqmq:s96r4",
    "hqmq:s24r3+med3",
    "polar:m4n4",
    "kivi:2",
    "innerq:k2v2",
    "turbo:b3",
    "octopus:b3",
]
# GPU encoders (int, bdr, hqmq, octopus, turbo) and host fallbacks (the rest).
ENCODE_CODECS = [
    "raw",
    "int4",
    "bdr64",
    "hqmq:s96r4",
    "turbo:b3+qjl",
    "octopus:b3",
    "kivi:2",
    "polar:m4n4",
]

HEADS, HEAD_DIM, TOKENS, BLOCK, NUM_BLOCKS = 2, 64, 75, 16, 9
SENTINEL = 0x7FC1  # a NaN bit pattern no decoder writes


def layer(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HEADS, TOKENS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(1, HEADS, TOKENS, HEAD_DIM, generator=g).to(dtype)
    return k, v


def block_table(seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    n = -(-TOKENS // BLOCK)
    return torch.randperm(NUM_BLOCKS, generator=g)[:n].tolist()


def empty_cache(layout, dtype):
    """The cache tensor(s), every element the sentinel bit pattern."""
    if layout == "flash_attn":
        shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    elif layout == "flashinfer":
        shape = (NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM)
    else:
        shape = (NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)
    make = lambda: torch.full(shape, SENTINEL, dtype=torch.int16, device="cuda").view(dtype)  # noqa: E731
    return (make(), make()) if layout == "hnd" else make()


def rows(cache, layout, ids, kind):
    """A view-free copy of K (kind 0) or V (1): [HEADS, TOKENS, HEAD_DIM],
    gathered with torch indexing (not kvpack's addressing)."""
    t = torch.arange(TOKENS, device="cuda")
    blk = torch.tensor(ids, device="cuda")[t // BLOCK]
    r = t % BLOCK
    if layout == "flash_attn":
        x = cache[kind][blk, r]  # [T, H, D]
    elif layout == "flashinfer":
        x = cache[blk, kind, r]  # [T, H, D]
    else:
        x = cache[kind][blk, :, r]  # [T, H, D]
    return x.permute(1, 0, 2)


def scatter(cache, layout, ids, kind, src):
    """Writes src [HEADS, TOKENS, HEAD_DIM] into the block table's rows."""
    t = torch.arange(TOKENS, device="cuda")
    blk = torch.tensor(ids, device="cuda")[t // BLOCK]
    r = t % BLOCK
    x = src.to("cuda").permute(1, 0, 2)  # [T, H, D]
    if layout == "flash_attn":
        cache[kind][blk, r] = x
    elif layout == "flashinfer":
        cache[blk, kind, r] = x
    else:
        cache[kind][blk, :, r] = x


def bits(x):
    return x.contiguous().view(torch.int16)


def untouched(cache, layout, ids):
    """Every element of the blocks outside the block table is the sentinel."""
    others = [b for b in range(NUM_BLOCKS) if b not in ids]
    parts = list(cache) if layout == "hnd" else [cache]
    for c in parts:
        if layout == "flash_attn":
            sel = c[:, others]
        else:
            sel = c[others]
        assert bool((bits(sel) == SENTINEL).all()), f"{layout}: a block outside the table was written"


@cuda_only
@pytest.mark.parametrize("codec", DECODE_CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_paged_is_bit_exact(layout, dtype, codec):
    k, v = layer(dtype, seed=len(codec))
    data = kvpack.compress([(k, v)], codec, page_tokens=32).data
    want = kvpack.open(data).decode(dtype="bf16" if dtype == torch.bfloat16 else "fp16", output="torch")
    ids = block_table(len(codec))
    cache = empty_cache(layout, dtype)
    stats = kvpack.cuda.decode_paged(data, cache, ids, layer=0, layout=layout)
    torch.cuda.current_stream().synchronize()
    assert stats["pages"] > 0 and stats["output_bytes"] == 2 * HEADS * TOKENS * HEAD_DIM * 2
    for kind, key in enumerate([(0, "K"), (0, "V")]):
        got = bits(rows(cache, layout, ids, kind)).cpu()
        exp = bits(want[key][0])
        assert torch.equal(got, exp), f"{codec} {layout} {dtype} {key}: not bit-identical to the CPU"
    untouched(cache, layout, ids)
    # Bodies read in place from a device copy of the file: the same result.
    again = empty_cache(layout, dtype)
    dev = torch.from_numpy(np.frombuffer(data, np.uint8).copy()).cuda()
    st = kvpack.cuda.decode_paged(data, again, ids, layer=0, layout=layout, device_copy=dev)
    assert st["uploaded_bytes"] < stats["uploaded_bytes"]
    for a, b in zip(again if isinstance(again, tuple) else [again], cache if isinstance(cache, tuple) else [cache]):
        assert torch.equal(bits(a), bits(b)), f"{codec} {layout}: resident decode differs"
    with pytest.raises(kvpack.ParameterError):
        kvpack.cuda.decode_paged(data, again, ids, layer=0, layout=layout, device_copy=dev[:-1])
    # The file on the device only: checked on the GPU, decoded in place.
    third = empty_cache(layout, dtype)
    kvpack.cuda.decode_paged(dev, third, ids, layer=0, layout=layout)
    for a, b in zip(third if isinstance(third, tuple) else [third], cache if isinstance(cache, tuple) else [cache]):
        assert torch.equal(bits(a), bits(b)), f"{codec} {layout}: device decode differs"
    bad = dev.clone()
    bad[len(data) // 2] ^= 0x40
    fourth = empty_cache(layout, dtype)
    with pytest.raises(kvpack.FormatError):
        kvpack.cuda.decode_paged(bad, fourth, ids, layer=0, layout=layout)
    untouched(fourth, layout, [])


@cuda_only
@pytest.mark.parametrize("codec", ENCODE_CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_encode_paged_matches_compress_bytes(layout, dtype, codec):
    k, v = layer(dtype, seed=7)
    ids = block_table(3)
    cache = empty_cache(layout, dtype)
    scatter(cache, layout, ids, 0, k[0])
    scatter(cache, layout, ids, 1, v[0])
    data = kvpack.cuda.encode_paged(cache, ids, TOKENS, codec, layout=layout, page_tokens=32)
    want = kvpack.compress([(k, v)], codec, page_tokens=32).data
    assert data.dtype == np.uint8 and bytes(data) == want, f"{codec} {layout} {dtype}: file differs from kvpack.compress"
    buf = torch.empty(len(want) + 4096, dtype=torch.uint8)
    n = kvpack.cuda.encode_paged(cache, ids, TOKENS, codec, layout=layout, page_tokens=32, out=buf)
    assert n == len(want) and bytes(buf[:n].numpy()) == want
    # Into CUDA memory: the frames are built and checksummed on the GPU.
    dev = torch.full((len(want) + 4096,), 0xA5, dtype=torch.uint8, device="cuda")
    n = kvpack.cuda.encode_paged(cache, ids, TOKENS, codec, layout=layout, page_tokens=32, out=dev)
    assert n == len(want) and bytes(dev[:n].cpu().numpy()) == want, f"{codec} {layout}: device-framed file differs"
    assert bool((dev[n:] == 0xA5).all())
    ar = kvpack.open(data)
    assert [t.shape for t in ar.tensors] == [(1, HEADS, TOKENS, HEAD_DIM)] * 2


@cuda_only
def test_caller_stream_and_async_job():
    dtype = torch.bfloat16
    k, v = layer(dtype, seed=11)
    data = kvpack.compress([(k, v)], "bdr64", page_tokens=32).data
    want = kvpack.open(data).decode(dtype="bf16", output="torch")
    ids = block_table(5)
    side = torch.cuda.Stream()
    for how in ("current", "explicit"):
        cache = empty_cache("flash_attn", dtype)
        # The cache was filled on the default stream: order the side stream after it.
        side.wait_stream(torch.cuda.current_stream())
        if how == "current":
            with torch.cuda.stream(side):
                job = kvpack.cuda.decode_paged(kvpack.open(data), cache, ids, layer=0, wait=False)
        else:
            job = kvpack.cuda.decode_paged(data, cache, ids, layer=0, stream=side, wait=False)
        stats = job.wait()
        assert stats is not None and job.done() and job.wait() is None
        torch.cuda.current_stream().wait_stream(side)
        got = bits(rows(cache, "flash_attn", ids, 0)).cpu()
        assert torch.equal(got, bits(want[(0, "K")][0])), how


@cuda_only
def test_bad_block_tables_are_parameter_errors():
    k, v = layer(torch.float16)
    data = kvpack.compress([(k, v)], "int4", page_tokens=32).data
    cache = empty_cache("flashinfer", torch.float16)
    for ids in ([0, 1], [0, 1, 2, 3, 9], [0, 1, 1, 2, 3], [0, -1, 2, 3, 4]):
        with pytest.raises(kvpack.ParameterError):
            kvpack.cuda.decode_paged(data, cache, ids, layer=0, layout="flashinfer")
    with pytest.raises(kvpack.ParameterError):
        kvpack.cuda.decode_paged(data, cache, block_table(), layer=3, layout="flashinfer")
    untouched(cache, "flashinfer", [])


def test_host_tensors_and_bad_layouts_are_refused():
    """Runs without a GPU: the checks before any CUDA call."""
    k, v = layer(torch.bfloat16)
    data = kvpack.compress([(k, v)], "int4", page_tokens=32).data
    cpu_cache = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(kvpack.ParameterError):
        kvpack.cuda.decode_paged(data, cpu_cache, block_table(), layer=0, layout="nhd")
    with pytest.raises(kvpack.ParameterError):
        kvpack.cuda.decode_paged(data, cpu_cache, block_table(), layer=0, layout="hnd")
    with pytest.raises((ValueError, kvpack.UnsupportedError)):
        kvpack.cuda.decode_paged(data, cpu_cache, block_table(), layer=0, stream=0)


# head_dims the tests above do not use (Phi-3: 96, MLA-style 192, small
# models 40-80, and odd ones whose int4 rows share bytes); bdr takes the
# largest block that divides head_dim (none for an odd one: refused on both).
ODD_HEAD_DIMS = [5, 33, 40, 80, 96, 192]
ODD_CODECS = ["int4", "bdr{h}", "hqmq:s24r3+ctr", "hqmq:s96r4+med3", "polar:m4n4", "innerq:k2v2", "kivi:2", "turbo:b4", "octopus:b3"]


@cuda_only
@pytest.mark.parametrize("head_dim", ODD_HEAD_DIMS)
@pytest.mark.parametrize("codec", ODD_CODECS)
def test_encode_and_decode_at_other_head_dims_match_the_cpu(head_dim, codec):
    """GPU encode = the host paged encoder's bytes, GPU decode = the host
    decoder's bits; a codec the CPU refuses for the shape (TurboQuant's
    Walsh-Hadamard transform at a head_dim that is not a power of two) is
    refused on the GPU too."""
    from kvpack import paged

    codec = codec.replace("{h}", str(1 << min((head_dim & -head_dim).bit_length() - 1, 7)))
    heads, block, ntok = 3, 16, 300
    nb = -(-ntok // block) + 4
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(2, nb, block, heads, head_dim, generator=g) * (1 + 4 * (torch.rand(head_dim, generator=g) > 0.9))
    gpu = x.to(torch.bfloat16).cuda()
    host = gpu.cpu().view(torch.int16).numpy().view(np.uint16)
    blocks = [int(b) for b in np.random.default_rng(head_dim).permutation(nb)[: -(-ntok // block)]]
    try:
        ref = paged.encode_paged(host, blocks, ntok, codec, dtype="bf16")
    except kvpack.ParameterError:
        with pytest.raises(kvpack.ParameterError):
            kvpack.cuda.encode_paged(gpu, np.asarray(blocks, np.int32), ntok, codec)
        return
    got = kvpack.cuda.encode_paged(gpu, np.asarray(blocks, np.int32), ntok, codec)
    assert bytes(got) == bytes(ref)
    out_gpu = torch.zeros_like(gpu)
    kvpack.cuda.decode_paged(bytes(ref), out_gpu, np.asarray(blocks, np.int64), layer=0)
    out_host = np.zeros_like(host)
    paged.decode_paged(bytes(ref), out_host, blocks, layer=0, dtype="bf16")
    assert np.array_equal(out_gpu.cpu().view(torch.int16).numpy().view(np.uint16), out_host)


@cuda_only
@pytest.mark.parametrize("how", [dict(bits=3.5), dict(bits=5.0), dict(key_codec="hqmq:s48r4+ctr", codec="hqmq:s12r2", sink=1)],
                         ids=["bits3.5", "bits5", "split"])
def test_planned_and_split_files_decode_on_the_gpu(how):
    """Files whose tensors use different codecs and sink windows (the
    planner's, a K/V split) decode into a paged cache on the GPU bit for
    bit as on the CPU, layer by layer, from host bytes and in place on the
    device."""
    g = torch.Generator().manual_seed(7)
    layers = []
    for i in range(3):
        scale = 1 + 4 * (torch.rand(HEAD_DIM, generator=g) > 0.9)
        k = (torch.randn(1, HEADS, TOKENS, HEAD_DIM, generator=g) * scale).to(torch.bfloat16)
        v = torch.randn(1, HEADS, TOKENS, HEAD_DIM, generator=g).to(torch.bfloat16)
        layers.append((k, v))
    data = kvpack.compress(layers, page_tokens=32, **how).data
    ar = kvpack.open(data)
    want = ar.decode(dtype="bf16", output="torch")
    dev = torch.from_numpy(np.frombuffer(data, np.uint8).copy()).cuda()
    ids = block_table(3)
    for i in range(3):
        for src in (data, dev):
            cache = empty_cache("flash_attn", torch.bfloat16)
            kvpack.cuda.decode_paged(src, cache, ids, layer=i, layout="flash_attn")
            torch.cuda.current_stream().synchronize()
            for kind, key in enumerate([(i, "K"), (i, "V")]):
                got = bits(rows(cache, "flash_attn", ids, kind)).cpu()
                assert torch.equal(got, bits(want[key][0])), f"{how} layer {i} {key[1]}"
