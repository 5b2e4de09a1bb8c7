//! Activation checkpointing (`autograd::checkpoint`, `nn::checkpoint`, the ResNets' and
//! BERT's segments): the same gradients bit for bit as without it (dropout on, training
//! mode, F32 and autocast), batch-norm statistics updated once, the generators left where
//! the plain run leaves them, a closure segment, and the segment's forward really run again.
//! The memory it saves is measured in `tests/act_memory.rs` (a binary of its own: it counts
//! the process's allocations).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hemi::amp::autocast;
use hemi::autograd::{checkpoint_fn, no_grad};
use hemi::models::{
    BertConfig, BertForMaskedLM, BertForSequenceClassification, BlockKind, CifarShortcut, ResNet,
    ResNetCheckpoint,
};
use hemi::nn::{Module, Replicate};
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::{DType, Generator, Tensor};

/// Every value's bits (F64 holds every dtype's values exactly).
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().iter().map(|v| v.to_bits()).collect()
}

/// The model's state (parameters and buffers) and every parameter's gradient, by name.
fn snapshot(m: &dyn Module) -> Vec<(String, Vec<u64>)> {
    let mut v: Vec<(String, Vec<u64>)> = m
        .state_dict()
        .iter()
        .map(|(n, t)| (n.clone(), bits(t)))
        .collect();
    for (n, p) in m.named_parameters() {
        let g = p.grad().unwrap_or_else(|| panic!("{n} has no gradient"));
        v.push((format!("{n}.grad"), bits(&g)));
    }
    v
}

fn assert_same(what: &str, a: &[(String, Vec<u64>)], b: &[(String, Vec<u64>)]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        assert!(va == vb, "{what}: {na} differs with checkpointing");
    }
}

/// Loss bits, then the state and gradients, after `steps` forward + backward passes (no
/// optimizer: the gradients accumulate, so a second pass also checks that the first left
/// the generators and statistics where the plain run leaves them).
fn run(
    model: &dyn Module,
    steps: usize,
    dtype: Option<DType>,
    x: &dyn Fn() -> Tensor,
) -> Vec<(String, Vec<u64>)> {
    let labels = Tensor::from_vec(vec![1i64, 0, 2, 1], &[4]).unwrap();
    let mut out = Vec::new();
    for s in 0..steps {
        let loss = {
            let _ac = dtype.map(autocast);
            let logits = model.forward(&x()).unwrap();
            cross_entropy(&logits, &labels, CrossEntropyOptions::default()).unwrap()
        };
        out.push((format!("loss {s}"), bits(&loss)));
        loss.backward().unwrap();
    }
    out.extend(snapshot(model));
    out
}

fn images(seed: u64, size: usize) -> Tensor {
    Tensor::randn(
        &[4, 3, size, size],
        0.0,
        1.0,
        DType::F32,
        &mut Generator::new(seed),
    )
    .unwrap()
}

/// A ResNet with every kind of block: `n` blocks per stage of `kind`, projection shortcuts.
fn resnet(kind: BlockKind, seed: u64) -> ResNet {
    let mut rng = Generator::new(seed);
    match kind {
        BlockKind::Basic => ResNet::cifar(2, 5, CifarShortcut::B, false, &mut rng).unwrap(),
        BlockKind::Bottleneck => ResNet::imagenet(kind, [1, 1, 1, 1], 5, false, &mut rng).unwrap(),
    }
}

fn resnet_case(kind: BlockKind, size: usize, dtype: Option<DType>) {
    let x = || images(7, size);
    let plain = resnet(kind, 3);
    let want = run(&plain, 2, dtype, &x);
    for g in [ResNetCheckpoint::Blocks, ResNetCheckpoint::Stages] {
        let mut m = resnet(kind, 3);
        m.checkpoint = Some(g);
        let got = run(&m, 2, dtype, &x);
        assert_same(&format!("{kind:?} {g:?} {dtype:?}"), &want, &got);
    }
}

#[test]
fn resnet_basic_blocks_gradients_and_statistics_are_bit_identical_in_f32() {
    resnet_case(BlockKind::Basic, 16, None);
}

#[test]
fn resnet_basic_blocks_gradients_and_statistics_are_bit_identical_under_autocast() {
    resnet_case(BlockKind::Basic, 16, Some(DType::BF16));
    resnet_case(BlockKind::Basic, 16, Some(DType::F16));
}

#[test]
fn resnet_bottlenecks_gradients_and_statistics_are_bit_identical() {
    // The ImageNet stem and Bottlenecks: 64 -> 256 last convolutions recomputed by their
    // own fused op, strided 3x3 convolutions, projection shortcuts.
    resnet_case(BlockKind::Bottleneck, 32, None);
    resnet_case(BlockKind::Bottleneck, 32, Some(DType::BF16));
}

#[test]
fn recompute_updates_no_statistics_and_keeps_the_forward_training_mode() {
    // A module switched to eval between forward and backward still recomputes in training
    // mode (the replica keeps the flag), and the statistics move once.
    let x = || images(9, 16);
    let plain = resnet(BlockKind::Basic, 4);
    let want = run(&plain, 1, None, &x);
    let mut m = resnet(BlockKind::Basic, 4);
    m.checkpoint = Some(ResNetCheckpoint::Blocks);
    let labels = Tensor::from_vec(vec![1i64, 0, 2, 1], &[4]).unwrap();
    let loss = cross_entropy(
        &m.forward(&x()).unwrap(),
        &labels,
        CrossEntropyOptions::default(),
    )
    .unwrap();
    m.set_training(false);
    loss.backward().unwrap();
    m.set_training(true);
    let mut got = vec![("loss 0".to_string(), bits(&loss))];
    got.extend(snapshot(&m));
    assert_same("eval before backward", &want, &got);
    let nbt = m
        .state_dict()
        .into_iter()
        .find(|(n, _)| n == "layer1.0.bn1.num_batches_tracked")
        .unwrap()
        .1;
    assert_eq!(nbt.to_vec_i64(), [1]);
}

fn bert_config() -> BertConfig {
    BertConfig {
        vocab_size: 37,
        hidden_size: 16,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        intermediate_size: 24,
        max_position_embeddings: 12,
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.2,
        ..BertConfig::default()
    }
    .with_num_labels(3)
}

/// ids, mask (the last two tokens of two rows padded), types.
fn text(seed: u64) -> (Tensor, Tensor, Tensor) {
    let mut rng = Generator::new(seed);
    let ids: Vec<i64> = (0..4 * 9).map(|_| 5 + rng.below(30) as i64).collect();
    let mut mask = vec![1i64; 4 * 9];
    for r in [1, 3] {
        mask[r * 9 + 7] = 0;
        mask[r * 9 + 8] = 0;
    }
    let types: Vec<i64> = (0..4 * 9).map(|i| i64::from(i % 9 > 4)).collect();
    (
        Tensor::from_vec(ids, &[4, 9]).unwrap(),
        Tensor::from_vec(mask, &[4, 9]).unwrap(),
        Tensor::from_vec(types, &[4, 9]).unwrap(),
    )
}

fn bert_run(mlm: bool, checkpoint: bool, dtype: Option<DType>) -> Vec<(String, Vec<u64>)> {
    let cfg = bert_config();
    let mut rng = Generator::new(11);
    let mut model: Box<dyn Module> = if mlm {
        Box::new(BertForMaskedLM::new(&cfg, &mut rng).unwrap())
    } else {
        Box::new(BertForSequenceClassification::new(&cfg, &mut rng).unwrap())
    };
    if checkpoint {
        model.set_activation_checkpointing(Some("layers")).unwrap();
    }
    let mut out = Vec::new();
    for step in 0..2 {
        let (ids, mask, types) = text(20 + step);
        let loss = {
            let _ac = dtype.map(autocast);
            let inputs = hemi::data::Inputs::Text(hemi::data::TextInputs {
                input_ids: ids.clone(),
                attention_mask: mask,
                token_type_ids: types,
            });
            let logits = model.forward_inputs(&inputs).unwrap();
            if mlm {
                let v = cfg.vocab_size;
                let labels: Vec<i64> = ids
                    .to_vec_i64()
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| if i % 3 == 0 { t } else { -100 })
                    .collect();
                let labels = Tensor::from_vec(labels, &[4 * 9]).unwrap();
                cross_entropy(
                    &logits.reshape(&[4 * 9, v]).unwrap(),
                    &labels,
                    CrossEntropyOptions::default(),
                )
                .unwrap()
            } else {
                let labels = Tensor::from_vec(vec![2i64, 0, 1, 1], &[4]).unwrap();
                cross_entropy(&logits, &labels, CrossEntropyOptions::default()).unwrap()
            }
        };
        out.push((format!("loss {step}"), bits(&loss)));
        loss.backward().unwrap();
    }
    out.extend(snapshot(model.as_ref()));
    // Where the dropout generators are left.
    for (i, g) in model.generators().iter().enumerate() {
        out.push((
            format!("generator {i}"),
            vec![g.lock().unwrap().clone().next_u64()],
        ));
    }
    out
}

#[test]
fn bert_gradients_with_dropout_are_bit_identical() {
    for mlm in [false, true] {
        for dtype in [None, Some(DType::F16), Some(DType::BF16)] {
            let want = bert_run(mlm, false, dtype);
            let got = bert_run(mlm, true, dtype);
            assert_same(&format!("BERT mlm={mlm} {dtype:?}"), &want, &got);
        }
    }
}

#[test]
fn granularities_are_named_and_checked() {
    let mut m = resnet(BlockKind::Basic, 1);
    assert_eq!(m.checkpoint_granularities(), ["blocks", "stages"]);
    m.set_activation_checkpointing(Some("stages")).unwrap();
    assert_eq!(m.checkpoint, Some(ResNetCheckpoint::Stages));
    let e = m
        .set_activation_checkpointing(Some("layers"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("blocks or stages"), "{e}");
    m.set_activation_checkpointing(None).unwrap();
    assert_eq!(m.checkpoint, None);
    let mut b = BertForSequenceClassification::new(&bert_config(), &mut Generator::new(0)).unwrap();
    assert_eq!(b.checkpoint_granularities(), ["layers"]);
    assert!(b.set_activation_checkpointing(Some("blocks")).is_err());
    let mut c = hemi::models::CifarNet::new(3, 32, 32, 10, &mut Generator::new(0)).unwrap();
    assert!(c.checkpoint_granularities().is_empty());
    let e = c
        .set_activation_checkpointing(Some("blocks"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no checkpointed segments"), "{e}");
}

/// A closure segment: two uses of its input, a parameter, dropout from a shared generator.
struct Closure {
    w: Tensor,
    b: Tensor,
    rng: Arc<Mutex<Generator>>,
    calls: Arc<AtomicUsize>,
}

impl Closure {
    fn new() -> Closure {
        let mut g = Generator::new(5);
        Closure {
            w: Tensor::randn(&[6, 6], 0.0, 0.5, DType::F32, &mut g)
                .unwrap()
                .requires_grad_(),
            b: Tensor::randn(&[6], 0.0, 0.5, DType::F32, &mut g)
                .unwrap()
                .requires_grad_(),
            rng: Arc::new(Mutex::new(Generator::new(99))),
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }
    fn f(&self) -> impl Fn(&[hemi::Tensor]) -> hemi::Result<Tensor> + Send + Sync + 'static {
        let (w, b, rng, calls) = (
            self.w.clone(),
            self.b.clone(),
            self.rng.clone(),
            self.calls.clone(),
        );
        move |xs: &[Tensor]| {
            calls.fetch_add(1, Ordering::SeqCst);
            let x = &xs[0];
            let h = x.linear(&w, Some(&b))?.gelu()?;
            let h = h.dropout(0.3, true, &mut rng.lock().unwrap())?;
            h.mul(x)?.add(&xs[1])?.tanh()
        }
    }
}

#[test]
fn closure_segment_matches_the_plain_closure() {
    let mut g = Generator::new(1);
    let x0 = Tensor::randn(&[5, 6], 0.0, 1.0, DType::F32, &mut g)
        .unwrap()
        .requires_grad_();
    let y0 = Tensor::randn(&[5, 6], 0.0, 1.0, DType::F32, &mut g).unwrap();
    let result = |ckpt: bool| {
        let c = Closure::new();
        // The input is an op's result (a non-leaf) and is also used after the segment.
        let x = x0.mul_scalar(1.5).unwrap();
        let f = c.f();
        let out = if ckpt {
            checkpoint_fn(&[&x, &y0], vec![c.rng.clone()], f).unwrap()
        } else {
            f(&[x.clone(), y0.clone()]).unwrap()
        };
        let loss = out.mul(&x).unwrap().sum_all().unwrap();
        let after_forward = c.calls.load(Ordering::SeqCst);
        loss.backward().unwrap();
        let v = vec![
            bits(&loss),
            bits(&x0.grad().unwrap()),
            bits(&c.w.grad().unwrap()),
            bits(&c.b.grad().unwrap()),
            vec![c.rng.lock().unwrap().next_u64()],
        ];
        x0.zero_grad();
        (v, after_forward, c.calls.load(Ordering::SeqCst))
    };
    let (want, _, _) = result(false);
    let (got, fwd, total) = result(true);
    assert_eq!(want, got);
    // Run once in the forward and once more in the backward.
    assert_eq!((fwd, total), (1, 2));

    // The comparison can fail: a segment that does not name its generator draws new
    // masks in the recompute, and its gradients are not the plain closure's.
    let c = Closure::new();
    let x = x0.mul_scalar(1.5).unwrap();
    let out = checkpoint_fn(&[&x, &y0], Vec::new(), c.f()).unwrap();
    let loss = out.mul(&x).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    assert_eq!(bits(&loss), want[0]);
    assert_ne!(bits(&c.w.grad().unwrap()), want[2]);
    x0.zero_grad();
}

#[test]
fn closure_segment_under_autograd_grad_and_no_grad() {
    let c = Closure::new();
    let mut g = Generator::new(2);
    let x = Tensor::randn(&[5, 6], 0.0, 1.0, DType::F32, &mut g)
        .unwrap()
        .requires_grad_();
    let y = Tensor::zeros(&[5, 6], DType::F32).unwrap();
    let state = c.rng.lock().unwrap().clone();
    let plain = c.f()(&[x.clone(), y.clone()]).unwrap().sum_all().unwrap();
    let want = hemi::autograd::grad(&plain, &[&x, &c.w]).unwrap();
    *c.rng.lock().unwrap() = state.clone();
    let out = checkpoint_fn(&[&x, &y], vec![c.rng.clone()], c.f())
        .unwrap()
        .sum_all()
        .unwrap();
    let got = hemi::autograd::grad(&out, &[&x, &c.w]).unwrap();
    for (a, b) in want.iter().zip(&got) {
        assert_eq!(bits(a), bits(b));
    }
    // `grad` writes no `.grad`, through the segment either.
    assert!(c.w.grad().is_none() && x.grad().is_none());
    // Outside grad mode: the forward, once, and no graph.
    let before = c.calls.load(Ordering::SeqCst);
    let _ng = no_grad();
    let out = checkpoint_fn(&[&x, &y], vec![c.rng.clone()], c.f()).unwrap();
    assert!(!out.requires_grad());
    assert_eq!(c.calls.load(Ordering::SeqCst), before + 1);
}

#[test]
fn a_segment_reading_an_outside_activation_is_an_error() {
    let c = Closure::new();
    let h = c.w.mul_scalar(2.0).unwrap(); // requires grad, not a leaf, not an input
    let x = Tensor::ones(&[2, 6], DType::F32).unwrap();
    let e = checkpoint_fn(&[&x], Vec::new(), move |xs| xs[0].matmul(&h))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pass it as one of the segment's inputs") && e.contains("mul_scalar"),
        "{e}"
    );
}

#[test]
fn module_checkpoint_of_a_layer_matches() {
    let mut rng = Generator::new(3);
    let fc = hemi::nn::Linear::new(6, 4, true, &mut rng).unwrap();
    let r = fc.replica();
    assert_eq!(
        r.weight.id(),
        fc.weight.id(),
        "a replica shares the parameters"
    );
    let x = Tensor::randn(&[3, 6], 0.0, 1.0, DType::F32, &mut rng)
        .unwrap()
        .requires_grad_();
    hemi::nn::checkpoint(&fc, &x)
        .unwrap()
        .square()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (gw, gx) = (bits(&fc.weight.grad().unwrap()), bits(&x.grad().unwrap()));
    fc.zero_grad();
    x.zero_grad();
    fc.forward(&x)
        .unwrap()
        .square()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(gw, bits(&fc.weight.grad().unwrap()));
    assert_eq!(gx, bits(&x.grad().unwrap()));
}
