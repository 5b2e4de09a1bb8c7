//! Data types: the `DType` enum, its finfo table, the promotion rule and the element trait
//! that ties a Rust type to its `DType`. Bulk conversions live in `convert`.

pub mod convert;
pub mod fastmath;

use half::{bf16, f16};

/// Storage data type of a tensor.
///
/// Float dtypes: F64 (references only), F32, F16 (IEEE binary16: 1 sign, 5 exponent,
/// 10 mantissa bits), BF16 (1 sign, 8 exponent, 7 mantissa bits). I64 holds labels and
/// indices; it is never differentiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE 754 half precision (binary16): max 65504, ε 2^-10 (`torch.float16`).
    F16,
    /// bfloat16: F32's exponent range with 7 mantissa bits, ε 2^-7 (`torch.bfloat16`).
    BF16,
    /// IEEE 754 single precision (`torch.float32`).
    F32,
    /// IEEE 754 double precision, for reference computations (`torch.float64`).
    F64,
    /// 64-bit signed integers: labels, token ids, indices (`torch.int64`).
    I64,
}

/// Machine limits of a float dtype (as `torch.finfo`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FInfo {
    /// Largest finite value.
    pub max: f64,
    /// Smallest positive normal value.
    pub min_positive_normal: f64,
    /// Smallest positive subnormal value.
    pub min_positive_subnormal: f64,
    /// Distance from 1.0 to the next larger value.
    pub epsilon: f64,
    /// Explicit mantissa (fraction) bits.
    pub mantissa_bits: u32,
    /// Exponent bits.
    pub exponent_bits: u32,
}

impl DType {
    /// Every dtype, half types first.
    pub const ALL: [DType; 5] = [DType::F16, DType::BF16, DType::F32, DType::F64, DType::I64];
    /// The float dtypes hemi trains in.
    pub const TRAINING_FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// F16 or BF16.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// True for F16, BF16, F32 and F64; false for I64.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }

    /// Short lower-case name, as PyTorch spells it (`float16`, `bfloat16`...).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I64 => "int64",
        }
    }

    /// The finfo table; `None` for integer dtypes.
    pub fn finfo(self) -> Option<FInfo> {
        Some(match self {
            DType::F16 => FInfo {
                max: 65504.0,
                min_positive_normal: 2f64.powi(-14),
                min_positive_subnormal: 2f64.powi(-24),
                epsilon: 2f64.powi(-10),
                mantissa_bits: 10,
                exponent_bits: 5,
            },
            DType::BF16 => FInfo {
                max: f64::from(bf16::MAX.to_f32()),
                min_positive_normal: 2f64.powi(-126),
                min_positive_subnormal: 2f64.powi(-133),
                epsilon: 2f64.powi(-7),
                mantissa_bits: 7,
                exponent_bits: 8,
            },
            DType::F32 => FInfo {
                max: f64::from(f32::MAX),
                min_positive_normal: f64::from(f32::MIN_POSITIVE),
                min_positive_subnormal: 2f64.powi(-149),
                epsilon: f64::from(f32::EPSILON),
                mantissa_bits: 23,
                exponent_bits: 8,
            },
            DType::F64 => FInfo {
                max: f64::MAX,
                min_positive_normal: f64::MIN_POSITIVE,
                min_positive_subnormal: f64::from_bits(1),
                epsilon: f64::EPSILON,
                mantissa_bits: 52,
                exponent_bits: 11,
            },
            DType::I64 => return None,
        })
    }

    /// The type kernels compute and accumulate in for this storage dtype: F64 for F64, F32
    /// for the others (the half types and F32 itself).
    pub fn compute_type(self) -> DType {
        if self == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// Unit roundoff of storing a value in this dtype (half of epsilon); 0 for integers.
    pub fn unit_roundoff(self) -> f64 {
        self.finfo().map_or(0.0, |f| f.epsilon / 2.0)
    }

    /// Rank in the promotion lattice among floats: F16 and BF16 are both "half", and
    /// mixing the two promotes to F32 (PyTorch's rule).
    fn float_rank(self) -> u8 {
        match self {
            DType::F16 | DType::BF16 => 1,
            DType::F32 => 2,
            DType::F64 => 3,
            DType::I64 => 0,
        }
    }

    /// The dtype of an op that mixes `self` and `other` (PyTorch's promotion among floats):
    /// equal dtypes stay; the wider float wins; F16 with BF16 gives F32; a float with an
    /// integer gives the float.
    pub fn promote(self, other: DType) -> DType {
        if self == other {
            return self;
        }
        match (self.is_float(), other.is_float()) {
            (true, false) => self,
            (false, true) => other,
            (false, false) => DType::I64,
            (true, true) => {
                let (a, b) = (self.float_rank(), other.float_rank());
                if a == b {
                    // F16 vs BF16: neither holds the other, F32 holds both.
                    DType::F32
                } else if a > b {
                    self
                } else {
                    other
                }
            }
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The one element trait: a Rust type a tensor stores (F16, BF16, F32, F64, I64), with its
/// dtype and exact conversions through f64. Backends' buffers, `Tensor::from_vec` /
/// `to_vec` and the kernels' generic code are all written over it (candle's `WithDType`
/// is the model); `FloatDType` narrows it to the types kernels compute in.
pub trait WithDType: Copy + Send + Sync + Default + PartialOrd + std::fmt::Debug + 'static {
    /// The dtype of tensors storing this type.
    const DTYPE: DType;
    /// `v` rounded to this type (nearest-even; floats to I64 truncate toward zero).
    fn from_f64(v: f64) -> Self;
    /// This value as f64 (exact for every dtype but I64 beyond 2^53).
    fn to_f64(self) -> f64;
    /// Appends the value's little-endian bytes (`DTYPE.size_in_bytes()` of them).
    fn write_le(self, out: &mut Vec<u8>);
    /// The value from its little-endian bytes; `b` holds exactly `DTYPE.size_in_bytes()`.
    fn read_le(b: &[u8]) -> Self;
}

macro_rules! with_dtype {
    ($t:ty, $dtype:ident, $from:expr, $to:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$dtype;
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn read_le(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
        }
    };
}
with_dtype!(f16, F16, f16::from_f64, |x: f16| x.to_f64());
with_dtype!(bf16, BF16, bf16::from_f64, |x: bf16| x.to_f64());
with_dtype!(f32, F32, |v| v as f32, f64::from);
with_dtype!(f64, F64, |v| v, |x| x);
with_dtype!(i64, I64, |v| v as i64, |x| x as f64);

/// A type kernels compute in: `f32` (for F16, BF16 and F32 tensors) or `f64` (for F64),
/// the precision contract's "every sum in at least F32".
pub trait FloatDType:
    WithDType
    + num_traits::Float
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
{
    /// The error function (F32: `fastmath::erf_f32`, within 2.5 ulp and vectorisable).
    fn erf(self) -> Self;
    /// e^x in loops that must vectorise (F32: `fastmath::exp_f32`, within 1.5 ulp; F64:
    /// `exp`).
    fn exp_fast(self) -> Self;
    /// `s` as F32 values when this type is `f32` (for kernels that take F32 beside F16/BF16).
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        same_slice(s)
    }
    /// `s` as F32 values when this type is `f32`.
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        same_slice_mut(s)
    }
}

impl FloatDType for f32 {
    #[inline(always)]
    fn erf(self) -> Self {
        fastmath::erf_f32(self)
    }
    #[inline(always)]
    fn exp_fast(self) -> Self {
        fastmath::exp_f32(self)
    }
}

impl FloatDType for f64 {
    fn erf(self) -> Self {
        libm::erf(self)
    }
    fn exp_fast(self) -> Self {
        self.exp()
    }
}

/// Runs `$body` with the type alias `$T` bound to the element type of `$dtype`.
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::dtype::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::dtype::DType::I64 => {
                type $T = i64;
                $body
            }
        }
    };
}

/// `s` reinterpreted as `[U]` when `T` and `U` are the same type, else `None`: lets generic
/// kernels take a type-specific fast path (an F32 buffer handed to an F32-only routine).
pub fn same_slice<T: 'static, U: 'static>(s: &[T]) -> Option<&[U]> {
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>())
        // SAFETY: T and U are the same type, so the pointer, length and lifetime carry over.
        .then(|| unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<U>(), s.len()) })
}

/// `same_slice`, mutable.
pub fn same_slice_mut<T: 'static, U: 'static>(s: &mut [T]) -> Option<&mut [U]> {
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>())
        // SAFETY: as in `same_slice`; the exclusive borrow moves into the result.
        .then(|| unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<U>(), s.len()) })
}
