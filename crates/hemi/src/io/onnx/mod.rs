//! ONNX export: the protobuf messages of the format (`proto`, written with `prost`'s derive,
//! so no `protoc` is needed), a small graph builder (`Graph`: unique names, initializers from
//! tensors, nodes, inputs and outputs with symbolic dimensions) and the nodes of hemi's layers
//! (`layers`). The ready-made models describe themselves with these through [`OnnxExport`]
//! (`crate::models::onnx`).
//!
//! Files target opset 17 (the first with `LayerNormalization`) and IR version 8, and describe
//! the eval-mode forward: batch norms use their running statistics (`BatchNormalization`
//! nodes, so the file's initializers are the checkpoint's own tensors; onnxruntime folds
//! them into the convolutions when it loads the file), dropout is the identity and so absent.
//!
//! Weights ([`OnnxDType`]): `F32` stores and computes in F32. `F16` stores the weights in
//! F16 (normalisation layers' tensors stay F32, as hemi's mixed-precision presets keep them)
//! and casts them to F32 in the graph (`Cast` nodes, which onnxruntime constant-folds at
//! load time), so the file is about half the size and computes in F32: its only error is the
//! rounding of the weights to F16. Inputs and outputs are the same in both.
//!
//! Why not compute in F16: onnxruntime's CPU provider (1.32, x86-64) has F16 kernels for
//! few of the operators used here (`LayerNormalization` only, of Conv, Gemm, MatMul,
//! BatchNormalization, Softmax, Erf, Tanh, Relu, MaxPool, GlobalAveragePool, Add, Mul); for
//! the rest it inserts `Cast`s around each node and computes in F32, so an F16 graph would
//! round every activation to F16 and pay for the casts without running faster. With the
//! casts on the weights, its optimised graph is the F32 file's (the casts and BatchNorms are
//! folded away). A GPU runtime that wants F16 compute can convert the F32 file.

mod layers;
pub mod proto;

use std::collections::HashSet;

use prost::Message;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use proto::{
    attribute_type, data_type, tensor_shape_proto::dimension, type_proto, AttributeProto,
    GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};

/// The ONNX operator set the files use (17: `LayerNormalization`).
pub const OPSET: i64 = 17;

/// The IR version that goes with [`OPSET`].
pub const IR_VERSION: i64 = 8;

/// How an exported file stores its weights (both compute in F32; see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnnxDType {
    /// Weights stored in F32.
    F32,
    /// Weights stored in F16 (normalisation layers' in F32), cast to F32 in the graph.
    F16,
}

impl OnnxDType {
    /// `f32` or `f16`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(OnnxDType::F32),
            "f16" | "float16" | "fp16" | "half" => Ok(OnnxDType::F16),
            other => Err(Error::arg(
                "onnx export",
                format!("unknown weight dtype {other:?}: f32 or f16"),
            )),
        }
    }

    /// The dtype a weight is stored in: F16 for `F16` unless it belongs to a normalisation
    /// layer.
    pub fn storage(self, is_norm: bool) -> DType {
        match self {
            OnnxDType::F16 if !is_norm => DType::F16,
            _ => DType::F32,
        }
    }

    /// `f32` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            OnnxDType::F32 => "f32",
            OnnxDType::F16 => "f16",
        }
    }
}

/// One dimension of a graph input or output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A size named by a symbol (`batch`, `sequence`), free at run time.
    Symbol(String),
}

impl Dim {
    /// A symbolic dimension.
    pub fn symbol(s: &str) -> Dim {
        Dim::Symbol(s.to_string())
    }
}

/// What an exporter needs besides the model.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// How the weights are stored.
    pub dtype: OnnxDType,
    /// The images an image model takes, `[C, H, W]` (the batch is symbolic); unused by text
    /// models.
    pub image_shape: Option<[usize; 3]>,
    /// Written into the file's `metadata_props` (model name, normalisation, class names).
    pub metadata: Vec<(String, String)>,
}

impl ExportOptions {
    /// `dtype` with no image shape and no metadata.
    pub fn new(dtype: OnnxDType) -> Self {
        ExportOptions {
            dtype,
            image_shape: None,
            metadata: Vec::new(),
        }
    }

    /// The image shape, or an error naming `model`, which needs one.
    pub fn image_shape(&self, model: &str) -> Result<[usize; 3]> {
        self.image_shape.ok_or_else(|| {
            Error::arg(
                "onnx export",
                format!("{model} takes images: give the input shape [C, H, W]"),
            )
        })
    }
}

/// A model that can describe its eval-mode forward as an ONNX graph.
pub trait OnnxExport {
    /// Declares the graph's inputs, adds the nodes of the forward and declares the outputs.
    fn build_onnx(&self, g: &mut Graph, opts: &ExportOptions) -> Result<()>;
}

/// An ONNX graph under construction. Value names are unique: a name asked for twice gets a
/// numbered suffix. Weights are initializers named as the model's `state_dict`.
pub struct Graph {
    name: String,
    dtype: OnnxDType,
    nodes: Vec<NodeProto>,
    initializers: Vec<TensorProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    names: HashSet<String>,
}

/// An attribute holding one int64.
pub fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INT,
        i: v,
        ..Default::default()
    }
}

/// An attribute holding a list of int64.
pub fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INTS,
        ints: v.to_vec(),
        ..Default::default()
    }
}

/// An attribute holding one float.
pub fn attr_float(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::FLOAT,
        f: v,
        ..Default::default()
    }
}

/// The ONNX element type of a hemi dtype.
pub fn onnx_data_type(dtype: DType) -> i32 {
    match dtype {
        DType::F16 => data_type::FLOAT16,
        DType::BF16 => data_type::BFLOAT16,
        DType::F32 => data_type::FLOAT,
        DType::F64 => data_type::DOUBLE,
        DType::I64 => data_type::INT64,
    }
}

fn value_info(name: &str, elem_type: i32, dims: &[Dim]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| proto::tensor_shape_proto::Dimension {
            value: Some(match d {
                Dim::Fixed(n) => dimension::Value::DimValue(*n as i64),
                Dim::Symbol(s) => dimension::Value::DimParam(s.clone()),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type,
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl Graph {
    /// An empty graph named `name` whose weights are stored as `dtype` says.
    pub fn new(name: &str, dtype: OnnxDType) -> Self {
        Graph {
            name: name.into(),
            dtype,
            nodes: Vec::new(),
            initializers: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// How the weights are stored.
    pub fn dtype(&self) -> OnnxDType {
        self.dtype
    }

    /// `hint` if no value has that name yet, else `hint_1`, `hint_2`, ...; reserved.
    fn unique(&mut self, hint: &str) -> String {
        let mut name = hint.to_string();
        let mut i = 0;
        while self.names.contains(&name) {
            i += 1;
            name = format!("{hint}_{i}");
        }
        self.names.insert(name.clone());
        name
    }

    /// Declares a graph input `name` of element type `elem_type` (a
    /// [`proto::data_type`] value) and shape `dims`; returns its value name.
    pub fn input(&mut self, name: &str, elem_type: i32, dims: &[Dim]) -> Result<String> {
        if self.names.contains(name) {
            return Err(Error::Msg(format!(
                "onnx export: input name {name:?} is already used"
            )));
        }
        let name = self.unique(name);
        self.inputs.push(value_info(&name, elem_type, dims));
        Ok(name)
    }

    /// Declares the value `value` a graph output called `name` (the node that computes it is
    /// renamed to write `name`), of element type `elem_type` and shape `dims`.
    pub fn output(&mut self, value: &str, name: &str, elem_type: i32, dims: &[Dim]) -> Result<()> {
        if value != name {
            if self.names.contains(name) {
                return Err(Error::Msg(format!(
                    "onnx export: output name {name:?} is already used"
                )));
            }
            let node = self
                .nodes
                .iter_mut()
                .find(|n| n.output.iter().any(|o| o == value))
                .ok_or_else(|| {
                    Error::Msg(format!(
                        "onnx export: output {value:?} is not computed by a node"
                    ))
                })?;
            for o in node.output.iter_mut().filter(|o| *o == value) {
                *o = name.to_string();
            }
            self.names.insert(name.to_string());
        }
        self.outputs.push(value_info(name, elem_type, dims));
        Ok(())
    }

    fn push_initializer(&mut self, name: &str, dtype: DType, dims: &[usize], raw: Vec<u8>) {
        self.initializers.push(TensorProto {
            dims: dims.iter().map(|&d| d as i64).collect(),
            data_type: onnx_data_type(dtype),
            name: name.into(),
            raw_data: raw,
            ..Default::default()
        });
    }

    /// The weight `t` as an initializer named `name` (its `state_dict` name), stored as
    /// [`OnnxDType::storage`] says; returns the name of an F32 value holding it (the
    /// initializer itself, or a `Cast` of it).
    pub fn param(&mut self, name: &str, t: &Tensor, is_norm: bool) -> Result<String> {
        if !t.dtype().is_float() {
            return Err(Error::dtype(
                "onnx export",
                t.dtype(),
                format!("weight {name} must be a float tensor"),
            ));
        }
        if self.names.contains(name) {
            return Err(Error::Msg(format!(
                "onnx export: weight name {name:?} is used twice"
            )));
        }
        let name = self.unique(name);
        let stored = self.dtype.storage(is_norm);
        let c = t.detach().to_dtype(stored)?.contiguous()?;
        let raw = c.storage().copy_strided(c.layout())?.to_le_bytes()?;
        self.push_initializer(&name, stored, t.shape(), raw);
        if stored == DType::F32 {
            return Ok(name);
        }
        Ok(self.node(
            "Cast",
            &format!("{name}.f32"),
            &[&name],
            vec![attr_int("to", data_type::FLOAT as i64)],
        ))
    }

    /// An int64 constant (shapes, axes, indices) of shape `dims`; returns its name.
    pub fn const_i64(&mut self, hint: &str, values: &[i64], dims: &[usize]) -> String {
        let name = self.unique(hint);
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.push_initializer(&name, DType::I64, dims, raw);
        name
    }

    /// An F32 constant of shape `dims`; returns its name.
    pub fn const_f32(&mut self, hint: &str, values: &[f32], dims: &[usize]) -> String {
        let name = self.unique(hint);
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.push_initializer(&name, DType::F32, dims, raw);
        name
    }

    /// Appends a node `op_type(inputs)` with `attrs`, its one output named after `hint`;
    /// returns that output's name (also the node's name).
    pub fn node(
        &mut self,
        op_type: &str,
        hint: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) -> String {
        let out = self.unique(hint);
        self.nodes.push(NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![out.clone()],
            name: out.clone(),
            op_type: op_type.into(),
            attribute: attrs,
            ..Default::default()
        });
        out
    }

    /// The finished model: IR version 8, opset 17, `metadata` as `metadata_props`.
    pub fn finish(self, metadata: &[(String, String)]) -> ModelProto {
        ModelProto {
            ir_version: IR_VERSION,
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: OPSET,
            }],
            producer_name: "hemi".into(),
            producer_version: env!("CARGO_PKG_VERSION").into(),
            model_version: 1,
            graph: Some(GraphProto {
                node: self.nodes,
                name: self.name,
                initializer: self.initializers,
                input: self.inputs,
                output: self.outputs,
                ..Default::default()
            }),
            metadata_props: metadata
                .iter()
                .map(|(k, v)| StringStringEntryProto {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
            ..Default::default()
        }
    }
}

/// Builds the ONNX model of `model` (named `name` in the graph) as `opts` say.
pub fn build_model(name: &str, model: &dyn OnnxExport, opts: &ExportOptions) -> Result<ModelProto> {
    let mut g = Graph::new(name, opts.dtype);
    model.build_onnx(&mut g, opts)?;
    Ok(g.finish(&opts.metadata))
}

/// The protobuf bytes of `model` (what a `.onnx` file holds).
pub fn encode(model: &ModelProto) -> Vec<u8> {
    model.encode_to_vec()
}

/// Reads a model from protobuf bytes.
pub fn decode(bytes: &[u8]) -> Result<ModelProto> {
    ModelProto::decode(bytes).map_err(|e| Error::Msg(format!("not an ONNX model: {e}")))
}
