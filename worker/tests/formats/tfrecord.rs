//! TFRecord framing against the Python `tfrecord` package's output, and under corruption.

use bytes::Bytes;
use stoker_worker::element::{Element, Field};
use stoker_worker::formats::{CorruptReason, example, tfrecord};

use crate::{bytes, el, outcome, within};

static FIXTURE: &[u8] = include_bytes!("../fixtures/examples.tfrecord");

#[test]
fn reads_what_the_python_tfrecord_package_wrote() {
    let items: Vec<_> = tfrecord::read(Bytes::from_static(FIXTURE), "examples.tfrecord").collect();
    let elements: Vec<Element> = items.into_iter().map(|i| i.expect("a good record")).collect();
    let image0: Vec<u8> = (0..=255u8).cycle().take(768).collect();
    let image2: Vec<u8> = (0..3000u32).map(|i| ((i * 31 + 7) % 256) as u8).collect();
    let expected = vec![
        el(&[
            ("image", bytes(&image0)),
            ("label", Field::Int64(vec![7])),
            ("bbox", Field::Float32(vec![0.1, 0.25, -1.5, 3.0e10])),
            ("tags", Field::BytesList(vec![Bytes::from_static(b"cat"), Bytes::new(), Bytes::from("ünï")])),
            ("ids", Field::Int64(vec![-1, 0, 1 << 40, i64::MIN])),
        ]),
        el(&[
            ("image", bytes(b"\xff\xd8\xff\xe0")),
            ("label", Field::Int64(vec![0])),
            ("scores", Field::Float32(vec![])),
            ("text", bytes(b"hello")),
        ]),
        el(&[("image", bytes(&image2)), ("label", Field::Int64(vec![-3]))]),
    ];
    assert_eq!(elements, expected);
}

#[test]
fn payloads_are_slices_of_the_shard() {
    let first = tfrecord::read(Bytes::from_static(FIXTURE), "s").next().expect("a record").expect("good");
    let Some(Field::Bytes(image)) = first.get("image") else { panic!("no image field") };
    assert!(within(FIXTURE, image));
}

#[test]
fn writer_round_trips_and_matches_the_fixture_framing() {
    // Re-frame the fixture's payloads with our writer: identical bytes means identical CRCs.
    let payloads: Vec<Bytes> = tfrecord::records(Bytes::from_static(FIXTURE), "s").map(|r| r.expect("good")).collect();
    assert_eq!(payloads.len(), 3);
    let mut out = Vec::new();
    payloads.iter().for_each(|p| tfrecord::write_record(&mut out, p));
    assert_eq!(out, FIXTURE);
}

fn two_records() -> (Vec<u8>, usize, Vec<Element>) {
    let elements = vec![
        el(&[("a", bytes(b"first")), ("n", Field::Int64(vec![1, 2]))]),
        el(&[("a", bytes(b"second")), ("f", Field::Float32(vec![0.5]))]),
    ];
    let mut file = Vec::new();
    tfrecord::write_record(&mut file, &example::encode(&elements[0]));
    let split = file.len();
    tfrecord::write_record(&mut file, &example::encode(&elements[1]));
    (file, split, elements)
}

fn read_all(file: Vec<u8>) -> Vec<Result<Element, stoker_worker::formats::Corrupt>> {
    tfrecord::read(Bytes::from(file), "shard-7").collect()
}

#[test]
fn a_bad_length_crc_stops_the_shard() {
    let (mut file, split, elements) = two_records();
    file[8] ^= 0x01;
    assert_eq!(outcome(&read_all(file.clone())), [Some(CorruptReason::BadLengthCrc)]);
    let (mut file, ..) = two_records();
    file[split + 10] ^= 0x80;
    let items = read_all(file);
    assert_eq!(outcome(&items), [None, Some(CorruptReason::BadLengthCrc)]);
    assert_eq!(items[0].as_ref().ok(), Some(&elements[0]));
    let corrupt = items[1].as_ref().unwrap_err();
    assert_eq!((corrupt.shard.as_str(), corrupt.offset), ("shard-7", split as u64));
}

#[test]
fn a_corrupted_length_itself_fails_its_crc() {
    let (mut file, ..) = two_records();
    file[0] ^= 0x04;
    assert_eq!(outcome(&read_all(file)), [Some(CorruptReason::BadLengthCrc)]);
}

#[test]
fn a_bad_data_crc_skips_only_that_record() {
    let (file, split, elements) = two_records();
    for at in [split - 1, 13] {
        // split - 1 is the data CRC's last byte; 13 is inside the first record's data.
        let mut bad = file.clone();
        bad[at] ^= 0x10;
        let items = read_all(bad);
        assert_eq!(outcome(&items), [Some(CorruptReason::BadDataCrc), None], "flip at {at}");
        assert_eq!(items[0].as_ref().unwrap_err().offset, 0);
        assert_eq!(items[1].as_ref().ok(), Some(&elements[1]));
    }
}

#[test]
fn truncation_at_every_offset_keeps_the_records_before_it() {
    let (file, split, elements) = two_records();
    for cut in 0..file.len() {
        let items = read_all(file[..cut].to_vec());
        let (good, start) = if cut < split { (0, 0) } else { (1, split) };
        let expected: Vec<Option<CorruptReason>> = match cut - start {
            0 => vec![None; good],
            n if n < 12 => [vec![None; good], vec![Some(CorruptReason::TruncatedLength)]].concat(),
            _ => [vec![None; good], vec![Some(CorruptReason::TruncatedData)]].concat(),
        };
        assert_eq!(outcome(&items), expected, "cut at {cut}");
        if good == 1 {
            assert_eq!(items[0].as_ref().ok(), Some(&elements[0]));
        }
        if let Some(Err(corrupt)) = items.last() {
            assert_eq!(corrupt.offset, start as u64, "cut at {cut}");
        }
    }
    assert_eq!(outcome(&read_all(file)), [None, None]);
}

#[test]
fn a_bad_example_is_reported_and_the_next_record_still_read() {
    let (_, _, elements) = two_records();
    let mut file = Vec::new();
    // A valid frame around bytes that are not an Example: field 1 with wire type 7.
    tfrecord::write_record(&mut file, &[0x0f, 0x00]);
    tfrecord::write_record(&mut file, &example::encode(&elements[1]));
    let items = read_all(file);
    assert_eq!(outcome(&items), [Some(CorruptReason::BadExample), None]);
    assert_eq!(items[1].as_ref().ok(), Some(&elements[1]));
}
