//! The safetensors importer (compress, send and append inputs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvpack::io::safetensors::parse(data, "fuzz");
});
