//! --profile: where the daemon's time goes, per hook path, for the lead's optimisation
//! work. Against a bridge on the fake driver at 0 ms, workloads run while a tool is
//! attached to the daemon (all its threads): hot Attach + Detach pairs (ref_count 1),
//! first Attach + last Detach cycles, and Create + Destroy pairs, each under `strace -f -c`
//! (system time), `strace -f -c -w` (wall time) and `strace -f -tt -T` of one iteration;
//! 256 first Attaches at once under `strace -f -c -w`; the hot pairs, the first Attach +
//! last Detach pairs and the Create + Destroy pairs under `perf stat` and `perf record`
//! (cpu-clock, DWARF call graphs), and create storms (64 at once) under `perf record`,
//! with their reports.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::procs::Proc;
use crate::runner::{Call, Via};
use crate::scenarios::{hot_calls, run_pairs, shown};
use crate::stats::Summary;
use crate::world::{BridgeSpec, World};

/// Iterations watched by each `strace -c` and perf run.
const HOT_PAIRS: usize = 1000;
const FIRST_CYCLES: usize = 100;
/// Create storms profiled, each of `STORM` Creates at once (then their Destroys).
const STORMS: usize = 30;
const STORM: usize = 64;
const CREATE_PAIRS: usize = 100;
const CONCURRENT: usize = 256;

pub fn profile(world: &World, out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    let out = out.canonicalize()?;
    for tool in ["strace", "perf"] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("{tool} is not installed (scripts/bench.sh --profile installs it)");
        }
    }
    let (_driver, socket) = world.fake_driver("profile-driver", 0, true)?;
    let (bridge, files) = world.bridge(&BridgeSpec::new("profile", &socket))?;
    let pid = bridge.pid().to_string();
    let via = Via::Socket(files.socket.clone());
    let base = files.base_dir.clone();
    let mut runner = world.runner()?;
    let prime = [
        Call::create("hot"),
        Call::attach("hot", "holder", 0, &base),
        Call::create("first"),
    ];
    runner.run("prime", &via, 1, &prime)?;

    // The three workloads; `tag` keeps sandbox and volume names unique per run.
    let hot = |n: usize, tag: &str| hot_calls("hot", n, &base, tag);
    let first = |n: usize, _: &str| -> Vec<Call> {
        (0..n)
            .flat_map(|_| {
                [
                    Call::attach("first", "sandbox", 0, &base),
                    Call::detach("first", "sandbox", 0),
                ]
            })
            .collect()
    };
    let create = |n: usize, tag: &str| -> Vec<Call> {
        (0..n)
            .flat_map(|i| {
                let id = format!("{tag}-{i:05}");
                [Call::create(&id), Call::destroy(&id)]
            })
            .collect()
    };
    run_pairs(&mut runner, "warm-up", &via, &hot(300, "warm"))?;
    run_pairs(&mut runner, "warm-up", &via, &first(10, "warm"))?;
    run_pairs(&mut runner, "warm-up", &via, &create(10, "warm"))?;
    let untraced = [
        (
            "hot Attach / Detach (ref_count 1)",
            run_pairs(&mut runner, "plain", &via, &hot(HOT_PAIRS, "plain"))?,
        ),
        (
            "first Attach / last Detach",
            run_pairs(&mut runner, "plain", &via, &first(FIRST_CYCLES, "plain"))?,
        ),
        (
            "Create / Destroy",
            run_pairs(&mut runner, "plain", &via, &create(CREATE_PAIRS, "plain"))?,
        ),
    ];

    // Runs `calls` with `tool` attached to the daemon.
    let mut traced = |tool: &str, args: &[&str], tag: &str, calls: Vec<Call>| {
        watched(&out, tool, args, tag, || {
            run_pairs(&mut runner, tag, &via, &calls).map(|_| ())
        })
    };
    let path = |name: &str| out.join(name).display().to_string();
    for (name, n) in [
        ("hot", HOT_PAIRS),
        ("first", FIRST_CYCLES),
        ("create", CREATE_PAIRS),
    ] {
        let calls = |n: usize, tag: &str| match name {
            "hot" => hot(n, tag),
            "first" => first(n, tag),
            _ => create(n, tag),
        };
        // -c sums system time per syscall; -c -w sums wall time (waits on the disk show).
        let summary = path(&format!("{name}-strace-summary.txt"));
        let wall = path(&format!("{name}-strace-wall.txt"));
        let one = path(&format!("{name}-strace-one.txt"));
        let tag = format!("{name}-strace-c");
        traced(
            "strace",
            &["-f", "-c", "-o", &summary, "-p", &pid],
            &tag,
            calls(n, &tag),
        )?;
        let tag = format!("{name}-strace-w");
        traced(
            "strace",
            &["-f", "-c", "-w", "-o", &wall, "-p", &pid],
            &tag,
            calls(n, &tag),
        )?;
        let tag = format!("{name}-strace-one");
        traced(
            "strace",
            &["-f", "-tt", "-T", "-o", &one, "-p", &pid],
            &tag,
            calls(1, &tag),
        )?;
    }
    // perf of the hot pairs, the first Attach + last Detach pairs (where a burst's CPU
    // goes) and the Create + Destroy pairs (where a create storm's goes): a count, then
    // samples.
    let events = "task-clock,context-switches,cpu-migrations,page-faults";
    for (name, n) in [
        ("hot", HOT_PAIRS),
        ("first", FIRST_CYCLES * 3),
        ("create", CREATE_PAIRS * 3),
    ] {
        let calls = |tag: &str| match name {
            "hot" => hot(n, tag),
            "first" => first(n, tag),
            _ => create(n, tag),
        };
        let stat = path(&format!("{name}-perf-stat.txt"));
        let data = path(&format!("{name}-perf.data"));
        let tag = format!("{name}-perf-stat");
        traced(
            "perf",
            &["stat", "-e", events, "-o", &stat, "-p", &pid],
            &tag,
            calls(&tag),
        )?;
        let tag = format!("{name}-perf-record");
        traced("perf", &perf_record(&data, &pid), &tag, calls(&tag))?;
    }
    // 256 first Attaches at once (then their Detaches, untraced): where concurrency waits.
    let ids: Vec<String> = (0..CONCURRENT).map(|i| format!("c-{i:03}")).collect();
    let attaches = ids
        .iter()
        .map(|id| Call::attach_handle(id, &format!("cube-{id}"), "sandbox", &base))
        .collect::<anyhow::Result<Vec<Call>>>()?;
    let detaches: Vec<Call> = ids
        .iter()
        .map(|id| Call::detach(id, "sandbox", 0))
        .collect();
    let wall = path("concurrent-strace-wall.txt");
    let mut took = 0;
    watched(
        &out,
        "strace",
        &["-f", "-c", "-w", "-o", &wall, "-p", &pid],
        "concurrent-strace",
        || {
            took = runner
                .run("256 at once", &via, CONCURRENT, &attaches)?
                .wall_ns;
            Ok(())
        },
    )?;
    runner.run("256 detaches", &via, CONCURRENT, &detaches)?;

    // Create storms (64 at once, then their Destroys 64 at once) under perf stat and perf
    // record: where a storm's CPU goes when its writes share transactions.
    let (storm_stat, storm_data) = (path("storm-perf-stat.txt"), path("storm-perf.data"));
    let stat = ["stat", "-e", events, "-o", &storm_stat, "-p", &pid];
    let record = perf_record(&storm_data, &pid);
    for (tag, args) in [
        ("storm-perf-stat", &stat[..]),
        ("storm-perf-record", &record[..]),
    ] {
        watched(&out, "perf", args, tag, || {
            for round in 0..STORMS {
                let ids: Vec<String> = (0..STORM)
                    .map(|i| format!("{tag}-{round}-{i:02}"))
                    .collect();
                let creates: Vec<Call> = ids.iter().map(|id| Call::create(id)).collect();
                let destroys: Vec<Call> = ids.iter().map(|id| Call::destroy(id)).collect();
                runner.run("storm", &via, STORM, &creates)?;
                runner.run("storm destroys", &via, STORM, &destroys)?;
            }
            Ok(())
        })?;
    }

    // `perf report` of the `workload`'s samples into <workload>-perf-<kind>.txt.
    let report = |workload: &str, args: &[&str], kind: &str| -> anyhow::Result<()> {
        let data = path(&format!("{workload}-perf.data"));
        let o = Command::new("perf")
            .args(["report", "--stdio", "-i", &data])
            .args(args)
            .output()?;
        std::fs::write(out.join(format!("{workload}-perf-{kind}.txt")), &o.stdout)?;
        Ok(())
    };
    let flat = [
        "--no-children",
        "--sort",
        "dso,symbol",
        "--percent-limit",
        "0.5",
        "-g",
        "none",
    ];
    let tree = [
        "--children",
        "--sort",
        "symbol",
        "--percent-limit",
        "2",
        "-g",
        "caller,0.5,callee,function,percent",
    ];
    for name in ["hot", "first", "create", "storm"] {
        report(name, &flat, "self")?;
        report(name, &tree, "children")?;
    }
    runner.run(
        "release",
        &via,
        1,
        &[
            Call::detach("hot", "holder", 0),
            Call::destroy("hot"),
            Call::destroy("first"),
        ],
    )?;

    println!(
        "bridge {} on the fake driver at 0 ms; untraced:",
        world.bridge.display()
    );
    for (name, (a, b)) in &untraced {
        println!(
            "  {name}: {} / {}",
            shown(&Summary::of_ns(a)),
            shown(&Summary::of_ns(b))
        );
    }
    println!("files in {}:", out.display());
    let mut names: Vec<String> = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".txt"))
        .collect();
    names.sort();
    for n in &names {
        println!("  {n}");
    }
    let show = |title: String, file: &str| -> anyhow::Result<()> {
        println!("\n--- {title}");
        let file = out.join(file);
        let text = std::fs::read_to_string(&file).with_context(|| file.display().to_string())?;
        print!("{text}");
        Ok(())
    };
    for (name, n) in [
        ("hot", HOT_PAIRS),
        ("first", FIRST_CYCLES),
        ("create", CREATE_PAIRS),
    ] {
        let title = format!("{name}: strace -f -c over {n} pairs (daemon, all threads)");
        show(title, &format!("{name}-strace-summary.txt"))?;
    }
    let title = format!(
        "{CONCURRENT} first Attaches at once ({:.0} ms traced): strace -f -c -w (wall time)",
        took as f64 / 1e6
    );
    show(title, "concurrent-strace-wall.txt")?;
    show(
        format!("hot: perf stat over {HOT_PAIRS} pairs"),
        "hot-perf-stat.txt",
    )?;
    show(
        format!(
            "first: perf stat over {} first Attach + last Detach pairs",
            FIRST_CYCLES * 3
        ),
        "first-perf-stat.txt",
    )?;
    show(
        format!(
            "create: perf stat over {} Create + Destroy pairs",
            CREATE_PAIRS * 3
        ),
        "create-perf-stat.txt",
    )?;
    show(
        format!("storm: perf stat over {STORMS} storms of {STORM} Creates, then their Destroys"),
        "storm-perf-stat.txt",
    )?;
    Ok(())
}

/// `perf record` of the daemon `pid` into `data`. No hardware counters in a VM: it
/// samples on cpu-clock; Rust keeps no frame pointers, so stacks are unwound from DWARF.
fn perf_record<'a>(data: &'a str, pid: &'a str) -> [&'a str; 11] {
    [
        "record",
        "-e",
        "cpu-clock",
        "-F",
        "999",
        "--call-graph",
        "dwarf,16384",
        "-o",
        data,
        "-p",
        pid,
    ]
}

/// Attaches `tool` (its args name the daemon's pid) to the daemon, runs `work`, and stops
/// the tool with SIGINT (strace then writes its summary, perf its data).
fn watched(
    out: &Path,
    tool: &str,
    args: &[&str],
    tag: &str,
    work: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut cmd = Command::new(tool);
    cmd.args(args);
    let mut proc = Proc::spawn(tool, cmd, &out.join(format!("{tag}.log")))?;
    // Time to attach to every thread before the work starts.
    std::thread::sleep(Duration::from_millis(700));
    proc.check_alive()?;
    work()?;
    proc.interrupt(Duration::from_secs(120));
    Ok(())
}
