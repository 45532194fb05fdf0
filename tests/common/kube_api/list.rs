//! List requests: label and field selectors, `limit`/`continue` pages, and the list object
//! the real server answers.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::resource::Target;
use super::selector::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::store::State;

/// `k=v&...` with percent-decoding ('+' is a space, as Go's url.ParseQuery has it).
pub fn parse_query(q: &str) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        let s = s.replace('+', " ");
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok());
            match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
                (b'%', Some(byte)) => {
                    out.push(byte);
                    i += 3;
                }
                (c, _) => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

impl State {
    /// The objects of a collection (one namespace's, or all), in key order.
    pub(super) fn select<'a>(
        &'a self,
        t: &Target,
    ) -> impl Iterator<Item = (&'a String, &'a Value)> + 'a {
        let prefix = match &t.ns {
            Some(ns) if t.res.namespaced => format!("{ns}/"),
            _ => String::new(),
        };
        self.objects
            .get(&format!("{}/{}", t.res.group, t.res.plural))
            .into_iter()
            .flatten()
            .filter(move |(k, _)| k.starts_with(&prefix))
    }

    pub(super) fn list_request(
        &self,
        t: &Target,
        q: &BTreeMap<String, String>,
    ) -> Result<Value, ApiError> {
        if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
            return Err(ApiError::bad_request(
                "watch is not implemented by the test API server",
            ));
        }
        let label_sel = q
            .get("labelSelector")
            .map(String::as_str)
            .unwrap_or_default();
        let field_sel = q
            .get("fieldSelector")
            .map(String::as_str)
            .unwrap_or_default();
        let labels = LabelSelector::parse(label_sel).map_err(ApiError::bad_request)?;
        let fields = FieldSelector::parse(field_sel, &t.res.selectable_fields())
            .map_err(ApiError::bad_request)?;
        let limit: usize = q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(0);
        // The continue token is opaque to clients: here, the hex of the last key returned.
        let after = match q.get("continue").filter(|c| !c.is_empty()) {
            None => None,
            Some(c) => Some(
                hex_decode(c).ok_or_else(|| ApiError::bad_request("continue key is not valid"))?,
            ),
        };
        let mut matching = self
            .select(t)
            .filter(|(k, _)| after.as_ref().is_none_or(|a| k.as_str() > a.as_str()))
            .filter(|(_, v)| labels.matches(v["metadata"].get("labels")) && fields.matches(v));
        let mut items = vec![];
        let mut last_key = None;
        for (k, v) in matching.by_ref() {
            let mut item = v.clone();
            if !t.res.custom {
                // Items of a built-in list carry no kind/apiVersion; custom ones do.
                let m = item.as_object_mut().unwrap();
                m.remove("kind");
                m.remove("apiVersion");
            }
            items.push(item);
            last_key = Some(k.clone());
            if limit > 0 && items.len() == limit {
                break;
            }
        }
        let remaining = matching.count();
        let mut list_meta = json!({"resourceVersion": self.rv.to_string()});
        if remaining > 0 {
            list_meta["continue"] = hex_encode(last_key.unwrap().as_bytes()).into();
            if label_sel.is_empty() && field_sel.is_empty() {
                list_meta["remainingItemCount"] = remaining.into();
            }
        }
        Ok(json!({
            "kind": format!("{}List", t.res.kind),
            "apiVersion": t.res.api_version(),
            "metadata": list_meta,
            "items": items,
        }))
    }
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex_decode(s: &str) -> Option<String> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}
