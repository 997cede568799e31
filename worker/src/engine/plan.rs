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
