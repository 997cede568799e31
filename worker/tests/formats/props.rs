//! Arbitrary and damaged inputs: no parser may panic, and every problem is a well-formed
//! `Corrupt` pointing inside the shard.

use bytes::Bytes;
use proptest::prelude::*;
use stoker_worker::element::{Element, Field};
use stoker_worker::formats::{Corrupt, CorruptReason, example, jsonl, tar as wds, tfrecord};

const CASES: u32 = 256;

/// Checks the invariants every parser keeps: offsets within the shard and never decreasing,
/// the shard named, and nothing after a corruption that stops the shard.
fn check(items: &[Result<Element, Corrupt>], len: usize, stopping: &[CorruptReason]) -> Result<(), TestCaseError> {
    let mut last = 0u64;
    for (i, item) in items.iter().enumerate() {
        if let Err(c) = item {
            prop_assert_eq!(c.shard.as_str(), "p");
            prop_assert!(c.offset <= len as u64, "offset {} past {}", c.offset, len);
            prop_assert!(c.offset >= last, "offsets went back");
            last = c.offset;
            if stopping.contains(&c.reason) {
                prop_assert_eq!(i, items.len() - 1, "{} was not the last item", c.reason);
            }
        }
    }
    Ok(())
}

fn field() -> impl Strategy<Value = Field> {
    let blob = || proptest::collection::vec(any::<u8>(), 0..40).prop_map(Bytes::from);
    prop_oneof![
        blob().prop_map(Field::Bytes),
        proptest::collection::vec(blob(), 2..4).prop_map(Field::BytesList),
        proptest::collection::vec(any::<i64>(), 0..6).prop_map(Field::Int64),
        proptest::collection::vec(-1e30f32..1e30, 0..6).prop_map(Field::Float32),
    ]
}

fn element() -> impl Strategy<Value = Element> {
    proptest::collection::btree_map("[a-z/_]{0,8}", field(), 0..5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn tfrecord_survives_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        let items: Vec<_> = tfrecord::read(Bytes::from(data.clone()), "p").collect();
        use CorruptReason::*;
        check(&items, data.len(), &[TruncatedLength, BadLengthCrc, TruncatedData])?;
    }

    #[test]
    fn example_decoding_survives_arbitrary_payloads(payload in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut file = Vec::new();
        tfrecord::write_record(&mut file, &payload);
        let items: Vec<_> = tfrecord::read(Bytes::from(file), "p").collect();
        prop_assert_eq!(items.len(), 1);
        if let Err(c) = &items[0] {
            prop_assert_eq!(c.reason, CorruptReason::BadExample);
        }
    }

    #[test]
    fn examples_round_trip_and_survive_mutation(e in element(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut encoded = example::encode(&e);
        prop_assert_eq!(example::decode(Bytes::from(encoded.clone())), Ok(e));
        let i = at.index(encoded.len());
        encoded[i] ^= 1 << bit;
        let _ = example::decode(Bytes::from(encoded));
    }

    #[test]
    fn jsonl_survives_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..400)) {
        let items: Vec<_> = jsonl::read(Bytes::from(data.clone()), "p").collect();
        check(&items, data.len(), &[])?;
    }

    #[test]
    fn jsonl_survives_json_like_text(text in r#"[{}\[\]":,0-9a-z.eE+\- \n\\]{0,200}"#) {
        let items: Vec<_> = jsonl::read(Bytes::from(text.clone()), "p").collect();
        check(&items, text.len(), &[])?;
    }

    #[test]
    fn tar_survives_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let items: Vec<_> = wds::read(Bytes::from(data.clone()), "p").collect();
        use CorruptReason::*;
        check(&items, data.len(), &[TruncatedTar, BadTarChecksum, BadTarHeader])?;
    }

    #[test]
    fn tar_survives_damage_to_real_archives(
        members in proptest::collection::vec(("[a-c]{1,2}\\.[a-z.]{1,4}", proptest::collection::vec(any::<u8>(), 0..700)), 1..5),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut builder = ::tar::Builder::new(Vec::new());
        for (name, data) in &members {
            let mut header = ::tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            builder.append_data(&mut header, name, data.as_slice()).expect("append");
        }
        let mut data = builder.into_inner().expect("finish");
        let whole: Vec<_> = wds::read(Bytes::from(data.clone()), "p").collect();
        prop_assert!(whole.iter().all(|i| i.as_ref().is_ok_or_duplicate()));
        let i = at.index(data.len());
        data[i] = byte;
        data.truncate(cut.index(data.len() + 1));
        let items: Vec<_> = wds::read(Bytes::from(data.clone()), "p").collect();
        use CorruptReason::*;
        check(&items, data.len(), &[TruncatedTar, BadTarChecksum, BadTarHeader])?;
    }
}

trait OkOrDuplicate {
    fn is_ok_or_duplicate(&self) -> bool;
}

impl OkOrDuplicate for Result<&Element, &Corrupt> {
    // Random names can repeat a field within a sample; anything else from a sound archive is a bug.
    fn is_ok_or_duplicate(&self) -> bool {
        self.as_ref().err().is_none_or(|c| c.reason == CorruptReason::DuplicateTarField)
    }
}
