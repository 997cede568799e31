//! Bounds on what a spec can make a worker allocate. A worker holds whole elements and whole
//! batches in memory, so a spec whose ops output an enormous image (a crop to 100000 x 100000
//! is about 120 GB as float32) would kill the worker by OOM on its first element. These limits
//! refuse such specs up front with the op, the field, the value and the limit. They are set
//! far above anything a real training pipeline uses, so they only ever stop mistakes and
//! abuse; the worker's ops enforce the side limit again on sizes that depend on the data
//! (`resize: {shorterSide}` scales the longer side by the image's aspect ratio).

use std::collections::BTreeMap;

use crate::{DType, DataPlaneSpec, Transform};

/// Most pixels per side of an image an op outputs. Training resolutions are 224 to 1024 px,
/// high-resolution segmentation and detection go to 4096; 8192 leaves twice that headroom.
pub const MAX_IMAGE_SIDE: u32 = 8192;

/// Most bytes of one element's images after the last op: 256 MiB, e.g. 4096 x 4096 x 4
/// channels as float32. A worker holds many elements at once (a chunk in transform, the
/// shuffle buffer, the batch being filled) in a default memory budget of 512 MiB, so an
/// element near this size already leaves room for only one.
pub const MAX_ELEMENT_BYTES: u64 = 256 << 20;

/// Most bytes of one batch (batchSize elements of the size the ops fix): 4 GiB. A batch is
/// built in one worker's memory and held by the client too; 4 GiB is 1700 ImageNet crops
/// (224 x 224 x 3, float32) per step, beyond any one host's batch.
pub const MAX_BATCH_BYTES: u64 = 4 << 30;

/// Largest `shuffle.bufferSize`: 2^24 elements, 13 times ImageNet-1k's 1.28M training images, so
/// even a full shuffle of a large corpus fits. The worker caps the buffer by its memory budget
/// anyway (see the worker's shuffle); this stops values that can only be typos.
pub const MAX_SHUFFLE_BUFFER: u32 = 1 << 24;

/// Sources a mix may name (spec.source.mix): each costs a listing per worker start, and each
/// is a number in every heartbeat.
pub const MAX_MIXED_SOURCES: usize = 64;

/// Columns a Parquet source may name (spec.source.columns): wide tables have thousands, and a
/// model that reads more than this reads nearly all of them (leave the list out).
pub const MAX_COLUMNS: usize = 1024;

/// Most elements of one call of a batched `python` op (its `batch`): the elements of a call are
/// in the worker's and the Python process's memory at once.
pub const MAX_PYTHON_BATCH: u32 = 4096;

/// Largest `tokenizer.json` a worker reads from a store: the largest published ones are tens of
/// MB; this stops a URI naming a dataset from filling a worker's memory.
pub const MAX_TOKENIZER_BYTES: u64 = 512 << 20;

/// Largest `vocabulary` file a worker reads: a recommendation model's largest id tables have
/// tens of millions of entries (some hundreds of MB); more would not fit beside the batches.
pub const MAX_VOCABULARY_BYTES: u64 = 1 << 30;

/// What the ops so far have fixed about an image field. Only fields whose size the spec
/// determines (a resize to `size`, a crop) are tracked; others depend on the data.
#[derive(Clone, Copy, Debug)]
struct Image {
    /// [height, width] when the spec fixes it.
    size: Option<[u32; 2]>,
    /// Channels when a decodeImage in the spec set them; 4 (the most) otherwise.
    channels: u8,
    dtype: DType,
}

impl Image {
    fn bytes(&self) -> Option<u64> {
        let [h, w] = self.size?;
        Some(u64::from(h) * u64::from(w) * u64::from(self.channels) * self.dtype.size() as u64)
    }

    fn describe(&self) -> String {
        let [h, w] = self.size.unwrap_or_default();
        format!("{h} x {w} x {} channels of {}", self.channels, self.dtype.numpy_name())
    }
}

/// Calls `err(field, message)` for every bound the spec's transforms and batch size break.
pub(crate) fn check(spec: &DataPlaneSpec, err: &mut impl FnMut(&str, String)) {
    let mut images: BTreeMap<String, Image> = BTreeMap::new();
    // The image ops require uint8 images; a field's dtype changes only later (normalize, cast).
    let uint8 = |images: &BTreeMap<String, Image>, field: &str| Image {
        size: None,
        channels: images.get(field).map_or(4, |i| i.channels),
        dtype: DType::Uint8,
    };
    for (i, t) in spec.transforms.iter().enumerate() {
        let at = format!("spec.transforms[{i}].{}", t.name());
        // One error per offending parameter; a size over the limit is not tracked further, so
        // the element bound does not repeat the complaint.
        let mut side = |name: &str, values: &[u32]| -> bool {
            if values.iter().all(|v| *v <= MAX_IMAGE_SIDE) {
                return true;
            }
            let value = match values {
                [v] => v.to_string(),
                _ => format!("{values:?}"),
            };
            err(
                &format!("{at}.{name}"),
                format!("{value} px: each side may be at most {MAX_IMAGE_SIDE} px; use a smaller size"),
            );
            false
        };
        let touched = match t {
            Transform::DecodeImage(d) => {
                images.insert(d.field.clone(), Image { size: None, channels: d.channels, dtype: DType::Uint8 });
                Some(d.field.as_str())
            }
            Transform::Resize(r) => {
                let ok = side("size", r.size.as_ref().map_or(&[][..], |s| &s[..]));
                side("shorterSide", r.shorter_side.as_slice());
                let image = Image { size: r.size.filter(|_| ok), ..uint8(&images, &r.field) };
                images.insert(r.field.clone(), image);
                Some(r.field.as_str())
            }
            Transform::CenterCrop(c) => {
                let size = Some(c.size).filter(|s| side("size", s));
                images.insert(c.field.clone(), Image { size, ..uint8(&images, &c.field) });
                Some(c.field.as_str())
            }
            Transform::RandomResizedCrop(c) => {
                let size = Some(c.size).filter(|s| side("size", s));
                images.insert(c.field.clone(), Image { size, ..uint8(&images, &c.field) });
                Some(c.field.as_str())
            }
            Transform::Normalize(n) => {
                let image = images.entry(n.field.clone()).or_insert_with(|| Image {
                    size: None,
                    channels: 4,
                    dtype: DType::Uint8,
                });
                image.dtype = n.dtype;
                Some(n.field.as_str())
            }
            Transform::Cast(c) => {
                if let Some(image) = images.get_mut(&c.field) {
                    image.dtype = c.dtype;
                }
                Some(c.field.as_str())
            }
            Transform::SelectFields(s) => {
                images.retain(|name, _| s.fields.contains(name));
                None
            }
            Transform::RenameFields(r) => {
                let moved: Vec<(String, Image)> =
                    r.mapping.iter().filter_map(|(from, to)| Some((to.clone(), images.remove(from)?))).collect();
                images.extend(moved);
                None
            }
            // Its output is unknown until it runs: the worker bounds each element it returns.
            Transform::Python(_) => {
                images.clear();
                None
            }
            Transform::RandomFlip(_)
            | Transform::Filter(_)
            | Transform::Autocache(_)
            | Transform::Tokenize(_)
            | Transform::Echo(_) => None,
            Transform::Pack(_) => {
                images.clear();
                None
            }
            // Numbers and ids, never images.
            feature => {
                for field in feature.feature_fields() {
                    images.remove(field);
                }
                None
            }
        };
        if let Some((field, image)) = touched.and_then(|f| Some((f, *images.get(f)?)))
            && let Some(bytes) = image.bytes().filter(|b| *b > MAX_ELEMENT_BYTES)
        {
            err(
                &at,
                format!(
                    "makes field {field:?} {} = {bytes} bytes per element, above the limit of \
                     {MAX_ELEMENT_BYTES} bytes ({} MiB); use a smaller size or dtype",
                    image.describe(),
                    MAX_ELEMENT_BYTES >> 20
                ),
            );
            // Counted once: later ops on the field would repeat the same complaint.
            images.remove(field);
        }
    }

    let element: u64 = images.values().filter_map(Image::bytes).sum();
    let batch = element * u64::from(spec.batch_size);
    if batch > MAX_BATCH_BYTES {
        err(
            "spec.batchSize",
            format!(
                "{} elements of {element} bytes (the sizes the transforms fix) are {batch} bytes per batch, above \
                 the limit of {MAX_BATCH_BYTES} bytes ({} GiB); use at most {} elements per batch",
                spec.batch_size,
                MAX_BATCH_BYTES >> 30,
                MAX_BATCH_BYTES / element
            ),
        );
    }

    if let Some(s) = spec.shuffle.as_ref().filter(|s| s.buffer_size > MAX_SHUFFLE_BUFFER) {
        err(
            "spec.shuffle.bufferSize",
            format!(
                "{} elements is above the limit of {MAX_SHUFFLE_BUFFER}; the worker also caps the buffer by its \
                 memory budget, so a larger value could not be honoured anyway",
                s.buffer_size
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::{DataPipelineSpec, ValidationError, validate};

    fn errors(extra: &str) -> Vec<ValidationError> {
        let yaml = format!("source: {{uri: 's3://bucket/train/', format: imageFolder}}\n{extra}");
        let spec: DataPipelineSpec = crate::from_yaml(&yaml).expect("test spec parses");
        validate(&spec).err().unwrap_or_default()
    }

    #[test]
    fn the_issues_oversized_crop_is_refused_naming_op_field_value_and_limit() {
        let e = errors("batchSize: 32\ntransforms:\n- decodeImage: {}\n- randomResizedCrop: {size: [100000, 224]}\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].field, "spec.transforms[1].randomResizedCrop.size");
        assert_eq!(e[0].message, "[100000, 224] px: each side may be at most 8192 px; use a smaller size");
        let e =
            errors("batchSize: 32\ntransforms:\n- decodeImage: {}\n- randomResizedCrop: {size: [100000, 100000]}\n");
        assert_eq!(e.len(), 1, "one error, not one per side and another for the bytes: {e:?}");
    }

    #[test]
    fn every_op_with_a_size_from_the_spec_is_bounded_per_side() {
        let e = errors(
            "batchSize: 1\ntransforms:\n- resize: {size: [8193, 10]}\n- resize: {shorterSide: 9000}\n\
             - centerCrop: {size: [10, 20000]}\n- randomResizedCrop: {size: [8192, 8192]}\n",
        );
        let fields: Vec<_> = e.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.transforms[0].resize.size",
                "spec.transforms[1].resize.shorterSide",
                "spec.transforms[2].centerCrop.size"
            ],
            "8192 itself is allowed: {e:?}"
        );
    }

    #[test]
    fn element_bytes_count_channels_and_the_dtype_ops_make_later() {
        // 8192 x 8192 x 3 as uint8 is 192 MiB: allowed. Normalizing to float32 makes it 768 MiB.
        let ok = "batchSize: 1\ntransforms:\n- decodeImage: {}\n- resize: {size: [8192, 8192]}\n";
        assert_eq!(errors(ok), []);
        let e = errors(&format!(
            "{ok}- normalize: {{mean: [0, 0, 0], std: [1, 1, 1]}}\n- cast: {{field: image, dtype: float64}}\n"
        ));
        assert_eq!(e.len(), 1, "reported once, at the op that crossed the limit: {e:?}");
        assert_eq!(e[0].field, "spec.transforms[2].normalize");
        assert!(
            e[0].message.contains("\"image\" 8192 x 8192 x 3 channels of float32 = 805306368 bytes")
                && e[0].message.contains("limit of 268435456 bytes (256 MiB)"),
            "{e:?}"
        );
        // Without a decodeImage the channels are unknown: the most (4) is assumed.
        let e = errors(
            "batchSize: 1\ntransforms:\n- centerCrop: {size: [5000, 5000], field: pixels}\n- cast: {field: pixels, dtype: float32}\n",
        );
        assert_eq!(e[0].field, "spec.transforms[1].cast", "{e:?}");
        // A field dropped by selectFields no longer counts; a renamed one does, under its new name.
        let dropped = "- selectFields: {fields: [label]}\n- normalize: {mean: [0], std: [1], field: other}\n";
        assert_eq!(errors(&format!("{ok}{dropped}")), []);
        let renamed = "- renameFields: {mapping: {image: x}}\n- cast: {field: x, dtype: float32}\n";
        assert_eq!(errors(&format!("{ok}{renamed}"))[0].field, "spec.transforms[3].cast");
    }

    #[test]
    fn a_batch_of_fixed_size_elements_is_bounded() {
        // 1024 x 1024 x 3 float32 = 12 MiB per element: 341 fit in 4 GiB, 342 do not.
        let ops = "transforms:\n- decodeImage: {}\n- centerCrop: {size: [1024, 1024]}\n- normalize: {mean: [0, 0, 0], std: [1, 1, 1]}\n";
        assert_eq!(errors(&format!("batchSize: 341\n{ops}")), []);
        let e = errors(&format!("batchSize: 342\n{ops}"));
        assert_eq!(e[0].field, "spec.batchSize");
        assert!(e[0].message.contains("use at most 341 elements per batch"), "{e:?}");
        // Sizes that depend on the data are not guessed at.
        assert_eq!(errors("batchSize: 65536\ntransforms:\n- decodeImage: {}\n- resize: {shorterSide: 8192}\n"), []);
    }

    #[test]
    fn the_shuffle_buffer_is_bounded() {
        let e = errors("batchSize: 1\nshuffle: {bufferSize: 4000000000}\n");
        assert_eq!(e[0].field, "spec.shuffle.bufferSize");
        assert!(e[0].message.starts_with("4000000000 elements is above the limit of 16777216"), "{e:?}");
        assert_eq!(errors("batchSize: 1\nshuffle: {bufferSize: 16777216}\n"), []);
    }
}
