//! The one backend trait of the GPU layer and the device-independent
//! steps built on it: a [`Backend`] places bytes in device memory, runs
//! kernel launches and reads bytes back; CUDA (`gpu::cuda`, feature
//! `cuda`) and the SIMT emulator (`gpu::emu`, always built) implement it.
//! What to place and launch is planned here and in `gpu::decplan` /
//! `gpu::encplan` / `gpu::family`, identically for both.

use std::collections::BTreeMap;

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::decode::Archive;
use crate::error::{Error, Result};
use crate::plan::PlannedPage;

use super::body::CanonicalBody;
use super::decplan::{Args, BODY_ALIGN, Staged, add_page, group_args, pack_groups};
use super::encplan::{EncodeLayout, Place};
use super::spec::{DstSpec, KernelChoice, KernelOptions, OutType, PageGeom};

/// One kernel launch: `blocks` blocks of `kernel` over the descriptors at
/// `descs` and the `(descriptor, first unit)` work items at `work`
/// (device addresses), with the optional arguments `args`.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub kernel: KernelChoice,
    pub descs: u64,
    pub work: u64,
    pub blocks: u32,
    pub args: Args,
}

/// Device memory and kernel launches, as the planning needs them.
/// Placing memory ([`Place`]) is the supertrait.
pub(crate) trait Backend: Place {
    /// Runs `launches` in order (a launch sees the writes of the ones
    /// before it).
    ///
    /// # Errors
    /// [`Error::Device`] when a kernel cannot be built or fails.
    fn launch(&mut self, launches: &[Launch]) -> Result<()>;

    /// Copies `len` bytes at device address `addr` (inside one placed
    /// buffer) back to the host, after the launches have finished.
    ///
    /// # Errors
    /// [`Error::Device`] for a failed copy or kernel.
    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>>;
}

/// Places staged pages: their bodies, then the side tables of their
/// `(codec, tensor)` pairs, in one buffer. Returns each page's
/// `(tensor, geometry with its side-table address, body address)` and the
/// buffer's address and length.
///
/// # Errors
/// As [`super::side::for_archive`] and [`Place::place`].
#[allow(clippy::type_complexity)]
pub(crate) fn place_pages(
    b: &mut dyn Backend,
    archive: &Archive<'_>,
    staged: &[Staged<'_>],
) -> Result<(Vec<(u32, PageGeom, u64)>, u64, usize)> {
    let mut offsets = Vec::with_capacity(staged.len());
    let mut total = 0usize;
    for s in staged {
        offsets.push(total);
        total += s.view.body().len().next_multiple_of(BODY_ALIGN);
    }
    // Side tables (codebooks, signs, factors) after the bodies.
    let (tables, at) =
        super::side::for_archive(archive, staged.iter().map(|s| (s.codec, s.tensor)))?;
    let side0 = total;
    total += tables.len().next_multiple_of(BODY_ALIGN);
    let mut host = vec![0u8; total.max(BODY_ALIGN)];
    for (s, &o) in staged.iter().zip(&offsets) {
        let body = s.view.body();
        host[o..o + body.len()].copy_from_slice(body);
    }
    host[side0..side0 + tables.len()].copy_from_slice(&tables);
    let base = b.place(&host)?;
    let pages = staged
        .iter()
        .zip(&offsets)
        .map(|(s, &o)| {
            let mut g = s.geom;
            if let Some(&t) = at.get(&(s.codec, s.tensor)) {
                g.side = base + (side0 as u64) + t;
            }
            (s.tensor, g, base + o as u64)
        })
        .collect();
    Ok((pages, base, host.len()))
}

/// A planned decode on a backend: its launches, the address of its two
/// status words ([`super::decplan::check_status`]) and the bytes its
/// kernels read and write.
pub(crate) struct PlacedDecode {
    pub launches: Vec<Launch>,
    pub status: u64,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub read: u64,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub written: u64,
}

/// Plans the decode of every placed page (of [`place_pages`]) whose tensor
/// has a destination in `by_tensor`: descriptors grouped by kernel, the
/// tables and the status words placed on `b`.
///
/// # Errors
/// [`Error::Parameter`] for a destination too small for its tensor;
/// [`Error::Unsupported`] for a shape no kernel takes; as
/// [`Place::place`].
pub(crate) fn place_decode(
    b: &mut dyn Backend,
    pages: &[(u32, PageGeom, u64)],
    by_tensor: &BTreeMap<u32, DstSpec>,
    out: OutType,
    opts: KernelOptions,
) -> Result<PlacedDecode> {
    let mut groups = BTreeMap::new();
    let (mut read, mut written) = (0, 0);
    for (tensor, g, body) in pages {
        if let Some(dst) = by_tensor.get(tensor) {
            let (r, w) = add_page(&mut groups, g, *body, dst, out, opts)?;
            read += r;
            written += w;
        }
    }
    let mut bytes = Vec::new();
    let packed = pack_groups(groups, &mut bytes);
    let table = b.place(&bytes)?;
    let status = b.place(&[0xff; 16])?;
    let launches = packed
        .iter()
        .map(|(key, d, w, blocks)| Launch {
            kernel: key.0.clone(),
            descs: table + *d as u64,
            work: table + *w as u64,
            blocks: *blocks,
            args: group_args(key, status),
        })
        .collect();
    Ok(PlacedDecode {
        launches,
        status,
        read,
        written,
    })
}

/// A planned encode on a backend: each page's body layout and its offset
/// in the bodies buffer at `bodies` (`bodies_len` bytes), the launches, the
/// status word's address and the bytes the kernels read and write.
pub(crate) struct PlacedEncode {
    pub layouts: Vec<(CanonicalBody, usize)>,
    /// The cut of data-dependent bodies ([`super::encplan::sections`]).
    pub cut: Option<super::encplan::SectionCut>,
    /// The first `setup` launches run once, before the first encode (the
    /// layout's `setup` works); the rest are the encode.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub setup: usize,
    pub bodies: u64,
    pub bodies_len: usize,
    pub launches: Vec<Launch>,
    pub status: u64,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub read: u64,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub written: u64,
}

/// Plans the encode of `pages` of `info` (source at device address `src`)
/// with `codec` ([`super::family::plan_encode`]) and places the bodies
/// buffer (zeroed on the device), descriptors, work lists, scratch, side
/// tables and the status word on `b`.
///
/// # Errors
/// As [`super::family::plan_encode`] and [`Place::place`].
pub(crate) fn place_encode(
    b: &mut dyn Backend,
    src: u64,
    info: &TensorInfo,
    codec: &dyn Codec,
    pages: &[PlannedPage],
    opts: KernelOptions,
) -> Result<PlacedEncode> {
    let layout = super::family::plan_encode(src, info, codec, pages, opts, b)?;
    place_layout(b, layout)
}

/// Places a planned encode layout on `b` ([`place_encode`] after the
/// planning).
///
/// # Errors
/// As [`Place::place`].
fn place_layout(b: &mut dyn Backend, mut layout: EncodeLayout) -> Result<PlacedEncode> {
    let bodies_len = layout.host_len.max(BODY_ALIGN);
    let bodies = b.zeroed(bodies_len)?;
    for d in &mut layout.descs {
        d.body += bodies;
    }
    let mut table: Vec<u8> = bytemuck::cast_slice(&layout.descs).to_vec();
    let mut works = Vec::new();
    let setup = layout.setup.len();
    let all: Vec<_> = std::mem::take(&mut layout.setup)
        .into_iter()
        .chain(std::mem::take(&mut layout.works))
        .collect();
    for w in &all {
        table.resize(table.len().next_multiple_of(BODY_ALIGN).max(BODY_ALIGN), 0);
        works.push(table.len());
        table.extend_from_slice(bytemuck::cast_slice(&w.items));
    }
    let t = b.place(&table)?;
    let status = b.place(&[0xff; 8])?;
    let launches = all
        .into_iter()
        .zip(works)
        .map(|(w, at)| Launch {
            blocks: w.items.len() as u32,
            kernel: w.kernel,
            descs: t,
            work: t + at as u64,
            args: Args {
                bits: w.bits,
                h: w.h,
                c: w.c,
                status,
            },
        })
        .collect();
    Ok(PlacedEncode {
        layouts: layout.layouts,
        cut: layout.cut,
        setup,
        bodies,
        bodies_len,
        launches,
        status,
        read: layout.read,
        written: layout.written,
    })
}

/// The InnerQ key statistics of the key tensor `info` (source at device
/// address `src`) over its body pages `pages` on `b`: the section bytes of
/// `family::group_enc::plan_key_amax` (f32 bits of `max |x|` per kv head
/// and channel), launched, checked and read back.
///
/// # Errors
/// [`Error::Parameter`] naming the row of a NaN or infinity; as
/// [`Place::place`], [`Backend::launch`] and [`Backend::read`].
pub(crate) fn key_amax(
    b: &mut dyn Backend,
    src: u64,
    info: &TensorInfo,
    pages: &[PlannedPage],
) -> Result<Vec<u8>> {
    let layout = super::family::group_enc::plan_key_amax(src, info, pages)?;
    let plan = place_layout(b, layout)?;
    b.launch(&plan.launches)?;
    let s = b.read(plan.status, 8)?;
    check_encode_status(
        u64::from_le_bytes(s[..8].try_into().expect("8 bytes")),
        info,
        pages,
    )?;
    let bodies = b.read(plan.bodies, plan.bodies_len)?;
    let (l, off) = &plan.layouts[0];
    let mut sections = l.sections(&bodies[*off..*off + l.body_len as usize]);
    Ok(sections.pop().map(|s| s.data).unwrap_or_default())
}

/// Checks the status word of an encode of `pages` of `info`: `u64::MAX`,
/// or `(page << 32) | row` of the first row holding a value the codec
/// cannot encode.
///
/// # Errors
/// [`Error::Parameter`] naming that row (plane and token).
pub(crate) fn check_encode_status(s: u64, info: &TensorInfo, pages: &[PlannedPage]) -> Result<()> {
    if s == u64::MAX {
        return Ok(());
    }
    let (page, row) = ((s >> 32) as usize, (s & 0xffff_ffff) as u32);
    let p = &pages[page.min(pages.len() - 1)];
    Err(Error::param(format!(
        "{} ({}) plane {} token {}: non-finite value (NaN or inf), or a value the codec \
         cannot represent, in a row to quantize",
        info.name,
        info.describe(),
        row / p.tokens,
        p.token_start + row % p.tokens
    )))
}
