//! # candle-attention
//!
//! PyTorch-exact attention layers for [Candle](https://github.com/huggingface/candle),
//! proven equal to PyTorch on safetensors fixtures that PyTorch exported.
//!
//! - [`scaled_dot_product_attention`] is `torch.nn.functional.scaled_dot_product_attention`,
//!   argument by argument (masks, `is_causal`, `scale`, `enable_gqa`, fully masked rows → 0).
//! - [`AttnMask`] is a mask whose polarity is fixed by its constructor.
//! - [`MultiheadAttention`] is `torch.nn.MultiheadAttention`, loaded from its `state_dict` names.
//! - [`ScaledDotProductAttention`], [`MultiHeadAttention`] and [`CausalAttention`] are the
//!   three modules of the reference notes, done right.
//! - [`fixture`] is the runner that checks a layer against a PyTorch fixture file.
//!
//! Every layer implements [`candle_nn::Module`] and runs on any candle device.
#![warn(missing_docs)]
extern crate candle_core as candle;
pub mod alibi;
pub mod cache;
mod cast;
pub mod decoder;
mod dims;
mod empty;
pub mod fixture;
pub mod kernels;
pub mod mask;
pub mod mha;
pub mod notes;
pub mod proj;
pub mod rope;
pub mod sdpa;
#[cfg(test)]
mod testing;

pub use cache::{KvCache, KvView};
pub use mask::{AttnMask, CausalAlign, CausalRule};
pub use mha::{MhaArgs, MultiheadAttention, MultiheadAttentionConfig};
pub use notes::{AttentionConfig, CausalAttention, MultiHeadAttention, ProjNames, ScaledDotProductAttention};
pub use proj::Proj;
pub use rope::{RopeConfig, RopeScaling, RopeStyle, RotaryEmbedding};
/// The instruction set of the fused CPU kernel on this machine: `avx512`, `avx2+fma`, `neon`
/// or `portable` (`CANDLE_ATTENTION_ISA=portable|avx2|avx512` forces one the machine supports).
pub fn cpu_kernel_isa() -> &'static str {
    kernels::cpu::isa()
}

pub use sdpa::{scaled_dot_product_attention, sdpa, Backend, SdpaOptions, SdpaOutput};
