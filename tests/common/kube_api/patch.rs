//! The three patch formats of PATCH requests, applied to the stored object as JSON.
//!
//! - JSON merge patch (RFC 7386, `application/merge-patch+json`).
//! - Strategic merge patch (`application/strategic-merge-patch+json`), reduced to RFC 7386:
//!   maps merge recursively, `null` deletes a key, lists are replaced whole. The real
//!   server merges some lists by a merge key (pod `status.conditions` by `type`,
//!   `metadata.ownerReferences` by `uid`, ...) and honours `$patch`, `$retainKeys`,
//!   `$setElementOrder/...` and `$deleteFromPrimitiveList/...` directives: none of that is
//!   implemented, and a patch carrying a `$` directive is refused rather than stored literally.
//! - JSON patch (RFC 6902, `application/json-patch+json`): add, remove, replace, move, copy,
//!   test.

use serde_json::Value;

/// RFC 7386: merge `patch` into `target`.
pub fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let map = target.as_object_mut().unwrap();
    for (k, v) in patch {
        if v.is_null() {
            map.remove(k);
        } else {
            merge(map.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// The first `$` directive key anywhere in a strategic merge patch, if any.
pub fn strategic_directive(patch: &Value) -> Option<String> {
    match patch {
        Value::Object(m) => m.iter().find_map(|(k, v)| {
            if k.starts_with('$') {
                Some(k.clone())
            } else {
                strategic_directive(v)
            }
        }),
        Value::Array(a) => a.iter().find_map(strategic_directive),
        _ => None,
    }
}

/// Why a JSON patch failed: the patch document itself is malformed (the real server
/// answers 400), or an operation could not be applied (422).
#[derive(Debug)]
pub enum JsonPatchError {
    Malformed(String),
    Failed(String),
}

/// The reference tokens of a JSON pointer ("" is the whole document).
fn pointer(p: &str) -> Result<Vec<String>, JsonPatchError> {
    if p.is_empty() {
        return Ok(vec![]);
    }
    let Some(rest) = p.strip_prefix('/') else {
        return Err(JsonPatchError::Malformed(format!(
            "invalid JSON pointer {p:?}"
        )));
    };
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn failed(msg: String) -> JsonPatchError {
    JsonPatchError::Failed(msg)
}

/// The array index a token names: `len` allowed (and `-`) only when adding.
fn index(token: &str, len: usize, adding: bool) -> Result<usize, JsonPatchError> {
    if adding && token == "-" {
        return Ok(len);
    }
    let valid = !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'));
    match token.parse::<usize>() {
        Ok(i) if valid && (i < len || (adding && i == len)) => Ok(i),
        _ => Err(failed(format!("index {token:?} out of bounds"))),
    }
}

/// The container that holds the value at `path` (all tokens but the last).
fn parent<'a>(doc: &'a mut Value, path: &[String]) -> Result<&'a mut Value, JsonPatchError> {
    let mut cur = doc;
    for t in &path[..path.len() - 1] {
        cur = match cur {
            Value::Object(m) => m.get_mut(t),
            Value::Array(a) => {
                let i = index(t, a.len(), false)?;
                a.get_mut(i)
            }
            _ => None,
        }
        .ok_or_else(|| failed(format!("missing path component {t:?}")))?;
    }
    Ok(cur)
}

fn add(doc: &mut Value, path: &[String], value: Value) -> Result<(), JsonPatchError> {
    let Some(last) = path.last() else {
        *doc = value;
        return Ok(());
    };
    match parent(doc, path)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
        }
        Value::Array(a) => {
            let i = index(last, a.len(), true)?;
            a.insert(i, value);
        }
        _ => return Err(failed(format!("cannot add {last:?} to a scalar"))),
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &[String]) -> Result<Value, JsonPatchError> {
    let Some(last) = path.last() else {
        return Ok(std::mem::take(doc));
    };
    match parent(doc, path)? {
        Value::Object(m) => m
            .remove(last)
            .ok_or_else(|| failed(format!("unable to remove nonexistent key {last:?}"))),
        Value::Array(a) => {
            let i = index(last, a.len(), false)?;
            Ok(a.remove(i))
        }
        _ => Err(failed(format!("cannot remove {last:?} from a scalar"))),
    }
}

fn get<'a>(doc: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(doc, |v, t| match v {
        Value::Object(m) => m.get(t),
        Value::Array(a) => index(t, a.len(), false).ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

/// RFC 6902: apply `ops` (a JSON array of operations) to a copy of `doc`.
pub fn json_patch(doc: &Value, ops: &Value) -> Result<Value, JsonPatchError> {
    let malformed = |m: &str| JsonPatchError::Malformed(m.to_string());
    let ops = ops
        .as_array()
        .ok_or_else(|| malformed("a JSON patch must be an array of operations"))?;
    let mut doc = doc.clone();
    for op in ops {
        let name = op["op"]
            .as_str()
            .ok_or_else(|| malformed("operation without \"op\""))?;
        let path = pointer(
            op["path"]
                .as_str()
                .ok_or_else(|| malformed("operation without \"path\""))?,
        )?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| malformed("operation without \"value\""))
        };
        let from = || {
            pointer(
                op["from"]
                    .as_str()
                    .ok_or_else(|| malformed("operation without \"from\""))?,
            )
        };
        match name {
            "add" => add(&mut doc, &path, value()?)?,
            "remove" => {
                remove(&mut doc, &path)?;
            }
            "replace" => {
                remove(&mut doc, &path)?;
                add(&mut doc, &path, value()?)?;
            }
            "move" => {
                let v = remove(&mut doc, &from()?)?;
                add(&mut doc, &path, v)?;
            }
            "copy" => {
                let v = get(&doc, &from()?)
                    .cloned()
                    .ok_or_else(|| failed("copy from a missing path".into()))?;
                add(&mut doc, &path, v)?;
            }
            "test" => {
                if get(&doc, &path) != Some(&value()?) {
                    return Err(failed(format!("testing value {:?} failed", op["path"])));
                }
            }
            other => return Err(malformed(&format!("unexpected operation {other:?}"))),
        }
    }
    Ok(doc)
}
