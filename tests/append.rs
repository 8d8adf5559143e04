//! Prompt-cache persistence: `append` adds the following tokens as a new
//! commit without rewriting existing bytes, and a crash at any point leaves
//! exactly the old or the new cache.

mod common;

use std::path::Path;

use common::*;
use kvpack::compress::CompressOptions;
use kvpack::decode::{Archive, Selection};
use kvpack::io::file::append_file;
use kvpack::plan::Layout;
use kvpack::{KvCache, Tensor, TensorData, TensorInfo};

/// The cache truncated by its last tokens: every tensor keeps its first
/// `keep(tokens)` slots, with the first `ids` token ids.
fn prefix(c: &KvCache, keep: impl Fn(u32) -> u32, ids: usize) -> KvCache {
    let tensors = c
        .tensors
        .iter()
        .map(|t| {
            let n = keep(t.info.tokens);
            let info = TensorInfo {
                tokens: n,
                ..t.info.clone()
            };
            let src = t.data.to_f32();
            let (tt, d) = (t.info.tokens as usize, t.info.head_dim as usize);
            let mut v = Vec::new();
            for p in 0..t.info.planes() {
                v.extend_from_slice(&src[p * tt * d..(p * tt + n as usize) * d]);
            }
            let mut data = TensorData::zeros(t.info.dtype, v.len());
            data.as_elems_mut().store(0, &v);
            Tensor::new(info, data).unwrap()
        })
        .collect();
    KvCache {
        tensors,
        metadata: c.metadata.clone(),
        token_ids: c.token_ids[..ids.min(c.token_ids.len())].to_vec(),
    }
}

fn write_file(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

fn decode(bytes: &[u8]) -> KvCache {
    Archive::open(bytes)
        .unwrap()
        .decode(&Selection::default(), None, None)
        .unwrap()
}

#[test]
fn appending_the_second_half_equals_compressing_the_whole() {
    let fx = fixture().cache;
    let dir = tempfile::tempdir().unwrap();
    for codec in ["bdr128", "int4", "raw"] {
        // The first "half": every layer without its last 254 tokens (global
        // layers 266 of 520, sliding layers 257 of 511), the prompt's first
        // 266 token ids. The append adds the 254 tokens that follow.
        let half = prefix(&fx, |t| t - 254, 266);
        let path = dir.path().join(format!("{codec}.kvpack"));
        write_file(
            &path,
            &compress_bytes(&half, codec, Layout::default(), None),
        );
        let before = std::fs::read(&path).unwrap();
        let r = append_file(&path, &fx, false, &CompressOptions::default(), &|_| {}).unwrap();
        assert_eq!(r.generation, 1);
        let after = std::fs::read(&path).unwrap();
        assert_eq!(
            &after[..before.len()],
            &before[..],
            "{codec}: existing bytes were rewritten"
        );
        let whole = decode(&compress_bytes(&fx, codec, Layout::default(), None));
        let appended = decode(&after);
        assert_eq!(appended.tensors, whole.tensors, "{codec}");
        assert_eq!(appended.token_ids, fx.token_ids);
        // Appending the same cache again adds nothing but a commit.
        let r2 = append_file(&path, &fx, false, &CompressOptions::default(), &|_| {}).unwrap();
        assert_eq!((r2.generation, r2.report.pages), (2, 0));
        assert_eq!(
            decode(&std::fs::read(&path).unwrap()).tensors,
            whole.tensors
        );
    }
}

#[test]
fn a_mismatched_prefix_or_model_is_refused_and_the_file_is_untouched() {
    let fx = fixture().cache;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kvpack");
    let half = prefix(&fx, |t| t - 254, 266);
    write_file(
        &path,
        &compress_bytes(&half, "int4", Layout::default(), None),
    );
    let before = std::fs::read(&path).unwrap();
    let mut other = fx.clone();
    other.token_ids[17] += 1;
    let e = append_file(&path, &other, false, &CompressOptions::default(), &|_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("token 17"), "{e}");
    let mut other = fx.clone();
    other.metadata.insert("kvpack.model".into(), "llama".into());
    assert!(
        append_file(&path, &other, false, &CompressOptions::default(), &|_| {})
            .unwrap_err()
            .to_string()
            .contains("model")
    );
    let shorter = prefix(&fx, |t| t - 400, 120);
    assert!(append_file(&path, &shorter, false, &CompressOptions::default(), &|_| {}).is_err());
    // A rolled sliding window (as a real 266 -> 520 continuation of Gemma
    // gives: sliding layers stay at 511 slots) is refused.
    let mut rolled = fx.clone();
    for t in &mut rolled.tensors {
        if t.info.tokens == 511 {
            *t = prefix(
                &KvCache {
                    tensors: vec![t.clone()],
                    ..Default::default()
                },
                |_| 300,
                0,
            )
            .tensors
            .remove(0);
        }
    }
    let e = append_file(&path, &rolled, false, &CompressOptions::default(), &|_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("sliding window rolled"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
    // Without token ids on either side, only --force appends.
    let mut anon = half.clone();
    anon.token_ids.clear();
    write_file(
        &path,
        &compress_bytes(&anon, "int4", Layout::default(), None),
    );
    let mut full = fx.clone();
    full.token_ids.clear();
    assert!(
        append_file(&path, &full, false, &CompressOptions::default(), &|_| {})
            .unwrap_err()
            .to_string()
            .contains("--force")
    );
    append_file(&path, &full, true, &CompressOptions::default(), &|_| {}).unwrap();
}

/// A small real cache (the fixture's first 3 layers, 24 -> 40 tokens) so
/// that every byte offset of the appended region can be tried.
fn small_pair() -> (KvCache, KvCache) {
    let mut fx = fixture().cache;
    fx.tensors.truncate(6);
    let long = prefix(&fx, |_| 40, 40);
    let short = prefix(&fx, |_| 24, 24);
    (short, long)
}

#[test]
fn truncating_at_every_byte_of_an_append_gives_the_old_or_the_new_cache() {
    let (short, long) = small_pair();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kvpack");
    let layout = Layout {
        page_tokens: 8,
        sink: 2,
        recent: 4,
    };
    write_file(&path, &compress_bytes(&short, "bdr64", layout, None));
    let old = std::fs::read(&path).unwrap();
    let opts = CompressOptions {
        layout,
        ..Default::default()
    };
    append_file(&path, &long, false, &opts, &|_| {}).unwrap();
    let new = std::fs::read(&path).unwrap();
    assert!(
        new.len() > old.len() + 10_000,
        "appended region {} bytes",
        new.len() - old.len()
    );
    let old_idx = Archive::open(&old).unwrap().reader().index().clone();
    let new_idx = Archive::open(&new).unwrap().reader().index().clone();
    let old_dec = decode(&old);
    for cut in old.len()..=new.len() {
        let ar = Archive::open(&new[..cut]).unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        let idx = ar.reader().index();
        if cut == new.len() {
            assert_eq!(*idx, new_idx);
            assert_eq!(ar.reader().torn_tail(), 0);
        } else {
            assert_eq!(*idx, old_idx, "cut at {cut} shows a mix");
            assert_eq!(ar.reader().torn_tail() as usize, cut - old.len());
        }
    }
    // The old commit seen through a torn file decodes exactly as before.
    let mid = (old.len() + new.len()) / 2;
    assert_eq!(decode(&new[..mid]), old_dec);
    // An append after a crash removes the torn tail first.
    write_file(&path, &new[..mid]);
    let r = append_file(&path, &long, false, &opts, &|_| {}).unwrap();
    assert_eq!(r.torn_tail_removed as usize, mid - old.len());
    assert_eq!(std::fs::read(&path).unwrap(), new);
}

#[test]
fn a_mapped_reader_keeps_its_view_during_an_append() {
    let (short, long) = small_pair();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kvpack");
    write_file(
        &path,
        &compress_bytes(&short, "int4", Layout::default(), None),
    );
    let map = kvpack::io::file::open_input(path.to_str().unwrap()).unwrap();
    let ar = Archive::open(&map).unwrap();
    let before = ar.decode(&Selection::default(), None, None).unwrap();
    append_file(&path, &long, false, &CompressOptions::default(), &|_| {}).unwrap();
    assert_eq!(
        ar.decode(&Selection::default(), None, None).unwrap(),
        before
    );
    let map2 = kvpack::io::file::open_input(path.to_str().unwrap()).unwrap();
    assert_eq!(
        Archive::open(&map2)
            .unwrap()
            .decode(&Selection::default(), None, None)
            .unwrap()
            .tensors[0]
            .info
            .tokens,
        40
    );
}

#[test]
fn killing_a_real_append_leaves_the_old_or_the_new_cache() {
    // A raw 4-layer cache of 1 Mi elements per tensor makes an append of
    // ~16 MB, long enough to be killed in the middle.
    let specs = [LayerSpec {
        batch: 1,
        heads: 8,
        tokens: 1024,
        head_dim: 128,
    }; 4];
    let long = synthetic(&specs, kvpack::DType::Bf16, 3);
    let short = prefix(&long, |_| 64, 64);
    let dir = tempfile::tempdir().unwrap();
    let more = dir.path().join("more.safetensors");
    let mut f = std::fs::File::create(&more).unwrap();
    kvpack::io::safetensors::write(&long, &mut f).unwrap();
    drop(f);
    let base = compress_bytes(&short, "raw", Layout::default(), None);
    let path = dir.path().join("c.kvpack");
    // Time one complete append.
    write_file(&path, &base);
    let t = std::time::Instant::now();
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args([
            "append",
            path.to_str().unwrap(),
            more.to_str().unwrap(),
            "-q",
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let full = t.elapsed();
    let new = std::fs::read(&path).unwrap();
    let new_idx = Archive::open(&new).unwrap().reader().index().clone();
    let old_idx = Archive::open(&base).unwrap().reader().index().clone();
    let (mut mid_write, mut trials) = (0, 0);
    for i in 0..16 {
        write_file(&path, &base);
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvpack"))
            .args([
                "append",
                path.to_str().unwrap(),
                more.to_str().unwrap(),
                "-q",
            ])
            .spawn()
            .unwrap();
        std::thread::sleep(full.mul_f64(0.15 + 0.07 * i as f64));
        child.kill().ok();
        child.wait().unwrap();
        trials += 1;
        let got = std::fs::read(&path).unwrap();
        if got.len() > base.len() && got.len() < new.len() {
            mid_write += 1;
        }
        let ar = Archive::open(&got)
            .unwrap_or_else(|e| panic!("after kill {i} ({} bytes): {e}", got.len()));
        let idx = ar.reader().index();
        assert!(
            *idx == old_idx || *idx == new_idx,
            "kill {i}: a mix of commits"
        );
        if *idx == new_idx {
            assert_eq!(&got[..new.len()], &new[..]);
        }
    }
    eprintln!(
        "{mid_write} of {trials} kills landed while the append was writing (full append {full:?})"
    );
    assert!(
        mid_write > 0,
        "no kill landed mid-write; the test did not exercise anything"
    );
}

/// Issue 12 section 3: a flipped bit anywhere in the final trailer of an
/// appended file is reported as damage, never read as a torn append that
/// silently falls back to the previous commit; and `append` refuses such a
/// file without changing a byte.
#[test]
fn final_trailer_bit_flip_is_damage_not_a_torn_append() {
    let (short, long) = small_pair();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kvpack");
    let layout = Layout {
        page_tokens: 8,
        sink: 2,
        recent: 4,
    };
    write_file(&path, &compress_bytes(&short, "bdr64", layout, None));
    let opts = CompressOptions {
        layout,
        ..Default::default()
    };
    append_file(&path, &long, false, &opts, &|_| {}).unwrap();
    let good = std::fs::read(&path).unwrap();
    let n = good.len();
    for bit in 0..64 * 8 {
        let mut b = good.clone();
        b[n - 64 + bit / 8] ^= 1 << (bit % 8);
        let e = Archive::open(&b).expect_err(&format!("bit {bit} accepted"));
        assert!(e.to_string().contains("damaged"), "bit {bit}: {e}");
    }
    let mut b = good.clone();
    b[n - 60] ^= 0x10;
    write_file(&path, &b);
    assert!(append_file(&path, &long, false, &opts, &|_| {}).is_err());
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b,
        "a refused append changed the file"
    );
}

/// Issue 12 section 3: an append that is refused (here: the new cache is not
/// an extension) leaves a file with a torn tail exactly as it was; the torn
/// tail is no longer truncated before the append is known to proceed.
#[test]
fn refused_append_after_a_torn_tail_changes_nothing() {
    let (short, long) = small_pair();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kvpack");
    let layout = Layout {
        page_tokens: 8,
        sink: 2,
        recent: 4,
    };
    write_file(&path, &compress_bytes(&short, "bdr64", layout, None));
    let old_len = std::fs::metadata(&path).unwrap().len() as usize;
    let opts = CompressOptions {
        layout,
        ..Default::default()
    };
    append_file(&path, &long, false, &opts, &|_| {}).unwrap();
    let new = std::fs::read(&path).unwrap();
    let torn = new[..(old_len + new.len()) / 2].to_vec();
    write_file(&path, &torn);
    // A cache that is not an extension of the stored one.
    let mut other = long.clone();
    other.token_ids[0] ^= 1;
    assert!(append_file(&path, &other, false, &opts, &|_| {}).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), torn);
    // The proper append still recovers and matches a clean append.
    append_file(&path, &long, false, &opts, &|_| {}).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), new);
}
