//! A phantom holder that slips through (issue 19, defect 1) can be found and undone: the
//! holders of a namespace that has made no hook for `node.stale_holder_secs` are reported
//! stale in `list`, `holders list` and the `cube_csi_bridge_stale_holders` metric, while a
//! namespace that keeps hooking — on any volume, even one torn down since — stays fresh;
//! `holders release` then removes the stale one. Both transports: the daemon's metric sees
//! what forked hooks did, since everything is judged from the shared journal.
//!
//! Needs root (real mounts); skips without it, except in CI.

mod common;

use std::time::{Duration, Instant};

use common::fake_driver::Caps;
use common::{BRIDGE, MODES, Mode, World};

/// How long the quiet namespace may take to turn stale, and the busy one to be seen fresh
/// at the same time (a bound on a condition, not a timing assertion).
const LIMIT: Duration = Duration::from_secs(60);

fn cli(w: &World, args: &[&str]) -> String {
    let out = std::process::Command::new(BRIDGE)
        .args(args)
        .arg("--config")
        .arg(&w.config_path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// (stale, age known) of each holder `namespace/sandbox` of `volume` in `list --output json`.
fn judged(list: &serde_json::Value, volume: &str) -> Vec<(String, bool, bool)> {
    list.as_array()
        .unwrap()
        .iter()
        .filter(|v| v["volume_id"] == volume)
        .flat_map(|v| v["holder_ages"].as_array().cloned().unwrap_or_default())
        .map(|h| {
            (
                format!(
                    "{}/{}",
                    h["namespace"].as_str().unwrap(),
                    h["sandbox"].as_str().unwrap()
                ),
                h["stale"].as_bool().unwrap(),
                h["age_secs"].is_u64(),
            )
        })
        .collect()
}

/// The value of the sample line `name` (no labels), if present.
fn gauge(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

async fn quiet_namespace_holders_are_reported_stale_and_released(mode: Mode) {
    let port = common::free_port();
    let mut w = World::start_with_config(
        mode,
        Caps::staging(),
        &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\nvolume_stats_interval_secs = 5\n"),
        |text| {
            text.replacen(
                "\nmount_view = \"self\"\n",
                "\nmount_view = \"self\"\nstale_holder_secs = 3\n",
                1,
            )
        },
    )
    .await;
    if mode == Mode::Binary {
        // Forked hooks do the work; the daemon only serves the metric, from the same
        // journal.
        w.start_daemon().await.expect("daemon starts");
    }
    let shared = w.create("shared").await.expect("create");
    let other = w.create("other").await.expect("create");
    // nsBusy holds `shared` first; nsQuiet's holder (the phantom) comes after it, so a
    // bridge that judged nsBusy by its hooks of `shared` alone would call it stale no
    // later than nsQuiet.
    let busy = w
        .attach_as("nsBusy", "sb-busy", "shared", 0, &shared.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));
    w.attach_as("nsQuiet", "sb-phantom", "shared", 1, &shared.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));

    // nsQuiet makes no more hooks; nsBusy keeps attaching and detaching `other` — each
    // time its only holder, so each Detach tears it down and deletes its record.
    let started = Instant::now();
    let (mut listed_at, mut metric_ok) = (None::<Instant>, false);
    let mut rounds = 0;
    while !metric_ok {
        assert!(
            started.elapsed() < LIMIT,
            "never saw nsQuiet stale and nsBusy fresh (list: {}, metric: {metric_ok}):\n{}\n{}\n{}",
            listed_at.is_some(),
            cli(&w, &["list", "--output", "json"]),
            common::scrape_metrics(port).await,
            w.logs()
        );
        rounds += 1;
        let a = w
            .attach_as("nsBusy", "sb-other", "other", 0, &other.private_data)
            .await
            .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));
        w.detach_as("nsBusy", "sb-other", "other", 0, &a.metadata)
            .await
            .unwrap();
        let list: serde_json::Value =
            serde_json::from_str(&cli(&w, &["list", "--output", "json"])).unwrap();
        let holders = judged(&list, "shared");
        assert_eq!(holders.len(), 2, "{list:#}");
        assert!(holders.iter().all(|(_, _, aged)| *aged), "{list:#}");
        if holders
            == [
                ("nsBusy/sb-busy".to_string(), false, true),
                ("nsQuiet/sb-phantom".to_string(), true, true),
            ]
        {
            listed_at.get_or_insert_with(Instant::now);
        }
        // Once nsQuiet is stale it stays so; a refresh of the gauge after that (they come
        // every 5 s) counts it, and nsBusy only if it is wrongly judged stale.
        if listed_at.is_some_and(|at| at.elapsed() > Duration::from_secs(6)) {
            let metrics = common::scrape_metrics(port).await;
            metric_ok = gauge(&metrics, "cube_csi_bridge_stale_holders") == Some(1);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "{mode:?}: nsQuiet seen stale, nsBusy fresh after {:?} ({rounds} rounds)",
        started.elapsed()
    );

    // The text forms name it too.
    let text = cli(&w, &["list"]);
    assert!(
        text.contains("nsQuiet/sb-phantom(") && text.contains(" STALE)"),
        "{text}"
    );
    let holders = cli(&w, &["holders", "list", "shared"]);
    let phantom = holders
        .lines()
        .find(|l| l.contains("sb-phantom"))
        .unwrap_or_else(|| panic!("{holders}"));
    assert!(phantom.ends_with("\tSTALE"), "{holders}");

    // The operator releases it; nsBusy keeps the volume.
    let released = cli(
        &w,
        &[
            "holders",
            "release",
            "shared",
            "--namespace",
            "nsQuiet",
            "--sandbox",
            "sb-phantom",
        ],
    );
    assert!(released.contains("other holders remain"), "{released}");
    let list: serde_json::Value =
        serde_json::from_str(&cli(&w, &["list", "--output", "json"])).unwrap();
    let left: Vec<String> = judged(&list, "shared").into_iter().map(|h| h.0).collect();
    assert_eq!(left, ["nsBusy/sb-busy"], "{list:#}");
    w.detach_as("nsBusy", "sb-busy", "shared", 0, &busy.metadata)
        .await
        .unwrap();
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
}

#[tokio::test(flavor = "multi_thread")]
async fn quiet_namespace_holders_are_reported_stale_and_released_over_both_transports() {
    require_root!();
    for mode in MODES {
        quiet_namespace_holders_are_reported_stale_and_released(mode).await;
    }
}
