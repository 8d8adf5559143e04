//! The stream reader and the decode-while-receiving pipeline.
#![no_main]
#[path = "common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpack::codec::set_codebook_budget(64 << 20);
    let _ = kvpack::stream_decode::decode_stream_with(data, None, common::limits(), &|_, _| {});
    if let Ok(mut r) = kvpack::format::StreamReader::with_limits(data, common::limits()) {
        while let Ok(Some(_)) = r.next_event() {}
    }
});
