//! Causal and sliding-window visibility, applied by the kernel's loop bounds.

/// Visibility rules applied by loop bounds (no L×S tensor is ever materialised).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Causal {
    /// Key j is visible from query i iff j <= i + offset (top-left: 0; bottom-right: S - L).
    pub offset: isize,
    /// Optional sliding window W: additionally requires j > i + offset - W (exactly W keys;
    /// W = 0 hides every key, so every row is 0).
    pub window: Option<usize>,
}
