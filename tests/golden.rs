//! Golden vectors (format/vectors/): files written by this implementation
//! whose bytes and decoded output must never change for format 1.x.
//!
//! `vectors.json` lists each file with the codec and options that made it,
//! the SHA-256 of the file and of its decoded output (every tensor's
//! elements as little-endian f32, in tensor-table order), and the format
//! version the file must declare (1.0 unless the entry says 1.1: fp8 and
//! MLA latent inputs). The test checks
//! both digests, and that encoding the committed input again reproduces
//! the file byte for byte.
//!
//! To add a vector, add an entry with empty digests and run
//! `KVPACK_WRITE_VECTORS=1 cargo test --test golden`; commit the result.
//! Never regenerate an existing vector: a changed digest is a format break.

mod common;

use common::*;
use kvpack::decode::{Archive, Selection};
use kvpack::plan::Layout;
use serde_json::Value;

const DIR: &str = "format/vectors";

#[test]
fn golden_vectors_decode_bit_exactly() {
    let list_path = repo(&format!("{DIR}/vectors.json"));
    let mut list: Value = serde_json::from_slice(&std::fs::read(&list_path).unwrap()).unwrap();
    let write = std::env::var_os("KVPACK_WRITE_VECTORS").is_some();
    let mut checked = 0;
    for v in list["vectors"].as_array_mut().unwrap() {
        let input_name = v["input"].as_str().unwrap().to_string();
        let input = std::fs::read(repo(&format!("{DIR}/{input_name}"))).unwrap();
        let cache = kvpack::io::safetensors::parse(&input, &input_name)
            .unwrap()
            .cache;
        let codec = v["codec"].as_str().unwrap().to_string();
        let layout = Layout {
            page_tokens: v["page_tokens"].as_u64().unwrap() as u32,
            sink: v["sink"].as_u64().unwrap() as u32,
            recent: v["recent"].as_u64().unwrap() as u32,
        };
        let zstd = v["zstd"].as_i64().map(|z| z as i32);
        let encoded = compress_bytes(&cache, &codec, layout, zstd);
        let file = repo(&format!("{DIR}/{}", v["file"].as_str().unwrap()));
        let have_digest = v["file_sha256"].as_str().is_some_and(|s| !s.is_empty());
        if write && !have_digest {
            std::fs::write(&file, &encoded).unwrap();
        }
        let bytes = std::fs::read(&file)
            .unwrap_or_else(|_| panic!("missing golden file {}", file.display()));
        let decoded = Archive::open(&bytes)
            .unwrap()
            .decode(&Selection::default(), None, None)
            .unwrap();
        let dsha = sha256(&decoded_f32_bytes(&decoded));
        // 1.0 vectors stay 1.0 files; fp8 and latent vectors are 1.1
        // (format/SPEC.md section 3.1).
        let version = v["format_version"].as_str().unwrap_or("1.0");
        assert_eq!(
            format!("1.{}", u16::from_le_bytes([bytes[10], bytes[11]])),
            version,
            "{}: format version",
            file.display()
        );
        if write && !have_digest {
            v["file_sha256"] = Value::String(sha256(&bytes));
            v["decoded_f32_sha256"] = Value::String(dsha.clone());
        }
        assert_eq!(
            sha256(&bytes),
            v["file_sha256"].as_str().unwrap(),
            "{codec} ({}): file digest changed",
            file.display()
        );
        assert_eq!(
            dsha,
            v["decoded_f32_sha256"].as_str().unwrap(),
            "{codec} ({}): decoded output changed",
            file.display()
        );
        assert!(
            encoded == bytes,
            "{codec}: encoding the input no longer reproduces {}",
            file.display()
        );
        checked += 1;
    }
    if write {
        std::fs::write(
            &list_path,
            serde_json::to_string_pretty(&list).unwrap() + "\n",
        )
        .unwrap();
    }
    assert!(checked >= 8, "only {checked} vectors");
}
