//! Mixed precision: autocast (the op policy table lives at the op entry layer,
//! `crate::ops::autocast`, because every op consults it; it is re-exported here), loss
//! scaling (`GradScaler`, PyTorch semantics plus hysteresis and min/max scale), F32 master
//! weights for F16 models (`Fp16Optimizer`, apex's FP16_Optimizer) and the precision presets.

pub mod master;
pub mod policy;
pub mod precision;
pub mod rounding;
pub mod scaler;

pub use crate::ops::autocast::{
    autocast, autocast_dtype, autocast_enabled, cached_casts, is_autocast_enabled, policy,
    AutocastGuard, CastPolicy, POLICY,
};
pub use crate::ops::autocast::{autocast_pinned, Pins};
pub use master::{Fp16Optimizer, LossScaling, MasterConfig};
pub use policy::{PolicyScope, PrecisionPolicy};
pub use precision::{AmpOptimizer, Precision};
pub use rounding::Rounding;
pub use scaler::{FoundInfSync, GradScaler, GradScalerConfig, LossScale, ScalerState};
