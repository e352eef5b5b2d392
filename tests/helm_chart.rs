//! The Helm chart in charts/cube-csi-bridge, through a real helm: `helm lint --strict` with the
//! default values and with each example values file; the rendered manifests of each example
//! pinned byte for byte in tests/golden/helm/; values.schema.json refusing wrong types, unknown
//! keys and bad names with a message that names the field; and the bridge configs the chart
//! renders (node.toml, controller.toml) accepted by the bridge's own config parser.
//!
//! Needs `CUBE_CSI_BRIDGE_K8S_BIN`, the directory holding `helm` (scripts/install-k8s-peers.sh
//! prints it). Without it the tests skip loudly, or fail when `CI` is set.
//!
//! After an intended change to the chart, accept the new renders with
//! `UPDATE_GOLDEN=1 cargo test --test helm_chart`, and review the diff of tests/golden/helm/.

use std::path::{Path, PathBuf};
use std::process::Command;

use cube_csi_bridge::config::{Config, ControllerStoreKind, Roles};
use cube_csi_bridge::csi::Endpoint;

const K8S_BIN_ENV: &str = "CUBE_CSI_BRIDGE_K8S_BIN";
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cube-csi-bridge");
const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/helm");
const RELEASE: &str = "cube-csi-bridge";
const NAMESPACE: &str = "cube-system";
/// The oldest Kubernetes the chart supports (Chart.yaml `kubeVersion`). Passed explicitly so a
/// render does not depend on the Kubernetes version a helm binary was built to assume.
const KUBE_VERSION: &str = "1.27.0";

/// Example values files: (golden name, file under the chart's examples/).
const EXAMPLES: [(&str, &str); 2] = [
    ("nfs", "values-nfs.yaml"),
    ("hostpath", "values-hostpath.yaml"),
];

/// Lines of a golden mismatch shown on each side.
const DIFF_LINES: usize = 12;

/// The helm binary, or `None` (test skipped) when `CUBE_CSI_BRIDGE_K8S_BIN` is unset outside CI.
fn helm_binary() -> Option<PathBuf> {
    let Some(dir) = std::env::var_os(K8S_BIN_ENV).filter(|v| !v.is_empty()) else {
        if std::env::var_os("CI").is_some() {
            panic!(
                "{K8S_BIN_ENV} is not set, and CI is: the Helm chart tests must run in CI \
                 (set it to the directory holding helm, printed by scripts/install-k8s-peers.sh)"
            );
        }
        eprintln!(
            "\n*** SKIPPED: {K8S_BIN_ENV} is not set, so the Helm chart was NOT tested. Set it to \
             the directory holding helm (scripts/install-k8s-peers.sh prints it). ***\n"
        );
        return None;
    };
    let helm = PathBuf::from(dir).join("helm");
    assert!(
        helm.is_file(),
        "{K8S_BIN_ENV}={} has no helm: run scripts/install-k8s-peers.sh",
        helm.parent().unwrap().display()
    );
    Some(helm)
}

/// Skips the test unless helm is available; yields a runner for it.
macro_rules! require_helm {
    () => {
        match helm_binary() {
            Some(bin) => Helm::new(bin),
            None => return,
        }
    };
}

/// One helm command's outcome.
struct Run {
    success: bool,
    stdout: String,
    stderr: String,
    /// The command line, for messages.
    line: String,
}

/// helm, isolated from the user's helm config, cache and data, and from any cluster.
struct Helm {
    bin: PathBuf,
    home: tempfile::TempDir,
}

impl Helm {
    fn new(bin: PathBuf) -> Helm {
        Helm {
            bin,
            home: tempfile::tempdir().expect("temp dir for helm's home"),
        }
    }

    fn run(&self, args: &[&str]) -> Run {
        let home = self.home.path();
        let out = Command::new(&self.bin)
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_DATA_HOME", home.join("data"))
            .env("KUBECONFIG", home.join("no-kubeconfig"))
            .env_remove("HELM_NAMESPACE")
            .env_remove("HELM_KUBECONTEXT")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.bin.display()));
        Run {
            success: out.status.success(),
            stdout: String::from_utf8(out.stdout).expect("helm's stdout is UTF-8"),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            line: format!("helm {}", args.join(" ")),
        }
    }

    /// `helm template` of the chart as release cube-csi-bridge in cube-system, plus `extra`.
    fn template(&self, extra: &[&str]) -> Run {
        let mut args = vec![
            "template",
            RELEASE,
            CHART,
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
        ];
        args.extend_from_slice(extra);
        self.run(&args)
    }

    /// `helm template` that must succeed; its manifests.
    fn render(&self, extra: &[&str]) -> String {
        let run = self.template(extra);
        assert!(
            run.success,
            "{} failed:\n{}{}",
            run.line, run.stderr, run.stdout
        );
        run.stdout
    }
}

fn example(file: &str) -> String {
    format!("{CHART}/examples/{file}")
}

/// Every values setup the chart ships: the defaults and each example.
fn value_sets() -> Vec<(&'static str, Vec<String>)> {
    let mut sets = vec![("default", Vec::new())];
    for (name, file) in EXAMPLES {
        sets.push((name, vec!["-f".to_string(), example(file)]));
    }
    sets
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn chart_lints_strictly_with_defaults_and_each_example() {
    let helm = require_helm!();
    for (name, values) in value_sets() {
        let mut args = vec!["lint", "--strict", CHART];
        args.extend(strs(&values));
        let run = helm.run(&args);
        assert!(
            run.success && run.stdout.contains("0 chart(s) failed"),
            "{} ({name} values) failed:\n{}{}",
            run.line,
            run.stdout,
            run.stderr
        );
        for level in ["[WARNING]", "[ERROR]"] {
            assert!(
                !run.stdout.contains(level),
                "{} ({name} values) reported {level}:\n{}",
                run.line,
                run.stdout
            );
        }
    }
}

#[test]
fn examples_render_exactly_as_the_golden_files() {
    let helm = require_helm!();
    let update = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1");
    let mut mismatches = Vec::new();
    for (name, file) in EXAMPLES {
        // With the CRD, so that a schema change shows up here too.
        let rendered = helm.render(&["--include-crds", "-f", &example(file)]);
        let golden_path = Path::new(GOLDEN_DIR).join(format!("{name}.yaml"));
        if update {
            std::fs::create_dir_all(GOLDEN_DIR).expect("create tests/golden/helm");
            std::fs::write(&golden_path, &rendered)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", golden_path.display()));
            eprintln!("UPDATE_GOLDEN=1: wrote {}", golden_path.display());
            continue;
        }
        let golden = std::fs::read_to_string(&golden_path).unwrap_or_else(|e| {
            panic!(
                "cannot read {}: {e}; create it with UPDATE_GOLDEN=1 cargo test --test helm_chart",
                golden_path.display()
            )
        });
        if golden != rendered {
            mismatches.push(format!(
                "examples/{file} renders differently from {}:\n{}",
                golden_path.display(),
                first_difference(&golden, &rendered)
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{}\nIf the change is intended, accept it with \
         UPDATE_GOLDEN=1 cargo test --test helm_chart and review the diff of tests/golden/helm/.",
        mismatches.join("\n")
    );
}

/// A short unified-style diff from the first line that differs: a little context, then the
/// differing lines of each side, up to where the two line up again at the same line number
/// (at most `DIFF_LINES`). Not a minimal diff; enough to see what changed.
fn first_difference(golden: &str, rendered: &str) -> String {
    let old: Vec<&str> = golden.split('\n').collect();
    let new: Vec<&str> = rendered.split('\n').collect();
    let same = |i: usize| i < old.len() && i < new.len() && old[i] == new[i];
    let first = (0..).find(|&i| !same(i)).expect("the texts differ");
    let start = first.saturating_sub(3);
    let limit = first + DIFF_LINES;
    let resync = (first..limit).find(|&i| same(i)).unwrap_or(limit);
    let old_end = resync.min(old.len());
    let new_end = resync.min(new.len());
    let after = (resync..resync + 3).take_while(|&i| same(i)).count();
    let mut out = format!(
        "--- golden\n+++ rendered\n@@ -{},{} +{},{} @@\n",
        start + 1,
        old_end - start + after,
        start + 1,
        new_end - start + after
    );
    for line in &old[start..first] {
        out.push_str(&format!(" {line}\n"));
    }
    for line in &old[first.min(old_end)..old_end] {
        out.push_str(&format!("-{line}\n"));
    }
    for line in &new[first.min(new_end)..new_end] {
        out.push_str(&format!("+{line}\n"));
    }
    for line in old.iter().skip(resync).take(after) {
        out.push_str(&format!(" {line}\n"));
    }
    out
}

#[test]
fn schema_refuses_bad_values_naming_the_field() {
    let helm = require_helm!();
    // (what is wrong, --set argument, text the error must contain)
    let cases = [
        ("a wrong type", "node.enabled=yes", "/node/enabled"),
        (
            "a wrong type",
            "volume.capacityBytes=lots",
            "/volume/capacityBytes",
        ),
        (
            "an unknown key",
            "node.nodeSelctor.role=cubelet",
            "nodeSelctor",
        ),
        ("an unknown top-level key", "drivr=nfs", "drivr"),
        ("a bad driver name", "driver=-nfs", "/driver"),
        ("a bad driver name", "driver=nfs/1", "/driver"),
        (
            "a relative path",
            "socketDir=run/cube-csi-bridge",
            "/socketDir",
        ),
        (
            "a value outside an enum",
            "node.services=all",
            "/node/services",
        ),
        ("a bad mount view", "node.mountView=host", "/node/mountView"),
        (
            "a record key pin that is no SHA-256",
            "kubernetes.recordKeySha256=abc",
            "/kubernetes/recordKeySha256",
        ),
        (
            "an unprivileged node driver container",
            "node.driver.securityContext.privileged=false",
            "/node/driver/securityContext/privileged",
        ),
        (
            "a probe timeout too short to leave the probe a second",
            "probes.readiness.timeoutSeconds=1",
            "/probes/readiness/timeoutSeconds",
        ),
        ("an unknown probe", "probes.startup.enabled=true", "startup"),
        (
            "a digest that is not one",
            "image.digest=latest",
            "/image/digest",
        ),
        (
            "a driver image registry given as a URL",
            "controller.driver.image.registry=https://mirror.internal",
            "/controller/driver/image/registry",
        ),
        (
            "a driver image registry with a trailing slash",
            "node.driver.image.registry=mirror.internal:5000/",
            "/node/driver/image/registry",
        ),
        // Checks across values, made by the templates.
        (
            "a single-node setup beside a controller side",
            "node.services=both",
            "controller.enabled",
        ),
        (
            "a driver name unfit to label CubeVolume objects",
            "driver=nfs-",
            "driver",
        ),
        (
            "a driver name unfit to label the CubeVolume objects a node follows",
            "driver=nfs-,controller.enabled=false",
            "node.followExpansions",
        ),
        (
            "volume parameters beside a StorageClass",
            "volume.parameters.server=10.0.0.5",
            "volume.parameters",
        ),
        // Driver X's controller side is instance X-controller (socket, state and lock
        // dirs): a release of driver X-controller would share them.
        (
            "a driver name another driver's controller side uses",
            "driver=nfs-controller",
            "-controller",
        ),
        (
            "the same, node side only",
            "driver=nfs-controller,controller.enabled=false",
            "-controller",
        ),
    ];
    for (what, set, field) in cases {
        let run = helm.template(&["--set", set]);
        assert!(
            !run.success,
            "{} ({what}) rendered instead of failing:\n{}",
            run.line, run.stdout
        );
        assert!(
            run.stderr.contains(field),
            "{} ({what}) failed without naming {field}:\n{}",
            run.line,
            run.stderr
        );
    }
}

/// The text of the block scalar `key: |` in a rendered ConfigMap.
///
/// Assumes the layout of templates/configmap.yaml as helm renders it: each key of `data` on a
/// line of its own, indented by two spaces, as a literal block scalar (`|`, clip chomping)
/// whose lines are indented by four spaces; blank lines inside it are empty.
fn block_scalar(manifest: &str, key: &str) -> Option<String> {
    let header = format!("  {key}: |");
    let mut lines = manifest.lines().skip_while(|l| *l != header);
    lines.next()?;
    let mut body: Vec<&str> = lines
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect();
    while body.last().is_some_and(|l| l.is_empty()) {
        body.pop();
    }
    Some(body.join("\n") + "\n")
}

#[test]
fn rendered_configs_are_valid_bridge_configs() {
    let helm = require_helm!();
    // Beyond the shipped setups: values whose TOML needs escaping, and every optional table.
    let dir = tempfile::tempdir().unwrap();
    let rich = dir.path().join("values-rich.yaml");
    std::fs::write(
        &rich,
        r#"driver: my.driver_1
kubernetes:
  storageClass: ""
  recordKeySha256: "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
volume:
  accessMode: single_node_writer
  capacityBytes: 107374182400
  fsType: ext4
  mountFlags: ["nfsvers=4.1", "hard"]
  parameters:
    server: "10.0.0.5"
    share: "/exports/\"quoted\"\\back"
    "key with spaces": "a&b<c>"
  mountGroup: 2000
  accessibilityRequirements:
    requisite:
      - {topology.example.com/zone: zone-a, topology.example.com/rack: "7"}
      - {topology.example.com/zone: zone-b}
    preferred:
      - {topology.example.com/zone: zone-b}
timeouts: {attachSecs: 60, detachSecs: 20}
driverUids: [65532, 1001]
node:
  controllerEndpoint: "http://10.0.0.8:10000"
controller:
  kind: Deployment
  replicas: 2
"#,
    )
    .unwrap();
    let mut sets = value_sets();
    sets.push(("rich", vec!["-f".into(), rich.display().to_string()]));

    for (name, values) in sets {
        let mut args = vec!["--show-only", "templates/configmap.yaml"];
        args.extend(strs(&values));
        let manifest = helm.render(&args);
        let mut found = 0;
        for (key, services) in [
            ("node.toml", [Roles::NODE, Roles::BOTH].as_slice()),
            ("controller.toml", [Roles::CONTROLLER].as_slice()),
        ] {
            let Some(text) = block_scalar(&manifest, key) else {
                continue;
            };
            found += 1;
            let path = PathBuf::from(format!("{name}/{key}"));
            let config = Config::parse(&text, &path)
                .unwrap_or_else(|e| panic!("{name} values: {key} is refused: {e}\n{text}"));
            assert!(
                services.contains(&config.serve.roles),
                "{name} values: {key} serves {:?}",
                config.serve.roles
            );
            assert_eq!(
                config.csi.endpoint,
                Endpoint::Unix("/csi/csi.sock".into()),
                "{name}/{key}"
            );
            let socket = config.socket_path().display().to_string();
            let expected = match key {
                "node.toml" => format!("/run/cube-csi-bridge/{}.sock", config.driver),
                _ => format!("/run/cube-csi-bridge/{}-controller.sock", config.driver),
            };
            assert_eq!(socket, expected, "{name}/{key}");
            // In the environment, not the file (see below).
            assert_eq!(config.state.instance, None, "{name}/{key}");
            if name != "rich" {
                assert!(config.csi.driver_uids.is_empty(), "{name}/{key}");
            }
            assert_eq!(
                config.node.default_volume_base_dir,
                Path::new("/data/cube-shared/volume"),
                "{name}/{key}"
            );
            if name == "rich" {
                assert_eq!(config.driver, "my.driver_1");
                assert_eq!(
                    config.volume.parameters.get("share").map(String::as_str),
                    Some(r#"/exports/"quoted"\back"#)
                );
                assert_eq!(
                    config
                        .volume
                        .parameters
                        .get("key with spaces")
                        .map(String::as_str),
                    Some("a&b<c>")
                );
                assert_eq!(config.volume.mount_flags, ["nfsvers=4.1", "hard"]);
                assert_eq!(config.volume.capacity_bytes, 107_374_182_400);
                assert_eq!(config.volume.mount_group, Some(2000));
                let zone = |pairs: &[(&str, &str)]| {
                    pairs
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect::<std::collections::BTreeMap<_, _>>()
                };
                let requirement = config.volume.accessibility.clone().expect("rendered");
                assert_eq!(
                    requirement.requisite,
                    [
                        zone(&[
                            ("topology.example.com/rack", "7"),
                            ("topology.example.com/zone", "zone-a")
                        ]),
                        zone(&[("topology.example.com/zone", "zone-b")])
                    ]
                );
                assert_eq!(
                    requirement.preferred,
                    [zone(&[("topology.example.com/zone", "zone-b")])]
                );
                assert_eq!(config.timeouts.attach, std::time::Duration::from_secs(60));
                assert_eq!(config.csi.driver_uids, [65532, 1001]);
                // The pin reaches the side that reads the key, and only that one.
                assert_eq!(
                    config.kubernetes.record_key_sha256.is_some(),
                    key == "controller.toml"
                );
                if key == "node.toml" {
                    assert_eq!(
                        config.csi.controller_endpoint,
                        Some(Endpoint::Tcp("10.0.0.8:10000".into()))
                    );
                }
            }
        }
        let expected = if name == "hostpath" { 1 } else { 2 };
        assert_eq!(
            found, expected,
            "{name} values: expected {expected} config(s) in the ConfigMap:\n{manifest}"
        );
    }
}

/// Releases of the same chart and values in two namespaces make no object of the same
/// kind, namespace and name (the CRDs aside, which they share): a second `helm install`
/// would fail on the first one's, and an apply would take it over. Before, the Role and
/// RoleBinding of the Secrets, made in the Secrets' namespace (`default` in the nfs
/// example), had the same names in both, and the StorageClass ClusterRole of release
/// `x-team` in namespace `a` was that of release `x` in namespace `team-a`.
#[test]
fn releases_in_two_namespaces_share_no_object() {
    let helm = require_helm!();
    let objects = |release: &str, namespace: &str, values: &[String]| {
        let mut args = vec![
            "template",
            release,
            CHART,
            "--namespace",
            namespace,
            "--kube-version",
            KUBE_VERSION,
        ];
        args.extend(strs(values));
        let run = helm.run(&args);
        assert!(run.success, "{} failed:\n{}", run.line, run.stderr);
        manifests(&run.stdout)
            .into_iter()
            .filter(|o| o["kind"] != "CustomResourceDefinition")
            .map(|o| {
                (
                    o["kind"].as_str().unwrap_or_default().to_string(),
                    o["metadata"]["namespace"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    o["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )
            })
            .collect::<std::collections::BTreeSet<_>>()
    };
    for (name, values) in value_sets() {
        for [(one, first), (two, second)] in [
            [(RELEASE, "team-a"), (RELEASE, "team-b")],
            [("cube-csi-bridge-team", "a"), (RELEASE, "team-a")],
        ] {
            let (a, b) = (objects(one, first, &values), objects(two, second, &values));
            let shared: Vec<_> = a.intersection(&b).collect();
            assert!(
                shared.is_empty(),
                "{name} values: {one} in {first} and {two} in {second} both make {shared:?}"
            );
        }
    }
}

/// The rendered manifests as JSON values, one per YAML document.
fn manifests(rendered: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    serde_norway::Deserializer::from_str(rendered)
        .map(|doc| serde_json::Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

/// The pod template of the workload (DaemonSet or Deployment) of `component`, if rendered.
fn workload_pod<'a>(
    objects: &'a [serde_json::Value],
    component: &str,
) -> Option<&'a serde_json::Value> {
    let name = format!("{RELEASE}-{component}");
    objects
        .iter()
        .find(|o| {
            matches!(o["kind"].as_str(), Some("DaemonSet" | "Deployment"))
                && o["metadata"]["name"] == name.as_str()
        })
        .map(|o| &o["spec"]["template"]["spec"])
}

fn pod_spec<'a>(objects: &'a [serde_json::Value], component: &str) -> &'a serde_json::Value {
    workload_pod(objects, component).unwrap_or_else(|| panic!("no {component} workload"))
}

fn container<'a>(pod: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn strings(value: &serde_json::Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Mount points of `container` by volume name.
fn mounts(container: &serde_json::Value) -> Vec<(String, serde_json::Value)> {
    container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap().to_string(), m.clone()))
        .collect()
}

/// The bridge containers' privileges, per side and node.mountView: no privileged mode, no
/// privilege escalation, uid 0 with every capability dropped except those the mount view
/// needs, and Bidirectional propagation only for the driver, which mounts.
#[test]
fn the_bridge_containers_get_only_what_their_role_needs() {
    let helm = require_helm!();
    let namespace_caps = ["SYS_PTRACE", "SYS_ADMIN", "SYS_CHROOT"];
    // (node.mountView, capabilities added to the node bridge, hostPID, namespace dir mounted)
    let views: [(&str, &[&str], Option<&str>); 4] = [
        ("self", &[], None),
        ("none", &[], None),
        (
            "auto",
            &namespace_caps,
            Some("/usr/local/services/cubetoolbox/cubeletmnt"),
        ),
        (
            "/run/cubelet-ns/mnt",
            &namespace_caps,
            Some("/run/cubelet-ns"),
        ),
    ];
    for (view, caps, ns_dir) in views {
        let objects = manifests(&helm.render(&["--set", &format!("node.mountView={view}")]));
        for component in ["node", "controller"] {
            let pod = pod_spec(&objects, component);
            let bridge = container(pod, "bridge");
            let context = &bridge["securityContext"];
            let what = format!("mountView {view}, {component} bridge");
            assert_eq!(context["privileged"], false, "{what}");
            assert_eq!(context["allowPrivilegeEscalation"], false, "{what}");
            assert_eq!(context["readOnlyRootFilesystem"], true, "{what}");
            assert_eq!(context["runAsUser"], 0, "{what}");
            assert_eq!(strings(&context["capabilities"]["drop"]), ["ALL"], "{what}");
            let added = strings(&context["capabilities"]["add"]);
            let expected: &[&str] = if component == "node" { caps } else { &[] };
            assert_eq!(added, expected, "{what}");
            assert_eq!(
                pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{what}"
            );
            let host_pid = pod["hostPID"].as_bool().unwrap_or(false);
            assert_eq!(host_pid, component == "node" && ns_dir.is_some(), "{what}");
            for probe in ["livenessProbe", "readinessProbe"] {
                let command = strings(&bridge[probe]["exec"]["command"]);
                assert_eq!(command[..2], ["cube-csi-bridge", "probe"], "{what} {probe}");
                assert_eq!(
                    command.contains(&"--ready".to_string()),
                    probe == "readinessProbe",
                    "{what} {probe}"
                );
            }

            let bridge_mounts = mounts(bridge);
            for (name, mount) in &bridge_mounts {
                assert_ne!(
                    mount["mountPropagation"], "Bidirectional",
                    "{what}: {name} is mounted Bidirectional"
                );
            }
            let ns_mount = bridge_mounts.iter().find(|(n, _)| n == "cubelet-mount-ns");
            match (component, ns_dir) {
                ("node", Some(dir)) => {
                    let (_, mount) = ns_mount.expect("the namespace dir is mounted");
                    assert_eq!(mount["mountPath"], dir, "{what}");
                    assert_eq!(mount["readOnly"], true, "{what}");
                }
                _ => assert!(ns_mount.is_none(), "{what}"),
            }
            if component == "node" {
                let (_, base) = bridge_mounts
                    .iter()
                    .find(|(n, _)| n == "volume-base-dir")
                    .unwrap();
                assert_eq!(base["mountPropagation"], "HostToContainer", "{what}");
                // The driver mounts: it alone keeps Bidirectional, hence privileged.
                let driver = container(pod, "csi-driver");
                let (_, driver_base) = mounts(driver)
                    .into_iter()
                    .find(|(n, _)| n == "volume-base-dir")
                    .unwrap();
                assert_eq!(driver_base["mountPropagation"], "Bidirectional", "{what}");
                assert_eq!(driver["securityContext"]["privileged"], true, "{what}");
            }
        }
    }
}

/// Each bridge container learns its release (`state.instance`, which tells two releases
/// of one driver name apart: their host paths agree) from its environment: a key new to
/// the config file would be refused by pods of an older version still running while
/// kubelet updates the file under them.
#[test]
fn each_bridge_container_names_its_release_in_its_environment() {
    let helm = require_helm!();
    let objects = manifests(&helm.render(&[]));
    let mut seen = 0;
    for component in ["node", "controller"] {
        let Some(pod) = workload_pod(&objects, component) else {
            continue;
        };
        for c in pod["containers"].as_array().unwrap() {
            if c["name"] != "bridge" {
                continue;
            }
            seen += 1;
            let env = c["env"].as_array().unwrap();
            assert!(
                env.iter().any(|e| e["name"] == "CUBE_CSI_BRIDGE_INSTANCE"
                    && e["value"] == format!("{NAMESPACE}/{RELEASE}")),
                "{component}: {env:?}"
            );
        }
    }
    assert_eq!(seen, 2, "a bridge container on each side");
}

/// The API token reaches the bridge container only, and only on a side that uses the API:
/// never the third-party driver container.
#[test]
fn only_the_bridge_gets_a_service_account_token() {
    let helm = require_helm!();
    let token_dir = "/var/run/secrets/kubernetes.io/serviceaccount";
    // (values, whether the node side uses the API)
    let setups: [(&[&str], bool); 4] = [
        (&[], true),
        // Following recorded expansions alone needs the API (CubeVolumes).
        (&["--set", "kubernetes.storageClass="], true),
        (
            &[
                "--set",
                "kubernetes.storageClass=",
                "--set",
                "node.followExpansions=false",
            ],
            false,
        ),
        (&["-f", &example("values-hostpath.yaml")], true),
    ];
    for (values, node_uses_api) in setups {
        let objects = manifests(&helm.render(values));
        for component in ["node", "controller"] {
            let Some(pod) = workload_pod(&objects, component) else {
                continue;
            };
            let what = format!("{values:?}, {component}");
            assert_eq!(pod["automountServiceAccountToken"], false, "{what}");
            let uses_api = component == "controller" || node_uses_api;
            for c in pod["containers"].as_array().unwrap() {
                let has_token = mounts(c).iter().any(|(_, m)| m["mountPath"] == token_dir);
                let is_bridge = c["name"] == "bridge";
                assert_eq!(
                    has_token,
                    is_bridge && uses_api,
                    "{what}: container {} token",
                    c["name"]
                );
            }
            let projected = pod["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == "kube-api-access");
            assert_eq!(projected.is_some(), uses_api, "{what}");
            if let Some(volume) = projected {
                let sources = volume["projected"]["sources"].as_array().unwrap();
                assert!(
                    sources
                        .iter()
                        .any(|s| s["serviceAccountToken"]["path"] == "token"),
                    "{what}"
                );
            }
        }
    }
}

/// The node side grows what `cube-csi-bridge expand` recorded in a CubeVolume (issue 21,
/// part 1): by default its config reads the CubeVolume store and its ServiceAccount may `get`
/// CubeVolumes, nothing more (no list, no write, no Secret); with node.followExpansions=false
/// it keeps the embedded store's (unused) default and gets no such Role.
#[test]
fn the_node_side_follows_recorded_expansions_with_get_only() {
    let helm = require_helm!();
    let node_sa = format!("{RELEASE}-node");
    let role_name = format!("{RELEASE}-node-cubevolumes");
    for (values, follows) in [
        (vec![], true),
        (vec!["--set", "kubernetes.storageClass="], true),
        (vec!["--set", "node.followExpansions=false"], false),
    ] {
        let rendered = helm.render(&values);
        let node_toml = block_scalar(&rendered, "node.toml").expect("node.toml");
        let config = Config::parse(&node_toml, Path::new("node.toml")).unwrap();
        assert_eq!(config.serve.roles, Roles::NODE, "{values:?}");
        assert_eq!(
            config.state.controller_store,
            if follows {
                ControllerStoreKind::Kubernetes
            } else {
                ControllerStoreKind::Embedded
            },
            "{values:?}: node.toml\n{node_toml}"
        );
        assert!(node_toml.contains("[kubernetes]") || !follows, "{values:?}");
        // The key that signs records never reaches the node side.
        assert!(!node_toml.contains("record_key"), "{values:?}\n{node_toml}");
        let objects = manifests(&rendered);
        let role = objects
            .iter()
            .find(|o| o["kind"] == "Role" && o["metadata"]["name"] == role_name.as_str());
        let binding = objects
            .iter()
            .find(|o| o["kind"] == "RoleBinding" && o["metadata"]["name"] == role_name.as_str());
        assert_eq!(role.is_some(), follows, "{values:?}");
        assert_eq!(binding.is_some(), follows, "{values:?}");
        if let (Some(role), Some(binding)) = (role, binding) {
            assert_eq!(
                role["rules"],
                serde_json::json!([{
                    "apiGroups": ["csibridge.cubesandbox.io"],
                    "resources": ["cubevolumes"],
                    "verbs": ["get"],
                }]),
                "{values:?}"
            );
            assert_eq!(binding["subjects"][0]["name"], node_sa.as_str());
            assert_eq!(binding["roleRef"]["name"], role_name.as_str());
        }
        // No other Role or ClusterRole binds the node account to CubeVolumes.
        for other in objects.iter().filter(|o| {
            matches!(
                o["kind"].as_str(),
                Some("RoleBinding" | "ClusterRoleBinding")
            ) && o["metadata"]["name"] != role_name.as_str()
        }) {
            let bound_to_node = other["subjects"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["name"] == node_sa.as_str());
            if bound_to_node {
                let role_ref = other["roleRef"]["name"].as_str().unwrap();
                assert!(
                    !role_ref.ends_with("-cubevolumes"),
                    "{values:?}: {role_ref}"
                );
            }
        }
    }
}

/// The bridge container's securityContext from the values is merged over the chart's own.
#[test]
fn bridge_security_context_values_are_merged_over_the_chart_defaults() {
    let helm = require_helm!();
    let digest = format!("image.digest=sha256:{}", "0f".repeat(32));
    let objects = manifests(&helm.render(&[
        "--set",
        "node.bridge.securityContext.appArmorProfile.type=Unconfined",
        "--set",
        "probes.liveness.enabled=false",
        "--set",
        &digest,
    ]));
    let pod = pod_spec(&objects, "node");
    let bridge = container(pod, "bridge");
    assert_eq!(
        bridge["securityContext"]["appArmorProfile"]["type"],
        "Unconfined"
    );
    assert_eq!(bridge["securityContext"]["allowPrivilegeEscalation"], false);
    assert!(bridge.get("livenessProbe").is_none());
    assert!(bridge.get("readinessProbe").is_some());
    let image = bridge["image"].as_str().unwrap();
    assert!(
        image.ends_with(&format!("@sha256:{}", "0f".repeat(32))),
        "{image}"
    );
}

/// The driver image is `<registry>/<repository>:<tag>` with `registry` set, and
/// `<repository>:<tag>` alone while it is empty, as in the defaults and every example: the chart
/// names no registry, so each repository is a plain image name whose first component is no
/// host (no '.' or ':'). The registry of one side leaves the other side and the bridge alone.
#[test]
fn driver_image_gets_the_registry_in_front_only_when_one_is_set() {
    let helm = require_helm!();
    for (name, values) in value_sets() {
        let objects = manifests(&helm.render(&strs(&values)));
        for side in ["node", "controller"] {
            let Some(pod) = workload_pod(&objects, side) else {
                continue;
            };
            let image = container(pod, "csi-driver")["image"].as_str().unwrap();
            let (repository, tag) = image.rsplit_once(':').unwrap();
            assert!(
                repository.starts_with("sig-storage/") && !tag.is_empty(),
                "{name} values, {side} side: {image}"
            );
            let first = repository.split('/').next().unwrap();
            assert!(
                !first.contains('.') && !first.contains(':'),
                "{name} values, {side} side names a registry: {image}"
            );
        }
    }
    let registry = "mirror.internal:5000/csi";
    let objects = manifests(&helm.render(&[
        "-f",
        &example("values-nfs.yaml"),
        "--set",
        &format!("node.driver.image.registry={registry}"),
    ]));
    let node = pod_spec(&objects, "node");
    assert_eq!(
        container(node, "csi-driver")["image"],
        format!("{registry}/sig-storage/nfsplugin:v4.13.4")
    );
    assert_eq!(
        container(pod_spec(&objects, "controller"), "csi-driver")["image"],
        "sig-storage/nfsplugin:v4.13.4"
    );
    let bridge = container(node, "bridge")["image"].as_str().unwrap();
    assert!(!bridge.contains(registry), "{bridge}");
    let objects = manifests(&helm.render(&[
        "-f",
        &example("values-hostpath.yaml"),
        "--set",
        "node.driver.image.registry=localhost:5000",
        "--set",
        "node.driver.image.tag=v1.18.0-rc.1",
    ]));
    assert_eq!(
        container(pod_spec(&objects, "node"), "csi-driver")["image"],
        "localhost:5000/sig-storage/hostpathplugin:v1.18.0-rc.1"
    );
}

/// Metrics are off by default (the host-path example); switched on (the nfs example does),
/// each bridge serves /metrics on its side's port
/// (node: metrics.port, controller: port + 1), a Service per side selects the pods, and the
/// ServiceMonitor appears only when asked for.
#[test]
fn metrics_are_exposed_only_when_enabled() {
    let helm = require_helm!();
    let nfs = example("values-nfs.yaml");
    let off = manifests(&helm.render(&["-f", &example("values-hostpath.yaml")]));
    assert!(
        !off.iter()
            .any(|o| o["kind"] == "Service" || o["kind"] == "ServiceMonitor"),
        "metrics objects rendered by default"
    );
    let lint = helm.run(&[
        "lint",
        "--strict",
        CHART,
        "--set",
        "metrics.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true",
    ]);
    assert!(lint.success, "{}{}", lint.stdout, lint.stderr);
    for monitor in [false, true] {
        let rendered = helm.render(&[
            "-f",
            &nfs,
            "--set",
            "metrics.enabled=true",
            "--set",
            &format!("metrics.serviceMonitor.enabled={monitor}"),
        ]);
        for (key, side, port) in [
            ("node.toml", "node", 9808),
            ("controller.toml", "controller", 9809),
        ] {
            let text = block_scalar(&rendered, key).unwrap();
            let config = Config::parse(&text, Path::new(key)).unwrap();
            // Loopback in the file; the pod's own IP, never every interface of a host
            // whose network the pod may share, through the args (issue 18, finding 2).
            assert_eq!(
                config.metrics.listen,
                Some(format!("127.0.0.1:{port}").parse().unwrap()),
                "{key}"
            );
            assert!(!text.contains("0.0.0.0"), "{key}: {text}");
            let objects = manifests(&rendered);
            let bridge = container(pod_spec(&objects, side), "bridge");
            let args: Vec<&str> = bridge["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            assert_eq!(
                args[args.len() - 2..],
                ["--metrics-listen-ip", "$(POD_IP)"],
                "{side}: {args:?}"
            );
            let pod_ip = bridge["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == "POD_IP")
                .unwrap_or_else(|| panic!("{side}: no POD_IP env"));
            assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
            assert_eq!(bridge["ports"][0]["containerPort"], port, "{side}");
            let service = objects
                .iter()
                .find(|o| {
                    o["kind"] == "Service"
                        && o["metadata"]["labels"]["app.kubernetes.io/component"] == side
                })
                .unwrap_or_else(|| panic!("no {side} metrics Service"));
            assert_eq!(service["spec"]["ports"][0]["port"], port);
            assert_eq!(
                service["spec"]["selector"]["app.kubernetes.io/component"],
                side
            );
        }
        let monitors = manifests(&rendered)
            .into_iter()
            .filter(|o| o["kind"] == "ServiceMonitor")
            .count();
        assert_eq!(monitors, usize::from(monitor));
    }
    let bad = helm.template(&["--set", "metrics.volumeStatsIntervalSecs=2"]);
    assert!(
        !bad.success && bad.stderr.contains("volumeStatsIntervalSecs"),
        "{}",
        bad.stderr
    );
}
