//! JSONL: one JSON object per line, each becoming an element.
//!
//! Mapping: string → `Bytes` (UTF-8), integer → `Int64`, other number → `Float64`, boolean →
//! `Int64` 0/1, null → field left out; arrays of numbers/booleans → `Int64`, or `Float64` if any
//! is not an integer; arrays of strings → `BytesList`; an empty array, having no element type,
//! → empty `Int64`. Nested objects, mixed or nested arrays and integers beyond int64 have no
//! faithful element form, so the line is reported as `UnsupportedJson` rather than guessed at.
//! Strings are copied out of the line: JSON escapes mean they are not slices of it anyway.

use bytes::Bytes;
use serde_json::{Number, Value};

use super::{Corrupt, CorruptReason};
use crate::element::{Element, Field};

/// The shard's lines as elements; blank lines are skipped, and a bad line is reported with its
/// byte offset while the next line is still read.
pub fn read(data: Bytes, shard: &str) -> impl Iterator<Item = Result<Element, Corrupt>> + use<> {
    let shard = shard.to_owned();
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        while pos < data.len() {
            let start = pos;
            let end = data[start..].iter().position(|&b| b == b'\n').map_or(data.len(), |i| start + i);
            pos = end + 1;
            let line = &data[start..end];
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Some(parse_line(line).map_err(|(reason, detail)| Corrupt::new(&shard, start, reason, detail)));
        }
        None
    })
}

fn parse_line(line: &[u8]) -> Result<Element, (CorruptReason, String)> {
    let value: Value = serde_json::from_slice(line).map_err(|e| (CorruptReason::BadJson, e.to_string()))?;
    let Value::Object(object) = value else {
        return Err((CorruptReason::UnsupportedJson, format!("line is {}, not an object", kind(&value))));
    };
    let mut element = Element::new();
    for (key, value) in object {
        match field(value) {
            Ok(Some(f)) => {
                element.insert(key, f);
            }
            Ok(None) => {}
            Err(why) => return Err((CorruptReason::UnsupportedJson, format!("field {key:?}: {why}"))),
        }
    }
    Ok(element)
}

fn field(value: Value) -> Result<Option<Field>, String> {
    Ok(Some(match value {
        Value::Null => return Ok(None),
        Value::Bool(b) => Field::Int64(vec![i64::from(b)]),
        Value::Number(n) => match int(&n)? {
            Some(i) => Field::Int64(vec![i]),
            None => Field::Float64(vec![float(&n)]),
        },
        Value::String(s) => Field::Bytes(Bytes::from(s)),
        Value::Array(items) => array(items)?,
        Value::Object(_) => return Err("nested objects are not supported".into()),
    }))
}

fn array(items: Vec<Value>) -> Result<Field, String> {
    if items.iter().all(Value::is_string) && !items.is_empty() {
        let strings = items.into_iter().filter_map(|v| match v {
            Value::String(s) => Some(Bytes::from(s)),
            _ => None,
        });
        return Ok(Field::BytesList(strings.collect()));
    }
    let mut ints = Vec::with_capacity(items.len());
    let mut floats: Option<Vec<f64>> = None;
    for item in &items {
        let (i, f) = match item {
            Value::Bool(b) => (Some(i64::from(*b)), f64::from(u8::from(*b))),
            Value::Number(n) => (int(n)?, float(n)),
            other => {
                return Err(format!("array holds {}; only all-number or all-string arrays are supported", kind(other)));
            }
        };
        match (&mut floats, i) {
            (None, Some(i)) => ints.push(i),
            // The first non-integer turns the whole array into floats, including what came before.
            (None, None) => floats = Some(ints.iter().map(|&i| i as f64).chain([f]).collect()),
            (Some(fs), _) => fs.push(f),
        }
    }
    Ok(floats.map_or(Field::Int64(ints), Field::Float64))
}

/// `Some` for an integer in int64 range, `None` for a non-integer, an error for an integer
/// too large to keep exactly.
fn int(n: &Number) -> Result<Option<i64>, String> {
    if let Some(i) = n.as_i64() {
        Ok(Some(i))
    } else if n.is_u64() {
        Err(format!("integer {n} is outside the int64 range"))
    } else {
        Ok(None)
    }
}

fn float(n: &Number) -> f64 {
    // Every JSON number serde_json accepts without arbitrary precision has an f64 form.
    n.as_f64().unwrap_or(f64::NAN)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
