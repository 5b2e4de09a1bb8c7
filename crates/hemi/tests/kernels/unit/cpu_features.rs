//! The unit tests of `hemi::cpu::features` (`src/cpu/features.rs`), run against the built library.

use hemi::cpu::features::*;

#[test]
fn levels_order_and_parse() {
    assert!(CpuLevel::Portable < CpuLevel::Avx2);
    assert!(CpuLevel::Avx2 < CpuLevel::Avx512);
    assert!(CpuLevel::Avx512 < CpuLevel::Native);
    for l in [
        CpuLevel::Portable,
        CpuLevel::Avx2,
        CpuLevel::Avx512,
        CpuLevel::Native,
    ] {
        assert_eq!(CpuLevel::parse(l.name()).unwrap(), l);
    }
    let e = CpuLevel::parse("sse9").unwrap_err().to_string();
    assert!(e.contains("sse9") && e.contains("avx2"), "{e}");
    assert_eq!(Feature::Avx512bf16.level(), CpuLevel::Avx512);
    assert_eq!(Feature::F16c.level(), CpuLevel::Avx2);
}
