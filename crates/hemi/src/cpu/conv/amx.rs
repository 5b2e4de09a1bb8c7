//! BF16 forward convolutions on Intel AMX straight from the image: no column matrix, no
//! packing of it, whole `tdpbf16ps` tiles read from a copy of the image.
//!
//! `conv::image_forward` otherwise runs a BF16 convolution on AMX as a GEMM
//! (the blocked GEMM's `amx-bf16`): im2col, then the column matrix packed into BF16 pairs, then
//! 32×32 tiles of small per-image products. On ResNet-20 at batch 128 (a 2-core Xeon with
//! AMX) that im2col and packing took more time than the tile products themselves.
//!
//! Here `y [c_out, L] = w [c_out, K] · col [K, L]` keeps the GEMM's orientation, with
//! `K = (tap, channel)`: for each tap `(ki, kj)` and chunk of 32 input channels, one A tile
//! (16 output channels × 32 channels of that tap, packed once per call) and one B tile of 16
//! output pixels × 16 channel pairs. The B tile is read as it lies in a copy of the image,
//! made once per image:
//! - channels interleaved in pairs (`u32` = channel `2q` low, `2q+1` high: the VNNI layout
//!   `tdpbf16ps` takes), one plane per pair: a B row (16 pixels of one pair) is 64
//!   contiguous bytes, and consecutive rows are one plane apart;
//! - padded with zeros (`hp × wp`, the rows and columns the outputs read), and the output
//!   computed over the padded width: output pixel `p' = oh·wp + ow` reads `p' + off(tap)`
//!   with `off = ki·dh·wp + kj·dw`, so 16 consecutive `p'` are 16 consecutive elements of
//!   every plane. The `wp - w_out` columns per row this computes in vain are dropped when
//!   the tile is stored (a quarter more work on ResNet-20's 8×8 planes, an eighth on 16×16).
//!
//! Strided convolutions read phase planes (`Phases`): with stride `(sh, sw)` the padded
//! image is cut into the planes of rows `a, a + sh, …` and columns `b, b + sw, …`, and tap
//! `(ki, kj)` of every output reads one of them as a stride-1 tap does, at an offset. Each
//! input pixel is copied once, into its own plane, so a strided convolution costs its own
//! outputs' work and no im2col (the forward and weight gradient of ResNet-20's two
//! downsampling convolutions took 10 % of an amp-bf16 step through im2col and the GEMM, 4 %
//! on phase planes; Emerald Rapids, 2 cores).
//!
//! Any stride, padding and dilation, input channels a multiple of 32 or exactly 16,
//! output channels a multiple of 16. With 16 input channels a chunk holds two taps of a
//! kernel row (channels of tap `kj` in its first 16 columns, of `kj + 1` in the others; a
//! kernel row of odd width leaves the last chunk half zero weights): the copy then holds
//! the 8 pairs twice, the second time as tap `kj + 1` reads them (column stride 1: the
//! same plane shifted by one tap; column stride 2, undilated: the odd columns' plane), so
//! that B rows 8–15 read tap `kj + 1` at the same pixel offset as rows 0–7 read tap `kj`.
//! The zero weights of such a half chunk multiply real pixels (one tap past the row): an
//! infinite input there makes a NaN of an output that im2col would have left finite
//! (0 · inf). The weight gradient likewise sums over computed pixels that are no output
//! (the columns past `w_out` of a padded row, the gaps between 32-pixel chunks), where dy
//! is zero: an infinite input there makes a NaN of a weight gradient that im2col would
//! have left finite. Either way the same input reaches real outputs through other taps,
//! so the loss is already non-finite (and a loss scaler skips the step).
//!
//! Tiles: 2 output-channel tiles × 2 pixel tiles (32 × 32) or, for the last 16 channels of
//! a `c_out` that is an odd multiple of 16, 1 × 4 (16 × 64).
//!
//! Numerics: every product of two BF16 values is exact in F32; each output sums them in
//! F32 over (tap, chunk) steps in order, the bias added at the end. Within one `tdpbf16ps`
//! the hardware's order is its own (see `gemm::select::Kernel::PortableAmx`), so the portable
//! twin (the Intel SDM's sequential order) agrees with the AMX tiles to the bit only where
//! the sums are exact; both are checked against F64 with the F32 summation bound
//! (`tests/kernels/conv_amx.rs`).

use std::cell::RefCell;
use std::mem::MaybeUninit;

use half::bf16;

use crate::backend::nn::Conv2dGeom;
use crate::cpu::conv::aligned::Aligned;

/// Rows of every tile: output channels of an A/C tile, channel pairs of a B tile.
const T16: usize = 16;
/// Input channels per chunk: one `tdpbf16ps` (16 pairs).
const CHUNK: usize = 32;
/// Elements of one packed A tile (16 rows × 32 BF16).
const A_TILE: usize = T16 * CHUNK;
/// Output pixels per block: the widest block (1 × 4 tiles of 16).
const PX: usize = 64;

/// A forward convolution on AMX tiles read from the image (see the module's text).
#[derive(Clone, Debug)]
pub struct AmxConvPlan {
    amx: bool,
    g: Conv2dGeom,
    /// Columns of a phase plane of the copy (`Phases`).
    wq: usize,
    /// The copy's planes, set by set (`PlaneSet`).
    sets: Vec<PlaneSet>,
    /// Length of one plane of the copy (`u32` pairs): the padded plane and the zeros past
    /// it that the last blocks read.
    q_len: usize,
    /// (tap, chunk) steps of every block.
    steps: usize,
    /// `offs[s]`: where step `s` reads, in `u32` elements from a block's first pixel.
    offs: Vec<usize>,
    /// Packed A tiles, group by group: a full group (32 channels) is `[step][2][16][32]`,
    /// a last half group (16) `[step][16][32]`; BF16 bits.
    wpk: Aligned<u16>,
    /// Output pixels computed (over the plane width): `(h_out - 1)·wq + w_out`.
    p_len: usize,
    /// The output runs of each 32-pixel part of the computed pixels: part `i`'s are
    /// `runs[parts[i]..parts[i + 1]]`.
    runs: Vec<Run>,
    parts: Vec<usize>,
    /// Where the outputs land (`OutMap`), and the length of output they need.
    out: OutMap,
    y_len: usize,
    /// The copy and the stores take their AVX-512 loops (`wide_store`).
    wide: bool,
    /// BF16 stores round with `vcvtneps2bf16` (AVX-512 BF16).
    bf16ne: bool,
}

/// Where output pixel `(oh, ow)` of output channel `o` lands: `o·ch + base + oh·row +
/// ow·col`. A plain output is `[c_out, h_out, w_out]` (`ch = L`, `row = w_out`, `col = 1`,
/// `base = 0`); a phase of a strided convolution's input gradient (`AmxInputGradPlan`) is
/// every `sh`-th row and `sw`-th column of `dx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OutMap {
    ch: usize,
    row: usize,
    col: usize,
    base: usize,
}

/// `pairs` consecutive planes of the copy: channel pairs `0..pairs` of one phase plane
/// (`Phases`), each moved `shift` elements towards its start (value `q` of the set's plane
/// is value `q + shift` of the phase plane; `PlaneSet::new`).
#[derive(Clone, Debug)]
struct PlaneSet {
    pairs: usize,
    /// The rows of input pixels each plane of the set holds (`CopyRun`), made once.
    runs: Vec<CopyRun>,
}

/// One row of a copy plane: elements `at..at + len` are input elements `from, from + sw, …`
/// of a channel plane.
#[derive(Clone, Copy, Debug)]
struct CopyRun {
    at: u32,
    from: u32,
    len: u32,
}

impl PlaneSet {
    fn new(g: &Conv2dGeom, ph: &Phases, phase: (usize, usize), shift: usize, pairs: usize) -> Self {
        let sw = g.stride.1;
        let mut runs = Vec::new();
        let u32_of = |v: usize| u32::try_from(v).expect("conv_amx: image too large");
        ph.runs(g, phase, |at, from, len| {
            // The first `skip` values would land before the plane's start.
            let skip = shift.saturating_sub(at);
            if skip < len {
                runs.push(CopyRun {
                    at: u32_of(at + skip - shift),
                    from: u32_of(from + skip * sw),
                    len: u32_of(len - skip),
                });
            }
        });
        PlaneSet { pairs, runs }
    }
}

/// A strided convolution's padded input cut into phase planes (stride 1: one plane, the
/// padded image). Phase plane `(a, b)` holds the padded input's rows `a, a + sh, …` and
/// columns `b, b + sw, …`, `hq × wq` of them: its element `(i, j)` is input pixel
/// `(i·sh + a - ph, j·sw + b - pw)`, or a zero of the padding. Tap `(ki, kj)` of output
/// pixel `(oh, ow)` reads padded pixel `(oh·sh + ki·dh, ow·sw + kj·dw)`, which is element
/// `(oh + u, ow + v)` of phase plane `(a, b)`, with `ki·dh = u·sh + a` and `kj·dw = v·sw + b`:
/// every tap is a stride-1 tap of one phase plane, and over the plane width `wq` its 16
/// consecutive outputs read 16 consecutive elements.
#[derive(Clone, Copy, Debug)]
struct Phases {
    hq: usize,
    wq: usize,
}

impl Phases {
    /// The planes of `g`.
    fn new(g: &Conv2dGeom) -> Self {
        let ((sh, sw), (dh, dw)) = (g.stride, g.dilation);
        Phases {
            hq: g.h_out + (g.kh - 1) * dh / sh,
            wq: g.w_out + (g.kw - 1) * dw / sw,
        }
    }

    /// Tap `(ki, kj)`: its phase plane `(a, b)` and its offset `u·wq + v` in it.
    fn tap(&self, g: &Conv2dGeom, ki: usize, kj: usize) -> ((usize, usize), usize) {
        let ((sh, sw), (dh, dw)) = (g.stride, g.dilation);
        let (r, c) = (ki * dh, kj * dw);
        ((r % sh, c % sw), (r / sh) * self.wq + c / sw)
    }

    /// `f(at, from, len)` for each row of input pixels in phase plane `phase`: plane
    /// elements `at..at + len` are input elements `from, from + sw, …` of an `h × w` plane.
    fn runs(&self, g: &Conv2dGeom, (a, b): (usize, usize), mut f: impl FnMut(usize, usize, usize)) {
        let ((sh, sw), (ph, pw)) = (g.stride, g.padding);
        // The first index whose padded position `i·s + off` is at least `pad`, and the end
        // of those below `n + pad`.
        let first = |pad: usize, off: usize, s: usize| pad.saturating_sub(off).div_ceil(s);
        let end =
            |n: usize, pad: usize, off: usize, s: usize| (n + pad).saturating_sub(off).div_ceil(s);
        let (i0, i1) = (first(ph, a, sh), end(g.h, ph, a, sh).min(self.hq));
        let (j0, j1) = (first(pw, b, sw), end(g.w, pw, b, sw).min(self.wq));
        if j0 >= j1 {
            return;
        }
        for i in i0..i1 {
            f(
                i * self.wq + j0,
                (i * sh + a - ph) * g.w + j0 * sw + b - pw,
                j1 - j0,
            );
        }
    }
}

/// Copies a thread keeps: one per phase of a strided input gradient (`AmxInputGradPlan`,
/// whose phases alternate image by image).
const COPIES: usize = 4;

thread_local! {
    /// The pair-interleaved padded copies a thread convolves, kept between images and calls,
    /// each with the layout its zeros were written for; the most recently used last.
    static COPY: RefCell<Vec<(Aligned<u32>, CopyLayout)>> = const { RefCell::new(Vec::new()) };
}

/// What decides where a copy holds pixels: the geometry (images and output channels aside)
/// and the plane length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CopyLayout {
    g: Conv2dGeom,
    q_len: usize,
}

/// Whether every position in one image's copies and outputs fits the `u32`s the runs keep:
/// the padded image, with a kernel's reach and a part of slack on each axis, over the wider
/// channel count, with room to spare.
fn fits_u32(g: &Conv2dGeom) -> bool {
    let rows = g.h + 2 * g.padding.0 + g.kh * g.dilation.0 + 2;
    let cols = g.w + 2 * g.padding.1 + g.kw * g.dilation.1 + 2 * RUN_PART;
    [rows, cols, g.c_in.max(g.c_out)]
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .is_some_and(|e| e <= (u32::MAX / 4) as usize)
}

impl AmxConvPlan {
    /// The plan where this file is the route: BF16 weights `w [c_out, c_in, kh, kw]`, a
    /// convolution `with_amx` takes, on a CPU and OS that run AMX-BF16.
    pub fn new(g: &Conv2dGeom, w: &[bf16]) -> Option<Self> {
        if !amx_available() {
            return None;
        }
        Self::with_amx(g, w, true)
    }

    /// The plan on AMX tiles (`amx`, where usable) or on their portable twin; `None` for
    /// convolutions it does not take: groups, input channels neither 16 nor a multiple of
    /// 32, output channels not a multiple of 16, no output; with 16 input channels, column
    /// strides other than 1 and 2 (2 only undilated).
    pub fn with_amx(g: &Conv2dGeom, w: &[bf16], amx: bool) -> Option<Self> {
        if (amx && !amx_available()) || !Self::takes(g) {
            return None;
        }
        if w.len() < g.weight_len() {
            return None;
        }
        // 16 input channels: a chunk is two taps of one kernel row (`pair_taps`).
        let pair_taps = g.c_in == T16;
        let ph = Phases::new(g);
        let p_len = (g.h_out - 1) * ph.wq + g.w_out;
        let chunks = g.c_in.div_ceil(CHUNK);
        // Steps (ki, kj, chunk): with `pair_taps`, taps kj and kj + 1 (none past the row).
        let mut step_at = Vec::new();
        for ki in 0..g.kh {
            for kj in (0..g.kw).step_by(if pair_taps { 2 } else { 1 }) {
                for c in 0..chunks {
                    step_at.push((ki, kj, c));
                }
            }
        }
        let steps = step_at.len();
        // The plane sets and where each step's 16 B rows begin among the planes. With
        // `pair_taps`, a set of 16 planes per phase row: the 8 pairs of tap kj's phase plane,
        // then those of tap kj + 1's at the same offset (column stride 1: the same plane a
        // tap on; column stride 2, undilated: kj is even, kj + 1 reads plane b = 1).
        let mut sets = Vec::new();
        let mut base_of = Vec::new();
        let mut offs = Vec::with_capacity(steps);
        for &(ki, kj, c) in &step_at {
            let (phase, off) = ph.tap(g, ki, kj);
            let key = if pair_taps { (phase.0, 0) } else { phase };
            let set = match base_of.iter().position(|&k| k == key) {
                Some(i) => i,
                None => {
                    base_of.push(key);
                    base_of.len() - 1
                }
            };
            let plane = if pair_taps {
                set * T16
            } else {
                set * g.c_in / 2 + c * T16
            };
            offs.push((plane, off));
        }
        for &key in &base_of {
            if pair_taps {
                let (b1, shift) = if g.stride.1 == 1 {
                    (0, g.dilation.1)
                } else {
                    (1, 0)
                };
                sets.push(PlaneSet::new(g, &ph, key, 0, T16 / 2));
                sets.push(PlaneSet::new(g, &ph, (key.0, b1), shift, T16 / 2));
            } else {
                sets.push(PlaneSet::new(g, &ph, key, 0, g.c_in / 2));
            }
        }
        let max_off = offs.iter().map(|&(_, off)| off).max().unwrap_or(0);
        let mut q_len = (ph.hq * ph.wq).max(p_len.next_multiple_of(PX) + max_off);
        q_len = q_len.next_multiple_of(16);
        // Planes a multiple of 4 KiB apart would put a B tile's 16 rows in one cache set.
        if (q_len * 4).is_multiple_of(4096) {
            q_len += 16;
        }
        let offs = offs
            .iter()
            .map(|&(plane, off)| plane * q_len + off)
            .collect();
        // Column e of a step's A tiles: (channel, ki, kj), or none (zero weight).
        let column = |(ki, kj, c): (usize, usize, usize), e: usize| match (pair_taps, e < T16) {
            (false, _) => Some((c * CHUNK + e, ki, kj)),
            (true, true) => Some((e, ki, kj)),
            (true, false) => (kj + 1 < g.kw).then_some((e - T16, ki, kj + 1)),
        };
        // A tiles: row r of tile (group, step, mt) is output channel o = group·32 + mt·16 + r.
        let k = g.k();
        let mut wpk = Aligned::<u16>::zeroed(g.c_out * steps * CHUNK);
        let mut at = 0;
        for o0 in (0..g.c_out).step_by(2 * T16) {
            let mts = (g.c_out - o0).min(2 * T16) / T16;
            for &step in &step_at {
                for mt in 0..mts {
                    for r in 0..T16 {
                        let o = o0 + mt * T16 + r;
                        for e in 0..CHUNK {
                            if let Some((ci, ki, kj)) = column(step, e) {
                                wpk[at] = w[o * k + (ci * g.kh + ki) * g.kw + kj].to_bits();
                            }
                            at += 1;
                        }
                    }
                }
            }
        }
        debug_assert_eq!(at, wpk.len());
        let out = OutMap {
            ch: g.l(),
            row: g.w_out,
            col: 1,
            base: 0,
        };
        let (runs, parts) = output_runs(p_len, ph.wq, g.w_out, out);
        Some(AmxConvPlan {
            amx,
            g: *g,
            wq: ph.wq,
            sets,
            q_len,
            steps,
            offs,
            wpk,
            p_len,
            runs,
            parts,
            out,
            y_len: g.out_image(),
            wide: wide_store(),
            bf16ne: wide_store() && bf16ne_available(),
        })
    }

    /// The plan writing its outputs where `out` puts them.
    fn with_out_map(mut self, out: OutMap) -> Self {
        let g = &self.g;
        let (runs, parts) = output_runs(self.p_len, self.wq, g.w_out, out);
        let last = (g.c_out - 1) * out.ch + out.base + (g.h_out - 1) * out.row;
        self.y_len = last + (g.w_out - 1) * out.col + 1;
        (self.runs, self.parts, self.out) = (runs, parts, out);
        self
    }

    /// Whether this file takes the convolution (the conditions of `with_amx`).
    pub fn takes(g: &Conv2dGeom) -> bool {
        let (sh, sw) = g.stride;
        let shape = sh > 0 && sw > 0 && g.groups == 1 && g.l() > 0 && g.kh > 0 && g.kw > 0;
        let c_in = g.c_in > 0 && (g.c_in.is_multiple_of(CHUNK) || g.c_in == T16);
        // Two taps of a row share one offset only at column stride 1, or 2 undilated.
        let pairs = g.c_in != T16 || sw == 1 || (sw == 2 && g.dilation.1 == 1);
        shape && c_in && pairs && g.c_out > 0 && g.c_out.is_multiple_of(T16) && fits_u32(g)
    }

    /// Whether the plan runs on AMX tiles (else on the portable twin).
    pub fn uses_amx(&self) -> bool {
        self.amx
    }

    /// One image: `y [c_out, L] = bias + w · col(x)`, `x [c_in, h, w]`, `bias` (`[c_out]`)
    /// or zeros, in F32 or rounded once to BF16 (`ConvOut`). Every element of `y` is written
    /// (with an `OutMap`: every element the map puts an output at).
    pub fn image<O: ConvOut>(&self, x: &[bf16], bias: Option<&[f32]>, y: &mut [O]) {
        let g = &self.g;
        assert!(
            x.len() >= g.in_image() && y.len() >= self.y_len,
            "conv_amx: buffers too small for one image of {g:?}"
        );
        assert!(
            bias.is_none_or(|b| b.len() >= g.c_out),
            "conv_amx: bias too short"
        );
        COPY.with_borrow_mut(|copies| {
            let want = CopyLayout {
                g: Conv2dGeom {
                    n: 1,
                    c_out: 0,
                    ..*g
                },
                q_len: self.q_len,
            };
            // The copy of this layout, last; else a new one in place of the least recently
            // used (its zeros written by `copy`).
            match copies.iter().position(|(_, l)| *l == want) {
                Some(i) => copies[i..].rotate_left(1),
                None => {
                    if copies.len() == COPIES {
                        copies.remove(0);
                    }
                    let planes: usize = self.sets.iter().map(|s| s.pairs).sum();
                    copies.push((Aligned::zeroed(planes * self.q_len), want));
                }
            }
            let (xq, _) = copies.last_mut().expect("pushed or found");
            self.copy(x, xq);
            #[cfg(target_arch = "x86_64")]
            if self.amx {
                // SAFETY: `amx` only where AMX-BF16 is usable (`with_amx`).
                let _release = unsafe { crate::cpu::amx::TileConfig::all_16x64().load() };
                return self.blocks(xq, bias, y);
            }
            self.blocks(xq, bias, y)
        })
    }

    /// Every (channel group, pixel block) of one image from its copy `xq`.
    fn blocks<O: ConvOut>(&self, xq: &[u32], bias: Option<&[f32]>, y: &mut [O]) {
        let g = &self.g;
        let group_len = 2 * self.steps * A_TILE;
        #[repr(C, align(64))]
        struct Buf([f32; 2 * T16 * 2 * T16]);
        let mut buf = Buf([0.0; 2 * T16 * 2 * T16]);
        for (gi, o0) in (0..g.c_out).step_by(2 * T16).enumerate() {
            let mts = (g.c_out - o0).min(2 * T16) / T16;
            let a = &self.wpk[gi * group_len..];
            // Pixels per block: 32 (2 × 2 tiles) or 64 (1 × 4).
            let px = if mts == 2 { 2 * T16 } else { 4 * T16 };
            for p0 in (0..self.p_len).step_by(px) {
                // SAFETY (both arms): `a` holds `steps` steps of `mts` A tiles; the copy
                // holds every element `p0 + offs[s] + 16·r·q_len + j` (r < 16, j < px) a
                // block reads (`with_amx` sized `q_len` for the last block); `buf` holds
                // `mts·16` rows of `px` F32.
                #[cfg(target_arch = "x86_64")]
                if self.amx {
                    unsafe {
                        let x = xq.as_ptr().add(p0).cast::<u8>();
                        let bufp = buf.0.as_mut_ptr();
                        if mts == 2 {
                            x86::block_2x2(self.steps, a.as_ptr(), x, &self.offs, self.q_len, bufp)
                        } else {
                            x86::block_1x4(self.steps, a.as_ptr(), x, &self.offs, self.q_len, bufp)
                        }
                    }
                    self.store(&buf.0, px, o0, mts * T16, p0, bias, y);
                    continue;
                }
                portable_block(self, a, xq, p0, mts, px / T16, &mut buf.0);
                self.store(&buf.0, px, o0, mts * T16, p0, bias, y);
            }
        }
    }

    /// Block `buf` (`rows` output channels from `o0`, `px` pixels over the padded width from
    /// `p0`) into `y`: the pixels of real columns, with the bias.
    #[allow(clippy::too_many_arguments)]
    fn store<O: ConvOut>(
        &self,
        buf: &[f32],
        px: usize,
        o0: usize,
        rows: usize,
        p0: usize,
        bias: Option<&[f32]>,
        y: &mut [O],
    ) {
        // The block's runs: those of its 32-pixel parts.
        let first = p0 / RUN_PART;
        let last = (first + px / RUN_PART).min(self.parts.len() - 1);
        let runs = &self.runs[self.parts[first]..self.parts[last]];
        let col = self.out.col;
        #[cfg(target_arch = "x86_64")]
        if self.wide && col == 1 {
            assert!(y.len() >= self.y_len && buf.len() >= rows * px);
            // SAFETY: AVX-512 F/BW/VL and F16C (`wide`); every run of every row lies in its
            // channel's part of `y` (`y_len`, checked by `image`) and in the block's `buf`
            // row; `ConvOut` is sealed to F32 (4 bytes) and BF16 written or not (2 bytes), so
            // the size names the lanes, and only stores go through the pointer.
            unsafe {
                let (o, ch) = (o0..o0 + rows, self.out.ch);
                if size_of::<O>() == 4 {
                    let y = y.as_mut_ptr().cast::<f32>();
                    x86::store_runs::<f32>(buf, px, p0, o, bias, y, ch, runs)
                } else if self.bf16ne {
                    let y = y.as_mut_ptr().cast::<bf16>();
                    x86::store_runs_ne(buf, px, p0, o, bias, y, ch, runs)
                } else {
                    let y = y.as_mut_ptr().cast::<bf16>();
                    x86::store_runs::<bf16>(buf, px, p0, o, bias, y, ch, runs)
                }
            }
            return;
        }
        for r in 0..rows {
            let o = o0 + r;
            let b = bias.map_or(0.0, |b| b[o]);
            let src = &buf[r * px..(r + 1) * px];
            let dst = &mut y[o * self.out.ch..];
            for run in runs {
                let (from, to, len) = (run.from as usize - p0, run.to as usize, run.len as usize);
                let src = &src[from..from + len];
                if col == 1 {
                    O::put(&mut dst[to..to + len], src, b);
                } else {
                    O::put_strided(&mut dst[to..to + (len - 1) * col + 1], col, src, b);
                }
            }
        }
    }

    /// `x` into `xq`, set by set (`PlaneSet`): plane `p` of a set holds channels `2p`
    /// (low half) and `2p + 1` (high half) of its phase plane, `q_len` apart, zeros around
    /// and past the pixels. Writes only the pixels: `xq` holds the zeros of this layout
    /// (`image`).
    fn copy(&self, x: &[bf16], xq: &mut [u32]) {
        let (plane, sw) = (self.g.h * self.g.w, self.g.stride.1);
        let mut dst_planes = xq.chunks_exact_mut(self.q_len);
        for set in &self.sets {
            for q in 0..set.pairs {
                let dst = dst_planes.next().expect("sized for every set");
                let lo = &x[2 * q * plane..(2 * q + 1) * plane];
                let hi = &x[(2 * q + 1) * plane..(2 * q + 2) * plane];
                #[cfg(target_arch = "x86_64")]
                if self.wide && sw <= 2 {
                    // SAFETY: AVX-512 F/BW/VL (`wide`); stride 1 or 2.
                    unsafe { x86::pair_rows(dst, lo, hi, &set.runs, sw) };
                    continue;
                }
                for r in &set.runs {
                    let (at, from, len) = (r.at as usize, r.from as usize, r.len as usize);
                    let src = from..from + (len - 1) * sw + 1;
                    pair_run_portable(&mut dst[at..at + len], &lo[src.clone()], &hi[src], sw);
                }
            }
        }
    }
}

/// The input gradient of a strided, undilated BF16 convolution on AMX tiles, phase by phase
/// of `dx`: input pixels `(ih, iw)` with `ih + ph ≡ a (mod sh)` and `iw + pw ≡ b (mod sw)`
/// receive only the taps `ki ≡ a`, `kj ≡ b`, and over them `dx` is a stride-1 convolution
/// of `dy`. With `ih + ph = i·sh + a` and `ki = a + u·sh`, tap `ki` reaches output row
/// `i - u`: so phase `(a, b)` is `dy` (channels `c_out`) convolved with the kernel
/// `w'[c][o][kh' - 1 - u][kw' - 1 - v] = w[o][c][a + u·sh][b + v·sw]` (`kh' × kw'` taps),
/// turned by 180°, padded by `kh' - 1 - i0` rows (`i0` the phase's first `i`), its outputs
/// stored straight to every `sh`-th row and `sw`-th column of `dx` (`OutMap`). A phase no
/// tap reaches (a kernel narrower than the stride) is zeros.
///
/// Every `dx` element is one phase's output, summed over its taps and channels in F32 and
/// rounded once: the products and sums of `col2im(wᵀ · dy)` without the column matrix and
/// its scatter-add.
#[derive(Clone, Debug)]
pub struct AmxInputGradPlan {
    g: Conv2dGeom,
    phases: Vec<InputPhase>,
}

/// One phase of `dx` (`AmxInputGradPlan`): its convolution, or `None` for zeros at
/// `rows × cols` pixels from `base`, `sh·w` and `sw` apart.
#[derive(Clone, Debug)]
struct InputPhase {
    plan: Option<AmxConvPlan>,
    base: usize,
    rows: usize,
    cols: usize,
}

impl AmxInputGradPlan {
    /// The plan where this file is the route (a CPU and OS that run AMX-BF16).
    pub fn new(g: &Conv2dGeom, w: &[bf16]) -> Option<Self> {
        if !amx_available() {
            return None;
        }
        Self::with_amx(g, w, true)
    }

    /// The plan on AMX tiles (`amx`) or on their portable twin; `None` for convolutions it
    /// does not take: stride 1 (`conv` turns those into a plain convolution of `dy`),
    /// groups, dilation, a phase whose convolution `AmxConvPlan` does not take (input
    /// gradient channels `c_in` not a multiple of 16, `c_out` neither 16 nor a multiple of
    /// 32), or one that would need negative padding (padding past the kernel).
    pub fn with_amx(g: &Conv2dGeom, w: &[bf16], amx: bool) -> Option<Self> {
        let (sh, sw) = g.stride;
        if g.stride == (1, 1) || sh == 0 || sw == 0 || g.groups != 1 || g.dilation != (1, 1) {
            return None;
        }
        if g.l() == 0 || g.in_image() == 0 || w.len() < g.weight_len() || !fits_u32(g) {
            return None;
        }
        let (ph, pw) = g.padding;
        // Taps of a phase residue, its first index and count of `dx` positions.
        let side = |r: usize, s: usize, k: usize, pad: usize, n: usize| {
            let taps = if r < k { (k - r).div_ceil(s) } else { 0 };
            let first = pad.saturating_sub(r).div_ceil(s);
            let end = (n + pad).saturating_sub(r).div_ceil(s);
            (taps, first, end.saturating_sub(first))
        };
        let mut phases = Vec::new();
        for a in 0..sh {
            let (th, i0, rows) = side(a, sh, g.kh, ph, g.h);
            for b in 0..sw {
                let (tw, j0, cols) = side(b, sw, g.kw, pw, g.w);
                if rows == 0 || cols == 0 {
                    continue;
                }
                let base = (i0 * sh + a - ph) * g.w + j0 * sw + b - pw;
                if th == 0 || tw == 0 {
                    phases.push(InputPhase {
                        plan: None,
                        base,
                        rows,
                        cols,
                    });
                    continue;
                }
                let (pad_h, pad_w) = ((th - 1).checked_sub(i0)?, (tw - 1).checked_sub(j0)?);
                let sub = Conv2dGeom {
                    n: 1,
                    c_in: g.c_out,
                    h: g.h_out,
                    w: g.w_out,
                    c_out: g.c_in,
                    kh: th,
                    kw: tw,
                    stride: (1, 1),
                    padding: (pad_h, pad_w),
                    dilation: (1, 1),
                    groups: 1,
                    h_out: rows,
                    w_out: cols,
                };
                let mut wt = vec![bf16::ZERO; sub.weight_len()];
                for c in 0..g.c_in {
                    for o in 0..g.c_out {
                        for u in 0..th {
                            for v in 0..tw {
                                let (ki, kj) = (a + u * sh, b + v * sw);
                                wt[((c * g.c_out + o) * th + th - 1 - u) * tw + tw - 1 - v] =
                                    w[((o * g.c_in + c) * g.kh + ki) * g.kw + kj];
                            }
                        }
                    }
                }
                let out = OutMap {
                    ch: g.h * g.w,
                    row: sh * g.w,
                    col: sw,
                    base,
                };
                let plan = AmxConvPlan::with_amx(&sub, &wt, amx)?.with_out_map(out);
                phases.push(InputPhase {
                    plan: Some(plan),
                    base,
                    rows,
                    cols,
                });
            }
        }
        Some(AmxInputGradPlan { g: *g, phases })
    }

    /// Whether the plan runs on AMX tiles (else on the portable twin).
    pub fn uses_amx(&self) -> bool {
        self.phases
            .iter()
            .any(|p| p.plan.as_ref().is_some_and(|p| p.uses_amx()))
    }

    /// One image: `dx [c_in, h, w]` from `dy [c_out, h_out, w_out]`, in F32 or rounded once
    /// to BF16. Every element of `dx` is written.
    pub fn image<O: ConvOut>(&self, dy: &[bf16], dx: &mut [O], zero: O) {
        let g = &self.g;
        assert!(
            dy.len() >= g.out_image() && dx.len() >= g.in_image(),
            "conv_amx: buffers too small for one image's input gradient of {g:?}"
        );
        let (sh, sw) = g.stride;
        for p in &self.phases {
            match &p.plan {
                Some(plan) => plan.image(dy, None, dx),
                None => {
                    for c in 0..g.c_in {
                        for i in 0..p.rows {
                            let at = c * g.h * g.w + p.base + i * sh * g.w;
                            for d in dx[at..].iter_mut().step_by(sw).take(p.cols) {
                                *d = zero;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `d[t]` = channel pair `(lo, hi)` at element `t·sw` of the input runs `lo`, `hi`
/// (`(d.len() - 1)·sw + 1` long): `lo`'s bits low, `hi`'s high.
#[doc(hidden)]
pub fn pair_run_portable(d: &mut [u32], lo: &[bf16], hi: &[bf16], sw: usize) {
    let (a, b) = (lo.iter().step_by(sw), hi.iter().step_by(sw));
    for ((d, a), b) in d.iter_mut().zip(a).zip(b) {
        *d = u32::from(a.to_bits()) | u32::from(b.to_bits()) << 16;
    }
}

/// Computed pixels per part of `AmxConvPlan::runs` (a block is one or two parts).
const RUN_PART: usize = 32;

/// What `AmxConvPlan::image` writes: F32, or BF16 rounded once (nearest-even, as
/// `convert::f32_to_bf16`), so that a BF16 convolution needs no F32 image of its output.
pub trait ConvOut: Copy + sealed::Sealed {
    /// `dst = src + b` over one output run (at most `RUN_PART` pixels), rounded to `Self`.
    fn put(dst: &mut [Self], src: &[f32], b: f32);
    /// `put` into every `step`-th element of `dst` (`(src.len() - 1)·step + 1` long), the
    /// others left as they are.
    fn put_strided(dst: &mut [Self], step: usize, src: &[f32], b: f32);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for std::mem::MaybeUninit<half::bf16> {}
}

/// Whether the CPU has `vcvtneps2bf16` (AVX-512 BF16), for `x86::store_runs_ne`.
fn bf16ne_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cpu_has!(Avx512bf16)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the run stores take their AVX-512 build (the AMX route always does).
#[inline]
#[doc(hidden)]
pub fn wide_store() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::norm::in_place::Level::Avx512.is_available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

// Runs are at most 32 pixels: two masked AVX-512 steps. The plain loops were left scalar by
// the compiler for runs this short (5–7 % of a ResNet-20 amp-bf16 step on Emerald Rapids).
impl ConvOut for f32 {
    #[inline]
    fn put(dst: &mut [f32], src: &[f32], b: f32) {
        assert!(dst.len() == src.len() && dst.len() <= RUN_PART);
        #[cfg(target_arch = "x86_64")]
        if wide_store() {
            // SAFETY: AVX-512 F/BW/VL (`wide_store`); equal lengths.
            return unsafe { x86::add_run(dst.as_mut_ptr(), src, b) };
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s + b;
        }
    }

    fn put_strided(dst: &mut [f32], step: usize, src: &[f32], b: f32) {
        assert!(!src.is_empty() && dst.len() == (src.len() - 1) * step + 1);
        for (d, &s) in dst.iter_mut().step_by(step).zip(src) {
            *d = s + b;
        }
    }
}

impl ConvOut for bf16 {
    #[inline]
    fn put(dst: &mut [bf16], src: &[f32], b: f32) {
        // SAFETY: same layout; `put` only stores initialised BF16 values through it.
        let dst = unsafe { &mut *(dst as *mut [bf16] as *mut [MaybeUninit<bf16>]) };
        MaybeUninit::<bf16>::put(dst, src, b)
    }

    fn put_strided(dst: &mut [bf16], step: usize, src: &[f32], b: f32) {
        // SAFETY: as in `put`.
        let dst = unsafe { &mut *(dst as *mut [bf16] as *mut [MaybeUninit<bf16>]) };
        MaybeUninit::<bf16>::put_strided(dst, step, src, b)
    }
}

/// BF16 into a buffer not yet initialised (`conv2d_forward_blocks` leaves its output
/// unzeroed: `image` writes every element).
impl ConvOut for MaybeUninit<bf16> {
    #[inline]
    fn put(dst: &mut [MaybeUninit<bf16>], src: &[f32], b: f32) {
        assert!(dst.len() == src.len() && dst.len() <= RUN_PART);
        #[cfg(target_arch = "x86_64")]
        if wide_store() {
            // SAFETY: AVX-512 F/BW/VL (`wide_store`); equal lengths; `add_run` only stores.
            return unsafe { x86::add_run(dst.as_mut_ptr().cast::<bf16>(), src, b) };
        }
        let (mut t, mut h) = ([0f32; RUN_PART], [bf16::ZERO; RUN_PART]);
        let (t, h) = (&mut t[..src.len()], &mut h[..src.len()]);
        for (t, &s) in t.iter_mut().zip(src) {
            *t = s + b;
        }
        crate::dtype::convert::f32_to_bf16(t, h);
        for (d, &v) in dst.iter_mut().zip(h.iter()) {
            d.write(v);
        }
    }

    fn put_strided(dst: &mut [MaybeUninit<bf16>], step: usize, src: &[f32], b: f32) {
        assert!(!src.is_empty() && src.len() <= RUN_PART);
        assert_eq!(dst.len(), (src.len() - 1) * step + 1);
        #[cfg(target_arch = "x86_64")]
        if step == 2 && wide_store() {
            // SAFETY: AVX-512 F/BW/VL (`wide_store`); `dst` holds every second element of the
            // run and `add_run_stride2` only stores those.
            return unsafe { x86::add_run_stride2(dst.as_mut_ptr().cast(), src, b) };
        }
        let mut h = [MaybeUninit::new(bf16::ZERO); RUN_PART];
        Self::put(&mut h[..src.len()], src, b);
        for (d, v) in dst.iter_mut().step_by(step).zip(h) {
            *d = v;
        }
    }
}

/// A run of consecutive computed pixels of one output row: `len` values from computed pixel
/// `from` to output pixel `to`.
#[derive(Clone, Copy, Debug)]
struct Run {
    from: u32,
    to: u32,
    len: u32,
}

/// The runs of output pixels among `p_len` pixels computed over the padded width `wp`
/// (`w_out` real columns a row), by 32-pixel part, and where each part's start; each run's
/// first output where `out` puts it (its channel's part of it).
fn output_runs(p_len: usize, wp: usize, w_out: usize, out: OutMap) -> (Vec<Run>, Vec<usize>) {
    let (mut runs, mut parts) = (Vec::new(), vec![0]);
    for p0 in (0..p_len).step_by(RUN_PART) {
        let end = (p0 + RUN_PART).min(p_len);
        let mut p = p0;
        while p < end {
            let (oh, ow) = (p / wp, p % wp);
            if ow >= w_out {
                p = (oh + 1) * wp;
                continue;
            }
            let len = (oh * wp + w_out).min(end) - p;
            let run = |v: usize| u32::try_from(v).expect("conv_amx: image too large");
            runs.push(Run {
                from: run(p),
                to: run(out.base + oh * out.row + ow * out.col),
                len: run(len),
            });
            p += len;
        }
        parts.push(runs.len());
    }
    (runs, parts)
}

/// The twin of the AMX blocks in plain Rust: the same tiles, each `tdpbf16ps` summed as the
/// Intel SDM's pseudocode does (per pair, the even channel's product, then the odd one's).
fn portable_block(
    plan: &AmxConvPlan,
    a: &[u16],
    xq: &[u32],
    p0: usize,
    mts: usize,
    nts: usize,
    buf: &mut [f32],
) {
    let px = nts * T16;
    buf[..mts * T16 * px].fill(0.0);
    let f = |bits: u16| f32::from_bits(u32::from(bits) << 16);
    for (s, &off) in plan.offs.iter().enumerate() {
        for mt in 0..mts {
            let tile = &a[(s * mts + mt) * A_TILE..(s * mts + mt + 1) * A_TILE];
            for r in 0..T16 {
                let arow = &tile[r * CHUNK..(r + 1) * CHUNK];
                let crow = &mut buf[(mt * T16 + r) * px..(mt * T16 + r + 1) * px];
                for (n, acc) in crow.iter_mut().enumerate() {
                    for j in 0..T16 {
                        let b = xq[p0 + off + j * plan.q_len + n];
                        *acc += f(arow[2 * j]) * f(b as u16);
                        *acc += f(arow[2 * j + 1]) * f((b >> 16) as u16);
                    }
                }
            }
        }
    }
}

/// Whether this process may run AMX-BF16 code.
pub fn amx_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::amx::usable(crate::cpu::amx::AmxType::Bf16)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The x86-64 kernels: pair copies, run stores, AMX tile blocks (public, hidden, for the
/// unit tests in `tests/kernels/unit/`).
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub mod x86 {
    /// `conv::amx::pair_run_portable` over every row run of one copy plane (`runs`), sixteen
    /// pairs per step under a mask, at strides 1 and 2.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL; `sw` is 1 or 2.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pair_rows(
        dst: &mut [u32],
        lo: &[half::bf16],
        hi: &[half::bf16],
        runs: &[super::CopyRun],
        sw: usize,
    ) {
        for r in runs {
            let (at, from, len) = (r.at as usize, r.from as usize, r.len as usize);
            let src = from..from + (len - 1) * sw + 1;
            // SAFETY: AVX-512 F/BW/VL; the slices' lengths are as `pair_run` needs.
            unsafe { pair_run(&mut dst[at..at + len], &lo[src.clone()], &hi[src], sw) };
        }
    }

    /// `conv::amx::pair_run_portable` at strides 1 and 2, sixteen pairs per step under a
    /// mask.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL; `sw` is 1 or 2; `lo` and `hi` are `(d.len() - 1)·sw + 1`
    /// long.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub unsafe fn pair_run(d: &mut [u32], lo: &[half::bf16], hi: &[half::bf16], sw: usize) {
        use std::arch::x86_64::*;
        assert!(!d.is_empty() && lo.len() == (d.len() - 1) * sw + 1 && hi.len() == lo.len());
        let (lo, hi, out) = (
            lo.as_ptr().cast::<i16>(),
            hi.as_ptr().cast::<i16>(),
            d.as_mut_ptr(),
        );
        let mut t = 0;
        while t < d.len() {
            let k = (d.len() - t).min(16);
            let m = (((1u32 << k) - 1) & 0xFFFF) as __mmask16;
            // SAFETY: the lanes under the masks lie inside the runs (their `(k - 1)·sw + 1`
            // elements from `t·sw`) and inside `d`.
            unsafe {
                let v = if sw == 1 {
                    let a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, lo.add(t)));
                    let b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, hi.add(t)));
                    _mm512_or_si512(a, _mm512_slli_epi32::<16>(b))
                } else {
                    // 32 values as 16 words: the even ones are the low halves.
                    let m2 = ((1u64 << (2 * k - 1)) - 1) as __mmask32;
                    let a = _mm512_maskz_loadu_epi16(m2, lo.add(2 * t));
                    let b = _mm512_maskz_loadu_epi16(m2, hi.add(2 * t));
                    _mm512_or_si512(
                        _mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)),
                        _mm512_slli_epi32::<16>(b),
                    )
                };
                _mm512_mask_storeu_epi32(out.add(t).cast(), m, v);
            }
            t += 16;
        }
    }

    /// `ConvOut::put` on AVX-512: sixteen lanes per step under a mask, each rounded to `L`
    /// as stored (BF16: `convert::f32_to_bf16_bits`' rule, `norm::in_place`'s store).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and F16C; `dst` is valid for writes of `src.len()`
    /// elements (which it may not yet hold: it is only stored to).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub(super) unsafe fn add_run<L: crate::cpu::norm::in_place::x86::Lanes>(
        dst: *mut L,
        src: &[f32],
        b: f32,
    ) {
        use std::arch::x86_64::*;
        let bv = _mm512_set1_ps(b);
        let mut j = 0;
        while j < src.len() {
            let n = src.len() - j;
            let m: __mmask16 = if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 };
            // SAFETY: the lanes under `m` lie inside `src` and the `src.len()` writable
            // elements at `dst`.
            unsafe {
                let v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(j)), bv);
                L::st(dst.add(j), v, m);
            }
            j += 16;
        }
    }

    /// A block's stores (`AmxConvPlan::store`, column step 1) in one call: for each output
    /// channel `o` of `rows` (block row `o - rows.start` of `buf`, `px` F32 from computed
    /// pixel `p0`), every run `buf + bias[o]`, rounded to `L` as stored, at `y + o·ch + to`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and F16C; `buf` holds `rows.len()·px` values and every
    /// run's pixels lie in `p0..p0 + px`; `y + o·ch + to` is writable for every run.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn store_runs<L: crate::cpu::norm::in_place::x86::Lanes>(
        buf: &[f32],
        px: usize,
        p0: usize,
        rows: std::ops::Range<usize>,
        bias: Option<&[f32]>,
        y: *mut L,
        ch: usize,
        runs: &[super::Run],
    ) {
        use std::arch::x86_64::*;
        for (r, o) in rows.enumerate() {
            let bv = _mm512_set1_ps(bias.map_or(0.0, |b| b[o]));
            let src = buf[r * px..(r + 1) * px].as_ptr();
            // SAFETY (the whole row): per the caller's guarantee.
            unsafe {
                let dst = y.add(o * ch);
                for run in runs {
                    let (from, to, len) =
                        (run.from as usize - p0, run.to as usize, run.len as usize);
                    let mut j = 0;
                    while j < len {
                        let n = len - j;
                        let m: __mmask16 = if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 };
                        let v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, src.add(from + j)), bv);
                        L::st(dst.add(to + j), v, m);
                        j += 16;
                    }
                }
            }
        }
    }

    /// `store_runs` into BF16 with `vcvtneps2bf16` (nearest-even, NaN quietened as
    /// `convert::f32_to_bf16_bits` does, ignoring MXCSR), sixteen lanes in one instruction.
    /// The instruction reads F32 subnormals as zero where the rule keeps them
    /// (`convert::x86::f32_to_bf16_avx512bf16`), so a vector holding one takes the integer
    /// rounding instead: the same bits either way.
    ///
    /// # Safety
    /// As `store_runs`, and the CPU has AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn store_runs_ne(
        buf: &[f32],
        px: usize,
        p0: usize,
        rows: std::ops::Range<usize>,
        bias: Option<&[f32]>,
        y: *mut half::bf16,
        ch: usize,
        runs: &[super::Run],
    ) {
        use crate::cpu::norm::in_place::x86::Lanes;
        use std::arch::x86_64::*;
        let (abs_mask, one, below) = (
            _mm512_set1_epi32(0x7FFF_FFFF),
            _mm512_set1_epi32(1),
            _mm512_set1_epi32(0x7F_FFFF),
        );
        for (r, o) in rows.enumerate() {
            let bv = _mm512_set1_ps(bias.map_or(0.0, |b| b[o]));
            let src = buf[r * px..(r + 1) * px].as_ptr();
            // SAFETY (the whole row): per the caller's guarantee.
            unsafe {
                let dst = y.add(o * ch);
                for run in runs {
                    let (from, to, len) =
                        (run.from as usize - p0, run.to as usize, run.len as usize);
                    let mut j = 0;
                    while j < len {
                        let n = len - j;
                        let m: __mmask16 = if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 };
                        let v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, src.add(from + j)), bv);
                        // Subnormal lanes: `abs - 1 < 0x7FFFFF` (unsigned), abs in 1..=0x7FFFFF.
                        let abs = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
                        let sub = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(abs, one), below);
                        if sub == 0 {
                            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
                            _mm256_mask_storeu_epi16(dst.add(to + j).cast(), m, h);
                        } else {
                            <half::bf16 as Lanes>::st(dst.add(to + j), v, m);
                        }
                        j += 16;
                    }
                }
            }
        }
    }

    /// `ConvOut::put_strided` for BF16 at step 2: each lane rounded as `add_run` rounds it,
    /// its 16 bits stored to every second element (a masked 16-bit store of the lanes' low
    /// halves).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL; `dst` is writable at the even elements `0, 2, …,
    /// 2·(src.len() - 1)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn add_run_stride2(dst: *mut u16, src: &[f32], b: f32) {
        use std::arch::x86_64::*;
        let bv = _mm512_set1_ps(b);
        let mut j = 0;
        while j < src.len() {
            let k = (src.len() - j).min(16);
            let m = (((1u32 << k) - 1) & 0xFFFF) as __mmask16;
            // The even halves of the first 2k: lanes 0..k's low halves.
            let even = (0x5555_5555u64 & ((1u64 << (2 * k)) - 1)) as __mmask32;
            // SAFETY: the lanes under `m` lie in `src`; the halves under `even` are the
            // elements 2j, 2j + 2, … the caller guarantees.
            unsafe {
                let v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(j)), bv);
                let h = crate::cpu::norm::in_place::x86::bf16_bits(v);
                _mm512_mask_storeu_epi16(dst.add(2 * j).cast(), even, h);
            }
            j += 16;
        }
    }

    /// 2 output-channel tiles × 2 pixel tiles: per step, A tiles `a` and `a + 1 KiB` (tmm4,
    /// tmm5), B tiles at `x + 4·offs[s]` and 64 bytes on (tmm6, tmm7, rows `4·q_len` bytes
    /// apart), four `tdpbf16ps` into tmm0–3; then stored to `buf` as 32 rows of 32 F32.
    ///
    /// # Safety
    /// Tiles configured as 16 × 64 bytes (AMX usable); `a` holds `2·steps` A tiles; every
    /// B row read lies in the copy; `buf` holds 32 × 32 F32.
    pub(super) unsafe fn block_2x2(
        steps: usize,
        a: *const u16,
        x: *const u8,
        offs: &[usize],
        q_len: usize,
        buf: *mut f32,
    ) {
        debug_assert!(offs.len() == steps && steps > 0);
        // SAFETY: per the caller's guarantee; only tile registers, the pointer copies and the
        // flags are changed.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "mov {p}, [{o}]",
                "lea {p}, [{x} + {p}*4]",
                "tileloadd tmm4, [{a} + {sa}]",
                "tileloadd tmm5, [{a} + {sa} + 1024]",
                "tileloadd tmm6, [{p} + {sb}]",
                "tileloadd tmm7, [{p} + {sb} + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a}, 2048",
                "add {o}, 8",
                "dec {n}",
                "jnz 2b",
                "tilestored [{d} + {sd}], tmm0",
                "tilestored [{d} + {sd} + 64], tmm1",
                "tilestored [{d2} + {sd}], tmm2",
                "tilestored [{d2} + {sd} + 64], tmm3",
                a = inout(reg) a => _,
                o = inout(reg) offs.as_ptr() => _,
                n = inout(reg) steps => _,
                p = out(reg) _,
                x = in(reg) x,
                sa = in(reg) 64usize,
                sb = in(reg) 4 * q_len,
                d = in(reg) buf,
                d2 = in(reg) buf.add(16 * 32),
                sd = in(reg) 128usize,
                options(nostack),
            );
        }
    }

    /// 1 output-channel tile × 4 pixel tiles: per step, A tile `a` (tmm4), B tiles at
    /// `x + 4·offs[s]` + 0, 64, 128, 192 bytes (tmm5–7, tmm5 reloaded), four `tdpbf16ps`
    /// into tmm0–3; then stored to `buf` as 16 rows of 64 F32.
    ///
    /// # Safety
    /// As `block_2x2`, with `steps` A tiles and `buf` 16 × 64 F32.
    pub(super) unsafe fn block_1x4(
        steps: usize,
        a: *const u16,
        x: *const u8,
        offs: &[usize],
        q_len: usize,
        buf: *mut f32,
    ) {
        debug_assert!(offs.len() == steps && steps > 0);
        // SAFETY: as in `block_2x2`.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "mov {p}, [{o}]",
                "lea {p}, [{x} + {p}*4]",
                "tileloadd tmm4, [{a} + {sa}]",
                "tileloadd tmm5, [{p} + {sb}]",
                "tileloadd tmm6, [{p} + {sb} + 64]",
                "tileloadd tmm7, [{p} + {sb} + 128]",
                "tdpbf16ps tmm0, tmm4, tmm5",
                "tileloadd tmm5, [{p} + {sb} + 192]",
                "tdpbf16ps tmm1, tmm4, tmm6",
                "tdpbf16ps tmm2, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm4, tmm5",
                "add {a}, 1024",
                "add {o}, 8",
                "dec {n}",
                "jnz 2b",
                "tilestored [{d} + {sd}], tmm0",
                "tilestored [{d} + {sd} + 64], tmm1",
                "tilestored [{d} + {sd} + 128], tmm2",
                "tilestored [{d} + {sd} + 192], tmm3",
                a = inout(reg) a => _,
                o = inout(reg) offs.as_ptr() => _,
                n = inout(reg) steps => _,
                p = out(reg) _,
                x = in(reg) x,
                sa = in(reg) 64usize,
                sb = in(reg) 4 * q_len,
                d = in(reg) buf,
                sd = in(reg) 256usize,
                options(nostack),
            );
        }
    }

    /// Weight gradient, 2 input-channel tiles (A rows from `a0`, `a1`, `2·plane` bytes apart)
    /// × 2 output-channel tiles (B from `b0`, `b1`): accumulators `c[0..4]` = (a0, b0),
    /// (a0, b1), (a1, b0), (a1, b1) from zero, `chunks` times four `tdpbf16ps` (A on by 64
    /// bytes, B by 1 KiB each time), stored back.
    ///
    /// # Safety
    /// Tiles configured as 16 × 64 bytes; every A and B row read lies in its buffer; each
    /// `c[j]` is 16 × 16 writable F32.
    pub(super) unsafe fn wgrad_2x2(
        chunks: usize,
        a0: *const u8,
        a1: *const u8,
        plane: usize,
        b0: *const u8,
        b1: *const u8,
        c: [*mut f32; 4],
    ) {
        // SAFETY: per the caller's guarantee; only tile registers, the pointer copies and the
        // flags are changed.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a0} + {sa}]",
                "tileloadd tmm5, [{a1} + {sa}]",
                "tileloadd tmm6, [{b0} + {s64}]",
                "tileloadd tmm7, [{b1} + {s64}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c0} + {s64}], tmm0",
                "tilestored [{c1} + {s64}], tmm1",
                "tilestored [{c2} + {s64}], tmm2",
                "tilestored [{c3} + {s64}], tmm3",
                a0 = inout(reg) a0 => _,
                a1 = inout(reg) a1 => _,
                b0 = inout(reg) b0 => _,
                b1 = inout(reg) b1 => _,
                n = inout(reg) chunks => _,
                sa = in(reg) 2 * plane,
                s64 = in(reg) 64usize,
                c0 = in(reg) c[0],
                c1 = in(reg) c[1],
                c2 = in(reg) c[2],
                c3 = in(reg) c[3],
                options(nostack),
            );
        }
    }

    /// Weight gradient, 2 taps (A rows from `a[j]`, B from `b[j]`) of one input-channel
    /// tile × one output-channel tile: accumulators `c[j]` = (a[j], b[j]), as `wgrad_2x2`.
    ///
    /// # Safety
    /// As `wgrad_2x2`.
    pub(super) unsafe fn wgrad_taps2(
        chunks: usize,
        a: [*const u8; 2],
        plane: usize,
        b: [*const u8; 2],
        c: [*mut f32; 2],
    ) {
        // SAFETY: as in `wgrad_2x2`.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "2:",
                "tileloadd tmm4, [{a0} + {sa}]",
                "tileloadd tmm6, [{b0} + {s64}]",
                "tileloadd tmm5, [{a1} + {sa}]",
                "tileloadd tmm7, [{b1} + {s64}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm5, tmm7",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c0} + {s64}], tmm0",
                "tilestored [{c1} + {s64}], tmm1",
                a0 = inout(reg) a[0] => _,
                a1 = inout(reg) a[1] => _,
                b0 = inout(reg) b[0] => _,
                b1 = inout(reg) b[1] => _,
                n = inout(reg) chunks => _,
                sa = in(reg) 2 * plane,
                s64 = in(reg) 64usize,
                c0 = in(reg) c[0],
                c1 = in(reg) c[1],
                options(nostack),
            );
        }
    }

    /// `copy_dy` for one image whose rows and padded width are even: pair `P / 2` of
    /// channel tile `t` (`dyq[(t·tile_pairs + P/2)·16..][..16]`, `P = at + oh·wp + ow`) is
    /// the pair at `(oh, ow)` of the tile's 16 channels of `dy`.
    ///
    /// # Safety
    /// AVX-512 F; `w_out`, `wp` and `at` even; `dy` one image of `g`'s output gradient;
    /// `dyq` holds `c_out / 16 · tile_pairs` pairs of 16 and every `P / 2` is below
    /// `tile_pairs`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gather_pairs(
        dy: &[half::bf16],
        g: &crate::backend::nn::Conv2dGeom,
        wp: usize,
        tile_pairs: usize,
        at: usize,
        dyq: &mut [u32],
    ) {
        use std::arch::x86_64::*;
        let (l2, wo2, wp2) = (g.l() / 2, g.w_out / 2, wp / 2);
        debug_assert!(dy.len() >= g.out_image() && dyq.len() >= g.c_out * tile_pairs);
        let lanes: [i32; 16] = std::array::from_fn(|c| (c * l2) as i32);
        let idx0 = _mm512_loadu_si512(lanes.as_ptr().cast());
        let src = dy.as_ptr().cast::<u8>();
        for t in 0..g.c_out / 16 {
            let tile = unsafe { src.add(t * 16 * l2 * 4) };
            let out = unsafe { dyq.as_mut_ptr().add((t * tile_pairs + at / 2) * 16) };
            for oh in 0..g.h_out {
                for q in 0..wo2 {
                    let idx = _mm512_add_epi32(idx0, _mm512_set1_epi32((oh * wo2 + q) as i32));
                    // SAFETY: per the caller's guarantee.
                    unsafe {
                        let v = _mm512_i32gather_epi32::<4>(idx, tile.cast::<i32>());
                        _mm512_storeu_si512(out.add((oh * wp2 + q) * 16).cast(), v);
                    }
                }
            }
        }
    }
}

/// How a weight-gradient plan tiles: 2 input-channel tiles × 2 output-channel tiles of one
/// tap (input and output channels multiples of 32), or 2 taps of one input-channel tile and
/// one output-channel tile (multiples of 16; an odd last tap paired with itself, its repeat
/// not stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WgradTiles {
    Channels2x2,
    Taps2,
}

/// Pixel pairs of zeros before and after each output-channel tile of a weight gradient's
/// `dy` copies: a tap's chunks start up to 31 pixels before the first pixel and end up to
/// 31 past the last (`AmxWgradPlan::add_weight_grad`).
const DY_PAD: usize = 16;

/// The weight gradient of a BF16 convolution on AMX tiles, read from copies of a run of
/// images: `dw[o][c][tap] = Σ_p dy[o][p] · x[c][p + off(tap)]` over the run's pixels (over
/// the padded width, where the output gradient's copy holds zeros in the columns that are
/// no output), as `C [c 16][o 16] += A [c 16][32 pixels] · B [16 pixel pairs][o 16]`:
/// - A rows are 32 consecutive pixels of one input-channel plane of a padded copy of the
///   images (BF16, the images one after another `qx` apart), read in place;
/// - B is the output gradient by pixel pair (`[o / 16][P / 2][16]` of `u32`), made once per
///   run;
/// - the accumulator tiles start from zero and are stored once to an F32 gradient in tile
///   order, added to `dw` at the end.
///
/// Any stride (the copy of `x` cut into phase planes, `Phases`), padding and dilation,
/// input and output channels multiples of 16.
#[derive(Clone, Debug)]
pub struct AmxWgradPlan {
    amx: bool,
    g: Conv2dGeom,
    /// The phase planes (`Phases`); strided: at least the output width rounded up to even.
    ph: Phases,
    /// The phase planes the taps read, in the order of the copy's plane groups.
    phases: Vec<(usize, usize)>,
    /// Pixels of one image in the copies (over the plane width), a multiple of 32.
    qx: usize,
    /// Elements of `x`'s copy read past the last image: the widest tap offset, rounded up.
    tail: usize,
    /// `taps[t]`: the phase group tap `t` reads and where, in pixels from its output pixel.
    taps: Vec<(usize, usize)>,
    tiles: WgradTiles,
}

/// A weight gradient's copies of x and dy, the layout (geometry, images) their zeros were
/// written for, and its F32 gradient in tile order.
type WgradBuffers = (
    Aligned<u16>,
    Aligned<u32>,
    Option<(Conv2dGeom, usize)>,
    Aligned<f32>,
);

thread_local! {
    /// The copies of a weight gradient's run (x as BF16 planes, dy as pixel pairs) and its
    /// F32 gradient in tile order.
    static WGRAD: RefCell<WgradBuffers> =
        const { RefCell::new((Aligned::new(), Aligned::new(), None, Aligned::new())) };
}

impl AmxWgradPlan {
    /// The plan where this file is the route: a convolution `with_amx` takes, on a CPU and
    /// OS that run AMX-BF16.
    pub fn new(g: &Conv2dGeom) -> Option<Self> {
        if !amx_available() {
            return None;
        }
        Self::with_amx(g, true)
    }

    /// The plan on AMX tiles (`amx`, where usable) or on their portable twin; `None` for
    /// convolutions it does not take: strides other than 1, groups, input or output channels
    /// not multiples of 16, no output.
    pub fn with_amx(g: &Conv2dGeom, amx: bool) -> Option<Self> {
        if amx && !amx_available() {
            return None;
        }
        let (sh, sw) = g.stride;
        if sh == 0 || sw == 0 || g.groups != 1 || g.l() == 0 || g.kh == 0 || g.kw == 0 {
            return None;
        }
        if g.c_in == 0
            || g.c_out == 0
            || !g.c_in.is_multiple_of(T16)
            || !g.c_out.is_multiple_of(T16)
            || !fits_u32(g)
        {
            return None;
        }
        // Strided: an even plane width, so that dy's pixel pairs are gathered from its rows
        // (`copy_dy`). Stride 1 keeps the padded width (the sums, so the bits, as they were).
        let mut ph = Phases::new(g);
        if g.stride != (1, 1) {
            ph.wq = ph.wq.next_multiple_of(2);
        }
        let p_len = (g.h_out - 1) * ph.wq + g.w_out;
        let mut phases = Vec::new();
        let mut taps = Vec::with_capacity(g.kh * g.kw);
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let (phase, off) = ph.tap(g, ki, kj);
                let at = match phases.iter().position(|&p| p == phase) {
                    Some(i) => i,
                    None => {
                        phases.push(phase);
                        phases.len() - 1
                    }
                };
                taps.push((at, off));
            }
        }
        let max_off = taps.iter().map(|&(_, off)| off).max().unwrap_or(0);
        // Every pixel a tap of an image's outputs reads lies in its own `hq·wq` plane.
        let qx = (ph.hq * ph.wq).max(p_len).next_multiple_of(CHUNK);
        let tail = (max_off + CHUNK).next_multiple_of(CHUNK);
        let tiles = if g.c_in.is_multiple_of(2 * T16) && g.c_out.is_multiple_of(2 * T16) {
            WgradTiles::Channels2x2
        } else {
            WgradTiles::Taps2
        };
        Some(AmxWgradPlan {
            amx,
            g: *g,
            ph,
            phases,
            qx,
            tail,
            taps,
            tiles,
        })
    }

    /// Whether the plan runs on AMX tiles (else on the portable twin).
    pub fn uses_amx(&self) -> bool {
        self.amx
    }

    /// The weight gradient of `n` images added to `dw [c_out, c_in, kh, kw]`: per element,
    /// the products summed in F32 over the run's pixels, then added (`x [n, c_in, h, w]`,
    /// `dy [n, c_out, h_out, w_out]`).
    pub fn add_weight_grad(&self, x: &[bf16], dy: &[bf16], n: usize, dw: &mut [f32]) {
        let g = &self.g;
        assert!(
            x.len() >= n * g.in_image() && dy.len() >= n * g.out_image(),
            "conv_amx: buffers too small for {n} images of {g:?}"
        );
        assert!(dw.len() >= g.weight_len(), "conv_amx: dw too short");
        if n == 0 {
            return;
        }
        let taps = self.taps.len();
        let groups = self.phases.len();
        let (cit, cot) = (g.c_in / T16, g.c_out / T16);
        // Taps rounded up to pairs for `Taps2` (the repeat lands past the real taps).
        let tap_slots = match self.tiles {
            WgradTiles::Channels2x2 => taps,
            WgradTiles::Taps2 => taps.next_multiple_of(2),
        };
        let np = n * self.qx;
        // Pairs per output-channel tile of one `dy` copy, and the u32 of one copy.
        let tile_pairs = np / 2 + 2 * DY_PAD;
        let copy_len = cot * tile_pairs * T16;
        WGRAD.with_borrow_mut(|(xc, dyq, layout, acc)| {
            // The copies hold zeros wherever no pixel is written: written once per layout.
            if *layout != Some((*g, n)) {
                xc.set_zeroed(groups * g.c_in * (np + self.tail));
                dyq.set_zeroed(2 * copy_len);
                *layout = Some((*g, n));
            }
            self.copy_x(x, n, xc);
            let (even, odd) = dyq.split_at_mut(copy_len);
            self.copy_dy(dy, n, tile_pairs, even);
            // The odd pairing (pixels 2m - 1, 2m): halves of neighbouring even pairs.
            odd[T16..]
                .iter_mut()
                .zip(even.iter().zip(&even[T16..]))
                .for_each(|(d, (&prev, &this))| *d = (prev >> 16) | (this << 16));
            // Not zeroed: every tile is written once, from zero (`run`), before it is read
            // (a memset of up to 9 MiB per run on ResNet-50's last stage).
            let need = tap_slots * cit * cot * T16 * T16;
            if acc.len() < need {
                acc.grow(need);
            }
            let plane = np + self.tail;
            // Each tap sums over its own grid of 32-pixel chunks: those of x from its offset
            // rounded down to 32 (so every A row starts on a 64-byte line: a row crossing
            // lines made `tileloadd` 4 times slower), dy `r = off % 32` pixels before the
            // run's start (zeros there and past its end), read from the copy paired from
            // an even or an odd pixel. One chunk more than the run covers every pixel.
            let chunks = np / CHUNK + 1;
            let a_of = |grp: usize, ci: usize, off: usize| {
                (grp * cit + ci) * T16 * plane + off / CHUNK * CHUNK
            };
            let b_of = |off: usize, co: usize| {
                let r = off % CHUNK;
                let (copy, first) = if r.is_multiple_of(2) {
                    (0, DY_PAD - r / 2)
                } else {
                    (1, DY_PAD - (r - 1) / 2)
                };
                copy * copy_len + (co * tile_pairs + first) * T16
            };
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `amx` only where AMX-BF16 is usable (`with_amx`).
            let _release = self
                .amx
                .then(|| unsafe { crate::cpu::amx::TileConfig::all_16x64().load() });
            match self.tiles {
                WgradTiles::Channels2x2 => {
                    for (t, &(grp, off)) in self.taps.iter().enumerate() {
                        for ci in (0..cit).step_by(2) {
                            for co in (0..cot).step_by(2) {
                                let a = [ci, ci + 1].map(|c| a_of(grp, c, off));
                                let b = [co, co + 1].map(|c| b_of(off, c));
                                let c = [(ci, co), (ci, co + 1), (ci + 1, co), (ci + 1, co + 1)]
                                    .map(|(i, o)| ((t * cit + i) * cot + o) * T16 * T16);
                                self.run(
                                    xc,
                                    dyq,
                                    acc,
                                    plane,
                                    chunks,
                                    &[a[0], a[0], a[1], a[1]],
                                    &[b[0], b[1], b[0], b[1]],
                                    &c,
                                );
                            }
                        }
                    }
                }
                WgradTiles::Taps2 => {
                    for ci in 0..cit {
                        for co in 0..cot {
                            for t0 in (0..taps).step_by(2) {
                                let tap = |j: usize| self.taps[(t0 + j).min(taps - 1)];
                                let a = [0, 1].map(|j| a_of(tap(j).0, ci, tap(j).1));
                                let b = [0, 1].map(|j| b_of(tap(j).1, co));
                                let c = [0, 1]
                                    .map(|j| ((ci * cot + co) * tap_slots + t0 + j) * T16 * T16);
                                self.run(xc, dyq, acc, plane, chunks, &a, &b, &c);
                            }
                        }
                    }
                }
            }
            // The tiles back into `dw [o][c][tap]`.
            for t in 0..taps {
                for c in 0..g.c_in {
                    for o in 0..g.c_out {
                        let (i, r, j, q) = (c / T16, c % T16, o / T16, o % T16);
                        let tile = match self.tiles {
                            WgradTiles::Channels2x2 => (t * cit + i) * cot + j,
                            WgradTiles::Taps2 => (i * cot + j) * tap_slots + t,
                        };
                        dw[(o * g.c_in + c) * taps + t] += acc[(tile * T16 + r) * T16 + q];
                    }
                }
            }
        })
    }

    /// Accumulator tiles `acc[c[j]..]` (16 × 16 F32 each, distinct; four for
    /// `Channels2x2`, two for `Taps2`) = A (`xc` from `a[j]`, rows `plane` apart) · B (`dyq`
    /// from `b[j]`), summed from zero over `chunks` chunks of 32 pixels.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        xc: &[u16],
        dyq: &[u32],
        acc: &mut [f32],
        plane: usize,
        chunks: usize,
        a: &[usize],
        b: &[usize],
        c: &[usize],
    ) {
        let tiles = match self.tiles {
            WgradTiles::Channels2x2 => 4,
            WgradTiles::Taps2 => 2,
        };
        assert!(a.len() == tiles && b.len() == tiles && c.len() == tiles);
        for j in 0..tiles {
            assert!(
                a[j] + 15 * plane + chunks * CHUNK <= xc.len(),
                "conv_amx: A past the copy"
            );
            assert!(
                b[j] + chunks * T16 * T16 <= dyq.len(),
                "conv_amx: B past the copy"
            );
            assert!(c[j] + T16 * T16 <= acc.len(), "conv_amx: C past the tiles");
        }
        #[cfg(target_arch = "x86_64")]
        if self.amx {
            // SAFETY: tiles configured (`add_weight_grad`); the bounds checked above: every A
            // row read (16 rows `plane` apart, 32 pixels a chunk) lies in `xc`, every B row
            // (16 rows of 16 a chunk) in `dyq`, each C tile in `acc`.
            unsafe {
                let xa = |j: usize| xc.as_ptr().add(a[j]).cast::<u8>();
                let yb = |j: usize| dyq.as_ptr().add(b[j]).cast::<u8>();
                let accp = acc.as_mut_ptr();
                let ca = |j: usize| accp.add(c[j]);
                match self.tiles {
                    WgradTiles::Channels2x2 => x86::wgrad_2x2(
                        chunks,
                        xa(0),
                        xa(2),
                        plane,
                        yb(0),
                        yb(1),
                        [ca(0), ca(1), ca(2), ca(3)],
                    ),
                    WgradTiles::Taps2 => x86::wgrad_taps2(
                        chunks,
                        [xa(0), xa(1)],
                        plane,
                        [yb(0), yb(1)],
                        [ca(0), ca(1)],
                    ),
                }
            }
            return;
        }
        let f = |bits: u16| f32::from_bits(u32::from(bits) << 16);
        for j in 0..tiles {
            let tile = &mut acc[c[j]..c[j] + T16 * T16];
            tile.fill(0.0);
            for ch in 0..chunks {
                for r in 0..T16 {
                    let arow = &xc[a[j] + r * plane + ch * CHUNK..][..CHUNK];
                    for q in 0..T16 {
                        let mut s = tile[r * T16 + q];
                        for pp in 0..T16 {
                            let v = dyq[b[j] + (ch * T16 + pp) * T16 + q];
                            s += f(arow[2 * pp]) * f(v as u16);
                            s += f(arow[2 * pp + 1]) * f((v >> 16) as u16);
                        }
                        tile[r * T16 + q] = s;
                    }
                }
            }
        }
    }

    /// `x`'s `n` images as BF16 planes of `n·qx + tail`, phase group by phase group
    /// (`phases`), `c_in` planes each: image `i`'s element `(r, c)` of a phase plane at
    /// `i·qx + r·wq + c`. Writes only those pixels (`xc` holds the zeros:
    /// `add_weight_grad`).
    fn copy_x(&self, x: &[bf16], n: usize, xc: &mut [u16]) {
        let g = &self.g;
        let sw = g.stride.1;
        let plane = n * self.qx + self.tail;
        for (grp, &phase) in self.phases.iter().enumerate() {
            for i in 0..n {
                let img = &x[i * g.in_image()..(i + 1) * g.in_image()];
                for (c, src) in img.chunks_exact(g.h * g.w).enumerate() {
                    let dst = &mut xc[(grp * g.c_in + c) * plane + i * self.qx..];
                    self.ph.runs(g, phase, |at, from, len| {
                        let d = &mut dst[at..at + len];
                        if sw == 1 {
                            for (d, s) in d.iter_mut().zip(&src[from..from + len]) {
                                *d = s.to_bits();
                            }
                        } else {
                            // As in `AmxConvPlan::copy`: whole strides, then the last value.
                            let (last, d) = d.split_last_mut().expect("a run is not empty");
                            let s = src[from..from + d.len() * sw].chunks_exact(sw);
                            for (d, s) in d.iter_mut().zip(s) {
                                *d = s[0].to_bits();
                            }
                            *last = src[from + d.len() * sw].to_bits();
                        }
                    });
                }
            }
        }
    }

    /// `dy`'s `n` images by pixel pair: `dyq[o / 16][DY_PAD + P / 2][o % 16]` (`tile_pairs`
    /// pairs a tile) holds `dy[o]` at pixels `P` (low half) and `P + 1` (high half), `P =
    /// i·qx + oh·wq + ow`; zeros elsewhere. Writes only those pixels (`dyq` holds the zeros:
    /// `add_weight_grad`).
    fn copy_dy(&self, dy: &[bf16], n: usize, tile_pairs: usize, dyq: &mut [u32]) {
        let g = &self.g;
        let (wo, l) = (g.w_out, g.l());
        #[cfg(target_arch = "x86_64")]
        if wo.is_multiple_of(2) && self.ph.wq.is_multiple_of(2) && cpu_has!(Avx512f) {
            // Even rows over an even padded width: a pair of pixels of the copy is a pair of
            // one row of dy, gathered 16 channels at a time.
            for i in 0..n {
                let img = &dy[i * g.out_image()..(i + 1) * g.out_image()];
                // SAFETY: AVX-512 F checked; the gathers read pairs within the image (`l` is
                // even, every index below `c_out·l/2`) and the stores write pairs of `dyq`
                // below `c_out / 16 · tile_pairs` (`DY_PAD + np/2 + DY_PAD` a tile).
                let at = DY_PAD * 2 + i * self.qx;
                unsafe { x86::gather_pairs(img, g, self.ph.wq, tile_pairs, at, dyq) };
            }
            return;
        }
        // As 16-bit halves: pixel P of channel o at `(o / 16)·tile_pairs·32 + (DY_PAD + P / 2)
        // ·32 + (o % 16)·2 + P % 2`, so consecutive pixels alternate between two halves of one
        // `u32` and the next `u32` pair lies 32 halves on.
        let halves: &mut [u16] = crate::cpu::gemm::pack::as_halves(dyq);
        for i in 0..n {
            let img = &dy[i * g.out_image()..(i + 1) * g.out_image()];
            for (o, src) in img.chunks_exact(l).enumerate() {
                let base = ((o / T16) * tile_pairs + DY_PAD) * 2 * T16 + (o % T16) * 2;
                for (oh, row) in src.chunks_exact(wo).enumerate() {
                    let p0 = i * self.qx + oh * self.ph.wq;
                    for (ow, v) in row.iter().enumerate() {
                        let pix = p0 + ow;
                        let half = if cfg!(target_endian = "little") {
                            pix & 1
                        } else {
                            1 - (pix & 1)
                        };
                        halves[base + (pix >> 1) * 2 * T16 + half] = v.to_bits();
                    }
                }
            }
        }
    }
}
