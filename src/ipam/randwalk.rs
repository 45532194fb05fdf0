//! The host-seeded random walk over a pool's blocks, bit-for-bit as upstream
//! (Go math/rand source + big.Int.Rand), so every node picks the same blocks Calico would.
