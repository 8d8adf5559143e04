//! Host-side description of GPU work, shared by the CUDA backend and the
//! CPU-only tests: which kernel handles a page, the page descriptors the
//! kernels read (`PageDesc` / `EncDesc`, mirrored in `kernels/common.cuh`),
//! and the work lists (one entry per thread block). The canonical body of
//! a page is `super::body`, its sections each family's `body_sections`.
//!
//! Nothing here touches a device; it is all plain data, so it is tested on
//! machines without CUDA.

use bytemuck::Zeroable;

use crate::cache::{DType, TensorInfo};
use crate::error::{Error, Result};
use crate::format::PageView;

/// Threads per block of the unit kernels (`BLOCK` in `common.cuh`).
pub const BLOCK: u32 = 256;
/// Units of 8 elements one thread of a unit kernel handles.
pub const UNITS_PER_THREAD: u32 = 4;
/// Units of 32 elements one thread of a decode kernel handles.
pub const DEC_UNITS_W32: u32 = 2;
/// Units of 32 elements one thread of an encode kernel handles.
pub const ENC_UNITS_W32: u32 = 1;
/// Units one block of an 8-element unit kernel handles.
pub const UNITS_PER_BLOCK: u32 = BLOCK * UNITS_PER_THREAD;

/// The multiplier kernels use to divide by `d` (`udiv` in `common.cuh`):
/// `ceil(2^32 / d)`, or 0 for `d <= 1` (the quotient is the dividend).
pub fn magic(d: u32) -> u32 {
    if d <= 1 {
        0
    } else {
        ((1u64 << 32).div_ceil(u64::from(d))) as u32
    }
}

/// `n / d` the way the kernels compute it from [`magic`] (for tests).
pub fn udiv(n: u32, d: u32, m: u32) -> u32 {
    if m == 0 {
        return n;
    }
    let mut q = ((u64::from(n) * u64::from(m)) >> 32) as u32;
    if u64::from(q) * u64::from(d) > u64::from(n) {
        q -= 1;
    }
    q
}

/// Kernel selection options of a device handle ([`super::Device`],
/// [`super::Gpu`], [`super::Emulator`]): benchmark knobs that pick another
/// kernel of the same family to isolate a cost. Results are identical with
/// any options; the default is the fastest measured choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct KernelOptions {
    /// `int`/`bdr`: use the 8-element unit kernels wherever they apply
    /// instead of the 32-element ones.
    pub narrow: bool,
    /// hqmq decode: read the joint codebook through L1 instead of copying
    /// it to shared memory once per work item (`HQ_ITEM` rows).
    pub global_hqmq_codebook: bool,
}
/// Threads per block of the segment (fallback) kernels.
pub const SEG_BLOCK: u32 = 128;
/// Largest segment (elements held in shared memory) of the fallback kernels,
/// and so the largest head_dim the `int`/`bdr` kernels accept.
pub const SEG_MAX: u32 = 1024;
/// Largest rotation block handled in registers and warp shuffles.
pub const MAX_SHUFFLE_BLOCK: u32 = 256;
/// Rows (tokens of one plane) per work item of the hqmq decode kernels
/// (`HQ_ITEM` in `common.cuh`).
pub const HQ_ITEM: u32 = 256;

/// What a GPU kernel needs to know about a page's codec, derived from the
/// codec table entry (`Codec::id` and `Codec::params`) and the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelCodec {
    /// `raw`: one RAW section at the tensor's dtype.
    Raw {
        /// Source element type.
        src: DType,
    },
    /// `int{b}` or `bdr{h}`: SCALE, ZERO, INDEX sections.
    Affine {
        /// Bits per code, 1..=8.
        bits: u8,
        /// Rotation block applied to this tensor (`None` for `int{b}` and
        /// for V under `bdr{h}:k`).
        block: Option<u32>,
    },
    /// `kivi` pages and the value-group V pages of `octopus` / `turbo`:
    /// f16 scale and zero point per group, `bits`-bit codes.
    Kivi {
        /// Bits per code, 1..=8.
        bits: u8,
        /// Group size `G`.
        group: u16,
        /// Groups run along tokens (K of `kivi`), else along channels.
        tokens: bool,
    },
    /// `innerq` pages.
    InnerQ {
        /// Bits per code, 1..=8.
        bits: u8,
        /// 0 asymmetric, 1 symmetric, 2 hybrid.
        mode: u8,
        /// Group size `G` (a multiple of 32).
        group: u16,
        /// Groups run along tokens (V), else along channels (K).
        tokens: bool,
        /// K values are multiplied by the layer's normalization factors.
        norm: bool,
    },
    /// `polar` key pages.
    Polar {
        /// Angle bits `m`.
        m: u8,
        /// Radius bits `n`.
        n: u8,
        /// Adjacent pairing (else half).
        adjacent: bool,
    },
    /// `octopus` / `turbo` coded pages (norm, rotated unit vector codes,
    /// optional QJL residual).
    Sphere {
        /// OCTOPUS triplets (else TurboQuant per coordinate).
        octopus: bool,
        /// Turbo bits `b`, or octopus direction bits `b_dir`.
        a: u8,
        /// Octopus norm bits `b_norm` (0 for turbo).
        b: u8,
        /// The page carries the QJL residual (K pages with `+qjl`).
        qjl: bool,
    },
    /// `hqmq` pages.
    Hqmq {
        /// Secondary codewords `S`.
        s: u32,
        /// Radius bits `b`.
        b: u8,
        /// Low symbol bits `E`.
        e: u8,
        /// Digits per group `G`.
        g: u8,
        /// Bits per digit group `W`.
        w: u8,
        /// Digit base `O` (odd).
        o: u32,
        /// Outlier extraction (`+med{C}`).
        med: bool,
        /// Per-channel gains (`+chan`) or centring (`+ctr`).
        chan: crate::codec::hqmq::Channels,
    },
}

impl KernelCodec {
    /// `h` as passed to the kernels: the block size, 0 without rotation.
    pub fn h(&self) -> u32 {
        match self {
            KernelCodec::Affine { block: Some(h), .. } => *h,
            _ => 0,
        }
    }

    /// `c_h`, the f32 nearest to `1/sqrt(h)` (1 without rotation).
    pub fn c(&self) -> f32 {
        match self {
            KernelCodec::Affine { block: Some(h), .. } => {
                crate::kernels::wht::inv_sqrt(*h as usize)
            }
            _ => 1.0,
        }
    }
}

/// Checks that the GPU kernels take tensors like `t`: bf16, fp16 or fp32
/// K or V tensors. fp8 tensors and MLA latents (format 1.1) are decoded and
/// encoded on the CPU only.
///
/// # Errors
/// [`Error::Unsupported`] naming the tensor and what the kernels lack.
pub fn supported(t: &TensorInfo) -> Result<()> {
    if let DType::Fp8(_) = t.dtype {
        return Err(Error::Unsupported(format!(
            "{} ({}) is stored as {}: the GPU kernels read bf16, fp16 and fp32 pages only; \
             decode or encode it on the CPU",
            t.name,
            t.describe(),
            t.dtype.name()
        )));
    }
    if t.kind == crate::cache::Kind::Latent {
        return Err(Error::Unsupported(format!(
            "{} ({}) is an MLA latent: the GPU kernels take K and V tensors only; \
             decode or encode it on the CPU",
            t.name,
            t.describe()
        )));
    }
    Ok(())
}

/// Element type of a GPU decode output: bf16 or f16 (the serving engines'
/// KV types). Stored as `u16` bit patterns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutType {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl OutType {
    /// Suffix of kernel names (`bf16`, `f16`).
    pub fn suffix(self) -> &'static str {
        match self {
            OutType::Bf16 => "bf16",
            OutType::F16 => "f16",
        }
    }

    /// The matching [`DType`].
    pub fn dtype(self) -> DType {
        match self {
            OutType::Bf16 => DType::Bf16,
            OutType::F16 => DType::F16,
        }
    }

    /// The output type for a [`DType`].
    ///
    /// # Errors
    /// [`Error::Parameter`] for f32 and fp8 (GPU decode writes 16-bit
    /// elements).
    pub fn from_dtype(d: DType) -> Result<OutType> {
        match d {
            DType::Bf16 => Ok(OutType::Bf16),
            DType::F16 => Ok(OutType::F16),
            DType::F32 | DType::Fp8(_) => Err(Error::param(format!(
                "GPU decode writes bf16 or fp16, not {}",
                d.name()
            ))),
        }
    }
}

/// Kernel-name suffix of a source element type (fp8 has no kernels: see
/// [`supported`]; its name is returned for messages).
pub fn src_suffix(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        DType::Fp8(_) => d.name(),
    }
}

/// Which kernel runs a group of pages, and how its work is cut.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelChoice {
    /// Source module (`raw`, `affine`, ...; see [`super::sources`]).
    pub source: &'static str,
    /// Kernel function name.
    pub name: String,
    /// How work items are counted (see [`Grid`]).
    pub grid: Grid,
    /// Dynamic shared memory per block, bytes.
    pub shared: u32,
}

/// How a kernel's work is cut into thread blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Grid {
    /// [`BLOCK`] threads; units of `w` (8 or 32) consecutive elements of a
    /// row, `per_thread` units per thread ([`UNITS_PER_THREAD`] for w = 8,
    /// [`DEC_UNITS_W32`] / [`ENC_UNITS_W32`] for w = 32).
    Units {
        /// Elements per unit.
        w: u32,
        /// Units per thread.
        per_thread: u32,
    },
    /// [`BLOCK`] threads, [`UNITS_PER_BLOCK`] single elements per block.
    Elements,
    /// [`SEG_BLOCK`] threads, one segment of `seg` elements per block.
    Segments {
        /// Elements per segment (a divisor of head_dim).
        seg: u32,
    },
    /// [`SEG_BLOCK`] threads, one row per block.
    Rows,
    /// [`BLOCK`] threads; a work item is up to `tokens` consecutive rows of
    /// one plane (items never cross planes); units of `unit` elements.
    PlaneRows {
        /// Rows per item.
        tokens: u32,
        /// Elements per unit (sets the descriptor's units per row).
        unit: u32,
    },
}

impl Grid {
    /// Threads per block.
    pub fn threads(self) -> u32 {
        match self {
            Grid::Units { .. } | Grid::Elements | Grid::PlaneRows { .. } => BLOCK,
            Grid::Segments { .. } | Grid::Rows => SEG_BLOCK,
        }
    }

    /// Work items (thread blocks) for a page of `rows` rows (`tokens` per
    /// plane) of `head_dim`, as `(page, first unit / element / segment /
    /// row)`, appended to `out`.
    pub fn push_items(
        self,
        page: u32,
        rows: u32,
        tokens: u32,
        head_dim: u32,
        out: &mut Vec<[u32; 2]>,
    ) {
        if let Grid::PlaneRows { tokens: item, .. } = self {
            let planes = rows.checked_div(tokens).unwrap_or(0);
            for p in 0..planes {
                let mut t = 0;
                while t < tokens {
                    out.push([page, p * tokens + t]);
                    t += item;
                }
            }
            return;
        }
        let (n, per) = match self {
            Grid::Units { w, per_thread } => (
                rows as u64 * (head_dim / w) as u64,
                u64::from(BLOCK * per_thread),
            ),
            Grid::Elements => (rows as u64 * head_dim as u64, UNITS_PER_BLOCK as u64),
            Grid::Segments { seg } => (rows as u64 * (head_dim / seg) as u64, 1),
            Grid::Rows => (rows as u64, 1),
            Grid::PlaneRows { .. } => unreachable!("handled above"),
        };
        let mut i = 0;
        while i < n {
            out.push([page, i as u32]);
            i += per;
        }
    }
}

/// The 8-element unit grid.
pub(crate) const W8: Grid = Grid::Units {
    w: 8,
    per_thread: UNITS_PER_THREAD,
};

impl Grid {
    /// Elements per unit of a unit kernel (0 for the others).
    pub fn unit(self) -> u32 {
        match self {
            Grid::Units { w, .. } => w,
            Grid::PlaneRows { unit, .. } => unit,
            _ => 0,
        }
    }
}

/// The encode kernel for `int`/`bdr` pages of a tensor.
///
/// # Errors
/// [`Error::Unsupported`] for `raw` (a copy; use the CPU) or head_dim above
/// [`SEG_MAX`].
pub fn encode_kernel(
    kc: KernelCodec,
    head_dim: u32,
    src: DType,
    opts: KernelOptions,
) -> Result<KernelChoice> {
    let KernelCodec::Affine { bits, block } = kc else {
        return Err(Error::Unsupported(
            "GPU encode covers int and bdr; raw pages are a plain copy".into(),
        ));
    };
    if head_dim > SEG_MAX {
        return Err(Error::Unsupported(format!(
            "GPU int/bdr kernels handle head_dim up to {SEG_MAX}, not {head_dim}"
        )));
    }
    let h = block.unwrap_or(0);
    let s = src_suffix(src);
    let fits = |w: u32| {
        let upr = head_dim / w;
        head_dim.is_multiple_of(w) && upr.is_power_of_two() && upr <= 32
    };
    let w8 = fits(8) && h <= MAX_SHUFFLE_BLOCK;
    if fits(32) && !(w8 && opts.narrow) {
        Ok(KernelChoice {
            source: "affine",
            name: format!("encode_affine_b{bits}_{s}"),
            grid: Grid::Units {
                w: 32,
                per_thread: ENC_UNITS_W32,
            },
            shared: 0,
        })
    } else if w8 {
        Ok(KernelChoice {
            source: "affine",
            name: format!("encode_affine_w8_b{bits}_{s}"),
            grid: W8,
            shared: 0,
        })
    } else {
        Ok(KernelChoice {
            source: "affine",
            name: format!("encode_affine_any_{s}"),
            grid: Grid::Rows,
            shared: 0,
        })
    }
}

pub use super::abi::{EncDesc, PageDesc};

/// Bytes of a page's sections (what a decode kernel reads of it).
pub fn section_bytes(page: &PageView<'_>) -> u64 {
    page.sections().iter().map(|s| u64::from(s.len)).sum()
}

/// Where one tensor's decoded rows go, as plain device addresses (built by
/// the backend from a [`super::Dst`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DstSpec {
    /// `[planes, tokens, head_dim]`: output token `t - first_token` of
    /// plane `p` at element `(p * tokens + t - first_token) * head_dim`.
    Contiguous {
        /// Device address of element 0.
        ptr: u64,
        /// Elements in the buffer.
        len: u64,
        /// First tensor token held by the buffer.
        first_token: u32,
        /// Tokens the buffer holds per plane.
        tokens: u32,
    },
    /// A paged cache: token `t` of batch item `b` goes to slot
    /// `slots[b * slot_stride + t]` (skipped when negative), addressed by
    /// `addr` from `ptr`.
    Paged {
        /// Device address of element (block 0, row 0, head 0) of this
        /// tensor (the K/V offset already applied).
        ptr: u64,
        /// Elements from `ptr` to the end of the allocation.
        len: u64,
        /// Device address of the i64 slot mapping.
        slots: u64,
        /// Entries in the slot mapping.
        slots_len: u64,
        /// Slot-mapping entries between batch items.
        slot_stride: u32,
        /// Block geometry; `None` for vLLM's flat
        /// `[num_slots, kv_heads, head_dim]` (slots of `kv_heads x
        /// head_dim` elements, as many as fit in `len`).
        addr: Option<super::addr::PagedAddr>,
    },
}

/// What a descriptor needs to know about a page besides its body address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageGeom {
    /// Kernel family of the page's codec.
    pub kc: KernelCodec,
    /// First token.
    pub token_start: u32,
    /// Tokens in the page.
    pub tokens: u32,
    /// Batch size of the tensor.
    pub batch: u32,
    /// KV heads of the tensor.
    pub heads: u32,
    /// Elements per row.
    pub head_dim: u32,
    /// Section offsets (`gpu::family::page_sections`).
    pub sections: [u32; 5],
    /// Codec parameters `p0..p3` of the descriptor
    /// (`gpu::family::desc_params` of the family, head_dim and the
    /// page-specific parameter of `gpu::family::page_sections`).
    pub params: [u32; 4],
    /// Device address of the tensor's side table, 0 if none (set when the
    /// page is placed on the device).
    pub side: u64,
    /// Bytes of the page's sections ([`section_bytes`]).
    pub read: u64,
}

impl PageGeom {
    /// Rows of the page (`batch * heads * tokens`).
    pub fn rows(&self) -> u64 {
        u64::from(self.batch) * u64::from(self.heads) * u64::from(self.tokens)
    }
}

/// The descriptor of page `g` (body at device address `body`) writing into
/// `dst` with a kernel of `unit` elements per unit (0 for non-unit
/// kernels), with the number of rows it writes; `None` when the page holds
/// no token of a contiguous destination's range.
///
/// # Errors
/// [`Error::Parameter`] when the destination is too small for the tensor
/// (contiguous), its length is not a whole number of slots, or the slot
/// mapping is too short (paged).
pub fn page_desc(
    g: &PageGeom,
    body: u64,
    dst: &DstSpec,
    unit: u32,
) -> Result<Option<(PageDesc, u64)>> {
    let rows = g.rows();
    let rows32 = u32::try_from(rows).map_err(|_| Error::param("page over 2^32 rows"))?;
    let planes = u64::from(g.batch) * u64::from(g.heads);
    let d = u64::from(g.head_dim);
    let mut desc = PageDesc {
        body,
        rows: rows32,
        tokens: g.tokens,
        heads: g.heads,
        head_dim: g.head_dim,
        sec0: g.sections[0],
        sec1: g.sections[1],
        sec2: g.sections[2],
        t_hi: g.tokens,
        m_tokens: magic(g.tokens),
        m_heads: magic(g.heads),
        upr: g.head_dim.checked_div(unit).unwrap_or(0),
        m_upr: magic(g.head_dim.checked_div(unit).unwrap_or(0)),
        side: g.side,
        sec3: g.sections[3],
        sec4: g.sections[4],
        ..PageDesc::zeroed()
    };
    [desc.p0, desc.p1, desc.p2, desc.p3] = g.params;
    match *dst {
        DstSpec::Contiguous {
            ptr,
            len,
            first_token,
            tokens,
        } => {
            if planes * u64::from(tokens) * d > len {
                return Err(Error::param(format!(
                    "contiguous output holds {len} elements, {planes} planes x {tokens} tokens x {d} need more"
                )));
            }
            let lo = first_token.max(g.token_start);
            let hi = (u64::from(first_token) + u64::from(tokens))
                .min(u64::from(g.token_start) + u64::from(g.tokens)) as u32;
            if lo >= hi {
                return Ok(None);
            }
            desc.dst = ptr;
            desc.stride = u64::from(tokens) * d;
            desc.tok_off = (i64::from(g.token_start) - i64::from(first_token)) as i32;
            desc.t_lo = lo - g.token_start;
            desc.t_hi = hi - g.token_start;
            Ok(Some((desc, planes * u64::from(hi - lo))))
        }
        DstSpec::Paged {
            ptr,
            len,
            slots,
            slots_len,
            slot_stride,
            addr,
        } => {
            let addr = match addr {
                Some(a) => a,
                None => {
                    let per_slot = u64::from(g.heads) * d;
                    if !len.is_multiple_of(per_slot) {
                        return Err(Error::param(format!(
                            "paged cache of {len} elements is not a whole number of slots of {per_slot}"
                        )));
                    }
                    super::addr::PagedAddr::flat(len / per_slot, g.heads, g.head_dim)
                }
            };
            addr.check(len, g.heads, g.head_dim)?;
            if slot_stride == 0 && g.batch > 1 {
                return Err(Error::param(format!(
                    "a block-table destination takes one sequence, not a batch of {}",
                    g.batch
                )));
            }
            let need = u64::from(g.batch - 1) * u64::from(slot_stride)
                + u64::from(g.token_start)
                + u64::from(g.tokens);
            if need > slots_len {
                return Err(Error::param(format!(
                    "slot mapping has {slots_len} entries, token {} of batch item {} needs {need}",
                    g.token_start + g.tokens - 1,
                    g.batch - 1
                )));
            }
            desc.dst = ptr;
            desc.slots = slots;
            desc.stride = u64::from(slot_stride);
            desc.limit = addr.slots();
            desc.blk_stride = addr.strides.block;
            desc.tok_stride = addr.strides.token;
            desc.head_stride = addr.strides.head;
            desc.block_size = addr.block_size;
            desc.m_block = magic(addr.block_size);
            desc.tok_off = g.token_start as i32;
            Ok(Some((desc, rows)))
        }
    }
}

/// Bytes a decode kernel moves for page `g`: `(read, written)` with read =
/// the page's section bytes (codes, scales, zero points, tables or raw
/// elements) and written = the output elements (2 bytes each) of the rows
/// written.
pub fn decode_bytes(g: &PageGeom, rows_written: u64) -> (u64, u64) {
    (g.read, rows_written * u64::from(g.head_dim) * 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_match_cuda() {
        assert_eq!(std::mem::size_of::<PageDesc>(), 160);
        assert_eq!(std::mem::size_of::<EncDesc>(), 104);
        // The CUDA side must declare the same constants.
        let c = super::super::sources::COMMON;
        for (name, v) in [
            ("BLOCK", BLOCK),
            ("UNITS_PER_THREAD", UNITS_PER_THREAD),
            ("DEC_UNITS_W32", DEC_UNITS_W32),
            ("ENC_UNITS_W32", ENC_UNITS_W32),
            ("SEG_BLOCK", SEG_BLOCK),
            ("SEG_MAX", SEG_MAX),
            ("HQ_ITEM", HQ_ITEM),
        ] {
            assert!(c.contains(&format!("#define {name} {v}\n")), "{name}");
        }
    }

    #[test]
    fn grid_items_cover_the_page() {
        let mut v = Vec::new();
        W8.push_items(3, 100, 100, 128, &mut v);
        // 100 rows x 16 units = 1600 units -> 2 blocks of 1024.
        assert_eq!(v, [[3, 0], [3, 1024]]);
        v.clear();
        Grid::Units {
            w: 32,
            per_thread: 1,
        }
        .push_items(0, 100, 100, 128, &mut v);
        // 100 rows x 4 units = 400 units -> 2 blocks of 256.
        assert_eq!(v, [[0, 0], [0, 256]]);
        v.clear();
        Grid::Segments { seg: 16 }.push_items(0, 2, 2, 48, &mut v);
        assert_eq!(v.len(), 6);
        v.clear();
        Grid::Rows.push_items(1, 3, 3, 48, &mut v);
        assert_eq!(v, [[1, 0], [1, 1], [1, 2]]);
        v.clear();
        // Items never cross planes: 2 planes of 300 tokens, 256 per item.
        Grid::PlaneRows {
            tokens: 256,
            unit: 4,
        }
        .push_items(2, 600, 300, 128, &mut v);
        assert_eq!(v, [[2, 0], [2, 256], [2, 300], [2, 556]]);
    }

    #[test]
    fn descriptors_clip_to_the_destination() {
        let g = PageGeom {
            kc: KernelCodec::Raw { src: DType::Bf16 },
            token_start: 256,
            tokens: 256,
            batch: 1,
            heads: 2,
            head_dim: 64,
            sections: [64, 0, 0, 0, 0],
            params: [0; 4],
            side: 0,
            read: 0,
        };
        let dst = DstSpec::Contiguous {
            ptr: 0x1000,
            len: 2 * 100 * 64,
            first_token: 400,
            tokens: 100,
        };
        let (d, rows) = page_desc(&g, 0x2000, &dst, 8).unwrap().unwrap();
        assert_eq!((d.upr, d.m_upr, d.m_tokens), (8, magic(8), magic(256)));
        // Page tokens 256..512, output tokens 400..500: page rows 144..244.
        assert_eq!((d.t_lo, d.t_hi, d.tok_off, rows), (144, 244, -144, 2 * 100));
        assert_eq!(d.stride, 100 * 64);
        let before = DstSpec::Contiguous {
            ptr: 0x1000,
            len: 2 * 100 * 64,
            first_token: 0,
            tokens: 100,
        };
        assert!(page_desc(&g, 0x2000, &before, 8).unwrap().is_none());
        let paged = DstSpec::Paged {
            ptr: 0x1000,
            len: 16 * 2 * 64,
            slots: 0x3000,
            slots_len: 500,
            slot_stride: 512,
            addr: None,
        };
        assert!(page_desc(&g, 0x2000, &paged, 8).is_err());
    }

    #[test]
    fn magic_division_is_exact() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let ds = [
            1u32,
            2,
            3,
            5,
            6,
            7,
            12,
            16,
            31,
            96,
            511,
            520,
            1000,
            65535,
            1 << 20,
            0x7fff_ffff,
        ];
        for &d in &ds {
            let m = magic(d);
            for n in [0u32, 1, d - 1, d, d + 1, u32::MAX - 1, u32::MAX] {
                assert_eq!(udiv(n, d, m), n / d, "{n} / {d}");
            }
            for _ in 0..20000 {
                let n = next() as u32;
                assert_eq!(udiv(n, d, m), n / d, "{n} / {d}");
            }
        }
        for _ in 0..20000 {
            let d = (next() as u32 >> (next() % 32)).max(1);
            let n = next() as u32;
            assert_eq!(udiv(n, d, magic(d)), n / d, "{n} / {d}");
        }
    }
}
