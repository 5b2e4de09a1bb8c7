//! The unit tests of `hemi::cpu::norm` (`src/cpu/norm/mod.rs`), run against the built library.

use hemi::cpu::chunked;
use hemi::cpu::norm::in_place as norm_wide;
use hemi::cpu::norm::in_place::Apply as BnApply;
use hemi::cpu::norm::*;
use hemi::cpu::reduce::sum_slice;
use hemi::dtype::WithDType;

/// The vectorised layer-norm row gives the baseline loop's bits, for every mix of
/// weight and bias, on rows of odd lengths; and statistics close to F64's.
#[test]
fn wide_layer_norm_rows_equal_the_baseline_and_f64() {
    let mut seed = 7u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 1.5
    };
    for d in [1usize, 7, 8, 33, 384, 385] {
        let row: Vec<f32> = (0..d).map(|_| next()).collect();
        let w: Vec<f32> = (0..d).map(|_| next()).collect();
        let b: Vec<f32> = (0..d).map(|_| next()).collect();
        for (wo, bo) in [
            (None, None),
            (Some(&w[..]), None),
            (None, Some(&b[..])),
            (Some(&w[..]), Some(&b[..])),
        ] {
            let (mut plain, mut wide) = (vec![0f32; d], vec![0f32; d]);
            let s_plain = ln_row_impl(&row, &mut plain, wo, bo, 1e-5);
            let s_wide = ln_row(&row, &mut wide, wo, bo, 1e-5);
            assert_eq!(s_plain.0.to_bits(), s_wide.0.to_bits(), "mean, d={d}");
            assert_eq!(s_plain.1.to_bits(), s_wide.1.to_bits(), "rstd, d={d}");
            assert!(
                plain
                    .iter()
                    .zip(&wide)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "d={d}"
            );
            let m: f64 = row.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
            let var: f64 = row.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / d as f64;
            assert!(
                (f64::from(s_wide.0) - m).abs() <= 1e-6 * (1.0 + m.abs()),
                "d={d}"
            );
            let r = 1.0 / (var + 1e-5).sqrt();
            assert!((f64::from(s_wide.1) - r).abs() <= 1e-5 * r, "d={d}");
            for j in 0..d {
                let want = (f64::from(row[j]) - m) * r * wo.map_or(1.0, |w| f64::from(w[j]))
                    + bo.map_or(0.0, |b| f64::from(b[j]));
                assert!(
                    (f64::from(wide[j]) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "y[{j}], d={d}"
                );
            }
        }
    }
}

/// The AVX2 `relu_sums` gives `relu_sums_impl`'s bits, with and without the ReLU's
/// output, at every tail length: exactly on finite data with signed zeros and
/// subnormals, and NaN for NaN where infinities and NaN come in.
#[cfg(target_arch = "x86_64")]
#[test]
fn relu_sums_avx2_equals_the_portable_loop() {
    if !hemi::cpu::features::Feature::Avx2.detected() {
        return;
    }
    for special in [
        &[0.0, -0.0, 1e-40, -3.5][..],
        &[f32::INFINITY, f32::NEG_INFINITY, f32::NAN],
    ] {
        let val = |i: usize, salt: usize| -> f32 {
            if (i * 7 + salt).is_multiple_of(23) {
                special[(i + salt) % special.len()]
            } else {
                (((i * 37 + salt * 11) % 101) as f32 - 50.0) * 0.173
            }
        };
        for n in (0..40).chain([1000, 1027]) {
            let g: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
            let y: Vec<f32> = (0..n).map(|i| val(i, 2)).collect();
            let x: Vec<f32> = (0..n).map(|i| val(i, 3)).collect();
            for yy in [None, Some(&y[..])] {
                let want = relu_sums_impl(&g, yy, &x, 0.3, 1.7);
                // SAFETY: AVX2 checked above; y and x are as long as g.
                let got = unsafe { wide::relu_sums_avx2(&g, yy, &x, 0.3, 1.7) };
                // Any NaN matches any NaN: Rust leaves a NaN result's sign and payload
                // to the compiler, which may swap an addition's operands.
                let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan();
                assert!(
                    same(got.0, want.0) && same(got.1, want.1),
                    "n {n}, relu {}: {got:?} vs {want:?}",
                    yy.is_some()
                );
            }
        }
    }
}

/// The AVX2 and AVX-512 builds of batch norm's elementwise loops (the forward's output,
/// the ReLU mask, the training input gradient) give the portable loop's bits, tails
/// included.
#[cfg(target_arch = "x86_64")]
#[test]
fn wide_norm_backward_loops_equal_the_portable_loop() {
    let k = DxTrain {
        mu: 0.3,
        rs: 1.7,
        wc: -0.9,
        dm: 0.011,
        dn: -0.37,
    };
    let val = |i: usize, salt: usize| match (i * 7 + salt) % 29 {
        0 => -0.0,
        1 => 1e-40,
        2 => f32::INFINITY,
        _ => (((i * 37 + salt * 11) % 101) as f32 - 50.0) * 0.173,
    };
    type Mask = unsafe fn(&mut [f32], &[f32], &[f32]);
    type Dx = unsafe fn(&mut [f32], &[f32], &[f32], DxTrain);
    let mut builds: Vec<(&str, Mask, Dx)> = vec![];
    if hemi::cpu::features::Feature::Avx2.detected() {
        builds.push(("avx2", wide::relu_mask_avx2, wide::dx_train_avx2));
    }
    if hemi::cpu::features::Feature::Avx512f.detected() {
        builds.push(("avx512", wide::relu_mask_avx512, wide::dx_train_avx512));
    }
    for n in (0..50).chain([1027]) {
        let g: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
        let y: Vec<f32> = (0..n).map(|i| val(i, 2)).collect();
        let x: Vec<f32> = (0..n).map(|i| val(i, 3)).collect();
        let (mut want_m, mut want_d) = (vec![0f32; n], vec![0f32; n]);
        relu_mask_impl(&mut want_m, &g, &y);
        dx_train_impl(&mut want_d, &g, &x, k);
        for &(name, mask, dx) in &builds {
            let (mut m, mut d) = (vec![0f32; n], vec![0f32; n]);
            // SAFETY: the features were detected above.
            unsafe {
                mask(&mut m, &g, &y);
                dx(&mut d, &g, &x, k);
            }
            let same = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan())
            };
            assert!(same(&m, &want_m), "{name}: relu mask, n {n}");
            assert!(same(&d, &want_d), "{name}: dx, n {n}");
        }
        let k = |relu| BnApply {
            mu: 0.3,
            scale: -1.3,
            shift: 0.2,
            relu,
        };
        for (r, relu) in [(None, false), (Some(&y[..]), true), (None, true)] {
            let mut want = vec![0f32; n];
            bn_apply_impl(&mut want, &x, r, k(relu));
            let mut wide: Vec<(&str, Vec<f32>)> = vec![];
            if hemi::cpu::features::Feature::Avx2.detected() {
                let mut o = vec![0f32; n];
                // SAFETY: AVX2 detected.
                unsafe { wide::bn_apply_avx2(&mut o, &x, r, k(relu)) };
                wide.push(("avx2", o));
            }
            if hemi::cpu::features::Feature::Avx512f.detected() {
                let mut o = vec![0f32; n];
                // SAFETY: AVX-512 F detected.
                unsafe { wide::bn_apply_avx512(&mut o, &x, r, k(relu)) };
                wide.push(("avx512", o));
            }
            for (name, o) in wide {
                let same = o
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan());
                assert!(same, "{name}: apply, n {n}, relu {relu}");
            }
        }
    }
}

/// The per-run kernels of `norm::in_place` (AVX-512 and AVX2 builds, each where this CPU
/// runs it), which read and write F32/F16/BF16 directly, give the bits of the portable path
/// (widen into an F32 buffer, the F32 loop, round out of a buffer) for every element type,
/// run length (tails included), with and without the ReLU's output and the residual, in
/// training and eval; on finite data with signed zeros and (F32) subnormals, and NaN for
/// NaN where infinities come in.
#[test]
fn direct_half_runs_equal_the_buffered_path() {
    let levels = [norm_wide::Level::Avx512, norm_wide::Level::Avx2];
    for level in levels.into_iter().filter(|l| l.is_available()) {
        check::<f32>(level);
        check::<half::f16>(level);
        check::<half::bf16>(level);
    }
    fn check<T: WithDType>(level: norm_wide::Level) {
        let name = T::DTYPE;
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan();
        let same_t = |a: &[T], b: &[T]| {
            let (mut fa, mut fb) = (vec![0f32; a.len()], vec![0f32; b.len()]);
            let (fa, fb) = (chunked::read(a, 0, &mut fa), chunked::read(b, 0, &mut fb));
            fa.iter().zip(fb).all(|(&x, &y)| same(x, y))
        };
        for special in [&[0.0, -0.0, 1e-40, -3.5][..], &[f32::INFINITY, f32::NAN]] {
            let val = |i: usize, salt: usize| -> f32 {
                if (i * 7 + salt).is_multiple_of(23) {
                    special[(i + salt) % special.len()]
                } else {
                    (((i * 37 + salt * 11) % 101) as f32 - 50.0) * 0.173
                }
            };
            let half = |salt: usize, n: usize| -> Vec<T> {
                let f: Vec<f32> = (0..n).map(|i| val(i, salt)).collect();
                let mut t = vec![T::default(); n];
                chunked::write(&f, &mut t);
                t
            };
            for n in (0..50).chain([1000, 1027]) {
                let (g, y, x) = (half(1, n), half(2, n), half(3, n));
                let widen = |v: &[T]| {
                    let mut b = vec![0f32; n];
                    chunked::read(v, 0, &mut b).to_vec()
                };
                let (gf, yf, xf) = (widen(&g), widen(&y), widen(&x));
                // SAFETY: `level.is_available()` (the caller's filter); every slice is `n` long.
                unsafe {
                    assert!(
                        same(norm_wide::sum(level, &x), sum_slice(&xf)),
                        "{level:?} {name:?} sum n {n}"
                    );
                    let want = sum_map(&xf, |v| (v - 0.3) * (v - 0.3));
                    assert!(
                        same(norm_wide::sq_dev(level, &x, 0.3), want),
                        "{level:?} {name:?} sq n {n}"
                    );
                    for yy in [None, Some((&y[..], &yf[..]))] {
                        let got = norm_wide::relu_sums(level, &g, yy.map(|p| p.0), &x, 0.3, 1.7);
                        let want = relu_sums_impl(&gf, yy.map(|p| p.1), &xf, 0.3, 1.7);
                        assert!(
                            same(got.0, want.0) && same(got.1, want.1),
                            "{level:?} {name:?} relu sums n {n}: {got:?} vs {want:?}"
                        );
                    }
                    for (r, relu) in [(None, false), (Some((&y[..], &yf[..])), true)] {
                        let k = BnApply {
                            mu: 0.3,
                            scale: -1.3,
                            shift: 0.2,
                            relu,
                        };
                        let mut want = vec![0f32; n];
                        bn_apply_impl(&mut want, &xf, r.map(|p| p.1), k);
                        let mut want_t = vec![T::default(); n];
                        chunked::write(&want, &mut want_t);
                        let mut got = vec![T::default(); n];
                        norm_wide::apply(level, norm_wide::uninit(&mut got), &x, r.map(|p| p.0), k);
                        assert!(
                            same_t(&got, &want_t),
                            "{level:?} {name:?} apply n {n} relu {relu}"
                        );
                    }
                    for (training, yy) in [(true, Some((&y[..], &yf[..]))), (false, None)] {
                        let k = DxTrain {
                            mu: 0.3,
                            rs: 1.7,
                            wc: -0.9,
                            dm: 0.011,
                            dn: -0.37,
                        };
                        let mut gz = vec![0f32; n];
                        let gz = through_relu(&gf, yy.map(|p| p.1), &mut gz).to_vec();
                        let mut want = vec![0f32; n];
                        if training {
                            dx_train_impl(&mut want, &gz, &xf, k);
                        } else {
                            for (o, &g) in want.iter_mut().zip(&gz) {
                                *o = g * k.wc * k.rs;
                            }
                        }
                        let (mut want_t, mut want_r) =
                            (vec![T::default(); n], vec![T::default(); n]);
                        chunked::write(&want, &mut want_t);
                        chunked::write(&gz, &mut want_r);
                        let (mut got, mut got_r) = (vec![T::default(); n], vec![T::default(); n]);
                        let kw = norm_wide::Dx {
                            training,
                            mu: k.mu,
                            rs: k.rs,
                            wc: k.wc,
                            dm: k.dm,
                            dn: k.dn,
                        };
                        let yv = yy.map(|p| p.0);
                        norm_wide::dx(
                            level,
                            &g,
                            yv,
                            &x,
                            kw,
                            Some(norm_wide::uninit(&mut got)),
                            Some(norm_wide::uninit(&mut got_r)),
                        );
                        assert!(
                            same_t(&got, &want_t),
                            "{level:?} {name:?} dx n {n} train {training}"
                        );
                        assert!(same_t(&got_r, &want_r), "{level:?} {name:?} dres n {n}");
                    }
                }
            }
        }
    }
}
