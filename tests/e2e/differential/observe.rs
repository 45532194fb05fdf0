//! What a step is seen to do, normalized so that two runs of the same case in two fresh
//! worlds can be compared: only what is random is replaced (MACs other than the host side's
//! `ee:ee:ee:ee:ee:ee` and those a case asks for, the IPv6 link-local addresses made from
//! them, UIDs, timestamps, resourceVersions and generations, IPAM sequence numbers, the
//! world's ports, netns and temp paths).
//!
//! The world's state is one flat map, facet → value: `etcd:<key>`, `k8s:<resource>/<name>`,
//! `pod<i>:link:<name>`, `pod<i>:addr:…`, `pod<i>:route:…`, `pod<i>:sysctl:<path>`, the same
//! for `host:`, and `agent:<n>` for what the gRPC agent was sent. A step's observation is
//! its exit code, its stdout and the change it made to that map.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// The world's state, facet → normalized value.
pub type State = BTreeMap<String, Value>;

/// One step, as seen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    pub exit: i32,
    /// The result or error JSON, or the text when stdout is not JSON.
    pub stdout: Value,
    /// The facets the step changed: the new value, or `null` for one that went away.
    pub changed: BTreeMap<String, Value>,
}

/// What changed from `before` to `after`.
pub fn delta(before: &State, after: &State) -> BTreeMap<String, Value> {
    let mut d = BTreeMap::new();
    for (k, v) in after {
        if before.get(k) != Some(v) {
            d.insert(k.clone(), v.clone());
        }
    }
    for k in before.keys() {
        if !after.contains_key(k) {
            d.insert(k.clone(), Value::Null);
        }
    }
    d
}

/// The replacements of one world and case: fixed strings (ports, paths) first, then the
/// random shapes.
#[derive(Clone, Debug, Default)]
pub struct Norm {
    /// (from, to), applied longest first.
    fixed: Vec<(String, String)>,
    /// MACs kept as they are (lower case): the host side's and those in the case's input.
    keep_macs: BTreeSet<String>,
}

impl Norm {
    pub fn new(fixed: Vec<(String, String)>, input_text: &str) -> Norm {
        let mut fixed: Vec<_> = fixed.into_iter().filter(|(f, _)| !f.is_empty()).collect();
        fixed.sort_by_key(|(f, _)| std::cmp::Reverse(f.len()));
        let mut keep_macs: BTreeSet<String> = ["ee:ee:ee:ee:ee:ee".to_string()].into();
        let lower = input_text.to_ascii_lowercase();
        let b = lower.as_bytes();
        for i in 0..b.len() {
            if mac_at(b, i) {
                keep_macs.insert(lower[i..i + 17].to_string());
            }
        }
        Norm { fixed, keep_macs }
    }

    /// `s` with the world's strings and the random shapes replaced.
    pub fn text(&self, s: &str) -> String {
        let mut s = s.to_string();
        for (from, to) in &self.fixed {
            if s.contains(from.as_str()) {
                s = s.replace(from.as_str(), to);
            }
        }
        self.shapes(&s)
    }

    fn shapes(&self, s: &str) -> String {
        let b = s.as_bytes();
        let mut out = String::with_capacity(s.len());
        let mut i = 0;
        while i < b.len() {
            let prev_hexish = i > 0 && (b[i - 1].is_ascii_hexdigit() || b[i - 1] == b':');
            if !prev_hexish {
                if uuid_at(b, i) {
                    out.push_str("<uid>");
                    i += 36;
                    continue;
                }
                if mac_at(b, i) {
                    let mac = s[i..i + 17].to_ascii_lowercase();
                    if self.keep_macs.contains(&mac) {
                        out.push_str(&mac);
                    } else {
                        out.push_str("<mac>");
                    }
                    i += 17;
                    continue;
                }
            }
            if i == 0 || !b[i - 1].is_ascii_hexdigit() {
                if let Some(n) = link_local_at(b, i) {
                    let ll = &s[i..i + n];
                    if ll == "fe80::ecee:eeff:feee:eeee" {
                        out.push_str(ll);
                    } else {
                        out.push_str("<ll>");
                    }
                    i += n;
                    continue;
                }
            }
            if (i == 0 || !b[i - 1].is_ascii_digit()) && b[i].is_ascii_digit() {
                if let Some(n) = time_at(b, i) {
                    out.push_str("<time>");
                    i += n;
                    continue;
                }
            }
            let c = s[i..].chars().next().unwrap_or_default();
            out.push(c);
            i += c.len_utf8().max(1);
        }
        out
    }

    /// Every string in `v` (keys too) through [`Norm::text`], and the values that say
    /// when or how often something was written replaced: `sequenceNumber*`, and in
    /// `metadata` the resourceVersion, generation and managedFields' times.
    pub fn value(&self, v: &Value) -> Value {
        match v {
            Value::String(s) => Value::String(self.text(s)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.value(x)).collect()),
            Value::Object(o) => {
                let mut m = Map::new();
                for (k, x) in o {
                    let nk = self.text(k);
                    let nx = match k.as_str() {
                        "sequenceNumber" => json!("<seq>"),
                        "sequenceNumberForAllocation" => match x {
                            Value::Object(s) => Value::Object(
                                s.keys().map(|k| (k.clone(), json!("<seq>"))).collect(),
                            ),
                            other => self.value(other),
                        },
                        "metadata" => self.metadata(x),
                        _ => self.value(x),
                    };
                    m.insert(nk, nx);
                }
                Value::Object(m)
            }
            other => other.clone(),
        }
    }

    fn metadata(&self, md: &Value) -> Value {
        let mut md = self.value(md);
        if let Some(o) = md.as_object_mut() {
            for k in ["resourceVersion", "generation", "selfLink"] {
                if o.contains_key(k) {
                    o.insert(k.into(), json!("<rv>"));
                }
            }
            if let Some(Value::Array(mf)) = o.get_mut("managedFields") {
                for e in mf.iter_mut() {
                    if let Some(e) = e.as_object_mut() {
                        e.remove("time");
                    }
                }
            }
        }
        md
    }
}

fn mac_at(b: &[u8], i: usize) -> bool {
    if i + 17 > b.len() {
        return false;
    }
    for k in 0..17 {
        let c = b[i + k];
        let ok = if k % 3 == 2 {
            c == b':'
        } else {
            c.is_ascii_hexdigit()
        };
        if !ok {
            return false;
        }
    }
    !(i + 17 < b.len() && (b[i + 17].is_ascii_hexdigit() || b[i + 17] == b':'))
}

fn uuid_at(b: &[u8], i: usize) -> bool {
    if i + 36 > b.len() {
        return false;
    }
    for k in 0..36 {
        let c = b[i + k];
        let ok = if [8, 13, 18, 23].contains(&k) {
            c == b'-'
        } else {
            c.is_ascii_hexdigit()
        };
        if !ok {
            return false;
        }
    }
    !(i + 36 < b.len() && b[i + 36].is_ascii_hexdigit())
}

/// `fe80::…` (hex digits and colons) at `i`: its length.
fn link_local_at(b: &[u8], i: usize) -> Option<usize> {
    if !b[i..].starts_with(b"fe80::") {
        return None;
    }
    let mut n = 6;
    while i + n < b.len() && (b[i + n].is_ascii_hexdigit() || b[i + n] == b':') {
        n += 1;
    }
    (n > 6).then_some(n)
}

/// A timestamp at `i`: `YYYY-MM-DD[T ]hh:mm:ss`, a fraction, and a zone (`Z`, `±hh:mm`,
/// Go's ` +0000 UTC` and its monotonic ` m=+0.001`); its length.
fn time_at(b: &[u8], i: usize) -> Option<usize> {
    let pat = b"dddd-dd-dd?dd:dd:dd";
    if i + pat.len() > b.len() {
        return None;
    }
    for (k, p) in pat.iter().enumerate() {
        let c = b[i + k];
        let ok = match p {
            b'd' => c.is_ascii_digit(),
            b'?' => c == b'T' || c == b' ',
            p => c == *p,
        };
        if !ok {
            return None;
        }
    }
    let mut n = pat.len();
    let at = |n: usize| b.get(i + n).copied();
    if at(n) == Some(b'.') {
        n += 1;
        while at(n).is_some_and(|c| c.is_ascii_digit()) {
            n += 1;
        }
    }
    match at(n) {
        Some(b'Z') => n += 1,
        Some(b'+') | Some(b'-')
            if at(n + 3) == Some(b':')
                && (1..=2).all(|k| at(n + k).is_some_and(|c| c.is_ascii_digit())) =>
        {
            n += 6
        }
        Some(b' ') if matches!(at(n + 1), Some(b'+') | Some(b'-')) => {
            n += 6;
            if at(n) == Some(b' ') && at(n + 1).is_some_and(|c| c.is_ascii_uppercase()) {
                n += 1;
                while at(n).is_some_and(|c| c.is_ascii_uppercase()) {
                    n += 1;
                }
            }
            if b[(i + n).min(b.len())..].starts_with(b" m=") {
                n += 3;
                while at(n)
                    .is_some_and(|c| c.is_ascii_digit() || c == b'+' || c == b'-' || c == b'.')
                {
                    n += 1;
                }
            }
        }
        _ => {}
    }
    Some(n.min(b.len() - i))
}

/// The state of the netns `name` as facets `<prefix>:…`, normalized.
pub fn netns_state(name: &str, prefix: &str, norm: &Norm, into: &mut State) {
    // Three `ip` processes (links and addresses in one batch; each family's routes), the
    // sysctls read in this process from a thread in the netns.
    let ip = |args: &[&str], stdin: &str| -> Vec<Value> {
        let mut child = std::process::Command::new("ip")
            .args(["-n", name, "-j"])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("read netns {name}: {e}"));
        if let Some(mut input) = child.stdin.take() {
            use std::io::Write as _;
            let _ = input.write_all(stdin.as_bytes());
        }
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("read netns {name}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        serde_json::Deserializer::from_str(&text)
            .into_iter::<Value>()
            .map(|v| v.unwrap_or_else(|e| panic!("netns {name}: {e} in {text}")))
            .collect()
    };
    let batch = ip(&["-d", "-batch", "-"], "link show\naddress show\n");
    assert_eq!(batch.len(), 2, "netns {name}: unexpected output {batch:?}");
    let v4 = ip(&["-4", "route", "show", "table", "all"], "");
    let v6 = ip(&["-6", "route", "show", "table", "all"], "");
    let arr = |v: &Value| v.as_array().cloned().unwrap_or_default();
    let parts = [
        arr(&batch[0]),
        arr(&batch[1]),
        v4.first().map(arr).unwrap_or_default(),
        v6.first().map(arr).unwrap_or_default(),
    ];
    for l in parts[0].clone() {
        let name = l["ifname"].as_str().unwrap_or_default();
        let flags: Vec<&str> = l["flags"]
            .as_array()
            .map(|f| f.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let v = json!({
            "kind": l["linkinfo"]["info_kind"],
            "type": l["link_type"],
            "mtu": l["mtu"],
            "mac": l["address"],
            "up": flags.contains(&"UP"),
            "noarp": flags.contains(&"NOARP"),
            "txqueues": l["num_tx_queues"],
            "rxqueues": l["num_rx_queues"],
        });
        into.insert(norm.text(&format!("{prefix}:link:{name}")), norm.value(&v));
    }
    for l in parts[1].clone() {
        let ifname = l["ifname"].as_str().unwrap_or_default();
        for a in l["addr_info"].as_array().into_iter().flatten() {
            let key = format!(
                "{prefix}:addr:{ifname}:{}/{}",
                a["local"].as_str().unwrap_or_default(),
                a["prefixlen"]
            );
            let flags: Vec<&str> = ["nodad", "noprefixroute", "dadfailed", "optimistic"]
                .into_iter()
                .filter(|f| a[*f].as_bool() == Some(true))
                .collect();
            let v = json!({"scope": a["scope"], "flags": flags});
            into.insert(norm.text(&key), norm.value(&v));
        }
    }
    for (part, family) in [(&parts[2], 4), (&parts[3], 6)] {
        for r in part.clone() {
            // The kernel's local and anycast routes of link-local addresses come when their
            // duplicate address detection ends, a moment after the call: not the plugin's.
            let dst = r["dst"].as_str().unwrap_or_default();
            if r["table"] == "local" && dst.starts_with("fe80:") {
                continue;
            }
            let mut desc = format!(
                "{prefix}:route{family}:{}:{} {}",
                r["table"].as_str().unwrap_or("main"),
                r["type"].as_str().unwrap_or("unicast"),
                r["dst"].as_str().unwrap_or_default()
            );
            for f in [
                "gateway", "dev", "protocol", "scope", "prefsrc", "metric", "pref",
            ] {
                match &r[f] {
                    Value::Null => {}
                    Value::String(s) => desc.push_str(&format!(" {f} {s}")),
                    other => desc.push_str(&format!(" {f} {other}")),
                }
            }
            if let Some(flags) = r["flags"].as_array().filter(|f| !f.is_empty()) {
                desc.push_str(&format!(" flags {}", Value::Array(flags.clone())));
            }
            into.insert(norm.text(&desc), json!(true));
        }
    }
    for (key, value) in sysctls(name) {
        into.insert(
            norm.text(&format!("{prefix}:sysctl:{key}")),
            Value::String(value),
        );
    }
}

/// The sysctls the plugins set, for every interface, read from a thread that joined the
/// netns (`/proc/sys/net` is the reading thread's netns's).
fn sysctls(netns: &str) -> Vec<(String, String)> {
    let path = format!("/run/netns/{netns}");
    let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    std::thread::scope(|s| {
        s.spawn(move || {
            use std::os::fd::AsFd;
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("join the netns");
            let mut out = Vec::new();
            let mut read = |key: String| {
                if let Ok(v) = std::fs::read_to_string(format!("/proc/sys/{key}")) {
                    out.push((key, v.trim_end().to_string()));
                }
            };
            read("net/ipv4/ip_forward".into());
            let per_interface: [(&str, &[&str]); 3] = [
                (
                    "net/ipv4/conf",
                    &["forwarding", "proxy_arp", "route_localnet", "rp_filter"],
                ),
                ("net/ipv4/neigh", &["proxy_delay"]),
                (
                    "net/ipv6/conf",
                    &[
                        "disable_ipv6",
                        "accept_dad",
                        "forwarding",
                        "proxy_ndp",
                        "accept_ra",
                    ],
                ),
            ];
            for (dir, keys) in per_interface {
                let mut names: Vec<String> = std::fs::read_dir(format!("/proc/sys/{dir}"))
                    .map(|d| {
                        d.filter_map(|e| e.ok())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                names.sort();
                for n in names {
                    for k in keys {
                        read(format!("{dir}/{n}/{k}"));
                    }
                }
            }
            out
        })
        .join()
        .expect("the sysctl reader")
    })
}
