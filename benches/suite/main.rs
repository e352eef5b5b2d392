//! The benchmark suite of cube-csi-bridge (docs/benchmarks.md; run it with
//! `scripts/bench.sh`): every speed and memory figure of the bridge beside its baseline
//! measured in the same run, printed as one table with the ratio, the target and
//! PASS/MISS. It prints; it never fails on time. A figure it could not measure (a broken
//! setup, a failing call) is printed as such, and the exit status is then non-zero.
//!
//! The same executable is also the suite's own child processes: `fake-csi` (the project's
//! fake CSI driver with a fixed latency per call), `tonic-floor` (a trivial tonic Cube
//! plugin) and `tonic-relay` (a tonic Cube plugin that only relays a first Attach and a
//! last Detach to the driver).

mod fake_csi;
mod flood;
mod kube_api;
mod procs;
mod profile;
mod report;
mod runner;
mod scenarios;
mod seed;
mod stats;
mod tonic_side;
mod world;

use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo bench --bench suite -- [--quick] [--only SECTIONS] [--keep] [--profile DIR]
                                    [--bridge EXE] [--work-dir DIR]
  --quick          fewer iterations (a minute or two instead of several)
  --only A,B       run only these sections: hot, flood, first, binary, concurrent,
                   store, kubernetes, ready (default: all)
  --keep           keep the work directory (logs, configs, state) and print its path
  --profile DIR    instead of the table: where the daemon's time goes (strace of hot
                   Attach/Detach, first Attach/Detach, Create/Destroy; perf of those
                   and of create storms), written into DIR
  --bridge EXE     measure this build of cube-csi-bridge instead of the one cargo built
  --work-dir DIR   make the work directory (state, journal, locks) in DIR, not /var/tmp;
                   a tmpfs there shows what durable writes cost
Needs root (real mounts) and the peers scripts/bench.sh installs; see docs/benchmarks.md.";

fn main() -> ExitCode {
    // `cargo bench` appends --bench; the suite has no use for it.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let result = match args.first().map(String::as_str) {
        Some("fake-csi") => fake_csi::Options::parse(&args[1..]).and_then(fake_csi::run),
        Some("tonic-floor") => tonic_side::run_floor(&args[1..]),
        Some("tonic-relay") => tonic_side::run_relay(&args[1..]),
        _ => return suite(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn suite(args: &[String]) -> ExitCode {
    let options = match world::Options::parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(64);
        }
    };
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("the benchmark suite makes real mounts: run it as root (scripts/bench.sh)");
        return ExitCode::FAILURE;
    }
    // Before any thread exists (unshare refuses a multi-threaded process): every mount of
    // the run happens in a private mount namespace, invisible to the rest of the host and
    // gone with the suite's last process.
    if let Err(e) = world::private_mount_namespace() {
        eprintln!("cannot enter a private mount namespace: {e}");
        return ExitCode::FAILURE;
    }
    let world = match world::World::new(options) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e:#}");
            return ExitCode::FAILURE;
        }
    };
    let ok = if let Some(dir) = world.options.profile.clone() {
        match profile::profile(&world, &dir) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("profile failed: {e:#}");
                false
            }
        }
    } else {
        scenarios::run_all(&world)
    };
    world.finish();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
