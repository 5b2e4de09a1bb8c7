//! `cpu::qgemm`, the INT8 GEMM, on every kernel this CPU runs (the portable twins on every
//! CPU): exact i32 sums against an i64 reference computed here, on odd sizes (m, n, k
//! tails of every tile), strided A, extreme values (where `vpmaddubsw` would saturate) and
//! k at `MAX_K`; the F32 and U8 epilogues bit for bit against `portable-i8`; threads; and
//! bad shapes as errors.

use hemi::cpu::qgemm::{qgemm, MAX_K};

use hemi::cpu::qgemm::epilogue::{Act, Epilogue};

use hemi::cpu::qgemm::pack::PackedB;

use hemi::cpu::qgemm::select::QKernel;
use hemi::Tensor;

/// xorshift64*: deterministic inputs without depending on hemi's generators.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn u8s(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| (self.next() >> 56) as u8).collect()
    }
    fn i8s(&mut self, len: usize) -> Vec<i8> {
        (0..len).map(|_| (self.next() >> 56) as u8 as i8).collect()
    }
    fn f32_in(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// Every kernel this CPU runs; the five portable ones always are.
fn kernels() -> Vec<QKernel> {
    let ks: Vec<QKernel> = QKernel::ALL
        .into_iter()
        .filter(|k| k.is_available())
        .collect();
    assert!(
        ks.iter().filter(|k| k.is_portable()).count() >= 5,
        "the portable kernel and its four twins must always run"
    );
    ks
}

/// `Σ_k A[i, k] · W[j, k]` in i64, checked to fit i32.
fn reference(a: &[u8], m: usize, lda: usize, w: &[i8], n: usize, k: usize) -> Vec<i32> {
    let mut c = vec![0i32; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: i64 = (0..k)
                .map(|x| a[i * lda + x] as i64 * w[j * k + x] as i64)
                .sum();
            c[i * n + j] = i32::try_from(s).expect("reference sum fits i32");
        }
    }
    c
}

fn sums(kernel: QKernel, a: &[u8], m: usize, lda: usize, w: &[i8], n: usize, k: usize) -> Vec<i32> {
    let b = PackedB::with_kernel(w, n, k, kernel).unwrap();
    // Not zero, so that an output a kernel forgets to write shows.
    let mut out = vec![i32::MIN + 7; m * n];
    qgemm(a, m, lda, &b, Epilogue::I32 { out: &mut out }).unwrap();
    out
}

/// A of m rows at stride `lda`, with the bytes between rows (and nothing after the last)
/// set to 0xA5, which no kernel may read into a sum.
fn strided(rng: &mut Rng, m: usize, k: usize, lda: usize) -> Vec<u8> {
    let mut a = vec![0xA5u8; if m == 0 { 0 } else { (m - 1) * lda + k }];
    for i in 0..m {
        a[i * lda..i * lda + k].copy_from_slice(&rng.u8s(k));
    }
    a
}

fn check_exact(kernel: QKernel, a: &[u8], m: usize, lda: usize, w: &[i8], n: usize, k: usize) {
    let want = reference(a, m, lda, w, n, k);
    let got = sums(kernel, a, m, lda, w, n, k);
    if let Some(p) = got.iter().zip(&want).position(|(g, w)| g != w) {
        panic!(
            "{}: m={m} n={n} k={k} lda={lda}: C[{}, {}] = {}, want {}",
            kernel.name(),
            p / n,
            p % n,
            got[p],
            want[p]
        );
    }
}

#[test]
fn sums_are_exact_on_odd_sizes() {
    const SIZES: [usize; 10] = [1, 2, 3, 7, 8, 9, 31, 33, 65, 130];
    const KS: [usize; 9] = [1, 2, 3, 4, 5, 8, 31, 64, 259];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for kernel in kernels() {
        for &m in &SIZES {
            for &n in &SIZES {
                for &k in &KS {
                    let a = rng.u8s(m * k);
                    let w = rng.i8s(n * k);
                    check_exact(kernel, &a, m, k, &w, n, k);
                }
            }
        }
    }
}

#[test]
fn sums_are_exact_for_every_row_count() {
    // Every tail of the 6-, 8- and 32-row tiles, and the switch from AMX tiles to
    // `vpdpbusd` ones for products of few rows.
    let mut rng = Rng(5);
    let (n, k) = (33, 67);
    let w = rng.i8s(n * k);
    for m in 1..=66 {
        let a = strided(&mut rng, m, k, k + 2);
        for kernel in kernels() {
            check_exact(kernel, &a, m, k + 2, &w, n, k);
        }
    }
}

#[test]
fn sums_are_exact_for_long_k_and_strided_rows() {
    let mut rng = Rng(7);
    // (m, n, k, lda): k not a multiple of 4 or 2, rows further apart than k.
    let cases = [
        (33, 65, 2051, 2051),
        (130, 31, 3001, 3013),
        (9, 130, 4096, 4100),
        (7, 33, 1023, 1030),
        (65, 9, 2, 5),
        (1, 1000, 1999, 2001),
    ];
    for kernel in kernels() {
        for &(m, n, k, lda) in &cases {
            let a = strided(&mut rng, m, k, lda);
            let w = rng.i8s(n * k);
            check_exact(kernel, &a, m, lda, &w, n, k);
        }
    }
}

#[test]
fn sums_are_exact_at_extreme_values() {
    // All 255 against all -128 or all 127 is where `vpmaddubsw`'s i16 pair sums saturate
    // (255·(-128)·2 = -65 280, 255·127·2 = 64 770); the alternating patterns put extremes of
    // both signs next to each other within a pair and within a group of 4.
    let (m, n) = (13, 37);
    for k in [1, 2, 3, 4, 5, 63, 64, 65, 1001] {
        let a_all = vec![255u8; m * k];
        let a_alt: Vec<u8> = (0..m * k)
            .map(|x| if x % 2 == 0 { 255 } else { 0 })
            .collect();
        let a_alt3: Vec<u8> = (0..m * k)
            .map(|x| if x % 3 == 0 { 0 } else { 255 })
            .collect();
        let w_neg = vec![-128i8; n * k];
        let w_pos = vec![127i8; n * k];
        let w_alt: Vec<i8> = (0..n * k)
            .map(|x| if x % 2 == 0 { -128 } else { 127 })
            .collect();
        let w_alt2: Vec<i8> = (0..n * k)
            .map(|x| if x / 2 % 2 == 0 { 127 } else { -128 })
            .collect();
        for kernel in kernels() {
            for a in [&a_all, &a_alt, &a_alt3] {
                for w in [&w_neg, &w_pos, &w_alt, &w_alt2] {
                    check_exact(kernel, a, m, k, w, n, k);
                }
            }
            // The extreme sums themselves, so the reference cannot hide a wrong pattern.
            let got = sums(kernel, &a_all, m, k, &w_neg, n, k);
            assert!(
                got.iter().all(|&c| c == -255 * 128 * k as i32),
                "{}",
                kernel.name()
            );
            let got = sums(kernel, &a_all, m, k, &w_pos, n, k);
            assert!(
                got.iter().all(|&c| c == 255 * 127 * k as i32),
                "{}",
                kernel.name()
            );
        }
    }
}

#[test]
fn sums_are_exact_at_max_k() {
    let (m, n) = (2, 3);
    for k in [MAX_K - 1, MAX_K] {
        let a = vec![255u8; m * k];
        let w = vec![-128i8; n * k];
        let mut rng = Rng(k as u64);
        let wr = rng.i8s(n * k);
        for kernel in kernels() {
            let got = sums(kernel, &a, m, k, &w, n, k);
            let want = -(255 * 128 * k as i64);
            assert!(want >= i32::MIN as i64);
            assert!(
                got.iter().all(|&c| c as i64 == want),
                "{} k={k}",
                kernel.name()
            );
            check_exact(kernel, &a, m, k, &wr, n, k);
        }
    }
}

#[test]
fn threads_give_the_same_sums() {
    // Above 64³ multiply-adds the product is split over rayon's pool; the pool's size must
    // not change a sum.
    let (m, n, k) = (131, 97, 515);
    let mut rng = Rng(11);
    let a = strided(&mut rng, m, k, k + 3);
    let w = rng.i8s(n * k);
    let want = reference(&a, m, k + 3, &w, n, k);
    for threads in [1, 2, 3, 5] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for kernel in kernels() {
            let got = pool.install(|| sums(kernel, &a, m, k + 3, &w, n, k));
            assert!(got == want, "{} on {threads} threads", kernel.name());
        }
    }
}

/// Per-row activation qparams, per-column weight scales and a bias for `m` × `n`.
struct Params {
    a_scale: Vec<f32>,
    a_zero: Vec<i32>,
    w_scale: Vec<f32>,
    bias: Vec<f32>,
}

fn params(rng: &mut Rng, m: usize, n: usize) -> Params {
    Params {
        a_scale: (0..m).map(|_| rng.f32_in(1e-3, 0.1)).collect(),
        a_zero: (0..m).map(|_| (rng.next() >> 56) as i32).collect(),
        w_scale: (0..n).map(|_| rng.f32_in(1e-4, 1e-2)).collect(),
        bias: (0..n).map(|_| rng.f32_in(-5.0, 5.0)).collect(),
    }
}

#[test]
fn epilogues_match_portable_bit_for_bit() {
    let mut rng = Rng(0xe91);
    for &(m, n, k) in &[
        (1, 1, 1),
        (7, 33, 65),
        (9, 31, 130),
        (65, 130, 259),
        (130, 65, 1001),
    ] {
        let lda = k + 1;
        let a = strided(&mut rng, m, k, lda);
        let w = rng.i8s(n * k);
        let p = params(&mut rng, m, n);
        let run = |kernel: QKernel, bias: bool, act: Act| {
            let relu = act == Act::Relu;
            let b = PackedB::with_kernel(&w, n, k, kernel).unwrap();
            let bias = bias.then_some(&p.bias[..]);
            let mut f = vec![f32::NAN; m * n];
            let epi = Epilogue::F32 {
                a_scale: &p.a_scale,
                a_zero: &p.a_zero,
                w_scale: &p.w_scale,
                bias,
                act,
                out: &mut f,
            };
            qgemm(&a, m, lda, &b, epi).unwrap();
            let mut q = vec![0xEEu8; m * n];
            let epi = Epilogue::U8 {
                a_scale: &p.a_scale,
                a_zero: &p.a_zero,
                w_scale: &p.w_scale,
                bias,
                relu,
                out_scale: 0.05,
                out_zero: 100,
                out: &mut q,
            };
            qgemm(&a, m, lda, &b, epi).unwrap();
            (f.iter().map(|x| x.to_bits()).collect::<Vec<u32>>(), q)
        };
        for bias in [false, true] {
            let (plain, _) = run(QKernel::Portable, bias, Act::None);
            for act in [Act::None, Act::Relu, Act::Gelu, Act::GeluTanh] {
                let relu = act == Act::Relu;
                let (f_ref, q_ref) = run(QKernel::Portable, bias, act);
                // A fused GELU gives the bits of the op applied to the plain outputs.
                if matches!(act, Act::Gelu | Act::GeluTanh) {
                    let y = Tensor::from_vec(
                        plain.iter().map(|&b| f32::from_bits(b)).collect(),
                        &[m, n],
                    )
                    .unwrap();
                    let y = if act == Act::Gelu {
                        y.gelu()
                    } else {
                        y.gelu_tanh()
                    }
                    .unwrap();
                    let want: Vec<u32> = y.to_vec_f32().iter().map(|x| x.to_bits()).collect();
                    assert!(
                        f_ref == want,
                        "{act:?} epilogue != the op, m={m} n={n} k={k}"
                    );
                }
                // The reference itself must be no constant: outputs of both signs (before
                // ReLU) and requantised values away from the clamps.
                if m * n > 1 {
                    assert!(f_ref.iter().any(|&x| f32::from_bits(x) > 0.0));
                    if act != Act::Relu {
                        assert!(f_ref.iter().any(|&x| f32::from_bits(x) < 0.0));
                    }
                    assert!(q_ref.iter().any(|&x| x != 0 && x != 255 && x != 100));
                }
                for kernel in kernels() {
                    let (f, q) = run(kernel, bias, act);
                    assert!(
                        f == f_ref,
                        "{} F32 epilogue bias={bias} {act:?} m={m} n={n} k={k}",
                        kernel.name()
                    );
                    assert!(
                        q == q_ref,
                        "{} U8 epilogue bias={bias} relu={relu} m={m} n={n} k={k}",
                        kernel.name()
                    );
                }
            }
        }
    }
}

#[test]
fn zero_sizes_are_fine() {
    for kernel in kernels() {
        // k = 0: every sum is 0.
        let b = PackedB::with_kernel(&[], 5, 0, kernel).unwrap();
        assert_eq!(b.col_sums(), &[0; 5]);
        let mut out = vec![9i32; 15];
        qgemm(&[], 3, 0, &b, Epilogue::I32 { out: &mut out }).unwrap();
        assert_eq!(out, vec![0; 15], "{}", kernel.name());
        // m = 0 and n = 0: nothing to write.
        let b = PackedB::with_kernel(&[1, 2, 3], 1, 3, kernel).unwrap();
        qgemm(&[], 0, 3, &b, Epilogue::I32 { out: &mut [] }).unwrap();
        let b = PackedB::with_kernel(&[], 0, 3, kernel).unwrap();
        qgemm(&[1, 2, 3], 1, 3, &b, Epilogue::I32 { out: &mut [] }).unwrap();
    }
}

#[test]
fn packing_keeps_shape_and_sums() {
    let mut rng = Rng(3);
    let (n, k) = (37, 1027);
    let w = rng.i8s(n * k);
    let want: Vec<i32> = w
        .chunks(k)
        .map(|r| r.iter().map(|&x| x as i32).sum())
        .collect();
    for kernel in kernels() {
        let b = PackedB::with_kernel(&w, n, k, kernel).unwrap();
        assert_eq!((b.n(), b.k(), b.kernel()), (n, k, kernel));
        assert_eq!(b.col_sums(), &want[..], "{}", kernel.name());
        assert!(b.nbytes() >= n * k + 4 * n);
    }
}

#[test]
fn best_is_the_fastest_available() {
    let best = QKernel::best();
    assert!(best.is_available());
    let order = [
        QKernel::AmxInt8,
        QKernel::Avx512Vnni,
        QKernel::AvxVnni,
        QKernel::Avx2I16,
    ];
    let expect = order
        .into_iter()
        .find(|k| k.is_available())
        .unwrap_or(QKernel::Portable);
    assert_eq!(best, expect);
    assert!(best == QKernel::Portable || !best.is_portable());
    assert_eq!(PackedB::new(&[1; 6], 2, 3).unwrap().kernel(), best);
    // Every name is distinct.
    let mut names: Vec<_> = QKernel::ALL.iter().map(|k| k.name()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), QKernel::ALL.len());
}

#[test]
fn bad_shapes_are_errors() {
    for kernel in kernels() {
        // Weights of the wrong length; k over MAX_K.
        assert!(PackedB::with_kernel(&[0; 5], 2, 3, kernel).is_err());
        assert!(PackedB::with_kernel(&[0; 7], 2, 3, kernel).is_err());
        let big = vec![0i8; MAX_K + 1];
        assert!(PackedB::with_kernel(&big, 1, MAX_K + 1, kernel).is_err());
        assert!(PackedB::with_kernel(&[], usize::MAX, 2, kernel).is_err());

        let (m, n, k) = (3, 4, 5);
        let b = PackedB::with_kernel(&[1; 20], n, k, kernel).unwrap();
        let mut out = vec![0i32; m * n];
        // A one byte short, at stride k and at a wider stride; stride below k.
        assert!(qgemm(&[0; 14], m, k, &b, Epilogue::I32 { out: &mut out }).is_err());
        assert!(qgemm(&[0; 20], m, 8, &b, Epilogue::I32 { out: &mut out }).is_err());
        assert!(qgemm(&[0; 15], m, 4, &b, Epilogue::I32 { out: &mut out }).is_err());
        assert!(qgemm(&[0; 15], usize::MAX, k, &b, Epilogue::I32 { out: &mut out }).is_err());
        // The exact lengths pass (no padding after the last row).
        assert!(qgemm(&[0; 15], m, k, &b, Epilogue::I32 { out: &mut out }).is_ok());
        assert!(qgemm(&[0; 21], m, 8, &b, Epilogue::I32 { out: &mut out }).is_ok());
        // Outputs and epilogue parameters of the wrong length.
        assert!(qgemm(&[0; 15], m, k, &b, Epilogue::I32 { out: &mut out[1..] }).is_err());
        let (s3, z3, s4, b4) = ([1.0f32; 3], [0i32; 3], [1.0f32; 4], [0.0f32; 4]);
        let mut f = vec![0f32; m * n];
        let mut epi = |a_scale: &[f32], a_zero: &[i32], w_scale: &[f32], bias, out_len| {
            let epi = Epilogue::F32 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                act: Act::None,
                out: &mut f[..out_len],
            };
            qgemm(&[0; 15], m, k, &b, epi)
        };
        assert!(epi(&s3, &z3, &s4, Some(&b4), 12).is_ok());
        assert!(epi(&s3[..2], &z3, &s4, None, 12).is_err());
        assert!(epi(&s3, &z3[..2], &s4, None, 12).is_err());
        assert!(epi(&s3, &z3, &s4[..3], None, 12).is_err());
        assert!(epi(&s3, &z3, &s4, Some(&b4[..3]), 12).is_err());
        assert!(epi(&s3, &z3, &s4, None, 11).is_err());
        let mut q = vec![0u8; m * n + 1];
        let epi = Epilogue::U8 {
            a_scale: &s3,
            a_zero: &z3,
            w_scale: &s4,
            bias: None,
            relu: false,
            out_scale: 1.0,
            out_zero: 0,
            out: &mut q,
        };
        assert!(qgemm(&[0; 15], m, k, &b, epi).is_err());
    }
    // A kernel this CPU lacks cannot be packed for.
    for kernel in QKernel::ALL.into_iter().filter(|k| !k.is_available()) {
        assert!(PackedB::with_kernel(&[0; 4], 2, 2, kernel).is_err());
    }
}
