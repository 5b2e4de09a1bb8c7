//! A checkpoint's MANIFEST.json as `load_checkpoint` parses it: Ok or Err, never a panic,
//! and an accepted entry never names a path outside its directory.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(entries) = hemi::train::checkpoint::parse_manifest("fuzz", data) {
        for e in entries {
            assert!(!e.name.contains('/') && e.name != ".." && e.sha256.len() == 64);
        }
    }
});
