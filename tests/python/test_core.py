"""The Python API on the committed real fixture (Gemma-3-270M KV cache) and
on synthetic edge cases: round trips, zero-copy decode into caller memory,
chunks, typed errors. numpy only; torch-dependent checks skip without it."""

from __future__ import annotations

import json
import os
import pathlib
import struct

import numpy as np
import pytest

import kvpack

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "gemma3-270m-gpl3-520.safetensors"


def load_fixture():
    """The fixture's K/V tensors as uint16 bf16 bit patterns, by (layer, kind),
    read with a tiny safetensors parser (numpy only)."""
    raw = FIXTURE.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        parts = name.split(".")
        if parts[0] != "past_key_values":
            continue
        a, b = t["data_offsets"]
        arr = np.frombuffer(raw[base + a : base + b], dtype=np.uint16).reshape(t["shape"])
        out[(int(parts[1]), "K" if parts[2] == "key" else "V")] = arr
    return out, meta


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="module")
def fixture():
    return load_fixture()


def test_raw_round_trip_is_bit_exact(fixture):
    kv, meta = fixture
    res = kvpack.compress(kv, "raw", dtype="bf16", model=meta["kvpack.model"], token_ids=json.loads(meta["kvpack.token_ids"]))
    assert res.codec == "raw"
    ar = kvpack.open(res.data)
    assert ar.model == "gemma-3-270m-q4_k_m"
    assert len(ar.token_ids) == 520
    assert ar.num_layers == 18
    got = ar.decode()
    assert set(got) == set(kv)
    for key, a in kv.items():
        b = got[key]
        b = b.view(np.uint16) if b.dtype != np.uint16 else b
        assert np.array_equal(a, b), key


def test_bdr128_matches_the_cli_figures(fixture):
    kv, _ = fixture
    res = kvpack.compress(kv, "bdr128", dtype="bf16")
    # 4.28 bits/element everything included, as `kvpack compress` reports
    # for this fixture; the file is the same bytes the CLI writes.
    assert 4.2 < res.bits_per_element < 4.4, res
    ar = kvpack.open(res.data)
    got = ar.decode(dtype="fp32")
    for key in [(0, "K"), (0, "V"), (17, "K")]:
        x = bf16_to_f32(kv[key]).ravel()
        y = got[key].ravel()
        cos = float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))
        assert cos > 0.99, (key, cos)


def test_decode_into_preallocated_numpy(fixture):
    kv, _ = fixture
    ar = kvpack.open(kvpack.compress(kv, "int4", dtype="bf16").data)
    ref = ar.decode(dtype="fp32")
    out = {key: np.empty(a.shape, np.float32) for key, a in kv.items()}
    ar.decode_into(out)
    for key in kv:
        assert np.array_equal(out[key], ref[key]), key
    # A token range into a token-major (strided) destination.
    t = ar.tensors[0]
    dst = np.zeros((t.batch, 100, t.kv_heads, t.head_dim), np.float32)
    ar.decode_into({(0, "K"): dst.transpose(0, 2, 1, 3)}, tokens=(50, 150))
    assert np.array_equal(dst.transpose(0, 2, 1, 3), ref[(0, "K")][:, :, 50:150])


def test_file_path_is_atomic_and_not_clobbered(tmp_path, fixture):
    kv, _ = fixture
    p = tmp_path / "c.kvpack"
    r = kvpack.compress(kv, "bdr128", dtype="bf16", path=p)
    assert r.data is None and p.stat().st_size == r.output_bytes
    with pytest.raises(kvpack.ParameterError, match="exists"):
        kvpack.compress(kv, "raw", dtype="bf16", path=p)
    assert p.stat().st_size == r.output_bytes
    kvpack.compress(kv, "raw", dtype="bf16", path=p, force=True)
    assert kvpack.open(p).codecs == ["raw"]
    assert kvpack.open(str(p)).tensors[0].head_dim == 256


def test_chunk_round_trip_and_bound():
    rng = np.random.default_rng(0)
    chunk = rng.standard_normal((2, 3, 256, 4 * 64)).astype(np.float32)
    for codec in ["raw", "int4", "bdr64", "hqmq:s96r4+med3", "polar:m4n4", "innerq:k2v2"]:
        bound = kvpack.chunk_max_size(chunk.shape, chunk.dtype, codec, head_dim=64)
        buf = np.zeros(bound, np.uint8)
        n = kvpack.encode_chunk(chunk, codec, head_dim=64, out=buf)
        assert 0 < n <= bound
        if "med" not in codec:
            assert n == bound, (codec, n, bound)  # exact for shape-only sizes
        assert kvpack.encode_chunk(chunk, codec, head_dim=64) == bytes(buf[:n])
        back = np.empty_like(chunk)
        kvpack.decode_chunk(buf[:n], back)
        if codec == "raw":
            assert np.array_equal(back, chunk)
        else:
            cos = float((back * chunk).sum() / np.linalg.norm(back) / np.linalg.norm(chunk))
            assert cos > 0.9, (codec, cos)
        # head_dim read from the file, fp16 output
        back16 = np.empty(chunk.shape, np.float16)
        kvpack.decode_chunk(bytes(buf[:n]), back16)
        assert np.allclose(back16, back, atol=1e-2, rtol=1e-2)


def test_chunk_out_too_small_and_bad_shapes():
    chunk = np.ones((2, 1, 16, 64), np.float16)
    with pytest.raises(kvpack.ParameterError, match="output buffer holds 10 bytes"):
        kvpack.encode_chunk(chunk, "raw", head_dim=64, out=np.zeros(10, np.uint8))
    with pytest.raises(kvpack.ParameterError, match="not a multiple"):
        kvpack.encode_chunk(chunk, "raw", head_dim=48)
    with pytest.raises(kvpack.ParameterError, match="expected"):
        kvpack.chunk_max_size((3, 1, 16, 64), "fp16", "raw", head_dim=64)


def test_errors_are_typed_and_located(fixture):
    kv, _ = fixture
    data = bytearray(kvpack.compress(kv, "bdr128", dtype="bf16").data)
    with pytest.raises(kvpack.FormatError) as e:
        kvpack.open(b"not a kvpack file at all")
    assert e.value.location == "file header"
    assert isinstance(e.value, ValueError)
    # A flipped byte inside a page: caught by the page CRC when decoded,
    # naming the page.
    data[len(data) // 2] ^= 0x40
    with pytest.raises(kvpack.FormatError) as e:
        kvpack.open(bytes(data)).decode()
    assert e.value.location.startswith("page #"), e.value.location
    with pytest.raises(kvpack.ParameterError, match="unknown codec"):
        kvpack.compress(kv, "zzz9", dtype="bf16")
    with pytest.raises(kvpack.ParameterError, match="power of two"):
        kvpack.compress(kv, "bdr999", dtype="bf16")
    with pytest.raises(kvpack.KvpackIOError) as e:
        kvpack.open("/nonexistent/cache.kvpack")
    assert isinstance(e.value, OSError) and e.value.errno == 2
    # head_dim 256 is not a multiple of bdr512's block.
    with pytest.raises(kvpack.ParameterError):
        kvpack.compress(kv, "bdr512", dtype="bf16")
    with pytest.raises(ValueError, match="element type"):
        kvpack.compress([(np.zeros((1, 1, 4, 8), np.int32), None)], "raw")
    with pytest.raises(ValueError, match="head_dim axis must be contiguous"):
        kvpack.compress([(np.zeros((1, 1, 8, 4), np.float32).transpose(0, 1, 3, 2), None)], "raw")
    with pytest.raises(TypeError, match="DLPack"):
        kvpack.compress([([1.0, 2.0], None)], "raw")


def test_decode_into_rejects_mismatch_and_readonly(fixture):
    kv, _ = fixture
    ar = kvpack.open(kvpack.compress(kv, "raw", dtype="bf16").data)
    with pytest.raises(kvpack.ParameterError, match="shaped"):
        ar.decode_into({(0, "K"): np.empty((1, 1, 511, 128), np.float32)})
    with pytest.raises(kvpack.ParameterError, match="stored"):
        ar.decode_into({(0, "K"): np.empty((1, 1, 600, 256), np.float32)})
    with pytest.raises(kvpack.ParameterError, match="no tensor"):
        ar.decode_into({(99, "K"): np.empty((1, 1, 1, 256), np.float32)})
    ro = np.empty((1, 1, 511, 256), np.float32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        ar.decode_into({(0, "K"): ro})
    big = np.empty((2, 1, 1, 511, 256), np.float32)
    with pytest.raises(ValueError, match="share memory"):
        ar.decode_into({(0, "K"): big[0], (0, "V"): big[0]})


def test_outputs_own_rust_memory_without_copies(fixture):
    kv, _ = fixture
    ar = kvpack.open(kvpack.compress(kv, "raw", dtype="bf16").data)
    got = ar.decode(layers=3, kind="V", output="dlpack")
    (key, arr), = got.items()
    assert key == (3, "V") and arr.dtype == "bf16" and arr.shape == [1, 1, 511, 256]
    a = np.from_dlpack(arr.as_bits())
    b = np.from_dlpack(arr.as_bits())
    # Two numpy views of one Rust buffer: same address, no copy.
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    del arr, got
    assert np.array_equal(a, kv[(3, "V")])


def test_torch_tensors_in_and_out(fixture):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    kv, _ = fixture
    tk = {key: torch.from_numpy(a.copy()).view(torch.bfloat16) for key, a in kv.items()}
    res = kvpack.compress(tk, "raw")
    ar = kvpack.open(res.data)
    got = ar.decode(output="torch")
    for key, t in tk.items():
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], t)
    out = {key: torch.empty(t.shape, dtype=torch.float32) for key, t in tk.items()}
    ar.decode_into(out)
    for key, t in tk.items():
        assert torch.equal(out[key], t.float())
    chunk = torch.randn(2, 2, 256, 2 * 128, dtype=torch.bfloat16)
    buf = torch.empty(kvpack.chunk_max_size(chunk.shape, chunk.dtype, "bdr128", head_dim=128), dtype=torch.uint8)
    n = kvpack.encode_chunk(chunk, "bdr128", head_dim=128, out=buf)
    back = torch.empty_like(chunk)
    kvpack.decode_chunk(buf[:n], back)
    assert torch.nn.functional.cosine_similarity(back.float().ravel(), chunk.float().ravel(), dim=0) > 0.99


def test_codec_list():
    names = [n for n, _, _ in kvpack.codecs()]
    for n in ["raw", "int", "bdr", "hqmq", "octopus", "turbo", "polar", "innerq", "kivi"]:
        assert n in names


def test_outputs_alive_at_interpreter_exit_do_not_crash():
    """Regression: torch frees DLPack tensors during interpreter shutdown,
    when the deleter can no longer take the GIL; it must not abort."""
    import subprocess
    import sys

    code = (
        "import kvpack, numpy as np\n"
        "k = np.ones((1, 2, 64, 32), np.float16)\n"
        "ar = kvpack.open(kvpack.compress([(k, k)], 'int4').data)\n"
        "keep_np = ar.decode()\n"
        "try:\n"
        "    import torch\n"
        "    keep_t = ar.decode(output='torch')\n"
        "except ImportError:\n"
        "    pass\n"
        "print('done')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "done"


def test_compress_a_safetensors_file_like_the_cli(tmp_path, fixture):
    kv, meta = fixture
    res = kvpack.compress(FIXTURE, "bdr128")
    # `kvpack compress fixtures/... --codec bdr128` reports 4.282 bits/element.
    assert round(res.bits_per_element, 3) == 4.282, res
    ar = kvpack.open(res.data)
    # The token ids move from the metadata into the file's index.
    ids = json.loads(meta["kvpack.token_ids"])
    assert ar.model == meta["kvpack.model"] and ar.token_ids == ids
    assert ar.metadata == {k: v for k, v in meta.items() if k != "kvpack.token_ids"}
    raw = kvpack.open(kvpack.compress(str(FIXTURE), "raw").data).decode()
    for key, a in kv.items():
        assert np.array_equal(raw[key].view(np.uint16), a), key
    p = tmp_path / "f.kvpack"
    kvpack.compress(FIXTURE, "int4", path=p)
    with pytest.raises(kvpack.ParameterError, match="exists"):
        kvpack.compress(FIXTURE, "int4", path=p)
    with pytest.raises(kvpack.ParameterError, match="carries its own"):
        kvpack.compress(FIXTURE, "int4", model="x")
    with pytest.raises(kvpack.KvpackIOError):
        kvpack.compress(tmp_path / "missing.safetensors", "int4")


def test_compress_key_codec_splits_keys_and_values():
    """key_codec=: keys coded by it and values by ``codec``, each kind
    decoding exactly as a file of its codec alone with the same windows,
    from a safetensors path and from in-memory arrays; refused with bits=."""
    split = kvpack.compress(str(FIXTURE), "int4", key_codec="hqmq:s24r3+ctr", sink=1, recent=0)
    assert split.codec == "K hqmq:s24r3+ctr / V int4"
    k = kvpack.compress(str(FIXTURE), "hqmq:s24r3+ctr", sink=1, recent=0)
    v = kvpack.compress(str(FIXTURE), "int4", sink=1, recent=0)
    got = kvpack.open(split.data).decode(dtype="fp32")
    want_k = kvpack.open(k.data).decode(dtype="fp32")
    want_v = kvpack.open(v.data).decode(dtype="fp32")
    assert len(got) == 36
    for key, arr in got.items():
        want = want_k if key[1] == "K" else want_v
        np.testing.assert_array_equal(arr, want[key])
    # In memory: two layers of synthetic K/V.
    rng = np.random.default_rng(3)
    layers = [(rng.standard_normal((1, 2, 40, 64)).astype(np.float32),
               rng.standard_normal((1, 2, 40, 64)).astype(np.float32)) for _ in range(2)]
    mem = kvpack.compress(layers, "int8", key_codec="hqmq:s12r2+ctr", sink=1)
    ks = kvpack.compress(layers, "hqmq:s12r2+ctr", sink=1)
    out, kout = kvpack.open(mem.data).decode(dtype="fp32"), kvpack.open(ks.data).decode(dtype="fp32")
    for layer in range(2):
        np.testing.assert_array_equal(out[(layer, "K")], kout[(layer, "K")])
    with pytest.raises(kvpack.ParameterError):
        kvpack.compress(str(FIXTURE), bits=3.0, key_codec="int4")
    with pytest.raises(kvpack.ParameterError):
        kvpack.compress(layers, "int4", key_codec="hqmq:nope")


def test_compress_bits_plans_within_the_budget():
    """bits=B: a budget plan, never over B bits/element, decodable, and
    refused together with a codec or windows."""
    res = kvpack.compress(str(FIXTURE), bits=3.0)
    assert res.codec == "plan:3"
    assert 2.75 < res.bits_per_element <= 3.0
    ar = kvpack.open(res.data)
    out = ar.decode(dtype="fp32")
    assert len(out) == 36
    again = kvpack.compress(str(FIXTURE), bits=3.0)
    assert again.data == res.data
    with pytest.raises(kvpack.ParameterError):
        kvpack.compress(str(FIXTURE), "bdr128", bits=3.0)
    with pytest.raises((kvpack.ParameterError, ValueError)):
        kvpack.compress(str(FIXTURE), bits=3.0, sink=4)
    with pytest.raises(kvpack.ParameterError):
        kvpack.compress(str(FIXTURE), bits=1.0)


def test_decode_chunk_refuses_an_output_of_another_shape():
    """A smaller output (fewer tokens, fewer layers) or another head split is
    refused, not filled with part of the chunk."""
    import numpy as np

    ch = np.random.default_rng(0).standard_normal((2, 2, 16, 256)).astype(np.float16)
    data = kvpack.encode_chunk(ch, "raw", head_dim=128)
    out = np.empty_like(ch)
    kvpack.decode_chunk(data, out)
    assert np.array_equal(out, ch)
    for shape, head_dim in [((2, 2, 8, 256), None), ((2, 1, 16, 256), None), ((2, 2, 16, 256), 64)]:
        with pytest.raises(kvpack.ParameterError):
            kvpack.decode_chunk(data, np.empty(shape, np.float16), head_dim=head_dim)


def test_chunk_max_size_takes_numpy_scalar_types():
    import numpy as np

    want = kvpack.chunk_max_size((2, 2, 16, 256), "fp16", "raw", head_dim=128)
    for d in (np.float16, np.dtype("float16")):
        assert kvpack.chunk_max_size((2, 2, 16, 256), d, "raw", head_dim=128) == want


def test_out_of_range_integers_are_parameter_errors():
    """Negative or too large integers are ParameterErrors (naming the
    argument where kvpack checks it), never a bare OverflowError."""
    import numpy as np

    a = np.ones((1, 2, 10, 64), np.float32)
    for kw in (dict(sink=-1), dict(recent=-2), dict(page_tokens=2**40), dict(token_ids=[-1]), dict(align=2**20)):
        with pytest.raises(kvpack.ParameterError):
            kvpack.compress([(a, a)], "int4", **kw)
    ar = kvpack.open(kvpack.compress([(a, a)], "int4").data)
    with pytest.raises(kvpack.ParameterError):
        ar.decode(layers=-1)


def test_metadata_must_be_strings_and_paths_may_be_bytes(tmp_path):
    import numpy as np

    a = np.ones((1, 2, 10, 64), np.float32)
    with pytest.raises(kvpack.ParameterError, match="'a'"):
        kvpack.compress([(a, a)], "int4", metadata={"a": 1})
    kvpack.compress([(a, a)], "int4", path=os.fsencode(tmp_path / "x.kvpack"))
    assert (tmp_path / "x.kvpack").is_file()
