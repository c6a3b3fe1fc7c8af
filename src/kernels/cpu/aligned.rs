//! Zero-initialised buffers whose data starts on a 64-byte (cache-line) boundary.

/// A zero-initialised f32 buffer whose data starts on a 64-byte boundary.
pub(crate) struct AlignedBuf {
    buf: Vec<f32>,
    off: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let buf = vec![0f32; len + 16];
        let off = buf.as_ptr().align_offset(64).min(16);
        Self { buf, off, len }
    }
    #[inline]
    pub fn as_slice(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.len]
    }
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// A zero-initialised buffer whose data starts on a 64-byte (cache-line) boundary, so
/// that AMX tile rows and AVX-512 vectors at 64-byte strides never straddle two lines.
pub(crate) struct AVec<T> {
    buf: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy + Default> AVec<T> {
    /// `len` zeroed (default) elements.
    pub fn new(len: usize) -> Self {
        let extra = 64 / std::mem::size_of::<T>().max(1);
        let buf = vec![T::default(); len + extra];
        let off = buf.as_ptr().align_offset(64).min(extra);
        Self { buf, off, len }
    }

    /// Makes room for at least `n` elements (contents are not kept when it grows).
    pub fn grow(&mut self, n: usize) {
        if self.len < n {
            *self = Self::new(n);
        }
    }
}

impl<T> Default for AVec<T> {
    fn default() -> Self {
        Self {
            buf: Vec::new(),
            off: 0,
            len: 0,
        }
    }
}

impl<T> std::ops::Deref for AVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl<T> std::ops::DerefMut for AVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.off..self.off + self.len]
    }
}
