//! Calico's block allocator: a library on the datastore, knowing nothing of CNI or the
//! plugins (`ipam_driver::calico` and `ipam_plugin` are its CNI-facing users).

pub mod allocator;
pub mod block;
pub mod block_copies;
pub mod lock;
pub mod owner;
pub mod randwalk;
pub mod selector;
pub mod verify;
