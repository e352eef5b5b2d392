//! `cube-csi-bridge probe` against the real `serve` daemon and the fake CSI driver: a healthy
//! daemon is alive and ready; with its driver down it stays alive but is not ready (and is
//! ready again once the driver is back); with the daemon gone both fail; a daemon that never
//! answers is cut off by the timeout; a bad config exits 78.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::fake_driver::Caps;
use common::{BRIDGE, Mode, World};
use cube_csi_bridge::transport::health::PROBE_INTERVAL;

/// One `cube-csi-bridge probe` run.
#[derive(Debug)]
struct ProbeRun {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn probe(config: &Path, extra: &[&str]) -> ProbeRun {
    let out = tokio::process::Command::new(BRIDGE)
        .arg("probe")
        .arg("--config")
        .arg(config)
        .args(extra)
        .output()
        .await
        .unwrap();
    ProbeRun {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs the probe until it exits with `code`, for at most a few prober intervals (the
/// daemon's readiness changes at its next probe of the driver); the last run.
async fn probe_until(config: &Path, extra: &[&str], code: i32) -> ProbeRun {
    let limit = Instant::now() + 3 * PROBE_INTERVAL + Duration::from_secs(5);
    loop {
        let run = probe(config, extra).await;
        if run.code == Some(code) || Instant::now() > limit {
            return run;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Exactly one line on stdout.
fn one_line(run: &ProbeRun) -> &str {
    let line = run.stdout.strip_suffix('\n').unwrap_or(&run.stdout);
    assert!(
        !line.is_empty() && !line.contains('\n'),
        "one line of stdout: {run:?}"
    );
    line
}

#[tokio::test(flavor = "multi_thread")]
async fn a_healthy_daemon_is_alive_and_ready() {
    let w = World::start(Mode::Rpc, Caps::default(), "").await;
    let live = probe(&w.config_path, &[]).await;
    assert_eq!(live.code, Some(0), "{live:?}");
    assert!(one_line(&live).starts_with("alive:"), "{live:?}");
    assert!(live.stdout.contains(&w.socket().display().to_string()));

    let ready = probe_until(&w.config_path, &["--ready"], 0).await;
    assert_eq!(ready.code, Some(0), "{ready:?}\n{}", w.logs());
    assert!(one_line(&ready).starts_with("ready:"), "{ready:?}");
    assert!(ready.stderr.is_empty(), "nothing on stderr: {ready:?}");
    assert!(
        w.driver.calls().iter().any(|c| c.method == "Probe"),
        "readiness comes from the driver's Probe"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_driver_down_the_daemon_is_alive_but_not_ready() {
    let mut w = World::start(Mode::Rpc, Caps::default(), "").await;
    let ready = probe_until(&w.config_path, &["--ready"], 0).await;
    assert_eq!(ready.code, Some(0), "{ready:?}");

    w.driver_server.take().unwrap().stop().await;
    let ready = probe_until(&w.config_path, &["--ready"], 1).await;
    assert_eq!(ready.code, Some(1), "{ready:?}\n{}", w.logs());
    let line = one_line(&ready);
    assert!(line.starts_with("not ready:"), "{ready:?}");
    assert!(line.contains("does not answer Probe"), "{ready:?}");
    assert!(
        line.contains("csi.sock"),
        "names the driver's endpoint: {ready:?}"
    );
    assert!(
        w.logs().contains("not ready"),
        "the daemon logs why: {}",
        w.logs()
    );

    let live = probe(&w.config_path, &[]).await;
    assert_eq!(
        live.code,
        Some(0),
        "liveness does not depend on the driver: {live:?}"
    );

    // The driver comes back: ready again at the next probe.
    w.driver_server = Some(w.driver.serve(&w.dir.path().join("csi.sock")));
    let ready = probe_until(&w.config_path, &["--ready"], 0).await;
    assert_eq!(ready.code, Some(0), "{ready:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_daemon_gone_both_probes_fail() {
    let mut w = World::start(Mode::Rpc, Caps::default(), "").await;
    assert_eq!(probe(&w.config_path, &[]).await.code, Some(0));

    // Killed: its socket file stays behind, and nobody answers on it.
    let mut daemon = w.daemon.take().unwrap();
    daemon.start_kill().unwrap();
    daemon.wait().await.unwrap();
    assert!(w.socket().exists(), "SIGKILL leaves the socket file");
    for flags in [&[][..], &["--ready"][..]] {
        let run = probe(&w.config_path, flags).await;
        assert_eq!(run.code, Some(1), "{flags:?}: {run:?}");
        let line = one_line(&run);
        assert!(line.starts_with("not "), "{run:?}");
        assert!(line.contains("no daemon answers"), "{run:?}");
    }

    // Removed: the socket file is gone as well.
    std::fs::remove_file(w.socket()).unwrap();
    for flags in [&[][..], &["--ready"][..]] {
        let run = probe(&w.config_path, flags).await;
        assert_eq!(run.code, Some(1), "{flags:?}: {run:?}");
        assert!(one_line(&run).contains("does not exist"), "{run:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_that_never_answers_is_cut_off_by_the_timeout() {
    let w = World::start(Mode::Binary, Caps::default(), "").await;
    // Something accepts connections on the bridge's socket and never speaks.
    let listener = tokio::net::UnixListener::bind(w.socket()).unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let started = Instant::now();
    let run = probe(&w.config_path, &["--timeout", "1"]).await;
    let elapsed = started.elapsed();
    hold.abort();
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(
        one_line(&run).contains("did not answer within 1s"),
        "{run:?}"
    );
    eprintln!(
        "probe --timeout 1 against a silent socket returned after {:.2}s",
        elapsed.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_config_exits_78() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let run = probe(&missing, &[]).await;
    assert_eq!(run.code, Some(78), "{run:?}");
    assert!(run.stdout.is_empty(), "{run:?}");
    assert!(run.stderr.contains("missing.toml"), "{run:?}");

    let invalid = dir.path().join("invalid.toml");
    std::fs::write(&invalid, "driver = \"fake\"\n[csi]\nendpoint = \"\"\n").unwrap();
    let run = probe(&invalid, &["--ready"]).await;
    assert_eq!(run.code, Some(78), "{run:?}");
}
