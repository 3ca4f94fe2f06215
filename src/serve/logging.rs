//! The log of `initium serve`: JSON (the default) or text, on stderr, filtered by `RUST_LOG`.

use super::args::LogFormat;
use initium_engine::untrusted::escape;

/// The Kubernetes client's own log, off unless `RUST_LOG` names it. initium reports every
/// error the client returns to it as a sentence (`crate::kube_errors`); the client's log says
/// the same things again as `Debug` dumps of hyper's errors (`eof in poll: Custom { kind:
/// UnexpectedEof, error: Service(hyper::Error(Body, ...` whenever the API server restarts).
const KUBE_CLIENT_OFF: &str = "kube_client=off,kube_runtime=off";

/// The filter for `RUST_LOG` (`None`: unset): its directives, or `info`, with the Kubernetes
/// client's own log off unless they name it (`RUST_LOG=info,kube_client=debug` turns it on).
fn directives(rust_log: Option<&str>) -> String {
    let given = rust_log.map(str::trim).filter(|s| !s.is_empty());
    let base = given.unwrap_or("info");
    if base.split(',').any(names_kube_client) {
        base.to_string()
    } else {
        format!("{base},{KUBE_CLIENT_OFF}")
    }
}

/// The directive (`target[span]=level`, or a bare level) applies to the client's own log: its
/// target is a prefix of the client's crates (`kube`, `kube_client`) or inside them
/// (`kube_client::client`).
fn names_kube_client(directive: &str) -> bool {
    let target = directive
        .split(['=', '['])
        .next()
        .unwrap_or_default()
        .trim();
    let crates = ["kube_client", "kube_runtime"];
    !target.is_empty()
        && crates
            .iter()
            .any(|c| c.starts_with(target) || target.starts_with(&format!("{c}::")))
}

pub(super) fn init_logging(format: LogFormat) {
    let rust_log = std::env::var("RUST_LOG").ok();
    let (filter, refused) =
        match tracing_subscriber::EnvFilter::try_new(directives(rust_log.as_deref())) {
            Ok(filter) => (filter, None),
            Err(e) => (
                tracing_subscriber::EnvFilter::new(directives(None)),
                Some(e.to_string()),
            ),
        };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.fmt_fields(text_fields()).try_init(),
    };
    if let Some(error) = refused {
        tracing::warn!(
            rust_log = rust_log.as_deref().unwrap_or_default(),
            error = %error,
            "RUST_LOG could not be read, so initium logs at info; write it as a level (info, \
             debug) or as target=level pairs separated by commas (info,initium=debug)"
        );
    }
}

/// Field formatting of the text log: as tracing-subscriber's default, except that control
/// characters are escaped (`\u{1b}`), so a name or message from a client or a rule cannot
/// move the cursor, recolour or rewrite a terminal. (The JSON format escapes them already.)
pub fn text_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = escape(&format!("{value:?}")).into_owned();
        if field.name() == "message" {
            write!(writer, "{text}")
        } else {
            write!(writer, "{}={text}", field.name())
        }
    })
    .delimited(" ")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn the_kube_clients_own_log_is_off_unless_rust_log_names_it() {
        const OFF: &str = ",kube_client=off,kube_runtime=off";
        for (given, expected) in [
            (None, format!("info{OFF}")),
            (Some(" "), format!("info{OFF}")),
            (Some("debug"), format!("debug{OFF}")),
            (
                Some("info,initium=debug"),
                format!("info,initium=debug{OFF}"),
            ),
            (
                Some("info,kube_client=debug"),
                "info,kube_client=debug".into(),
            ),
            (
                Some("initium=debug,kube=info"),
                "initium=debug,kube=info".into(),
            ),
            (
                Some("warn,kube_runtime::watcher=debug"),
                "warn,kube_runtime::watcher=debug".into(),
            ),
            // Naming one of initium's own modules is not naming the client.
            (
                Some("info,initium::kube_errors=debug"),
                format!("info,initium::kube_errors=debug{OFF}"),
            ),
            (Some("info,"), format!("info,{OFF}")),
            (Some("kubelet=debug"), format!("kubelet=debug{OFF}")),
        ] {
            assert_eq!(directives(given), expected, "{given:?}");
        }
        for given in [None, Some("debug"), Some("info,kube_runtime=trace")] {
            assert!(
                tracing_subscriber::EnvFilter::try_new(directives(given)).is_ok(),
                "{given:?}"
            );
        }

        // What the filter lets through: initium's warning, not the client's dump of the same.
        let written = Sink::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_env_filter(tracing_subscriber::EnvFilter::new(directives(Some("info"))))
            .with_writer(written.writer())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "kube_client::client", "eof in poll: Custom {{ kind: UnexpectedEof }}");
            tracing::error!(target: "kube_client::client::builder", "failed with error client error (Connect)");
            tracing::warn!(target: "kube_runtime::watcher", "watcher error 403: Api(Status {{ }})");
            tracing::warn!(target: "initium::controller::duty", "watching Namespaces failed");
        });
        let text = written.text();
        assert!(text.contains("watching Namespaces failed"), "{text}");
        assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    }

    #[test]
    fn text_logs_escape_control_characters_from_untrusted_text() {
        let written = Sink::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .fmt_fields(text_fields())
            .with_writer(written.writer())
            .finish();
        let name = "web\u{1b}[2J\u{1b}[31mred\u{7}\u{202e}";
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(name = %name, kind = "Pod\u{1b}]0;title\u{7}", "admitted {name}");
        });
        let text = written.text();
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text:?}"
        );
        assert!(!text.contains('\u{202e}'), "{text:?}");
        assert!(
            text.contains(r"name=web\u{1b}[2J\u{1b}[31mred\u{7}\u{202e}"),
            "{text}"
        );
        assert!(text.contains(r"admitted web\u{1b}[2J"), "{text}");
        assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    }

    /// What a test subscriber wrote, shared with its writers.
    #[derive(Clone, Default)]
    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Sink {
        fn writer(&self) -> impl Fn() -> Sink + 'static {
            let sink = self.clone();
            move || sink.clone()
        }

        fn text(&self) -> String {
            String::from_utf8(self.0.lock().map(|w| w.clone()).unwrap_or_default()).expect("UTF-8")
        }
    }

    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut w) = self.0.lock() {
                w.extend_from_slice(buf);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
