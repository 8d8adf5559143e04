"""kvpack.paged: one layer encoded straight from a host paged cache, and
decoded straight into one, on the committed real fixture's KV cache (tiled
to 1000 tokens: 4 pages per tensor, the last partial; 63 blocks of 16,
shuffled)."""

from __future__ import annotations

import numpy as np
import pytest

import kvpack
from kvpack import paged as kp
from paged_cache import BLOCK, TOKENS, as_flash_attn, fixture_layers, paged, relayout, unpaged

LAYOUTS = ("flash_attn", "flashinfer", "hnd")
CODECS = ("bdr128", "int4", "int3", "raw", "turbo:b4", "hqmq:s24r3")
NUM_BLOCKS = 80


@pytest.fixture(scope="module")
def layers():
    return fixture_layers(2)


def _table(seed):
    n = -(-TOKENS // BLOCK)
    return [int(b) for b in np.random.default_rng(seed).permutation(NUM_BLOCKS)[:n]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", CODECS)
def test_encode_paged_equals_compress_of_the_gathered_layer(layers, layout, codec):
    blocks = _table(1)
    cache = paged(layers, blocks, NUM_BLOCKS, layout)[1]
    k, v = layers[1]
    want = kvpack.compress({(1, "K"): k[None], (1, "V"): v[None]}, codec, dtype="bf16").data
    got = kp.encode_paged(cache, blocks, TOKENS, codec, layout=layout, layer=1, dtype="bf16")
    assert got == want
    # Into a caller buffer, and with the block table as an int32 array.
    buf = np.zeros(len(want) + 100, np.uint8)
    n = kp.encode_paged(cache, np.asarray(blocks, np.int32), TOKENS, codec, layout=layout, layer=1, dtype="bf16", out=buf)
    assert n == len(want) and bytes(buf[:n]) == want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", ("bdr128", "int4", "turbo:b4"))
def test_decode_paged_writes_the_files_rows_into_the_blocks(layers, layout, codec):
    k, v = layers[0]
    data = kvpack.compress({(0, "K"): k[None], (0, "V"): v[None]}, codec, dtype="bf16").data
    want = kvpack.open(data).decode(dtype="bf16")
    blocks = _table(2)
    cache = relayout(np.zeros((2, NUM_BLOCKS, BLOCK, k.shape[0], k.shape[2]), np.uint16), layout)
    kp.decode_paged(data, cache, blocks, layer=0, layout=layout, dtype="bf16")
    fa = as_flash_attn(cache, layout)
    got_k, got_v = unpaged(fa, blocks, TOKENS)
    assert np.array_equal(got_k, np.asarray(want[(0, "K")])[0].view(np.uint16))
    assert np.array_equal(got_v, np.asarray(want[(0, "V")])[0].view(np.uint16))
    # Blocks not in the table are untouched; so is the tail of the last block.
    others = [b for b in range(NUM_BLOCKS) if b not in blocks]
    assert not fa[:, others].any()
    assert not fa[:, blocks[-1], TOKENS % BLOCK :].any()
    # A kvpack.Archive decodes the same.
    again = relayout(np.zeros_like(as_flash_attn(cache, layout)), layout)
    kp.decode_paged(kvpack.open(data), again, blocks, layer=0, layout=layout, dtype="bf16")
    assert np.array_equal(as_flash_attn(again, layout), fa)


def test_token_ranges_bad_tables_and_corruption(layers):
    k, v = layers[0]
    blocks = _table(3)
    cache = paged(layers, blocks, NUM_BLOCKS)[0]
    data = kp.encode_paged(cache, blocks, TOKENS, "bdr128", dtype="bf16")
    out = np.zeros_like(cache)
    kp.decode_paged(data, out, blocks, layer=0, dtype="bf16", tokens=(256, 512))
    got_k, _ = unpaged(out, blocks, TOKENS)
    full = np.zeros_like(cache)
    kp.decode_paged(data, full, blocks, layer=0, dtype="bf16")
    want_k, _ = unpaged(full, blocks, TOKENS)
    assert np.array_equal(got_k[:, 256:512], want_k[:, 256:512])
    assert not got_k[:, :256].any() and not got_k[:, 512:].any()
    for bad, why in ((blocks[:10], "block ids"), (blocks[:-1] + [blocks[0]], "used twice"), (blocks[:-1] + [NUM_BLOCKS], "outside")):
        with pytest.raises(kvpack.ParameterError, match=why):
            kp.encode_paged(cache, bad, TOKENS, "bdr128", dtype="bf16")
        with pytest.raises(kvpack.ParameterError, match=why):
            kp.decode_paged(data, out, bad, layer=0, dtype="bf16")
    with pytest.raises(kvpack.ParameterError, match="1000 stored"):
        kp.decode_paged(data, out, blocks, layer=0, dtype="bf16", tokens=(0, 1001))
    with pytest.raises(kvpack.ParameterError, match="no K tensor for layer 3"):
        kp.decode_paged(data, out, blocks, layer=3, dtype="bf16")
    with pytest.raises(ValueError, match="contiguous"):
        kp.encode_paged(cache[:, ::2], blocks, TOKENS, "bdr128", dtype="bf16")
    # A flipped byte in the middle of the file: refused, naming the page.
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(kvpack.FormatError):
        kp.decode_paged(bytes(bad), out, blocks, layer=0, dtype="bf16")


def test_cpu_torch_caches_code_like_numpy(layers):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    blocks = _table(4)
    cache = paged(layers, blocks, NUM_BLOCKS, "flashinfer")[0]
    t = torch.from_numpy(cache.view(np.int16)).view(torch.bfloat16)
    want = kp.encode_paged(cache, blocks, TOKENS, "bdr128", layout="flashinfer", dtype="bf16")
    assert kp.encode_paged(t, torch.tensor(blocks), TOKENS, "bdr128", layout="flashinfer") == want
    out = torch.zeros_like(t)
    kp.decode_paged(want, out, blocks, layer=0, layout="flashinfer")
    ref = np.zeros_like(cache)
    kp.decode_paged(want, ref, blocks, layer=0, layout="flashinfer", dtype="bf16")
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), ref)


@pytest.mark.parametrize("head_dim", [3, 5, 33])
@pytest.mark.parametrize("bits", [3, 4, 5])
def test_rows_that_share_bytes_code_and_decode_like_the_archive(head_dim, bits):
    """int codes of rows that do not fill whole bytes (odd head_dims at 4
    bits, 3 and 5 bits at any head_dim) run on from row to row: the paged
    encoder writes kvpack.compress's bytes and the paged decoder the
    archive's rows (int4 at an odd head_dim once panicked on decode)."""
    rng = np.random.default_rng(head_dim * 10 + bits)
    nb, block, ntok = 6, 16, 70
    x = (rng.standard_normal((2, nb, block, 2, head_dim)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    blocks = [4, 1, 5, 0, 2]
    codec = f"int{bits}"
    data = kp.encode_paged(x, blocks, ntok, codec, dtype="bf16")
    rows = lambda kind: x[kind][blocks].reshape(-1, 2, head_dim)[:ntok].transpose(1, 0, 2)  # noqa: E731
    want = kvpack.compress([(rows(0)[None].copy(), rows(1)[None].copy())], codec, dtype="bf16").data
    assert data == want
    out = np.zeros_like(x)
    kp.decode_paged(data, out, blocks, layer=0, dtype="bf16")
    dec = kvpack.open(data).decode(dtype="bf16")
    for kind, key in enumerate([(0, "K"), (0, "V")]):
        got = out[kind][blocks].reshape(-1, 2, head_dim)[:ntok].transpose(1, 0, 2)
        assert np.array_equal(got.view(np.uint16), np.asarray(dec[key])[0].view(np.uint16))
