//! Two runs of a case side by side: every place where their observations differ, and which
//! of those the list of accepted differences (tests/differential/accepted.json) explains.
//! The world's states are compared whole after each step (each run's changes summed up from
//! the same seeded world), so a difference shows at every step it lasts.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::case::Case;
use super::observe::Observation;

/// One place where two runs differ.
#[derive(Clone, Debug)]
pub struct Difference {
    /// The step, from 1.
    pub step: usize,
    /// `exit`, `stdout/<pointer>`, or a facet and a pointer into its value.
    pub what: String,
    pub ours: Value,
    pub theirs: Value,
    /// Whether both runs' step failed (a non-zero exit).
    pub both_failed: bool,
}

impl Difference {
    pub fn line(&self) -> String {
        format!(
            "step {} {}: ours {} upstream {}",
            self.step,
            self.what,
            brief(&self.ours),
            brief(&self.theirs)
        )
    }
}

fn brief(v: &Value) -> String {
    let s = match v {
        Value::Null => "(nothing)".to_string(),
        other => other.to_string(),
    };
    if s.chars().count() > 300 {
        format!("{}…", s.chars().take(300).collect::<String>())
    } else {
        s
    }
}

/// Every difference between `ours` and `theirs` (one observation a step each).
pub fn compare(ours: &[Observation], theirs: &[Observation]) -> Vec<Difference> {
    let mut out = Vec::new();
    let (mut a_state, mut b_state) = (BTreeMap::new(), BTreeMap::new());
    for step in 0..ours.len().max(theirs.len()) {
        let n = step + 1;
        let (Some(a), Some(b)) = (ours.get(step), theirs.get(step)) else {
            out.push(Difference {
                step: n,
                what: "steps".into(),
                ours: Value::from(ours.len()),
                theirs: Value::from(theirs.len()),
                both_failed: false,
            });
            break;
        };
        let mut found = Vec::new();
        if a.exit != b.exit {
            found.push(("exit".to_string(), Value::from(a.exit), Value::from(b.exit)));
        }
        diff_value("stdout", &a.stdout, &b.stdout, &mut found);
        apply(&mut a_state, &a.changed);
        apply(&mut b_state, &b.changed);
        let mut facets: Vec<&String> = a_state.keys().chain(b_state.keys()).collect();
        facets.sort();
        facets.dedup();
        for f in facets {
            match (a_state.get(f), b_state.get(f)) {
                (Some(x), Some(y)) => diff_value(f, x, y, &mut found),
                (x, y) => found.push((
                    f.clone(),
                    x.cloned().unwrap_or(Value::Null),
                    y.cloned().unwrap_or(Value::Null),
                )),
            }
        }
        let both_failed = a.exit != 0 && b.exit != 0;
        out.extend(found.into_iter().map(|(what, ours, theirs)| Difference {
            step: n,
            what,
            ours,
            theirs,
            both_failed,
        }));
    }
    out
}

/// A step's changes applied to a state (`null`: the facet went away).
fn apply(state: &mut BTreeMap<String, Value>, changed: &BTreeMap<String, Value>) {
    for (k, v) in changed {
        match v {
            Value::Null => state.remove(k),
            v => state.insert(k.clone(), v.clone()),
        };
    }
}

type Found = Vec<(String, Value, Value)>;

fn diff_value(path: &str, a: &Value, b: &Value, out: &mut Found) {
    if a == b {
        return;
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let sub = format!("{path}/{k}");
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => diff_value(&sub, p, q, out),
                    (p, q) => out.push((
                        sub,
                        p.cloned().unwrap_or(Value::Null),
                        q.cloned().unwrap_or(Value::Null),
                    )),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                diff_value(&format!("{path}/{i}"), p, q, out);
            }
        }
        _ => out.push((path.to_string(), a.clone(), b.clone())),
    }
}

/// One accepted difference: which cases, which steps' facets, and why.
#[derive(Clone, Debug, Deserialize)]
pub struct Accepted {
    /// A short name, the key of the counts.
    pub id: String,
    /// Case ids it covers (`*` matches anything).
    pub cases: String,
    /// What differs (`*` matches anything), as [`Difference::what`] prints it.
    pub what: String,
    /// Only where ours shows this (a pattern over its value's JSON), when set.
    #[serde(default)]
    pub ours: Option<String>,
    /// Only where upstream shows this (a pattern over its value's JSON), when set.
    #[serde(default)]
    pub upstream: Option<String>,
    /// Only in steps of this command (`ADD`, `CHECK`, …), when set.
    #[serde(default)]
    pub command: Option<String>,
    /// Only in steps that failed in both runs, when set.
    #[serde(default)]
    pub both_failed: bool,
    pub reason: String,
    /// The section of docs/differences.md that says it.
    pub doc: String,
}

#[derive(Debug, Deserialize)]
pub struct AcceptedList {
    pub accepted: Vec<Accepted>,
}

impl AcceptedList {
    pub fn load(path: &std::path::Path) -> AcceptedList {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The accepted difference that explains `d` in `case`, if any.
    pub fn explain(&self, case: &Case, d: &Difference) -> Option<&Accepted> {
        let command = d
            .step
            .checked_sub(1)
            .and_then(|i| case.steps.get(i))
            .map(|s| s.command.as_str());
        self.accepted.iter().find(|a| {
            glob(&a.cases, &case.id)
                && glob(&a.what, &d.what)
                && a.ours.as_ref().is_none_or(|p| glob(p, &d.ours.to_string()))
                && a.upstream
                    .as_ref()
                    .is_none_or(|p| glob(p, &d.theirs.to_string()))
                && a.command.as_deref().is_none_or(|c| Some(c) == command)
                && (!a.both_failed || d.both_failed)
        })
    }
}

/// What a case came to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    Identical,
    /// Every difference accepted; the accepted differences' ids.
    Accepted(Vec<String>),
    Unexplained,
}

pub fn verdict(list: &AcceptedList, case: &Case, diffs: &[Difference]) -> Verdict {
    if diffs.is_empty() {
        return Verdict::Identical;
    }
    let mut ids = Vec::new();
    for d in diffs {
        match list.explain(case, d) {
            Some(a) => ids.push(a.id.clone()),
            None => return Verdict::Unexplained,
        }
    }
    ids.sort();
    ids.dedup();
    Verdict::Accepted(ids)
}

/// The table the replay and the live run print.
pub fn table(
    title: &str,
    verdicts: &[(String, Verdict)],
    commit: &str,
    list: &AcceptedList,
) -> String {
    let total = verdicts.len();
    let identical = verdicts
        .iter()
        .filter(|(_, v)| *v == Verdict::Identical)
        .count();
    let unexplained = verdicts
        .iter()
        .filter(|(_, v)| *v == Verdict::Unexplained)
        .count();
    let mut by_reason: BTreeMap<String, usize> = BTreeMap::new();
    let mut accepted = 0;
    for (_, v) in verdicts {
        if let Verdict::Accepted(ids) = v {
            accepted += 1;
            for id in ids {
                *by_reason.entry(id.clone()).or_default() += 1;
            }
        }
    }
    let mut s = format!(
        "{title}\n\n| cases | identical | accepted | unexplained | upstream |\n|---|---|---|---|---|\n| {total} | {identical} | {accepted} | {unexplained} | {commit} |\n"
    );
    if !by_reason.is_empty() {
        s.push_str("\n| accepted difference | cases | why |\n|---|---|---|\n");
        for (id, n) in by_reason {
            let why = list
                .accepted
                .iter()
                .find(|a| a.id == id)
                .map(|a| format!("{} ([docs]({}))", a.reason, a.doc))
                .unwrap_or_default();
            s.push_str(&format!("| {id} | {n} | {why} |\n"));
        }
    }
    s
}

/// `*`-glob match of the whole of `text`.
pub fn glob(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let mut rest = text;
    for (i, part) in parts.iter().enumerate() {
        if i == 0 {
            match rest.strip_prefix(part) {
                Some(r) => rest = r,
                None => return false,
            }
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            match rest.find(part) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
    }
    true
}

#[test]
fn globs_match_whole_texts() {
    assert!(glob("etcd/*", "etcd/v4/add"));
    assert!(!glob("etcd/*", "kdd/v4/add"));
    assert!(glob(
        "*profiles/*",
        "etcd:/calico/resources/v3/projectcalico.org/profiles/net1"
    ));
    assert!(glob("a*b*c", "axxbyyc"));
    assert!(!glob("a*b*c", "axxbyyd"));
    assert!(glob("exact", "exact"));
    assert!(glob("*", ""));
}

/// Every accepted difference names its reason and a section of docs/differences.md that
/// exists (GitHub's anchors: lower case, spaces to `-`, punctuation dropped).
#[test]
fn every_accepted_difference_links_to_its_section() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let list = AcceptedList::load(&root.join("tests/differential/accepted.json"));
    let doc = std::fs::read_to_string(root.join("docs/differences.md")).unwrap();
    let anchors: Vec<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| {
            h.to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect();
    for a in &list.accepted {
        assert!(!a.reason.is_empty(), "{}: no reason", a.id);
        let anchor = a
            .doc
            .strip_prefix("docs/differences.md#")
            .unwrap_or_else(|| {
                panic!(
                    "{}: {} is not a section of docs/differences.md",
                    a.id, a.doc
                )
            });
        assert!(
            anchors.iter().any(|x| x == anchor),
            "{}: no section #{anchor} in docs/differences.md ({anchors:?})",
            a.id
        );
    }
}
