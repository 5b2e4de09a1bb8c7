//! Autocast: every op is in the policy table and behaves as its entry says; scopes nest and
//! are per thread; parameter casts are cached for the outermost scope with gradients still
//! reaching the F32 parameters; backward is not autocast.
//!
//! The tests that run ops are in `autocast_suite.rs`, shared with the GPU backend's suite
//! (`../gpu/models.rs`); here they run on the CPU.

use std::collections::BTreeSet;

use hemi::amp::{autocast_enabled, policy};
use hemi::Device;

/// The device the shared tests run on.
const DEVICE: Device = Device::Cpu;

/// The CPU is always there.
macro_rules! on_device {
    ($name:expr) => {};
}

include!("autocast_suite.rs");

/// Public functions of the op layer that return tensors, read from the source: each is an
/// op and must have a policy.
fn ops_in_source() -> BTreeSet<String> {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(format!("{src}/ops"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .filter(|p| !p.ends_with("autocast.rs") && !p.ends_with("mod.rs"))
        .collect();
    files.push(format!("{src}/tensor/view.rs").into());
    files.push(format!("{src}/tensor/mod.rs").into());
    let mut names = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, _) in text.match_indices("pub fn ") {
            let rest = &text[i + 7..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let sig = &rest[..rest.find('{').unwrap_or(rest.len())];
            if sig.contains("-> Result<Tensor>") || sig.contains("-> Result<(Tensor") {
                names.insert(name);
            }
        }
    }
    names
}

#[test]
fn every_op_has_exactly_one_policy_and_the_table_names_only_ops() {
    let ops = ops_in_source();
    assert!(ops.len() > 50, "the source scan found only {ops:?}");
    let table: Vec<&str> = POLICY.iter().map(|(n, _)| *n).collect();
    let unique: BTreeSet<&str> = table.iter().copied().collect();
    assert_eq!(unique.len(), table.len(), "an op appears twice in POLICY");
    let missing: Vec<&String> = ops.iter().filter(|o| policy(o).is_none()).collect();
    assert!(
        missing.is_empty(),
        "ops without an autocast policy: {missing:?}"
    );
    let stale: Vec<&&str> = table.iter().filter(|n| !ops.contains(**n)).collect();
    assert!(stale.is_empty(), "POLICY names non-ops: {stale:?}");
}

#[test]
fn f64_and_integer_inputs_are_never_cast() {
    let _g = autocast(DType::F16);
    assert_eq!(
        call("matmul", DType::F64, DType::F64).unwrap().dtype(),
        DType::F64
    );
    assert_eq!(
        call("exp", DType::F64, DType::F64).unwrap().dtype(),
        DType::F64
    );
    assert_eq!(
        call("sum", DType::F64, DType::F64).unwrap().dtype(),
        DType::F64
    );
}

#[test]
fn scopes_nest_disable_and_restore() {
    assert_eq!(autocast_dtype(), None);
    {
        let _a = autocast(DType::F16);
        assert_eq!(autocast_dtype(), Some(DType::F16));
        {
            let _b = autocast(DType::BF16);
            assert_eq!(autocast_dtype(), Some(DType::BF16));
            {
                let _c = autocast_enabled(DType::F16, false);
                assert_eq!(autocast_dtype(), None);
                assert_eq!(
                    call("linear", DType::F32, DType::F32).unwrap().dtype(),
                    DType::F32
                );
            }
            assert_eq!(autocast_dtype(), Some(DType::BF16));
        }
        assert_eq!(autocast_dtype(), Some(DType::F16));
        // Autocast "to F32" is a disabled scope.
        let _d = autocast(DType::F32);
        assert_eq!(autocast_dtype(), None);
    }
    assert_eq!(autocast_dtype(), None);
}

#[test]
fn autocast_is_per_thread() {
    let _g = autocast(DType::F16);
    let other = std::thread::spawn(|| {
        (
            autocast_dtype(),
            call("linear", DType::F32, DType::F32).unwrap().dtype(),
        )
    })
    .join()
    .unwrap();
    assert_eq!(other, (None, DType::F32));
    assert_eq!(
        call("linear", DType::F32, DType::F32).unwrap().dtype(),
        DType::F16
    );
}

/// The table says what DESIGN.md's autocast policy says for the ops it names.
#[test]
fn table_matches_the_design() {
    use CastPolicy::*;
    let expect: &[(&[&str], CastPolicy)] = &[
        (&["matmul", "linear", "conv2d"], LowerPrecision),
        (
            &[
                "softmax",
                "log_softmax",
                "cross_entropy",
                "nll_loss",
                "mse_loss",
                "layer_norm",
                "exp",
                "log",
                "pow_scalar",
                "sum",
                "mean",
                "gelu",
                "var",
            ],
            Fp32,
        ),
        (&["batch_norm", "batch_norm_act"], Fp32Statistics),
        (&["add", "mul", "cat", "stack", "where_cond"], Promote),
        (
            &["relu", "max_pool2d", "reshape", "transpose", "dropout"],
            PassThrough,
        ),
    ];
    for (names, want) in expect {
        for n in *names {
            assert_eq!(policy(n), Some(*want), "policy of {n}");
        }
    }
}
