//! Data types: the `DType` enum, its finfo table, the promotion rule and the element trait
//! that ties a Rust type to its `DType`. Bulk conversions live in `convert`.

pub mod convert;

use half::{bf16, f16};

/// Storage data type of a tensor.
///
/// Float dtypes: F64 (references only), F32, F16 (IEEE binary16: 1 sign, 5 exponent,
/// 10 mantissa bits), BF16 (1 sign, 8 exponent, 7 mantissa bits). I64 holds labels and
/// indices; it is never differentiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F16,
    BF16,
    F32,
    F64,
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

/// A Rust type stored in tensors.
pub trait Element: Copy + Send + Sync + 'static + std::fmt::Debug {
    const DTYPE: DType;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promotion_follows_pytorch() {
        use DType::*;
        assert_eq!(F16.promote(F32), F32);
        assert_eq!(BF16.promote(F16), F32);
        assert_eq!(BF16.promote(BF16), BF16);
        assert_eq!(F64.promote(F16), F64);
        assert_eq!(I64.promote(BF16), BF16);
    }

    #[test]
    fn finfo_matches_half() {
        let f = DType::F16.finfo().unwrap();
        assert_eq!(f.max, f64::from(f16::MAX.to_f32()));
        assert_eq!(f.min_positive_normal, f64::from(f16::MIN_POSITIVE.to_f32()));
        assert_eq!(f.epsilon, f64::from(f16::EPSILON.to_f32()));
        assert_eq!(
            f.min_positive_subnormal,
            f64::from(f16::from_bits(1).to_f32())
        );
        let b = DType::BF16.finfo().unwrap();
        assert_eq!(b.epsilon, f64::from(bf16::EPSILON.to_f32()));
        assert_eq!(
            b.min_positive_normal,
            f64::from(bf16::MIN_POSITIVE.to_f32())
        );
        assert_eq!(
            b.min_positive_subnormal,
            f64::from(bf16::from_bits(1).to_f32())
        );
        assert!(DType::I64.finfo().is_none());
    }
}
