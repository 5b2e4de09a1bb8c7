//! Buffers that start on a 64-byte boundary (`Aligned`), for the AMX kernels' tiles.

/// 64 bytes on a 64-byte boundary: the unit of `Aligned`.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Element types `Aligned` holds: plain data for which all-zero bytes are a value.
///
/// # Safety
/// Every bit pattern, all zeros included, is a valid `Self`; no padding, no drop.
pub(crate) unsafe trait Plain: Copy {}
// SAFETY: integers and floats of any bits.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}

/// A buffer of `T` that starts on a 64-byte boundary: what tiles are loaded from and stored
/// to. `malloc` aligns to 16 bytes, and on Emerald Rapids (2-core VM) a `tileloadd` whose
/// rows cross cache lines took about 4 times as long as an aligned one (19 against 4.5 ns
/// for 16 rows of 64 bytes), long enough that the loads no longer hid behind the
/// `tdpbf16ps` they feed.
#[derive(Clone)]
pub(crate) struct Aligned<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Plain> Aligned<T> {
    /// No elements.
    pub(crate) const fn new() -> Self {
        Aligned {
            lines: Vec::new(),
            len: 0,
            _t: std::marker::PhantomData,
        }
    }

    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        let mut a = Self::new();
        a.set_zeroed(len);
        a
    }

    /// Makes the buffer `len` zeros (reusing its memory where it is large enough).
    pub(crate) fn set_zeroed(&mut self, len: usize) {
        let lines = bytes::<T>(len).div_ceil(64);
        self.lines.clear();
        self.lines.resize(lines, Line([0; 64]));
        self.len = len;
    }

    /// At least `len` elements, those past the old length zero (the others kept).
    pub(crate) fn grow(&mut self, len: usize) {
        if len > self.len {
            self.lines
                .resize(bytes::<T>(len).div_ceil(64), Line([0; 64]));
            self.len = len;
        }
    }
}

/// The bytes of `len` `T`s; a count past the address space is a bug in the caller.
fn bytes<T>(len: usize) -> usize {
    len.checked_mul(size_of::<T>())
        .expect("aligned buffer larger than the address space")
}

impl<T: Plain> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the lines hold at least `len` `T`s' bytes, all initialised (zeros or
        // written as `T`), and a line's alignment (64) is a multiple of `T`'s.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and the borrow is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> std::fmt::Debug for Aligned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Aligned({} elements)", self.len)
    }
}

impl<T: Plain> Default for Aligned<T> {
    fn default() -> Self {
        Self::zeroed(0)
    }
}
