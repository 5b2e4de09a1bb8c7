//! `alone`: a test that changes process-wide state (a GEMM kernel forced for every product)
//! runs in a process of its own, so that the tests running beside it in this binary see
//! none of it. (It still shares the CPU with them: a test that needs idle cores, such as
//! `tests/spinners.rs`, keeps a binary of its own, which `cargo test` runs by itself.)

use std::process::Command;

/// The variable naming the test a process was started for.
const ALONE: &str = "HEMI_TEST_ALONE";

/// Runs `body`, the body of the calling test, in a process of its own: this binary started
/// again on that test alone (`--exact`), which is checked to pass there. In that process
/// (`HEMI_TEST_ALONE` names the test) it runs `body` itself.
pub fn alone(body: impl FnOnce()) {
    // libtest runs each test on a thread named after it (`module::test`).
    let thread = std::thread::current();
    let test = thread
        .name()
        .expect("a test runs on a thread named after it");
    if std::env::var_os(ALONE).is_some_and(|v| v == test) {
        return body();
    }
    let exe = std::env::current_exe().expect("the path of this test binary");
    let out = Command::new(exe)
        .args(["--exact", test, "--test-threads=1", "--nocapture"])
        .env(ALONE, test)
        .output()
        .expect("the test binary starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test}, run alone ({}):\n{stdout}\n{stderr}",
        out.status
    );
}
