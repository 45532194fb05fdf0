//! The `calico-ipam` plugin and Calico's block allocator.

pub mod allocator;
pub mod block;
pub mod lock;
pub mod plugin;
pub mod randwalk;
pub mod selector;
pub mod upgrade;
pub mod verify;
