//! No import circle between the files of `src/`: a file's `use crate::…`,
//! `use super::…`, `use self::…` and inline `crate::…` paths are its edges to the files that
//! define those modules (test modules left out), and the graph must have no strongly
//! connected component of more than one file. A circle means two layers each need the
//! other: what both need belongs below them.
//!
//! And the layers of docs/architecture.md (`LAYERS`): a file imports only from its own layer
//! and those below it; a folder of `src/` not in the table fails the test until it is given
//! its place.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Module = Vec<String>;

/// Every `.rs` file under `src/`, by module path (`datastore/kubernetes/mod.rs` is
/// `datastore::kubernetes`), with its source up to its test module.
fn modules() -> BTreeMap<Module, String> {
    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&root, &mut files);
    let mut out = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&root).unwrap().with_extension("");
        let mut parts: Module = rel
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let is_mod = matches!(
            parts.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        );
        if is_mod {
            parts.pop();
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let code = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default()
            .to_string();
        out.insert(parts, code);
    }
    out
}

/// The longest prefix of `path` that is a file's module.
fn file_of<'a>(path: &[String], files: &'a BTreeMap<Module, String>) -> Option<&'a Module> {
    (1..=path.len())
        .rev()
        .find_map(|n| files.get_key_value(&path[..n]).map(|(k, _)| k))
}

/// The `a::b::c` path that starts at byte `at` of `code`.
fn path_at(code: &str, at: usize) -> Vec<String> {
    code[at..]
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .next()
        .unwrap_or_default()
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn edges(files: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut graph = BTreeMap::new();
    for (module, code) in files {
        let mut deps = BTreeSet::new();
        // `self::` is the module itself (a mod.rs or a plain file alike); `super::` its parent.
        let parent: Module = module[..module.len().saturating_sub(1)].to_vec();
        for (at, _) in code.match_indices("use ") {
            let path = path_at(code, at + 4);
            let target: Module = match path.first().map(String::as_str) {
                Some("crate") => path[1..].to_vec(),
                Some("super") => parent
                    .iter()
                    .cloned()
                    .chain(path[1..].iter().cloned())
                    .collect(),
                Some("self") => module
                    .iter()
                    .cloned()
                    .chain(path[1..].iter().cloned())
                    .collect(),
                _ => continue,
            };
            if let Some(f) = file_of(&target, files) {
                deps.insert(f.clone());
            }
        }
        for (at, _) in code.match_indices("crate::") {
            let path = path_at(code, at);
            if let Some(f) = file_of(&path[1..], files) {
                deps.insert(f.clone());
            }
        }
        deps.remove(module);
        graph.insert(module.clone(), deps);
    }
    graph
}

/// Tarjan's strongly connected components with more than one member.
fn circles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct State<'g> {
        graph: &'g BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'g Module, usize>,
        low: BTreeMap<&'g Module, usize>,
        stack: Vec<&'g Module>,
        on: BTreeSet<&'g Module>,
        out: Vec<Vec<Module>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g Module) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// `src/`'s top-level modules by layer, the top first (docs/architecture.md, "Layers").
const LAYERS: &[&[&str]] = &[
    // The three programs (`main.rs` dispatches to them; `lib.rs` declares them).
    &["plugin", "install"],
    // calico-ipam, which `calico` also runs in-process.
    &["calico_ipam"],
    // How a plugin call starts: its datastore connection, the ClusterInformation gate.
    &["call"],
    // The top-level error of the programs, composing the errors of the layers below.
    &["error"],
    // What `calico` delegates to: another CNI plugin, the pod's interface.
    &["delegate", "dataplane"],
    // The IPAM allocator library.
    &["ipam"],
    &["datastore"],
    &["logging"],
    // Calico's NetConf and the identifiers of a call.
    &["config"],
    // The CNI protocol, knowing nothing of Calico.
    &["skel"],
    // Go's texts and formats, the deadline: knowing nothing of Calico or CNI.
    &["support"],
];

/// The layer of a module (its index in `LAYERS`), `None` for the crate root and the test
/// support module, which are outside the layers.
fn layer(module: &Module) -> Option<Result<usize, String>> {
    let top = module.first()?;
    if top == "test_support" {
        return None;
    }
    Some(
        LAYERS
            .iter()
            .position(|l| l.contains(&top.as_str()))
            .ok_or_else(|| format!("src/{top} has no layer in LAYERS")),
    )
}

/// Every import from a file to one of a higher layer, as `from -> to`.
fn upward_imports(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<String> {
    let mut out = Vec::new();
    for (from, deps) in graph {
        let Some(own) = layer(from) else { continue };
        let own = match own {
            Ok(l) => l,
            Err(e) => {
                out.push(e);
                continue;
            }
        };
        for to in deps {
            if let Some(Ok(theirs)) = layer(to) {
                if theirs < own {
                    out.push(format!("{} -> {}", from.join("/"), to.join("/")));
                }
            }
        }
    }
    out
}

#[test]
fn no_import_from_a_lower_layer_to_a_higher_one() {
    let files = modules();
    assert!(files.len() > 50, "src/ not found: {} files", files.len());
    let found = upward_imports(&edges(&files));
    assert!(found.is_empty(), "upward imports: {found:#?}");
}

/// The check finds an upward import where there is one, and a folder with no layer.
#[test]
fn an_upward_import_is_found() {
    let m = |s: &str| s.split('/').map(str::to_string).collect::<Module>();
    let graph = BTreeMap::from([
        (m("support/net"), BTreeSet::from([m("plugin/del")])),
        (m("plugin/del"), BTreeSet::from([m("support/net")])),
        (m("elsewhere/x"), BTreeSet::new()),
    ]);
    let found = upward_imports(&graph);
    assert_eq!(
        found,
        [
            "src/elsewhere has no layer in LAYERS",
            "support/net -> plugin/del"
        ]
    );
}

#[test]
fn no_import_circle_between_files() {
    let files = modules();
    assert!(files.len() > 50, "src/ not found: {} files", files.len());
    let found: Vec<String> = circles(&edges(&files))
        .iter()
        .map(|c| {
            c.iter()
                .map(|m| m.join("/"))
                .collect::<Vec<_>>()
                .join(" <-> ")
        })
        .collect();
    assert!(found.is_empty(), "import circles: {found:#?}");
}

/// The check finds a circle where there is one.
#[test]
fn a_circle_is_found() {
    let m = |s: &str| s.split('/').map(str::to_string).collect::<Module>();
    let graph = BTreeMap::from([
        (m("a"), BTreeSet::from([m("b")])),
        (m("b"), BTreeSet::from([m("c")])),
        (m("c"), BTreeSet::from([m("a")])),
        (m("d"), BTreeSet::from([m("a")])),
    ]);
    let found = circles(&graph);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].len(), 3);
}

/// ADD's files (`src/plugin/add/`) know the IPAM only through the driver trait
/// (`plugin::ipam`): none of them reads blocks or takes the host's IPAM lock
/// (`ipam::allocator`, `ipam::lock`) or builds calico-ipam's inputs (`calico_ipam::add`). The
/// one import of calico-ipam is `calico_ipam::del` for the `ipAddrs` annotation's release of
/// the endpoint's old addresses, which upstream's plugin makes with Calico IPAM whatever the
/// IPAM plugin (its `releaseIPAddrs`).
#[test]
fn add_knows_the_ipam_only_through_the_driver() {
    let files = modules();
    let graph = edges(&files);
    let allowed = |to: &Module| to.join("/") == "calico_ipam/del";
    let found: Vec<String> = graph
        .iter()
        .filter(|(from, _)| from.starts_with(&["plugin".to_string(), "add".to_string()]))
        .flat_map(|(from, deps)| {
            deps.iter()
                .filter(|to| matches!(to.first().map(String::as_str), Some("ipam" | "calico_ipam")))
                .filter(|to| !allowed(to))
                .map(move |to| format!("{} -> {}", from.join("/"), to.join("/")))
        })
        .collect();
    assert!(found.is_empty(), "ADD around the driver trait: {found:#?}");
}
