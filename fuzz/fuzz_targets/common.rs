//! Limits small enough that no input can exceed libFuzzer's default 2 GiB
//! RSS limit, yet large enough for every seed (format/vectors/ and the
//! fixture) to decode.
pub fn limits() -> kvpack::format::Limits {
    kvpack::format::Limits {
        max_memory: 256 << 20,
        max_page_bytes: 64 << 20,
        max_index_bytes: 64 << 20,
        max_header_bytes: 1 << 20,
        ..Default::default()
    }
}
