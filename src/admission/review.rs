//! The AdmissionReview wire format (`admission.k8s.io/v1`): only the fields initium reads, and
//! the response shapes the API server accepts.
//!
//! Our own small types rather than kube's `AdmissionReview<DynamicObject>`: the request is read
//! straight into what the engine needs (the object stays a `serde_json::Value`), and every
//! field we do not use (`oldObject`, `userInfo`, `options`) is skipped without allocating.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use initium_engine::api::Operation;
use initium_engine::untrusted::quote;

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

/// Kubernetes drops a warning that contains a control character, and once the warnings of one
/// response pass 4096 characters it cuts every warning to 256 characters and drops the rest
/// (k8s.io/apiserver `filters/warning.go`). initium keeps each warning within 256 characters
/// and all of them within 4096, so what the client sees is what initium wrote.
pub const WARNING_MAX_CHARS: usize = 256;
const WARNINGS_MAX_TOTAL_CHARS: usize = 4096;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    request: Option<AdmissionRequest>,
}

/// The namespace a review is for (`""` for a cluster-scoped object, or a body that is not a
/// review), read without keeping the object: what decides whose queue a review waits in
/// ([`super::fair`]) before it is parsed on the blocking pool.
pub(super) fn namespace_of(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Outer {
        request: Option<Inner>,
    }
    #[derive(Deserialize)]
    struct Inner {
        #[serde(default)]
        namespace: Option<String>,
    }
    serde_json::from_slice::<Outer>(body)
        .ok()
        .and_then(|o| o.request)
        .and_then(|r| r.namespace)
        .unwrap_or_default()
}

/// `request` of an AdmissionReview.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    pub uid: String,
    /// The kind of `object` (after any conversion to the version the webhook asked for).
    pub kind: GroupVersionKind,
    #[serde(default)]
    pub resource: GroupVersionResource,
    #[serde(default)]
    pub sub_resource: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
    pub operation: String,
    /// `null` or absent for DELETE and CONNECT.
    #[serde(default)]
    pub object: Option<Value>,
    #[serde(default)]
    pub dry_run: Option<bool>,
    /// Of `oldObject` (UPDATE), only what the engine needs: which rules had changed the
    /// stored object. The rest of it is skipped while parsing, not kept.
    #[serde(default)]
    pub old_object: Option<OldObject>,
}

/// The part of `request.oldObject` the mutating webhook reads.
#[derive(Debug, Default, Deserialize)]
pub struct OldObject {
    #[serde(default)]
    metadata: Option<OldMetadata>,
    /// A controller's Pod template, for rules with `spec.autogen` (other kinds' `spec` is
    /// skipped while parsing).
    #[serde(default)]
    spec: Option<OldSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct OldSpec {
    #[serde(default)]
    template: Option<Value>,
    #[serde(default)]
    job_template: Option<OldJobTemplate>,
}

#[derive(Debug, Default, Deserialize)]
struct OldJobTemplate {
    #[serde(default)]
    spec: Option<OldJobSpec>,
}

#[derive(Debug, Default, Deserialize)]
struct OldJobSpec {
    #[serde(default)]
    template: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct OldMetadata {
    #[serde(default)]
    annotations: Option<OldAnnotations>,
}

#[derive(Debug, Default, Deserialize)]
struct OldAnnotations {
    #[serde(rename = "initium.dev/mutated-by", default)]
    mutated_by: Option<String>,
}

impl OldObject {
    /// The stored object's `initium.dev/mutated-by`.
    pub fn mutated_by(&self) -> Option<&str> {
        self.metadata
            .as_ref()?
            .annotations
            .as_ref()?
            .mutated_by
            .as_deref()
    }

    /// The stored object's Pod template (`spec.template`, or a CronJob's
    /// `spec.jobTemplate.spec.template`).
    pub fn template(&self) -> Option<&Value> {
        let spec = self.spec.as_ref()?;
        spec.template
            .as_ref()
            .or_else(|| spec.job_template.as_ref()?.spec.as_ref()?.template.as_ref())
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct GroupVersionKind {
    #[serde(default)]
    pub group: String,
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub kind: String,
}

/// Only the resource name is used (for logs: `pods` with subresource `status`).
#[derive(Debug, Default, Deserialize)]
pub struct GroupVersionResource {
    #[serde(default)]
    pub resource: String,
}

impl AdmissionRequest {
    /// CREATE or UPDATE; `None` for DELETE and CONNECT, which initium never changes.
    pub fn operation(&self) -> Option<Operation> {
        match self.operation.as_str() {
            "CREATE" => Some(Operation::Create),
            "UPDATE" => Some(Operation::Update),
            _ => None,
        }
    }

    /// `pods/status`, `deployments/scale`, ...: requests that change a part of an object the
    /// rules do not see.
    pub fn subresource(&self) -> Option<&str> {
        self.sub_resource.as_deref().filter(|s| !s.is_empty())
    }

    /// The request's namespace; `None` for cluster-scoped objects.
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref().filter(|s| !s.is_empty())
    }

    /// The request's name; `None` on a CREATE whose object only has `generateName`.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref().filter(|s| !s.is_empty())
    }

    pub fn is_dry_run(&self) -> bool {
        self.dry_run.unwrap_or(false)
    }

    /// `metadata.generateName` of the object: what the API server will name it after, on a
    /// CREATE that has no name yet.
    pub fn generate_name(&self) -> Option<&str> {
        self.object
            .as_ref()
            .and_then(|o| o.pointer("/metadata/generateName"))
            .and_then(Value::as_str)
            .filter(|g| !g.is_empty())
    }
}

/// `group/version/Kind`, or `version/Kind` for the core group: `v1/Pod`, `apps/v1/Deployment`.
impl std::fmt::Display for GroupVersionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.group.is_empty() {
            write!(f, "{}/", self.group)?;
        }
        write!(f, "{}/{}", self.version, self.kind)
    }
}

/// Reads an AdmissionReview; the error is one line that says what is wrong with the body.
pub fn parse(body: &[u8]) -> Result<AdmissionRequest, String> {
    let review: ReviewIn = match serde_json::from_slice(body) {
        Ok(review) => review,
        // Bad bodies are rare: only then pay for a second pass that tracks the field path.
        Err(_) => return Err(describe_parse_error(body)),
    };
    if review.api_version != API_VERSION || review.kind != KIND {
        return Err(format!(
            "expected an {KIND} of apiVersion {API_VERSION}, found kind {:?} of apiVersion {:?}",
            review.kind, review.api_version
        ));
    }
    review
        .request
        .ok_or_else(|| format!("the {KIND} has no request"))
}

/// `request.uid` alone, skipping everything else without building it.
pub fn uid(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Review {
        request: Option<Request>,
    }
    #[derive(Deserialize)]
    struct Request {
        uid: String,
    }
    serde_json::from_slice::<Review>(body)
        .ok()?
        .request
        .map(|r| r.uid)
}

/// `request.oldObject.spec` of an UPDATE, read on its own: only the validating webhook needs
/// it, and the mutating webhook should not pay for parsing the old object of every update.
pub fn old_spec(body: &[u8]) -> Option<Value> {
    #[derive(Deserialize)]
    struct Review {
        request: Option<Request>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Request {
        #[serde(default)]
        old_object: Option<Old>,
    }
    #[derive(Deserialize)]
    struct Old {
        #[serde(default)]
        spec: Option<Value>,
    }
    serde_json::from_slice::<Review>(body)
        .ok()?
        .request?
        .old_object?
        .spec
}

fn describe_parse_error(body: &[u8]) -> String {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, ReviewIn>(&mut deserializer) {
        // The path names the body's own keys and the parser's message may quote its values:
        // both are the client's text, escaped and cut so the reason stays one short line.
        Err(e) if e.path().to_string() != "." => format!(
            "not an {KIND}: {}: {}",
            quote(&e.path().to_string()),
            quote(&e.inner().to_string())
        ),
        Err(e) => format!("not an {KIND}: {}", quote(&e.inner().to_string())),
        // Only reached if the two passes disagree, e.g. trailing data after the document.
        Ok(_) => match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Err(e) => format!("malformed JSON: {e}"),
            Ok(_) => format!("not an {KIND}"),
        },
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ReviewOut<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: &'a AdmissionResponse,
}

/// `response` of an AdmissionReview.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    pub uid: String,
    pub allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<&'static str>,
    /// Base64 of the RFC 6902 patch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// The `metav1.Status` of a rejection. The API server prefixes `message` with
/// `admission webhook "<name>" denied the request: ` and kubectl prints it after
/// `Error from server (<reason>): `.
#[derive(Debug, Serialize)]
pub struct Status {
    pub status: &'static str,
    pub message: String,
    pub reason: &'static str,
    pub code: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<StatusDetails>,
}

/// For `reason: Invalid`, kubectl prints `The <kind> "<name>" is invalid:` and then one line
/// per cause, `<field>: <message>`.
#[derive(Debug, Serialize)]
pub struct StatusDetails {
    pub name: String,
    pub group: String,
    pub kind: String,
    pub causes: Vec<StatusCause>,
}

#[derive(Debug, Serialize)]
pub struct StatusCause {
    pub reason: &'static str,
    pub message: String,
    pub field: String,
}

impl AdmissionResponse {
    /// Allowed, unchanged.
    pub fn allow(uid: &str) -> AdmissionResponse {
        AdmissionResponse {
            uid: uid.to_string(),
            allowed: true,
            patch_type: None,
            patch: None,
            status: None,
            warnings: Vec::new(),
        }
    }

    /// Rejected with `403 Forbidden`: a rule decided the object may not be admitted.
    pub fn forbid(uid: &str, message: String) -> AdmissionResponse {
        AdmissionResponse {
            allowed: false,
            status: Some(Status {
                status: "Failure",
                message,
                reason: "Forbidden",
                code: 403,
                details: None,
            }),
            ..AdmissionResponse::allow(uid)
        }
    }

    /// Rejected with `429 TooManyRequests`: initium could not look at the object now; the
    /// message says to retry.
    pub fn too_many_requests(uid: &str, message: String) -> AdmissionResponse {
        AdmissionResponse {
            allowed: false,
            status: Some(Status {
                status: "Failure",
                message,
                reason: "TooManyRequests",
                code: 429,
                details: None,
            }),
            ..AdmissionResponse::allow(uid)
        }
    }

    /// Rejected with `422 Invalid`: the object itself is wrong, field by field.
    pub fn invalid(uid: &str, message: String, details: StatusDetails) -> AdmissionResponse {
        AdmissionResponse {
            allowed: false,
            status: Some(Status {
                status: "Failure",
                message,
                reason: "Invalid",
                code: 422,
                details: Some(details),
            }),
            ..AdmissionResponse::allow(uid)
        }
    }

    /// The whole AdmissionReview, as JSON.
    pub fn to_review_json(&self) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec(&ReviewOut {
            api_version: API_VERSION,
            kind: KIND,
            response: self,
        })
    }
}

/// Warnings as the client will see them: each one line of at most [`WARNING_MAX_CHARS`]
/// characters, all of them within the API server's total; when they do not fit, the last one
/// says how many were left out (the log has them all).
pub fn client_warnings(messages: &[String]) -> Vec<String> {
    let warnings: Vec<String> = messages.iter().map(|m| one_warning(m)).collect();
    let total: usize = warnings.iter().map(|w| w.chars().count()).sum();
    if total <= WARNINGS_MAX_TOTAL_CHARS {
        return warnings;
    }
    // Room for the closing "N more ..." line.
    let budget = WARNINGS_MAX_TOTAL_CHARS - 100;
    let mut kept = Vec::new();
    let mut used = 0;
    for w in &warnings {
        let n = w.chars().count();
        if used + n > budget {
            break;
        }
        used += n;
        kept.push(w.clone());
    }
    let left_out = warnings.len() - kept.len();
    kept.push(format!(
        "{left_out} more warning(s) left out to stay within the API server's limits; initium's log lists them"
    ));
    kept
}

/// One line (control characters become spaces, runs of them one space), cut to
/// [`WARNING_MAX_CHARS`] characters with a trailing `…`.
fn one_warning(message: &str) -> String {
    let mut line = String::with_capacity(message.len());
    let mut gap = false;
    for c in message.trim().chars() {
        if c.is_control() || c.is_whitespace() {
            gap = true;
            continue;
        }
        if gap && !line.is_empty() {
            line.push(' ');
        }
        gap = false;
        line.push(c);
    }
    if line.chars().count() > WARNING_MAX_CHARS {
        line = line.chars().take(WARNING_MAX_CHARS - 1).collect();
        line.push('…');
    }
    line
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_review_too_deep_to_parse_is_read_for_its_uid_rule_and_field() {
        let mut deep = String::from("\"x\"");
        for n in 0..200 {
            deep = if n % 2 == 0 {
                format!("[1, \"a]b\", {deep}]")
            } else {
                format!("{{\"k\\\"{n}\": {deep}}}")
            };
        }
        let body = format!(
            "{{\"apiVersion\": \"admission.k8s.io/v1\", \"request\": {{\"namespace\": \"ns\", \
             \"object\": {{\"kind\": \"MutationRule\", \"spec\": {{\"v\": {deep}}}, \
             \"metadata\": {{\"name\": \"r\\u0031\"}}}}, \"uid\": \"u-1\"}}}}"
        );
        assert!(parse(body.as_bytes()).is_err());
        let found = too_deep(body.as_bytes()).expect("too deep");
        assert_eq!(found.uid.as_deref(), Some("u-1"));
        assert_eq!(found.kind.as_deref(), Some("MutationRule"));
        assert_eq!(found.name.as_deref(), Some("r1"));
        assert_eq!(found.namespace.as_deref(), Some("ns"));
        assert_eq!(found.depth, 202);
        assert_eq!(found.field, "spec.v.k\"199[2].k\"197[2].k\"195[2]...");
        let shallow = br#"{"kind": "AdmissionReview", "request": {"uid": "u", "object": {}}}"#;
        assert_eq!(
            too_deep(shallow),
            None,
            "a review within the limit is not too deep"
        );
    }

    #[test]
    fn warnings_are_single_lines_within_the_api_server_limits() {
        assert_eq!(one_warning("a\n\tb  c\u{7f}d"), "a b c d");
        let long = "x".repeat(300);
        let cut = one_warning(&long);
        assert_eq!(cut.chars().count(), WARNING_MAX_CHARS);
        assert!(cut.ends_with('…'));

        let many: Vec<String> = (0..40).map(|i| format!("{i:03} {long}")).collect();
        let out = client_warnings(&many);
        let total: usize = out.iter().map(|w| w.chars().count()).sum();
        assert!(total <= WARNINGS_MAX_TOTAL_CHARS, "{total}");
        assert!(out.iter().all(|w| w.chars().count() <= WARNING_MAX_CHARS));
        let last = out.last().map(String::as_str).unwrap_or_default();
        assert!(
            last.starts_with(&format!("{} more warning(s)", 40 - (out.len() - 1))),
            "{last}"
        );
        assert!(out[0].starts_with("000 "));
    }

    #[test]
    fn parse_errors_quote_the_bodys_keys_on_one_line() {
        // Found by the fuzzer: a key with a newline in managedFields made a two-line reason.
        let body = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","kind":{"group":"","version":"v1","kind":"Pod"},"operation":"CREATE","object":{"metadata":{"managedFields":[{"fieldsV1":{"k:{\"name\":\n\"api\"}":"\ud800"}}]}}}}"#;
        let e = parse(body).unwrap_err();
        assert!(!e.contains('\n'), "{e}");
        assert!(
            e.starts_with("not an AdmissionReview: request.object.metadata.managedFields[0]"),
            "{e}"
        );
        assert!(
            e.contains("\\n"),
            "the newline is written as an escape: {e}"
        );
        let long = format!(
            r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"{}":{{"x":1}},"uid":7}}}}"#,
            "k".repeat(100_000)
        );
        let e = parse(long.as_bytes()).unwrap_err();
        assert!(e.len() < 1024, "{} bytes", e.len());
    }

    #[test]
    fn parse_errors_name_the_field() {
        let e = parse(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","kind":{"group":"","version":"v1","kind":"Pod"},"operation":7}}"#)
            .unwrap_err();
        assert!(e.contains("request.operation"), "{e}");
        let e = parse(b"{").unwrap_err();
        assert!(e.contains("EOF"), "{e}");
        let e = parse(br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview"}"#)
            .unwrap_err();
        assert!(e.contains("v1beta1"), "{e}");
    }
}

/// What [`too_deep`] finds in a review nested deeper than `serde_json` reads.
#[derive(Debug, Default, PartialEq)]
pub struct TooDeep {
    pub uid: Option<String>,
    pub kind: Option<String>,
    pub name: Option<String>,
    pub namespace: Option<String>,
    /// The field of `request.object` where the nesting first passed the limit, as a rule's
    /// fields are written (`spec.mutations[0].merge.a.a`), at most [`SHOWN_SEGMENTS`] of it.
    pub field: String,
    /// How deep `request.object` nests (its fields count from 1).
    pub depth: usize,
}

/// The deepest nesting `serde_json` reads (its recursion limit is 128: the 128th level is
/// refused), counted from the review's root (the review 1, `request` 2, `request.object` 3).
pub const READ_DEPTH: usize = 127;

/// Segments of a too-deep field that a message shows.
const SHOWN_SEGMENTS: usize = 8;

/// A review nested deeper than [`READ_DEPTH`], read without building it (a loop over the
/// bytes, no recursion): the request's uid, the object's kind, name and namespace, and where
/// the object is too deep. `None` when the body nests no deeper than that, or is not JSON.
pub fn too_deep(body: &[u8]) -> Option<TooDeep> {
    #[derive(Clone)]
    enum Seg {
        Key(String),
        Index(usize),
    }
    let mut found = TooDeep::default();
    let mut path: Vec<Seg> = Vec::new();
    // Per open container: an object (`true`) or a list.
    let mut objects: Vec<bool> = Vec::new();
    let mut expect_key = false;
    let mut deepest = 0usize;
    let mut first_deep: Option<Vec<Seg>> = None;
    let is = |path: &[Seg], want: &[&str]| {
        path.len() == want.len()
            && path
                .iter()
                .zip(want)
                .all(|(s, w)| matches!(s, Seg::Key(k) if k == w))
    };
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'{' | b'[' => {
                let object = body[i] == b'{';
                objects.push(object);
                path.push(if object {
                    Seg::Key(String::new())
                } else {
                    Seg::Index(0)
                });
                expect_key = object;
                deepest = deepest.max(objects.len());
                if objects.len() > READ_DEPTH && first_deep.is_none() {
                    first_deep = Some(path.clone());
                }
                i += 1;
            }
            b'}' | b']' => {
                objects.pop()?;
                path.pop();
                expect_key = false;
                i += 1;
            }
            b',' => {
                match (objects.last(), path.last_mut()) {
                    (Some(true), _) => expect_key = true,
                    (Some(false), Some(Seg::Index(n))) => *n += 1,
                    _ => return None,
                }
                i += 1;
            }
            b'"' => {
                let start = i;
                i += 1;
                while i < body.len() && body[i] != b'"' {
                    i += if body[i] == b'\\' { 2 } else { 1 };
                }
                let text: String = serde_json::from_slice(body.get(start..=i)?).ok()?;
                i += 1;
                if expect_key {
                    if let Some(last) = path.last_mut() {
                        *last = Seg::Key(text);
                    }
                    expect_key = false;
                } else {
                    let slot = if is(&path, &["request", "uid"]) {
                        &mut found.uid
                    } else if is(&path, &["request", "object", "kind"]) {
                        &mut found.kind
                    } else if is(&path, &["request", "object", "metadata", "name"]) {
                        &mut found.name
                    } else if is(&path, &["request", "object", "metadata", "namespace"])
                        || (is(&path, &["request", "namespace"]) && found.namespace.is_none())
                    {
                        &mut found.namespace
                    } else {
                        continue;
                    };
                    *slot = Some(text);
                }
            }
            _ => i += 1,
        }
    }
    let deep = first_deep?;
    // `request.object.` is not part of the rule's fields.
    let fields = deep.get(2..).unwrap_or_default();
    for (n, seg) in fields.iter().take(SHOWN_SEGMENTS).enumerate() {
        match seg {
            Seg::Key(key) if n == 0 => found.field.push_str(key),
            Seg::Key(key) => {
                found.field.push('.');
                found.field.push_str(key);
            }
            Seg::Index(index) => found.field.push_str(&format!("[{index}]")),
        }
    }
    if fields.len() > SHOWN_SEGMENTS {
        found.field.push_str("...");
    }
    // The review's object and request: the object's own nesting is two less.
    found.depth = deepest.saturating_sub(2);
    Some(found)
}
