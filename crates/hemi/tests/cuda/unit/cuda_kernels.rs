//! The unit tests of `hemi::cuda::kernels` (`src/cuda/kernels.rs`), run against the built library.

use hemi::cuda::kernels::*;
use hemi::cuda::launch::RowStrategy;
use hemi::dtype::DType;
use hemi::error::Error;

/// Brackets of each kind balance and nest (the sources have no string or char literals
/// apart from the `extern "C"` markers and the `<...>` of the includes).
fn balanced(src: &str) -> std::result::Result<(), String> {
    let mut stack = Vec::new();
    for (line_no, line) in src.lines().enumerate() {
        if line.starts_with('#') {
            continue;
        }
        let line = line.replace("extern \"C\"", "");
        if line.contains('"') || line.contains('\'') {
            return Err(format!("line {}: unexpected literal: {line}", line_no + 1));
        }
        for ch in line.chars() {
            match ch {
                '(' | '[' | '{' => stack.push(ch),
                ')' | ']' | '}' => {
                    let open = stack
                        .pop()
                        .ok_or(format!("line {}: unmatched {ch}", line_no + 1))?;
                    let want = match ch {
                        ')' => '(',
                        ']' => '[',
                        _ => '{',
                    };
                    if open != want {
                        return Err(format!("line {}: {open} closed by {ch}", line_no + 1));
                    }
                }
                _ => {}
            }
        }
    }
    if stack.is_empty() {
        Ok(())
    } else {
        Err(format!("unclosed {stack:?}"))
    }
}

fn entry_points(src: &str) -> Vec<String> {
    src.match_indices("extern \"C\" __global__ void ")
        .map(|(i, m)| {
            let rest = &src[i + m.len()..];
            rest[..rest.find('(').unwrap()].to_string()
        })
        .collect()
}

#[test]
fn every_module_is_well_formed_with_exactly_the_expected_entry_points() {
    for dtype in DTYPES {
        let src = module_source(dtype).unwrap();
        balanced(&src).unwrap_or_else(|e| panic!("{dtype:?}: {e}"));
        let mut found = entry_points(&src);
        let mut want: Vec<String> = Kernel::all(dtype)
            .into_iter()
            .map(|k| k.name(dtype).unwrap())
            .collect();
        assert_eq!(want.len(), 14 + 6 + 2 + 6 + 1);
        found.sort();
        want.sort();
        assert_eq!(found, want, "{dtype:?}");
        for n in &found {
            assert!(
                n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && !n.starts_with(|c: char| c.is_ascii_digit()),
                "{n}"
            );
        }
        // Kernels of this dtype use only its storage type in their signatures' data
        // pointers (casts aside).
        let (_, ty) = cuda_type(dtype).unwrap();
        assert!(src.contains(&format!("const {ty}* __restrict__ xs")));
    }
}

#[test]
fn conversions_round_to_nearest_even_and_accumulate_in_f32() {
    let src = module_source(DType::BF16).unwrap();
    assert!(src.contains("__float2half_rn(x)") && src.contains("__float2bfloat16_rn(x)"));
    // No 16-bit arithmetic: every load goes through to_f32.
    assert!(!src.contains("__hadd") && !src.contains("__hmul"));
    assert!(src.contains("float acc = 0.0f;"));
    let f32src = module_source(DType::F32).unwrap();
    assert!(
        f32src.contains("cast_f32_to_bf16")
            && f32src.contains("from_f32<__nv_bfloat16>(to_f32(xs[i]))")
    );
}

#[test]
fn thread_indices_are_computed_in_64_bits() {
    for dtype in DTYPES {
        let src = module_source(dtype).unwrap();
        for (i, _) in src.match_indices("blockIdx.x * blockDim.x") {
            assert!(
                src[..i].ends_with("(unsigned long long)"),
                "32-bit index product at {i}"
            );
        }
        for (i, _) in src.match_indices("gridDim.x * blockDim.x") {
            assert!(
                src[..i].ends_with("(unsigned long long)"),
                "32-bit stride product at {i}"
            );
        }
    }
}

#[test]
fn kernel_names_are_what_the_launcher_looks_up() {
    assert_eq!(
        Kernel::Unary(UnaryOp::Exp.name()).name(DType::F16).unwrap(),
        "unary_exp_f16"
    );
    assert_eq!(
        Kernel::Binary(BinaryOp::Add).name(DType::BF16).unwrap(),
        "binary_add_bf16"
    );
    assert_eq!(
        Kernel::Cast(DType::F32).name(DType::BF16).unwrap(),
        "cast_bf16_to_f32"
    );
    assert_eq!(
        Kernel::Reduce(ReduceOp::Max, RowStrategy::BlockPerRow)
            .name(DType::F32)
            .unwrap(),
        "max_rows_block_f32"
    );
    assert_eq!(
        Kernel::Softmax(RowStrategy::WarpPerRow)
            .name(DType::F16)
            .unwrap(),
        "softmax_rows_warp_f16"
    );
    assert_eq!(Kernel::Unscale.name(DType::F32).unwrap(), "unscale_f32");
    assert!(matches!(
        Kernel::Cast(DType::F16).name(DType::F16),
        Err(Error::DType { .. })
    ));
    assert!(matches!(
        Kernel::Unscale.name(DType::F64),
        Err(Error::DType { .. })
    ));
    assert!(module_source(DType::I64).is_err());
}

#[test]
fn module_keys_are_stable_distinct_and_change_with_the_source() {
    let opts = vec!["--gpu-architecture=compute_90".to_string()];
    let src = module_source(DType::F16).unwrap();
    let k1 = module_key(DType::F16, "compute_90", &src, &opts).unwrap();
    assert_eq!(
        k1,
        module_key(DType::F16, "compute_90", &src, &opts).unwrap()
    );
    assert!(
        k1.starts_with("hemi_f16_compute_90_") && k1.len() == "hemi_f16_compute_90_".len() + 16,
        "{k1}"
    );
    let others = [
        module_key(
            DType::BF16,
            "compute_90",
            &module_source(DType::BF16).unwrap(),
            &opts,
        )
        .unwrap(),
        module_key(DType::F16, "compute_80", &src, &opts).unwrap(),
        module_key(DType::F16, "compute_90", &format!("{src} "), &opts).unwrap(),
        module_key(DType::F16, "compute_90", &src, &[]).unwrap(),
    ];
    for o in &others {
        assert_ne!(&k1, o);
    }
    // Known FNV-1a vectors.
    assert_eq!(fnv1a(b""), 0xcbf29ce484222325);
    assert_eq!(fnv1a(b"a"), 0xaf63dc4c8601ec8c);
}

#[test]
fn index_params_broadcast_like_numpy() {
    // a: [2, 3, 4] contiguous; b: [3, 1] (a column), broadcast to [2, 3, 4].
    let (out, p) = IndexParams::binary(&[2, 3, 4], &[12, 4, 1], &[3, 1], &[1, 1]).unwrap();
    assert_eq!(out, vec![2, 3, 4]);
    let a: Vec<f64> = (0..24).map(|v| v as f64).collect();
    let b = [100.0, 200.0, 300.0];
    for i in 0..p.numel as u64 {
        let (oa, ob) = p.offsets(i);
        let (x, y, z) = (i / 12, (i / 4) % 3, i % 4);
        assert_eq!(a[oa as usize], (x * 12 + y * 4 + z) as f64);
        assert_eq!(b[ob as usize], b[y as usize]);
    }
    // Transposed a ([4, 3] view of a [3, 4] buffer) plus a row vector.
    let (out, p) = IndexParams::binary(&[4, 3], &[1, 4], &[3], &[1]).unwrap();
    assert_eq!(out, vec![4, 3]);
    for i in 0..12u64 {
        let (oa, ob) = p.offsets(i);
        let (r, c) = (i / 3, i % 3);
        assert_eq!((oa, ob), ((r + 4 * c) as i64, c as i64));
    }
    let e = IndexParams::binary(&[2, 3], &[3, 1], &[4], &[1]).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }));
}

#[test]
fn contiguous_dims_merge_so_high_rank_views_fit() {
    // A contiguous rank-10 tensor is one dim.
    let shape = [2usize; 10];
    let strides: Vec<isize> = (0..10).map(|d| 1isize << (9 - d)).collect();
    let p = IndexParams::unary(&shape, &strides).unwrap();
    assert_eq!(
        (p.rank, p.numel, p.shape[0], p.stride_a[0]),
        (1, 1024, 1024, 1)
    );
    // Size-1 dims vanish; a scalar is rank 0 with one element at offset 0.
    let p = IndexParams::unary(&[1, 1], &[7, 9]).unwrap();
    assert_eq!((p.rank, p.numel, p.offsets(0)), (0, 1, (0, 0)));
    // Nine alternating-stride dims cannot merge: too many.
    let shape = [2usize; 9];
    let strides: Vec<isize> = (0..9).map(|d| 1isize << (2 * (8 - d) + 1)).collect();
    let e = IndexParams::unary(&shape, &strides)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 8"), "{e}");
    assert!(IndexParams::unary(&[2, 2], &[-2, 1]).is_err());
    assert!(IndexParams::unary(&[3, 3], &[isize::MAX, 1]).is_err());
    let p = IndexParams::unary(&[4, 3], &[1, 4]).unwrap();
    assert_eq!(p.max_offsets(), (11, 11));
    let (_, p) = IndexParams::binary(&[4, 3], &[3, 1], &[3], &[2]).unwrap();
    assert_eq!(p.max_offsets(), (11, 4));
    let p = IndexParams::unary(&[3, 0, 2], &[2, 2, 1]).unwrap();
    assert_eq!((p.rank, p.numel, p.max_offsets()), (0, 0, (0, 0)));
    assert!(IndexParams::unary(&[2], &[1, 1]).is_err());
}

#[test]
fn index_params_match_the_c_struct_layout() {
    // 2 + 3 * 8 fields of 8 bytes, no padding: what `struct HemiIndex` is in C.
    assert_eq!(std::mem::size_of::<IndexParams>(), (2 + 3 * MAX_RANK) * 8);
    assert_eq!(std::mem::align_of::<IndexParams>(), 8);
    assert!(prelude().contains("long long stride_b[HEMI_MAX_RANK];\n};"));
}
