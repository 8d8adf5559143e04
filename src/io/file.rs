//! Memory-mapped input and atomic output files.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::ops::Deref;
use std::path::Path;

use crate::error::{Error, Result};

/// Bytes of an input file: memory-mapped, or read into memory for stdin.
#[derive(Debug)]
pub enum InputBytes {
    /// A read-only memory map of a regular file.
    Mapped(memmap2::Mmap),
    /// Bytes read from a pipe or stdin (or an empty file).
    Owned(Vec<u8>),
}

impl Deref for InputBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            InputBytes::Mapped(m) => m,
            InputBytes::Owned(v) => v,
        }
    }
}

/// Opens `path` for reading: `-` reads all of stdin, anything else is
/// memory-mapped.
///
/// The map is only valid while no other process truncates the file; kvpack
/// itself never truncates or rewrites committed bytes of a file (writes go
/// to a temporary file that is renamed, appends only add bytes).
///
/// # Errors
/// [`Error::Io`] naming the path.
pub fn open_input(path: &str) -> Result<InputBytes> {
    if path == "-" {
        let mut v = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut v)
            .map_err(|e| Error::io("reading stdin", e))?;
        return Ok(InputBytes::Owned(v));
    }
    let f = File::open(path).map_err(|e| Error::io(format!("opening {path}"), e))?;
    let len = f
        .metadata()
        .map_err(|e| Error::io(format!("reading metadata of {path}"), e))?
        .len();
    if len == 0 || !f.metadata().map(|m| m.is_file()).unwrap_or(false) {
        let mut v = Vec::new();
        (&f).read_to_end(&mut v)
            .map_err(|e| Error::io(format!("reading {path}"), e))?;
        return Ok(InputBytes::Owned(v));
    }
    // SAFETY: the map is read-only. Another process truncating the file
    // while it is mapped would fault; kvpack never does so (see above).
    let m =
        unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(format!("mapping {path}"), e))?;
    Ok(InputBytes::Mapped(m))
}

/// Writes a file atomically: `fill` writes into a temporary file in the same
/// directory, which is flushed, synced and renamed over `path`. Without
/// `force` an existing `path` is never replaced (checked before writing and
/// again by a no-clobber rename).
///
/// # Errors
/// [`Error::Parameter`] when `path` exists and `force` is false;
/// [`Error::Io`] naming the path; any error of `fill` (the temporary file is
/// then removed and `path` untouched).
pub fn write_atomic(
    path: &Path,
    force: bool,
    fill: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    if !force && path.exists() {
        return Err(Error::param(format!(
            "{} exists; use --force to overwrite it",
            path.display()
        )));
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".kvpack-tmp-")
        .tempfile_in(dir)
        .map_err(|e| Error::io(format!("creating a temporary file in {}", dir.display()), e))?;
    {
        let mut w = BufWriter::with_capacity(1 << 20, tmp.as_file());
        fill(&mut w)?;
        w.flush()
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    }
    tmp.as_file()
        .sync_all()
        .map_err(|e| Error::io(format!("syncing {}", path.display()), e))?;
    let res = if force {
        tmp.persist(path).map(|_| ())
    } else {
        tmp.persist_noclobber(path).map(|_| ())
    };
    res.map_err(|e| {
        Error::io(
            format!("renaming the temporary file to {}", path.display()),
            e.error,
        )
    })
}
