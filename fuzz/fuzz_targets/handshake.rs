//! The receiver's handshake and the authenticated stream reader: the
//! input is what a peer sends.
#![no_main]
use std::io::Read;

use libfuzzer_sys::fuzz_target;

struct Peer<'a> {
    input: &'a [u8],
}

impl Read for Peer<'_> {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(b)
    }
}

impl std::io::Write for Peer<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let _ = kvpack::net::Hello::parse(data);
    for secret in [None, Some(b"0123456789abcdef".to_vec())] {
        let accept = kvpack::net::Accept {
            model: None,
            secret,
        };
        if let Ok((_, mut r)) = kvpack::net::server_handshake(Peer { input: data }, &accept) {
            let mut sink = vec![0u8; 4096];
            while let Ok(n) = r.read(&mut sink) {
                if n == 0 {
                    break;
                }
            }
        }
    }
});
