//! The functions' log lines, and the CloudWatch Logs filter patterns the template's
//! metric filters read them with: [`matches`] evaluates a pattern on a line as
//! CloudWatch does, [`printed`] gives the lines a piece of code prints, formatted as
//! the functions format them (`flexway_aws::log_subscriber`, feature `aws`).

/// Whether the JSON filter pattern `pattern` matches `line`, as far as the template
/// uses the syntax: one `{ }` of comparisons joined by `&&` and `||` (not mixed
/// without parentheses), each a `$.a.b` selector, an operator (`=` `!=` on a quoted
/// string, where `*` matches any text; `=` `!=` `<` `<=` `>` `>=` on a number) and a
/// value. A line that is not a JSON object matches no JSON pattern. Anything else in
/// the pattern fails the test, so that a pattern this cannot read never passes it.
pub fn matches(pattern: &str, line: &str) -> bool {
    let expression = Parser::new(pattern).pattern();
    let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else { return false };
    event.is_object() && expression.holds(&event)
}

#[derive(Debug)]
enum Expression {
    All(Vec<Expression>),
    Any(Vec<Expression>),
    Compare { path: Vec<String>, op: Op, value: Value },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug)]
enum Value {
    Text(String),
    Number(f64),
}

impl Expression {
    fn holds(&self, event: &serde_json::Value) -> bool {
        match self {
            Expression::All(terms) => terms.iter().all(|t| t.holds(event)),
            Expression::Any(terms) => terms.iter().any(|t| t.holds(event)),
            Expression::Compare { path, op, value } => {
                let found = path.iter().try_fold(event, |v, key| v.get(key));
                let Some(found) = found else { return false };
                match value {
                    Value::Text(glob) => {
                        let Some(found) = found.as_str() else { return false };
                        let equal = glob_matches(glob, found);
                        if *op == Op::Eq { equal } else { !equal }
                    }
                    Value::Number(wanted) => {
                        let Some(found) = found.as_f64() else { return false };
                        match op {
                            Op::Eq => found == *wanted,
                            Op::Ne => found != *wanted,
                            Op::Lt => found < *wanted,
                            Op::Le => found <= *wanted,
                            Op::Gt => found > *wanted,
                            Op::Ge => found >= *wanted,
                        }
                    }
                }
            }
        }
    }
}

/// `*` matches any text (none included); every other character itself.
fn glob_matches(glob: &str, text: &str) -> bool {
    let mut parts = glob.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else { return rest.is_empty() };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

struct Parser<'a> {
    pattern: &'a str,
    rest: &'a str,
}

impl<'a> Parser<'a> {
    fn new(pattern: &'a str) -> Self {
        Parser { pattern, rest: pattern }
    }

    fn fail(&self, what: &str) -> ! {
        panic!("filter pattern {:?}: {what} at {:?}", self.pattern, self.rest)
    }

    fn skip_space(&mut self) {
        self.rest = self.rest.trim_start();
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_space();
        match self.rest.strip_prefix(token) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    fn pattern(&mut self) -> Expression {
        if !self.eat("{") {
            self.fail("a JSON pattern starts with {");
        }
        let expression = self.expression();
        if !self.eat("}") {
            self.fail("expected }");
        }
        self.skip_space();
        if !self.rest.is_empty() {
            self.fail("text after the pattern");
        }
        expression
    }

    /// Terms joined by one operator: `&&` and `||` mixed need parentheses.
    fn expression(&mut self) -> Expression {
        let mut terms = vec![self.term()];
        let mut joiner = None;
        loop {
            let next = if self.eat("&&") {
                "&&"
            } else if self.eat("||") {
                "||"
            } else {
                break;
            };
            if joiner.is_some_and(|j| j != next) {
                self.fail("&& and || mixed without parentheses");
            }
            joiner = Some(next);
            terms.push(self.term());
        }
        match joiner {
            None => terms.pop().unwrap_or_else(|| self.fail("an empty expression")),
            Some("&&") => Expression::All(terms),
            Some(_) => Expression::Any(terms),
        }
    }

    fn term(&mut self) -> Expression {
        if self.eat("(") {
            let inner = self.expression();
            if !self.eat(")") {
                self.fail("expected )");
            }
            return inner;
        }
        if !self.eat("$.") {
            self.fail("a $. selector");
        }
        let end =
            self.rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.')).unwrap_or(self.rest.len());
        let path: Vec<String> = self.rest[..end].split('.').map(str::to_owned).collect();
        if path.iter().any(String::is_empty) {
            self.fail("a selector of dotted names");
        }
        self.rest = &self.rest[end..];
        let op = [("<=", Op::Le), (">=", Op::Ge), ("!=", Op::Ne), ("=", Op::Eq), ("<", Op::Lt), (">", Op::Gt)]
            .into_iter()
            .find(|(token, _)| self.eat(token))
            .map(|(_, op)| op)
            .unwrap_or_else(|| self.fail("a comparison operator"));
        self.skip_space();
        let value = if let Some(quoted) = self.rest.strip_prefix('"') {
            let Some(end) = quoted.find('"') else { self.fail("an unterminated string") };
            if quoted[..end].contains('\\') {
                self.fail("an escape in a string");
            }
            self.rest = &quoted[end + 1..];
            if !matches!(op, Op::Eq | Op::Ne) {
                self.fail("a string compared with < or >");
            }
            Value::Text(quoted[..end].to_owned())
        } else {
            let end =
                self.rest.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-')).unwrap_or(self.rest.len());
            let number = self.rest[..end].parse().unwrap_or_else(|_| self.fail("a quoted string or a number"));
            self.rest = &self.rest[end..];
            Value::Number(number)
        };
        Expression::Compare { path, op, value }
    }
}

/// The log lines `run` prints, one JSON object each, formatted by the subscriber the
/// functions' `main` installs (`flexway_aws::log_subscriber`), at its default level.
#[cfg(feature = "aws")]
pub fn printed(run: impl std::future::Future<Output = ()>) -> Vec<String> {
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = flexway_aws::log_subscriber(move || writer.clone());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    tracing::subscriber::with_default(subscriber, || runtime.block_on(run));
    let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    text.lines().map(str::to_owned).collect()
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn reads_the_patterns_the_template_writes() {
        let line = r#"{"level":"ERROR","fields":{"message":"swept expired reservations","charged":2}}"#;
        assert!(matches(r#"{ $.level = "ERROR" }"#, line));
        assert!(!matches(r#"{ $.level = "INFO" }"#, line));
        assert!(matches(r#"{ $.fields.message = "swept*" && $.fields.charged > 0 }"#, line));
        assert!(!matches(r#"{ $.fields.message = "swept*" && $.fields.charged > 2 }"#, line));
        assert!(matches(r#"{ $.fields.message = "nothing" || $.fields.charged >= 2 }"#, line));
        assert!(matches(r#"{ ($.level = "WARN" || $.level = "ERROR") && $.fields.message = "*expired*" }"#, line));
        assert!(!matches(r#"{ $.fields.missing = "*" }"#, line), "an absent field matches nothing");
        assert!(!matches(r#"{ $.level = "ERROR" }"#, "ERROR not JSON"));
        assert!(matches(r#"{ $.fields.message != "swept" }"#, line));
    }

    #[test]
    #[should_panic(expected = "mixed without parentheses")]
    fn refuses_what_it_cannot_read() {
        matches(r#"{ $.a = "x" && $.b = "y" || $.c = "z" }"#, "{}");
    }
}
