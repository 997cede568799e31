//! A deterministic ImageNet-like corpus for tests and benchmarks: `<root>/<label>/<n>.jpg`,
//! sides of 250-500 px, JPEG quality 90 (about 100 KB each). The content is fractal value noise
//! with a per-class palette, a few shapes and pixel grain: smooth regions and fine detail, so JPEG sizes
//! and decode costs resemble photographs, unlike flat or white-noise images. Tests and
//! benchmarks run `resnet50_train` over it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use jpeg_encoder::{ColorType, Encoder};
use stoker_api::{
    DType, DataPlaneSpec, DecodeImage, Normalize, OnError, RandomFlip, RandomResizedCrop, Source, SourceFormat,
    Transform, WorkerPipeline,
};

use crate::shuffle::SplitMix64;

#[derive(Clone, Debug)]
pub struct CorpusSpec {
    pub images: usize,
    pub classes: usize,
    pub seed: u64,
    pub min_side: u32,
    pub max_side: u32,
    pub quality: u8,
}

impl Default for CorpusSpec {
    fn default() -> Self {
        CorpusSpec { images: 1000, classes: 10, seed: 1, min_side: 250, max_side: 500, quality: 90 }
    }
}

/// Writes the corpus under `root` and returns the files written, in order. Image `i` is the
/// same bytes for the same spec on every machine.
pub fn generate(root: &Path, spec: &CorpusSpec) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::with_capacity(spec.images);
    for i in 0..spec.images {
        let class = i % spec.classes.max(1);
        let dir = root.join(format!("class{class:04}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(format!("{i:07}.jpg"));
        let jpeg = image_jpeg(spec, i as u64, class as u64)?;
        std::fs::write(&path, jpeg).with_context(|| format!("writing {}", path.display()))?;
        files.push(path);
    }
    Ok(files)
}

/// One image as JPEG bytes.
pub fn image_jpeg(spec: &CorpusSpec, index: u64, class: u64) -> anyhow::Result<Vec<u8>> {
    let mut rng = SplitMix64::new(spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index);
    let span = (spec.max_side - spec.min_side + 1) as usize;
    let w = spec.min_side + rng.below(span) as u32;
    let h = spec.min_side + rng.below(span) as u32;
    let rgb = render(&mut rng, class, w as usize, h as usize);
    let mut out = Vec::new();
    Encoder::new(&mut out, spec.quality)
        .encode(&rgb, w as u16, h as u16, ColorType::Rgb)
        .context("encoding a corpus JPEG")?;
    Ok(out)
}

fn render(rng: &mut SplitMix64, class: u64, w: usize, h: usize) -> Vec<u8> {
    // Palette: three colours per class, fixed by the class so classes look different.
    let mut palette_rng = SplitMix64::new(class.wrapping_mul(0xA24B_AED4_963E_E407) + 1);
    let palette: Vec<[f32; 3]> = (0..3).map(|_| [0, 1, 2].map(|_| (palette_rng.next_u64() % 256) as f32)).collect();
    let octaves: Vec<Lattice> = (0..8).map(|o| Lattice::new(rng, 4 << o)).collect();
    let shapes: Vec<(f32, f32, f32, f32, [f32; 3])> = (0..3)
        .map(|_| {
            let unit = |r: &mut SplitMix64| (r.next_u64() % 10_000) as f32 / 10_000.0;
            (unit(rng), unit(rng), 0.05 + 0.2 * unit(rng), 0.05 + 0.2 * unit(rng), palette[rng.below(3)])
        })
        .collect();
    let mut rgb = vec![0u8; w * h * 3];
    for y in 0..h {
        let fy = y as f32 / h as f32;
        for x in 0..w {
            let fx = x as f32 / w as f32;
            let (mut v, mut amp, mut norm) = (0.0, 1.0, 0.0);
            for lattice in &octaves {
                v += amp * lattice.at(fx, fy);
                norm += amp;
                amp *= 0.75;
            }
            let t = v / norm;
            let (a, b) = if t < 0.5 { (palette[0], palette[1]) } else { (palette[1], palette[2]) };
            let k = if t < 0.5 { t * 2.0 } else { (t - 0.5) * 2.0 };
            let mut c = [0, 1, 2].map(|i| a[i] + (b[i] - a[i]) * k);
            for (cx, cy, rx, ry, colour) in &shapes {
                let (dx, dy) = ((fx - cx) / rx, (fy - cy) / ry);
                if dx * dx + dy * dy < 1.0 {
                    c = [0, 1, 2].map(|i| 0.35 * c[i] + 0.65 * colour[i]);
                }
            }
            // Sensor-like grain: photographs are never smooth at the pixel level.
            let grain = (rng.next_u64() % 41) as f32 - 20.0;
            let px = &mut rgb[(y * w + x) * 3..(y * w + x) * 3 + 3];
            for i in 0..3 {
                px[i] = (c[i] + grain).clamp(0.0, 255.0) as u8;
            }
        }
    }
    rgb
}

/// Random values on an n x n grid, bilinearly interpolated (value noise).
struct Lattice {
    n: usize,
    values: Vec<f32>,
}

impl Lattice {
    fn new(rng: &mut SplitMix64, n: usize) -> Self {
        let values = (0..(n + 1) * (n + 1)).map(|_| (rng.next_u64() % 1_000_000) as f32 / 1_000_000.0).collect();
        Lattice { n, values }
    }

    fn at(&self, fx: f32, fy: f32) -> f32 {
        let (gx, gy) = (fx * self.n as f32, fy * self.n as f32);
        let (x0, y0) = (gx as usize, gy as usize);
        let (tx, ty) = (gx - x0 as f32, gy - y0 as f32);
        let v = |x: usize, y: usize| self.values[y.min(self.n) * (self.n + 1) + x.min(self.n)];
        let top = v(x0, y0) * (1.0 - tx) + v(x0 + 1, y0) * tx;
        let bottom = v(x0, y0 + 1) * (1.0 - tx) + v(x0 + 1, y0 + 1) * tx;
        top * (1.0 - ty) + bottom * ty
    }
}

/// ResNet-50's training transforms (torchvision's reference recipe) over an image folder.
pub fn resnet50_train(uri: &str, batch_size: u32) -> WorkerPipeline {
    WorkerPipeline {
        namespace: "bench".into(),
        name: "resnet50-train".into(),
        data_plane: DataPlaneSpec {
            source: Source::single(uri, SourceFormat::ImageFolder),
            transforms: vec![
                Transform::DecodeImage(DecodeImage { channels: 3, field: "image".into() }),
                Transform::RandomResizedCrop(RandomResizedCrop {
                    size: [224, 224],
                    scale: [0.08, 1.0],
                    ratio: [3.0 / 4.0, 4.0 / 3.0],
                    field: "image".into(),
                }),
                Transform::RandomFlip(RandomFlip { horizontal: true, vertical: false, field: "image".into() }),
                Transform::Normalize(Normalize {
                    mean: vec![0.485, 0.456, 0.406],
                    std: vec![0.229, 0.224, 0.225],
                    dtype: DType::Float32,
                    field: "image".into(),
                }),
            ],
            shuffle: None,
            batch_size,
            drop_remainder: false,
            pad_value: None,
            jagged: Vec::new(),
            seed: Some(1),
            on_error: OnError::Skip,
        },
        cache_mode: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_is_deterministic_and_shaped_like_imagenet() {
        let dir = tempfile::tempdir().unwrap();
        let spec = CorpusSpec { images: 6, classes: 3, ..Default::default() };
        let files = generate(dir.path(), &spec).unwrap();
        assert_eq!(files.len(), 6);
        let labels: std::collections::BTreeSet<_> =
            files.iter().map(|f| f.parent().unwrap().file_name().unwrap().to_owned()).collect();
        assert_eq!(labels.len(), 3, "one folder per class");
        for f in &files {
            let bytes = std::fs::read(f).unwrap();
            assert_eq!(&bytes[..2], &[0xFF, 0xD8], "JPEG magic");
            assert!((20_000..300_000).contains(&bytes.len()), "{} is {} bytes", f.display(), bytes.len());
        }
        let sizes: Vec<usize> = files.iter().map(|f| std::fs::metadata(f).unwrap().len() as usize).collect();
        eprintln!("corpus JPEG sizes: {sizes:?}");
        assert_eq!(image_jpeg(&spec, 4, 1).unwrap(), std::fs::read(&files[4]).unwrap(), "same bytes again");
        assert_ne!(image_jpeg(&spec, 4, 1).unwrap(), image_jpeg(&spec, 5, 1).unwrap());
    }
}
