//! The metrics endpoint cannot starve the hooks (issue 18, item 2). Anyone who can reach
//! the metrics port could open idle, half-sent requests until the daemon ran out of file
//! descriptors; Create and Attach over the Unix socket then failed, and the accept loop
//! spun logging "Too many open files". Now the endpoint serves at most
//! `metrics::MAX_CONNECTIONS` connections (more are closed at accept), cuts each off after
//! `metrics::CONNECTION_TIMEOUT`, backs off after a failed accept, and rate-limits its log.
//!
//! The daemon runs with a soft and hard limit of 1024 open files, as a default install
//! would have without the unit's LimitNOFILE. Needs root (real mounts); skips without it,
//! except in CI. Hook latency under the flood is printed, never asserted.

mod common;

use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use common::fake_driver::Caps;
use common::{Mode, World};
use tokio::io::AsyncWriteExt;

/// Idle connections opened against the metrics port: more than the daemon's fd limit.
const FLOOD: usize = 1100;

/// Raises this process's soft open-file limit to its hard one (the flood needs > 1024).
fn raise_own_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

/// Starts `serve` for `w` with RLIMIT_NOFILE 1024 (soft and hard).
async fn start_limited_daemon(w: &mut World) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(w.daemon_log_path())
        .unwrap();
    let mut command = std::process::Command::new(common::BRIDGE);
    command
        .args(["serve", "--config"])
        .arg(&w.config_path)
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log);
    unsafe {
        command.pre_exec(|| {
            use nix::sys::resource::{Resource, setrlimit};
            setrlimit(Resource::RLIMIT_NOFILE, 1024, 1024).map_err(std::io::Error::from)
        });
    }
    let child = tokio::process::Command::from(command)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::UnixStream::connect(w.socket()).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "daemon did not listen: {}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.daemon = Some(child);
    w.mode = Mode::Rpc;
}

/// One Create → Attach → Detach → Destroy; the time of each hook.
async fn lifecycle(w: &World, volume: &str) -> Vec<Duration> {
    let mut times = Vec::new();
    let started = Instant::now();
    let created = w
        .create(volume)
        .await
        .unwrap_or_else(|e| panic!("create {volume}: {e:?}\n{}", w.logs()));
    times.push(started.elapsed());
    let started = Instant::now();
    let attached = w
        .attach("sb", volume, 0, &created.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach {volume}: {e:?}\n{}", w.logs()));
    times.push(started.elapsed());
    let started = Instant::now();
    w.detach("sb", volume, 0, &attached.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach {volume}: {e:?}\n{}", w.logs()));
    times.push(started.elapsed());
    let started = Instant::now();
    w.destroy(volume)
        .await
        .unwrap_or_else(|e| panic!("destroy {volume}: {e:?}\n{}", w.logs()));
    times.push(started.elapsed());
    times
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_idle_metrics_connections_does_not_starve_the_hooks() {
    require_root!();
    raise_own_limit();
    let port = common::free_port();
    let mut w = World::start(
        Mode::Binary,
        Caps::staging(),
        &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
    )
    .await;
    start_limited_daemon(&mut w).await;

    let quiet = lifecycle(&w, "quiet").await;

    // FLOOD connections, each with half a request line and then nothing.
    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(mut stream) => {
                let _ = stream.write_all(b"GET /metr").await;
                flood.push(stream);
            }
            Err(error) => panic!("connecting to the metrics port: {error}"),
        }
    }
    // Give the daemon the time to accept (or refuse) them all.
    let accepted_by = Instant::now() + Duration::from_secs(2);
    while Instant::now() < accepted_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Every hook still works while the flood is open, over the Unix socket.
    // (Bounded: before the fix the daemon had no descriptor left and the hooks hung.)
    let mut flooded = Vec::new();
    for n in 0..5 {
        let volume = format!("flooded-{n}");
        let times = tokio::time::timeout(Duration::from_secs(60), lifecycle(&w, &volume))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the hooks of {volume} did not finish within 60 s under the flood\n{}",
                    w.logs()
                        .lines()
                        .rev()
                        .take(20)
                        .collect::<Vec<_>>()
                        .join("\n")
                )
            });
        flooded.extend(times);
    }
    // A real scrape still gets an answer once the connection slots free up.
    drop(flood);
    let text = loop {
        if let Ok(text) = scrape(port).await {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        text.contains("cube_csi_bridge_hook_calls_total"),
        "{}",
        &text[..text.len().min(500)]
    );
    let logs = w.logs();
    assert!(
        logs.contains("refused connections over the limit"),
        "the refusals are logged: {logs}"
    );
    let refusal_lines = logs.matches("refused connections over the limit").count();
    assert!(
        refusal_lines < 20,
        "the refusal log is rate-limited: {refusal_lines} lines"
    );
    assert!(!logs.contains("Too many open files"), "{logs}");
    println!(
        "hook median: quiet {:?}, under a flood of {FLOOD} idle metrics connections {:?}",
        median(quiet),
        median(flooded)
    );
}

/// One `GET /metrics`.
async fn scrape(port: u16) -> std::io::Result<String> {
    use tokio::io::AsyncReadExt;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut text))
        .await
        .map_err(|_| std::io::Error::other("no answer"))??;
    if text.is_empty() {
        return Err(std::io::Error::other("closed"));
    }
    Ok(text)
}
