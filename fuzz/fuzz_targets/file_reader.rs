//! The random-access reader: open, then decode everything at the source
//! dtype and as f32. Any input must give Ok or Err, never a panic, an
//! abort or an allocation beyond the limits.
#![no_main]
#[path = "common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpack::codec::set_codebook_budget(64 << 20);
    if let Ok(ar) = kvpack::decode::Archive::open_with(data, common::limits()) {
        let _ = ar.decode(&Default::default(), None, None);
        let _ = ar.decode(
            &kvpack::decode::Selection {
                tokens: Some(1..7),
                ..Default::default()
            },
            Some(kvpack::DType::F32),
            None,
        );
    }
});
