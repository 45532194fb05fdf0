//! The recorded oracle: upstream's normalized observations of every single-binary case,
//! as test data (tests/differential/recorded.jsonl). Its first line says which upstream
//! made it; each further line is one case: its id, the digest of its definition when it
//! was recorded, and one observation per step. Only `make oracle` writes it.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::observe::Observation;

/// The folder of the suite's data.
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/differential")
}

pub fn recording_path() -> PathBuf {
    data_dir().join("recorded.jsonl")
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Header {
    /// `calico -v` of the binary that was recorded.
    pub upstream_version: String,
    /// The upstream commit it was built from.
    pub upstream_commit: String,
    /// When (UTC, RFC 3339).
    pub recorded_at: String,
    pub cases: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recorded {
    pub id: String,
    pub digest: String,
    pub steps: Vec<Observation>,
}

pub struct Recording {
    pub header: Header,
    pub cases: BTreeMap<String, Recorded>,
}

impl Recording {
    pub fn load(path: &Path) -> Recording {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
            panic!(
                "read {}: {e} (the recording is made by `make oracle`)",
                path.display()
            )
        });
        let mut lines = text.lines();
        let header: Header = serde_json::from_str(lines.next().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{}: header: {e}", path.display()));
        let mut cases = BTreeMap::new();
        for (n, line) in lines.enumerate() {
            let r: Recorded = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{}:{}: {e}", path.display(), n + 2));
            cases.insert(r.id.clone(), r);
        }
        Recording { header, cases }
    }

    pub fn write(&self, path: &Path) {
        let tmp = path.with_extension("jsonl.tmp");
        let mut f =
            std::fs::File::create(&tmp).unwrap_or_else(|e| panic!("create {}: {e}", tmp.display()));
        let mut put = |v: String| {
            f.write_all(v.as_bytes())
                .and_then(|_| f.write_all(b"\n"))
                .unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()))
        };
        put(serde_json::to_string(&self.header).unwrap_or_default());
        for r in self.cases.values() {
            put(serde_json::to_string(r).unwrap_or_default());
        }
        drop(f);
        std::fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
    }
}
