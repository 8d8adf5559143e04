//! The `kvpack` binary: exit codes, JSON output, refusing to clobber,
//! stdin/stdout, and clear errors for bad input.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;
use kvpack::cache::DType;

fn kvpack(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args(args)
        .output()
        .unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn write_cache(path: &Path, c: &kvpack::KvCache) {
    let mut f = std::fs::File::create(path).unwrap();
    kvpack::io::safetensors::write(c, &mut f).unwrap();
}

#[test]
fn compress_inspect_verify_decompress_on_the_fixture() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.kvpack");
    let o = kvpack(&[
        "compress",
        &fixture_path(),
        "--codec",
        "bdr128",
        "-o",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let j = json(&o);
    assert_eq!(j["codec"], "bdr128");
    let bpe = j["bits_per_element"].as_f64().unwrap();
    assert!(bpe > 4.25 && bpe <= 4.6, "bits/element {bpe}");

    let o = kvpack(&["inspect", out.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0);
    let j = json(&o);
    assert_eq!(j["bits_per_element"].as_f64().unwrap(), bpe);
    assert_eq!(j["layers"], 18);
    let tokens: Vec<u64> = j["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tokens"].as_u64().unwrap())
        .collect();
    assert!(tokens.contains(&511) && tokens.contains(&520), "{tokens:?}");
    assert_eq!(j["model"], "gemma-3-270m-q4_k_m");

    let o = kvpack(&[
        "verify",
        out.to_str().unwrap(),
        "--against",
        &fixture_path(),
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stdout));
    let j = json(&o);
    assert_eq!(j["ok"], true);
    assert_eq!(j["attention"].as_array().unwrap().len(), 18);
    assert!(j["summary"]["k_cosine"].as_f64().unwrap() > 0.99);

    // A threshold that cannot hold makes verify fail with exit 1.
    let o = kvpack(&[
        "verify",
        out.to_str().unwrap(),
        "--against",
        &fixture_path(),
        "--max-attn-err",
        "1e-9",
    ]);
    assert_eq!(code(&o), 1);

    let st = dir.path().join("back.safetensors");
    let o = kvpack(&[
        "decompress",
        out.to_str().unwrap(),
        "-o",
        st.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let back = kvpack::io::safetensors::parse(&std::fs::read(&st).unwrap(), "back").unwrap();
    let orig = fixture();
    assert_eq!(back.cache.tensors.len(), orig.cache.tensors.len());
    for (a, b) in back.cache.tensors.iter().zip(&orig.cache.tensors) {
        assert_eq!(
            (&a.info.name, a.info.shape(), a.info.dtype),
            (&b.info.name, b.info.shape(), b.info.dtype)
        );
    }
    assert_eq!(back.cache.token_ids, orig.cache.token_ids);
    assert_eq!(back.cache.metadata, orig.cache.metadata);
}

/// The fixture's absolute path (tests run from any directory).
fn fixture_path() -> String {
    repo(FIXTURE).display().to_string()
}

#[test]
fn existing_output_needs_force_and_is_not_touched() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.kvpack");
    std::fs::write(&out, b"precious").unwrap();
    let o = kvpack(&["compress", &fixture_path(), "-o", out.to_str().unwrap()]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
    let o = kvpack(&[
        "compress",
        &fixture_path(),
        "-o",
        out.to_str().unwrap(),
        "--force",
        "-q",
    ]);
    assert_eq!(code(&o), 0);
    assert_ne!(std::fs::read(&out).unwrap(), b"precious");
    // No temporary files are left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[test]
fn raw_round_trip_through_stdin_and_stdout_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("s.safetensors");
    let c = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 33,
            head_dim: 32,
        }],
        DType::F16,
        2,
    );
    write_cache(&src, &c);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args(["compress", "-", "--codec", "raw", "-o", "-", "-q"])
        .stdin(std::fs::File::open(&src).unwrap())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut packed = Vec::new();
    std::io::Read::read_to_end(child.stdout.as_mut().unwrap(), &mut packed).unwrap();
    assert!(child.wait().unwrap().success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpack"))
        .args(["decompress", "-", "-o", "-", "-q"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let w = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &packed).unwrap());
    let mut back = Vec::new();
    std::io::Read::read_to_end(child.stdout.as_mut().unwrap(), &mut back).unwrap();
    w.join().unwrap();
    assert!(child.wait().unwrap().success());
    let back = kvpack::io::safetensors::parse(&back, "stdout").unwrap();
    assert_eq!(back.cache.tensors, c.tensors);
}

#[test]
fn bad_input_gives_exit_2_and_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    // Unknown codec.
    let o = kvpack(&[
        "compress",
        &fixture_path(),
        "--codec",
        "zip9",
        "-o",
        &p("x"),
    ]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("unknown codec"), "{}", stderr(&o));
    // Missing file.
    let o = kvpack(&["inspect", &p("nope.kvpack")]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("nope.kvpack"));
    // Not a safetensors file.
    std::fs::write(p("junk"), b"not a tensor file at all").unwrap();
    let o = kvpack(&["compress", &p("junk"), "-o", &p("j.kvpack")]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("safetensors"), "{}", stderr(&o));
    // Head_dim that bdr64 cannot divide names the largest valid block.
    let c = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 1,
            tokens: 5,
            head_dim: 96,
        }],
        DType::Bf16,
        2,
    );
    write_cache(Path::new(&p("hd96.safetensors")), &c);
    let o = kvpack(&[
        "compress",
        &p("hd96.safetensors"),
        "--codec",
        "bdr64",
        "-o",
        &p("h.kvpack"),
    ]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("bdr32"), "{}", stderr(&o));
    assert!(!Path::new(&p("h.kvpack")).exists());
    // Misnamed tensors.
    let mut c2 = c.clone();
    c2.tensors[1].info.name = "past_key_values.0.val".into();
    write_cache(Path::new(&p("bad.safetensors")), &c2);
    let o = kvpack(&["compress", &p("bad.safetensors"), "-o", &p("b.kvpack")]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains("past_key_values.0.val"),
        "{}",
        stderr(&o)
    );
    // K present, V missing.
    let mut c3 = c.clone();
    c3.tensors.pop();
    write_cache(Path::new(&p("nov.safetensors")), &c3);
    let o = kvpack(&["compress", &p("nov.safetensors"), "-o", &p("n.kvpack")]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains("past_key_values.0.value is missing"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn verify_reports_corruption_with_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.kvpack");
    assert_eq!(
        code(&kvpack(&[
            "compress",
            &fixture_path(),
            "--codec",
            "int4",
            "-o",
            out.to_str().unwrap(),
            "-q"
        ])),
        0
    );
    let mut b = std::fs::read(&out).unwrap();
    let n = b.len();
    b[n / 2] ^= 4;
    std::fs::write(&out, &b).unwrap();
    let o = kvpack(&["verify", out.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 1);
    let j = json(&o);
    assert_eq!(j["ok"], false);
    assert!(j["problems"][0].as_str().unwrap().contains("page #"), "{j}");
    // Other commands refuse the file with exit 2.
    assert_eq!(
        code(&kvpack(&[
            "decompress",
            out.to_str().unwrap(),
            "-o",
            dir.path().join("x").to_str().unwrap()
        ])),
        2
    );
}

#[test]
fn codecs_lists_bits_per_element() {
    let o = kvpack(&["codecs", "--json"]);
    assert_eq!(code(&o), 0);
    let j = json(&o);
    let bdr = j["examples"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "bdr128")
        .unwrap()
        .clone();
    assert_eq!(bdr["bits_per_element_d128"].as_f64().unwrap(), 4.5);
    assert_eq!(bdr["bits_per_element_d256"].as_f64().unwrap(), 4.25);
    let o = kvpack(&["--help"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("Exit status"));
}

/// Issue 12 section 3: `verify --against` has a default quality floor, so
/// a file that decodes to something unrelated to the original (here: the
/// fixture negated, cosine -1) fails without any flag, while a real codec
/// passes.
#[test]
fn verify_against_fails_garbage_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let mut neg = fixture().cache;
    for t in &mut neg.tensors {
        let v: Vec<f32> = t.data.to_f32().iter().map(|x| -x).collect();
        t.data = kvpack::cache::TensorData::F32(v);
        t.info.dtype = DType::F32;
    }
    let negp = dir.path().join("neg.safetensors");
    write_cache(&negp, &neg);
    let bad = dir.path().join("bad.kvpack");
    let o = kvpack(&[
        "compress",
        negp.to_str().unwrap(),
        "-c",
        "raw",
        "-o",
        bad.to_str().unwrap(),
        "-q",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let fx = repo(FIXTURE);
    let o = kvpack(&[
        "verify",
        bad.to_str().unwrap(),
        "--against",
        fx.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 1, "{}", String::from_utf8_lossy(&o.stdout));
    assert!(String::from_utf8_lossy(&o.stdout).contains("cosine"));
    let good = dir.path().join("good.kvpack");
    let o = kvpack(&[
        "compress",
        fx.to_str().unwrap(),
        "-c",
        "int2",
        "-o",
        good.to_str().unwrap(),
        "-q",
    ]);
    assert_eq!(code(&o), 0);
    let o = kvpack(&[
        "verify",
        good.to_str().unwrap(),
        "--against",
        fx.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stdout));
}

/// Issue 12 section 5: Gemma's sliding layers hold positions 9..519 of the
/// fixture's 520-token prefill, so a prompt matching only part of the
/// prefix cannot be served (match used to say 300); the whole prefix can.
#[test]
fn match_accounts_for_rolled_sliding_windows() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.kvpack");
    let fx = repo(FIXTURE);
    let o = kvpack(&[
        "compress",
        fx.to_str().unwrap(),
        "-c",
        "int4",
        "-o",
        out.to_str().unwrap(),
        "-q",
    ]);
    assert_eq!(code(&o), 0);
    let cache = fixture().cache;
    let model = cache.metadata["kvpack.model"].clone();
    let ids = cache.token_ids.clone();
    let run = |prompt: &[u32]| {
        let o = kvpack(&[
            "match",
            out.to_str().unwrap(),
            "--model",
            &model,
            "--tokens",
            &serde_json::to_string(prompt).unwrap(),
            "--json",
        ]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        json(&o)
    };
    let part = run(&ids[..300]);
    assert_eq!(part["matching_prefix"], 300);
    assert_eq!(part["usable_prefix"], 0);
    assert!(part["reason"].as_str().unwrap().contains("rolled"));
    let rolled = part["rolled_layers"].as_array().unwrap();
    assert_eq!(rolled.len(), 15);
    assert_eq!(rolled[0]["holds"], serde_json::json!([9, 520]));
    let mut longer = ids.clone();
    longer.extend([1, 2, 3]);
    let whole = run(&longer);
    assert_eq!(whole["usable_prefix"], 520);
    assert!(whole["reason"].is_null());
}

/// `kvpack eval --plot`: the rate-distortion report is drawn, its JSON
/// carries the uniform codecs and the planner's budgets, and an existing
/// plot is not replaced without --force. On a machine without a TrueType
/// font the command must refuse with exit 2, say how to fix it, and write
/// nothing.
#[test]
fn eval_plot_draws_the_rate_distortion_report() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("rd.svg");
    let svg_s = svg.to_str().unwrap();
    let fx = fixture_path();
    let o = kvpack(&["eval", &fx, "-c", "int4", "--plot", svg_s, "--json"]);
    if stderr(&o).contains("no TrueType font") {
        assert_eq!(code(&o), 2, "{}", stderr(&o));
        assert!(stderr(&o).contains("KVPACK_FONT"), "{}", stderr(&o));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        eprintln!("no system font: checked the refusal only");
        return;
    }
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let plans = v["planner"].as_array().unwrap();
    assert!(plans.len() >= 5, "{v}");
    assert!(!v["uniform"].as_array().unwrap().is_empty(), "{v}");
    // Every planned point keeps its budget, everything counted.
    for p in plans {
        let (b, got) = (p["budget"].as_f64().unwrap(), p["bits"].as_f64().unwrap());
        assert!(got <= b + 1e-9, "{p}");
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg") && text.len() > 2000, "{}", text.len());
    // Only the plot is left behind: no scratch files.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    let o = kvpack(&["eval", &fx, "-c", "int4", "--plot", svg_s]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
}

/// `--key-codec`: keys (K) coded by one codec and values (V) by `--codec`,
/// both with the given windows. Oracle: each kind decodes exactly as the
/// same kind of a file coded by its codec alone with the same windows;
/// `inspect` names both; `--key-codec` with `--bits` and an unknown key
/// codec are usage errors (exit 2).
#[test]
fn key_codec_splits_keys_and_values() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let fx = fixture_path();
    let compress = |out: &str, extra: &[&str]| {
        let mut args = vec!["compress", fx.as_str(), "--sink", "1", "--recent", "0"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-o", out, "-q"]);
        let o = kvpack(&args);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    };
    compress(
        &p("split.kvpack"),
        &["--key-codec", "hqmq:s24r3+ctr", "--codec", "int4"],
    );
    compress(&p("k.kvpack"), &["--codec", "hqmq:s24r3+ctr"]);
    compress(&p("v.kvpack"), &["--codec", "int4"]);
    let decode = |f: &str| {
        let o = kvpack(&[
            "decompress",
            &p(f),
            "--dtype",
            "fp32",
            "-o",
            &p(&format!("{f}.st")),
            "-q",
        ]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let bytes = std::fs::read(p(&format!("{f}.st"))).unwrap();
        kvpack::io::safetensors::parse(&bytes, f).unwrap().cache
    };
    let (split, k, v) = (
        decode("split.kvpack"),
        decode("k.kvpack"),
        decode("v.kvpack"),
    );
    let mut kinds = [0, 0];
    for ((s, k), v) in split.tensors.iter().zip(&k.tensors).zip(&v.tensors) {
        let want = if s.info.kind == kvpack::cache::Kind::Key {
            k
        } else {
            v
        };
        assert_eq!(s.info.name, want.info.name);
        assert!(
            s.data == want.data,
            "{}: decoded values differ",
            s.info.name
        );
        kinds[usize::from(s.info.kind == kvpack::cache::Kind::Key)] += 1;
    }
    assert!(kinds[0] > 0 && kinds[1] > 0, "{kinds:?}");
    let o = kvpack(&["inspect", &p("split.kvpack"), "--json"]);
    let j = json(&o);
    let names: Vec<&str> = j["codecs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"hqmq:s24r3+ctr") && names.contains(&"int4"),
        "{names:?}"
    );
    for args in [
        &["--key-codec", "hqmq:s24r3+ctr", "--bits", "3.25"][..],
        &["--key-codec", "hqmq:s24r3+nope"][..],
    ] {
        let mut a = vec!["compress", fx.as_str()];
        a.extend_from_slice(args);
        let out = p("bad.kvpack");
        a.extend_from_slice(&["-o", out.as_str()]);
        let o = kvpack(&a);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(!dir.path().join("bad.kvpack").exists());
    }
}

/// A cache whose head_dim (96) neither bdr128 nor TurboQuant's
/// Walsh-Hadamard transform takes: `eval` compares int4 with the bdr
/// block that fits (bdr32) by default, and `compress --bits` plans with
/// the candidates that accept the shape. Real rows: the fixture's, cut to
/// their first 96 channels.
#[test]
fn eval_and_bits_fit_a_head_dim_of_96() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(fixture_path()).unwrap();
    let mut cache = kvpack::io::safetensors::parse(&bytes, "fixture")
        .unwrap()
        .cache;
    for t in &mut cache.tensors {
        let full = t.info.head_dim as usize;
        let kvpack::TensorData::Bf16(v) = &t.data else {
            panic!("bf16 fixture")
        };
        let cut: Vec<_> = v
            .chunks_exact(full)
            .flat_map(|r| r[..96].to_vec())
            .collect();
        let mut info = t.info.clone();
        info.head_dim = 96;
        *t = kvpack::Tensor::new(info, kvpack::TensorData::Bf16(cut)).unwrap();
    }
    let src = dir.path().join("hd96.safetensors");
    write_cache(&src, &cache);
    let src = src.to_str().unwrap();
    let o = kvpack(&["eval", src, "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let codecs: Vec<String> = json(&o)
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["codec"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(codecs, ["int4", "bdr32"]);
    let out = dir.path().join("p.kvpack");
    let o = kvpack(&[
        "compress",
        src,
        "--bits",
        "3.5",
        "-o",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(json(&o)["bits_per_element"].as_f64().unwrap() <= 3.5);
    let o = kvpack(&["verify", out.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// `verify --against` of a lossless (`raw`) file of a cache holding
/// infinities and NaN: bit-identical, so it passes although its cosine is
/// NaN; `--max-attn-err` without queries to measure it on fails.
#[test]
fn verify_passes_a_bit_identical_tensor_holding_non_finite_values() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = synthetic(
        &[LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 20,
            head_dim: 64,
        }],
        DType::F32,
        3,
    );
    if let kvpack::TensorData::F32(v) = &mut c.tensors[0].data {
        v[..64].fill(f32::INFINITY);
        v[70] = f32::NAN;
    }
    let src = dir.path().join("inf.safetensors");
    write_cache(&src, &c);
    let out = dir.path().join("inf.kvpack");
    let (src, out) = (src.to_str().unwrap(), out.to_str().unwrap());
    let o = kvpack(&["compress", src, "--codec", "raw", "-o", out, "-q"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = kvpack(&["verify", out, "--against", src, "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // An attention floor on a cache without queries measures nothing: a
    // failure that says so, not a silent pass.
    let o = kvpack(&["verify", out, "--against", src, "--max-attn-err", "0.5"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &stderr(&o);
    assert!(text.contains("no attention error was measured"), "{text}");
}

/// An I/O error names what was being done and the OS error, once.
#[test]
fn io_errors_print_the_os_error_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.kvpack");
    let o = kvpack(&["inspect", missing.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o)); // a missing input: bad input
    let e = stderr(&o);
    assert!(e.contains("missing.kvpack"), "{e}");
    assert_eq!(e.matches("os error 2").count(), 1, "{e}");
}
