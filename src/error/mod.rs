//! The crate's top-level error: one variant per layer over a typed root, context added on
//! the way up without flattening the cause (`Chain`, as netavark's `NetavarkError::Chain`),
//! and the one mapping of every error to a CNI error code (`From<Error> for CniError`).
//!
//! A deadline is recognised by type, wherever it sits in the chain (`Error::deadline`).

pub mod conditions;

pub use conditions::{
    AnnotationError, CheckError, ContextDeadline, DatastoreNotReady, EmptyIpamAnswer, GcError,
    HostLocalError, PoolRequestError, ReadinessGateError, VmError,
};

use crate::config::identifiers::IdentifierError;
use crate::config::ConfigError;
use crate::dataplane::DataplaneError;
use crate::datastore::settings::SettingsError;
use crate::datastore::validate::ValidationError;
use crate::datastore::DatastoreError;
use crate::delegate::DelegateError;
use crate::ipam::allocator::IpamError;
use crate::ipam::verify::VerifyError;
use crate::skel::error::{CODE_INVALID_ENV, CODE_NOT_AVAILABLE, CODE_TRY_AGAIN_LATER, CODE_UNSET};
use crate::skel::CniError;
use crate::support::deadline::Expired;
use crate::support::gojson::GoJsonError;
use crate::support::net::ParseIpNetError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error(transparent)]
    Datastore(#[from] DatastoreError),
    /// libcalico-go's validator refused an object before it was written.
    #[error(transparent)]
    Validation(#[from] ValidationError),
    #[error(transparent)]
    Ipam(#[from] IpamError),
    #[error(transparent)]
    Verify(#[from] VerifyError),
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    /// A delegated plugin (an IPAM plugin from CNI_PATH) that was not run or that failed.
    #[error(transparent)]
    Delegate(#[from] DelegateError),
    #[error(transparent)]
    Annotation(#[from] AnnotationError),
    #[error(transparent)]
    HostLocal(#[from] HostLocalError),
    #[error(transparent)]
    EmptyIpamAnswer(#[from] EmptyIpamAnswer),
    #[error(transparent)]
    Check(#[from] CheckError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    PoolRequest(#[from] PoolRequestError),
    #[error(transparent)]
    ReadinessGate(#[from] ReadinessGateError),
    #[error(transparent)]
    DatastoreNotReady(#[from] DatastoreNotReady),
    #[error(transparent)]
    ContextDeadline(#[from] ContextDeadline),
    #[error(transparent)]
    Gc(#[from] GcError),
    #[error("error constructing WorkloadEndpoint name: {0}")]
    Identifiers(#[from] IdentifierError),
    #[error("error constructing WorkloadEndpoint prefix: {0}")]
    IdentifierPrefix(IdentifierError),
    /// An operating-system failure (spawning or talking to a child plugin, say).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// JSON that does not parse (a config being rewritten, say).
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A JSON value given by a user (an annotation's, say) that does not parse, in Go's words.
    #[error(transparent)]
    JsonValue(#[from] JsonValueError),
    /// The same without upstream's prefix (the pool and family annotations).
    #[error(transparent)]
    GoJson(#[from] GoJsonError),
    /// A CIDR that does not parse (Go's `invalid CIDR address: <s>`).
    #[error(transparent)]
    Cidr(#[from] ParseIpNetError),
    /// An IP address that does not parse (Go's `invalid IP format: <s>`).
    #[error("invalid IP format: {input}")]
    InvalidIp {
        input: String,
        #[source]
        source: std::net::AddrParseError,
    },
    /// The call's deadline passed (`crate::support::deadline`).
    #[error(transparent)]
    Deadline(#[from] Expired),
    /// Calico is not ready to serve ADD (STATUS's answer; the cause, if any, in the text).
    #[error("{what}{}", .source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
    NotReady {
        what: String,
        source: Option<Box<Error>>,
    },
    /// `calico -t`: the datastore connection failed (upstream's code 100, the cause as
    /// details).
    #[error("data store connection failed")]
    ConnectionTest(#[source] Box<Error>),
    /// An interface name with a `%`, the kernel's name template.
    #[error("interface name contains '%', which the kernel treats as a name template")]
    InterfaceNameTemplate { ifname: String },
    /// Another ADD of the same pod interface holds its sandbox lock.
    #[error("another ADD for the interface {host_veth} is in progress on this node")]
    SandboxBusy { host_veth: String },
    /// An error that already is a CNI error: passed through unchanged.
    #[error("{}", .0.msg)]
    Cni(CniError),
    /// A test's own failure (production conditions are typed: `conditions.rs`).
    #[cfg(test)]
    #[error("{0}")]
    Msg(String),
    /// `context: cause`, the cause kept with its type.
    #[error("{context}: {source}")]
    Chain {
        context: String,
        #[source]
        source: Box<Error>,
    },
    /// Several independent failures of one call (DEL runs every step), joined with "; ".
    #[error("{}", join(.0))]
    List(Vec<Error>),
}

/// Go's `json.Unmarshal` refusing a value given as text (a pod annotation's):
/// `failed to parse '<raw>' as JSON: <Go's reason>`.
#[derive(Debug, thiserror::Error)]
#[error("failed to parse '{raw}' as JSON: {source}")]
pub struct JsonValueError {
    pub raw: String,
    #[source]
    pub source: GoJsonError,
}

fn join(errors: &[impl std::fmt::Display]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl Error {
    #[cfg(test)]
    pub fn msg(s: impl Into<String>) -> Self {
        Error::Msg(s.into())
    }

    /// `context: cause`.
    pub fn chain(context: impl Into<String>, cause: impl Into<Error>) -> Self {
        Error::Chain {
            context: context.into(),
            source: Box::new(cause.into()),
        }
    }

    /// The call's deadline, when it is what this error (or any cause in its chain) is.
    pub fn deadline(&self) -> Option<&Expired> {
        match self {
            Error::Deadline(e) => Some(e),
            Error::Datastore(e) => e.deadline(),
            Error::Ipam(IpamError::Datastore(e) | IpamError::Node(e)) => e.deadline(),
            Error::Verify(e) => e.deadline(),
            Error::Dataplane(DataplaneError::Deadline(e)) => Some(e),
            Error::Delegate(DelegateError::Deadline(e)) => Some(e),
            Error::Chain { source, .. } => source.deadline(),
            Error::List(all) => all.iter().find_map(Error::deadline),
            _ => None,
        }
    }
}

/// Adds context to an error on its way up, keeping it as the cause.
pub trait Context<T> {
    fn context(self, context: impl Into<String>) -> Result<T>;
    fn with_context<C: Into<String>>(self, context: impl FnOnce() -> C) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::chain(context, e))
    }

    fn with_context<C: Into<String>>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| Error::chain(context(), e))
    }
}

impl From<CniError> for Error {
    fn from(e: CniError) -> Self {
        Error::Cni(e)
    }
}

/// The one place errors become CNI codes: typed CNI errors keep theirs; a call that ran out
/// of time is code 11, "try again later" (the spec's code for a transient condition the
/// runtime should retry: a datastore that does not answer in time is one), with the deadline
/// as `msg` and the whole error, with its context, as `details`; several failures take the
/// deadline's code when one of them is it, else the first one's; everything else is 999
/// ("internal") with the error's text, as Go's skel does for untyped errors. A delegated
/// plugin's failure is the error object libcni made of it (`pluginErr`), with the code the
/// plugin's output gave, else none (0: libcni words those failures itself).
impl From<Error> for CniError {
    fn from(e: Error) -> CniError {
        // The interface name is the details.
        if let Error::InterfaceNameTemplate { ifname } = &e {
            return CniError::new(CODE_INVALID_ENV, e.to_string(), ifname.as_str());
        }
        match e {
            Error::Cni(c) => c,
            e @ Error::NotReady { .. } => CniError::new(CODE_NOT_AVAILABLE, e.to_string(), ""),
            Error::ConnectionTest(cause) => CniError::new(
                CONNECTION_TEST_FAILED,
                CONNECTION_TEST_MSG,
                cause.to_string(),
            ),
            e @ Error::SandboxBusy { .. } => CniError::new(
                CODE_TRY_AGAIN_LATER,
                e.to_string(),
                "two ADDs of one sandbox at once; retry once the first is done",
            ),
            Error::Delegate(DelegateError::Result(c)) => c,
            Error::Delegate(DelegateError::Plugin(p)) => {
                let code = p.code().unwrap_or(CODE_UNSET);
                CniError::new(code, p.msg(), p.details())
            }
            Error::List(mut all) if all.len() == 1 => CniError::from(all.remove(0)),
            Error::List(all) => {
                let msg = join(&all);
                let codes: Vec<u64> = all.into_iter().map(|e| CniError::from(e).code).collect();
                let code = match codes.contains(&CODE_TRY_AGAIN_LATER) {
                    true => CODE_TRY_AGAIN_LATER,
                    false => codes
                        .first()
                        .copied()
                        .unwrap_or(crate::skel::error::CODE_INTERNAL),
                };
                CniError::new(code, msg, "")
            }
            other => match other.deadline() {
                Some(expired) => {
                    let msg = expired.to_string();
                    let text = other.to_string();
                    let details = if text == msg { String::new() } else { text };
                    CniError::new(CODE_TRY_AGAIN_LATER, msg, details)
                }
                None => CniError::internal(other.to_string()),
            },
        }
    }
}

/// `calico -t`'s code and text when the datastore cannot be reached (upstream's).
const CONNECTION_TEST_FAILED: u64 = 100;
const CONNECTION_TEST_MSG: &str = "data store connection failed";

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datastore::DatastoreError;

    #[test]
    fn a_deadline_is_found_by_type_under_any_context() {
        let e =
            crate::support::deadline::expired("waiting for etcd (txn /calico/ipam/v2/handle/h)");
        let wrapped = Error::chain(
            "error creating calico client",
            Error::chain(
                "error getting ClusterInformation",
                DatastoreError::Deadline(e.clone()),
            ),
        );
        assert_eq!(wrapped.deadline(), Some(&e));
        let c = CniError::from(wrapped);
        assert_eq!(c.code, CODE_TRY_AGAIN_LATER);
        assert_eq!(c.msg, e.to_string());
        assert_eq!(
            c.details,
            format!("error creating calico client: error getting ClusterInformation: {e}")
        );
        // The same text without the type is not a deadline.
        let text = Error::msg(format!("error getting ClusterInformation: {e}"));
        assert_eq!(CniError::from(text).code, crate::skel::error::CODE_INTERNAL);
    }

    #[test]
    fn context_keeps_the_cause() {
        let r: Result<(), DatastoreError> = Err(DatastoreError::Conflict("x".into()));
        let e = r.context("error deleting endpoint").unwrap_err();
        assert_eq!(e.to_string(), "error deleting endpoint: update conflict: x");
        let Error::Chain { source, .. } = &e else {
            panic!("not a chain: {e:?}");
        };
        assert!(matches!(
            **source,
            Error::Datastore(DatastoreError::Conflict(_))
        ));
    }

    /// The conditions found above the libraries get their codes here, and nowhere else.
    #[test]
    fn each_condition_gets_its_code_in_the_one_mapping() {
        let not_ready = Error::NotReady {
            what: "the Calico datastore is not ready".into(),
            source: Some(Box::new(
                crate::support::deadline::expired("reading x").into(),
            )),
        };
        let c = CniError::from(not_ready);
        assert_eq!(
            c.code, CODE_NOT_AVAILABLE,
            "not ready, even when the cause is a deadline"
        );
        assert!(
            c.msg.starts_with("the Calico datastore is not ready: "),
            "{}",
            c.msg
        );
        let c = CniError::from(Error::ConnectionTest(Box::new(Error::msg("refused"))));
        assert_eq!(
            (c.code, c.msg.as_str(), c.details.as_str()),
            (100, "data store connection failed", "refused")
        );
        let c = CniError::from(Error::SandboxBusy {
            host_veth: "cali1".into(),
        });
        assert_eq!(c.code, CODE_TRY_AGAIN_LATER);
        let c = CniError::from(Error::InterfaceNameTemplate {
            ifname: "e%d".into(),
        });
        assert_eq!((c.code, c.details.as_str()), (CODE_INVALID_ENV, "e%d"));
    }
}
