//! Bit packing of code streams, LSB-first (format/SPEC.md "Bit-packed
//! index streams").
//!
//! Code `i` of a `b`-bit stream occupies stream bits `[i*b, (i+1)*b)`; stream
//! bit `k` is bit `k % 8` (0 = least significant) of byte `k / 8`; the code's
//! least significant bit comes first. For `b = 4` this puts code `2j` in the
//! low nibble and code `2j+1` in the high nibble of byte `j`. Unused high bits
//! of the last byte are zero.

/// Bytes needed for `n` codes of `bits` bits: `ceil(n * bits / 8)`.
pub fn packed_len(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(8)
}

/// LSB-first packing of `codes` (masked to `bits` bits, 1..=32) into `out`.
/// Whole 32-bit words leave the accumulator at once (at most `31 + 32`
/// bits are pending), then the last bytes: the same stream as a byte at a
/// time, with one store per 32 bits.
fn pack_bits(codes: impl Iterator<Item = u64>, bits: u32, out: &mut [u8]) {
    let mask = (1u64 << bits) - 1;
    let mut acc: u64 = 0;
    let mut nacc = 0u32;
    let mut o = 0;
    for c in codes {
        acc |= (c & mask) << nacc;
        nacc += bits;
        if nacc >= 32 {
            out[o..o + 4].copy_from_slice(&(acc as u32).to_le_bytes());
            o += 4;
            acc >>= 32;
            nacc -= 32;
        }
    }
    while nacc > 0 {
        out[o] = acc as u8;
        o += 1;
        acc >>= 8;
        nacc = nacc.saturating_sub(8);
    }
}

/// LSB-first unpacking of `n` codes of `bits` bits (1..=32), handed to
/// `put(i, code)`.
fn unpack_bits(packed: &[u8], bits: u32, n: usize, mut put: impl FnMut(usize, u64)) {
    let mask = (1u64 << bits) - 1;
    let mut acc: u64 = 0;
    let mut nacc = 0u32;
    let mut i = 0;
    for k in 0..n {
        while nacc < bits {
            acc |= u64::from(packed[i]) << nacc;
            i += 1;
            nacc += 8;
        }
        put(k, acc & mask);
        acc >>= bits;
        nacc -= bits;
    }
}

/// Packs `codes` (each `< 2^bits`, `bits` in 1..=32) into `out`.
///
/// # Panics
/// If `out.len() != packed_len(codes.len(), bits)` or `bits` is out of
/// range. Codes are masked to `bits` bits.
pub fn pack_u32(codes: &[u32], bits: u32, out: &mut [u8]) {
    assert!((1..=32).contains(&bits));
    assert_eq!(out.len(), packed_len(codes.len(), bits));
    pack_bits(codes.iter().map(|&c| u64::from(c)), bits, out);
}

/// Unpacks `out.len()` codes of `bits` bits (1..=32) from `packed`.
///
/// # Panics
/// If `packed` is shorter than `packed_len(out.len(), bits)`.
pub fn unpack_u32(packed: &[u8], bits: u32, out: &mut [u32]) {
    assert!((1..=32).contains(&bits));
    assert!(packed.len() >= packed_len(out.len(), bits));
    unpack_bits(packed, bits, out.len(), |i, c| out[i] = c as u32);
}

/// Packs `codes` of `bits` bits (1..=64) into `out`, LSB-first, the same
/// bitstream as [`pack_u32`] for widths up to 32 (used for fields wider
/// than the 32 bits of the container's packed element type, e.g. the
/// mixed-radix digit groups of [`super::radix`]).
///
/// # Panics
/// If `out.len() != packed_len(codes.len(), bits)` or `bits` is out of
/// range. Codes are masked to `bits` bits.
pub fn pack_u64(codes: &[u64], bits: u32, out: &mut [u8]) {
    assert!((1..=64).contains(&bits));
    assert_eq!(out.len(), packed_len(codes.len(), bits));
    let mask = u128::from(u64::MAX >> (64 - bits));
    let mut acc: u128 = 0;
    let mut nacc = 0u32;
    let mut o = 0;
    for &c in codes {
        acc |= (u128::from(c) & mask) << nacc;
        nacc += bits;
        while nacc >= 8 {
            out[o] = acc as u8;
            o += 1;
            acc >>= 8;
            nacc -= 8;
        }
    }
    if nacc > 0 {
        out[o] = acc as u8;
    }
}

/// Unpacks `out.len()` codes of `bits` bits (1..=64) from `packed`
/// (inverse of [`pack_u64`]).
///
/// # Panics
/// If `packed` is shorter than `packed_len(out.len(), bits)`.
pub fn unpack_u64(packed: &[u8], bits: u32, out: &mut [u64]) {
    assert!((1..=64).contains(&bits));
    assert!(packed.len() >= packed_len(out.len(), bits));
    let mask = u128::from(u64::MAX >> (64 - bits));
    let mut acc: u128 = 0;
    let mut nacc = 0u32;
    let mut i = 0;
    for c in out.iter_mut() {
        while nacc < bits {
            acc |= u128::from(packed[i]) << nacc;
            i += 1;
            nacc += 8;
        }
        *c = (acc & mask) as u64;
        acc >>= bits;
        nacc -= bits;
    }
}

/// True when the bits of the last byte of a `packed_len(n, bits)`-byte
/// stream beyond its `n * bits` code bits are zero, as format/SPEC.md
/// section 6.2 requires (decoders use it to reject non-canonical streams).
pub fn tail_is_zero(packed: &[u8], n: usize, bits: u32) -> bool {
    let used = n * bits as usize;
    match packed.get(used / 8) {
        Some(&last) if !used.is_multiple_of(8) => last >> (used % 8) == 0,
        _ => true,
    }
}

/// Packs byte codes (`bits` in 1..=8) into `out`, with fast paths for 4 and 8.
///
/// # Panics
/// If `out.len() != packed_len(codes.len(), bits)`.
pub fn pack_u8(codes: &[u8], bits: u32, out: &mut [u8]) {
    assert!((1..=8).contains(&bits));
    assert_eq!(out.len(), packed_len(codes.len(), bits));
    match bits {
        8 => out.copy_from_slice(codes),
        4 => {
            let (pairs, rest) = codes.as_chunks::<2>();
            for (o, p) in out.iter_mut().zip(pairs) {
                *o = (p[0] & 15) | (p[1] << 4);
            }
            if let [last] = rest {
                out[pairs.len()] = last & 15;
            }
        }
        _ => pack_bits(codes.iter().map(|&c| u64::from(c)), bits, out),
    }
}

/// [`unpack_u8`] for `B` bits: eight codes fill exactly `B` bytes, read as
/// one little-endian word (the bit order of `unpack_bits`, which handles
/// the tail).
fn unpack_words<const B: usize>(packed: &[u8], out: &mut [u8]) {
    let mask = (1u64 << B) - 1;
    let (groups, _) = out.as_chunks_mut::<8>();
    let whole = groups.len();
    let (words, _) = packed.as_chunks::<B>();
    for (g, src) in groups.iter_mut().zip(words) {
        let mut w = [0u8; 8];
        w[..B].copy_from_slice(src);
        let w = u64::from_le_bytes(w);
        for (k, o) in g.iter_mut().enumerate() {
            *o = ((w >> (k * B)) & mask) as u8;
        }
    }
    let tail = &mut out[8 * whole..];
    unpack_bits(&packed[whole * B..], B as u32, tail.len(), |i, c| {
        tail[i] = c as u8
    });
}

/// Unpacks `out.len()` byte codes of `bits` bits (1..=8).
///
/// # Panics
/// If `packed` is shorter than `packed_len(out.len(), bits)`.
pub fn unpack_u8(packed: &[u8], bits: u32, out: &mut [u8]) {
    assert!((1..=8).contains(&bits));
    assert!(packed.len() >= packed_len(out.len(), bits));
    match bits {
        8 => out.copy_from_slice(&packed[..out.len()]),
        4 => {
            let n = out.len();
            let (pairs, rest) = out.as_chunks_mut::<2>();
            for (p, &b) in pairs.iter_mut().zip(packed) {
                p[0] = b & 15;
                p[1] = b >> 4;
            }
            if let [last] = rest {
                *last = packed[n / 2] & 15;
            }
        }
        1 => unpack_words::<1>(packed, out),
        2 => unpack_words::<2>(packed, out),
        3 => unpack_words::<3>(packed, out),
        5 => unpack_words::<5>(packed, out),
        6 => unpack_words::<6>(packed, out),
        _ => unpack_words::<7>(packed, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nibble_order_is_low_first() {
        let mut out = [0u8; 2];
        pack_u8(&[1, 2, 3], 4, &mut out);
        assert_eq!(out, [0x21, 0x03]);
        let mut out3 = [0u8; 2];
        // 3-bit codes 5, 6, 7: bits 101 110 111 LSB-first -> 0b11_110_101, 0b1
        pack_u8(&[5, 6, 7], 3, &mut out3);
        assert_eq!(out3, [0b1111_0101, 0b0000_0001]);
    }

    proptest! {
        #[test]
        fn u8_round_trip(bits in 1u32..=8, raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let codes: Vec<u8> = raw.iter().map(|c| c & ((1u16 << bits) - 1) as u8).collect();
            let mut packed = vec![0u8; packed_len(codes.len(), bits)];
            pack_u8(&codes, bits, &mut packed);
            let mut back = vec![0u8; codes.len()];
            unpack_u8(&packed, bits, &mut back);
            prop_assert_eq!(&back, &codes);
            // Same bitstream as the generic u32 packer.
            let wide: Vec<u32> = codes.iter().map(|&c| u32::from(c)).collect();
            let mut packed32 = vec![0u8; packed.len()];
            pack_u32(&wide, bits, &mut packed32);
            prop_assert_eq!(&packed32, &packed);
        }

        #[test]
        fn u64_matches_u32_and_round_trips(bits in 1u32..=64, raw in proptest::collection::vec(any::<u64>(), 0..120)) {
            let mask = u64::MAX >> (64 - bits);
            let codes: Vec<u64> = raw.iter().map(|c| c & mask).collect();
            let mut packed = vec![0u8; packed_len(codes.len(), bits)];
            pack_u64(&codes, bits, &mut packed);
            prop_assert!(tail_is_zero(&packed, codes.len(), bits));
            let mut back = vec![0u64; codes.len()];
            unpack_u64(&packed, bits, &mut back);
            prop_assert_eq!(&back, &codes);
            if bits <= 32 {
                let narrow: Vec<u32> = codes.iter().map(|&c| c as u32).collect();
                let mut p32 = vec![0u8; packed.len()];
                pack_u32(&narrow, bits, &mut p32);
                prop_assert_eq!(&p32, &packed);
            }
        }

        #[test]
        fn u32_round_trip(bits in 1u32..=32, raw in proptest::collection::vec(any::<u32>(), 0..200)) {
            let mask = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
            let codes: Vec<u32> = raw.iter().map(|c| c & mask).collect();
            let mut packed = vec![0u8; packed_len(codes.len(), bits)];
            pack_u32(&codes, bits, &mut packed);
            let mut back = vec![0u32; codes.len()];
            unpack_u32(&packed, bits, &mut back);
            prop_assert_eq!(back, codes);
        }
    }
}
