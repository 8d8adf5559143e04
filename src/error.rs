//! The library's one error type, grouped by whose fault an error is.
//!
//! * [`Error::Format`]: the bytes being read are not a valid kvpack file or
//!   stream (corrupted, truncated, written by a newer major version). The
//!   [`Location`] names the header, page, section or index entry at fault,
//!   the [`FormatCause`] says what kind of fault it is.
//! * [`Error::Parameter`]: the caller asked for something invalid (an unknown
//!   codec name, a head_dim the codec cannot handle, a missing tensor).
//! * [`Error::Limits`]: the input is well formed but exceeds a configured
//!   [`crate::format::Limits`] bound.
//! * [`Error::Io`]: the operating system refused a read or write.
//! * [`Error::Unsupported`]: the feature exists in the format but not in this
//!   build or on this machine (for example GPU decode without CUDA).
//! * [`Error::Device`]: the GPU (CUDA driver, NVRTC, a kernel, the SIMT
//!   emulator) failed. The `kvpack` CLI exits with status 4 for it.

use std::fmt;

/// Where in a kvpack file or stream a [`Error::Format`] was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// The file header (magic, version, tensor table, codec table, metadata).
    Header,
    /// A page frame. `page` is the page's position in stream order (0-based);
    /// `tensor` and the token range are given when the page header could be
    /// parsed.
    Page {
        /// Position of the page in stream order.
        page: u64,
        /// Byte offset of the page frame from the start of the file.
        offset: u64,
        /// `"layer 3 K tokens 0..256"` style description, when known.
        what: Option<String>,
    },
    /// A section inside a page (`kind` is the section kind's name).
    Section {
        /// Position of the page in stream order.
        page: u64,
        /// Description of the page (layer, K/V, token range).
        what: String,
        /// Section kind name, e.g. `"INDEX"`.
        kind: String,
    },
    /// The footer index of commit `generation`.
    Index {
        /// Commit generation (0 for the first write, +1 per append).
        generation: u32,
    },
    /// The trailer (end magic and index pointer) at `offset`.
    Trailer {
        /// Byte offset of the trailer.
        offset: u64,
    },
    /// Anywhere else in the data section (padding, tiling gaps).
    Data {
        /// Byte offset from the start of the file.
        offset: u64,
    },
    /// An input tensor file (safetensors), by tensor name when known.
    Input(String),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Header => write!(f, "file header"),
            Location::Page { page, offset, what } => {
                write!(f, "page #{page} at byte {offset}")?;
                if let Some(w) = what {
                    write!(f, " ({w})")?;
                }
                Ok(())
            }
            Location::Section { page, what, kind } => {
                write!(f, "section {kind} of page #{page} ({what})")
            }
            Location::Index { generation } => write!(f, "footer index (commit {generation})"),
            Location::Trailer { offset } => write!(f, "trailer at byte {offset}"),
            Location::Data { offset } => write!(f, "data section at byte {offset}"),
            Location::Input(name) => write!(f, "input {name}"),
        }
    }
}

/// What kind of fault an [`Error::Format`] is, for callers that act on it
/// (retry a transfer after [`FormatCause::Checksum`] or
/// [`FormatCause::Truncated`], ask for an upgrade after
/// [`FormatCause::UnsupportedVersion`]). The message still says exactly
/// what is wrong; new causes may be added in minor versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FormatCause {
    /// The bytes do not start with the kvpack magic (or are empty): not a
    /// kvpack file or stream at all.
    NotKvpack,
    /// Written by an incompatible version: a newer major version, or
    /// required feature flags this reader does not know.
    UnsupportedVersion,
    /// A codec id that this build does not know (written by a newer kvpack)
    /// or a codec parameter block it rejects.
    UnknownCodec,
    /// A header, page, index or trailer CRC32 does not match its bytes.
    Checksum,
    /// The data ends before the structure it announces.
    Truncated,
    /// A page's sections do not match its codec's spec (missing, extra,
    /// wrong type or size, values the codec never writes), found by the
    /// codec's decoder after every checksum passed.
    Codec,
    /// Any other violation of format/SPEC.md (bad field value, ordering,
    /// tiling, padding, sizes).
    Malformed,
}

impl fmt::Display for FormatCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FormatCause::NotKvpack => "not kvpack data",
            FormatCause::UnsupportedVersion => "unsupported version",
            FormatCause::UnknownCodec => "unknown codec",
            FormatCause::Checksum => "checksum mismatch",
            FormatCause::Truncated => "truncated",
            FormatCause::Codec => "codec data invalid",
            FormatCause::Malformed => "malformed",
        })
    }
}

/// Every error the kvpack library returns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file or stream is malformed, corrupted, truncated or from an
    /// incompatible version. The data's fault.
    #[error("invalid kvpack data in {at}: {msg}")]
    Format {
        /// Which structure is at fault.
        at: Location,
        /// What kind of fault.
        cause: FormatCause,
        /// What is wrong with it.
        msg: String,
    },
    /// The caller passed an invalid argument or an input that does not fit
    /// the request (unknown codec, bad shape, missing tensor). The caller's
    /// fault.
    #[error("{0}")]
    Parameter(String),
    /// A size exceeds the configured [`crate::format::Limits`].
    #[error("limit exceeded: {0}")]
    Limits(String),
    /// An operating-system I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What kvpack was doing (e.g. `"reading cache.kvpack"`).
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Supported by the format but not by this build or machine.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The GPU failed: a CUDA driver call, NVRTC compilation, a kernel
    /// launch or copy, out of device memory, or the SIMT emulator. The
    /// machine's fault, not the data's or the caller's.
    #[error("{context}: {source}")]
    Device {
        /// What kvpack was doing (e.g. `"CUDA launch decode_bdr_bf16"`).
        context: String,
        /// The driver's, compiler's or emulator's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Shorthand for `std::result::Result<T, kvpack::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Builds a [`Error::Format`] of cause [`FormatCause::Malformed`].
    pub fn format(at: Location, msg: impl Into<String>) -> Self {
        Error::format_with(FormatCause::Malformed, at, msg)
    }

    /// Builds a [`Error::Format`] with its cause.
    pub fn format_with(cause: FormatCause, at: Location, msg: impl Into<String>) -> Self {
        Error::Format {
            at,
            cause,
            msg: msg.into(),
        }
    }

    /// Builds an [`Error::Device`]: `context` says what kvpack was doing,
    /// `source` is the driver's error (anything printable works:
    /// `Error::device("CUDA launch", format!("{e:?}"))`).
    pub fn device(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Error::Device {
            context: context.into(),
            source: source.into(),
        }
    }

    /// The cause of a [`Error::Format`], `None` for other kinds.
    pub fn format_cause(&self) -> Option<FormatCause> {
        match self {
            Error::Format { cause, .. } => Some(*cause),
            _ => None,
        }
    }

    /// Builds a [`Error::Parameter`].
    pub fn param(msg: impl Into<String>) -> Self {
        Error::Parameter(msg.into())
    }

    /// Builds an [`Error::Io`] with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// True when the error is the data's fault (corrupt/truncated input).
    pub fn is_format(&self) -> bool {
        matches!(self, Error::Format { .. })
    }
}
