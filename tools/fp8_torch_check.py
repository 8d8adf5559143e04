"""Cross-checks kvpack's fp8 (E4M3FN / E5M2) conversions against torch's
float8_e4m3fn / float8_e5m2, an independent implementation.

1. Narrowing: 262,144 f32 values spread over both formats' ranges (|x| <=
   440, exponents -18..15) go through `kvpack compress --codec raw` and
   `kvpack decompress --dtype fp8_e4m3|fp8_e5m2` (scale 1); every code must
   equal torch's `x.to(float8_*)`.
2. Scales and dequantization: the real fixture is stored as fp8 by torch with
   per-tensor scales `amax / max` (safetensors F8_E4M3 / F8_E5M2 plus
   `{name}_scale` tensors); kvpack must keep the codes and scales through
   `raw` bit for bit, and decode to f32 values equal to torch's
   `code.float() * scale`.

Writes the fp8 fixtures to --out (used for the README figures).

Usage: python tools/fp8_torch_check.py --kvpack target/release/kvpack [--out DIR]
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures/gemma3-270m-gpl3-520.safetensors"
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def run(kvpack, *args):
    subprocess.run([kvpack, *args, "-q", "-f"], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvpack", required=True)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = pathlib.Path(a.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    failures = 0

    g = torch.Generator().manual_seed(1)
    shape = (1, 1, 4096, 64)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-18, 16, shape, generator=g).float())
    x = x.clamp(-440, 440)
    save_file({"past_key_values.0.key": x, "past_key_values.0.value": x.clone()}, out / "xcheck-f32.safetensors")
    run(a.kvpack, "compress", str(out / "xcheck-f32.safetensors"), "--codec", "raw", "-o", str(out / "x.kvpack"))
    for name, (dt, _) in FORMATS.items():
        run(a.kvpack, "decompress", str(out / "x.kvpack"), "-o", str(out / f"x-{name}.safetensors"), "--dtype", f"fp8_{name}")
        got = load_file(out / f"x-{name}.safetensors")["past_key_values.0.key"].view(torch.uint8)
        bad = (got != x.to(dt).view(torch.uint8)).sum().item()
        print(f"narrowing fp8_{name}: {got.numel()} values, {bad} codes differ from torch")
        failures += bad

    with safe_open(str(FIXTURE), "pt") as f:
        meta = f.metadata()
    src = load_file(FIXTURE)
    for name, (dt, mx) in FORMATS.items():
        fp8 = {}
        for k, v in src.items():
            if k.startswith("past_key_values."):
                scale = (v.float().abs().max() / mx).float()
                fp8[k] = (v.float() / scale).clamp(-mx, mx).to(dt)
                fp8[k + "_scale"] = scale.reshape(())
            else:
                fp8[k] = v
        path = out / f"fixture-fp8-{name}.safetensors"
        save_file(fp8, path, metadata=meta)
        run(a.kvpack, "compress", str(path), "--codec", "raw", "-o", str(out / f"f-{name}.kvpack"))
        run(a.kvpack, "decompress", str(out / f"f-{name}.kvpack"), "-o", str(out / f"f-{name}-same.safetensors"))
        run(a.kvpack, "decompress", str(out / f"f-{name}.kvpack"), "-o", str(out / f"f-{name}-f32.safetensors"), "--dtype", "fp32")
        same = load_file(out / f"f-{name}-same.safetensors")
        f32 = load_file(out / f"f-{name}-f32.safetensors")
        n = bad_codes = bad_vals = 0
        for k, v in fp8.items():
            if k.startswith("past_key_values.") and not k.endswith("_scale"):
                n += v.numel()
                bad_codes += (same[k].view(torch.uint8) != v.view(torch.uint8)).sum().item()
                bad_codes += int(same[k + "_scale"].item() != fp8[k + "_scale"].item())
                bad_vals += (f32[k] != v.float() * fp8[k + "_scale"]).sum().item()
        print(f"fixture fp8_{name}: {n} values, {bad_codes} codes/scales and {bad_vals} dequantized values differ from torch")
        failures += bad_codes + bad_vals
    print("OK" if failures == 0 else f"FAILED: {failures} differences")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
