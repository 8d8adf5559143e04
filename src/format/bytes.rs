//! Little-endian byte cursor with bounds-checked reads that report the
//! [`Location`] of any failure, and small writing helpers.

use crate::error::{Error, FormatCause, Location, Result};

/// Rounds `x` up to a multiple of `align` (a power of two).
///
/// # Panics
/// On overflow (callers bound `x` by file sizes first).
pub fn align_up(x: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    x.checked_add(align - 1).expect("offset overflow") & !(align - 1)
}

/// A bounds-checked little-endian reader over a byte slice.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    at: Location,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8], at: Location) -> Self {
        Cursor { buf, pos: 0, at }
    }

    pub(crate) fn err(&self, msg: impl Into<String>) -> Error {
        Error::format(self.at.clone(), msg)
    }

    pub(crate) fn err_with(&self, cause: FormatCause, msg: impl Into<String>) -> Error {
        Error::format_with(cause, self.at.clone(), msg)
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                self.err_with(
                    FormatCause::Truncated,
                    format!(
                        "{what} needs {n} bytes at offset {} but only {} remain",
                        self.pos,
                        self.remaining()
                    ),
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub(crate) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let b = self.bytes(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads `n` bytes that must all be zero (reserved fields, padding).
    pub(crate) fn zeros(&mut self, n: usize, what: &str) -> Result<()> {
        let start = self.pos;
        let b = self.bytes(n, what)?;
        if let Some(i) = b.iter().position(|&x| x != 0) {
            return Err(self.err(format!(
                "{what} at offset {} must be zero (reserved), found 0x{:02x}",
                start + i,
                b[i]
            )));
        }
        Ok(())
    }

    /// A `u32` length followed by that many UTF-8 bytes.
    pub(crate) fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u32(what)? as usize;
        let b = self.bytes(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(format!("{what} is not valid UTF-8")))
    }

    pub(crate) fn expect_end(&self, what: &str) -> Result<()> {
        if self.remaining() != 0 {
            return Err(self.err(format!(
                "{} unexpected bytes after the end of {what}",
                self.remaining()
            )));
        }
        Ok(())
    }
}

/// Checks that every byte of `b` is zero; `base` is the file offset of
/// `b[0]` for the message.
pub(crate) fn check_zero_padding(b: &[u8], base: u64, at: Location) -> Result<()> {
    if let Some(i) = b.iter().position(|&x| x != 0) {
        return Err(Error::format(
            at,
            format!(
                "padding byte at {} is 0x{:02x}, must be zero",
                base + i as u64,
                b[i]
            ),
        ));
    }
    Ok(())
}

/// Appending little-endian writers for `Vec<u8>`.
pub(crate) trait PutLe {
    fn put_u8(&mut self, v: u8);
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
    fn put_str(&mut self, s: &str);
    fn pad_to(&mut self, align: usize);
}

impl PutLe for Vec<u8> {
    fn put_u8(&mut self, v: u8) {
        self.push(v);
    }
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_str(&mut self, s: &str) {
        self.put_u32(s.len() as u32);
        self.extend_from_slice(s.as_bytes());
    }
    fn pad_to(&mut self, align: usize) {
        let n = self.len().next_multiple_of(align);
        self.resize(n, 0);
    }
}

/// CRC-32 (IEEE 802.3 polynomial, as zlib) of the concatenation of `parts`.
pub(crate) fn crc32(parts: &[&[u8]]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize()
}
