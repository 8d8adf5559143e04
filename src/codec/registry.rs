//! The codec registry: codec families by name and by id.

use crate::error::{Error, FormatCause, Location, Result};
use crate::format::CodecEntry;

use super::Codec;

/// Parser of a codec name: `None` when the name belongs to another family.
pub type ParseFn = fn(&str) -> Option<Result<Box<dyn Codec>>>;

/// A codec family: one codec id, a name parser and a parameter decoder.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// Registered codec id (format/SPEC.md "Codec ids").
    pub id: u16,
    /// Family name, e.g. `bdr`.
    pub name: &'static str,
    /// Name syntax shown by `kvpack codecs`.
    pub syntax: &'static str,
    /// One-line description.
    pub summary: &'static str,
    /// Parses a full codec name; `None` when the name is not of this family.
    pub parse: ParseFn,
    /// Rebuilds the codec from its parameter block.
    pub from_params: fn(&[u8]) -> Result<Box<dyn Codec>>,
    /// Parameter sets that matter (every name variant with its own code
    /// path). `tests/conformance.rs` runs each through round trip, golden
    /// re-encode, tampered sections, random shapes and CPU vs GPU: a new
    /// family gets all of that by listing its examples here.
    pub examples: &'static [Example],
}

/// One example parameter set of a [`Family`], with the quality the
/// conformance suite requires of it.
#[derive(Debug, Clone, Copy)]
pub struct Example {
    /// A full codec name accepted by [`parse`], e.g. `bdr64:k`.
    pub name: &'static str,
    /// Smallest reconstruction SNR in dB (`-10 log10(rel_mse)`, see
    /// [`crate::metrics::TensorError`]) of any tensor of the real fixture
    /// and of the synthetic test cache, every token coded (no raw
    /// windows), set at least 1 dB below the value measured when the
    /// example was added (`cargo test --release --test conformance --
    /// --nocapture` prints it). `f64::INFINITY` for lossless codecs, which
    /// must decode bit exactly.
    pub min_snr_db: f64,
}

/// Every registered codec family.
pub const FAMILIES: &[Family] = &[
    super::raw::FAMILY,
    super::affine::INT_FAMILY,
    super::affine::BDR_FAMILY,
    super::polar::FAMILY,
    super::innerq::FAMILY,
    super::kivi::FAMILY,
    super::hqmq::FAMILY,
    super::octopus::FAMILY,
    super::turbo::FAMILY,
];

/// Parses a codec name such as `raw`, `int4`, `bdr128`, `bdr128:k` or
/// `hqmq:s96r4+med3`.
///
/// # Errors
/// [`Error::Parameter`] for an unknown name or invalid options, listing the
/// known families.
pub fn parse(name: &str) -> Result<Box<dyn Codec>> {
    let name = name.trim();
    for f in FAMILIES {
        if let Some(r) = (f.parse)(name) {
            return r;
        }
    }
    let known: Vec<&str> = FAMILIES.iter().map(|f| f.syntax).collect();
    Err(Error::param(format!(
        "unknown codec {name:?}; known codecs:\n  {}",
        known.join("\n  ")
    )))
}

/// Rebuilds the codec of a codec table entry read from a file.
///
/// # Errors
/// [`Error::Format`] at the header for an unknown id or invalid parameters.
pub fn from_entry(slot: usize, e: &CodecEntry) -> Result<Box<dyn Codec>> {
    let f = FAMILIES.iter().find(|f| f.id == e.id).ok_or_else(|| {
        Error::format_with(
            FormatCause::UnknownCodec,
            Location::Header,
            format!(
                "codec slot {slot}: unknown codec id {} (written by a newer kvpack?)",
                e.id
            ),
        )
    })?;
    (f.from_params)(&e.params).map_err(|err| {
        Error::format_with(
            FormatCause::UnknownCodec,
            Location::Header,
            format!("codec slot {slot} ({}): {err}", f.name),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_params() {
        for n in [
            "raw", "int2", "int3", "int4", "int8", "bdr16", "bdr128", "bdr256:k", "bdr64:b3",
        ] {
            let c = parse(n).unwrap();
            assert_eq!(c.name(), n);
            let back = from_entry(
                0,
                &CodecEntry {
                    id: c.id(),
                    params: c.params(),
                },
            )
            .unwrap();
            assert_eq!(back.name(), n);
        }
    }

    #[test]
    fn bad_names_are_rejected() {
        for n in [
            "int0", "int9", "bdr100", "bdr", "bdr128:x", "foo", "bdr8192",
        ] {
            assert!(parse(n).is_err(), "{n}");
        }
    }
}
