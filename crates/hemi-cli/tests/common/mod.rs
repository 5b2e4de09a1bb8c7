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
