//! The ONNX protobuf messages hemi writes (and its tests read back), with the field numbers
//! and wire types of the official `onnx.proto` (IR version 8). Only the fields hemi uses are
//! declared: protobuf readers skip fields they do not know, and these structs skip the
//! fields of a file written by others that hemi does not know.
//!
//! Enum fields are declared as `int32` (the same varint on the wire) with the values as
//! constants, which keeps the structs plain.

/// `TensorProto.DataType` values.
pub mod data_type {
    /// `float` (F32).
    pub const FLOAT: i32 = 1;
    /// `int32`.
    pub const INT32: i32 = 6;
    /// `int64`.
    pub const INT64: i32 = 7;
    /// `bool`.
    pub const BOOL: i32 = 9;
    /// IEEE half precision (F16).
    pub const FLOAT16: i32 = 10;
    /// `double` (F64).
    pub const DOUBLE: i32 = 11;
    /// bfloat16.
    pub const BFLOAT16: i32 = 16;
}

/// `AttributeProto.AttributeType` values.
pub mod attribute_type {
    /// One float (`f`).
    pub const FLOAT: i32 = 1;
    /// One int64 (`i`).
    pub const INT: i32 = 2;
    /// One byte string (`s`).
    pub const STRING: i32 = 3;
    /// One tensor (`t`).
    pub const TENSOR: i32 = 4;
    /// A list of floats (`floats`).
    pub const FLOATS: i32 = 6;
    /// A list of int64 (`ints`).
    pub const INTS: i32 = 7;
}

/// `ModelProto`: the file's top-level message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelProto {
    /// The IR version the file follows (8 for opset 17).
    #[prost(int64, tag = "1")]
    pub ir_version: i64,
    /// The operator sets the graph uses (the default domain `""` at a version).
    #[prost(message, repeated, tag = "8")]
    pub opset_import: Vec<OperatorSetIdProto>,
    /// The tool that wrote the file.
    #[prost(string, tag = "2")]
    pub producer_name: String,
    /// Its version.
    #[prost(string, tag = "3")]
    pub producer_version: String,
    /// Reverse-DNS namespace of the model.
    #[prost(string, tag = "4")]
    pub domain: String,
    /// The model's own version number.
    #[prost(int64, tag = "5")]
    pub model_version: i64,
    /// Free text.
    #[prost(string, tag = "6")]
    pub doc_string: String,
    /// The computation.
    #[prost(message, optional, tag = "7")]
    pub graph: Option<GraphProto>,
    /// Named strings (hemi: the model's name, input normalisation, class names).
    #[prost(message, repeated, tag = "14")]
    pub metadata_props: Vec<StringStringEntryProto>,
}

/// `OperatorSetIdProto`: an operator set and its version.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OperatorSetIdProto {
    /// `""` is the default ONNX domain (`ai.onnx`).
    #[prost(string, tag = "1")]
    pub domain: String,
    /// The opset version.
    #[prost(int64, tag = "2")]
    pub version: i64,
}

/// `StringStringEntryProto`: one key/value pair.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StringStringEntryProto {
    /// The key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `GraphProto`: nodes in topological order, initializers (constant tensors), inputs and
/// outputs.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GraphProto {
    /// The nodes, each after the nodes that produce its inputs.
    #[prost(message, repeated, tag = "1")]
    pub node: Vec<NodeProto>,
    /// The graph's name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// Constant tensors (the weights), referred to by name.
    #[prost(message, repeated, tag = "5")]
    pub initializer: Vec<TensorProto>,
    /// Free text.
    #[prost(string, tag = "10")]
    pub doc_string: String,
    /// The graph's inputs.
    #[prost(message, repeated, tag = "11")]
    pub input: Vec<ValueInfoProto>,
    /// The graph's outputs.
    #[prost(message, repeated, tag = "12")]
    pub output: Vec<ValueInfoProto>,
    /// Types of intermediate values (optional; hemi writes none).
    #[prost(message, repeated, tag = "13")]
    pub value_info: Vec<ValueInfoProto>,
}

/// `NodeProto`: one operator application.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeProto {
    /// Input value names; `""` for an omitted optional input.
    #[prost(string, repeated, tag = "1")]
    pub input: Vec<String>,
    /// Output value names.
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
    /// The node's name (unique in the graph).
    #[prost(string, tag = "3")]
    pub name: String,
    /// The operator (`Conv`, `Gemm`, ...).
    #[prost(string, tag = "4")]
    pub op_type: String,
    /// The operator's domain (`""`: ONNX).
    #[prost(string, tag = "7")]
    pub domain: String,
    /// The operator's attributes.
    #[prost(message, repeated, tag = "5")]
    pub attribute: Vec<AttributeProto>,
    /// Free text.
    #[prost(string, tag = "6")]
    pub doc_string: String,
}

/// `AttributeProto`: a named attribute of a node; `type` says which value field holds it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AttributeProto {
    /// The attribute's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Free text.
    #[prost(string, tag = "13")]
    pub doc_string: String,
    /// An [`attribute_type`] value.
    #[prost(int32, tag = "20")]
    pub r#type: i32,
    /// `FLOAT`.
    #[prost(float, tag = "2")]
    pub f: f32,
    /// `INT`.
    #[prost(int64, tag = "3")]
    pub i: i64,
    /// `STRING`.
    #[prost(bytes = "vec", tag = "4")]
    pub s: Vec<u8>,
    /// `TENSOR`.
    #[prost(message, optional, tag = "5")]
    pub t: Option<TensorProto>,
    /// `FLOATS`.
    #[prost(float, repeated, tag = "7")]
    pub floats: Vec<f32>,
    /// `INTS`.
    #[prost(int64, repeated, tag = "8")]
    pub ints: Vec<i64>,
}

/// `TensorProto`: a constant tensor. hemi writes the elements as little-endian `raw_data`;
/// readers also accept the typed fields.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    /// The shape.
    #[prost(int64, repeated, tag = "1")]
    pub dims: Vec<i64>,
    /// A [`data_type`] value.
    #[prost(int32, tag = "2")]
    pub data_type: i32,
    /// FLOAT elements (when `raw_data` is empty).
    #[prost(float, repeated, tag = "4")]
    pub float_data: Vec<f32>,
    /// INT32, INT16, INT8, UINT16, UINT8, BOOL, FLOAT16 and BFLOAT16 elements (the last two
    /// as their bit patterns).
    #[prost(int32, repeated, tag = "5")]
    pub int32_data: Vec<i32>,
    /// INT64 elements.
    #[prost(int64, repeated, tag = "7")]
    pub int64_data: Vec<i64>,
    /// The name (an initializer's name is the value name nodes use).
    #[prost(string, tag = "8")]
    pub name: String,
    /// The elements as little-endian bytes, row-major.
    #[prost(bytes = "vec", tag = "9")]
    pub raw_data: Vec<u8>,
    /// DOUBLE elements.
    #[prost(double, repeated, tag = "10")]
    pub double_data: Vec<f64>,
    /// Free text.
    #[prost(string, tag = "12")]
    pub doc_string: String,
}

/// `ValueInfoProto`: a named value with its type (graph inputs and outputs).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueInfoProto {
    /// The value's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its type.
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<TypeProto>,
    /// Free text.
    #[prost(string, tag = "3")]
    pub doc_string: String,
}

/// `TypeProto`: hemi uses only tensor types.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TypeProto {
    /// The kind of value.
    #[prost(oneof = "type_proto::Value", tags = "1")]
    pub value: Option<type_proto::Value>,
    /// A denotation (`IMAGE`, `TEXT`, ...), optional.
    #[prost(string, tag = "6")]
    pub denotation: String,
}

/// Nested messages of `TypeProto`.
pub mod type_proto {
    /// `TypeProto.Tensor`: element type and shape.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Tensor {
        /// A [`super::data_type`] value.
        #[prost(int32, tag = "1")]
        pub elem_type: i32,
        /// The shape, each dimension a number or a symbol.
        #[prost(message, optional, tag = "2")]
        pub shape: Option<super::TensorShapeProto>,
    }

    /// `TypeProto.value` (only `tensor_type` here).
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        /// A dense tensor.
        #[prost(message, tag = "1")]
        TensorType(Tensor),
    }
}

/// `TensorShapeProto`: dimensions, each a number or a symbol.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {
    /// The dimensions, outermost first.
    #[prost(message, repeated, tag = "1")]
    pub dim: Vec<tensor_shape_proto::Dimension>,
}

/// Nested messages of `TensorShapeProto`.
pub mod tensor_shape_proto {
    /// `TensorShapeProto.Dimension`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Dimension {
        /// A fixed size or a symbolic name.
        #[prost(oneof = "dimension::Value", tags = "1, 2")]
        pub value: Option<dimension::Value>,
        /// A denotation (`DATA_BATCH`, `DATA_CHANNEL`, ...), optional.
        #[prost(string, tag = "3")]
        pub denotation: String,
    }

    /// Nested types of `Dimension`.
    pub mod dimension {
        /// `Dimension.value`.
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            /// A fixed size.
            #[prost(int64, tag = "1")]
            DimValue(i64),
            /// A symbolic size (`batch`, `sequence`), the same symbol the same size.
            #[prost(string, tag = "2")]
            DimParam(String),
        }
    }
}
