//! Gzipped IDX bytes as the MNIST reader parses them. The input is the gzip stream
//! itself (the seeds are gzip files), so this target exercises decompression bombs,
//! corrupt streams and headers that claim more than the stream holds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Keep the gzip magic so every input takes the gzip path.
    let mut bytes = vec![0x1f, 0x8b];
    bytes.extend_from_slice(data.get(2..).unwrap_or_default());
    hemi_fuzz::idx(&bytes);
});
