//! ONNX export, checked without onnxruntime: the written bytes decode back (prost) to the
//! same model; the graph has opset 17, the declared inputs and outputs, and one initializer
//! per `state_dict` tensor (BatchNorm's counters aside) with its name, shape, dtype and
//! bit-exact values; and a reference interpreter below, in f64, for exactly the operators
//! the exporters emit, runs the decoded graph and must agree with hemi's eval-mode forward.
//! That proves the file computes what the model computes; `bench/onnx_check.py` runs the
//! same files in onnxruntime.

use std::collections::HashMap;

use half::f16;
use hemi::io::onnx::proto::{attribute_type, data_type, tensor_shape_proto::dimension};
use hemi::io::onnx::proto::{ModelProto, NodeProto, TensorProto};
use hemi::io::onnx::{decode, encode, ExportOptions, OnnxDType, IR_VERSION, OPSET};
use hemi::models::onnx::export_onnx;
use hemi::models::{
    BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel, BlockKind, CifarNet,
    CifarShortcut, Mlp, ResNet,
};
use hemi::nn::Module;
use hemi::{DType, Generator, Tensor};

// ---------------------------------------------------------------------------------------
// A reference interpreter: f64 values, numpy broadcasting, the ONNX operator definitions.

#[derive(Clone, Debug)]
enum Data {
    F(Vec<f64>),
    I(Vec<i64>),
}

#[derive(Clone, Debug)]
struct V {
    shape: Vec<usize>,
    data: Data,
}

impl V {
    fn f(shape: Vec<usize>, v: Vec<f64>) -> V {
        assert_eq!(shape.iter().product::<usize>(), v.len(), "shape {shape:?}");
        V {
            shape,
            data: Data::F(v),
        }
    }
    fn i(shape: Vec<usize>, v: Vec<i64>) -> V {
        assert_eq!(shape.iter().product::<usize>(), v.len(), "shape {shape:?}");
        V {
            shape,
            data: Data::I(v),
        }
    }
    fn fs(&self) -> &[f64] {
        match &self.data {
            Data::F(v) => v,
            Data::I(_) => panic!("expected a float tensor"),
        }
    }
    fn is(&self) -> &[i64] {
        match &self.data {
            Data::I(v) => v,
            Data::F(_) => panic!("expected an int64 tensor"),
        }
    }
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn tensor_value(t: &TensorProto) -> V {
    let shape: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    let raw = &t.raw_data;
    match t.data_type {
        data_type::FLOAT => V::f(
            shape,
            raw.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
        ),
        data_type::FLOAT16 => V::f(
            shape,
            raw.chunks(2)
                .map(|c| f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64())
                .collect(),
        ),
        data_type::INT64 => V::i(
            shape,
            raw.chunks(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        other => panic!("initializer {}: data type {other}", t.name),
    }
}

fn attr_i(n: &NodeProto, name: &str, default: i64) -> i64 {
    n.attribute
        .iter()
        .find(|a| a.name == name)
        .map_or(default, |a| {
            assert_eq!(a.r#type, attribute_type::INT, "{name}");
            a.i
        })
}

fn attr_f(n: &NodeProto, name: &str, default: f32) -> f64 {
    n.attribute
        .iter()
        .find(|a| a.name == name)
        .map_or(default, |a| {
            assert_eq!(a.r#type, attribute_type::FLOAT, "{name}");
            a.f
        }) as f64
}

fn attr_is(n: &NodeProto, name: &str) -> Option<Vec<i64>> {
    n.attribute.iter().find(|a| a.name == name).map(|a| {
        assert_eq!(a.r#type, attribute_type::INTS, "{name}");
        a.ints.clone()
    })
}

fn axis(a: i64, rank: usize) -> usize {
    if a < 0 {
        (a + rank as i64) as usize
    } else {
        a as usize
    }
}

/// Elementwise `f(a, b)` with numpy broadcasting.
fn broadcast(a: &V, b: &V, f: impl Fn(f64, f64) -> f64) -> V {
    let r = a.shape.len().max(b.shape.len());
    let pad = |s: &[usize]| {
        let mut p = vec![1; r - s.len()];
        p.extend_from_slice(s);
        p
    };
    let (sa, sb) = (pad(&a.shape), pad(&b.shape));
    let shape: Vec<usize> = (0..r)
        .map(|i| {
            assert!(
                sa[i] == sb[i] || sa[i] == 1 || sb[i] == 1,
                "{:?} vs {:?}",
                a.shape,
                b.shape
            );
            sa[i].max(sb[i])
        })
        .collect();
    let (ta, tb) = (strides(&sa), strides(&sb));
    let n: usize = shape.iter().product();
    let so = strides(&shape);
    let (fa, fb) = (a.fs(), b.fs());
    let out = (0..n)
        .map(|k| {
            let (mut ia, mut ib) = (0, 0);
            for d in 0..r {
                let c = k / so[d] % shape[d];
                if sa[d] > 1 {
                    ia += c * ta[d];
                }
                if sb[d] > 1 {
                    ib += c * tb[d];
                }
            }
            f(fa[ia], fb[ib])
        })
        .collect();
    V::f(shape, out)
}

fn map(a: &V, f: impl Fn(f64) -> f64) -> V {
    V::f(a.shape.clone(), a.fs().iter().map(|&x| f(x)).collect())
}

fn transpose(a: &V, perm: &[usize]) -> V {
    let shape: Vec<usize> = perm.iter().map(|&p| a.shape[p]).collect();
    let (si, so) = (strides(&a.shape), strides(&shape));
    let n = a.fs().len();
    let out = (0..n)
        .map(|k| {
            let src: usize = (0..shape.len())
                .map(|d| (k / so[d] % shape[d]) * si[perm[d]])
                .sum();
            a.fs()[src]
        })
        .collect();
    V::f(shape, out)
}

/// `a @ b`: `b` of rank 2 broadcast over `a`'s batch, or both of one batch shape.
fn matmul(a: &V, b: &V) -> V {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (k2, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    assert_eq!(k, k2, "matmul {:?} {:?}", a.shape, b.shape);
    let batch: usize = a.shape[..ra - 2].iter().product();
    let b_batched = rb > 2;
    if b_batched {
        assert_eq!(a.shape[..ra - 2], b.shape[..rb - 2]);
    }
    let (fa, fb) = (a.fs(), b.fs());
    let mut out = vec![0.0; batch * m * n];
    for t in 0..batch {
        let bo = if b_batched { t * k * n } else { 0 };
        for i in 0..m {
            for j in 0..n {
                out[(t * m + i) * n + j] = (0..k)
                    .map(|p| fa[(t * m + i) * k + p] * fb[bo + p * n + j])
                    .sum();
            }
        }
    }
    let mut shape = a.shape[..ra - 2].to_vec();
    shape.extend([m, n]);
    V::f(shape, out)
}

fn conv(n: &NodeProto, x: &V, w: &V, b: Option<&V>) -> V {
    let (nb, c, h, wd) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let (o, cg, kh, kw) = (w.shape[0], w.shape[1], w.shape[2], w.shape[3]);
    assert_eq!(
        attr_is(n, "kernel_shape").unwrap(),
        vec![kh as i64, kw as i64]
    );
    let s = attr_is(n, "strides").unwrap_or(vec![1, 1]);
    let p = attr_is(n, "pads").unwrap_or(vec![0; 4]);
    let d = attr_is(n, "dilations").unwrap_or(vec![1, 1]);
    let g = attr_i(n, "group", 1) as usize;
    assert_eq!(c, cg * g);
    let oh = (h as i64 + p[0] + p[2] - d[0] * (kh as i64 - 1) - 1) / s[0] + 1;
    let ow = (wd as i64 + p[1] + p[3] - d[1] * (kw as i64 - 1) - 1) / s[1] + 1;
    let (oh, ow) = (oh as usize, ow as usize);
    let (fx, fw) = (x.fs(), w.fs());
    let mut out = vec![0.0; nb * o * oh * ow];
    let og = o / g;
    for bi in 0..nb {
        for oc in 0..o {
            let grp = oc / og;
            for i in 0..oh {
                for j in 0..ow {
                    let mut acc = b.map_or(0.0, |b| b.fs()[oc]);
                    for ci in 0..cg {
                        let ic = grp * cg + ci;
                        for u in 0..kh {
                            let y = i as i64 * s[0] - p[0] + u as i64 * d[0];
                            if y < 0 || y >= h as i64 {
                                continue;
                            }
                            for v in 0..kw {
                                let xx = j as i64 * s[1] - p[1] + v as i64 * d[1];
                                if xx < 0 || xx >= wd as i64 {
                                    continue;
                                }
                                acc += fx[((bi * c + ic) * h + y as usize) * wd + xx as usize]
                                    * fw[((oc * cg + ci) * kh + u) * kw + v];
                            }
                        }
                    }
                    out[((bi * o + oc) * oh + i) * ow + j] = acc;
                }
            }
        }
    }
    V::f(vec![nb, o, oh, ow], out)
}

fn max_pool(n: &NodeProto, x: &V) -> V {
    let k = attr_is(n, "kernel_shape").unwrap();
    let s = attr_is(n, "strides").unwrap_or(vec![1, 1]);
    let p = attr_is(n, "pads").unwrap_or(vec![0; 4]);
    assert_eq!(attr_i(n, "ceil_mode", 0), 0);
    let (nb, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let oh = ((h as i64 + p[0] + p[2] - k[0]) / s[0] + 1) as usize;
    let ow = ((w as i64 + p[1] + p[3] - k[1]) / s[1] + 1) as usize;
    let fx = x.fs();
    let mut out = Vec::with_capacity(nb * c * oh * ow);
    for bc in 0..nb * c {
        for i in 0..oh {
            for j in 0..ow {
                let mut m = f64::NEG_INFINITY;
                for u in 0..k[0] {
                    for v in 0..k[1] {
                        let y = i as i64 * s[0] - p[0] + u;
                        let xx = j as i64 * s[1] - p[1] + v;
                        if (0..h as i64).contains(&y) && (0..w as i64).contains(&xx) {
                            m = m.max(fx[(bc * h + y as usize) * w + xx as usize]);
                        }
                    }
                }
                out.push(m);
            }
        }
    }
    V::f(vec![nb, c, oh, ow], out)
}

/// Runs `model`'s graph on `feeds`; returns every graph output by name.
fn run(model: &ModelProto, feeds: &[(&str, V)]) -> HashMap<String, V> {
    let g = model.graph.as_ref().unwrap();
    let mut env: HashMap<String, V> = HashMap::new();
    for t in &g.initializer {
        env.insert(t.name.clone(), tensor_value(t));
    }
    for (name, v) in feeds {
        assert!(g.input.iter().any(|i| i.name == *name), "no input {name}");
        env.insert(name.to_string(), v.clone());
    }
    for n in &g.node {
        let ins: Vec<Option<&V>> = n
            .input
            .iter()
            .map(|s| {
                (!s.is_empty()).then(|| {
                    env.get(s)
                        .unwrap_or_else(|| panic!("{}: input {s} not computed yet", n.name))
                })
            })
            .collect();
        let x = |i: usize| ins[i].unwrap();
        let out = match n.op_type.as_str() {
            "Conv" => conv(n, x(0), x(1), ins.get(2).copied().flatten()),
            "BatchNormalization" => {
                let eps = attr_f(n, "epsilon", 1e-5);
                let (a, sc, b, m, v) = (x(0), x(1).fs(), x(2).fs(), x(3).fs(), x(4).fs());
                let (c, hw) = (a.shape[1], a.shape[2..].iter().product::<usize>());
                let out = a
                    .fs()
                    .iter()
                    .enumerate()
                    .map(|(k, &z)| {
                        let ch = k / hw % c;
                        (z - m[ch]) / (v[ch] + eps).sqrt() * sc[ch] + b[ch]
                    })
                    .collect();
                V::f(a.shape.clone(), out)
            }
            "Relu" => map(x(0), |z| z.max(0.0)),
            "Tanh" => map(x(0), f64::tanh),
            "Erf" => map(x(0), libm::erf),
            "Add" => broadcast(x(0), x(1), |a, b| a + b),
            "Sub" => broadcast(x(0), x(1), |a, b| a - b),
            "Mul" => broadcast(x(0), x(1), |a, b| a * b),
            "MaxPool" => max_pool(n, x(0)),
            "GlobalAveragePool" => {
                let a = x(0);
                let hw: usize = a.shape[2..].iter().product();
                let out = a
                    .fs()
                    .chunks(hw)
                    .map(|c| c.iter().sum::<f64>() / hw as f64)
                    .collect();
                V::f(vec![a.shape[0], a.shape[1], 1, 1], out)
            }
            "Flatten" => {
                let a = x(0);
                let ax = axis(attr_i(n, "axis", 1), a.shape.len());
                let outer = a.shape[..ax].iter().product();
                V::f(vec![outer, a.fs().len() / outer.max(1)], a.fs().to_vec())
            }
            "Gemm" => {
                assert_eq!(attr_f(n, "alpha", 1.0), 1.0);
                assert_eq!(attr_f(n, "beta", 1.0), 1.0);
                assert_eq!(attr_i(n, "transA", 0), 0);
                let b = if attr_i(n, "transB", 0) == 1 {
                    transpose(x(1), &[1, 0])
                } else {
                    x(1).clone()
                };
                let y = matmul(x(0), &b);
                match ins.get(2).copied().flatten() {
                    Some(c) => broadcast(&y, c, |a, b| a + b),
                    None => y,
                }
            }
            "MatMul" => matmul(x(0), x(1)),
            "Transpose" => {
                let perm: Vec<usize> = attr_is(n, "perm")
                    .unwrap()
                    .iter()
                    .map(|&p| p as usize)
                    .collect();
                transpose(x(0), &perm)
            }
            "Cast" => {
                let a = x(0);
                match attr_i(n, "to", 0) as i32 {
                    data_type::FLOAT => match &a.data {
                        // Values are exact in f64; a cast to F32 rounds them to f32.
                        Data::F(v) => V::f(
                            a.shape.clone(),
                            v.iter().map(|&z| z as f32 as f64).collect(),
                        ),
                        Data::I(v) => V::f(a.shape.clone(), v.iter().map(|&z| z as f64).collect()),
                    },
                    other => panic!("Cast to {other}"),
                }
            }
            "Shape" => V::i(
                vec![x(0).shape.len()],
                x(0).shape.iter().map(|&d| d as i64).collect(),
            ),
            "Slice" => {
                let a = x(0);
                let r = a.shape.len();
                let starts = x(1).is();
                let ends = x(2).is();
                let axes: Vec<usize> = match ins.get(3).copied().flatten() {
                    Some(v) => v.is().iter().map(|&q| axis(q, r)).collect(),
                    None => (0..starts.len()).collect(),
                };
                let steps: Vec<i64> = match ins.get(4).copied().flatten() {
                    Some(v) => v.is().to_vec(),
                    None => vec![1; starts.len()],
                };
                // Per axis: the indices kept (positive steps only).
                let mut keep: Vec<Vec<usize>> = a.shape.iter().map(|&d| (0..d).collect()).collect();
                for (q, &ax) in axes.iter().enumerate() {
                    let dim = a.shape[ax] as i64;
                    let clamp = |v: i64| (if v < 0 { v + dim } else { v }).clamp(0, dim);
                    assert!(steps[q] > 0);
                    keep[ax] = (clamp(starts[q])..clamp(ends[q]))
                        .step_by(steps[q] as usize)
                        .map(|i| i as usize)
                        .collect();
                }
                let shape: Vec<usize> = keep.iter().map(Vec::len).collect();
                let (si, so) = (strides(&a.shape), strides(&shape));
                let n_out: usize = shape.iter().product();
                let src = |k: usize| -> usize {
                    (0..r).map(|d| keep[d][k / so[d] % shape[d]] * si[d]).sum()
                };
                match &a.data {
                    Data::F(v) => V::f(shape.clone(), (0..n_out).map(|k| v[src(k)]).collect()),
                    Data::I(v) => V::i(shape.clone(), (0..n_out).map(|k| v[src(k)]).collect()),
                }
            }
            "Pad" => {
                assert!(ins.get(2).copied().flatten().is_none(), "Pad with a value");
                let a = x(0);
                let r = a.shape.len();
                let p = x(1).is();
                let shape: Vec<usize> = (0..r)
                    .map(|d| (a.shape[d] as i64 + p[d] + p[d + r]) as usize)
                    .collect();
                let (si, so) = (strides(&a.shape), strides(&shape));
                let n_out: usize = shape.iter().product();
                let out = (0..n_out)
                    .map(|k| {
                        let mut src = 0;
                        for d in 0..r {
                            let c = (k / so[d] % shape[d]) as i64 - p[d];
                            if c < 0 || c >= a.shape[d] as i64 {
                                return 0.0;
                            }
                            src += c as usize * si[d];
                        }
                        a.fs()[src]
                    })
                    .collect();
                V::f(shape, out)
            }
            "Gather" => {
                let (a, idx) = (x(0), x(1));
                let ax = axis(attr_i(n, "axis", 0), a.shape.len());
                let outer: usize = a.shape[..ax].iter().product();
                let dim = a.shape[ax];
                let inner: usize = a.shape[ax + 1..].iter().product();
                let mut shape = a.shape[..ax].to_vec();
                shape.extend(&idx.shape);
                shape.extend(&a.shape[ax + 1..]);
                let mut out = Vec::new();
                for o in 0..outer {
                    for &i in idx.is() {
                        let i = if i < 0 { i + dim as i64 } else { i } as usize;
                        assert!(i < dim, "Gather index {i} of {dim}");
                        let base = (o * dim + i) * inner;
                        out.extend_from_slice(&a.fs()[base..base + inner]);
                    }
                }
                V::f(shape, out)
            }
            "Reshape" => {
                let a = x(0);
                let mut shape: Vec<i64> = x(1).is().to_vec();
                for (d, s) in shape.iter_mut().enumerate() {
                    if *s == 0 {
                        *s = a.shape[d] as i64;
                    }
                }
                let known: i64 = shape.iter().filter(|&&s| s != -1).product();
                let shape: Vec<usize> = shape
                    .iter()
                    .map(|&s| if s == -1 { a.fs().len() as i64 / known } else { s } as usize)
                    .collect();
                V::f(shape, a.fs().to_vec())
            }
            "Unsqueeze" => {
                let a = x(0);
                let mut axes: Vec<usize> = x(1)
                    .is()
                    .iter()
                    .map(|&q| axis(q, a.shape.len() + x(1).is().len()))
                    .collect();
                axes.sort();
                let mut shape = a.shape.clone();
                for q in axes {
                    shape.insert(q, 1);
                }
                V::f(shape, a.fs().to_vec())
            }
            "Softmax" => {
                let a = x(0);
                assert_eq!(
                    axis(attr_i(n, "axis", -1), a.shape.len()),
                    a.shape.len() - 1
                );
                let w = *a.shape.last().unwrap();
                let mut out = Vec::with_capacity(a.fs().len());
                for row in a.fs().chunks(w) {
                    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = row.iter().map(|&z| (z - m).exp()).collect();
                    let s: f64 = e.iter().sum();
                    out.extend(e.iter().map(|z| z / s));
                }
                V::f(a.shape.clone(), out)
            }
            "LayerNormalization" => {
                let a = x(0);
                let ax = axis(attr_i(n, "axis", -1), a.shape.len());
                let eps = attr_f(n, "epsilon", 1e-5);
                let w: usize = a.shape[ax..].iter().product();
                let (sc, b) = (x(1).fs(), x(2).fs());
                let mut out = Vec::with_capacity(a.fs().len());
                for row in a.fs().chunks(w) {
                    let mean = row.iter().sum::<f64>() / w as f64;
                    let var = row.iter().map(|z| (z - mean).powi(2)).sum::<f64>() / w as f64;
                    let inv = 1.0 / (var + eps).sqrt();
                    out.extend(
                        row.iter()
                            .enumerate()
                            .map(|(i, z)| (z - mean) * inv * sc[i] + b[i]),
                    );
                }
                V::f(a.shape.clone(), out)
            }
            other => panic!(
                "the reference interpreter does not know {other} ({})",
                n.name
            ),
        };
        assert_eq!(n.output.len(), 1, "{}", n.name);
        env.insert(n.output[0].clone(), out);
    }
    g.output
        .iter()
        .map(|o| (o.name.clone(), env[&o.name].clone()))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Checks shared by the models.

fn image(x: &Tensor) -> V {
    V::f(x.shape().to_vec(), x.to_vec_f64())
}

fn ints(t: &Tensor) -> V {
    V::i(t.shape().to_vec(), t.to_vec_i64())
}

/// The graph's declared dims of value `name` (inputs or outputs): numbers, or symbols as -1.
fn declared(model: &ModelProto, name: &str) -> (i32, Vec<Result<i64, String>>) {
    let g = model.graph.as_ref().unwrap();
    let vi = g
        .input
        .iter()
        .chain(&g.output)
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no graph input or output {name}"));
    let Some(hemi::io::onnx::proto::type_proto::Value::TensorType(t)) =
        vi.r#type.as_ref().and_then(|t| t.value.clone())
    else {
        panic!("{name} is not a tensor");
    };
    let dims = t
        .shape
        .unwrap()
        .dim
        .into_iter()
        .map(|d| match d.value.unwrap() {
            dimension::Value::DimValue(v) => Ok(v),
            dimension::Value::DimParam(s) => Err(s),
        })
        .collect();
    (t.elem_type, dims)
}

/// Exports `model`, checks the bytes decode to the same message, the opset, the IR version,
/// that every node's op is known to the interpreter's list and every initializer but the
/// graph's own constants is a `state_dict` tensor, stored as `dtype` says with bit-exact
/// values (F16: the tensor rounded to nearest-even), and every tensor but BatchNorm's
/// counters is there. Returns the decoded model.
fn export_and_check(
    name: &str,
    model: &(dyn Module + 'static),
    opts: &ExportOptions,
) -> ModelProto {
    let proto = export_onnx(name, model, opts).unwrap();
    let bytes = encode(&proto);
    let back = decode(&bytes).unwrap();
    assert_eq!(back, proto, "the bytes decode to another model");
    assert_eq!(back.ir_version, IR_VERSION);
    assert_eq!(back.opset_import.len(), 1);
    assert_eq!(back.opset_import[0].domain, "");
    assert_eq!(back.opset_import[0].version, OPSET);
    assert_eq!(OPSET, 17);
    let g = back.graph.as_ref().unwrap();
    let inits: HashMap<&str, &TensorProto> =
        g.initializer.iter().map(|t| (t.name.as_str(), t)).collect();
    assert_eq!(
        inits.len(),
        g.initializer.len(),
        "duplicate initializer names"
    );
    let state: HashMap<String, (Tensor, bool)> = model
        .tensors()
        .into_iter()
        .map(|(n, t, _, norm)| (n, (t.clone(), norm)))
        .collect();
    for (n, (t, is_norm)) in &state {
        if n.ends_with("num_batches_tracked") {
            assert!(!inits.contains_key(n.as_str()), "{n} exported");
            continue;
        }
        let init = inits
            .get(n.as_str())
            .unwrap_or_else(|| panic!("{name}: {n} is not an initializer"));
        let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        assert_eq!(init.dims, dims, "{n}");
        let stored = opts.dtype.storage(*is_norm);
        let want_type = if stored == DType::F16 {
            data_type::FLOAT16
        } else {
            data_type::FLOAT
        };
        assert_eq!(init.data_type, want_type, "{n}");
        let want: Vec<u8> = match stored {
            DType::F16 => t
                .to_vec_f32()
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            _ => t
                .to_vec_f32()
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
        };
        assert!(init.raw_data == want, "{n}: values differ");
    }
    // The rest are the graph's constants (shapes, axes, scalars): small, never float weights.
    for t in &g.initializer {
        if !state.contains_key(&t.name) {
            assert!(
                t.dims.iter().product::<i64>() <= 8,
                "{}: an initializer that is no state_dict tensor: {:?}",
                t.name,
                t.dims
            );
        }
    }
    // Every value a node reads exists (an input, an initializer or an earlier output), and
    // every initializer is read.
    let mut known: std::collections::HashSet<&str> = inits.keys().copied().collect();
    known.extend(g.input.iter().map(|i| i.name.as_str()));
    let mut read = std::collections::HashSet::new();
    for n in &g.node {
        assert_eq!(n.domain, "");
        for i in &n.input {
            assert!(
                known.contains(i.as_str()),
                "{}: reads {i} before it exists",
                n.name
            );
            read.insert(i.as_str());
        }
        known.extend(n.output.iter().map(String::as_str));
    }
    for t in &g.initializer {
        assert!(read.contains(t.name.as_str()), "{} is never read", t.name);
    }
    back
}

/// max |got - want| over the scale of `want` (hemi's forward in F32).
fn rel_diff(what: &str, got: &V, want: &Tensor) -> f64 {
    assert_eq!(got.shape, want.shape(), "{what}");
    let want = want.to_vec_f64();
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(scale > 1e-3, "{what}: degenerate logits");
    let d = got
        .fs()
        .iter()
        .zip(&want)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    d / scale
}

/// `got` agrees with `want` within 1e-4 of the logits' scale.
fn assert_close(what: &str, got: &V, want: &Tensor) {
    let r = rel_diff(what, got, want);
    assert!(
        r <= 1e-4,
        "{what}: the graph gives logits {r:e} of their scale away from hemi's"
    );
}

fn image_opts(dtype: OnnxDType, shape: [usize; 3]) -> ExportOptions {
    ExportOptions {
        image_shape: Some(shape),
        ..ExportOptions::new(dtype)
    }
}

/// Randomises BatchNorm affine parameters and running statistics, so that eval-mode BN
/// (which uses them) matters; the model is left in eval mode.
fn randomise_batch_norms(net: &mut dyn Module, rng: &mut Generator) {
    let state: Vec<(String, Tensor)> = net
        .state_dict()
        .into_iter()
        .map(|(n, t)| {
            let leaf = n.rsplit('.').next().unwrap().to_string();
            let bn = n.contains("bn") || n.contains("downsample.1");
            let v = match leaf.as_str() {
                "weight" | "running_var" if bn => {
                    Tensor::rand(t.shape(), 0.5, 1.5, DType::F32, rng).unwrap()
                }
                "bias" | "running_mean" if bn => {
                    Tensor::rand(t.shape(), -0.25, 0.25, DType::F32, rng).unwrap()
                }
                _ => t,
            };
            (n, v)
        })
        .collect();
    net.load_state_dict(&state).unwrap();
    net.set_training(false);
}

/// Exports an image model in F32 and F16, and checks both graphs against hemi's forward
/// of the model the file holds (F16: weights rounded to F16, norms F32, computed in F32).
fn check_image_model(name: &str, mut net: Box<dyn Module>, shape: [usize; 3], seed: u64) {
    let mut rng = Generator::new(seed);
    let [c, h, w] = shape;
    let x = Tensor::randn(&[2, c, h, w], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let _g = hemi::no_grad();
    for dtype in [OnnxDType::F32, OnnxDType::F16] {
        let m = export_and_check(name, net.as_ref(), &image_opts(dtype, shape));
        let (elem, dims) = declared(&m, "input");
        assert_eq!(elem, data_type::FLOAT);
        assert_eq!(
            dims,
            vec![
                Err("batch".into()),
                Ok(c as i64),
                Ok(h as i64),
                Ok(w as i64)
            ]
        );
        let (_, out_dims) = declared(&m, "logits");
        assert_eq!(out_dims[0], Err("batch".into()));
        let got = run(&m, &[("input", image(&x))]);
        let mut reference = if dtype == OnnxDType::F16 {
            let mut r: Box<dyn Module> = rebuild(name, net.as_ref(), shape);
            r.to_dtype(DType::F16, true).unwrap();
            r.to_dtype(DType::F32, false).unwrap();
            r
        } else {
            rebuild(name, net.as_ref(), shape)
        };
        reference.set_training(false);
        let want = reference.forward(&x).unwrap();
        assert_close(&format!("{name} {dtype:?}"), &got["logits"], &want);
        assert_eq!(out_dims[1], Ok(want.shape()[1] as i64));
    }
    net.set_training(false);
}

/// A copy of `net` (same registry name and weights).
fn rebuild(name: &str, net: &dyn Module, shape: [usize; 3]) -> Box<dyn Module> {
    let classes = net.tensors().last().unwrap().1.shape()[0];
    let mut m: Box<dyn Module> = match name {
        "resnet-cifar" => Box::new(
            ResNet::cifar(1, classes, CifarShortcut::A, false, &mut Generator::new(0)).unwrap(),
        ),
        "resnet-basic" => Box::new(
            ResNet::imagenet(
                BlockKind::Basic,
                [1, 1, 1, 1],
                classes,
                false,
                &mut Generator::new(0),
            )
            .unwrap(),
        ),
        "resnet-bottleneck" => Box::new(
            ResNet::imagenet(
                BlockKind::Bottleneck,
                [1, 1, 1, 1],
                classes,
                false,
                &mut Generator::new(0),
            )
            .unwrap(),
        ),
        "cifar-net" => Box::new(
            CifarNet::new(
                shape[0],
                shape[1],
                shape[2],
                classes,
                &mut Generator::new(0),
            )
            .unwrap(),
        ),
        "mlp" => {
            Box::new(Mlp::new(shape.iter().product(), 24, classes, &mut Generator::new(0)).unwrap())
        }
        other => panic!("{other}"),
    };
    m.load_state_dict(&net.state_dict()).unwrap();
    m.set_training(false);
    m
}

// ---------------------------------------------------------------------------------------
// Image models.

#[test]
fn cifar_net_graph_computes_hemis_logits() {
    let shape = [3, 16, 16];
    let mut net = CifarNet::new(3, 16, 16, 5, &mut Generator::new(1)).unwrap();
    net.set_training(false);
    check_image_model("cifar-net", Box::new(net), shape, 11);
}

#[test]
fn mlp_graph_computes_hemis_logits() {
    let shape = [1, 6, 5];
    let net = Mlp::new(30, 24, 4, &mut Generator::new(2)).unwrap();
    check_image_model("mlp", Box::new(net), shape, 12);
}

#[test]
fn cifar_resnet_graph_with_option_a_shortcuts_computes_hemis_logits() {
    let mut net = ResNet::cifar(1, 10, CifarShortcut::A, false, &mut Generator::new(3)).unwrap();
    randomise_batch_norms(&mut net, &mut Generator::new(4));
    let m = export_and_check("resnet-cifar", &net, &image_opts(OnnxDType::F32, [3, 8, 8]));
    let ops: Vec<&str> = m
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .map(|n| n.op_type.as_str())
        .collect();
    // Two option-A shortcuts (16 -> 32 and 32 -> 64 channels), each a strided Slice and a Pad.
    assert_eq!(ops.iter().filter(|o| **o == "Pad").count(), 2);
    assert_eq!(ops.iter().filter(|o| **o == "Slice").count(), 2);
    assert_eq!(
        ops.iter().filter(|o| **o == "BatchNormalization").count(),
        7
    );
    check_image_model("resnet-cifar", Box::new(net), [3, 8, 8], 13);
}

#[test]
fn the_interpreter_notices_misplaced_shortcut_channels() {
    // The same ResNet with the zero channels of its option-A shortcuts all placed after the
    // input's channels instead of half before: the comparison must fail, or it proves
    // nothing about the split.
    let mut net = ResNet::cifar(1, 10, CifarShortcut::A, false, &mut Generator::new(3)).unwrap();
    randomise_batch_norms(&mut net, &mut Generator::new(4));
    let mut m = export_and_check("resnet-cifar", &net, &image_opts(OnnxDType::F32, [3, 8, 8]));
    let g = m.graph.as_mut().unwrap();
    let mut changed = 0;
    for t in g
        .initializer
        .iter_mut()
        .filter(|t| t.name.ends_with("shortcut.pads"))
    {
        let mut p: Vec<i64> = t
            .raw_data
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert!(p[1] > 0 && p[1] == p[5], "pads {p:?}");
        p[5] += p[1];
        p[1] = 0;
        t.raw_data = p.iter().flat_map(|v| v.to_le_bytes()).collect();
        changed += 1;
    }
    assert_eq!(changed, 2);
    let x = Tensor::randn(&[2, 3, 8, 8], 0.0, 1.0, DType::F32, &mut Generator::new(5)).unwrap();
    let got = run(&m, &[("input", image(&x))]);
    let want = net.forward(&x).unwrap();
    let r = rel_diff("misplaced", &got["logits"], &want);
    assert!(r > 1e-2, "a wrong graph passed the comparison ({r:e})");
}

#[test]
fn imagenet_resnets_with_projection_shortcuts_compute_hemis_logits() {
    for (name, kind) in [
        ("resnet-basic", BlockKind::Basic),
        ("resnet-bottleneck", BlockKind::Bottleneck),
    ] {
        let mut net =
            ResNet::imagenet(kind, [1, 1, 1, 1], 7, false, &mut Generator::new(6)).unwrap();
        randomise_batch_norms(&mut net, &mut Generator::new(7));
        check_image_model(name, Box::new(net), [3, 32, 32], 14);
    }
}

#[test]
fn image_exports_refuse_shapes_that_do_not_fit() {
    let net = CifarNet::new(3, 16, 16, 5, &mut Generator::new(1)).unwrap();
    let e = export_onnx("cifar-net", &net, &ExportOptions::new(OnnxDType::F32)).unwrap_err();
    assert!(e.to_string().contains("input shape"), "{e}");
    let e = export_onnx("cifar-net", &net, &image_opts(OnnxDType::F32, [1, 16, 16])).unwrap_err();
    assert!(e.to_string().contains("3-channel"), "{e}");
    let e = export_onnx("cifar-net", &net, &image_opts(OnnxDType::F32, [3, 32, 32])).unwrap_err();
    assert!(e.to_string().contains("fc1"), "{e}");
    // A model type without an exporter is an error naming it, not a panic.
    let base = BertModel::new(&tiny_bert("gelu"), false, &mut Generator::new(0)).unwrap();
    let e = export_onnx("bert-base", &base, &ExportOptions::new(OnnxDType::F32)).unwrap_err();
    assert!(
        e.to_string().contains("bert-base") && e.to_string().contains("no ONNX export"),
        "{e}"
    );
    assert!(OnnxDType::parse("bf16").is_err());
    assert_eq!(OnnxDType::parse("F16").unwrap(), OnnxDType::F16);
}

// ---------------------------------------------------------------------------------------
// BERT.

fn tiny_bert(act: &str) -> BertConfig {
    // initializer_range 0.5: activations far from zero, so GELU, LayerNorm and the softmax
    // are exercised away from their linear regions.
    let text = format!(
        r#"{{"model_type": "bert", "vocab_size": 50, "hidden_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 24,
            "hidden_act": "{act}", "max_position_embeddings": 20, "type_vocab_size": 2,
            "layer_norm_eps": 1e-12, "initializer_range": 0.5, "pad_token_id": 0,
            "num_labels": 3}}"#
    );
    BertConfig::from_json_str("tiny", &text).unwrap()
}

/// Ids, mask (rows padded to 7, 3 and 1 of 7 tokens) and token types.
fn text_batch() -> [Tensor; 3] {
    let (b, l) = (3, 7);
    let mut rng = Generator::new(21);
    let lens = [7, 3, 1];
    let (mut ids, mut mask, mut types) = (vec![], vec![], vec![]);
    for len in lens {
        for j in 0..l {
            let keep = j < len;
            ids.push(if keep {
                1 + (rng.next_u64() % 49) as i64
            } else {
                0
            });
            mask.push(keep as i64);
            types.push((keep && j >= len / 2) as i64);
        }
    }
    [
        Tensor::from_vec(ids, &[b, l]).unwrap(),
        Tensor::from_vec(mask, &[b, l]).unwrap(),
        Tensor::from_vec(types, &[b, l]).unwrap(),
    ]
}

fn text_feeds(t: &[Tensor; 3]) -> Vec<(&'static str, V)> {
    vec![
        ("input_ids", ints(&t[0])),
        ("attention_mask", ints(&t[1])),
        ("token_type_ids", ints(&t[2])),
    ]
}

fn check_text_inputs(m: &ModelProto) {
    for name in ["input_ids", "attention_mask", "token_type_ids"] {
        let (elem, dims) = declared(m, name);
        assert_eq!(elem, data_type::INT64, "{name}");
        assert_eq!(
            dims,
            vec![Err("batch".into()), Err("sequence".into())],
            "{name}"
        );
    }
}

#[test]
fn bert_classifier_graph_computes_hemis_logits_with_padding() {
    let _g = hemi::no_grad();
    let batch = text_batch();
    for act in ["gelu", "gelu_new"] {
        let cfg = tiny_bert(act);
        let mut net = BertForSequenceClassification::new(&cfg, &mut Generator::new(8)).unwrap();
        net.set_training(false);
        for dtype in [OnnxDType::F32, OnnxDType::F16] {
            let m = export_and_check("bert-classifier", &net, &ExportOptions::new(dtype));
            check_text_inputs(&m);
            let (_, out) = declared(&m, "logits");
            assert_eq!(out, vec![Err("batch".into()), Ok(3)]);
            let ops: Vec<&str> = m
                .graph
                .as_ref()
                .unwrap()
                .node
                .iter()
                .map(|n| n.op_type.as_str())
                .collect();
            assert_eq!(
                ops.iter().filter(|o| **o == "LayerNormalization").count(),
                5
            );
            assert_eq!(
                ops.iter().filter(|o| **o == "Erf").count(),
                if act == "gelu" { 2 } else { 0 }
            );
            let got = run(&m, &text_feeds(&batch));
            let mut reference =
                BertForSequenceClassification::new(&cfg, &mut Generator::new(0)).unwrap();
            reference.load_state_dict(&net.state_dict()).unwrap();
            if dtype == OnnxDType::F16 {
                reference.to_dtype(DType::F16, true).unwrap();
                reference.to_dtype(DType::F32, false).unwrap();
            }
            reference.set_training(false);
            let want = reference
                .forward_text(&batch[0], &batch[1], &batch[2])
                .unwrap();
            assert_close(
                &format!("bert-classifier {act} {dtype:?}"),
                &got["logits"],
                &want,
            );
        }
    }
}

#[test]
fn bert_masked_lm_graph_computes_hemis_logits() {
    let _g = hemi::no_grad();
    let batch = text_batch();
    let cfg = tiny_bert("gelu");
    let mut net = BertForMaskedLM::new(&cfg, &mut Generator::new(9)).unwrap();
    // A non-zero decoder bias, so that the test sees it.
    net.bias
        .set_data(&Tensor::randn(&[50], 0.0, 1.0, DType::F32, &mut Generator::new(10)).unwrap())
        .unwrap();
    net.set_training(false);
    let m = export_and_check("bert-mlm", &net, &ExportOptions::new(OnnxDType::F32));
    check_text_inputs(&m);
    let (_, out) = declared(&m, "logits");
    assert_eq!(
        out,
        vec![Err("batch".into()), Err("sequence".into()), Ok(50)]
    );
    let got = run(&m, &text_feeds(&batch));
    let want = net.forward_text(&batch[0], &batch[1], &batch[2]).unwrap();
    assert_close("bert-mlm", &got["logits"], &want);
}
