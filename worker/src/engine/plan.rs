//! Planning: a source's listing cut into the splits the dispatcher hands out.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use stoker_api::{SourceFormat, order};

use parquet::file::metadata::ParquetMetaData;

use crate::formats::image_folder;
use crate::formats::parquet::ParquetReadError;
use crate::source::{DataSource, Shard};

/// A unit of work: whole shard files of one format, or row groups of Parquet files, handed out
/// by the dispatcher later.
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    /// As planned, the index in its source's splits; in an epoch, the slot the dispatcher
    /// hands out (see `mix`).
    pub id: u64,
    /// Which source of the mix it is read from (0 for a single source).
    pub source: usize,
    pub shards: Vec<Shard>,
    /// A Parquet split: the row groups it reads of each of its shards, in order (empty for
    /// other formats).
    pub row_groups: Vec<RowGroups>,
}

/// Consecutive row groups of a Parquet file, and their compressed bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct RowGroups {
    pub range: Range<usize>,
    pub bytes: u64,
}

/// Rows a Parquet split gathers from consecutive row groups, across files, before it is cut:
/// small row groups or files (a writer flushing often, a table of many small files) would
/// otherwise make splits too small for their dispatcher round trip, while large row groups
/// (the usual 64K-1M rows) make a split each.
pub const PARQUET_SPLIT_ROWS: u64 = 16_384;

/// Parquet splits: the files' row groups in listing order, gathered into splits of at least
/// `PARQUET_SPLIT_ROWS` rows (the last may be shorter), a split holding the row groups of one
/// file or the tail of one and the heads of the next; empty row groups are left out.
pub(super) fn plan_row_groups(files: Vec<(Shard, Vec<(u64, u64)>)>) -> Vec<Split> {
    let mut splits = Vec::new();
    let mut open = Split { id: 0, source: 0, shards: Vec::new(), row_groups: Vec::new() };
    let mut rows = 0;
    for (shard, groups) in files {
        for (i, &(group_rows, bytes)) in groups.iter().enumerate() {
            if group_rows == 0 {
                continue;
            }
            match (open.shards.last(), open.row_groups.last_mut()) {
                (Some(last), Some(run)) if *last == shard && run.range.end == i => {
                    run.range.end = i + 1;
                    run.bytes += bytes;
                }
                _ => {
                    open.shards.push(shard.clone());
                    open.row_groups.push(RowGroups { range: i..i + 1, bytes });
                }
            }
            rows += group_rows;
            if rows >= PARQUET_SPLIT_ROWS {
                let id = splits.len() as u64 + 1;
                splits.push(std::mem::replace(
                    &mut open,
                    Split { id, source: 0, shards: Vec::new(), row_groups: Vec::new() },
                ));
                rows = 0;
            }
        }
    }
    if !open.shards.is_empty() {
        splits.push(open);
    }
    splits
}

/// The footers planning read, by file path: a split's read starts from its file's.
pub type Footers = BTreeMap<String, Arc<ParquetMetaData>>;

/// A Parquet source's splits: each file's footer read (16 at once) for its row groups.
pub(super) async fn parquet(
    source: &DataSource,
    listed: Vec<Shard>,
) -> Result<(Vec<Split>, Footers), ParquetReadError> {
    use futures::{StreamExt, TryStreamExt};
    let files = listed.into_iter().filter(|s| is_parquet_file(source.relative(s)));
    let footers = futures::stream::iter(files.map(|shard| async move {
        let footer = source.parquet(&shard).metadata().await?;
        Ok::<_, ParquetReadError>((shard, footer))
    }));
    let footers: Vec<(Shard, Arc<ParquetMetaData>)> = footers.buffered(16).try_collect().await?;
    let groups = footers.iter().map(|(shard, footer)| {
        let groups = footer.row_groups().iter().map(|g| (g.num_rows() as u64, g.compressed_size() as u64)).collect();
        (shard.clone(), groups)
    });
    let splits = plan_row_groups(groups.collect());
    Ok((splits, footers.into_iter().map(|(shard, footer)| (shard.path, footer)).collect()))
}

/// Whether a listed object is one of a Parquet source's files: Spark, Hive and Hadoop leave
/// markers and metadata beside them (`_SUCCESS`, `_committed_*`, `.crc` files), whose names
/// start with `_` or `.`.
pub(super) fn is_parquet_file(relative: &str) -> bool {
    let name = relative.rsplit('/').next().unwrap_or(relative);
    !(name.is_empty() || name.starts_with('_') || name.starts_with('.'))
}

/// Files per image-folder split: aim at 64 splits or more, so dynamic sharding has enough to
/// share, without going below 8 files (each split costs a dispatcher round trip) or above
/// the configured most.
pub(super) fn split_size(files: usize, most: usize) -> usize {
    files.div_ceil(64).max(8).min(most.max(1))
}

/// The seed the listing is ordered by before it is cut into splits: with `shuffle`, an image
/// folder's files (sorted by class on the store) are spread over the splits, so each split
/// holds many classes; the order is fixed across epochs, so cache entries stay valid. Record
/// formats take one file per split: there is nothing to spread. None: the listing's order.
pub fn listing_order(format: SourceFormat, shuffle_seed: Option<u64>) -> Option<u64> {
    match format {
        SourceFormat::ImageFolder => shuffle_seed,
        _ => None,
    }
}

/// Splits for a listing: image folders group files (the label map comes from their folders),
/// in the seeded order `listing_order` gives; record formats take one shard file per split.
pub(super) fn plan(
    source: &DataSource,
    format: SourceFormat,
    shards: Vec<Shard>,
    files_per_split: usize,
    listing_order: Option<u64>,
) -> (Vec<Split>, BTreeMap<String, i64>) {
    match format {
        SourceFormat::ImageFolder => {
            let mut images: Vec<Shard> =
                shards.into_iter().filter(|s| image_folder::is_image(source.relative(s))).collect();
            let names: Vec<String> = images.iter().map(|s| source.relative(s).to_string()).collect();
            let labels = image_folder::label_map(&names);
            if let Some(seed) = listing_order {
                order::shuffle(&mut images, seed, order::EVERY_EPOCH, |s| order::name_id(source.relative(s)));
            }
            let splits = images
                .chunks(split_size(images.len(), files_per_split))
                .enumerate()
                .map(|(i, c)| Split { id: i as u64, source: 0, shards: c.to_vec(), row_groups: Vec::new() })
                .collect();
            (splits, labels)
        }
        _ => {
            let splits = shards
                .into_iter()
                .enumerate()
                .map(|(i, s)| Split { id: i as u64, source: 0, shards: vec![s], row_groups: Vec::new() })
                .collect();
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
        let (splits, labels) = plan(&source(), SourceFormat::ImageFolder, listing.clone(), 256, None);
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
        let (splits, _) = plan(&source(), SourceFormat::ImageFolder, shards(&names), 4, None);
        assert_eq!(splits.iter().map(|s| s.shards.len()).collect::<Vec<_>>(), [4, 4, 2]);
        assert_eq!(flattened(&splits), (shards(&images(10)), true));
    }

    #[test]
    fn parquet_splits_gather_row_groups_across_files_to_enough_rows() {
        let file = |name: &str, groups: Vec<(u64, u64)>| (shards(&[name.to_string()]).remove(0), groups);
        let files = vec![
            // Large row groups: one split each (the empty one left out).
            file("a.parquet", vec![(100_000, 10), (0, 0), (20_000, 2)]),
            // Small ones gather; a file's tail joins the next file's head.
            file("b.parquet", vec![(10_000, 1), (10_000, 1), (5_000, 1)]),
            file("c.parquet", vec![(6_000, 3), (6_000, 3), (1, 1)]),
            // Small files gather whole, and the last split is what is left.
            file("d.parquet", vec![(8_000, 4)]),
            file("e.parquet", vec![(8_000, 4)]),
            file("f.parquet", vec![(100, 1)]),
        ];
        let planned: Vec<Vec<(String, Range<usize>, u64)>> = plan_row_groups(files)
            .iter()
            .enumerate()
            .map(|(i, s)| {
                assert_eq!(s.id, i as u64);
                assert_eq!(s.shards.len(), s.row_groups.len());
                let pieces = s.shards.iter().zip(&s.row_groups);
                pieces
                    .map(|(f, g)| (f.path.trim_start_matches("data/").to_string(), g.range.clone(), g.bytes))
                    .collect()
            })
            .collect();
        let piece = |f: &str, r: Range<usize>, b| (f.to_string(), r, b);
        assert_eq!(
            planned,
            [
                vec![piece("a.parquet", 0..1, 10)],
                vec![piece("a.parquet", 2..3, 2)],
                vec![piece("b.parquet", 0..2, 2)],
                vec![piece("b.parquet", 2..3, 1), piece("c.parquet", 0..2, 6)],
                // 16,101 rows, the last split: shorter than the rest may be.
                vec![
                    piece("c.parquet", 2..3, 1),
                    piece("d.parquet", 0..1, 4),
                    piece("e.parquet", 0..1, 4),
                    piece("f.parquet", 0..1, 1),
                ],
            ]
        );
        assert!(is_parquet_file("x/part-0.snappy.parquet") && is_parquet_file("y"));
        assert!(!is_parquet_file("x/_SUCCESS") && !is_parquet_file(".part-0.parquet.crc"));
    }

    #[test]
    fn record_formats_take_one_shard_per_split() {
        let names: Vec<String> = (0..5).map(|i| format!("part-{i}.tfrecord")).collect();
        let listing = shards(&names);
        for format in [SourceFormat::Tfrecord, SourceFormat::Jsonl, SourceFormat::Webdataset] {
            let (splits, labels) = plan(&source(), format, listing.clone(), 2, listing_order(format, Some(7)));
            assert!(splits.iter().all(|s| s.shards.len() == 1), "{format:?}");
            assert_eq!(flattened(&splits), (listing.clone(), true), "{format:?}");
            assert!(labels.is_empty());
        }
    }

    #[test]
    fn with_shuffle_an_image_folder_is_spread_over_the_splits_the_same_way_every_time() {
        // 20 classes of 50 images, listed class by class as a store lists them.
        let names: Vec<String> = (0..1000).map(|i| format!("class{:02}/{i:05}.jpg", i / 50)).collect();
        let listing = shards(&names);
        let order = listing_order(SourceFormat::ImageFolder, Some(7));
        let (splits, labels) = plan(&source(), SourceFormat::ImageFolder, listing.clone(), 256, order);
        let (again, _) = plan(&source(), SourceFormat::ImageFolder, listing.clone(), 256, order);
        assert_eq!(splits, again, "fixed for a seed: cache entries stay valid");
        let (mut all, numbered) = flattened(&splits);
        assert!(numbered);
        assert_ne!(all, listing, "not the listing's order");
        all.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(all, listing, "every image once");
        let classes =
            |s: &Split| s.shards.iter().map(|f| f.path[5..12].to_string()).collect::<std::collections::BTreeSet<_>>();
        // In listing order a split of 16 holds one or two classes; spread, about 11 of 20.
        let counts: Vec<usize> = splits.iter().map(|s| classes(s).len()).collect();
        let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
        assert!(mean > 9.0 && counts.iter().all(|&n| n >= 4), "classes per split: {counts:?}");
        assert_eq!(labels.len(), 20, "labels still come from the sorted folder names");
        let (other_seed, _) = plan(&source(), SourceFormat::ImageFolder, listing, 256, Some(8));
        assert_ne!(splits, other_seed);
    }
}
