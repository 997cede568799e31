//! The image kernels against Pillow/numpy outputs made by fixtures/ops/make_fixtures.py.

use std::path::PathBuf;

use bytes::Bytes;
use serde_json::Value;
use stoker_api::{CenterCrop, DType, Normalize, Tensor};
use stoker_worker::ops::{self, OpError};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ops")
}

fn file(name: &str) -> Vec<u8> {
    std::fs::read(dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn meta(name: &str) -> Value {
    let all: Value = serde_json::from_slice(&file("fixtures.json")).unwrap();
    all[name].clone()
}

/// A fixture as a tensor, with the shape and dtype fixtures.json gives it.
fn fixture(name: &str) -> Tensor {
    let m = meta(name);
    let shape = m["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let dtype = match m["dtype"].as_str().unwrap() {
        "uint8" => DType::Uint8,
        "float32" => DType::Float32,
        other => panic!("{other}"),
    };
    Tensor::new(dtype, shape, Bytes::from(file(&format!("{name}.bin")))).unwrap()
}

/// (max, mean) absolute difference of two uint8 tensors of the same shape.
fn diff(got: &Tensor, want: &Tensor) -> (u8, f64) {
    assert_eq!((got.dtype, &got.shape), (want.dtype, &want.shape));
    let d: Vec<u8> = got.data.iter().zip(want.data.iter()).map(|(a, b)| a.abs_diff(*b)).collect();
    (d.iter().copied().max().unwrap_or(0), d.iter().map(|&v| f64::from(v)).sum::<f64>() / d.len() as f64)
}

#[test]
fn png_decodes_exactly() {
    // PNG is lossless: any difference is a bug.
    assert_eq!(ops::decode_image(&file("rgb.png"), 3).unwrap(), fixture("rgb"));
    assert_eq!(ops::decode_image(&file("grey.png"), 1).unwrap(), fixture("grey"));
    assert_eq!(ops::decode_image(&file("rgba.png"), 4).unwrap(), fixture("rgba"));
}

#[test]
fn png_channel_conversion_matches_pillow_convert() {
    // Pillow's convert uses the same integer formulas, so these are exact too.
    assert_eq!(ops::decode_image(&file("grey.png"), 3).unwrap(), fixture("grey_as_rgb"));
    assert_eq!(ops::decode_image(&file("rgb.png"), 1).unwrap(), fixture("rgb_as_grey"));
    assert_eq!(ops::decode_image(&file("rgba.png"), 3).unwrap(), fixture("rgb"));
}

#[test]
fn palette_png_expands_like_pillow() {
    // Palette lookup is exact.
    assert_eq!(ops::decode_image(&file("palette.png"), 3).unwrap(), fixture("palette_as_rgb"));
}

#[test]
fn grey_jpeg_decodes_as_pillow_does() {
    // Both are libjpeg-turbo with the accurate integer IDCT: the same pixels.
    let got = ops::decode_image(&file("grey_q90.jpg"), 1).unwrap();
    assert_eq!(diff(&got, &fixture("grey_q90_pillow")), (0, 0.0));
    let rgb = ops::decode_image(&file("grey_q90.jpg"), 3).unwrap();
    assert!(rgb.data.chunks_exact(3).zip(got.data.iter()).all(|(p, &g)| p == [g, g, g]));
}

#[test]
fn jpeg_decodes_as_pillow_does() {
    // libjpeg-turbo with the accurate integer IDCT and fancy chroma upsampling, as Pillow's
    // defaults: the same pixels.
    let got = ops::decode_image(&file("rgb_q90.jpg"), 3).unwrap();
    assert_eq!(diff(&got, &fixture("rgb_q90_pillow")), (0, 0.0));
    // Grey and RGBA outputs keep the same geometry.
    assert_eq!(ops::decode_image(&file("rgb_q90.jpg"), 1).unwrap().shape, vec![37, 53, 1]);
    let rgba = ops::decode_image(&file("rgb_q90.jpg"), 4).unwrap();
    assert_eq!(rgba.shape, vec![37, 53, 4]);
    assert!(rgba.data.chunks_exact(4).all(|p| p[3] == 255));
}

#[test]
fn resize_matches_pillow_bilinear() {
    // Same taps, fixed-point rounding and pass order as Pillow: expected bit-exact, and a
    // one-level slack would still flag any real divergence (wrong support, no antialias,
    // vertical-first) since those differ by many levels.
    let rgb = fixture("rgb");
    let cases = [
        ("rgb_resize_down", [20, 31]),
        ("rgb_resize_up", [61, 80]),
        ("rgb_resize_mixed", [50, 24]),
        ("rgb_resize_tiny", [3, 2]),
    ];
    for (name, size) in cases {
        let (max, mean) = diff(&ops::resize_exact(&rgb, size).unwrap(), &fixture(name));
        println!("{name}: max {max}, mean {mean:.4}");
        assert!(max <= 1, "{name}: max {max}, mean {mean}");
    }
    let (max, _) = diff(&ops::resize_exact(&fixture("grey"), [11, 17]).unwrap(), &fixture("grey_resize_down"));
    assert!(max <= 1, "grey: {max}");
    let shorter = ops::resize_shorter_side(&rgb, 24).unwrap();
    let (max, _) = diff(&shorter, &fixture("rgb_shorter_24"));
    assert!(max <= 1, "shorter side: {max}");
}

#[test]
fn crops_match_numpy_and_pillow() {
    // Pure indexing: exact.
    let rgb = fixture("rgb");
    let centered = ops::center_crop(&rgb, &CenterCrop { size: [20, 30], field: "image".into() }).unwrap();
    assert_eq!(centered, fixture("rgb_center_20x30"));
    // A resized crop is a crop then a Pillow resize: the resize tolerance applies.
    let b = &meta("rgb_resized_crop")["box"];
    let n = |k: &str| b[k].as_u64().unwrap() as usize;
    let cropped = ops::crop(&rgb, n("top"), n("left"), n("height"), n("width")).unwrap();
    let (max, _) = diff(&ops::resize_exact(&cropped, [16, 16]).unwrap(), &fixture("rgb_resized_crop"));
    assert!(max <= 1, "resized crop: {max}");
}

#[test]
fn normalize_matches_numpy() {
    // The reference is float64 math cast to float32, as is ours: allow one f32 rounding.
    let m = meta("rgb_normalized");
    let floats = |k: &str| m[k].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let op = Normalize { mean: floats("mean"), std: floats("std"), dtype: DType::Float32, field: "image".into() };
    let got = ops::normalize(&fixture("rgb"), &op).unwrap();
    let want = fixture("rgb_normalized");
    assert_eq!(got.shape, want.shape);
    let f = |t: &Tensor| t.data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect::<Vec<_>>();
    for (g, w) in f(&got).into_iter().zip(f(&want)) {
        assert!((g - w).abs() <= w.abs() * 1.2e-7, "{g} vs {w}");
    }
}

#[test]
fn corrupt_images_are_errors_not_panics() {
    let jpeg = file("rgb_q90.jpg");
    let png = file("rgb.png");
    // Every cut, down to dropping just the 2-byte end-of-image marker, is an error.
    for len in (0..jpeg.len()).step_by(7).chain([jpeg.len() - 2, jpeg.len() - 1]) {
        let result = ops::decode_image(&jpeg[..len], 3);
        assert!(matches!(result, Err(OpError::CorruptImage(_))), "jpeg cut at {len}: {:?}", result.map(|t| t.shape));
    }
    for len in [8, 30, png.len() / 2, png.len() - 12] {
        let result = ops::decode_image(&png[..len], 3);
        assert!(matches!(result, Err(OpError::CorruptImage(_))), "png cut at {len}: {:?}", result.map(|t| t.shape));
    }
    // Flipped bytes inside the entropy-coded data and random garbage behind a valid header:
    // any outcome but a panic is acceptable, since some damage decodes to a wrong picture.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..300 {
        let mut damaged = jpeg.clone();
        for _ in 0..4 {
            let i = 2 + (next() as usize) % (damaged.len() - 2);
            damaged[i] = next() as u8;
        }
        let _ = ops::decode_image(&damaged, 3);
        let mut garbage = vec![0xFF, 0xD8, 0xFF];
        garbage.extend((0..(next() % 2000)).map(|_| next() as u8));
        let _ = ops::decode_image(&garbage, 3);
        let mut png_garbage = png[..33].to_vec();
        png_garbage.extend((0..(next() % 500)).map(|_| next() as u8));
        assert!(ops::decode_image(&png_garbage, 3).is_err());
    }
    let random: Vec<u8> = (0..512).map(|_| next() as u8).collect();
    assert!(matches!(ops::decode_image(&random, 3), Err(OpError::CorruptImage(_))));
}
