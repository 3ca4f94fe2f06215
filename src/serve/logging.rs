//! The log of `initium serve`: JSON (the default) or text, on stderr, filtered by `RUST_LOG`.

use super::args::LogFormat;
use crate::escape_controls;

pub(super) fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.fmt_fields(text_fields()).try_init(),
    };
}

/// Field formatting of the text log: as tracing-subscriber's default, except that control
/// characters are escaped (`\u{1b}`), so a name or message from a client or a rule cannot
/// move the cursor, recolour or rewrite a terminal. (The JSON format escapes them already.)
pub fn text_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt as _;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = escape_controls(&format!("{value:?}"));
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
    fn text_logs_escape_control_characters_from_untrusted_text() {
        use std::sync::{Arc, Mutex};
        let written = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = written.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .fmt_fields(text_fields())
            .with_writer(move || Sink(sink.clone()))
            .finish();
        let name = "web\u{1b}[2J\u{1b}[31mred\u{7}\u{202e}";
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(name = %name, kind = "Pod\u{1b}]0;title\u{7}", "admitted {name}");
        });
        let text = String::from_utf8(written.lock().map(|w| w.clone()).unwrap_or_default())
            .expect("UTF-8");
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

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

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
