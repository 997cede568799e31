//! Packing: a split's token sequences, in order, into rows of exactly `length` tokens, each
//! with the segment and position ids attention masking needs. A small state machine: `push`
//! documents, take the rows they completed, `finish` the split for its padded last row.

use stoker_api::{DType, Pack, Tensor};

use super::stack::{Fields, Row};

/// The output fields besides the packed ids (`Pack::field`).
pub const SEGMENT_IDS: &str = "segment_ids";
pub const POSITION_IDS: &str = "position_ids";

pub struct Packer {
    length: usize,
    field: String,
    separator: Option<i32>,
    pad_id: i32,
    /// The row being filled.
    ids: Vec<i32>,
    segments: Vec<i32>,
    positions: Vec<i32>,
    /// The row's current segment number (0 before its first document).
    segment: i32,
}

impl Packer {
    pub fn new(op: &Pack) -> Packer {
        let length = op.length as usize;
        Packer {
            length,
            field: op.field.clone(),
            separator: op.separator,
            pad_id: op.pad_id,
            ids: Vec::with_capacity(length),
            segments: Vec::with_capacity(length),
            positions: Vec::with_capacity(length),
            segment: 0,
        }
    }

    /// The field the ids come from.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// Adds one document's tokens (and the separator); returns the rows it completed.
    pub fn push(&mut self, tokens: &[i32]) -> Vec<Row> {
        let separator = self.separator.filter(|s| tokens.last() != Some(s));
        let mut rows = Vec::new();
        let mut position = 0;
        let mut new_segment = true;
        for &token in tokens.iter().chain(separator.iter()) {
            if new_segment {
                self.segment += 1;
                new_segment = false;
            }
            self.ids.push(token);
            self.segments.push(self.segment);
            self.positions.push(position);
            position += 1;
            if self.ids.len() == self.length {
                rows.push(self.take_row());
                // The document goes on in the next row: a new segment there, positions from 0.
                (position, new_segment) = (0, true);
            }
        }
        rows
    }

    /// The split's last row, filled with `pad_id` (segment 0), if it has any token.
    pub fn finish(&mut self) -> Option<Row> {
        if self.ids.is_empty() {
            return None;
        }
        let fill = self.length - self.ids.len();
        self.ids.extend(std::iter::repeat_n(self.pad_id, fill));
        self.segments.extend(std::iter::repeat_n(0, fill));
        self.positions.extend(std::iter::repeat_n(0, fill));
        Some(self.take_row())
    }

    fn take_row(&mut self) -> Row {
        let tensor = |values: &mut Vec<i32>| {
            let data: Vec<u8> = values.drain(..).flat_map(i32::to_le_bytes).collect();
            Tensor::new(DType::Int32, vec![self.length], data.into()).expect("length int32 values")
        };
        let row = Row::Fields(Fields::from([
            (self.field.clone(), tensor(&mut self.ids)),
            (SEGMENT_IDS.to_string(), tensor(&mut self.segments)),
            (POSITION_IDS.to_string(), tensor(&mut self.positions)),
        ]));
        self.segment = 0;
        row
    }
}

/// The token ids of a row's `field` (int32 or int64 vectors; other types are not token ids).
pub fn tokens(row: &Row, field: &str) -> Result<Vec<i32>, String> {
    let Row::Fields(fields) = row else { return Err("pack: a table row (pack is not a columnar op)".into()) };
    let t = fields.get(field).ok_or_else(|| format!("pack: the element has no field {field:?}"))?;
    match t.dtype {
        DType::Int32 => {
            Ok(t.data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
        }
        DType::Int64 => t
            .data
            .chunks_exact(8)
            .map(|c| {
                let v = i64::from_le_bytes(c.try_into().expect("8 bytes"));
                i32::try_from(v).map_err(|_| format!("pack: token id {v} of {field:?} does not fit int32"))
            })
            .collect(),
        other => Err(format!("pack: field {field:?} is {}, not token ids (int32 or int64)", other.numpy_name())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(length: u32, separator: Option<i32>) -> Pack {
        Pack { length, field: "ids".into(), separator, pad_id: -1 }
    }

    fn fields(row: &Row) -> &Fields {
        let Row::Fields(fields) = row else { panic!("packed rows are fields") };
        fields
    }

    fn values(row: &Row, field: &str) -> Vec<i32> {
        tokens(row, field).unwrap()
    }

    fn pack(op: &Pack, docs: &[Vec<i32>]) -> Vec<Row> {
        let mut packer = Packer::new(op);
        let mut rows: Vec<Row> = docs.iter().flat_map(|d| packer.push(d)).collect();
        rows.extend(packer.finish());
        rows
    }

    #[test]
    fn documents_fill_rows_with_separators_and_boundaries() {
        let rows = pack(&op(4, Some(0)), &[vec![1, 2], vec![3, 4, 5, 6, 7], vec![8]]);
        let ids: Vec<Vec<i32>> = rows.iter().map(|r| values(r, "ids")).collect();
        assert_eq!(ids, [vec![1, 2, 0, 3], vec![4, 5, 6, 7], vec![0, 8, 0, -1]]);
        let segments: Vec<Vec<i32>> = rows.iter().map(|r| values(r, SEGMENT_IDS)).collect();
        assert_eq!(segments, [vec![1, 1, 1, 2], vec![1, 1, 1, 1], vec![1, 2, 2, 0]]);
        let positions: Vec<Vec<i32>> = rows.iter().map(|r| values(r, POSITION_IDS)).collect();
        assert_eq!(positions, [vec![0, 1, 2, 0], vec![0, 1, 2, 3], vec![0, 0, 1, 0]]);
    }

    #[test]
    fn no_token_is_lost_and_the_same_input_packs_the_same() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as i32
        };
        let docs: Vec<Vec<i32>> = (0..200).map(|_| (0..next() % 50).map(|_| 1 + next() % 1000).collect()).collect();
        for length in [1, 3, 16, 2048] {
            let rows = pack(&op(length, Some(0)), &docs);
            let flat: Vec<i32> = rows.iter().flat_map(|r| values(r, "ids")).filter(|t| *t != -1).collect();
            let want: Vec<i32> = docs.iter().flat_map(|d| d.iter().copied().chain([0])).collect();
            assert_eq!(flat, want, "length {length}: every token once, in order");
            assert!(rows.iter().all(|r| fields(r).values().all(|t| t.shape == [length as usize])));
            // Segments restart in every row and only padding is segment 0.
            for r in &rows {
                let (ids, segments) = (values(r, "ids"), values(r, SEGMENT_IDS));
                assert!(ids.iter().zip(&segments).all(|(i, s)| (*s == 0) == (*i == -1)));
                assert!(segments.windows(2).all(|w| w[1] >= w[0] || w[1] == 0));
            }
            let again = pack(&op(length, Some(0)), &docs);
            let all = |rows: &[Row]| rows.iter().map(|r| fields(r).clone()).collect::<Vec<_>>();
            assert_eq!(all(&rows), all(&again), "deterministic");
        }
    }

    #[test]
    fn a_document_ending_with_the_separator_gets_no_second_one() {
        let rows = pack(&op(8, Some(9)), &[vec![1, 9], vec![2]]);
        assert_eq!(values(&rows[0], "ids"), [1, 9, 2, 9, -1, -1, -1, -1]);
        assert!(pack(&op(8, None), &[]).is_empty(), "nothing to pack, no row");
    }

    #[test]
    fn only_token_ids_pack() {
        let row = Row::Fields(Fields::from([(
            "ids".to_string(),
            Tensor::new(DType::Float32, vec![1], vec![0u8; 4].into()).unwrap(),
        )]));
        assert!(tokens(&row, "ids").unwrap_err().contains("not token ids"));
        assert!(tokens(&row, "other").unwrap_err().contains("no field"));
    }
}
