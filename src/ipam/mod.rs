//! Calico's block allocator: a library on the datastore, knowing nothing of CNI or the
//! plugins (`calico_ipam` is its CNI-facing user, which `calico` also runs in-process).

pub mod allocator;
pub mod block;
pub mod block_copies;
pub mod lock;
pub mod owner;
pub mod randwalk;
pub mod selector;
pub mod verify;
