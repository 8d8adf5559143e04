"""kvpack.lmcache: the kvpack serde inside the real LMCache package.

Tested with ``lmcache==0.5.6`` (its wheel is for CPython 3.11). Everything
here runs on a CPU: LMCache's own host-memory allocator makes the memory
objects, its serde factory builds the processor from a JSON-style config,
and a real ``StorageManager`` (CPU L1 tier + the local-disk ``fs`` L2 back
end) stores and retrieves chunks through the serde.

Chunk data are real KV values: the committed fixture's Gemma-3-270M cache
(18 layers, 1 KV head x 256) cut into LMCache chunks of 256 tokens
``[2, 18, 256, 256]`` (and the 255-token tail chunk), and the same values
rearranged into the Llama-3-8B chunk shape ``[2, 32, 256, 8 * 128]``.

Skipped, with the reason printed by ``pytest -rs``, when torch, lmcache or
safetensors is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="kvpack.lmcache tests need torch")
pytest.importorskip(
    "lmcache.v1.distributed.serde",
    reason="kvpack.lmcache tests need lmcache (pip install lmcache==0.5.6; CPython 3.11 wheel)",
)
safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="kvpack.lmcache tests read the fixture with safetensors"
)

from lmcache.v1.distributed.api import (  # noqa: E402
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args  # noqa: E402
from lmcache.v1.distributed.serde import (  # noqa: E402
    Deserializer,
    SerdeConfig,
    Serializer,
    create_serde_processor,
    get_registered_serde_types,
)
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

import kvpack  # noqa: E402
import kvpack.lmcache as klm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "gemma3-270m-gpl3-520.safetensors"
CHUNK_TOKENS = 256  # LMCache's chunk size
GEMMA_LAYERS, GEMMA_HEAD_DIM = 18, 256
LLAMA_LAYERS, LLAMA_HEADS, LLAMA_HEAD_DIM = 32, 8, 128
MAGIC = b"\x89KVP\r\n\x1a\n"
TIMEOUT_S = 120.0

# Relative RMS error (||decoded - source|| / ||source||) the lossy codecs must
# stay under on these chunks. Measured (kvpack 0.1.0): int4 0.218 (Gemma
# chunk) / 0.175 (Llama-shaped), bdr128 0.104 / 0.093, hqmq:s96r4+med3
# 0.084 / 0.082; the bounds are 1.3x the larger value.
REL_RMS_BOUND = {"int4": 0.28, "bdr128": 0.14, "hqmq:s96r4+med3": 0.11}


# ----------------------------------------------------------------- data


@pytest.fixture(scope="module")
def gemma_layers() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixture's (K, V) per layer, each [tokens, 256] bf16 (1 KV head)."""
    tensors = safetensors_torch.load_file(str(FIXTURE))
    return [
        (
            tensors[f"past_key_values.{i}.key"][0, 0],
            tensors[f"past_key_values.{i}.value"][0, 0],
        )
        for i in range(GEMMA_LAYERS)
    ]


def gemma_chunk(layers, start: int, stop: int) -> torch.Tensor:
    """Tokens [start, stop) as an LMCache chunk [2, 18, stop-start, 256]."""
    k = torch.stack([kv[0][start:stop] for kv in layers])
    v = torch.stack([kv[1][start:stop] for kv in layers])
    return torch.stack([k, v]).contiguous()


def llama_chunk(layers) -> torch.Tensor:
    """Real Gemma K/V values in the Llama-3-8B chunk shape [2, 32, 256, 1024].

    Head h of layer l is one 128-wide half of Gemma layer (l + h) % 18's
    256-wide vectors (half h % 2), tokens 0..256.
    """
    base = gemma_chunk(layers, 0, CHUNK_TOKENS)  # [2, 18, 256, 256]
    heads = []
    for h in range(LLAMA_HEADS):
        idx = [(layer + h) % GEMMA_LAYERS for layer in range(LLAMA_LAYERS)]
        half = (h % 2) * LLAMA_HEAD_DIM
        heads.append(base[:, idx, :, half : half + LLAMA_HEAD_DIM])
    return torch.cat(heads, dim=-1).contiguous()


@pytest.fixture(scope="module")
def chunks(gemma_layers) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (chunk, head_dim)."""
    return {
        "gemma3-270m": (gemma_chunk(gemma_layers, 0, CHUNK_TOKENS), GEMMA_HEAD_DIM),
        "gemma3-270m-tail": (gemma_chunk(gemma_layers, CHUNK_TOKENS, 511), GEMMA_HEAD_DIM),
        "llama3-8b": (llama_chunk(gemma_layers), LLAMA_HEAD_DIM),
    }


# ------------------------------------------------------ LMCache objects


class Objects:
    """LMCache TensorMemoryObjs from LMCache's own CPU allocator, freed at exit."""

    def __init__(self, capacity: int) -> None:
        self.allocator = HostMemoryAllocator(capacity)
        self.live = []

    def _keep(self, obj):
        assert obj is not None, "LMCache host allocator is full"
        self.live.append(obj)
        return obj

    def kv(self, chunk: torch.Tensor):
        """A KV memory object [2, layers, tokens, hidden] holding ``chunk``."""
        obj = self._keep(self.allocator.allocate(chunk.shape, chunk.dtype, fmt=MemoryFormat.KV_2LTD))
        obj.tensor.copy_(chunk)
        return obj

    def empty_kv(self, shape, dtype):
        obj = self._keep(self.allocator.allocate(torch.Size(shape), dtype, fmt=MemoryFormat.KV_2LTD))
        obj.tensor.fill_(float("nan"))  # nothing left over can pass for decoded data
        return obj

    def buffer(self, size: int):
        """A byte-buffer memory object of ``size`` uint8, filled with 0xA5."""
        obj = self._keep(
            self.allocator.allocate(torch.Size([size]), torch.uint8, fmt=MemoryFormat.BINARY_BUFFER)
        )
        obj.tensor.fill_(0xA5)  # stale bytes, as a reused L1 block has
        return obj

    def close(self) -> None:
        for obj in self.live:
            obj.ref_count_down()
        self.live.clear()


@pytest.fixture
def objects():
    pool = Objects(384 << 20)
    yield pool
    pool.close()


def layout_of(chunk: torch.Tensor) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[torch.Size(chunk.shape)], dtypes=[chunk.dtype])


def key_of(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name="kvpack-test/model", kv_rank=0)


def processor(**config):
    """The processor LMCache builds for ``"serde": {"type": "kvpack", ...}``."""
    return create_serde_processor(SerdeConfig(type="kvpack", kwargs=config))


def wait_result(query, task_id):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        result = query(task_id)
        if result is not None:
            return result
        time.sleep(0.01)
    raise AssertionError(f"serde task {task_id} did not finish in {TIMEOUT_S} s")


def serde_round_trip(objects, chunk, **config):
    """chunk -> AsyncSerdeProcessor serialize -> deserialize; returns (out, stored bytes, n)."""
    proc = processor(**config)
    try:
        size = proc.estimate_serialized_size(layout_of(chunk))
        src, buf, key = objects.kv(chunk), objects.buffer(size), key_of(1)
        assert wait_result(proc.query_serialize_result, proc.submit_serialize([src], [buf], [key]))
        n = buf.get_size()  # AsyncSerdeProcessor narrowed it to serialize()'s result
        stored = bytes(buf.byte_array)
        back = objects.buffer(size)
        back.tensor[:n].copy_(torch.frombuffer(bytearray(stored), dtype=torch.uint8))
        out = objects.empty_kv(chunk.shape, chunk.dtype)
        assert wait_result(proc.query_deserialize_result, proc.submit_deserialize([back], [out], [key]))
        return out.tensor.clone(), stored, n
    finally:
        proc.close()


def direct_decode(chunk, codec, head_dim):
    """The same chunk through kvpack's chunk API alone (no LMCache)."""
    data = kvpack.encode_chunk(chunk, codec, head_dim=head_dim)
    out = torch.empty_like(chunk)
    kvpack.decode_chunk(data, out)
    return out, data


def rel_rms(decoded: torch.Tensor, source: torch.Tensor) -> float:
    d, s = decoded.double(), source.double()
    return float(torch.linalg.vector_norm(d - s) / torch.linalg.vector_norm(s))


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module", autouse=True)
def registered():
    klm.register()


def test_register_is_idempotent_and_refuses_a_taken_name():
    klm.register()
    klm.register()
    assert "kvpack" in get_registered_serde_types()
    with pytest.raises(ValueError, match="fp8"):
        klm.register("fp8")  # LMCache's own fp8 serde holds that name
    config = klm.KvpackSerdeConfig.from_dict({"head_dim": 128})
    assert isinstance(klm.KvpackSerializer(config), Serializer)
    assert isinstance(klm.KvpackDeserializer(config), Deserializer)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"codec": "raw"}, "head_dim"),
        ({"codec": "raw", "head_dim": 128, "windows": 4}, "unknown key"),
        ({"codec": "no-such-codec", "head_dim": 128}, "no-such-codec"),
        ({"codec": "raw", "head_dim": "128"}, "integer"),
        ({"codec": "raw", "head_dim": 128, "sink": -1}, "sink"),
        ({"codec": "raw", "head_dim": 128, "pad": "yes"}, "pad"),
        ({"codec": "raw", "head_dim": 128, "max_workers": 0}, "max_workers"),
    ],
)
def test_bad_config_is_refused_when_lmcache_builds_the_serde(config, message):
    with pytest.raises(kvpack.ParameterError, match=message):
        processor(**config)


@pytest.mark.parametrize("codec", ["raw", "int4", "bdr128", "hqmq:s24r3"])
@pytest.mark.parametrize("name", ["gemma3-270m", "gemma3-270m-tail", "llama3-8b"])
def test_estimate_is_the_exact_size_for_shape_determined_codecs(chunks, name, codec):
    chunk, head_dim = chunks[name]
    proc = processor(codec=codec, head_dim=head_dim)
    try:
        estimate = proc.estimate_serialized_size(layout_of(chunk))
        assert estimate == len(kvpack.encode_chunk(chunk, codec, head_dim=head_dim))
        assert estimate <= kvpack.chunk_max_size(tuple(chunk.shape), "bf16", codec, head_dim=head_dim)
    finally:
        proc.close()


@pytest.mark.parametrize("codec", ["hqmq:s96r4+med3", "hqmq:s5r2+med2"])
def test_estimate_is_kvpacks_bound_for_data_dependent_codecs(chunks, codec):
    chunk, head_dim = chunks["gemma3-270m"]
    proc = processor(codec=codec, head_dim=head_dim)
    try:
        bound = kvpack.chunk_max_size(tuple(chunk.shape), "bf16", codec, head_dim=head_dim)
        assert proc.estimate_serialized_size(layout_of(chunk)) == bound
        assert len(kvpack.encode_chunk(chunk, codec, head_dim=head_dim)) < bound
    finally:
        proc.close()


@pytest.mark.parametrize("codec", ["bdr128", "hqmq:s96r4+med3"])
def test_one_serializer_sizes_each_layout_it_meets(chunks, codec):
    """Every layout (shape, dtype) gets its own size."""
    full, head_dim = chunks["gemma3-270m"]
    tail, _ = chunks["gemma3-270m-tail"]
    config = klm.KvpackSerdeConfig.from_dict({"codec": codec, "head_dim": head_dim})
    serializer = klm.KvpackSerializer(config)
    for chunk in (full, tail, full.to(torch.float16), tail.to(torch.float32)):
        size = serializer.estimate_serialized_size(layout_of(chunk))
        dtype = str(chunk.dtype).removeprefix("torch.")
        bound = kvpack.chunk_max_size(tuple(chunk.shape), dtype, codec, head_dim=head_dim)
        exact = len(kvpack.encode_chunk(chunk, codec, head_dim=head_dim))
        assert size == (bound if "+med" in codec else exact)


def test_layouts_kvpack_cannot_take_are_refused(chunks):
    chunk, _ = chunks["gemma3-270m"]
    serializer = klm.KvpackSerializer(klm.KvpackSerdeConfig.from_dict({"codec": "raw", "head_dim": 96}))
    with pytest.raises(kvpack.ParameterError):  # 256 is no multiple of 96
        serializer.estimate_serialized_size(layout_of(chunk))
    two_groups = MemoryLayoutDesc(shapes=[chunk.shape, chunk.shape], dtypes=[chunk.dtype, chunk.dtype])
    with pytest.raises(kvpack.ParameterError, match="2 shape groups"):
        serializer.estimate_serialized_size(two_groups)
    mla = MemoryLayoutDesc(shapes=[torch.Size([1, 18, 256, 576])], dtypes=[chunk.dtype])
    with pytest.raises(kvpack.ParameterError):  # LMCache's MLA format has no K/V axis
        serializer.estimate_serialized_size(mla)
    ints = MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[torch.int32])
    with pytest.raises(kvpack.ParameterError, match="int32"):
        serializer.estimate_serialized_size(ints)


@pytest.mark.parametrize("name", ["gemma3-270m", "gemma3-270m-tail", "llama3-8b"])
def test_raw_round_trip_is_exact(objects, chunks, name):
    chunk, head_dim = chunks[name]
    out, stored, n = serde_round_trip(objects, chunk, codec="raw", head_dim=head_dim)
    assert torch.equal(out, chunk)
    assert n == len(stored) == len(kvpack.encode_chunk(chunk, "raw", head_dim=head_dim))
    assert stored.startswith(MAGIC) and stored.endswith(MAGIC)


@pytest.mark.parametrize("codec", ["int4", "bdr128", "hqmq:s96r4+med3"])
@pytest.mark.parametrize("name", ["gemma3-270m", "llama3-8b"])
def test_lossy_round_trip_matches_kvpack_and_stays_within_bound(objects, chunks, name, codec):
    chunk, head_dim = chunks[name]
    out, stored, n = serde_round_trip(objects, chunk, codec=codec, head_dim=head_dim)
    expected, data = direct_decode(chunk, codec, head_dim)
    assert torch.equal(out, expected), "the serde must add nothing to the codec's own loss"
    assert stored[: len(data)] == data, "the stored object is kvpack's file for this chunk"
    if "+med" in codec:  # data-dependent size: the file, then zeros up to the bound
        assert n == kvpack.chunk_max_size(tuple(chunk.shape), "bf16", codec, head_dim=head_dim)
        assert not any(stored[len(data) :])
    else:
        assert n == len(data)
    error = rel_rms(out, chunk)
    print(f"{name} {codec}: relative RMS error {error:.4f}, file {len(data)} B, source {chunk.numel() * 2} B")
    assert 0 < error < REL_RMS_BOUND[codec]


def test_sink_and_recent_windows_reach_the_file(objects, chunks):
    """ "sink" and "recent" keep the chunk's first and last tokens exact."""
    chunk, head_dim = chunks["gemma3-270m"]
    out, stored, n = serde_round_trip(objects, chunk, codec="int4", head_dim=head_dim, sink=16, recent=32)
    assert stored == kvpack.encode_chunk(chunk, "int4", head_dim=head_dim, sink=16, recent=32)
    assert n == len(stored)
    assert torch.equal(out[:, :, :16], chunk[:, :, :16])
    assert torch.equal(out[:, :, -32:], chunk[:, :, -32:])
    assert not torch.equal(out[:, :, 16:-32], chunk[:, :, 16:-32])


def test_stored_object_is_a_kvpack_file_with_the_chunk_tensors(objects, chunks):
    chunk, head_dim = chunks["llama3-8b"]
    _, stored, _ = serde_round_trip(objects, chunk, codec="bdr128", head_dim=head_dim)
    archive = kvpack.open(stored)
    assert archive.num_layers == LLAMA_LAYERS
    assert archive.codecs[0] == "bdr128"
    tensors = {(t.layer, t.kind): t for t in archive.tensors}
    assert len(tensors) == 2 * LLAMA_LAYERS
    k0 = tensors[(0, "K")]
    assert (k0.dtype, k0.kv_heads, k0.tokens, k0.head_dim) == (
        "bf16",
        LLAMA_HEADS,
        CHUNK_TOKENS,
        LLAMA_HEAD_DIM,
    )


def test_fp16_chunk_round_trips_exactly(objects, chunks):
    chunk, head_dim = chunks["gemma3-270m"]
    chunk16 = chunk.to(torch.float16)
    out, _, _ = serde_round_trip(objects, chunk16, codec="raw", head_dim=head_dim)
    assert out.dtype == torch.float16 and torch.equal(out, chunk16)


def test_batched_tasks_on_two_workers(objects, chunks):
    """Two concurrent batch tasks (two chunks each) on LMCache's thread pool."""
    chunk, head_dim = chunks["gemma3-270m"]
    variants = [chunk, chunk.flip(2), chunk * 0.5, chunk.roll(1, dims=1)]
    variants = [v.contiguous() for v in variants]
    proc = processor(codec="bdr128", head_dim=head_dim, max_workers=2)
    try:
        size = proc.estimate_serialized_size(layout_of(chunk))
        srcs = [objects.kv(v) for v in variants]
        bufs = [objects.buffer(size) for _ in variants]
        keys = [key_of(40 + i) for i in range(len(variants))]
        tasks = [proc.submit_serialize(srcs[i : i + 2], bufs[i : i + 2], keys[i : i + 2]) for i in (0, 2)]
        assert all(wait_result(proc.query_serialize_result, t) for t in tasks)
        for v, buf in zip(variants, bufs):
            assert bytes(buf.byte_array) == kvpack.encode_chunk(v, "bdr128", head_dim=head_dim)
        outs = [objects.empty_kv(chunk.shape, chunk.dtype) for _ in variants]
        tasks = [proc.submit_deserialize(bufs[i : i + 2], outs[i : i + 2], keys[i : i + 2]) for i in (0, 2)]
        assert all(wait_result(proc.query_deserialize_result, t) for t in tasks)
        for v, out in zip(variants, outs):
            assert torch.equal(out.tensor, direct_decode(v, "bdr128", head_dim)[0])
    finally:
        proc.close()


def test_both_call_signatures(objects, chunks):
    """LMCache 0.5.x passes ``key``; other callers (and other releases) do not."""
    chunk, head_dim = chunks["gemma3-270m"]
    config = klm.KvpackSerdeConfig.from_dict({"codec": "bdr128", "head_dim": head_dim})
    serializer, deserializer = klm.KvpackSerializer(config), klm.KvpackDeserializer(config)
    size = serializer.estimate_serialized_size(layout_of(chunk))
    src, key = objects.kv(chunk), key_of(2)
    results = []
    for call in (
        lambda s, d: serializer.serialize(s, d, key),
        lambda s, d: serializer.serialize(s, d),
        lambda s, d: serializer.serialize(s, d, key=key),
    ):
        buf = objects.buffer(size)
        n = call(src, buf)
        results.append(bytes(buf.byte_array)[:n])
    assert results[0] == results[1] == results[2]
    decoded = []
    for call in (
        lambda s, d: deserializer.deserialize(s, d, key),
        lambda s, d: deserializer.deserialize(s, d),
        lambda s, d: deserializer.deserialize(s, d, key=key),
    ):
        buf = objects.buffer(size)
        buf.tensor.copy_(torch.frombuffer(bytearray(results[0]), dtype=torch.uint8))
        out = objects.empty_kv(chunk.shape, chunk.dtype)
        call(buf, out)
        decoded.append(out.tensor.clone())
    assert torch.equal(decoded[0], decoded[1]) and torch.equal(decoded[0], decoded[2])
    assert torch.equal(decoded[0], direct_decode(chunk, "bdr128", head_dim)[0])


def test_damaged_object_is_refused(objects, chunks):
    chunk, head_dim = chunks["gemma3-270m"]
    config = klm.KvpackSerdeConfig.from_dict({"codec": "bdr128", "head_dim": head_dim})
    serializer, deserializer = klm.KvpackSerializer(config), klm.KvpackDeserializer(config)
    buf = objects.buffer(serializer.estimate_serialized_size(layout_of(chunk)))
    n = serializer.serialize(objects.kv(chunk), buf)
    out = objects.empty_kv(chunk.shape, chunk.dtype)
    length = klm.file_length(buf.tensor[:n].numpy())
    buf.tensor[length // 2] ^= 0x10  # one bit in the middle of the file
    with pytest.raises(kvpack.FormatError):
        deserializer.deserialize(buf, out)
    zeros = objects.buffer(4096)
    zeros.tensor.zero_()
    with pytest.raises(kvpack.FormatError, match="does not end with a kvpack file"):
        deserializer.deserialize(zeros, out)
    too_small = objects.buffer(n // 2)
    with pytest.raises(kvpack.ParameterError, match="destination buffer"):
        serializer.serialize(objects.kv(chunk), too_small)


# ------------------------------------- LMCache storage manager + local disk


def kvpack_cli() -> list[str]:
    """The kvpack command line: $KVPACK_BIN, target/release/kvpack, or PATH."""
    for candidate in (
        os.environ.get("KVPACK_BIN"),
        str(ROOT / "target" / "release" / "kvpack"),
        shutil.which("kvpack"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return [candidate]
    pytest.skip("the kvpack CLI is not built (cargo build --release, or set KVPACK_BIN)")


@contextlib.contextmanager
def storage_manager(disk: Path, serde: dict):
    """LMCache's StorageManager: 0.25 GiB CPU L1, one local-disk L2 with ``serde``."""
    adapter = {"type": "fs", "base_path": str(disk), "serde": serde}
    config = parse_args(
        ["--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)]
    )
    manager = StorageManager(config)
    try:
        yield manager
    finally:
        manager.close()


def store(manager, disk: Path, keys, chunk_list) -> list[Path]:
    layout = layout_of(chunk_list[0])
    reserved = manager.reserve_write(keys, layout)
    for key, chunk in zip(keys, chunk_list):
        reserved[key].tensor.copy_(chunk)
    manager.finish_write(keys)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        files = sorted(p for p in disk.iterdir() if p.suffix == ".data")
        if len(files) == len(keys):
            return files
        time.sleep(0.02)
    raise AssertionError(f"LMCache stored {len(files)} of {len(keys)} chunks")


def retrieve(manager, keys, layout):
    """Drop L1, prefetch from L2; returns (L2 hits, chunks or None)."""
    manager.clear(force=True)
    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
    handle = manager.submit_prefetch_task(spec)
    assert manager.wait_prefetch_status(handle, TIMEOUT_S)
    result = manager.query_prefetch_status(handle)
    hits = result.l2_hit_count
    if hits != len(keys):
        return hits, None
    with manager.read_prefetched_results(keys) as objs:
        chunks_back = [obj.tensor.clone() for obj in objs]
    manager.finish_read_prefetched(keys)
    return hits, chunks_back


def inspect(path: Path) -> str:
    """``kvpack inspect`` of ``path`` (the CLI), printed and returned."""
    run = subprocess.run(
        [*kvpack_cli(), "inspect", str(path)], check=False, capture_output=True, text=True, timeout=60
    )
    print(run.stdout)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_lmcache_disk_store_and_retrieve(tmp_path, chunks):
    """Two Llama-3-8B-shaped chunks through LMCache's fs back end: stored as
    kvpack files of exactly the encoded size, inspected, loaded back."""
    chunk, head_dim = chunks["llama3-8b"]
    second = chunk.flip(2).contiguous()  # another chunk of the same shape
    keys = [key_of(10), key_of(11)]
    serde = {"type": "kvpack", "codec": "bdr128", "head_dim": head_dim}
    with storage_manager(tmp_path, serde) as manager:
        files = store(manager, tmp_path, keys, [chunk, second])
        expected = {kvpack.encode_chunk(c, "bdr128", head_dim=head_dim) for c in (chunk, second)}
        assert {f.read_bytes() for f in files} == expected

        archive = kvpack.open(str(files[0]))
        assert archive.num_layers == LLAMA_LAYERS and archive.codecs[0] == "bdr128"
        report = inspect(files[0])
        assert "bdr128" in report and "interrupted append" not in report

        hits, back = retrieve(manager, keys, layout_of(chunk))
        assert hits == 2
        assert torch.equal(back[0], direct_decode(chunk, "bdr128", head_dim)[0])
        assert torch.equal(back[1], direct_decode(second, "bdr128", head_dim)[0])


def test_lmcache_disk_store_of_a_data_dependent_codec_is_padded(tmp_path, chunks):
    """hqmq+med3 sizes depend on the data: the stored object is the kvpack file
    then zeros up to the bound; it loads back, and kvpack inspect reads it."""
    chunk, head_dim = chunks["gemma3-270m"]
    codec = "hqmq:s96r4+med3"
    keys = [key_of(15)]
    with storage_manager(tmp_path, {"type": "kvpack", "codec": codec, "head_dim": head_dim}) as manager:
        (path,) = store(manager, tmp_path, keys, [chunk])
        expected, data = direct_decode(chunk, codec, head_dim)
        stored = path.read_bytes()
        assert len(stored) == kvpack.chunk_max_size(tuple(chunk.shape), "bf16", codec, head_dim=head_dim)
        assert stored[: len(data)] == data and not any(stored[len(data) :])
        assert f"{len(stored) - len(data)} bytes after the last commit" in inspect(path)
        hits, back = retrieve(manager, keys, layout_of(chunk))
        assert hits == 1 and torch.equal(back[0], expected)


def test_lmcache_reports_a_damaged_disk_object_as_a_miss(tmp_path, chunks):
    chunk, head_dim = chunks["gemma3-270m"]
    keys = [key_of(20)]
    with storage_manager(tmp_path, {"type": "kvpack", "codec": "raw", "head_dim": head_dim}) as manager:
        (path,) = store(manager, tmp_path, keys, [chunk])
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))
        hits, back = retrieve(manager, keys, layout_of(chunk))
        assert (hits, back) == (0, None)


def test_lmcache_0_5_6_reads_back_the_full_estimate(tmp_path, chunks):
    """Why the serde pads: LMCache 0.5.6's fs back end reads back
    estimate_serialized_size bytes and counts a shorter object as a miss."""
    chunk, head_dim = chunks["gemma3-270m"]
    keys = [key_of(30)]
    codec = "hqmq:s96r4+med3"  # data-dependent size: shorter than the estimate
    serde = {"type": "kvpack", "codec": codec, "head_dim": head_dim, "pad": False}
    with storage_manager(tmp_path, serde) as manager:
        (path,) = store(manager, tmp_path, keys, [chunk])
        assert path.read_bytes() == kvpack.encode_chunk(chunk, codec, head_dim=head_dim)
        hits, _ = retrieve(manager, keys, layout_of(chunk))
        assert hits == 0
