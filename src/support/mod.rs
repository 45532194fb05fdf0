//! What every layer may use and that knows nothing of Calico or CNI: Go's texts and parsing
//! (`gocompat`, `gojson`: bools, errnos, flags, JSON errors as Go words them), IP networks
//! with Go's text forms (`net`), upstream's time formats (`timefmt`), base64 (`encoding`),
//! the call's one deadline (`deadline`), files a call's input names opened without blocking
//! (`input_file`), and Go's HTTP proxy rules (`http_proxy`).

pub mod deadline;
pub mod encoding;
pub mod gocompat;
pub mod gojson;
pub mod http_proxy;
pub mod input_file;
pub mod net;
pub mod timefmt;
