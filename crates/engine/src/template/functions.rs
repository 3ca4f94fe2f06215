//! The functions templates can call. Each counts what it builds with the meter before it
//! builds it, so a rule cannot make one admission allocate without bound (a `split()` into a
//! million pieces, a `base64Decode()` of the whole object, a `replace()` that doubles a
//! string) — it stops at the output limit, like a rewrite.

use std::io::Write;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use serde_json::{Map, Value};

use super::catalog::Function;
use super::eval::{Evaluator, Fail, Val};
use super::image;
use super::parse::Call;
use crate::limits::{MAX_DEPTH, measure, replace_all};
use crate::path::type_name;

impl<'a> Evaluator<'a, '_, '_> {
    /// Runs the function of `call` on its arguments (the picks after it are the caller's).
    pub(super) fn apply(&mut self, call: &'a Call) -> Result<Val<'a>, Fail> {
        let f = call.function.name();
        let args = &call.args;
        let built = match call.function {
            Function::Default => {
                return match self.arg(&args[0], f) {
                    Ok(v) if !v.get().is_null() => Ok(v),
                    Ok(_) | Err(Fail::Nothing(_)) => self.arg(&args[1], f),
                    Err(stop) => Err(stop),
                };
            }
            Function::Lower | Function::Upper => {
                let s = self.text(&args[0], f, "its argument")?;
                let lower = call.function == Function::Lower;
                // Case mappings may lengthen a character (İ lower-cased is two).
                let bytes = s
                    .as_str()
                    .chars()
                    .map(|c| {
                        if lower {
                            c.to_lowercase().map(char::len_utf8).sum::<usize>()
                        } else {
                            c.to_uppercase().map(char::len_utf8).sum()
                        }
                    })
                    .sum();
                self.count(bytes)?;
                Value::String(if lower {
                    s.as_str().to_lowercase()
                } else {
                    s.as_str().to_uppercase()
                })
            }
            Function::Trim | Function::TrimPrefix | Function::TrimSuffix => {
                let s = self.text(&args[0], f, "the text")?;
                let cut = match call.function {
                    Function::TrimPrefix => {
                        let prefix = self.text(&args[1], f, "the prefix")?;
                        let s = s.as_str();
                        s.strip_prefix(prefix.as_str()).unwrap_or(s).len()
                    }
                    Function::TrimSuffix => {
                        let suffix = self.text(&args[1], f, "the suffix")?;
                        let s = s.as_str();
                        s.strip_suffix(suffix.as_str()).unwrap_or(s).len()
                    }
                    _ => s.as_str().trim().len(),
                };
                self.count(cut)?;
                let s = s.as_str();
                Value::String(match call.function {
                    Function::TrimPrefix => s[s.len() - cut..].to_string(),
                    Function::TrimSuffix => s[..cut].to_string(),
                    _ => s.trim().to_string(),
                })
            }
            Function::Split => {
                let s = self.text(&args[0], f, "the text")?;
                let separator = self.text(&args[1], f, "the separator")?;
                let (s, separator) = (s.as_str(), separator.as_str());
                if separator.is_empty() {
                    return Err(self.misuse(f, "the separator is empty".into()).into());
                }
                // As JSON: each piece quoted, with a comma.
                let pieces = s.matches(separator).count() + 1;
                self.count(s.len() - (pieces - 1) * separator.len() + 3 * pieces)?;
                Value::Array(
                    s.split(separator)
                        .map(|piece| Value::String(piece.to_string()))
                        .collect(),
                )
            }
            Function::Join => {
                let separator = self.text(&args[0], f, "the separator")?;
                let items = self.list(&args[1], f)?;
                let mut bytes = separator.as_str().len() * items.len().saturating_sub(1);
                for (i, item) in items.iter().enumerate() {
                    bytes += match item.get() {
                        Value::String(s) => s.len(),
                        v @ (Value::Number(_) | Value::Bool(_)) => v.to_string().len(),
                        other => {
                            return Err(self
                                .misuse(
                                    f,
                                    format!(
                                        "element {i} of the list is {}; only strings, numbers and booleans are joined",
                                        type_name(other)
                                    ),
                                )
                                .into());
                        }
                    };
                }
                self.count(bytes)?;
                let mut out = String::with_capacity(bytes);
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(separator.as_str());
                    }
                    match item.get() {
                        Value::String(s) => out.push_str(s),
                        other => out.push_str(&other.to_string()),
                    }
                }
                Value::String(out)
            }
            Function::Replace => {
                let s = self.text(&args[0], f, "the text")?;
                let replacement = self.text(&args[2], f, "the replacement")?;
                let Some(regex) = &call.regex else {
                    return Err(self
                        .misuse(f, "the regular expression was not compiled".into())
                        .into());
                };
                match replace_all(regex, false, s.as_str(), replacement.as_str(), self.meter)? {
                    Some(replaced) => Value::String(replaced),
                    None => {
                        self.count(s.as_str().len())?;
                        Value::String(s.into_string())
                    }
                }
            }
            Function::Base64Encode => {
                let s = self.text(&args[0], f, "its argument")?;
                self.count(s.as_str().len().div_ceil(3) * 4)?;
                Value::String(base64::engine::general_purpose::STANDARD.encode(s.as_str()))
            }
            Function::Base64Decode => {
                let s = self.text(&args[0], f, "its argument")?;
                self.count(s.as_str().len().div_ceil(4) * 3)?;
                let bytes = BASE64_LENIENT_PADDING.decode(s.as_str()).map_err(|e| {
                    self.misuse(f, format!("its argument is not valid base64 ({e})"))
                })?;
                Value::String(String::from_utf8(bytes).map_err(|_| {
                    self.misuse(
                        f,
                        "the decoded bytes are not UTF-8 text, and only text can be written into a JSON string"
                            .into(),
                    )
                })?)
            }
            Function::Sha256 => {
                let s = self.text(&args[0], f, "its argument")?;
                self.count(64)?;
                let digest = ring::digest::digest(&ring::digest::SHA256, s.as_str().as_bytes());
                let mut hex = String::with_capacity(64);
                for b in digest.as_ref() {
                    hex.push(char::from(HEX[usize::from(b >> 4)]));
                    hex.push(char::from(HEX[usize::from(b & 15)]));
                }
                Value::String(hex)
            }
            Function::ToJson => {
                let value = self.arg(&args[0], f)?;
                // Serialized into a buffer that refuses to grow past what the rule may still
                // write, so the whole object is never serialized only to be refused.
                let limit = self.meter.remaining();
                let mut out = Bounded {
                    bytes: Vec::new(),
                    limit,
                };
                if serde_json::to_writer(&mut out, value.get()).is_err() {
                    self.count(limit.saturating_add(1))?;
                }
                self.count(out.bytes.len())?;
                Value::String(
                    String::from_utf8(out.bytes)
                        .map_err(|_| self.misuse(f, "the JSON text is not UTF-8".into()))?,
                )
            }
            Function::FromJson => {
                let s = self.text(&args[0], f, "its argument")?;
                // The value takes about as many bytes as JSON as its text.
                self.count(s.as_str().len())?;
                let value: Value = serde_json::from_str(s.as_str())
                    .map_err(|e| self.misuse(f, format!("its argument is not JSON ({e})")))?;
                if measure(&value, usize::MAX, MAX_DEPTH).depth > MAX_DEPTH {
                    return Err(self
                        .misuse(
                            f,
                            format!(
                                "the JSON nests more than {MAX_DEPTH} levels deep (the depth limit)"
                            ),
                        )
                        .into());
                }
                value
            }
            Function::Image => {
                let s = self.text(&args[0], f, "its argument")?;
                let parsed = image::parse(s.as_str()).map_err(|problem| {
                    self.misuse(
                        f,
                        format!(
                            "{} is not an image reference: {problem}",
                            crate::untrusted::InQuotes(s.as_str())
                        ),
                    )
                })?;
                let fields = [
                    ("registry", parsed.registry),
                    ("repository", parsed.repository),
                    ("name", parsed.name),
                    ("tag", parsed.tag),
                    ("digest", parsed.digest),
                ];
                self.count(fields.iter().map(|(k, v)| k.len() + v.len() + 6).sum())?;
                Value::Object(
                    fields
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), Value::String(v)))
                        .collect::<Map<String, Value>>(),
                )
            }
        };
        Ok(Val::Own(built))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Standard base64, with or without its `=` padding.
const BASE64_LENIENT_PADDING: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// A buffer that fails once more than `limit` bytes are written into it.
struct Bounded {
    bytes: Vec<u8>,
    limit: usize,
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > self.limit {
            return Err(std::io::Error::other("over the output limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
