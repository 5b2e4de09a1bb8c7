//! Inputs the fuzz targets (fuzz/ at the repository root) found to crash, hang or exhaust
//! memory, minimised with `cargo fuzz tmin` and kept under `tests/fixtures/fuzz/TARGET/`.
//! Each must now be an `Err` from the parser of its target, not a panic. Adding a crasher
//! is adding a file; a new target is a new directory and a line in `parse`.

use std::path::Path;

/// Runs `target`'s parser on `bytes` as the fuzz target does; `Err` is the expected
/// outcome for a crasher, and its message must name the source.
fn parse(target: &str, bytes: &[u8]) -> Option<hemi::Result<()>> {
    Some(match target {
        "cifar10" => hemi::data::Cifar10::parse(bytes).map(drop),
        "idx_raw" | "idx_gz" => hemi::data::parse_idx_images(bytes)
            .map(drop)
            .and(hemi::data::parse_idx_labels(bytes).map(drop)),
        "image" => hemi::data::parse_image(bytes).map(drop),
        "safetensors" => hemi::io::from_safetensors_bytes("<bytes>", bytes).map(drop),
        "checkpoint_manifest" => {
            hemi::train::checkpoint::parse_manifest("<bytes>", bytes).map(drop)
        }
        "checkpoint_state" => hemi::train::checkpoint::parse_state("<bytes>", bytes).map(drop),
        _ => return None,
    })
}

#[test]
fn every_minimised_crasher_is_an_error() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz");
    let mut checked = 0;
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        let target = dir.file_name().unwrap().to_string_lossy().into_owned();
        for file in std::fs::read_dir(&dir).unwrap() {
            let file = file.unwrap().path();
            let bytes = std::fs::read(&file).unwrap();
            let result = parse(&target, &bytes)
                .unwrap_or_else(|| panic!("{}: no parser for target {target}", file.display()));
            let err = result.expect_err(&file.display().to_string());
            assert!(
                err.to_string().contains("<bytes>"),
                "{}: {err}",
                file.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "no fixtures under {}", root.display());
}
