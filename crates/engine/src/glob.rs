//! Shell-style globs (`*` any run, `?` one character) for names, namespaces and annotation
//! values. Compiled once; matching allocates nothing.

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glob {
    pattern: Vec<char>,
    literal: bool,
}

impl Glob {
    pub fn new(pattern: &str) -> Glob {
        Glob {
            pattern: pattern.chars().collect(),
            literal: !pattern.contains(['*', '?']),
        }
    }

    /// The pattern, when it has no wildcard (lets the index key on it).
    pub fn literal(&self) -> Option<String> {
        self.literal.then(|| self.pattern.iter().collect())
    }

    /// The characters before the first wildcard: every text it matches starts with them.
    pub fn literal_prefix(&self) -> String {
        self.pattern
            .iter()
            .take_while(|c| !matches!(c, '*' | '?'))
            .collect()
    }

    /// The characters after the last wildcard: every text it matches ends with them.
    pub fn literal_suffix(&self) -> String {
        let start = self
            .pattern
            .iter()
            .rposition(|c| matches!(c, '*' | '?'))
            .map_or(0, |at| at + 1);
        self.pattern[start..].iter().collect()
    }

    pub fn matches(&self, text: &str) -> bool {
        if self.literal {
            return self.pattern.iter().copied().eq(text.chars());
        }
        let text: Vec<char> = text.chars().collect();
        // Iterative wildcard matching with single backtrack point: linear in practice,
        // O(n*m) worst case, no recursion.
        let (mut p, mut t) = (0usize, 0usize);
        let mut star: Option<(usize, usize)> = None;
        while t < text.len() {
            match self.pattern.get(p) {
                Some('*') => {
                    star = Some((p, t));
                    p += 1;
                }
                Some('?') => {
                    p += 1;
                    t += 1;
                }
                Some(c) if *c == text[t] => {
                    p += 1;
                    t += 1;
                }
                _ => match star {
                    Some((sp, st)) => {
                        p = sp + 1;
                        t = st + 1;
                        star = Some((sp, st + 1));
                    }
                    None => return false,
                },
            }
        }
        self.pattern[p..].iter().all(|c| *c == '*')
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::Glob;

    #[test]
    fn globs() {
        let cases = [
            ("web-*", "web-1", true),
            ("web-*", "web-", true),
            ("web-*", "api-1", false),
            ("*", "", true),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("*-prod-*", "team-prod-eu", true),
            ("*-prod-*", "team-prodeu", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            ("a*b*c", "aXbYbZc", true),
            ("a*b*c", "aXbYbZ", false),
        ];
        for (pattern, text, want) in cases {
            assert_eq!(Glob::new(pattern).matches(text), want, "{pattern} ~ {text}");
        }
        assert_eq!(
            Glob::new("kube-system").literal().as_deref(),
            Some("kube-system")
        );
        assert_eq!(Glob::new("team-*").literal(), None);
    }

    #[test]
    fn affixes_are_what_every_match_starts_and_ends_with() {
        let affixes = |p: &str| {
            let g = Glob::new(p);
            (g.literal_prefix(), g.literal_suffix())
        };
        assert_eq!(affixes("web-*"), ("web-".into(), String::new()));
        assert_eq!(affixes("*-canary"), (String::new(), "-canary".into()));
        assert_eq!(affixes("a?b*c"), ("a".into(), "c".into()));
        assert_eq!(affixes("exact"), ("exact".into(), "exact".into()));
        assert_eq!(affixes("*"), (String::new(), String::new()));
    }
}
