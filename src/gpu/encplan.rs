//! Device-independent planning of a GPU encode: page body templates,
//! descriptors ([`EncDesc`]) and the work lists of each kernel launch, for
//! `int{b}` / `bdr{h}` (one kernel) and `hqmq` (`encode_hqmq_{src}`
//! writing one symbol per chunk to a scratch buffer, then
//! `encode_hqmq_pack` building the code streams from it; with `+med{C}`
//! also `encode_hqmq_med_{src}` first, computing each page plane's outlier
//! threshold on the device, and `encode_hqmq_compact_{src}` before the
//! pack, writing the outlier table; see [`MedTrim`]).
//!
//! The planner places the buffers it needs besides the bodies (hqmq side
//! tables and scratch) through a callback, so the CUDA backend and the SIMT
//! emulator (`gpu::emu`) share it.

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::{ElemType, SectionKind};
use crate::kernels::radix::Groups;
use crate::plan::PlannedPage;

use super::body::{CanonicalBody, SectionSpec};
use super::spec::{
    self, AffineBody, BLOCK, EncDesc, Grid, KernelChoice, KernelCodec, KernelOptions, src_suffix,
};

/// Alignment of page bodies in the body buffer, bytes.
pub const BODY_ALIGN: usize = 256;

/// One kernel launch of an encode.
#[derive(Debug, Clone)]
pub struct EncWork {
    /// The kernel.
    pub kernel: KernelChoice,
    /// Work items `(descriptor, first unit / row / word)`.
    pub items: Vec<[u32; 2]>,
    /// `bits` argument (affine fallback kernels).
    pub bits: Option<u32>,
    /// `h` argument (affine kernels).
    pub h: Option<u32>,
    /// `c` argument (affine kernels).
    pub c: Option<f32>,
}

/// A planned encode. `descs[i].body` is the offset of page `i`'s body in
/// `host`; the caller rebases it to the device address of the uploaded
/// `host`.
#[derive(Debug, Clone)]
pub struct EncodeLayout {
    /// Each page's body layout and its offset in `host`.
    pub layouts: Vec<(CanonicalBody, usize)>,
    /// The body templates (section tables filled in, sections zeroed).
    pub host: Vec<u8>,
    /// One descriptor per page.
    pub descs: Vec<EncDesc>,
    /// Launches to run once, before the first launch of `works` (they
    /// build tables the encode reads: the hqmq cell index).
    pub setup: Vec<EncWork>,
    /// The launches, in order.
    pub works: Vec<EncWork>,
    /// Bytes the kernels read (source elements).
    pub read: u64,
    /// Bytes the kernels write (the sections; with `+med`, without
    /// outliers).
    pub written: u64,
    /// `hqmq+med`: the bodies are in the worst-case layout, cut to their
    /// sections by [`MedTrim::sections`]; `None` for canonical bodies.
    pub trim: Option<MedTrim>,
}

impl EncodeLayout {
    /// The sections of page `i` from its encoded body `body` (the
    /// [`CanonicalBody::body_len`] bytes at the page's offset), as the CPU
    /// encoder returns them.
    ///
    /// # Errors
    /// [`Error::Parameter`] (internal) when a `+med` body holds an
    /// impossible outlier count.
    ///
    /// # Panics
    /// If `i` is out of range or `body` is shorter than the page's body.
    pub fn sections(&self, i: usize, body: &[u8]) -> Result<Vec<crate::format::Section>> {
        let l = &self.layouts[i].0;
        match &self.trim {
            Some(t) => t.sections(l, body),
            None => Ok(l.sections(body)),
        }
    }
}

/// How an `hqmq+med{C}` body written in the worst-case layout (INDEX
/// streams for every chunk an inlier, OUTLIERS for the most outliers a
/// lower median allows) becomes the CPU encoder's sections: the outlier
/// count `n_out` is the first u32 of the OUTLIERS table the device wrote,
/// so INDEX 0 is cut to `n - n_out` codes of `e` bits, INDEX 1 to the
/// digit groups of `n - n_out` digits and OUTLIERS to its table.
#[derive(Debug, Clone)]
pub struct MedTrim {
    /// Low symbol bits `E`.
    pub e: u32,
    /// The digit grouping of INDEX 1.
    pub groups: Groups,
}

impl MedTrim {
    /// The sections of body `body` of worst-case layout `l` (SCALE, INDEX
    /// 0, INDEX 1, OUTLIERS).
    ///
    /// # Errors
    /// [`Error::Parameter`] (internal) when the table's count exceeds the
    /// layout's chunks or its table space.
    ///
    /// # Panics
    /// If `body` is shorter than `l.body_len` or `l` has other than 4
    /// sections.
    pub fn sections(&self, l: &CanonicalBody, body: &[u8]) -> Result<Vec<crate::format::Section>> {
        let mut s = l.sections(body);
        assert_eq!(s.len(), 4, "hqmq+med layout");
        let n = s[1].count as usize;
        let t = &s[3].data;
        let n_out = u32::from_le_bytes(t[0..4].try_into().expect("4 bytes")) as usize;
        let bitmap = n.div_ceil(8);
        let pos = if 4 * n_out <= bitmap {
            4 * n_out
        } else {
            bitmap
        };
        let table = 12 + pos + 8 * n_out;
        if n_out > n || table > t.len() {
            return Err(Error::param(format!(
                "internal: GPU hqmq outlier count {n_out} of {n} chunks"
            )));
        }
        let n_in = n - n_out;
        s[1].count = n_in as u32;
        s[1].data
            .truncate(crate::kernels::bitpack::packed_len(n_in, self.e));
        let high = self.groups.packed_len(n_in);
        s[2].count = high as u32;
        s[2].data.truncate(high);
        s[3].data.truncate(table);
        s[3].count = table as u32;
        Ok(s)
    }
}

/// Checks that a page lies inside the tensor; returns its rows.
fn page_rows(info: &TensorInfo, p: &PlannedPage) -> Result<u32> {
    if p.tokens == 0 || u64::from(p.token_start) + u64::from(p.tokens) > u64::from(info.tokens) {
        return Err(Error::param(format!(
            "page tokens {}..{} outside {} ({} tokens)",
            p.token_start,
            p.token_start + p.tokens,
            info.describe(),
            info.tokens
        )));
    }
    u32::try_from(info.planes() as u64 * u64::from(p.tokens))
        .map_err(|_| Error::param("page over 2^32 rows"))
}

/// Appends a body template, [`BODY_ALIGN`]-aligned; returns its offset.
fn push_body(host: &mut Vec<u8>, l: &CanonicalBody) -> usize {
    host.resize(host.len().next_multiple_of(BODY_ALIGN), 0);
    let off = host.len();
    host.extend_from_slice(&l.template());
    off
}

/// Plans the encode of `pages` of tensor `info` (source elements at device
/// address `src`, `[planes, tokens, head_dim]`) with `codec`. `place`
/// stores a byte buffer on the device and returns its address.
///
/// # Errors
/// [`Error::Parameter`] for a page outside the tensor or a codec that
/// cannot encode it; [`Error::Unsupported`] for codecs other than `int`,
/// `bdr` and `hqmq`; the errors of `place`.
pub fn plan(
    src: u64,
    info: &TensorInfo,
    codec: &dyn Codec,
    pages: &[PlannedPage],
    opts: KernelOptions,
    place: &mut dyn FnMut(&[u8]) -> Result<u64>,
) -> Result<EncodeLayout> {
    codec.check(info)?;
    let kc = KernelCodec::of(codec, info)?;
    match kc {
        KernelCodec::Affine { bits, .. } => plan_affine(src, info, kc, bits, pages, opts),
        KernelCodec::Hqmq { .. } => plan_hqmq(src, info, codec, kc, pages, place),
        _ => Err(Error::Unsupported(format!(
            "GPU encode covers int, bdr and hqmq, not {}",
            codec.name()
        ))),
    }
}

/// True when the GPU encodes `codec` for tensor `info` ([`plan`] accepts
/// it): `int{b}`, `bdr{h}` and `hqmq`, on a tensor the codec takes.
pub fn gpu_encodes(codec: &dyn Codec, info: &TensorInfo) -> bool {
    codec.check(info).is_ok()
        && matches!(
            KernelCodec::of(codec, info),
            Ok(KernelCodec::Affine { .. } | KernelCodec::Hqmq { .. })
        )
}

fn empty() -> EncodeLayout {
    EncodeLayout {
        layouts: Vec::new(),
        host: Vec::new(),
        descs: Vec::new(),
        setup: Vec::new(),
        works: Vec::new(),
        read: 0,
        written: 0,
        trim: None,
    }
}

/// `int{b}` / `bdr{h}`: one kernel writing SCALE, ZERO and INDEX.
fn plan_affine(
    src: u64,
    info: &TensorInfo,
    kc: KernelCodec,
    bits: u8,
    pages: &[PlannedPage],
    opts: KernelOptions,
) -> Result<EncodeLayout> {
    let esize = info.dtype.size() as u64;
    let kernel = spec::encode_kernel(kc, info.head_dim, info.dtype, opts)?;
    let d = info.head_dim;
    let mut p = empty();
    let mut work = Vec::new();
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let l = AffineBody::new(rows, d, bits)?;
        let cl = CanonicalBody::from(&l);
        let off = push_body(&mut p.host, &cl);
        p.read += u64::from(rows) * u64::from(d) * esize;
        p.written += u64::from(l.lens[0]) + u64::from(l.lens[1]) + u64::from(l.lens[2]);
        p.descs.push(EncDesc {
            src: src + u64::from(pg.token_start) * u64::from(d) * esize,
            body: off as u64,
            stride: u64::from(info.tokens) * u64::from(d),
            rows,
            tokens: pg.tokens,
            head_dim: d,
            sec_scale: l.offsets[0],
            sec_zero: l.offsets[1],
            sec_index: l.offsets[2],
            page: i as u32,
            m_tokens: spec::magic(pg.tokens),
            upr: d.checked_div(kernel.grid.unit()).unwrap_or(0),
            m_upr: spec::magic(d.checked_div(kernel.grid.unit()).unwrap_or(0)),
            heads: info.heads,
            ..bytemuck::Zeroable::zeroed()
        });
        kernel
            .grid
            .push_items(i as u32, rows, pg.tokens, d, &mut work);
        p.layouts.push((cl, off));
    }
    let fallback = !matches!(kernel.grid, Grid::Units { .. });
    p.works.push(EncWork {
        kernel,
        items: work,
        bits: fallback.then_some(u32::from(bits)),
        h: Some(kc.h()),
        c: Some(kc.c()),
    });
    Ok(p)
}

/// `hqmq`: the search kernel (symbols to scratch, SCALE written) and the
/// pack kernel (INDEX 0 and 1 from the symbols); with `+med{C}` the median
/// kernel before them (per page plane `tau = C * med` into the page's
/// scratch header) and the compaction kernel between them (inlier symbols
/// to the front, the OUTLIERS table), on worst-case bodies ([`MedTrim`]).
fn plan_hqmq(
    src: u64,
    info: &TensorInfo,
    codec: &dyn Codec,
    kc: KernelCodec,
    pages: &[PlannedPage],
    place: &mut dyn FnMut(&[u8]) -> Result<u64>,
) -> Result<EncodeLayout> {
    let KernelCodec::Hqmq {
        s,
        b,
        e,
        g,
        w,
        o,
        med,
    } = kc
    else {
        unreachable!("hqmq")
    };
    let esize = info.dtype.size() as u64;
    let d = info.head_dim;
    let nc = d / 4;
    let planes = info.planes() as u64;
    let rb = (BLOCK / nc.max(1)).max(1);
    let groups = Groups::new(u64::from(o), u32::from(g)).expect("checked grouping");
    let c = crate::codec::hqmq::Hqmq::from_params(&codec.params())?.outlier_multiplier;
    let mut table = super::side::hqmq_encode_table(codec, info, s)?;
    let cells = super::hqmq_cells::grid(s).filter(|_| !pages.is_empty());
    if let Some(g) = cells {
        table.extend_from_slice(&super::hqmq_cells::region(g, info.heads));
    }
    let side = place(&table)?;
    drop(table);
    let mut p = empty();
    if let Some(g) = cells {
        let boxes = u64::from(info.heads) * u64::from(g).pow(3);
        p.setup.push(EncWork {
            kernel: KernelChoice {
                source: "hqmq_enc",
                name: "encode_hqmq_cells".into(),
                grid: Grid::Units {
                    w: 1,
                    per_thread: 1,
                },
                shared: 0,
            },
            items: (0..boxes)
                .step_by(BLOCK as usize)
                .map(|b| [0, b as u32])
                .collect(),
            bits: None,
            h: None,
            c: None,
        });
    }
    // Per page: u32 symbols, then with +med the header (u32 n_out, f32 C,
    // f32 tau per plane).
    let mut scratch_host = Vec::new();
    let mut scratch_at = Vec::new();
    for pg in pages {
        let rows = page_rows(info, pg)?;
        scratch_at.push(scratch_host.len() as u64);
        scratch_host.resize(scratch_host.len() + 4 * rows as usize * nc as usize, 0);
        if med {
            scratch_host.extend_from_slice(&[0; 4]);
            scratch_host.extend_from_slice(&c.unwrap_or(1.0).to_le_bytes());
            scratch_host.resize(scratch_host.len() + 4 * planes as usize, 0);
        }
    }
    scratch_host.resize(scratch_host.len().max(4), 0);
    let scratch = place(&scratch_host)?;
    drop(scratch_host);
    let kernel = |name: String, grid| KernelChoice {
        source: "hqmq_enc",
        name,
        grid,
        shared: 0,
    };
    let items = Grid::Units {
        w: 1,
        per_thread: 1,
    };
    let sfx = src_suffix(info.dtype);
    let search = kernel(
        format!("encode_hqmq_{sfx}"),
        Grid::PlaneRows {
            tokens: rb,
            unit: 4,
        },
    );
    let (mut w0, mut w1, mut w2, mut w3) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let count = |v: u64| u32::try_from(v).map_err(|_| Error::param("hqmq page too large"));
    for (i, pg) in pages.iter().enumerate() {
        let rows = page_rows(info, pg)?;
        let n = u64::from(rows) * u64::from(nc);
        let low_len = (n * u64::from(e)).div_ceil(8);
        let high_len = groups.packed_len(n as usize) as u64;
        let spec = |kind, stream, elem, count, len| SectionSpec {
            kind,
            stream,
            elem,
            count,
            len,
        };
        let mut specs = vec![
            spec(SectionKind::Scale, 0, ElemType::F16, rows, 2 * rows),
            spec(
                SectionKind::Index,
                0,
                ElemType::Packed(e),
                count(n)?,
                count(low_len)?,
            ),
            spec(
                SectionKind::Index,
                1,
                ElemType::Bytes,
                count(high_len)?,
                count(high_len)?,
            ),
        ];
        if med {
            // The most outliers: planes * floor(N / 2) (kernel header).
            let cap = planes * (u64::from(pg.tokens) * u64::from(nc) / 2);
            let len = count(12 + n.div_ceil(8) + 8 * cap)?;
            specs.push(spec(SectionKind::Outliers, 0, ElemType::Bytes, len, len));
        }
        let l = CanonicalBody::new(specs)?;
        let off = push_body(&mut p.host, &l);
        p.read += u64::from(rows) * u64::from(d) * esize;
        p.written += u64::from(2 * rows) + low_len + high_len;
        p.descs.push(EncDesc {
            src: src + u64::from(pg.token_start) * u64::from(d) * esize,
            body: off as u64,
            stride: u64::from(info.tokens) * u64::from(d),
            rows,
            tokens: pg.tokens,
            head_dim: d,
            sec_scale: l.offsets[0],
            sec_zero: l.offsets.get(3).copied().unwrap_or(0),
            sec_index: l.offsets[1],
            page: i as u32,
            m_tokens: spec::magic(pg.tokens),
            upr: nc,
            m_upr: spec::magic(nc),
            side,
            aux: scratch + scratch_at[i],
            sec3: l.offsets[2],
            heads: info.heads,
            p0: s,
            p1: rb | u32::from(cells.is_some()) << 31,
            p2: u32::from(b) | u32::from(e) << 8 | u32::from(g) << 16 | u32::from(w) << 24,
            p3: o | u32::from(med) << 31,
        });
        if med {
            for plane in 0..planes as u32 {
                w0.push([i as u32, plane]);
            }
            w2.push([i as u32, 0]);
        }
        search
            .grid
            .push_items(i as u32, rows, pg.tokens, d, &mut w1);
        let words = (n * u64::from(e)).div_ceil(32)
            + (n.div_ceil(u64::from(g)) * u64::from(w)).div_ceil(32);
        let mut at = 0u64;
        while at < words {
            w3.push([i as u32, at as u32]);
            at += u64::from(BLOCK);
        }
        p.layouts.push((l, off));
    }
    let mut launches = vec![(search, w1)];
    if med {
        launches.insert(0, (kernel(format!("encode_hqmq_med_{sfx}"), items), w0));
        launches.push((kernel(format!("encode_hqmq_compact_{sfx}"), items), w2));
        p.trim = Some(MedTrim {
            e: u32::from(e),
            groups,
        });
    }
    launches.push((kernel("encode_hqmq_pack".into(), items), w3));
    for (kernel, items) in launches {
        p.works.push(EncWork {
            kernel,
            items,
            bits: None,
            h: None,
            c: None,
        });
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind};

    #[test]
    fn hqmq_plan_covers_every_row_and_word() {
        let info = TensorInfo {
            name: "t".into(),
            layer: 0,
            kind: Kind::Key,
            dtype: DType::Bf16,
            batch: 1,
            heads: 3,
            tokens: 70,
            head_dim: 64,
        };
        let c = crate::codec::parse("hqmq:s24r3").unwrap();
        let pages = [
            PlannedPage {
                tensor: 0,
                token_start: 0,
                tokens: 64,
                raw: false,
            },
            PlannedPage {
                tensor: 0,
                token_start: 64,
                tokens: 6,
                raw: false,
            },
        ];
        let mut placed = Vec::new();
        let l = plan(
            0x1000,
            &info,
            c.as_ref(),
            &pages,
            KernelOptions::default(),
            &mut |b| {
                placed.push(b.len());
                Ok(0x10_0000 * placed.len() as u64)
            },
        )
        .unwrap();
        assert_eq!(l.works.len(), 2);
        // 16 chunks per row, 16 rows per item: 3 planes x 4 items + 3 x 1.
        assert_eq!(l.works[0].items.len(), 12 + 3);
        assert_eq!(l.descs[1].aux, 0x20_0000 + 4 * 3 * 64 * 16);
        assert_eq!(placed, [3 * 25 * 24 * 16, 4 * 3 * 70 * 16]);
    }
}
