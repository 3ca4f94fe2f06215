//! JSON written straight into a byte buffer, byte for byte as `serde_json::to_writer` writes
//! it (compact, keys in the map's order, the same string escapes), for the patch the webhook
//! answers with. `serde_json` goes through `io::Write` for every quote, colon and comma and
//! looks at a string one byte at a time; writing a patch that way cost a tenth of an
//! admission. Here a string is searched for what needs escaping eight bytes at a time, and
//! the plain runs between are copied whole.

use serde_json::{Number, Value};

use super::scan;

/// Writes `value` as compact JSON.
pub(crate) fn value(out: &mut Vec<u8>, value: &Value) -> serde_json::Result<()> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => number(out, n)?,
        Value::String(s) => string(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                self::value(out, item)?;
            }
            out.push(b']');
        }
        Value::Object(map) => {
            out.push(b'{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                string(out, key);
                out.push(b':');
                self::value(out, item)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

/// Integers digit by digit; anything else (a float) as `serde_json` writes it.
fn number(out: &mut Vec<u8>, n: &Number) -> serde_json::Result<()> {
    if let Some(u) = n.as_u64() {
        digits(out, u);
    } else if let Some(i) = n.as_i64() {
        out.push(b'-');
        digits(out, i.unsigned_abs());
    } else {
        serde_json::to_writer(&mut *out, n)?;
    }
    Ok(())
}

fn digits(out: &mut Vec<u8>, mut n: u64) {
    let mut buf = [0u8; 20];
    let mut start = buf.len();
    for slot in buf.iter_mut().rev() {
        *slot = b'0' + (n % 10) as u8;
        n /= 10;
        start -= 1;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(buf.get(start..).unwrap_or_default());
}

/// Writes `s` as a JSON string.
pub(crate) fn string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let mut rest = s.as_bytes();
    while let Some(at) = first_to_escape(rest) {
        let Some((plain, tail)) = rest.split_at_checked(at) else {
            break;
        };
        out.extend_from_slice(plain);
        let Some((&byte, after)) = tail.split_first() else {
            break;
        };
        escape(out, byte);
        rest = after;
    }
    out.extend_from_slice(rest);
    out.push(b'"');
}

/// The escape `serde_json` writes for a byte it does not copy.
fn escape(out: &mut Vec<u8>, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match byte {
        b'"' => out.extend_from_slice(b"\\\""),
        b'\\' => out.extend_from_slice(b"\\\\"),
        0x08 => out.extend_from_slice(b"\\b"),
        0x0c => out.extend_from_slice(b"\\f"),
        b'\n' => out.extend_from_slice(b"\\n"),
        b'\r' => out.extend_from_slice(b"\\r"),
        b'\t' => out.extend_from_slice(b"\\t"),
        _ => out.extend_from_slice(&[
            b'\\',
            b'u',
            b'0',
            b'0',
            HEX[usize::from(byte >> 4)],
            HEX[usize::from(byte & 0xf)],
        ]),
    }
}

fn needs_escape(byte: u8) -> bool {
    byte < 0x20 || byte == b'"' || byte == b'\\'
}

/// Where the first byte that needs an escape is: a control character, `"` or `\`.
fn first_to_escape(bytes: &[u8]) -> Option<usize> {
    scan::first(
        bytes,
        |word| scan::below(word, 0x20) | scan::equal(word, b'"') | scan::equal(word, b'\\'),
        needs_escape,
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    fn written(v: &Value) -> String {
        let mut out = Vec::new();
        value(&mut out, v).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        // Every byte that needs an escape (and its neighbours), at every place around the
        // eight-byte boundaries, alone, in runs, and beside text that is not ASCII.
        let mut texts: Vec<String> = vec![
            String::new(),
            "plain".into(),
            "é ü 日本 🦀 \u{7f} \u{80} \u{2028}".into(),
            "\"\\\"\\".into(),
            "a\u{0}b\u{1f}c\u{20}d\u{7}".into(),
        ];
        let specials: Vec<char> = (0u8..0x21)
            .map(char::from)
            .chain(['"', '\\', '/', '~', 'é', '\u{7f}'])
            .collect();
        for len in 1..20 {
            for at in 0..len {
                for &special in &specials {
                    let mut text: Vec<char> = "abcdefghijklmnopqrst"[..len].chars().collect();
                    text[at] = special;
                    let text: String = text.into_iter().collect();
                    texts.push(format!("{text}{text}"));
                    texts.push(text);
                }
            }
        }
        for text in &texts {
            let v = Value::String(text.clone());
            assert_eq!(written(&v), serde_json::to_string(&v).unwrap(), "{text:?}");
        }
    }

    #[test]
    fn values_are_written_as_serde_json_writes_them() {
        let values = [
            json!(null),
            json!(true),
            json!(false),
            json!(0),
            json!(7),
            json!(-1),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(i64::MAX),
            json!(10_000_000_000u64),
            json!(1.5),
            json!(-0.0),
            json!(1e300),
            json!(2.5e-8),
            json!([]),
            json!({}),
            json!([1, "a", null, [[]], {"b": {}}]),
            json!({"z": 1, "a\"b": [true, {"c\n": "d\\"}], "m": -3.25, "": ""}),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"app": "x"}}}),
        ];
        for v in &values {
            assert_eq!(written(v), serde_json::to_string(v).unwrap(), "{v}");
        }
    }
}
