//! The differential suite: each case of a generated corpus (corpus.rs) run in identical
//! fresh worlds (world.rs) by ours and by upstream Calico v3.32.1's own binaries, and their
//! normalized observations compared (observe.rs, compare.rs). See docs/differences.md.
//!
//! * `replay_the_recorded_oracle` (in `make test`): upstream's outcomes, recorded into
//!   tests/differential/recorded.jsonl by `make oracle`, against ours; fails on any
//!   difference that tests/differential/accepted.json does not explain, and on a
//!   recording that is missing or was made from another definition of its case.
//! * `live_against_upstream` (`make differential`, needs upstream's binaries): every case,
//!   mixed sequences too, run by both.
//! * `record_the_oracle` (`make oracle`, needs upstream's binaries): writes the recording.
//!
//! Upstream's binaries are found in the folder `CALICO_UPSTREAM_BIN` names (`calico`; the
//! harness links `calico-ipam` to it). `CALICO_DIFFERENTIAL_CASES` (comma-separated `*`
//! patterns) runs a part of the corpus; `CALICO_DIFFERENTIAL_WORKERS` (2) worlds run at once;
//! with `CALICO_DIFFERENTIAL_STDERR` set, each call's stderr is kept in
//! `target/differential/stderr/`.

mod case;
mod compare;
mod corpus;
mod etcd_kv;
mod observe;
mod oracle;
mod world;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde_json::Value;

use crate::common::cni::report_skip;
use crate::common::netns::require_root;
use crate::common::real_k8s::RealK8s;

use case::{By, Case};
use compare::{compare, glob, table, verdict, AcceptedList, Difference, Verdict};
use observe::{delta, Observation};
use oracle::{recording_path, Header, Recorded, Recording};
use world::{DiffWorld, Side};

const UPSTREAM_ENV: &str = "CALICO_UPSTREAM_BIN";

/// The folder of upstream's binaries, or why there is none.
fn upstream_bin() -> Result<PathBuf, String> {
    let dir = std::env::var_os(UPSTREAM_ENV).ok_or_else(|| {
        format!(
            "{UPSTREAM_ENV} is not set: it names the folder holding upstream Calico v3.32.1's \
             `calico` binary, built from its source outside this repository"
        )
    })?;
    let dir = PathBuf::from(dir);
    if !dir.join("calico").is_file() {
        return Err(format!(
            "{UPSTREAM_ENV}={}: there is no `calico` in it",
            dir.display()
        ));
    }
    Ok(dir)
}

/// The corpus, or the part of it `CALICO_DIFFERENTIAL_CASES` selects.
fn selected() -> Vec<Case> {
    let all = corpus::corpus();
    match std::env::var("CALICO_DIFFERENTIAL_CASES") {
        Ok(p) if !p.is_empty() => all
            .into_iter()
            .filter(|c| p.split(',').any(|g| glob(g.trim(), &c.id)))
            .collect(),
        _ => all,
    }
}

/// Writes straight to the process's stderr (libtest does not capture it).
fn say(text: &str) {
    let _ = std::io::stderr().write_all(text.as_bytes());
}

fn report_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("differential");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// Runs `case` from a fresh world: each step by the side its `by` names (`subject` for
/// the subject's); with `reference`, every step by upstream.
fn run_case(w: &mut DiffWorld, case: &Case, subject: Side, reference: bool) -> Vec<Observation> {
    w.reset(case);
    let mut prev: Option<Value> = None;
    let mut out = Vec::new();
    for step in &case.steps {
        let side = match (reference, step.by) {
            (true, _) | (false, By::Upstream) => Side::Upstream,
            (false, By::Ours) => Side::Ours,
            (false, By::Subject) => subject,
        };
        let o = w.call(step, side, prev.as_ref());
        if std::env::var_os("CALICO_DIFFERENTIAL_STDERR").is_some() {
            let dir = report_dir().join("stderr");
            let _ = std::fs::create_dir_all(&dir);
            let name = format!(
                "{}-{}-{}.txt",
                case.id.replace('/', "_"),
                side.name(),
                out.len() + 1
            );
            let _ = std::fs::write(dir.join(name), format!("{}\n---\n{}", o.stdout, o.stderr));
        }
        let parsed: Option<Value> = serde_json::from_str(&o.stdout).ok();
        if step.command == "ADD" && o.code == 0 {
            if let Some(p) = &parsed {
                prev = Some(p.clone());
            }
        }
        let stdout = match &parsed {
            Some(v) => w.norm.value(v),
            None => Value::String(w.norm.text(&o.stdout)),
        };
        let after = w.observe_state(case);
        let changed = delta(&w.state, &after);
        w.state = after;
        out.push(Observation {
            exit: o.code,
            stdout,
            changed,
        });
    }
    out
}

/// `job` over every case, on `workers` worlds at once; results in the cases' order. A
/// case the harness itself fails on (a panic) is that case's `Err`, and its world is
/// started again for the next.
fn run_all<R: Send>(
    cases: &[Case],
    upstream: Option<&Path>,
    job: impl Fn(&mut DiffWorld, &Case) -> R + Sync,
) -> Vec<Result<R, String>> {
    let workers: usize = std::env::var("CALICO_DIFFERENTIAL_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(2)
        .clamp(1, 8)
        .min(cases.len().max(1));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<R, String>>>> =
        Mutex::new((0..cases.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut world = Some(DiffWorld::start(upstream));
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(case) = cases.get(i) else { break };
                    let w = world.get_or_insert_with(|| DiffWorld::start(upstream));
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(w, case)))
                        .map_err(|p| {
                            world = None;
                            p.downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_else(|| "the harness panicked".into())
                        });
                    if let Err(e) = &r {
                        say(&format!("HARNESS FAILED {}: {e}\n", case.id));
                    }
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.expect("every case ran"))
        .collect()
}

/// Each step of a run, in a line: the command, the exit code and stdout.
fn summary(case: &Case, obs: Option<&Vec<Observation>>) -> Vec<String> {
    let Some(obs) = obs else { return Vec::new() };
    case.steps
        .iter()
        .zip(obs)
        .map(|(s, o)| {
            let out = o.stdout.to_string();
            let out: String = out.chars().take(240).collect();
            format!("{} {} -> {} {out}", s.plugin, s.command, o.exit)
        })
        .collect()
}

/// A case the harness could not run, as a difference no accepted entry explains.
fn harness_failure(e: &str) -> Difference {
    Difference {
        step: 0,
        what: "harness".into(),
        ours: Value::String(e.to_string()),
        theirs: Value::Null,
        both_failed: false,
    }
}

fn accepted() -> AcceptedList {
    AcceptedList::load(&oracle::data_dir().join("accepted.json"))
}

/// One line per differing case, then the table; the whole of each difference in
/// `target/differential/<name>.txt`.
fn report(
    name: &str,
    title: &str,
    commit: &str,
    cases: &[Case],
    diffs: &[Vec<Difference>],
    ours: &[Vec<String>],
) -> Vec<(String, Verdict)> {
    let list = accepted();
    let mut verdicts = Vec::new();
    let mut full = String::new();
    for ((case, d), steps) in cases.iter().zip(diffs).zip(ours) {
        let v = verdict(&list, case, d);
        if v == Verdict::Unexplained {
            let first = d
                .iter()
                .find(|x| list.explain(case, x).is_none())
                .map(Difference::line)
                .unwrap_or_default();
            say(&format!(
                "DIFFERS {} ({} differences): {first}\n",
                case.id,
                d.len()
            ));
        }
        if !d.is_empty() {
            full.push_str(&format!("== {} ({:?})\n", case.id, v));
            for (i, s) in steps.iter().enumerate() {
                full.push_str(&format!("  ours {}: {s}\n", i + 1));
            }
            for x in d {
                let why = list
                    .explain(case, x)
                    .map(|a| format!("[accepted: {}] ", a.id))
                    .unwrap_or_default();
                full.push_str(&format!("  {why}{}\n", x.line()));
            }
        }
        verdicts.push((case.id.clone(), v));
    }
    let t = table(title, &verdicts, commit, &list);
    say(&format!("\n{t}\n"));
    let path = report_dir().join(format!("{name}.txt"));
    let _ = std::fs::write(&path, format!("{t}\n{full}"));
    say(&format!("every difference: {}\n", path.display()));
    verdicts
}

#[test]
fn replay_the_recorded_oracle() {
    require_root();
    if let Err(why) = RealK8s::available() {
        report_skip("differential::replay_the_recorded_oracle", &why);
        return;
    }
    let started = Instant::now();
    let recording = Recording::load(&recording_path());
    let cases: Vec<Case> = selected().into_iter().filter(Case::single_binary).collect();
    let mut problems = Vec::new();
    for c in &cases {
        match recording.cases.get(&c.id) {
            None => problems.push(format!("{}: not recorded (make oracle)", c.id)),
            Some(r) if r.digest != c.digest() => problems.push(format!(
                "{}: recorded from another definition of the case (make oracle)",
                c.id
            )),
            Some(_) => {}
        }
    }
    if std::env::var_os("CALICO_DIFFERENTIAL_CASES").is_none() {
        let ids: std::collections::BTreeSet<&str> = cases.iter().map(|c| c.id.as_str()).collect();
        for id in recording.cases.keys() {
            if !ids.contains(id.as_str()) {
                problems.push(format!(
                    "{id}: recorded, but no longer in the corpus (make oracle)"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the recording does not fit the corpus:\n{}",
        problems.join("\n")
    );
    let ours = run_all(&cases, None, |w, c| run_case(w, c, Side::Ours, false));
    let norm_recorded: Vec<Vec<Observation>> = cases
        .iter()
        .map(|c| recording.cases[&c.id].steps.clone())
        .collect();
    let diffs: Vec<Vec<Difference>> = ours
        .iter()
        .zip(&norm_recorded)
        .map(|(a, b)| match a {
            Ok(a) => compare(a, b),
            Err(e) => vec![harness_failure(e)],
        })
        .collect();
    let commit = format!(
        "{} ({})",
        recording.header.upstream_version, recording.header.upstream_commit
    );
    let steps: Vec<Vec<String>> = cases
        .iter()
        .zip(&ours)
        .map(|(c, o)| summary(c, o.as_ref().ok()))
        .collect();
    let verdicts = report(
        "replay",
        &format!(
            "Replay of the recorded oracle ({} cases, {:.0} s)",
            cases.len(),
            started.elapsed().as_secs_f64()
        ),
        &commit,
        &cases,
        &diffs,
        &steps,
    );
    let unexplained: Vec<&str> = verdicts
        .iter()
        .filter(|(_, v)| *v == Verdict::Unexplained)
        .map(|(id, _)| id.as_str())
        .collect();
    assert!(
        unexplained.is_empty(),
        "{} cases differ from the recorded oracle in ways tests/differential/accepted.json does \
         not explain: {unexplained:?}",
        unexplained.len()
    );
}

#[test]
#[ignore = "needs upstream's binaries (CALICO_UPSTREAM_BIN): make differential"]
fn live_against_upstream() {
    require_root();
    let upstream = upstream_bin().unwrap_or_else(|why| panic!("{why}"));
    let started = Instant::now();
    let cases = selected();
    let pairs = run_all(&cases, Some(&upstream), |w, c| {
        let ours = run_case(w, c, Side::Ours, false);
        let theirs = run_case(w, c, Side::Upstream, !c.single_binary());
        (ours, theirs)
    });
    let diffs: Vec<Vec<Difference>> = pairs
        .iter()
        .map(|r| match r {
            Ok((a, b)) => compare(a, b),
            Err(e) => vec![harness_failure(e)],
        })
        .collect();
    let steps: Vec<Vec<String>> = cases
        .iter()
        .zip(&pairs)
        .map(|(c, r)| summary(c, r.as_ref().ok().map(|(a, _)| a)))
        .collect();
    let version = upstream_version(&upstream);
    for store in ["etcd", "kdd"] {
        let mut cs = Vec::new();
        let mut ds = Vec::new();
        let mut ss = Vec::new();
        for ((c, d), s) in cases.iter().zip(&diffs).zip(&steps) {
            if c.store.name() == store {
                cs.push(c.clone());
                ds.push(d.clone());
                ss.push(s.clone());
            }
        }
        report(
            &format!("live-{store}"),
            &format!(
                "Live differential, {store} ({} cases; whole run {:.0} s)",
                cs.len(),
                started.elapsed().as_secs_f64()
            ),
            &version,
            &cs,
            &ds,
            &ss,
        );
    }
}

fn upstream_version(dir: &Path) -> String {
    let out = std::process::Command::new(dir.join("calico"))
        .arg("-v")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let commit =
        std::env::var("CALICO_UPSTREAM_COMMIT").unwrap_or_else(|_| "commit not given".into());
    format!("{out} ({commit})")
}

#[test]
#[ignore = "needs upstream's binaries (CALICO_UPSTREAM_BIN): make oracle"]
fn record_the_oracle() {
    require_root();
    let upstream = upstream_bin().unwrap_or_else(|why| panic!("{why}"));
    let commit = std::env::var("CALICO_UPSTREAM_COMMIT").unwrap_or_else(|_| {
        panic!("CALICO_UPSTREAM_COMMIT names the upstream commit the binaries were built from")
    });
    let cases: Vec<Case> = selected().into_iter().filter(Case::single_binary).collect();
    let observed = run_all(&cases, Some(&upstream), |w, c| {
        run_case(w, c, Side::Upstream, false)
    });
    let path = recording_path();
    // A partial recording (CALICO_DIFFERENTIAL_CASES) replaces only those cases.
    let mut recording = if std::env::var_os("CALICO_DIFFERENTIAL_CASES").is_some() && path.exists()
    {
        Recording::load(&path)
    } else {
        Recording {
            header: Header {
                upstream_version: String::new(),
                upstream_commit: String::new(),
                recorded_at: String::new(),
                cases: 0,
            },
            cases: Default::default(),
        }
    };
    let failed: Vec<String> = cases
        .iter()
        .zip(&observed)
        .filter_map(|(c, r)| r.as_ref().err().map(|e| format!("{}: {e}", c.id)))
        .collect();
    assert!(
        failed.is_empty(),
        "nothing recorded: the harness failed on\n{}",
        failed.join("\n")
    );
    for (c, steps) in cases.iter().zip(observed.into_iter().flatten()) {
        recording.cases.insert(
            c.id.clone(),
            Recorded {
                id: c.id.clone(),
                digest: c.digest(),
                steps,
            },
        );
    }
    let version = std::process::Command::new(upstream.join("calico"))
        .arg("-v")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    recording.header = Header {
        upstream_version: version,
        upstream_commit: commit,
        recorded_at: calico_cni::support::timefmt::now_rfc3339(),
        cases: recording.cases.len(),
    };
    recording.write(&path);
    say(&format!(
        "recorded {} cases into {}\n",
        recording.cases.len(),
        path.display()
    ));
}
