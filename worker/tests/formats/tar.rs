//! WebDataset grouping of archives written by the `tar` crate, and damaged archives.

use bytes::Bytes;
use stoker_worker::element::{Element, Field};
use stoker_worker::formats::{Corrupt, CorruptReason, tar as wds};
use tar::{Builder, EntryType, Header};

use crate::{bytes, el, outcome, within};

fn gnu(path: &str, data: &[u8], builder: &mut Builder<Vec<u8>>) {
    let mut header = Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    builder.append_data(&mut header, path, data).expect("append");
}

fn archive(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = Builder::new(Vec::new());
    for (path, data) in members {
        gnu(path, data, &mut builder);
    }
    builder.into_inner().expect("finish")
}

fn read(data: &[u8]) -> Vec<Result<Element, Corrupt>> {
    wds::read(Bytes::copy_from_slice(data), "s.tar").collect()
}

fn sample(key: &str, fields: &[(&str, &[u8])]) -> Element {
    let mut e = el(&[("__key__", bytes(key.as_bytes()))]);
    e.extend(fields.iter().map(|(k, v)| (k.to_string(), bytes(v))));
    e
}

#[test]
fn consecutive_members_group_by_key() {
    let data = archive(&[
        ("d/000.jpg", b"J0"),
        ("d/000.cls", b"3"),
        ("d/001.jpg", b"J1"),
        ("d/001.seg.png", b"P1"),
        ("d/README", b"skipped: no extension"),
        ("d/.hidden", b"skipped: no key"),
        ("d/002.jpg", b""),
        ("e.f/003.txt", b"T"),
    ]);
    let expected = vec![
        Ok(sample("d/000", &[("jpg", b"J0"), ("cls", b"3")])),
        Ok(sample("d/001", &[("jpg", b"J1"), ("seg.png", b"P1")])),
        Ok(sample("d/002", &[("jpg", b"")])),
        Ok(sample("e.f/003", &[("txt", b"T")])),
    ];
    assert_eq!(read(&data), expected);
}

#[test]
fn a_key_seen_again_later_starts_a_new_sample() {
    let data = archive(&[("a.x", b"1"), ("b.x", b"2"), ("a.y", b"3")]);
    let expected =
        vec![Ok(sample("a", &[("x", b"1")])), Ok(sample("b", &[("x", b"2")])), Ok(sample("a", &[("y", b"3")]))];
    assert_eq!(read(&data), expected);
}

#[test]
fn long_names_prefixes_pax_and_non_regular_entries() {
    let long_dir = "l".repeat(120);
    let mut builder = Builder::new(Vec::new());
    // GNU long name ('L' entry), longer than the 100-byte name field.
    gnu(&format!("{long_dir}/k1.jpg"), b"A", &mut builder);
    // POSIX ustar prefix + name.
    let mut ustar = Header::new_ustar();
    ustar.set_size(1);
    ustar.set_mode(0o644);
    builder.append_data(&mut ustar, format!("{}/k1.cls", "p".repeat(90) + &"/q".repeat(10)), &b"B"[..]).expect("ustar");
    // A directory and a symlink are skipped.
    let mut dir = Header::new_gnu();
    dir.set_entry_type(EntryType::Directory);
    dir.set_size(0);
    builder.append_data(&mut dir, "somedir/", &[][..]).expect("dir");
    let mut link = Header::new_gnu();
    link.set_entry_type(EntryType::Symlink);
    link.set_size(0);
    builder.append_link(&mut link, "k2.lnk", "k1.jpg").expect("link");
    // A pax path record overrides the header's name.
    builder.append_pax_extensions([("path", &b"pax/k3.json"[..])]).expect("pax");
    gnu("ignored.bin", b"C", &mut builder);
    let data = builder.into_inner().expect("finish");
    let prefix_key = "p".repeat(90) + &"/q".repeat(10) + "/k1";
    let expected = vec![
        Ok(sample(&format!("{long_dir}/k1"), &[("jpg", b"A")])),
        Ok(sample(&prefix_key, &[("cls", b"B")])),
        Ok(sample("pax/k3", &[("json", b"C")])),
    ];
    assert_eq!(read(&data), expected);
}

#[test]
fn fields_are_slices_of_the_shard() {
    let data = Bytes::from(archive(&[("k.bin", &[7u8; 1000])]));
    let first = wds::read(data.clone(), "s").next().expect("a sample").expect("good");
    let Some(Field::Bytes(payload)) = first.get("bin") else { panic!("no bin field") };
    assert_eq!(payload.len(), 1000);
    assert!(within(&data, payload));
}

#[test]
fn a_repeated_field_drops_that_sample_only() {
    let data = archive(&[("a.x", b"1"), ("a.x", b"2"), ("a.y", b"3"), ("b.x", b"4")]);
    let items = read(&data);
    assert_eq!(outcome(&items), [Some(CorruptReason::DuplicateTarField), None]);
    assert_eq!(items[0].as_ref().unwrap_err().offset, 1024);
    assert_eq!(items[1], Ok(sample("b", &[("x", b"4")])));
}

#[test]
fn a_bad_checksum_stops_the_shard() {
    let data = archive(&[("a.x", b"1"), ("b.x", b"2"), ("c.x", b"3")]);
    // Member headers sit at 0, 1024 and 2048; corrupt the third one's name.
    let mut bad = data.clone();
    bad[2048] ^= 0x01;
    let items = read(&bad);
    // "b" was still being gathered when the shard broke, so it is dropped with it.
    assert_eq!(outcome(&items), [None, Some(CorruptReason::BadTarChecksum)]);
    assert_eq!(items[0], Ok(sample("a", &[("x", b"1")])));
    assert_eq!(items[1].as_ref().unwrap_err().offset, 2048);
    // A non-octal size with a matching checksum is a header error, not a checksum one.
    let mut bad = data;
    bad[124] = b'9';
    let sum: u32 =
        bad[..512].iter().enumerate().map(|(i, &b)| if (148..156).contains(&i) { 32 } else { u32::from(b) }).sum();
    bad[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    assert_eq!(outcome(&read(&bad)), [Some(CorruptReason::BadTarHeader)]);
}

#[test]
fn truncation_anywhere_is_reported_and_complete_samples_survive() {
    let data = archive(&[("a.x", b"1"), ("a.y", &[5u8; 700]), ("b.x", b"2"), ("c.x", b"3")]);
    let full = read(&data);
    assert_eq!(full.len(), 3);
    assert!(full.iter().all(Result::is_ok));
    // The archive body ends where its two zero blocks begin.
    let body = data.len() - 1024;
    for cut in 0..body {
        let items = read(&data[..cut]);
        let (last, good) = items.split_last().expect("truncation is reported");
        assert_eq!(last.as_ref().map_err(|c| c.reason).err(), Some(CorruptReason::TruncatedTar), "cut at {cut}");
        assert!(last.as_ref().unwrap_err().offset <= cut as u64);
        assert_eq!(good, &full[..good.len()], "cut at {cut}");
        // A sample only comes out once the next key's header has been read.
        let expected_good = if cut > 4096 {
            2
        } else if cut > 3072 {
            1
        } else {
            0
        };
        assert_eq!(good.len(), expected_good, "cut at {cut}");
    }
    // One end-of-archive zero block is enough.
    assert_eq!(read(&data[..body + 512]), full);
}
