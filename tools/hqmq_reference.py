#!/usr/bin/env python3
"""Independent reference of HQMQ (format/codecs/hqmq.md) in pure Python.

Written from the specs (format/SPEC.md, format/codecs/hqmq.md), not from the
Rust code, with only the Python standard library: integers for SplitMix64
and the rejection test, binary64 for the normalization (Python floats),
binary32 rounding via struct (round to nearest even), and every binary32
operation evaluated one at a time (a binary64 result of +, -, *, / on
binary32 operands rounds to the correct binary32 value).

  python3 tools/hqmq_reference.py > format/vectors/hqmq-codebook.json
      writes the committed codebook test vector that tests/hqmq.rs checks
      the Rust implementation against, bit for bit;
  python3 tools/hqmq_reference.py decode FILE.kvpack
      decodes a kvpack file of bf16 or fp8 (format 1.1, SPEC 4.3) K/V or
      MLA latent tensors whose pages are hqmq or raw (uncompressed bodies)
      and prints the SHA-256 of the decoded output (SPEC section 12), to
      compare with format/vectors/vectors.json.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class SplitMix64:
    def __init__(self, state: int):
        self.state = state & M64

    def next(self) -> int:
        self.state = (self.state + GAMMA) & M64
        return mix64(self.state)


def f32(x: float) -> float:
    """Round a binary64 value to binary32 (nearest, ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bits(x: float) -> str:
    return "%08x" % struct.unpack("<I", struct.pack("<f", x))[0]


def add(a, b):
    return f32(a + b)


def sub(a, b):
    return f32(a - b)


def mul(a, b):
    return f32(a * b)


def codebook_state(seed: int, layer: int, head: int, kind: int) -> int:
    ident = (layer << 32) | head
    return mix64(mix64(seed ^ ident) ^ kind)


def haar_unit(rng: SplitMix64):
    while True:
        m = [(rng.next() >> 40) - (1 << 23) for _ in range(4)]
        n2 = sum(v * v for v in m)
        if (1 << 40) <= n2 <= (1 << 46):
            r = math.sqrt(float(n2))
            return [f32(float(v) / r) for v in m]


def hurwitz():
    units = []
    for i in range(4):
        for sign in (1.0, -1.0):
            u = [0.0] * 4
            u[i] = sign
            units.append(u)
    for m in range(16):
        units.append([-0.5 if (m >> k) & 1 else 0.5 for k in range(4)])
    return units


def hamilton(p, q):
    """p * q in binary32 with the normative operation order."""
    return [
        sub(sub(sub(mul(p[0], q[0]), mul(p[1], q[1])), mul(p[2], q[2])), mul(p[3], q[3])),
        sub(add(add(mul(p[0], q[1]), mul(p[1], q[0])), mul(p[2], q[3])), mul(p[3], q[2])),
        add(add(sub(mul(p[0], q[2]), mul(p[1], q[3])), mul(p[2], q[0])), mul(p[3], q[1])),
        add(sub(add(mul(p[0], q[3]), mul(p[1], q[2])), mul(p[2], q[1])), mul(p[3], q[0])),
    ]


def secondaries(seed, layer, head, kind, s):
    rng = SplitMix64(codebook_state(seed, layer, head, kind))
    return [haar_unit(rng) for _ in range(s)]


CASES = [
    # (seed, layer, kv head, kind 0=K 1=V, S)
    (0, 0, 0, 0, 8),
    (0, 0, 0, 1, 8),
    (42, 17, 0, 0, 8),
    (1337, 3, 5, 1, 8),
    (0xFFFFFFFFFFFFFFFF, 4294967295, 4294967295, 1, 8),
]
JOINT = [(0, 0), (1, 3), (2, 1), (7, 7), (8, 0), (13, 5), (22, 2), (23, 6)]


# ---------------------------------------------------------------------------
# Decoder (format/SPEC.md sections 4-6, format/codecs/hqmq.md sections 5-6)


def f16(bits16: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits16))[0]


def bf16(bits16: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits16 << 16))[0]


# fp8 (SPEC 4.3): (exponent bits, mantissa bits, bias) of dtype codes 4, 5.
FP8 = {4: (4, 3, 7), 5: (5, 2, 15)}


def fp8_value(code: int, dtype: int) -> float:
    """The value of an fp8 code, from the SPEC 4.3 table."""
    eb, mb, bias = FP8[dtype]
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> mb) & ((1 << eb) - 1), code & ((1 << mb) - 1)
    if dtype == 4 and e == 15 and m == 7:
        return math.nan
    if dtype == 5 and e == 31:
        return s * math.inf if m == 0 else math.nan
    if e == 0:
        return s * 2.0 ** (1 - bias) * (m / 2**mb)
    return s * 2.0 ** (e - bias) * (1 + m / 2**mb)


def fp8_code(x: float, dtype: int) -> int:
    """Nearest finite fp8 code of a finite x, ties to the even code,
    saturating (SPEC 4.3), by search over all codes."""
    best = None
    for c in range(128):
        v = fp8_value(c, dtype)
        if not math.isfinite(v):
            continue
        dist = abs(abs(x) - v)
        if best is None or dist < best[0] or (dist == best[0] and c % 2 == 0):
            best = (dist, c)
    return best[1] | (0x80 if math.copysign(1.0, x) < 0 else 0)


class Buf:
    def __init__(self, b: bytes, pos: int = 0):
        self.b, self.pos = b, pos

    def take(self, n: int) -> bytes:
        v = self.b[self.pos : self.pos + n]
        assert len(v) == n, "truncated"
        self.pos += n
        return v

    def u(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def string(self) -> str:
        return self.take(self.u(4)).decode()


def read_bits(data: bytes, start: int, width: int) -> int:
    """Bits [start, start + width) of an LSB-first stream (SPEC 6.2)."""
    v = int.from_bytes(data, "little")
    return (v >> start) & ((1 << width) - 1)


def unpack(data: bytes, n: int, width: int):
    v = int.from_bytes(data, "little")
    mask = (1 << width) - 1
    out = [(v >> (i * width)) & mask for i in range(n)]
    assert v >> (n * width) == 0, "padding bits set"
    return out


def parse_outliers(data: bytes, universe: int):
    b = Buf(data)
    n, unit, enc, _ = b.u(4), b.u(1), b.u(1), b.u(2)
    assert unit == 4 and b.u(4) == universe
    if enc == 0:
        pos = [b.u(4) for _ in range(n)]
    else:
        bm = int.from_bytes(b.take((universe + 7) // 8), "little")
        pos = [i for i in range(universe) if bm >> i & 1]
    assert len(pos) == n
    vals = [f16(b.u(2)) for _ in range(4 * n)]
    return dict(zip(pos, (vals[4 * i : 4 * i + 4] for i in range(n))))


def hqmq_params(p: bytes):
    s, b, g, flags = int.from_bytes(p[0:4], "little"), p[4], p[5], p[6]
    seed = int.from_bytes(p[16:24], "little")
    m = 24 * s << b
    e = (m & -m).bit_length() - 1
    o = m >> e
    w = (o**g - 1).bit_length()
    assert flags & ~7 == 0, "unknown hqmq flag bits"
    assert flags & 6 != 6, "+chan and +ctr both set"
    return dict(S=s, b=b, G=g, med=bool(flags & 1), chan=bool(flags & 6), ctr=bool(flags & 4), seed=seed, E=e, O=o, W=w)


def decode_hqmq_page(prm, sections, layer, kind, heads, planes, tokens, d, codebooks):
    nc = d // 4
    rows = planes * tokens
    n = rows * nc
    L = (1 << prm["b"]) - 1
    scales = sections[(1, 0)]
    out_tab = parse_outliers(sections[(4, 0)][1], n) if prm["med"] else {}
    assert ((4, 0) in sections) == prm["med"]
    # +chan: gain per (plane, channel), SCALE stream 1 (hqmq.md section 10);
    # +ctr: per plane d gains then d offsets (section 11).
    assert ((1, 1) in sections) == prm["chan"]
    per = 2 * d if prm["ctr"] else d
    side = [f16(int.from_bytes(sections[(1, 1)][1][2 * i : 2 * i + 2], "little")) for i in range(planes * per)] if prm["chan"] else None
    n_in = n - len(out_tab)
    lows = unpack(sections[(3, 0)][1], n_in, prm["E"])
    groups = unpack(sections[(3, 1)][1], -(-n_in // prm["G"]), prm["W"])
    highs = []
    for v in groups:
        assert v < prm["O"] ** prm["G"]
        for _ in range(prm["G"]):
            highs.append(v % prm["O"])
            v //= prm["O"]
    assert all(h == 0 for h in highs[n_in:])
    out = []
    k = 0
    for r in range(rows):
        head = (r // tokens) % heads
        key = (layer, head, kind)
        if key not in codebooks:
            sec = secondaries(prm["seed"], layer, head, kind, prm["S"])
            codebooks[key] = [hamilton(pp, q) for pp in hurwitz() for q in sec]
        joint = codebooks[key]
        sigma = f16(int.from_bytes(scales[1][2 * r : 2 * r + 2], "little"))
        step = f32(sigma / float(L))
        for c in range(nc):
            u = r * nc + c
            if u in out_tab:
                x = list(out_tab[u])
            else:
                v = (highs[k] << prm["E"]) | lows[k]
                k += 1
                j, q = v >> prm["b"], v & ((1 << prm["b"]) - 1)
                rh = mul(float(q), step)
                x = [mul(rh, cw) for cw in joint[j]]
            if side is not None:
                p0 = (r // tokens) * per + 4 * c
                x = [mul(xt, side[p0 + t]) for t, xt in enumerate(x)]
                if prm["ctr"]:
                    x = [add(xt, side[p0 + d + t]) for t, xt in enumerate(x)]
            out.extend(x)
    return out


def decode_file(path: str) -> str:
    data = open(path, "rb").read()
    b = Buf(data)
    assert b.take(8) == b"\x89KVP\r\n\x1a\n"
    b.take(12)  # versions, flags
    b.take(4)  # align_log2, reserved
    header_len, body_len = b.u(4), b.u(4)
    n_tensors, n_codecs, n_meta = b.u(4), b.u(4), b.u(4)
    b.take(20)
    tensors = []
    for _ in range(n_tensors):
        layer, kind, dtype, _ = b.u(4), b.u(1), b.u(1), b.u(2)
        batch, heads, tokens, d = b.u(4), b.u(4), b.u(4), b.u(4)
        b.string()
        scale = struct.unpack("<f", b.take(4))[0] if dtype in FP8 else None
        tensors.append(dict(layer=layer, kind=kind, dtype=dtype, scale=scale, planes=batch * heads, heads=heads, d=d))
    codecs = []
    for _ in range(n_codecs):
        cid, _ = b.u(2), b.u(2)
        codecs.append((cid, b.take(b.u(4))))
    tr = Buf(data, len(data) - 64)
    assert tr.take(4) == b"KVTR"
    tr.u(4)
    index_offset = tr.u(8)
    ix = Buf(data, header_len + index_offset)
    assert ix.take(4) == b"KVIX"
    ix.u(4)
    assert ix.u(4) == n_tensors
    n_pages = ix.u(4)
    ix.take(64 - 16)
    counts = [ix.u(4) for _ in range(n_tensors)]
    entries = []
    for _ in range(n_pages):
        off, _flen, t, t0, nt, slot, flags = ix.u(8), ix.u(8), ix.u(4), ix.u(4), ix.u(4), ix.u(2), ix.u(2)
        ix.take(8)
        assert flags == 0, "zstd pages are not supported by this reference"
        entries.append((off, t, t0, nt, slot))
    values = [[0.0] * (t["planes"] * c * t["d"]) for t, c in zip(tensors, counts)]
    codebooks = {}
    for off, ti, t0, nt, slot in entries:
        pg = Buf(data, header_len + off + 20)
        n_sec = pg.u(2)
        body = header_len + off + 64
        sections = {}
        for i in range(n_sec):
            e = Buf(data, body + 16 * i)
            kind, stream, elem, bits, count, so, ln = e.u(1), e.u(1), e.u(1), e.u(1), e.u(4), e.u(4), e.u(4)
            sections[(kind, stream)] = (count, data[body + so : body + so + ln])
        t = tensors[ti]
        d, planes, total = t["d"], t["planes"], counts[ti]
        cid, params = codecs[slot]
        if cid == 0:
            raw = sections[(5, 0)][1]
            if t["dtype"] in FP8:
                page = [mul(fp8_value(c, t["dtype"]), t["scale"]) for c in raw]
            else:
                assert t["dtype"] == 1, "this reference reads bf16 and fp8 raw pages"
                page = [bf16(int.from_bytes(raw[2 * i : 2 * i + 2], "little")) for i in range(len(raw) // 2)]
        elif cid == 3:
            prm = hqmq_params(params)
            page = decode_hqmq_page(prm, sections, t["layer"], t["kind"], t["heads"], planes, nt, d, codebooks)
        else:
            raise SystemExit(f"codec id {cid} not supported by this reference")
        for p in range(planes):
            for r in range(nt):
                dst = (p * total + t0 + r) * d
                src = (p * nt + r) * d
                values[ti][dst : dst + d] = page[src : src + d]
    # The decoded output is in each tensor's source dtype (SPEC 4.3: round
    # to nearest even), then widened to f32 for the digest (SPEC 12).
    h = hashlib.sha256()
    for t, v in zip(tensors, values):
        if t["dtype"] in FP8:
            s, dt = t["scale"], t["dtype"]
            h.update(struct.pack(f"<{len(v)}f", *(mul(fp8_value(fp8_code(f32(x / s), dt), dt), s) for x in v)))
            continue
        assert t["dtype"] == 1, "this reference writes bf16 and fp8 outputs"
        h.update(struct.pack(f"<{len(v)}f", *(to_bf16(x) for x in v)))
    return h.hexdigest()


def to_bf16(x: float) -> float:
    """Round a binary32 value to bfloat16, nearest even (x is finite)."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", u))[0]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "decode":
        print(decode_file(sys.argv[2]))
        return 0
    units = hurwitz()
    out = {
        "description": "HQMQ secondary and joint codebooks (format/codecs/hqmq.md); "
        "f32 values as hex bit patterns; generated by tools/hqmq_reference.py",
        "cases": [],
    }
    for seed, layer, head, kind, s in CASES:
        sec = secondaries(seed, layer, head, kind, s)
        out["cases"].append(
            {
                "seed": str(seed),
                "layer": layer,
                "head": head,
                "kind": "K" if kind == 0 else "V",
                "state0": "%016x" % codebook_state(seed, layer, head, kind),
                "secondary": [[bits(v) for v in q] for q in sec],
                "joint": [
                    {"p": p, "s": si, "j": p * s + si, "value": [bits(v) for v in hamilton(units[p], sec[si])]}
                    for p, si in JOINT
                ],
            }
        )
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
