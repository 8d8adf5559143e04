//! HQMQ names (`hqmq:s96r4+med3:seed7`) and the 24-byte parameter block
//! (format/codecs/hqmq.md "Parameter block").

use crate::error::{Error, Result};
use crate::kernels::radix::Groups;

use super::super::Codec;
use super::{Channels, Hqmq};

/// Parameter block length in bytes.
pub const PARAMS_LEN: usize = 24;
/// Flag bit 0: Med-C outlier extraction.
const FLAG_OUTLIERS: u8 = 1;
/// Flag bit 1: per-channel gains (`+chan`).
const FLAG_CHANNELS: u8 = 2;
/// Flag bit 2: per-channel centring (`+ctr`); never with bit 1.
const FLAG_CENTRED: u8 = 4;

/// Canonical name: `hqmq:s{S}r{b}`, then `+med{C}` with outliers, `+chan`
/// with channel gains or `+ctr` with centring, then `:seed{N}` for a non-zero seed and `:g{G}` for a non-default grouping.
pub(super) fn name(h: &Hqmq) -> String {
    let mut n = format!("hqmq:s{}r{}", h.secondaries, h.radius_bits);
    if let Some(c) = h.outlier_multiplier {
        n.push_str(&format!("+med{c}"));
    }
    match h.channels {
        Channels::Off => {}
        Channels::Gains => n.push_str("+chan"),
        Channels::Centred => n.push_str("+ctr"),
    }
    if h.seed != 0 {
        n.push_str(&format!(":seed{}", h.seed));
    }
    if h.groups != Groups::best(h.split().1) {
        n.push_str(&format!(":g{}", h.groups.digits));
    }
    n
}

/// The parameter block (all integers little-endian):
///
/// | off | size | field |
/// |---|---|---|
/// | 0 | 4 | `S`, u32 |
/// | 4 | 1 | radius bits `b` |
/// | 5 | 1 | digits per group `G` |
/// | 6 | 1 | flags (bit 0: outlier extraction; bit 1: channel gains; bit 2: centring) |
/// | 7 | 1 | reserved, 0 |
/// | 8 | 4 | `C`, f32 (0 without outliers) |
/// | 12 | 4 | reserved, 0 |
/// | 16 | 8 | seed, u64 |
pub(super) fn to_bytes(h: &Hqmq) -> Vec<u8> {
    let mut p = Vec::with_capacity(PARAMS_LEN);
    p.extend_from_slice(&h.secondaries.to_le_bytes());
    p.push(h.radius_bits);
    p.push(h.groups.digits as u8);
    let mut flags = 0;
    if h.outlier_multiplier.is_some() {
        flags |= FLAG_OUTLIERS;
    }
    flags |= match h.channels {
        Channels::Off => 0,
        Channels::Gains => FLAG_CHANNELS,
        Channels::Centred => FLAG_CENTRED,
    };
    p.push(flags);
    p.push(0);
    p.extend_from_slice(&h.outlier_multiplier.unwrap_or(0.0).to_le_bytes());
    p.extend_from_slice(&[0; 4]);
    p.extend_from_slice(&h.seed.to_le_bytes());
    p
}

/// Parses the parameter block (format/codecs/hqmq.md): the codec's one
/// reader of it, used by its registry entry and the GPU staging.
///
/// # Errors
/// [`Error::Parameter`] for a wrong length, reserved bytes or unknown flag
/// bits set, flag bits 1 and 2 both set, or any field out of range.
pub(crate) fn from_params(p: &[u8]) -> Result<Hqmq> {
    if p.len() != PARAMS_LEN {
        return Err(Error::param(format!(
            "hqmq parameters are {PARAMS_LEN} bytes, found {}",
            p.len()
        )));
    }
    let u32_at = |o: usize| u32::from_le_bytes(p[o..o + 4].try_into().expect("4 bytes"));
    let (s, b, g, flags) = (u32_at(0), p[4], p[5], p[6]);
    if p[7] != 0 || u32_at(12) != 0 || flags & !(FLAG_OUTLIERS | FLAG_CHANNELS | FLAG_CENTRED) != 0
    {
        return Err(Error::param(format!(
            "hqmq parameters have reserved bytes or flag bits set: {p:02x?}"
        )));
    }
    let channels = match (flags & FLAG_CHANNELS != 0, flags & FLAG_CENTRED != 0) {
        (false, false) => Channels::Off,
        (true, false) => Channels::Gains,
        (false, true) => Channels::Centred,
        (true, true) => {
            return Err(Error::param(
                "hqmq parameters: flag bits 1 (+chan) and 2 (+ctr) are both set; a codec has \
                 at most one channel treatment",
            ));
        }
    };
    let c = f32::from_bits(u32_at(8));
    let multiplier = if flags & FLAG_OUTLIERS != 0 {
        Some(c)
    } else if c.to_bits() != 0 {
        return Err(Error::param(
            "hqmq parameters: C must be 0 without outlier extraction",
        ));
    } else {
        None
    };
    let seed = u64::from_le_bytes(p[16..24].try_into().expect("8 bytes"));
    if !(1..=8).contains(&b) || !(1..=super::MAX_S).contains(&s) {
        return Err(Error::param(format!(
            "hqmq parameters out of range: S = {s}, b = {b}"
        )));
    }
    let base = super::symbol_split(s, b).1;
    let groups = Groups::new(base, u32::from(g)).ok_or_else(|| {
        Error::param(format!(
            "hqmq parameters: {g} digits per group is not valid for base {base}"
        ))
    })?;
    Ok(Hqmq::with_groups(s, b, multiplier, seed, groups)?.with_channels(channels))
}

/// Registry parser: `None` unless the name starts with `hqmq`.
pub(super) fn parse_family(s: &str) -> Option<Result<Box<dyn Codec>>> {
    if !s.starts_with("hqmq") {
        return None;
    }
    Some(parse_name(s).map(|h| Box::new(h) as Box<dyn Codec>))
}

/// Parses `hqmq:s{S}r{b}[+med{C}][+chan|+ctr][:seed{N}][:g{G}]`.
///
/// # Errors
/// [`Error::Parameter`] with the expected syntax.
pub fn parse_name(s: &str) -> Result<Hqmq> {
    let bad = |why: &str| {
        Error::param(format!(
            "{s:?}: {why}; HQMQ names look like hqmq:s96r4, hqmq:s96r4+med3, \
             hqmq:s24r3+chan, hqmq:s48r4+ctr or hqmq:s24r3:seed7 (S >= 1 secondary \
             codewords, 1 to 8 radius bits, optional Med-C outlier extraction, optional \
             per-channel gains or centring, optional codebook seed)"
        ))
    };
    let rest = s
        .strip_prefix("hqmq:")
        .ok_or_else(|| bad("missing the configuration"))?;
    let mut parts = rest.split(':');
    let main = parts.next().unwrap_or("");
    let mut plus = main.split('+');
    let core = plus.next().unwrap_or("");
    let (mut med, mut channels) = (None, Channels::Off);
    for opt in plus {
        match opt {
            "chan" if channels == Channels::Off => channels = Channels::Gains,
            "ctr" if channels == Channels::Off => channels = Channels::Centred,
            _ if opt.starts_with("med") && med.is_none() && channels == Channels::Off => {
                med = Some(opt)
            }
            _ => {
                return Err(bad(&format!(
                    "unknown or repeated option +{opt} (options: +med{{C}}, then one of +chan \
                     and +ctr)"
                )));
            }
        }
    }
    let (sv, rv) = core
        .strip_prefix('s')
        .and_then(|c| c.split_once('r'))
        .ok_or_else(|| bad("expected s{S}r{b}"))?;
    let secondaries: u32 = sv.parse().map_err(|_| bad("S is not a number"))?;
    let radius_bits: u8 = rv.parse().map_err(|_| bad("b is not a number"))?;
    let multiplier = match med {
        None => None,
        Some(m) => Some(
            m.strip_prefix("med")
                .and_then(|c| c.parse::<f32>().ok())
                .ok_or_else(|| bad("the outlier option is +med{C}, e.g. +med3"))?,
        ),
    };
    let mut seed = 0u64;
    let mut digits = None;
    for opt in parts {
        if let Some(v) = opt.strip_prefix("seed") {
            seed = v
                .parse()
                .map_err(|_| bad("the seed is a number, e.g. :seed7"))?;
        } else if let Some(v) = opt.strip_prefix('g') {
            digits = Some(v.parse::<u32>().map_err(|_| bad("bad :g{G}"))?);
        } else {
            return Err(bad(&format!("unknown option {opt:?}")));
        }
    }
    let h =
        Hqmq::new(secondaries, radius_bits, multiplier, seed).map_err(|e| bad(&e.to_string()))?;
    let h = match digits {
        None => h,
        Some(g) => {
            let base = h.split().1;
            let groups = Groups::new(base, g)
                .ok_or_else(|| bad(&format!("{g} digits per group do not fit 64 bits")))?;
            Hqmq::with_groups(secondaries, radius_bits, multiplier, seed, groups)?
        }
    };
    Ok(h.with_channels(channels))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{from_entry, parse};
    use crate::format::CodecEntry;

    #[test]
    fn names_round_trip() {
        for n in [
            "hqmq:s24r3",
            "hqmq:s96r4",
            "hqmq:s96r4+med3",
            "hqmq:s192r6+med3",
            "hqmq:s1r1",
            "hqmq:s100r8+med2.5",
            "hqmq:s48r4:seed1337",
            "hqmq:s96r4+med3:seed42:g5",
            "hqmq:s24r3+chan",
            "hqmq:s96r4+med3+chan:seed3",
            "hqmq:s48r4+ctr",
            "hqmq:s12r2+med4+ctr:seed2",
        ] {
            let c = parse(n).unwrap();
            assert_eq!(c.name(), n);
            assert_eq!(c.params().len(), PARAMS_LEN);
            let back = from_entry(
                0,
                &CodecEntry {
                    id: c.id(),
                    params: c.params(),
                },
            )
            .unwrap();
            assert_eq!(back.name(), n);
            assert_eq!(back.params(), c.params());
        }
    }

    #[test]
    fn bad_names_and_params_are_rejected() {
        for n in [
            "hqmq",
            "hqmq:",
            "hqmq:s0r4",
            "hqmq:s96r0",
            "hqmq:s96r9",
            "hqmq:s65537r4",
            "hqmq:s96",
            "hqmq:s96r4+med",
            "hqmq:s96r4+med0.5",
            "hqmq:s96r4+mad3",
            "hqmq:s96r4:seedx",
            "hqmq:s96r4:g30",
            "hqmq:s96r4:z",
            "hqmq:s96r4+chan+med3",
            "hqmq:s96r4+chan+chan",
            "hqmq:s96r4+chan+ctr",
            "hqmq:s96r4+ctr+chan",
            "hqmq:s96r4+ctr+med3",
            "hqmq:s96r4+med3+med3",
            "hqmq:s96r4+chans",
        ] {
            assert!(parse(n).is_err(), "{n}");
        }
        let good = parse("hqmq:s96r4+med3").unwrap().params();
        for (i, v) in [
            (4, 0u8),
            (5, 0),
            (5, 21),
            (6, 4),
            (6, 6),
            (6, 7),
            (6, 8),
            (6, 0x80),
            (7, 1),
            (12, 1),
            (0, 0),
        ] {
            let mut p = good.clone();
            p[i] = v;
            if i == 0 {
                p[1] = 0; // S = 0
            }
            assert!(from_params(&p).is_err(), "byte {i} = {v}");
        }
        let mut no_flag = good.clone();
        no_flag[6] = 0; // C set without the flag
        assert!(from_params(&no_flag).is_err());
        assert!(from_params(&good[..23]).is_err());
    }
}
