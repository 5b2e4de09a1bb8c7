//! `hemi bench infer`: forward-pass latency of a registered model, float or INT8.
//!
//! `hemi bench infer [--model bert-classifier] [--pretrained DIR] [--batch 1,64]
//! [--seq-len 128] [--quant none|dynamic|static]`: the model in eval mode, F32, under
//! `no_grad`, on random token ids (a fixed seed; or `--ids FILE`) or random images. Per
//! batch size: `--warmup` untimed forwards, then `--reps` timed ones; the median ms per
//! forward, items/s at that median, and the process's peak RSS (reset before each batch
//! size where Linux allows it, `/proc/self/clear_refs`; otherwise the peak so far).
//!
//! `--quant dynamic` is `hemi::quant::quantize_dynamic` (every `Linear` INT8, activations
//! quantised per row at run time); `--quant static` calibrates with 4 random batches
//! through `prepare_static` (min-max observers), then `convert_static` (image models). The
//! INT8 GEMM kernel (`QKernel::best()`) is printed.
//!
//! `--outputs` adds the first forward's output (flattened, F32) to each JSON line, so that
//! a driver can compare models (`bench/quant_side_by_side.py`). `--breakdown` times every
//! `Linear`/`Conv2d` (through a forward hook wrapped around the layer's own) and prints the
//! share of a forward each group of layers takes; the rest is the other ops (attention,
//! layer norm, GELU, embeddings).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::{Args, ValueEnum};
use hemi::cpu::qgemm::select::QKernel;
use hemi::data::{Inputs, TextInputs};
use hemi::models::registry::{InputKind, ModelSpec};
use hemi::nn::{ForwardHook, LayerRef, Module};
use hemi::quant::ObserverKind;
use hemi::{DType, Error, Generator, Result, Tensor};

use super::{check_batch, fits, median, BenchArgs};

/// Calibration batches of `--quant static`.
const CALIB_BATCHES: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuantArg {
    /// The float model.
    None,
    /// `quantize_dynamic`: Linear weights INT8, activations quantised per row at run time.
    Dynamic,
    /// Static INT8 (image models): 4 random calibration batches, min-max observers.
    Static,
}

impl QuantArg {
    fn name(self) -> &'static str {
        match self {
            QuantArg::None => "none",
            QuantArg::Dynamic => "dynamic",
            QuantArg::Static => "static",
        }
    }
}

#[derive(Args)]
pub struct InferArgs {
    /// A registered model (`hemi models`).
    #[arg(long, default_value = "bert-classifier")]
    model: String,
    /// Text models: a Hugging Face model directory (config.json, model.safetensors).
    #[arg(long)]
    pretrained: Option<PathBuf>,
    /// Text models: a BERT config.json (fresh weights) instead of --pretrained.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Batch sizes, comma-separated; each is timed in turn.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 64])]
    batch: Vec<usize>,
    /// Text models: tokens per sequence (all real tokens, full attention mask).
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Image models: side of the square images (default: the model's designed input).
    #[arg(long)]
    image_size: Option<usize>,
    /// Output classes (default 2 for text classifiers, 10 for image models).
    #[arg(long)]
    classes: Option<usize>,
    /// INT8 quantisation of the model before timing.
    #[arg(long, value_enum, default_value = "none")]
    quant: QuantArg,
    /// Untimed forwards before the timed ones, per batch size.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Seed of the random inputs (and of fresh weights).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Text models: token ids from this file (whitespace-separated integers, row-major
    /// [B, seq-len] for the largest B; batch b takes the first b rows) instead of random.
    #[arg(long)]
    ids: Option<PathBuf>,
    /// Add the first forward's output (flattened F32) and its shape to the JSON lines.
    #[arg(long)]
    outputs: bool,
    /// Time each Linear/Conv2d layer too and print where a forward's time goes.
    #[arg(long)]
    breakdown: bool,
}

/// A forward hook that times the layer's forward (its previous hook, or the float one).
struct TimingHook {
    inner: Option<Arc<dyn ForwardHook>>,
    nanos: AtomicU64,
    calls: AtomicU64,
}

impl ForwardHook for TimingHook {
    fn forward(&self, layer: LayerRef<'_>, x: &Tensor, relu: bool) -> Result<Tensor> {
        let t0 = Instant::now();
        let y = match (&self.inner, layer) {
            (Some(h), layer) => h.forward(layer, x, relu)?,
            (None, LayerRef::Linear(l)) => {
                let y = x.linear(&l.weight, l.bias.as_ref())?;
                if relu {
                    y.relu()?
                } else {
                    y
                }
            }
            (None, LayerRef::Conv2d(c)) => {
                let y = x.conv2d(&c.weight, c.bias.as_ref(), c.opts)?;
                if relu {
                    y.relu()?
                } else {
                    y
                }
            }
        };
        self.nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(y)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Wraps every layer's hook in a [`TimingHook`]; returns (group, hook) per layer, the group
/// being the layer's name without its block index (`encoder.layer.3.attention.self.query`
/// → `attention.self.query`).
fn wrap_timing(model: &mut dyn Module) -> Vec<(String, Arc<TimingHook>)> {
    let mut out = Vec::new();
    for (name, mut layer) in model.layers_mut() {
        let inner = layer.hook_mut().take();
        let hook = Arc::new(TimingHook {
            inner,
            nanos: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        });
        *layer.hook_mut() = Some(hook.clone() as Arc<dyn ForwardHook>);
        out.push((layer_group(&name), hook));
    }
    out
}

fn layer_group(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.iter().position(|p| p.parse::<usize>().is_ok()) {
        Some(i) if i + 1 < parts.len() => parts[i + 1..].join("."),
        _ => name.strip_prefix("bert.").unwrap_or(name).to_string(),
    }
}

/// The model, its input kind and a description of one item's shape.
struct Built {
    model: Box<dyn Module>,
    kind: InputKind,
    /// Text: (vocabulary size); images: [C, H, W].
    vocab: usize,
    image: [usize; 3],
    max_positions: usize,
}

fn build(args: &InferArgs, spec: &ModelSpec) -> Result<Built> {
    match spec.input {
        InputKind::Text => {
            let (model, cfg) = super::text_model(
                "bench infer",
                spec,
                args.config.as_deref(),
                args.pretrained.as_deref(),
                args.classes,
                args.seed,
            )?;
            Ok(Built {
                model,
                kind: InputKind::Text,
                vocab: cfg.vocab_size,
                image: [0; 3],
                max_positions: cfg.max_position_embeddings,
            })
        }
        InputKind::Image => {
            let [c, h, w] = spec.input_shape;
            let shape = match args.image_size {
                Some(s) => [c, s, s],
                None => [c, h, w],
            };
            let model =
                crate::train::build_model(spec.name, shape, args.classes.unwrap_or(10), args.seed)?;
            Ok(Built {
                model,
                kind: InputKind::Image,
                vocab: 0,
                image: shape,
                max_positions: 0,
            })
        }
    }
}

/// Token ids read from `path`: whitespace-separated integers.
fn read_ids(path: &Path) -> Result<Vec<i64>> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    s.split_whitespace()
        .map(|t| {
            t.parse::<i64>().map_err(|_| Error::Data {
                path: path.display().to_string(),
                msg: format!("{t:?} is not an integer token id"),
            })
        })
        .collect()
}

/// The inputs of one batch of `b` items.
fn make_inputs(
    built: &Built,
    b: usize,
    l: usize,
    ids: Option<&[i64]>,
    rng: &mut Generator,
) -> Result<Inputs> {
    match built.kind {
        InputKind::Text => {
            let ids: Vec<i64> = match ids {
                Some(all) => {
                    if all.len() < b * l {
                        return Err(Error::arg(
                            "bench infer",
                            format!(
                                "--ids holds {} ids; batch {b} x seq-len {l} needs {}",
                                all.len(),
                                b * l
                            ),
                        ));
                    }
                    if let Some(bad) = all[..b * l]
                        .iter()
                        .find(|&&t| t < 0 || t as usize >= built.vocab)
                    {
                        return Err(Error::arg(
                            "bench infer",
                            format!(
                                "--ids: id {bad} is outside the vocabulary ({})",
                                built.vocab
                            ),
                        ));
                    }
                    all[..b * l].to_vec()
                }
                None => {
                    // Ids above the special tokens of a BERT vocabulary, as `bench train`.
                    let low = 1000.min(built.vocab / 2) as u64;
                    let span = built.vocab as u64 - low;
                    (0..b * l)
                        .map(|_| (low + rng.next_u64() % span) as i64)
                        .collect()
                }
            };
            Ok(Inputs::Text(TextInputs {
                input_ids: Tensor::from_vec(ids, &[b, l])?,
                attention_mask: Tensor::from_vec(vec![1i64; b * l], &[b, l])?,
                token_type_ids: Tensor::from_vec(vec![0i64; b * l], &[b, l])?,
            }))
        }
        InputKind::Image => {
            let [c, h, w] = built.image;
            Ok(Inputs::Images(Tensor::randn(
                &[b, c, h, w],
                0.0,
                1.0,
                DType::F32,
                rng,
            )?))
        }
    }
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS; false where not allowed.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

pub fn run(args: &BenchArgs, pool: &rayon::ThreadPool, a: &InferArgs) -> Result<()> {
    if a.batch.is_empty() {
        return Err(Error::arg("bench infer", "--batch needs at least one size"));
    }
    for &b in &a.batch {
        check_batch(b)?;
    }
    let spec = hemi::models::registry::find(&a.model)?;
    let max_b = a.batch.iter().copied().max().unwrap_or(1);
    match spec.input {
        InputKind::Text => {
            if a.seq_len == 0 {
                return Err(Error::arg("bench infer", "--seq-len must be at least 1"));
            }
            if a.quant == QuantArg::Static {
                return Err(Error::arg(
                    "bench infer",
                    "--quant static is implemented for image models; use --quant dynamic",
                ));
            }
        }
        InputKind::Image => {
            if a.image_size == Some(0) {
                return Err(Error::arg("bench infer", "--image-size must be at least 1"));
            }
            let [c, h, w] = spec.input_shape;
            let side = a.image_size.map_or(h * w, |s| s * s);
            fits(
                &format!("--batch {max_b}"),
                max_b
                    .checked_mul(c)
                    .and_then(|n| n.checked_mul(side))
                    .and_then(|n| n.checked_mul(4)),
            )?;
        }
    }
    if a.ids.is_some() && spec.input != InputKind::Text {
        return Err(Error::arg("bench infer", "--ids is for text models"));
    }
    pool.install(|| infer(args, a, &spec, max_b))
}

fn infer(args: &BenchArgs, a: &InferArgs, spec: &ModelSpec, max_b: usize) -> Result<()> {
    let t0 = Instant::now();
    let mut built = build(a, spec)?;
    let l = a.seq_len;
    if built.kind == InputKind::Text && l > built.max_positions {
        return Err(Error::arg(
            "bench infer",
            format!(
                "--seq-len {l} exceeds the model's max_position_embeddings {}",
                built.max_positions
            ),
        ));
    }
    let ids = a.ids.as_deref().map(read_ids).transpose()?;
    let mut rng = Generator::new(a.seed);
    built.model.set_training(false);
    let _g = hemi::no_grad();
    let layers = match a.quant {
        QuantArg::None => Vec::new(),
        QuantArg::Dynamic => hemi::quant::quantize_dynamic(built.model.as_mut())?,
        QuantArg::Static => {
            hemi::quant::prepare_static(built.model.as_mut(), ObserverKind::MinMax)?;
            let cb = max_b.min(64);
            for _ in 0..CALIB_BATCHES {
                let x = make_inputs(&built, cb, l, None, &mut rng)?;
                built.model.forward_inputs(&x)?;
            }
            hemi::quant::convert_static(built.model.as_mut())?
        }
    };
    if a.quant != QuantArg::None && layers.is_empty() {
        return Err(Error::arg(
            "bench infer",
            format!("{} has no layers to quantise", spec.name),
        ));
    }
    let setup_s = t0.elapsed().as_secs_f64();
    let timing = if a.breakdown {
        wrap_timing(built.model.as_mut())
    } else {
        Vec::new()
    };
    let kernel = QKernel::best().name();
    let item = match built.kind {
        InputKind::Text => format!("seq-len {l}"),
        InputKind::Image => {
            let [c, h, w] = built.image;
            format!("{c}x{h}x{w}")
        }
    };
    if !args.json {
        println!(
            "infer {} ({item}), quant {}{}, F32, {} threads, INT8 kernel {kernel}; \
             median of {} forwards after {} warm-up; setup {setup_s:.1} s",
            spec.name,
            a.quant.name(),
            if layers.is_empty() {
                String::new()
            } else {
                format!(" ({} layers)", layers.len())
            },
            args.threads,
            args.reps,
            a.warmup
        );
        println!(
            "{:>6} {:>10} {:>10} {:>10} {:>12}",
            "batch", "median ms", "min ms", "items/s", "peak RSS MiB"
        );
    }
    for &b in &a.batch {
        let x = make_inputs(&built, b, l, ids.as_deref(), &mut rng)?;
        let rss_reset = reset_peak_rss();
        let first = built.model.forward_inputs(&x)?;
        for _ in 1..a.warmup {
            black_box(built.model.forward_inputs(&x)?);
        }
        for (_, h) in &timing {
            h.nanos.store(0, Ordering::Relaxed);
            h.calls.store(0, Ordering::Relaxed);
        }
        let mut times = Vec::with_capacity(args.reps);
        for _ in 0..args.reps {
            let t = Instant::now();
            black_box(built.model.forward_inputs(&x)?);
            times.push(t.elapsed().as_secs_f64());
        }
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        let min = times.iter().copied().fold(f64::INFINITY, f64::min);
        let med = median(times);
        let ips = b as f64 / med;
        let rss = crate::train::peak_rss_mib();
        // (group, ms per forward) in the order the layers first appear.
        let mut groups: Vec<(String, f64)> = Vec::new();
        for (g, h) in &timing {
            let ms = h.nanos.load(Ordering::Relaxed) as f64 / 1e6 / args.reps as f64;
            match groups.iter_mut().find(|(n, _)| n == g) {
                Some((_, t)) => *t += ms,
                None => groups.push((g.clone(), ms)),
            }
        }
        let layers_ms: f64 = groups.iter().map(|(_, t)| t).sum();
        if args.json {
            let mut j = serde_json::json!({
                "bench": "infer", "model": spec.name, "quant": a.quant.name(),
                "int8_kernel": kernel, "quantized_layers": layers.len(), "batch": b,
                "threads": args.threads, "cpu": super::cpu_record(), "reps": args.reps, "warmup": a.warmup,
                "median_ms": med * 1e3, "min_ms": min * 1e3, "mean_ms": mean * 1e3,
                "items_per_s": ips, "peak_rss_mib": rss, "peak_rss_reset": rss_reset,
                "setup_s": setup_s,
            });
            match built.kind {
                InputKind::Text => j["seq_len"] = l.into(),
                InputKind::Image => j["image"] = built.image.to_vec().into(),
            }
            if a.outputs {
                j["output_shape"] = first.shape().to_vec().into();
                j["output"] = first.to_vec_f32().into();
            }
            if a.breakdown {
                let map: BTreeMap<String, f64> = groups.iter().cloned().collect();
                j["breakdown_ms"] = serde_json::json!(map);
                j["other_ms"] = (mean * 1e3 - layers_ms).into();
            }
            println!("{j}");
        } else {
            println!(
                "{b:>6} {:>10.2} {:>10.2} {ips:>10.1} {:>12}",
                med * 1e3,
                min * 1e3,
                rss.map_or("unknown".into(), |m| format!(
                    "{m:.0}{}",
                    if rss_reset { "" } else { " (process)" }
                ))
            );
            if a.breakdown {
                println!("         per forward (mean {:.2} ms):", mean * 1e3);
                for (g, ms) in &groups {
                    println!(
                        "         {g:<32} {ms:>9.2} ms {:>5.1}%",
                        100.0 * ms / (mean * 1e3)
                    );
                }
                let other = mean * 1e3 - layers_ms;
                println!(
                    "         {:<32} {other:>9.2} ms {:>5.1}%",
                    "other ops (not Linear/Conv2d)",
                    100.0 * other / (mean * 1e3)
                );
            }
        }
        drop(first);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::layer_group;

    #[test]
    fn groups_drop_the_block_index() {
        assert_eq!(
            layer_group("bert.encoder.layer.3.attention.self.query"),
            "attention.self.query"
        );
        assert_eq!(layer_group("bert.pooler.dense"), "pooler.dense");
        assert_eq!(layer_group("classifier"), "classifier");
        assert_eq!(layer_group("fc1"), "fc1");
    }
}
