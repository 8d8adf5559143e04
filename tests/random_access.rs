//! Random access: decoding a layer, K/V or token range touches only the
//! pages that hold it.

mod common;

use common::*;
use kvpack::Kind;
use kvpack::decode::{Archive, DecodeStats, Selection};
use kvpack::plan::Layout;

#[test]
fn partial_decode_reads_only_overlapping_pages() {
    let fx = fixture();
    let layout = Layout {
        page_tokens: 64,
        sink: 0,
        recent: 0,
    };
    let bytes = compress_bytes(&fx.cache, "bdr128", layout, None);
    let ar = Archive::open(&bytes).unwrap();
    let sel = Selection {
        layers: Some(3..5),
        tokens: Some(128..300),
        kind: None,
    };
    let stats = DecodeStats::default();
    let part = ar.decode(&sel, None, Some(&stats)).unwrap();
    // Pages of 64 tokens: 128..300 overlaps pages 2, 3, 4 (128..320) of
    // each of the 4 tensors (layers 3 and 4, K and V).
    let want: Vec<usize> = (0..ar.reader().index().entries.len())
        .filter(|&i| {
            let m = ar.reader().index().entries[i].meta;
            let t = &ar.reader().header().tensors[m.tensor as usize];
            (3..5).contains(&t.layer) && m.token_start < 300 && m.token_start + m.tokens > 128
        })
        .collect();
    assert_eq!(want.len(), 12);
    assert_eq!(stats.pages.load(std::sync::atomic::Ordering::Relaxed), 12);
    assert_eq!(part.tensors.len(), 4);
    assert!(part.tensors.iter().all(|t| t.info.tokens == 172));

    // Proof that nothing else is read: corrupt the body of every other
    // page; the partial decode still succeeds and is identical, while a
    // full decode fails.
    let mut bad = bytes.clone();
    let hl = ar.reader().header_len();
    for (i, e) in ar.reader().index().entries.iter().enumerate() {
        if !want.contains(&i) {
            bad[(hl + e.offset + 64) as usize] ^= 0x5A;
        }
    }
    let ar2 = Archive::open(&bad).unwrap();
    let part2 = ar2.decode(&sel, None, None).unwrap();
    assert_eq!(part2.tensors, part.tensors);
    assert!(ar2.decode(&Selection::default(), None, None).is_err());

    // Only keys of one layer.
    let stats = DecodeStats::default();
    let k = ar
        .decode(
            &Selection {
                layers: Some(17..18),
                tokens: None,
                kind: Some(Kind::Key),
            },
            None,
            Some(&stats),
        )
        .unwrap();
    assert_eq!(k.tensors.len(), 1);
    assert_eq!(stats.pages.load(std::sync::atomic::Ordering::Relaxed), 9); // 520 tokens / 64
}

#[test]
fn pages_are_zero_copy_views_of_the_buffer() {
    let fx = fixture();
    let bytes = compress_bytes(&fx.cache, "int4", Layout::default(), None);
    let ar = Archive::open(&bytes).unwrap();
    let p = ar.reader().page(5).unwrap();
    let body = p.body().as_ptr() as usize;
    let (lo, hi) = (
        bytes.as_ptr() as usize,
        bytes.as_ptr() as usize + bytes.len(),
    );
    assert!(
        body >= lo && body < hi,
        "an uncompressed page body must borrow the file buffer"
    );
}

#[test]
fn prompt_identity_finds_the_longest_matching_prefix() {
    let fx = fixture();
    let bytes = compress_bytes(&fx.cache, "int4", Layout::default(), None);
    let ar = Archive::open(&bytes).unwrap();
    assert_eq!(ar.model(), Some("gemma-3-270m-q4_k_m"));
    let ids = fx.cache.token_ids.clone();
    assert_eq!(
        ar.matching_prefix("gemma-3-270m-q4_k_m", &ids).unwrap(),
        520
    );
    let mut other = ids[..300].to_vec();
    other.extend([1, 2, 3]);
    assert_eq!(
        ar.matching_prefix("gemma-3-270m-q4_k_m", &other).unwrap(),
        300
    );
    assert_eq!(
        ar.matching_prefix("gemma-3-270m-q4_k_m", &ids[..10])
            .unwrap(),
        10
    );
    assert!(ar.matching_prefix("llama-3-8b", &ids).is_err());
}
