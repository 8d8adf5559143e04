//! Issue 12 section 3: rows whose range overflows f32 (values near
//! ±3.4e38 of both signs) used to be encoded by int8, int4 and polar into
//! garbage (cosine 0) with exit 0. Every codec now either refuses them with
//! an error naming the row, or stores them well (cosine above 0.99).

mod common;

use common::*;
use kvpack::cache::{DType, TensorData};
use kvpack::compress::{CompressOptions, compress};
use kvpack::decode::{Archive, Selection};
use kvpack::plan::Layout;

fn huge_range_cache() -> kvpack::KvCache {
    let mut c = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 1,
            tokens: 8,
            head_dim: 32,
        }],
        DType::F32,
        4,
    );
    for t in &mut c.tensors {
        if let TensorData::F32(v) = &mut t.data {
            for (i, x) in v.iter_mut().enumerate() {
                *x = if i % 2 == 0 { 3.0e38 } else { -3.0e38 } * (1.0 - (i % 7) as f32 * 0.01);
            }
        }
    }
    c
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

#[test]
fn rows_whose_range_overflows_f32_are_refused_or_stored_well() {
    let cache = huge_range_cache();
    for name in [
        "int8",
        "int4",
        "bdr16",
        "polar:m4n4",
        "kivi:2",
        "innerq:k2v2",
    ] {
        let codec = kvpack::codec::parse(name).unwrap();
        let opts = CompressOptions {
            layout: Layout {
                page_tokens: 8,
                sink: 0,
                recent: 0,
            },
            ..Default::default()
        };
        match compress(&cache, codec.as_ref(), &opts, Vec::new(), &|_| {}) {
            Err(e) => {
                let m = e.to_string();
                assert!(
                    m.contains("overflows f32")
                        || m.contains("finite")
                        || m.contains("NaN")
                        || m.contains("does not fit"),
                    "{name}: {m}"
                );
            }
            Ok((bytes, _)) => {
                let dec = Archive::open(&bytes)
                    .unwrap()
                    .decode(&Selection::default(), Some(DType::F32), None)
                    .unwrap();
                for (a, b) in cache.tensors.iter().zip(&dec.tensors) {
                    let c = cosine(&a.data.to_f32(), &b.data.to_f32());
                    assert!(c > 0.99, "{name} {}: cosine {c}", a.info.name);
                }
            }
        }
    }
}
