//! Go's `encoding/json` error texts, for input that upstream decodes with `json.Unmarshal`
//! (a NetConf, a pod annotation): the scanner's syntax errors (`invalid character 'x'
//! looking for beginning of value`, `unexpected end of JSON input`, …), found first, over
//! the whole input, as Go's `checkValid` does, and the type errors of the shapes the
//! plugins decode (`json: cannot unmarshal object into Go value of type []string`).

use serde_json::Value;

/// A syntax error, as Go's scanner words it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct SyntaxError {
    pub msg: String,
    /// The byte offset Go reports with it (`SyntaxError.Offset`).
    pub offset: usize,
}

/// What Go's decoder says of a well-formed value of the wrong type.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GoJsonError {
    #[error(transparent)]
    Syntax(#[from] SyntaxError),
    /// `json: cannot unmarshal <kind> into Go value of type <type>`.
    #[error("json: cannot unmarshal {kind} into Go value of type {go_type}")]
    Type { kind: &'static str, go_type: String },
    /// json-iterator's own text (`iter_string_list`).
    #[error("{0}")]
    Iter(String),
}

/// `json.Unmarshal(raw, &[]string{})` through json-iterator's standard-library-compatible
/// configuration (libcalico-go's `lib/json`, which decodes `allowedSourcePrefixes`): its
/// own words where the value does not start a list (`[]string: decode slice: expect [ or
/// n, but found 1, error found in #1 byte of ...|10.0.0.0/8|..., bigger context ...`), the
/// standard library's otherwise.
pub fn iter_string_list(raw: &str) -> Result<Vec<String>, GoJsonError> {
    let b = raw.as_bytes();
    let first = b.iter().position(|c| !is_space(*c));
    if let Some(at) = first {
        let c = b[at];
        if c != b'[' && c != b'n' {
            // The iterator stands just past the token it read.
            let head = at + 1;
            let window = |before: usize, after: usize| {
                let from = head.saturating_sub(before);
                let to = (head + after).min(b.len());
                (from, String::from_utf8_lossy(&b[from..to]).into_owned())
            };
            let (peek_start, parsing) = window(10, 10);
            let (_, context) = window(50, 50);
            return Err(GoJsonError::Iter(format!(
                "[]string: decode slice: expect [ or n, but found {}, error found in #{} byte of ...|{parsing}|..., bigger context ...|{context}|...",
                c as char,
                head - peek_start
            )));
        }
    }
    string_list(raw)
}

/// Go's name for the kind of a JSON value in a type error (`UnmarshalTypeError.Value`).
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Object(_) => "object",
        Value::Array(_) => "array",
        Value::String(_) => "string",
        Value::Number(_) => "number",
        Value::Bool(_) => "bool",
        Value::Null => "null",
    }
}

/// `json.Unmarshal(raw, &[]string{})`: the list, or Go's error. `null` is an empty list.
pub fn string_list(raw: &str) -> Result<Vec<String>, GoJsonError> {
    check_syntax(raw.as_bytes())?;
    let v: Value = serde_json::from_str(raw).map_err(|e| SyntaxError {
        msg: e.to_string(),
        offset: 0,
    })?;
    let type_error = |v: &Value, go_type: &str| GoJsonError::Type {
        kind: kind(v),
        go_type: go_type.to_string(),
    };
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => {
            // Go decodes every element it can and reports the first it could not.
            let mut out = Vec::new();
            let mut first_error = None;
            for item in items {
                match item {
                    Value::String(s) => out.push(s),
                    Value::Null => out.push(String::new()),
                    other => {
                        first_error.get_or_insert_with(|| type_error(&other, "string"));
                    }
                }
            }
            match first_error {
                Some(e) => Err(e),
                None => Ok(out),
            }
        }
        other => Err(type_error(&other, "[]string")),
    }
}

/// Go's `quoteChar`: the character as a Go string literal would show it, in single quotes.
fn quote_char(c: u8) -> String {
    match c {
        b'\'' => "'\\''".into(),
        b'"' => "'\"'".into(),
        0x20..=0x7e => format!("'{}'", c as char),
        b'\n' => "'\\n'".into(),
        b'\r' => "'\\r'".into(),
        b'\t' => "'\\t'".into(),
        0x07 => "'\\a'".into(),
        0x08 => "'\\b'".into(),
        0x0c => "'\\f'".into(),
        0x0b => "'\\v'".into(),
        // A byte of a multi-byte UTF-8 sequence: Go's scanner sees the byte, and quotes
        // the rune it makes on its own (U+FFFD).
        0x80..=0xff => "'\\ufffd'".into(),
        _ => format!("'\\x{c:02x}'"),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Container {
    ObjectKey,
    ObjectValue,
    Array,
}

#[derive(Clone, Copy, PartialEq)]
enum State {
    BeginValue,
    BeginValueOrEmpty,
    BeginStringOrEmpty,
    BeginString,
    EndValue,
    EndTop,
    InString,
    InStringEsc,
    InStringEscU(u8),
    Neg,
    One,
    Zero,
    Dot,
    Dot0,
    E,
    ESign,
    E0,
    /// Inside a literal: the bytes still expected, and the literal's name.
    Literal(&'static [u8], &'static str),
}

fn is_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r' | b'\n')
}

/// Go's `checkValid`: the first syntax error in `data`, worded as Go's scanner words it.
pub fn check_syntax(data: &[u8]) -> Result<(), SyntaxError> {
    let mut stack: Vec<Container> = Vec::new();
    let mut state = State::BeginValue;
    for (i, &c) in data.iter().enumerate() {
        state = step(state, &mut stack, c).map_err(|context| SyntaxError {
            msg: format!("invalid character {} {context}", quote_char(c)),
            offset: i + 1,
        })?;
    }
    // End of input: a value that is complete ends the top level; anything else is cut short.
    let ended = match state {
        State::EndTop => true,
        State::One | State::Zero | State::Dot0 | State::E0 | State::EndValue => stack.is_empty(),
        _ => false,
    };
    if ended {
        Ok(())
    } else {
        Err(SyntaxError {
            msg: "unexpected end of JSON input".into(),
            offset: data.len(),
        })
    }
}

/// One byte through the scanner: the next state, or the context of Go's error text.
fn step(state: State, stack: &mut Vec<Container>, c: u8) -> Result<State, String> {
    use State::*;
    match state {
        BeginValue | BeginValueOrEmpty | BeginStringOrEmpty | BeginString | EndValue | EndTop
            if is_space(c) =>
        {
            Ok(state)
        }
        BeginValueOrEmpty if c == b']' => end_container(stack),
        BeginValueOrEmpty | BeginValue => begin_value(stack, c),
        BeginStringOrEmpty if c == b'}' => {
            // `{}`: the key position is replaced by the object's end.
            if let Some(top) = stack.last_mut() {
                *top = Container::ObjectValue;
            }
            end_container(stack)
        }
        BeginStringOrEmpty | BeginString => match c {
            b'"' => Ok(InString),
            _ => Err("looking for beginning of object key string".into()),
        },
        EndTop => Err("after top-level value".into()),
        EndValue => end_value(stack, c),
        InString => match c {
            b'"' => Ok(EndValue),
            b'\\' => Ok(InStringEsc),
            0..=0x1f => Err("in string literal".into()),
            _ => Ok(InString),
        },
        InStringEsc => match c {
            b'b' | b'f' | b'n' | b'r' | b't' | b'\\' | b'/' | b'"' => Ok(InString),
            b'u' => Ok(InStringEscU(0)),
            _ => Err("in string escape code".into()),
        },
        InStringEscU(n) => match c.is_ascii_hexdigit() {
            true if n == 3 => Ok(InString),
            true => Ok(InStringEscU(n + 1)),
            false => Err("in \\u hexadecimal character escape".into()),
        },
        Neg => match c {
            b'0' => Ok(Zero),
            b'1'..=b'9' => Ok(One),
            _ => Err("in numeric literal".into()),
        },
        One if c.is_ascii_digit() => Ok(One),
        One | Zero => match c {
            b'.' => Ok(Dot),
            b'e' | b'E' => Ok(E),
            _ => end_value(stack, c),
        },
        Dot => match c.is_ascii_digit() {
            true => Ok(Dot0),
            false => Err("after decimal point in numeric literal".into()),
        },
        Dot0 => match c {
            b'0'..=b'9' => Ok(Dot0),
            b'e' | b'E' => Ok(E),
            _ => end_value(stack, c),
        },
        E if c == b'+' || c == b'-' => Ok(ESign),
        E | ESign => match c.is_ascii_digit() {
            true => Ok(E0),
            false => Err("in exponent of numeric literal".into()),
        },
        E0 => match c.is_ascii_digit() {
            true => Ok(E0),
            false => end_value(stack, c),
        },
        Literal(rest, name) => match rest.split_first() {
            Some((want, more)) if *want == c => match more.is_empty() {
                true => Ok(EndValue),
                false => Ok(Literal(more, name)),
            },
            Some((want, _)) => Err(format!(
                "in literal {name} (expecting {})",
                quote_char(*want)
            )),
            None => end_value(stack, c),
        },
    }
}

fn begin_value(stack: &mut Vec<Container>, c: u8) -> Result<State, String> {
    use State::*;
    match c {
        b'{' => {
            stack.push(Container::ObjectKey);
            Ok(BeginStringOrEmpty)
        }
        b'[' => {
            stack.push(Container::Array);
            Ok(BeginValueOrEmpty)
        }
        b'"' => Ok(InString),
        b'-' => Ok(Neg),
        b'0' => Ok(Zero),
        b'1'..=b'9' => Ok(One),
        b't' => Ok(Literal(b"rue", "true")),
        b'f' => Ok(Literal(b"alse", "false")),
        b'n' => Ok(Literal(b"ull", "null")),
        _ => Err("looking for beginning of value".into()),
    }
}

/// After a value: what its container allows next.
fn end_value(stack: &mut Vec<Container>, c: u8) -> Result<State, String> {
    use State::*;
    let Some(top) = stack.last_mut() else {
        return match is_space(c) {
            true => Ok(EndTop),
            false => Err("after top-level value".into()),
        };
    };
    if is_space(c) {
        return Ok(EndValue);
    }
    match *top {
        Container::ObjectKey => match c {
            b':' => {
                *top = Container::ObjectValue;
                Ok(BeginValue)
            }
            _ => Err("after object key".into()),
        },
        Container::ObjectValue => match c {
            b',' => {
                *top = Container::ObjectKey;
                Ok(BeginString)
            }
            b'}' => end_container(stack),
            _ => Err("after object key:value pair".into()),
        },
        Container::Array => match c {
            b',' => Ok(BeginValue),
            b']' => end_container(stack),
            _ => Err("after array element".into()),
        },
    }
}

fn end_container(stack: &mut Vec<Container>) -> Result<State, String> {
    stack.pop();
    Ok(match stack.is_empty() {
        true => State::EndTop,
        false => State::EndValue,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> String {
        check_syntax(s.as_bytes()).unwrap_err().msg
    }

    #[test]
    fn syntax_errors_as_go_words_them() {
        // Each as Go 1.25's encoding/json prints it.
        assert_eq!(
            err(r#"{"cniVersion":"1.0.0", nope}"#),
            "invalid character 'n' looking for beginning of object key string"
        );
        assert_eq!(err(""), "unexpected end of JSON input");
        assert_eq!(err(r#"{"a":"b""#), "unexpected end of JSON input");
        assert_eq!(
            err("second-ipv4-ippool"),
            "invalid character 's' looking for beginning of value"
        );
        assert_eq!(
            err("10.65.3.9"),
            "invalid character '.' after top-level value"
        );
        assert_eq!(
            err("IPv4"),
            "invalid character 'I' looking for beginning of value"
        );
        assert_eq!(
            err("[nope"),
            "invalid character 'o' in literal null (expecting 'u')"
        );
        assert_eq!(err("[1 2]"), "invalid character '2' after array element");
        assert_eq!(err(r#"{"a" 1}"#), "invalid character '1' after object key");
        assert_eq!(
            err(r#"{"a":1 "b":2}"#),
            "invalid character '\"' after object key:value pair"
        );
        assert_eq!(err("-x"), "invalid character 'x' in numeric literal");
        assert_eq!(
            err("1.x"),
            "invalid character 'x' after decimal point in numeric literal"
        );
        assert_eq!(
            err("1ex"),
            "invalid character 'x' in exponent of numeric literal"
        );
        assert_eq!(
            err("\"a\\x\""),
            "invalid character 'x' in string escape code"
        );
        assert_eq!(
            err("\"\u{1}\""),
            "invalid character '\\x01' in string literal"
        );
        assert_eq!(
            err("'a'"),
            "invalid character '\\'' looking for beginning of value"
        );
        assert_eq!(err("{} x"), "invalid character 'x' after top-level value");
        assert_eq!(
            err("[1,]"),
            "invalid character ']' looking for beginning of value"
        );
        for ok in [
            "{}",
            "[]",
            " [1, 2.5e-3, \"x\", true, null, {\"a\": []}] ",
            "0",
            "\"\\u00e9\"",
            "123",
            "123 ",
        ] {
            assert!(check_syntax(ok.as_bytes()).is_ok(), "{ok}");
        }
    }

    #[test]
    fn string_lists_as_go_decodes_them() {
        assert_eq!(string_list(r#"["a","b"]"#).unwrap(), vec!["a", "b"]);
        assert_eq!(string_list("null").unwrap(), Vec::<String>::new());
        let type_err = |s: &str| string_list(s).unwrap_err().to_string();
        assert_eq!(
            type_err(r#"{"a":1}"#),
            "json: cannot unmarshal object into Go value of type []string"
        );
        assert_eq!(
            type_err(r#""x""#),
            "json: cannot unmarshal string into Go value of type []string"
        );
        assert_eq!(
            type_err("[1]"),
            "json: cannot unmarshal number into Go value of type string"
        );
        assert_eq!(
            type_err("1.2.3.4"),
            "invalid character '.' after top-level value"
        );
    }

    #[test]
    fn json_iterator_words_a_value_that_is_not_a_list() {
        // As upstream v3.32.1 printed it for `allowedSourcePrefixes: 10.0.0.0/8`.
        assert_eq!(
            iter_string_list("10.0.0.0/8").unwrap_err().to_string(),
            "[]string: decode slice: expect [ or n, but found 1, error found in #1 byte of ...|10.0.0.0/8|..., bigger context ...|10.0.0.0/8|..."
        );
        assert_eq!(
            iter_string_list(r#"["10.0.0.0/8"]"#).unwrap(),
            vec!["10.0.0.0/8"]
        );
        assert_eq!(iter_string_list("null").unwrap(), Vec::<String>::new());
    }
}
