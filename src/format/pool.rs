//! A small process-wide pool of byte buffers for the encoders' page-sized
//! allocations (section payloads, page frames).
//!
//! Encoding a layer allocates and frees buffers of tens to hundreds of KiB
//! per page, a few pages at a time. glibc gives freed memory at the top of
//! an arena back to the kernel once 128 KiB sit there (and serves blocks
//! of 128 KiB and more by `mmap`), so the next page faults the memory in
//! and zeroes it again: measured, 30% of a bdr128 layer's encode time on
//! one thread and two thirds of raw's. Buffers returned here are handed
//! out again instead. The pool holds at most [`MAX_BUFFERS`] buffers and
//! [`MAX_BYTES`] of capacity; what does not fit is freed.

use std::sync::Mutex;

/// Most buffers kept.
pub const MAX_BUFFERS: usize = 64;
/// Most bytes of capacity kept, over all buffers.
pub const MAX_BYTES: usize = 32 << 20;
/// Smaller buffers are not worth keeping (the allocator serves them well).
const MIN_KEPT: usize = 16 << 10;

static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// An empty buffer with a capacity of at least `cap` bytes: the smallest
/// pooled one that fits, else a new one.
pub fn take(cap: usize) -> Vec<u8> {
    if cap >= MIN_KEPT {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= cap)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let mut b = pool.swap_remove(i);
            b.clear();
            return b;
        }
    }
    Vec::with_capacity(cap)
}

/// `len` zero bytes in a pooled buffer ([`take`]).
pub fn zeroed(len: usize) -> Vec<u8> {
    let mut b = take(len);
    b.resize(len, 0);
    b
}

/// Gives a buffer back for [`take`] to hand out again (kept while the
/// pool is under its limits, else freed).
pub fn give(b: Vec<u8>) {
    if b.capacity() < MIN_KEPT {
        return;
    }
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let held: usize = pool.iter().map(|b| b.capacity()).sum();
    if pool.len() < MAX_BUFFERS && held + b.capacity() <= MAX_BYTES {
        pool.push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_the_pool_is_bounded() {
        let b = take(1 << 20);
        assert!(b.capacity() >= 1 << 20 && b.is_empty());
        let p = b.as_ptr();
        give(b);
        // Other tests may share the pool: look for our buffer among what
        // comes back for that size.
        let got: Vec<Vec<u8>> = (0..MAX_BUFFERS).map(|_| take(1 << 20)).collect();
        assert!(got.iter().any(|b| b.as_ptr() == p));
        assert!(got.iter().all(|b| b.is_empty() && b.capacity() >= 1 << 20));
        let z = zeroed(100 << 10);
        assert!(z.len() == 100 << 10 && z.iter().all(|&x| x == 0));
        for b in got {
            give(b);
        }
        give(z);
        let pool = POOL.lock().unwrap();
        assert!(pool.len() <= MAX_BUFFERS);
        assert!(pool.iter().map(|b| b.capacity()).sum::<usize>() <= MAX_BYTES);
    }
}
