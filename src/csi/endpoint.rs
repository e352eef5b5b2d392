//! Where a CSI driver listens: a Unix socket, or (for a controller elsewhere) host:port.

use std::fmt;
use std::path::PathBuf;

/// A parsed, dialable endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port`, dialed as plaintext HTTP/2 (controller endpoints only).
    Tcp(String),
}

impl Endpoint {
    /// Parses `unix:///abs/path` or a bare absolute path (the forms CSI drivers and
    /// kubelet use).
    pub fn parse_unix(value: &str) -> Result<Self, String> {
        let value = value.trim();
        let path = match value.strip_prefix("unix://") {
            Some(rest) => rest,
            None if value.starts_with('/') => value,
            None => {
                return Err(format!(
                    "{value:?} is not a unix socket: use unix:///abs/path.sock or /abs/path.sock"
                ));
            }
        };
        if !path.starts_with('/') {
            return Err(format!("{value:?}: the socket path must be absolute"));
        }
        Ok(Endpoint::Unix(PathBuf::from(path)))
    }

    /// Like `parse_unix`, and also `http://host:port` or `tcp://host:port`.
    pub fn parse(value: &str) -> Result<Self, String> {
        let trimmed = value.trim();
        let Some(hostport) = trimmed
            .strip_prefix("http://")
            .or_else(|| trimmed.strip_prefix("tcp://"))
        else {
            return Self::parse_unix(value).map_err(|_| {
                format!("{trimmed:?} is neither unix:///path, /path nor http://host:port")
            });
        };
        // Exactly what the channel will dial must parse now, not at the first call.
        let authority: http::uri::Authority = hostport
            .parse()
            .map_err(|e| format!("{trimmed:?} is not http://host:port: {e}"))?;
        if authority.port_u16().is_none() || authority.host().is_empty() {
            return Err(format!("{trimmed:?} needs host:port"));
        }
        if hostport.contains(['/', '@', '?', '#']) {
            return Err(format!("{trimmed:?} must be only http://host:port"));
        }
        Ok(Endpoint::Tcp(authority.to_string()))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
            Endpoint::Tcp(hp) => write!(f, "http://{hp}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_strictly() {
        assert_eq!(
            Endpoint::parse_unix("unix:///a/b.sock").unwrap(),
            Endpoint::Unix("/a/b.sock".into())
        );
        assert_eq!(
            Endpoint::parse_unix("/a/b.sock").unwrap(),
            Endpoint::Unix("/a/b.sock".into())
        );
        assert!(Endpoint::parse_unix("unix://rel.sock").is_err());
        assert!(Endpoint::parse_unix("http://h:1").is_err());
        assert_eq!(
            Endpoint::parse("http://h:1").unwrap(),
            Endpoint::Tcp("h:1".into())
        );
        assert_eq!(
            Endpoint::parse("tcp://h:1").unwrap(),
            Endpoint::Tcp("h:1".into())
        );
        assert_eq!(
            Endpoint::parse("/a.sock").unwrap(),
            Endpoint::Unix("/a.sock".into())
        );
        for bad in [
            "http://a:1:2",
            "http://h",
            "http://:1",
            "http://h:x",
            "http://h:1/p",
            "http://u@h:1",
            "h:1",
            "ftp://h:1",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad} was accepted");
        }
    }
}
