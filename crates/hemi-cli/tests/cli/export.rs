//! `hemi export --format onnx` from the CLI: a trained checkpoint becomes a file that decodes
//! to an opset-17 graph with the model's inputs, outputs and metadata (F16 weights about
//! half the size), `--sample` writes inputs with hemi's logits, a Hugging Face directory
//! exports too, and bad input is an error that names it (never a panic), leaving no file.
//! What the graph computes is checked in `crates/hemi/tests/io/onnx.rs` (a reference
//! interpreter) and `bench/onnx_check.py` (onnxruntime).

use crate::common;
use common::{hemi, ok};
use std::path::Path;
use std::process::Output;

use hemi::io::onnx::{decode, OPSET};

fn err(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "expected an error exit:\n{e}");
    assert!(!e.contains("panicked"), "{e}");
    e
}

fn metadata(m: &hemi::io::onnx::proto::ModelProto, key: &str) -> String {
    m.metadata_props
        .iter()
        .find(|p| p.key == key)
        .unwrap_or_else(|| panic!("no metadata {key}"))
        .value
        .clone()
}

#[test]
fn a_checkpoint_exports_to_onnx_with_hemis_logits_beside_it() {
    let t = tempfile::tempdir().unwrap();
    ok(&hemi(
        t.path(),
        &[
            "train",
            "--model",
            "cifar-net",
            "--dataset",
            "synthetic",
            "--synthetic-size",
            "128",
            "--batch-size",
            "64",
            "--epochs",
            "1",
            "--quiet",
            "--checkpoint-dir",
            "ck",
        ],
    ));
    let mut sizes = Vec::new();
    for dtype in ["f32", "f16"] {
        let out = format!("out/{dtype}.onnx");
        let base = [
            "export",
            "--checkpoint",
            "ck",
            "--format",
            "onnx",
            "--out",
            &out,
        ];
        let said = ok(&hemi(
            t.path(),
            &[&base[..], &["--dtype", dtype, "--sample", "3"]].concat(),
        ));
        assert!(said.contains("opset 17"), "{said}");
        let bytes = std::fs::read(t.path().join(&out)).unwrap();
        sizes.push(bytes.len());
        let m = decode(&bytes).unwrap();
        assert_eq!(m.opset_import[0].version, OPSET);
        let g = m.graph.as_ref().unwrap();
        let inputs: Vec<&str> = g.input.iter().map(|i| i.name.as_str()).collect();
        let outputs: Vec<&str> = g.output.iter().map(|i| i.name.as_str()).collect();
        assert_eq!((inputs, outputs), (vec!["input"], vec!["logits"]));
        assert_eq!(metadata(&m, "model"), "cifar-net");
        assert_eq!(metadata(&m, "weights_dtype"), dtype);
        assert_eq!(metadata(&m, "normalize.mean"), "[0.5]");
        assert!(metadata(&m, "class_names").starts_with('['));
        let (sample, meta) =
            hemi::io::load_safetensors(&t.path().join(format!("{out}.sample.safetensors")))
                .unwrap();
        let shape = |n: &str| {
            sample
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.shape().to_vec())
                .unwrap_or_else(|| panic!("no {n}"))
        };
        assert_eq!(shape("input"), vec![3, 3, 32, 32]);
        assert_eq!(shape("logits"), vec![3, 10]);
        assert_eq!(shape("logits_f32"), vec![3, 10]);
        assert_eq!(meta.get("weights_dtype").map(String::as_str), Some(dtype));
    }
    // F16 weights: half the bytes (less the few F32 constants).
    assert!(sizes[1] * 2 < sizes[0] + 4096, "{sizes:?}");
    // Atomic writes leave no temporary files.
    let left: Vec<_> = std::fs::read_dir(t.path().join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_hugging_face_bert_directory_exports_with_text_inputs() {
    let t = tempfile::tempdir().unwrap();
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../hemi/tests/fixtures/bert/tiny/cls");
    let dir = fixture.to_str().unwrap();
    ok(&hemi(
        t.path(),
        &[
            "export",
            "--pretrained",
            dir,
            "--out",
            "bert.onnx",
            "--sample",
            "4",
            "--sample-length",
            "9",
        ],
    ));
    let m = decode(&std::fs::read(t.path().join("bert.onnx")).unwrap()).unwrap();
    let g = m.graph.as_ref().unwrap();
    let inputs: Vec<&str> = g.input.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(inputs, ["input_ids", "attention_mask", "token_type_ids"]);
    assert_eq!(metadata(&m, "model"), "bert-classifier");
    let (sample, _) =
        hemi::io::load_safetensors(&t.path().join("bert.onnx.sample.safetensors")).unwrap();
    let get = |n: &str| {
        sample
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(get("input_ids").shape(), [4, 9]);
    assert_eq!(get("logits").shape(), [4, 3]);
    // Some rows are padded: the sample exercises the attention mask.
    let mask = get("attention_mask").to_vec_i64();
    assert!(
        mask.contains(&0) && mask[..9].iter().all(|&m| m == 1),
        "{mask:?}"
    );
    // --pretrained builds text models only.
    let e = err(&hemi(
        t.path(),
        &[
            "export",
            "--pretrained",
            dir,
            "--model",
            "resnet20",
            "--out",
            "x.onnx",
        ],
    ));
    assert!(e.contains("resnet20") && e.contains("text"), "{e}");
}

#[test]
fn bad_export_requests_are_errors_that_name_the_problem() {
    let t = tempfile::tempdir().unwrap();
    ok(&hemi(
        t.path(),
        &[
            "train",
            "--model",
            "mlp",
            "--dataset",
            "synthetic",
            "--synthetic-size",
            "64",
            "--batch-size",
            "64",
            "--epochs",
            "1",
            "--quiet",
            "--checkpoint-dir",
            "ck",
        ],
    ));
    let export = |extra: &[&str]| {
        hemi(
            t.path(),
            &[&["export", "--checkpoint", "ck"], extra].concat(),
        )
    };
    let e = err(&export(&["--format", "tflite", "--out", "m.tflite"]));
    assert!(e.contains("tflite") && e.contains("onnx"), "{e}");
    let e = err(&export(&["--dtype", "int4", "--out", "m.onnx"]));
    assert!(e.contains("int4") && e.contains("f16"), "{e}");
    std::fs::create_dir(t.path().join("adir")).unwrap();
    let e = err(&export(&["--out", "adir"]));
    assert!(e.contains("adir") && e.contains("directory"), "{e}");
    std::fs::write(t.path().join("afile"), b"x").unwrap();
    let e = err(&export(&["--out", "afile/m.onnx"]));
    assert!(e.contains("afile"), "{e}");
    let e = err(&hemi(
        t.path(),
        &["export", "--checkpoint", "nowhere", "--out", "m.onnx"],
    ));
    assert!(e.contains("nowhere"), "{e}");
    assert!(!t.path().join("m.onnx").exists());
    assert!(!t.path().join("m.tflite").exists());
    // The MLP itself exports.
    ok(&export(&["--out", "m.onnx"]));
    assert!(t.path().join("m.onnx").is_file());
}
