//! Module traversal (`hemi::nn::Visit`): a module that only describes itself once gets every
//! list `Module` derives from that description (state_dict names and order, mutable slots,
//! layers for quantisation, batch norms, dropout generators, train/eval), and the built-in
//! models' two descriptions (`visit`, `visit_mut`) agree.

use hemi::models::registry::{models, InputKind};
use hemi::nn::{
    BatchNorm2d, Conv2d, Dropout, Kind, LayerMut, Linear, Module, Visit, Visitor, VisitorMut,
};
use hemi::{DType, Generator, Tensor};

/// Part of a model that is not a `Module` itself: a convolution and its batch norm.
struct Stage {
    conv: Conv2d,
    bn: BatchNorm2d,
}

impl Visit for Stage {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("conv", &self.conv);
        v.child("bn", &self.bn);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("conv", &mut self.conv);
        v.child("bn", &mut self.bn);
    }
}

/// A part whose (imagined) fused forward bypasses its layer's hook, so it hides it.
struct Fused {
    proj: Linear,
    drop: Dropout,
}

impl Visit for Fused {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("proj", &self.proj);
        v.child("drop", &self.drop);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.hide_layers();
        v.child("proj", &mut self.proj);
        v.child("drop", &mut self.drop);
    }
}

/// A user's module: its own parameter and buffer, stages in a list, a dropout, a head, and
/// a part that hides its layers.
struct Custom {
    scale: Tensor,
    stages: Vec<Stage>,
    drop: Dropout,
    head: Linear,
    fused: Fused,
    steps: Tensor,
}

impl Custom {
    fn new(seed: u64) -> Custom {
        let mut rng = Generator::new(seed);
        let stage = |c: usize, rng: &mut Generator| Stage {
            conv: Conv2d::new(c, 4, (3, 3), Default::default(), true, rng).unwrap(),
            bn: BatchNorm2d::new(4).unwrap(),
        };
        Custom {
            scale: Tensor::randn(&[4], 0.0, 1.0, DType::F32, &mut rng)
                .unwrap()
                .requires_grad_(),
            stages: vec![stage(2, &mut rng), stage(4, &mut rng)],
            drop: Dropout::new(0.5, 7).unwrap(),
            head: Linear::new(4, 3, true, &mut rng).unwrap(),
            fused: Fused {
                proj: Linear::new(3, 3, false, &mut rng).unwrap(),
                drop: Dropout::new(0.5, 8).unwrap(),
            },
            steps: Tensor::zeros(&[], DType::I64).unwrap(),
        }
    }
}

impl Module for Custom {
    fn forward(&self, x: &Tensor) -> hemi::Result<Tensor> {
        self.head.forward(&self.drop.forward(x)?)
    }
}

impl Visit for Custom {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.param("scale", &self.scale);
        for (i, s) in self.stages.iter().enumerate() {
            v.child(&format!("stages.{i}"), s);
        }
        v.child("drop", &self.drop);
        v.child("head", &self.head);
        v.child("fused", &self.fused);
        v.buffer("steps", &self.steps);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.param("scale", &mut self.scale);
        for (i, s) in self.stages.iter_mut().enumerate() {
            v.child(&format!("stages.{i}"), s);
        }
        v.child("drop", &mut self.drop);
        v.child("head", &mut self.head);
        v.child("fused", &mut self.fused);
        v.buffer("steps", &mut self.steps);
    }
}

const BN: [&str; 5] = [
    "weight",
    "bias",
    "running_mean",
    "running_var",
    "num_batches_tracked",
];

#[test]
fn a_module_written_with_only_visit_gets_state_dict_names_in_order() {
    let mut m = Custom::new(0);
    let mut want = vec!["scale".to_string()];
    for i in 0..2 {
        want.push(format!("stages.{i}.conv.weight"));
        want.push(format!("stages.{i}.conv.bias"));
        want.extend(BN.iter().map(|n| format!("stages.{i}.bn.{n}")));
    }
    want.extend(["head.weight", "head.bias", "fused.proj.weight", "steps"].map(String::from));
    let names: Vec<String> = m.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, want);

    // Kinds and norm marks come from where each tensor is described.
    let described: Vec<(String, Kind, bool)> = m
        .tensors()
        .into_iter()
        .map(|(n, _, k, norm)| (n, k, norm))
        .collect();
    let of = |name: &str| described.iter().find(|d| d.0 == name).unwrap().clone();
    assert_eq!(of("scale"), ("scale".into(), Kind::Parameter, false));
    assert_eq!(of("steps"), ("steps".into(), Kind::Buffer, false));
    assert_eq!(
        of("stages.1.bn.running_var"),
        ("stages.1.bn.running_var".into(), Kind::Buffer, true)
    );
    assert_eq!(
        of("stages.0.conv.weight"),
        ("stages.0.conv.weight".into(), Kind::Parameter, false)
    );
    let params: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(params.len(), 1 + 2 * 4 + 2 + 1);
    assert!(!params
        .iter()
        .any(|n| n.ends_with("running_mean") || n == "steps"));

    // The mutable description lists the same tensors, the same tensors themselves.
    let shared: Vec<(String, Kind, bool, Tensor)> = m
        .tensors()
        .into_iter()
        .map(|(n, t, k, norm)| (n, k, norm, t.clone()))
        .collect();
    let slots = m.tensors_mut();
    assert_eq!(slots.len(), shared.len());
    for (s, (n, k, norm, t)) in slots.iter().zip(&shared) {
        assert_eq!((&s.name, s.kind, s.is_norm), (n, *k, *norm));
        assert_eq!(s.tensor.id(), t.id(), "{n}");
    }
}

#[test]
fn loading_and_casting_reach_every_described_tensor() {
    let src = Custom::new(1);
    let mut dst = Custom::new(2);
    dst.load_state_dict(&src.state_dict()).unwrap();
    for ((n, a), (_, b)) in src.state_dict().iter().zip(dst.state_dict().iter()) {
        assert_eq!(a.to_vec_f32(), b.to_vec_f32(), "{n}");
    }
    dst.to_dtype(DType::F16, true).unwrap();
    for (n, t, kind, norm) in dst.tensors() {
        let want = if n.ends_with("num_batches_tracked") || n == "steps" {
            DType::I64
        } else if norm {
            DType::F32
        } else {
            DType::F16
        };
        assert_eq!(t.dtype(), want, "{n}");
        assert_eq!(t.requires_grad(), kind == Kind::Parameter, "{n}");
    }
}

#[test]
fn layers_and_batch_norms_are_found_where_they_are_nested() {
    let mut m = Custom::new(0);
    let bn_ids: Vec<_> = m.stages.iter().map(|s| s.bn.weight.id()).collect();
    let layers: Vec<(String, &str)> = m
        .layers_mut()
        .into_iter()
        .map(|(n, l)| {
            let kind = match l {
                LayerMut::Linear(_) => "linear",
                LayerMut::Conv2d(_) => "conv",
            };
            (n, kind)
        })
        .collect();
    // `fused.proj` is hidden by `Fused::visit_mut`.
    let want = [
        ("stages.0.conv", "conv"),
        ("stages.1.conv", "conv"),
        ("head", "linear"),
    ];
    assert_eq!(layers, want.map(|(n, k)| (n.to_string(), k)));
    let found: Vec<_> = m.batch_norms_mut().iter().map(|b| b.weight.id()).collect();
    assert_eq!(found, bn_ids);

    // A lone layer is its own layer, named "", and a lone batch norm its own batch norm.
    let mut lin = Linear::new(2, 2, true, &mut Generator::new(0)).unwrap();
    let l = lin.layers_mut();
    assert_eq!(l.len(), 1);
    assert!(l[0].0.is_empty() && matches!(l[0].1, LayerMut::Linear(_)));
    assert_eq!(BatchNorm2d::new(3).unwrap().batch_norms_mut().len(), 1);
}

#[test]
fn set_training_and_generators_reach_nested_dropout_and_batch_norm() {
    let mut m = Custom::new(0);
    // The dropouts' generators, in visiting order (`drop`, then `fused.drop`).
    let firsts: Vec<u64> = m
        .generators()
        .iter()
        .map(|g| g.lock().unwrap().clone().next_u64())
        .collect();
    assert_eq!(
        firsts,
        [Generator::new(7).next_u64(), Generator::new(8).next_u64()]
    );

    let x = Tensor::from_vec((1..=64).map(|i| i as f32).collect(), &[4, 16]).unwrap();
    let img = Tensor::randn(&[2, 4, 3, 3], 1.0, 1.0, DType::F32, &mut Generator::new(3)).unwrap();
    let bn_moves = |m: &Custom| {
        let before = m.stages[1].bn.running_mean.to_vec_f32();
        m.stages[1].bn.forward(&img).unwrap();
        m.stages[1].bn.running_mean.to_vec_f32() != before
    };
    let dropped = |d: &Dropout| d.forward(&x).unwrap().to_vec_f32() != x.to_vec_f32();
    assert!(dropped(&m.drop) && dropped(&m.fused.drop) && bn_moves(&m));
    m.set_training(false);
    assert!(!dropped(&m.drop) && !dropped(&m.fused.drop) && !bn_moves(&m));
    m.set_training(true);
    assert!(dropped(&m.drop) && dropped(&m.fused.drop) && bn_moves(&m));
}

/// Every built-in model: `visit` and `visit_mut` describe the same tensors, each batch norm
/// is found once, and the layers, batch norms and generators are those the models listed by
/// hand before the traversal (ResNets hide their layers: their fused ops bypass the hooks).
#[test]
fn built_in_models_describe_the_same_tensors_both_ways() {
    let cfg = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/bert/tiny/cls/config.json");
    let layers_of_bert = 2 * 6;
    for spec in models() {
        let mut m = match spec.input {
            InputKind::Image => spec.build(spec.input_shape, 10, 0).unwrap(),
            InputKind::Text => spec.build_text(&cfg, 3, 0).unwrap(),
        };
        let shared: Vec<(String, Kind, bool)> = m
            .tensors()
            .into_iter()
            .map(|(n, _, k, norm)| (n, k, norm))
            .collect();
        let slots: Vec<(String, Kind, bool)> = m
            .tensors_mut()
            .into_iter()
            .map(|s| (s.name, s.kind, s.is_norm))
            .collect();
        assert_eq!(shared, slots, "{}", spec.name);
        let running = shared
            .iter()
            .filter(|(n, ..)| n.ends_with(".running_mean"))
            .count();
        assert_eq!(m.batch_norms_mut().len(), running, "{}", spec.name);
        let layers: Vec<String> = m.layers_mut().into_iter().map(|(n, _)| n).collect();
        let generators = m.generators().len();
        match spec.name {
            "cifar-net" => assert_eq!(layers, ["conv1", "conv2", "fc1", "fc2"]),
            "mlp" => assert_eq!(layers, ["fc1", "fc2"]),
            "bert-classifier" => {
                assert_eq!(layers.len(), layers_of_bert + 2);
                assert_eq!(layers[0], "bert.encoder.layer.0.attention.self.query");
                assert_eq!(
                    layers[layers_of_bert..],
                    ["bert.pooler.dense", "classifier"]
                );
                assert_eq!(generators, 1 + 2 * 3 + 1);
            }
            "bert-mlm" => {
                assert_eq!(layers.len(), layers_of_bert + 1);
                assert_eq!(layers[5], "bert.encoder.layer.0.output.dense");
                assert_eq!(layers[layers_of_bert], "cls.predictions.transform.dense");
                assert_eq!(generators, 1 + 2 * 3);
            }
            name => {
                assert!(name.starts_with("resnet"), "a new model: {name}");
                assert!(layers.is_empty(), "{name}: {layers:?}");
            }
        }
        if spec.input == InputKind::Image {
            assert_eq!(generators, 0, "{}", spec.name);
        }
    }
}
