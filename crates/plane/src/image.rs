//! `image` (scripts/image): initium's image and the test toolbox as OCI archives, built
//! without a daemon, and imported into the plane's real node when one runs.
//!
//! initium's image is what deploy/Dockerfile describes, read from it: the final stage's
//! `COPY` destination, `USER` and `ENTRYPOINT` are taken from the file, so the two cannot
//! drift apart, and a test checks that the Dockerfile builds with the same target and static
//! linking as scripts/image.

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::log::log;
use crate::oci::{File, Image};
use crate::process;
use crate::realnode;
use crate::settings::{REAL_NODE, Settings};

pub(crate) const INITIUM_IMAGE: &str = "docker.io/library/initium:dev";
pub(crate) const TOOLBOX_IMAGE: &str = "docker.io/library/toolbox:dev";

/// The busybox applets the toolbox links: a POSIX shell, cat, sleep, a TCP client (nc) and a
/// few more that test workloads use.
const APPLETS: [&str; 22] = [
    "sh", "cat", "sleep", "nc", "echo", "ls", "wget", "true", "false", "test", "date", "mkdir",
    "env", "printf", "grep", "head", "id", "hostname", "timeout", "tail", "wc", "rm",
];

/// What deploy/Dockerfile's final stage says of the image.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Described {
    pub(crate) binary: String,
    pub(crate) user: String,
    pub(crate) entrypoint: Vec<String>,
}

/// Reads the final stage of a Dockerfile: its `COPY` destination, `USER` and exec-form
/// `ENTRYPOINT`.
pub(crate) fn describe(dockerfile: &str) -> Result<Described> {
    let last_stage = dockerfile
        .rsplit_once("\nFROM ")
        .map(|(_, stage)| stage)
        .context("deploy/Dockerfile has no final FROM stage")?;
    let mut binary = None;
    let mut user = None;
    let mut entrypoint = None;
    for line in last_stage.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("COPY ") {
            binary = rest.split_whitespace().last().map(str::to_owned);
        } else if let Some(rest) = line.strip_prefix("USER ") {
            user = Some(rest.trim().to_owned());
        } else if let Some(rest) = line.strip_prefix("ENTRYPOINT ") {
            let parsed: Vec<String> = serde_json::from_str(rest.trim()).with_context(|| {
                format!("deploy/Dockerfile's ENTRYPOINT is not in exec form (a JSON list): {rest}")
            })?;
            entrypoint = Some(parsed);
        }
    }
    Ok(Described {
        binary: binary.context("deploy/Dockerfile's final stage copies no binary")?,
        user: user.context("deploy/Dockerfile's final stage sets no USER")?,
        entrypoint: entrypoint.context("deploy/Dockerfile's final stage has no ENTRYPOINT")?,
    })
}

/// The command `image --binary PATH --out DIR`.
pub(crate) fn build(settings: &Settings, dir: &Path, binary: &Path, out: &Path) -> Result<()> {
    let dockerfile = settings.wrappers.join("../../deploy/Dockerfile");
    let text = std::fs::read_to_string(&dockerfile)
        .with_context(|| format!("cannot read {}", dockerfile.display()))?;
    let described = describe(&text)?;
    if described.entrypoint.first() != Some(&described.binary) {
        bail!(
            "deploy/Dockerfile copies the binary to {} but its ENTRYPOINT runs {:?}; make them one path",
            described.binary,
            described.entrypoint
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let initium = out.join("initium.tar");
    Image {
        name: INITIUM_IMAGE,
        files: vec![File::from_disk(
            described.binary.trim_start_matches('/'),
            binary,
            0o755,
        )?],
        user: &described.user,
        entrypoint: described.entrypoint.clone(),
        cmd: Vec::new(),
        env: Vec::new(),
    }
    .write(&initium)?;
    log(format_args!(
        "wrote {} ({INITIUM_IMAGE})",
        initium.display()
    ));

    let busybox = settings.bin("busybox");
    if !busybox.is_file() {
        bail!(
            "{} is missing; build it with: scripts/control-plane build --real-node",
            busybox.display()
        );
    }
    let mut files = vec![
        File::directory("bin", 0o755),
        File::from_disk("bin/busybox", &busybox, 0o755)?,
        File::directory("tmp", 0o1777),
    ];
    files.extend(
        APPLETS
            .iter()
            .map(|applet| File::symlink(&format!("bin/{applet}"), "busybox")),
    );
    let toolbox = out.join("toolbox.tar");
    Image {
        name: TOOLBOX_IMAGE,
        files,
        user: "65534:65534",
        entrypoint: Vec::new(),
        cmd: vec!["sh".to_owned()],
        env: vec!["PATH=/bin".to_owned()],
    }
    .write(&toolbox)?;
    log(format_args!(
        "wrote {} ({TOOLBOX_IMAGE})",
        toolbox.display()
    ));

    if crate::launch::is_real_node(dir) && process::running(dir, REAL_NODE).is_some() {
        for archive in [&initium, &toolbox] {
            realnode::import_image(settings, dir, archive)?;
        }
        log(format_args!(
            "imported initium:dev and toolbox:dev into the real node of {}",
            dir.display()
        ));
    } else {
        log(format_args!(
            "no real node runs in {}; import the archives with `ctr -n k8s.io images import` or `skopeo copy oci-archive:...`",
            dir.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn dockerfile() -> String {
        std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/Dockerfile"),
        )
        .unwrap()
    }

    /// scripts/image takes these from deploy/Dockerfile; this pins what they are, so that a
    /// change to the Dockerfile is a change to the image both ways build.
    #[test]
    fn the_dockerfile_describes_the_image_scripts_image_builds() {
        let described = describe(&dockerfile()).unwrap();
        assert_eq!(
            described,
            Described {
                binary: "/initium".to_owned(),
                user: "65532:65532".to_owned(),
                entrypoint: vec!["/initium".to_owned()],
            }
        );
    }

    /// The Dockerfile builds the binary as scripts/image does: the same target, linked
    /// statically the same way.
    #[test]
    fn the_dockerfile_builds_the_binary_as_scripts_image_does() {
        let text = dockerfile();
        let script = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/image"),
        )
        .unwrap();
        for needle in ["x86_64-unknown-linux-gnu", "target-feature=+crt-static"] {
            assert!(text.contains(needle), "deploy/Dockerfile lacks {needle}");
            assert!(script.contains(needle), "scripts/image lacks {needle}");
        }
    }

    #[test]
    fn a_dockerfile_without_an_exec_form_entrypoint_is_refused() {
        let error = describe("FROM a AS b\nFROM scratch\nCOPY x /x\nUSER 1\nENTRYPOINT /x\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("exec form"), "{error}");
    }
}
