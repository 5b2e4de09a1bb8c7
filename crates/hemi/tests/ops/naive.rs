//! The same test bodies on every backend: each op runs forward and backward (autograd, with
//! a random output gradient) on the CPU and on `Device::Naive` (the plain-loops reference
//! backend, `hemi::naive`) from the same random, odd-sized inputs, contiguous and as
//! strided views (transposed, narrowed at an offset), in F64, F32, F16 and BF16, and the
//! two backends' outputs and input gradients are compared.
//!
//! **Tolerance rule** (one for the whole file). For a result of dtype `d` whose elements
//! each sum at most `n` terms (`n = 1` for an elementwise map; the reduction length for
//! sums, products and norms, the longest one of the forward and the backward), with `ε_d`
//! the dtype's epsilon and `ε_c` its compute type's (F32 for F32, F16 and BF16; F64 for
//! F64):
//!
//! ```text
//! |cpu_i - naive_i| <= 4 · (ε_d + n · ε_c) · max_j |cpu_j|
//! ```
//!
//! Both backends round each result once into `d` (an ulp of `d` apart at most when the
//! exact value sits near a rounding boundary: the `ε_d` term) after summing in different
//! orders and precisions (the CPU in F32 lanes and blocks, naive in f64: `n · ε_c`,
//! Higham's bound for a sum of `n` terms); the tensor's largest magnitude is the scale,
//! since a result that cancels to near zero keeps the absolute error of its terms. The
//! factor 4 covers the few roundings of a chain (a norm's statistics, a gradient through
//! two ops). A wrong index, a missing term or a wrong mask errs by O(1) times the scale.
//!
//! Where both backends do the same IEEE operations the results are **bit-identical** and
//! the tests say so: the binary maps, the exact unary maps (neg, abs, relu, clamp, the
//! scalar add and multiply, squaring), copies, casts, gathers, concatenation, max-pool,
//! the extrema and their indices, and dropout (the same counter-based mask).
//!
//! The average and adaptive pools, attention and the class losses run on the naive backend
//! through their default compositions (`backend::compose`), which this suite thus also
//! checks against the CPU's fused kernels through the public ops.

use hemi::Error;

/// The backend the suite compares with the CPU.
const BACKEND: Device = Device::Naive;

/// One `#[test]` per dtype (F64, F32, F16, BF16) from a body `fn(DType)`, with optional
/// attributes on each (`#[ignore = ...]`).
macro_rules! every_dtype {
    ($(#[$m:meta])* $name:ident, $body:ident) => {
        mod $name {
            $(#[$m])*
            #[test]
            fn f64() {
                super::$body(hemi::DType::F64)
            }
            $(#[$m])*
            #[test]
            fn f32() {
                super::$body(hemi::DType::F32)
            }
            $(#[$m])*
            #[test]
            fn f16() {
                super::$body(hemi::DType::F16)
            }
            $(#[$m])*
            #[test]
            fn bf16() {
                super::$body(hemi::DType::BF16)
            }
        }
    };
}

include!("suite.rs");

// ----- devices ----------------------------------------------------------------------------------

/// An op on a CPU and a naive tensor is a device error naming both devices, not a panic.
#[test]
fn mixing_devices_is_an_error() {
    let cpu = Tensor::from_f64_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], DType::F32).unwrap();
    let naive = cpu.to_device(Device::Naive).unwrap();
    assert_eq!(naive.device(), Device::Naive);
    assert_eq!(naive.to_vec_f64(), cpu.to_vec_f64());
    type Op<'a> = (&'a str, Box<dyn Fn() -> Result<Tensor> + 'a>);
    let ops: [Op; 5] = [
        ("add", Box::new(|| cpu.add(&naive))),
        ("matmul", Box::new(|| naive.matmul(&cpu))),
        ("where", Box::new(|| Tensor::where_cond(&cpu, &naive, &cpu))),
        ("cat", Box::new(|| Tensor::cat(&[&cpu, &naive], 0))),
        (
            "conv2d",
            Box::new(|| {
                let w = Tensor::ones(&[1, 1, 1, 1], DType::F32)?;
                naive
                    .reshape(&[1, 1, 2, 2])?
                    .conv2d(&w, None, Conv2dOptions::default())
            }),
        ),
    ];
    for (what, op) in ops {
        match op() {
            Err(e @ Error::Device { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("cpu") && msg.contains("naive"),
                    "{what}: {msg}"
                );
            }
            other => panic!("{what}: expected a device error, got {other:?}"),
        }
    }
}

/// `naive` parses and prints as a device, and tensors go there and back unchanged.
#[test]
fn naive_device_round_trip() {
    assert_eq!("naive".parse::<Device>().unwrap(), Device::Naive);
    assert_eq!(Device::Naive.to_string(), "naive");
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        let mut rng = Generator::new(20);
        let v = rand_values(12, -3.0, 3.0, dtype, &mut rng);
        let t = Tensor::from_f64_vec(v.clone(), &[3, 4], dtype).unwrap();
        let n = t.transpose(0, 1).unwrap().to_device(Device::Naive).unwrap();
        assert_eq!(n.dtype(), dtype);
        let back = n.to_device(Device::Cpu).unwrap();
        assert_eq!(back.device(), Device::Cpu);
        assert_eq!(back.to_vec_f64(), t.transpose(0, 1).unwrap().to_vec_f64());
        // The gradient of to_device moves back.
        let leaf = t.clone().requires_grad_();
        let y = leaf
            .to_device(Device::Naive)
            .unwrap()
            .mul_scalar(2.0)
            .unwrap()
            .sum_all()
            .unwrap();
        y.backward().unwrap();
        let g = leaf.grad().unwrap();
        assert_eq!(g.device(), Device::Cpu);
        assert_eq!(g.to_vec_f64(), vec![2.0; 12]);
    }
    let ids = Tensor::from_vec(vec![5i64, -2, 1 << 40], &[3]).unwrap();
    let n = ids.to_device(Device::Naive).unwrap();
    assert_eq!(n.to_vec::<i64>().unwrap(), vec![5, -2, 1 << 40]);
}
