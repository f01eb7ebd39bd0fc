//! The serverless stack's parameters a configuration needs (`flexway validate
//! --serverless`), derived from its secret references, and a given set of them checked.
//!
//! The stack (infra/template.yaml) grants the gateway's role
//! `secretsmanager:GetSecretValue` on `SecretsManagerArns` and `ssm:GetParameter` on
//! `SsmParameterArns`, and the reconcile function's role `secretsmanager:GetSecretValue`
//! on `UsageApiSecretArns`: nothing else. An ARN the config references and its list does
//! not cover is AccessDenied when the function starts, so every call answers 502. Typed
//! once (the config) and derived, or checked at build, the two cannot disagree.
//!
//! The stack creates the response cache's table, and grants the gateway's role its use,
//! only with `CacheStore=dynamodb`: what a config whose `ai.cache.store` is `{kind:
//! dynamodb}` needs, and what one without it does not.
//!
//! Only ARN references are the stack's business: `env:` and `file:` ones are the
//! function's environment and package. Coverage is decided as IAM matches a resource:
//! the whole ARN against each pattern, `*` any run of characters, `?` any one.

use std::collections::BTreeMap;
use std::fmt;

use flexway::config::{AuditSinkConfig, CacheStoreConfig, Config, Diagnostic, SecretRef, StoreConfig};

/// The stack parameter that creates the cache table (`none` or `dynamodb`).
const CACHE_STORE: &str = "CacheStore";

/// The stack parameters that list what a role may read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parameter {
    SecretsManager,
    SsmParameters,
    UsageApiSecrets,
}

impl Parameter {
    const ALL: [Parameter; 3] = [Parameter::SecretsManager, Parameter::SsmParameters, Parameter::UsageApiSecrets];

    fn name(self) -> &'static str {
        match self {
            Parameter::SecretsManager => "SecretsManagerArns",
            Parameter::SsmParameters => "SsmParameterArns",
            Parameter::UsageApiSecrets => "UsageApiSecretArns",
        }
    }

    /// Whose role the parameter grants.
    fn role(self) -> &'static str {
        match self {
            Parameter::SecretsManager | Parameter::SsmParameters => "the gateway's role",
            Parameter::UsageApiSecrets => "the reconcile function's role",
        }
    }
}

/// The resource IAM checks a read against: the referenced ARN, or, for a Secrets
/// Manager ARN written without its random suffix (a partial ARN), that ARN followed by
/// `-` and six unknown letters or digits.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Resource {
    arn: String,
    unknown_suffix: bool,
}

impl fmt::Display for Resource {
    /// As a stack parameter lists it: `NAME-??????` for the unknown suffix.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.arn)?;
        if self.unknown_suffix { f.write_str("-??????") } else { Ok(()) }
    }
}

/// One ARN reference of the config and the parameter that must cover it.
#[derive(Debug)]
struct Grant {
    /// Its path in the document (`ai.backends.openai.auth.secret`).
    path: String,
    parameter: Parameter,
    resource: Resource,
}

/// What `flexway validate --serverless` does with the stack parameters.
#[derive(Debug)]
pub enum Mode {
    /// Print the ones the config needs.
    Print,
    /// Check that these cover every ARN reference.
    Check(StackParameters),
}

/// The config reviewed as a serverless one: errors and warnings with their path in
/// the document, and in [`Mode::Print`] the stack parameters it needs.
#[derive(Debug)]
pub struct Review {
    pub errors: Vec<Diagnostic>,
    pub warnings: Vec<Diagnostic>,
    pub overrides: Option<String>,
}

/// `config` as a serverless one, its stack parameters printed or checked per `mode`.
pub fn review(config: &Config, mode: &Mode) -> Review {
    let (grants, mut errors) = needs(config);
    let (warnings, overrides) = match mode {
        Mode::Print => (Vec::new(), Some(grants.overrides())),
        Mode::Check(given) => {
            errors.extend(grants.uncovered(given));
            let mut warnings = grants.unused(given);
            match (grants.cache_table, given.0.get(CACHE_STORE).map(String::as_str)) {
                (true, Some("dynamodb")) | (false, None | Some("none")) => {}
                (true, given) => errors.push(Diagnostic::new(
                    "ai.cache.store",
                    format!(
                        "the cache table is the stack's only with {CACHE_STORE}=dynamodb ({}): the gateway's \
                         role could not reach it, and every lookup would be a miss",
                        given.map_or_else(|| "not among the stack parameters".to_owned(), |v| format!("given {v}"))
                    ),
                )),
                (false, Some(other)) => warnings.push(Diagnostic::new(
                    "",
                    format!(
                        "--stack-parameters: {CACHE_STORE}={other}, and the config keeps no response cache in \
                         the stack's DynamoDB table: {CACHE_STORE}=none"
                    ),
                )),
            }
            (warnings, None)
        }
    };
    Review { errors, warnings, overrides }
}

/// What the stack must grant for a config's ARN references, and whether it must
/// create the cache table.
#[derive(Debug)]
struct Grants {
    arns: Vec<Grant>,
    cache_table: bool,
}

/// The grants every ARN reference of `config` needs, and why it cannot be deployed as
/// a serverless one, if it cannot.
fn needs(config: &Config) -> (Grants, Vec<Diagnostic>) {
    let mut errors = Vec::new();
    if !matches!(config.store, StoreConfig::DynamoDb { .. }) {
        errors.push(Diagnostic::new(
            "store.kind",
            "the serverless shape keeps the ledger in the stack's DynamoDB table: \
             store: {kind: dynamodb, table: <stack>-ledger}",
        ));
    }
    if !matches!(config.audit.sink, AuditSinkConfig::CloudWatch { .. }) {
        errors.push(Diagnostic::new(
            "audit.sink",
            "the serverless shape writes the audit to the stack's log group, where the metrics, alarms and \
             the reconcile function read it: audit: {sink: cloudwatch, log_group: /<stack>/audit}",
        ));
    }
    let gateway = config.secret_references().into_iter().map(|(path, reference)| (path, reference, false));
    let usage = config.usage_api_references().into_iter().map(|(path, reference)| (path, reference, true));
    let mut grants = Vec::new();
    for (path, reference, usage_api) in gateway.chain(usage) {
        let SecretRef::AwsArn(arn) = reference else { continue };
        // Checked at load: arn:PARTITION:SERVICE:REGION:ACCOUNT:RESOURCE.
        let [_, _, service, region, account, resource] = arn.splitn(6, ':').collect::<Vec<_>>()[..] else {
            continue;
        };
        if region.is_empty() || account.is_empty() {
            errors.push(Diagnostic::new(
                path,
                format!("{arn}: name its region and account: the stack's roles are granted whole ARNs"),
            ));
            continue;
        }
        let parameter = match (service, usage_api) {
            ("secretsmanager", false) => Parameter::SecretsManager,
            ("secretsmanager", true) => Parameter::UsageApiSecrets,
            (_, false) => Parameter::SsmParameters,
            (_, true) => {
                errors.push(Diagnostic::new(
                    path,
                    format!(
                        "{arn}: the reconcile function may read Secrets Manager secrets only \
                         (UsageApiSecretArns): keep the admin key in Secrets Manager"
                    ),
                ));
                continue;
            }
        };
        let unknown_suffix = service == "secretsmanager" && resource.strip_prefix("secret:").is_some_and(is_partial);
        let resource = Resource { arn: arn.clone(), unknown_suffix };
        grants.push(Grant { path, parameter, resource });
    }
    let cache_table = config.ai.cache.as_ref().is_some_and(|c| matches!(c.store, CacheStoreConfig::DynamoDb { .. }));
    (Grants { arns: grants, cache_table }, errors)
}

/// A Secrets Manager name without the `-` and six letters or digits the service
/// appends to it in the full ARN. (A secret whose own name ends so cannot be told
/// from a full ARN when referenced partially: AWS advises against such names.)
fn is_partial(name: &str) -> bool {
    let bytes = name.as_bytes();
    let suffixed = bytes.len() > 7
        && bytes[bytes.len() - 7] == b'-'
        && bytes[bytes.len() - 6..].iter().all(u8::is_ascii_alphanumeric);
    !suffixed
}

impl Grants {
    /// The parameters as `sam deploy --parameter-overrides` takes them, every one given
    /// (an empty list as `""`: a parameter left out keeps its previous value), the
    /// ARN lists and then [`CACHE_STORE`].
    fn overrides(&self) -> String {
        let each = Parameter::ALL.map(|parameter| {
            let mut values: Vec<String> = Vec::new();
            for grant in self.arns.iter().filter(|g| g.parameter == parameter) {
                let value = grant.resource.to_string();
                if !values.contains(&value) {
                    values.push(value);
                }
            }
            let list = if values.is_empty() { "\"\"".to_owned() } else { values.join(",") };
            format!("{}={list}", parameter.name())
        });
        let cache = if self.cache_table { "dynamodb" } else { "none" };
        format!("{} {CACHE_STORE}={cache}", each.join(" "))
    }

    /// Each reference `given` does not cover: an error naming its path, the ARN and
    /// the parameter that should list it.
    fn uncovered(&self, given: &StackParameters) -> Vec<Diagnostic> {
        let mut errors = Vec::new();
        for grant in &self.arns {
            let name = grant.parameter.name();
            let patterns = given.list(name);
            if patterns.as_ref().is_some_and(|p| p.iter().any(|pattern| covers(pattern, &grant.resource))) {
                continue;
            }
            let absent = if patterns.is_none() { " (not among the stack parameters)" } else { "" };
            let hint = if grant.resource.unknown_suffix { format!("; list {}", grant.resource) } else { String::new() };
            errors.push(Diagnostic::new(
                grant.path.clone(),
                format!(
                    "{} is not covered by {name}{absent}: {} could not read it{hint}",
                    grant.resource.arn,
                    grant.parameter.role()
                ),
            ));
        }
        errors
    }

    /// Each pattern of `given` that covers no reference: a role allowed more than the
    /// config needs.
    fn unused(&self, given: &StackParameters) -> Vec<Diagnostic> {
        let mut warnings = Vec::new();
        for parameter in Parameter::ALL {
            for pattern in given.list(parameter.name()).unwrap_or_default() {
                let mut grants = self.arns.iter().filter(|g| g.parameter == parameter);
                if !grants.any(|g| covers(&pattern, &g.resource)) {
                    warnings.push(Diagnostic::new(
                        "",
                        format!(
                            "--stack-parameters: {} lists {pattern}, which covers no ARN reference of the \
                             config: {} may read more than it needs",
                            parameter.name(),
                            parameter.role()
                        ),
                    ));
                }
            }
        }
        warnings
    }
}

/// Stack parameters as `sam deploy --parameter-overrides` takes them: `Name=Value`
/// (or `ParameterKey=Name,ParameterValue=Value`) separated by spaces, a value quoted
/// when it is empty or holds a space.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StackParameters(BTreeMap<String, String>);

impl std::str::FromStr for StackParameters {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut parameters = BTreeMap::new();
        for word in words(text)? {
            let (name, value) = match word.strip_prefix("ParameterKey=") {
                Some(rest) => rest
                    .split_once(",ParameterValue=")
                    .ok_or_else(|| format!("`{word}` is not ParameterKey=NAME,ParameterValue=VALUE"))?,
                None => word.split_once('=').ok_or_else(|| format!("`{word}` is not NAME=VALUE"))?,
            };
            if name.is_empty() {
                return Err(format!("`{word}` names no parameter"));
            }
            parameters.insert(name.to_owned(), value.to_owned());
        }
        Ok(StackParameters(parameters))
    }
}

impl StackParameters {
    /// A CommaDelimitedList parameter's entries, if it is given.
    fn list(&self, name: &str) -> Option<Vec<String>> {
        let value = self.0.get(name)?;
        Some(value.split(',').map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned).collect())
    }
}

/// `text` split at spaces outside quotes, the quotes removed, as `sam deploy` reads
/// its `--parameter-overrides`.
fn words(text: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in text.chars() {
        match (quote, c) {
            (Some(open), c) if c == open => quote = None,
            (Some(_), c) => word.get_or_insert_default().push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                word.get_or_insert_default();
            }
            (None, c) if c.is_whitespace() => words.extend(word.take()),
            (None, c) => word.get_or_insert_default().push(c),
        }
    }
    if quote.is_some() {
        return Err("a quote is not closed".to_owned());
    }
    words.extend(word);
    Ok(words)
}

/// Whether the IAM resource pattern `pattern` matches `resource`. An unknown suffix
/// letter is matched by `?`, `*`, or a letter or digit written in its place (a full ARN
/// listed for a partial reference names the same secret).
fn covers(pattern: &str, resource: &Resource) -> bool {
    #[derive(Clone, Copy)]
    enum Symbol {
        Char(char),
        AnyAlphanumeric,
    }
    let mut subject: Vec<Symbol> = resource.arn.chars().map(Symbol::Char).collect();
    if resource.unknown_suffix {
        subject.push(Symbol::Char('-'));
        subject.extend([Symbol::AnyAlphanumeric; 6]);
    }
    let pattern: Vec<char> = pattern.chars().collect();
    let matches = |p: char, s: Symbol| match s {
        Symbol::Char(c) => p == '?' || p == c,
        Symbol::AnyAlphanumeric => p == '?' || p.is_ascii_alphanumeric(),
    };
    // Glob matching with one backtrack point: the last `*` and where it started.
    let (mut p, mut s) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while let Some(&symbol) = subject.get(s) {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, s));
                p += 1;
            }
            Some(&c) if matches(c, symbol) => {
                p += 1;
                s += 1;
            }
            _ => match star {
                Some((star_p, star_s)) => {
                    p = star_p + 1;
                    s = star_s + 1;
                    star = Some((star_p, star_s + 1));
                }
                None => return false,
            },
        }
    }
    pattern.get(p..).is_some_and(|rest| rest.iter().all(|&c| c == '*'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(arn: &str) -> Resource {
        Resource { arn: arn.to_owned(), unknown_suffix: false }
    }

    const SECRET: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:flexway/openai";

    #[test]
    fn wildcards_match_as_iam_does() {
        let resource = full(&format!("{SECRET}-AbCdEf"));
        assert!(covers(&format!("{SECRET}-AbCdEf"), &resource));
        assert!(covers(&format!("{SECRET}-??????"), &resource));
        assert!(covers("arn:aws:secretsmanager:eu-west-1:123456789012:secret:flexway/*", &resource));
        assert!(covers("arn:aws:secretsmanager:*:*:secret:*", &resource));
        assert!(covers("*", &resource));
        assert!(!covers(&format!("{SECRET}-?????"), &resource), "one ? is one character");
        assert!(!covers(&format!("{SECRET}-AbCdEF"), &resource), "ARNs match case-sensitively");
        assert!(!covers(SECRET, &resource), "the name without its suffix is another resource");
        assert!(!covers("arn:aws:ssm:eu-west-1:123456789012:parameter/*", &resource));
    }

    #[test]
    fn a_partial_reference_is_covered_by_its_suffix_pattern_or_a_full_arn() {
        let partial = Resource { arn: SECRET.to_owned(), unknown_suffix: true };
        assert!(covers(&format!("{SECRET}-??????"), &partial));
        assert!(covers(&format!("{SECRET}-AbCdEf"), &partial));
        assert!(covers(&format!("{SECRET}*"), &partial));
        assert!(!covers(SECRET, &partial), "IAM checks the full ARN, suffix included");
        assert!(!covers(&format!("{SECRET}-?????"), &partial));
        assert!(!covers(&format!("{SECRET}-AbC/Ef"), &partial), "a suffix is letters and digits");
    }

    #[test]
    fn a_full_arn_is_told_from_a_partial_one_by_its_suffix() {
        assert!(!is_partial("flexway/openai-AbCdEf"));
        assert!(is_partial("flexway/openai"));
        assert!(is_partial("flexway/openai-key"));
        assert!(is_partial("-AbCdEf"), "a suffix needs a name before it");
    }

    #[test]
    fn parameters_read_as_sam_reads_them() {
        let given: StackParameters =
            "SecretsManagerArns=a,b SsmParameterArns=\"\" ParameterKey=UsageApiSecretArns,ParameterValue=c  Other='x y'"
                .parse()
                .unwrap();
        assert_eq!(given.list("SecretsManagerArns"), Some(vec!["a".to_owned(), "b".to_owned()]));
        assert_eq!(given.list("SsmParameterArns"), Some(vec![]));
        assert_eq!(given.list("UsageApiSecretArns"), Some(vec!["c".to_owned()]));
        assert_eq!(given.0.get("Other").map(String::as_str), Some("x y"));
        assert_eq!(given.list("AlarmTopicArn"), None);
        assert!("SecretsManagerArns".parse::<StackParameters>().is_err());
        assert!("=a".parse::<StackParameters>().is_err());
        assert!("A=\"b".parse::<StackParameters>().is_err());
        assert_eq!("".parse::<StackParameters>(), Ok(StackParameters::default()));
    }
}
