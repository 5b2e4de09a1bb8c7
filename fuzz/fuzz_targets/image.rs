//! JPEG/PNG bytes decoded as the image folder decodes a file, into hemi's CHW `Image`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(image) = hemi::data::parse_image(data) {
        assert_eq!(image.channels(), 3);
        assert_eq!(image.data().len(), 3 * image.height() * image.width());
    }
});
