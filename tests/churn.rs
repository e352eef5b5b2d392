//! Churn (issue 13): 1,000 Attach/Detach cycles over 20 volumes and 3 containerd
//! namespaces from concurrent callers — rpc clients of the `serve` daemon and a few forked
//! binary hooks on the same node state — each cycle writing a file through host_path. The
//! callers keep Cubelet's books: a holder count per (namespace, volume), Attach sending
//! the count before and Detach the count after, and Attach/Detach serialised per volume as
//! Cubelet serialises them. At the end: zero mounts, no staging, an empty journal, no
//! ControllerPublish left, and every file intact. Prints its figures (docs/reliability.md);
//! nothing is asserted about time. Needs root.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::callers::{CubeCaller, attach_request, create_request, detach_request};
use common::fake_driver::Caps;
use common::{Mode, Rng, World};
use tokio::sync::Mutex;

const CYCLES: usize = 1_000;
const VOLUMES: usize = 20;
const NAMESPACES: [&str; 3] = ["ns-a", "ns-b", "ns-c"];
const RPC_CALLERS: usize = 8;
const BINARY_CALLERS: usize = 2;
/// Reproduces a run: the seed is printed; set it here to replay that run's choices.
const SEED_ENV: &str = "CUBE_CSI_BRIDGE_CHURN_SEED";

/// Cubelet's books for one volume: holders per namespace.
type Books = Mutex<BTreeMap<&'static str, i64>>;

/// A file a cycle wrote, to be found intact at the end.
#[derive(Debug, Clone)]
struct Written {
    volume: usize,
    name: String,
    text: String,
}

#[derive(Default)]
struct Figures {
    attach: Vec<Duration>,
    detach: Vec<Duration>,
    max_holders: usize,
}

fn volume_id(i: usize) -> String {
    format!("churn-{i:02}")
}

/// The contents a cycle writes: distinct per cycle, a few KiB.
fn contents(cycle: usize, namespace: &str, sandbox: &str, volume: usize) -> String {
    let line = format!("cycle {cycle} namespace {namespace} sandbox {sandbox} volume {volume}\n");
    line.repeat(64)
}

struct Shared {
    books: Vec<Books>,
    handles: Vec<String>,
    base_dir: PathBuf,
    next: AtomicUsize,
    written: std::sync::Mutex<Vec<Written>>,
    figures: std::sync::Mutex<BTreeMap<String, Figures>>,
}

/// One caller: takes cycles until all are done.
async fn caller_loop(
    shared: Arc<Shared>,
    cube: Box<dyn CubeCaller>,
    mut rng: Rng,
) -> Result<(), String> {
    let name = cube.name();
    loop {
        let cycle = shared.next.fetch_add(1, Ordering::SeqCst);
        if cycle >= CYCLES {
            return Ok(());
        }
        let volume = rng.below(VOLUMES);
        let namespace = NAMESPACES[rng.below(NAMESPACES.len())];
        let sandbox = format!("sb-{cycle}");
        let id = volume_id(volume);

        let (attached, attach_took, holders) = {
            let mut books = shared.books[volume].lock().await;
            let before = *books.get(namespace).unwrap_or(&0);
            let started = Instant::now();
            let attached = cube
                .attach(attach_request(
                    namespace,
                    &shared.base_dir,
                    &sandbox,
                    &id,
                    before,
                    &shared.handles[volume],
                ))
                .await
                .map_err(|e| format!("{name}: Attach {sandbox} of {id} in {namespace}: {e:?}"))?;
            let took = started.elapsed();
            *books.entry(namespace).or_default() += 1;
            let holders = books.values().sum::<i64>() as usize;
            (attached, took, holders)
        };

        // The sandbox's I/O through host_path, while other sandboxes come and go.
        let host_path = PathBuf::from(&attached.host_path);
        let file = format!("f-{cycle:04}.txt");
        let text = contents(cycle, namespace, &sandbox, volume);
        std::fs::write(host_path.join(&file), &text)
            .map_err(|e| format!("writing {}: {e}", host_path.join(&file).display()))?;
        tokio::time::sleep(Duration::from_millis(rng.below(60) as u64)).await;
        let read = std::fs::read_to_string(host_path.join(&file))
            .map_err(|e| format!("reading back {file}: {e}"))?;
        if read != text {
            return Err(format!("{file} on {id} changed while its sandbox held it"));
        }
        shared.written.lock().unwrap().push(Written {
            volume,
            name: file,
            text,
        });

        let detach_took = {
            let mut books = shared.books[volume].lock().await;
            let after = books.get(namespace).copied().unwrap_or(0) - 1;
            books.insert(namespace, after);
            let started = Instant::now();
            cube.detach(detach_request(
                namespace,
                &sandbox,
                &id,
                after,
                &attached.metadata,
            ))
            .await
            .map_err(|e| format!("{name}: Detach {sandbox} of {id} in {namespace}: {e:?}"))?;
            started.elapsed()
        };

        let mut figures = shared.figures.lock().unwrap();
        let mine = figures.entry(name.clone()).or_default();
        mine.attach.push(attach_took);
        mine.detach.push(detach_took);
        mine.max_holders = mine.max_holders.max(holders);
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_attach_detach_cycles_leak_nothing_and_keep_every_file() {
    require_root!();
    let w = World::start(Mode::Rpc, Caps::all_steps(), "").await;
    let seed: u64 = common::seed_from(SEED_ENV);
    println!("churn seed {seed} (replay with {SEED_ENV}={seed})");

    let mut handles = Vec::new();
    for i in 0..VOLUMES {
        let created = w
            .caller()
            .create(create_request(&volume_id(i)))
            .await
            .unwrap();
        handles.push(created.private_data);
    }
    w.driver.clear_calls();
    let shared = Arc::new(Shared {
        books: (0..VOLUMES).map(|_| Books::default()).collect(),
        handles,
        base_dir: w.base_dir.clone(),
        next: AtomicUsize::new(0),
        written: Default::default(),
        figures: Default::default(),
    });

    let started = Instant::now();
    let mut callers = Vec::new();
    for i in 0..RPC_CALLERS + BINARY_CALLERS {
        let cube: Box<dyn CubeCaller> = if i < RPC_CALLERS {
            Box::new(w.rpc_caller())
        } else {
            Box::new(w.binary_caller())
        };
        let rng = Rng(seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        callers.push(tokio::spawn(caller_loop(shared.clone(), cube, rng)));
    }
    let mut failures = Vec::new();
    for caller in callers {
        if let Err(e) = caller.await.expect("a caller panicked") {
            failures.push(e);
        }
    }
    let elapsed = started.elapsed();
    assert!(
        failures.is_empty(),
        "hooks failed:\n{}",
        failures.join("\n")
    );

    // Cubelet's books are balanced: every namespace's count is back to zero.
    for (i, books) in shared.books.iter().enumerate() {
        let books = books.lock().await;
        assert!(
            books.values().all(|&n| n == 0),
            "{}: {books:?}",
            volume_id(i)
        );
    }

    // Nothing leaked on the node.
    assert_eq!(w.mounts(), Vec::<PathBuf>::new(), "leaked mounts");
    assert_eq!(
        common::left_in_base_dir(&w.base_dir),
        Vec::<PathBuf>::new(),
        "host_path or staging directories left in the base dir"
    );
    let journal = w.dir.path().join("state/node");
    let entries = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().is_file())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(entries(&journal), Vec::<String>::new(), "journal records");
    assert_eq!(
        entries(&journal.join("pending")),
        Vec::<String>::new(),
        "pending markers"
    );
    assert_eq!(
        w.driver.controller_published(),
        Vec::new(),
        "ControllerPublished"
    );

    // Every file is intact in its volume: in the driver's data, and through host_path
    // when each volume is attached once more.
    let written = shared.written.lock().unwrap().clone();
    assert_eq!(written.len(), CYCLES);
    let mut by_volume: HashMap<usize, Vec<&Written>> = HashMap::new();
    for file in &written {
        by_volume.entry(file.volume).or_default().push(file);
    }
    for (i, handle) in shared.handles.iter().enumerate() {
        let id = volume_id(i);
        let data = w.driver.volume_dir(&w.driver.csi_volume_of(&id).unwrap());
        let files = by_volume.get(&i).cloned().unwrap_or_default();
        for file in &files {
            let read = std::fs::read_to_string(data.join(&file.name)).unwrap_or_default();
            assert_eq!(
                read, file.text,
                "{} of {id} in the driver's data",
                file.name
            );
        }
        let on_disk = std::fs::read_dir(&data).unwrap().count();
        assert_eq!(on_disk, files.len(), "{id}: files in the volume");
        let attached = w.attach("sb-check", &id, 0, handle).await.unwrap();
        for file in &files {
            let read = std::fs::read_to_string(Path::new(&attached.host_path).join(&file.name))
                .unwrap_or_default();
            assert_eq!(read, file.text, "{} of {id} through host_path", file.name);
        }
        w.detach("sb-check", &id, 0, &attached.metadata)
            .await
            .unwrap();
    }
    assert_eq!(w.mounts(), Vec::<PathBuf>::new());

    // The figures (printed, not asserted).
    let calls = w.driver.mutating_calls();
    let count = |m: &str| calls.iter().filter(|c| **c == m).count();
    println!(
        "churn: {CYCLES} cycles over {VOLUMES} volumes and {} namespaces by {RPC_CALLERS} rpc \
         and {BINARY_CALLERS} binary callers in {:.1} s ({:.0} cycles/s)",
        NAMESPACES.len(),
        elapsed.as_secs_f64(),
        CYCLES as f64 / elapsed.as_secs_f64()
    );
    println!(
        "churn: CSI calls: {} NodeStage, {} NodePublish, {} ControllerPublish (first holders); \
         {} NodeUnpublish, {} NodeUnstage, {} ControllerUnpublish (last holders), incl. the \
         final check's {VOLUMES}",
        count("NodeStageVolume"),
        count("NodePublishVolume"),
        count("ControllerPublishVolume"),
        count("NodeUnpublishVolume"),
        count("NodeUnstageVolume"),
        count("ControllerUnpublishVolume"),
    );
    println!(
        "churn: {} of {CYCLES} Attaches found their volume already mounted (another holder, \
         in the same or another namespace) and made no CSI call",
        CYCLES + VOLUMES - count("NodePublishVolume")
    );
    for (name, mut figures) in std::mem::take(&mut *shared.figures.lock().unwrap()) {
        figures.attach.sort();
        figures.detach.sort();
        println!(
            "churn: {name:>6}: {} cycles; Attach p50 {:.1} ms p95 {:.1} ms max {:.1} ms; \
             Detach p50 {:.1} ms p95 {:.1} ms max {:.1} ms; most holders of one volume {}",
            figures.attach.len(),
            percentile(&figures.attach, 0.5),
            percentile(&figures.attach, 0.95),
            percentile(&figures.attach, 1.0),
            percentile(&figures.detach, 0.5),
            percentile(&figures.detach, 0.95),
            percentile(&figures.detach, 1.0),
            figures.max_holders
        );
    }

    for i in 0..VOLUMES {
        w.destroy(&volume_id(i)).await.unwrap();
    }
}
