//! `hemi data fetch cifar10`: download the official CIFAR-10 binary archive over HTTPS,
//! check its size and SHA-256 while it streams, and unpack it atomically (into a temporary
//! directory renamed into place), so that a half-finished fetch never looks like data.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The dataset authors' archive of the binary version.
pub const CIFAR10_URL: &str = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz";
/// Its SHA-256 (the authors publish MD5 c32a1d4ab5d03f1284b67883e8d87530 for the same file).
pub const CIFAR10_SHA256: &str = "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd";
/// Its size in bytes.
pub const CIFAR10_BYTES: u64 = 170_052_171;
/// The files the archive must provide, under `cifar-10-batches-bin/`.
pub const CIFAR10_FILES: [&str; 6] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
    "test_batch.bin",
];

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source: e,
    }
}

/// What to say when the download fails: how to use local files instead.
fn offline_hint(url: &str, why: &str) -> Error {
    Error::Msg(format!(
        "could not download {url}: {why}\n\
         Without network access, point hemi at local files instead: `--data-dir DIR` where DIR \
         holds data_batch_1..5.bin and test_batch.bin (or cifar-10-batches-bin/ with them), or \
         train/<class>/*.jpg and test/<class>/*.jpg folders — e.g. \
         `tar xzf ../shared/data/cifar10-jpeg.tar.gz -C /tmp/cifar` then \
         `hemi train --data-dir /tmp/cifar`."
    ))
}

/// Downloads CIFAR-10 into `data_dir/cifar-10-batches-bin/` (unless it is already there)
/// and returns that directory.
pub fn fetch_cifar10(data_dir: &Path) -> Result<PathBuf> {
    fetch_archive(data_dir, CIFAR10_URL, CIFAR10_SHA256, Some(CIFAR10_BYTES))
}

/// `fetch_cifar10` with the source spelled out (tests use a local archive or a dead URL).
pub fn fetch_archive(
    data_dir: &Path,
    url: &str,
    sha256: &str,
    bytes: Option<u64>,
) -> Result<PathBuf> {
    let dest = data_dir.join("cifar-10-batches-bin");
    if CIFAR10_FILES.iter().all(|f| dest.join(f).is_file()) {
        return Ok(dest);
    }
    // The directories this call creates, so a failed fetch can take them away again
    // (an offline `hemi data fetch` must not leave an empty data directory that later
    // looks like a place where data was put). Directories that existed are never removed.
    let created: Vec<PathBuf> = data_dir
        .ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .map(Path::to_path_buf)
        .collect();
    fs::create_dir_all(data_dir).map_err(|e| io_err(data_dir, e))?;
    let archive = data_dir.join(format!(
        ".cifar-10-binary.tar.gz.part{}",
        std::process::id()
    ));
    let result =
        download(url, &archive, sha256, bytes).and_then(|_| unpack_cifar10(&archive, data_dir));
    let _ = fs::remove_file(&archive);
    if result.is_err() {
        // Deepest first; `remove_dir` only removes an empty directory, so anything another
        // process put there meanwhile stays.
        for dir in &created {
            let _ = fs::remove_dir(dir);
        }
    }
    result
}

/// Streams `url` into `to`, hashing as it goes; checks the size and the SHA-256.
fn download(url: &str, to: &Path, sha256: &str, bytes: Option<u64>) -> Result<()> {
    let response = ureq::get(url)
        .call()
        .map_err(|e| offline_hint(url, &e.to_string()))?;
    let mut reader = response.into_body().into_reader();
    let mut file = fs::File::create(to).map_err(|e| io_err(to, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = reader
            .read(&mut buf)
            .map_err(|e| offline_hint(url, &e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        file.write_all(&buf[..n]).map_err(|e| io_err(to, e))?;
        total += n as u64;
    }
    file.sync_all().map_err(|e| io_err(to, e))?;
    if let Some(b) = bytes {
        if total != b {
            return Err(Error::Data {
                path: url.into(),
                msg: format!("downloaded {total} bytes, expected {b} (interrupted?)"),
            });
        }
    }
    verify_sha256(url, &hasher.finalize(), sha256)
}

fn verify_sha256(what: &str, digest: &[u8], want: &str) -> Result<()> {
    let got: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    if !got.eq_ignore_ascii_case(want) {
        return Err(Error::Data {
            path: what.into(),
            msg: format!(
                "SHA-256 {got} does not match the expected {want}; the download is corrupt"
            ),
        });
    }
    Ok(())
}

/// Unpacks the six batch files of a CIFAR-10 binary archive into
/// `data_dir/cifar-10-batches-bin/`, through a temporary directory renamed into place.
/// Only those regular files are taken (no other paths from the archive are written).
pub fn unpack_cifar10(archive: &Path, data_dir: &Path) -> Result<PathBuf> {
    let dest = data_dir.join("cifar-10-batches-bin");
    let tmp = data_dir.join(format!(".cifar-10-batches-bin.tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    let bad = |msg: String| Error::Data {
        path: archive.display().to_string(),
        msg,
    };
    let run = || -> Result<()> {
        let file = fs::File::open(archive).map_err(|e| io_err(archive, e))?;
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
        let entries = tar
            .entries()
            .map_err(|e| bad(format!("not a tar.gz archive: {e}")))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| bad(format!("corrupt archive: {e}")))?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let path = entry
                .path()
                .map_err(|e| bad(format!("bad member name: {e}")))?
                .into_owned();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !CIFAR10_FILES.contains(&name) && name != "batches.meta.txt" {
                continue;
            }
            let out = tmp.join(name);
            let mut f = fs::File::create(&out).map_err(|e| io_err(&out, e))?;
            std::io::copy(&mut entry, &mut f)
                .map_err(|e| bad(format!("corrupt archive member {name}: {e}")))?;
            f.sync_all().map_err(|e| io_err(&out, e))?;
        }
        if let Some(missing) = CIFAR10_FILES.iter().find(|f| !tmp.join(f).is_file()) {
            return Err(bad(format!("the archive has no {missing}")));
        }
        let _ = fs::remove_dir_all(&dest);
        fs::rename(&tmp, &dest).map_err(|e| io_err(&dest, e))
    };
    run().inspect_err(|_| {
        let _ = fs::remove_dir_all(&tmp);
    })?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
