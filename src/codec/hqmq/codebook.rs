//! HQMQ codebooks: the per-(layer, kv head, K|V) secondary codebook of `S`
//! Haar-random unit quaternions regenerated from the file's 64-bit seed,
//! and the joint codebook `{q_p * q_s}` (HQMQ paper section 3, Eq. 1;
//! appendix D; format/codecs/hqmq.md "Codebooks").

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::cache::Kind;
use crate::kernels::quaternion::{self, HURWITZ, Quat};
use crate::kernels::rng::{SplitMix64, mix64};

/// Number of primary codewords (the Hurwitz units, 2T).
pub const PRIMARY: usize = 24;

/// The PRNG state that generates the secondary codebook of `(layer, head,
/// kind)` from the file seed (format/codecs/hqmq.md):
///
/// ```text
/// id     = (layer << 32) | head                 (u64)
/// state0 = mix64( mix64(seed XOR id) XOR kind )  (kind: 0 = K, 1 = V)
/// ```
pub fn codebook_state(seed: u64, layer: u32, head: u32, kind: Kind) -> u64 {
    let id = (u64::from(layer) << 32) | u64::from(head);
    mix64(mix64(seed ^ id) ^ u64::from(kind.code()))
}

/// The `S` secondary unit quaternions of `(layer, head, kind)`: `S`
/// successive [`quaternion::haar_unit`] draws from
/// `SplitMix64::new(codebook_state(..))`.
pub fn secondaries(seed: u64, layer: u32, head: u32, kind: Kind, s: usize) -> Vec<Quat> {
    let mut rng = SplitMix64::new(codebook_state(seed, layer, head, kind));
    (0..s).map(|_| quaternion::haar_unit(&mut rng)).collect()
}

/// One (layer, kv head, K|V) codebook, precomputed for encoding and
/// decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    /// Secondary codebook `q_s`, `s` in `0..S`.
    pub secondary: Vec<Quat>,
    /// Joint codebook: entry `j = p * S + s` is `HURWITZ[p] * q_s`
    /// ([`quaternion::mul`], primary on the left); `24 S` entries.
    pub joint: Vec<Quat>,
    /// Secondary components as four arrays (`q_s[k]` at `soa[k][s]`) for
    /// the vectorized encoder search.
    pub soa: [Vec<f32>; 4],
    /// `s` as f32 for `s` in `0..S` (exact; lets the vector search load a
    /// group number instead of counting it in a register).
    pub index: Vec<f32>,
}

impl Codebook {
    /// Builds the codebook from its secondaries.
    pub fn new(secondary: Vec<Quat>) -> Codebook {
        let s = secondary.len();
        let mut joint = Vec::with_capacity(PRIMARY * s);
        for p in &HURWITZ {
            for q in &secondary {
                joint.push(quaternion::mul(*p, *q));
            }
        }
        let soa = std::array::from_fn(|k| secondary.iter().map(|q| q[k]).collect());
        Codebook {
            index: (0..s).map(|i| i as f32).collect(),
            secondary,
            joint,
            soa,
        }
    }

    /// Number of secondary codewords `S`.
    pub fn s(&self) -> usize {
        self.secondary.len()
    }
}

/// Bytes of codebooks cached by every [`Cache`] of the process.
static CACHED_BYTES: AtomicU64 = AtomicU64::new(0);
/// Budget for [`CACHED_BYTES`] (see [`crate::codec::set_codebook_budget`]).
static BUDGET_BYTES: AtomicU64 = AtomicU64::new(512 << 20);

/// Sets the process-wide codebook cache budget, bytes.
pub fn set_budget(bytes: u64) {
    BUDGET_BYTES.store(bytes, Ordering::Relaxed);
}

impl Codebook {
    /// Heap bytes held by the codebook.
    pub fn heap_bytes(&self) -> u64 {
        let quat = std::mem::size_of::<Quat>() as u64;
        let s = self.secondary.len() as u64;
        s * quat + self.joint.len() as u64 * quat + 4 * 4 * s + 4 * s
    }
}

/// Codebooks built so far, keyed by `(layer, head, kind)`. Codebooks are a
/// pure function of the codec parameters and the key, so caching them in
/// an otherwise immutable codec is invisible to callers.
/// Bounded twice: at most `MAX_CACHED` entries per cache, and all caches
/// of the process together within the budget of [`set_budget`]; past the
/// budget a codebook is built for the page at hand and not kept.
#[derive(Default)]
pub struct Cache {
    map: RwLock<HashMap<(u32, u32, u8), Arc<Codebook>>>,
    bytes: AtomicU64,
}

impl Drop for Cache {
    fn drop(&mut self) {
        CACHED_BYTES.fetch_sub(*self.bytes.get_mut(), Ordering::Relaxed);
    }
}

/// Entries kept before the cache is cleared (bounds memory on models with
/// many layers and heads: 1024 codebooks of S = 192 are 72 MiB).
const MAX_CACHED: usize = 1024;

impl Cache {
    /// The codebook of `(layer, head, kind)`, built on first use.
    pub fn get(&self, seed: u64, s: usize, layer: u32, head: u32, kind: Kind) -> Arc<Codebook> {
        let key = (layer, head, kind.code());
        if let Some(c) = self.map.read().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return c.clone();
        }
        let built = Arc::new(Codebook::new(secondaries(seed, layer, head, kind, s)));
        let size = built.heap_bytes();
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(&key) {
            return c.clone();
        }
        let budget = BUDGET_BYTES.load(Ordering::Relaxed);
        if map.len() >= MAX_CACHED || CACHED_BYTES.load(Ordering::Relaxed) + size > budget {
            map.clear();
            let mine = self.bytes.swap(0, Ordering::Relaxed);
            CACHED_BYTES.fetch_sub(mine, Ordering::Relaxed);
        }
        if CACHED_BYTES.load(Ordering::Relaxed) + size > budget {
            return built;
        }
        CACHED_BYTES.fetch_add(size, Ordering::Relaxed);
        self.bytes.fetch_add(size, Ordering::Relaxed);
        map.insert(key, built.clone());
        built
    }
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.map.read().map(|m| m.len()).unwrap_or(0);
        write!(f, "Cache({n} codebooks)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codebooks_differ_per_layer_head_kind_and_seed() {
        let base = secondaries(0, 3, 1, Kind::Key, 4);
        assert_eq!(base, secondaries(0, 3, 1, Kind::Key, 4));
        for other in [
            secondaries(1, 3, 1, Kind::Key, 4),
            secondaries(0, 2, 1, Kind::Key, 4),
            secondaries(0, 3, 0, Kind::Key, 4),
            secondaries(0, 3, 1, Kind::Value, 4),
        ] {
            assert_ne!(base, other);
        }
        // A prefix of a larger codebook is the smaller codebook.
        assert_eq!(secondaries(0, 3, 1, Kind::Key, 9)[..4], base[..]);
    }

    /// Issue 12: 24 hqmq slots of S = 65536 over 64 heads cached 1536
    /// codebooks of 28 MB each (43 GB); past the process budget a
    /// codebook is built and used but not kept.
    #[test]
    fn cache_respects_the_process_budget() {
        let c = Cache::default();
        set_budget(0);
        let a = c.get(1, 8, 0, 0, Kind::Key);
        assert_eq!(c.map.read().unwrap().len(), 0);
        set_budget(512 << 20);
        let b = c.get(1, 8, 0, 0, Kind::Key);
        assert_eq!(c.map.read().unwrap().len(), 1);
        assert_eq!(*a, *b);
        assert_eq!(c.bytes.load(Ordering::Relaxed), b.heap_bytes());
    }

    #[test]
    fn joint_codebook_order_is_primary_major() {
        let cb = Codebook::new(secondaries(5, 0, 0, Kind::Value, 3));
        assert_eq!(cb.joint.len(), 72);
        // p = 0 is the identity: the first S entries are the secondaries.
        assert_eq!(cb.joint[..3], cb.secondary[..]);
        // p = 1 is -1.
        assert_eq!(cb.joint[4], cb.secondary[1].map(|v| -v));
        assert_eq!(
            cb.joint[10 * 3 + 2],
            quaternion::mul(HURWITZ[10], cb.secondary[2])
        );
    }
}
