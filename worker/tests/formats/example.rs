//! tf.train.Example decoding of hand-built wire data: the encodings other writers may use.

use bytes::Bytes;
use stoker_worker::element::Field;
use stoker_worker::formats::example;

use crate::{bytes, el};

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn len_field(number: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    varint(&mut out, number << 3 | 2);
    varint(&mut out, payload.len() as u64);
    out.extend_from_slice(payload);
    out
}

/// Example bytes for `(name, Feature bytes)` entries.
fn example_of(entries: &[(&str, Vec<u8>)]) -> Bytes {
    let mut features = Vec::new();
    for (name, feature) in entries {
        let entry = [len_field(1, name.as_bytes()), len_field(2, feature)].concat();
        features.extend(len_field(1, &entry));
    }
    Bytes::from(len_field(1, &features))
}

#[test]
fn unpacked_repeated_fields_decode_like_packed_ones() {
    let mut floats = Vec::new();
    for f in [1.5f32, -2.0] {
        floats.push(0x0d); // field 1, fixed32
        floats.extend(f.to_le_bytes());
    }
    let mut ints = Vec::new();
    for i in [300i64, -2] {
        ints.push(0x08); // field 1, varint
        varint(&mut ints, i as u64);
    }
    let record = example_of(&[("f", len_field(2, &floats)), ("i", len_field(3, &ints))]);
    let expected = el(&[("f", Field::Float32(vec![1.5, -2.0])), ("i", Field::Int64(vec![300, -2]))]);
    assert_eq!(example::decode(record), Ok(expected));
}

#[test]
fn protobuf_merge_rules_apply() {
    let first = len_field(1, &len_field(1, b"a"));
    let second = len_field(1, &len_field(1, b"b"));
    // A oneof member seen twice merges; a later map entry for the same key replaces it.
    let merged = [first.clone(), second.clone()].concat();
    let record = example_of(&[("x", merged), ("y", first.clone()), ("y", len_field(3, &[0x08, 0x05]))]);
    let expected = el(&[
        ("x", Field::BytesList(vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")])),
        ("y", Field::Int64(vec![5])),
    ]);
    assert_eq!(example::decode(record), Ok(expected));
    // Unknown fields anywhere are skipped; a Feature with no list set is left out.
    let mut with_unknown = example_of(&[("z", vec![]), ("w", first)]).to_vec();
    with_unknown.extend([0x10, 0x01]);
    assert_eq!(example::decode(Bytes::from(with_unknown)), Ok(el(&[("w", bytes(b"a"))])));
}

#[test]
fn malformed_wire_data_is_rejected() {
    let cases: Vec<(&str, Bytes)> = vec![
        ("features as varint", Bytes::from_static(&[0x08, 0x01])),
        ("length past the end", Bytes::from_static(&[0x0a, 0x09, 0x0a])),
        (
            "non-UTF-8 key",
            Bytes::from(len_field(1, &len_field(1, &[len_field(1, &[0xff]), len_field(2, &[])].concat()))),
        ),
        ("packed floats of 3 bytes", example_of(&[("f", len_field(2, &len_field(1, &[1, 2, 3])))])),
        ("truncated packed varint", example_of(&[("i", len_field(3, &len_field(1, &[0x80])))])),
        ("bytes value as varint", example_of(&[("b", len_field(1, &[0x08, 0x01]))])),
        ("group wire type", Bytes::from_static(&[0x0b])),
    ];
    for (what, record) in cases {
        assert!(example::decode(record).is_err(), "{what} was accepted");
    }
}

#[test]
fn encode_then_decode_gives_the_element_back() {
    let element = el(&[
        ("b", bytes(b"\x00\x01")),
        ("l", Field::BytesList(vec![Bytes::new(), Bytes::from_static(b"zz")])),
        ("i", Field::Int64(vec![i64::MIN, -1, 0, i64::MAX])),
        ("f", Field::Float32(vec![f32::MIN_POSITIVE, 1e30])),
        ("e", Field::Int64(vec![])),
    ]);
    assert_eq!(example::decode(Bytes::from(example::encode(&element))), Ok(element));
}

#[test]
fn rewriting_bytes_values_keeps_every_other_field() {
    // Bytes values starting with "jpeg" get `prefix`; "text" never does.
    let element = |prefix: &str| {
        let value = |v: &str| Bytes::from(format!("{prefix}{v}"));
        el(&[
            ("image", Field::Bytes(value("jpeg one"))),
            ("views", Field::BytesList(vec![value("jpeg two"), Bytes::from_static(b"text"), value("jpeg three")])),
            ("label", Field::Int64(vec![3, -1])),
            ("box", Field::Float32(vec![0.25, 0.5])),
        ])
    };
    let mut seen = Vec::new();
    let rewritten = example::rewrite_bytes(Bytes::from(example::encode(&element(""))), &mut |value| {
        seen.push(value.to_vec());
        value.starts_with(b"jpeg").then(|| [b"new ", value].concat())
    })
    .unwrap();
    assert_eq!(seen.len(), 4, "every bytes value, and only those");
    assert_eq!(example::decode(Bytes::from(rewritten)).unwrap(), element("new "));
    assert!(example::rewrite_bytes(Bytes::from_static(b"\x0a\x05ab"), &mut |_| None).is_err(), "a length past the end");
}
