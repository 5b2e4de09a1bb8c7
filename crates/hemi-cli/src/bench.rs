//! `hemi bench`: kernel throughput, medians of repeated runs after a warm-up, on a rayon
//! pool of `--threads` threads.
//!
//! - `hemi bench matmul [--sizes 256,512,1024]`: GFLOP/s (2·n³ / median seconds) of hemi's
//!   n×n matmul in F32, F16 and BF16, and of the `gemm` crate called directly on f32
//!   buffers (the baseline hemi's F32 path should stay within 10% of, or beat where it runs
//!   on hemi's own GEMM), and the GEMM kernel each hemi product ran on. With `--int8`, a
//!   second table: GOP/s of the INT8 GEMM (`hemi::cpu::qgemm`, u8 × s8 with the F32
//!   dequantising epilogue, weights packed beforehand as a quantised layer holds them) on
//!   each SIMD kernel this CPU runs, timed interleaved with hemi's F32 and BF16 matmul, and
//!   its ratios to them.
//! - `hemi bench convert [--n 16777216]`: Gelem/s of hemi's bulk conversions
//!   (`hemi::dtype::convert`) and of a scalar `half` loop, for F32↔F16 and F32↔BF16.
//!
//! - `hemi bench train [--model cifar-net] [--precision amp-fp16] [--batch-size 128]
//!   [--steps 20] [--image-size 32]`: full training steps (forward, loss, backward,
//!   optimizer step with the preset's loss scaling or master weights) on random 3×S×S
//!   images; images/s from the median step time after two warm-up steps, and the process's
//!   peak resident memory. Run one preset per process so that the peak memory is that
//!   preset's. The allocator also counts the heap (`alloc::count_heap`): the bytes the
//!   forward keeps for the backward and the step's peak above what lives between steps,
//!   the largest over the timed steps. `--checkpoint-activations [SEGMENTS]` turns on the
//!   model's activation checkpointing (`bench/checkpoint_ab.py` compares on and off).
//! - `hemi bench conv [--layers cifar-conv1,cifar-conv2,resnet-3x3,resnet20-16,...] [--batch-size N]`:
//!   median ms and GFLOP/s of `Tensor::conv2d`'s forward, input gradient and weight
//!   gradient per layer, in F32, F16 and BF16.
//! - `hemi bench pool [--batch-size 128]`: median ms and Gelem/s of 2×2 max pooling
//!   (forward and backward) on CifarNet's two pooled activations, in F32, F16 and BF16.
//!
//! - `hemi bench infer [--model bert-classifier] [--batch 1,64] [--quant dynamic]`:
//!   forward-pass latency, float or INT8 (see `bench_infer`).
//!
//! `--json` prints one JSON object per measurement and line instead of a table.

use std::hint::black_box;
use std::time::Instant;

use clap::{Args, Subcommand, ValueEnum};
use half::{bf16, f16};
use hemi::amp::{AmpOptimizer, GradScalerConfig, Precision};
use hemi::autograd::backward_with_retain_graph;
use hemi::cpu::gemm::select;
use hemi::data::{Batch, Inputs, TextInputs};
use hemi::dtype::convert;
use hemi::ops::conv::Conv2dOptions;
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use hemi::{DType, Error, Generator, Result, Tensor};

#[path = "bench_infer.rs"]
mod bench_infer;

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
    /// Threads of the rayon pool the timed work runs on.
    #[arg(long, global = true, default_value_t = 2)]
    threads: usize,
    /// Timed repetitions (after one warm-up); the median is reported.
    #[arg(long, global = true, default_value_t = 10)]
    reps: usize,
    /// One JSON object per line instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
enum Which {
    /// n×n matrix products: hemi F32/F16/BF16 and the gemm crate on f32.
    Matmul {
        /// Matrix sizes n, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [256, 512, 1024])]
        sizes: Vec<usize>,
        /// Also time the INT8 GEMM against hemi's F32 and BF16 matmul.
        #[arg(long)]
        int8: bool,
    },
    /// Bulk F32<->F16/BF16 conversions: hemi's and a scalar `half` loop.
    Convert {
        /// Elements per conversion.
        #[arg(long, default_value_t = 1 << 24)]
        n: usize,
    },
    /// Training steps on random data: images/s (median step) and peak memory.
    Train {
        #[arg(long, default_value = "cifar-net")]
        model: String,
        #[arg(long, default_value = "amp-fp16", value_parser = crate::train::parse_precision)]
        precision: Precision,
        #[arg(long, default_value_t = 128)]
        batch_size: usize,
        /// Timed steps (after two warm-up steps).
        #[arg(long, default_value_t = 20)]
        steps: usize,
        /// Side of the square RGB images (224 for the ImageNet ResNets as torchvision
        /// benchmarks them).
        #[arg(long, default_value_t = 32)]
        image_size: usize,
        /// Text models: a Hugging Face model directory whose config and weights to use.
        #[arg(long)]
        pretrained: Option<std::path::PathBuf>,
        /// Text models: a BERT config.json (fresh weights) instead of --pretrained.
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        /// Text models: tokens per sequence (every sequence has exactly this many).
        #[arg(long, default_value_t = 64)]
        max_length: usize,
        /// Activation checkpointing, as `hemi train --checkpoint-activations` (optionally
        /// which segments: blocks or stages for the ResNets, layers for BERT).
        #[arg(long, value_name = "SEGMENTS", num_args = 0..=1, default_missing_value = "")]
        checkpoint_activations: Option<String>,
        /// Where the steps run: cpu, or gpu / gpu:N (the wgpu backend; a build with
        /// `--features gpu`). The batch is uploaded once; each timed step ends with the
        /// loss read back, so it includes the device's work.
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Convolution layers: forward, input gradient and weight gradient, F32/F16/BF16.
    ///
    /// Timed per pass (stride 1, no bias): `forward` is `x.conv2d(w)` with no graph;
    /// `backward-input` is the conv's backward from a given random dy with only x
    /// requiring grad (so only dx is computed), run through `autograd::backward_with_retain_graph` on a
    /// graph built once outside the timing; `backward-weight` likewise with only w
    /// requiring grad. Half passes include converting their inputs to F32 and rounding the
    /// result, as in training. GFLOP/s = 2·N·C_out·H_out·W_out·C_in·kh·kw per pass.
    Conv {
        /// Layers, comma-separated.
        #[arg(long, value_enum, value_delimiter = ',',
              default_values_t = [ConvLayer::CifarConv1, ConvLayer::CifarConv2, ConvLayer::Resnet3x3])]
        layers: Vec<ConvLayer>,
        /// Overrides each layer's batch size N.
        #[arg(long)]
        batch_size: Option<usize>,
    },
    /// 2×2 max pooling, stride 2: forward and backward on CifarNet's pooled activations
    /// ([N,64,30,30] and [N,128,13,13]), F32/F16/BF16.
    ///
    /// `forward` is `x.max_pool2d` with no graph; `backward` is its backward from a given dy
    /// through `autograd::backward_with_retain_graph` on a graph built once. Gelem/s counts input
    /// elements.
    Pool {
        #[arg(long, default_value_t = 128)]
        batch_size: usize,
    },
    /// Forward-pass latency of a model, float or INT8 (`bench_infer`): median ms, items/s
    /// and peak memory per batch size.
    Infer(bench_infer::InferArgs),
}

/// A convolution layer `hemi bench conv` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ConvLayer {
    /// CifarNet's conv1: [128,3,32,32] * [64,3,3,3].
    CifarConv1,
    /// CifarNet's conv2: [128,64,15,15] * [128,64,3,3].
    CifarConv2,
    /// A ResNet-style 3×3 layer: [32,64,56,56] * [64,64,3,3], padding 1.
    #[value(name = "resnet-3x3")]
    Resnet3x3,
    /// ResNet-20's first stage: [128,16,32,32] * [16,16,3,3], padding 1.
    #[value(name = "resnet20-16")]
    Resnet20C16,
    /// ResNet-20's second stage: [128,32,16,16] * [32,32,3,3], padding 1.
    #[value(name = "resnet20-32")]
    Resnet20C32,
    /// ResNet-20's third stage: [128,64,8,8] * [64,64,3,3], padding 1.
    #[value(name = "resnet20-64")]
    Resnet20C64,
    /// ResNet-50's pointwise reduction (layer1): [32,256,56,56] * [64,256,1,1].
    #[value(name = "resnet50-1x1")]
    Resnet50Pointwise,
}

impl ConvLayer {
    /// Input shape, weight shape and padding (stride 1).
    fn spec(self) -> ([usize; 4], [usize; 4], usize) {
        match self {
            ConvLayer::CifarConv1 => ([128, 3, 32, 32], [64, 3, 3, 3], 0),
            ConvLayer::CifarConv2 => ([128, 64, 15, 15], [128, 64, 3, 3], 0),
            ConvLayer::Resnet3x3 => ([32, 64, 56, 56], [64, 64, 3, 3], 1),
            ConvLayer::Resnet20C16 => ([128, 16, 32, 32], [16, 16, 3, 3], 1),
            ConvLayer::Resnet20C32 => ([128, 32, 16, 16], [32, 32, 3, 3], 1),
            ConvLayer::Resnet20C64 => ([128, 64, 8, 8], [64, 64, 3, 3], 1),
            ConvLayer::Resnet50Pointwise => ([32, 256, 56, 56], [64, 256, 1, 1], 0),
        }
    }

    fn name(self) -> &'static str {
        match self {
            ConvLayer::CifarConv1 => "cifar-conv1",
            ConvLayer::CifarConv2 => "cifar-conv2",
            ConvLayer::Resnet3x3 => "resnet-3x3",
            ConvLayer::Resnet20C16 => "resnet20-16",
            ConvLayer::Resnet20C32 => "resnet20-32",
            ConvLayer::Resnet20C64 => "resnet20-64",
            ConvLayer::Resnet50Pointwise => "resnet50-1x1",
        }
    }
}

/// The largest batch a benchmark takes (CifarNet activations at 2^16 images are ~40 GiB).
const MAX_BATCH: usize = 1 << 16;

/// Checks that a benchmark needing `bytes` (None: the size overflowed) fits in the memory
/// this machine has available, so that a mistyped size is an error, not a crash.
fn fits(what: &str, bytes: Option<usize>) -> Result<()> {
    let avail = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s
                .lines()
                .find(|l| l.starts_with("MemAvailable:"))?
                .to_owned();
            line.split_whitespace().nth(1)?.parse::<usize>().ok()
        })
        .map(|kb| kb.saturating_mul(1024));
    match (bytes, avail) {
        (None, _) => Err(Error::arg(
            "bench",
            format!("{what}: the size overflows (more than 2^64 bytes)"),
        )),
        (Some(b), Some(a)) if b > a => Err(Error::arg(
            "bench",
            format!(
                "{what}: needs about {:.1} GiB, {:.1} GiB available",
                b as f64 / (1u64 << 30) as f64,
                a as f64 / (1u64 << 30) as f64
            ),
        )),
        _ => Ok(()),
    }
}

fn check_batch(b: usize) -> Result<()> {
    if b == 0 || b > MAX_BATCH {
        return Err(Error::arg(
            "bench",
            format!("--batch-size {b} is out of range (1..={MAX_BATCH})"),
        ));
    }
    Ok(())
}

/// The CPU configuration a benchmark ran under, and the CPU's instruction sets, for its
/// JSON record (`hemi::cpu::features`).
pub(crate) fn cpu_record() -> serde_json::Value {
    use hemi::cpu::features as f;
    let c = f::current();
    serde_json::json!({
        "level": c.level.name(),
        "amx": c.amx,
        "bf16_route": c.bf16_route.map_or("auto", |r| r.name()),
        "detected": f::detected_names(),
    })
}

pub fn run(mut args: BenchArgs) -> Result<()> {
    if args.threads == 0 || args.reps == 0 {
        return Err(Error::arg(
            "bench",
            "--threads and --reps must be at least 1",
        ));
    }
    args.threads = crate::cap_threads(args.threads)?;
    match &args.which {
        Which::Matmul { sizes, .. } => {
            for &n in sizes {
                // a, b, the product and the baseline's copies: about 40 bytes per element.
                fits(
                    &format!("--sizes {n}"),
                    n.checked_mul(n).and_then(|e| e.checked_mul(40)),
                )?;
            }
        }
        Which::Convert { n } => fits(&format!("--n {n}"), n.checked_mul(16))?,
        Which::Train {
            batch_size,
            image_size,
            max_length,
            ..
        } => {
            check_batch(*batch_size)?;
            if *max_length == 0 {
                return Err(Error::arg("bench", "--max-length must be at least 1"));
            }
            if *image_size == 0 {
                return Err(Error::arg("bench", "--image-size must be at least 1"));
            }
            // The input alone, in F32; the activations are many times more.
            fits(
                &format!("--batch-size {batch_size} --image-size {image_size}"),
                batch_size
                    .checked_mul(*image_size)
                    .and_then(|n| n.checked_mul(*image_size))
                    .and_then(|n| n.checked_mul(12)),
            )?
        }
        Which::Pool { batch_size } => check_batch(*batch_size)?,
        Which::Infer(_) => {}
        Which::Conv { batch_size, .. } => {
            if let Some(b) = batch_size {
                check_batch(*b)?
            }
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()
        .map_err(|e| Error::Msg(format!("bench: cannot build a thread pool: {e}")))?;
    match &args.which {
        Which::Matmul { sizes, int8 } => {
            bench_matmul(&args, &pool, sizes)?;
            if *int8 {
                bench_int8(&args, &pool, sizes)?;
            }
            Ok(())
        }
        Which::Convert { n } => bench_convert(&args, &pool, *n),
        Which::Train {
            model,
            precision,
            batch_size,
            steps,
            image_size,
            pretrained,
            config,
            max_length,
            checkpoint_activations,
            device,
        } => {
            let spec = hemi::models::registry::find(model)?;
            let device: hemi::Device = device.parse()?;
            let ckpt = checkpoint_activations.as_deref();
            if spec.input == hemi::models::registry::InputKind::Text {
                let text = TextBench {
                    pretrained: pretrained.as_deref(),
                    config: config.as_deref(),
                    max_length: *max_length,
                };
                pool.install(|| {
                    bench_train_text(
                        &args,
                        &spec,
                        &text,
                        *precision,
                        (*batch_size, *steps, device),
                        ckpt,
                    )
                })
            } else {
                let shape = Shape {
                    batch: *batch_size,
                    steps: *steps,
                    size: *image_size,
                    device,
                };
                pool.install(|| bench_train(&args, &spec, *precision, shape, ckpt))
            }
        }
        Which::Conv { layers, batch_size } => bench_conv(&args, &pool, layers, *batch_size),
        Which::Pool { batch_size } => bench_pool(&args, &pool, *batch_size),
        Which::Infer(a) => bench_infer::run(&args, &pool, a),
    }
}

/// The dtypes the kernel benchmarks compare.
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// One timed forward under `no_grad`.
fn forward_job<'a>(f: impl Fn() -> Result<Tensor> + Send + 'a) -> Job<'a> {
    Box::new(move || {
        let _g = hemi::no_grad();
        black_box(f()?);
        Ok(())
    })
}

/// One timed backward of the graph ending in `y` from the output gradient `dy`, into the
/// leaf `x` (its gradient is dropped after each run, so no run adds to an earlier one).
fn backward_job<'a>(y: &'a Tensor, dy: &'a Tensor, x: &'a Tensor) -> Job<'a> {
    Box::new(move || {
        backward_with_retain_graph(y, dy.clone())?;
        black_box(x.grad());
        x.zero_grad();
        Ok(())
    })
}

/// The tensors of one dtype's conv passes: the operands, an output gradient, and two
/// graphs built once whose backward computes only dx (`y_dx`) or only dw (`y_dw`).
struct ConvCase {
    x: Tensor,
    w: Tensor,
    dy: Tensor,
    x_leaf: Tensor,
    w_leaf: Tensor,
    y_dx: Tensor,
    y_dw: Tensor,
}

const CONV_PASSES: [&str; 3] = ["forward", "backward-input", "backward-weight"];

fn bench_conv(
    args: &BenchArgs,
    pool: &rayon::ThreadPool,
    layers: &[ConvLayer],
    batch: Option<usize>,
) -> Result<()> {
    if batch == Some(0) {
        return Err(Error::arg("bench conv", "--batch-size must be at least 1"));
    }
    let mut rng = Generator::new(0xc0);
    if !args.json {
        println!(
            "conv2d, stride 1, no bias: median ms of {} reps and GFLOP/s \
             (2·N·C_out·H_out·W_out·C_in·kh·kw per pass), {} threads",
            args.reps, args.threads
        );
        println!(
            "{:<12} {:<34} {:<16} {:>17} {:>17} {:>17}",
            "layer",
            "input * weight",
            "pass",
            "f32 ms  GFLOP/s",
            "f16 ms  GFLOP/s",
            "bf16 ms  GFLOP/s"
        );
    }
    for &layer in layers {
        let (mut xs, ws, pad) = layer.spec();
        if let Some(n) = batch {
            xs[0] = n;
        }
        let opts = Conv2dOptions::default().padding(pad);
        let x32 = Tensor::randn(&xs, 0.0, 1.0, DType::F32, &mut rng)?;
        // Weights on the scale of a trained layer's (PyTorch's default init bound).
        let bound = 1.0 / ((ws[1] * ws[2] * ws[3]) as f64).sqrt();
        let w32 = Tensor::rand(&ws, -bound, bound, DType::F32, &mut rng)?;
        let ys = {
            let _g = hemi::no_grad();
            pool.install(|| x32.conv2d(&w32, None, opts))?
                .shape()
                .to_vec()
        };
        let dy32 = Tensor::randn(&ys, 0.0, 1.0, DType::F32, &mut rng)?;
        let flop = 2.0 * (ys.iter().product::<usize>() * ws[1] * ws[2] * ws[3]) as f64;
        let cases = DTYPES
            .iter()
            .map(|&dt| {
                let (x, w, dy) = (x32.to_dtype(dt)?, w32.to_dtype(dt)?, dy32.to_dtype(dt)?);
                let (x_leaf, w_leaf) = (x.detach().requires_grad_(), w.detach().requires_grad_());
                let (y_dx, y_dw) = pool.install(|| -> Result<_> {
                    Ok((
                        x_leaf.conv2d(&w, None, opts)?,
                        x.conv2d(&w_leaf, None, opts)?,
                    ))
                })?;
                Ok(ConvCase {
                    x,
                    w,
                    dy,
                    x_leaf,
                    w_leaf,
                    y_dx,
                    y_dw,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // Jobs in the order dtype-major, pass-minor, all interleaved.
        let mut jobs: Vec<Job<'_>> = Vec::new();
        for c in &cases {
            jobs.push(forward_job(move || c.x.conv2d(&c.w, None, opts)));
            jobs.push(backward_job(&c.y_dx, &c.dy, &c.x_leaf));
            jobs.push(backward_job(&c.y_dw, &c.dy, &c.w_leaf));
        }
        let secs = pool.install(|| interleaved_medians(args.reps, &mut jobs))?;
        drop(jobs);
        let at = |d: usize, p: usize| secs[d * CONV_PASSES.len() + p];
        let gflops = |s: f64| flop / s / 1e9;
        for (p, pass) in CONV_PASSES.iter().enumerate() {
            if args.json {
                for (d, dt) in DTYPES.iter().enumerate() {
                    let s = at(d, p);
                    let j = serde_json::json!({
                        "bench": "conv", "layer": layer.name(), "input": xs, "weight": ws,
                        "padding": pad, "output": ys, "pass": pass, "dtype": dt.to_string(),
                        "threads": args.threads, "cpu": cpu_record(), "reps": args.reps, "flop": flop,
                        "median_s": s, "median_ms": s * 1e3, "gflops": gflops(s),
                    });
                    println!("{j}");
                }
            } else {
                let shapes = format!("{}*{} pad {pad}", dims(&xs), dims(&ws));
                let cells: Vec<String> = (0..DTYPES.len())
                    .map(|d| format!("{:>8.2} {:>8.1}", at(d, p) * 1e3, gflops(at(d, p))))
                    .collect();
                println!(
                    "{:<12} {shapes:<34} {pass:<16} {:>17} {:>17} {:>17}",
                    layer.name(),
                    cells[0],
                    cells[1],
                    cells[2]
                );
            }
        }
    }
    Ok(())
}

/// A shape as `128x64x15x15`.
fn dims(shape: &[usize]) -> String {
    let d: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    d.join("x")
}

fn bench_pool(args: &BenchArgs, pool: &rayon::ThreadPool, batch: usize) -> Result<()> {
    if batch == 0 {
        return Err(Error::arg("bench pool", "--batch-size must be at least 1"));
    }
    let mut rng = Generator::new(0x9001);
    if !args.json {
        println!(
            "max_pool2d 2×2 stride 2: median ms of {} reps and Gelem/s (input elements), \
             {} threads",
            args.reps, args.threads
        );
        println!(
            "{:<18} {:<9} {:>17} {:>17} {:>17}",
            "input", "pass", "f32 ms  Gelem/s", "f16 ms  Gelem/s", "bf16 ms  Gelem/s"
        );
    }
    for shape in [[batch, 64, 30, 30], [batch, 128, 13, 13]] {
        let x32 = Tensor::randn(&shape, 0.0, 1.0, DType::F32, &mut rng)?;
        // Per dtype: the input, a leaf copy, its pooled graph and an output gradient.
        let cases = DTYPES
            .iter()
            .map(|&dt| {
                let x = x32.to_dtype(dt)?;
                let leaf = x.detach().requires_grad_();
                let y = pool.install(|| leaf.max_pool2d((2, 2), (2, 2), (0, 0)))?;
                let dy = Tensor::randn(y.shape(), 0.0, 1.0, dt, &mut rng)?;
                Ok((x, leaf, y, dy))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut jobs: Vec<Job<'_>> = Vec::new();
        for (x, leaf, y, dy) in &cases {
            jobs.push(forward_job(move || x.max_pool2d((2, 2), (2, 2), (0, 0))));
            jobs.push(backward_job(y, dy, leaf));
        }
        let secs = pool.install(|| interleaved_medians(args.reps, &mut jobs))?;
        drop(jobs);
        let elems = shape.iter().product::<usize>() as f64;
        for (p, pass) in ["forward", "backward"].iter().enumerate() {
            let at = |d: usize| secs[d * 2 + p];
            if args.json {
                for (d, dt) in DTYPES.iter().enumerate() {
                    let j = serde_json::json!({
                        "bench": "pool", "op": "max_pool2d", "input": shape, "kernel": [2, 2],
                        "stride": [2, 2], "pass": pass, "dtype": dt.to_string(),
                        "threads": args.threads, "cpu": cpu_record(), "reps": args.reps, "median_s": at(d),
                        "median_ms": at(d) * 1e3, "gelems": elems / at(d) / 1e9,
                    });
                    println!("{j}");
                }
            } else {
                let cells: Vec<String> = (0..DTYPES.len())
                    .map(|d| format!("{:>8.2} {:>8.2}", at(d) * 1e3, elems / at(d) / 1e9))
                    .collect();
                println!(
                    "{:<18} {pass:<9} {:>17} {:>17} {:>17}",
                    dims(&shape),
                    cells[0],
                    cells[1],
                    cells[2]
                );
            }
        }
    }
    Ok(())
}

/// The batch, timed steps and image side of `bench train` on images.
struct Shape {
    batch: usize,
    steps: usize,
    size: usize,
    device: hemi::Device,
}

/// Turns on `--checkpoint-activations` (`asked`) for `model` and starts counting the heap;
/// the segments' name, if any.
fn bench_checkpointing(
    spec: &hemi::models::registry::ModelSpec,
    model: &mut dyn hemi::nn::Module,
    asked: Option<&str>,
) -> Result<Option<&'static str>> {
    crate::alloc::count_heap();
    let Some(asked) = asked else {
        return Ok(None);
    };
    let g = crate::train::checkpoint_segments(spec, model, asked)?;
    model.set_activation_checkpointing(Some(g))?;
    Ok(Some(g))
}

/// The heap a training step holds above what lives between steps, per timed step: what the
/// forward leaves for the backward (the activations, the loss) and the step's peak.
#[derive(Default)]
struct StepHeap {
    base: isize,
    kept: Vec<f64>,
    peak: Vec<f64>,
}

impl StepHeap {
    fn start(&mut self) {
        self.base = crate::alloc::heap_live();
        crate::alloc::reset_heap_peak();
    }
    fn after_forward(&mut self, timed: bool) {
        if timed {
            self.kept
                .push((crate::alloc::heap_live() - self.base) as f64 / MIB);
        }
    }
    fn end(&mut self, timed: bool) {
        let peak = crate::alloc::reset_heap_peak();
        if timed {
            self.peak.push((peak - self.base) as f64 / MIB);
        }
    }
    /// (kept, peak): the largest over the timed steps, MiB.
    fn max(&self) -> (f64, f64) {
        let m = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        (m(&self.kept), m(&self.peak))
    }
}

const MIB: f64 = (1 << 20) as f64;

/// ` on gpu:0 (adapter)` for a run off the CPU, for the table line.
fn on_device(device: hemi::Device) -> String {
    match (device, adapter_record(device)) {
        (hemi::Device::Cpu, _) => String::new(),
        (d, serde_json::Value::Object(a)) => {
            format!(" on {d} ({})", a["name"].as_str().unwrap_or("?"))
        }
        (d, _) => format!(" on {d}"),
    }
}

/// The GPU a `--device gpu:N` run used (name, driver, whether it has native F16) and its
/// allocator's peak, MiB; null on the CPU.
#[cfg(feature = "gpu")]
fn adapter_record(device: hemi::Device) -> serde_json::Value {
    let hemi::Device::Gpu(n) = device else {
        return serde_json::Value::Null;
    };
    match hemi::gpu::context(n) {
        Ok(ctx) => {
            let info = ctx.info();
            let mem = ctx.memory_stats();
            serde_json::json!({
                "name": info.name, "driver": info.driver, "shader_f16": info.shader_f16,
                "peak_allocated_mib": mem.peak_allocated as f64 / MIB,
                "peak_reserved_mib": mem.peak_reserved as f64 / MIB,
            })
        }
        Err(_) => serde_json::Value::Null,
    }
}

#[cfg(not(feature = "gpu"))]
fn adapter_record(_device: hemi::Device) -> serde_json::Value {
    serde_json::Value::Null
}

/// Median images/s of full training steps of `model` under `precision` on random data.
fn bench_train(
    args: &BenchArgs,
    spec: &hemi::models::registry::ModelSpec,
    precision: Precision,
    shape: Shape,
    checkpoint: Option<&str>,
) -> Result<()> {
    const WARMUP: usize = 2;
    let Shape {
        batch,
        steps,
        size,
        device,
    } = shape;
    let model_name = spec.name;
    if batch == 0 || steps == 0 {
        return Err(Error::arg(
            "bench train",
            "--batch-size and --steps must be at least 1",
        ));
    }
    let mut rng = Generator::new(0);
    let mut model = crate::train::build_model(model_name, [3, size, size], 10, 0)?;
    let ckpt = bench_checkpointing(spec, model.as_mut(), checkpoint)?;
    model.to_device(device)?;
    precision.prepare_model(model.as_mut())?;
    let mut opt = AmpOptimizer::new(
        precision,
        model.parameters(),
        GradScalerConfig::default(),
        0,
        |p| {
            Ok(Box::new(Sgd::new(
                p,
                SgdConfig {
                    lr: 1e-3,
                    momentum: 0.9,
                    ..Default::default()
                },
            )?) as Box<dyn Optimizer>)
        },
    )?;
    let images = Tensor::randn(&[batch, 3, size, size], 0.0, 1.0, DType::F32, &mut rng)?
        .to_device(device)?;
    let labels = Tensor::randint(&[batch], 10, &mut rng)?.to_device(device)?;
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = f64::NAN;
    let mut heap = StepHeap::default();
    for i in 0..WARMUP + steps {
        let t0 = Instant::now();
        opt.zero_grad();
        heap.start();
        let loss = {
            let _ac = precision.autocast();
            let logits = model.forward(&precision.input(&images)?)?;
            cross_entropy(&logits, &labels, CrossEntropyOptions::default())?
        };
        heap.after_forward(i >= WARMUP);
        let trace = std::env::var_os("HEMI_MEM_TRACE").is_some();
        if trace {
            eprintln!(
                "after forward: rss {:?} peak {:?}",
                rss_now(),
                crate::train::peak_rss_mib()
            );
        }
        opt.backward(&loss)?;
        if trace {
            eprintln!(
                "after backward: rss {:?} peak {:?}",
                rss_now(),
                crate::train::peak_rss_mib()
            );
        }
        opt.step()?;
        last_loss = loss.to_scalar()?;
        drop(loss);
        heap.end(i >= WARMUP);
        if i >= WARMUP {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let med = median(times);
    let ips = batch as f64 / med;
    let rss = crate::train::peak_rss_mib();
    let (kept, step_peak) = heap.max();
    if args.json {
        let j = serde_json::json!({
            "bench": "train", "model": model_name, "precision": precision.name(),
            "batch_size": batch, "image_size": size, "steps": steps, "threads": args.threads, "cpu": cpu_record(),
            "device": device.to_string(), "adapter": adapter_record(device),
            "checkpoint_activations": ckpt,
            "images_per_s": ips, "median_step_ms": med * 1e3,
            "peak_rss_mib": rss, "kept_heap_mib": kept, "step_heap_mib": step_peak,
            "loss": last_loss, "loss_scale": opt.scale(),
            "skipped": opt.skipped_steps(),
        });
        println!("{j}");
    } else {
        println!(
            "train {model_name} {precision} batch {batch} ({size}x{size}){}{}, {} threads: {ips:.0} \
             images/s (median step {:.1} ms over {steps}), peak RSS {}, step heap {step_peak:.0} MiB \
             ({kept:.0} MiB kept for the backward)",
            ckpt.map_or(String::new(), |g| format!(", checkpointed {g}")),
            on_device(device),
            args.threads,
            med * 1e3,
            rss.map_or("unknown".into(), |m| format!("{m:.0} MiB"))
        );
    }
    Ok(())
}

/// A text model for the benches: its config from `config` or `pretrained/config.json`, the
/// pretrained weights when given; `classes` labels (default 2; masked-LM: the vocabulary).
pub(crate) fn text_model(
    what: &'static str,
    spec: &hemi::models::registry::ModelSpec,
    config: Option<&std::path::Path>,
    pretrained: Option<&std::path::Path>,
    classes: Option<usize>,
    seed: u64,
) -> Result<(Box<dyn hemi::nn::Module>, hemi::models::BertConfig)> {
    let config = match (config, pretrained) {
        (Some(c), _) => c.to_path_buf(),
        (None, Some(d)) => d.join("config.json"),
        (None, None) => {
            return Err(Error::arg(
                what,
                format!("{} needs --pretrained DIR or --config FILE", spec.name),
            ))
        }
    };
    let cfg = hemi::models::BertConfig::from_file(&config)?;
    let classes = if spec.task == "masked-lm" {
        cfg.vocab_size
    } else {
        classes.unwrap_or(2)
    };
    let mut model = spec.build_text(&config, classes, seed)?;
    if let Some(d) = pretrained {
        hemi::models::load_pretrained(model.as_mut(), &d.join("model.safetensors"))?;
    }
    Ok((model, cfg))
}

/// Where `bench train` takes a text model from.
struct TextBench<'a> {
    pretrained: Option<&'a std::path::Path>,
    config: Option<&'a std::path::Path>,
    max_length: usize,
}

/// Median sentences/s of full training steps of a text model (forward, the task's loss,
/// backward, AdamW step under the preset) on random token ids, every sequence exactly
/// `max_length` tokens with a full attention mask; masked-LM targets at 15 % of positions.
fn bench_train_text(
    args: &BenchArgs,
    spec: &hemi::models::registry::ModelSpec,
    text: &TextBench<'_>,
    precision: Precision,
    (batch, steps, device): (usize, usize, hemi::Device),
    checkpoint: Option<&str>,
) -> Result<()> {
    const WARMUP: usize = 2;
    if batch == 0 || steps == 0 {
        return Err(Error::arg(
            "bench train",
            "--batch-size and --steps must be at least 1",
        ));
    }
    let mlm = spec.task == "masked-lm";
    let (mut model, cfg) = text_model("bench train", spec, text.config, text.pretrained, None, 0)?;
    let ckpt = bench_checkpointing(spec, model.as_mut(), checkpoint)?;
    let l = text.max_length;
    if l > cfg.max_position_embeddings {
        return Err(Error::arg(
            "bench train",
            format!(
                "--max-length {l} exceeds the model's max_position_embeddings {}",
                cfg.max_position_embeddings
            ),
        ));
    }
    model.to_device(device)?;
    precision.prepare_model(model.as_mut())?;
    let task = hemi::train::find_task(spec.task)?;
    let mut opt = AmpOptimizer::new(
        precision,
        model.parameters(),
        GradScalerConfig::default(),
        0,
        |p| {
            Ok(Box::new(AdamW::new(
                p,
                AdamWConfig {
                    lr: 5e-5,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?) as Box<dyn Optimizer>)
        },
    )?;
    let mut rng = Generator::new(0);
    // Ids above the special tokens of a BERT vocabulary.
    let low = 1000.min(cfg.vocab_size / 2) as u64;
    let span = cfg.vocab_size as u64 - low;
    let ids: Vec<i64> = (0..batch * l)
        .map(|_| (low + rng.next_u64() % span) as i64)
        .collect();
    let labels = if mlm {
        let v: Vec<i64> = ids
            .iter()
            .map(|&id| if rng.next_u64() % 100 < 15 { id } else { -100 })
            .collect();
        Tensor::from_vec(v, &[batch, l])?
    } else {
        Tensor::randint(&[batch], 2, &mut rng)?
    };
    let b = Batch {
        inputs: Inputs::Text(TextInputs {
            input_ids: Tensor::from_vec(ids, &[batch, l])?,
            attention_mask: Tensor::from_vec(vec![1i64; batch * l], &[batch, l])?,
            token_type_ids: Tensor::from_vec(vec![0i64; batch * l], &[batch, l])?,
        }),
        labels,
        indices: (0..batch).collect(),
    }
    .to_device(device)?;
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = f64::NAN;
    let mut heap = StepHeap::default();
    for i in 0..WARMUP + steps {
        let t0 = Instant::now();
        opt.zero_grad();
        heap.start();
        let loss = {
            let _ac = precision.autocast();
            task.forward(model.as_ref(), &b, precision, 0.0, false)?
                .loss
        };
        heap.after_forward(i >= WARMUP);
        opt.backward(&loss)?;
        opt.step()?;
        last_loss = loss.to_scalar()?;
        drop(loss);
        heap.end(i >= WARMUP);
        if i >= WARMUP {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let med = median(times);
    let sps = batch as f64 / med;
    let rss = crate::train::peak_rss_mib();
    let (kept, step_peak) = heap.max();
    if args.json {
        let j = serde_json::json!({
            "bench": "train", "model": spec.name, "precision": precision.name(),
            "batch_size": batch, "max_length": l, "steps": steps, "threads": args.threads, "cpu": cpu_record(),
            "device": device.to_string(), "adapter": adapter_record(device),
            "checkpoint_activations": ckpt,
            "sentences_per_s": sps, "median_step_ms": med * 1e3,
            "peak_rss_mib": rss, "kept_heap_mib": kept, "step_heap_mib": step_peak,
            "loss": last_loss, "loss_scale": opt.scale(),
            "skipped": opt.skipped_steps(),
        });
        println!("{j}");
    } else {
        println!(
            "train {} {precision} batch {batch} x length {l}{}{}, {} threads: {sps:.1} sentences/s \
             (median step {:.1} ms over {steps}), peak RSS {}, step heap {step_peak:.0} MiB \
             ({kept:.0} MiB kept for the backward)",
            spec.name,
            ckpt.map_or(String::new(), |g| format!(", checkpointed {g}")),
            on_device(device),
            args.threads,
            med * 1e3,
            rss.map_or("unknown".into(), |m| format!("{m:.0} MiB"))
        );
    }
    Ok(())
}

/// A timed candidate: one run of the work (its result is passed to `black_box`).
type Job<'a> = Box<dyn FnMut() -> Result<()> + Send + 'a>;

/// Median wall time of each job over `reps` rounds, after one untimed warm-up run each.
/// Each round runs every job once, in turn, so that a burst of load from other processes
/// on a shared machine slows all candidates alike instead of one of them.
fn interleaved_medians(reps: usize, jobs: &mut [Job<'_>]) -> Result<Vec<f64>> {
    for job in jobs.iter_mut() {
        job()?;
    }
    let mut times = vec![Vec::with_capacity(reps); jobs.len()];
    for _ in 0..reps {
        for (job, t) in jobs.iter_mut().zip(&mut times) {
            let start = Instant::now();
            job()?;
            t.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(times.into_iter().map(median).collect())
}

/// One timed hemi matmul.
fn product_job<'a>(a: &'a Tensor, b: &'a Tensor) -> Job<'a> {
    Box::new(move || {
        black_box(a.matmul(b)?);
        Ok(())
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        0.5 * (v[mid - 1] + v[mid])
    }
}

/// `gemm` on row-major f32 buffers: `dst = a · b`, n×n, with the pool's threads.
#[rustfmt::skip]
fn gemm_f32(dst: &mut [f32], a: &[f32], b: &[f32], n: usize, threads: usize) {
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    assert!(dst.len() >= n * n && a.len() >= n * n && b.len() >= n * n);
    // SAFETY: all three buffers hold n*n elements, row-major (row stride n, column stride 1),
    // which is all gemm reads and writes.
    unsafe {
        gemm::gemm::<f32>(
            n, n, n,
            dst.as_mut_ptr(), 1, n as isize, false,
            a.as_ptr(), 1, n as isize,
            b.as_ptr(), 1, n as isize,
            0.0, 1.0, false, false, false, par,
        );
    }
}

fn bench_matmul(args: &BenchArgs, pool: &rayon::ThreadPool, sizes: &[usize]) -> Result<()> {
    let mut rng = Generator::new(0xbe);
    if !args.json {
        println!(
            "matmul n×n: GFLOP/s = 2n³ / median of {} reps, {} threads",
            args.reps, args.threads
        );
        println!(
            "{:>6} {:>10} {:>10} {:>10} {:>10} {:>12}  kernels f32/f16/bf16",
            "n", "hemi f32", "hemi f16", "hemi bf16", "gemm f32", "f32 / gemm"
        );
    }
    for &n in sizes {
        let a = Tensor::rand(&[n, n], -1.0, 1.0, DType::F32, &mut rng)?;
        let b = Tensor::rand(&[n, n], -1.0, 1.0, DType::F32, &mut rng)?;
        let flop = 2.0 * (n as f64).powi(3);
        let (a16, b16) = (a.to_dtype(DType::F16)?, b.to_dtype(DType::F16)?);
        let (ab16, bb16) = (a.to_dtype(DType::BF16)?, b.to_dtype(DType::BF16)?);
        // The baseline runs on plain f32 buffers.
        let (av, bv) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
        let mut dst = vec![0f32; n * n];
        let names = [
            ("hemi", "float32"),
            ("hemi", "float16"),
            ("hemi", "bfloat16"),
            ("gemm", "float32"),
        ];
        let secs = {
            let mut jobs: Vec<Job<'_>> = vec![
                product_job(&a, &b),
                product_job(&a16, &b16),
                product_job(&ab16, &bb16),
                Box::new(|| {
                    gemm_f32(&mut dst, &av, &bv, n, args.threads);
                    black_box(&dst);
                    Ok(())
                }),
            ];
            pool.install(|| interleaved_medians(args.reps, &mut jobs))?
        };
        let gflops: Vec<_> = names
            .iter()
            .zip(&secs)
            .map(|(&(i, d), &s)| (i, d, s))
            .collect();
        // hemi's F32 product must be the same product as the baseline's.
        let ours = pool.install(|| a.matmul(&b))?.to_vec::<f32>()?;
        let worst = ours
            .iter()
            .zip(&dst)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        if worst > 1e-3 * n as f32 {
            return Err(Error::Msg(format!(
                "bench matmul: hemi and gemm differ by {worst} at n = {n}"
            )));
        }

        let rate = |secs: f64| flop / secs / 1e9;
        // The kernel each hemi product ran on: F32 goes to the gemm crate unless hemi's GEMM
        // has the better kernel for it (`f32_kernel`).
        let kernels = [
            select::f32_kernel(n, n, n).map_or("gemm", |k| k.name()),
            select::kernel_name(DType::F16, DType::F16),
            select::kernel_name(DType::BF16, DType::BF16),
            "gemm",
        ];
        if args.json {
            for ((imp, dt, secs), kernel) in gflops.iter().zip(kernels) {
                println!(
                    "{{\"bench\":\"matmul\",\"impl\":\"{imp}\",\"dtype\":\"{dt}\",\"n\":{n},\
                     \"kernel\":\"{kernel}\",\"threads\":{},\"cpu\":{},\"reps\":{},\"median_s\":{secs:.6e},\
                     \"gflops\":{:.3}}}",
                    args.threads,
                    cpu_record(),
                    args.reps,
                    rate(*secs)
                );
            }
        } else {
            let r: Vec<f64> = gflops.iter().map(|g| rate(g.2)).collect();
            println!(
                "{n:>6} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>11.0}%  {}/{}/{}",
                r[0],
                r[1],
                r[2],
                r[3],
                100.0 * r[0] / r[3],
                kernels[0],
                kernels[1],
                kernels[2]
            );
        }
    }
    Ok(())
}

/// INT8 GEMM (`C = A · Wᵀ`, A u8, W s8, F32 epilogue) on each SIMD kernel of this CPU, with
/// hemi's F32 and BF16 matmul timed in the same rounds, so that the ratios compare runs under
/// the same load. GOP/s counts a multiply-add as two operations, as GFLOP/s does.
fn bench_int8(args: &BenchArgs, pool: &rayon::ThreadPool, sizes: &[usize]) -> Result<()> {
    use hemi::cpu::qgemm::epilogue::{dequant_one, Act, Epilogue};
    use hemi::cpu::qgemm::pack::PackedB;
    use hemi::cpu::qgemm::qgemm;
    use hemi::cpu::qgemm::select::QKernel;
    let kernels: Vec<QKernel> = QKernel::ALL
        .into_iter()
        .filter(|k| k.is_available() && !k.is_portable())
        .collect();
    if kernels.is_empty() {
        return Err(Error::Msg(
            "bench matmul --int8: this CPU runs no SIMD INT8 kernel".into(),
        ));
    }
    let mut rng = Generator::new(0x18);
    if !args.json {
        println!(
            "int8 GEMM n×n (u8 × s8, F32 epilogue): GOP/s = 2n³ / median of {} reps, {} threads",
            args.reps, args.threads
        );
        println!(
            "{:>6} {:>10} {:>10}  {:<12} {:>10} {:>10} {:>10}",
            "n", "hemi f32", "hemi bf16", "int8 kernel", "int8", "int8/f32", "int8/bf16"
        );
    }
    for &n in sizes {
        let a = Tensor::rand(&[n, n], -1.0, 1.0, DType::F32, &mut rng)?;
        let b = Tensor::rand(&[n, n], -1.0, 1.0, DType::F32, &mut rng)?;
        let (ab16, bb16) = (a.to_dtype(DType::BF16)?, b.to_dtype(DType::BF16)?);
        // Quantised operands: any bytes do, the time does not depend on the values.
        let qa: Vec<u8> = a
            .to_vec::<f32>()?
            .iter()
            .map(|&x| (x * 127.0 + 128.0) as u8)
            .collect();
        let qw: Vec<i8> = b
            .to_vec::<f32>()?
            .iter()
            .map(|&x| (x * 127.0) as i8)
            .collect();
        let packed = kernels
            .iter()
            .map(|&k| PackedB::with_kernel(&qw, n, n, k))
            .collect::<Result<Vec<_>>>()?;
        let (a_scale, a_zero, w_scale) = (vec![1e-2f32; n], vec![128i32; n], vec![1e-2f32; n]);
        let mut outs = vec![vec![0f32; n * n]; kernels.len()];
        let secs = {
            let mut jobs: Vec<Job<'_>> = vec![product_job(&a, &b), product_job(&ab16, &bb16)];
            for (p, out) in packed.iter().zip(outs.iter_mut()) {
                let (qa, a_scale, a_zero, w_scale) = (&qa, &a_scale, &a_zero, &w_scale);
                jobs.push(Box::new(move || {
                    let epi = Epilogue::F32 {
                        a_scale,
                        a_zero,
                        w_scale,
                        bias: None,
                        act: Act::None,
                        out: &mut out[..],
                    };
                    qgemm(qa, n, n, p, epi)?;
                    black_box(&out);
                    Ok(())
                }));
            }
            pool.install(|| interleaved_medians(args.reps, &mut jobs))?
        };
        // Every kernel must have computed the same product (they agree to the bit), and
        // that product must be A · Wᵀ: a few elements recomputed here.
        for (kernel, out) in kernels.iter().zip(&outs) {
            let bad = (0..n * n).step_by((n * n / 97).max(1)).find(|&e| {
                let (i, j) = (e / n, e % n);
                let acc: i64 = (0..n)
                    .map(|x| qa[i * n + x] as i64 * qw[j * n + x] as i64)
                    .sum();
                let col: i32 = qw[j * n..(j + 1) * n].iter().map(|&w| w as i32).sum();
                let want = dequant_one(acc as i32, 128, col, 1e-2, 1e-2, 0.0, false);
                out[e].to_bits() != want.to_bits() || out[e].to_bits() != outs[0][e].to_bits()
            });
            if let Some(e) = bad {
                return Err(Error::Msg(format!(
                    "bench matmul --int8: {} is wrong at element {e} for n = {n}",
                    kernel.name()
                )));
            }
        }
        let rate = |secs: f64| 2.0 * (n as f64).powi(3) / secs / 1e9;
        let (f32_rate, bf16_rate) = (rate(secs[0]), rate(secs[1]));
        for (i, (kernel, &s)) in kernels.iter().zip(&secs[2..]).enumerate() {
            let r = rate(s);
            if args.json {
                println!(
                    "{{\"bench\":\"matmul-int8\",\"n\":{n},\"kernel\":\"{}\",\"threads\":{},\"cpu\":{},\
                     \"reps\":{},\"median_s\":{s:.6e},\"gops\":{r:.3},\"f32_gflops\":{f32_rate:.3},\
                     \"bf16_gflops\":{bf16_rate:.3},\"vs_f32\":{:.3},\"vs_bf16\":{:.3}}}",
                    kernel.name(),
                    args.threads,
                    cpu_record(),
                    args.reps,
                    r / f32_rate,
                    r / bf16_rate
                );
            } else if i == 0 {
                println!(
                    "{n:>6} {f32_rate:>10.1} {bf16_rate:>10.1}  {:<12} {r:>10.1} {:>9.2}× {:>9.2}×",
                    kernel.name(),
                    r / f32_rate,
                    r / bf16_rate
                );
            } else {
                println!(
                    "{:>6} {:>10} {:>10}  {:<12} {r:>10.1} {:>9.2}× {:>9.2}×",
                    "",
                    "",
                    "",
                    kernel.name(),
                    r / f32_rate,
                    r / bf16_rate
                );
            }
        }
    }
    Ok(())
}

fn bench_convert(args: &BenchArgs, pool: &rayon::ThreadPool, n: usize) -> Result<()> {
    let mut rng = Generator::new(0xc0);
    let src: Vec<f32> = (0..n).map(|_| rng.uniform(-4.0, 4.0) as f32).collect();
    let src_h: Vec<f16> = src.iter().map(|&x| f16::from_f32(x)).collect();
    let src_b: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();

    /// hemi's bulk conversion and the scalar `half` loop, interleaved round by round, each
    /// into its own destination buffer.
    fn pair<S: Sync, D: Copy + Send>(
        args: &BenchArgs,
        pool: &rayon::ThreadPool,
        src: &[S],
        zero: D,
        bulk: impl Fn(&[S], &mut [D]) + Sync,
        // Generic (not a fn pointer) so that the loop inlines and vectorises as it would
        // in user code.
        scalar: impl Fn(&S) -> D + Sync,
    ) -> Result<(f64, f64)> {
        let (mut d1, mut d2) = (vec![zero; src.len()], vec![zero; src.len()]);
        let mut jobs: Vec<Job<'_>> = vec![
            Box::new(|| {
                bulk(src, &mut d1);
                black_box(&d1);
                Ok(())
            }),
            Box::new(|| {
                for (d, s) in d2.iter_mut().zip(src) {
                    *d = scalar(s);
                }
                black_box(&d2);
                Ok(())
            }),
        ];
        let t = pool.install(|| interleaved_medians(args.reps, &mut jobs))?;
        Ok((t[0], t[1]))
    }
    // Each row: (conversion, hemi seconds, scalar `half` loop seconds).
    let mut rows = Vec::new();
    let (h, s) = pair(args, pool, &src, f16::ZERO, convert::f32_to_f16, |x| {
        f16::from_f32(*x)
    })?;
    rows.push(("f32->f16", h, s));
    let (h, s) = pair(args, pool, &src_h, 0f32, convert::f16_to_f32, |x| {
        x.to_f32()
    })?;
    rows.push(("f16->f32", h, s));
    let (h, s) = pair(args, pool, &src, bf16::ZERO, convert::f32_to_bf16, |x| {
        bf16::from_f32(*x)
    })?;
    rows.push(("f32->bf16", h, s));
    let (h, s) = pair(args, pool, &src_b, 0f32, convert::bf16_to_f32, |x| {
        x.to_f32()
    })?;
    rows.push(("bf16->f32", h, s));

    let rate = |secs: f64| n as f64 / secs / 1e9;
    if args.json {
        for (name, hemi_s, scalar_s) in rows {
            for (imp, secs) in [("hemi", hemi_s), ("half-scalar", scalar_s)] {
                println!(
                    "{{\"bench\":\"convert\",\"impl\":\"{imp}\",\"conversion\":\"{name}\",\"n\":{n},\
                     \"threads\":{},\"cpu\":{},\"reps\":{},\"median_s\":{secs:.6e},\"gelems\":{:.3}}}",
                    args.threads,
                    cpu_record(),
                    args.reps,
                    rate(secs)
                );
            }
        }
    } else {
        println!(
            "convert {n} elements: Gelem/s = n / median of {} reps, {} threads",
            args.reps, args.threads
        );
        println!(
            "{:>10} {:>10} {:>12} {:>9}",
            "", "hemi", "half scalar", "speed-up"
        );
        for (name, hemi_s, scalar_s) in rows {
            println!(
                "{name:>10} {:>10.2} {:>12.2} {:>8.1}x",
                rate(hemi_s),
                rate(scalar_s),
                scalar_s / hemi_s
            );
        }
    }
    Ok(())
}

fn rss_now() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
