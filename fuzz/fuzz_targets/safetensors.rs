//! safetensors bytes as `load_safetensors` parses them: any input is Ok or Err, never a
//! panic, a hang or an allocation beyond the input's size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = hemi::io::from_safetensors_bytes("fuzz", data);
});
