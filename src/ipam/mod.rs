//! The `calico-ipam` plugin and Calico's block allocator.

pub mod block;
pub mod randwalk;
