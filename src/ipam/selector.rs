//! A subset of Calico's label selector language, enough for IP pool `nodeSelector` and
//! `namespaceSelector`: `all()`, `k == 'v'`, `k != "v"`, `has(k)`, `k in {'a','b'}`,
//! `k not in {...}`, `!`, `&&`, `||` and parentheses (`||` binds loosest, then `&&`, then `!`).
//! An empty selector matches everything.

use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid selector {selector:?}: {why}")]
pub struct SelectorError {
    pub selector: String,
    pub why: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    All,
    Has(String),
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Not(Box<Selector>),
    And(Box<Selector>, Box<Selector>),
    Or(Box<Selector>, Box<Selector>),
}

impl Selector {
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Selector::All => true,
            Selector::Has(k) => labels.contains_key(k),
            Selector::Eq(k, v) => labels.get(k) == Some(v),
            Selector::Ne(k, v) => labels.get(k) != Some(v),
            Selector::In(k, vs) => labels.get(k).is_some_and(|x| vs.contains(x)),
            Selector::NotIn(k, vs) => !labels.get(k).is_some_and(|x| vs.contains(x)),
            Selector::Not(s) => !s.matches(labels),
            Selector::And(a, b) => a.matches(labels) && b.matches(labels),
            Selector::Or(a, b) => a.matches(labels) || b.matches(labels),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Str(String),
    EqEq,
    Ne,
    Not,
    And,
    Or,
    LParen,
    RParen,
    LBrace,
    RBrace,
    Comma,
}

fn lex(s: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            ' ' | '\t' | '\n' | '\r' => i += 1,
            '(' => {
                out.push(Tok::LParen);
                i += 1
            }
            ')' => {
                out.push(Tok::RParen);
                i += 1
            }
            '{' => {
                out.push(Tok::LBrace);
                i += 1
            }
            '}' => {
                out.push(Tok::RBrace);
                i += 1
            }
            ',' => {
                out.push(Tok::Comma);
                i += 1
            }
            '=' if next == Some('=') => {
                out.push(Tok::EqEq);
                i += 2
            }
            '!' if next == Some('=') => {
                out.push(Tok::Ne);
                i += 2
            }
            '!' => {
                out.push(Tok::Not);
                i += 1
            }
            '&' if next == Some('&') => {
                out.push(Tok::And);
                i += 2
            }
            '|' if next == Some('|') => {
                out.push(Tok::Or);
                i += 2
            }
            '\'' | '"' => {
                let end = chars[i + 1..]
                    .iter()
                    .position(|x| *x == c)
                    .ok_or("unterminated string")?;
                out.push(Tok::Str(chars[i + 1..i + 1 + end].iter().collect()));
                i += end + 2;
            }
            c if c.is_alphanumeric() || "_./-".contains(c) => {
                let start = i;
                while i < chars.len() && (chars[i].is_alphanumeric() || "_./-".contains(chars[i])) {
                    i += 1;
                }
                out.push(Tok::Ident(chars[start..i].iter().collect()));
            }
            other => return Err(format!("unexpected character {other:?}")),
        }
    }
    Ok(out)
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }
    fn expect(&mut self, t: Tok) -> Result<(), String> {
        match self.next() {
            Some(x) if x == t => Ok(()),
            other => Err(format!("expected {t:?}, found {other:?}")),
        }
    }
    fn or(&mut self) -> Result<Selector, String> {
        let mut left = self.and()?;
        while self.peek() == Some(&Tok::Or) {
            self.pos += 1;
            left = Selector::Or(Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }
    fn and(&mut self) -> Result<Selector, String> {
        let mut left = self.unary()?;
        while self.peek() == Some(&Tok::And) {
            self.pos += 1;
            left = Selector::And(Box::new(left), Box::new(self.unary()?));
        }
        Ok(left)
    }
    fn unary(&mut self) -> Result<Selector, String> {
        match self.peek() {
            Some(Tok::Not) => {
                self.pos += 1;
                Ok(Selector::Not(Box::new(self.unary()?)))
            }
            Some(Tok::LParen) => {
                self.pos += 1;
                let s = self.or()?;
                self.expect(Tok::RParen)?;
                Ok(s)
            }
            _ => self.term(),
        }
    }
    fn string_list(&mut self) -> Result<Vec<String>, String> {
        self.expect(Tok::LBrace)?;
        let mut out = Vec::new();
        loop {
            match self.next() {
                Some(Tok::RBrace) if out.is_empty() => return Ok(out),
                Some(Tok::Str(s)) => out.push(s),
                other => return Err(format!("expected a string, found {other:?}")),
            }
            match self.next() {
                Some(Tok::Comma) => continue,
                Some(Tok::RBrace) => return Ok(out),
                other => return Err(format!("expected , or }}, found {other:?}")),
            }
        }
    }
    fn term(&mut self) -> Result<Selector, String> {
        let Some(Tok::Ident(id)) = self.next() else {
            return Err("expected a label or function".into());
        };
        if id == "all" || id == "has" {
            self.expect(Tok::LParen)?;
            if id == "all" {
                self.expect(Tok::RParen)?;
                return Ok(Selector::All);
            }
            let Some(Tok::Ident(k)) = self.next() else {
                return Err("has() needs a label name".into());
            };
            self.expect(Tok::RParen)?;
            return Ok(Selector::Has(k));
        }
        match self.next() {
            Some(Tok::EqEq) => match self.next() {
                Some(Tok::Str(v)) => Ok(Selector::Eq(id, v)),
                other => Err(format!("expected a string, found {other:?}")),
            },
            Some(Tok::Ne) => match self.next() {
                Some(Tok::Str(v)) => Ok(Selector::Ne(id, v)),
                other => Err(format!("expected a string, found {other:?}")),
            },
            Some(Tok::Ident(w)) if w == "in" => Ok(Selector::In(id, self.string_list()?)),
            Some(Tok::Ident(w)) if w == "not" => match self.next() {
                Some(Tok::Ident(w2)) if w2 == "in" => Ok(Selector::NotIn(id, self.string_list()?)),
                other => Err(format!("expected 'in', found {other:?}")),
            },
            other => Err(format!("expected an operator after {id}, found {other:?}")),
        }
    }
}

pub fn parse(s: &str) -> Result<Selector, SelectorError> {
    let err = |why: String| SelectorError {
        selector: s.to_string(),
        why,
    };
    if s.trim().is_empty() {
        return Ok(Selector::All);
    }
    let toks = lex(s).map_err(err)?;
    let mut p = Parser { toks, pos: 0 };
    let sel = p.or().map_err(err)?;
    if p.pos != p.toks.len() {
        return Err(err("trailing input".into()));
    }
    Ok(sel)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(sel: &str, labels: &[(&str, &str)]) -> bool {
        let l = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        parse(sel).unwrap().matches(&l)
    }

    #[test]
    fn operators() {
        let l = [("zone", "a"), ("kubernetes.io/hostname", "node1")];
        assert!(m("all()", &l) && m("", &l));
        assert!(m("zone == 'a'", &l) && !m("zone == \"b\"", &l));
        assert!(m("zone != 'b'", &l) && m("missing != 'b'", &l));
        assert!(m("has(zone)", &l) && !m("has(rack)", &l) && m("!has(rack)", &l));
        assert!(m("zone in {'a', 'b'}", &l) && !m("zone in {'c'}", &l));
        assert!(m("zone not in {'c'}", &l) && m("rack not in {'c'}", &l));
        assert!(m("zone == 'a' && kubernetes.io/hostname == 'node1'", &l));
        assert!(m("zone == 'x' || has(zone)", &l));
        assert!(!m("!(zone == 'a')", &l));
        // && binds tighter than ||.
        assert!(m("has(zone) || has(x) && has(y)", &l));
        assert!(!m("(has(zone) || has(x)) && has(y)", &l));
        assert!(parse("zone ==").is_err());
        assert!(parse("zone = 'a'").is_err());
    }
}
