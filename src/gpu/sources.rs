//! The CUDA C sources of the GPU kernels (`src/gpu/kernels/*.cu`), embedded
//! in the binary and compiled at run time by NVRTC (see [`super`]).
//!
//! This module is available with and without the `cuda` feature, so the
//! CPU-only test suite can check that every kernel a launcher asks for is
//! defined in the sources.

/// Definitions shared by every source (`kernels/common.cuh`): integer
/// typedefs, the page descriptor structs, bf16/f16 conversions, the
/// Walsh-Hadamard butterflies. Prepended to each source before compiling.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// One kernel source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source {
    /// Module name (`raw`, `affine`, `copy`, ...); also the file stem.
    pub name: &'static str,
    /// The CUDA C text of `kernels/<name>.cu`.
    pub code: &'static str,
}

/// The device-to-device copy kernel (the bandwidth ceiling).
pub const COPY: Source = Source {
    name: "copy",
    code: include_str!("kernels/copy.cu"),
};

/// Decode and encode kernels of the `raw` codec.
pub const RAW: Source = Source {
    name: "raw",
    code: include_str!("kernels/raw.cu"),
};

/// Decode and encode kernels of the `int{b}` and `bdr{h}` codecs.
pub const AFFINE: Source = Source {
    name: "affine",
    code: include_str!("kernels/affine.cu"),
};

/// Decode kernels of `kivi` and of the value groups of `octopus` / `turbo`.
pub const KIVI: Source = Source {
    name: "kivi",
    code: include_str!("kernels/kivi.cu"),
};

/// Decode kernels of `innerq`.
pub const INNERQ: Source = Source {
    name: "innerq",
    code: include_str!("kernels/innerq.cu"),
};

/// Decode kernels of `polar` key pages.
pub const POLAR: Source = Source {
    name: "polar",
    code: include_str!("kernels/polar.cu"),
};

/// Decode kernels of `octopus` and `turbo` coded pages.
pub const SPHERE: Source = Source {
    name: "sphere",
    code: include_str!("kernels/sphere.cu"),
};

/// Decode kernels of `hqmq`.
pub const HQMQ: Source = Source {
    name: "hqmq",
    code: include_str!("kernels/hqmq.cu"),
};

/// Encode kernels of `hqmq` (with and without outlier extraction), and the
/// builder of their cell index.
pub const HQMQ_ENC: Source = Source {
    name: "hqmq_enc",
    code: include_str!("kernels/hqmq_enc.cu"),
};

/// Encode kernels of `kivi` and `innerq` (and InnerQ's key statistics).
pub const GROUP_ENC: Source = Source {
    name: "group_enc",
    code: include_str!("kernels/group_enc.cu"),
};

/// Encode kernels of `polar` key pages.
pub const POLAR_ENC: Source = Source {
    name: "polar_enc",
    code: include_str!("kernels/polar_enc.cu"),
};

/// Encode kernels of `octopus` and `turbo` unit-coded pages.
pub const SPHERE_ENC: Source = Source {
    name: "sphere_enc",
    code: include_str!("kernels/sphere_enc.cu"),
};

/// Page frames on the device: copies into a file, CRC-32 of spans, and the
/// CRC fields of page headers, index entries and the index header
/// (`gpu::frame`).
pub const FRAME: Source = Source {
    name: "frame",
    code: include_str!("kernels/frame.cu"),
};

/// Every kernel source.
pub const ALL: [Source; 13] = [
    COPY, RAW, AFFINE, KIVI, INNERQ, POLAR, SPHERE, HQMQ, HQMQ_ENC, GROUP_ENC, POLAR_ENC,
    SPHERE_ENC, FRAME,
];

impl Source {
    /// The text handed to NVRTC: [`COMMON`], then this source with a
    /// `#line` directive so compiler messages name the right file and line.
    pub fn full_text(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", self.name, self.code)
    }

    /// Names of the `extern "C" __global__` functions this source defines,
    /// in order of appearance.
    pub fn kernel_names(&self) -> Vec<String> {
        kernel_names(self.code)
    }
}

/// Names of the `extern "C" __global__` functions defined in CUDA C text
/// (after an optional `__launch_bounds__(...)`), skipping `//` comments.
pub fn kernel_names(code: &str) -> Vec<String> {
    let text: String = code
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let marker = "extern \"C\"";
    let mut rest = text.as_str();
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let mut words = rest.split_whitespace();
        if words.next() != Some("__global__") {
            continue;
        }
        // Skip `void` and an optional `__launch_bounds__(N)`.
        let after = rest
            .trim_start()
            .trim_start_matches("__global__")
            .trim_start();
        let after = after.trim_start_matches("void").trim_start();
        let after = match after.strip_prefix("__launch_bounds__") {
            Some(a) => a.split_once(')').map(|(_, r)| r).unwrap_or("").trim_start(),
            None => after,
        };
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && after[name.len()..].trim_start().starts_with('(') {
            out.push(name);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_names() {
        let code = "// extern \"C\" __global__ void commented(int)\n\
                    extern \"C\" __global__ void __launch_bounds__(BLOCK)\n    foo_bf16(int a) {}\n\
                    extern \"C\" __global__ void bar(int a) {}\n\
                    extern \"C\" int not_a_kernel(void);";
        assert_eq!(kernel_names(code), ["foo_bf16", "bar"]);
    }

    #[test]
    fn every_source_defines_kernels() {
        for s in ALL {
            let names = s.kernel_names();
            assert!(!names.is_empty(), "{}", s.name);
            let mut sorted = names.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), names.len(), "duplicate kernel in {}", s.name);
        }
        assert!(COMMON.contains("struct PageDesc"));
    }
}
