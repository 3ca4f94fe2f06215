//! The flags of `initium serve`, parsed and checked before anything starts.

use std::net::SocketAddr;
use std::time::Duration;

use crate::admission::Limits;
use initium_engine::{Limits as RuleLimits, parse_duration};

/// Flags of `initium serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address of the HTTPS admission webhook.
    #[arg(long, default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// Address of the plain-HTTP operations port (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub ops_listen: SocketAddr,
    /// Out-of-cluster mode: register this base URL (e.g. `https://127.0.0.1:8443`) in the
    /// webhook configurations instead of the Service.
    #[arg(long)]
    pub webhook_url: Option<String>,
    /// In-cluster mode: the Service in front of the replicas (port 443).
    #[arg(long, default_value = "initium")]
    pub service: String,
    /// initium's own namespace (never intercepted; holds the Lease and the TLS Secret).
    #[arg(long, env = "POD_NAMESPACE", default_value = "initium-system")]
    pub namespace: String,
    /// Namespaces never intercepted besides initium's own (repeat the flag for several).
    #[arg(long = "exclude-namespace", default_value = "kube-system")]
    pub exclude_namespaces: Vec<String>,
    /// Latency budget per admission request (`200ms`, `1s`). Rules not run when it is
    /// spent are skipped (`Ignore`) or deny (`Fail`). The webhook timeout is set to twice
    /// the budget (at least 1 s, at most 30 s).
    #[arg(long, default_value = "200ms", value_parser = budget)]
    pub budget: Duration,
    /// Name of the MutatingWebhookConfiguration and ValidatingWebhookConfiguration (at most
    /// 63 characters: it also names the label `fail-rules.initium.dev/<name>` on the
    /// namespaces with Fail rules).
    #[arg(long, default_value = "initium")]
    pub webhook_name: String,
    /// Name of the Lease that elects the replica that writes (status, configurations).
    #[arg(long, default_value = "initium")]
    pub lease_name: String,
    /// This replica's identity in the Lease (default: the Pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Serving certificate (PEM) from a file, e.g. from cert-manager, reloaded when it
    /// changes. Without it initium manages its own CA in a Secret.
    #[arg(long, requires = "tls_key_file")]
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// Private key (PEM) for `--tls-cert-file`.
    #[arg(long, requires = "tls_cert_file")]
    pub tls_key_file: Option<std::path::PathBuf>,
    /// CA certificate (PEM) to publish as the webhooks' caBundle with `--tls-cert-file`
    /// (default: the certificate file itself).
    #[arg(long)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Name of the Secret holding the self-managed CA and serving certificate.
    #[arg(long, default_value = "initium-tls")]
    pub tls_secret: String,
    /// After SIGTERM, how long initium goes on serving, not ready, before it stops accepting:
    /// the time the API server needs to learn that this Pod is terminating and send its
    /// requests to another replica (a request sent to a Pod that stopped listening fails,
    /// and under a `Fail` rule the create with it). SIGINT (Ctrl-C) skips it.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,
    /// How long in-flight requests may take to finish after SIGTERM (after
    /// `--shutdown-delay`).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Log format: `json` (one object per line) or `text`.
    #[arg(long, default_value = "json")]
    pub log_format: LogFormat,
    /// Largest AdmissionReview accepted (413 above), in bytes or with a suffix (`8Mi`).
    #[arg(long, default_value = "8Mi", value_parser = bytes)]
    pub max_body_bytes: usize,
    /// Bytes of request bodies read or worked on at once, across all connections; a request
    /// that would go over it gets 503 and may retry.
    #[arg(long, default_value = "32Mi", value_parser = bytes)]
    pub max_inflight_bytes: usize,
    /// Open webhook connections; more are closed as soon as they are accepted.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Time a client has to send a request's headers (every request; also how long an idle
    /// keep-alive connection stays open).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in (408 after it).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub body_read_timeout: Duration,
    /// Largest request head (HTTP/1.1 headers, HTTP/2 header list), at least 8Ki.
    #[arg(long, default_value = "16Ki", value_parser = bytes)]
    pub max_header_bytes: usize,
    /// HTTP/2 requests open at once on one connection.
    #[arg(long, default_value_t = 100)]
    pub http2_max_concurrent_streams: u32,
    /// Rules compiled at once by the validating webhook; a rule that waits longer than the
    /// budget is denied with a message to retry.
    #[arg(long, default_value_t = 2)]
    pub max_concurrent_validations: usize,
    /// Pods the gate controller releases at once (one write each): a wave of Pods waiting on
    /// one dependency is released this many at a time. Lower it to spare a busy API server.
    #[arg(long, default_value_t = crate::controller::DEFAULT_GATE_RELEASE_CONCURRENCY, value_parser = clap::value_parser!(u16).range(1..))]
    pub gate_release_concurrency: u16,
    /// How often each replica sums up what `mode: Audit` rules would have done, as one Event
    /// per rule and verdict (`AuditWouldChange`, `AuditWouldFail`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub audit_report_interval: Duration,
    /// Audit Events each replica publishes per namespace and report interval: past it, the
    /// most important are published and one `AuditEventsSummarized` Event sums up the rest
    /// (ClusterMutationRules' Events count in `default`, where Kubernetes stores them).
    #[arg(long, default_value_t = crate::controller::audit::DEFAULT_MAX_AUDIT_EVENTS_PER_NAMESPACE, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_audit_events_per_namespace: u32,
    /// AdmissionReviews evaluated at once on the blocking pool (those above 64 KiB, and those
    /// whose rules run past a 2 ms slice), in turns that go round the namespaces; one that has
    /// run 5 ms while another namespace's review waits pauses until its namespace's next turn.
    /// One that waits longer than the budget gets 503 and the API server applies the webhook's
    /// failure policy.
    #[arg(long, default_value_t = 2)]
    pub max_blocking_reviews: usize,
    /// Memory the reviews on the blocking pool may take together: each is charged 48 bytes per
    /// byte of its AdmissionReview (at most all of it) before it is parsed, and waits for its
    /// turn until that much is free. With the chart's 256Mi limit, keep it at half or less.
    #[arg(long, default_value = "128Mi", value_parser = bytes)]
    pub max_review_memory: usize,
    /// JSON values (elements, members) in an AdmissionReview above 64 KiB; more gets 413
    /// before it is parsed (parsing takes up to 16 times a body's bytes).
    #[arg(long, default_value_t = 1_000_000)]
    pub max_json_values: usize,
    /// Bytes (as JSON) one rule may write into one object: values it adds or replaces, what
    /// its templates copy, what its rewrites produce. A rule over it fails by its
    /// failurePolicy, its changes undone (docs/rules.md, Limits).
    #[arg(long, default_value = "1Mi", value_parser = bytes)]
    pub max_rule_output: usize,
    /// Bytes all rules together may write into one object.
    #[arg(long, default_value = "4Mi", value_parser = bytes)]
    pub max_admission_output: usize,
    /// Element × mutation steps one rule's forEach mutations may take in one object.
    #[arg(long, default_value_t = 100_000)]
    pub max_foreach_steps: usize,
    /// MutationRules of one namespace that may be Ready; the ones past it (the newest
    /// first) are not Ready, with reason QuotaExceeded. ClusterMutationRules do not count.
    #[arg(long, default_value_t = 1_000)]
    pub max_rules_per_namespace: usize,
    /// What the Ready MutationRules of one namespace may make initium hold, as measured when
    /// each is compiled (its spec, its JSONPath queries, its regular expressions and their
    /// search caches); a rule that would take the namespace past it is not Ready, with reason
    /// QuotaExceeded.
    #[arg(long, default_value = "64Mi", value_parser = bytes)]
    pub max_rule_bytes_per_namespace: usize,
    /// Distinct ConfigMaps the MutationRules of one namespace may look up together
    /// (`spec.lookups`); a rule that would go over it is not Ready (`LookupQuotaExceeded`).
    /// ClusterMutationRules are exempt.
    #[arg(long, default_value_t = crate::controller::DEFAULT_MAX_LOOKUPS_PER_NAMESPACE)]
    pub max_lookups_per_namespace: usize,
    /// Distinct objects the gates of one namespace's MutationRules may wait on together
    /// (`spec.gate.waitFor[].object`; each is a watch while Pods wait on it); a rule that would
    /// go over it is not Ready (`GateObjectQuotaExceeded`). ClusterMutationRules are exempt.
    #[arg(long, default_value_t = crate::controller::DEFAULT_MAX_GATE_OBJECTS_PER_NAMESPACE)]
    pub max_gate_objects_per_namespace: usize,
    /// `auto`: a Ready rule that a MutatingAdmissionPolicy does exactly, and that no rule
    /// before it may meet, is compiled to one and served by the API server itself (Kubernetes
    /// 1.36+): no webhook call, and it keeps working while initium is down. The rule's
    /// `ServedByAPIServer` condition says how it is served, or why not. `off`: every rule on
    /// the webhook (policies an earlier run generated are deleted). See docs/rules.md,
    /// "Served by the API server".
    #[arg(long, env = "INITIUM_COMPILE_RULES", value_enum, default_value_t = crate::controller::CompileRules::Off)]
    pub compile_rules: crate::controller::CompileRules,
    /// With `--compile-rules auto`: at most this many rules are compiled, the first in
    /// initium's order; the rest stay on the webhook. The API server checks every policy on
    /// every request it admits: measured on 2 cores, 10 compiled rules cost a Pod less than
    /// initium's webhook, 100 cost more than twice as much (BENCHMARKS.md, "Compiled rules").
    #[arg(long, env = "INITIUM_MAX_COMPILED_RULES", default_value_t = initium_engine::policy::DEFAULT_MAX_COMPILED)]
    pub max_compiled_rules: usize,
}

impl ServeArgs {
    /// What one admission's rules may do, from the flags.
    pub fn rule_limits(&self) -> RuleLimits {
        RuleLimits {
            rule_output_bytes: self.max_rule_output,
            admission_output_bytes: self.max_admission_output,
            foreach_steps: self.max_foreach_steps,
        }
    }

    /// The webhook server's limits from the flags.
    pub fn limits(&self) -> Limits {
        Limits {
            max_body_bytes: self.max_body_bytes,
            max_inflight_bytes: self.max_inflight_bytes,
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            body_read_timeout: self.body_read_timeout,
            max_header_bytes: self.max_header_bytes,
            http2_max_concurrent_streams: self.http2_max_concurrent_streams,
            max_concurrent_validations: self.max_concurrent_validations,
            max_blocking_reviews: self.max_blocking_reviews,
            max_review_memory: self.max_review_memory,
            max_json_values: self.max_json_values,
        }
    }
}

/// The rule limits must let a rule write something, and one rule's share must fit in the
/// whole object's.
pub(super) fn validate_rule_limits(limits: &RuleLimits) -> Result<(), String> {
    if limits.rule_output_bytes == 0 || limits.foreach_steps == 0 {
        return Err("--max-rule-output and --max-foreach-steps must be more than zero".into());
    }
    if limits.admission_output_bytes < limits.rule_output_bytes {
        return Err(format!(
            "--max-admission-output ({}) must be at least --max-rule-output ({})",
            limits.admission_output_bytes, limits.rule_output_bytes
        ));
    }
    Ok(())
}

/// A size in bytes: `1048576`, `512Ki`, `8Mi`, `1Gi`.
fn bytes(text: &str) -> Result<usize, String> {
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let unit: usize = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => {
            return Err(format!(
                "{text:?} is not a size: write bytes, or a number with Ki, Mi or Gi (8Mi)"
            ));
        }
    };
    number
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| {
            format!("{text:?} is not a size: write bytes, or a number with Ki, Mi or Gi (8Mi)")
        })
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

fn budget(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text).map_err(|e| e.to_string())?;
    if d > Duration::from_secs(15) {
        return Err(
            "at most 15s: the webhook timeout is twice the budget and Kubernetes allows 30s".into(),
        );
    }
    Ok(d)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn the_flags_default_to_the_documented_limits() {
        let args = Command::try_parse_from(["initium"]).expect("defaults parse");
        assert_eq!(args.serve.limits(), Limits::default());
        assert_eq!(args.serve.rule_limits(), RuleLimits::default());
        let args = Command::try_parse_from([
            "initium",
            "--max-rule-output",
            "8Mi",
            "--max-admission-output",
            "4Mi",
        ])
        .expect("sizes parse");
        let e = validate_rule_limits(&args.serve.rule_limits()).unwrap_err();
        assert_eq!(
            e,
            "--max-admission-output (4194304) must be at least --max-rule-output (8388608)"
        );
        let args = Command::try_parse_from([
            "initium",
            "--max-inflight-bytes",
            "64Mi",
            "--max-header-bytes",
            "8192",
        ])
        .expect("sizes parse");
        assert_eq!(args.serve.max_inflight_bytes, 64 << 20);
        assert_eq!(args.serve.max_header_bytes, 8192);
        let e = bytes("8MB").unwrap_err();
        assert!(e.contains("Ki, Mi or Gi"), "{e}");
    }
}
