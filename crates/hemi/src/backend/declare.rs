//! One declaration per primitive: `primitives!` turns an area's list of primitives into the
//! backend trait (what a backend implements) and the `Storage` methods that dispatch to it
//! (what ops call), with one doc comment for both.
//!
//! ```text
//! primitives! {
//!     /// The area's doc (supertraits: the areas the default bodies use).
//!     pub trait MapOps {
//!         /// What `unary` computes (the doc of the trait method and of `Storage::unary`).
//!         fn unary(&self, layout: &Layout, op: UnaryOp, out: DType) -> Result<Self>;
//!         /// A derived primitive: its default body composes basic ones.
//!         fn binary_assign(&mut self, ..) -> Result<()> { .. }
//!         /// A constructor (no receiver): trait item only; its `Storage` method is written
//!         /// by hand, since only the caller knows which backend it wants.
//!         fn dropout_mask(n: usize, ..) -> Result<Self>;
//!     }
//! }
//! ```
//!
//! The argument types are written once, with `Self`: in the trait `Self` is the backend's
//! buffer, in `impl Storage` it is `Storage`, so `Opt<'_, Self>` becomes `Opt<'_, Storage>`
//! there. The generated `Storage` method binds the receiver's buffer (`dispatch!`), brings
//! every argument to that backend (`Peer`: a `Storage` argument must be on the receiver's
//! device, else an `Error::Device` naming the primitive and both devices; other arguments
//! pass unchanged) and wraps the backend's result back into `Storage`s (`Lift`).

use super::BackendStorage;
use crate::error::{Error, Result};
use crate::tensor::storage::dispatch;
use crate::tensor::{Layout, Storage};
use std::any::Any;

/// An argument of a `Storage` method, brought to the backend of the receiver `like`.
pub trait Peer<B> {
    /// The argument as backend `B`'s method takes it.
    type Out;
    /// The argument on `like`'s backend, or a device error naming `op`.
    fn peer(self, op: &'static str, like: &B) -> Result<Self::Out>;
}

fn mixed(op: &'static str, a: crate::device::Device, b: crate::device::Device) -> Error {
    Error::device(op, format!("inputs on {a} and {b}"))
}

impl<'a, B: BackendStorage> Peer<B> for &'a Storage {
    type Out = &'a B;
    fn peer(self, op: &'static str, like: &B) -> Result<&'a B> {
        dispatch!(self, s => (s as &dyn Any).downcast_ref::<B>())
            .ok_or_else(|| mixed(op, like.device(), self.device()))
    }
}

impl<'a, B: BackendStorage> Peer<B> for &'a mut Storage {
    type Out = &'a mut B;
    fn peer(self, op: &'static str, like: &B) -> Result<&'a mut B> {
        let device = self.device();
        dispatch!(self, s => (s as &mut dyn Any).downcast_mut::<B>())
            .ok_or_else(|| mixed(op, like.device(), device))
    }
}

impl<B, T: Peer<B>> Peer<B> for Option<T> {
    type Out = Option<T::Out>;
    fn peer(self, op: &'static str, like: &B) -> Result<Self::Out> {
        self.map(|t| t.peer(op, like)).transpose()
    }
}

impl<B, T: Peer<B>, U: Peer<B>> Peer<B> for (T, U) {
    type Out = (T::Out, U::Out);
    fn peer(self, op: &'static str, like: &B) -> Result<Self::Out> {
        Ok((self.0.peer(op, like)?, self.1.peer(op, like)?))
    }
}

impl<B, T: Peer<B>, U: Peer<B>, V: Peer<B>> Peer<B> for (T, U, V) {
    type Out = (T::Out, U::Out, V::Out);
    fn peer(self, op: &'static str, like: &B) -> Result<Self::Out> {
        Ok((
            self.0.peer(op, like)?,
            self.1.peer(op, like)?,
            self.2.peer(op, like)?,
        ))
    }
}

/// Arguments that are the same on every backend (shapes, dtypes, scalars, settings).
macro_rules! plain {
    ($($t:ty),* $(,)?) => {$(
        impl<B> Peer<B> for $t {
            type Out = $t;
            fn peer(self, _: &'static str, _: &B) -> Result<$t> {
                Ok(self)
            }
        }
    )*};
}
plain!(bool, f32, f64, usize, crate::dtype::DType);
plain!(super::map::BinaryOp, super::map::UnaryOp);
plain!(super::reduce::Rows, super::reduce::ReduceOp);
plain!(
    super::loss::ClassLoss,
    super::loss::Reduction,
    super::index::AlongDim
);
plain!(
    super::nn::BatchNormGeom,
    super::nn::BatchNormMode,
    super::nn::BlockGrads,
    super::train::SgdFlags,
    super::train::AdamDecay
);
plain!(crate::dtype::convert::Rounding);

/// Arguments passed by reference that are the same on every backend.
macro_rules! plain_ref {
    ($($t:ty),* $(,)?) => {$(
        impl<'a, B> Peer<B> for &'a $t {
            type Out = &'a $t;
            fn peer(self, _: &'static str, _: &B) -> Result<&'a $t> {
                Ok(self)
            }
        }
    )*};
}
plain_ref!(
    Layout,
    [usize],
    super::nn::Conv2dGeom,
    super::nn::Pool2dGeom
);
plain_ref!(
    super::nn::AdaptivePool2dGeom,
    super::nn::AttentionGeom,
    super::nn::Indices
);
plain_ref!(super::train::SgdScalars, super::train::AdamScalars);

impl<'a, B> Peer<B> for &'a mut crate::rng::Generator {
    type Out = &'a mut crate::rng::Generator;
    fn peer(self, _: &'static str, _: &B) -> Result<Self::Out> {
        Ok(self)
    }
}

/// The argument structs that carry buffers: each field brought to the backend as its own
/// argument would be.
macro_rules! peer_struct {
    ($($name:ident { $($field:ident),* $(,)? })*) => {$(
        impl<'a, B: BackendStorage> Peer<B> for $name<'a, Storage> {
            type Out = $name<'a, B>;
            fn peer(self, op: &'static str, like: &B) -> Result<Self::Out> {
                Ok($name {
                    $($field: self.$field.peer(op, like)?,)*
                })
            }
        }
    )*};
}
mod peer_structs {
    use super::super::nn::{Act, ActSaved, Affine, Qkv, Saved};
    use super::super::{loss::ClassSaved, train::AdamState};
    use super::{BackendStorage, Peer, Result, Storage};
    peer_struct! {
        Affine { weight, bias }
        Act { residual, relu }
        ActSaved { y, want_residual }
        Saved { mean, invstd, weight, from_input }
        Qkv { q, k, v }
        ClassSaved { log_probs, counted }
        AdamState { exp_avg, exp_avg_sq, max_exp_avg_sq }
    }
}

/// A backend method's result as the `Storage` method returns it (`Out`): each backend
/// buffer wrapped into its `Storage` variant, everything else unchanged.
pub trait Lift<Out> {
    /// The result with `Storage`s in place of backend buffers.
    fn lift(self) -> Out;
}

impl<B: BackendStorage + Into<Storage>> Lift<Storage> for B {
    fn lift(self) -> Storage {
        self.into()
    }
}

impl<T: Lift<U>, U> Lift<Option<U>> for Option<T> {
    fn lift(self) -> Option<U> {
        self.map(Lift::lift)
    }
}

impl<T: Lift<U>, U, V: Lift<W>, W> Lift<(U, W)> for (T, V) {
    fn lift(self) -> (U, W) {
        (self.0.lift(), self.1.lift())
    }
}

impl<T: Lift<U>, U, V: Lift<W>, W, X: Lift<Y>, Y> Lift<(U, W, Y)> for (T, V, X) {
    fn lift(self) -> (U, W, Y) {
        (self.0.lift(), self.1.lift(), self.2.lift())
    }
}

/// Results that are the same on every backend.
macro_rules! plain_result {
    ($($t:ty),* $(,)?) => {$(
        impl Lift<$t> for $t {
            fn lift(self) -> $t {
                self
            }
        }
    )*};
}
plain_result!(
    (),
    f64,
    u64,
    usize,
    super::nn::Indices,
    super::train::Log2Histogram
);

/// Declares an area's primitives once: the backend trait (`$Trait: BackendStorage`) and
/// the dispatching `Storage` methods (module doc above).
macro_rules! primitives {
    ($(#[$tm:meta])* pub trait $Trait:ident $(: $sup:ident $(+ $more:ident)*)? { $($items:tt)* }) => {
        $crate::backend::declare::primitives!(
            @munch [$(#[$tm])*] [$(+ $sup $(+ $more)*)?] $Trait [] $($items)*
        );
    };

    // One primitive with a shared receiver.
    (@munch $tm:tt $sup:tt $Trait:ident [$($acc:tt)*]
        $(#[$m:meta])* fn $name:ident(&$slf:ident $(, $a:ident: $t:ty)* $(,)?) -> Result<$r:ty> $body:tt
        $($rest:tt)*
    ) => {
        $crate::backend::declare::primitives!(@munch $tm $sup $Trait [$($acc)*
            {shared $slf [$(#[$m])*] $name [$($a: $t),*] [$r] $body}] $($rest)*);
    };

    // One primitive that updates its receiver in place.
    (@munch $tm:tt $sup:tt $Trait:ident [$($acc:tt)*]
        $(#[$m:meta])* fn $name:ident(&mut $slf:ident $(, $a:ident: $t:ty)* $(,)?) -> Result<$r:ty> $body:tt
        $($rest:tt)*
    ) => {
        $crate::backend::declare::primitives!(@munch $tm $sup $Trait [$($acc)*
            {unique $slf [$(#[$m])*] $name [$($a: $t),*] [$r] $body}] $($rest)*);
    };

    // A constructor: no receiver, so no generated `Storage` method.
    (@munch $tm:tt $sup:tt $Trait:ident [$($acc:tt)*]
        $(#[$m:meta])* fn $name:ident($($a:ident: $t:ty),* $(,)?) -> Result<$r:ty> $body:tt
        $($rest:tt)*
    ) => {
        $crate::backend::declare::primitives!(@munch $tm $sup $Trait [$($acc)*
            {constructor [$(#[$m])*] $name [$($a: $t),*] [$r] $body}] $($rest)*);
    };

    (@munch [$(#[$tm:meta])*] [$($sup:tt)*] $Trait:ident [$($item:tt)*]) => {
        $(#[$tm])*
        pub trait $Trait: $crate::backend::BackendStorage $($sup)* {
            $($crate::backend::declare::primitives!(@trait $item);)*
        }

        impl $crate::tensor::Storage {
            $($crate::backend::declare::primitives!(@storage $Trait $item);)*
        }
    };

    (@trait {shared $slf:ident [$(#[$m:meta])*] $name:ident [$($a:ident: $t:ty),*] [$r:ty] $body:tt}) => {
        $(#[$m])*
        fn $name(&$slf, $($a: $t),*) -> $crate::error::Result<$r> $body
    };
    (@trait {unique $slf:ident [$(#[$m:meta])*] $name:ident [$($a:ident: $t:ty),*] [$r:ty] $body:tt}) => {
        $(#[$m])*
        fn $name(&mut $slf, $($a: $t),*) -> $crate::error::Result<$r> $body
    };
    (@trait {constructor [$(#[$m:meta])*] $name:ident [$($a:ident: $t:ty),*] [$r:ty] $body:tt}) => {
        $(#[$m])*
        fn $name($($a: $t),*) -> $crate::error::Result<$r> $body
    };

    (@storage $Trait:ident {shared $slf:ident [$(#[$m:meta])*] $name:ident [$($a:ident: $t:ty),*] [$r:ty] $body:tt}) => {
        $(#[$m])*
        pub fn $name(&self, $($a: $t),*) -> $crate::error::Result<$r> {
            use $crate::backend::declare::{Lift, Peer};
            $crate::tensor::storage::dispatch!(self, s => {
                $(let $a = Peer::peer($a, stringify!($name), s)?;)*
                Ok(Lift::<$r>::lift($Trait::$name(s, $($a),*)?))
            })
        }
    };
    (@storage $Trait:ident {unique $slf:ident [$(#[$m:meta])*] $name:ident [$($a:ident: $t:ty),*] [$r:ty] $body:tt}) => {
        $(#[$m])*
        pub fn $name(&mut self, $($a: $t),*) -> $crate::error::Result<$r> {
            use $crate::backend::declare::{Lift, Peer};
            $crate::tensor::storage::dispatch!(self, s => {
                $(let $a = Peer::peer($a, stringify!($name), &*s)?;)*
                Ok(Lift::<$r>::lift($Trait::$name(s, $($a),*)?))
            })
        }
    };
    (@storage $Trait:ident {constructor $($ignored:tt)*}) => {};
}
pub(crate) use primitives;
