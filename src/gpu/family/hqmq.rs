//! `hqmq` pages: f16 scale per row, low symbols and grouped high digits of
//! the joint codeword per 4-element chunk, optional outlier table and
//! per-channel gains or centring (`kernels/hqmq.cu`); the encoder, with and without outlier extraction
//! (`kernels/hqmq_enc.cu`, its search through the cell index of
//! `gpu::hqmq_cells`).

use crate::cache::TensorInfo;
use crate::codec::Codec;
use crate::codec::hqmq::codebook::{Codebook, secondaries};
use crate::codec::hqmq::{self, Channels, Hqmq};
use crate::error::{Error, Result};
use crate::format::{ElemType, PageView, Section, SectionKind};
use crate::kernels::radix::Groups;

use super::f32_bytes;
use super::{GpuFamily, OUTS, at, bad_params, offset, section};
use crate::gpu::body::{CanonicalBody, SectionSpec};
use crate::gpu::encplan::{
    EncWork, EncodeJob, EncodeLayout, Place, SectionCut, empty, page_rows, push_body,
};
use crate::gpu::hqmq_cells;
use crate::gpu::spec::{
    self, BLOCK, EncDesc, Grid, HQ_ITEM, KernelChoice, KernelCodec, KernelOptions, OutType,
    src_suffix,
};

/// Chunks per hqmq decode sub-block (`HQ_NPOS`): head_dim / 4 may not
/// exceed it.
pub const HQ_NPOS: u32 = 2048;
/// Largest joint codebook (bytes) the hqmq decode kernels keep in shared
/// memory (`24 S` float4; S <= 256). Larger ones are read through L1.
pub const HQ_SMEM_MAX: u32 = 24 * 256 * 16;

/// The hqmq family ([`KernelCodec::Hqmq`]).
pub(crate) struct Family;

/// `(s, b, e, g, w, o, med)` of an hqmq kernel codec.
fn fields(kc: KernelCodec) -> (u32, u8, u8, u8, u8, u32, bool) {
    let (s, b, e, g, w, o, med, _) = all_fields(kc);
    (s, b, e, g, w, o, med)
}

/// `(s, b, e, g, w, o, med, chan)` of an hqmq kernel codec.
fn all_fields(kc: KernelCodec) -> (u32, u8, u8, u8, u8, u32, bool, Channels) {
    let KernelCodec::Hqmq {
        s,
        b,
        e,
        g,
        w,
        o,
        med,
        chan,
    } = kc
    else {
        unreachable!("hqmq family")
    };
    (s, b, e, g, w, o, med, chan)
}

/// The packed `b | e << 8 | g << 16 | w << 24` descriptor word.
fn bits_word(b: u8, e: u8, g: u8, w: u8) -> u32 {
    u32::from(b) | u32::from(e) << 8 | u32::from(g) << 16 | u32::from(w) << 24
}

/// The codebook of kv head `head` of `t` for an hqmq codec of `seed`.
fn codebook(seed: u64, t: &TensorInfo, head: u32, s: u32) -> Codebook {
    Codebook::new(secondaries(seed, t.layer, head, t.kind, s as usize))
}

/// The hqmq encode side table of `t`: per kv head the `S` secondaries,
/// then the `24 S` joint codewords, float4 each.
///
/// # Errors
/// [`Error::Parameter`] when the codec's parameter block does not parse.
pub fn encode_table(codec: &dyn Codec, t: &TensorInfo, s: u32) -> Result<Vec<u8>> {
    let seed = Hqmq::from_params(&codec.params())?.seed;
    let mut out = Vec::new();
    for head in 0..t.heads {
        let cb = codebook(seed, t, head, s);
        for q in cb.secondary.iter().chain(&cb.joint) {
            out.extend_from_slice(&f32_bytes(q));
        }
    }
    Ok(out)
}

impl GpuFamily for Family {
    fn codec_ids(&self) -> &'static [u16] {
        &[hqmq::ID]
    }

    fn kernel_codec(&self, codec: &dyn Codec, _t: &TensorInfo) -> Result<KernelCodec> {
        let h = Hqmq::from_params(&codec.params())?;
        let (e, o) = hqmq::symbol_split(h.secondaries, h.radius_bits);
        Ok(KernelCodec::Hqmq {
            s: h.secondaries,
            b: h.radius_bits,
            e: e as u8,
            g: h.groups.digits as u8,
            w: h.groups.bits as u8,
            o: u32::try_from(o).map_err(|_| bad_params(codec))?,
            med: h.outlier_multiplier.is_some(),
            chan: h.channels,
        })
    }

    /// The page-specific parameter is the number of inlier chunks; the
    /// fifth section offset is SCALE stream 1's (gains, `+chan`; gains and
    /// offsets, `+ctr`), else 0.
    fn page_sections(
        &self,
        kc: KernelCodec,
        page: &PageView<'_>,
        t: &TensorInfo,
    ) -> Result<([u32; 5], u32)> {
        let (_, _, e, g, _, o, med, chan) = all_fields(kc);
        let rows = t.planes() * page.header.meta.tokens as usize;
        let groups = Groups::new(u64::from(o), u32::from(g))
            .ok_or_else(|| page.error("hqmq: invalid digit grouping"))?;
        let p = hqmq::page_layout(
            page,
            med,
            chan,
            t.planes(),
            u32::from(e),
            &groups,
            rows,
            t.head_dim as usize,
        )?;
        let table = if med {
            offset(page, SectionKind::Outliers, 0)
        } else {
            0
        };
        let s = [
            at(page, p.scales),
            at(page, p.low),
            at(page, p.high),
            table,
            if chan.has_gains() {
                at(page, p.gains)
            } else {
                0
            },
        ];
        Ok((s, p.n_in as u32))
    }

    fn decode_kernel(
        &self,
        kc: KernelCodec,
        head_dim: u32,
        out: OutType,
        opts: KernelOptions,
    ) -> Result<KernelChoice> {
        let (s, _, _, _, _, base, _, chan) = all_fields(kc);
        let o = out.suffix();
        if head_dim / 4 > HQ_NPOS {
            return Err(Error::Unsupported(format!(
                "GPU hqmq kernels handle head_dim up to {}, not {head_dim}",
                4 * HQ_NPOS
            )));
        }
        let ob = if matches!(base, 3 | 9) { base } else { 0 };
        let bytes = 24 * 16 * u64::from(s);
        let smem = bytes <= u64::from(HQ_SMEM_MAX) && !opts.global_hqmq_codebook;
        Ok(KernelChoice {
            source: "hqmq",
            name: format!(
                "decode_hqmq_o{ob}_{}{}_{o}",
                if smem { "s" } else { "g" },
                match chan {
                    Channels::Off => "",
                    Channels::Gains => "_c",
                    Channels::Centred => "_m",
                }
            ),
            grid: Grid::PlaneRows {
                tokens: HQ_ITEM,
                unit: 4,
            },
            shared: if smem { bytes as u32 } else { 0 },
        })
    }

    fn desc_params(&self, kc: KernelCodec, _head_dim: u32, extra: u32) -> [u32; 4] {
        let (s, b, e, g, w, o, _) = fields(kc);
        [s, bits_word(b, e, g, w), o, extra]
    }

    fn body_sections(
        &self,
        kc: KernelCodec,
        rows: u64,
        tokens: u64,
        d: u64,
    ) -> Result<Vec<SectionSpec>> {
        let (_, _, e, g, _, o, med, chan) = all_fields(kc);
        let n = rows * (d / 4);
        let groups = Groups::new(u64::from(o), u32::from(g))
            .ok_or_else(|| Error::param("hqmq parameters: invalid digit grouping"))?;
        let high = usize::try_from(n).map_or(u64::MAX, |n| groups.packed_len(n) as u64);
        let mut v = vec![section(SectionKind::Scale, 0, ElemType::F16, rows)?];
        if chan.has_gains() {
            // One gain (and with +ctr one offset) per plane and channel.
            let planes = rows / tokens.max(1);
            let per = if chan.has_offsets() { 2 * d } else { d };
            v.push(section(SectionKind::Scale, 1, ElemType::F16, planes * per)?);
        }
        v.extend([
            section(SectionKind::Index, 0, ElemType::Packed(e), n)?,
            section(SectionKind::Index, 1, ElemType::Bytes, high)?,
        ]);
        if med {
            // Bound (format/SPEC.md 6.5): every chunk an outlier, its
            // position in the bitmap (the writer never picks a longer
            // list), 8 bytes of values each.
            let table = 12 + n.div_ceil(8) + 8 * n;
            v.push(section(SectionKind::Outliers, 0, ElemType::Bytes, table)?);
        }
        Ok(v)
    }

    /// u64 `O^G` (0 when it is `2^64`), 8 zero bytes, then per kv head the
    /// `24 S` joint codewords (float4).
    fn side_table(
        &self,
        codec: &dyn Codec,
        kc: KernelCodec,
        t: &TensorInfo,
    ) -> Result<Option<Vec<u8>>> {
        let (s, _, _, g, _, o, _) = fields(kc);
        let limit = Groups::new(u64::from(o), u32::from(g))
            .map(|gr| gr.limit())
            .ok_or_else(|| Error::param("hqmq parameters: invalid digit grouping"))?;
        let seed = Hqmq::from_params(&codec.params())?.seed;
        let mut out = Vec::new();
        out.extend_from_slice(&u64::try_from(limit).unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&[0u8; 8]);
        for head in 0..t.heads {
            for q in &codebook(seed, t, head, s).joint {
                out.extend_from_slice(&f32_bytes(q));
            }
        }
        Ok(Some(out))
    }

    fn kernel_names(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        for out in OUTS {
            let o = out.suffix();
            for base in [0, 3, 9] {
                for m in ["s", "g", "s_c", "g_c", "s_m", "g_m"] {
                    v.push(("hqmq", format!("decode_hqmq_o{base}_{m}_{o}")));
                }
            }
        }
        for s in ["bf16", "f16", "f32"] {
            for k in ["", "med_", "compact_", "gains_"] {
                v.push(("hqmq_enc", format!("encode_hqmq_{k}{s}")));
            }
        }
        v.push(("hqmq_enc", "encode_hqmq_pack".to_string()));
        v.push(("hqmq_enc", "encode_hqmq_cells".to_string()));
        v
    }

    /// With and without outlier extraction (`+med`), per-channel gains
    /// (`+chan`) and centring (`+ctr`).
    fn encodes(&self, _kc: KernelCodec) -> bool {
        true
    }

    /// The search kernel (symbols to scratch, SCALE written) and the pack
    /// kernel (INDEX 0 and 1 from the symbols); with `+med{C}` the median
    /// kernel before them (per page plane `tau = C * med` into the page's
    /// scratch header) and the compaction kernel between them (inlier
    /// symbols to the front, the OUTLIERS table), on worst-case bodies cut
    /// by [`med_sections`]. For `S <=` [`hqmq_cells::MAX_S`] a setup
    /// launch builds the search's cell index once.
    fn plan_encode(&self, job: &EncodeJob<'_>, place: &mut dyn Place) -> Result<EncodeLayout> {
        let EncodeJob {
            src,
            info,
            codec,
            kc,
            pages,
            ..
        } = *job;
        let (s, b, e, g, w, o, med, chan) = all_fields(kc);
        let esize = info.dtype.size() as u64;
        let d = info.head_dim;
        let nc = d / 4;
        let planes = info.planes() as u64;
        let rb = (BLOCK / nc.max(1)).max(1);
        let groups = Groups::new(u64::from(o), u32::from(g)).expect("checked grouping");
        let c = Hqmq::from_params(&codec.params())?.outlier_multiplier;
        let mut table = encode_table(codec, info, s)?;
        let cells = hqmq_cells::grid(s).filter(|_| !pages.is_empty());
        let mut lists = 0;
        if let Some(gr) = cells {
            let (head, n) = hqmq_cells::region_head(gr, info.heads);
            table.extend_from_slice(&head);
            lists = n;
        }
        // The cell lists (zero until the setup launch fills them) are
        // cleared on the device, not uploaded.
        let side = place.place_padded(&table, table.len() + lists)?;
        drop(table);
        let mut p = empty();
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
        if let Some(gr) = cells {
            let boxes = u64::from(info.heads) * u64::from(gr).pow(3);
            p.setup.push(EncWork {
                kernel: kernel("encode_hqmq_cells".into(), items),
                items: (0..boxes)
                    .step_by(BLOCK as usize)
                    .map(|x| [0, x as u32])
                    .collect(),
                bits: None,
                h: None,
                c: None,
            });
        }
        // Per page: u32 symbols, then with +med the header (u32 n_out, f32
        // C, f32 tau per plane), then with +chan the f32 gains (+ctr: per
        // plane the gains then the offsets). Without +med nothing in it is
        // read before the kernels write it: zeroed on the device, not
        // uploaded.
        let side_rows = usize::from(chan.has_gains()) + usize::from(chan.has_offsets());
        let header = if med { 8 + 4 * planes as usize } else { 0 }
            + 4 * side_rows * planes as usize * d as usize;
        let mut scratch_at = Vec::with_capacity(pages.len());
        let mut len = 0usize;
        for pg in pages {
            scratch_at.push(len as u64);
            len += 4 * page_rows(info, pg)? as usize * nc as usize + header;
        }
        let scratch = if med {
            // Each page header's C (the rest is zero).
            let at = pages
                .iter()
                .zip(&scratch_at)
                .map(|(pg, &at)| {
                    Ok(at as usize + 4 * page_rows(info, pg)? as usize * nc as usize + 4)
                })
                .collect::<Result<Vec<_>>>()?;
            place.zeroed_with(len.max(4), c.unwrap_or(1.0).to_bits(), &at)?
        } else {
            place.zeroed(len.max(4))?
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
            let mut specs = vec![spec(SectionKind::Scale, 0, ElemType::F16, rows, 2 * rows)];
            let gains = count(side_rows as u64 * planes * u64::from(d))?;
            if chan.has_gains() {
                specs.push(spec(SectionKind::Scale, 1, ElemType::F16, gains, 2 * gains));
            }
            specs.extend([
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
            ]);
            if med {
                // The most outliers: planes * floor(N / 2) (kernel header).
                let cap = planes * (u64::from(pg.tokens) * u64::from(nc) / 2);
                let len = count(12 + n.div_ceil(8) + 8 * cap)?;
                specs.push(spec(SectionKind::Outliers, 0, ElemType::Bytes, len, len));
            }
            let l = CanonicalBody::new(specs)?;
            let off = push_body(&mut p.host_len, &l);
            // The source counted once (the gains kernel reads it again), as
            // for the copy kernel it is compared with.
            p.read += u64::from(rows) * u64::from(d) * esize;
            p.written += u64::from(2 * rows) + 2 * u64::from(gains) + low_len + high_len;
            let k = usize::from(chan.has_gains());
            p.descs.push(EncDesc {
                src: src + u64::from(pg.token_start) * u64::from(d) * esize,
                body: off as u64,
                stride: u64::from(info.tokens) * u64::from(d),
                rows,
                tokens: pg.tokens,
                head_dim: d,
                sec_scale: l.offsets[0],
                sec_zero: l.offsets.get(3 + k).copied().unwrap_or(0),
                sec_index: l.offsets[1 + k],
                page: i as u32,
                m_tokens: spec::magic(pg.tokens),
                upr: nc,
                m_upr: spec::magic(nc),
                side,
                aux: scratch + scratch_at[i],
                sec3: l.offsets[2 + k],
                heads: info.heads,
                p0: s,
                p1: rb | u32::from(cells.is_some()) << 31,
                p2: bits_word(b, e, g, w),
                p3: o
                    | u32::from(chan.has_offsets()) << 29
                    | u32::from(chan.has_gains()) << 30
                    | u32::from(med) << 31,
            });
            if med || chan.has_gains() {
                for plane in 0..planes as u32 {
                    w0.push([i as u32, plane]);
                }
            }
            if med {
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
            launches.insert(
                0,
                (kernel(format!("encode_hqmq_med_{sfx}"), items), w0.clone()),
            );
            launches.push((kernel(format!("encode_hqmq_compact_{sfx}"), items), w2));
            p.cut = Some(SectionCut {
                cut: med_sections,
                args: [u64::from(e), u64::from(o), u64::from(g), 0],
            });
        }
        if chan.has_gains() {
            // The gains (and offsets) first: every later kernel applies them.
            launches.insert(0, (kernel(format!("encode_hqmq_gains_{sfx}"), items), w0));
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
}

/// The sections of an `hqmq+med{C}` body written in the worst-case layout
/// `l` (SCALE, with `+chan` or `+ctr` SCALE 1, INDEX 0 and INDEX 1 for every chunk an
/// inlier, OUTLIERS for
/// the most outliers a lower median allows), `args = [E, O, G, 0]`: the
/// outlier count `n_out` is the first u32 of the OUTLIERS table the device
/// wrote, so INDEX 0 is cut to `n - n_out` codes of `E` bits, INDEX 1 to
/// the digit groups of `n - n_out` digits and OUTLIERS to its table.
///
/// # Errors
/// [`Error::Parameter`] (internal) when the count exceeds the chunks or
/// the table space, or the grouping is invalid.
///
/// # Panics
/// If `body` is shorter than `l.body_len` or `l` has other than 4 or 5
/// sections.
pub(crate) fn med_sections(l: &CanonicalBody, body: &[u8], args: [u64; 4]) -> Result<Vec<Section>> {
    let [e, o, g, _] = args;
    let groups =
        Groups::new(o, g as u32).ok_or_else(|| Error::param("internal: hqmq digit grouping"))?;
    assert!(matches!(l.specs.len(), 4 | 5), "hqmq+med layout");
    // With +chan or +ctr SCALE 1 sits between SCALE 0 and INDEX 0.
    let k = l.specs.len() - 4;
    let n = l.specs[1 + k].count as usize;
    let t = l.offsets[3 + k] as usize;
    let n_out = u32::from_le_bytes(body[t..t + 4].try_into().expect("4 bytes")) as usize;
    let bitmap = n.div_ceil(8);
    let pos = if 4 * n_out <= bitmap {
        4 * n_out
    } else {
        bitmap
    };
    let table = 12 + pos + 8 * n_out;
    if n_out > n || table > l.specs[3 + k].len as usize {
        return Err(Error::param(format!(
            "internal: GPU hqmq outlier count {n_out} of {n} chunks"
        )));
    }
    // Only the bytes the cut keeps are copied.
    let n_in = n - n_out;
    let low = crate::kernels::bitpack::packed_len(n_in, e as u32);
    let high = groups.packed_len(n_in);
    let mut keep = vec![(l.specs[0].count, l.specs[0].len as usize)];
    if k == 1 {
        keep.push((l.specs[1].count, l.specs[1].len as usize));
    }
    keep.extend([
        (n_in as u32, low),
        (high as u32, high),
        (table as u32, table),
    ]);
    Ok(l.specs
        .iter()
        .zip(&l.offsets)
        .zip(keep)
        .map(|((s, &at), (count, len))| Section {
            kind: s.kind,
            stream: s.stream,
            elem: s.elem,
            count,
            data: body[at as usize..at as usize + len].to_vec(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{DType, Kind};
    use crate::plan::PlannedPage;

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
        let mut placed = crate::gpu::encplan::Counting::default();
        let l = super::super::plan_encode(
            0x1000,
            &info,
            c.as_ref(),
            &pages,
            KernelOptions::default(),
            &mut placed,
        )
        .unwrap();
        assert_eq!(l.works.len(), 2);
        // 16 chunks per row, 16 rows per item: 3 planes x 4 items + 3 x 1.
        assert_eq!(l.works[0].items.len(), 12 + 3);
        assert_eq!(l.descs[1].aux, 0x20_0000 + 4 * 3 * 64 * 16);
        // The codebooks then the cell index (grid 20 for S = 24), the
        // scratch; the cell build covers 3 heads x 20^3 boxes.
        let region = hqmq_cells::region(20, 3).len();
        assert_eq!(placed.sizes, [3 * 25 * 24 * 16 + region, 4 * 3 * 70 * 16]);
        assert_eq!(l.setup.len(), 1);
        assert_eq!(
            l.setup[0].items.len(),
            (3 * 20 * 20 * 20usize).div_ceil(256)
        );
        assert_eq!(l.descs[0].p1 >> 31, 1);
    }
}
