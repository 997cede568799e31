//! A by-hand throughput check of the ResNet-50 training transforms on one core, not a test:
//! cargo test --release -p stoker-worker --test worker ops_bench:: -- --ignored --nocapture

use std::time::Instant;

use stoker_api::{DType, Normalize, RandomFlip, RandomResizedCrop};
use stoker_worker::ops;

#[test]
#[ignore = "benchmark; run by hand with --release"]
fn resnet_train_transforms_images_per_second() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/ops/bench_350x400.jpg");
    let jpeg = std::fs::read(path).unwrap();
    let crop =
        RandomResizedCrop { size: [224, 224], scale: [0.08, 1.0], ratio: [0.75, 4.0 / 3.0], field: "image".into() };
    let flip = RandomFlip { horizontal: true, vertical: false, field: "image".into() };
    let norm = Normalize {
        mean: vec![0.485, 0.456, 0.406],
        std: vec![0.229, 0.224, 0.225],
        dtype: DType::Float32,
        field: "image".into(),
    };
    let iterations: u64 = std::env::var("OPS_BENCH_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let mut stages = [0f64; 4];
    let start = Instant::now();
    for element in 0..iterations {
        let mut rng = ops::element_rng(0, 0, element, 0);
        let t0 = Instant::now();
        let image = ops::decode_image(&jpeg, 3).unwrap();
        let t1 = Instant::now();
        let image = ops::random_resized_crop(&image, &crop, &mut rng).unwrap();
        let t2 = Instant::now();
        let image = ops::random_flip(&image, &flip, &mut rng).unwrap();
        let t3 = Instant::now();
        let out = ops::normalize(&image, &norm).unwrap();
        let t4 = Instant::now();
        assert_eq!(out.shape, vec![224, 224, 3]);
        for (s, d) in stages.iter_mut().zip([t1 - t0, t2 - t1, t3 - t2, t4 - t3]) {
            *s += d.as_secs_f64();
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let per_image_us = |s: f64| s / iterations as f64 * 1e6;
    println!(
        "{iterations} images of 400x350 in {secs:.2}s: {:.0} images/s on one core \
         (per image: decode {:.0} us, randomResizedCrop {:.0} us, flip {:.0} us, normalize {:.0} us)",
        iterations as f64 / secs,
        per_image_us(stages[0]),
        per_image_us(stages[1]),
        per_image_us(stages[2]),
        per_image_us(stages[3]),
    );
}
