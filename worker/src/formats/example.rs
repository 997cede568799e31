//! tf.train.Example: `Example { Features features = 1 }`, `Features { map<string, Feature>
//! feature = 1 }`, `Feature { oneof { BytesList = 1, FloatList = 2, Int64List = 3 } }`, each
//! list being `repeated <type> value = 1`.
//!
//! Decoding follows protobuf's merge rules because writers rely on them: a message field seen
//! twice merges, a map key seen twice keeps the last value, a oneof switches to the last member
//! set, repeated scalars may be packed or not, and unknown fields are skipped. A known field
//! with the wrong wire type is rejected rather than skipped: no Example writer produces it, so
//! it means the bytes are not an Example.

use std::collections::BTreeMap;

use bytes::Bytes;

use super::protowire::{Reader, Value, put_len, put_tag, put_varint};
use crate::element::{Element, Field};

enum Kind {
    Bytes(Vec<Bytes>),
    Float(Vec<f32>),
    Int(Vec<i64>),
}

/// Decodes a serialized Example into an element: a bytes_list of one value becomes
/// `Field::Bytes` (the common image/label case), other bytes_lists `BytesList`, float_list
/// `Float32` and int64_list `Int64`. A feature with no list set is left out.
pub fn decode(record: Bytes) -> Result<Element, String> {
    let mut features: BTreeMap<String, Option<Kind>> = BTreeMap::new();
    let mut r = Reader::new(record);
    while let Some((number, value)) = r.field()? {
        match (number, value) {
            (1, Value::Len(b)) => decode_features(b, &mut features)?,
            (1, _) => return Err("Example.features has the wrong wire type".into()),
            _ => {}
        }
    }
    Ok(features
        .into_iter()
        .filter_map(|(name, kind)| {
            let field = match kind? {
                Kind::Bytes(mut v) if v.len() == 1 => Field::Bytes(v.pop()?),
                Kind::Bytes(v) => Field::BytesList(v),
                Kind::Float(v) => Field::Float32(v),
                Kind::Int(v) => Field::Int64(v),
            };
            Some((name, field))
        })
        .collect())
}

fn decode_features(buf: Bytes, features: &mut BTreeMap<String, Option<Kind>>) -> Result<(), String> {
    let mut r = Reader::new(buf);
    while let Some((number, value)) = r.field()? {
        match (number, value) {
            (1, Value::Len(entry)) => {
                let (key, kind) = decode_entry(entry)?;
                features.insert(key, kind);
            }
            (1, _) => return Err("Features.feature has the wrong wire type".into()),
            _ => {}
        }
    }
    Ok(())
}

fn decode_entry(buf: Bytes) -> Result<(String, Option<Kind>), String> {
    let mut key = String::new();
    let mut kind = None;
    let mut r = Reader::new(buf);
    while let Some((number, value)) = r.field()? {
        match (number, value) {
            (1, Value::Len(k)) => {
                key = String::from_utf8(k.to_vec()).map_err(|_| "feature name is not UTF-8".to_string())?;
            }
            (2, Value::Len(f)) => decode_feature(f, &mut kind)?,
            (1 | 2, _) => return Err("feature map entry has the wrong wire type".into()),
            _ => {}
        }
    }
    Ok((key, kind))
}

fn decode_feature(buf: Bytes, kind: &mut Option<Kind>) -> Result<(), String> {
    let mut r = Reader::new(buf);
    while let Some((number, value)) = r.field()? {
        let Value::Len(list) = value else {
            if (1..=3).contains(&number) {
                return Err(format!("Feature field {number} has the wrong wire type"));
            }
            continue;
        };
        // Same oneof member again: merge (append); a different member replaces the value.
        match number {
            1 => {
                if !matches!(kind, Some(Kind::Bytes(_))) {
                    *kind = Some(Kind::Bytes(Vec::new()));
                }
                if let Some(Kind::Bytes(v)) = kind {
                    decode_bytes_list(list, v)?;
                }
            }
            2 => {
                if !matches!(kind, Some(Kind::Float(_))) {
                    *kind = Some(Kind::Float(Vec::new()));
                }
                if let Some(Kind::Float(v)) = kind {
                    decode_float_list(list, v)?;
                }
            }
            3 => {
                if !matches!(kind, Some(Kind::Int(_))) {
                    *kind = Some(Kind::Int(Vec::new()));
                }
                if let Some(Kind::Int(v)) = kind {
                    decode_int64_list(list, v)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn decode_bytes_list(buf: Bytes, out: &mut Vec<Bytes>) -> Result<(), String> {
    let mut r = Reader::new(buf);
    while let Some((number, value)) = r.field()? {
        match (number, value) {
            (1, Value::Len(b)) => out.push(b),
            (1, _) => return Err("BytesList.value has the wrong wire type".into()),
            _ => {}
        }
    }
    Ok(())
}

fn decode_float_list(buf: Bytes, out: &mut Vec<f32>) -> Result<(), String> {
    let mut r = Reader::new(buf);
    while let Some((number, value)) = r.field()? {
        match (number, value) {
            (1, Value::Fixed32(bits)) => out.push(f32::from_bits(bits)),
            (1, Value::Len(packed)) => {
                if packed.len() % 4 != 0 {
                    return Err(format!("packed FloatList of {} bytes is not a multiple of 4", packed.len()));
                }
                out.extend(packed.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
            }
            (1, _) => return Err("FloatList.value has the wrong wire type".into()),
            _ => {}
        }
    }
    Ok(())
}

fn decode_int64_list(buf: Bytes, out: &mut Vec<i64>) -> Result<(), String> {
    let mut r = Reader::new(buf);
    while let Some((number, value)) = r.field()? {
        match (number, value) {
            // int64 is two's complement in a varint, so the cast is the decoding.
            (1, Value::Varint(v)) => out.push(v as i64),
            (1, Value::Len(packed)) => {
                let mut p = Reader::new(packed);
                while !p.is_empty() {
                    out.push(p.varint()? as i64);
                }
            }
            (1, _) => return Err("Int64List.value has the wrong wire type".into()),
            _ => {}
        }
    }
    Ok(())
}

/// Encodes an element as a serialized Example, lists packed as protobuf writers do.
/// Example has no float64 list, so `Float64` values are narrowed to float32; a tensor is
/// written as its raw bytes (Example has no shapes).
pub fn encode(element: &Element) -> Vec<u8> {
    let mut features = Vec::new();
    for (name, field) in element {
        let mut list = Vec::new();
        let member = match field {
            Field::Bytes(b) => {
                put_len(&mut list, 1, b);
                1
            }
            Field::Tensor(t) => {
                put_len(&mut list, 1, &t.data);
                1
            }
            Field::BytesList(v) => {
                v.iter().for_each(|b| put_len(&mut list, 1, b));
                1
            }
            Field::Float32(v) => {
                let packed: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                put_packed(&mut list, &packed);
                2
            }
            Field::Float64(v) => {
                let packed: Vec<u8> = v.iter().flat_map(|&f| (f as f32).to_le_bytes()).collect();
                put_packed(&mut list, &packed);
                2
            }
            Field::Int64(v) => {
                let mut packed = Vec::new();
                v.iter().for_each(|&i| put_varint(&mut packed, i as u64));
                put_packed(&mut list, &packed);
                3
            }
        };
        let mut feature = Vec::new();
        put_len(&mut feature, member, &list);
        let mut entry = Vec::new();
        put_len(&mut entry, 1, name.as_bytes());
        put_len(&mut entry, 2, &feature);
        put_len(&mut features, 1, &entry);
    }
    let mut example = Vec::new();
    put_len(&mut example, 1, &features);
    example
}

/// The serialized Example with each value of its bytes_lists replaced where `replace` gives
/// one (a JPEG rewritten, say); every other field is kept as it was decoded.
pub fn rewrite_bytes(record: Bytes, replace: &mut dyn FnMut(&[u8]) -> Option<Vec<u8>>) -> Result<Vec<u8>, String> {
    // Example.features, Features.feature (a map entry), the entry's value, Feature.bytes_list,
    // BytesList.value.
    rewrite_at(record, &[1, 1, 2, 1, 1], replace)
}

/// `message` with the length-delimited values at `path` (field numbers, outermost first)
/// replaced where `replace` gives one.
fn rewrite_at(
    message: Bytes,
    path: &[u32],
    replace: &mut dyn FnMut(&[u8]) -> Option<Vec<u8>>,
) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(message.len());
    let mut r = Reader::new(message);
    while let Some((number, value)) = r.field()? {
        match value {
            Value::Len(inner) if number == path[0] => {
                let inner = match path {
                    [_] => replace(&inner).unwrap_or_else(|| inner.to_vec()),
                    [_, rest @ ..] => rewrite_at(inner, rest, replace)?,
                    [] => unreachable!("the path is never empty"),
                };
                put_len(&mut out, number, &inner);
            }
            Value::Len(inner) => put_len(&mut out, number, &inner),
            Value::Varint(v) => {
                put_tag(&mut out, number, 0);
                put_varint(&mut out, v);
            }
            Value::Fixed64(v) => {
                put_tag(&mut out, number, 1);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Value::Fixed32(v) => {
                put_tag(&mut out, number, 5);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(out)
}

// Protobuf writers leave out an empty packed field; an empty list is then just `{}`.
fn put_packed(out: &mut Vec<u8>, packed: &[u8]) {
    if !packed.is_empty() {
        put_len(out, 1, packed);
    }
}
