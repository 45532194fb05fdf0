//! Go's `encoding/json` error texts, for input that upstream decodes with `json.Unmarshal`
//! (a NetConf, a pod annotation): the scanner's syntax errors (`invalid character 'x'
//! looking for beginning of value`, `unexpected end of JSON input`, …), found first, over
//! the whole input, as Go's `checkValid` does, and the type errors of the shapes the
//! plugins decode (`json: cannot unmarshal object into Go value of type []string`), among
//! them libcni's `types.Error` (`unmarshal_cni_error`).

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
    /// `json: cannot unmarshal <value> into Go struct field <struct>.<field> of type <type>`
    /// (`value` is the kind, or `number <literal>` for a number an integer field refuses).
    #[error(
        "json: cannot unmarshal {value} into Go struct field {go_struct}.{field} of type {go_type}"
    )]
    Field {
        value: String,
        go_struct: &'static str,
        field: &'static str,
        go_type: &'static str,
    },
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

/// libcni's `types.Error` (`{"code","msg","details"}`) as Go's `json.Unmarshal` fills it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniErrorFields {
    /// Go's `uint` (64 bits).
    pub code: u64,
    pub msg: String,
    pub details: String,
}

/// `json.Unmarshal(data, &types.Error{})`: what it fills in, and its error. A syntax error
/// (found first, over the whole input) fills in nothing; a value of the wrong type is
/// skipped, the other fields still decoded, and the first such error reported. Keys match
/// the fields' names exactly or case-insensitively; unknown keys and `null`s are ignored;
/// strings are unquoted as Go does (an invalid byte or a lone surrogate is U+FFFD).
pub fn unmarshal_cni_error(data: &[u8]) -> (CniErrorFields, Option<GoJsonError>) {
    let mut out = CniErrorFields::default();
    if let Err(e) = check_syntax(data) {
        return (out, Some(e.into()));
    }
    let mut d = Decoder {
        b: data,
        i: 0,
        error: None,
    };
    d.space();
    match d.peek() {
        Some(b'{') => d.error_fields(&mut out),
        Some(b'n') => {}
        Some(c) => {
            let kind = match c {
                b'[' => "array",
                b'"' => "string",
                b't' | b'f' => "bool",
                _ => "number",
            };
            d.error = Some(GoJsonError::Type {
                kind,
                go_type: "types.Error".into(),
            });
        }
        None => {}
    }
    (out, d.error)
}

/// The fields of `types.Error`, by their JSON names.
#[derive(Clone, Copy)]
enum ErrorField {
    Code,
    Msg,
    Details,
}

impl ErrorField {
    fn name(self) -> &'static str {
        match self {
            ErrorField::Code => "code",
            ErrorField::Msg => "msg",
            ErrorField::Details => "details",
        }
    }

    /// Go's match of an object key: the exact name, else the same name under Go's case
    /// folding (`foldName`: each rune to the smallest of its fold orbit, so `ſ` is `S`).
    fn of(key: &str) -> Option<ErrorField> {
        let all = [ErrorField::Code, ErrorField::Msg, ErrorField::Details];
        if let Some(f) = all.iter().find(|f| f.name() == key) {
            return Some(*f);
        }
        let fold = |s: &str| -> String {
            s.chars()
                .map(|c| match c {
                    'a'..='z' => c.to_ascii_uppercase(),
                    '\u{17f}' => 'S',
                    '\u{212a}' => 'K',
                    other => other,
                })
                .collect()
        };
        let key = fold(key);
        all.into_iter().find(|f| fold(f.name()) == key)
    }
}

/// A reader over input `check_syntax` has accepted.
struct Decoder<'a> {
    b: &'a [u8],
    i: usize,
    /// The first type error (Go's `savedError`).
    error: Option<GoJsonError>,
}

impl Decoder<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn space(&mut self) {
        while self.peek().is_some_and(is_space) {
            self.i += 1;
        }
    }

    fn save(&mut self, e: GoJsonError) {
        self.error.get_or_insert(e);
    }

    /// The object at the cursor into `out`.
    fn error_fields(&mut self, out: &mut CniErrorFields) {
        self.i += 1;
        loop {
            self.space();
            match self.peek() {
                Some(b'"') => {}
                Some(b'}') => {
                    self.i += 1;
                    return;
                }
                _ => return,
            }
            let key = self.string();
            self.space();
            if self.peek() == Some(b':') {
                self.i += 1;
            }
            self.space();
            match ErrorField::of(&key) {
                Some(ErrorField::Code) => {
                    if let Some(code) = self.uint_field(ErrorField::Code) {
                        out.code = code;
                    }
                }
                Some(f @ (ErrorField::Msg | ErrorField::Details)) => {
                    if let Some(s) = self.string_field(f) {
                        match f {
                            ErrorField::Msg => out.msg = s,
                            _ => out.details = s,
                        }
                    }
                }
                None => self.skip_value(),
            }
            self.space();
            if self.peek() == Some(b',') {
                self.i += 1;
            }
        }
    }

    fn field_error(&mut self, value: impl Into<String>, field: ErrorField, go_type: &'static str) {
        self.save(GoJsonError::Field {
            value: value.into(),
            go_struct: "Error",
            field: field.name(),
            go_type,
        });
    }

    /// The kind of a value that is not a scalar Go can store, skipped; `None` for scalars.
    fn skip_composite(&mut self) -> Option<&'static str> {
        let kind = match self.peek() {
            Some(b'{') => "object",
            Some(b'[') => "array",
            _ => return None,
        };
        self.skip_value();
        Some(kind)
    }

    /// A `uint` field: its value, `None` for `null` or a value Go refuses (the error saved).
    fn uint_field(&mut self, field: ErrorField) -> Option<u64> {
        if let Some(kind) = self.skip_composite() {
            self.field_error(kind, field, "uint");
            return None;
        }
        match self.peek() {
            Some(b'"') => {
                self.string();
                self.field_error("string", field, "uint");
                None
            }
            Some(b't' | b'f') => {
                self.literal();
                self.field_error("bool", field, "uint");
                None
            }
            Some(b'n') => {
                self.literal();
                None
            }
            _ => {
                let number = self.literal();
                // strconv.ParseUint(s, 10, 64): digits only.
                let parsed = match number.bytes().all(|c| c.is_ascii_digit()) {
                    true => number.parse::<u64>().ok(),
                    false => None,
                };
                if parsed.is_none() {
                    self.field_error(format!("number {number}"), field, "uint");
                }
                parsed
            }
        }
    }

    /// A `string` field: its value, `None` for `null` or a value Go refuses (the error saved).
    fn string_field(&mut self, field: ErrorField) -> Option<String> {
        if let Some(kind) = self.skip_composite() {
            self.field_error(kind, field, "string");
            return None;
        }
        match self.peek() {
            Some(b'"') => Some(self.string()),
            Some(b't' | b'f') => {
                self.literal();
                self.field_error("bool", field, "string");
                None
            }
            Some(b'n') => {
                self.literal();
                None
            }
            _ => {
                self.literal();
                self.field_error("number", field, "string");
                None
            }
        }
    }

    /// A number or `true`/`false`/`null` at the cursor, as its text.
    fn literal(&mut self) -> String {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'+' | b'.'))
        {
            self.i += 1;
        }
        String::from_utf8_lossy(&self.b[start..self.i]).into_owned()
    }

    /// Any value at the cursor, passed over.
    fn skip_value(&mut self) {
        match self.peek() {
            Some(b'"') => {
                self.string();
            }
            Some(open @ (b'{' | b'[')) => {
                let close = if open == b'{' { b'}' } else { b']' };
                self.i += 1;
                loop {
                    self.space();
                    match self.peek() {
                        Some(c) if c == close => {
                            self.i += 1;
                            return;
                        }
                        Some(b',' | b':') => self.i += 1,
                        Some(_) => self.skip_value(),
                        None => return,
                    }
                }
            }
            _ => {
                self.literal();
            }
        }
    }

    /// The string at the cursor, unquoted as Go's `unquoteBytes` does.
    fn string(&mut self) -> String {
        self.i += 1;
        let mut out = String::new();
        loop {
            let Some(c) = self.peek() else { return out };
            match c {
                b'"' => {
                    self.i += 1;
                    return out;
                }
                b'\\' => {
                    self.i += 1;
                    let Some(e) = self.peek() else { return out };
                    self.i += 1;
                    match e {
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let first = self.hex4();
                            out.push(self.rune_after(first));
                        }
                        other => out.push(char::from(other)),
                    }
                }
                c if c < 0x80 => {
                    out.push(char::from(c));
                    self.i += 1;
                }
                _ => {
                    // One rune of UTF-8, or U+FFFD for one byte that starts none.
                    let rest = &self.b[self.i..self.b.len().min(self.i + 4)];
                    let valid = match std::str::from_utf8(rest) {
                        Ok(s) => s,
                        Err(e) => std::str::from_utf8(&rest[..e.valid_up_to()]).unwrap_or(""),
                    };
                    match valid.chars().next() {
                        Some(r) => {
                            out.push(r);
                            self.i += r.len_utf8();
                        }
                        None => {
                            out.push('\u{fffd}');
                            self.i += 1;
                        }
                    }
                }
            }
        }
    }

    /// The four hex digits after `\u` (the scanner has checked them).
    fn hex4(&mut self) -> u32 {
        let digits = self.b.get(self.i..self.i + 4).unwrap_or_default();
        self.i += digits.len();
        std::str::from_utf8(digits)
            .ok()
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .unwrap_or(0xfffd)
    }

    /// The rune a `\u` escape of `first` stands for: a surrogate pair takes the `\u` escape
    /// that follows; a surrogate that is not half of a pair is U+FFFD.
    fn rune_after(&mut self, first: u32) -> char {
        if (0xd800..0xe000).contains(&first) {
            if first < 0xdc00 && self.b.get(self.i..self.i + 2) == Some(b"\\u") {
                let save = self.i;
                self.i += 2;
                let second = self.hex4();
                if (0xdc00..0xe000).contains(&second) {
                    let r = 0x10000 + ((first - 0xd800) << 10) + (second - 0xdc00);
                    return char::from_u32(r).unwrap_or('\u{fffd}');
                }
                self.i = save;
            }
            return '\u{fffd}';
        }
        char::from_u32(first).unwrap_or('\u{fffd}')
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

    #[test]
    fn cni_errors_as_go_unmarshals_them() {
        // Each as Go 1.26's json.Unmarshal into libcni's types.Error left it.
        type Case<'a> = (&'a [u8], (u64, &'a str, &'a str), &'a str);
        let cases: &[Case] = &[
            (br#"{"code": "7", "msg": "m", "details": "dd"}"#, (0, "m", "dd"), "json: cannot unmarshal string into Go struct field Error.code of type uint"),
            (br#"{"msg": "only msg"}"#, (0, "only msg", ""), ""),
            (b"null", (0, "", ""), ""),
            (b"[1,2]", (0, "", ""), "json: cannot unmarshal array into Go value of type types.Error"),
            (br#""a string""#, (0, "", ""), "json: cannot unmarshal string into Go value of type types.Error"),
            (b"12", (0, "", ""), "json: cannot unmarshal number into Go value of type types.Error"),
            (b"true", (0, "", ""), "json: cannot unmarshal bool into Go value of type types.Error"),
            (br#"{"code": -1, "msg": {"a":1}}"#, (0, "", ""), "json: cannot unmarshal number -1 into Go struct field Error.code of type uint"),
            (br#"{"code": 5000000000, "MSG": "upper", "detaiLs": "x"}"#, (5000000000, "upper", "x"), ""),
            (br#"{"code": 12, "msg": 5}"#, (12, "", ""), "json: cannot unmarshal number into Go struct field Error.msg of type string"),
            (br#"{"code": 1} trailing"#, (0, "", ""), "invalid character 't' after top-level value"),
            (br#"{"code": 3, "msg": "caf\u00e9 \ud800 <x>", "details": true}"#, (3, "café \u{fffd} <x>", ""), "json: cannot unmarshal bool into Go struct field Error.details of type string"),
            (br#"{"code": 1.5}"#, (0, "", ""), "json: cannot unmarshal number 1.5 into Go struct field Error.code of type uint"),
            (br#"{"code": 18446744073709551616}"#, (0, "", ""), "json: cannot unmarshal number 18446744073709551616 into Go struct field Error.code of type uint"),
            (br#"{"code": 18446744073709551615}"#, (u64::MAX, "", ""), ""),
            (br#"{"code": 1e2}"#, (0, "", ""), "json: cannot unmarshal number 1e2 into Go struct field Error.code of type uint"),
            (br#"{"code": -0}"#, (0, "", ""), "json: cannot unmarshal number -0 into Go struct field Error.code of type uint"),
            ("{\"m\u{17f}g\": \"long s\", \"\\u0063ode\": 4, \"x\": [1, {\"y\": null}], \"details\": null}".as_bytes(), (4, "long s", ""), ""),
            (b"{\"msg\": \"pair \\ud83e\\udd73 lone-low \\udc00 hi-then-x \\ud800\\u0041 bad\xff\xe2\x82 end\", \"code\": null}", (0, "pair \u{1f973} lone-low \u{fffd} hi-then-x \u{fffd}A bad\u{fffd}\u{fffd}\u{fffd} end", ""), ""),
            (br#"{"code": [1], "details": "after", "code": 9}"#, (9, "", "after"), "json: cannot unmarshal array into Go struct field Error.code of type uint"),
            (br#"{"code": 2, "code": false}"#, (2, "", ""), "json: cannot unmarshal bool into Go struct field Error.code of type uint"),
            (b"{}", (0, "", ""), ""),
            (br#" {"code" : 5 , "msg" : "sp" } "#, (5, "sp", ""), ""),
            (br#"{"Code": 6, "CODE": 7, "code": 8}"#, (8, "", ""), ""),
            (b"", (0, "", ""), "unexpected end of JSON input"),
            (b"oops: not json\n", (0, "", ""), "invalid character 'o' looking for beginning of value"),
        ];
        for (input, (code, msg, details), err) in cases {
            let (fields, e) = unmarshal_cni_error(input);
            let shown = String::from_utf8_lossy(input);
            assert_eq!(
                (fields.code, fields.msg.as_str(), fields.details.as_str()),
                (*code, *msg, *details),
                "{shown}"
            );
            assert_eq!(
                e.map(|e| e.to_string()).unwrap_or_default(),
                *err,
                "{shown}"
            );
        }
    }
}
