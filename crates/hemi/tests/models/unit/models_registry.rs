//! The unit tests of `hemi::models::registry` (`src/models/registry.rs`), run against the built library.

use hemi::error::Result;
use hemi::models::registry::*;
use hemi::nn::Module;

fn err_of(r: Result<Box<dyn Module>>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_model_builds_for_its_input_and_names_are_unique() {
    let all = models();
    let mut names: Vec<&str> = all.iter().map(|m| m.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), all.len());
    for m in all
        .iter()
        .filter(|m| m.name != "resnet50" && m.name != "resnet34" && m.input == InputKind::Image)
    {
        let net = m.build(m.input_shape, 10, 1).unwrap();
        assert!(net.num_parameters() > 0, "{}", m.name);
    }
    let e = find("resnet7").unwrap_err().to_string();
    assert!(
        e.contains("resnet7") && e.contains("cifar-net") && e.contains("resnet56"),
        "{e}"
    );
    let e = err_of(build("resnet20", [1, 28, 28], 10, 0));
    assert!(e.contains("3-channel") && e.contains("[1, 28, 28]"), "{e}");
    assert!(build("mlp", [1, 28, 28], 0, 0).is_err());
}

#[test]
fn every_model_names_a_known_recipe() {
    for m in models() {
        let r = hemi::train::Recipe::find(m.recipe).unwrap();
        hemi::train::find_task(m.task).unwrap();
        if m.input == InputKind::Image {
            r.normalize_for(m.input_shape[0]).unwrap();
        }
    }
    assert_eq!(find("resnet20").unwrap().recipe, "resnet-cifar");
    assert_eq!(find("cifar-net").unwrap().recipe, "documents");
}

#[test]
fn text_models_build_from_a_config_and_refuse_image_shapes() {
    let cfg = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/bert/tiny/cls/config.json");
    let cls = find("bert-classifier").unwrap();
    let net = cls.build_text(&cfg, 3, 0).unwrap();
    let head = net
        .tensors()
        .into_iter()
        .find(|(n, ..)| n == "classifier.weight")
        .map(|(_, t, ..)| t.shape().to_vec());
    assert_eq!(head.unwrap()[0], 3);
    let mlm = find("bert-mlm").unwrap().build_text(&cfg, 1, 0).unwrap();
    assert!(mlm
        .tensors()
        .iter()
        .any(|(n, ..)| n == "cls.predictions.transform.dense.weight"));
    let e = err_of(cls.build([3, 32, 32], 10, 0));
    assert!(e.contains("text model"), "{e}");
    let e = err_of(find("mlp").unwrap().build_text(&cfg, 2, 0));
    assert!(e.contains("image model"), "{e}");
    let e = err_of(cls.build_text(std::path::Path::new("/nonexistent/config.json"), 2, 0));
    assert!(e.contains("/nonexistent/config.json"), "{e}");
}

/// The shapes `hemi models` describes are the shapes the models have.
#[test]
fn descriptions_match_the_built_models() {
    let shape = |net: &dyn Module, name: &str| -> Vec<usize> {
        net.tensors()
            .into_iter()
            .find(|(n, ..)| n == name)
            .map(|(_, t, ..)| t.shape().to_vec())
            .unwrap_or_else(|| panic!("no {name}"))
    };
    let d = |name: &str| find(name).unwrap().description;
    let net = build("cifar-net", [3, 32, 32], 10, 0).unwrap();
    assert_eq!(shape(net.as_ref(), "conv1.weight"), [64, 3, 3, 3]);
    assert_eq!(shape(net.as_ref(), "conv2.weight"), [128, 64, 3, 3]);
    assert_eq!(shape(net.as_ref(), "fc1.weight"), [256, 4608]);
    assert_eq!(shape(net.as_ref(), "fc2.weight"), [10, 256]);
    for part in ["3->64", "64->128", "4608->256", "256->classes"] {
        assert!(d("cifar-net").contains(part), "{part}");
    }
    let net = build("mlp", [1, 28, 28], 10, 0).unwrap();
    assert_eq!(shape(net.as_ref(), "fc1.weight"), [512, 784]);
    assert_eq!(shape(net.as_ref(), "fc2.weight"), [10, 512]);
    assert!(d("mlp").contains("->512") && d("mlp").contains("512->classes"));
    // ResNets: blocks per stage and each stage's output channels, from the weights.
    for name in [
        "resnet20", "resnet32", "resnet56", "resnet18", "resnet34", "resnet50",
    ] {
        let net = build(name, find(name).unwrap().input_shape, 10, 0).unwrap();
        let names: Vec<String> = net.tensors().into_iter().map(|(n, ..)| n).collect();
        let mut blocks = Vec::new();
        let mut widths = Vec::new();
        for stage in 1..=4 {
            let n = (0..)
                .take_while(|b| {
                    names
                        .iter()
                        .any(|x| x.starts_with(&format!("layer{stage}.{b}.")))
                })
                .count();
            if n == 0 {
                break;
            }
            blocks.push(n);
            let last = format!("layer{stage}.{}.", n - 1);
            let bn = if names.contains(&format!("{last}bn3.weight")) {
                "bn3"
            } else {
                "bn2"
            };
            widths.push(shape(net.as_ref(), &format!("{last}{bn}.weight"))[0]);
            if bn == "bn3" {
                assert!(d(name).contains("Bottlenecks"), "{name}");
            }
        }
        let desc = d(name);
        let widths_text = widths
            .iter()
            .map(|w| w.to_string())
            .collect::<Vec<_>>()
            .join("/");
        assert!(
            desc.contains(&widths_text),
            "{name}: {desc} vs {widths_text}"
        );
        if blocks.iter().all(|&b| b == blocks[0]) && blocks.len() == 3 {
            assert!(
                desc.contains(&format!("with {} BasicBlocks each", blocks[0])),
                "{name}: {desc}"
            );
        } else {
            let list = blocks
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            assert!(
                desc.contains(&format!("[{list}]")),
                "{name}: {desc} vs {list}"
            );
        }
    }
}
