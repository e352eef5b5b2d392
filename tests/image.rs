//! The Dockerfile's promises, read statically (no container daemon is needed or used): every
//! base image is pinned by a full sha256 digest, the builder and the runtime share a Debian
//! release (the binary links the builder's glibc), and the image runs as a fixed, numeric,
//! non-root user by default.

use std::collections::BTreeMap;

const DOCKERFILE: &str = include_str!("../Dockerfile");

/// Instructions with continuation lines joined and comments dropped: (keyword, rest).
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && pending.is_empty()) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        let (keyword, rest) = pending.split_once(' ').unwrap_or((&pending, ""));
        out.push((keyword.to_ascii_uppercase(), rest.trim().to_string()));
        pending.clear();
    }
    out
}

/// The base image of each FROM, `${ARG}` replaced by the ARG's default.
fn base_images(text: &str) -> Vec<String> {
    let mut args = BTreeMap::new();
    let mut stages = Vec::new();
    let mut bases = Vec::new();
    for (keyword, rest) in instructions(text) {
        match keyword.as_str() {
            "ARG" => {
                if let Some((name, default)) = rest.split_once('=') {
                    args.insert(name.to_string(), default.to_string());
                }
            }
            "FROM" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                let mut image = words[0].to_string();
                for (name, value) in &args {
                    image = image.replace(&format!("${{{name}}}"), value);
                }
                // A FROM of an earlier stage is not a base image.
                if !stages.contains(&image) {
                    bases.push(image);
                }
                if let [_, as_kw, stage] = words[..]
                    && as_kw.eq_ignore_ascii_case("as")
                {
                    stages.push(stage.to_string());
                }
            }
            _ => {}
        }
    }
    bases
}

fn is_sha256_digest(image: &str) -> bool {
    image.split_once("@sha256:").is_some_and(|(name, hex)| {
        !name.is_empty()
            && hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[test]
fn every_base_image_is_pinned_by_digest() {
    let bases = base_images(DOCKERFILE);
    assert_eq!(bases.len(), 2, "a builder and a runtime base: {bases:?}");
    for image in &bases {
        assert!(
            is_sha256_digest(image),
            "{image} is not pinned by a sha256 digest"
        );
        assert!(!image.contains("${"), "{image}: an ARG without a default");
    }
}

#[test]
fn builder_and_runtime_share_a_debian_release() {
    let bases = base_images(DOCKERFILE);
    let release = |image: &str| {
        ["bookworm", "trixie", "bullseye"]
            .into_iter()
            .find(|r| image.split('@').next().unwrap().contains(r))
    };
    let releases: Vec<_> = bases.iter().map(|b| release(b)).collect();
    assert!(releases[0].is_some(), "{bases:?}");
    assert_eq!(releases[0], releases[1], "{bases:?}");
}

#[test]
fn the_image_runs_as_a_fixed_non_root_user() {
    let users: Vec<String> = instructions(DOCKERFILE)
        .into_iter()
        .filter(|(k, _)| k == "USER")
        .map(|(_, v)| v)
        .collect();
    let last = users.last().expect("a USER instruction");
    let (uid, gid) = last.split_once(':').unwrap_or((last, last));
    let uid: u32 = uid.parse().expect("a numeric uid");
    let gid: u32 = gid.parse().expect("a numeric gid");
    assert!(uid != 0 && gid != 0, "USER {last} is root");
}

#[test]
fn the_checks_see_an_unpinned_or_root_image() {
    let unpinned = DOCKERFILE.replace(
        "debian:bookworm-20260918-slim@sha256:",
        "debian:bookworm-slim#",
    );
    assert!(
        base_images(&unpinned).iter().any(|b| !is_sha256_digest(b)),
        "an unpinned base is noticed"
    );
    let from_stage = format!("{DOCKERFILE}\nFROM build AS again\n");
    assert_eq!(base_images(&from_stage).len(), 2, "a stage is not a base");
    assert!(!is_sha256_digest("debian@sha256:abc"));
    assert!(!is_sha256_digest(&format!(
        "debian@sha256:{}",
        "G".repeat(64)
    )));
}
