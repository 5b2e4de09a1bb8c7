//! The one error type of hemi. Every fallible entry point returns `Result<T>`; user input
//! (shapes, dtypes, files) never panics, it comes back as an `Error` that names what was wrong.

use crate::dtype::DType;

/// Everything that can go wrong in hemi, each variant naming the op and what it was given.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Shapes that do not fit together, e.g. `matmul: [2, 3] x [4, 5]`.
    #[error("{op}: shape mismatch: {msg}")]
    Shape {
        /// The op (or function) that failed, as PyTorch names it where there is one.
        op: &'static str,
        /// The shapes involved and what was expected of them.
        msg: String,
    },

    /// A dtype the op does not accept, or a mix it cannot handle.
    #[error("{op}: unsupported dtype {dtype:?}: {msg}")]
    DType {
        /// The op (or function) that failed, as PyTorch names it where there is one.
        op: &'static str,
        /// The offending dtype.
        dtype: DType,
        /// What the op accepts instead.
        msg: String,
    },

    /// A dimension index out of range for the tensor's rank.
    #[error("{op}: dim {dim} out of range for a tensor of rank {rank}")]
    Dim {
        /// The op (or function) that failed, as PyTorch names it where there is one.
        op: &'static str,
        /// The dim as given (negative values count from the end).
        dim: isize,
        /// The tensor's number of dims.
        rank: usize,
    },

    /// An index value (label, embedding id, index_select entry) out of range.
    #[error("{op}: index {index} out of range for size {size}")]
    Index {
        /// The op (or function) that failed, as PyTorch names it where there is one.
        op: &'static str,
        /// The offending index value.
        index: i64,
        /// The size of the indexed dim (valid indices are `0..size`).
        size: usize,
    },

    /// A bad argument that is not a shape or dtype (negative probability, zero stride...).
    #[error("{op}: invalid argument: {msg}")]
    Arg {
        /// The op (or function) that failed, as PyTorch names it where there is one.
        op: &'static str,
        /// What was wrong with the argument.
        msg: String,
    },

    /// A device that is absent, unusable or mixed with another in one op (names both).
    #[error("{op}: device error: {msg}")]
    Device {
        /// The op (or function) that failed, as PyTorch names it where there is one.
        op: &'static str,
        /// What was wrong: the devices involved, the missing library and its fix.
        msg: String,
    },

    /// Misuse of autograd (backward from a non-scalar, from a tensor without a graph...).
    #[error("autograd: {0}")]
    Autograd(String),

    /// A file that could not be read or written, with the path.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory involved.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Data that is malformed (a truncated file, a wrong magic number...), with the path.
    #[error("{path}: {msg}")]
    Data {
        /// The file (or data set) the bad data came from.
        path: String,
        /// What is wrong with it.
        msg: String,
    },

    /// Training stopped on request (Ctrl-C, SIGTERM): where it stopped and what was saved.
    #[error("interrupted: {0}")]
    Interrupted(String),

    /// Training diverged (non-finite losses, a collapsed loss scale).
    #[error("{0}")]
    Diverged(String),

    /// Anything else, with a message.
    #[error("{0}")]
    Msg(String),
}

/// `std::result::Result` with hemi's [`Error`]; what every fallible function returns.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Shape`] for `op` with a message naming the shapes.
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }
    /// An [`Error::Device`] for `op`.
    pub fn device(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Device {
            op,
            msg: msg.into(),
        }
    }
    /// An [`Error::Arg`] for `op`.
    pub fn arg(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Arg {
            op,
            msg: msg.into(),
        }
    }
    /// An [`Error::DType`] for `op` given `dtype`; `msg` says what it accepts.
    pub fn dtype(op: &'static str, dtype: DType, msg: impl Into<String>) -> Self {
        Error::DType {
            op,
            dtype,
            msg: msg.into(),
        }
    }
}

/// `bail!(Error::shape(...))`-style early return.
#[macro_export]
macro_rules! bail {
    ($e:expr) => {
        return Err($e)
    };
}
