//! OCI image archives without a daemon: one uncompressed layer written as a tar, its config
//! and manifest, in an OCI image layout packed as a tar (what `ctr images import` and
//! `skopeo copy oci-archive:` read). Used for the pause image, initium's image and the test
//! toolbox (`scripts/image`).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::json;

/// One entry of the layer.
pub(crate) struct File {
    /// Inside the image, without a leading slash (`initium`, `bin/sh`).
    pub(crate) path: String,
    pub(crate) kind: Kind,
}

pub(crate) enum Kind {
    Regular { contents: Vec<u8>, mode: u32 },
    Symlink(String),
    Directory { mode: u32 },
}

impl File {
    pub(crate) fn from_disk(path: &str, source: &Path, mode: u32) -> Result<File> {
        let contents =
            std::fs::read(source).with_context(|| format!("cannot read {}", source.display()))?;
        Ok(File {
            path: path.to_owned(),
            kind: Kind::Regular { contents, mode },
        })
    }

    pub(crate) fn symlink(path: &str, target: &str) -> File {
        File {
            path: path.to_owned(),
            kind: Kind::Symlink(target.to_owned()),
        }
    }

    pub(crate) fn directory(path: &str, mode: u32) -> File {
        File {
            path: path.to_owned(),
            kind: Kind::Directory { mode },
        }
    }
}

/// An image of one layer.
pub(crate) struct Image<'a> {
    /// Its full reference, as containerd names it (`docker.io/library/initium:dev`).
    pub(crate) name: &'a str,
    pub(crate) files: Vec<File>,
    /// `UID:GID`.
    pub(crate) user: &'a str,
    pub(crate) entrypoint: Vec<String>,
    pub(crate) cmd: Vec<String>,
    pub(crate) env: Vec<String>,
}

fn sha256(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A ustar archive, built in memory (the images are small: initium's binary is the largest
/// file). Times are 0 so that the same inputs give the same digests.
#[derive(Default)]
struct Tar {
    bytes: Vec<u8>,
}

impl Tar {
    fn entry(&mut self, path: &str, typeflag: u8, mode: u32, link: &str, contents: &[u8]) {
        let mut header = [0u8; 512];
        let put = |header: &mut [u8; 512], at: usize, len: usize, value: &[u8]| {
            let n = value.len().min(len);
            header[at..at + n].copy_from_slice(&value[..n]);
        };
        let octal = |value: u64, width: usize| format!("{value:0w$o}\0", w = width - 1);
        // ustar splits long names into a prefix and a name; the images' paths are short.
        let (prefix, name) = if path.len() > 100 {
            path.rsplit_once('/').unwrap_or(("", path))
        } else {
            ("", path)
        };
        put(&mut header, 0, 100, name.as_bytes());
        put(&mut header, 100, 8, octal(u64::from(mode), 8).as_bytes());
        put(&mut header, 108, 8, octal(0, 8).as_bytes());
        put(&mut header, 116, 8, octal(0, 8).as_bytes());
        put(
            &mut header,
            124,
            12,
            octal(contents.len() as u64, 12).as_bytes(),
        );
        put(&mut header, 136, 12, octal(0, 12).as_bytes());
        put(&mut header, 148, 8, b"        ");
        header[156] = typeflag;
        put(&mut header, 157, 100, link.as_bytes());
        put(&mut header, 257, 6, b"ustar\0");
        put(&mut header, 263, 2, b"00");
        put(&mut header, 345, 155, prefix.as_bytes());
        let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
        put(&mut header, 148, 8, format!("{sum:06o}\0 ").as_bytes());
        self.bytes.extend_from_slice(&header);
        self.bytes.extend_from_slice(contents);
        let pad = (512 - contents.len() % 512) % 512;
        self.bytes.extend(std::iter::repeat_n(0, pad));
    }

    fn file(&mut self, path: &str, contents: &[u8]) {
        self.entry(path, b'0', 0o644, "", contents);
    }

    fn finish(mut self) -> Vec<u8> {
        self.bytes.extend(std::iter::repeat_n(0, 1024));
        self.bytes
    }
}

impl Image<'_> {
    /// The layer, its config, manifest and index, as an OCI archive at `out` (written under
    /// a temporary name, then renamed).
    pub(crate) fn write(&self, out: &Path) -> Result<()> {
        let mut layer = Tar::default();
        for file in &self.files {
            match &file.kind {
                Kind::Regular { contents, mode } => {
                    layer.entry(&file.path, b'0', *mode, "", contents);
                }
                Kind::Symlink(target) => layer.entry(&file.path, b'2', 0o777, target, &[]),
                Kind::Directory { mode } => {
                    layer.entry(&format!("{}/", file.path), b'5', *mode, "", &[]);
                }
            }
        }
        let layer = layer.finish();
        let layer_digest = sha256(&layer);
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "User": self.user,
                "Entrypoint": if self.entrypoint.is_empty() { None } else { Some(&self.entrypoint) },
                "Cmd": if self.cmd.is_empty() { None } else { Some(&self.cmd) },
                "Env": self.env,
            },
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
            "history": [{"created_by": "initium's scripts/image (crates/plane/src/oci.rs)"}],
        }))?;
        let config_digest = sha256(&config);
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": format!("sha256:{config_digest}"),
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": format!("sha256:{layer_digest}"),
                "size": layer.len(),
            }],
        }))?;
        let manifest_digest = sha256(&manifest);
        let tag = self.name.rsplit_once(':').map_or("latest", |(_, tag)| tag);
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{manifest_digest}"),
                "size": manifest.len(),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": self.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }],
        }))?;
        let mut archive = Tar::default();
        archive.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
        archive.file("index.json", &index);
        archive.entry("blobs/", b'5', 0o755, "", &[]);
        archive.entry("blobs/sha256/", b'5', 0o755, "", &[]);
        for (digest, blob) in [
            (&layer_digest, &layer),
            (&config_digest, &config),
            (&manifest_digest, &manifest),
        ] {
            archive.file(&format!("blobs/sha256/{digest}"), blob);
        }
        let bytes = archive.finish();
        let tmp = out.with_extension(format!("tmp.{}", std::process::id()));
        let mut file = std::fs::File::create(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        file.write_all(&bytes)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        drop(file);
        std::fs::rename(&tmp, out)
            .with_context(|| format!("cannot move {} into place", out.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// `tar -t` (GNU tar) reads what Tar writes: names, links and sizes.
    #[test]
    fn tar_lists_the_archive() {
        let mut tar = Tar::default();
        tar.file("a/b.txt", b"hello");
        tar.entry("bin/sh", b'2', 0o777, "busybox", &[]);
        tar.entry("dir/", b'5', 0o755, "", &[]);
        let path = std::env::temp_dir().join(format!("oci-tar-{}.tar", std::process::id()));
        std::fs::write(&path, tar.finish()).unwrap();
        let listing = std::process::Command::new("tar")
            .arg("-tvf")
            .arg(&path)
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&path);
        let text = String::from_utf8_lossy(&listing.stdout);
        assert!(
            listing.status.success(),
            "{}",
            String::from_utf8_lossy(&listing.stderr)
        );
        assert!(text.contains("a/b.txt"), "{text}");
        assert!(text.contains(" 5 "), "the size of a/b.txt: {text}");
        assert!(text.contains("bin/sh -> busybox"), "{text}");
        assert!(text.contains("dir/"), "{text}");
    }
}
