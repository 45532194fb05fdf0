//! The CNI protocol, knowing nothing of Calico: reads CNI_* env and stdin, validates them
//! exactly as Go's libcni `pkg/skel` (v1.3) does, negotiates the version, calls the plugin and
//! prints the result or the error JSON (containernetworking/cni `pkg/skel`).

pub mod args;
pub mod attachments;
pub mod error;
pub mod result;
pub mod version;

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;

use serde::Serialize;

pub use error::CniError;
use error::*;
pub use result::CniResult;

/// What a plugin receives for one call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CmdArgs {
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    /// Raw CNI_ARGS (`K=V;K=V`).
    pub args: String,
    /// CNI_PATH (colon-separated).
    pub path: String,
    pub netns_override: String,
    /// The network configuration from stdin, raw.
    pub stdin_data: Vec<u8>,
}

/// A CNI plugin. `add` returns the result in the spec-1.0 model; skel encodes it in the
/// config's `cniVersion`.
pub trait Plugin {
    /// Printed on stderr when CNI_COMMAND is not set at all.
    fn about(&self) -> String;
    /// The version used to print results when the config has no `cniVersion`
    /// (`calico` uses "0.2.0", `calico-ipam` "0.1.0").
    fn default_result_version(&self) -> &'static str;
    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError>;
    fn del(&self, args: &CmdArgs) -> Result<(), CniError>;
    fn check(&self, args: &CmdArgs) -> Result<(), CniError>;
    /// CNI 1.1 STATUS: can the plugin serve ADD now? (libcni: no handler = ready.)
    fn status(&self, _args: &CmdArgs) -> Result<(), CniError> {
        Ok(())
    }
    /// CNI 1.1 GC: release what attachments not in `cni.dev/valid-attachments` hold.
    fn gc(&self, _args: &CmdArgs) -> Result<(), CniError> {
        Ok(())
    }
}

#[derive(Serialize)]
struct ErrorJson<'a> {
    code: u64,
    msg: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    details: &'a str,
}

/// The error object as Go prints it: 4-space indent, `details` omitted when empty.
pub fn error_json(e: &CniError) -> String {
    let j = ErrorJson {
        code: e.code,
        msg: &e.msg,
        details: &e.details,
    };
    result::to_go_json_indent(&j).unwrap_or_else(|_| {
        format!(
            "{{\n    \"code\": {},\n    \"msg\": \"internal error\"\n}}",
            e.code
        )
    })
}

/// Runs the plugin against the real process environment and stdio; returns the exit code.
///
/// No stdio lock is held across the call: the plugin logs (to stderr) from helper threads
/// while the main thread waits for them, so a lock held here would deadlock the process.
/// Each write takes the lock only for itself.
pub fn run(plugin: &dyn Plugin) -> i32 {
    let env = |k: &str| std::env::var(k).ok();
    run_with(
        plugin,
        &env,
        &mut std::io::stdin(),
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    )
}

/// The testable core of `run`.
pub fn run_with(
    plugin: &dyn Plugin,
    env: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    match dispatch(plugin, env, stdin, stdout, stderr) {
        Ok(()) => 0,
        Err(e) => {
            let _ = stdout.write_all(error_json(&e).as_bytes());
            let _ = stdout.flush();
            1
        }
    }
}

const ALL_COMMANDS: &[&str] = &["ADD", "CHECK", "DEL", "GC", "STATUS"];
const ATTACHMENT_COMMANDS: &[&str] = &["ADD", "CHECK", "DEL"];

/// A validator of one CNI_* variable's value.
type Validate = fn(&str) -> Result<(), CniError>;

/// libcni's table of CNI_* variables, in its order: the commands that require each, and
/// the check its value must pass when it is set and required.
const ENV_VARS: &[(&str, &[&str], Option<Validate>)] = &[
    ("CNI_COMMAND", ALL_COMMANDS, None),
    (
        "CNI_CONTAINERID",
        ATTACHMENT_COMMANDS,
        Some(validate_container_id),
    ),
    ("CNI_NETNS", &["ADD", "CHECK"], None),
    ("CNI_IFNAME", ATTACHMENT_COMMANDS, Some(validate_ifname)),
    ("CNI_ARGS", &[], None),
    ("CNI_PATH", ALL_COMMANDS, None),
    ("CNI_NETNS_OVERRIDE", &[], None),
];

/// libcni v1.3's `getCmdArgsFromEnv`: walks the variables in table order, failing at the
/// first set-but-invalid value, then reports every missing required one at once.
fn env_args(env: &dyn Fn(&str) -> Option<String>) -> Result<(String, CmdArgs), CniError> {
    let get = |k: &str| env(k).unwrap_or_default();
    let cmd = get("CNI_COMMAND");
    let mut missing = Vec::new();
    for (name, cmds, validate) in ENV_VARS {
        let value = get(name);
        let required = cmds.contains(&cmd.as_str());
        if value.is_empty() {
            if required || *name == "CNI_COMMAND" {
                missing.push(*name);
            }
        } else if let (true, Some(validate)) = (required, validate) {
            validate(&value)?;
        }
    }
    if !missing.is_empty() {
        return Err(CniError::new(
            CODE_INVALID_ENV,
            format!("required env variables [{}] missing", missing.join(",")),
            "",
        ));
    }
    let args = CmdArgs {
        container_id: get("CNI_CONTAINERID"),
        netns: get("CNI_NETNS"),
        ifname: get("CNI_IFNAME"),
        args: get("CNI_ARGS"),
        path: get("CNI_PATH"),
        netns_override: get("CNI_NETNS_OVERRIDE"),
        stdin_data: Vec::new(),
    };
    Ok((cmd, args))
}

fn dispatch(
    plugin: &dyn Plugin,
    env: &dyn Fn(&str) -> Option<String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<(), CniError> {
    let (cmd, mut args) = match env_args(env) {
        Ok(v) => v,
        // No CNI_COMMAND at all (whatever else is set): the about text, exit 0, as libcni.
        Err(e)
            if e.code == CODE_INVALID_ENV && env("CNI_COMMAND").unwrap_or_default().is_empty() =>
        {
            let _ = writeln!(stderr, "{}", plugin.about());
            let _ = writeln!(
                stderr,
                "CNI protocol versions supported: {}",
                version::SUPPORTED.join(", ")
            );
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    if cmd == "VERSION" {
        let _ = writeln!(stdout, "{}", version::version_json());
        return Ok(());
    }
    stdin.read_to_end(&mut args.stdin_data).map_err(|e| {
        CniError::new(
            CODE_IO_FAILURE,
            format!("error reading from stdin: {e}"),
            "",
        )
    })?;
    validate_config(&args.stdin_data)?;
    match cmd.as_str() {
        "ADD" => {
            let config_version = checked_version(&args.stdin_data)?;
            check_netns(&args)?;
            let result = call_guarded(|| plugin.add(&args), "ADD")?;
            let print_version = if config_version_given(&args.stdin_data) {
                config_version
            } else {
                plugin.default_result_version().to_string()
            };
            let out = result.encode(&print_version)?;
            let _ = stdout.write_all(out.as_bytes());
            let _ = stdout.flush();
            Ok(())
        }
        "DEL" => {
            checked_version(&args.stdin_data)?;
            check_netns(&args)?;
            call_guarded(|| plugin.del(&args), "DEL")
        }
        "CHECK" => {
            gated(&config_version(&args.stdin_data)?, "0.4.0", "CHECK")?;
            checked_version(&args.stdin_data)?;
            check_netns(&args)?;
            call_guarded(|| plugin.check(&args), "CHECK")
        }
        "GC" => {
            gated(&config_version(&args.stdin_data)?, "1.1.0", "GC")?;
            call_guarded(|| plugin.gc(&args), "GC")
        }
        "STATUS" => {
            gated(&config_version(&args.stdin_data)?, "1.1.0", "STATUS")?;
            call_guarded(|| plugin.status(&args), "STATUS")
        }
        other => Err(CniError::new(
            CODE_INVALID_ENV,
            format!("unknown CNI_COMMAND: {other}"),
            "",
        )),
    }
}

/// Runs a plugin command, turning a panic into a code-999 error as upstream's recover does.
fn call_guarded<T>(f: impl FnOnce() -> Result<T, CniError>, what: &str) -> Result<T, CniError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(CniError::internal(format!(
                "Calico CNI panicked during {what}: {msg}"
            )))
        }
    }
}

/// CHECK needs config >= 0.4.0, GC/STATUS >= 1.1.0; then some supported version must be at
/// least the config's ("plugin version does not allow" otherwise), and the config's version
/// must itself be supported (libcni's `checkVersionAndCall`).
fn gated(config: &str, floor: &str, what: &str) -> Result<(), CniError> {
    if !version::version_ge(config, floor) {
        return Err(CniError::new(
            CODE_INCOMPATIBLE_VERSION,
            format!("config version does not allow {what}"),
            "",
        ));
    }
    let supported = version::SUPPORTED
        .iter()
        .any(|v| version::version_ge(v, config));
    if supported {
        return checked_version_of(config).map(|_| ());
    }
    Err(CniError::new(
        CODE_INCOMPATIBLE_VERSION,
        format!("plugin version does not allow {what}"),
        "",
    ))
}

/// The config's version, which must be one the plugin supports (`checkVersionAndCall`).
fn checked_version(data: &[u8]) -> Result<String, CniError> {
    checked_version_of(&config_version(data)?)
}

fn checked_version_of(config: &str) -> Result<String, CniError> {
    if version::is_supported(config) {
        return Ok(config.to_string());
    }
    Err(CniError::new(
        CODE_INCOMPATIBLE_VERSION,
        "incompatible CNI versions",
        version::incompatible_details(config),
    ))
}

fn config_version_given(data: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .is_some_and(|v| {
            v.get("cniVersion")
                .and_then(|c| c.as_str())
                .is_some_and(|s| !s.is_empty())
        })
}

/// The config's `cniVersion`; missing (or empty) means 0.1.0.
fn config_version(data: &[u8]) -> Result<String, CniError> {
    let decoding = |e: String| {
        CniError::new(
            CODE_DECODING_FAILURE,
            format!("decoding version from network config: {e}"),
            "",
        )
    };
    crate::support::gojson::check_syntax(data).map_err(|e| decoding(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(data).map_err(|e| decoding(e.to_string()))?;
    // A `cniVersions` list (a network configuration's, for the runtime) is not read, as
    // libcni's plugin side does not: no `cniVersion` is 0.1.0.
    let missing = || "0.1.0".to_string();
    match go_field(&v, "cniVersion") {
        None | Some(serde_json::Value::Null) => Ok(missing()),
        Some(serde_json::Value::String(s)) if s.is_empty() => Ok(missing()),
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(decoding(format!(
            "json: cannot unmarshal {} into Go struct field .cniVersion of type string",
            crate::support::gojson::kind(other)
        ))),
    }
}

/// The field Go's decoder fills from `v` for a struct field tagged `key`: the last key of
/// the object equal to it ignoring case (an exact match is not preferred when both occur:
/// each key found overwrites the field).
fn go_field<'a>(v: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    v.as_object()?
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(key))
        .map(|(_, v)| v)
        .next_back()
}

fn valid_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
}

/// libcni's `validateConfig`: the config decoded into `struct { Name string }`, in Go's
/// words when it does not decode.
fn validate_config(data: &[u8]) -> Result<(), CniError> {
    let decoding = |e: String| {
        CniError::new(
            CODE_DECODING_FAILURE,
            format!("error unmarshall network config: {e}"),
            "",
        )
    };
    crate::support::gojson::check_syntax(data).map_err(|e| decoding(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(data).map_err(|e| decoding(e.to_string()))?;
    let name = match (&v, go_field(&v, "name")) {
        (serde_json::Value::Object(_) | serde_json::Value::Null, None) => "",
        (_, Some(serde_json::Value::Null)) => "",
        (_, Some(serde_json::Value::String(s))) => s.as_str(),
        (_, Some(other)) => {
            return Err(decoding(format!(
                "json: cannot unmarshal {} into Go struct field .name of type string",
                crate::support::gojson::kind(other)
            )))
        }
        (other, None) => {
            return Err(decoding(format!(
                "json: cannot unmarshal {} into Go value of type struct {{ Name string \"json:\\\"name\\\"\" }}",
                crate::support::gojson::kind(other)
            )))
        }
    };
    if name.is_empty() {
        return Err(CniError::new(
            CODE_INVALID_NETWORK_CONFIG,
            "missing network name",
            "",
        ));
    }
    if !valid_name(name) {
        return Err(CniError::new(
            CODE_INVALID_NETWORK_CONFIG,
            "invalid characters found in network name",
            name,
        ));
    }
    Ok(())
}

fn validate_container_id(id: &str) -> Result<(), CniError> {
    if valid_name(id) {
        Ok(())
    } else {
        Err(CniError::new(
            CODE_INVALID_ENV,
            "invalid characters in containerID",
            id,
        ))
    }
}

fn validate_ifname(name: &str) -> Result<(), CniError> {
    let err = |msg: &str, details: &str| Err(CniError::new(CODE_INVALID_ENV, msg, details));
    if name.is_empty() {
        return err("interface name is empty", "");
    }
    if name.len() > 15 {
        return err(
            "interface name is too long",
            "interface name should be less than 16 characters",
        );
    }
    if name == "." || name == ".." {
        return err("interface name is . or ..", "");
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return err(
            "interface name contains / or : or whitespace characters",
            "",
        );
    }
    Ok(())
}

/// Refuses a CNI_NETNS that is the plugin's own network namespace, unless
/// `CNI_NETNS_OVERRIDE` is `1` or (any case) `true` (libcni v1.3's `ns.CheckNetNS`).
///
/// libcni runs this after the plugin, so a refused ADD has already built the pod's
/// interface in the host's netns and allocated its addresses (and printed its result);
/// we run it before any plugin code, for ADD, DEL and CHECK, so a refused call has done
/// nothing. CHECK too (libcni skips it there): it enters CNI_NETNS like ADD and DEL, and
/// would compare the host's own interfaces with the previous result as if they were the
/// pod's. GC, STATUS and VERSION have no CNI_NETNS.
fn check_netns(args: &CmdArgs) -> Result<(), CniError> {
    let o = args.netns_override.as_str();
    // DEL may come without a netns (the sandbox is gone): nothing to compare.
    if o == "1" || o.eq_ignore_ascii_case("true") || args.netns.is_empty() {
        return Ok(());
    }
    if netns_is_same(std::path::Path::new(&args.netns), &own_netns_path())? {
        return Err(CniError::new(
            CODE_INVALID_NETNS,
            "plugin's netns and netns from CNI_NETNS should not be the same",
            "",
        ));
    }
    Ok(())
}

/// The calling thread's own netns: a thread may have entered another netns than the
/// process's first thread, and the plugin's work runs from this one.
fn own_netns_path() -> std::path::PathBuf {
    let thread_self = std::path::Path::new("/proc/thread-self/ns/net");
    if thread_self.exists() {
        return thread_self.to_path_buf();
    }
    // Kernels before 3.17 have no /proc/thread-self.
    let tid = nix::unistd::gettid();
    std::path::PathBuf::from(format!("/proc/self/task/{tid}/ns/net"))
}

/// Whether the namespace file `target` is the namespace `own` (same device and inode).
/// Both are compared by `stat`, never opened: a `target` that is a FIFO (or anything else
/// whose open can block) must not stall the call here; the plugin's own namespace check
/// (`dataplane::sys`) refuses what is not a namespace before it opens it. A `target` that
/// cannot be stat'ed is not refused here: the plugin reports its own error for it (and DEL
/// of a netns already gone succeeds). An `own` that cannot be stat'ed is code 8, "get
/// plugin's netns failed", as libcni.
fn netns_is_same(target: &std::path::Path, own: &std::path::Path) -> Result<bool, CniError> {
    let own = std::fs::metadata(own)
        .map_err(|_| CniError::new(CODE_INVALID_NETNS, "get plugin's netns failed", ""))?;
    Ok(std::fs::metadata(target).is_ok_and(|t| t.dev() == own.dev() && t.ino() == own.ino()))
}

#[cfg(test)]
mod tests;
