//! Dictionary columns: strings the Parquet reader keeps as keys into their column chunk's
//! dictionary (`formats::parquet::kept_dictionaries`). An op that works item by item runs on
//! a dictionary's values once per table and its rows take their results by key, instead of
//! every row of every piece of the table being unpacked and worked on: a Criteo row group's
//! 131,072 rows hold a few thousand distinct values in most of its columns.

use std::sync::{Arc, Mutex};

use arrow_array::cast::AsArray;
use arrow_array::types::Int32Type;
use arrow_array::{Array, ArrayRef, BinaryArray, DictionaryArray, Int32Array, StringArray};
use arrow_schema::DataType;

use super::column::ColumnResult;

/// What the ops made of the dictionaries of one table (its slices and pieces share it): for
/// op `index`, the values each dictionary's values became.
#[derive(Debug, Default)]
pub struct Memo {
    /// Rows of the table: a dictionary larger than that is cheaper unpacked.
    rows: usize,
    made: Mutex<Vec<(usize, ArrayRef, Made)>>,
}

/// An op's values for one dictionary: being made by the first piece that needed them, then
/// made. A piece that finds them being made works on its own rows instead: waiting would leave
/// a thread idle while the other works (the pieces of a chunk start together), and making them
/// too would do the whole dictionary's work twice.
type Made = Arc<Mutex<Option<ColumnResult<ArrayRef>>>>;

impl Memo {
    pub fn new(rows: usize) -> Arc<Memo> {
        Arc::new(Memo { rows, made: Mutex::default() })
    }

    /// `make` of `values` for op `index`, made once per table; None while another piece
    /// makes them.
    fn values(
        &self,
        index: usize,
        values: &ArrayRef,
        make: impl FnOnce(&ArrayRef) -> ColumnResult<ArrayRef>,
    ) -> Option<ColumnResult<ArrayRef>> {
        let cell = {
            let mut made = self.made.lock().unwrap();
            // The same values are the same `Arc`: a table's slices and takes share their
            // dictionaries' values, and comparing buffers instead cost a copy of each entry's
            // `ArrayData` per look-up.
            let same = |(i, seen, _): &&(usize, ArrayRef, Made)| *i == index && Arc::ptr_eq(seen, values);
            match made.iter().find(same) {
                Some((_, _, cell)) => cell.clone(),
                None => {
                    let cell = Made::default();
                    made.push((index, values.clone(), cell.clone()));
                    let mut making = cell.lock().unwrap();
                    drop(made);
                    let result = make(values);
                    *making = Some(result.clone());
                    return Some(result);
                }
            }
        };
        // Held by its maker until made.
        cell.try_lock().ok()?.clone()
    }

    /// Whether `column` is a dictionary worth working on by value: its values no more than the
    /// table's rows.
    fn takes<'a>(&self, column: &'a ArrayRef) -> Option<&'a dyn arrow_array::AnyDictionaryArray> {
        let dictionary = column.as_any_dictionary_opt()?;
        (dictionary.values().len() <= self.rows.max(column.len())).then_some(dictionary)
    }
}

/// `f` (an op that works item by item) of a dictionary column: `f` of its values, made once
/// per table, looked up by its keys (a null key stays null). None for any other column, and
/// while another piece makes the values: the caller then works on the rows.
pub fn per_value(
    memo: &Memo,
    index: usize,
    column: &ArrayRef,
    f: impl FnOnce(&ArrayRef) -> ColumnResult<ArrayRef>,
) -> Option<ColumnResult<ArrayRef>> {
    let dictionary = memo.takes(column)?;
    Some(memo.values(index, dictionary.values(), f)?.map(|values| {
        arrow_select::take::take(values.as_ref(), dictionary.keys(), None)
            .expect("a dictionary's keys index its values")
    }))
}

/// `fillNull`'s `text` in a dictionary column of strings or binary: its values with `text`
/// added (once per table), its null rows pointed at it. The rows' bytes are never copied. None
/// for any other column, and while another piece adds it.
pub fn fill_text(memo: &Memo, index: usize, column: &ArrayRef, text: &str) -> Option<ArrayRef> {
    let dictionary = column.as_dictionary_opt::<Int32Type>()?;
    if !matches!(dictionary.values().data_type(), DataType::Utf8 | DataType::Binary) || memo.takes(column).is_none() {
        return None;
    }
    let Some(nulls) = column.logical_nulls().filter(|n| n.null_count() > 0) else { return Some(column.clone()) };
    let values = memo.values(index, dictionary.values(), |values| Ok(with_text(values, text)))?.expect("infallible");
    let at = (values.len() - 1) as i32;
    let keys = super::column::fill_slots(dictionary.keys().values(), &nulls, at);
    // SAFETY: every key is the column's own, into values that `values` begins with, or `at`,
    // the text's. Checked, the keys cost a second pass as long as the fill itself.
    let filled = unsafe { DictionaryArray::new_unchecked(Int32Array::from(keys), values) };
    Some(Arc::new(filled))
}

/// Strings or binary `values` with `text` after them (a dictionary may repeat a value).
fn with_text(values: &ArrayRef, text: &str) -> ArrayRef {
    let one: ArrayRef = match values.data_type() {
        DataType::Utf8 => Arc::new(StringArray::from(vec![text])),
        _ => Arc::new(BinaryArray::from(vec![text.as_bytes()])),
    };
    arrow_select::concat::concat(&[values.as_ref(), one.as_ref()]).expect("values of one type")
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use arrow_array::builder::StringDictionaryBuilder;

    use super::*;

    fn dictionary(rows: &[Option<&str>]) -> ArrayRef {
        let mut builder = StringDictionaryBuilder::<Int32Type>::new();
        rows.iter().for_each(|r| builder.append_option(*r));
        Arc::new(builder.finish())
    }

    fn strings(column: &ArrayRef) -> Vec<Option<String>> {
        let plain = super::super::column::plain(column);
        plain.as_string::<i32>().iter().map(|s| s.map(str::to_string)).collect()
    }

    #[test]
    fn an_op_runs_once_per_dictionary_for_every_piece_of_a_table() {
        let column = dictionary(&[Some("a"), None, Some("b"), Some("a"), Some("b"), Some("a")]);
        let memo = Memo::new(column.len());
        let calls = AtomicUsize::new(0);
        let lengths = |values: &ArrayRef| {
            calls.fetch_add(1, Ordering::Relaxed);
            let lengths: Vec<i64> = values.as_string::<i32>().iter().map(|s| s.unwrap().len() as i64 * 10).collect();
            Ok(Arc::new(arrow_array::Int64Array::from(lengths)) as ArrayRef)
        };
        let (first, second) = (column.slice(0, 3), column.slice(3, 3));
        let first = per_value(&memo, 0, &first, lengths).unwrap().unwrap();
        let second = per_value(&memo, 0, &second, lengths).unwrap().unwrap();
        assert_eq!(calls.load(Ordering::Relaxed), 1, "the second piece reuses the first's values");
        let ints = |c: &ArrayRef| c.as_primitive::<arrow_array::types::Int64Type>().iter().collect::<Vec<_>>();
        assert_eq!(ints(&first), [Some(10), None, Some(10)]);
        assert_eq!(ints(&second), [Some(10), Some(10), Some(10)]);
        // Another op's index makes its own.
        per_value(&memo, 1, &column, lengths).unwrap().unwrap();
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_dictionary_larger_than_its_table_is_left_to_be_unpacked() {
        let column = dictionary(&[Some("a"), Some("b"), Some("c"), Some("d")]).slice(0, 2);
        assert!(per_value(&Memo::new(2), 0, &column, |v| Ok(v.clone())).is_none());
        let plain: ArrayRef = Arc::new(StringArray::from(vec!["x"]));
        assert!(per_value(&Memo::new(2), 0, &plain, |v| Ok(v.clone())).is_none());
    }

    #[test]
    fn a_piece_that_finds_the_values_being_made_works_on_its_own_rows() {
        let column = dictionary(&[Some("a"), Some("b"), Some("a"), Some("b")]);
        let memo = Memo::new(column.len());
        let inner = per_value(&memo, 0, &column, |values| {
            assert!(per_value(&memo, 0, &column.slice(2, 2), |v| Ok(v.clone())).is_none(), "being made");
            Ok(values.clone())
        });
        assert_eq!(strings(&inner.unwrap().unwrap()), ["a", "b", "a", "b"].map(|s| Some(s.to_string())));
        assert!(per_value(&memo, 0, &column.slice(2, 2), |_| panic!("made already")).is_some());
    }

    #[test]
    fn fill_text_points_the_null_rows_at_the_text_without_copying_the_rows() {
        let column = dictionary(&[Some("a"), None, Some(""), None, Some("a")]);
        let memo = Memo::new(column.len());
        let filled = fill_text(&memo, 0, &column, "").unwrap();
        assert_eq!(filled.logical_null_count(), 0);
        let expected = ["a", "", "", "", "a"].map(|s| Some(s.to_string()));
        assert_eq!(strings(&filled), expected);
        let again = fill_text(&memo, 0, &column.slice(1, 2), "").unwrap();
        let (a, b) = (filled.as_any_dictionary().values(), again.as_any_dictionary().values());
        assert!(a.to_data().ptr_eq(&b.to_data()), "one set of values for the table");
        let filled = fill_text(&memo, 1, &column, "none").unwrap();
        assert_eq!(strings(&filled), ["a", "none", "", "none", "a"].map(|s| Some(s.to_string())));
    }
}
