//! The op table (`backend::map::UnaryOp`, `BinaryOp`) is the definition every backend is
//! held to: here the CPU backend's maps, their derivatives and the binary maps against the
//! table's f64 `reference`/`derivative`, for every op in `ALL`, on F64, F32, F16 and BF16
//! strided views. The CUDA backend's test (`tests/cuda`) compares its kernels with the same
//! references.

use std::sync::Arc;

use crate::common::{assert_close, balanced, rand_values, tensor};
use hemi::backend::map::{BinaryOp, UnaryOp};
use hemi::rng::Generator;
use hemi::tensor::{Layout, Storage, Tensor};
use hemi::DType;

const DTYPES: [DType; 4] = [DType::F64, DType::F32, DType::F16, DType::BF16];

fn values(s: Storage, shape: &[usize]) -> Vec<f64> {
    Tensor::from_storage(Arc::new(s), Layout::contiguous(shape)).to_vec_f64()
}

/// Inputs inside the op's domain, away from its kinks (where a one-ulp change of the input
/// flips the derivative).
fn domain(op: UnaryOp) -> (f64, f64) {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt => (0.1, 6.0),
        UnaryOp::Exp => (-6.0, 6.0),
        _ => (-3.0, 3.0),
    }
}

#[test]
fn every_unary_map_and_its_derivative_match_the_tables_f64_definition() {
    let mut rng = Generator::new(5);
    let shape = [7, 13];
    for dtype in DTYPES {
        for op in UnaryOp::ALL {
            let what = format!("{} {dtype:?}", op.name());
            let (lo, hi) = domain(op);
            let xv: Vec<f64> = rand_values(91, lo, hi, dtype, &mut rng)
                .into_iter()
                .map(|x| if x.abs() < 1e-2 { 0.5 } else { x })
                .collect();
            let x = tensor(&xv, &shape, dtype, true);
            let y = x.storage().unary(x.layout(), op, dtype).unwrap();
            let yv = values(y.clone(), &shape);
            let want: Vec<f64> = xv.iter().map(|&x| op.reference(x)).collect();
            assert_close(&format!("{what}: value"), &yv, &want, balanced(dtype));

            let gv = rand_values(91, -2.0, 2.0, dtype, &mut rng);
            let g = tensor(&gv, &shape, dtype, false);
            let (saved, ls) = if op.backward_uses_output() {
                (y, Layout::contiguous(&shape))
            } else {
                ((*x.storage()).clone(), x.layout().clone())
            };
            let dx = g
                .storage()
                .unary_backward(g.layout(), &saved, &ls, op, dtype)
                .unwrap();
            let want: Vec<f64> = xv
                .iter()
                .zip(&gv)
                .map(|(&x, &g)| g * op.derivative(x))
                .collect();
            // The output-based derivatives read the rounded output: one more rounding of
            // the dtype in the slope.
            let mut tol = balanced(dtype);
            if op.backward_uses_output() {
                tol.rtol *= 2.0;
                tol.atol *= 2.0;
            }
            assert_close(
                &format!("{what}: derivative"),
                &values(dx, &shape),
                &want,
                tol,
            );
        }
    }
}

#[test]
fn every_binary_map_matches_the_tables_f64_definition_with_broadcasting() {
    let mut rng = Generator::new(6);
    for dtype in DTYPES {
        for op in BinaryOp::ALL {
            let what = format!("{} {dtype:?}", op.name());
            let av = rand_values(5 * 9, -3.0, 3.0, dtype, &mut rng);
            let mut bv = rand_values(9, -3.0, 3.0, dtype, &mut rng);
            bv[2] = av[2]; // a tie for maximum/minimum
            let a = tensor(&av, &[5, 9], dtype, true);
            let b = tensor(&bv, &[9], dtype, false);
            // b broadcast over the rows by a zero stride.
            let lb = Layout::new(vec![5, 9], vec![0, 1], b.layout().offset());
            let y = a
                .storage()
                .binary(a.layout(), &b.storage(), &lb, op, dtype)
                .unwrap();
            let want: Vec<f64> = (0..45).map(|i| op.reference(av[i], bv[i % 9])).collect();
            assert_close(&what, &values(y, &[5, 9]), &want, balanced(dtype));
        }
    }
}
