//! Reading and rebuilding Arrow columns the way every feature op needs: dictionaries
//! unpacked, a list's items worked on with the list kept around them, numbers and byte
//! strings taken whatever their Arrow type.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, GenericListArray, OffsetSizeTrait};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field};

/// Why an op cannot take a column: the same for every row, so a spec or data mismatch to
/// report, not a record to skip.
pub type ColumnResult<T> = Result<T, String>;

/// The column with a dictionary's values looked up (Parquet's dictionary-encoded strings).
pub fn plain(column: &ArrayRef) -> ArrayRef {
    match column.as_any_dictionary_opt() {
        Some(dictionary) => arrow_select::take::take(dictionary.values().as_ref(), dictionary.keys(), None)
            .expect("a dictionary's keys index its values"),
        None => column.clone(),
    }
}

/// The same columns, unless their types differ: then with every dictionary unpacked (a
/// column read as a dictionary from one row group and plain from another), or the first
/// column's type and the one that still differs from it.
pub fn same_type(columns: Vec<ArrayRef>) -> Result<Vec<ArrayRef>, (DataType, DataType)> {
    let differs =
        |cs: &[ArrayRef]| cs.iter().find(|c| c.data_type() != cs[0].data_type()).map(|c| c.data_type().clone());
    if differs(&columns).is_none() {
        return Ok(columns);
    }
    let unpacked: Vec<ArrayRef> = columns.iter().map(plain).collect();
    match differs(&unpacked) {
        None => Ok(unpacked),
        Some(other) => Err((columns[0].data_type().clone(), other)),
    }
}

/// Applies `f` to the column's items: a list's values (only those of its rows, when the list
/// is a slice), rebuilt into a list of the same lengths and nulls; any other column whole.
pub fn per_item(column: &ArrayRef, f: impl Fn(&ArrayRef) -> ColumnResult<ArrayRef>) -> ColumnResult<ArrayRef> {
    match column.data_type() {
        DataType::List(_) => on_list(column.as_list::<i32>(), f),
        DataType::LargeList(_) => on_list(column.as_list::<i64>(), f),
        _ => f(&plain(column)),
    }
}

fn on_list<O: OffsetSizeTrait>(
    list: &GenericListArray<O>,
    f: impl Fn(&ArrayRef) -> ColumnResult<ArrayRef>,
) -> ColumnResult<ArrayRef> {
    let (values, offsets) = list_values(list);
    let values = f(&plain(&values))?;
    Ok(Arc::new(list_of(values, offsets, list.nulls().cloned())))
}

/// A list's own values (from its first row's to its last's) and its offsets into them.
pub fn list_values<O: OffsetSizeTrait>(list: &GenericListArray<O>) -> (ArrayRef, OffsetBuffer<O>) {
    let offsets = list.value_offsets();
    let (first, last) = (offsets[0], offsets[offsets.len() - 1]);
    let values = list.values().slice(first.as_usize(), (last - first).as_usize());
    let rebased: Vec<O> = offsets.iter().map(|o| *o - first).collect();
    (values, OffsetBuffer::new(ScalarBuffer::from(rebased)))
}

/// A list of `values` cut at `offsets`.
pub fn list_of<O: OffsetSizeTrait>(
    values: ArrayRef,
    offsets: OffsetBuffer<O>,
    nulls: Option<arrow_buffer::NullBuffer>,
) -> GenericListArray<O> {
    let item = Arc::new(Field::new_list_field(values.data_type().clone(), true));
    GenericListArray::new(item, offsets, values, nulls)
}

/// A numeric (or boolean) column's values as f64, unsigned ones as the unsigned values they
/// are (a null's slot holds whatever it holds); None for other types.
pub fn numbers(column: &ArrayRef) -> Option<Vec<f64>> {
    macro_rules! all {
        ($t:ty) => {
            column.as_primitive::<$t>().values().iter().map(|v| *v as f64).collect()
        };
    }
    Some(match column.data_type() {
        DataType::Float32 => column.as_primitive::<Float32Type>().values().iter().map(|v| f64::from(*v)).collect(),
        DataType::Float64 => column.as_primitive::<Float64Type>().values().to_vec(),
        DataType::Int64 => all!(Int64Type),
        DataType::UInt64 => all!(UInt64Type),
        DataType::Boolean => column.as_boolean().values().iter().map(|b| f64::from(u8::from(b))).collect(),
        _ => integers(column)?.into_iter().map(|v| v as f64).collect(),
    })
}

/// An integer (or boolean) column's values exactly, unsigned 64-bit ones included; None for
/// other types.
pub fn wide_integers(column: &ArrayRef) -> Option<Vec<i128>> {
    match column.data_type() {
        DataType::UInt64 => Some(column.as_primitive::<UInt64Type>().values().iter().map(|v| i128::from(*v)).collect()),
        _ => Some(integers(column)?.into_iter().map(i128::from).collect()),
    }
}

/// An integer (or boolean) column's values as i64, unsigned 64-bit ones wrapping (what the
/// hash and the batch's int64 take); None for other types.
pub fn integers(column: &ArrayRef) -> Option<Vec<i64>> {
    macro_rules! all {
        ($t:ty) => {
            column.as_primitive::<$t>().values().iter().map(|v| *v as i64).collect()
        };
    }
    Some(match column.data_type() {
        DataType::Int8 => all!(Int8Type),
        DataType::Int16 => all!(Int16Type),
        DataType::Int32 => all!(Int32Type),
        DataType::Int64 => column.as_primitive::<Int64Type>().values().to_vec(),
        DataType::UInt8 => all!(UInt8Type),
        DataType::UInt16 => all!(UInt16Type),
        DataType::UInt32 => all!(UInt32Type),
        DataType::UInt64 => all!(UInt64Type),
        DataType::Boolean => column.as_boolean().values().iter().map(i64::from).collect(),
        _ => return None,
    })
}

/// `values` with each null slot (per `nulls`) set to `fill`, a word of 64 slots at a time: a
/// word without a null is copied whole, instead of a validity bit tested per slot.
pub fn fill_slots<T: Copy>(values: &[T], nulls: &arrow_buffer::NullBuffer, fill: T) -> Vec<T> {
    let mut filled = values.to_vec();
    for (word, valid) in nulls.inner().bit_chunks().iter_padded().enumerate() {
        let mut missing = !valid;
        while missing != 0 {
            let slot = word * 64 + missing.trailing_zeros() as usize;
            // The last word's padding reads as null.
            let Some(value) = filled.get_mut(slot) else { break };
            *value = fill;
            missing &= missing - 1;
        }
    }
    filled
}

/// Whether the column holds floats (as opposed to integers or booleans).
pub fn is_float(column: &ArrayRef) -> bool {
    matches!(column.data_type(), DataType::Float32 | DataType::Float64 | DataType::Float16)
}

/// A string or binary column's values (a null's as empty); None for other types.
pub fn byte_strings(column: &ArrayRef) -> Option<Vec<&[u8]>> {
    let mut values = Vec::with_capacity(column.len());
    for_each_bytes(column, |v| values.push(v)).then_some(values)
}

/// Whether a column of `data_type` holds strings or binary.
pub fn is_bytes(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    )
}

/// Calls `f` with each value of a string or binary column in order (a null's is whatever its
/// slot holds, usually empty); false for other types. Reads the offsets and bytes directly:
/// the per-value iterators check validity and build a `str` each time, a third of a hash's
/// cost for Criteo's 8-byte strings.
pub fn for_each_bytes<'a>(column: &'a ArrayRef, mut f: impl FnMut(&'a [u8])) -> bool {
    fn ranges<'a, O: arrow_array::OffsetSizeTrait>(offsets: &'a [O], data: &'a [u8], f: &mut impl FnMut(&'a [u8])) {
        for w in offsets.windows(2) {
            f(&data[w[0].as_usize()..w[1].as_usize()]);
        }
    }
    match column.data_type() {
        DataType::Utf8 => {
            let a = column.as_string::<i32>();
            ranges(a.value_offsets(), a.value_data(), &mut f)
        }
        DataType::LargeUtf8 => {
            let a = column.as_string::<i64>();
            ranges(a.value_offsets(), a.value_data(), &mut f)
        }
        DataType::Binary => {
            let a = column.as_binary::<i32>();
            ranges(a.value_offsets(), a.value_data(), &mut f)
        }
        DataType::LargeBinary => {
            let a = column.as_binary::<i64>();
            ranges(a.value_offsets(), a.value_data(), &mut f)
        }
        DataType::Utf8View => column.as_string_view().iter().for_each(|s| f(s.map(str::as_bytes).unwrap_or_default())),
        DataType::BinaryView => column.as_binary_view().iter().for_each(|s| f(s.unwrap_or_default())),
        _ => return false,
    }
    true
}

/// The column's type, for an error message.
pub fn describe(column: &ArrayRef) -> String {
    column.data_type().to_string()
}

/// XXH64 with seed 0: the hash `hashBucket` and `cross` promise (docs/transforms.md).
pub fn xxh64(bytes: &[u8]) -> u64 {
    twox_hash::XxHash64::oneshot(0, bytes)
}

/// `h % buckets` without a division: Lemire, Kaser and Kurz's direct remainder ("Faster
/// Remainder by Direct Computation", 2019) with a 128-bit reciprocal, exact for every 64-bit
/// value and divisor. A 64-bit division cost as much as the hash of a Criteo string.
#[derive(Clone, Copy, Debug)]
pub struct Buckets {
    count: u64,
    /// ceil(2^128 / count); 0 for one bucket.
    reciprocal: u128,
}

impl Buckets {
    pub fn new(count: u64) -> Buckets {
        assert!(count > 0, "validation refuses zero buckets");
        let reciprocal = if count == 1 { 0 } else { u128::MAX / u128::from(count) + 1 };
        Buckets { count, reciprocal }
    }

    /// The bucket of `h`: `h % count`.
    pub fn of(&self, h: u64) -> u64 {
        let low = self.reciprocal.wrapping_mul(u128::from(h));
        let (hi, lo) = ((low >> 64) as u64, low as u64);
        let d = u128::from(self.count);
        ((u128::from(hi) * d + ((u128::from(lo) * d) >> 64)) >> 64) as u64
    }
}

/// Each item's xxh64: a byte string's bytes, an integer's (or boolean's) value as 8
/// little-endian bytes of an int64. Floats are refused: bucketize them first.
pub fn hashes(column: &ArrayRef) -> ColumnResult<Vec<u64>> {
    hashes_into(column, |h| h)
}

/// `f` of each item's xxh64 (as `hashes`), in one pass.
pub fn hashes_into<T>(column: &ArrayRef, f: impl Fn(u64) -> T) -> ColumnResult<Vec<T>> {
    let mut hashed = Vec::with_capacity(column.len());
    if for_each_bytes(column, |v| hashed.push(f(xxh64(v)))) {
        return Ok(hashed);
    }
    match integers(column) {
        Some(values) => Ok(values.into_iter().map(|v| f(xxh64(&v.to_le_bytes()))).collect()),
        None => Err(format!(
            "is {}; hashing takes strings, binary, integers and booleans (bucketize floats first)",
            describe(column)
        )),
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::builder::StringDictionaryBuilder;
    use arrow_array::types::Int32Type as Key;
    use arrow_array::{Int64Array, ListArray};

    use super::*;

    #[test]
    fn a_sliced_list_works_on_its_own_values_only() {
        let list = ListArray::from_iter_primitive::<Int64Type, _, _>([
            Some(vec![Some(1), Some(2)]),
            None,
            Some(vec![Some(3)]),
            Some(vec![Some(4), Some(5), Some(6)]),
        ]);
        let sliced: ArrayRef = Arc::new(list.slice(2, 2));
        let seen = std::sync::Mutex::new(0);
        let doubled = per_item(&sliced, |values| {
            *seen.lock().unwrap() = values.len();
            let v = integers(values).unwrap();
            Ok(Arc::new(Int64Array::from_iter_values(v.into_iter().map(|x| x * 2))) as ArrayRef)
        })
        .unwrap();
        assert_eq!(*seen.lock().unwrap(), 4, "the slice's four values, not the list's six");
        let doubled = doubled.as_list::<i32>();
        assert_eq!(doubled.value_offsets(), [0, 1, 4]);
        assert_eq!(integers(doubled.values()).unwrap(), [6, 8, 10, 12]);
    }

    #[test]
    fn fill_slots_fills_exactly_the_null_slots_of_any_slice() {
        let values: Vec<i64> = (0..200).collect();
        let valid: Vec<bool> = (0..200).map(|i| i % 7 != 0 && !(64..130).contains(&i)).collect();
        let array = Int64Array::new(values.into(), Some(arrow_buffer::NullBuffer::from(valid.clone())));
        for (offset, len) in [(0, 200), (3, 190), (64, 70), (130, 70), (199, 1), (5, 0)] {
            let slice = array.slice(offset, len);
            let filled = fill_slots(slice.values(), slice.nulls().unwrap(), -1);
            let expected: Vec<i64> = (offset..offset + len).map(|i| if valid[i] { i as i64 } else { -1 }).collect();
            assert_eq!(filled, expected, "offset {offset}, len {len}");
        }
    }

    #[test]
    fn buckets_are_the_remainder_for_every_value_and_count() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let counts = [1, 2, 3, 7, 97, 1000, 10_000_000, 1 << 32, (1 << 32) + 1, u64::MAX / 3, u64::MAX - 1, u64::MAX];
        let random_counts: Vec<u64> = (0..200).map(|_| next() >> (next() % 64)).collect();
        for count in counts.into_iter().chain(random_counts).filter(|c| *c > 0) {
            let buckets = Buckets::new(count);
            let edges = [0, 1, count - 1, count, count.wrapping_add(1), u64::MAX, u64::MAX - 1];
            let values: Vec<u64> = edges.into_iter().chain((0..500).map(|_| next())).collect();
            for h in values {
                assert_eq!(buckets.of(h), h % count, "{h} % {count}");
            }
        }
    }

    #[test]
    fn dictionaries_are_unpacked_and_hashed_as_their_strings() {
        let mut dictionary = StringDictionaryBuilder::<Key>::new();
        dictionary.append_value("b");
        dictionary.append_value("a");
        dictionary.append_value("b");
        let column: ArrayRef = Arc::new(dictionary.finish());
        assert_eq!(byte_strings(&plain(&column)).unwrap(), [b"b", b"a", b"b"]);
        let hashed = hashes(&plain(&column)).unwrap();
        assert_eq!(hashed[0], hashed[2]);
        // XXH64("a", seed 0) as the reference implementation gives it.
        assert_eq!(hashed[1], 0xd24e_c4f1_a98c_6e5b);
    }
}
