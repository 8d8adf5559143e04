//! The element addressing of one of K or V in a paged cache
//! ([`PagedAddr`]), shared by every decode kernel (`row_dst` in
//! `kernels/common.cuh`) and by the page descriptors. Plain data.

use crate::error::{Error, Result};

/// Element strides of one of K or V in a paged cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PagedStrides {
    /// Between blocks.
    pub block: u64,
    /// Between the rows (tokens) of a block.
    pub token: u64,
    /// Between the heads of a row.
    pub head: u64,
}

/// The addressing of one of K or V in a paged cache, as the kernels use
/// it: slot `s` is row `s % block_size` of block `s / block_size`; head `h`
/// of it starts at element `block * strides.block + row * strides.token +
/// h * strides.head` (a row's `head_dim` elements are contiguous).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PagedAddr {
    /// Blocks.
    pub num_blocks: u64,
    /// Slots per block.
    pub block_size: u32,
    /// Strides, elements.
    pub strides: PagedStrides,
}

impl PagedAddr {
    /// vLLM's flat slot layout `[num_slots, kv_heads, head_dim]` (blocks of
    /// one slot).
    pub fn flat(num_slots: u64, kv_heads: u32, head_dim: u32) -> PagedAddr {
        let d = u64::from(head_dim);
        PagedAddr {
            num_blocks: num_slots,
            block_size: 1,
            strides: PagedStrides {
                block: u64::from(kv_heads) * d,
                token: 0,
                head: d,
            },
        }
    }

    /// Slots: `num_blocks * block_size`.
    pub fn slots(&self) -> u64 {
        self.num_blocks * u64::from(self.block_size)
    }

    /// Element offset of head `head` of slot `slot`.
    pub fn offset(&self, slot: u64, head: u32) -> u64 {
        let bs = u64::from(self.block_size);
        // Block sizes are powers of two in practice: shift and mask
        // instead of a division (the same quotient and remainder).
        let (block, row) = if bs.is_power_of_two() {
            (slot >> bs.trailing_zeros(), slot & (bs - 1))
        } else {
            (slot / bs, slot % bs)
        };
        block * self.strides.block + row * self.strides.token + u64::from(head) * self.strides.head
    }

    /// Checks that every row of `heads` heads of `head_dim` elements lies
    /// within `len` elements, that the slots fit 32 bits, and that every
    /// stride keeps row starts as aligned as in a contiguous tensor (a
    /// multiple of the largest power of two dividing `head_dim`, up to 8
    /// elements: the kernels store 8 elements at once).
    ///
    /// # Errors
    /// [`Error::Parameter`] naming the violated bound.
    pub fn check(&self, len: u64, heads: u32, head_dim: u32) -> Result<()> {
        if self.slots() > u64::from(u32::MAX) || self.block_size == 0 || self.num_blocks == 0 {
            return Err(Error::param(format!(
                "paged cache with {} blocks of {} slots: between 1 and 2^32 - 1 slots needed",
                self.num_blocks, self.block_size
            )));
        }
        let last = self.offset(self.slots() - 1, heads.saturating_sub(1)) + u64::from(head_dim);
        if last > len {
            return Err(Error::param(format!(
                "paged cache of {len} elements is too small: the last row of {} blocks x {} \
                 slots x {heads} heads x {head_dim} ends at element {last}",
                self.num_blocks, self.block_size
            )));
        }
        let a = 1u64 << head_dim.trailing_zeros().min(3);
        let s = self.strides;
        if ![s.block, s.token, s.head]
            .iter()
            .all(|x| x.is_multiple_of(a))
        {
            return Err(Error::param(format!(
                "paged cache strides {s:?} (elements) are not multiples of {a}: rows of \
                 head_dim {head_dim} would be misaligned"
            )));
        }
        Ok(())
    }
}
