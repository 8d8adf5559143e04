//! Bad input never panics and never passes: every byte of a small file
//! corrupted, every truncation, and the same for streams.

mod common;

use common::*;
use kvpack::cache::DType;
use kvpack::decode::{Archive, Selection};
use kvpack::format::{StreamEvent, StreamReader};
use kvpack::plan::Layout;

/// A small file that exercises every structure: two layers with different
/// token counts, a sink and a recent raw window, several codec pages, some
/// zstd-compressed, metadata and token ids.
fn small_file() -> Vec<u8> {
    let c = synthetic(
        &[
            LayerSpec {
                batch: 1,
                heads: 2,
                tokens: 21,
                head_dim: 16,
            },
            LayerSpec {
                batch: 1,
                heads: 2,
                tokens: 9,
                head_dim: 16,
            },
        ],
        DType::Bf16,
        77,
    );
    compress_bytes(
        &c,
        "bdr16",
        Layout {
            page_tokens: 8,
            sink: 2,
            recent: 3,
        },
        Some(19),
    )
}

fn open_and_decode(b: &[u8]) -> kvpack::Result<()> {
    let ar = Archive::open(b)?;
    ar.decode(&Selection::default(), None, None)?;
    Ok(())
}

fn stream_all(b: &[u8]) -> kvpack::Result<usize> {
    let mut r = StreamReader::new(b)?;
    let mut pages = 0;
    let mut committed = false;
    while let Some(ev) = r.next_event()? {
        match ev {
            StreamEvent::Page(_) => pages += 1,
            StreamEvent::Commit(..) => committed = true,
        }
    }
    assert!(committed);
    Ok(pages)
}

#[test]
fn the_small_file_is_valid_and_uses_zstd() {
    let b = small_file();
    open_and_decode(&b).unwrap();
    let ar = Archive::open(&b).unwrap();
    let flags: Vec<u16> = ar
        .reader()
        .index()
        .entries
        .iter()
        .map(|e| e.flags)
        .collect();
    assert!(
        flags.contains(&1),
        "some page should be zstd-compressed: {flags:?}"
    );
    assert_eq!(stream_all(&b).unwrap(), ar.reader().index().entries.len());
}

#[test]
fn corrupting_any_byte_is_an_error_never_a_panic() {
    let b = small_file();
    for i in 0..b.len() {
        for mask in [0x01u8, 0x80, 0xFF] {
            let mut c = b.clone();
            c[i] ^= mask;
            assert!(
                open_and_decode(&c).is_err(),
                "random access accepted a flip of byte {i} (mask {mask:#x}) of {}",
                b.len()
            );
            assert!(
                stream_all(&c).is_err(),
                "stream accepted a flip of byte {i} (mask {mask:#x})"
            );
        }
    }
}

#[test]
fn every_truncation_is_an_error() {
    let b = small_file();
    for n in 0..b.len() {
        let e = open_and_decode(&b[..n]).expect_err("truncated file accepted");
        assert!(e.is_format(), "truncation to {n}: {e}");
        assert!(
            stream_all(&b[..n]).is_err(),
            "truncated stream accepted at {n}"
        );
    }
}

#[test]
fn errors_name_the_page() {
    let b = small_file();
    let ar = Archive::open(&b).unwrap();
    let e = ar.reader().index().entries[2];
    let mut c = b.clone();
    let off = (ar.reader().header_len() + e.offset + 64 + 3) as usize;
    c[off] ^= 0x10;
    let msg = open_and_decode(&c).unwrap_err().to_string();
    assert!(msg.contains("page #2") && msg.contains("layer 0"), "{msg}");
    let msg = stream_all(&c).unwrap_err().to_string();
    assert!(msg.contains("page #2"), "{msg}");
    // A stream cut inside page 3 names the page it was reading.
    let cut = (ar.reader().header_len() + ar.reader().index().entries[3].offset + 100) as usize;
    let msg = stream_all(&b[..cut]).unwrap_err().to_string();
    assert!(msg.contains("truncated"), "{msg}");
}

#[test]
fn garbage_and_other_formats_are_rejected() {
    let fx = std::fs::read(repo(FIXTURE)).unwrap();
    for junk in [&b""[..], b"hello", &[0u8; 200], &fx[..4096]] {
        assert!(open_and_decode(junk).is_err());
        assert!(stream_all(junk).is_err());
    }
    // A newer major version is refused with a message naming both.
    let mut b = small_file();
    b[8] = 2;
    let msg = open_and_decode(&b).unwrap_err().to_string();
    assert!(msg.contains("version 2.0") && msg.contains("1.x"), "{msg}");
}

#[test]
fn format_errors_carry_a_cause_callers_can_match() {
    use kvpack::FormatCause;
    let b = small_file();
    let cause = |c: &[u8]| open_and_decode(c).unwrap_err().format_cause();
    // A flipped byte inside a page body: the page's CRC catches it.
    let ar = Archive::open(&b).unwrap();
    let e = ar.reader().index().entries[2];
    let mut c = b.clone();
    c[(ar.reader().header_len() + e.offset + 64 + 3) as usize] ^= 0x10;
    assert_eq!(cause(&c), Some(FormatCause::Checksum));
    // A newer major version.
    let mut c = b.clone();
    c[8] = 2;
    assert_eq!(cause(&c), Some(FormatCause::UnsupportedVersion));
    // Not kvpack at all.
    assert_eq!(
        cause(b"hello, this is not kvpack data at all, not at all....................."),
        Some(FormatCause::NotKvpack)
    );
    // Cut inside the header, and a stream cut inside a page.
    assert_eq!(cause(&b[..40]), Some(FormatCause::Truncated));
    let cut = (ar.reader().header_len() + e.offset + 100) as usize;
    assert_eq!(
        stream_all(&b[..cut]).unwrap_err().format_cause(),
        Some(FormatCause::Truncated)
    );
    // Non-format errors have no cause.
    assert_eq!(kvpack::Error::param("x").format_cause(), None);
}

mod random_mutations {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Random edits (several bytes changed, a range deleted or
        /// duplicated) never panic the random-access or streaming reader,
        /// and a changed committed region is never accepted.
        #[test]
        fn random_edits_are_rejected_without_panicking(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
            len in 1usize..300,
            mode in 0u8..3,
        ) {
            let b = small_file();
            let mut c = b.clone();
            match mode {
                0 => for (i, v) in &edits {
                    let i = i.index(c.len());
                    c[i] = c[i].wrapping_add(v | 1);
                },
                1 => {
                    let at = cut.index(c.len());
                    let end = (at + len).min(c.len());
                    c.drain(at..end);
                }
                _ => {
                    let at = cut.index(c.len());
                    let end = (at + len).min(c.len());
                    let dup: Vec<u8> = c[at..end].to_vec();
                    c.splice(at..at, dup);
                }
            }
            prop_assume!(c != b);
            // The only accepted change is junk after a complete commit, which
            // is indistinguishable from an interrupted append: the reader
            // then opens exactly the original commit and reports the tail.
            if open_and_decode(&c).is_ok() {
                let ar = Archive::open(&c).unwrap();
                prop_assert!(c.starts_with(&b), "a changed committed region was accepted");
                prop_assert_eq!(ar.reader().committed_len() as usize, b.len());
                prop_assert_eq!(ar.reader().torn_tail() as usize, c.len() - b.len());
            }
            prop_assert!(stream_all(&c).is_err());
        }
    }
}
