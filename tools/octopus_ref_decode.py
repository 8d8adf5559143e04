#!/usr/bin/env python3
"""Independent reference decoder for the `octopus` and `turbo` golden vectors.

Written from the text of format/SPEC.md, format/codecs/octopus.md and
format/codecs/turbo.md only (no kvpack code), with numpy float32 arithmetic
(IEEE binary32, round to nearest even, no fused multiply-add). It decodes each
octopus/turbo vector of format/vectors/vectors.json to the source dtype, as
the golden test does, and compares the SHA-256 of the output (every tensor
as little-endian f32) with the recorded digest. A match shows that the specs
are enough to decode bit-exactly.

    /work/venv/bin/python tools/octopus_ref_decode.py [--kvpack target/release/kvpack]

With --kvpack it also decompresses each vector with `kvpack decompress --dtype
fp32` and compares every f32 bit of the two decoders (before the bf16
rounding that the golden digest includes).
Container checks (CRCs, padding, limits) are not repeated here; zstd page
bodies go through the `zstd` command-line tool.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

F32 = np.float32
ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "format" / "vectors"
M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


# --- container (format/SPEC.md) ---------------------------------------------

def u16(b, o): return struct.unpack_from("<H", b, o)[0]
def u32(b, o): return struct.unpack_from("<I", b, o)[0]
def u64(b, o): return struct.unpack_from("<Q", b, o)[0]


def parse_file(b: bytes):
    header_len, n_tensors, n_codecs = u32(b, 24), u32(b, 32), u32(b, 36)
    o = 64
    tensors = []
    for _ in range(n_tensors):
        layer, kind, dtype = u32(b, o), b[o + 4], b[o + 5]
        batch, heads, tokens, hd = (u32(b, o + 8 + 4 * i) for i in range(4))
        n = u32(b, o + 24)
        o += 28 + n
        tensors.append(dict(layer=layer, kind=kind, dtype=dtype, batch=batch, heads=heads,
                            tokens=tokens, head_dim=hd))
    codecs = []
    for _ in range(n_codecs):
        cid, plen = u16(b, o), u32(b, o + 4)
        codecs.append((cid, b[o + 8:o + 8 + plen]))
        o += 8 + plen
    trailer = b[-64:]
    index = header_len + u64(trailer, 8)
    nt, npages = u32(b, index + 8), u32(b, index + 12)
    eo = index + 64 + 4 * nt
    pages = []
    for i in range(npages):
        e = eo + 40 * i
        pages.append(dict(offset=header_len + u64(b, e), tensor=u32(b, e + 16),
                          token_start=u32(b, e + 20), tokens=u32(b, e + 24), codec=u16(b, e + 28)))
    return tensors, codecs, pages


def page_sections(b: bytes, off: int):
    flags, nsec, stored, body_len = u16(b, off + 18), u16(b, off + 20), u64(b, off + 24), u64(b, off + 32)
    body = b[off + 64:off + 64 + stored]
    if flags & 1:
        body = subprocess.run(["zstd", "-d", "-c"], input=body, capture_output=True, check=True).stdout
    assert len(body) == body_len
    secs = {}
    for i in range(nsec):
        kind, stream, elem, bits = body[16 * i:16 * i + 4]
        count, so, ln = u32(body, 16 * i + 4), u32(body, 16 * i + 8), u32(body, 16 * i + 12)
        secs[(kind, stream)] = (elem, bits, count, body[so:so + ln])
    return secs


SCALE, ZERO, INDEX, RAW = 1, 2, 3, 5


def unpack(data: bytes, bits: int, count: int) -> np.ndarray:
    """LSB-first bit-packed codes (SPEC 6.2)."""
    allbits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
    idx = np.arange(count)[:, None] * bits + np.arange(bits)[None, :]
    return (allbits[idx].astype(np.int64) << np.arange(bits)[None, :]).sum(1)


# --- shared frame (octopus.md) -----------------------------------------------

def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def derive(seed, fields):
    h = seed
    for f in fields:
        h = mix(((h + GAMMA) & M64) ^ f)
    return h


def signs(key, d):
    st, out, w = key, [], 0
    for i in range(d):
        if i % 64 == 0:
            st = (st + GAMMA) & M64
            w = mix(st)
        out.append(-1.0 if (w >> (i % 64)) & 1 else 1.0)
    return np.array(out, F32)


def inv_sqrt(d):
    k = d.bit_length() - 1
    p = F32(2.0 ** -(k // 2))
    return p if k % 2 == 0 else F32(p * F32(struct.unpack("<f", struct.pack("<I", 0x3F3504F3))[0]))


def fwht(v: np.ndarray) -> np.ndarray:
    v = v.astype(F32).copy()
    s = 1
    while s < len(v):
        v = v.reshape(-1, 2, s)
        a, b = v[:, 0, :].copy(), v[:, 1, :].copy()
        v[:, 0, :], v[:, 1, :] = a + b, a - b
        v = v.reshape(-1)
        s *= 2
    return v


def sgn(v):
    return F32(-1.0) if v < 0 else F32(1.0)


def oct_dir(xi, eta):
    xi, eta = F32(xi), F32(eta)
    r = (F32(1) - abs(xi)) - abs(eta)
    if r >= 0:
        x, y = xi, eta
    else:
        x, y = sgn(xi) * (F32(1) - abs(eta)), sgn(eta) * (F32(1) - abs(xi))
    w = F32(1) / np.sqrt((x * x + y * y) + r * r)
    return np.array([x * w, y * w, r * w], F32)


K_QJL = np.frombuffer(struct.pack("<I", 0x3FA06C99), F32)[0]


def read_header(p):
    return dict(a=p[0], b=p[1], qjl=p[2] & 1, enc=p[3], vbits=p[4], vgroup=u16(p, 6), seed=u64(p, 8)), p[16:]


def codebooks(cid, p):
    h, t = read_header(p)
    o = 0
    dir_cb = None
    if cid == 4:
        dir_cb = np.frombuffer(t[:4 << h["a"]], F32)
        o = 4 << h["a"]
    levels = 1 << (h["b"] if cid == 4 else h["a"])
    n = u32(t, o)
    o += 4
    per_dim = {}
    for _ in range(n):
        d = u32(t, o)
        per_dim[d] = np.frombuffer(t[o + 4:o + 4 + 4 * levels], F32)
        o += 4 + 4 * levels
    assert o == len(t)
    return h, dir_cb, per_dim


def decode_page(cid, params, info, secs, tokens):
    h, dir_cb, per_dim = codebooks(cid, params)
    d, planes = info["head_dim"], info["batch"] * info["heads"]
    rows = planes * tokens
    out = np.zeros((rows, d), F32)
    if info["kind"] == 1 and h["vbits"]:
        g = h["vgroup"]
        f16 = lambda k: np.frombuffer(secs[(k, 0)][3], np.float16).astype(F32).reshape(rows, d // g)
        sc, mn = f16(SCALE), f16(ZERO)
        q = unpack(secs[(INDEX, 0)][3], h["vbits"], rows * d).astype(F32).reshape(rows, d)
        return q * np.repeat(sc, g, axis=1) + np.repeat(mn, g, axis=1)
    gam = np.frombuffer(secs[(SCALE, 0)][3], F32)
    with_qjl = info["kind"] == 0 and h["qjl"]
    if cid == 4:
        T = (d + 2) // 3
        jd = unpack(secs[(INDEX, 0)][3], h["a"], 2 * rows * T).reshape(rows, T, 2)
        jn = unpack(secs[(INDEX, 1)][3], h["b"], rows * T).reshape(rows, T)
        qstream = 2
    else:
        codes = unpack(secs[(INDEX, 0)][3], h["a"], rows * d).reshape(rows, d)
        qstream = 1
    if with_qjl:
        gr = np.frombuffer(secs[(SCALE, 1)][3], np.float16).astype(F32)
        sb = unpack(secs[(INDEX, qstream)][3], 1, rows * d).reshape(rows, d)
    cd = inv_sqrt(d)
    for r in range(rows):
        head = (r // tokens) % info["heads"]
        s = signs(derive(h["seed"], [info["layer"], head, info["kind"], 0]), d)
        if cid == 4:
            rho_cb = per_dim[d]
            u = np.zeros(3 * T, F32)
            for i in range(T):
                n = oct_dir(dir_cb[jd[r, i, 0]], dir_cb[jd[r, i, 1]])
                u[3 * i:3 * i + 3] = n * rho_cb[jn[r, i]]
            u = u[:d].copy()
        else:
            u = per_dim[d][codes[r]].astype(F32)
        if with_qjl:
            s2 = signs(derive(h["seed"], [info["layer"], head, info["kind"], 1]), d)
            hs = fwht(np.where(sb[r] == 0, F32(1), F32(-1)).astype(F32))
            a = (gr[r] * K_QJL) * F32(1.0 / d)
            u = u + (s2 * hs) * a
        gg = gam[r] * cd
        out[r] = s * fwht(u * gg)
    return out


def to_bf16_f32(x: np.ndarray) -> np.ndarray:
    b = x.astype(F32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return r.view(F32)


def decode_f32(b: bytes):
    """Every tensor decoded to f32, `[planes, tokens, head_dim]`, tensor-table order."""
    tensors, codecs, pages = parse_file(b)
    outs = [np.zeros((t["batch"] * t["heads"], t["tokens"], t["head_dim"]), F32) for t in tensors]
    for pg in pages:
        info = tensors[pg["tensor"]]
        cid, params = codecs[pg["codec"]]
        secs = page_sections(b, pg["offset"])
        t0, n, d = pg["token_start"], pg["tokens"], info["head_dim"]
        planes = info["batch"] * info["heads"]
        if cid == 0:
            elem, _, count, data = secs[(RAW, 0)]
            assert elem == 1, "bf16 sources only"
            v = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(F32)
            vals = v.reshape(planes, n, d)
        else:
            vals = decode_page(cid, params, info, secs, n).reshape(planes, n, d)
        outs[pg["tensor"]][:, t0:t0 + n, :] = vals
    assert all(t["dtype"] == 1 for t in tensors)
    return outs


def decode_file(b: bytes) -> bytes:
    return b"".join(to_bf16_f32(o).astype("<f4").tobytes() for o in decode_f32(b))


def kvpack_f32(kvpack: str, path: Path) -> list:
    """Tensors of `kvpack decompress --dtype fp32`, in file (= tensor-table) order."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "x.safetensors"
        subprocess.run([kvpack, "decompress", str(path), "-o", str(out), "--dtype", "fp32", "--force"],
                       check=True, capture_output=True)
        st = out.read_bytes()
    n = struct.unpack_from("<Q", st, 0)[0]
    hdr = json.loads(st[8:8 + n])
    names = sorted((k for k in hdr if k != "__metadata__"), key=lambda k: hdr[k]["data_offsets"][0])
    return [np.frombuffer(st[8 + n + hdr[k]["data_offsets"][0]:8 + n + hdr[k]["data_offsets"][1]], F32)
            for k in names]


def main() -> int:
    kvpack = sys.argv[2] if len(sys.argv) == 3 and sys.argv[1] == "--kvpack" else None
    listing = json.loads((VECTORS / "vectors.json").read_text())
    bad = 0
    for v in listing["vectors"]:
        if not v["codec"].startswith(("octopus", "turbo")):
            continue
        path = VECTORS / v["file"]
        got = hashlib.sha256(decode_file(path.read_bytes())).hexdigest()
        ok = got == v["decoded_f32_sha256"]
        extra = ""
        if kvpack:
            mine = decode_f32(path.read_bytes())
            theirs = kvpack_f32(kvpack, path)
            diff = sum(int((a.reshape(-1).view(np.uint32) != b.view(np.uint32)).sum())
                       for a, b in zip(mine, theirs))
            ok = ok and diff == 0 and len(mine) == len(theirs)
            extra = f"  f32 bits differing from kvpack: {diff}"
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {v['codec']:<24} {v['file']}{extra}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
