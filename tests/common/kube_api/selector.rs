//! Label and field selectors of list requests, with the grammar of `labelSelector` /
//! `fieldSelector`: requirements joined by `,` (AND); label operators `k=v`, `k==v`, `k!=v`,
//! `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, `k>n`, `k<n`; field operators `=`, `==`, `!=`.

use serde_json::Value;

#[derive(Debug, PartialEq)]
enum Op {
    Eq,
    NotEq,
    In,
    NotIn,
    Exists,
    NotExists,
    Gt,
    Lt,
}

#[derive(Debug)]
pub struct Requirement {
    key: String,
    op: Op,
    values: Vec<String>,
}

/// A label selector: every requirement must hold. Empty selects everything.
#[derive(Debug, Default)]
pub struct LabelSelector(Vec<Requirement>);

/// Characters that end a key or a value.
fn is_special(c: char) -> bool {
    c.is_whitespace() || ",()=!<>".contains(c)
}

struct Lexer<'a> {
    s: &'a str,
    pos: usize,
}

impl Lexer<'_> {
    fn skip_ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }
    fn peek(&self) -> Option<char> {
        self.s[self.pos..].chars().next()
    }
    fn eat(&mut self, t: &str) -> bool {
        self.skip_ws();
        let hit = self.s[self.pos..].starts_with(t);
        if hit {
            self.pos += t.len();
        }
        hit
    }
    /// A key or a value (possibly empty).
    fn word(&mut self) -> String {
        self.skip_ws();
        let start = self.pos;
        while self.peek().is_some_and(|c| !is_special(c)) {
            self.pos += self.peek().unwrap().len_utf8();
        }
        self.s[start..self.pos].to_string()
    }
    fn at_end(&mut self) -> bool {
        self.skip_ws();
        self.pos == self.s.len()
    }
}

/// The value of a `>` / `<` requirement, which must be an integer.
fn integer(v: String) -> Result<String, String> {
    match v.parse::<i64>() {
        Ok(_) => Ok(v),
        Err(_) => Err(format!(
            "unable to parse requirement: for 'Gt', 'Lt' operators, the value must be an integer: {v:?}"
        )),
    }
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<LabelSelector, String> {
        let mut lx = Lexer { s, pos: 0 };
        let mut reqs = Vec::new();
        if lx.at_end() {
            return Ok(LabelSelector(reqs));
        }
        loop {
            let negated = lx.eat("!");
            let key = lx.word();
            if key.is_empty() {
                return Err(format!(
                    "unable to parse requirement: expected a key at {:?}",
                    &s[lx.pos..]
                ));
            }
            let (op, values) = if negated {
                (Op::NotExists, vec![])
            } else if lx.at_end() || lx.s[lx.pos..].starts_with(',') {
                (Op::Exists, vec![])
            } else if lx.eat("==") || lx.eat("=") {
                (Op::Eq, vec![lx.word()])
            } else if lx.eat("!=") {
                (Op::NotEq, vec![lx.word()])
            } else if lx.eat(">") {
                (Op::Gt, vec![integer(lx.word())?])
            } else if lx.eat("<") {
                (Op::Lt, vec![integer(lx.word())?])
            } else {
                let op = match lx.word().as_str() {
                    "in" => Op::In,
                    "notin" => Op::NotIn,
                    other => return Err(format!("unable to parse requirement: found '{other}', expected: in, notin, =, ==, !=, gt, lt")),
                };
                if !lx.eat("(") {
                    return Err("unable to parse requirement: expected: '('".to_string());
                }
                let mut values = vec![lx.word()];
                while lx.eat(",") {
                    values.push(lx.word());
                }
                if !lx.eat(")") {
                    return Err("unable to parse requirement: expected: ')'".to_string());
                }
                (op, values)
            };
            reqs.push(Requirement { key, op, values });
            if lx.at_end() {
                return Ok(LabelSelector(reqs));
            }
            if !lx.eat(",") {
                return Err(format!(
                    "unable to parse requirement: expected ',' at {:?}",
                    &s[lx.pos..]
                ));
            }
        }
    }

    /// Whether `labels` (the object's `metadata.labels`, absent = none) satisfies the selector.
    pub fn matches(&self, labels: Option<&Value>) -> bool {
        self.0.iter().all(|r| {
            let v = labels.and_then(|l| l.get(&r.key)).and_then(Value::as_str);
            let in_set = v.is_some_and(|v| r.values.iter().any(|x| x == v));
            let num = |v: &str| v.parse::<i64>().ok();
            match r.op {
                Op::Eq | Op::In => in_set,
                Op::NotEq | Op::NotIn => !in_set,
                Op::Exists => v.is_some(),
                Op::NotExists => v.is_none(),
                Op::Gt => v
                    .and_then(num)
                    .is_some_and(|n| n > num(&r.values[0]).unwrap()),
                Op::Lt => v
                    .and_then(num)
                    .is_some_and(|n| n < num(&r.values[0]).unwrap()),
            }
        })
    }
}

/// A field selector: `path=value`, `path==value` or `path!=value`, AND-ed.
#[derive(Debug, Default)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// `supported`: the field paths the resource can be selected by (the real server
    /// refuses any other with "field label not supported").
    pub fn parse(s: &str, supported: &[&str]) -> Result<FieldSelector, String> {
        let mut reqs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, eq, value) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                (k, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{s}'; can't understand '{part}'"
                ));
            };
            let key = key.trim();
            if !supported.contains(&key) {
                return Err(format!("field label not supported: {key}"));
            }
            reqs.push((key.to_string(), eq, value.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, eq, want)| {
            let got = path.split('.').try_fold(obj, |v, k| v.get(k));
            let got = match got {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            (got == *want) == *eq
        })
    }
}
