//! On-disk cache of the PTX that NVRTC compiles from the kernel sources.
//!
//! Compiling every kernel family takes NVRTC about two minutes on a server
//! CPU (the affine family alone about 20 s), paid by every process on its
//! first use of a family. The PTX depends only on the source text, the
//! compile options and the NVRTC version, so it is kept in a cache
//! directory under a SHA-256 of those three and reused by later processes
//! (the driver then caches the PTX-to-SASS step itself).
//!
//! Directory: `$KVPACK_PTX_CACHE` when set (an empty value or `0` turns the
//! cache off), else `$XDG_CACHE_HOME/kvpack/ptx`, else
//! `$HOME/.cache/kvpack/ptx`. The cache is best effort: a directory that
//! cannot be created or written, or an entry that is unreadable, truncated
//! or written for another key, falls back to compiling (entries are written
//! to a temporary file and renamed into place, so readers never see half an
//! entry). Device independent, no CUDA needed: the backend passes the
//! compiler in as a closure.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// First line of every entry, followed by the entry's full key (hex).
const MAGIC: &str = "// kvpack ptx cache v1 ";

/// The cache directory, or `None` when caching is off or no home is known.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn dir() -> Option<PathBuf> {
    dir_from(|k| std::env::var_os(k))
}

fn dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    if let Some(v) = var("KVPACK_PTX_CACHE") {
        return (!v.is_empty() && v != "0").then(|| PathBuf::from(v));
    }
    if let Some(x) = var("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("kvpack").join("ptx"));
    }
    var("HOME")
        .filter(|v| !v.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("kvpack").join("ptx"))
}

/// The key of one compilation: SHA-256 (hex) over the compiler identity
/// (e.g. the NVRTC version), the options and the source text, each
/// length-prefixed.
pub(crate) fn key(compiler: &str, options: &[String], source: &str) -> String {
    let mut h = Sha256::new();
    let mut part = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(compiler.as_bytes());
    for o in options {
        part(o.as_bytes());
    }
    part(source.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn entry(dir: &Path, name: &str, key: &str) -> PathBuf {
    dir.join(format!("{name}-{}.ptx", &key[..16]))
}

/// The cached PTX of `name` under `key` in `dir`, if a complete entry for
/// exactly that key is there.
pub(crate) fn load(dir: &Path, name: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(entry(dir, name, key)).ok()?;
    let (first, rest) = text.split_once('\n')?;
    (first.strip_prefix(MAGIC)? == key && rest.contains(".entry")).then(|| rest.to_string())
}

/// Stores `ptx` for `name` under `key` in `dir` (atomically: a temporary
/// file renamed into place). Errors are ignored: the cache is an
/// optimisation.
pub(crate) fn store(dir: &Path, name: &str, key: &str, ptx: &str) {
    let _ = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut tmp = tempfile::Builder::new()
            .prefix(".kvpack-ptx-")
            .tempfile_in(dir)?;
        tmp.write_all(MAGIC.as_bytes())?;
        tmp.write_all(key.as_bytes())?;
        tmp.write_all(b"\n")?;
        tmp.write_all(ptx.as_bytes())?;
        tmp.as_file().sync_all()?;
        tmp.persist(entry(dir, name, key)).map_err(|e| e.error)?;
        Ok(())
    })();
}

/// Removes the entry of `name` under `key` (one the driver refused).
pub(crate) fn forget(dir: &Path, name: &str, key: &str) {
    let _ = std::fs::remove_file(entry(dir, name, key));
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = ".version 9.0\n.target sm_90\n.visible .entry k()\n{\n ret;\n}\n";

    #[test]
    fn stores_and_loads_by_key_and_refuses_other_keys_and_torn_entries() {
        let d = tempfile::tempdir().unwrap();
        let k1 = key("nvrtc 13.0", &["--opt".into()], "src");
        let k2 = key("nvrtc 13.1", &["--opt".into()], "src");
        assert_ne!(k1, k2);
        assert_ne!(k1, key("nvrtc 13.0", &["--opt".into()], "src2"));
        // Length prefixes: moving a byte between parts changes the key.
        assert_ne!(key("a", &["bc".into()], ""), key("ab", &["c".into()], ""));
        assert_eq!(load(d.path(), "affine", &k1), None);
        store(d.path(), "affine", &k1, PTX);
        assert_eq!(load(d.path(), "affine", &k1).as_deref(), Some(PTX));
        assert_eq!(load(d.path(), "affine", &k2), None);
        // A torn entry (cut inside the PTX) or another key's header is a miss.
        let p = entry(d.path(), "affine", &k1);
        let full = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, &full[..full.find(".entry").unwrap()]).unwrap();
        assert_eq!(load(d.path(), "affine", &k1), None);
        std::fs::write(&p, full.replacen(&k1, &k2, 1)).unwrap();
        assert_eq!(load(d.path(), "affine", &k1), None);
        forget(d.path(), "affine", &k1);
        assert!(!p.exists());
        // Only the entry is left: no temporary files.
        store(d.path(), "raw", &k2, PTX);
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![format!("raw-{}.ptx", &k2[..16])]);
    }

    #[test]
    fn directory_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        assert_eq!(
            dir_from(env(&[("KVPACK_PTX_CACHE", "0"), ("HOME", "/h")])),
            None
        );
        assert_eq!(dir_from(env(&[("KVPACK_PTX_CACHE", "")])), None);
        assert_eq!(
            dir_from(env(&[("KVPACK_PTX_CACHE", "/c"), ("HOME", "/h")])),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            dir_from(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/kvpack/ptx"))
        );
        assert_eq!(
            dir_from(env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/kvpack/ptx"))
        );
        assert_eq!(dir_from(env(&[])), None);
    }
}
