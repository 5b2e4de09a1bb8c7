//! The WGSL kernels, generated as text per variant (dtypes, op); the context compiles each
//! text once (`GpuContext::launch` caches pipelines by their source).
//!
//! Every buffer is an `array<u32>`: F32 one element a word, F16 and BF16 two elements a
//! word (element `2i` in the low half, the little-endian order of the host's bytes). Halves
//! convert to F32 exactly and back with round-to-nearest-even in integer arithmetic (`f2h`,
//! `f2bf`), so the results do not depend on a driver's conversion or on `SHADER_F16`. A
//! kernel writing a half dtype computes a whole word (two elements) per thread, so no two
//! threads write one word.
//!
//! Bindings: 0 the parameters (`p`, `u32` words, read-only and so uniform), 1 the output,
//! 2.. the inputs (read_write: `GpuContext::launch` says why).
//! Strided operands: `p[0]` elements, `p[1]` rank `r`, `p[2]`, `p[3]` two scalar words,
//! `p[4..4+r]` the shape, then per operand `k` its offset and `r` strides at
//! `4 + r + k(r + 1)`.

use crate::dtype::DType;

/// How a kernel stores a dtype: `F32` (a word) or a half (two per word).
fn storage_kind(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => unreachable!("only F32/F16/BF16 reach the shaders"),
    }
}

const CONVERSIONS: &str = r#"
fn h2f(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        return bitcast<f32>(bitcast<u32>(f32(m) * 5.9604644775390625e-8) | s);
    }
    if (e == 31u) {
        return bitcast<f32>(s | 0x7f800000u | (m << 13u));
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
/// `ld_<name>(i) -> f32` (the value) and `lb_<name>(i) -> u32` (the bits).
fn input(name: &str, binding: u32, d: DType) -> String {
    let body = match d {
        DType::F32 => format!(
            "fn lb_{name}(i: u32) -> u32 {{ return {name}[i]; }}\n\
             fn ld_{name}(i: u32) -> f32 {{ return bitcast<f32>({name}[i]); }}\n"
        ),
        DType::F16 | DType::BF16 => {
            let val = if d == DType::F16 {
                "h2f(lb_NAME(i))".replace("NAME", name)
            } else {
                "bitcast<f32>(lb_NAME(i) << 16u)".replace("NAME", name)
            };
            format!(
                "fn lb_{name}(i: u32) -> u32 {{ return ({name}[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu; }}\n\
                 fn ld_{name}(i: u32) -> f32 {{ return {val}; }}\n"
            )
        }
        _ => unreachable!("only F32/F16/BF16 reach the shaders"),
    };
    // read_write although only read: blocks of one segment share a wgpu buffer, whose usage
    // wgpu tracks as a whole, so every block binds with the output's access.
    format!("@group(0) @binding({binding}) var<storage, read_write> {name}: array<u32>;\n{body}")
}

fn header(out_rw: bool) -> String {
    let access = if out_rw { "read_write" } else { "read" };
    format!(
        "@group(0) @binding(0) var<storage, read> p: array<u32>;\n\
         @group(0) @binding(1) var<storage, {access}> out: array<u32>;\n{CONVERSIONS}\n\
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

/// An elementwise kernel over the output's shape: `expr` of `a` (and `b`) as F32, the
/// operands read through their layouts, the scalars `c0`, `c1`; stored as `out`. With
/// `bits`, the elements are copied as bits (`expr` is ignored; one input of `out`'s dtype).
pub fn map(inputs: &[DType], expr: &str, out: DType, bits: bool) -> String {
    let mut s = header(true);
    let names = ["a", "b", "c"];
    for (k, &d) in inputs.iter().enumerate() {
        s += &input(names[k], 2 + k as u32, d);
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
    for (k, _) in inputs.iter().enumerate() {
        let n = names[k];
        if bits {
            s += &format!("    let {n} = lb_{n}(off({k}u, e));\n");
        } else {
            s += &format!("    let {n} = ld_{n}(off({k}u, e));\n");
        }
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
    s += match storage_kind(out) {
        "f32" => "    if (t >= n) { return; }\n    out[t] = conv(value(t));\n}\n",
        _ => {
            "    let e = 2u * t;\n    if (e >= n) { return; }\n    var w = conv(value(e));\n    if (e + 1u < n) { w = w | (conv(value(e + 1u)) << 16u); }\n    out[t] = w;\n}\n"
        }
    };
    s
}

/// A row reduction: one workgroup of 64 per output row `o < p[0]`, over the `p[2]` (`inner`)
/// elements `o*inner + j` of the input's row-major order; F32 results (`out` is F32).
/// `op`: `sum`, `mean`, `max`, `min`, `var` (`p[3]` the correction).
pub fn reduce(input_dtype: DType, op: &str) -> String {
    let mut s = header(true);
    s += &input("a", 2, input_dtype);
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
/// tile, batch)`.
pub fn matmul(a: DType, b: DType, bias: bool) -> String {
    let mut s = header(true);
    s += &input("a", 2, a);
    s += &input("b", 3, b);
    if bias {
        s += &input("bias", 4, DType::F32);
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
