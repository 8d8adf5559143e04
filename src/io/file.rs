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
    fill: impl FnOnce(&mut (dyn Write + Send)) -> Result<()>,
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
    let mut builder = tempfile::Builder::new();
    builder.prefix(".kvpack-tmp-");
    // Created with mode 0666 minus the umask, like any new file (tempfile's
    // default 0600 would make outputs unreadable to other users).
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let tmp = builder
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

/// What [`append_file`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct AppendReport {
    /// The new commit's encoding report (bytes are the appended bytes).
    pub report: crate::compress::CompressReport,
    /// Generation of the new commit.
    pub generation: u32,
    /// Bytes of an earlier interrupted append that were removed first.
    pub torn_tail_removed: u64,
}

/// Appends the tokens of `longer` that follow the stored ones to the
/// kvpack file at `path`, as a new commit, without rewriting existing bytes
/// (format/SPEC.md section 10): takes an exclusive lock, truncates the torn
/// tail of an earlier interrupted append if any, writes pages and index,
/// syncs, writes the trailer, syncs. A crash at any point leaves a file
/// that opens as the previous commit or the new one.
///
/// # Errors
/// [`Error::Io`] naming the path (including "locked by another process");
/// the errors of [`crate::compress::append`]; [`Error::Format`] when the
/// existing file is invalid.
pub fn append_file(
    path: &Path,
    longer: &crate::KvCache,
    unverified_ok: bool,
    opts: &crate::compress::CompressOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<AppendReport> {
    use std::io::{Seek, SeekFrom};
    let name = path.display();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| Error::io(format!("opening {name} for append"), e))?;
    file.try_lock().map_err(|e| match e {
        std::fs::TryLockError::WouldBlock => Error::io(
            format!("locking {name}"),
            std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "another process is appending to it",
            ),
        ),
        std::fs::TryLockError::Error(e) => Error::io(format!("locking {name}"), e),
    })?;
    // SAFETY: read-only map; kvpack never truncates committed bytes, and
    // the exclusive lock keeps other kvpack appenders out.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| Error::io(format!("mapping {name}"), e))?;
    let reader = crate::format::Reader::open(&map)?;
    let committed = reader.committed_len();
    let torn = reader.torn_tail();
    if torn > 0 {
        file.set_len(committed)
            .map_err(|e| Error::io(format!("removing the torn tail of {name}"), e))?;
        file.sync_data()
            .map_err(|e| Error::io(format!("syncing {name}"), e))?;
    }
    let mut f = &file;
    f.seek(SeekFrom::Start(committed))
        .map_err(|e| Error::io(format!("seeking {name}"), e))?;
    let w = BufWriter::with_capacity(1 << 20, f);
    let mut sync = |w: &mut BufWriter<&File>| -> std::io::Result<()> {
        w.flush()?;
        w.get_ref().sync_data()
    };
    let (_, report, trailer) = crate::compress::append(
        &reader,
        &longer.view(),
        unverified_ok,
        opts,
        w,
        progress,
        &mut sync,
    )?;
    Ok(AppendReport {
        report,
        generation: trailer.generation,
        torn_tail_removed: torn,
    })
}
