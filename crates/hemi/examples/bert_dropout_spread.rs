//! How far BERT's dropout moves its outputs: the pretrained encoder (all-MiniLM-L6-v2 from
//! `../shared/models`) in eval mode, then `--draws` forward passes in training mode on the
//! same batch (the first 32 sentences of SST-2's `train.tsv`, max length 64), printing the
//! mean squared deviation of the last hidden states (real tokens only) and of the pooled
//! output from the eval-mode values, as one JSON object.
//!
//! `bench/torch_bert_dropout_spread.py` computes the same for transformers'
//! `BertModel`: if hemi's five dropout sites (embeddings, attention probabilities, the
//! attention and feed-forward outputs) matched PyTorch's in placement and strength, the two
//! figures agree within their sampling error (a fraction of a percent at 50 draws).
//!
//! ```sh
//! cargo run --release -p hemi --example bert_dropout_spread -- --draws 50
//! ```

use std::path::{Path, PathBuf};

use hemi::data::Tokenizer;
use hemi::models::BertModel;
use hemi::nn::Module;
use hemi::{Generator, Result, Tensor};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let draws: usize = match args.iter().position(|a| a == "--draws") {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| hemi::Error::arg("bert_dropout_spread", "--draws needs a count"))?,
        None => 50,
    };
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared");
    let model_dir: PathBuf = shared.join("models/all-MiniLM-L6-v2");
    let tsv_path = shared.join("data/sst2/train.tsv");
    let tsv = std::fs::read_to_string(&tsv_path)
        .map_err(|e| hemi::Error::Msg(format!("{}: {e}", tsv_path.display())))?;
    let sentences: Vec<&str> = tsv
        .lines()
        .skip(1)
        .take(32)
        .map(|l| l.split('\t').next().unwrap_or(""))
        .collect();

    let tok = Tokenizer::from_file(model_dir.join("tokenizer.json"))?;
    let enc = sentences
        .iter()
        .map(|s| tok.encode(s, 64))
        .collect::<Result<Vec<_>>>()?;
    let (b, l) = (
        enc.len(),
        enc.iter().map(|e| e.ids.len()).max().unwrap_or(0),
    );
    let (mut ids, mut mask) = (vec![0i64; b * l], vec![0i64; b * l]);
    for (r, e) in enc.iter().enumerate() {
        for (c, &id) in e.ids.iter().enumerate() {
            ids[r * l + c] = id as i64;
            mask[r * l + c] = 1;
        }
    }
    let ids_t = Tensor::from_vec(ids, &[b, l])?;
    let mask_t = Tensor::from_vec(mask.clone(), &[b, l])?;
    let types = Tensor::zeros(&[b, l], hemi::DType::I64)?;

    let mut model = BertModel::from_pretrained(&model_dir, &mut Generator::new(7))?;
    let _no_grad = hemi::no_grad();
    model.set_training(false);
    let (h0, p0) = model.forward_text(&ids_t, &mask_t, &types)?;
    let h0 = h0.to_vec_f64();
    let p0 = p0
        .ok_or_else(|| hemi::Error::Msg("the checkpoint has no pooler".into()))?
        .to_vec_f64();
    let hidden = h0.len() / (b * l);
    let real = mask.iter().filter(|&&m| m != 0).count();

    model.set_training(true);
    let (mut sq_hidden, mut sq_pooled) = (0.0, 0.0);
    for _ in 0..draws {
        let (h, p) = model.forward_text(&ids_t, &mask_t, &types)?;
        let (h, p) = (h.to_vec_f64(), p.expect("pooler").to_vec_f64());
        for (t, &m) in mask.iter().enumerate() {
            if m != 0 {
                let row = t * hidden..(t + 1) * hidden;
                sq_hidden += h[row.clone()]
                    .iter()
                    .zip(&h0[row])
                    .map(|(x, y)| (x - y) * (x - y))
                    .sum::<f64>();
            }
        }
        sq_pooled += p
            .iter()
            .zip(&p0)
            .map(|(x, y)| (x - y) * (x - y))
            .sum::<f64>();
    }
    println!(
        "{{\"framework\": \"hemi\", \"draws\": {draws}, \"batch\": [{b}, {l}], \
         \"msd_hidden\": {}, \"msd_pooled\": {}}}",
        sq_hidden / (draws * real * hidden) as f64,
        sq_pooled / (draws * p0.len()) as f64
    );
    Ok(())
}
