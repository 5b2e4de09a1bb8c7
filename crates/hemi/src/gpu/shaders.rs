//! The WGSL kernels, generated as text per variant (dtypes, op, F16 route); the context
//! compiles each text once (`GpuContext::launch` caches pipelines by their source).
//!
//! Memory: F32 one element a 4-byte word, F16 and BF16 two elements a word (element `2i` in
//! the low half, the little-endian order of the host's bytes), whatever the shader's view.
//! Arithmetic is F32 in every kernel (sums included); a result is rounded once when stored.
//!
//! F16 has two routes, picked per launch (`GpuContext::native_f16`):
//! - native, where the adapter has wgpu's `SHADER_F16` (requested at device creation;
//!   lavapipe has it): kernels that read F16 values (maps, reductions, matmul, the
//!   convolutions) bind those inputs as `array<f16>` under `enable f16;` and widen each
//!   element with `f32(x)`, exact; matmul and convolution accumulate in F32.
//! - packed, the fallback (and `gpu::with_packed_halves`, which tests it on lavapipe): every
//!   buffer an `array<u32>`, each half converted to F32 in integer arithmetic (`h2f`).
//!
//! Stores of F16, on both routes, round on the bits (`f2h`, round-to-nearest-even in integer
//! arithmetic, overflow to ±inf, subnormals, NaN payload kept) and write whole words, two
//! elements a thread, so no two threads write one word. Why not WGSL's `f16(x)`: WGSL leaves
//! the rounding of an inexact conversion and the result of a NaN to the implementation, and
//! the test that decided it (`wgsl_native_f16_conversion_drops_nan_payloads_on_lavapipe`, over
//! 2^24 F32 patterns covering every rounding case) found lavapipe rounding every finite value
//! as the CPU does but returning every NaN as the canonical 0x7e00, its payload lost, where
//! the CPU keeps it. Storing hand-rounded bits into an `array<f16>` would need
//! `bitcast<vec2<f16>>(u32)`, which naga does not implement yet (gfx-rs/wgpu#8896), so the
//! bits go out as words. BF16 (no WGSL type) is packed on both routes: `bf2f` widens it
//! exactly, `f2bf` rounds to nearest-even. Widening quiets a signalling NaN, as the CPU's
//! conversions (`vcvtph2ps`, `half`) do, so casts are the CPU's bit for bit
//! (`f16_and_bf16_casts_match_the_cpu_on_a_dense_set` holds both routes to it).
//!
//! Bindings: 0 the parameters (`p`, `u32` words, read-only and so uniform), 1 the output,
//! 2.. the inputs (read_write: `GpuContext::launch` says why).
//! Strided operands: `p[0]` elements, `p[1]` rank `r`, `p[2]`, `p[3]` two scalar words,
//! `p[4..4+r]` the shape, then per operand `k` its offset and `r` strides at
//! `4 + r + k(r + 1)`.

use crate::dtype::DType;

const CONVERSIONS: &str = r#"
fn h2f(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        return bitcast<f32>(bitcast<u32>(f32(m) * 5.9604644775390625e-8) | s);
    }
    if (e == 31u) {
        // A NaN comes back quiet, as the CPU's conversions (vcvtph2ps, half) return it.
        let quiet = select(0u, 0x400000u, m != 0u);
        return bitcast<f32>(s | 0x7f800000u | quiet | (m << 13u));
    }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}
fn f2h(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let s = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return s | 0x7e00u | ((a >> 13u) & 0x3ffu);
    }
    if (a >= 0x477ff000u) {
        return s | 0x7c00u;
    }
    if (a >= 0x38800000u) {
        let r = a - 0x38000000u;
        let q = r >> 13u;
        let rem = r & 0x1fffu;
        var h = q;
        if (rem > 0x1000u || (rem == 0x1000u && (q & 1u) == 1u)) {
            h = h + 1u;
        }
        return s | h;
    }
    if (a < 0x33000000u) {
        return s;
    }
    let e = a >> 23u;
    let m = (a & 0x7fffffu) | 0x800000u;
    let shift = 126u - e;
    let q = m >> shift;
    let rem = m & ((1u << shift) - 1u);
    let halfway = 1u << (shift - 1u);
    var h = q;
    if (rem > halfway || (rem == halfway && (q & 1u) == 1u)) {
        h = h + 1u;
    }
    return s | h;
}
fn bf2f(h: u32) -> f32 {
    // Exact; a NaN comes back quiet, as the CPU's conversion returns it.
    let quiet = select(0u, 0x400000u, (h & 0x7fffu) > 0x7f80u);
    return bitcast<f32>((h << 16u) | quiet);
}
fn f2bf(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}
// NaN by its bits: lavapipe's compiler folded `a != a` to false.
fn hemi_isnan(a: f32) -> bool {
    return (bitcast<u32>(a) & 0x7fffffffu) > 0x7f800000u;
}
fn hemi_max(a: f32, b: f32) -> f32 {
    return select(b, a, hemi_isnan(a) || a > b);
}
fn hemi_min(a: f32, b: f32) -> f32 {
    return select(b, a, hemi_isnan(a) || a < b);
}
fn hemi_erf(x: f32) -> f32 {
    // WGSL has no erf: Abramowitz & Stegun 7.1.26, which errs by 1.5e-7 at most (absolute),
    // within F32 GELU's tolerance.
    let a = abs(x);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
        + 0.254829592) * t * exp(-a * a);
    return select(y, -y, x < 0.0);
}
fn hemi_pow(x: f32, c: f32) -> f32 {
    if (c == 2.0) {
        return x * x;
    }
    if (c == 1.0) {
        return x;
    }
    if (c == 0.0) {
        return 1.0;
    }
    let r = pow(abs(x), c);
    if (x < 0.0) {
        if (c != floor(c)) {
            return bitcast<f32>(0x7fc00000u);
        }
        let odd = (c * 0.5) != floor(c * 0.5);
        return select(r, -r, odd);
    }
    return r;
}
fn hemi_tanh(x: f32) -> f32 {
    // tanh(±15) is ±1 in F32; the clamp keeps drivers' exp-based tanh from inf/inf.
    return tanh(clamp(x, -15.0, 15.0));
}
"#;

/// Binding `binding` as an input named `name` of dtype `d`, with its loaders
/// `ld_<name>(i) -> f32` (the value) and `lb_<name>(i) -> u32` (the bits) for the shader
/// dtypes, and `nz_<name>(i) -> bool` (nonzero, NaN included) for every dtype. With
/// `native` an F16 input is an `array<f16>` with `ld_<name>` only (the caller enables f16).
fn input(name: &str, binding: u32, d: DType, native: bool) -> String {
    if native && d == DType::F16 {
        return format!(
            "@group(0) @binding({binding}) var<storage, read_write> {name}: array<f16>;
             fn ld_{name}(i: u32) -> f32 {{ return f32({name}[i]); }}
"
        );
    }
    let body = match d {
        DType::F32 => format!(
            "fn lb_{name}(i: u32) -> u32 {{ return {name}[i]; }}\n\
             fn ld_{name}(i: u32) -> f32 {{ return bitcast<f32>({name}[i]); }}\n\
             fn nz_{name}(i: u32) -> bool {{ return ({name}[i] & 0x7fffffffu) != 0u; }}\n"
        ),
        DType::F16 | DType::BF16 => {
            let val = if d == DType::F16 {
                "h2f(lb_NAME(i))".replace("NAME", name)
            } else {
                "bf2f(lb_NAME(i))".replace("NAME", name)
            };
            format!(
                "fn lb_{name}(i: u32) -> u32 {{ return ({name}[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu; }}\n\
                 fn ld_{name}(i: u32) -> f32 {{ return {val}; }}\n\
                 fn nz_{name}(i: u32) -> bool {{ return (lb_{name}(i) & 0x7fffu) != 0u; }}\n"
            )
        }
        // Two words an element, the low one first; F64's sign bit alone is a zero.
        DType::F64 | DType::I64 => {
            let mask = if d == DType::F64 {
                "0x7fffffffu"
            } else {
                "0xffffffffu"
            };
            format!(
                "fn nz_{name}(i: u32) -> bool {{ return ({name}[2u * i] | ({name}[2u * i + 1u] & {mask})) != 0u; }}\n"
            )
        }
    };
    // read_write although only read: blocks of one segment share a wgpu buffer, whose usage
    // wgpu tracks as a whole, so every block binds with the output's access.
    format!("@group(0) @binding({binding}) var<storage, read_write> {name}: array<u32>;\n{body}")
}

/// The start of a strided kernel: `enable f16;` where an input is `array<f16>`, the
/// parameters, the output (words), the conversions and `off`.
fn header(f16: bool) -> String {
    let enable = if f16 { "enable f16;\n" } else { "" };
    format!(
        "{enable}@group(0) @binding(0) var<storage, read> p: array<u32>;\n\
         @group(0) @binding(1) var<storage, read_write> out: array<u32>;\n{CONVERSIONS}\n\
         fn off(k: u32, e: u32) -> u32 {{\n\
             let r = p[1];\n\
             let base = 4u + r + k * (r + 1u);\n\
             var o = p[base];\n\
             var rem = e;\n\
             for (var d = r; d > 0u; d = d - 1u) {{\n\
                 let sz = p[3u + d];\n\
                 o = o + (rem % sz) * p[base + d];\n\
                 rem = rem / sz;\n\
             }}\n\
             return o;\n\
         }}\n"
    )
}

/// How an elementwise kernel reads an operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Load {
    /// The value as F32 (a shader dtype).
    Value,
    /// The bits (a copy; a shader dtype).
    Bits,
    /// 1.0 where nonzero (NaN included), else 0.0 (any dtype: `where`'s condition).
    Nonzero,
}

/// An elementwise kernel over the output's shape: `expr` of `a`, `b`, `c` (the operands in
/// order, each read through its layout as `Load` says; `x` is `a`), the scalars `c0`, `c1`,
/// and the functions in `prelude`; stored as `out`. With `bits`, the first operand's bits
/// are copied (`expr` is ignored; one input of `out`'s dtype). With `native`, F16 values are
/// read from `array<f16>` bindings (bits, and `where`'s condition, are read as words on
/// either route). A half output is stored a word (two elements) per thread on either route.
pub fn map(
    inputs: &[(DType, Load)],
    prelude: &str,
    expr: &str,
    out: DType,
    bits: bool,
    native: bool,
) -> String {
    let native_in = |d: DType, load: Load| native && d == DType::F16 && load == Load::Value;
    let f16 = inputs.iter().any(|&(d, l)| native_in(d, l));
    let mut s = header(f16);
    s += prelude;
    let names = ["a", "b", "c"];
    for (k, &(d, load)) in inputs.iter().enumerate() {
        s += &input(names[k], 2 + k as u32, d, native_in(d, load));
    }
    let (ty, conv) = if bits {
        ("u32", "v")
    } else {
        (
            "f32",
            match out {
                DType::F32 => "bitcast<u32>(v)",
                DType::F16 => "f2h(v)",
                _ => "f2bf(v)",
            },
        )
    };
    s += &format!("fn value(e: u32) -> {ty} {{\n    let c0 = bitcast<f32>(p[2]);\n    let c1 = bitcast<f32>(p[3]);\n");
    for (k, &(_, load)) in inputs.iter().enumerate() {
        let n = names[k];
        s += &match load {
            Load::Bits => format!("    let {n} = lb_{n}(off({k}u, e));\n"),
            Load::Value => format!("    let {n} = ld_{n}(off({k}u, e));\n"),
            Load::Nonzero => format!("    let {n} = select(0.0, 1.0, nz_{n}(off({k}u, e)));\n"),
        };
    }
    if !bits && !inputs.is_empty() {
        s += "    let x = a;\n";
    }
    s += &format!(
        "    _ = c0; _ = c1;\n    return {};\n}}\nfn conv(v: {ty}) -> u32 {{ return {conv}; }}\n",
        if bits { "a" } else { expr }
    );
    s += "@compute @workgroup_size(64)\n\
          fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {\n\
              let t = gid.x + gid.y * nw.x * 64u;\n\
              let n = p[0];\n";
    s += match out {
        DType::F32 => "    if (t >= n) { return; }\n    out[t] = conv(value(t));\n}\n",
        _ => {
            "    let e = 2u * t;\n    if (e >= n) { return; }\n    var w = conv(value(e));\n    if (e + 1u < n) { w = w | (conv(value(e + 1u)) << 16u); }\n    out[t] = w;\n}\n"
        }
    };
    s
}

/// A row reduction: one workgroup of 64 per output row `o < p[0]`, over the `p[2]` (`inner`)
/// elements `o*inner + j` of the input's row-major order; F32 results (`out` is F32).
/// `op`: `sum`, `mean`, `max`, `min`, `var` (`p[3]` the correction).
/// With `native`, an F16 input is read as `array<f16>`.
pub fn reduce(input_dtype: DType, op: &str, native: bool) -> String {
    let native = native && input_dtype == DType::F16;
    let mut s = header(native);
    s += &input("a", 2, input_dtype, native);
    let (init, combine) = match op {
        "max" => ("bitcast<f32>(0xff800000u)", "hemi_max(x, y)"),
        "min" => ("bitcast<f32>(0x7f800000u)", "hemi_min(x, y)"),
        _ => ("0.0", "x + y"),
    };
    s += &format!(
        "var<workgroup> sh: array<f32, 64>;\n\
         fn combine(x: f32, y: f32) -> f32 {{ return {combine}; }}\n\
         fn tree(l: u32) -> f32 {{\n\
             for (var s = 32u; s > 0u; s = s >> 1u) {{\n\
                 if (l < s) {{ sh[l] = combine(sh[l], sh[l + s]); }}\n\
                 workgroupBarrier();\n\
             }}\n\
             let r = sh[0];\n\
             workgroupBarrier();\n\
             return r;\n\
         }}\n\
         @compute @workgroup_size(64)\n\
         fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{\n\
             let o = wid.x + wid.y * nw.x;\n\
             let l = lid.x;\n\
             let inner = p[2];\n\
             let valid = o < p[0];\n\
             let cnt = select(0u, inner, valid);\n\
             var acc = {init};\n\
             for (var j = l; j < cnt; j = j + 64u) {{\n\
                 let y = ld_a(off(0u, o * inner + j));\n\
                 acc = combine(acc, y);\n\
             }}\n\
             sh[l] = acc;\n\
             workgroupBarrier();\n\
             var r = tree(l);\n"
    );
    match op {
        "mean" => s += "    r = r / f32(inner);\n",
        "var" => {
            s += "    let mean = r / f32(inner);\n\
                  var sq = 0.0;\n\
                  for (var j = l; j < cnt; j = j + 64u) {\n\
                      let d = ld_a(off(0u, o * inner + j)) - mean;\n\
                      sq = sq + d * d;\n\
                  }\n\
                  sh[l] = sq;\n\
                  workgroupBarrier();\n\
                  let ss = tree(l);\n\
                  let dof = f32(max(i32(inner) - i32(p[3]), 0));\n\
                  r = ss / dof;\n"
        }
        _ => {}
    }
    s += "    if (valid && l == 0u) { out[o] = bitcast<u32>(r); }\n}\n";
    s
}

/// Batched matmul, 16×16 output tiles, F32 accumulation, F32 output `[batch, m, n]`
/// (+ an F32 bias `[n]` at binding 4 when `bias`). Parameters: `m, n, k, batch rank br,
/// a offset, a row stride, a k stride, b offset, b k stride, b column stride`, then the
/// batch shape, a's and b's batch strides (`br` words each). Workgroup `(col tile, row
/// tile, batch)`. With `native`, F16 operands are read as `array<f16>`.
pub fn matmul(a: DType, b: DType, bias: bool, native: bool) -> String {
    let (na, nb) = (native && a == DType::F16, native && b == DType::F16);
    let mut s = header(na || nb);
    s += &input("a", 2, a, na);
    s += &input("b", 3, b, nb);
    if bias {
        s += &input("bias", 4, DType::F32, false);
    }
    s += "var<workgroup> ta: array<array<f32, 16>, 16>;\n\
          var<workgroup> tb: array<array<f32, 16>, 16>;\n\
          @compute @workgroup_size(16, 16)\n\
          fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {\n\
              let m = p[0];\n\
              let n = p[1];\n\
              let k = p[2];\n\
              let br = p[3];\n\
              var abase = p[4];\n\
              var bbase = p[7];\n\
              var rem = wid.z;\n\
              for (var d = br; d > 0u; d = d - 1u) {\n\
                  let sz = p[10u + d];\n\
                  let i = rem % sz;\n\
                  rem = rem / sz;\n\
                  abase = abase + i * p[10u + br + d];\n\
                  bbase = bbase + i * p[10u + 2u * br + d];\n\
              }\n\
              let row = wid.y * 16u + lid.y;\n\
              let col = wid.x * 16u + lid.x;\n\
              var acc = 0.0;\n\
              for (var t = 0u; t < k; t = t + 16u) {\n\
                  let ka = t + lid.x;\n\
                  var va = 0.0;\n\
                  if (row < m && ka < k) { va = ld_a(abase + row * p[5] + ka * p[6]); }\n\
                  ta[lid.y][lid.x] = va;\n\
                  let kb = t + lid.y;\n\
                  var vb = 0.0;\n\
                  if (kb < k && col < n) { vb = ld_b(bbase + kb * p[8] + col * p[9]); }\n\
                  tb[lid.y][lid.x] = vb;\n\
                  workgroupBarrier();\n\
                  for (var q = 0u; q < 16u; q = q + 1u) {\n\
                      acc = acc + ta[lid.y][q] * tb[q][lid.x];\n\
                  }\n\
                  workgroupBarrier();\n\
              }\n\
              if (row < m && col < n) {\n";
    if bias {
        s += "        acc = acc + ld_bias(col);\n";
    }
    s += "        out[(wid.z * m + row) * n + col] = bitcast<u32>(acc);\n    }\n}\n";
    s
}

// ----- kernels over contiguous F32 buffers ---------------------------------------------------
//
// The primitives below read their operands as contiguous F32 buffers (`GpuStorage::f32_view`:
// the cast kernel, exact for every shader dtype), compute one F32 result per thread into an
// F32 buffer, and round it once into the output dtype with the cast kernel. The
// convolutions take F16 operands as they are on the native route (`array<f16>`, widened by
// `f32(..)` as they are read; `GpuStorage::conv_view`). I64 operands
// (ids, indices) are read and written as two words per element, the low word first.

/// A kernel's bindings after the parameters: `(name, element type)` for binding 1 (the
/// output), 2, 3, ...; every binding read_write (`GpuContext::launch` says why), and the
/// thread index `t` of a one-dimensional launch (`groups_1d`).
/// An `f16` binding enables f16 (the convolutions' native F16 operands, read as `f32(..)`).
fn contiguous(bindings: &[(&str, &str)], body: &str) -> String {
    let mut s = String::new();
    if bindings.iter().any(|&(_, ty)| ty == "f16") {
        s += "enable f16;\n";
    }
    s += "@group(0) @binding(0) var<storage, read> p: array<u32>;\n";
    for (k, (name, ty)) in bindings.iter().enumerate() {
        s += &format!(
            "@group(0) @binding({}) var<storage, read_write> {name}: array<{ty}>;\n",
            k + 1
        );
    }
    s += CONVERSIONS;
    s += U64;
    s += "@compute @workgroup_size(64)\n\
          fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {\n\
              let t = gid.x + gid.y * nw.x * 64u;\n";
    s += body;
    s += "}\n";
    s
}

/// 64-bit unsigned arithmetic on `vec2<u32>` (`x` the low word): WGSL has no `u64`.
const U64: &str = r#"
fn mul_wide(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return vec2<u32>((p00 & 0xffffu) | (mid << 16u), a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}
fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let w = mul_wide(a.x, b.x);
    return vec2<u32>(w.x, w.y + a.x * b.y + a.y * b.x);
}
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}
// a >> s for 0 < s < 32.
fn shr64(a: vec2<u32>, s: u32) -> vec2<u32> {
    return vec2<u32>((a.x >> s) | (a.y << (32u - s)), a.y >> s);
}
fn lt64(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.y < b.y || (a.y == b.y && a.x < b.x);
}
"#;

/// `unary_backward`'s and `minmax_backward`'s helpers, prepended to the elementwise kernel
/// (`map`'s `prelude`).
pub const BACKWARD_HELPERS: &str = r#"
fn hemi_gelu_slope(s: f32) -> f32 {
    return 0.5 * (1.0 + hemi_erf(s * 0.70710678118654752)) + s * exp(-0.5 * s * s) * 0.3989422804014327;
}
fn hemi_gelu_tanh_slope(s: f32) -> f32 {
    let k = 0.7978845608028654;
    let c3 = 0.044715;
    let t = hemi_tanh(k * (s + c3 * s * s * s));
    return 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * k * (1.0 + 3.0 * c3 * s * s);
}
fn hemi_sign(s: f32) -> f32 {
    return select(select(select(0.0, -1.0, s < 0.0), 1.0, s > 0.0), s, hemi_isnan(s));
}
// The share of the gradient `x` gets in maximum (`is_max`) or minimum against `y`.
fn hemi_minmax_weight(x: f32, y: f32, is_max: bool) -> f32 {
    if (x == y) {
        return 0.5;
    }
    return select(0.0, 1.0, (x > y) == is_max);
}
"#;

/// Dropout's scale factors: `out[i] = keep53(seed, i, threshold) ? scale : 0` (F32), the
/// CPU's splitmix64 hash in 64-bit emulation. Parameters: `n`, seed (lo, hi), threshold
/// (lo, hi), the scale's bits.
pub fn dropout_mask() -> String {
    contiguous(
        &[("out", "u32")],
        "    if (t >= p[0]) { return; }\n\
         let seed = vec2<u32>(p[1], p[2]);\n\
         let idx = add64(vec2<u32>(t, 0u), vec2<u32>(1u, 0u));\n\
         var z = add64(seed, mul64(idx, vec2<u32>(0x7F4A7C15u, 0x9E3779B9u)));\n\
         z = mul64(z ^ shr64(z, 30u), vec2<u32>(0x1CE4E5B9u, 0xBF58476Du));\n\
         z = mul64(z ^ shr64(z, 27u), vec2<u32>(0x133111EBu, 0x94D049BBu));\n\
         z = z ^ shr64(z, 31u);\n\
         let keep = !lt64(shr64(z, 11u), vec2<u32>(p[3], p[4]));\n\
         out[t] = select(0u, p[5], keep);\n",
    )
}

/// The gradient of a max/min reduction, one thread per run: `g[o] / ties` at the elements of
/// run `o` equal to `m[o]` (NaN matching NaN), 0 elsewhere. Parameters: outer, inner.
pub fn extreme_backward() -> String {
    contiguous(
        &[("out", "f32"), ("x", "f32"), ("m", "f32"), ("g", "f32")],
        "    let o = t;\n\
         if (o >= p[0]) { return; }\n\
         let inner = p[1];\n\
         let mo = m[o];\n\
         var ties = 0u;\n\
         for (var i = 0u; i < inner; i = i + 1u) {\n\
             let v = x[o * inner + i];\n\
             if (v == mo || (hemi_isnan(v) && hemi_isnan(mo))) { ties = ties + 1u; }\n\
         }\n\
         let share = g[o] / f32(ties);\n\
         for (var i = 0u; i < inner; i = i + 1u) {\n\
             let v = x[o * inner + i];\n\
             let hit = v == mo || (hemi_isnan(v) && hemi_isnan(mo));\n\
             out[o * inner + i] = select(0.0, share, hit);\n\
         }\n",
    )
}

/// The extreme of each row and its index (the first on ties, the first NaN), one thread per
/// row: values F32 at `out`, indices I64 at `idx`. Parameters: rows, len, inner, is_max.
pub fn extreme_dim() -> String {
    contiguous(
        &[("out", "f32"), ("x", "f32"), ("idx", "u32")],
        "    let r = t;\n\
         if (r >= p[0]) { return; }\n\
         let len = p[1];\n\
         let inner = p[2];\n\
         let start = (r / inner) * len * inner + r % inner;\n\
         var best = x[start];\n\
         var at = 0u;\n\
         if (!hemi_isnan(best)) {\n\
             for (var k = 1u; k < len; k = k + 1u) {\n\
                 let v = x[start + k * inner];\n\
                 if (hemi_isnan(v)) { best = v; at = k; break; }\n\
                 if ((p[3] == 1u && v > best) || (p[3] == 0u && v < best)) { best = v; at = k; }\n\
             }\n\
         }\n\
         out[r] = best;\n\
         idx[2u * r] = at;\n\
         idx[2u * r + 1u] = 0u;\n",
    )
}

/// The gradient of `extreme_dim`, one thread per input element: `g[r]` where the element is
/// at `index[r]` of its row `r`, else 0. Parameters: elements, len, inner, the indices'
/// offset (in elements).
pub fn extreme_dim_backward() -> String {
    contiguous(
        &[("out", "f32"), ("g", "f32"), ("idx", "u32")],
        "    if (t >= p[0]) { return; }\n\
         let len = p[1];\n\
         let inner = p[2];\n\
         let o = t / (len * inner);\n\
         let k = (t / inner) % len;\n\
         let r = o * inner + t % inner;\n\
         out[t] = select(0.0, g[r], idx[2u * (p[3] + r)] == k);\n",
    )
}

/// `out[o, j, i] = src[o, ids[j], i]`, one thread per output element. Parameters: elements,
/// size, inner, ids count, ids' offset (in elements).
pub fn index_select() -> String {
    contiguous(
        &[("out", "f32"), ("src", "f32"), ("ids", "u32")],
        "    if (t >= p[0]) { return; }\n\
         let size = p[1];\n\
         let inner = p[2];\n\
         let nids = p[3];\n\
         let i = t % inner;\n\
         let j = (t / inner) % nids;\n\
         let o = t / (inner * nids);\n\
         let id = ids[2u * (p[4] + j)];\n\
         out[t] = src[(o * size + id) * inner + i];\n",
    )
}

/// The backward of `index_select`: one thread per output element `(o, row, i)`, adding the
/// gradient rows `j` with `ids[j] == row` in the order of `j` (deterministic, no atomics).
/// Parameters: elements, size, inner, ids count, ids' offset.
pub fn index_add_zeros() -> String {
    contiguous(
        &[("out", "f32"), ("g", "f32"), ("ids", "u32")],
        "    if (t >= p[0]) { return; }\n\
         let size = p[1];\n\
         let inner = p[2];\n\
         let nids = p[3];\n\
         let i = t % inner;\n\
         let row = (t / inner) % size;\n\
         let o = t / (inner * size);\n\
         var acc = 0.0;\n\
         for (var j = 0u; j < nids; j = j + 1u) {\n\
             if (ids[2u * (p[4] + j)] == row) { acc = acc + g[(o * nids + j) * inner + i]; }\n\
         }\n\
         out[t] = acc;\n",
    )
}

/// One part of a concatenation: `out[o, start + j, i] = part[o, j, i]`, one thread per
/// element of the part. Parameters: part elements, part len, inner, total len, start.
pub fn cat_part() -> String {
    contiguous(
        &[("out", "f32"), ("part", "f32")],
        "    if (t >= p[0]) { return; }\n\
         let len = p[1];\n\
         let inner = p[2];\n\
         let i = t % inner;\n\
         let j = (t / inner) % len;\n\
         let o = t / (inner * len);\n\
         out[(o * p[3] + p[4] + j) * inner + i] = part[t];\n",
    )
}

/// The convolution's geometry as parameters 1..: n, c_in, h, w, c_out, kh, kw, stride,
/// padding, dilation (each vertical then horizontal), groups, h_out, w_out; with helpers.
const CONV_GEOM: &str =
    "    let n = p[1]; let cin = p[2]; let h = p[3]; let w = p[4]; let cout = p[5];\n\
    let kh = p[6]; let kw = p[7]; let sh = p[8]; let sw = p[9]; let ph = p[10]; let pw = p[11];\n\
    let dh = p[12]; let dw = p[13]; let groups = p[14]; let ho = p[15]; let wo = p[16];\n\
    let cin_g = cin / groups; let cout_g = cout / groups;\n\
    _ = n;\n";

/// Direct convolution, one thread per output element `(n, co, oh, ow)`, F32 sums in the
/// order (input channel, kernel row, kernel column); `bias` (F32 `[c_out]`) when `p[17]`.
/// `x` and `wt` are `array<x_ty>`, `array<w_ty>` (`f32`, or `f16` on the native route).
pub fn conv2d(x_ty: &str, w_ty: &str) -> String {
    contiguous(
        &[("out", "f32"), ("x", x_ty), ("wt", w_ty), ("bias", "f32")],
        &format!(
            "    if (t >= p[0]) {{ return; }}\n{CONV_GEOM}\
             let ow = t % wo;\n\
             let oh = (t / wo) % ho;\n\
             let co = (t / (wo * ho)) % cout;\n\
             let b = t / (wo * ho * cout);\n\
             let grp = co / cout_g;\n\
             var acc = 0.0;\n\
             for (var cl = 0u; cl < cin_g; cl = cl + 1u) {{\n\
                 let ci = grp * cin_g + cl;\n\
                 for (var i = 0u; i < kh; i = i + 1u) {{\n\
                     let ih = i32(oh * sh + i * dh) - i32(ph);\n\
                     if (ih < 0 || ih >= i32(h)) {{ continue; }}\n\
                     for (var j = 0u; j < kw; j = j + 1u) {{\n\
                         let iw = i32(ow * sw + j * dw) - i32(pw);\n\
                         if (iw < 0 || iw >= i32(w)) {{ continue; }}\n\
                         acc = acc + f32(x[((b * cin + ci) * h + u32(ih)) * w + u32(iw)])\n\
                             * f32(wt[((co * cin_g + cl) * kh + i) * kw + j]);\n\
                     }}\n\
                 }}\n\
             }}\n\
             if (p[17] == 1u) {{ acc = acc + bias[co]; }}\n\
             out[t] = acc;\n"
        ),
    )
}

/// The convolution's input gradient, one thread per input element `(n, ci, ih, iw)`: the
/// output positions whose taps read it, in the order (output channel, kernel row, column).
/// `dy` and `wt` as in [`conv2d`].
pub fn conv2d_backward_input(dy_ty: &str, w_ty: &str) -> String {
    contiguous(
        &[("out", "f32"), ("dy", dy_ty), ("wt", w_ty)],
        &format!(
            "    if (t >= p[0]) {{ return; }}\n{CONV_GEOM}\
             let iw = t % w;\n\
             let ih = (t / w) % h;\n\
             let ci = (t / (w * h)) % cin;\n\
             let b = t / (w * h * cin);\n\
             let grp = ci / cin_g;\n\
             let cl = ci % cin_g;\n\
             var acc = 0.0;\n\
             for (var cq = 0u; cq < cout_g; cq = cq + 1u) {{\n\
                 let co = grp * cout_g + cq;\n\
                 for (var i = 0u; i < kh; i = i + 1u) {{\n\
                     let num_h = i32(ih + ph) - i32(i * dh);\n\
                     if (num_h < 0 || u32(num_h) % sh != 0u) {{ continue; }}\n\
                     let oh = u32(num_h) / sh;\n\
                     if (oh >= ho) {{ continue; }}\n\
                     for (var j = 0u; j < kw; j = j + 1u) {{\n\
                         let num_w = i32(iw + pw) - i32(j * dw);\n\
                         if (num_w < 0 || u32(num_w) % sw != 0u) {{ continue; }}\n\
                         let ow = u32(num_w) / sw;\n\
                         if (ow >= wo) {{ continue; }}\n\
                         acc = acc + f32(dy[((b * cout + co) * ho + oh) * wo + ow])\n\
                             * f32(wt[((co * cin_g + cl) * kh + i) * kw + j]);\n\
                     }}\n\
                 }}\n\
             }}\n\
             out[t] = acc;\n"
        ),
    )
}

/// The convolution's weight gradient, one thread per weight element `(co, cl, i, j)`: the
/// sum over images and output pixels of input × output gradient. `x` and `dy` as in
/// [`conv2d`].
pub fn conv2d_backward_weight(x_ty: &str, dy_ty: &str) -> String {
    contiguous(
        &[("out", "f32"), ("x", x_ty), ("dy", dy_ty)],
        &format!(
            "    if (t >= p[0]) {{ return; }}\n{CONV_GEOM}\
             let j = t % kw;\n\
             let i = (t / kw) % kh;\n\
             let cl = (t / (kw * kh)) % cin_g;\n\
             let co = t / (kw * kh * cin_g);\n\
             let ci = (co / cout_g) * cin_g + cl;\n\
             var acc = 0.0;\n\
             for (var b = 0u; b < n; b = b + 1u) {{\n\
                 for (var oh = 0u; oh < ho; oh = oh + 1u) {{\n\
                     let ih = i32(oh * sh + i * dh) - i32(ph);\n\
                     if (ih < 0 || ih >= i32(h)) {{ continue; }}\n\
                     for (var ow = 0u; ow < wo; ow = ow + 1u) {{\n\
                         let iw = i32(ow * sw + j * dw) - i32(pw);\n\
                         if (iw < 0 || iw >= i32(w)) {{ continue; }}\n\
                         acc = acc + f32(x[((b * cin + ci) * h + u32(ih)) * w + u32(iw)])\n\
                             * f32(dy[((b * cout + co) * ho + oh) * wo + ow]);\n\
                     }}\n\
                 }}\n\
             }}\n\
             out[t] = acc;\n"
        ),
    )
}

/// The pool's geometry as parameters 1..: h, w, kernel, stride, padding (each vertical then
/// horizontal), h_out, w_out.
const POOL_GEOM: &str =
    "    let h = p[1]; let w = p[2]; let kh = p[3]; let kw = p[4]; let sh = p[5];\n\
    let sw = p[6]; let ph = p[7]; let pw = p[8]; let ho = p[9]; let wo = p[10];\n";

/// Max pooling, one thread per output: the window's maximum (the first on ties; a NaN wins,
/// the last one) at `out`, its flat input position (plane included) at `arg` (u32), and
/// its position within the plane at `idx` (I64).
pub fn max_pool2d() -> String {
    contiguous(
        &[("out", "f32"), ("x", "f32"), ("arg", "u32"), ("idx", "u32")],
        &format!(
            "    if (t >= p[0]) {{ return; }}\n{POOL_GEOM}\
             let ow = t % wo;\n\
             let oh = (t / wo) % ho;\n\
             let plane = (t / (wo * ho)) * h * w;\n\
             var best = 0.0;\n\
             var at = 0xffffffffu;\n\
             var nan = 0xffffffffu;\n\
             for (var i = 0u; i < kh; i = i + 1u) {{\n\
                 let ih = i32(oh * sh + i) - i32(ph);\n\
                 if (ih < 0 || ih >= i32(h)) {{ continue; }}\n\
                 for (var j = 0u; j < kw; j = j + 1u) {{\n\
                     let iw = i32(ow * sw + j) - i32(pw);\n\
                     if (iw < 0 || iw >= i32(w)) {{ continue; }}\n\
                     let k = u32(ih) * w + u32(iw);\n\
                     let v = x[plane + k];\n\
                     if (hemi_isnan(v)) {{ nan = k; }}\n\
                     else if (at == 0xffffffffu || v > best) {{ best = v; at = k; }}\n\
                 }}\n\
             }}\n\
             if (nan != 0xffffffffu) {{ at = nan; best = x[plane + nan]; }}\n\
             out[t] = best;\n\
             arg[t] = plane + at;\n\
             if (p[11] == 1u) {{ idx[2u * t] = at; idx[2u * t + 1u] = 0u; }}\n"
        ),
    )
}

/// Max pooling's backward, one thread per input element: the output gradients whose maximum
/// came from it, added in output order. Parameters: input elements, then the pool's geometry.
pub fn max_pool2d_backward() -> String {
    contiguous(
        &[("out", "f32"), ("dy", "f32"), ("arg", "u32")],
        &format!(
            "    if (t >= p[0]) {{ return; }}\n{POOL_GEOM}\
             let iw = t % w;\n\
             let ih = (t / w) % h;\n\
             let pl = t / (w * h);\n\
             var acc = 0.0;\n\
             // Only the windows that can hold (ih, iw).\n\
             let h0 = select(0u, (ih + ph - kh) / sh + 1u, ih + ph >= kh);\n\
             let w0 = select(0u, (iw + pw - kw) / sw + 1u, iw + pw >= kw);\n\
             for (var oh = h0; oh < ho && oh * sh <= ih + ph; oh = oh + 1u) {{\n\
                 let top = i32(oh * sh) - i32(ph);\n\
                 if (i32(ih) < top || i32(ih) >= top + i32(kh)) {{ continue; }}\n\
                 for (var ow = w0; ow < wo && ow * sw <= iw + pw; ow = ow + 1u) {{\n\
                     let left = i32(ow * sw) - i32(pw);\n\
                     if (i32(iw) < left || i32(iw) >= left + i32(kw)) {{ continue; }}\n\
                     let o = (pl * ho + oh) * wo + ow;\n\
                     if (arg[o] == t) {{ acc = acc + dy[o]; }}\n\
                 }}\n\
             }}\n\
             out[t] = acc;\n"
        ),
    )
}

/// Stochastic rounding of F32 values into F16 (`p[1] == 0`: one 64-bit draw per element,
/// `bits[2i]` low word) or BF16 (`p[1] == 1`: one draw per four elements, 16 bits each,
/// lowest first): the CPU's `stochastic_round_f16` / `_bf16` on the same bits. The output
/// holds each result's 16 bits in a word of its own (`u32`), packed by the caller.
pub fn stochastic_round() -> String {
    contiguous(
        &[("out", "u32"), ("x", "f32"), ("bits", "u32")],
        r#"    if (t >= p[0]) { return; }
    let v = x[t];
    if (p[1] == 1u) {
        let word = bits[2u * (t / 4u) + (t % 4u) / 2u];
        let r = (word >> (16u * (t % 2u))) & 0xffffu;
        if (hemi_isnan(v) || abs(v) > bitcast<f32>(0x7f7f0000u)) {
            out[t] = f2bf(v);
        } else {
            out[t] = (bitcast<u32>(v) + r) >> 16u;
        }
        return;
    }
    let a = abs(v);
    if (hemi_isnan(a) || a > 65504.0) {
        out[t] = f2h(v);
        return;
    }
    let nearest = f2h(a);
    var down = nearest;
    if (h2f(nearest) > a) { down = nearest - 1u; }
    let lo = h2f(down);
    var mag = down;
    if (a != lo) {
        // u < (a - lo) / (up - lo) with u = (bits >> 11) / 2^53: both differences are exact
        // in F32, the quotient q too (a power-of-two divisor), and the test is the integer
        // comparison bits >> 11 < ceil(q * 2^53).
        let q = (a - lo) / (h2f(down + 1u) - lo);
        let qb = bitcast<u32>(q);
        let m = (qb & 0x7fffffu) | 0x800000u;
        let e = i32(qb >> 23u) - 127 + 30;
        var thr = vec2<u32>(0u, 0u);
        if (e >= 32) {
            thr = vec2<u32>(0u, m << u32(e - 32));
        } else if (e > 8) {
            thr = vec2<u32>(m << u32(e), m >> u32(32 - e));
        } else if (e >= 0) {
            thr = vec2<u32>(m << u32(e), 0u);
        } else if (e > -24) {
            let s = u32(-e);
            thr = vec2<u32>((m + (1u << s) - 1u) >> s, 0u);
        } else {
            thr = vec2<u32>(1u, 0u);
        }
        let k = shr64(vec2<u32>(bits[2u * t], bits[2u * t + 1u]), 11u);
        if (lt64(k, thr)) { mag = down + 1u; }
    }
    out[t] = mag | select(0u, 0x8000u, (bitcast<u32>(v) >> 31u) == 1u);
"#,
    )
}

/// Packs 16-bit results held one a word (`stochastic_round`'s output) two to a word.
pub fn pack_halves() -> String {
    contiguous(
        &[("out", "u32"), ("src", "u32")],
        "    let n = p[0];\n\
         let e = 2u * t;\n\
         if (e >= n) { return; }\n\
         var w = src[e] & 0xffffu;\n\
         if (e + 1u < n) { w = w | (src[e + 1u] << 16u); }\n\
         out[t] = w;\n",
    )
}
