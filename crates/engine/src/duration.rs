//! Durations as rules write them: `30s`, `10m`, `1h30m`.

use std::time::Duration;

/// `30s`, `10m`, `1h`, `1h30m`, `500ms`.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let bad = || DurationError {
        text: text.to_string(),
    };
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            _ => return Err(bad()),
        };
        total = total.saturating_add(unit);
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// A duration that is not a number with a unit.
#[derive(Debug, thiserror::Error)]
#[error("invalid duration {text:?}: use a number with a unit, like 30s, 10m or 1h30m")]
pub struct DurationError {
    text: String,
}
