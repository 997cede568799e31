//! JSONL lines to elements, and bad lines in the middle of a shard.

use bytes::Bytes;
use stoker_worker::element::{Element, Field};
use stoker_worker::formats::{Corrupt, CorruptReason, jsonl};

use crate::{bytes, el, outcome};

fn read(text: &str) -> Vec<Result<Element, Corrupt>> {
    jsonl::read(Bytes::copy_from_slice(text.as_bytes()), "s.jsonl").collect()
}

#[test]
fn json_types_map_to_fields() {
    let line = r#"{"s":"h\u00e9\n","i":-4,"big":9223372036854775807,"f":2.5,"e":1e3,"t":true,"no":false,"nul":null,
        "ints":[1,-2,true],"mixed":[1,2.5,3],"strs":["a","bc"],"empty":[],"floats":[0.5]}"#;
    let items = read(&line.replace('\n', " "));
    let expected = el(&[
        ("s", bytes("hé\n".as_bytes())),
        ("i", Field::Int64(vec![-4])),
        ("big", Field::Int64(vec![i64::MAX])),
        ("f", Field::Float64(vec![2.5])),
        ("e", Field::Float64(vec![1000.0])),
        ("t", Field::Int64(vec![1])),
        ("no", Field::Int64(vec![0])),
        ("ints", Field::Int64(vec![1, -2, 1])),
        ("mixed", Field::Float64(vec![1.0, 2.5, 3.0])),
        ("strs", Field::BytesList(vec![Bytes::from_static(b"a"), Bytes::from_static(b"bc")])),
        ("empty", Field::Int64(vec![])),
        ("floats", Field::Float64(vec![0.5])),
    ]);
    assert_eq!(items, vec![Ok(expected)]);
}

#[test]
fn a_malformed_line_is_reported_at_its_offset_and_reading_goes_on() {
    let text = "{\"a\":1}\n{\"a\":2,\n\n  \r\n{\"a\":3}\r\n[1]\n{\"a\":{\"b\":1}}\n{\"a\":4}";
    let items = read(text);
    use CorruptReason::*;
    assert_eq!(outcome(&items), [None, Some(BadJson), None, Some(UnsupportedJson), Some(UnsupportedJson), None]);
    let offsets: Vec<u64> = items.iter().filter_map(|i| i.as_ref().err()).map(|c| c.offset).collect();
    let bad = ["{\"a\":2,", "[1]", "{\"a\":{"];
    let expected: Vec<u64> = bad.iter().map(|b| text.find(b).unwrap() as u64).collect();
    assert_eq!(offsets, expected);
    let values: Vec<&Field> = items.iter().filter_map(|i| i.as_ref().ok()).map(|e| &e["a"]).collect();
    assert_eq!(values, [&Field::Int64(vec![1]), &Field::Int64(vec![3]), &Field::Int64(vec![4])]);
    let nested = items[4].as_ref().unwrap_err();
    assert!(nested.detail.contains("\"a\""), "detail names the key: {}", nested.detail);
    assert_eq!(nested.shard, "s.jsonl");
}

#[test]
fn values_without_an_element_form_are_unsupported() {
    for line in [
        r#"{"k":18446744073709551615}"#,
        r#"{"k":[1,"a"]}"#,
        r#"{"k":[[1]]}"#,
        r#"{"k":[null]}"#,
        r#"{"k":[{"x":1}]}"#,
        r#""just a string""#,
    ] {
        assert_eq!(outcome(&read(line)), [Some(CorruptReason::UnsupportedJson)], "{line}");
    }
    assert_eq!(outcome(&read("{\"k\":\"\\ud800\"}\n{\"k\":1}")), [Some(CorruptReason::BadJson), None]);
    assert_eq!(outcome(&read("\u{0}{}")), [Some(CorruptReason::BadJson)]);
    assert!(read("\n\n   \n").is_empty());
}
