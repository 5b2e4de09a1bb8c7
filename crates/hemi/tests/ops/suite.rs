// The op suite: the same test bodies on the CPU and on another backend, `BACKEND`, compared
// by the tolerance rule written at the top of `naive.rs`. Two files include it (`include!`):
// `naive.rs` (the naive backend, F64/F32/F16/BF16) and `../gpu/ops.rs` (the wgpu backend,
// F32/F16/BF16). The includer defines `BACKEND: Device` and the macro
// `every_dtype!(name, body)`, which makes one `#[test]` per dtype it runs.

use crate::common;
use common::*;
use hemi::backend::map::{BinaryOp, UnaryOp};
use hemi::ops::conv::Conv2dOptions;
use hemi::ops::index::embedding;
use hemi::ops::loss::{cross_entropy, mse_loss, nll_loss, CrossEntropyOptions, Reduction};
use hemi::{DType, Device, Generator, Result, Tensor};

/// How an input reaches the op: the tensor itself, or a non-contiguous view of a buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum View {
    /// A contiguous tensor.
    Plain,
    /// The last two dims stored swapped and transposed back (rank >= 2).
    Transposed,
    /// The last dim cut out of a buffer 3 wider, from offset 1 (gaps and an offset).
    Narrowed,
}

/// An input of an op: its row-major values (exact in `dtype`), shape, dtype, how it is
/// viewed and whether it gets a gradient.
#[derive(Clone, Debug)]
struct Input {
    values: Vec<f64>,
    shape: Vec<usize>,
    dtype: DType,
    view: View,
    grad: bool,
}

/// A float input of random values in `[lo, hi)`, rounded into `dtype`, with a gradient.
fn float(
    shape: &[usize],
    dtype: DType,
    view: View,
    (lo, hi): (f64, f64),
    rng: &mut Generator,
) -> Input {
    let n = shape.iter().product();
    Input {
        values: rand_values(n, lo, hi, dtype, rng),
        shape: shape.to_vec(),
        dtype,
        view,
        grad: true,
    }
}

/// An input in `[-1, 1)`.
fn unit(shape: &[usize], dtype: DType, view: View, rng: &mut Generator) -> Input {
    float(shape, dtype, view, (-1.0, 1.0), rng)
}

/// An I64 input (class indices, ids): no gradient, contiguous.
fn ints(values: Vec<i64>, shape: &[usize]) -> Input {
    Input {
        values: values.into_iter().map(|v| v as f64).collect(),
        shape: shape.to_vec(),
        dtype: DType::I64,
        view: View::Plain,
        grad: false,
    }
}

impl Input {
    /// The same input without a gradient.
    fn no_grad(mut self) -> Input {
        self.grad = false;
        self
    }

    /// The leaf on `device` (the buffer that gets the gradient) and the view the op reads.
    fn make(&self, device: Device) -> (Tensor, Tensor) {
        let r = self.shape.len();
        let (values, shape) = match self.view {
            View::Plain => (self.values.clone(), self.shape.clone()),
            View::Transposed => {
                assert!(r >= 2, "a transposed view needs rank 2");
                let (a, b) = (self.shape[r - 2], self.shape[r - 1]);
                let mut v = vec![0.0; self.values.len()];
                for o in 0..self.values.len() / (a * b).max(1) {
                    for i in 0..a {
                        for j in 0..b {
                            v[o * a * b + j * a + i] = self.values[o * a * b + i * b + j];
                        }
                    }
                }
                let mut s = self.shape.clone();
                s.swap(r - 1, r - 2);
                (v, s)
            }
            View::Narrowed => {
                let last = self.shape[r - 1];
                let mut v = Vec::new();
                for row in self.values.chunks(last.max(1)) {
                    v.push(0.25);
                    v.extend_from_slice(row);
                    v.extend_from_slice(&[-0.5, 0.75]);
                }
                let mut s = self.shape.clone();
                s[r - 1] += 3;
                (v, s)
            }
        };
        let leaf = Tensor::from_f64_vec(values, &shape, self.dtype)
            .unwrap()
            .to_device(device)
            .unwrap();
        if self.grad {
            leaf.set_requires_grad(true).unwrap();
        }
        let view = match self.view {
            View::Plain => leaf.clone(),
            View::Transposed => leaf.transpose(-1, -2).unwrap(),
            View::Narrowed => leaf.narrow(-1, 1, self.shape[r - 1]).unwrap(),
        };
        assert_eq!(view.shape(), &self.shape[..]);
        (leaf, view)
    }
}

/// What one backend computed: each output's values (and dtype), each input's gradient.
struct Run {
    outputs: Vec<(DType, Vec<f64>)>,
    grads: Vec<Option<Vec<f64>>>,
}

/// Runs `f` on `device`; the first output gets a backward with a random gradient (the same
/// values on every device) when an input asks for one.
fn run(inputs: &[Input], device: Device, f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Run {
    let (leaves, views): (Vec<Tensor>, Vec<Tensor>) = inputs.iter().map(|i| i.make(device)).unzip();
    let outs = f(&views).unwrap_or_else(|e| panic!("on {device}: {e}"));
    for o in &outs {
        assert_eq!(o.device(), device, "an output left {device}");
    }
    let first = &outs[0];
    if first.requires_grad() {
        let mut rng = Generator::new(0x5eed);
        let g = rand_values(first.numel(), -1.0, 1.0, first.dtype(), &mut rng);
        let g = Tensor::from_f64_vec(g, first.shape(), first.dtype())
            .unwrap()
            .to_device(device)
            .unwrap();
        hemi::autograd::backward_with(first, g).unwrap_or_else(|e| panic!("on {device}: {e}"));
    }
    Run {
        outputs: outs.iter().map(|o| (o.dtype(), o.to_vec_f64())).collect(),
        grads: leaves
            .iter()
            .zip(inputs)
            .map(|(l, i)| {
                i.grad.then(|| {
                    let g = l
                        .grad()
                        .expect("every input that asks for a gradient gets one");
                    assert_eq!(g.device(), device, "a gradient left {device}");
                    g.to_vec_f64()
                })
            })
            .collect(),
    }
}

/// How closely the two backends must agree.
#[derive(Clone, Copy, Debug)]
enum Agree {
    /// Bit for bit (NaN matching NaN).
    Bits,
    /// The file's rule with at most `n` terms per element.
    Terms(usize),
}

/// The file's tolerance for `dtype` and `n` terms, as a factor of the tensor's scale.
fn tolerance(dtype: DType, n: usize) -> f64 {
    let eps = |d: DType| d.finfo().unwrap().epsilon;
    4.0 * (eps(dtype) + n as f64 * eps(dtype.compute_type()))
}

#[track_caller]
fn compare(what: &str, dtype: DType, cpu: &[f64], other: &[f64], agree: Agree) {
    assert_eq!(cpu.len(), other.len(), "{what}: lengths");
    match agree {
        Agree::Bits => {
            for (i, (c, n)) in cpu.iter().zip(other).enumerate() {
                assert!(
                    c.to_bits() == n.to_bits() || (c.is_nan() && n.is_nan()),
                    "{what}[{i}]: cpu {c:e}, {BACKEND} {n:e} (not bit-identical)"
                );
            }
        }
        Agree::Terms(n) => {
            let scale = cpu
                .iter()
                .filter(|v| v.is_finite())
                .fold(0.0f64, |m, v| m.max(v.abs()));
            let t = tolerance(dtype, n);
            assert_close(
                what,
                other,
                cpu,
                Tol {
                    rtol: 0.0,
                    atol: t * scale.max(f64::MIN_POSITIVE),
                },
            );
        }
    }
}

/// Runs `f` on both backends and compares every output (`forward`) and input gradient
/// (`backward`).
#[track_caller]
fn same(
    what: &str,
    inputs: &[Input],
    forward: Agree,
    backward: Agree,
    f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>>,
) {
    same_dyn(what, inputs, forward, backward, &f)
}

/// [`same`]'s body, compiled once rather than once per closure.
#[track_caller]
fn same_dyn(
    what: &str,
    inputs: &[Input],
    forward: Agree,
    backward: Agree,
    f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>,
) {
    let cpu = run(inputs, Device::Cpu, f);
    let other = run(inputs, BACKEND, f);
    for (k, ((dc, c), (dn, n))) in cpu.outputs.iter().zip(&other.outputs).enumerate() {
        assert_eq!(dc, dn, "{what}: output {k}'s dtype");
        let agree = if dc.is_float() { forward } else { Agree::Bits };
        compare(&format!("{what}: output {k}"), *dc, c, n, agree);
    }
    for (k, (c, n)) in cpu.grads.iter().zip(&other.grads).enumerate() {
        if let (Some(c), Some(n)) = (c, n) {
            let dt = inputs[k].dtype;
            compare(&format!("{what}: d input {k}"), dt, c, n, backward);
        }
    }
}

/// One output.
fn one(t: Result<Tensor>) -> Result<Vec<Tensor>> {
    Ok(vec![t?])
}

const VIEWS: [View; 3] = [View::Plain, View::Transposed, View::Narrowed];

// ----- maps -----------------------------------------------------------------------------

/// `op` through the public method that calls it.
fn apply(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    match op {
        UnaryOp::Neg => x.neg(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.log(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Relu => x.relu(),
        UnaryOp::Gelu => x.gelu(),
        UnaryOp::GeluTanh => x.gelu_tanh(),
        UnaryOp::Sigmoid => x.sigmoid(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::AddScalar(c) => x.add_scalar(c),
        UnaryOp::MulScalar(c) => x.mul_scalar(c),
        UnaryOp::PowScalar(p) => x.pow_scalar(p),
        UnaryOp::Clamp(lo, hi) => x.clamp(lo, hi),
    }
}

fn unary_maps(dtype: DType) {
    let mut rng = Generator::new(1);
    for op in UnaryOp::ALL {
        // Log and sqrt on positive values, the others across zero.
        let range = match op {
            UnaryOp::Log | UnaryOp::Sqrt => (0.125, 3.0),
            _ => (-3.0, 3.0),
        };
        let exact = matches!(
            op,
            UnaryOp::Neg
                | UnaryOp::Abs
                | UnaryOp::Relu
                | UnaryOp::Clamp(..)
                | UnaryOp::AddScalar(_)
                | UnaryOp::MulScalar(_)
                | UnaryOp::PowScalar(_)
        );
        for view in VIEWS {
            let x = float(&[3, 7, 5], dtype, view, range, &mut rng);
            same(
                &format!("{} {view:?}", op.name()),
                &[x],
                if exact { Agree::Bits } else { Agree::Terms(1) },
                Agree::Terms(1),
                |t| one(apply(op, &t[0])),
            );
        }
    }
}
every_dtype!(unary, unary_maps);

fn binary_maps(dtype: DType) {
    let mut rng = Generator::new(2);
    // (a's shape, b's shape): equal shapes, and broadcasting either way.
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[4, 5, 7], &[4, 5, 7]),
        (&[4, 5, 7], &[5, 1]),
        (&[1, 5, 7], &[4, 5, 1]),
        (&[7], &[3, 4, 7]),
    ];
    for op in BinaryOp::ALL {
        for (k, (sa, sb)) in shapes.into_iter().enumerate() {
            let (va, vb) = (VIEWS[k % 3], VIEWS[(k + 1) % 3]);
            let a = unit(sa, dtype, va, &mut rng);
            // Divisors away from zero.
            let mut b = match op {
                BinaryOp::Div => float(sb, dtype, vb, (0.5, 2.0), &mut rng),
                _ => unit(sb, dtype, vb, &mut rng),
            };
            // Ties for maximum/minimum: a third of b's values equal to a's (same shapes).
            if sa == sb {
                for i in (0..b.values.len()).step_by(3) {
                    b.values[i] = a.values[i];
                }
            }
            let n = sa.iter().chain(sb.iter()).product::<usize>();
            same(
                &format!("{} {sa:?} {sb:?}", op.name()),
                &[a, b],
                Agree::Bits,
                Agree::Terms(n),
                |t| {
                    one(match op {
                        BinaryOp::Add => t[0].add(&t[1]),
                        BinaryOp::Sub => t[0].sub(&t[1]),
                        BinaryOp::Mul => t[0].mul(&t[1]),
                        BinaryOp::Div => t[0].div(&t[1]),
                        BinaryOp::Maximum => t[0].maximum(&t[1]),
                        BinaryOp::Minimum => t[0].minimum(&t[1]),
                    })
                },
            );
        }
    }
}
every_dtype!(binary, binary_maps);

fn where_and_masked_fill(dtype: DType) {
    let mut rng = Generator::new(3);
    for view in VIEWS {
        let mut cond = unit(&[5, 1], dtype, View::Plain, &mut rng).no_grad();
        cond.values
            .iter_mut()
            .for_each(|v| *v = f64::from(*v > 0.0));
        let a = unit(&[3, 5, 7], dtype, view, &mut rng);
        let b = unit(&[5, 7], dtype, View::Transposed, &mut rng);
        same(
            &format!("where {view:?}"),
            &[cond.clone(), a.clone(), b],
            Agree::Bits,
            Agree::Terms(3),
            |t| one(Tensor::where_cond(&t[0], &t[1], &t[2])),
        );
        same(
            &format!("masked_fill {view:?}"),
            &[a, cond],
            Agree::Bits,
            Agree::Bits,
            |t| one(t[0].masked_fill(&t[1], -0.5)),
        );
    }
}
every_dtype!(where_cond, where_and_masked_fill);

fn casts(dtype: DType) {
    let mut rng = Generator::new(4);
    for to in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        for view in VIEWS {
            // Values that each target dtype must round.
            let x = float(&[4, 9], dtype, view, (-70000.0, 70000.0), &mut rng);
            same(
                &format!("{dtype} -> {to} {view:?}"),
                &[x],
                Agree::Bits,
                Agree::Bits,
                |t| one(t[0].to_dtype(to)),
            );
        }
    }
    // Integers to floats and back (truncation toward zero).
    let ids = ints(vec![0, 3, -7, 2048, 4097, 1 << 20], &[6]);
    same(
        &format!("i64 -> {dtype} -> i64"),
        &[ids],
        Agree::Bits,
        Agree::Bits,
        |t| {
            let f = t[0].to_dtype(dtype)?;
            let back = f.mul_scalar(0.7)?.to_dtype(DType::I64)?;
            Ok(vec![f, back])
        },
    );
}
every_dtype!(cast, casts);

fn dropout(dtype: DType) {
    for (k, view) in VIEWS.into_iter().enumerate() {
        let x = unit(&[6, 11], dtype, view, &mut Generator::new(5 + k as u64));
        for p in [0.1, 0.5, 1.0] {
            same(
                &format!("dropout p={p} {view:?}"),
                std::slice::from_ref(&x),
                Agree::Bits,
                Agree::Bits,
                |t| {
                    let mut rng = Generator::new(77);
                    one(t[0].dropout(p, true, &mut rng))
                },
            );
        }
    }
}
every_dtype!(dropout_mask, dropout);

// ----- reductions -------------------------------------------------------------------------

fn reductions(dtype: DType) {
    let mut rng = Generator::new(6);
    let shape = [4, 6, 5];
    for view in VIEWS {
        let x = unit(&shape, dtype, view, &mut rng);
        let at = |what: &str| format!("{what} {view:?}");
        let sums: [(&str, &[isize], usize); 4] = [
            ("dim 1", &[1], 6),
            ("dims 0, 2", &[0, 2], 20),
            ("last", &[-1], 5),
            ("all", &[0, 1, 2], 120),
        ];
        for (name, dims, n) in sums {
            let keep = dims.len() == 1;
            let tol = Agree::Terms(n);
            same(
                &at(&format!("sum {name}")),
                std::slice::from_ref(&x),
                tol,
                tol,
                |t| one(t[0].sum(dims, keep)),
            );
            same(
                &at(&format!("mean {name}")),
                std::slice::from_ref(&x),
                tol,
                tol,
                |t| one(t[0].mean(dims, keep)),
            );
            same(
                &at(&format!("var {name}")),
                std::slice::from_ref(&x),
                tol,
                tol,
                |t| one(t[0].var(dims, 1, keep)),
            );
            same(
                &at(&format!("var0 {name}")),
                std::slice::from_ref(&x),
                tol,
                tol,
                |t| one(t[0].var(dims, 0, !keep)),
            );
            same(
                &at(&format!("max {name}")),
                std::slice::from_ref(&x),
                Agree::Bits,
                Agree::Bits,
                |t| one(t[0].max(dims, keep)),
            );
            same(
                &at(&format!("min {name}")),
                std::slice::from_ref(&x),
                Agree::Bits,
                Agree::Bits,
                |t| one(t[0].min(dims, keep)),
            );
        }
        same(
            &at("sum_all"),
            std::slice::from_ref(&x),
            Agree::Terms(120),
            Agree::Bits,
            |t| one(t[0].sum_all()),
        );
        same(
            &at("mean_all"),
            std::slice::from_ref(&x),
            Agree::Terms(120),
            Agree::Bits,
            |t| one(t[0].mean_all()),
        );
        for dim in [0, 1, -1] {
            same(
                &at(&format!("max_dim {dim}")),
                std::slice::from_ref(&x),
                Agree::Bits,
                Agree::Bits,
                |t| {
                    let (v, i) = t[0].max_dim(dim, false)?;
                    Ok(vec![v, i])
                },
            );
            same(
                &at(&format!("min_dim {dim}")),
                std::slice::from_ref(&x),
                Agree::Bits,
                Agree::Bits,
                |t| {
                    let (v, i) = t[0].min_dim(dim, true)?;
                    Ok(vec![
                        v,
                        i,
                        t[0].argmax(dim, false)?,
                        t[0].argmin(dim, true)?,
                    ])
                },
            );
        }
    }
    // Ties: the extrema's gradient split evenly, the first index on ties.
    let mut x = unit(&[3, 8], dtype, View::Plain, &mut rng);
    for r in 0..3 {
        x.values[r * 8 + 2] = 1.0;
        x.values[r * 8 + 5] = 1.0;
        x.values[r * 8 + 6] = -1.0;
    }
    same(
        "max ties",
        std::slice::from_ref(&x),
        Agree::Bits,
        Agree::Bits,
        |t| {
            let (v, i) = t[0].max_dim(1, false)?;
            Ok(vec![t[0].max(&[1], false)?, v, i])
        },
    );
    same("min ties", &[x], Agree::Bits, Agree::Bits, |t| {
        one(t[0].min(&[0, 1], false))
    });
}
every_dtype!(reduce, reductions);

fn softmaxes(dtype: DType) {
    let mut rng = Generator::new(7);
    for view in VIEWS {
        let x = float(&[3, 9, 7], dtype, view, (-4.0, 4.0), &mut rng);
        for dim in [-1, 1] {
            let n = if dim == 1 { 9 } else { 7 };
            same(
                &format!("softmax {dim} {view:?}"),
                std::slice::from_ref(&x),
                Agree::Terms(n),
                Agree::Terms(n),
                |t| one(t[0].softmax(dim)),
            );
            same(
                &format!("log_softmax {dim} {view:?}"),
                std::slice::from_ref(&x),
                Agree::Terms(n),
                Agree::Terms(n),
                |t| one(t[0].log_softmax(dim)),
            );
        }
    }
}
every_dtype!(softmax, softmaxes);

// ----- network ops -------------------------------------------------------------------------

fn matmuls(dtype: DType) {
    let mut rng = Generator::new(8);
    // (a, b): plain, batched with a broadcast matrix, batch dims that broadcast both ways.
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[5, 7], &[7, 3]),
        (&[2, 5, 7], &[7, 3]),
        (&[2, 1, 5, 7], &[3, 7, 4]),
        (&[1, 9], &[2, 9, 6]),
    ];
    for (sa, sb) in shapes {
        for (va, vb) in [
            (View::Plain, View::Plain),
            (View::Transposed, View::Narrowed),
            (View::Narrowed, View::Transposed),
        ] {
            let (a, b) = (unit(sa, dtype, va, &mut rng), unit(sb, dtype, vb, &mut rng));
            let n = 2 * sa.iter().chain(sb).max().unwrap();
            same(
                &format!("matmul {sa:?}{va:?} {sb:?}{vb:?}"),
                &[a, b],
                Agree::Terms(n),
                Agree::Terms(n),
                |t| one(t[0].matmul(&t[1])),
            );
        }
    }
    // linear: x [.., in] · wᵀ + bias, the weight a transposed view.
    let x = unit(&[2, 3, 10], dtype, View::Narrowed, &mut rng);
    let w = unit(&[6, 10], dtype, View::Plain, &mut rng);
    let b = unit(&[6], dtype, View::Narrowed, &mut rng);
    same(
        "linear",
        &[x, w, b],
        Agree::Terms(12),
        Agree::Terms(12),
        |t| one(t[0].linear(&t[1], Some(&t[2]))),
    );
}
every_dtype!(matmul, matmuls);

fn convolutions(dtype: DType) {
    let mut rng = Generator::new(9);
    // (input, weight, options, bias)
    let cases: [(&[usize], &[usize], Conv2dOptions, bool); 5] = [
        (&[2, 3, 7, 6], &[4, 3, 3, 3], Conv2dOptions::default(), true),
        (
            &[2, 3, 9, 8],
            &[5, 3, 3, 2],
            Conv2dOptions::default().stride(2).padding(1),
            false,
        ),
        (
            &[1, 4, 7, 7],
            &[6, 2, 3, 3],
            Conv2dOptions::default().groups(2).padding(1),
            true,
        ),
        (
            &[2, 3, 9, 9],
            &[2, 3, 3, 3],
            Conv2dOptions::default().dilation(2),
            true,
        ),
        (
            &[3, 4, 5, 5],
            &[4, 1, 3, 3],
            Conv2dOptions::default().groups(4).stride(2).padding(1),
            false,
        ),
    ];
    for (k, (sx, sw, opts, bias)) in cases.into_iter().enumerate() {
        let x = unit(sx, dtype, VIEWS[k % 3], &mut rng);
        let w = unit(sw, dtype, VIEWS[(k + 1) % 3], &mut rng);
        let mut inputs = vec![x, w];
        if bias {
            inputs.push(unit(&[sw[0]], dtype, View::Plain, &mut rng));
        }
        // The longest sum: a weight gradient's, over the batch and the output pixels.
        let n = sx[0] * sx[2] * sx[3] + sw[1] * sw[2] * sw[3];
        same(
            &format!("conv2d {sx:?} {sw:?} {opts:?}"),
            &inputs,
            Agree::Terms(n),
            Agree::Terms(n),
            |t| one(t[0].conv2d(&t[1], t.get(2), opts)),
        );
    }
}
every_dtype!(conv2d, convolutions);

fn max_pools(dtype: DType) {
    let mut rng = Generator::new(10);
    let windows = [
        ((2, 2), (2, 2), (0, 0)),
        ((3, 3), (2, 2), (1, 1)),
        ((3, 2), (1, 2), (1, 0)),
        ((1, 1), (2, 2), (0, 0)),
    ];
    for (k, (kernel, stride, padding)) in windows.into_iter().enumerate() {
        let x = unit(&[2, 3, 9, 7], dtype, VIEWS[k % 3], &mut rng);
        same(
            &format!("max_pool2d {kernel:?} {stride:?} {padding:?}"),
            &[x],
            Agree::Bits,
            Agree::Terms(9),
            |t| {
                let (y, idx) = t[0].max_pool2d_with_indices(kernel, stride, padding)?;
                Ok(vec![y, idx, t[0].max_pool2d(kernel, stride, padding)?])
            },
        );
    }
}
every_dtype!(max_pool2d, max_pools);

fn avg_pools(dtype: DType) {
    let mut rng = Generator::new(11);
    for (k, include_pad) in [false, true].into_iter().enumerate() {
        let x = unit(&[2, 3, 9, 7], dtype, VIEWS[k], &mut rng);
        same(
            &format!("avg_pool2d include_pad={include_pad}"),
            &[x],
            Agree::Terms(9),
            Agree::Terms(9),
            |t| one(t[0].avg_pool2d((3, 3), (2, 2), (1, 1), include_pad)),
        );
    }
}
every_dtype!(avg_pool2d, avg_pools);

fn adaptive_pools(dtype: DType) {
    let mut rng = Generator::new(12);
    for (k, out) in [(1, 1), (3, 2), (4, 5)].into_iter().enumerate() {
        let x = unit(&[2, 3, 9, 7], dtype, VIEWS[k], &mut rng);
        same(
            &format!("adaptive_avg_pool2d {out:?}"),
            &[x],
            Agree::Terms(63),
            Agree::Terms(63),
            |t| one(t[0].adaptive_avg_pool2d(out)),
        );
    }
}
every_dtype!(adaptive_avg_pool2d, adaptive_pools);

fn batch_norms(dtype: DType) {
    let mut rng = Generator::new(13);
    for (k, shape) in [&[4, 3, 5, 7][..], &[9, 5]].into_iter().enumerate() {
        let c = shape[1];
        let x = unit(shape, dtype, VIEWS[k + 1], &mut rng);
        let w = float(&[c], DType::F32, View::Plain, (0.5, 1.5), &mut rng);
        let b = unit(&[c], DType::F32, View::Narrowed, &mut rng);
        let rm = unit(&[c], DType::F32, View::Plain, &mut rng).no_grad();
        let rv = float(&[c], DType::F32, View::Plain, (0.5, 2.0), &mut rng).no_grad();
        let n = shape.iter().product::<usize>() / c;
        for training in [true, false] {
            same(
                &format!("batch_norm {shape:?} training={training}"),
                &[x.clone(), w.clone(), b.clone(), rm.clone(), rv.clone()],
                Agree::Terms(n),
                Agree::Terms(n),
                |t| {
                    let y = t[0].batch_norm(
                        Some(&t[3]),
                        Some(&t[4]),
                        Some(&t[1]),
                        Some(&t[2]),
                        training,
                        0.1,
                        1e-5,
                    )?;
                    // The running statistics, updated in place in training.
                    Ok(vec![y, t[3].clone(), t[4].clone()])
                },
            );
        }
        same(
            &format!("batch_norm {shape:?} no affine"),
            &[x],
            Agree::Terms(n),
            Agree::Terms(n),
            |t| one(t[0].batch_norm(None, None, None, None, true, 0.1, 1e-5)),
        );
    }
}
every_dtype!(batch_norm, batch_norms);

fn layer_norms(dtype: DType) {
    let mut rng = Generator::new(14);
    for (k, (shape, normalized)) in [(&[3, 5, 12][..], &[12][..]), (&[4, 3, 7], &[3, 7])]
        .into_iter()
        .enumerate()
    {
        let x = float(shape, dtype, VIEWS[k + 1], (-2.0, 2.0), &mut rng);
        let d: usize = normalized.iter().product();
        let w = float(normalized, dtype, View::Plain, (0.5, 1.5), &mut rng);
        let b = unit(normalized, dtype, View::Plain, &mut rng);
        let rows = shape.iter().product::<usize>() / d;
        let n = d.max(rows);
        same(
            &format!("layer_norm {shape:?}"),
            &[x.clone(), w, b],
            Agree::Terms(n),
            Agree::Terms(n),
            |t| one(t[0].layer_norm(normalized, Some(&t[1]), Some(&t[2]), 1e-5)),
        );
        same(
            &format!("layer_norm {shape:?} no affine"),
            &[x],
            Agree::Terms(n),
            Agree::Terms(n),
            |t| one(t[0].layer_norm(normalized, None, None, 1e-5)),
        );
    }
}
every_dtype!(layer_norm, layer_norms);

// ----- indexing -----------------------------------------------------------------------------

fn gathers(dtype: DType) {
    let mut rng = Generator::new(15);
    // Repeated ids: their gradients add up.
    let ids = ints(vec![3, 0, 6, 3, 3, 1, 6], &[7]);
    for view in VIEWS {
        let table = unit(&[7, 5], dtype, view, &mut rng);
        same(
            &format!("embedding {view:?}"),
            &[table.clone(), ids.clone()],
            Agree::Bits,
            Agree::Terms(3),
            |t| one(embedding(&t[0], &t[1])),
        );
        let x = unit(&[3, 7, 5], dtype, view, &mut rng);
        for dim in [0, 1, -1] {
            let ids = ints(vec![2, 0, 2, 1], &[4]);
            same(
                &format!("index_select {dim} {view:?}"),
                &[x.clone(), ids],
                Agree::Bits,
                Agree::Terms(2),
                |t| one(t[0].index_select(dim, &t[1])),
            );
        }
    }
    // Two-dimensional ids (an embedding of a batch of sequences).
    let table = unit(&[9, 4], dtype, View::Transposed, &mut rng);
    let ids = ints(vec![1, 8, 8, 0, 4, 1], &[2, 3]);
    same(
        "embedding [2, 3]",
        &[table, ids],
        Agree::Bits,
        Agree::Terms(2),
        |t| one(embedding(&t[0], &t[1])),
    );
}
every_dtype!(index_select, gathers);

fn concatenations(dtype: DType) {
    let mut rng = Generator::new(16);
    for dim in [0isize, 1, -1] {
        let d = dim.rem_euclid(3) as usize;
        let mut shapes = [[3, 4, 5], [3, 4, 5], [3, 4, 5]];
        shapes[1][d] = 2;
        shapes[2][d] = 6;
        let inputs: Vec<Input> = shapes
            .iter()
            .enumerate()
            .map(|(k, s)| unit(s, dtype, VIEWS[k], &mut rng))
            .collect();
        same(
            &format!("cat {dim}"),
            &inputs,
            Agree::Bits,
            Agree::Bits,
            |t| one(Tensor::cat(&[&t[0], &t[1], &t[2]], dim)),
        );
        same(
            &format!("stack {dim}"),
            &inputs[..1],
            Agree::Bits,
            Agree::Terms(2),
            |t| one(Tensor::stack(&[&t[0], &t[0]], dim)),
        );
    }
}
every_dtype!(cat, concatenations);

// ----- losses ---------------------------------------------------------------------------------

fn mse(dtype: DType) {
    let mut rng = Generator::new(17);
    for (k, reduction) in [Reduction::Mean, Reduction::Sum, Reduction::None]
        .into_iter()
        .enumerate()
    {
        let a = unit(&[5, 7], dtype, VIEWS[k], &mut rng);
        let b = unit(&[5, 7], dtype, VIEWS[(k + 1) % 3], &mut rng);
        same(
            &format!("mse {reduction:?}"),
            &[a, b],
            Agree::Terms(35),
            Agree::Terms(35),
            |t| one(mse_loss(&t[0], &t[1], reduction)),
        );
    }
}
every_dtype!(mse_loss, mse);

fn class_losses(dtype: DType) {
    let mut rng = Generator::new(18);
    let target = ints(vec![3, 0, -100, 6, 2], &[5]);
    for (k, reduction) in [Reduction::Mean, Reduction::Sum, Reduction::None]
        .into_iter()
        .enumerate()
    {
        let logits = float(&[5, 7], dtype, VIEWS[k], (-3.0, 3.0), &mut rng);
        for smoothing in [0.0, 0.1] {
            let opts = CrossEntropyOptions {
                reduction,
                label_smoothing: smoothing,
                ..Default::default()
            };
            same(
                &format!("cross_entropy {reduction:?} ε={smoothing}"),
                &[logits.clone(), target.clone()],
                Agree::Terms(35),
                Agree::Terms(35),
                |t| one(cross_entropy(&t[0], &t[1], opts)),
            );
        }
        same(
            &format!("nll {reduction:?}"),
            &[logits, target.clone()],
            Agree::Terms(35),
            Agree::Terms(35),
            |t| {
                one(nll_loss(
                    &t[0].log_softmax(-1)?,
                    &t[1],
                    reduction,
                    Some(-100),
                ))
            },
        );
    }
    // Class dim in the middle: [N, C, d].
    let logits = unit(&[2, 5, 3], dtype, View::Transposed, &mut rng);
    let target = ints(vec![0, 4, 1, 2, 2, 3], &[2, 3]);
    same(
        "cross_entropy [N, C, d]",
        &[logits, target],
        Agree::Terms(30),
        Agree::Terms(30),
        |t| one(cross_entropy(&t[0], &t[1], CrossEntropyOptions::default())),
    );
}
every_dtype!(class_loss, class_losses);

fn attentions(dtype: DType) {
    let mut rng = Generator::new(19);
    let (q, k, v) = (
        unit(&[2, 3, 5, 8], dtype, View::Plain, &mut rng),
        unit(&[2, 3, 7, 8], dtype, View::Transposed, &mut rng),
        unit(&[2, 3, 7, 6], dtype, View::Narrowed, &mut rng),
    );
    same(
        "attention",
        &[q.clone(), k.clone(), v.clone()],
        Agree::Terms(16),
        Agree::Terms(16),
        |t| one(t[0].scaled_dot_product_attention(&t[1], &t[2], None, 0.0, None, None)),
    );
    let mask = unit(&[5, 7], dtype.compute_type(), View::Plain, &mut rng).no_grad();
    same(
        "attention masked, dropout",
        &[q, k, v, mask],
        Agree::Terms(16),
        Agree::Terms(16),
        |t| {
            let mut rng = Generator::new(5);
            one(t[0].scaled_dot_product_attention(
                &t[1],
                &t[2],
                Some(&t[3]),
                0.25,
                Some(&mut rng),
                Some(0.3),
            ))
        },
    );
}
every_dtype!(attention, attentions);
