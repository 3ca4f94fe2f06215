//! Reading documents for the offline commands: files, directories (recursive `*.yaml`,
//! `*.yml`, `*.json`) or `-` (stdin); multi-document YAML, JSON, and `kind: List`.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{Error, Result};

/// Inputs larger than this are refused rather than read into memory.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;
/// Deeper documents are refused: nothing in Kubernetes nests this far, and a bound keeps
/// every later recursive walk safe.
pub const MAX_DEPTH: usize = 100;

/// One document and where it came from (`file.yaml#2`, `file.yaml#2 items[0]`).
#[derive(Clone, Debug)]
pub struct Document {
    pub origin: String,
    pub value: Value,
}

/// Expands files and directories into the list of files to read, sorted within each
/// directory so runs are deterministic.
pub fn expand(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        if input.as_os_str() == "-" {
            files.push(input.clone());
        } else if input.is_dir() {
            walk(input, &mut files)?;
        } else if input.exists() {
            files.push(input.clone());
        } else {
            return Err(Error::input(
                input.display().to_string(),
                "no such file or directory",
            ));
        }
    }
    Ok(files)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    let io = |e: std::io::Error| Error::input_from(dir.display().to_string(), "cannot read", e);
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .map_err(io)?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(&path, files)?;
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            files.push(path);
        }
    }
    Ok(())
}

/// Reads every document of every input, in order.
pub fn read_documents(inputs: &[PathBuf]) -> Result<Vec<Document>> {
    let mut docs = Vec::new();
    for file in expand(inputs)? {
        let (origin, text) = read_text(&file)?;
        docs.extend(parse_documents(&origin, &text)?);
    }
    Ok(docs)
}

fn read_text(file: &Path) -> Result<(String, String)> {
    let origin = if file.as_os_str() == "-" {
        "<stdin>".to_string()
    } else {
        file.display().to_string()
    };
    let io = |e: std::io::Error| Error::input_from(origin.clone(), "cannot read", e);
    let mut bytes = Vec::new();
    if file.as_os_str() == "-" {
        std::io::stdin()
            .take(MAX_INPUT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
    } else {
        std::fs::File::open(file)
            .and_then(|f| f.take(MAX_INPUT_BYTES + 1).read_to_end(&mut bytes))
            .map_err(io)?;
    }
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        return Err(Error::input(
            origin,
            format!("larger than {} MiB", MAX_INPUT_BYTES >> 20),
        ));
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| Error::input_from(origin.clone(), "not UTF-8 text", e))?;
    Ok((origin, text))
}

/// Nesting initium reads in YAML: the YAML reader recurses, with large frames, so this is
/// lower than JSON's 128 (`serde_json`). Kubernetes objects stay far below either; an object
/// nested deeper than this can be given as JSON, and `apply -o json` writes it back.
pub const YAML_MAX_DEPTH: usize = 64;
/// Documents in one YAML file (a rendered chart can hold thousands).
const YAML_MAX_DOCUMENTS: usize = 100_000;
/// Nodes in one YAML file, aliases expanded (the guard against "billion laughs"): at most
/// [`YAML_NODES_PER_BYTE`] per byte of the file, at least [`YAML_MIN_NODES`], at most
/// [`YAML_MAX_NODES`]. A file without aliases has fewer nodes than bytes; with them, what it
/// expands to stays a small multiple of the file (1,865 bytes of nested aliases expanded to
/// 10 million values, 164 MB, under a fixed bound).
const YAML_MAX_NODES: usize = 2_000_000;
const YAML_MIN_NODES: usize = 100_000;
const YAML_NODES_PER_BYTE: usize = 8;

/// The most nodes a YAML text of `bytes` may expand to.
fn yaml_max_nodes(bytes: usize) -> usize {
    bytes
        .saturating_mul(YAML_NODES_PER_BYTE)
        .clamp(YAML_MIN_NODES, YAML_MAX_NODES)
}

fn yaml_options(bytes: usize) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = YAML_MAX_DEPTH;
    budget.max_documents = YAML_MAX_DOCUMENTS;
    budget.max_nodes = yaml_max_nodes(bytes);
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options
}

/// The YAML reader's error as a sentence: its limits and its advice to the programmer
/// ("set DuplicateKeyPolicy in Options") become what the person who wrote the file can do.
fn yaml_error(error: &serde_saphyr::Error, bytes: usize) -> String {
    use serde_saphyr::budget::BudgetBreach;
    let mut inner = error;
    while let serde_saphyr::Error::AliasError { error, .. }
    | serde_saphyr::Error::WithSnippet { error, .. } = inner
    {
        inner = error;
    }
    let serde_saphyr::Error::Budget { breach, .. } = inner else {
        return error.to_string().replace(
            ", set DuplicateKeyPolicy in Options if acceptable",
            "; a key may appear only once in a mapping",
        );
    };
    let at = match error.location() {
        Some(l) if l.line() > 0 => format!("line {} column {}: ", l.line(), l.column()),
        _ => String::new(),
    };
    let sentence = match breach {
        BudgetBreach::Depth { .. } => format!(
            "the YAML nests deeper than {YAML_MAX_DEPTH} levels, more than initium reads (as for JSON)"
        ),
        BudgetBreach::Documents { .. } => format!(
            "the file has more than {YAML_MAX_DOCUMENTS} YAML documents; split it into several files"
        ),
        BudgetBreach::Events { .. } => "the YAML is too large once its aliases (*name) are expanded; write the repeated parts out or split the file".to_string(),
        BudgetBreach::Nodes { .. } => format!(
            "the YAML has more than {} values once its aliases (*name) are expanded ({YAML_NODES_PER_BYTE} per byte of the file, at least {YAML_MIN_NODES}, at most {YAML_MAX_NODES}); write the repeated parts out or split the file",
            yaml_max_nodes(bytes)
        ),
        BudgetBreach::Aliases { .. }
        | BudgetBreach::Anchors { .. }
        | BudgetBreach::AliasAnchorRatio { .. }
        | BudgetBreach::MergeKeys { .. } => {
            "the YAML uses more anchors, aliases or merge keys than initium reads; write the repeated parts out".to_string()
        }
        _ => "the YAML is larger or more deeply built than initium reads; split the file or simplify it".to_string(),
    };
    format!("{at}{sentence}")
}

/// Parses the documents of one text: JSON when it starts with `{` or `[`, YAML otherwise.
/// Empty documents are skipped; a `kind: List` is replaced by its items.
pub fn parse_documents(origin: &str, text: &str) -> Result<Vec<Document>> {
    let trimmed = text.trim_start();
    let values: Vec<Value> = if trimmed.starts_with('{') || trimmed.starts_with('[') {
        let mut values = Vec::new();
        for v in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
            values.push(v.map_err(|e| Error::input_from(origin, "invalid JSON", e))?);
        }
        values
    } else {
        // The reader's own text is replaced, not kept as a cause: it speaks to programmers
        // ("set DuplicateKeyPolicy in Options") and [`yaml_error`] says it for the author.
        serde_saphyr::from_multiple_with_options::<Value>(text, yaml_options(text.len())).map_err(
            |e| {
                Error::input(
                    origin,
                    format!("invalid YAML: {}", yaml_error(&e, text.len())),
                )
            },
        )?
    };
    let many = values.len() > 1;
    let mut docs = Vec::new();
    for (i, value) in values.into_iter().enumerate() {
        let origin = if many {
            format!("{origin}#{}", i + 1)
        } else {
            origin.to_string()
        };
        push_document(origin, value, &mut docs)?;
    }
    Ok(docs)
}

fn push_document(origin: String, value: Value, docs: &mut Vec<Document>) -> Result<()> {
    match value {
        Value::Null => Ok(()),
        Value::Array(items) => {
            for (i, item) in items.into_iter().enumerate() {
                push_document(format!("{origin} [{i}]"), item, docs)?;
            }
            Ok(())
        }
        Value::Object(ref map) => {
            if depth(&value) > MAX_DEPTH {
                return Err(Error::input(
                    origin,
                    format!("nested deeper than {MAX_DEPTH} levels"),
                ));
            }
            let is_list = map
                .get("kind")
                .and_then(Value::as_str)
                .is_some_and(|k| k == "List" || k.ends_with("List"))
                && map.get("items").is_some_and(Value::is_array);
            if is_list {
                let Some(Value::Array(items)) = value.get("items").cloned() else {
                    return Ok(());
                };
                for (i, item) in items.into_iter().enumerate() {
                    push_document(format!("{origin} items[{i}]"), item, docs)?;
                }
                return Ok(());
            }
            docs.push(Document { origin, value });
            Ok(())
        }
        other => Err(Error::input(
            origin,
            format!(
                "expected an object (a Kubernetes resource), found {}",
                initium_engine::describe_value(&other)
            ),
        )),
    }
}

/// Depth of nesting, iteratively (no recursion, so any input is safe to measure).
fn depth(value: &Value) -> usize {
    let mut max = 0;
    let mut stack = vec![(value, 1usize)];
    while let Some((v, d)) = stack.pop() {
        max = max.max(d);
        match v {
            Value::Array(items) => stack.extend(items.iter().map(|i| (i, d + 1))),
            Value::Object(map) => stack.extend(map.values().map(|i| (i, d + 1))),
            _ => {}
        }
    }
    max
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn yaml_json_and_lists() {
        let docs = parse_documents(
            "t",
            "a: 1\n---\n---\nkind: List\napiVersion: v1\nitems:\n- {b: 2}\n- {c: 3}\n",
        )
        .unwrap();
        let origins: Vec<_> = docs.iter().map(|d| d.origin.as_str()).collect();
        assert_eq!(origins, vec!["t#1", "t#2 items[0]", "t#2 items[1]"]);
        let docs = parse_documents("j", "{\"a\": 1} {\"b\": 2}").unwrap();
        assert_eq!(docs.len(), 2);
        let docs = parse_documents("j", "[{\"a\": 1}, {\"b\": 2}]").unwrap();
        assert_eq!(docs[1].origin, "j [1]");
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        for (text, want) in [
            ("a: [1, 2", "invalid YAML"),
            ("{\"a\": ", "invalid JSON"),
            ("- 1\n- 2\n", "expected an object"),
            ("just text", "expected an object"),
        ] {
            let err = parse_documents("bad.yaml", text).unwrap_err().to_string();
            assert!(err.starts_with("bad.yaml"), "{err}");
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let deep = format!("{}1{}", "[".repeat(150), "]".repeat(150));
        let deep_obj = format!("{{\"a\":{deep}}}");
        let err = parse_documents("deep.json", &deep_obj)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid JSON") || err.contains("nested deeper"),
            "{err}"
        );
    }

    #[test]
    fn yaml_limits_are_sentences_not_library_wording() {
        let error = |text: &str| parse_documents("f.yaml", text).unwrap_err().to_string();
        let deep = format!("a: {}1{}", "[".repeat(100), "]".repeat(100));
        let e = error(&deep);
        assert!(e.contains("nests deeper than 64 levels"), "{e}");
        // 100,001 documents take a minute to read in a debug build: the breach is made here.
        let many = yaml_error(
            &serde_saphyr::Error::Budget {
                breach: serde_saphyr::budget::BudgetBreach::Documents { documents: 100_001 },
                location: serde_saphyr::Location::UNKNOWN,
            },
            100,
        );
        assert_eq!(
            many,
            "the file has more than 100000 YAML documents; split it into several files"
        );
        let mut laughs = vec!["a0: &a0 [x, x, x, x, x, x, x, x, x, x]".to_string()];
        for i in 1..12 {
            laughs.push(format!(
                "a{i}: &a{i} [{}]",
                vec![format!("*a{}", i - 1); 10].join(", ")
            ));
        }
        let e = error(&laughs.join("\n"));
        assert!(e.contains("once its aliases (*name) are expanded"), "{e}");
        // What a file may expand to grows with the file, so a short one expands little.
        let text = laughs[..7].join("\n");
        let e = error(&text);
        assert!(
            e.contains("the YAML has more than 100000 values once its aliases (*name) are expanded (8 per byte of the file"),
            "{e}"
        );
        assert_eq!(super::yaml_max_nodes(1 << 20), 2_000_000);
        assert_eq!(super::yaml_max_nodes(50_000), 400_000);
        let e = error("a: 1\na: 2\n");
        assert!(e.contains("a key may appear only once in a mapping"), "{e}");
        for e in [
            error(&deep),
            many,
            error(&laughs.join("\n")),
            error("a: 1\na: 2\n"),
        ] {
            assert!(
                !e.contains(" { ") && !e.contains("Options"),
                "library wording in {e}"
            );
        }
    }
}
