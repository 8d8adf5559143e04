//! Writes seed corpora for the fuzz targets of `fuzz/` from the golden
//! vectors (`format/vectors/*.kvpack`, `input-small.safetensors`):
//!
//! ```text
//! cargo run --release --example fuzz_seeds -- fuzz/seeds
//! ```
//!
//! `page_decode/` gets every vector page in the target's input layout
//! (codec id and parameters, tensor shape, uncompressed page body);
//! `handshake/` a hello followed by a plain kvpack stream.

use std::io::{Read, Write};
use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).ok_or("usage: fuzz_seeds OUT_DIR")?;
    let out = Path::new(&out);
    let pd = out.join("page_decode");
    let hs = out.join("handshake");
    std::fs::create_dir_all(&pd)?;
    std::fs::create_dir_all(&hs)?;
    let mut n = 0;
    for e in std::fs::read_dir("format/vectors")? {
        let p = e?.path();
        if p.extension().and_then(|x| x.to_str()) != Some("kvpack") {
            continue;
        }
        let bytes = std::fs::read(&p)?;
        let ar = kvpack::decode::Archive::open(&bytes)?;
        let r = ar.reader();
        let h = r.header();
        for (i, e) in r.index().entries.iter().enumerate().take(12) {
            let info = &h.tensors[e.meta.tensor as usize];
            let heads = info.batch * info.heads;
            if heads > 4 || e.meta.tokens > 64 || info.head_dim > 512 {
                continue;
            }
            let view = r.page(i)?;
            let c = &h.codecs[e.meta.codec as usize];
            let mut s = Vec::new();
            s.extend_from_slice(&c.id.to_le_bytes());
            s.extend_from_slice(&(c.params.len() as u32).to_le_bytes());
            s.extend_from_slice(&c.params);
            s.push(info.kind.code());
            s.push((heads - 1) as u8);
            s.push((e.meta.tokens - 1) as u8);
            s.extend_from_slice(&((info.head_dim - 1) as u16).to_le_bytes());
            s.push(view.header.n_sections as u8);
            s.extend_from_slice(view.body());
            std::fs::write(
                pd.join(format!("{}-{i}", p.file_stem().unwrap().to_string_lossy())),
                s,
            )?;
            n += 1;
        }
        // A handshake followed by the plain stream of this vector.
        let hello = kvpack::net::Hello {
            version: (1, 0),
            model: h.metadata.get("kvpack.model").cloned().unwrap_or_default(),
            codecs: h.codecs.iter().map(|c| c.id).collect(),
            authenticated: false,
        };
        let mut peer = Fake {
            reply: [&b"KVPA\0"[..], &[0u8; 16], &0u32.to_le_bytes()].concat(),
            pos: 0,
            sent: Vec::new(),
        };
        {
            let mut w = kvpack::net::client_handshake(&mut peer, &hello, None)?;
            w.write_all(&bytes)?;
            w.finish()?;
        }
        std::fs::write(hs.join(p.file_name().unwrap()), &peer.sent)?;
    }
    eprintln!("{n} page seeds");
    Ok(())
}

/// A peer that answers the handshake with a fixed reply and records what
/// is sent.
struct Fake {
    reply: Vec<u8>,
    pos: usize,
    sent: Vec<u8>,
}

impl Read for Fake {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        let n = b.len().min(self.reply.len() - self.pos);
        b[..n].copy_from_slice(&self.reply[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for Fake {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.sent.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
