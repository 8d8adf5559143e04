//! `hqmq:s{S}r{b}[+med{C}][+chan|+ctr]`: Hurwitz-quaternion multiplicative vector
//! quantization (Swain et al., "Hurwitz Quaternion Multiplicative
//! Quantization for KV Cache Compression", arXiv:2605.27646; bitstream in
//! format/codecs/hqmq.md).
//!
//! Every head vector (one token of one kv head, `head_dim` values) is cut
//! into `head_dim / 4` chunks, each a quaternion `x`. Its radius `|x|` and
//! its direction are quantized separately (paper section 3, appendix B):
//!
//! * direction: the nearest codeword of the joint codebook
//!   `{q_p * q_s : q_p in 2T, q_s in S_{layer, head, K|V}}` (Eq. 1): the
//!   24 Hurwitz units times `S` Haar-random unit quaternions regenerated
//!   from the file's seed ([`codebook`]), found by an exact fast search
//!   ([`search`]);
//! * radius: `b` bits, uniform levels `0 ..= 2^b - 1` times a per-token
//!   fp16 scale (the row's largest inlier radius).
//!
//! With `+med{C}` (paper "Median-multiplier outlier extraction", Eq. 2,
//! `C = 3` in the paper) a chunk whose radius exceeds `C` times the median
//! chunk radius of its (plane, page) is stored exactly in fp16 in the
//! page's outlier table (format/SPEC.md section 6.5) instead.
//!
//! With `+chan` every page first divides each channel (one of the
//! `head_dim` coordinates of one kv head) by its largest magnitude over the
//! page's tokens, rounded up to fp16 and stored in the page, and the decoder
//! multiplies it back. Keys carry a few channels far larger than the rest
//! (the outlier channels of KIVI, arXiv:2402.02750, section 3, and
//! KVQuant, arXiv:2401.18079, section 3.1, which both quantize keys per
//! channel); the per-token radius scale then spends its levels on them.
//! Gains put every channel on one scale first. Not part of the HQMQ paper.
//!
//! With `+ctr` every page first subtracts from each channel its mean over
//! the page's tokens (an fp16 offset) and divides the rest by the square
//! root of its largest remaining magnitude (an fp16 gain); the decoder
//! multiplies the gain back and adds the offset. Keys of most models carry
//! a per-channel offset common to all tokens (a constant vector added to
//! every key changes no attention weight, since softmax ignores a constant
//! added to every score), which otherwise takes most of each chunk's
//! radius; the square root puts the channels on closer scales than the raw
//! keys without flattening them as `+chan` does. Not part of the HQMQ
//! paper (format/codecs/hqmq.md section 11).
//!
//! The `(direction, radius)` symbol of a chunk takes one of `24 S 2^b`
//! values; it is split into its low `E` bits and a base-`O` digit (`24 S
//! 2^b = O 2^E`, `O` odd: 9 for `S = 3 * 2^k`), and the digits are packed
//! in mixed radix ([`crate::kernels::radix`]), so a chunk costs
//! `E + W/G ~ log2(24 S) + b` bits: the paper's Table 21 accounting,
//! `(log2(24 S) + b) / 4 + 16 / head_dim` bits per element.

pub mod codebook;
mod page;
pub(crate) use page::page_layout;
mod params;
pub mod search;

use std::sync::Arc;

use crate::cache::TensorInfo;
use crate::error::{Error, Result};
use crate::format::{PageView, Section};
use crate::kernels::radix::Groups;

use self::codebook::{Cache, Codebook};
use super::{Codec, Example, Family, PageIn, PageOut};

pub use params::parse_name;

/// Codec id of `hqmq` (format/SPEC.md section 7).
pub const ID: u16 = 3;

/// Largest secondary codebook size `S`.
pub const MAX_S: u32 = 65_536;

/// Registry entry of `hqmq`.
pub const FAMILY: Family = Family {
    id: ID,
    name: "hqmq",
    syntax: "hqmq:s{S}r{b}[+med{C}][+chan|+ctr] e.g. hqmq:s96r4+med3",
    summary: "Hurwitz-quaternion multiplicative VQ of 4-element chunks, fp16 outliers, per-channel gains or centring (:seed{N})",
    parse: params::parse_family,
    from_params: |p| Ok(Box::new(params::from_params(p)?)),
    examples: &[
        Example {
            name: "hqmq:s24r3",
            min_snr_db: 8.0,
        },
        Example {
            name: "hqmq:s96r4+med3",
            min_snr_db: 16.0,
        },
        Example {
            name: "hqmq:s5r2+med2:seed9",
            min_snr_db: 8.0,
        },
        Example {
            name: "hqmq:s24r3+chan",
            min_snr_db: 8.0,
        },
        Example {
            name: "hqmq:s12r2+med4+chan",
            min_snr_db: 6.0,
        },
        Example {
            name: "hqmq:s24r3+ctr",
            min_snr_db: 8.0,
        },
        Example {
            name: "hqmq:s12r2+med4+ctr",
            min_snr_db: 6.0,
        },
    ],
};

/// What an hqmq page does to each channel (one of the `head_dim`
/// coordinates of one kv head) before coding, and the decoder undoes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Channels {
    /// Nothing: the paper's HQMQ.
    #[default]
    Off,
    /// `+chan` (format flag bit 1): divide by the channel's largest
    /// magnitude in the page, an fp16 gain stored in the page
    /// (format/codecs/hqmq.md section 10).
    Gains,
    /// `+ctr` (format flag bit 2): subtract the channel's mean over the
    /// page's tokens (an fp16 offset) and divide by the square root of the
    /// largest remaining magnitude (an fp16 gain), both stored in the page
    /// (format/codecs/hqmq.md section 11).
    Centred,
}

impl Channels {
    /// True when pages store a gain per plane and channel (SCALE stream 1).
    pub fn has_gains(self) -> bool {
        self != Channels::Off
    }

    /// True when pages store an offset per plane and channel (`+ctr`:
    /// SCALE stream 1 holds per plane the gains, then the offsets).
    pub fn has_offsets(self) -> bool {
        self == Channels::Centred
    }
}

/// An HQMQ configuration. Immutable; caches the codebooks it builds.
#[derive(Debug)]
pub struct Hqmq {
    /// Secondary codebook size `S` (1..=65536).
    pub secondaries: u32,
    /// Radius bits `b` (1..=8): levels `0 ..= 2^b - 1`.
    pub radius_bits: u8,
    /// Outlier multiplier `C` of `+med{C}`, or `None` without outlier
    /// extraction.
    pub outlier_multiplier: Option<f32>,
    /// Seed of every secondary codebook (default 0).
    pub seed: u64,
    /// Mixed-radix grouping of the direction digits.
    pub groups: Groups,
    /// The per-channel treatment of every page before coding (`+chan`,
    /// `+ctr`; [`Channels`]). [`Channels::Off`] by default.
    pub channels: Channels,
    cache: Arc<Cache>,
}

impl Hqmq {
    /// A configuration with the default digit grouping.
    ///
    /// # Errors
    /// [`Error::Parameter`] when `S` is not in 1..=65536, `b` not in 1..=8,
    /// or `C` is not a finite number in 1..=65504.
    pub fn new(
        secondaries: u32,
        radius_bits: u8,
        outlier_multiplier: Option<f32>,
        seed: u64,
    ) -> Result<Hqmq> {
        check_ranges(secondaries, radius_bits)?;
        let base = symbol_split(secondaries, radius_bits).1;
        Hqmq::with_groups(
            secondaries,
            radius_bits,
            outlier_multiplier,
            seed,
            Groups::best(base),
        )
    }

    /// A configuration with an explicit digit grouping (as read from a
    /// parameter block).
    ///
    /// # Errors
    /// As [`Hqmq::new`], and when `groups` is not a grouping of base `O`.
    pub fn with_groups(
        secondaries: u32,
        radius_bits: u8,
        outlier_multiplier: Option<f32>,
        seed: u64,
        groups: Groups,
    ) -> Result<Hqmq> {
        check_ranges(secondaries, radius_bits)?;
        if let Some(c) = outlier_multiplier
            && !(c.is_finite() && (1.0..=65504.0).contains(&c))
        {
            return Err(Error::param(format!(
                "hqmq: outlier multiplier {c}; C must be a number from 1 to 65504"
            )));
        }
        let base = symbol_split(secondaries, radius_bits).1;
        if Groups::new(base, groups.digits) != Some(groups) {
            return Err(Error::param(format!(
                "hqmq: {} digits per group is not a valid grouping of base {base}",
                groups.digits
            )));
        }
        Ok(Hqmq {
            secondaries,
            radius_bits,
            outlier_multiplier,
            seed,
            groups,
            channels: Channels::Off,
            cache: Arc::default(),
        })
    }

    /// This configuration with the per-channel treatment `channels`
    /// (`+chan`, `+ctr` or none).
    pub fn with_channels(self, channels: Channels) -> Hqmq {
        Hqmq { channels, ..self }
    }

    /// Radius levels minus one, `L = 2^b - 1`.
    pub fn levels(&self) -> u32 {
        (1 << self.radius_bits) - 1
    }

    /// `(E, O)` with `24 S 2^b = O 2^E`, `O` odd.
    pub fn split(&self) -> (u32, u64) {
        symbol_split(self.secondaries, self.radius_bits)
    }

    /// A copy of this configuration that shares its codebook cache (the
    /// codebooks it built and will build are used by both).
    pub fn clone_with_codebooks(&self) -> Hqmq {
        Hqmq {
            cache: self.cache.clone(),
            ..*self
        }
    }

    /// This configuration using the codebook cache of `other` when both
    /// have the same `S` and seed (codebooks depend on nothing else), else
    /// unchanged: configurations differing only in radius bits, outlier
    /// extraction or digit grouping then build each codebook once.
    pub fn with_codebooks_of(self, other: &Hqmq) -> Hqmq {
        if self.secondaries == other.secondaries && self.seed == other.seed {
            Hqmq {
                cache: other.cache.clone(),
                ..self
            }
        } else {
            self
        }
    }

    /// The codebook of `(layer, kv head, kind)`.
    pub fn codebook(&self, layer: u32, head: u32, kind: crate::cache::Kind) -> Arc<Codebook> {
        self.cache
            .get(self.seed, self.secondaries as usize, layer, head, kind)
    }

    /// Payload bits per inlier chunk: `E + W / G` (direction and radius
    /// symbol; compare `log2(24 S) + b`, HQMQ paper Table 21).
    pub fn bits_per_chunk(&self) -> f64 {
        f64::from(self.split().0) + self.groups.bits_per_digit()
    }
}

fn check_ranges(secondaries: u32, radius_bits: u8) -> Result<()> {
    if !(1..=MAX_S).contains(&secondaries) {
        return Err(Error::param(format!(
            "hqmq: S = {secondaries} secondary codewords; S must be 1 to {MAX_S}"
        )));
    }
    if !(1..=8).contains(&radius_bits) {
        return Err(Error::param(format!(
            "hqmq: {radius_bits} radius bits; b must be 1 to 8"
        )));
    }
    Ok(())
}

/// The direction index of every chunk of one page, as the search of a
/// configuration with `S` secondaries and `seed` found it, and its filter
/// pass per plane (a search of more secondaries of the seed continues it).
#[derive(Debug, Clone)]
struct Directions {
    secondaries: u32,
    seed: u64,
    js: Vec<u32>,
    progress: Vec<search::Progress>,
}

/// The sizes of a page's sections ([`Hqmq::trial`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trial {
    /// Section payload bytes (the `data` of every section).
    pub payload: u64,
    /// The part of `payload` that a page has whatever its token count:
    /// the channel gains of `+chan` (`2 * planes * head_dim` bytes), the
    /// gains and offsets of `+ctr` (twice that), else 0.
    pub per_page: u64,
    /// Number of sections.
    pub sections: usize,
}

/// Work that hqmq configurations encoding the same page share
/// ([`Hqmq::encode_shared`]): the page's chunks and radii, and the
/// direction search of each `(S, seed)` met so far; one slot per
/// [`Channels`] treatment (their chunks differ). One per page.
#[derive(Debug, Clone, Default)]
pub struct Shared {
    slots: [Slot; 3],
}

/// The chunks of a page as configurations of one [`Channels`] treatment
/// see them, and their direction searches.
#[derive(Debug, Clone, Default)]
struct Slot {
    chunks: Option<page::Chunks>,
    directions: Vec<Directions>,
}

impl Hqmq {
    /// Encodes `page` exactly as [`Codec::encode`] does, sharing work
    /// between configurations: when `shared` holds the chunks of a page
    /// with as many chunks they are used, else loaded and stored (the
    /// searches stored before are dropped); when it holds the direction
    /// search of a configuration with the same `S` and seed it is used,
    /// else done and stored. The chunks do not depend on the
    /// configuration, and radius bits and outlier extraction do not
    /// change the directions, so `hqmq:s96r4`, `hqmq:s96r6`,
    /// `hqmq:s96r4+med3` and `hqmq:s24r3` encoding one page load it once
    /// and search it twice. A search of more secondaries than one stored
    /// for the seed continues its filter pass (a codebook's secondaries
    /// start with those of every smaller codebook of its seed): encoding
    /// `hqmq:s24r3` then `hqmq:s96r4` scores secondaries `0..24` once.
    /// (The budget planner tries them all on each tensor's sample.) The
    /// caller passes one `shared` per page: the
    /// chunks of another page with as many chunks would be taken as they
    /// are.
    ///
    /// # Errors
    /// As [`Codec::encode`].
    pub fn encode_shared(&self, page: &PageIn<'_>, shared: &mut Shared) -> Result<Vec<Section>> {
        page::encode(self, page, Some(shared), None).map(page::Coded::into_sections)
    }

    /// What [`Hqmq::encode_shared`] would store, measured, and the page it
    /// would decode to: writes to `recon` the page as [`Codec::decode`]
    /// returns it from the sections, bit for bit, without decoding
    /// (`[planes, tokens, head_dim]` f32, the rows of `page` in order),
    /// and returns the sections' payload bytes and number without packing
    /// them (the budget planner's round trips).
    ///
    /// # Errors
    /// As [`Codec::encode`], and [`Error::Parameter`] when `recon` does not
    /// hold exactly the page's values.
    pub fn trial(
        &self,
        page: &PageIn<'_>,
        shared: &mut Shared,
        recon: &mut [f32],
    ) -> Result<Trial> {
        match page::encode(self, page, Some(shared), Some(recon))? {
            page::Coded::Sizes(t) => Ok(t),
            page::Coded::Sections(_) => unreachable!("a reconstruction returns sizes"),
        }
    }

    /// Rebuilds the codec from its parameter block (format/codecs/hqmq.md):
    /// the codec's one reader of it, used by its registry entry and the GPU
    /// staging.
    ///
    /// # Errors
    /// [`Error::Parameter`] for a wrong length, reserved bytes or unknown
    /// flag bits set, or any field out of range.
    pub fn from_params(p: &[u8]) -> Result<Hqmq> {
        params::from_params(p)
    }
}

/// `(E, O)` with `24 S 2^b = O 2^E` and `O` odd (`S >= 1`).
pub(crate) fn symbol_split(s: u32, b: u8) -> (u32, u64) {
    let m = (24 * u64::from(s)) << b;
    let e = m.trailing_zeros();
    (e, m >> e)
}

impl Codec for Hqmq {
    fn size_depends_only_on_shape(&self) -> bool {
        self.outlier_multiplier.is_none()
    }

    /// One sink token with `+chan` and `+ctr` (an attention-sink token in
    /// a page would set its channel statistics for every other row,
    /// format/codecs/hqmq.md sections 10-11), else none.
    fn default_windows(&self) -> (u32, u32) {
        if self.channels.has_gains() {
            (1, 0)
        } else {
            (0, 0)
        }
    }

    fn name(&self) -> String {
        params::name(self)
    }

    fn id(&self) -> u16 {
        ID
    }

    fn params(&self) -> Vec<u8> {
        params::to_bytes(self)
    }

    fn check(&self, t: &TensorInfo) -> Result<()> {
        if !t.head_dim.is_multiple_of(4) {
            return Err(Error::param(format!(
                "{} cuts head vectors into 4-element chunks, but {} ({}) has head_dim {}, \
                 not a multiple of 4",
                self.name(),
                t.name,
                t.describe(),
                t.head_dim
            )));
        }
        Ok(())
    }

    fn encode(&self, page: &PageIn<'_>) -> Result<Vec<Section>> {
        page::encode(self, page, None, None).map(page::Coded::into_sections)
    }

    fn decode(&self, page: &PageView<'_>, out: &mut PageOut<'_>) -> Result<()> {
        page::decode(self, page, out)
    }

    /// `(E + W/G) / 4 + 16 / head_dim`: the chunk symbols and the fp16
    /// per-token scale; outliers (data-dependent) excluded. At head_dim 128
    /// this is the HQMQ paper's Table 21 (3.17 for s24r3 ... 4.67 for
    /// s192r6) to two decimals.
    fn bits_per_element(&self, t: &TensorInfo) -> f64 {
        self.bits_per_chunk() / 4.0 + 16.0 / f64::from(t.head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Kind;

    /// Configurations of one `S` and seed share codebooks when asked;
    /// others keep their own; a shared codebook is the one each would
    /// build.
    #[test]
    fn codebooks_are_shared_only_between_equal_s_and_seed() {
        let a = Hqmq::new(24, 3, None, 5).unwrap();
        let b = Hqmq::new(24, 6, Some(3.0), 5)
            .unwrap()
            .with_codebooks_of(&a);
        let c = Hqmq::new(48, 3, None, 5).unwrap().with_codebooks_of(&a);
        let d = Hqmq::new(24, 3, None, 6).unwrap().with_codebooks_of(&a);
        assert!(Arc::ptr_eq(&a.cache, &b.cache));
        assert!(!Arc::ptr_eq(&a.cache, &c.cache));
        assert!(!Arc::ptr_eq(&a.cache, &d.cache));
        let e = b.clone_with_codebooks();
        assert!(Arc::ptr_eq(&a.cache, &e.cache));
        assert_eq!(e.params(), b.params());
        let own = Hqmq::new(24, 6, Some(3.0), 5).unwrap();
        assert_eq!(
            *e.codebook(3, 0, Kind::Value),
            *own.codebook(3, 0, Kind::Value)
        );
        assert_eq!(c.codebook(3, 0, Kind::Value).s(), 48);
        assert_ne!(
            *d.codebook(3, 0, Kind::Value),
            *a.codebook(3, 0, Kind::Value)
        );
    }
}
