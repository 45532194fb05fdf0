//! Answers: `Reply`, and failures rendered as the real server's `Status` objects, with its
//! reasons and message texts (`errors.NewNotFound`, `NewConflict`, `NewInvalid`, ...).

use serde_json::{json, Map, Value};

use super::resource::{qualify, Resource};

/// An HTTP answer.
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    pub fn json(status: u16, v: &Value) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body: serde_json::to_vec(v).unwrap(),
            headers: vec![],
        }
    }
    /// What the real server's mux answers for a path nothing serves.
    pub fn page_not_found() -> Reply {
        Reply {
            status: 404,
            content_type: "text/plain; charset=utf-8",
            body: b"404 page not found\n".to_vec(),
            headers: vec![],
        }
    }
}

/// A `StatusDetails` object, empty fields left out as the real server does.
pub fn details(name: &str, group: &str, kind: &str) -> Value {
    let mut d = Map::new();
    for (k, v) in [("name", name), ("group", group), ("kind", kind)] {
        if !v.is_empty() {
            d.insert(k.into(), v.into());
        }
    }
    Value::Object(d)
}

/// A failed request, rendered as a `Status` object.
#[derive(Debug)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }
    pub fn with(mut self, details: Value) -> ApiError {
        self.details = Some(details);
        self
    }
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", message)
    }
    pub fn not_found(r: &Resource, name: &str) -> ApiError {
        let msg = format!("{} \"{name}\" not found", r.qualified());
        ApiError::new(404, "NotFound", msg).with(details(name, &r.group, &r.plural))
    }
    pub fn already_exists(r: &Resource, name: &str) -> ApiError {
        let msg = format!("{} \"{name}\" already exists", r.qualified());
        ApiError::new(409, "AlreadyExists", msg).with(details(name, &r.group, &r.plural))
    }
    /// `Conflict` on a resource named by (group, resource-or-kind), as `errors.NewConflict`.
    pub fn conflict(group: &str, resource: &str, name: &str, cause: &str) -> ApiError {
        let msg = format!(
            "Operation cannot be fulfilled on {} \"{name}\": {cause}",
            qualify(resource, group)
        );
        ApiError::new(409, "Conflict", msg).with(details(name, group, resource))
    }
    /// The optimistic-concurrency failure of an update.
    pub fn modified(r: &Resource, name: &str) -> ApiError {
        let cause = "the object has been modified; please apply your changes to the latest version and try again";
        ApiError::conflict(&r.group, &r.plural, name, cause)
    }
    /// 422 Invalid for (group, kind) `name` with field errors, as `errors.NewInvalid`.
    pub fn invalid(group: &str, kind: &str, name: &str, errs: &[FieldError]) -> ApiError {
        let bodies: Vec<String> = errs.iter().map(FieldError::to_string).collect();
        let agg = match bodies.as_slice() {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        let msg = format!("{} \"{name}\" is invalid: {agg}", qualify(kind, group));
        let mut d = details(name, group, kind);
        d["causes"] = errs
            .iter()
            .map(|e| json!({"reason": e.reason(), "message": e.body(), "field": e.field}))
            .collect();
        ApiError::new(422, "Invalid", msg).with(d)
    }
    pub fn unsupported_media_type(accepted: &[&str]) -> ApiError {
        let msg = format!(
            "the body of the request was in an unknown format - accepted media types include: {}",
            accepted.join(", ")
        );
        ApiError::new(415, "UnsupportedMediaType", msg)
    }
    pub fn method_not_allowed() -> ApiError {
        let msg = "the server does not allow this method on the requested resource";
        ApiError::new(405, "MethodNotAllowed", msg).with(json!({}))
    }

    pub fn status(&self) -> Value {
        let mut s = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message,
        });
        if !self.reason.is_empty() {
            s["reason"] = self.reason.into();
        }
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s["code"] = self.code.into();
        s
    }

    pub fn reply(&self) -> Reply {
        Reply::json(self.code, &self.status())
    }
}

/// One field error of an Invalid answer (`field.Error`).
pub struct FieldError {
    field: String,
    kind: &'static str,
    /// The rendered bad value, for `Invalid value` errors.
    value: Option<String>,
    detail: String,
}

impl FieldError {
    pub fn required(field: &str, detail: &str) -> FieldError {
        FieldError {
            field: field.into(),
            kind: "Required value",
            value: None,
            detail: detail.into(),
        }
    }
    pub fn invalid(field: &str, value: String, detail: &str) -> FieldError {
        FieldError {
            field: field.into(),
            kind: "Invalid value",
            value: Some(value),
            detail: detail.into(),
        }
    }
    pub fn forbidden(field: &str, detail: &str) -> FieldError {
        FieldError {
            field: field.into(),
            kind: "Forbidden",
            value: None,
            detail: detail.into(),
        }
    }
    pub fn reason(&self) -> &'static str {
        match self.kind {
            "Required value" => "FieldValueRequired",
            "Invalid value" => "FieldValueInvalid",
            _ => "FieldValueForbidden",
        }
    }
    /// The text without the field path (a cause's message).
    pub fn body(&self) -> String {
        let mut s = self.kind.to_string();
        if let Some(v) = &self.value {
            s = format!("{s}: {v}");
        }
        if !self.detail.is_empty() {
            s = format!("{s}: {}", self.detail);
        }
        s
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}
