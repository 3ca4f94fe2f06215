//! Text that came from a tenant (rule and object names, values, patterns, queries, templates),
//! made safe to show a person: one escaper and one length cap for every place such text can
//! reach — logs, admission warnings, Events, rule status, `explain`, `test`, error messages.
//!
//! - [`escape`]: control characters (escape sequences that recolour or rewrite a terminal,
//!   carriage returns, newlines) and the invisible or bidirectional characters a terminal obeys
//!   (U+200B–U+200F, U+202A–U+202E, U+2066–U+2069) are written as Rust escapes (`\u{1b}`);
//! - [`quote`]: [`escape`], and text longer than [`MAX_QUOTED_BYTES`] cut to its start with the
//!   length it had, so that a rule cannot make one message (and every log line, warning and
//!   Event that carries it) as large as itself.
//! - [`capped`]: the same with a cap of one's own, for errors a log line carries whole (an API
//!   server's refusal of what tenants' rules made, [`MAX_ERROR_BYTES`]).

use std::borrow::Cow;
use std::fmt;

/// The most bytes of one quoted piece of untrusted text in a message.
pub const MAX_QUOTED_BYTES: usize = 200;

/// The most bytes of an error a log line carries whole: an API server's refusal lists every
/// problem of what it refused (a webhook configuration built from thousands of rules made
/// 115 KB, logged at every retry).
pub const MAX_ERROR_BYTES: usize = 4096;

fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every control, invisible and bidirectional character written as an escape.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `text` as [`escape`] writes it, cut after [`MAX_QUOTED_BYTES`] bytes (at a character
/// boundary) with `… (N bytes)` saying how long it was.
pub fn quote(text: &str) -> Cow<'_, str> {
    capped(text, MAX_QUOTED_BYTES)
}

/// `text` as [`escape`] writes it, cut after `max` bytes (at a character boundary) with
/// `… (N bytes)` saying how long it was.
pub fn capped(text: &str, max: usize) -> Cow<'_, str> {
    match cut(text, max) {
        (_, None) => escape(text),
        (start, Some(len)) => Cow::Owned(format!("{}… ({len} bytes)", escape(start))),
    }
}

/// The start of `text` that fits `max` bytes, and its whole length when it was cut.
fn cut(text: &str, max: usize) -> (&str, Option<usize>) {
    if text.len() <= max {
        return (text, None);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (&text[..end], Some(text.len()))
}

/// Displays as [`quote`]: for error types whose fields hold untrusted text.
pub struct Quoted<'a>(pub &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&quote(self.0))
    }
}

/// Displays as `{text:?}` did (between double quotes, with Rust's escapes), cut as [`quote`]
/// cuts, with anything Rust's escapes leave that a terminal would obey escaped too.
pub struct InQuotes<'a>(pub &'a str);

impl fmt::Display for InQuotes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (start, len) = cut(self.0, MAX_QUOTED_BYTES);
        f.write_str(&escape(&format!("{start:?}")))?;
        match len {
            Some(len) => write!(f, "… ({len} bytes)"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidirectional_overrides_are_escaped() {
        assert_eq!(escape("plain"), Cow::Borrowed("plain"));
        assert_eq!(escape("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(escape("a\r\nb"), "a\\r\\nb");
        assert_eq!(escape("evil\u{202e}txt"), "evil\\u{202e}txt");
        assert_eq!(escape("zero\u{200b}width"), "zero\\u{200b}width");
        assert_eq!(escape("é ü 日本"), "é ü 日本");
    }

    #[test]
    fn long_text_is_cut_with_its_length() {
        let short = "x".repeat(MAX_QUOTED_BYTES);
        assert_eq!(quote(&short), short.as_str());
        let long = "é".repeat(MAX_QUOTED_BYTES);
        let quoted = quote(&long);
        assert!(quoted.len() < MAX_QUOTED_BYTES + 32, "{quoted}");
        assert!(
            quoted.ends_with(&format!("… ({} bytes)", long.len())),
            "{quoted}"
        );
        // The cut falls on a character boundary and what is kept is still escaped.
        let hostile = format!("\u{1b}{}", "a".repeat(1 << 20));
        let quoted = quote(&hostile);
        assert!(quoted.starts_with("\\u{1b}aaa"), "{quoted}");
        assert!(quoted.len() < 256, "{}", quoted.len());
        assert_eq!(InQuotes("a\"b\\w").to_string(), "\"a\\\"b\\\\w\"");
        assert_eq!(InQuotes("x\u{202e}").to_string(), "\"x\\u{202e}\"");
        assert_eq!(Quoted("a\nb").to_string(), "a\\nb");
    }

    #[test]
    fn an_error_is_logged_whole_up_to_its_cap_and_escaped() {
        let refusal = format!(
            "line one\n{}",
            "webhooks[0].rules: Invalid value ".repeat(4000)
        );
        let logged = capped(&refusal, MAX_ERROR_BYTES);
        assert!(logged.len() < MAX_ERROR_BYTES + 32, "{}", logged.len());
        assert!(logged.starts_with("line one\\n"), "{logged}");
        assert!(
            logged.ends_with(&format!("… ({} bytes)", refusal.len())),
            "{logged}"
        );
        assert_eq!(capped("short", MAX_ERROR_BYTES), "short");
    }
}
