//! Container image references, read as Docker and Kubernetes read them (the grammar of
//! `distribution/reference`, normalized as `docker pull` does):
//!
//! ```text
//! reference  := name [ ":" tag ] [ "@" digest ]
//! name       := [ registry "/" ] repository
//! registry   := host [ ":" port ]          (a first segment with a '.' or ':', or localhost)
//! repository := component ( "/" component )*, component := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
//! tag        := [A-Za-z0-9_] [A-Za-z0-9_.-]{0,127}
//! digest     := algorithm ":" [0-9a-fA-F]{32,}
//! ```
//!
//! Without a registry the image is on Docker Hub (`docker.io`), and a one-segment Docker Hub
//! repository is an official image (`nginx` is `docker.io/library/nginx`); `index.docker.io`
//! is `docker.io`. Without a tag or a digest the tag is `latest`.

#[derive(Debug, PartialEq)]
pub(super) struct ImageRef {
    pub registry: String,
    pub repository: String,
    /// The repository's last segment (`nginx` of `library/nginx`).
    pub name: String,
    /// Empty when the reference has a digest and no tag.
    pub tag: String,
    /// Empty when there is none.
    pub digest: String,
}

const DOCKER_HUB: &str = "docker.io";

/// Reads an image reference, or says what is wrong with it.
pub(super) fn parse(text: &str) -> Result<ImageRef, String> {
    if text.is_empty() {
        return Err("it is empty".into());
    }
    let (rest, digest) = match text.split_once('@') {
        Some((rest, digest)) => {
            check_digest(digest)?;
            (rest, digest)
        }
        None => (text, ""),
    };
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => {
            let tag = &rest[last_slash + i + 1..];
            check_tag(tag)?;
            (&rest[..last_slash + i], tag)
        }
        None => (rest, ""),
    };
    if name.len() > 255 {
        return Err("the name is longer than 255 characters".into());
    }
    let (registry, repository) = match name.split_once('/') {
        Some((first, rest))
            if first.contains(['.', ':'])
                || first == "localhost"
                || first.chars().any(|c| c.is_ascii_uppercase()) =>
        {
            check_registry(first)?;
            let first = if first == "index.docker.io" {
                DOCKER_HUB
            } else {
                first
            };
            (first, rest.to_string())
        }
        _ => (DOCKER_HUB, name.to_string()),
    };
    let repository = if registry == DOCKER_HUB && !repository.contains('/') {
        format!("library/{repository}")
    } else {
        repository
    };
    for component in repository.split('/') {
        check_component(component)?;
    }
    let tag = if tag.is_empty() && digest.is_empty() {
        "latest"
    } else {
        tag
    };
    Ok(ImageRef {
        registry: registry.to_string(),
        name: repository
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string(),
        repository,
        tag: tag.to_string(),
        digest: digest.to_string(),
    })
}

fn check_digest(digest: &str) -> Result<(), String> {
    let bad = || format!("{digest:?} is not a digest (algorithm:hex, like sha256:0123…)");
    let (algorithm, hex) = digest.split_once(':').ok_or_else(bad)?;
    let algorithm_ok = algorithm.split(['+', '.', '_', '-']).all(|part| {
        part.starts_with(|c: char| c.is_ascii_alphabetic())
            && part.chars().all(|c| c.is_ascii_alphanumeric())
    });
    if !algorithm_ok || hex.len() < 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad());
    }
    Ok(())
}

fn check_tag(tag: &str) -> Result<(), String> {
    let valid = (1..=128).contains(&tag.len())
        && tag.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "the tag {tag:?} is not 1 to 128 letters, digits, '_', '.' and '-' (not starting with '.' or '-')"
        ))
    }
}

fn check_registry(registry: &str) -> Result<(), String> {
    let bad = || format!("the registry {registry:?} is not a host name with an optional :port");
    let (host, port) = match registry.strip_prefix('[') {
        // An IPv6 address: [::1]:5000
        Some(v6) => {
            let (address, after) = v6.split_once(']').ok_or_else(bad)?;
            if address.is_empty() || !address.chars().all(|c| c.is_ascii_hexdigit() || c == ':') {
                return Err(bad());
            }
            match after.strip_prefix(':') {
                Some(port) => (None, Some(port)),
                None if after.is_empty() => (None, None),
                None => return Err(bad()),
            }
        }
        None => match registry.split_once(':') {
            Some((host, port)) => (Some(host), Some(port)),
            None => (Some(registry), None),
        },
    };
    if let Some(host) = host {
        let label_ok = |label: &str| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        if !host.split('.').all(label_ok) {
            return Err(bad());
        }
    }
    if port.is_some_and(|p| p.is_empty() || !p.chars().all(|c| c.is_ascii_digit())) {
        return Err(bad());
    }
    Ok(())
}

fn check_component(component: &str) -> Result<(), String> {
    if component.chars().any(|c| c.is_ascii_uppercase()) {
        return Err(format!(
            "the repository segment {component:?} has upper-case letters; repositories are lower case"
        ));
    }
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    let mut valid = component.starts_with(alnum) && component.ends_with(alnum);
    // Between runs of letters and digits: ".", "_", "__" or any number of "-".
    for separator in component.split(alnum).filter(|s| !s.is_empty()) {
        valid &= matches!(separator, "." | "_" | "__") || separator.chars().all(|c| c == '-');
    }
    if valid {
        Ok(())
    } else {
        Err(format!(
            "the repository segment {component:?} is not lower-case letters and digits separated by '.', '_', '__' or '-'"
        ))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn parts(text: &str) -> [String; 5] {
        let r = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        [r.registry, r.repository, r.name, r.tag, r.digest]
    }

    #[test]
    fn references_are_normalized_as_docker_pull_does() {
        let digest = format!("sha256:{}", "a".repeat(64));
        let cases: [(&str, [&str; 5]); 9] = [
            (
                "nginx",
                ["docker.io", "library/nginx", "nginx", "latest", ""],
            ),
            (
                "nginx:1.25",
                ["docker.io", "library/nginx", "nginx", "1.25", ""],
            ),
            (
                "bitnami/redis:7",
                ["docker.io", "bitnami/redis", "redis", "7", ""],
            ),
            (
                "index.docker.io/nginx",
                ["docker.io", "library/nginx", "nginx", "latest", ""],
            ),
            (
                "ghcr.io/org/team/app:v1",
                ["ghcr.io", "org/team/app", "app", "v1", ""],
            ),
            (
                "localhost:5000/app",
                ["localhost:5000", "app", "app", "latest", ""],
            ),
            ("localhost/app:dev", ["localhost", "app", "app", "dev", ""]),
            (
                "[::1]:5000/a_b/c__d-e",
                ["[::1]:5000", "a_b/c__d-e", "c__d-e", "latest", ""],
            ),
            (
                "registry.k8s.io/pause",
                ["registry.k8s.io", "pause", "pause", "latest", ""],
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parts(text), want.map(String::from), "{text}");
        }
        assert_eq!(
            parts(&format!("quay.io/a/b@{digest}")),
            ["quay.io", "a/b", "b", "", digest.as_str()].map(String::from)
        );
        assert_eq!(
            parts(&format!("nginx:1.25@{digest}")),
            [
                "docker.io",
                "library/nginx",
                "nginx",
                "1.25",
                digest.as_str()
            ]
            .map(String::from)
        );
    }

    #[test]
    fn invalid_references_say_what_is_wrong() {
        for (text, problem) in [
            ("", "it is empty"),
            ("Nginx", "upper-case"),
            ("nginx:", "the tag \"\""),
            ("nginx:-x", "the tag \"-x\""),
            ("a/b..c", "is not lower-case letters"),
            ("nginx@sha256:abc", "is not a digest"),
            ("my_host.io:x/app", "is not a host name"),
            ("a//b", "\"\""),
        ] {
            let error = parse(text).expect_err(text);
            assert!(error.contains(problem), "{text}: {error}");
        }
    }
}
