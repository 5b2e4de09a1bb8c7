//! Times the non-GEMM ops of one BERT-MiniLM layer at batch 64 × 128 tokens (hidden 384,
//! 12 heads, FFN 1536), F32, no grad: residual add, LayerNorm, GELU, fused attention and the
//! heads' permute-copy. Medians of 7 after one warm-up. `bench/torch_bert_ops.py` times the
//! same ops in PyTorch. A quick figure, not a benchmark harness.
//!
//! cargo run --release -p hemi --example bert_ops_timing [-- attn]   (attn: attention only, 30×)

use hemi::{DType, Generator, Result, Tensor};
use std::time::Instant;

fn time<F: FnMut() -> Result<Tensor>>(label: &str, n: usize, mut f: F) -> Result<()> {
    let _ = f()?;
    let mut v = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        drop(f()?);
        v.push(t.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(f64::total_cmp);
    println!("{label:>28}: {:8.2} ms", v[n / 2]);
    Ok(())
}

fn main() -> Result<()> {
    let _g = hemi::autograd::no_grad();
    let (b, l, h, heads) = (64usize, 128usize, 384usize, 12usize);
    let d = h / heads;
    let mut rng = Generator::new(0);
    let x = Tensor::randn(&[b, l, h], 0.0, 1.0, DType::F32, &mut rng)?;
    let y = Tensor::randn(&[b, l, h], 0.0, 1.0, DType::F32, &mut rng)?;
    let f = Tensor::randn(&[b, l, 4 * h], 0.0, 1.0, DType::F32, &mut rng)?;
    let w = Tensor::ones(&[h], DType::F32)?;
    let bias = Tensor::zeros(&[h], DType::F32)?;
    let mask = Tensor::zeros(&[b, 1, 1, l], DType::F32)?;
    let split = |t: &Tensor| t.reshape(&[b, l, heads, d])?.permute(&[0, 2, 1, 3]);
    let attention = || {
        split(&x)?.scaled_dot_product_attention(
            &split(&y)?,
            &split(&x)?,
            Some(&mask),
            0.0,
            None,
            None,
        )
    };
    let n = 7;
    if std::env::args().nth(1).as_deref() == Some("attn") {
        for _ in 0..30 {
            time("attention", n, attention)?;
        }
        return Ok(());
    }
    time("add [64,128,384]", n, || x.add(&y))?;
    time("layer_norm", n, || {
        x.layer_norm(&[h], Some(&w), Some(&bias), 1e-12)
    })?;
    time("gelu [64,128,1536]", n, || f.gelu())?;
    time("attention", n, attention)?;
    let ctx = split(&x)?.contiguous()?;
    time("permute+reshape copy", n, || {
        ctx.permute(&[0, 2, 1, 3])?.reshape(&[b, l, h])
    })?;
    Ok(())
}
