//! Memory-mapped input and atomic output files.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::ops::Deref;
use std::path::Path;

use crate::error::{Error, Result};

/// Bytes of an input file: memory-mapped, or read into memory for stdin.
#[derive(Debug)]
pub enum InputBytes {
    /// A read-only memory map of a regular file, with the file kept open
    /// (it holds the shared reader lock of [`lock_for_reading`]).
    Mapped(memmap2::Mmap, File),
    /// Bytes read from a pipe or stdin (or an empty file).
    Owned(Vec<u8>),
}

impl Deref for InputBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            InputBytes::Mapped(m, _) => m,
            InputBytes::Owned(v) => v,
        }
    }
}

impl InputBytes {
    /// True for a memory-mapped file (another process could change its
    /// bytes; readers should use private page copies).
    pub fn is_mapped(&self) -> bool {
        matches!(self, InputBytes::Mapped(..))
    }

    /// Drops the mapped memory pages covering bytes `range` from this
    /// process's resident set (`madvise(MADV_DONTNEED)` on the enclosing
    /// whole pages): a reader that is done with a part of a mapped input
    /// calls it so that resident memory stays at the parts in use, not the
    /// whole file. The bytes stay readable (a later access reads them from
    /// the page cache again). Does nothing for owned bytes, an empty or
    /// out-of-range `range`, or where the advice is not supported.
    pub fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let InputBytes::Mapped(m, _) = self {
            // Reading one byte of a mapping maps the cached pages around it
            // too: Linux maps a whole large folio of the page cache (up to
            // 2 MiB) or a 64 KiB "fault-around" window, so reading the
            // header of the next frame maps the end of the previous one
            // again. Releasing 2 MiB more on each side undoes that (a page
            // released while another thread reads it is read again).
            const AROUND: usize = 2 << 20;
            let start = range.start.saturating_sub(AROUND) / AROUND * AROUND;
            let end = range.end.saturating_add(AROUND).min(m.len());
            if start >= end {
                return;
            }
            // SAFETY: the map is a read-only shared file mapping: dropping
            // its pages loses nothing (the next access reads the file
            // again); no slice of it is invalidated.
            let _ = unsafe {
                m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
        let _ = range;
    }

    /// [`InputBytes::release`] of the bytes of `part`, a slice of this
    /// input (anything else is ignored).
    pub fn release_slice(&self, part: &[u8]) {
        let base = self.as_ptr() as usize;
        let p = part.as_ptr() as usize;
        if p >= base && p + part.len() <= base + self.len() {
            self.release(p - base..p - base + part.len());
        }
    }
}

impl crate::format::Release for InputBytes {
    fn release(&self, range: std::ops::Range<usize>) {
        InputBytes::release(self, range);
    }
}

/// What an input must start with, and how much of a non-mappable input
/// (stdin, pipe, device) may be read into memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputRules<'m> {
    /// Leading bytes the input must have (checked before anything else is
    /// read), e.g. [`crate::format::MAGIC`]; `None` accepts any input.
    pub magic: Option<&'m [u8]>,
    /// Largest input read from a pipe, stdin or a device, bytes.
    pub max_bytes: u64,
}

impl InputRules<'static> {
    /// A kvpack file: starts with the magic, at most `max_bytes` from a pipe.
    pub fn kvpack(max_bytes: u64) -> Self {
        InputRules {
            magic: Some(&crate::format::MAGIC),
            max_bytes,
        }
    }

    /// Any file (safetensors inputs), at most `max_bytes` from a pipe.
    pub fn any(max_bytes: u64) -> Self {
        InputRules {
            magic: None,
            max_bytes,
        }
    }
}

/// Opens `path` for reading: `-` reads all of stdin, anything else is
/// memory-mapped. Accepts any content, reads at most
/// [`crate::format::Limits::max_memory`] bytes from a pipe (see
/// [`open_input_with`]).
///
/// # Errors
/// As [`open_input_with`].
pub fn open_input(path: &str) -> Result<InputBytes> {
    open_input_with(
        path,
        InputRules::any(crate::format::Limits::default().max_memory),
    )
}

/// Reads up to `buf.len()` bytes; returns how many arrived before EOF.
fn read_some(r: &mut dyn Read, buf: &mut [u8], what: &str) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(format!("reading {what}"), e)),
        }
    }
    Ok(got)
}

/// Reads a non-mappable input: the magic first (rejected at once when it
/// differs, so `/dev/zero` or a large wrong stdin costs nothing), then the
/// rest up to `rules.max_bytes`.
fn read_checked(r: &mut dyn Read, what: &str, rules: InputRules<'_>) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    if let Some(magic) = rules.magic {
        v.resize(magic.len(), 0);
        let n = read_some(r, &mut v, what)?;
        v.truncate(n);
        check_magic(&v, magic, what)?;
    }
    let room = rules.max_bytes.saturating_sub(v.len() as u64);
    r.take(room.saturating_add(1))
        .read_to_end(&mut v)
        .map_err(|e| Error::io(format!("reading {what}"), e))?;
    if v.len() as u64 > rules.max_bytes {
        return Err(Error::Limits(format!(
            "{what} is longer than {} bytes, the most read from a pipe or device \
             (raise it with --max-memory, or pass a regular file)",
            rules.max_bytes
        )));
    }
    Ok(v)
}

fn check_magic(head: &[u8], magic: &[u8], what: &str) -> Result<()> {
    if head.len() < magic.len() || head[..magic.len()] != *magic {
        return Err(Error::format(
            crate::error::Location::Header,
            format!(
                "{what} is not a kvpack file: it starts with {:02x?}, expected {:02x?}",
                &head[..head.len().min(magic.len())],
                magic
            ),
        ));
    }
    Ok(())
}

/// Opens `path` for reading under `rules`: `-` reads stdin, a pipe or
/// device is read (magic first, at most `rules.max_bytes`), a regular file
/// is memory-mapped after its magic is checked.
///
/// A mapped file is held with a shared advisory lock ([`lock_for_reading`]):
/// `kvpack append` does not truncate a torn tail while it is held. Pages
/// are copied out of the map before their checksum is verified
/// ([`crate::format::Reader::page`]), so a file rewritten in place by
/// another process cannot feed unverified bytes to a decoder; a file
/// truncated by a process that ignores the lock makes accesses to the lost
/// bytes fault (SIGBUS), which the CLI reports as an I/O error.
///
/// # Errors
/// [`Error::Io`] naming the path; [`Error::Format`] when the magic differs;
/// [`Error::Limits`] when a pipe delivers more than `rules.max_bytes`.
pub fn open_input_with(path: &str, rules: InputRules<'_>) -> Result<InputBytes> {
    if path == "-" {
        let v = read_checked(&mut std::io::stdin().lock(), "stdin", rules)?;
        return Ok(InputBytes::Owned(v));
    }
    let f = File::open(path).map_err(|e| Error::io(format!("opening {path}"), e))?;
    let meta = f
        .metadata()
        .map_err(|e| Error::io(format!("reading metadata of {path}"), e))?;
    if meta.len() == 0 || !meta.is_file() {
        let v = read_checked(&mut &f, path, rules)?;
        return Ok(InputBytes::Owned(v));
    }
    lock_for_reading(&f).map_err(|e| Error::io(format!("locking {path} for reading"), e))?;
    // SAFETY: the map is read-only and held with a shared advisory lock
    // that kvpack's own truncation respects; bytes are copied before they
    // are verified and used (see above).
    let m =
        unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(format!("mapping {path}"), e))?;
    if let Some(magic) = rules.magic {
        check_magic(&m[..m.len().min(magic.len())], magic, path)?;
    }
    Ok(InputBytes::Mapped(m, f))
}

/// Takes a shared advisory lock on the whole of `f` (see `record_lock`):
/// readers hold it while the file is mapped, and [`append_file`] only
/// truncates a torn tail when it can take the exclusive lock. Never
/// blocks; a file that cannot be locked (no support on this file system,
/// or an appender of a platform whose lock kinds conflict) is read without
/// the lock.
///
/// # Errors
/// Never in practice: failures to lock are ignored (advisory only).
pub fn lock_for_reading(f: &File) -> std::io::Result<()> {
    let _ = record_lock(f, false);
    Ok(())
}

/// Tries to take a record lock on the whole file, shared or exclusive,
/// without blocking: `Ok(false)` when another holder has a conflicting one.
///
/// The concurrency contract needs two independent locks on one file:
/// appenders exclude each other for the whole append (the whole-file lock
/// of [`File::try_lock`], `flock` on Unix), while readers must not hold
/// appends back, only the final cut of a torn tail. std's locks are one
/// lock per file, so readers use this second kind: on Linux an open file
/// description (OFD) lock, `F_OFD_SETLK`, which is independent of `flock`
/// and owned by the descriptor (two readers in one process, or a reader
/// and an appender, each hold their own); on other Unix systems a POSIX
/// record lock, `F_SETLK`, owned by the process (kvpack keeps one
/// descriptor per input, so closing another one cannot drop it). Where a
/// system makes `flock` and record locks conflict, the outcome is an
/// append refused while a reader holds the file, or a torn tail left in
/// place (readers ignore it): never a cut under a reader. Elsewhere there
/// is no such lock and this returns `Ok(true)`.
#[cfg(unix)]
fn record_lock(f: &File, exclusive: bool) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    #[cfg(target_os = "linux")]
    const SETLK: libc::c_int = libc::F_OFD_SETLK;
    #[cfg(not(target_os = "linux"))]
    const SETLK: libc::c_int = libc::F_SETLK;
    // SAFETY: `flock` is a plain C struct; zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = if exclusive {
        libc::F_WRLCK
    } else {
        libc::F_RDLCK
    } as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = 0;
    fl.l_len = 0;
    // SAFETY: valid fd and a pointer to an initialized flock struct.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), SETLK, &fl) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(not(unix))]
fn record_lock(_f: &File, _exclusive: bool) -> std::io::Result<bool> {
    Ok(true)
}

/// The temporary output being written, for the signal handlers of
/// [`install_cleanup_handlers`] (a leaked C string, or null).
#[cfg(unix)]
static TEMP_PATH: std::sync::atomic::AtomicPtr<libc::c_char> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Registers `path` as the temporary output until dropped.
struct TempRegistration;

impl TempRegistration {
    fn new(path: &Path) -> TempRegistration {
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            if let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) {
                // Leaked on purpose: a signal handler may read it at any
                // time, so it is never freed (one short path per output).
                TEMP_PATH.store(c.into_raw(), std::sync::atomic::Ordering::SeqCst);
            }
        }
        let _ = path;
        TempRegistration
    }
}

impl Drop for TempRegistration {
    fn drop(&mut self) {
        #[cfg(unix)]
        TEMP_PATH.store(std::ptr::null_mut(), std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(unix)]
extern "C" fn remove_temp_and_reraise(sig: libc::c_int) {
    let p = TEMP_PATH.load(std::sync::atomic::Ordering::SeqCst);
    // SAFETY: unlink, signal and raise are async-signal-safe; `p` is null or
    // a leaked, never-freed C string.
    unsafe {
        if !p.is_null() {
            libc::unlink(p);
        }
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

#[cfg(unix)]
extern "C" fn input_vanished(_sig: libc::c_int) {
    const MSG: &[u8] = b"kvpack: an input file shrank while it was being read \
(SIGBUS: another process truncated it); nothing was written\n";
    let p = TEMP_PATH.load(std::sync::atomic::Ordering::SeqCst);
    // SAFETY: write, unlink and _exit are async-signal-safe.
    unsafe {
        libc::write(2, MSG.as_ptr().cast(), MSG.len());
        if !p.is_null() {
            libc::unlink(p);
        }
        libc::_exit(3);
    }
}

/// Installs process-wide signal handlers for command-line use: SIGINT,
/// SIGTERM and SIGHUP remove the temporary output of a [`write_atomic`] in
/// progress and then end the process as the signal would (exit status
/// 128 + signal); SIGBUS (a mapped input truncated by another process)
/// removes it, prints a message and exits with status 3.
pub fn install_cleanup_handlers() {
    #[cfg(unix)]
    // SAFETY: the handlers only call async-signal-safe functions.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(
                sig,
                remove_temp_and_reraise as *const () as libc::sighandler_t,
            );
        }
        libc::signal(
            libc::SIGBUS,
            input_vanished as *const () as libc::sighandler_t,
        );
    }
}

/// True when `path` exists and is neither a regular file nor a
/// directory (a FIFO, a character or block device): outputs are written
/// into such a path directly, in order, instead of replacing it.
pub fn is_special(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Writes a file atomically: `fill` writes into a temporary file in the same
/// directory, which is flushed, synced and renamed over `path`, and the
/// directory is synced so that the rename itself survives a crash. Without
/// `force` an existing `path` is never replaced (checked before writing and
/// again by a no-clobber rename). An existing `path` that is not a regular
/// file (a FIFO, a character device such as `/dev/null`) is written into
/// directly instead of being replaced.
///
/// # Errors
/// [`Error::Parameter`] when `path` is an existing regular file and `force`
/// is false; [`Error::Io`] naming the path; any error of `fill` (the
/// temporary file is then removed and `path` untouched).
pub fn write_atomic(
    path: &Path,
    force: bool,
    fill: impl FnOnce(&mut (dyn Write + Send)) -> Result<()>,
) -> Result<()> {
    if is_special(path) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        fill(&mut w)?;
        return w
            .flush()
            .map_err(|e| Error::io(format!("writing {}", path.display()), e));
    }
    write_atomic_file(path, force, |f| {
        let mut w = BufWriter::with_capacity(1 << 20, f);
        fill(&mut w)?;
        w.flush()
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    })
}

/// Like [`write_atomic`] for a writer that needs the file itself
/// (positional writes from several threads, [`write_all_at`], or a length
/// set up front): `fill` gets the temporary file, which is then synced and
/// renamed over `path` (the directory synced too). `path` must be a regular
/// file or not exist (see [`is_special`]); the temporary file is removed on
/// an error, SIGINT, SIGTERM or SIGHUP.
///
/// # Errors
/// As [`write_atomic`]; [`Error::Parameter`] when `path` is a FIFO or
/// device.
pub fn write_atomic_file(
    path: &Path,
    force: bool,
    fill: impl FnOnce(&File) -> Result<()>,
) -> Result<()> {
    if is_special(path) {
        return Err(Error::param(format!(
            "{} is not a regular file; this output needs one",
            path.display()
        )));
    }
    check_writable(path, force)?;
    let dir = parent_dir(path);
    let mut builder = tempfile::Builder::new();
    builder.prefix(".kvpack-tmp-");
    // Created with mode 0666 minus the umask, like any new file (tempfile's
    // default 0600 would make outputs unreadable to other users).
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let tmp = builder
        .tempfile_in(dir)
        .map_err(|e| Error::io(format!("creating a temporary file in {}", dir.display()), e))?;
    let _registered = TempRegistration::new(tmp.path());
    fill(tmp.as_file())?;
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
    })?;
    sync_dir(dir)
}

/// Writes all of `buf` at byte `offset` of `f` without moving its cursor
/// (`pwrite`), so several threads can fill one file.
///
/// # Errors
/// The operating system's error (e.g. disk full).
pub fn write_all_at(f: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::write_all_at(f, buf, offset)
    }
    #[cfg(windows)]
    {
        let (mut buf, mut offset) = (buf, offset);
        while !buf.is_empty() {
            match std::os::windows::fs::FileExt::seek_write(f, buf, offset) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    buf = &buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Checks, before any work, that `path` can be created: it does not exist
/// (or `force`), and its directory exists and accepts a new file.
///
/// # Errors
/// [`Error::Parameter`] when `path` exists and `force` is false;
/// [`Error::Io`] when the directory is missing or not writable.
pub fn check_writable(path: &Path, force: bool) -> Result<()> {
    if let Ok(m) = std::fs::metadata(path)
        && !m.is_file()
        && !m.is_dir()
    {
        return Ok(()); // FIFO or device: written into directly
    }
    if !force && path.exists() {
        return Err(Error::param(format!(
            "{} exists; use --force to overwrite it",
            path.display()
        )));
    }
    let dir = parent_dir(path);
    tempfile::Builder::new()
        .prefix(".kvpack-check-")
        .tempfile_in(dir)
        .map(drop)
        .map_err(|e| Error::io(format!("creating a file in {}", dir.display()), e))
}

/// Makes a rename in `dir` durable (fsync of the directory).
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(format!("syncing directory {}", dir.display()), e))?;
    let _ = dir;
    Ok(())
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
/// (format/SPEC.md section 10): takes an exclusive lock against other
/// appenders, writes pages and index after the last complete commit (over
/// the torn tail of an earlier interrupted append, if any), syncs, writes
/// the trailer, syncs, then cuts what is left of a torn tail when no reader
/// holds the shared lock of [`lock_for_reading`]. A crash at any point
/// leaves a file that opens as the previous commit or the new one; a
/// refused append changes nothing.
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
    let mut reader = crate::format::Reader::open(&map)?;
    reader.set_private_pages(true);
    let committed = reader.committed_len();
    let torn = reader.torn_tail();
    // The torn tail of an earlier interrupted append is not truncated
    // first: the new commit is written over it, and what is left of it is
    // cut only after the new commit is durable. A refused or failed append
    // therefore changes no byte before the old commit's end, and leaves a
    // file that opens as before.
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
    let new_end = reader.header_len() + trailer.commit_end;
    let len = file
        .metadata()
        .map_err(|e| Error::io(format!("reading metadata of {name}"), e))?
        .len();
    if len > new_end {
        // Leftover bytes of the old torn tail after the new trailer: cut
        // them when no reader holds the file (they are harmless otherwise:
        // readers find the new trailer and report them as a torn tail).
        if record_lock(&file, true).unwrap_or(false) {
            file.set_len(new_end)
                .map_err(|e| Error::io(format!("removing the torn tail of {name}"), e))?;
            file.sync_data()
                .map_err(|e| Error::io(format!("syncing {name}"), e))?;
        }
    }
    Ok(AppendReport {
        report,
        generation: trailer.generation,
        torn_tail_removed: torn,
    })
}
