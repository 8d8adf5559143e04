//! A SIMT emulator for kvpack's CUDA kernels: runs the kernel sources of
//! [`super::sources`] on the CPU, compiled as host C++ (g++) with a small
//! runtime (`emu_runtime.h`, `emu_main.h`) in which every CUDA thread of a
//! block is a fiber and `__syncthreads` / warp shuffles are barriers. It
//! executes the very plans the CUDA backend launches (descriptors, work
//! lists, side tables; [`super::spec`], [`super::encplan`], `gpu::family`) over a "device
//! memory" file mapped at a fixed address, so kernel logic and indexing can
//! be checked against the CPU codecs on machines without a GPU. Not fast
//! (fibers), not a performance model, and not a substitute for running on
//! a GPU: memory ordering, timing and resource limits are not emulated.
//!
//! Built with or without the `cuda` feature (it shares the device-independent
//! planning of `gpu::decplan` with CUDA); [`Emulator::new`] needs `g++` on the PATH
//! (else [`Error::Unsupported`]). Binaries are cached per source text in
//! the temporary directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::Digest;

use super::backend::{
    Backend, Launch, check_encode_status, place_decode, place_encode, place_pages,
};
use super::decplan::{Args, PagedImage, Staged, check_status, group_args, stage_page};
use super::encplan::{EncodedBodies, Place};
use super::paged::{self, PagedLayout, PagedShape};
use super::spec::{DstSpec, KernelOptions};
use super::{HostLayout, OutType, POISON, host, sources};
use crate::cache::{Kind, Tensor, TensorData};
use crate::codec::Codec;
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::format::Section;
use crate::plan::PlannedPage;

/// Address at which the emulated device memory is mapped.
const BASE: u64 = 0x2000_0000_0000;
/// Alignment of every buffer in the emulated device memory.
const ALIGN: usize = 256;

const RUNTIME: &str = include_str!("emu_runtime.h");
const MAIN: &str = include_str!("emu_main.h");

/// The emulated device memory: one byte vector, addresses `BASE + offset`.
struct Arena {
    bytes: Vec<u8>,
}

impl Arena {
    /// Places `b` (aligned); returns its address.
    fn place(&mut self, b: &[u8]) -> u64 {
        self.bytes
            .resize(self.bytes.len().next_multiple_of(ALIGN), 0);
        let at = self.bytes.len();
        self.bytes.extend_from_slice(b);
        BASE + at as u64
    }

    /// Places `len` zero bytes (aligned); returns their address.
    fn zeroed(&mut self, len: usize) -> u64 {
        let at = self.bytes.len().next_multiple_of(ALIGN);
        self.bytes.resize(at + len, 0);
        BASE + at as u64
    }

    fn at(&self, addr: u64, len: usize) -> &[u8] {
        let o = (addr - BASE) as usize;
        &self.bytes[o..o + len]
    }
}

/// Runs kvpack's CUDA kernels on the CPU (module docs).
#[derive(Debug, Clone)]
pub struct Emulator {
    dir: PathBuf,
    options: KernelOptions,
}

impl Emulator {
    /// An emulator caching its binaries under the temporary directory.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when `g++` cannot be run.
    pub fn new() -> Result<Emulator> {
        let ok = Command::new("g++")
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            return Err(Error::Unsupported(
                "the SIMT emulator needs g++ (a C++17 compiler) on the PATH".into(),
            ));
        }
        let dir = std::env::temp_dir().join("kvpack-emu");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(dir.display().to_string(), e))?;
        Ok(Emulator {
            dir,
            options: KernelOptions::default(),
        })
    }

    /// This emulator choosing kernels with `options` (benchmark knobs;
    /// results are identical).
    pub fn with_kernel_options(&self, options: KernelOptions) -> Emulator {
        Emulator {
            options,
            ..self.clone()
        }
    }

    /// The emulator binary of kernel source `name` (compiled on first use).
    fn binary(&self, name: &str) -> Result<PathBuf> {
        let src = sources::ALL
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::param(format!("internal: no kernel source {name:?}")))?;
        let table: String = src
            .kernel_names()
            .iter()
            .map(|n| format!("    {{\"{n}\", (void*)&{n}}},\n"))
            .collect();
        let text = format!(
            "{RUNTIME}\n{}\n#line 1 \"{name}.cu\"\n{}\n\
             struct EmuKernel {{ const char* name; void* fn; }};\n\
             static const EmuKernel emu_kernels[] = {{\n{table}    {{nullptr, nullptr}}\n}};\n{MAIN}",
            sources::COMMON,
            src.code
        );
        let hash: String = sha2::Sha256::digest(text.as_bytes())[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let bin = self.dir.join(format!("{name}-{hash}"));
        if bin.exists() {
            return Ok(bin);
        }
        let io = |p: &Path| {
            let p = p.display().to_string();
            move |e| Error::io(p, e)
        };
        let work = tempfile::Builder::new()
            .prefix(&format!("{name}-build"))
            .tempdir_in(&self.dir)
            .map_err(io(&self.dir))?;
        let cpp = work.path().join(format!("{name}.cpp"));
        std::fs::write(&cpp, &text).map_err(io(&cpp))?;
        let out = work.path().join("emu");
        let o = Command::new("g++")
            .args([
                "-std=c++17",
                "-O1",
                "-ffp-contract=off",
                "-fno-strict-aliasing",
                "-w",
                "-o",
            ])
            .arg(&out)
            .arg(&cpp)
            .output()
            .map_err(io(Path::new("g++")))?;
        if !o.status.success() {
            return Err(Error::device(
                format!("g++ compiling the emulator of {name}.cu"),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            ));
        }
        std::fs::rename(&out, &bin).map_err(io(&bin))?;
        Ok(bin)
    }

    /// Runs `launches` over `arena` (in place), grouped by source module.
    fn run(&self, arena: &mut Arena, launches: &[Launch]) -> Result<()> {
        let mut by_source: BTreeMap<&str, String> = BTreeMap::new();
        for l in launches {
            if l.blocks == 0 {
                continue;
            }
            let a = &l.args;
            let (shape, extra) = match (a.bits, a.h, a.c) {
                (None, None, None) => (0, String::new()),
                (Some(b), None, None) => (1, format!("{b:x} ")),
                (None, Some(h), Some(c)) => (2, format!("{h:x} {:x} ", c.to_bits())),
                (Some(b), Some(h), Some(c)) => (3, format!("{b:x} {h:x} {:x} ", c.to_bits())),
                _ => return Err(Error::param("internal: unsupported kernel argument shape")),
            };
            let line = format!(
                "{} {} {} {} {shape} {:x} {:x} {extra}{:x}\n",
                l.kernel.name,
                l.blocks,
                l.kernel.grid.threads(),
                l.kernel.shared,
                l.descs,
                l.work,
                a.status
            );
            by_source
                .entry(l.kernel.source)
                .or_default()
                .push_str(&line);
        }
        let dir = tempfile::tempdir_in(&self.dir).map_err(|e| Error::io("emulator run", e))?;
        let file = dir.path().join("arena");
        std::fs::write(&file, &arena.bytes).map_err(|e| Error::io("emulator arena", e))?;
        for (source, lines) in by_source {
            let bin = self.binary(source)?;
            let lf = dir.path().join(format!("{source}.launches"));
            std::fs::write(&lf, lines).map_err(|e| Error::io("emulator launches", e))?;
            let o = Command::new(&bin)
                .arg(&file)
                .arg(format!("{BASE:x}"))
                .arg(&lf)
                .output()
                .map_err(|e| Error::io(bin.display().to_string(), e))?;
            if !o.status.success() {
                return Err(Error::device(
                    format!("emulator of {source}.cu"),
                    String::from_utf8_lossy(&o.stderr).into_owned(),
                ));
            }
        }
        arena.bytes = std::fs::read(&file).map_err(|e| Error::io("emulator arena", e))?;
        Ok(())
    }

    /// [`super::Device::decode_tensor`] through the emulated kernels.
    ///
    /// # Errors
    /// As [`super::Device::decode_tensor`], and [`Error::Device`] (or [`Error::Io`] for its files) when the
    /// emulator cannot be built or fails.
    pub fn decode_tensor(
        &self,
        archive: &Archive<'_>,
        tensor: usize,
        out: OutType,
        layout: &HostLayout,
    ) -> Result<Vec<u16>> {
        let info = host::tensor_info(archive, tensor)?;
        let len = host::layout_len(&info, layout)?;
        let (lo, hi) = host::token_range(&info, layout);
        let staged: Vec<Staged<'_>> = archive
            .reader()
            .pages_overlapping(tensor, lo, hi)
            .into_iter()
            .map(|pi| stage_page(archive, pi))
            .collect::<Result<_>>()?;
        let mut run = EmuRun {
            emu: self,
            arena: Arena { bytes: Vec::new() },
        };
        let (pages, _, _) = place_pages(&mut run, archive, &staged)?;
        let out_at = run.place(bytemuck::cast_slice(&vec![POISON; len]))?;
        let dst = match layout {
            HostLayout::Contiguous {
                first_token,
                tokens,
            } => DstSpec::Contiguous {
                ptr: out_at,
                len: len as u64,
                first_token: *first_token,
                tokens: *tokens,
            },
            HostLayout::Paged { slots, .. } => DstSpec::Paged {
                ptr: out_at,
                len: len as u64,
                slots: run.place(bytemuck::cast_slice(slots))?,
                slots_len: slots.len() as u64,
                slot_stride: info.tokens,
                addr: None,
            },
            HostLayout::Blocks {
                layout,
                shape,
                block_ids,
            } => {
                let slots = super::paged::slot_mapping(block_ids, shape, info.tokens)?;
                let (off, len, addr) = shape.image_target(*layout, info.kind);
                DstSpec::Paged {
                    ptr: out_at + 2 * off,
                    len,
                    slots: run.place(bytemuck::cast_slice(&slots))?,
                    slots_len: slots.len() as u64,
                    slot_stride: 0,
                    addr: Some(addr),
                }
            }
        };
        let by_tensor = BTreeMap::from([(tensor as u32, dst)]);
        let plan = place_decode(&mut run, &pages, &by_tensor, out, self.options)?;
        run.launch(&plan.launches)?;
        check_status(&bytemuck::pod_collect_to_vec::<u8, u64>(
            &run.read(plan.status, 16)?,
        ))?;
        Ok(bytemuck::pod_collect_to_vec(&run.read(out_at, 2 * len)?))
    }

    /// [`super::Device::decode_paged`] through the emulated kernels: the
    /// image, descriptors and launches of [`super::Gpu::decode_paged`].
    ///
    /// # Errors
    /// As [`super::Gpu::decode_paged`], and [`Error::Device`] (or [`Error::Io`] for its files) when the
    /// emulator cannot be built or fails.
    pub fn decode_paged(
        &self,
        archive: &Archive<'_>,
        layer: u32,
        layout: PagedLayout,
        shape: &PagedShape,
        block_ids: &[i64],
        out: OutType,
    ) -> Result<Vec<u16>> {
        let img = PagedImage::new(archive, layer, shape, block_ids)?;
        let len = usize::try_from(2 * shape.kv_elements())
            .map_err(|_| Error::param("paged cache too large for this host"))?;
        let mut arena = Arena { bytes: Vec::new() };
        let cache = arena.place(bytemuck::cast_slice(&vec![POISON; len]));
        let target = |k| {
            let (off, n, addr) = shape.image_target(layout, k);
            (cache + 2 * off, n, addr)
        };
        let tlen = img.tables(0, target, out, self.options)?.0.len();
        let base = arena.place(&vec![0u8; img.fixed + tlen]);
        let (tables, launches, _) = img.tables(base, target, out, self.options)?;
        let o = (base - BASE) as usize;
        img.fill(&mut arena.bytes[o..o + img.fixed]);
        arena.bytes[o + img.fixed..o + img.fixed + tlen].copy_from_slice(&tables);
        let status = base + img.status0 as u64;
        let launches: Vec<Launch> = launches
            .iter()
            .map(|(key, d, w, blocks)| Launch {
                kernel: key.0.clone(),
                descs: base + *d as u64,
                work: base + *w as u64,
                blocks: *blocks,
                args: group_args(key, status),
            })
            .collect();
        self.run(&mut arena, &launches)?;
        check_status(&bytemuck::pod_collect_to_vec::<u8, u64>(
            arena.at(status, 16),
        ))?;
        Ok(bytemuck::pod_collect_to_vec(arena.at(cache, 2 * len)))
    }

    /// [`super::Device::encode_paged`] through the emulated kernels: the
    /// gather and encode launches of [`super::Gpu::encode_paged`] (the
    /// host fallback for codecs without a GPU encoder).
    ///
    /// # Errors
    /// As [`super::Gpu::encode_paged`], and [`Error::Device`] (or [`Error::Io`] for its files) when the
    /// emulator cannot be built or fails.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_paged(
        &self,
        image: &[u16],
        layout: PagedLayout,
        shape: &PagedShape,
        dtype: crate::cache::DType,
        block_ids: &[i64],
        num_tokens: u32,
        codec: &dyn Codec,
        layer: u32,
        opts: &crate::compress::CompressOptions,
    ) -> Result<(Vec<u8>, crate::compress::CompressReport)> {
        if num_tokens == 0 {
            return Err(Error::param("encode_paged needs at least one token"));
        }
        let infos = paged::layer_infos(shape, dtype, layer, num_tokens);
        let slots = paged::slot_mapping(block_ids, shape, num_tokens)?;
        let mut arena = Arena { bytes: Vec::new() };
        let cache = arena.place(bytemuck::cast_slice(image));
        let slots_at = arena.place(bytemuck::cast_slice(&slots));
        let n = infos[0].elements() as usize;
        let outs = [arena.place(&vec![0; 2 * n]), arena.place(&vec![0; 2 * n])];
        let targets = [Kind::Key, Kind::Value].map(|k| {
            let (off, len, addr) = shape.image_target(layout, k);
            (cache + 2 * off, len, addr)
        });
        let (kernel, descs, work) = paged::gather_plan(shape, targets, slots_at, num_tokens, outs)?;
        let launch = Launch {
            kernel,
            descs: arena.place(bytemuck::cast_slice(&descs)),
            work: arena.place(bytemuck::cast_slice(&work)),
            blocks: work.len() as u32,
            args: Args {
                bits: None,
                h: None,
                c: None,
                status: arena.place(&[0xff; 16]),
            },
        };
        let status = launch.args.status;
        self.run(&mut arena, &[launch])?;
        check_status(&bytemuck::pod_collect_to_vec::<u8, u64>(
            arena.at(status, 16),
        ))?;
        let host = outs.map(|o| bytemuck::pod_collect_to_vec::<u8, u16>(arena.at(o, 2 * n)));
        let pages = crate::plan::plan(&infos, &[0, 0], opts.layout)?;
        let prepared = match super::family::sphere::prepare_shapes(codec, &infos)? {
            Some(c) => Some(c),
            None => paged::prepare_on_gpu(codec, &infos, &pages, opts, |body| {
                let mut run = EmuRun {
                    emu: self,
                    arena: Arena { bytes: Vec::new() },
                };
                let src = run.arena.place(bytemuck::cast_slice(&host[0]));
                super::backend::key_amax(&mut run, src, &infos[0], body).map(Some)
            })?,
        };
        let codec = prepared.as_deref().unwrap_or(codec);
        if !paged::encodes_on_gpu(&infos, &pages, codec, opts) {
            return paged::file_from_host(infos, host, codec, opts, Vec::new());
        }
        let tensors = infos
            .iter()
            .cloned()
            .zip(host)
            .map(|(i, v)| paged::host_tensor(i, v))
            .collect::<Result<Vec<_>>>()?;
        let bodies = paged::bodies_by_tensor(&pages, 2, codec, |t, mine, c| {
            self.encode_bodies(&tensors[t], c, mine)
        })?;
        paged::file_from_bodies(infos, codec, opts, &pages, &bodies, Vec::new())
    }

    /// [`super::Device::encode_tensor`] through the emulated kernels.
    ///
    /// # Errors
    /// As [`super::Device::encode_tensor`], and [`Error::Device`] (or [`Error::Io`] for its files) when the
    /// emulator cannot be built or fails.
    pub fn encode_tensor(
        &self,
        tensor: &Tensor,
        codec: &dyn Codec,
        pages: &[PlannedPage],
    ) -> Result<Vec<Vec<Section>>> {
        self.encode_bodies(tensor, codec, pages)?.sections()
    }

    /// [`Emulator::encode_tensor`] returning the downloaded bodies.
    fn encode_bodies(
        &self,
        tensor: &Tensor,
        codec: &dyn Codec,
        pages: &[PlannedPage],
    ) -> Result<EncodedBodies> {
        let info = &tensor.info;
        let mut arena = Arena { bytes: Vec::new() };
        let src = match &tensor.data {
            TensorData::Bf16(v) => arena.place(bytemuck::cast_slice(v)),
            TensorData::F16(v) => arena.place(bytemuck::cast_slice(v)),
            TensorData::F32(v) => arena.place(bytemuck::cast_slice(v)),
            // Refused by the plan below (`spec::supported`).
            TensorData::Fp8(_, v) => arena.place(v),
        };
        let mut run = EmuRun { emu: self, arena };
        let plan = place_encode(&mut run, src, info, codec, pages, self.options)?;
        run.launch(&plan.launches)?;
        let s = u64::from_le_bytes(run.read(plan.status, 8)?.try_into().expect("8 bytes"));
        check_encode_status(s, info, pages)?;
        let bodies = run.read(plan.bodies, plan.bodies_len)?;
        EncodedBodies::new(plan.layouts, plan.cut, Box::new(bodies))
    }
}

/// The emulator as a [`Backend`]: its arena and its kernel runner.
struct EmuRun<'e> {
    emu: &'e Emulator,
    arena: Arena,
}

impl Place for EmuRun<'_> {
    fn place(&mut self, bytes: &[u8]) -> Result<u64> {
        Ok(self.arena.place(bytes))
    }

    fn zeroed(&mut self, len: usize) -> Result<u64> {
        Ok(self.arena.zeroed(len))
    }
}

impl Backend for EmuRun<'_> {
    fn launch(&mut self, launches: &[Launch]) -> Result<()> {
        self.emu.run(&mut self.arena, launches)
    }

    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>> {
        Ok(self.arena.at(addr, len).to_vec())
    }
}
