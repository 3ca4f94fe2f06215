//! Kind patterns: `Kind`, `version/Kind` (core group) or `group/version/Kind`, `*` per segment.

use std::fmt;

/// The group, version and kind of an object (`""` is the core group).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gvk {
    pub group: String,
    pub version: String,
    pub kind: String,
}

impl Gvk {
    pub fn new(group: &str, version: &str, kind: &str) -> Gvk {
        Gvk {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
        }
    }

    /// From an object's `apiVersion` (`v1`, `apps/v1`) and `kind`.
    pub fn from_api_version(api_version: &str, kind: &str) -> Gvk {
        match api_version.split_once('/') {
            Some((group, version)) => Gvk::new(group, version, kind),
            None => Gvk::new("", api_version, kind),
        }
    }

    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

impl fmt::Display for Gvk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.api_version(), self.kind)
    }
}

/// One segment of a kind pattern.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Segment {
    Any,
    Exact(String),
}

impl Segment {
    fn matches(&self, value: &str) -> bool {
        match self {
            Segment::Any => true,
            Segment::Exact(s) => s == value,
        }
    }

    pub fn exact(&self) -> Option<&str> {
        match self {
            Segment::Any => None,
            Segment::Exact(s) => Some(s),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KindPattern {
    pub group: Segment,
    pub version: Segment,
    pub kind: Segment,
}

impl KindPattern {
    pub fn parse(text: &str) -> Result<KindPattern, KindError> {
        let parts: Vec<&str> = text.split('/').collect();
        let (group, version, kind) = match parts.as_slice() {
            [kind] => ("*", "*", *kind),
            [version, kind] => ("", *version, *kind),
            [group, version, kind] => (*group, *version, *kind),
            _ => {
                return Err(KindError::Shape {
                    text: text.to_string(),
                });
            }
        };
        let segment = |s: &str| {
            if s == "*" {
                Segment::Any
            } else {
                Segment::Exact(s.to_string())
            }
        };
        if kind != "*"
            && !(kind.starts_with(|c: char| c.is_ascii_uppercase())
                && kind.chars().all(|c| c.is_ascii_alphanumeric()))
        {
            return Err(KindError::Kind {
                text: text.to_string(),
                kind: kind.to_string(),
            });
        }
        let version_ok = version == "*"
            || (!version.is_empty()
                && version
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        if !version_ok {
            return Err(KindError::Version {
                text: text.to_string(),
                version: version.to_string(),
            });
        }
        let group_ok = group == "*"
            || (parts.len() == 2 && group.is_empty())
            || (!group.is_empty()
                && group.len() <= 253
                && group
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'));
        if !group_ok {
            return Err(KindError::Group {
                text: text.to_string(),
                group: group.to_string(),
            });
        }
        Ok(KindPattern {
            group: segment(group),
            version: segment(version),
            kind: segment(kind),
        })
    }

    pub fn matches(&self, gvk: &Gvk) -> bool {
        self.kind.matches(&gvk.kind)
            && self.version.matches(&gvk.version)
            && self.group.matches(&gvk.group)
    }
}

/// A kind pattern of a rule that is not one.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    #[error("invalid kind {text:?}: use Kind, version/Kind or group/version/Kind")]
    Shape { text: String },
    #[error("invalid kind {text:?}: {kind:?} is not a Kind name (like Pod or Deployment) or *")]
    Kind { text: String, kind: String },
    #[error("invalid kind {text:?}: {version:?} is not an API version (like v1) or *")]
    Version { text: String, version: String },
    #[error("invalid kind {text:?}: {group:?} is not an API group (like apps) or *")]
    Group { text: String, group: String },
}

impl fmt::Display for KindPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |s: &Segment| s.exact().unwrap_or("*").to_string();
        write!(
            f,
            "{}/{}/{}",
            s(&self.group),
            s(&self.version),
            s(&self.kind)
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn kind_forms() {
        let pod = Gvk::new("", "v1", "Pod");
        let deploy = Gvk::new("apps", "v1", "Deployment");
        let m = |p: &str, g: &Gvk| KindPattern::parse(p).unwrap().matches(g);
        assert!(m("Pod", &pod));
        assert!(m("v1/Pod", &pod));
        assert!(!m("v2/Pod", &pod));
        assert!(m("*/Pod", &pod));
        assert!(m("*", &deploy));
        assert!(m("apps/v1/Deployment", &deploy));
        assert!(m("apps/*/Deployment", &deploy));
        assert!(m("*/*/Deployment", &deploy));
        assert!(
            !m("v1/Deployment", &deploy),
            "two segments mean the core group"
        );
        assert!(!m("batch/v1/Deployment", &deploy));
    }

    #[test]
    fn bad_kinds() {
        for bad in [
            "",
            "pod",
            "a/b/c/d",
            "apps/v1/",
            "Apps/v1/Deployment",
            "V1/Pod",
            "apps/v1/Pod-x",
        ] {
            assert!(
                KindPattern::parse(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }
}
