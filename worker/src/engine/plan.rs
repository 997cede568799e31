//! Planning: a source's listing cut into the splits the dispatcher hands out.

use std::collections::BTreeMap;

use stoker_api::SourceFormat;

use crate::formats::image_folder;
use crate::source::{DataSource, Shard};

/// A unit of work: whole shard files of one format, handed out by the dispatcher later.
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    pub id: u64,
    pub shards: Vec<Shard>,
}

/// Files per image-folder split: aim at 64 splits or more, so dynamic sharding has enough to
/// share, without going below 8 files (each split costs a dispatcher round trip) or above
/// the configured most.
pub(super) fn split_size(files: usize, most: usize) -> usize {
    files.div_ceil(64).max(8).min(most.max(1))
}

/// Splits for a listing: image folders group files (the label map comes from their folders);
/// record formats take one shard file per split.
pub(super) fn plan(
    source: &DataSource,
    format: SourceFormat,
    shards: Vec<Shard>,
    files_per_split: usize,
) -> (Vec<Split>, BTreeMap<String, i64>) {
    match format {
        SourceFormat::ImageFolder => {
            let images: Vec<Shard> =
                shards.into_iter().filter(|s| image_folder::is_image(source.relative(s))).collect();
            let names: Vec<String> = images.iter().map(|s| source.relative(s).to_string()).collect();
            let labels = image_folder::label_map(&names);
            let splits = images
                .chunks(split_size(images.len(), files_per_split))
                .enumerate()
                .map(|(i, c)| Split { id: i as u64, shards: c.to_vec() })
                .collect();
            (splits, labels)
        }
        _ => {
            let splits = shards.into_iter().enumerate().map(|(i, s)| Split { id: i as u64, shards: vec![s] }).collect();
            (splits, BTreeMap::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> DataSource {
        DataSource::open("file:///data/").unwrap()
    }

    fn shards(names: &[String]) -> Vec<Shard> {
        names.iter().map(|n| Shard { path: format!("data/{n}"), size: 1, version: "v".into() }).collect()
    }

    fn images(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("class{}/{i:05}.jpg", i % 3)).collect()
    }

    /// Every shard of `splits` in split order, and whether the ids count up from 0.
    fn flattened(splits: &[Split]) -> (Vec<Shard>, bool) {
        let numbered = splits.iter().enumerate().all(|(i, s)| s.id == i as u64);
        (splits.iter().flat_map(|s| s.shards.clone()).collect(), numbered)
    }

    #[test]
    fn image_splits_aim_at_64_between_8_files_and_the_configured_most() {
        assert_eq!(split_size(100, 256), 8, "few files: 8 per split, not 2");
        assert_eq!(split_size(64 * 20, 256), 20, "64 splits of 20");
        assert_eq!(split_size(64 * 20 + 1, 256), 21, "rounded up, never more than 64 splits");
        assert_eq!(split_size(1_000_000, 256), 256, "capped at the configured most");
        assert_eq!(split_size(100, 5), 5, "the configured most wins over the 8-file floor");
        assert_eq!(split_size(100, 0), 1, "a most of 0 still makes progress");
    }

    #[test]
    fn image_folder_splits_cover_every_image_once_in_order() {
        let names = images(1000);
        let listing = shards(&names);
        let (splits, labels) = plan(&source(), SourceFormat::ImageFolder, listing.clone(), 256);
        assert_eq!(splits.len(), 63, "1000 images in splits of 16");
        assert!(splits[..62].iter().all(|s| s.shards.len() == 16));
        assert_eq!(splits[62].shards.len(), 1000 - 62 * 16);
        assert_eq!(flattened(&splits), (listing, true));
        assert_eq!(labels, BTreeMap::from([("class0".into(), 0), ("class1".into(), 1), ("class2".into(), 2)]));
    }

    #[test]
    fn image_folder_plans_skip_files_that_are_not_images() {
        let mut names = images(10);
        names.insert(3, "class0/README.txt".into());
        names.push("class1/.jpg".into());
        let (splits, _) = plan(&source(), SourceFormat::ImageFolder, shards(&names), 4);
        assert_eq!(splits.iter().map(|s| s.shards.len()).collect::<Vec<_>>(), [4, 4, 2]);
        assert_eq!(flattened(&splits), (shards(&images(10)), true));
    }

    #[test]
    fn record_formats_take_one_shard_per_split() {
        let names: Vec<String> = (0..5).map(|i| format!("part-{i}.tfrecord")).collect();
        let listing = shards(&names);
        for format in [SourceFormat::Tfrecord, SourceFormat::Jsonl, SourceFormat::Webdataset] {
            let (splits, labels) = plan(&source(), format, listing.clone(), 2);
            assert!(splits.iter().all(|s| s.shards.len() == 1), "{format:?}");
            assert_eq!(flattened(&splits), (listing.clone(), true), "{format:?}");
            assert!(labels.is_empty());
        }
    }
}
