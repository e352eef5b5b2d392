//! Which kubeconfig the API client loads, and the trust rule it and every file or program
//! it names are held to before the root daemon believes or runs them.
//!
//! A kubeconfig says which API server to believe (its CA), with which credentials (a
//! token file, a client key), and may name a program to run for them (`exec`, an auth
//! provider's `cmd-path`): each is as much the bridge's config as the config file is, so
//! each must pass `config::check_trusted_file` (owned by root or the bridge's user, not
//! writable by others, reached through no directory or symlink another user controls).

use std::path::{Path, PathBuf};

use kube::client::AuthError;
use kube::config::{AuthInfo, Cluster, ExecInteractiveMode, KubeConfigOptions, Kubeconfig};

use super::KubeError;

/// Reads the kubeconfig at `path` (the `kubernetes.kubeconfig` setting) once it and what
/// it names have passed the trust rule.
pub(super) async fn load(path: &Path) -> Result<kube::Config, KubeError> {
    let configure = |e: &dyn std::fmt::Display| KubeError::Configure {
        source_desc: path.display().to_string(),
        message: e.to_string(),
    };
    crate::config::check_trusted_file(path).map_err(|e| configure(&e))?;
    let kubeconfig =
        Kubeconfig::read_from(path).map_err(|e| configure(&describe_config_error(&e)))?;
    check_named_files(&kubeconfig).map_err(|e| configure(&e))?;
    check_no_proxy(&kubeconfig).map_err(|e| configure(&e))?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| configure(&describe_config_error(&e)))
}

/// A kubeconfig error as words safe to return to Cube: the YAML parser's message quotes
/// the lines around the error, which may hold a token, a password or a key.
pub(super) fn describe_config_error(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(kube::config::KubeconfigError::Parse(_)) =
            e.downcast_ref::<kube::config::KubeconfigError>()
        {
            return "the kubeconfig is not valid YAML of a kubeconfig (the parser's message \
                    is not shown: it quotes the file's lines, which may hold credentials)"
                .to_string();
        }
        cause = e.source();
    }
    error.to_string()
}

/// Refuses a cluster that names a `proxy-url`: the client is built without proxy support
/// (it would fail naming a build feature, and quote the URL, credentials included), and
/// the API server is reached directly.
fn check_no_proxy(kubeconfig: &Kubeconfig) -> Result<(), String> {
    let proxied = kubeconfig.clusters.iter().find(|named| {
        named
            .cluster
            .as_ref()
            .and_then(|c| c.proxy_url.as_deref())
            .is_some_and(|url| !url.is_empty())
    });
    match proxied {
        Some(named) => Err(format!(
            "its cluster {:?} names a proxy-url; the bridge reaches the API server directly \
             (no proxy): remove it",
            named.name
        )),
        None => Ok(()),
    }
}

/// Holds the kubeconfig files `kube::Config::infer` would read (`$KUBECONFIG`'s, else
/// `~/.kube/config`) to the same rule as an explicit one, and what they name: a forked
/// hook inherits Cubelet's environment and home. With none of them present, infer falls
/// back to the pod's service account, whose files the kubelet mounts.
pub(super) fn check_inferred() -> Result<(), KubeError> {
    check_candidates(&inferred_candidates())
}

/// `check_inferred` of these kubeconfig paths.
fn check_candidates(candidates: &[PathBuf]) -> Result<(), KubeError> {
    // One missing now may be there when the client reads it a moment later: where another
    // user could make it (a directory on the way theirs, or writable by them), refused.
    let euid = nix::unistd::geteuid().as_raw();
    for missing in candidates.iter().filter(|p| !p.exists()) {
        let absolute = std::path::absolute(missing).unwrap_or_else(|_| missing.to_path_buf());
        let why = crate::config::untrusted_on_the_way([absolute.as_path()], euid, false)
            .map(|replaceable| replaceable.describe("it"))
            .or_else(|| creatable_by_others(&absolute, euid));
        if let Some(why) = why {
            return Err(KubeError::Configure {
                source_desc: missing.display().to_string(),
                message: format!(
                    "{why}, so another user could make this kubeconfig (not there yet) between \
                     its check and its read; point $KUBECONFIG (or HOME) at a directory only \
                     root can write"
                ),
            });
        }
    }
    let present: Vec<&PathBuf> = candidates.iter().filter(|p| p.exists()).collect();
    for path in &present {
        crate::config::check_trusted_file(path).map_err(|message| KubeError::Configure {
            source_desc: path.display().to_string(),
            message,
        })?;
    }
    if present.is_empty() {
        return Ok(());
    }
    let source_desc = present
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let configure = |message: String| KubeError::Configure {
        source_desc: source_desc.clone(),
        message,
    };
    // Merged as infer merges them; a file that cannot be read is infer's error to report.
    let merged = present
        .iter()
        .try_fold(Kubeconfig::default(), |merged, path| {
            Kubeconfig::read_from(path).and_then(|one| merged.merge(one))
        });
    match merged {
        Ok(kubeconfig) => {
            check_named_files(&kubeconfig).map_err(configure)?;
            check_no_proxy(&kubeconfig).map_err(configure)
        }
        Err(_) => Ok(()),
    }
}

/// Why another user could make `path`, which does not exist: a link is there (to a file
/// not there either, wherever it leads), or the nearest directory above it that exists
/// lets others add names (with the sticky bit too: it stops renames and removals, not a
/// new name).
fn creatable_by_others(path: &Path, euid: u32) -> Option<String> {
    if std::fs::symlink_metadata(path).is_ok() {
        return Some(format!(
            "{} is a link to a file that is not there",
            path.display()
        ));
    }
    let dir = path.ancestors().skip(1).find(|d| d.exists())?;
    crate::config::others_may_add_names(dir, euid)
        .map(|why| format!("the nearest directory of it there is, {why}"))
}

/// Makes the client run the kubeconfig's programs exactly as they were checked: a bare
/// `exec` command (or an auth provider's `cmd-path`) becomes the absolute path of the file
/// found and checked, so that a file put earlier on `PATH` later, or a `dropEnv: [PATH]`,
/// cannot change what the client's spawn runs at a token refresh. The `exec` command also
/// runs with no terminal of the bridge's: in the client's default (interactive) mode it
/// would inherit the process's stdin and stderr, and a forked hook's stderr is what Cube
/// shows as a failed hook's message.
pub(super) fn pin_programs(config: &mut kube::Config) -> Result<(), String> {
    if let Some(exec) = config.auth_info.exec.as_mut() {
        exec.interactive_mode = Some(ExecInteractiveMode::Never);
        if let Some(command) = &exec.command {
            let program = checked_program("exec command", command, exec_path(exec))?;
            exec.command = Some(program);
        }
    }
    if let Some(provider) = config.auth_info.auth_provider.as_mut()
        && let Some(command) = provider.config.get("cmd-path")
    {
        let program = checked_program("auth-provider cmd-path", command, None)?;
        provider.config.insert("cmd-path".into(), program);
    }
    Ok(())
}

/// The `PATH` an `exec` command's own `env` gives it: the last one, as the spawn sets
/// them in order.
fn exec_path(exec: &kube::config::ExecConfig) -> Option<String> {
    exec.env
        .iter()
        .flatten()
        .rev()
        .find(|pair| pair.get("name").is_some_and(|n| n == "PATH") && pair.contains_key("value"))
        .and_then(|pair| pair.get("value").cloned())
}

/// The absolute path of the program `command` names, once it passed the trust rule.
fn checked_program(field: &str, command: &str, path_env: Option<String>) -> Result<String, String> {
    let path = program_path(command, path_env)?;
    crate::config::check_trusted_file(&path)
        .map_err(|problem| format!("its {field} {}: {problem}", path.display()))?;
    let absolute = std::path::absolute(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    absolute
        .to_str()
        .map(str::to_string)
        .ok_or_else(|| format!("its {field} {} is not UTF-8", absolute.display()))
}

/// A client error as words safe to log and to return to Cube: an authentication failure
/// is named by what failed, never with the text the client gives it, which carries the
/// `exec` command's arguments and environment (`Command`'s debug form) and its output, or a
/// plugin's own message, any of which may hold credentials.
pub(super) fn describe_client_error(error: &kube::Error) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(auth) = e.downcast_ref::<AuthError>() {
            return describe_auth_error(auth);
        }
        cause = e.source();
    }
    error.to_string()
}

fn describe_auth_error(error: &AuthError) -> String {
    const WITHHELD: &str = "its details are not shown: they may hold credentials";
    match error {
        AuthError::AuthExecStart(io) => {
            format!("the kubeconfig's exec command could not be started ({io}); check its command")
        }
        AuthError::AuthExecRun { out, .. } => format!(
            "the kubeconfig's exec command failed ({}); {WITHHELD} (run it by hand as root to \
             see them)",
            out.status
        ),
        AuthError::ReadTokenFile(io, path) => format!(
            "the kubeconfig's token file {} cannot be read: {io}",
            path.display()
        ),
        AuthError::MissingCommand => "the kubeconfig's exec entry names no command".to_string(),
        _ => format!(
            "authenticating to the API server with the kubeconfig's user failed; {WITHHELD}"
        ),
    }
}

/// The files `kube::Config::infer` reads: each of `$KUBECONFIG`'s, else `.kube/config` in
/// the home dir found as the client finds it (`std::env::home_dir`: `$HOME`, else the
/// user's entry in the password database, which is where it looks under a systemd unit
/// with no `User=`, whose environment has no `HOME`).
fn inferred_candidates() -> Vec<PathBuf> {
    let listed: Vec<PathBuf> = std::env::var_os("KUBECONFIG")
        .map(|list| {
            std::env::split_paths(&list)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default();
    // A `$KUBECONFIG` that names no file (empty, or only separators) is no `$KUBECONFIG`
    // to the client: it reads the home dir's file then.
    if !listed.is_empty() {
        return listed;
    }
    std::env::home_dir()
        .map(|home| home.join(".kube/config"))
        .into_iter()
        .collect()
}

/// Checks every file and program the context in use names (all contexts' when none is
/// current or it cannot be found: the client fails on it anyway, and nothing is read
/// before this check). `Kubeconfig::read_from` has made relative paths absolute.
fn check_named_files(kubeconfig: &Kubeconfig) -> Result<(), String> {
    let context = kubeconfig
        .current_context
        .as_deref()
        .and_then(|name| kubeconfig.contexts.iter().find(|c| c.name == name))
        .and_then(|named| named.context.as_ref());
    let clusters: Vec<&Cluster> = kubeconfig
        .clusters
        .iter()
        .filter(|named| context.is_none_or(|c| c.cluster == named.name))
        .filter_map(|named| named.cluster.as_ref())
        .collect();
    let users: Vec<&AuthInfo> = kubeconfig
        .auth_infos
        .iter()
        .filter(|named| context.is_none_or(|c| c.user.as_deref() == Some(&named.name)))
        .filter_map(|named| named.auth_info.as_ref())
        .collect();
    let mut named: Vec<(&str, PathBuf)> = Vec::new();
    for cluster in clusters {
        if let Some(ca) = &cluster.certificate_authority {
            named.push(("certificate-authority", PathBuf::from(ca)));
        }
    }
    for user in users {
        let files = [
            ("client-certificate", &user.client_certificate),
            ("client-key", &user.client_key),
            ("tokenFile", &user.token_file),
        ];
        for (field, file) in files {
            if let Some(file) = file {
                named.push((field, PathBuf::from(file)));
            }
        }
        if let Some(exec) = &user.exec
            && let Some(command) = &exec.command
        {
            named.push(("exec command", program_path(command, exec_path(exec))?));
        }
        if let Some(command) = user
            .auth_provider
            .as_ref()
            .and_then(|provider| provider.config.get("cmd-path"))
        {
            named.push(("auth-provider cmd-path", program_path(command, None)?));
        }
    }
    for (field, path) in named {
        crate::config::check_trusted_file(&path)
            .map_err(|problem| format!("its {field} {}: {problem}", path.display()))?;
    }
    Ok(())
}

/// The file a program name runs: itself when it holds a '/', else the first executable
/// of that name along `PATH` (the command's own PATH when its `env` sets one), as the
/// client's spawn finds it. A program found nowhere is refused here rather than left to
/// a search this check did not make.
fn program_path(command: &str, path_env: Option<String>) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt;
    if command.contains('/') {
        return Ok(PathBuf::from(command));
    }
    let search = path_env
        .map(std::ffi::OsString::from)
        .or_else(|| std::env::var_os("PATH"))
        .unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join(command))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            format!(
                "the program {command:?} it names is not found on PATH; name it by its \
                 absolute path"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const KUBECONFIG: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n";

    fn set_mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A $KUBECONFIG naming a file not there yet, in a directory another user may write,
    /// is refused: the client reads it right after the check, and whoever makes it first
    /// has root run its `exec` command. Before, a missing file was passed over.
    #[test]
    fn a_missing_kubeconfig_another_user_could_make_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let missing = open.join("config");
        let error = check_candidates(&[missing]).unwrap_err().to_string();
        assert!(error.contains("not there yet"), "{error}");
        // Sticky does not help: it stops renames, not a new name.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let error = check_candidates(&[open.join("config")])
            .unwrap_err()
            .to_string();
        assert!(error.contains("add names"), "{error}");
        // Nor does a link there to a file not there.
        let private = tmp.path().join("private");
        std::fs::create_dir(&private).unwrap();
        std::os::unix::fs::symlink(open.join("later"), private.join("config")).unwrap();
        let error = check_candidates(&[private.join("config")])
            .unwrap_err()
            .to_string();
        assert!(error.contains("link"), "{error}");
        // Missing where only root could make it: nothing to refuse.
        check_candidates(&[tmp.path().join("config")]).unwrap();
    }

    /// A kubeconfig whose YAML is broken next to a credential is refused without quoting
    /// it, and one whose cluster names a proxy is refused without quoting the proxy's URL
    /// (and its password). Before, the parser's message quoted the lines around the error,
    /// and the client's named the proxy URL whole, into Cube's stored error.
    #[tokio::test]
    async fn a_broken_or_proxied_kubeconfig_is_refused_without_quoting_it() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("kubeconfig");
        let broken = KUBECONFIG.replace("token: t", "token: tok-SECRET-1\n    bogus: [unclosed");
        std::fs::write(&path, broken).unwrap();
        set_mode(&path, 0o600);
        let error = load(&path).await.unwrap_err().to_string();
        assert!(!error.contains("SECRET"), "{error}");
        assert!(error.contains("not valid YAML"), "{error}");

        let proxied = KUBECONFIG.replace(
            "server: https://127.0.0.1:1",
            "server: https://127.0.0.1:1\n    proxy-url: http://u:pw-SECRET@127.0.0.1:9",
        );
        std::fs::write(&path, proxied).unwrap();
        let kube = super::super::Kube::new(&crate::config::KubernetesSettings {
            kubeconfig: Some(path.clone()),
            namespace: Some("x".into()),
            ..Default::default()
        });
        let Err(error) = kube.client().await else {
            panic!("a kubeconfig naming a proxy was taken");
        };
        let error = error.to_string();
        assert!(!error.contains("SECRET"), "{error}");
        assert!(error.contains("proxy-url"), "{error}");
    }

    /// A kubeconfig another user could change (here: writable by others) is refused
    /// before it is read: its `exec` command would run as root. The bridge's own loads.
    #[tokio::test]
    async fn a_kubeconfig_another_user_could_change_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("kubeconfig");
        std::fs::write(&path, KUBECONFIG).unwrap();
        set_mode(&path, 0o666);
        let error = load(&path).await.unwrap_err().to_string();
        assert!(
            error.contains("writable by its group or by others"),
            "{error}"
        );
        set_mode(&path, 0o600);
        load(&path).await.unwrap();
        // Inferred from $KUBECONFIG (as a forked hook inherits it): the same rule.
        // SAFETY (set_var): no other test of this binary reads KUBECONFIG or HOME.
        let other = tmp.path().join("other");
        std::fs::copy(&path, &other).unwrap();
        set_mode(&other, 0o666);
        let list = std::env::join_paths([&path, &other]).unwrap();
        unsafe { std::env::set_var("KUBECONFIG", &list) };
        let inferred = check_inferred();
        unsafe { std::env::remove_var("KUBECONFIG") };
        let error = inferred.unwrap_err().to_string();
        assert!(
            error.contains("other") && error.contains("writable"),
            "{error}"
        );
        // An inferred kubeconfig of the bridge's own naming a token file others may write.
        let token = tmp.path().join("token");
        std::fs::write(&token, "t\n").unwrap();
        set_mode(&token, 0o666);
        let naming = KUBECONFIG.replace("token: t", &format!("tokenFile: {}", token.display()));
        std::fs::write(&other, naming).unwrap();
        set_mode(&other, 0o600);
        unsafe { std::env::set_var("KUBECONFIG", &other) };
        let inferred = check_inferred();
        unsafe { std::env::remove_var("KUBECONFIG") };
        let error = inferred.unwrap_err().to_string();
        assert!(error.contains("tokenFile"), "{error}");
        // A $KUBECONFIG naming no file is none: the home dir's file is read, and checked.
        let home = tmp.path().join("home");
        std::fs::create_dir_all(home.join(".kube")).unwrap();
        std::fs::copy(&path, home.join(".kube/config")).unwrap();
        set_mode(&home.join(".kube/config"), 0o666);
        let saved_home = std::env::var_os("HOME");
        unsafe { std::env::set_var("HOME", &home) };
        unsafe { std::env::set_var("KUBECONFIG", ":") };
        let inferred = check_inferred();
        unsafe { std::env::remove_var("KUBECONFIG") };
        match saved_home {
            Some(saved) => unsafe { std::env::set_var("HOME", saved) },
            None => unsafe { std::env::remove_var("HOME") },
        }
        let error = inferred.unwrap_err().to_string();
        assert!(
            error.contains(".kube/config") && error.contains("writable"),
            "{error}"
        );
        // No $HOME (a systemd unit with no User=): the client still reads the user's
        // `~/.kube/config` (found through the password database), so it is checked too.
        let home = std::env::var_os("HOME");
        unsafe { std::env::remove_var("HOME") };
        let candidates = inferred_candidates();
        let expected = std::env::home_dir().map(|h| h.join(".kube/config"));
        if let Some(home) = home {
            unsafe { std::env::set_var("HOME", home) };
        }
        // A uid with no entry in the password database has no home dir to find.
        assert_eq!(candidates, expected.into_iter().collect::<Vec<_>>());
    }

    /// The files and programs a trusted kubeconfig names are its config too: a CA another
    /// user could swap lets them answer as the API server, a token file or client key is
    /// whose credentials the bridge uses, an exec program (by path or found on PATH) runs
    /// as root. Each is refused when another user could change it, and the kubeconfig
    /// loads once it could not. Entries of a context not in use are not the client's.
    #[tokio::test]
    async fn files_and_programs_a_kubeconfig_names_are_held_to_its_rule() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("kubeconfig");
        let open_dir = dir.join("open");
        std::fs::create_dir(&open_dir).unwrap();
        set_mode(&open_dir, 0o777);
        let ca = dir.join("ca.crt");
        let token = open_dir.join("token");
        std::fs::write(&ca, "not read before the check\n").unwrap();
        std::fs::write(&token, "t\n").unwrap();
        let program = dir.join("get-token");
        std::fs::write(&program, "#!/bin/sh\nexit 1\n").unwrap();
        set_mode(&program, 0o777);
        std::fs::copy(&program, open_dir.join("get-token-on-path")).unwrap();

        let cases: [(&str, String, &str); 5] = [
            (
                "a CA writable by others",
                KUBECONFIG.replace(
                    "server: https://127.0.0.1:1",
                    "server: https://127.0.0.1:1\n    certificate-authority: ca.crt",
                ),
                "certificate-authority",
            ),
            (
                "a token file in a directory others may write",
                KUBECONFIG.replace("token: t", &format!("tokenFile: {}", token.display())),
                "tokenFile",
            ),
            (
                "an exec program by path, writable by others",
                KUBECONFIG.replace(
                    "token: t",
                    &format!(
                        "exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: {}",
                        program.display()
                    ),
                ),
                "exec command",
            ),
            (
                "an exec program found on a PATH that leads through a directory others may write",
                KUBECONFIG.replace(
                    "token: t",
                    &format!(
                        "exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: get-token-on-path\n      env:\n      - name: PATH\n        value: {}",
                        open_dir.display()
                    ),
                ),
                "exec command",
            ),
            (
                "an exec program found nowhere",
                KUBECONFIG.replace(
                    "token: t",
                    "exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: no-such-program-anywhere",
                ),
                "not found on PATH",
            ),
        ];
        set_mode(&ca, 0o666);
        for (what, text, names) in &cases {
            std::fs::write(&path, text).unwrap();
            set_mode(&path, 0o600);
            let error = match load(&path).await {
                Ok(_) => panic!("{what}: loaded"),
                Err(e) => e.to_string(),
            };
            assert!(error.contains(names), "{what}: {error}");
        }

        // Made the bridge's own: the CA and the program load (the CA file is read only
        // when the client is built, which this does not do).
        set_mode(&ca, 0o644);
        set_mode(&program, 0o755);
        for (what, text) in [("the CA", &cases[0].1), ("the exec program", &cases[2].1)] {
            std::fs::write(&path, text).unwrap();
            if let Err(e) = load(&path).await {
                panic!("{what}, trusted: {e}");
            }
        }

        // An untrusted token file of a context not in use is not the client's.
        let unused = KUBECONFIG
            .replace(
                "contexts:",
                &format!(
                    "- name: v\n  user:\n    tokenFile: {}\ncontexts:",
                    token.display()
                ),
            )
            .replace(
                "current-context: x\n",
                "- name: y\n  context:\n    cluster: c\n    user: v\ncurrent-context: x\n",
            );
        std::fs::write(&path, unused).unwrap();
        if let Err(e) = load(&path).await {
            panic!("a context not in use: {e}");
        }
    }

    /// A failing `exec` command's arguments, environment and output never reach the
    /// error the bridge logs and returns to Cube, nor its stderr: before, the client's
    /// message carried all three (`Command`'s debug form and the captured output), and
    /// the command wrote to the hook's stderr, which Cube shows.
    #[tokio::test]
    async fn a_failing_exec_commands_secrets_stay_out_of_the_error() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("kubeconfig");
        let text = KUBECONFIG.replace(
            "token: t",
            "exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n      args: [\"-c\", \"echo out-secret; echo err-secret >&2; exit 3\", \"arg-secret\"]\n      env:\n      - name: X\n        value: env-secret",
        );
        std::fs::write(&path, text).unwrap();
        set_mode(&path, 0o600);
        let mut config = load(&path).await.unwrap();
        pin_programs(&mut config).unwrap();
        assert_eq!(
            config.auth_info.exec.as_ref().unwrap().interactive_mode,
            Some(ExecInteractiveMode::Never)
        );
        // The client's own text carries them all.
        let raw = match kube::Client::try_from(config) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("the client runs the exec command when it is built"),
        };
        assert!(
            raw.contains("env-secret") && raw.contains("out-secret"),
            "{raw}"
        );
        // What the bridge makes of it, as every store and settings call gets it.
        let kube = super::super::Kube::new(&crate::config::KubernetesSettings {
            kubeconfig: Some(path.clone()),
            ..Default::default()
        });
        let described = match kube.client().await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a client whose exec command fails"),
        };
        assert!(!described.contains("secret"), "{described}");
        assert!(
            described.contains("exec command failed") && described.contains("3"),
            "{described}"
        );
    }

    /// A bare exec command is run as the file that was checked, by its absolute path: one
    /// put earlier on the command's PATH afterwards (a directory that passed no check,
    /// here empty when the kubeconfig was loaded) is never what a token refresh runs.
    /// Before, the client kept the bare name and looked it up again at every spawn.
    #[tokio::test]
    async fn a_bare_exec_command_runs_as_the_file_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let (early, late) = (tmp.path().join("early"), tmp.path().join("late"));
        for dir in [&early, &late] {
            std::fs::create_dir(dir).unwrap();
        }
        let checked = late.join("get-token");
        std::fs::write(&checked, "#!/bin/sh\nexit 1\n").unwrap();
        set_mode(&checked, 0o755);
        let path = tmp.path().join("kubeconfig");
        let search = std::env::join_paths([&early, &late]).unwrap();
        std::fs::write(
            &path,
            KUBECONFIG.replace(
                "token: t",
                &format!(
                    "exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: get-token\n      env:\n      - name: PATH\n        value: /nowhere\n      - name: PATH\n        value: {}",
                    search.to_str().unwrap()
                ),
            ),
        )
        .unwrap();
        set_mode(&path, 0o600);
        let mut config = load(&path).await.unwrap();
        pin_programs(&mut config).unwrap();
        std::fs::copy(&checked, early.join("get-token")).unwrap();
        let command = config.auth_info.exec.as_ref().unwrap().command.clone();
        assert_eq!(command.as_deref(), checked.to_str());
    }
}
