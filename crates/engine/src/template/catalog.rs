//! The functions templates can call, by name and signature: what the parser knows of them.
//! What each does is in `functions.rs`.

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Function {
    Base64Decode,
    Base64Encode,
    Default,
    FromJson,
    Image,
    Join,
    Lower,
    Replace,
    Sha256,
    Split,
    ToJson,
    Trim,
    TrimPrefix,
    TrimSuffix,
    Upper,
}

/// Every function with its name and how it is called, alphabetically (as errors list them).
const FUNCTIONS: [(Function, &str, &str); 15] = [
    (Function::Base64Decode, "base64Decode", "base64Decode(s)"),
    (Function::Base64Encode, "base64Encode", "base64Encode(s)"),
    (Function::Default, "default", "default(value, fallback)"),
    (Function::FromJson, "fromJson", "fromJson(s)"),
    (Function::Image, "image", "image(s)"),
    (Function::Join, "join", "join(separator, list)"),
    (Function::Lower, "lower", "lower(s)"),
    (
        Function::Replace,
        "replace",
        "replace(s, 'regex', replacement)",
    ),
    (Function::Sha256, "sha256", "sha256(s)"),
    (Function::Split, "split", "split(s, separator)"),
    (Function::ToJson, "toJson", "toJson(value)"),
    (Function::Trim, "trim", "trim(s)"),
    (Function::TrimPrefix, "trimPrefix", "trimPrefix(s, prefix)"),
    (Function::TrimSuffix, "trimSuffix", "trimSuffix(s, suffix)"),
    (Function::Upper, "upper", "upper(s)"),
];

impl Function {
    pub fn named(name: &str) -> Option<Function> {
        FUNCTIONS
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(f, _, _)| *f)
    }

    fn entry(self) -> (&'static str, &'static str) {
        FUNCTIONS
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or(("?", "?"), |(_, name, signature)| (name, signature))
    }

    pub fn name(self) -> &'static str {
        self.entry().0
    }

    pub fn signature(self) -> &'static str {
        self.entry().1
    }

    pub fn arity(self) -> usize {
        match self {
            Function::Replace => 3,
            Function::Default
            | Function::Join
            | Function::Split
            | Function::TrimPrefix
            | Function::TrimSuffix => 2,
            _ => 1,
        }
    }

    /// `base64Decode(s), base64Encode(s), ...`: for the message about an unknown function.
    pub fn list() -> String {
        FUNCTIONS
            .iter()
            .map(|(_, _, signature)| *signature)
            .collect::<Vec<_>>()
            .join(", ")
    }
}
