//! Faults around the CLI (issue 12 sections 2 and 3): a signal during
//! `compress` leaves no temporary file and no output; a FIFO named by -o is
//! written into.

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
