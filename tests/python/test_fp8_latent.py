"""Format 1.1 through the Python API: fp8 and MLA latent golden vectors
(format/vectors/) open, decode and select by kind. numpy only."""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
import pytest

import kvpack

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "format" / "vectors"


def read_safetensors(path: pathlib.Path):
    """{name: (dtype, shape, bytes)} with a tiny parser (numpy only)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (t["dtype"], t["shape"], raw[base + t["data_offsets"][0] : base + t["data_offsets"][1]]) for k, t in header.items()}


def test_fp8_raw_vector_keeps_the_codes():
    src = read_safetensors(VECTORS / "input-fp8-e4m3.safetensors")
    ar = kvpack.open(VECTORS / "raw-fp8-e4m3.kvpack")
    assert {t.dtype for t in ar.tensors} == {"fp8_e4m3"}
    codes = ar.decode()
    f32 = ar.decode(dtype="fp32")
    for t in ar.tensors:
        dt, shape, data = src[t.name]
        assert dt == "F8_E4M3" and tuple(shape) == t.shape
        got = codes[(t.layer, t.kind)]
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got.reshape(-1), np.frombuffer(data, dtype=np.uint8))
        (scale,) = struct.unpack("<f", src[t.name + "_scale"][2])
        # code * scale with the E4M3FN formula (bias 7, 3 mantissa bits; the
        # vector holds no NaN), in float32.
        c = got.reshape(-1).astype(np.int32)
        e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
        mag = np.where(e == 0, 2.0**-6 * m / 8, 2.0 ** (e - 7) * (1 + m / 8))
        want = (np.where(c & 0x80, -mag, mag).astype(np.float32) * np.float32(scale)).astype(np.float32)
        np.testing.assert_array_equal(f32[(t.layer, t.kind)].reshape(-1), want)


def test_latent_vector_kind_and_selection():
    ar = kvpack.open(VECTORS / "bdr64-latent.kvpack")
    assert [(t.kind, t.shape) for t in ar.tensors] == [("L", (1, 1, 37, 576)), ("L", (1, 1, 21, 576))]
    got = ar.decode(kind="latent", layers=1, dtype="fp32")
    assert list(got) == [(1, "L")]
    assert got[(1, "L")].shape == (1, 1, 21, 576)
    assert ar.decode(kind="K") == {}


def test_fp8_torch_tensors_in_with_scales():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import kvpack

    g = torch.Generator().manual_seed(3)
    layers = []
    for _ in range(2):
        k = (torch.randn(1, 2, 64, 32, generator=g) * 4).to(torch.float8_e4m3fn)
        v = (torch.randn(1, 2, 64, 32, generator=g) * 4).to(torch.float8_e5m2)
        layers.append((k, v))
    scales = {(0, "K"): 0.5, (0, "V"): 0.25, (1, "K"): 2.0, (1, "V"): 1.0}
    ar = kvpack.open(kvpack.compress(layers, "raw", scales=scales).data)
    assert [(t.dtype, t.scale) for t in ar.tensors] == [
        ("fp8_e4m3", 0.5), ("fp8_e5m2", 0.25), ("fp8_e4m3", 2.0), ("fp8_e5m2", 1.0)
    ]
    back = ar.decode(output="torch")  # raw keeps the codes: uint8 views
    for (l, kind), t in back.items():
        src = layers[l][0 if kind == "K" else 1]
        assert torch.equal(t, src.view(torch.uint8)), (l, kind)
    # A lossy codec codes the dequantized values (code * scale).
    f32 = kvpack.open(kvpack.compress(layers, "int8", scales=scales).data).decode(dtype="fp32", output="torch")
    want = layers[1][0].float() * 2.0
    cos = torch.nn.functional.cosine_similarity(f32[(1, "K")].ravel(), want.ravel(), dim=0)
    assert cos > 0.99, cos
    with pytest.raises(kvpack.ParameterError, match="not in the cache"):
        kvpack.compress(layers, "raw", scales={(5, "K"): 1.0})
    with pytest.raises(ValueError, match="not fp8"):
        kvpack.compress([(torch.zeros(1, 1, 4, 8), None)], "raw", scales={(0, "K"): 1.0})
