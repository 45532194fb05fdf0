//! Helpers shared by the unit tests.

use std::collections::HashMap;

/// An environment lookup over `pairs` (for code that reads its settings through a closure).
pub fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}
