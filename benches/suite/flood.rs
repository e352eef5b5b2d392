//! The flood of the `flood` section: idle, half-sent requests held open on the metrics
//! port, and peers of another uid reconnecting to the TCP port, each refused by
//! `serve.allowed_uids`. The strangers are threads of this process that set their own
//! file-system uid to nobody's (setfsuid(2) acts on the calling thread only); the kernel
//! records a socket's owner from it, so the daemon sees connections owned by 65534.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The uid the strangers connect as (not in the bridge's `allowed_uids = [0]`).
pub const STRANGER: u32 = 65534;
/// How long a connect or the daemon's answer may take before the flood gives up.
const PATIENCE: Duration = Duration::from_secs(10);

/// A flood in progress; `stop` ends it.
pub struct Flood {
    idle: Vec<TcpStream>,
    stopping: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    peers: Vec<JoinHandle<anyhow::Result<()>>>,
}

impl Flood {
    /// Opens `idle` half-sent requests on `metrics`, then starts `peers` strangers that
    /// each connect to `tcp` once per `every` (or as fast as the daemon refuses them).
    /// Returns once every stranger has been refused once.
    pub fn start(
        metrics: SocketAddr,
        idle: usize,
        tcp: SocketAddr,
        peers: usize,
        every: Duration,
    ) -> anyhow::Result<Flood> {
        raise_open_file_limit();
        let mut flood = Flood {
            idle: Vec::with_capacity(idle),
            stopping: Arc::new(AtomicBool::new(false)),
            refused: Arc::new(AtomicU64::new(0)),
            peers: Vec::new(),
        };
        for _ in 0..idle {
            let mut stream = TcpStream::connect_timeout(&metrics, PATIENCE)
                .with_context(|| format!("connecting to the metrics port {metrics}"))?;
            // The endpoint closes what it holds no slot for: then the write may fail.
            let _ = stream.write_all(b"GET /metr");
            flood.idle.push(stream);
        }
        for _ in 0..peers {
            let (stop, refused) = (flood.stopping.clone(), flood.refused.clone());
            flood.peers.push(std::thread::spawn(move || {
                stranger(tcp, every, &stop, &refused)
            }));
        }
        let deadline = Instant::now() + PATIENCE;
        while flood.refused() < peers as u64 {
            if flood.peers.iter().any(JoinHandle::is_finished) || Instant::now() > deadline {
                return flood
                    .stop()
                    .and_then(|_| Err(anyhow::anyhow!("the strangers did not get going")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(flood)
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// Ends the flood; the number of refused connections, or why a stranger stopped.
    pub fn stop(self) -> anyhow::Result<u64> {
        self.stopping.store(true, Ordering::SeqCst);
        drop(self.idle);
        for peer in self.peers {
            peer.join().expect("a stranger panicked")?;
        }
        Ok(self.refused.load(Ordering::SeqCst))
    }
}

/// One stranger: connects as nobody, waits for the daemon to close the connection, again.
fn stranger(
    tcp: SocketAddr,
    every: Duration,
    stop: &AtomicBool,
    refused: &AtomicU64,
) -> anyhow::Result<()> {
    let stranger = nix::unistd::Uid::from_raw(STRANGER);
    nix::unistd::setfsuid(stranger);
    // setfsuid(2) returns the previous value whether or not it succeeded.
    if nix::unistd::setfsuid(stranger) != stranger {
        bail!("setfsuid({STRANGER}) did not take (the suite runs as root)");
    }
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let mut stream = TcpStream::connect_timeout(&tcp, PATIENCE)
            .with_context(|| format!("a stranger connecting to {tcp}"))?;
        stream.set_read_timeout(Some(PATIENCE))?;
        // An admitted connection gets the server's HTTP/2 SETTINGS; a refused one is closed.
        match stream.read(&mut [0u8; 64]) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Ok(_) => bail!("a connection owned by uid {STRANGER} was admitted over TCP"),
            Err(e) => return Err(e).context("waiting for the daemon to refuse a stranger"),
        }
        refused.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(every.saturating_sub(started.elapsed()));
    }
    Ok(())
}

/// The idle connections need more descriptors than the default soft limit.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}
