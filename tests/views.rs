//! Borrowed views (`kvpack::view`): compressing from memory in another axis
//! order gives the same file as compressing kvpack's own order, and
//! decoding into caller memory in any axis order gives the same elements as
//! the owned decode.

mod common;

use common::*;
use kvpack::cache::{DType, Elems, ElemsMut, KvCache, TensorData};
use kvpack::compress::{CompressOptions, compress, compress_view};
use kvpack::decode::{Archive, Destination, Selection};
use kvpack::plan::Layout;
use kvpack::view::{CacheView, Strides, TensorView, TensorViewMut};

/// `[b, h, t, d]` -> `[b, t, h, d]` copy of one tensor's elements.
fn to_token_major(c: &KvCache) -> Vec<TensorData> {
    c.tensors
        .iter()
        .map(|t| {
            let [b, h, n, d] = t.info.shape();
            let mut out = TensorData::zeros(t.info.dtype, t.data.len());
            let src = t.data.to_f32();
            let mut row = vec![0f32; d];
            for bi in 0..b {
                for hi in 0..h {
                    for ti in 0..n {
                        let s = ((bi * h + hi) * n + ti) * d;
                        row.copy_from_slice(&src[s..s + d]);
                        let o = ((bi * n + ti) * h + hi) * d;
                        out.as_elems_mut().store(o, &row);
                    }
                }
            }
            out
        })
        .collect()
}

fn token_major_view<'a>(c: &KvCache, data: &'a [TensorData]) -> CacheView<'a> {
    CacheView {
        tensors: c
            .tensors
            .iter()
            .zip(data)
            .map(|(t, d)| {
                TensorView::new(t.info.clone(), d.as_elems(), Strides::token_major(&t.info))
                    .unwrap()
            })
            .collect(),
        metadata: c.metadata.clone(),
        token_ids: c.token_ids.clone(),
    }
}

#[test]
fn token_major_view_compresses_to_the_same_file() {
    let spec = [
        LayerSpec {
            batch: 2,
            heads: 3,
            tokens: 70,
            head_dim: 64,
        },
        LayerSpec {
            batch: 1,
            heads: 2,
            tokens: 33,
            head_dim: 64,
        },
    ];
    let cache = synthetic(&spec, DType::Bf16, 5);
    let tm = to_token_major(&cache);
    let view = token_major_view(&cache, &tm);
    let opts = CompressOptions {
        layout: Layout {
            page_tokens: 16,
            sink: 4,
            recent: 8,
        },
        ..Default::default()
    };
    for codec in [
        "raw",
        "int4",
        "int3",
        "bdr64",
        "bdr16:k",
        "bdr8",
        "innerq:k2v2",
        "octopus:b3",
        "hqmq:s24r3",
    ] {
        let c = kvpack::codec::parse(codec).unwrap();
        let (a, _) = compress(&cache, c.as_ref(), &opts, Vec::new(), &|_| {}).unwrap();
        let (b, _) = compress_view(&view, c.as_ref(), &opts, Vec::new(), &|_| {}).unwrap();
        assert!(a == b, "{codec}: files differ");
    }
}

#[test]
fn decode_into_token_major_matches_owned_decode() {
    let fx = fixture().cache;
    let c = kvpack::codec::parse("bdr128").unwrap();
    let (file, _) = compress(
        &fx,
        c.as_ref(),
        &CompressOptions::default(),
        Vec::new(),
        &|_| {},
    )
    .unwrap();
    let ar = Archive::open(&file).unwrap();
    for (dtype, first) in [(DType::Bf16, 0u32), (DType::F32, 100)] {
        let owned = ar
            .decode(
                &Selection {
                    tokens: Some(first..u32::MAX),
                    ..Default::default()
                },
                Some(dtype),
                None,
            )
            .unwrap();
        // Token-major buffers, filled by decode_into.
        let mut bufs: Vec<TensorData> = owned
            .tensors
            .iter()
            .map(|t| TensorData::zeros(dtype, t.data.len()))
            .collect();
        let outs = owned
            .tensors
            .iter()
            .zip(bufs.iter_mut())
            .enumerate()
            .map(|(i, (t, b))| Destination {
                tensor: i,
                first_token: first,
                view: TensorViewMut::new(
                    t.info.clone(),
                    b.as_elems_mut(),
                    Strides::token_major(&t.info),
                )
                .unwrap(),
            })
            .collect();
        ar.decode_into(outs, None).unwrap();
        let want = to_token_major(&owned);
        assert!(bufs == want, "{dtype:?} from token {first}");
    }
}

#[test]
fn views_reject_short_buffers_and_overlap() {
    let fx = fixture().cache;
    let t = &fx.tensors[0];
    let short = &t.data.as_elems().slice(0, t.data.len() - 1);
    let e = TensorView::new(t.info.clone(), *short, Strides::head_major(&t.info)).unwrap_err();
    assert!(e.to_string().contains("the buffer holds"), "{e}");
    let mut buf = TensorData::zeros(t.info.dtype, t.data.len());
    let overlap = Strides {
        batch: 0,
        head: 0,
        token: 1,
    };
    let e = TensorViewMut::new(t.info.clone(), buf.as_elems_mut(), overlap).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    // Wrong dtype.
    let f32s = vec![0f32; t.data.len()];
    let e = TensorView::new(
        t.info.clone(),
        Elems::F32(&f32s),
        Strides::head_major(&t.info),
    )
    .unwrap_err();
    assert!(e.to_string().contains("declared"), "{e}");
    let mut f = vec![0f32; 4];
    let ar_file = compress_bytes(&fx, "raw", Layout::default(), None);
    let ar = Archive::open(&ar_file).unwrap();
    let mut info = t.info.clone();
    info.dtype = DType::F32;
    info.tokens = 1;
    info.head_dim = 4;
    let v = TensorViewMut::new(info, ElemsMut::F32(&mut f), Strides::head_major(&t.info));
    // head_dim mismatch is caught by decode_into, not by the view.
    let e = ar
        .decode_into(
            vec![Destination {
                tensor: 0,
                first_token: 0,
                view: v.unwrap(),
            }],
            None,
        )
        .unwrap_err();
    assert!(e.to_string().contains("shaped"), "{e}");
}

#[test]
fn max_compressed_size_bounds_every_codec_with_raw_fallback() {
    let fx = fixture().cache;
    let infos: Vec<_> = fx.tensors.iter().map(|t| t.info.clone()).collect();
    for codec in [
        "raw",
        "int4",
        "int8",
        "bdr128",
        "bdr64:k",
        "hqmq:s24r3",
        "hqmq:s96r4+med3",
        "hqmq:s5r2+med2",
        "innerq:k2v2",
        "octopus:b3",
        "turbo:b3",
        "polar:m4n4",
        "kivi:2",
        "octopus:b2+qjl:vg16",
        "turbo:b2+qjl:vg32",
    ] {
        let c = kvpack::codec::parse(codec).unwrap();
        for zstd in [None, Some(1)] {
            let opts = CompressOptions {
                raw_fallback: true,
                zstd_level: zstd,
                layout: Layout {
                    page_tokens: 64,
                    sink: 4,
                    recent: 16,
                },
                ..Default::default()
            };
            let bound = kvpack::compress::max_compressed_size(
                &infos,
                &fx.metadata,
                fx.token_ids.len(),
                c.as_ref(),
                &opts,
            )
            .unwrap();
            let (file, _) = compress(&fx, c.as_ref(), &opts, Vec::new(), &|_| {}).unwrap();
            assert!(
                file.len() as u64 <= bound,
                "{codec} zstd {zstd:?}: {} > bound {bound}",
                file.len()
            );
            if c.size_depends_only_on_shape() && zstd.is_none() {
                assert_eq!(file.len() as u64, bound, "{codec}: the bound is exact");
            }
        }
    }
}

#[test]
fn empty_tensors_are_valid_destinations() {
    // Regression: a layer with 0 tokens has zero strides, which the overlap
    // check took for aliasing.
    let info = kvpack::cache::TensorInfo {
        name: "t".into(),
        layer: 0,
        kind: kvpack::cache::Kind::Key,
        dtype: DType::F32,
        batch: 1,
        heads: 2,
        tokens: 0,
        head_dim: 8,
    };
    let mut none: Vec<f32> = Vec::new();
    TensorViewMut::new(
        info.clone(),
        ElemsMut::F32(&mut none),
        Strides::head_major(&info),
    )
    .unwrap();
}
