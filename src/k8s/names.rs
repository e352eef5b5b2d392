//! Kubernetes object-name rules the bridge checks before it sends a name to the API.

/// A DNS-1123 label: namespaces, and each dot-separated part of a subdomain.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 subdomain as Kubernetes checks object names (StorageClasses, Secrets):
/// at most 253 bytes of dot-separated parts, each `[a-z0-9-]` with alphanumeric ends
/// (Kubernetes does not apply DNS's 63-byte limit to the parts).
pub fn is_dns_subdomain(s: &str) -> bool {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !p.starts_with('-')
            && !p.ends_with('-')
    };
    s.len() <= 253 && s.split('.').all(part_ok)
}

/// `s` in the characters of a DNS-1123 name: lowercased, anything outside `[a-z0-9-]`
/// made `-` (the caller trims and bounds it).
pub fn dns_name_chars(s: &str) -> String {
    s.chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .collect()
}

/// A label value (non-empty form): `[A-Za-z0-9._-]`, alphanumeric at both ends.
pub fn is_label_value(s: &str) -> bool {
    let alnum = |c: Option<u8>| c.is_some_and(|b| b.is_ascii_alphanumeric());
    s.len() <= 63
        && alnum(s.bytes().next())
        && alnum(s.bytes().last())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_dns_subdomain("csi.example.com") && !is_dns_subdomain("a..b"));
        assert!(is_label_value("nfs.csi_1") && !is_label_value("_x"));
        assert!(is_dns_label("cube-system") && !is_dns_label("Cube"));
    }
}
