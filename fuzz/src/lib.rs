//! Shared bodies of the fuzz targets (one target per file under `fuzz_targets/`).

/// IDX bytes, raw or gzipped, through both parsers and into a data set.
pub fn idx(data: &[u8]) {
    if let Ok(images) = hemi::data::parse_idx_images(data) {
        assert_eq!(images.pixels.len(), images.count * images.rows * images.cols);
        let labels = vec![0u8; images.count];
        let _ = images.into_dataset(labels, hemi::data::MnistKind::Mnist.class_names());
    }
    let _ = hemi::data::parse_idx_labels(data);
}
