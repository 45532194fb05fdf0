//! Pure allocation-block operations (no I/O): assign, release, garbage collection.
