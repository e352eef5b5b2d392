//! The sections of the suite. Each starts what it needs (drivers, floors, bridge daemons),
//! measures its figures and their baselines in interleaved rounds, stops everything, and
//! returns its rows of the table. `profile` is the --profile mode.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;
use cube_csi_bridge::proto::csi::v1::volume_capability::access_mode::Mode as AccessMode;

use crate::procs::Proc;
use crate::report::{Row, Target, table};
use crate::runner::{Call, Runner, Via};
use crate::stats::{Summary, fmt_duration, fmt_kib};
use crate::tonic_side::{DirectCsi, time_to_first_call, tonic_hop};
use crate::world::{self, BridgeSpec, SECTIONS, Store, World};

/// Runs every selected section and prints the table; false if a figure was not measured.
pub fn run_all(world: &World) -> bool {
    let started = Instant::now();
    let header = world::machine();
    let mut rows = Vec::new();
    let mut ok = true;
    for &section in SECTIONS {
        if !world.options.runs(section) {
            continue;
        }
        eprintln!("== {section}");
        let t = Instant::now();
        let result = match section {
            "hot" => hot(world),
            "flood" => flood(world),
            "first" => first(world),
            "binary" => binary(world),
            "concurrent" => concurrent(world),
            "store" => store(world),
            "kubernetes" => kubernetes(world),
            "ready" => ready(world),
            _ => unreachable!("SECTIONS lists every section"),
        };
        match result {
            Ok(r) => rows.extend(r),
            Err(e) => {
                ok = false;
                eprintln!("   {section} failed: {e:#}");
                rows.push(Row::not_measured(section, format!("{e:#}")));
            }
        }
        eprintln!("   {section} took {:.1} s", t.elapsed().as_secs_f64());
    }
    let s = world.sizes;
    println!(
        "cube-csi-bridge benchmarks ({}), {header}; load average at the end {}; {:.0} s in all",
        if world.options.quick {
            "--quick"
        } else {
            "full"
        },
        world::load_average(),
        started.elapsed().as_secs_f64()
    );
    println!("bridge measured: {}", world.bridge_description());
    println!("forked hook measured: {}", world.hook.display());
    println!("{}", world.work_dir_description());
    println!(
        "iterations: hot pairs {} (+{} warm-up) per target in {} interleaved rounds; \
         first Attach {} (fake 0 ms) / {} (fake 10 ms) / {} (csi-mock); binary pairs {}; \
         {} rounds of 256; Create+Destroy pairs {} per store size; {} daemon starts\n",
        s.hot_pairs,
        s.warmup_pairs,
        s.rounds,
        s.first_fast,
        s.first_slow,
        s.first_mock,
        s.binary_pairs,
        s.concurrent_rounds,
        s.create_destroy_pairs,
        s.ready_runs
    );
    print!("{}", table(&rows));
    ok
}

/// Attach/Detach samples of one target.
#[derive(Debug, Default)]
struct Pairs {
    attach: Vec<i64>,
    detach: Vec<i64>,
}

impl Pairs {
    fn add(&mut self, (attach, detach): (Vec<i64>, Vec<i64>)) {
        self.attach.extend(attach);
        self.detach.extend(detach);
    }
}

/// `n` hot pairs on one volume: Attach with ref_count 1 (another sandbox holds it) and
/// the matching Detach with ref_count 1, each from a sandbox of its own.
pub fn hot_calls(volume: &str, n: usize, base: &Path, tag: &str) -> Vec<Call> {
    (0..n)
        .flat_map(|i| {
            let sandbox = format!("{tag}-{i}");
            [
                Call::attach(volume, &sandbox, 1, base),
                Call::detach(volume, &sandbox, 1),
            ]
        })
        .collect()
}

/// Runs alternating Attach/Detach calls; returns (attach, detach) samples.
pub fn run_pairs(
    runner: &mut Runner,
    name: &str,
    via: &Via,
    calls: &[Call],
) -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
    let out = runner.run(name, via, 1, calls)?;
    Ok((out.every(0, 2), out.every(1, 2)))
}

/// "1.24 ms (p99 2.10 ms, n 3000)".
pub fn shown(s: &Summary) -> String {
    format!(
        "{} (p99 {}, n {})",
        fmt_duration(s.median),
        fmt_duration(s.p99),
        s.n
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Rows judging a median against a baseline median (and, with `p99_limit`, a p99
/// against the baseline's p99).
fn judged_latency(
    figure: &str,
    measured: &Summary,
    baseline_name: &str,
    baseline: &Summary,
    median_limit: Target,
    p99_limit: Option<f64>,
) -> Vec<Row> {
    let mut rows = vec![Row::judged(
        format!("{figure} — median"),
        shown(measured),
        format!("{baseline_name}: {}", shown(baseline)),
        ms(measured.median),
        ms(baseline.median),
        median_limit,
        "ms",
    )];
    if let Some(limit) = p99_limit {
        rows.push(Row::judged(
            format!("{figure} — p99"),
            fmt_duration(measured.p99),
            format!("{baseline_name} p99: {}", fmt_duration(baseline.p99)),
            ms(measured.p99),
            ms(baseline.p99),
            Target::Ratio(limit),
            "ms",
        ));
    }
    rows
}

/// The round whose median (and the round whose p99) is furthest above the floor's in the
/// same round: the targets hold in every round, not only the quiet ones. Samples are in
/// rounds of `per_round`, the floor's interleaved with the bridge's.
fn worst_round(figure: &str, measured: &[i64], floor: &[i64], per_round: usize) -> Vec<Row> {
    let rounds: Vec<(Summary, Summary)> = measured
        .chunks(per_round)
        .zip(floor.chunks(per_round))
        .map(|(m, f)| (Summary::of_ns(m), Summary::of_ns(f)))
        .collect();
    let ratio = |a: Duration, b: Duration| ms(a) / ms(b).max(f64::MIN_POSITIVE);
    let n = rounds.len();
    let mut rows = Vec::new();
    if let Some((m, f)) = rounds
        .iter()
        .max_by(|a, b| ratio(a.0.median, a.1.median).total_cmp(&ratio(b.0.median, b.1.median)))
    {
        rows.push(Row::judged(
            format!("{figure} — median, worst of {n} rounds"),
            shown(m),
            format!("trivial grpc-go plugin, same round: {}", shown(f)),
            ms(m.median),
            ms(f.median),
            Target::Ratio(1.5),
            "ms",
        ));
    }
    if let Some((m, f)) = rounds
        .iter()
        .max_by(|a, b| ratio(a.0.p99, a.1.p99).total_cmp(&ratio(b.0.p99, b.1.p99)))
    {
        rows.push(Row::judged(
            format!("{figure} — p99, worst of {n} rounds"),
            fmt_duration(m.p99),
            format!(
                "trivial grpc-go plugin p99, same round: {}",
                fmt_duration(f.p99)
            ),
            ms(m.p99),
            ms(f.p99),
            Target::Ratio(2.0),
            "ms",
        ));
    }
    rows
}

/// Hot Attach (volume already mounted) and Detach with holders left, over rpc, beside
/// the floors of one gRPC hop.
fn hot(world: &World) -> anyhow::Result<Vec<Row>> {
    let s = world.sizes;
    let (_go_floor, go_floor) = world.floor(true)?;
    let (_tonic_floor, tonic_floor) = world.floor(false)?;
    let (_fake, fake_socket) = world.fake_driver("hot-fake", 0, true)?;
    let (_fake_bridge, fake_files) =
        world.bridge(&BridgeSpec::new("hot-bridge-fake", &fake_socket))?;
    let mock = world.mock_driver("hot-mock")?;
    let mock_bridge = match &mock {
        Some((_, socket)) => Some(world.bridge(&BridgeSpec::mock("hot-bridge-mock", socket))?),
        None => None,
    };

    let floor_base = world.dir("floor-volumes")?;
    // (label, where, base dir, is a bridge)
    let mut targets = vec![
        (
            "grpc-go client → trivial grpc-go plugin",
            Via::Socket(go_floor.clone()),
            floor_base.clone(),
            false,
        ),
        (
            "grpc-go client → trivial tonic plugin",
            Via::Socket(tonic_floor.clone()),
            floor_base.clone(),
            false,
        ),
        (
            "bridge, fake driver",
            Via::Socket(fake_files.socket.clone()),
            fake_files.base_dir.clone(),
            true,
        ),
    ];
    if let Some((_, files)) = &mock_bridge {
        targets.push((
            "bridge, csi-mock driver",
            Via::Socket(files.socket.clone()),
            files.base_dir.clone(),
            true,
        ));
    }

    let mut runner = world.runner()?;
    for (label, via, base, bridge) in &targets {
        if *bridge {
            runner.run(
                &format!("prime {label}"),
                via,
                1,
                &[Call::create("hot"), Call::attach("hot", "holder", 0, base)],
            )?;
        }
        runner.run(
            &format!("warm-up {label}"),
            via,
            1,
            &hot_calls("hot", s.warmup_pairs, base, "warm"),
        )?;
    }
    tonic_hop(&tonic_floor, s.warmup_pairs)?;

    let mut samples: Vec<Pairs> = targets.iter().map(|_| Pairs::default()).collect();
    let mut bare_tonic = Pairs::default();
    let per_round = s.hot_pairs / s.rounds;
    for round in 0..s.rounds {
        for ((label, via, base, _), pairs) in targets.iter().zip(&mut samples) {
            let calls = hot_calls("hot", per_round, base, &format!("r{round}"));
            pairs.add(run_pairs(
                &mut runner,
                &format!("hot {label} round {round}"),
                via,
                &calls,
            )?);
        }
        bare_tonic.add(tonic_hop(&tonic_floor, per_round)?);
    }
    for (label, via, _, bridge) in &targets {
        if *bridge {
            runner.run(
                &format!("release {label}"),
                via,
                1,
                &[Call::detach("hot", "holder", 0), Call::destroy("hot")],
            )?;
        }
    }

    let floor_attach = Summary::of_ns(&samples[0].attach);
    let floor_detach = Summary::of_ns(&samples[0].detach);
    let floor_name = "trivial grpc-go plugin";
    let mut rows = vec![
        Row::judged(
            "one gRPC hop: grpc-go client → trivial grpc-go plugin, Attach (the floor)",
            shown(&floor_attach),
            String::new(),
            0.0,
            0.0,
            Target::Info,
            "ms",
        ),
        Row::judged(
            "one gRPC hop: grpc-go client → trivial tonic plugin, Attach",
            shown(&Summary::of_ns(&samples[1].attach)),
            format!("{floor_name}: {}", fmt_duration(floor_attach.median)),
            ms(Summary::of_ns(&samples[1].attach).median),
            ms(floor_attach.median),
            Target::Info,
            "ms",
        ),
        Row::judged(
            "bare tonic unary call: tonic client → trivial tonic plugin, Attach",
            shown(&Summary::of_ns(&bare_tonic.attach)),
            format!("{floor_name}: {}", fmt_duration(floor_attach.median)),
            ms(Summary::of_ns(&bare_tonic.attach).median),
            ms(floor_attach.median),
            Target::Info,
            "ms",
        ),
    ];
    for ((label, _, _, bridge), pairs) in targets.iter().zip(&samples) {
        if !*bridge {
            continue;
        }
        let driver = label.trim_start_matches("bridge, ");
        rows.extend(judged_latency(
            &format!("Attach, volume already mounted (ref_count 1), rpc, {driver}"),
            &Summary::of_ns(&pairs.attach),
            floor_name,
            &floor_attach,
            Target::Ratio(1.5),
            Some(2.0),
        ));
        rows.extend(worst_round(
            &format!("Attach, volume already mounted (ref_count 1), rpc, {driver}"),
            &pairs.attach,
            &samples[0].attach,
            per_round,
        ));
        // Each pair adds and removes one holder of the same volume: a cost that grows with
        // that history shows as a later round slower than the first.
        let first_round = Summary::of_ns(&pairs.attach[..per_round]);
        let last_round = Summary::of_ns(&pairs.attach[pairs.attach.len() - per_round..]);
        rows.push(Row::judged(
            format!("Attach, volume already mounted, rpc, {driver}: last round vs first round"),
            format!(
                "{} after {} pairs on the volume",
                fmt_duration(last_round.median),
                s.warmup_pairs + s.hot_pairs
            ),
            format!(
                "first round: {} after {} pairs",
                fmt_duration(first_round.median),
                s.warmup_pairs + per_round
            ),
            ms(last_round.median),
            ms(first_round.median),
            Target::Info,
            "ms",
        ));
        rows.extend(judged_latency(
            &format!("Detach, ref_count 1 (holders left), rpc, {driver}"),
            &Summary::of_ns(&pairs.detach),
            floor_name,
            &floor_detach,
            Target::Ratio(1.5),
            Some(2.0),
        ));
        rows.extend(worst_round(
            &format!("Detach, ref_count 1 (holders left), rpc, {driver}"),
            &pairs.detach,
            &samples[0].detach,
            per_round,
        ));
    }
    if mock.is_none() {
        rows.push(Row::not_measured(
            "Attach/Detach hot, rpc, csi-mock driver",
            world::CSI_MOCK_MISSING,
        ));
    }
    Ok(rows)
}

/// Hot Attach/Detach over the socket while the daemon is flooded — idle half-sent
/// requests on its metrics port and strangers reconnecting to its TCP port, each refused
/// by `serve.allowed_uids` — beside the same pairs on the same daemon with no flood, in
/// interleaved rounds (issue 18, findings 2 and 8).
fn flood(world: &World) -> anyhow::Result<Vec<Row>> {
    const IDLE: usize = 1000;
    const PEERS: usize = 32;
    // About 640 connections a second, ten times the rate of the flood.
    const EVERY: Duration = Duration::from_millis(50);
    let s = world.sizes;
    let (_driver, socket) = world.fake_driver("flood-driver", 0, true)?;
    let (metrics, tcp) = (world::free_loopback_addr()?, world::free_loopback_addr()?);
    let spec = BridgeSpec {
        serve_extra: format!("allowed_uids = [0]\ntcp = \"{tcp}\"\n"),
        extra: format!("\n[metrics]\nlisten = \"{metrics}\"\n"),
        ..BridgeSpec::new("flood", &socket)
    };
    let (mut bridge, files) = world.bridge(&spec)?;
    let via = Via::Socket(files.socket.clone());
    let base = &files.base_dir;
    let mut runner = world.runner()?;
    runner.run(
        "prime",
        &via,
        1,
        &[Call::create("hot"), Call::attach("hot", "holder", 0, base)],
    )?;
    runner.run(
        "warm-up",
        &via,
        1,
        &hot_calls("hot", s.warmup_pairs, base, "warm"),
    )?;
    let per_round = s.hot_pairs / s.rounds;
    let (mut quiet, mut flooded) = (Vec::new(), Vec::new());
    let mut refused = 0;
    let mut flood_time = Duration::ZERO;
    for round in 0..s.rounds {
        let calls = hot_calls("hot", per_round, base, &format!("q{round}"));
        quiet.extend(
            runner
                .run(&format!("quiet round {round}"), &via, 1, &calls)?
                .samples_ns,
        );
        let flood = crate::flood::Flood::start(metrics, IDLE, tcp, PEERS, EVERY)?;
        let (t, before) = (Instant::now(), flood.refused());
        let calls = hot_calls("hot", per_round, base, &format!("f{round}"));
        let outcome = runner.run(&format!("flooded round {round}"), &via, 1, &calls);
        // Only the connections refused while the pairs ran.
        refused += flood.refused() - before;
        flood_time += t.elapsed();
        flood.stop()?;
        flooded.extend(outcome?.samples_ns);
        bridge.check_alive()?;
    }
    runner.run(
        "release",
        &via,
        1,
        &[Call::detach("hot", "holder", 0), Call::destroy("hot")],
    )?;
    let log = std::fs::read_to_string(&files.log)?;
    let log_lines = log
        .lines()
        .filter(|l| l.contains("refused a TCP connection"))
        .count();
    let (q, f) = (Summary::of_ns(&quiet), Summary::of_ns(&flooded));
    Ok(vec![Row::judged(
        format!(
            "hot Attach/Detach over the socket while {IDLE} idle metrics connections and \
             {PEERS} refused TCP peers (uid {}, one connect per {} ms each) flood — p99",
            crate::flood::STRANGER,
            EVERY.as_millis()
        ),
        format!(
            "{} (median {}, n {}; {refused} connections refused during the {:.1} s of \
             flooded pairs, {log_lines} refusal log lines)",
            fmt_duration(f.p99),
            fmt_duration(f.median),
            f.n,
            flood_time.as_secs_f64()
        ),
        format!(
            "no flood, same daemon: p99 {} (median {})",
            fmt_duration(q.p99),
            fmt_duration(q.median)
        ),
        ms(f.p99),
        ms(q.p99),
        Target::Ratio(2.0),
        "ms",
    )])
}

/// One driver of the first-Attach section.
struct FirstCase {
    label: &'static str,
    name: &'static str,
    rounds: usize,
}

/// First Attach (stage + publish) and last Detach over rpc, beside the same CSI calls
/// made directly against the driver.
fn first(world: &World) -> anyhow::Result<Vec<Row>> {
    let s = world.sizes;
    let mut rows = Vec::new();
    let cases = [
        (
            FirstCase {
                label: "fake driver, 0 ms",
                name: "first-fake0",
                rounds: s.first_fast,
            },
            Some(0),
        ),
        (
            FirstCase {
                label: "fake driver, 10 ms per call",
                name: "first-fake10",
                rounds: s.first_slow,
            },
            Some(10),
        ),
        (
            FirstCase {
                label: "csi-mock driver",
                name: "first-mock",
                rounds: s.first_mock,
            },
            None,
        ),
    ];
    for (case, latency) in cases {
        let (driver, spec, mode) = match latency {
            Some(ms) => {
                let (proc, socket) =
                    world.fake_driver(&format!("{}-driver", case.name), ms, true)?;
                let spec = BridgeSpec::new(case.name, &socket);
                (proc, spec, AccessMode::MultiNodeMultiWriter)
            }
            None => match world.mock_driver(&format!("{}-driver", case.name))? {
                Some((proc, socket)) => (
                    proc,
                    BridgeSpec::mock(case.name, &socket),
                    AccessMode::MultiNodeMultiWriter,
                ),
                None => {
                    rows.push(Row::not_measured(
                        format!("first Attach, rpc, {}", case.label),
                        world::CSI_MOCK_MISSING,
                    ));
                    continue;
                }
            },
        };
        let direct = DirectCsi {
            socket: spec.csi_socket.clone(),
            access_mode: mode,
            capacity_bytes: spec.capacity_bytes as i64,
            stage: true,
        };
        let (bridge, files) = world.bridge(&spec)?;
        let direct_base = world.dir(&format!("{}/direct-volumes", case.name))?;
        // The bare relay in front of the fake driver (csi-mock would need its volume
        // created first): the share of the figure any tonic bridge pays.
        let relay = match latency {
            Some(_) => Some(world.relay(&format!("{}-relay", case.name), &spec.csi_socket)?),
            None => None,
        };
        let mut runner = world.runner()?;
        let via = Via::Socket(files.socket.clone());
        let cycle = |n: usize, base: &Path| -> Vec<Call> {
            (0..n)
                .flat_map(|_| {
                    [
                        Call::attach("first", "sandbox", 0, base),
                        Call::detach("first", "sandbox", 0),
                    ]
                })
                .collect()
        };
        runner.run("create", &via, 1, &[Call::create("first")])?;
        let warm = (case.rounds / 10).max(3);
        run_pairs(&mut runner, "warm-up", &via, &cycle(warm, &files.base_dir))?;
        direct.attach_detach(&direct_base, "direct", warm)?;
        if let Some((_, socket, base)) = &relay {
            let relay_via = Via::Socket(socket.clone());
            run_pairs(&mut runner, "warm-up relay", &relay_via, &cycle(warm, base))?;
        }
        let (mut bridged, mut direct_pairs) = (Pairs::default(), Pairs::default());
        let (mut relayed, mut relay_cpu) = (Pairs::default(), Duration::ZERO);
        let mut fsyncs = Vec::new();
        // The daemon's own CPU over the bridged rounds (it is idle during the direct ones):
        // steadier than wall time on a shared host, and what a burst is bound by.
        let mut cpu = Duration::ZERO;
        for round in 0..s.rounds {
            let n = case.rounds / s.rounds;
            let cpu_before = crate::procs::cpu_time(bridge.pid())?;
            bridged.add(run_pairs(
                &mut runner,
                &format!("first {} round {round}", case.label),
                &via,
                &cycle(n, &files.base_dir),
            )?);
            cpu += crate::procs::cpu_time(bridge.pid())?.saturating_sub(cpu_before);
            direct_pairs.add(direct.attach_detach(&direct_base, "direct", n)?);
            if let Some((proc, socket, base)) = &relay {
                let cpu_before = crate::procs::cpu_time(proc.pid())?;
                relayed.add(run_pairs(
                    &mut runner,
                    &format!("first {} relay round {round}", case.label),
                    &Via::Socket(socket.clone()),
                    &cycle(n, base),
                )?);
                relay_cpu += crate::procs::cpu_time(proc.pid())?.saturating_sub(cpu_before);
            }
            fsyncs.extend(fresh_file_fdatasyncs(&files.state_dir, FSYNC_SAMPLES)?);
        }
        runner.run("destroy", &via, 1, &[Call::destroy("first")])?;
        drop((runner, bridge, relay, driver));

        // The target: the direct calls + one fdatasync of a fresh 4 KiB file in the state
        // dir (its median in this run) + 0.3 ms.
        let direct_attach = Summary::of_ns(&direct_pairs.attach);
        let fsync = Summary::of_ns(&fsyncs);
        let measured = Summary::of_ns(&bridged.attach);
        rows.push(Row::judged(
            format!(
                "first Attach (stage + publish), rpc, {} — median",
                case.label
            ),
            shown(&measured),
            format!(
                "NodeStage + NodePublish direct: {}; fdatasync of a fresh 4 KiB file in the state dir: {}",
                shown(&direct_attach),
                shown(&fsync)
            ),
            ms(measured.median),
            ms(direct_attach.median),
            Target::Plus(ms(fsync.median) + 0.3),
            "ms",
        ));
        let direct_detach = Summary::of_ns(&direct_pairs.detach);
        rows.extend(judged_latency(
            &format!("last Detach (unpublish + unstage), rpc, {}", case.label),
            &Summary::of_ns(&bridged.detach),
            "NodeUnpublish + NodeUnstage direct",
            &direct_detach,
            Target::Info,
            None,
        ));
        rows.push(cpu_per_pair(
            format!(
                "bridge daemon CPU (user + system) per first Attach + last Detach, rpc, {}",
                case.label
            ),
            cpu,
            bridged.attach.len(),
        ));
        if !relayed.attach.is_empty() {
            rows.extend(relay_rows(
                case.label,
                &relayed,
                relay_cpu,
                &measured,
                &direct_attach,
                &direct_detach,
            ));
        }
    }
    Ok(rows)
}

/// The bare relay's first Attach and last Detach beside the direct calls, and the share
/// of the bridge's first Attach above the relay's (its own work: journal, locks, checks).
fn relay_rows(
    label: &str,
    relayed: &Pairs,
    cpu: Duration,
    bridged_attach: &Summary,
    direct_attach: &Summary,
    direct_detach: &Summary,
) -> Vec<Row> {
    let (attach, detach) = (
        Summary::of_ns(&relayed.attach),
        Summary::of_ns(&relayed.detach),
    );
    let over = |a: &Summary, b: &Summary| ms(a.median) - ms(b.median);
    vec![
        Row::judged(
            format!(
                "first Attach, bare tonic relay (the same CSI calls, nothing kept), {label} — median"
            ),
            format!(
                "{} ({:+.2} ms over direct; the bridge {:+.2} ms over the relay)",
                shown(&attach),
                over(&attach, direct_attach),
                over(bridged_attach, &attach)
            ),
            format!("NodeStage + NodePublish direct: {}", shown(direct_attach)),
            ms(attach.median),
            ms(direct_attach.median),
            Target::Info,
            "ms",
        ),
        Row::judged(
            format!("last Detach, bare tonic relay, {label} — median"),
            format!(
                "{} ({:+.2} ms over direct)",
                shown(&detach),
                over(&detach, direct_detach)
            ),
            format!(
                "NodeUnpublish + NodeUnstage direct: {}",
                shown(direct_detach)
            ),
            ms(detach.median),
            ms(direct_detach.median),
            Target::Info,
            "ms",
        ),
        cpu_per_pair(
            format!("bare tonic relay CPU per first Attach + last Detach, {label}"),
            cpu,
            relayed.attach.len(),
        ),
    ]
}

/// An info row: a process's CPU over `pairs` first Attach + last Detach pairs, per pair.
fn cpu_per_pair(figure: String, cpu: Duration, pairs: usize) -> Row {
    let pairs = pairs.max(1);
    Row::judged(
        figure,
        format!(
            "{} ({} in {pairs} pairs)",
            fmt_duration(cpu / pairs as u32),
            fmt_duration(cpu)
        ),
        String::new(),
        0.0,
        0.0,
        Target::Info,
        "ms",
    )
}

/// fdatasync samples of a fresh 4 KiB file per round of the first-Attach figures.
const FSYNC_SAMPLES: usize = 20;

/// `n` times: a fresh 4 KiB file written in `dir`, then its `fdatasync` timed (ns); the
/// file is removed afterwards. The cost of one durable write of a new small file there.
fn fresh_file_fdatasyncs(dir: &Path, n: usize) -> anyhow::Result<Vec<i64>> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let path = dir.join(format!(".fsync-probe-{i}"));
        let mut file = std::fs::File::create(&path)?;
        file.write_all(&[0x5a; 4096])?;
        let start = std::time::Instant::now();
        file.sync_data()?;
        out.push(start.elapsed().as_nanos() as i64);
        drop(file);
        std::fs::remove_file(&path)?;
    }
    Ok(out)
}

/// The binary hook forked with Cube's argv on its fast paths, beside exec of /bin/true
/// with the same argv: the front Cube is registered to fork (judged), and the full binary
/// forked directly (for context: what the front saves).
fn binary(world: &World) -> anyhow::Result<Vec<Row>> {
    let s = world.sizes;
    let (_driver, socket) = world.fake_driver("binary-driver", 0, true)?;
    let files = world.bridge_files(&BridgeSpec::new("binary", &socket))?;
    let forked = |exe: &PathBuf| Via::Fork {
        exe: exe.clone(),
        env: vec![format!("CUBE_CSI_BRIDGE_CONFIG={}", files.config.display())],
        raw: false,
    };
    let (hook, full) = (forked(&world.hook), forked(&world.bridge));
    let floor = Via::Fork {
        exe: "/bin/true".into(),
        env: vec![],
        raw: true,
    };
    let mut runner = world.runner()?;
    // One volume per executable: the Go runner keeps each one's Create answer for itself.
    let volumes = [("hot", &hook), ("hot-full", &full)];
    for (volume, via) in volumes {
        runner.run(
            "prime",
            via,
            1,
            &[
                Call::create(volume),
                Call::attach(volume, "holder", 0, &files.base_dir),
            ],
        )?;
    }
    let warm = s.warmup_pairs / 5;
    for (name, via, volume) in [
        ("warm-up hook", &hook, "hot"),
        ("warm-up full", &full, "hot-full"),
        ("warm-up true", &floor, "hot"),
    ] {
        let calls = hot_calls(volume, warm, &files.base_dir, "warm");
        run_pairs(&mut runner, name, via, &calls)?;
    }
    let (mut front, mut whole, mut trivial) =
        (Pairs::default(), Pairs::default(), Pairs::default());
    for round in 0..s.rounds {
        let calls = |volume| {
            let per_round = s.binary_pairs / s.rounds;
            hot_calls(volume, per_round, &files.base_dir, &format!("r{round}"))
        };
        trivial.add(run_pairs(
            &mut runner,
            "exec /bin/true",
            &floor,
            &calls("hot"),
        )?);
        front.add(run_pairs(&mut runner, "binary hook", &hook, &calls("hot"))?);
        whole.add(run_pairs(
            &mut runner,
            "full binary",
            &full,
            &calls("hot-full"),
        )?);
    }
    for (volume, via) in volumes {
        runner.run(
            "release",
            via,
            1,
            &[Call::detach(volume, "holder", 0), Call::destroy(volume)],
        )?;
    }
    let front_name = world.hook.file_name().unwrap_or_default().to_string_lossy();
    let mut rows = Vec::new();
    for (figure, measured, full, base) in [
        (
            "Attach, volume already mounted (ref_count 1), wall per call",
            &front.attach,
            &whole.attach,
            &trivial.attach,
        ),
        (
            "Detach, ref_count 1, wall per call",
            &front.detach,
            &whole.detach,
            &trivial.detach,
        ),
    ] {
        let (m, f, b) = (
            Summary::of_ns(measured),
            Summary::of_ns(full),
            Summary::of_ns(base),
        );
        let baseline = format!("exec /bin/true, same argv: {}", shown(&b));
        rows.push(Row::judged(
            format!("binary hook ({front_name}), {figure} — median"),
            shown(&m),
            baseline.clone(),
            ms(m.median),
            ms(b.median),
            Target::Ratio(2.0),
            "ms",
        ));
        rows.push(Row::judged(
            format!("full binary forked directly, {figure} — median"),
            shown(&f),
            baseline,
            ms(f.median),
            ms(b.median),
            Target::Info,
            "ms",
        ));
    }
    Ok(rows)
}

/// 256 first Attaches (and then 256 last Detaches) of 256 volumes at once with a 10 ms
/// driver, beside the same 256 NodeStage + NodePublish (NodeUnpublish + NodeUnstage) made
/// directly on the driver at once, round by round; one Attach alone for context.
fn concurrent(world: &World) -> anyhow::Result<Vec<Row>> {
    const N: usize = 256;
    let s = world.sizes;
    let (_driver, socket) = world.fake_driver("concurrent-driver", 10, true)?;
    let (_bridge, files) = world.bridge(&BridgeSpec::new("concurrent", &socket))?;
    let via = Via::Socket(files.socket.clone());
    let mut runner = world.runner()?;
    // Attach needs no record in the controller store: the CSI handle comes in private_data.
    let ids: Vec<String> = (0..N).map(|i| format!("c-{i:03}")).collect();
    let attaches = ids
        .iter()
        .map(|id| Call::attach_handle(id, &format!("cube-{id}"), "sandbox", &files.base_dir))
        .collect::<anyhow::Result<Vec<Call>>>()?;
    let detaches: Vec<Call> = ids
        .iter()
        .map(|id| Call::detach(id, "sandbox", 0))
        .collect();
    // The driver's own share: the same calls made directly, all at once.
    let direct = DirectCsi {
        socket: socket.clone(),
        access_mode: AccessMode::MultiNodeMultiWriter,
        capacity_bytes: 0,
        stage: true,
    };
    let direct_base = world.dir("concurrent/direct-volumes")?;
    let direct_names: Vec<String> = (0..N).map(|i| format!("d-{i:03}")).collect();
    // The bare relay's share: the same hooks through a tonic plugin that only relays them.
    let (_relay, relay_socket, relay_base) = world.relay("concurrent-relay", &socket)?;
    let relay_via = Via::Socket(relay_socket);
    let relay_attaches = ids
        .iter()
        .map(|id| Call::attach_handle(id, &format!("relay-{id}"), "sandbox", &relay_base))
        .collect::<anyhow::Result<Vec<Call>>>()?;
    let (mut relay_walls, mut relay_detach_walls) = (Vec::new(), Vec::new());

    let (mut single, mut walls, mut detach_walls) = (Pairs::default(), Vec::new(), Vec::new());
    let (mut direct_walls, mut direct_detach_walls) = (Vec::new(), Vec::new());
    // One warm-up of each shape.
    run_pairs(
        &mut runner,
        "warm-up single",
        &via,
        &[attaches[0].clone(), detaches[0].clone()],
    )?;
    runner.run("warm-up 256", &via, N, &attaches)?;
    runner.run("warm-up 256 detach", &via, N, &detaches)?;
    direct.all_at_once(&direct_base, &direct_names)?;
    runner.run("warm-up relay 256", &relay_via, N, &relay_attaches)?;
    runner.run("warm-up relay 256 detach", &relay_via, N, &detaches)?;
    for round in 0..s.concurrent_rounds {
        for _ in 0..3 {
            single.add(run_pairs(
                &mut runner,
                "single",
                &via,
                &[attaches[0].clone(), detaches[0].clone()],
            )?);
        }
        let (attach, detach) = direct.all_at_once(&direct_base, &direct_names)?;
        direct_walls.push(attach.as_nanos() as i64);
        direct_detach_walls.push(detach.as_nanos() as i64);
        // One burst of all `calls` at once through `via`: its wall time.
        let mut burst = |tag: &str, via: &Via, calls: &[Call]| -> anyhow::Result<i64> {
            let name = format!("{tag} round {round}");
            Ok(runner.run(&name, via, N, calls)?.wall_ns)
        };
        walls.push(burst("256 attaches", &via, &attaches)?);
        detach_walls.push(burst("256 detaches", &via, &detaches)?);
        relay_walls.push(burst("relay 256 attaches", &relay_via, &relay_attaches)?);
        relay_detach_walls.push(burst("relay 256 detaches", &relay_via, &detaches)?);
    }
    let (relay_all, relay_all_d) = (
        Summary::of_ns(&relay_walls),
        Summary::of_ns(&relay_detach_walls),
    );

    let (direct_all, direct_all_d) = (
        Summary::of_ns(&direct_walls),
        Summary::of_ns(&direct_detach_walls),
    );
    let (one, all) = (Summary::of_ns(&single.attach), Summary::of_ns(&walls));
    let (one_d, all_d) = (
        Summary::of_ns(&single.detach),
        Summary::of_ns(&detach_walls),
    );
    Ok(vec![
        Row::judged(
            "256 first Attaches on 256 volumes at once, fake driver at 10 ms per call: total wall",
            format!("{} {}", fmt_duration(all.median), spread(&walls)),
            format!(
                "the same 256 NodeStage + NodePublish directly on the driver at once: {} {}",
                fmt_duration(direct_all.median),
                spread(&direct_walls)
            ),
            ms(all.median),
            ms(direct_all.median),
            Target::Ratio(1.3),
            "ms",
        ),
        Row::judged(
            "256 last Detaches at once, same volumes: total wall",
            format!("{} {}", fmt_duration(all_d.median), spread(&detach_walls)),
            format!(
                "the same 256 NodeUnpublish + NodeUnstage directly at once: {} {}",
                fmt_duration(direct_all_d.median),
                spread(&direct_detach_walls)
            ),
            ms(all_d.median),
            ms(direct_all_d.median),
            Target::Ratio(1.3),
            "ms",
        ),
        Row::judged(
            "256 first Attaches at once, bare tonic relay (the same CSI calls, nothing kept): total wall",
            format!(
                "{} {}",
                fmt_duration(relay_all.median),
                spread(&relay_walls)
            ),
            format!(
                "the same 256 NodeStage + NodePublish directly at once: {}",
                fmt_duration(direct_all.median)
            ),
            ms(relay_all.median),
            ms(direct_all.median),
            Target::Info,
            "ms",
        ),
        Row::judged(
            "256 last Detaches at once, bare tonic relay: total wall",
            format!(
                "{} {}",
                fmt_duration(relay_all_d.median),
                spread(&relay_detach_walls)
            ),
            format!(
                "the same 256 NodeUnpublish + NodeUnstage directly at once: {}",
                fmt_duration(direct_all_d.median)
            ),
            ms(relay_all_d.median),
            ms(direct_all_d.median),
            Target::Info,
            "ms",
        ),
        Row::judged(
            "256 first Attaches at once against one first Attach alone",
            fmt_duration(all.median),
            format!("one first Attach alone: {}", shown(&one)),
            ms(all.median),
            ms(one.median),
            Target::Info,
            "ms",
        ),
        Row::judged(
            "256 last Detaches at once against one last Detach alone",
            fmt_duration(all_d.median),
            format!("one last Detach alone: {}", shown(&one_d)),
            ms(all_d.median),
            ms(one_d.median),
            Target::Info,
            "ms",
        ),
    ])
}

/// "(max …, N rounds)" of a figure's wall times (ns), beside its median.
fn spread(walls: &[i64]) -> String {
    let max = walls.iter().max().copied().unwrap_or_default();
    format!(
        "(max {}, {} rounds)",
        fmt_duration(Duration::from_nanos(max as u64)),
        walls.len()
    )
}

/// Create + Destroy pairs on fresh volumes; returns (create, destroy) samples.
fn create_destroy(
    runner: &mut Runner,
    via: &Via,
    tag: &str,
    n: usize,
) -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
    let calls: Vec<Call> = (0..n)
        .flat_map(|i| {
            let id = format!("{tag}-{i:05}");
            [Call::create(&id), Call::destroy(&id)]
        })
        .collect();
    run_pairs(runner, tag, via, &calls)
}

fn fill_ids(range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("fill-{i:05}")).collect()
}

/// Rows comparing Create and Destroy medians at 10,000 stored volumes with 100.
fn store_rows(store: &str, small: &Pairs, big: &Pairs) -> Vec<Row> {
    store_rows_at(store, small, big, "10,000")
}

/// Create and Destroy with `stored` records against the same pairs at 100.
fn store_rows_at(store: &str, small: &Pairs, big: &Pairs, stored: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    for (hook, s, b) in [
        ("Create", &small.attach, &big.attach),
        ("Destroy", &small.detach, &big.detach),
    ] {
        let (s, b) = (Summary::of_ns(s), Summary::of_ns(b));
        rows.push(Row::judged(
            format!("{hook}, {store} store, {stored} volumes stored vs 100 — median"),
            format!("{} at {stored}", shown(&b)),
            format!("{} at 100", shown(&s)),
            ms(b.median),
            ms(s.median),
            Target::Ratio(1.5),
            "ms",
        ));
    }
    rows
}

/// The embedded store from 100 to 10,000 volumes, and the daemon's memory idle and with
/// 10,000 volumes stored and 1,000 attached (first Attaches through the fake driver's
/// bind mounts, detached again afterwards).
/// Creates at once in the create-storm figures.
const STORM: usize = 64;

/// One round of the create storm: `STORM` Creates on fresh ids released together, then
/// their Destroys. Their wall time in ns, and the CPU `watched` spent on the Creates.
fn create_storm(
    runner: &mut Runner,
    via: &Via,
    tag: &str,
    round: usize,
    watched: &CpuWatch,
) -> anyhow::Result<(i64, Vec<Duration>)> {
    let ids: Vec<String> = (0..STORM)
        .map(|i| format!("{tag}-{round}-{i:02}"))
        .collect();
    let creates: Vec<Call> = ids.iter().map(|id| Call::create(id)).collect();
    let before = watched.read()?;
    let wall = runner
        .run(
            &format!("{STORM} creates round {round}"),
            via,
            STORM,
            &creates,
        )?
        .wall_ns;
    let cpu = watched.since(&before)?;
    let destroys: Vec<Call> = ids.iter().map(|id| Call::destroy(id)).collect();
    runner.run(
        &format!("{STORM} destroys round {round}"),
        via,
        8,
        &destroys,
    )?;
    Ok((wall, cpu))
}

/// The CPU time of a few processes (their live threads), read before and after a span.
struct CpuWatch(Vec<u32>);

impl CpuWatch {
    fn read(&self) -> anyhow::Result<Vec<Duration>> {
        self.0
            .iter()
            .map(|pid| crate::procs::threads_cpu(*pid))
            .collect()
    }

    /// What each process spent since `before` (a `read` of this watch).
    fn since(&self, before: &[Duration]) -> anyhow::Result<Vec<Duration>> {
        Ok(self
            .read()?
            .iter()
            .zip(before)
            .map(|(now, then)| now.saturating_sub(*then))
            .collect())
    }
}

/// Fills the embedded store from `from` records to `to` (see seed.rs) plus one that the
/// bridge then Destroys: proof that it reads the added records. The id at `to` is the
/// one destroyed, so the next fill may use it again.
fn seed_to(
    runner: &mut Runner,
    via: &Via,
    store_file: &Path,
    from: usize,
    to: usize,
) -> anyhow::Result<()> {
    let extra = fill_ids(to..to + 1).remove(0);
    crate::seed::fill(
        store_file,
        world::DRIVER,
        from as u64,
        "fill-00000",
        &fill_ids(from..to + 1),
    )?;
    runner.run("destroy an added record", via, 1, &[Call::destroy(&extra)])?;
    if crate::seed::holds(store_file, &extra)? {
        bail!("the bridge did not Destroy the added record of {extra}: seed.rs is out of date");
    }
    let stored_records = crate::seed::count(store_file)?;
    if stored_records != to as u64 {
        bail!("the store holds {stored_records} records, expected {to}");
    }
    Ok(())
}

fn store(world: &World) -> anyhow::Result<Vec<Row>> {
    const SMALL: usize = 100;
    const BIG: usize = 10_000;
    const HUGE: usize = 100_000;
    const ATTACHED: usize = 1_000;
    let s = world.sizes;
    let (_driver, socket) = world.fake_driver("store-driver", 0, true)?;
    let (floor, _) = world.floor(false)?;
    let (bridge, files) = world.bridge(&BridgeSpec::new("store", &socket))?;
    std::thread::sleep(Duration::from_secs(s.idle_secs));
    let idle = bridge.rss_kib()?;
    let floor_idle = floor.rss_kib()?;
    drop(floor);

    let via = Via::Socket(files.socket.clone());
    let mut runner = world.runner()?;
    let creates = |ids: Vec<String>| ids.iter().map(|id| Call::create(id)).collect::<Vec<_>>();
    runner.run("create 100", &via, 16, &creates(fill_ids(0..SMALL)))?;
    create_destroy(&mut runner, &via, "warm", 20)?;
    let mut small = Pairs::default();
    small.add(create_destroy(
        &mut runner,
        &via,
        "cd-small",
        s.create_destroy_pairs,
    )?);

    // Issue 20: a Create against the same CreateVolume made directly, one at a time and
    // as a storm of 64 at once (interleaved with the bridge's, round by round).
    let direct = DirectCsi {
        socket: socket.clone(),
        access_mode: AccessMode::MultiNodeMultiWriter,
        capacity_bytes: 0,
        stage: true,
    };
    let (direct_create, _) = direct.create_delete("direct-cd", s.create_destroy_pairs)?;
    // The bare relay's share of both (a Create relayed as CreateVolume, nothing kept).
    let (relay, relay_socket, _) = world.relay("store-relay", &socket)?;
    let relay_via = Via::Socket(relay_socket);
    create_destroy(&mut runner, &relay_via, "relay-warm", 20)?;
    let (relay_create, _) =
        create_destroy(&mut runner, &relay_via, "relay-cd", s.create_destroy_pairs)?;
    let relay_watch = CpuWatch(vec![relay.pid()]);
    let (mut relay_storm_walls, mut relay_storm_cpu) = (Vec::new(), Duration::ZERO);
    let (mut storm_walls, mut direct_storm_walls) = (Vec::new(), Vec::new());
    // Where a storm's CPU goes: the bridge's daemon, and this process (the fake driver,
    // and in the direct storm also the client making the calls). The Go client of the
    // bridged storm is not counted.
    let watch = CpuWatch(vec![bridge.pid(), std::process::id()]);
    let (mut storm_cpu, mut direct_storm_cpu) = (vec![Duration::ZERO; 2], Duration::ZERO);
    for round in 0..s.rounds {
        let (wall, cpu) = create_storm(&mut runner, &via, "storm", round, &watch)?;
        storm_walls.push(wall);
        storm_cpu.iter_mut().zip(cpu).for_each(|(sum, c)| *sum += c);
        let direct_ids: Vec<String> = (0..STORM)
            .map(|i| format!("direct-storm-{round}-{i:02}"))
            .collect();
        let before = watch.read()?;
        direct_storm_walls.push(direct.creates_at_once(&direct_ids)?.as_nanos() as i64);
        direct_storm_cpu += watch.since(&before)?[1];
        let (wall, cpu) =
            create_storm(&mut runner, &relay_via, "relay-storm", round, &relay_watch)?;
        relay_storm_walls.push(wall);
        relay_storm_cpu += cpu[0];
    }
    drop(relay);

    // To 10,000 records.
    let store_file = files.state_dir.join("controller.redb");
    seed_to(&mut runner, &via, &store_file, SMALL, BIG)?;
    let mut big = Pairs::default();
    big.add(create_destroy(
        &mut runner,
        &via,
        "cd-big",
        s.create_destroy_pairs,
    )?);
    let stored = bridge.rss_kib()?;

    let attaches = fill_ids(0..ATTACHED)
        .iter()
        .map(|id| Call::attach_handle(id, &format!("cube-{id}"), "memory", &files.base_dir))
        .collect::<anyhow::Result<Vec<Call>>>()?;
    runner.run("attach 1,000", &via, 8, &attaches)?;
    let loaded = bridge.rss_kib()?;
    let peak = world::peak_kib(bridge.pid())?;
    let detaches: Vec<Call> = fill_ids(0..ATTACHED)
        .iter()
        .map(|id| Call::detach(id, "memory", 0))
        .collect();
    runner.run("detach 1,000", &via, 8, &detaches)?;

    // Issue 20: to 100,000 records the same way, and the same pairs and memory there.
    seed_to(&mut runner, &via, &store_file, BIG, HUGE)?;
    let mut huge = Pairs::default();
    huge.add(create_destroy(
        &mut runner,
        &via,
        "cd-huge",
        s.create_destroy_pairs,
    )?);
    let huge_rss = bridge.rss_kib()?;
    let huge_peak = world::peak_kib(bridge.pid())?;

    let mut rows = store_rows("embedded", &small, &big);
    rows.extend(store_rows_at("embedded", &small, &huge, "100,000"));
    let (one, one_direct) = (
        Summary::of_ns(&small.attach),
        Summary::of_ns(&direct_create),
    );
    rows.push(Row::judged(
        "Create, embedded store (100 stored), one at a time, fake driver at 0 ms — median",
        shown(&one),
        format!("CreateVolume direct: {}", shown(&one_direct)),
        ms(one.median),
        ms(one_direct.median),
        Target::Plus(1.0),
        "ms",
    ));
    let (storm, storm_direct) = (
        Summary::of_ns(&storm_walls),
        Summary::of_ns(&direct_storm_walls),
    );
    rows.push(Row::judged(
        format!("{STORM} Creates at once (CubeMaster create storm), embedded store: total wall"),
        format!("{} {}", fmt_duration(storm.median), spread(&storm_walls)),
        format!(
            "the same {STORM} CreateVolume directly on the driver at once: {} {}",
            fmt_duration(storm_direct.median),
            spread(&direct_storm_walls)
        ),
        ms(storm.median),
        ms(storm_direct.median),
        Target::Ratio(1.5),
        "ms",
    ));
    let per_create = |cpu: Duration| fmt_duration(cpu / (STORM * s.rounds.max(1)) as u32);
    rows.push(Row::judged(
        format!("{STORM} Creates at once, embedded store: CPU (user + system) per Create"),
        format!(
            "bridge daemon {}, the fake driver {}",
            per_create(storm_cpu[0]),
            per_create(storm_cpu[1])
        ),
        format!(
            "direct: the fake driver with its client {}",
            per_create(direct_storm_cpu)
        ),
        0.0,
        0.0,
        Target::Info,
        "ms",
    ));
    let relay_one = Summary::of_ns(&relay_create);
    rows.push(Row::judged(
        "Create, bare tonic relay (CreateVolume, nothing kept), one at a time — median",
        format!(
            "{} ({:+.2} ms over direct; the bridge {:+.2} ms over the relay)",
            shown(&relay_one),
            ms(relay_one.median) - ms(one_direct.median),
            ms(one.median) - ms(relay_one.median)
        ),
        format!("CreateVolume direct: {}", shown(&one_direct)),
        ms(relay_one.median),
        ms(one_direct.median),
        Target::Info,
        "ms",
    ));
    let relay_storm = Summary::of_ns(&relay_storm_walls);
    rows.push(Row::judged(
        format!("{STORM} Creates at once, bare tonic relay: total wall"),
        format!(
            "{} {}; relay CPU per Create {}",
            fmt_duration(relay_storm.median),
            spread(&relay_storm_walls),
            per_create(relay_storm_cpu)
        ),
        format!(
            "the same {STORM} CreateVolume directly on the driver at once: {}",
            fmt_duration(storm_direct.median)
        ),
        ms(relay_storm.median),
        ms(storm_direct.median),
        Target::Info,
        "ms",
    ));
    let mib = |kib: u64| kib as f64 / 1024.0;
    rows.push(Row::judged(
        "daemon resident memory, idle (VmRSS)",
        fmt_kib(idle),
        format!("trivial tonic plugin idle: {}", fmt_kib(floor_idle)),
        mib(idle),
        mib(floor_idle),
        Target::Absolute(16.0),
        "MiB",
    ));
    rows.push(Row::judged(
        "daemon resident memory, 10,000 volumes stored, none attached",
        fmt_kib(stored),
        format!("idle: {}", fmt_kib(idle)),
        mib(stored),
        mib(idle),
        Target::Info,
        "MiB",
    ));
    rows.push(Row::judged(
        "daemon resident memory, 10,000 volumes stored and 1,000 attached",
        format!("{} (peak VmHWM {})", fmt_kib(loaded), fmt_kib(peak)),
        format!("idle: {}", fmt_kib(idle)),
        mib(loaded),
        mib(idle),
        Target::Absolute(48.0),
        "MiB",
    ));
    rows.push(Row::judged(
        "daemon resident memory, 100,000 volumes stored (after Create/Destroy pairs there)",
        format!("{} (peak VmHWM {})", fmt_kib(huge_rss), fmt_kib(huge_peak)),
        format!("idle: {}", fmt_kib(idle)),
        mib(huge_rss),
        mib(idle),
        Target::Absolute(64.0),
        "MiB",
    ));
    Ok(rows)
}

/// The Kubernetes store (CubeVolume objects in a real kube-apiserver) from 100 to 10,000
/// volumes; the store is filled straight through the API.
fn kubernetes(world: &World) -> anyhow::Result<Vec<Row>> {
    const SMALL: usize = 100;
    const BIG: usize = 10_000;
    const HUGE: usize = 100_000;
    let Some(bin) = &world.k8s else {
        return Ok(vec![Row::not_measured(
            "Create/Destroy, Kubernetes store",
            "CUBE_CSI_BRIDGE_K8S_BIN is not set",
        )]);
    };
    let s = world.sizes;
    let api = crate::kube_api::ApiServer::start(bin, &world.dir("k8s")?)?;
    let (_driver, socket) = world.fake_driver("kubernetes-driver", 0, false)?;
    let spec = BridgeSpec {
        services: "controller",
        store: Store::Kubernetes {
            kubeconfig: api.kubeconfig.clone(),
        },
        ..BridgeSpec::new("kubernetes", &socket)
    };
    let (bridge, files) = world.bridge(&spec)?;
    let via = Via::Socket(files.socket.clone());
    let runtime = tokio::runtime::Runtime::new()?;
    let client = runtime.block_on(api.client())?;
    let fill = |range: std::ops::Range<usize>, parallel: usize| -> anyhow::Result<Duration> {
        let t = Instant::now();
        runtime.block_on(crate::kube_api::fill(
            &client,
            world::DRIVER,
            crate::fake_csi::NAME,
            fill_ids(range),
            parallel,
        ))?;
        Ok(t.elapsed())
    };
    let mut runner = world.runner()?;
    fill(0..SMALL, 16)?;
    create_destroy(&mut runner, &via, "warm", 20)?;
    let mut small = Pairs::default();
    small.add(create_destroy(
        &mut runner,
        &via,
        "cd-small",
        s.create_destroy_pairs,
    )?);
    let took = fill(SMALL..BIG, 32)?;
    let stored = runtime.block_on(crate::kube_api::count(&client))?;
    if stored != BIG {
        bail!("the API server holds {stored} CubeVolumes, expected {BIG}");
    }
    let mut big = Pairs::default();
    big.add(create_destroy(
        &mut runner,
        &via,
        "cd-big",
        s.create_destroy_pairs,
    )?);
    // Issue 20: 64 Creates at once against the same CubeVolume writes made straight to
    // the API at once, interleaved round by round (at 10,000 stored).
    let (mut storm_walls, mut direct_walls) = (Vec::new(), Vec::new());
    for round in 0..s.rounds {
        let unwatched = CpuWatch(Vec::new());
        storm_walls.push(create_storm(&mut runner, &via, "k8s-storm", round, &unwatched)?.0);
        let direct_ids: Vec<String> = (0..STORM)
            .map(|i| format!("k8s-direct-storm-{round}-{i:02}"))
            .collect();
        let wall = runtime.block_on(crate::kube_api::create_storm(
            &client,
            world::DRIVER,
            crate::fake_csi::NAME,
            &direct_ids,
        ))?;
        direct_walls.push(wall.as_nanos() as i64);
    }
    // To 100,000 CubeVolumes, and the same pairs there.
    let took_huge = fill(BIG..HUGE, 64)?;
    let stored = runtime.block_on(crate::kube_api::count(&client))?;
    if stored < HUGE {
        bail!("the API server holds {stored} CubeVolumes, expected at least {HUGE}");
    }
    let mut huge = Pairs::default();
    huge.add(create_destroy(
        &mut runner,
        &via,
        "cd-huge",
        s.create_destroy_pairs,
    )?);
    let huge_rss = bridge.rss_kib()?;
    let mut rows = store_rows("Kubernetes", &small, &big);
    rows.extend(store_rows_at("Kubernetes", &small, &huge, "100,000"));
    rows.push(Row::judged(
        "controller daemon resident memory, Kubernetes store, 100,000 CubeVolumes stored",
        fmt_kib(huge_rss),
        String::new(),
        huge_rss as f64 / 1024.0,
        0.0,
        Target::Absolute(64.0),
        "MiB",
    ));
    let (storm, direct) = (Summary::of_ns(&storm_walls), Summary::of_ns(&direct_walls));
    rows.push(Row::judged(
        format!("{STORM} Creates at once (CubeMaster create storm), Kubernetes store (10,000 stored): total wall"),
        format!("{} {}", fmt_duration(storm.median), spread(&storm_walls)),
        format!(
            "the same CubeVolume writes (create, replace) for {STORM} volumes straight to the API at once: {} {}",
            fmt_duration(direct.median),
            spread(&direct_walls)
        ),
        ms(storm.median),
        ms(direct.median),
        Target::Ratio(1.5),
        "ms",
    ));
    rows.push(Row::judged(
        "filling the Kubernetes store: 9,900 CubeVolumes written straight to the API, 32 at a time",
        format!(
            "{:.0} objects/s (90,000 more, 64 at a time: {:.0} objects/s)",
            (BIG - SMALL) as f64 / took.as_secs_f64(),
            (HUGE - BIG) as f64 / took_huge.as_secs_f64()
        ),
        String::new(),
        0.0,
        0.0,
        Target::Info,
        "",
    ));
    Ok(rows)
}

/// From exec of `serve` to its first answered hook, beside a trivial tonic plugin.
fn ready(world: &World) -> anyhow::Result<Vec<Row>> {
    let s = world.sizes;
    let (_driver, socket) = world.fake_driver("ready-driver", 0, true)?;
    let files = world.bridge_files(&BridgeSpec::new("ready", &socket))?;
    let floor_dir = world.dir("ready-floor")?;
    let floor_socket = floor_dir.join("plugin.sock");
    let start_bridge = || Proc::spawn("bridge ready", world.serve_command(&files), &files.log);
    let start_floor = || {
        let mut cmd = Command::new(&world.suite);
        cmd.arg("tonic-floor").arg("--listen").arg(&floor_socket);
        Proc::spawn("tonic floor", cmd, &floor_dir.join("plugin.log"))
    };
    let timeout = Duration::from_secs(30);
    // The first start creates the state; later ones are restarts, as on a running host.
    drop(time_to_first_call(start_bridge, &files.socket, timeout)?.1);
    drop(time_to_first_call(start_floor, &floor_socket, timeout)?.1);
    let (mut bridge, mut floor) = (Vec::new(), Vec::new());
    for _ in 0..s.ready_runs {
        let (t, proc) = time_to_first_call(start_bridge, &files.socket, timeout)?;
        bridge.push(t);
        drop(proc);
        let (t, proc) = time_to_first_call(start_floor, &floor_socket, timeout)?;
        floor.push(t);
        drop(proc);
    }
    let (b, f) = (Summary::of(&bridge), Summary::of(&floor));
    let max = |v: &[Duration]| fmt_duration(v.iter().max().copied().unwrap_or_default());
    Ok(vec![Row::judged(
        "daemon ready to accept calls after exec (spawn → first answered hook) — median",
        format!(
            "{} (max {}, n {})",
            fmt_duration(b.median),
            max(&bridge),
            b.n
        ),
        format!(
            "trivial tonic plugin: {} (max {})",
            fmt_duration(f.median),
            max(&floor)
        ),
        ms(b.median),
        ms(f.median),
        Target::Absolute(50.0),
        "ms",
    )])
}
