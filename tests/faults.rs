//! Faults around the CLI (issue 12 sections 2 and 3): a signal during
//! `compress` leaves no temporary file and no output; a FIFO named by -o is
//! written into; readers and appenders follow the lock contract.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn temps(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".kvpack-tmp-"))
        .collect()
}

#[test]
fn sigterm_or_sigint_during_compress_removes_the_temporary_output() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c.kvpack");
        // A slow codec so that the signal arrives while pages are written.
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvpack"))
            .args([
                "compress",
                repo(FIXTURE).to_str().unwrap(),
                "-c",
                "hqmq:s96r4+med3",
                "-o",
                out.to_str().unwrap(),
                "-q",
                "--threads",
                "1",
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while temps(dir.path()).is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no temporary file appeared"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "compress ended before the signal"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        let st = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(st.signal(), Some(sig), "{st:?}");
        assert!(
            temps(dir.path()).is_empty(),
            "temporary left: {:?}",
            temps(dir.path())
        );
        assert!(!out.exists());
    }
}

#[test]
fn output_to_a_fifo_is_written_into_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: plain mkfifo on a path in our temporary directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let o = Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args([
            "compress",
            repo(FIXTURE).to_str().unwrap(),
            "-c",
            "int4",
            "-o",
            fifo.to_str().unwrap(),
            "-q",
        ])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let got = reader.join().unwrap();
    assert_eq!(
        got,
        compress_bytes(&fixture().cache, "int4", Default::default(), None)
    );
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
}

/// The concurrency contract (format/SPEC.md 10.3): a reader's shared
/// record lock keeps `append` from cutting a torn tail under it (the new
/// commit is still written and read back), the cut happens once no reader
/// holds the file, and a second appender is refused while one holds the
/// file lock. (Linux: OFD locks conflict between two descriptors of one
/// process, which lets one test process play both sides.)
#[cfg(target_os = "linux")]
#[test]
fn readers_keep_append_from_cutting_a_torn_tail_and_appenders_exclude_each_other() {
    use kvpack::DType;
    use kvpack::compress::CompressOptions;
    use kvpack::io::file;
    let spec = |tokens| common::LayerSpec {
        batch: 1,
        heads: 2,
        tokens,
        head_dim: 64,
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.kvpack");
    let base = common::synthetic(&[spec(64); 2], DType::Bf16, 5);
    let bytes = common::compress_bytes(&base, "int8", kvpack::plan::Layout::default(), None);
    // A torn tail of an interrupted append: 1 MiB of zeros after the commit.
    let committed = bytes.len() as u64;
    let mut torn = bytes.clone();
    torn.resize(bytes.len() + (1 << 20), 0);
    std::fs::write(&path, &torn).unwrap();
    let opts = CompressOptions::default();
    let append = |tokens| {
        let longer = common::synthetic(&[spec(tokens); 2], DType::Bf16, 5);
        file::append_file(&path, &longer, true, &opts, &|_| {})
    };
    let committed_len = || {
        let b = std::fs::read(&path).unwrap();
        let r = kvpack::format::Reader::open(&b).unwrap();
        (r.committed_len(), r.torn_tail(), r.index().generation)
    };

    // A reader holds the file: the append commits, the leftover tail stays.
    let reader = std::fs::File::open(&path).unwrap();
    file::lock_for_reading(&reader).unwrap();
    let r = append(80).unwrap();
    assert_eq!(r.generation, 1);
    let (end, tail, generation) = committed_len();
    assert_eq!(generation, 1);
    assert!(end > committed);
    assert_eq!(
        end + tail,
        committed + (1 << 20),
        "the tail was cut under a reader"
    );

    // Another appender holds the file lock: refused, nothing changes.
    let other = std::fs::File::open(&path).unwrap();
    other.try_lock().unwrap();
    let before = std::fs::read(&path).unwrap();
    let e = append(96).unwrap_err().to_string();
    assert!(e.contains("another process is appending"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
    drop(other);

    // The reader is gone: the next append cuts what is left of the tail.
    drop(reader);
    let r = append(96).unwrap();
    assert_eq!(r.generation, 2);
    let (end, tail, _) = committed_len();
    assert_eq!(tail, 0);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), end);
}
