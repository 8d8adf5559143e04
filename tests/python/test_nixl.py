"""kvpack.nixl: the prefill-to-decode handoff over NIXL, host DRAM to host
DRAM between two processes (UCX on loopback), on the committed real
fixture's KV cache (tiled to more tokens so layers span several pages).

Skipped, with the reason printed, when NIXL is not installed (``pip install
nixl``); CI has none.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket

import numpy as np
import pytest

import kvpack
from kvpack import nixl as kn
from kvpack.nixl import caches as kc
from paged_cache import BLOCK, TOKENS
from paged_cache import as_flash_attn as _as_flash_attn
from paged_cache import fixture as _fixture
from paged_cache import fixture_layers as _fixture_layers
from paged_cache import paged as _paged
from paged_cache import relayout as _relayout
from paged_cache import unpaged as _unpaged

pytestmark = pytest.mark.skipif(not kn.available(), reason="NIXL is not installed (pip install nixl): handoff tests skipped")

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_device(cache, device):
    """A uint16 (bf16 bits) numpy cache as a bf16 torch tensor on ``device``
    (``"cpu"``: the numpy array itself)."""
    if device == "cpu":
        return cache
    import torch

    return torch.from_numpy(cache.view(np.int16)).view(torch.bfloat16).to(device)


def _to_host(cache):
    if isinstance(cache, tuple):
        return tuple(_to_host(c) for c in cache)
    if isinstance(cache, np.ndarray):
        return cache
    import torch

    return cache.cpu().view(torch.int16).numpy().view(np.uint16)


def _prefill(port, spec_json, block_ids, num_blocks, q, back, device="cpu", memory="DRAM", layout="flash_attn", poison=None):
    """Child process: the prefill worker (``poison``: a layer whose keys get
    a NaN, which the codecs refuse)."""
    try:
        spec = kn.HandoffSpec.from_json(spec_json)
        layers = _fixture_layers(spec.num_layers)
        if poison is not None:
            layers[poison][0][0, 3, 5] = 0x7FC0  # bf16 NaN
        caches = [_to_device(c, device) for c in _paged(layers, block_ids, num_blocks, layout)]
        tx = kn.Sender("prefill", port=port)
        q.put("ready")
        out = tx.accept(model=spec.model, timeout=60, memory=memory)
        failed = []
        for layer in range(spec.num_layers):
            try:
                out.send_layer(layer, caches[layer], block_ids, layout=layout)
            except kvpack.ParameterError:
                failed.append(layer)
        out.finish(timeout=60)
        q.put(f"done, failed {failed}")
        back.get(timeout=120)  # keep the agent alive until the decode side is done
    except BaseException as e:  # reported to the parent
        q.put(f"error: {e!r}")


def _handoff(codec, *, n_layers=3, corrupt=None, device="cpu", memory="DRAM", layout="flash_attn", poison=None):
    """Runs one handoff; returns (spec, decoded caches, reference layers,
    decode block ids, TransferErrors by layer)."""
    spec_probe = _fixture().tensors[0]
    spec = kn.HandoffSpec(
        model="gemma3-270m-test", codec=codec, num_layers=n_layers, kv_heads=spec_probe.kv_heads,
        head_dim=spec_probe.head_dim, num_tokens=TOKENS, block_size=BLOCK, dtype="bf16",
    )
    nb = spec.num_blocks()
    rng = np.random.default_rng(7)
    pre_blocks = [int(b) for b in rng.permutation(nb + 8)[:nb]]  # scattered blocks
    dec_blocks = list(range(5, 5 + nb))  # one contiguous run, offset
    port = _free_port()
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_prefill, args=(port, spec.to_json(), pre_blocks, nb + 8, q, back, device, memory, layout, poison))
    p.start()
    try:
        assert q.get(timeout=60) == "ready"
        rx = kn.Receiver("decode", port=_free_port())
        rx.connect("prefill", "127.0.0.1", port)
        inc = rx.expect(spec, dec_blocks, peer="prefill", memory=memory)
        zeros = np.zeros((2, nb + 5, BLOCK, spec.kv_heads, spec.head_dim), np.uint16)
        caches = [_to_device(_relayout(zeros.copy(), layout), device) for _ in range(n_layers)]
        errors = {}
        for layer in range(n_layers):
            if corrupt is not None and layer == corrupt[0]:
                frame = inc.wait_layer(layer)
                i = corrupt[1](len(frame))
                frame[i] = frame[i] ^ 0x10  # a flipped bit in flight
            try:
                inc.decode_layer(layer, caches[layer], layout=layout)
            except kn.TransferError as e:
                errors[layer] = e
        msg = q.get(timeout=60)
        assert msg == f"done, failed {[] if poison is None else [poison]}", msg
        back.put("bye")
        inc.close()
        rx.close()
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    return spec, [_as_flash_attn(_to_host(c), layout) for c in caches], _fixture_layers(n_layers), dec_blocks, errors


@pytest.mark.parametrize("codec", ["raw", "bdr128"])
def test_host_handoff_matches_local_decode(codec):
    spec, caches, ref, blocks, errors = _handoff(codec)
    assert errors == {}
    for layer, (k, v) in enumerate(ref):
        # What the same codec gives locally, in one process, no NIXL.
        want = kvpack.open(kvpack.compress({(layer, "K"): k, (layer, "V"): v}, codec, dtype="bf16").data).decode(dtype="bf16")
        got_k, got_v = _unpaged(caches[layer], blocks, TOKENS)
        np.testing.assert_array_equal(got_k, np.asarray(want[(layer, "K")])[0].view(np.uint16))
        np.testing.assert_array_equal(got_v, np.asarray(want[(layer, "V")])[0].view(np.uint16))
        if codec == "raw":
            np.testing.assert_array_equal(got_k, k)
        # blocks outside the table stay untouched
        assert not caches[layer][:, :5].any()


def test_prefill_failure_names_the_layer_on_the_decode_side():
    spec, caches, ref, blocks, errors = _handoff("bdr128", n_layers=3, poison=1)
    assert list(errors) == [1]
    e = errors[1]
    assert e.cause == "peer" and "encode failed" in str(e) and "non-finite" in str(e), str(e)
    assert e.blocks == blocks and e.tokens == [(0, TOKENS)]
    assert not caches[1].any() and caches[0].any() and caches[2].any()


@contextlib.contextmanager
def _agents(name):
    """A prefill and a decode agent of this process, introduced to each other."""
    tx, rx = kn.Sender(f"{name}-prefill"), kn.Receiver(f"{name}-decode")
    try:
        tx.add_peer(rx.metadata())
        rx.add_peer(tx.metadata())
        yield tx, rx
    finally:
        tx.close()
        rx.close()


SMALL = dict(model="m", codec="raw", num_layers=2, kv_heads=1, head_dim=64, num_tokens=40, block_size=16)


def test_nothing_arriving_is_a_timeout_naming_every_block():
    with _agents("t") as (tx, rx):
        spec = kn.HandoffSpec(**SMALL)
        inc = rx.expect(spec, [7, 8, 9], peer="t-prefill")
        out = tx.accept(model="m", timeout=10)
        assert out.remote_blocks == [7, 8, 9] and out.spec == spec
        with pytest.raises(kn.TransferError) as e:
            inc.wait_layer(0, timeout=0.3)
        assert e.value.cause == "timeout" and e.value.blocks == [7, 8, 9] and e.value.layer == 0
        with pytest.raises(kvpack.ParameterError):
            inc.wait_layer(2)
        out.close()
        inc.close()


def test_malformed_notifications_are_ignored():
    """Notifications of the request that are not what a prefill side sends
    (not JSON, not an object, missing or non-numeric fields, a layer outside
    the spec) are dropped; the real layers still decode exactly."""
    from kvpack.nixl.agent import _LAYER

    with _agents("m") as (tx, rx):
        inc = rx.expect(kn.HandoffSpec(**SMALL), [0, 1, 2], peer="m-prefill")
        out = tx.accept(model="m", timeout=10)
        r = inc.request.encode()
        for junk in [b"{not json", b"[1, 2]", b'"text"', b'{"r": "%s"}' % r, b'{"r": "%s", "l": "x", "n": 1, "e": 0, "p": 0}' % r,
                     b'{"r": "%s", "l": 7, "n": 64, "e": 0, "p": 0}' % r, b'{"r": "%s", "l": 0, "n": null, "e": 0, "p": 0}' % r]:
            tx._notify("m-decode", _LAYER + junk)
        rng = np.random.default_rng(3)
        src = [rng.integers(0, 0x3F00, size=(2, 3, 16, 1, 64), dtype=np.uint16) for _ in range(2)]
        dst = [np.zeros_like(a) for a in src]
        for layer in range(2):
            out.send_layer(layer, src[layer], [0, 1, 2])
        tokens = lambda a: a.reshape(2, -1, 64)[:, :40]  # noqa: E731 (blocks 0, 1, 2 in order: [K/V, token, head_dim])
        for layer in range(2):
            inc.decode_layer(layer, dst[layer], timeout=10)
            assert np.array_equal(tokens(dst[layer]), tokens(src[layer]))
        out.finish()
        out.close()
        inc.close()


def test_ticket_for_another_model_is_refused_on_both_sides():
    tx, rx = kn.Sender("m-prefill"), kn.Receiver("m-decode")
    try:
        tx.add_peer(rx.metadata())
        rx.add_peer(tx.metadata())
        spec = kn.HandoffSpec(model="other", codec="raw", num_layers=1, kv_heads=1, head_dim=64, num_tokens=16, block_size=16)
        inc = rx.expect(spec, [0], peer="m-prefill")
        with pytest.raises(kvpack.ParameterError, match="other"):
            tx.accept(model="mine", timeout=10)
        with pytest.raises(kn.TransferError) as e:
            inc.wait_layer(0, timeout=10)
        assert e.value.cause == "peer" and "mine" in str(e.value)
        inc.close()
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("layout", ["flashinfer", "hnd"])
def test_host_handoff_other_layouts(layout):
    spec, caches, ref, blocks, errors = _handoff("raw", n_layers=2, layout=layout)
    assert errors == {}
    for layer, (k, v) in enumerate(ref):
        got_k, got_v = _unpaged(caches[layer], blocks, TOKENS)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)


def test_cache_that_does_not_match_the_spec_is_refused():
    spec = kn.HandoffSpec(model="m", codec="raw", num_layers=1, kv_heads=8, head_dim=128, num_tokens=64, block_size=16)
    with pytest.raises(kvpack.ParameterError, match="block_size"):
        kc._check_cache(np.zeros((2, 4, 32, 8, 128), np.uint16), "flash_attn", spec)
    with pytest.raises(kvpack.ParameterError, match="pair"):
        kc._check_cache(np.zeros((2, 4, 16, 8, 128), np.uint16), "hnd", spec)
    kc._check_cache((np.zeros((4, 8, 16, 128)),) * 2, "hnd", spec)
    kc._check_cache(np.zeros((4, 2, 16, 8, 128)), "flashinfer", spec)


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])  # decoded in place / via scratch + scatter
def test_flipped_byte_in_flight_names_layer_and_blocks(layout):
    # Flip a bit in the middle of layer 1's landed frame: inside a page body.
    spec, caches, ref, blocks, errors = _handoff("bdr128", corrupt=(1, lambda n: n // 2), layout=layout)
    assert list(errors) == [1]
    e = errors[1]
    assert e.layer == 1 and e.cause == "corrupt" and "CRC mismatch" in str(e)
    assert len(e.tokens) == 1
    lo, hi = e.tokens[0]
    assert hi - lo <= 256 and hi <= TOKENS
    want_blocks = [blocks[i] for i in range(lo // BLOCK, -(-hi // BLOCK))]
    assert e.blocks == want_blocks
    # every other block of layer 1 was decoded and is right
    ref_file = kvpack.compress({(1, "K"): ref[1][0], (1, "V"): ref[1][1]}, "bdr128", dtype="bf16").data
    want = kvpack.open(ref_file).decode(dtype="bf16")
    got_k, got_v = _unpaged(caches[1], blocks, TOKENS)
    wk = np.asarray(want[(1, "K")])[0].view(np.uint16)
    wv = np.asarray(want[(1, "V")])[0].view(np.uint16)
    keep = np.ones(TOKENS, bool)
    keep[lo:hi] = False
    np.testing.assert_array_equal(got_k[:, keep], wk[:, keep])
    np.testing.assert_array_equal(got_v[:, keep], wv[:, keep])
    # layers 0 and 2 are intact
    assert np.array_equal(_unpaged(caches[2], blocks, TOKENS)[0], kvpack.open(
        kvpack.compress({(2, "K"): ref[2][0], (2, "V"): ref[2][1]}, "bdr128", dtype="bf16").data
    ).decode(dtype="bf16")[(2, "K")][0].view(np.uint16))


def test_flipped_header_byte_loses_the_whole_layer():
    spec, caches, ref, blocks, errors = _handoff("raw", n_layers=2, corrupt=(0, lambda n: 9))
    assert list(errors) == [0]
    assert errors[0].blocks == blocks and errors[0].tokens == [(0, TOKENS)]


def test_spec_checks():
    with pytest.raises(kvpack.ParameterError):
        kn.HandoffSpec(model="m", codec="bdr128", num_layers=0, kv_heads=1, head_dim=64, num_tokens=1, block_size=16)
    s = kn.HandoffSpec(model="m", codec="bdr128", num_layers=2, kv_heads=8, head_dim=128, num_tokens=4096, block_size=16)
    assert kn.HandoffSpec.from_json(s.to_json()) == s
    raw = kn.HandoffSpec(**{**s.to_json(), "codec": "raw"})
    # bdr128 slot: well under the raw slot (which holds 2*8*4096*128 bf16 plus structure)
    assert raw.slot_bytes() >= 2 * 8 * 4096 * 128 * 2
    assert s.slot_bytes() < 0.3 * raw.slot_bytes()
    with pytest.raises(kvpack.ParameterError):
        kn.HandoffSpec.from_json({"model": "m"})


# --------------------------------------------------------------------------
# GPU to GPU (run on a CUDA machine; skipped elsewhere with the reason)


def _gpu_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    import kvpack.cuda

    if not (torch.cuda.is_available() and kvpack.cuda.available()):
        return "needs a CUDA GPU and a kvpack build with the cuda feature"
    return None


# A string condition: evaluated when a test runs, not when the spawned
# children import this module (importing torch there would cost seconds).
gpu_only = pytest.mark.skipif(
    "_gpu_reason() is not None", reason="GPU handoff: needs torch, a CUDA GPU and a kvpack build with the cuda feature"
)


@gpu_only
@pytest.mark.parametrize("memory", ["VRAM", "DRAM"])
@pytest.mark.parametrize("codec", ["raw", "bdr128", "int4", "turbo:b4", "polar:m4n4", "hqmq:s96r4"])
def test_gpu_handoff_is_bit_exact_with_the_cpu_codec(codec, memory):
    """Paged GPU caches on both sides (two processes, one GPU), NIXL
    buffers in GPU memory (VRAM) or host memory (DRAM): the decode side's
    cache equals the CPU codec's round trip of the same layer."""
    spec, caches, ref, blocks, errors = _handoff(codec, device="cuda", memory=memory)
    assert errors == {}
    for layer, (k, v) in enumerate(ref):
        want = kvpack.open(kvpack.compress({(layer, "K"): k, (layer, "V"): v}, codec, dtype="bf16").data).decode(dtype="bf16")
        got_k, got_v = _unpaged(caches[layer], blocks, TOKENS)
        np.testing.assert_array_equal(got_k, np.asarray(want[(layer, "K")])[0].view(np.uint16))
        np.testing.assert_array_equal(got_v, np.asarray(want[(layer, "V")])[0].view(np.uint16))
        assert not caches[layer][:, :5].any()


@gpu_only
def test_gpu_flipped_byte_in_vram_names_layer_and_every_block():
    spec, caches, ref, blocks, errors = _handoff("bdr128", device="cuda", memory="VRAM", corrupt=(1, lambda n: n // 2))
    assert list(errors) == [1]
    e = errors[1]
    assert e.cause == "corrupt" and "CRC mismatch" in str(e) and len(e.tokens) == 1
    # a CUDA cache's layer decodes all or nothing: every block is named, none written
    assert e.blocks == blocks
    assert not caches[1].any()
