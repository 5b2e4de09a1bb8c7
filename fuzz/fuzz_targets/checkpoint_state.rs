//! A checkpoint's state.json as `load_checkpoint` parses it: Ok or Err, never a panic, and
//! an accepted state has sizes within the limits checked before anything is allocated.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((_state, info)) = hemi::train::checkpoint::parse_state("fuzz", data) {
        assert!(info.classes >= 1 && info.classes <= 1 << 24);
        let n = info.input_shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        assert!(n.is_some_and(|n| n <= 1 << 30));
    }
});
