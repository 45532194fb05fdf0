//! CNI 1.1 GC's input: the attachments the runtime still considers valid, from the config's
//! `cni.dev/valid-attachments` (the spec's name since 1.1.0 was released; libcni also sends
//! the older `cni.dev/attachments`, which is accepted too).

use std::collections::BTreeSet;

use serde::Deserialize;

use super::error::{CniError, CODE_DECODING_FAILURE, CODE_INVALID_NETWORK_CONFIG};

pub const VALID_ATTACHMENTS_KEY: &str = "cni.dev/valid-attachments";
pub const OLD_ATTACHMENTS_KEY: &str = "cni.dev/attachments";

/// One valid attachment.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    #[serde(default)]
    pub ifname: String,
}

/// The valid attachments of a GC call. A config without the list is refused: GC without it
/// would release every address of the network on this node.
pub fn valid_attachments(stdin: &[u8]) -> Result<Vec<Attachment>, CniError> {
    let v: serde_json::Value = serde_json::from_slice(stdin)
        .map_err(|e| CniError::new(CODE_DECODING_FAILURE, e.to_string(), ""))?;
    let list = v
        .get(VALID_ATTACHMENTS_KEY)
        .or_else(|| v.get(OLD_ATTACHMENTS_KEY))
        .filter(|l| !l.is_null())
        .ok_or_else(|| {
            CniError::new(
                CODE_INVALID_NETWORK_CONFIG,
                format!("GC needs the list of valid attachments ({VALID_ATTACHMENTS_KEY})"),
                "",
            )
        })?;
    serde_json::from_value(list.clone()).map_err(|e| {
        CniError::new(
            CODE_DECODING_FAILURE,
            format!("cannot decode {VALID_ATTACHMENTS_KEY}: {e}"),
            "",
        )
    })
}

/// The container IDs of a list of attachments.
pub fn container_ids(list: &[Attachment]) -> BTreeSet<String> {
    list.iter().map(|a| a.container_id.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn either_key_and_refusals() {
        let got = valid_attachments(
            br#"{"name":"n","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}"#,
        )
        .unwrap();
        assert_eq!(got[0].container_id, "a");
        let got = valid_attachments(br#"{"name":"n","cni.dev/attachments":[{"containerID":"b"}]}"#)
            .unwrap();
        assert_eq!(container_ids(&got), BTreeSet::from(["b".to_string()]));
        assert!(
            valid_attachments(br#"{"name":"n","cni.dev/valid-attachments":[]}"#)
                .unwrap()
                .is_empty()
        );
        assert_eq!(valid_attachments(br#"{"name":"n"}"#).unwrap_err().code, 7);
        assert_eq!(
            valid_attachments(br#"{"name":"n","cni.dev/valid-attachments":"x"}"#)
                .unwrap_err()
                .code,
            6
        );
    }
}
