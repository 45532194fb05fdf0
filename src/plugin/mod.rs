//! The `calico` network plugin.
