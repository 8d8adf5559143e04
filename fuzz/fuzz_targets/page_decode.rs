//! Every codec's page decoder on arbitrary sections. Input layout:
//! `u16 codec id, u32 params_len, params, u8 kind (K/V), u8 heads (1..=4),
//! u8 tokens (1..=64), u16 head_dim (1..=512), u8 n_sections, body`
//! (the body is a page body as in SPEC 6.2, uncompressed).
#![no_main]
use kvpack::cache::{DType, Kind, TensorData, TensorInfo};
use kvpack::codec::PageOut;
use kvpack::error::Location;
use kvpack::format::{CodecEntry, PageHeader, PageMeta, PageView};
use libfuzzer_sys::fuzz_target;

fn take<'a>(d: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    (d.len() >= n).then(|| {
        let (a, b) = d.split_at(n);
        *d = b;
        a
    })
}

fuzz_target!(|data: &[u8]| {
    kvpack::codec::set_codebook_budget(64 << 20);
    let mut d = data;
    let Some(id) = take(&mut d, 2) else { return };
    let id = u16::from_le_bytes([id[0], id[1]]);
    let Some(pl) = take(&mut d, 4) else { return };
    let pl = u32::from_le_bytes(pl.try_into().unwrap()) as usize;
    let Some(params) = take(&mut d, pl.min(1 << 16)) else {
        return;
    };
    let Some(s) = take(&mut d, 6) else { return };
    let kind = if s[0] & 1 == 0 {
        Kind::Key
    } else {
        Kind::Value
    };
    let heads = u32::from(s[1] % 4) + 1;
    let tokens = u32::from(s[2] % 64) + 1;
    let head_dim = u32::from(u16::from_le_bytes([s[3], s[4]]) % 512) + 1;
    let n_sections = u16::from(s[5] % 16);
    let entry = CodecEntry {
        id,
        params: params.to_vec(),
    };
    let Ok(codec) = kvpack::codec::from_entry(0, &entry) else {
        return;
    };
    let info = TensorInfo {
        name: "t".into(),
        layer: 0,
        kind,
        dtype: DType::F32,
        batch: 1,
        heads,
        tokens,
        head_dim,
    };
    let codecs = vec![codec];
    let meta = PageMeta {
        tensor: 0,
        token_start: 0,
        tokens,
        codec: 0,
    };
    if kvpack::codec::check_page_fits(&codecs, std::slice::from_ref(&info), meta).is_err() {
        return;
    }
    let body = d.to_vec();
    let h = PageHeader {
        meta,
        flags: 0,
        n_sections,
        stored_len: body.len() as u64,
        body_len: body.len() as u64,
        body_crc: kvpack_crc(&body),
    };
    let Ok(view) = PageView::from_stored(h, body.into(), 0, String::new(), &Location::Header)
    else {
        return;
    };
    let per = (tokens * head_dim) as usize;
    let mut out = TensorData::zeros(DType::F32, per * heads as usize);
    let mut rest = out.as_elems_mut();
    let mut planes = Vec::new();
    for _ in 0..heads {
        let (a, b) = rest.split_at(per);
        planes.push(a);
        rest = b;
    }
    let mut po = PageOut {
        scatter: None,
        tensor: &info,
        tokens,
        planes,
    };
    let _ = codecs[0].decode(&view, &mut po);
});

/// CRC-32/ISO-HDLC, as the container uses.
fn kvpack_crc(b: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &x in b {
        c ^= u32::from(x);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}
