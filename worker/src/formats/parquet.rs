//! Parquet files. A split is a run of row groups of one file; reading it fetches (unless
//! planning read it already) the footer, then only the chunks of the projected columns in those row groups (ranged reads through
//! object_store), and decodes them into Arrow record batches. A row group whose statistics
//! prove that a leading `filter` op drops every row of it is never fetched (`excludes`), and
//! where the file has a page index, neither is a page of the row groups read whose statistics
//! prove it (`page_selection`). A read decodes its columns in groups at once
//! (`with_decoders`), strings dictionary-encoded throughout as keys into their dictionary
//! (`kept_dictionaries`).
//!
//! Rows become elements here, one field per column: integers and booleans as int64, floats as
//! float32 or float64, strings and binary (dictionary-encoded or not) as bytes, lists of those
//! as lists. A null is a field the element does not have. Any other type is an error naming
//! the column, before anything is read.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::DataType;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector};
use parquet::arrow::async_reader::{AsyncFileReader, ParquetRecordBatchStreamBuilder};
use parquet::errors::ParquetError;
use parquet::file::metadata::{
    ColumnChunkMask, PageIndexPolicy, ParquetMetaData, ParquetMetaDataReader, RowGroupMetaData,
};
use parquet::file::page_index::column_index::ColumnIndexMetaData;
use parquet::file::statistics::Statistics;
use stoker_api::{Filter, FilterOp};

use crate::element::{Element, Field};
use crate::source_reads::SourceReads;

/// Why a Parquet file cannot be read as asked.
#[derive(Debug, thiserror::Error)]
pub enum ParquetReadError {
    #[error("{file}: {source}")]
    Parquet { file: String, source: ParquetError },
    #[error("{file} has no column {column:?} (it has {available})")]
    NoColumn { file: String, column: String, available: String },
    #[error(
        "{file}: column {column:?} is {data_type}, which Stoker does not read (integers, floats, booleans, strings, binary and lists of those)"
    )]
    UnsupportedType { file: String, column: String, data_type: DataType },
    #[error("{file} has {groups} row groups, not {asked:?}")]
    NoRowGroups { file: String, groups: usize, asked: Range<usize> },
}

/// One file of a Parquet source.
pub struct ParquetFile {
    store: Arc<dyn ObjectStore>,
    path: Path,
    size: u64,
    /// The footer, when planning read it already: a split's read then fetches only the
    /// column chunks.
    footer: Option<Arc<ParquetMetaData>>,
    /// Bytes fetched from the store so far: the footer and the projected column chunks.
    fetched: Arc<AtomicU64>,
    /// How many groups of columns a read decodes at once, each on a thread of the runtime.
    decoders: usize,
    /// Its source's read counters, which every fetch adds to.
    reads: Option<Arc<SourceReads>>,
}

impl ParquetFile {
    pub fn new(store: Arc<dyn ObjectStore>, path: Path, size: u64) -> Self {
        ParquetFile { store, path, size, footer: None, fetched: Arc::default(), decoders: 1, reads: None }
    }

    /// The file whose fetches count into its source's `reads` too.
    pub fn counting(self, reads: Arc<SourceReads>) -> Self {
        ParquetFile { reads: Some(reads), ..self }
    }

    /// The file whose footer is `footer` (as `metadata` read it before).
    pub fn with_footer(self, footer: Option<Arc<ParquetMetaData>>) -> Self {
        ParquetFile { footer, ..self }
    }

    /// The file read by `decoders` groups of its columns at once (each a task of the runtime):
    /// the columns of one row group are decoded one after another otherwise, and a split is
    /// usually one row group.
    pub fn with_decoders(self, decoders: usize) -> Self {
        ParquetFile { decoders: decoders.max(1), ..self }
    }

    /// Bytes fetched from the store so far.
    pub fn fetched(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    fn reader(&self) -> Ranges {
        Ranges {
            store: self.store.clone(),
            path: self.path.clone(),
            size: self.size,
            fetched: self.fetched.clone(),
            reads: self.reads.clone(),
        }
    }

    fn error(&self, source: ParquetError) -> ParquetReadError {
        ParquetReadError::Parquet { file: self.path.to_string(), source }
    }

    /// The file's footer: its schema and row groups.
    pub async fn metadata(&self) -> Result<Arc<ParquetMetaData>, ParquetReadError> {
        let builder = ParquetRecordBatchStreamBuilder::new(self.reader()).await.map_err(|e| self.error(e))?;
        Ok(builder.metadata().clone())
    }

    /// The footer as the Arrow reader takes it, its columns of the types of `schema` when
    /// given (else those the file's own schema gives).
    fn arrow(
        &self,
        footer: Arc<ParquetMetaData>,
        schema: Option<arrow_schema::SchemaRef>,
    ) -> Result<ArrowReaderMetadata, ParquetReadError> {
        let options = match schema {
            Some(schema) => ArrowReaderOptions::new().with_schema(schema),
            None => ArrowReaderOptions::default(),
        };
        ArrowReaderMetadata::try_new(footer, options).map_err(|e| self.error(e))
    }

    /// The rows of `row_groups`, of the `columns` named (every column if None), in batches,
    /// but for the row groups `filters` (the pipeline's leading `filter` ops) drop whole.
    pub async fn read(
        &self,
        row_groups: Range<usize>,
        columns: Option<&[String]>,
        filters: &[Filter],
    ) -> Result<RowGroupsRead, ParquetReadError> {
        let footer = match &self.footer {
            Some(footer) => footer.clone(),
            None => self.metadata().await?,
        };
        let builder =
            ParquetRecordBatchStreamBuilder::new_with_metadata(self.reader(), self.arrow(footer.clone(), None)?);
        let groups = builder.metadata().num_row_groups();
        if row_groups.end > groups || row_groups.is_empty() {
            return Err(ParquetReadError::NoRowGroups { file: self.path.to_string(), groups, asked: row_groups });
        }
        let schema = builder.schema().clone();
        let roots: Vec<usize> = match columns {
            None => (0..schema.fields().len()).collect(),
            Some(names) => names
                .iter()
                .map(|name| {
                    schema.index_of(name).map_err(|_| ParquetReadError::NoColumn {
                        file: self.path.to_string(),
                        column: name.clone(),
                        available: schema.fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", "),
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        for &root in &roots {
            let field = schema.field(root);
            if !readable(field.data_type()) {
                return Err(ParquetReadError::UnsupportedType {
                    file: self.path.to_string(),
                    column: field.name().clone(),
                    data_type: field.data_type().clone(),
                });
            }
        }
        // A filter prunes only on a column it reads: on another, every row would fail it.
        let prunes: Vec<(usize, &Filter)> = filters
            .iter()
            .filter_map(|f| {
                let root = schema.index_of(&f.field).ok().filter(|r| roots.contains(r))?;
                let ordered = matches!(
                    schema.field(root).data_type(),
                    DataType::Int8
                        | DataType::Int16
                        | DataType::Int32
                        | DataType::Int64
                        | DataType::Float32
                        | DataType::Float64
                );
                let leaf =
                    builder.parquet_schema().columns().iter().position(|c| c.path().parts() == [f.field.as_str()])?;
                ordered.then_some((leaf, f))
            })
            .collect();
        let metadata = builder.metadata().clone();
        let (kept, skipped): (Vec<usize>, Vec<usize>) =
            row_groups.partition(|&g| !prunes.iter().any(|(leaf, f)| excludes(metadata.row_group(g), *leaf, f)));
        let mut skipped_rows = skipped.iter().map(|&g| metadata.row_group(g).num_rows() as u64).sum();
        if kept.is_empty() {
            return Ok(RowGroupsRead { batches: Vec::new(), skipped_rows });
        }
        // With filters that prune, the page index of the filters' columns too (where the file
        // has one; only the index's ranges are read, the footer is the one held): the reader
        // fetches only the pages of the rows it rules in.
        let (metadata, selection) = if prunes.is_empty() {
            (metadata, None)
        } else {
            // Page statistics of the filters' columns; page locations of every column, so the
            // reader skips the pages of every column it reads.
            let filtered = ColumnChunkMask::columns(prunes.iter().map(|(leaf, _)| *leaf));
            let mut indexed = ParquetMetaDataReader::new_with_metadata(metadata.as_ref().clone())
                .with_page_index_policy(PageIndexPolicy::Optional)
                .with_column_index_mask(filtered);
            indexed.load_page_index(&mut self.reader()).await.map_err(|e| self.error(e))?;
            let indexed = Arc::new(indexed.finish().map_err(|e| self.error(e))?);
            let selection = page_selection(&indexed, &kept, &prunes);
            (indexed, selection)
        };
        let dictionaries = kept_dictionaries(&schema, &metadata, &kept, &roots);
        let arrow = self.arrow(metadata, Some(Arc::new(dictionaries)))?;
        if let Some((_, rows)) = &selection {
            skipped_rows += rows;
        }
        let selection = selection.map(|(selection, _)| selection);
        let decoding: Vec<_> = column_groups(arrow.metadata(), &kept, roots, self.decoders)
            .into_iter()
            .map(|group| {
                let builder = ParquetRecordBatchStreamBuilder::new_with_metadata(self.reader(), arrow.clone());
                let mask = ProjectionMask::roots(builder.parquet_schema(), group);
                // Batches of 8192 rows: the reader's default of 1024 cost the columnar path a
                // tenth of its time in per-batch work and in joining the batches.
                let builder = builder.with_projection(mask).with_row_groups(kept.clone()).with_batch_size(1 << 17);
                let builder = match &selection {
                    Some(selection) => builder.with_row_selection(selection.clone()),
                    None => builder,
                };
                let stream = builder.build().map_err(|e| self.error(e))?;
                Ok(stream.try_collect::<Vec<RecordBatch>>())
            })
            .collect::<Result<_, ParquetReadError>>()?;
        let decoded: Vec<Vec<RecordBatch>> = match decoding.len() {
            1 => vec![decoding.into_iter().next().expect("one").await.map_err(|e| self.error(e))?],
            // Each group of columns decoded on a thread of the runtime of its own.
            _ => {
                let tasks = decoding.into_iter().map(tokio::spawn);
                let joined = futures::future::try_join_all(tasks).await.expect("a decoding task does not panic");
                joined.into_iter().collect::<Result<_, _>>().map_err(|e| self.error(e))?
            }
        };
        let batches = side_by_side(arrow.schema(), decoded).map_err(|e| self.error(ParquetError::General(e)))?;
        Ok(RowGroupsRead { batches, skipped_rows })
    }
}

/// `roots` in at most `ways` groups of about equal compressed bytes in `groups`, each in the
/// file's order: columns that one decoder each decodes at the same time as the others.
fn column_groups(metadata: &ParquetMetaData, groups: &[usize], roots: Vec<usize>, ways: usize) -> Vec<Vec<usize>> {
    let ways = ways.clamp(1, roots.len().max(1));
    if ways == 1 {
        return vec![roots];
    }
    let leaves = metadata.file_metadata().schema_descr();
    let bytes = |root: usize| -> u64 {
        (0..leaves.num_columns())
            .filter(|&leaf| leaves.get_column_root_idx(leaf) == root)
            .flat_map(|leaf| groups.iter().map(move |&g| metadata.row_group(g).column(leaf).compressed_size() as u64))
            .sum()
    };
    let mut sized: Vec<(u64, usize)> = roots.into_iter().map(|r| (bytes(r), r)).collect();
    sized.sort_by(|a, b| b.cmp(a));
    let mut split: Vec<(u64, Vec<usize>)> = vec![(0, Vec::new()); ways];
    for (size, root) in sized {
        let lightest = split.iter_mut().min_by_key(|(total, _)| *total).expect("ways > 0");
        lightest.0 += size;
        lightest.1.push(root);
    }
    split
        .into_iter()
        .map(|(_, mut roots)| {
            roots.sort_unstable();
            roots
        })
        .filter(|roots| !roots.is_empty())
        .collect()
}

/// The batches that groups of columns decoded, joined column by column into batches of every
/// column (the groups read the same rows in the same batches), in the file's column order.
fn side_by_side(file: &arrow_schema::Schema, decoded: Vec<Vec<RecordBatch>>) -> Result<Vec<RecordBatch>, String> {
    if decoded.len() == 1 {
        return Ok(decoded.into_iter().next().expect("one"));
    }
    let count = decoded[0].len();
    if decoded.iter().any(|d| d.len() != count) {
        return Err("column groups decoded into different numbers of batches".into());
    }
    (0..count)
        .map(|i| {
            let mut columns: Vec<(arrow_schema::FieldRef, ArrayRef)> = Vec::new();
            for batch in decoded.iter().map(|d| &d[i]) {
                columns.extend(batch.schema().fields().iter().cloned().zip(batch.columns().iter().cloned()));
            }
            columns.sort_by_key(|(field, _)| file.index_of(field.name()).ok());
            let rows = decoded[0][i].num_rows();
            if decoded.iter().any(|d| d[i].num_rows() != rows) {
                return Err(format!("column groups decoded batch {i} into different numbers of rows"));
            }
            let (fields, arrays): (Vec<_>, Vec<_>) = columns.into_iter().unzip();
            RecordBatch::try_new(Arc::new(arrow_schema::Schema::new(fields)), arrays).map_err(|e| e.to_string())
        })
        .collect()
}

/// A split's row groups as read.
#[derive(Debug)]
pub struct RowGroupsRead {
    pub batches: Vec<RecordBatch>,
    /// Rows of the row groups and pages the filters dropped whole, never fetched.
    pub skipped_rows: u64,
}

/// `schema` with each string or binary column of `roots` that is dictionary-encoded in every
/// data page of every row group of `groups` read as a dictionary (int32 keys into the chunk's
/// dictionary page), its other columns as they are. The ops then work on a dictionary's values
/// once rather than on every row (`table::dictionary`), and shuffling or gathering rows
/// moves their keys, not their bytes. A chunk with any page written plain (a writer whose
/// dictionary grew past its limit falls back) is read plain: the reader would intern its
/// values into a dictionary, costing more than it saves.
pub(crate) fn kept_dictionaries(
    schema: &arrow_schema::Schema,
    metadata: &ParquetMetaData,
    groups: &[usize],
    roots: &[usize],
) -> arrow_schema::Schema {
    let leaves = metadata.file_metadata().schema_descr().columns();
    let fields = schema.fields().iter().enumerate().map(|(root, field)| {
        let bytes = matches!(field.data_type(), DataType::Utf8 | DataType::Binary);
        let leaf = leaves.iter().position(|c| c.path().parts() == [field.name().as_str()]);
        let all_dictionary = |leaf: usize| {
            groups.iter().all(|&g| {
                let chunk = metadata.row_group(g).column(leaf);
                chunk.dictionary_page_offset().is_some()
                    && chunk.page_encoding_stats_mask().is_some_and(|m| {
                        m.is_only(parquet::basic::Encoding::RLE_DICTIONARY)
                            || m.is_only(parquet::basic::Encoding::PLAIN_DICTIONARY)
                    })
            })
        };
        match leaf {
            Some(leaf) if bytes && roots.contains(&root) && all_dictionary(leaf) => {
                let keyed = DataType::Dictionary(Box::new(DataType::Int32), Box::new(field.data_type().clone()));
                Arc::new(field.as_ref().clone().with_data_type(keyed))
            }
            _ => field.clone(),
        }
    });
    arrow_schema::Schema::new_with_metadata(fields.collect::<Vec<_>>(), schema.metadata().clone())
}

/// Whether the statistics of column chunk `leaf` of `group` prove that `filter` drops every
/// row: a numeric target (the op compares numbers then, `apply::keeps`), a minimum and maximum
/// outside what it keeps, and no nulls (a row without the field fails the op instead of being
/// dropped, so a chunk with nulls, or that does not say, is read).
fn excludes(group: &RowGroupMetaData, leaf: usize, filter: &Filter) -> bool {
    let Some(stats) = group.column(leaf).statistics() else { return false };
    // As f64, as the op compares them: the conversion keeps the order, so the bounds hold.
    let bounds = match stats {
        Statistics::Int32(s) => s.min_opt().zip(s.max_opt()).map(|(a, b)| (f64::from(*a), f64::from(*b))),
        Statistics::Int64(s) => s.min_opt().zip(s.max_opt()).map(|(a, b)| (*a as f64, *b as f64)),
        Statistics::Float(s) => s.min_opt().zip(s.max_opt()).map(|(a, b)| (f64::from(*a), f64::from(*b))),
        Statistics::Double(s) => s.min_opt().zip(s.max_opt()).map(|(a, b)| (*a, *b)),
        _ => None,
    };
    rules_out(filter, stats.null_count_opt(), bounds)
}

/// The rows of `groups` (in that order) the page index shows no `prunes` filter can keep, as
/// a selection of the rest, and how many they are; None when it rules out none (or the file
/// has no page index). A page is ruled out as a row group is (`rules_out`), on its own
/// minimum, maximum and null count; a row goes when any filter rules out its page.
fn page_selection(
    metadata: &ParquetMetaData,
    groups: &[usize],
    prunes: &[(usize, &Filter)],
) -> Option<(RowSelection, u64)> {
    let mut selectors = Vec::new();
    let mut skipped = 0u64;
    for &g in groups {
        let rows = metadata.row_group(g).num_rows() as usize;
        let index = metadata.page_index_for_row_group(g);
        // The row ranges ruled out, then merged in order.
        let mut out: Vec<Range<usize>> = Vec::new();
        for &(leaf, filter) in prunes {
            let (Some(pages), Some(offsets)) = (index.column_index(leaf), index.offset_index(leaf)) else { continue };
            let starts: Vec<usize> = offsets.page_locations().iter().map(|p| p.first_row_index as usize).collect();
            for (page, &start) in starts.iter().enumerate() {
                let end = starts.get(page + 1).copied().unwrap_or(rows);
                let nulls = pages.null_count(page).and_then(|n| u64::try_from(n).ok());
                if start < end && rules_out(filter, nulls, page_bounds(pages, page)) {
                    out.push(start..end);
                }
            }
        }
        out.sort_by_key(|r| r.start);
        let mut at = 0;
        for range in out {
            if range.end <= at {
                continue;
            }
            let start = range.start.max(at);
            if start > at {
                selectors.push(RowSelector::select(start - at));
            }
            selectors.push(RowSelector::skip(range.end - start));
            skipped += (range.end - start) as u64;
            at = range.end;
        }
        if rows > at {
            selectors.push(RowSelector::select(rows - at));
        }
    }
    (skipped > 0).then(|| (RowSelection::from(selectors), skipped))
}

/// A page's minimum and maximum in its column index, as f64 (numbers only).
fn page_bounds(index: &ColumnIndexMetaData, page: usize) -> Option<(f64, f64)> {
    match index {
        ColumnIndexMetaData::INT32(i) => {
            i.min_value(page).zip(i.max_value(page)).map(|(a, b)| (f64::from(*a), f64::from(*b)))
        }
        ColumnIndexMetaData::INT64(i) => i.min_value(page).zip(i.max_value(page)).map(|(a, b)| (*a as f64, *b as f64)),
        ColumnIndexMetaData::FLOAT(i) => {
            i.min_value(page).zip(i.max_value(page)).map(|(a, b)| (f64::from(*a), f64::from(*b)))
        }
        ColumnIndexMetaData::DOUBLE(i) => i.min_value(page).zip(i.max_value(page)).map(|(a, b)| (*a, *b)),
        _ => None,
    }
}

/// Whether values between `bounds` (a row group's or a page's), with `nulls` nulls, all fail
/// `filter`: see [`excludes`].
fn rules_out(filter: &Filter, nulls: Option<u64>, bounds: Option<(f64, f64)>) -> bool {
    let Ok(target) = filter.value.parse::<f64>() else { return false };
    if nulls != Some(0) {
        return false;
    }
    let Some((min, max)) = bounds.filter(|(a, b)| !a.is_nan() && !b.is_nan()) else { return false };
    match filter.op {
        FilterOp::Gt => max <= target,
        FilterOp::Ge => max < target,
        FilterOp::Lt => min >= target,
        FilterOp::Le => min > target,
        FilterOp::Eq => target < min || target > max,
        FilterOp::Ne => min == target && max == target,
    }
}

/// Ranged reads of one object, as the Parquet reader asks for them.
struct Ranges {
    store: Arc<dyn ObjectStore>,
    path: Path,
    size: u64,
    fetched: Arc<AtomicU64>,
    reads: Option<Arc<SourceReads>>,
}

impl Ranges {
    /// Counts a fetch of `bytes` that took from `started` until now.
    fn count(&self, bytes: u64, started: std::time::Instant) {
        if let Some(reads) = &self.reads {
            reads.add(bytes, started.elapsed());
        }
    }
}

fn store_error(e: object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl AsyncFileReader for Ranges {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        let bytes = range.end - range.start;
        self.fetched.fetch_add(bytes, Ordering::Relaxed);
        async move {
            let started = std::time::Instant::now();
            let got = self.store.get_range(&self.path, range).await.map_err(store_error)?;
            self.count(bytes, started);
            Ok(got)
        }
        .boxed()
    }

    fn get_byte_ranges(&mut self, ranges: Vec<Range<u64>>) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        let bytes = ranges.iter().map(|r| r.end - r.start).sum();
        self.fetched.fetch_add(bytes, Ordering::Relaxed);
        async move {
            let started = std::time::Instant::now();
            let got = self.store.get_ranges(&self.path, &ranges).await.map_err(store_error)?;
            self.count(bytes, started);
            Ok(got)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            let size = self.size;
            let reader = ParquetMetaDataReader::new().with_arrow_reader_options(options);
            Ok(Arc::new(reader.load_and_finish(self, size).await?))
        }
        .boxed()
    }
}

/// Whether a column of `data_type` becomes an element field.
fn readable(data_type: &DataType) -> bool {
    match data_type {
        DataType::List(item) | DataType::LargeList(item) => scalar(item.data_type()),
        other => scalar(other),
    }
}

fn scalar(data_type: &DataType) -> bool {
    use DataType::*;
    match data_type {
        Boolean | Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Float32 | Float64 => true,
        Utf8 | LargeUtf8 | Utf8View | Binary | LargeBinary | BinaryView | FixedSizeBinary(_) => true,
        Dictionary(_, values) => scalar(values),
        _ => false,
    }
}

/// The rows of `batch` as elements (a null leaves its field out).
pub fn elements(batch: &RecordBatch) -> Vec<Element> {
    let mut rows = vec![Element::new(); batch.num_rows()];
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        for (row, value) in rows.iter_mut().zip(values(column)) {
            if let Some(value) = value {
                row.insert(field.name().clone(), value);
            }
        }
    }
    rows
}

/// Each row's value of `column` as a field, None where it is null.
fn values(column: &ArrayRef) -> Vec<Option<Field>> {
    let valid = |i: usize| column.is_valid(i);
    let n = column.len();
    match column.data_type() {
        DataType::List(_) | DataType::LargeList(_) => {
            let item = |i: usize| -> ArrayRef {
                match column.data_type() {
                    DataType::List(_) => column.as_list::<i32>().value(i),
                    _ => column.as_list::<i64>().value(i),
                }
            };
            (0..n).map(|i| valid(i).then(|| list(&item(i)))).collect()
        }
        _ => {
            let each = scalars(column);
            each.into_iter().enumerate().map(|(i, v)| v.filter(|_| valid(i))).collect()
        }
    }
}

/// A list's values as one field: numbers as a numeric list, strings and binary as bytes.
fn list(items: &ArrayRef) -> Field {
    match items.data_type() {
        DataType::Float32 => Field::Float32(items.as_primitive::<Float32Type>().values().to_vec()),
        DataType::Float64 => Field::Float64(items.as_primitive::<Float64Type>().values().to_vec()),
        _ => match int64s(items) {
            Some(ints) => Field::Int64(ints),
            None => Field::BytesList(byte_strings(items).into_iter().map(Option::unwrap_or_default).collect()),
        },
    }
}

/// One field per row (nulls included: the caller leaves them out).
fn scalars(column: &ArrayRef) -> Vec<Option<Field>> {
    match column.data_type() {
        DataType::Float32 => {
            column.as_primitive::<Float32Type>().values().iter().map(|v| Some(Field::Float32(vec![*v]))).collect()
        }
        DataType::Float64 => {
            column.as_primitive::<Float64Type>().values().iter().map(|v| Some(Field::Float64(vec![*v]))).collect()
        }
        _ => match int64s(column) {
            Some(ints) => ints.into_iter().map(|v| Some(Field::Int64(vec![v]))).collect(),
            None => byte_strings(column).into_iter().map(|b| b.map(Field::Bytes)).collect(),
        },
    }
}

/// Integer and boolean columns as int64 (unsigned 64-bit ones wrap, as numpy's cast does).
fn int64s(column: &ArrayRef) -> Option<Vec<i64>> {
    fn all<T: arrow_array::ArrowPrimitiveType>(column: &ArrayRef, f: impl Fn(T::Native) -> i64) -> Vec<i64> {
        column.as_primitive::<T>().values().iter().map(|v| f(*v)).collect()
    }
    Some(match column.data_type() {
        DataType::Boolean => column.as_boolean().values().iter().map(i64::from).collect(),
        DataType::Int8 => all::<Int8Type>(column, i64::from),
        DataType::Int16 => all::<Int16Type>(column, i64::from),
        DataType::Int32 => all::<Int32Type>(column, i64::from),
        DataType::Int64 => all::<Int64Type>(column, |v| v),
        DataType::UInt8 => all::<UInt8Type>(column, i64::from),
        DataType::UInt16 => all::<UInt16Type>(column, i64::from),
        DataType::UInt32 => all::<UInt32Type>(column, i64::from),
        DataType::UInt64 => all::<UInt64Type>(column, |v| v as i64),
        _ => return None,
    })
}

/// String and binary columns, dictionary-encoded or not, as bytes per row (None: null).
fn byte_strings(column: &ArrayRef) -> Vec<Option<Bytes>> {
    let copy = |v: Option<&[u8]>| v.map(Bytes::copy_from_slice);
    match column.data_type() {
        DataType::Utf8 => column.as_string::<i32>().iter().map(|v| copy(v.map(str::as_bytes))).collect(),
        DataType::LargeUtf8 => column.as_string::<i64>().iter().map(|v| copy(v.map(str::as_bytes))).collect(),
        DataType::Utf8View => column.as_string_view().iter().map(|v| copy(v.map(str::as_bytes))).collect(),
        DataType::Binary => column.as_binary::<i32>().iter().map(copy).collect(),
        DataType::LargeBinary => column.as_binary::<i64>().iter().map(copy).collect(),
        DataType::BinaryView => column.as_binary_view().iter().map(copy).collect(),
        DataType::FixedSizeBinary(_) => column.as_fixed_size_binary().iter().map(copy).collect(),
        DataType::Dictionary(_, _) => {
            let dictionary = column.as_any_dictionary();
            let values = byte_strings(dictionary.values());
            dictionary
                .normalized_keys()
                .into_iter()
                .enumerate()
                .map(|(i, key)| if column.is_valid(i) { values.get(key).cloned().flatten() } else { None })
                .collect()
        }
        other => unreachable!("{other} is checked readable before reading"),
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::builder::{Int64Builder, ListBuilder};
    use arrow_array::{BooleanArray, Float32Array, Int32Array, StringArray};
    use object_store::local::LocalFileSystem;
    use parquet::arrow::ArrowWriter;
    use parquet::basic::{Compression, ZstdLevel};
    use parquet::file::properties::WriterProperties;

    use super::*;

    /// A file of 10 rows in row groups of 4 (4, 4, 2): an int32 id, a float label with a
    /// null, a dictionary-encoded string, a boolean and an id list, zstd-compressed.
    fn write(dir: &std::path::Path) -> ParquetFile {
        write_with(dir, Compression::ZSTD(ZstdLevel::default()))
    }

    fn write_with(dir: &std::path::Path, compression: Compression) -> ParquetFile {
        let ids = Int32Array::from_iter_values(0..10);
        let label = Float32Array::from_iter((0..10).map(|i| (i != 3).then_some(i as f32 / 2.0)));
        let city = StringArray::from_iter_values((0..10).map(|i| ["oslo", "lima"][i % 2]));
        let flag = BooleanArray::from_iter((0..10).map(|i| Some(i % 3 == 0)));
        let mut lists = ListBuilder::new(Int64Builder::new());
        for i in 0..10i64 {
            lists.values().append_slice(&(0..i % 3).map(|j| i * 10 + j).collect::<Vec<_>>());
            lists.append(true);
        }
        let batch = RecordBatch::try_from_iter([
            ("id", Arc::new(ids) as ArrayRef),
            ("label", Arc::new(label) as ArrayRef),
            ("city", Arc::new(city) as ArrayRef),
            ("flag", Arc::new(flag) as ArrayRef),
            ("history", Arc::new(lists.finish()) as ArrayRef),
        ])
        .unwrap();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(4))
            .set_compression(compression)
            .set_dictionary_enabled(true)
            .build();
        file_of(&dir.join("part-0.parquet"), &batch, props)
    }

    /// `batch` written to `path` with `props`, as a source's file.
    fn file_of(path: &std::path::Path, batch: &RecordBatch, props: WriterProperties) -> ParquetFile {
        let mut writer =
            ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
        writer.write(batch).unwrap();
        writer.close().unwrap();
        let size = std::fs::metadata(path).unwrap().len();
        let store: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new());
        ParquetFile::new(store, Path::from_filesystem_path(path).unwrap(), size)
    }

    fn read(file: &ParquetFile, groups: Range<usize>, columns: Option<&[&str]>) -> Vec<Element> {
        let columns: Option<Vec<String>> = columns.map(|c| c.iter().map(|s| s.to_string()).collect());
        let read = futures::executor::block_on(file.read(groups, columns.as_deref(), &[])).unwrap();
        read.batches.iter().flat_map(elements).collect()
    }

    /// Strings dictionary-encoded in every page (`few`) are read as a dictionary, those a
    /// writer fell back to plain for (`many`, past its dictionary limit) plain; read by one
    /// decoder or by several groups of columns at once, the same rows in the file's order.
    #[tokio::test(flavor = "multi_thread")]
    async fn whole_dictionaries_are_kept_and_column_groups_decode_the_same_rows() {
        let dir = tempfile::tempdir().unwrap();
        let rows = 3000;
        let batch = RecordBatch::try_from_iter([
            ("id", Arc::new(Int32Array::from_iter_values(0..rows)) as ArrayRef),
            (
                "few",
                Arc::new(StringArray::from_iter((0..rows).map(|i| (i % 5 != 0).then(|| ["a", "b"][i as usize % 2]))))
                    as ArrayRef,
            ),
            ("many", Arc::new(StringArray::from_iter_values((0..rows).map(|i| format!("{i:08x}")))) as ArrayRef),
            ("label", Arc::new(Float32Array::from_iter_values((0..rows).map(|i| i as f32))) as ArrayRef),
        ])
        .unwrap();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(1000))
            .set_dictionary_page_size_limit(1024)
            .build();
        let file = file_of(&dir.path().join("part-0.parquet"), &batch, props);
        let alone = file.read(0..3, None, &[]).await.unwrap();
        let schema = alone.batches[0].schema();
        let types: Vec<String> = schema.fields().iter().map(|f| f.data_type().to_string()).collect();
        assert_eq!(types, ["Int32", "Dictionary(Int32, Utf8)", "Utf8", "Float32"]);
        let file = file.with_decoders(3);
        let grouped = file.read(0..3, None, &[]).await.unwrap();
        assert_eq!(grouped.batches[0].schema(), schema, "the file's order");
        let (alone, grouped): (Vec<Element>, Vec<Element>) =
            (alone.batches.iter().flat_map(elements).collect(), grouped.batches.iter().flat_map(elements).collect());
        assert_eq!(alone.len(), rows as usize);
        assert_eq!(alone, grouped);
        assert_eq!(alone[7]["few"], Field::Bytes(Bytes::from_static(b"b")));
        assert!(!alone[10].contains_key("few"), "a null stays a missing field");
    }

    #[test]
    fn row_groups_are_read_alone_with_only_the_named_columns() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path());
        let meta = futures::executor::block_on(file.metadata()).unwrap();
        assert_eq!(meta.num_row_groups(), 3);
        let footer = file.fetched();
        let rows = read(&file, 1..2, Some(&["label", "city"]));
        assert_eq!(rows.len(), 4, "the second row group: rows 4-7");
        // Only those two columns' chunks of that row group were fetched after the footer.
        let group = meta.row_group(1);
        let chunks: u64 = [1, 2].iter().map(|&c| group.column(c).compressed_size() as u64).sum();
        assert_eq!(file.fetched() - 2 * footer, chunks, "the footer again, then the two chunks");
        // With the footer planning read, only the chunks.
        let file = file.with_footer(Some(meta));
        let before = file.fetched();
        assert_eq!(read(&file, 1..2, Some(&["label", "city"])).len(), 4);
        assert_eq!(file.fetched() - before, chunks, "the two chunks alone");
        // Counted for its source too (the worker's metrics), the same bytes.
        let reads = Arc::new(SourceReads::default());
        let file = file.counting(reads.clone());
        assert_eq!(read(&file, 1..2, Some(&["label", "city"])).len(), 4);
        assert_eq!(reads.bytes.load(Ordering::Relaxed), chunks);
        assert!(reads.nanos.load(Ordering::Relaxed) > 0);
        assert_eq!(rows[0].keys().collect::<Vec<_>>(), ["city", "label"], "only the named columns");
        assert_eq!(rows[0]["label"], Field::Float32(vec![2.0]));
        assert_eq!(rows[1]["city"], Field::Bytes(Bytes::from_static(b"lima")));
    }

    #[test]
    fn every_type_becomes_a_field_and_a_null_leaves_it_out() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path());
        let rows = read(&file, 0..3, None);
        assert_eq!(rows.len(), 10);
        assert_eq!(rows[3].get("label"), None, "row 3's label is null");
        assert_eq!(rows[5]["id"], Field::Int64(vec![5]));
        assert_eq!(rows[6]["flag"], Field::Int64(vec![1]));
        assert_eq!(rows[5]["history"], Field::Int64(vec![50, 51]));
        assert_eq!(rows[3]["history"], Field::Int64(vec![]), "an empty list is a field with no values");
    }

    /// The file of `write`: ids 0-3, 4-7 and 8-9 in its row groups; label null in row 3.
    #[test]
    fn a_leading_filter_skips_the_row_groups_its_statistics_rule_out() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path());
        let filter = |field: &str, op, value: &str| Filter { field: field.into(), op, value: value.into() };
        let skipped = |filters: &[Filter], columns: Option<&[String]>| {
            let read = futures::executor::block_on(file.read(0..3, columns, filters)).unwrap();
            (read.skipped_rows, read.batches.iter().map(RecordBatch::num_rows).sum::<usize>())
        };
        assert_eq!(skipped(&[filter("id", FilterOp::Ge, "5")], None), (4, 6), "row group 0 (ids 0-3) skipped");
        assert_eq!(skipped(&[filter("id", FilterOp::Lt, "4")], None), (6, 4));
        assert_eq!(skipped(&[filter("id", FilterOp::Eq, "9")], None), (8, 2));
        assert_eq!(skipped(&[filter("id", FilterOp::Ne, "9")], None), (0, 10), "no group is all 9");
        assert_eq!(skipped(&[filter("id", FilterOp::Gt, "99")], None), (10, 0), "nothing fetched");
        // Rows 0-3 hold labels 0, 0.5, 1 and a null: the null keeps the group, whose row 3
        // would fail the op rather than be dropped; the others (2-3.5, 4-4.5) go.
        assert_eq!(skipped(&[filter("label", FilterOp::Gt, "4.5")], None), (6, 4));
        // Text targets compare bytes, and a column not read never prunes.
        assert_eq!(skipped(&[filter("id", FilterOp::Gt, "x")], None), (0, 10));
        assert_eq!(skipped(&[filter("id", FilterOp::Gt, "99")], Some(&["city".to_string()])), (0, 10));
    }

    /// One row group of 10,000 ids in order, in pages of 500 rows with a page index (the
    /// writer's default): a filter on the ids reads the pages that can hold what it keeps.
    #[test]
    fn the_page_index_skips_the_pages_a_filter_rules_out() {
        let dir = tempfile::tempdir().unwrap();
        let ids = arrow_array::Int64Array::from_iter_values(0..10_000);
        // A column no filter names, read beside: its pages are skipped with the rows.
        let score = Float32Array::from_iter_values((0..10_000).map(|i| i as f32 / 2.0));
        let batch =
            RecordBatch::try_from_iter([("id", Arc::new(ids) as ArrayRef), ("score", Arc::new(score) as ArrayRef)])
                .unwrap();
        let props = WriterProperties::builder()
            .set_data_page_row_count_limit(500)
            .set_write_batch_size(500)
            .set_dictionary_enabled(false)
            .build();
        let path = dir.path().join("paged.parquet");
        file_of(&path, &batch, props);
        let read = |filters: &[Filter]| {
            // A file of its own each time: its count of bytes fetched starts at 0.
            let size = std::fs::metadata(&path).unwrap().len();
            let file =
                ParquetFile::new(Arc::new(LocalFileSystem::new()), Path::from_filesystem_path(&path).unwrap(), size);
            let read = futures::executor::block_on(file.read(0..1, None, filters)).unwrap();
            let ids: Vec<i64> =
                read.batches.iter().flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec()).collect();
            (read.skipped_rows, ids, file.fetched())
        };
        let (none, all, everything) = read(&[]);
        assert_eq!((none, all.len()), (0, 10_000));
        let ge = Filter { field: "id".into(), op: FilterOp::Ge, value: "8750".into() };
        let (skipped, ids, fetched) = read(&[ge]);
        // Pages 0-16 (ids 0-8499) go; page 17 (8500-8999) holds 8750 and is read whole.
        assert_eq!(skipped, 8500);
        assert_eq!(ids, (8500..10_000).collect::<Vec<_>>());
        assert!(fetched < everything / 2, "{fetched} bytes fetched of {everything}");
        // Two filters: a row goes when either rules out its page.
        let lt = Filter { field: "id".into(), op: FilterOp::Lt, value: "9200".into() };
        let ge = Filter { field: "id".into(), op: FilterOp::Ge, value: "8750".into() };
        let (skipped, ids, _) = read(&[ge, lt]);
        assert_eq!((skipped, ids.first(), ids.last()), (9000, Some(&8500), Some(&9499)));
        // A filter no page fails skips nothing.
        let (skipped, ids, _) = read(&[Filter { field: "id".into(), op: FilterOp::Ge, value: "-1".into() }]);
        assert_eq!((skipped, ids.len()), (0, 10_000));
    }

    #[test]
    fn every_common_codec_is_read() {
        use parquet::basic::{Compression::*, GzipLevel};
        for codec in [UNCOMPRESSED, SNAPPY, GZIP(GzipLevel::default()), LZ4, LZ4_RAW, ZSTD(ZstdLevel::default())] {
            let dir = tempfile::tempdir().unwrap();
            let rows = read(&write_with(dir.path(), codec), 0..3, Some(&["id", "city"]));
            assert_eq!(rows.len(), 10, "{codec:?}");
            assert_eq!(rows[9]["city"], Field::Bytes(Bytes::from_static(b"lima")), "{codec:?}");
        }
    }

    #[test]
    fn a_missing_column_or_row_group_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path());
        let err = futures::executor::block_on(file.read(0..1, Some(&["price".to_string()]), &[])).unwrap_err();
        assert!(err.to_string().contains("no column \"price\" (it has id, label, city, flag, history)"), "{err}");
        let err = futures::executor::block_on(file.read(2..4, None, &[])).unwrap_err();
        assert!(err.to_string().contains("has 3 row groups, not 2..4"), "{err}");
    }
}
