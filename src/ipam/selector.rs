//! Calico label selectors (`libcalico-go/lib/selector`), as IP pools use them in
//! `nodeSelector` and `namespaceSelector`.
//!
//! Grammar, loosest binding first:
//! ```text
//! or    := and ( "||" and )*
//! and   := op ( "&&" op )*
//! op    := "!"* ( "all()" | "global()" | "has(" key ")" | "(" or ")"
//!              | key ( "==" | "!=" | "contains" | "starts with" | "ends with" ) string
//!              | key ( "in" | "not in" ) "{" [ string ( "," string )* [","] ] "}" )
//! ```
//! Strings are single- or double-quoted with no escapes; keys are `[a-zA-Z0-9_./-]+`;
//! whitespace is spaces and tabs. An empty selector matches everything. A missing label
//! makes `==`, `in`, `contains`, `starts with`, `ends with` false and `!=`, `not in` true.

use std::collections::BTreeMap;

/// A selector that fails to parse; the message is upstream's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SelectorError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, SelectorError> {
    Err(SelectorError(msg.into()))
}

/// A parsed selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    All,
    Global,
    Has(String),
    Eq(String, String),
    Ne(String, String),
    Contains(String, String),
    StartsWith(String, String),
    EndsWith(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Not(Box<Selector>),
    And(Vec<Selector>),
    Or(Vec<Selector>),
}

impl Selector {
    /// Evaluates the selector against a label set.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let get = |k: &str| labels.get(k).map(String::as_str);
        match self {
            Selector::All | Selector::Global => true,
            Selector::Has(k) => labels.contains_key(k),
            Selector::Eq(k, v) => get(k) == Some(v.as_str()),
            Selector::Ne(k, v) => get(k) != Some(v.as_str()),
            Selector::Contains(k, v) => get(k).is_some_and(|x| x.contains(v.as_str())),
            Selector::StartsWith(k, v) => get(k).is_some_and(|x| x.starts_with(v.as_str())),
            Selector::EndsWith(k, v) => get(k).is_some_and(|x| x.ends_with(v.as_str())),
            Selector::In(k, set) => get(k).is_some_and(|x| set.iter().any(|s| s == x)),
            Selector::NotIn(k, set) => !get(k).is_some_and(|x| set.iter().any(|s| s == x)),
            Selector::Not(s) => !s.matches(labels),
            Selector::And(ops) => ops.iter().all(|s| s.matches(labels)),
            Selector::Or(ops) => ops.iter().any(|s| s.matches(labels)),
        }
    }
}

/// Parses a selector; the empty (or all-whitespace) string is `all()`.
pub fn parse(s: &str) -> Result<Selector, SelectorError> {
    let tokens = tokenize(s)?;
    if tokens.first() == Some(&Tok::Eof) {
        return Ok(Selector::All);
    }
    let mut p = Parser {
        toks: &tokens,
        pos: 0,
    };
    let sel = p.or()?;
    if p.peek() != &Tok::Eof {
        return err(format!(
            "unexpected content at end of selector {:?}",
            &tokens[p.pos..]
        ));
    }
    Ok(sel)
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Label(String),
    Str(String),
    LBrace,
    RBrace,
    Comma,
    Eq,
    Ne,
    In,
    Not,
    NotIn,
    Contains,
    StartsWith,
    EndsWith,
    All,
    Has(String),
    LParen,
    RParen,
    And,
    Or,
    Global,
    Eof,
}

fn is_key_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'/' | b'-')
}

/// The longest label key at the start of `s` (upstream's `findIdentifier`, which only
/// accepts a key that is followed by something).
fn identifier(s: &str) -> &str {
    match s.bytes().position(|c| !is_key_char(c)) {
        Some(i) => &s[..i],
        None => "",
    }
}

fn trim_ws(s: &str) -> &str {
    s.trim_start_matches([' ', '\t'])
}

/// Upstream's tokenizer, including its context rule: right after a label only an operator
/// word (`in`, `not in`, `contains`, `starts with`, `ends with`) is accepted.
fn tokenize(input: &str) -> Result<Vec<Tok>, SelectorError> {
    let mut toks: Vec<Tok> = Vec::new();
    let mut s = input;
    loop {
        s = trim_ws(s);
        let Some(&c) = s.as_bytes().first() else {
            toks.push(Tok::Eof);
            return Ok(toks);
        };
        let after_label = matches!(toks.last(), Some(Tok::Label(_)));
        let next = |t: Tok, n: usize, toks: &mut Vec<Tok>| {
            toks.push(t);
            n
        };
        let consumed = match c {
            b'(' => next(Tok::LParen, 1, &mut toks),
            b')' => next(Tok::RParen, 1, &mut toks),
            b'{' => next(Tok::LBrace, 1, &mut toks),
            b'}' => next(Tok::RBrace, 1, &mut toks),
            b',' => next(Tok::Comma, 1, &mut toks),
            b'"' | b'\'' => {
                let quote = c as char;
                let Some(end) = s[1..].find(quote) else {
                    return err("unterminated string");
                };
                next(Tok::Str(s[1..1 + end].to_string()), end + 2, &mut toks)
            }
            b'=' if s.as_bytes().get(1) == Some(&b'=') => next(Tok::Eq, 2, &mut toks),
            b'=' => return err("expected =="),
            b'!' if s.as_bytes().get(1) == Some(&b'=') => next(Tok::Ne, 2, &mut toks),
            b'!' => next(Tok::Not, 1, &mut toks),
            b'&' if s.as_bytes().get(1) == Some(&b'&') => next(Tok::And, 2, &mut toks),
            b'&' => return err("expected &&"),
            b'|' if s.as_bytes().get(1) == Some(&b'|') => next(Tok::Or, 2, &mut toks),
            b'|' => return err("expected ||"),
            _ if after_label => {
                let label = match toks.last() {
                    Some(Tok::Label(l)) => l.clone(),
                    _ => String::new(),
                };
                let (tok, rest) = operator_after_label(s, &label)?;
                toks.push(tok);
                s.len() - rest.len()
            }
            _ => {
                let (tok, rest) = term(s)?;
                toks.push(tok);
                s.len() - rest.len()
            }
        };
        s = &s[consumed..];
    }
}

/// The word operator that follows `label` at the start of `s`, and the input after it.
fn operator_after_label<'s>(s: &'s str, label: &str) -> Result<(Tok, &'s str), SelectorError> {
    let bad = || {
        err(format!(
            "unexpected characters after label '{label}', was expecting an operator"
        ))
    };
    // `first` then (after spaces) `second`, as in `starts with`.
    let two = |first: &str, second: &str, tok: Tok| match s.strip_prefix(first) {
        Some(r) => match trim_ws(r).strip_prefix(second) {
            Some(r) => Some(Ok((tok, r))),
            None => Some(bad()),
        },
        None => None,
    };
    if let Some(r) = s.strip_prefix("contains") {
        return Ok((Tok::Contains, r));
    }
    for (first, second, tok) in [
        ("starts", "with", Tok::StartsWith),
        ("ends", "with", Tok::EndsWith),
        ("not", "in", Tok::NotIn),
    ] {
        if let Some(found) = two(first, second, tok) {
            return found;
        }
    }
    match s.strip_prefix("in") {
        Some(r) => Ok((Tok::In, r)),
        None => bad(),
    }
}

/// A term that is not an operator: `has(label)`, `all()`, `global()` or a label; and the
/// input after it.
fn term(s: &str) -> Result<(Tok, &str), SelectorError> {
    if let Some(r) = s.strip_prefix("has(") {
        let r = trim_ws(r);
        let ident = identifier(r);
        if ident.is_empty() {
            return err("no label name in has( expression");
        }
        let Some(r) = trim_ws(&r[ident.len()..]).strip_prefix(')') else {
            return err("no closing ')' after has(");
        };
        return Ok((Tok::Has(ident.to_string()), r));
    }
    for (open, tok, unclosed) in [
        ("all(", Tok::All, "no closing ')' after all("),
        ("global(", Tok::Global, "no closing ')' after global("),
    ] {
        if let Some(r) = s.strip_prefix(open) {
            let Some(r) = trim_ws(r).strip_prefix(')') else {
                return err(unclosed);
            };
            return Ok((tok, r));
        }
    }
    let ident = identifier(s);
    if ident.is_empty() {
        return err("unexpected characters");
    }
    Ok((Tok::Label(ident.to_string()), &s[ident.len()..]))
}

struct Parser<'a> {
    toks: &'a [Tok],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> &Tok {
        // The token list always ends with Eof and the parser never moves past it.
        self.toks.get(self.pos).unwrap_or(&Tok::Eof)
    }

    fn bump(&mut self) -> Tok {
        let t = self.peek().clone();
        if self.pos < self.toks.len() {
            self.pos += 1;
        }
        t
    }

    fn or(&mut self) -> Result<Selector, SelectorError> {
        let mut ops = vec![self.and()?];
        while self.peek() == &Tok::Or {
            self.bump();
            ops.push(self.and()?);
        }
        Ok(if ops.len() == 1 {
            ops.remove(0)
        } else {
            Selector::Or(ops)
        })
    }

    fn and(&mut self) -> Result<Selector, SelectorError> {
        let mut ops = vec![self.operation()?];
        while self.peek() == &Tok::And {
            self.bump();
            ops.push(self.operation()?);
        }
        Ok(if ops.len() == 1 {
            ops.remove(0)
        } else {
            Selector::And(ops)
        })
    }

    fn string(&mut self) -> Result<String, SelectorError> {
        match self.bump() {
            Tok::Str(v) => Ok(v),
            _ => err("expected string"),
        }
    }

    fn operation(&mut self) -> Result<Selector, SelectorError> {
        // Any run of leading "!" collapses to one negation (or none).
        let mut negated = false;
        while self.peek() == &Tok::Not {
            self.bump();
            negated = !negated;
        }
        let sel = match self.bump() {
            Tok::Has(k) => Selector::Has(k),
            Tok::All => Selector::All,
            Tok::Global => Selector::Global,
            Tok::Label(k) => match self.bump() {
                Tok::Eq => Selector::Eq(k, self.string()?),
                Tok::Ne => Selector::Ne(k, self.string()?),
                Tok::Contains => Selector::Contains(k, self.string()?),
                Tok::StartsWith => Selector::StartsWith(k, self.string()?),
                Tok::EndsWith => Selector::EndsWith(k, self.string()?),
                op @ (Tok::In | Tok::NotIn) => {
                    if self.bump() != Tok::LBrace {
                        return err("expected set literal");
                    }
                    let mut values = Vec::new();
                    while let Tok::Str(v) = self.peek() {
                        values.push(v.clone());
                        self.bump();
                        if self.peek() == &Tok::Comma {
                            self.bump();
                        } else {
                            break;
                        }
                    }
                    if self.bump() != Tok::RBrace {
                        return err("expected }");
                    }
                    values.sort();
                    values.dedup();
                    if op == Tok::In {
                        Selector::In(k, values)
                    } else {
                        Selector::NotIn(k, values)
                    }
                }
                Tok::Eof => return err("unexpected end of string looking for op"),
                other => return err(format!("expected == or != not: {other:?}")),
            },
            Tok::LParen => {
                let inner = self.or()?;
                if self.bump() != Tok::RParen {
                    return err("expected )");
                }
                inner
            }
            other => return err(format!("unexpected token: {other:?}")),
        };
        Ok(if negated {
            Selector::Not(Box::new(sel))
        } else {
            sel
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn m(sel: &str, l: &[(&str, &str)]) -> bool {
        parse(sel)
            .unwrap_or_else(|e| panic!("{sel}: {e}"))
            .matches(&labels(l))
    }

    #[test]
    fn all_and_empty() {
        assert_eq!(parse("").unwrap(), Selector::All);
        assert_eq!(parse("  \t ").unwrap(), Selector::All);
        assert!(m("all()", &[]));
        assert!(m("all( )", &[("a", "b")]));
        assert!(m("global()", &[]));
        assert!(!m("!all()", &[]));
    }

    #[test]
    fn equality() {
        let l = [("zone", "us-east"), ("kubernetes.io/os", "linux")];
        assert!(m("zone == 'us-east'", &l));
        assert!(m(r#"zone=="us-east""#, &l));
        assert!(m("kubernetes.io/os == 'linux'", &l));
        assert!(!m("zone == 'us-west'", &l));
        assert!(!m("missing == ''", &l));
        assert!(m("zone != 'us-west'", &l));
        assert!(!m("zone != 'us-east'", &l));
        assert!(m("missing != 'x'", &l), "!= matches an absent label");
        assert!(m("missing != ''", &l));
        assert!(m(r#"q == 'say "hi"'"#, &[("q", r#"say "hi""#)]));
    }

    #[test]
    fn has() {
        let l = [("rack", "r1")];
        assert!(m("has(rack)", &l));
        assert!(m("has( rack )", &l));
        assert!(!m("has(zone)", &l));
        assert!(m("!has(zone)", &l));
        assert!(!m("!has(rack)", &l));
        assert!(m("!!has(rack)", &l));
    }

    #[test]
    fn set_membership() {
        let l = [("zone", "b")];
        assert!(m("zone in {'a','b'}", &l));
        assert!(m(r#"zone in { "a" , "b" }"#, &l));
        assert!(!m("zone in {'a','c'}", &l));
        assert!(!m("zone in {}", &l));
        assert!(m("zone in {'b',}", &l));
        assert!(!m("other in {'b'}", &l));
        assert!(m("zone not in {'a','c'}", &l));
        assert!(!m("zone not in {'b'}", &l));
        assert!(
            m("other not in {'b'}", &l),
            "not in matches an absent label"
        );
        assert!(m("zone notin {'a'}", &l));
    }

    #[test]
    fn string_operators() {
        let l = [("name", "node-17.example")];
        assert!(m("name contains '17'", &l));
        assert!(m("name starts with 'node-'", &l));
        assert!(m("name ends with '.example'", &l));
        assert!(!m("name ends with 'node'", &l));
        assert!(!m("other contains ''", &l));
    }

    #[test]
    fn boolean_operators_and_precedence() {
        let l = [("a", "1"), ("b", "2")];
        assert!(m("a == '1' && b == '2'", &l));
        assert!(!m("a == '1' && b == '3'", &l));
        assert!(m("a == '0' || b == '2'", &l));
        assert!(!m("a == '0' || b == '0'", &l));
        // || binds loosest: true || (false && false) = true.
        assert!(m("a == '1' || a == '0' && b == '0'", &l));
        // Parentheses regroup: (true || false) && false = false.
        assert!(!m("(a == '1' || a == '0') && b == '0'", &l));
        // ! applies to the next operation only: (!false) && true.
        assert!(m("!a == '0' && b == '2'", &l));
        assert!(!m("!(a == '1' && b == '2')", &l));
        assert!(m("!(a == '1' && b == '0') || has(c)", &l));
        assert_eq!(
            parse("a == 'x' || b == 'y' && c == 'z'").unwrap(),
            Selector::Or(vec![
                Selector::Eq("a".into(), "x".into()),
                Selector::And(vec![
                    Selector::Eq("b".into(), "y".into()),
                    Selector::Eq("c".into(), "z".into()),
                ]),
            ])
        );
        assert!(m(
            "((has(a)))&&(b in {'2'}||!has(b))",
            &[("a", ""), ("b", "2")]
        ));
    }

    #[test]
    fn errors() {
        let cases = [
            ("a == 'x", "unterminated string"),
            ("a = 'x'", "expected =="),
            ("a == 'x' & b == 'y'", "expected &&"),
            ("a == 'x' | b == 'y'", "expected ||"),
            (
                "a b",
                "unexpected characters after label 'a', was expecting an operator",
            ),
            ("a == b ", "expected string"),
            ("a in 'x'", "expected set literal"),
            ("a in {'x' 'y'}", "expected }"),
            ("(a == 'x'", "expected )"),
            ("has()", "no label name in has( expression"),
            ("has(a b)", "no closing ')' after has("),
            // Upstream's key scanner needs a character after the key, so a key that ends
            // the input is not recognised at all.
            ("has(a", "no label name in has( expression"),
            ("a", "unexpected characters"),
            ("all(x)", "no closing ')' after all("),
            ("a ", "unexpected end of string looking for op"),
            ("#", "unexpected characters"),
        ];
        for (sel, want) in cases {
            assert_eq!(parse(sel).unwrap_err().to_string(), want, "{sel}");
        }
        assert!(parse("a == 'x' b == 'y'").is_err());
        assert!(parse("a == 'x')").is_err());
        assert!(parse("&& a == 'x'").is_err());
        assert!(parse("a == 'x' ||").is_err());
        assert!(parse("!").is_err());
    }
}
