//! `install`: the node installer of the calico/cni image (upstream's `pkg/install` contract,
//! v3.32.1), run by Calico's DaemonSet as the `install-cni` container. It copies the image's
//! CNI binaries onto the host, the etcd TLS assets into `calico-tls`, writes
//! `calico-kubeconfig` (a TokenRequest token for the CNI service account) and the conflist,
//! removes `CNI_OLD_CONF_NAME`, then sleeps or exits as `SLEEP` says.
//!
//! Unlike upstream, everything that can be refused is checked before anything is written
//! (the template, the environment, the token), every file lands by rename (`files`), and the
//! copied `calico` must answer `-v` with this build's version before the conflist that makes
//! kubelet use it is written. Exit codes: 0 the node is set up; 1 it is not (something
//! failed after writing began: binaries may be new, the conflist is not); 2 the
//! configuration was refused and nothing was written.

pub mod files;
pub mod kubeconfig;
pub mod netconf;
pub mod settings;

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

use crate::datastore::DatastoreError;
use crate::support::gocompat::NumError;
use kubeconfig::InCluster;
use netconf::{EtcdTls, Inputs};
use settings::{EnvconfigError, Paths, Settings};

/// Exit code: configuration refused, nothing written.
pub const EXIT_REFUSED: u8 = 2;
/// How long the copied `calico -v` may take.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a sleeping installer looks for renewed etcd TLS assets.
const TLS_POLL: Duration = Duration::from_secs(10);
const ETCD_TLS_FILES: [&str; 3] = ["etcd-ca", "etcd-cert", "etcd-key"];

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The configuration cannot work; checked before anything is written.
    #[error("{0}")]
    Refused(String),
    /// A variable envconfig cannot convert (`UPDATE_CNI_BINARIES`, `SLEEP`), in its words.
    #[error(transparent)]
    Env(#[from] EnvconfigError),
    /// `TEST_FILE_PERMISSION` is not what Go's `strconv.ParseUint(s, 8, 32)` reads.
    #[error("{0}")]
    Permission(NumError),
    /// The conflist's path cannot be written as a file (`CNI_CONF_NAME` empty, or naming a
    /// directory or a place under a missing one), in `os.WriteFile`'s words. Upstream finds
    /// out when it writes, after the binaries; this is checked before.
    #[error("{}", crate::support::gocompat::path_error("open", .path, .err))]
    ConfPath { path: PathBuf, err: io::Error },
    #[error("{what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("unable to create token for CNI kubeconfig: {0}")]
    Token(#[source] DatastoreError),
    #[error("found no writeable directory for the CNI binaries (tried {0})")]
    NoBinDir(String),
    #[error("the installed {} does not work: {why}", .path.display())]
    Verify { path: PathBuf, why: String },
}

impl InstallError {
    fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> InstallError + 'a {
        move |source| InstallError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What one run did, for the tests and the log.
#[derive(Debug, Default)]
pub struct Report {
    pub binaries_written: Vec<PathBuf>,
    pub conflist: PathBuf,
    pub kubeconfig: Option<PathBuf>,
}

/// The installer's entry point (argv[0] `install`). Like upstream's, it takes its settings
/// from the environment only: arguments are ignored (with a warning), as upstream ignores
/// them (`main.rs` answers `-v` itself).
pub fn main(args: &[String]) -> ExitCode {
    crate::logging::init(&crate::config::NetConf::default(), "cni-installer");
    if !args.is_empty() {
        tracing::warn!(
            "Ignoring arguments {args:?}: the installer takes its settings from the environment"
        );
    }
    let env = |k: &str| std::env::var(k).ok();
    let paths = Paths::from_env(&env);
    let settings = match Settings::from_env(&env) {
        Ok(s) => s,
        Err(e) => return fail(&InstallError::Env(e)),
    };
    match install(&settings, &paths, &env) {
        Ok(report) => {
            tracing::info!(conflist = %report.conflist.display(), "Done configuring CNI.  Sleep={}", settings.sleep);
        }
        Err(e) => return fail(&e),
    }
    if settings.sleep {
        sleep_forever(&settings, &paths);
    }
    ExitCode::SUCCESS
}

fn fail(e: &InstallError) -> ExitCode {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        cause = c.source();
    }
    tracing::error!("Error installing CNI plugin: {text}");
    let code = match e {
        InstallError::Refused(_)
        | InstallError::Env(_)
        | InstallError::Permission(_)
        | InstallError::ConfPath { .. } => EXIT_REFUSED,
        _ => 1,
    };
    ExitCode::from(code)
}

/// One installation: every check first, then the writes.
pub fn install(
    settings: &Settings,
    paths: &Paths,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Report, InstallError> {
    // 1. Everything that can be refused, before anything is written.
    let pod = InCluster::load(&paths.service_account_dir, env)?;
    let (template, source) = template(settings)?;
    let hostname = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().trim().to_lowercase())
        .map_err(|e| InstallError::Io {
            what: "reading the hostname",
            path: PathBuf::new(),
            source: e.into(),
        })?;
    let etcd_tls = etcd_tls_to_copy(&settings.tls_assets_dir);
    let conflist = netconf::render(
        &template,
        &source,
        &Inputs {
            settings,
            hostname: &hostname,
            service_account_token: pod.as_ref().map(|p| p.token.as_str()).unwrap_or(""),
            etcd_tls,
        },
        env,
    )?;
    // Where upstream reads it: once the conflist is rendered.
    tracing::info!(
        "CNI config file permission is set to {}",
        settings.conf_permission
    );
    let conf_mode = settings.conf_mode().map_err(InstallError::Permission)?;
    let conf_path = in_net_dir(&paths.host_net_dir, &settings.conf_name);
    if paths.host_net_dir.is_dir() {
        check_conf_path(
            &conf_path,
            &settings.conf_name,
            etcd_tls != EtcdTls::default(),
        )?;
    }
    let sources = image_binaries(&paths.image_bin_dir, settings)?;
    // 2. The token: asked before writing, so a refused token leaves the node as it was.
    let kubeconfig = match &pod {
        Some(pod) => {
            tracing::info!("Running as a Kubernetes pod");
            let token = run_async(kubeconfig::cni_token(pod, env))?;
            Some(kubeconfig::render(pod, &token, env)?)
        }
        None => None,
    };
    // 3. The writes: TLS assets, binaries (verified), kubeconfig, and the conflist last.
    let net_dir = &paths.host_net_dir;
    if !net_dir.is_dir() {
        return Err(InstallError::Io {
            what: "the host's CNI config directory",
            path: net_dir.clone(),
            source: io::ErrorKind::NotFound.into(),
        });
    }
    install_etcd_tls(
        &settings.tls_assets_dir,
        &net_dir.join("calico-tls"),
        etcd_tls,
    )?;
    let mut report = Report {
        binaries_written: install_binaries(&sources, paths, settings)?,
        ..Default::default()
    };
    if let Some(text) = kubeconfig {
        let path = net_dir.join("calico-kubeconfig");
        files::write_atomic(&path, text.as_bytes(), 0o600)
            .map_err(InstallError::io("writing", &path))?;
        report.kubeconfig = Some(path);
    }
    let path = conf_path;
    files::write_atomic(&path, conflist.as_bytes(), conf_mode)
        .map_err(InstallError::io("writing", &path))?;
    tracing::info!("Created {}", path.display());
    report.conflist = path;
    if settings.old_conf_name != settings.conf_name {
        let old = in_net_dir(net_dir, &settings.old_conf_name);
        tracing::info!("Removing {}", old.display());
        if let Err(e) = files::remove_as_go(&old) {
            tracing::warn!(
                error = %crate::support::gocompat::path_error("remove", &old, &e),
                "Failed to remove {}",
                settings.old_conf_name
            );
        }
    }
    Ok(report)
}

/// `<host config dir>/<name>` as upstream builds it (`fmt.Sprintf(".../net.d/%s", name)`):
/// text appended, so `""` names the directory itself (`net.d/`) and a name starting with
/// `/` stays inside it (where `Path::join` would leave it).
fn in_net_dir(net_dir: &Path, name: &str) -> PathBuf {
    let mut path = net_dir.as_os_str().to_owned();
    path.push("/");
    path.push(name);
    PathBuf::from(path)
}

/// Whether `os.WriteFile` could create the conflist at `path` once the writes before it are
/// done, answered without writing: not a directory (`""`, `.`, a name ending in `/`), and
/// in a directory that exists. `calico-tls` is a directory then only when TLS assets are
/// copied into it (`tls_dir`): upstream removes it first. The error is `open(2)`'s.
fn check_conf_path(path: &Path, name: &str, tls_dir: bool) -> Result<(), InstallError> {
    let refuse = |err: io::Error| InstallError::ConfPath {
        path: path.to_path_buf(),
        err,
    };
    let is_a_directory = || refuse(io::Error::from_raw_os_error(libc::EISDIR));
    let names_tls_dir = !name.ends_with('/')
        && Path::new(name)
            .components()
            .filter(|c| !matches!(c, Component::CurDir | Component::RootDir))
            .eq([Component::Normal("calico-tls".as_ref())]);
    if names_tls_dir {
        return if tls_dir {
            Err(is_a_directory())
        } else {
            Ok(())
        };
    }
    match fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(is_a_directory()),
        Ok(_) => Ok(()),
        // open(O_CREAT) of a missing name with a trailing slash: EISDIR.
        Err(e) if e.kind() == io::ErrorKind::NotFound && name.ends_with('/') => {
            Err(is_a_directory())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => match path.parent().map(fs::metadata) {
            Some(Ok(m)) if m.is_dir() => Ok(()),
            Some(Ok(_)) => Err(refuse(io::Error::from_raw_os_error(libc::ENOTDIR))),
            Some(Err(e)) => Err(refuse(e)),
            None => Ok(()),
        },
        Err(e) => Err(refuse(e)),
    }
}

/// The conflist template and where it came from: `CNI_NETWORK_CONFIG_FILE` over
/// `CNI_NETWORK_CONFIG` over upstream's default.
fn template(settings: &Settings) -> Result<(String, String), InstallError> {
    if let Some(file) = &settings.network_config_file {
        tracing::info!("Using CNI config template from CNI_NETWORK_CONFIG_FILE");
        let text = fs::read_to_string(file).map_err(|e| {
            InstallError::Refused(format!(
                "cannot read CNI_NETWORK_CONFIG_FILE {}: {e}",
                file.display()
            ))
        })?;
        return Ok((text, format!("CNI_NETWORK_CONFIG_FILE {}", file.display())));
    }
    if let Some(text) = &settings.network_config {
        tracing::info!("Using CNI config template from CNI_NETWORK_CONFIG environment variable.");
        return Ok((text.clone(), "CNI_NETWORK_CONFIG".into()));
    }
    Ok((
        netconf::DEFAULT_TEMPLATE.into(),
        "the default template".into(),
    ))
}

/// `<TLS_ASSETS_DIR>/<file>`, as upstream joins them (`fmt.Sprintf("%s/%s", ...)`).
fn tls_asset(dir: &str, file: &str) -> PathBuf {
    PathBuf::from(format!("{dir}/{file}"))
}

/// Upstream's `fileExists`: there, and not a directory.
fn file_exists(p: &Path) -> bool {
    fs::metadata(p).is_ok_and(|m| !m.is_dir())
}

/// Which etcd TLS files will be on the host: those in `TLS_ASSETS_DIR` when it is a
/// directory (`""` is none), as upstream copies them when at least one exists, and starts
/// from an empty `calico-tls`.
fn etcd_tls_to_copy(dir: &str) -> EtcdTls {
    if !Path::new(dir).is_dir() {
        return EtcdTls::default();
    }
    let has = |f: &str| file_exists(&tls_asset(dir, f));
    EtcdTls {
        ca: has("etcd-ca"),
        cert: has("etcd-cert"),
        key: has("etcd-key"),
    }
}

fn install_etcd_tls(from: &str, to: &Path, tls: EtcdTls) -> Result<(), InstallError> {
    match fs::remove_dir_all(to) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("Error removing old TLS directory: {e}"),
    }
    if tls == EtcdTls::default() {
        // Upstream says so only of a directory that exists.
        if Path::new(from).is_dir() {
            tracing::info!("No TLS assets found in {from}, skipping");
        }
        return Ok(());
    }
    tracing::info!("Installing any TLS assets");
    fs::create_dir_all(to).map_err(InstallError::io("creating", to))?;
    for name in ETCD_TLS_FILES {
        let src = tls_asset(from, name);
        if file_exists(&src) {
            let dst = to.join(name);
            files::copy_atomic(&src, &dst).map_err(InstallError::io("copying to", &dst))?;
        } else {
            tracing::warn!("Missing {name}");
        }
    }
    Ok(())
}

/// One file of the image's bin directory to put on the host.
#[derive(Debug)]
struct Source {
    name: String,
    path: PathBuf,
    /// A link to another binary of the image that is installed too (`calico-ipam` ->
    /// `calico`): recreated as a link on the host instead of a second copy.
    link_to: Option<String>,
}

/// The image's binaries, less `install` and `SKIP_CNI_BINARIES`, in name order.
fn image_binaries(dir: &Path, settings: &Settings) -> Result<Vec<Source>, InstallError> {
    let entries = fs::read_dir(dir).map_err(|e| {
        InstallError::Refused(format!(
            "cannot read the image's binaries in {}: {e}",
            dir.display()
        ))
    })?;
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n != "install" && !n.starts_with('.'))
        .filter(|n| !settings.skip_binaries.contains(n))
        .collect();
    names.sort();
    let installed = names.clone();
    Ok(names
        .into_iter()
        .map(|name| {
            let path = dir.join(&name);
            let link_to = fs::read_link(&path)
                .ok()
                .and_then(|t| t.to_str().map(String::from))
                .filter(|t| !t.contains('/') && installed.contains(t));
            Source {
                name,
                path,
                link_to,
            }
        })
        .collect())
}

/// Copies the binaries into every writable host bin directory; fails when there is none,
/// or when a copied `calico` does not answer `-v` with this build's version.
fn install_binaries(
    sources: &[Source],
    paths: &Paths,
    settings: &Settings,
) -> Result<Vec<PathBuf>, InstallError> {
    let mut written = Vec::new();
    let mut any_dir = false;
    for dir in &paths.host_bin_dirs {
        if !files::dir_writable(dir) {
            tracing::info!("{} is not writeable, skipping", dir.display());
            continue;
        }
        any_dir = true;
        for src in sources {
            let target = dir.join(&src.name);
            if !settings.update_binaries && fs::symlink_metadata(&target).is_ok() {
                tracing::info!("Skipping installation of {}", target.display());
                continue;
            }
            install_one(src, &target)?;
            if src.name == "calico" {
                verify_calico(&target)?;
                tracing::info!("CNI plugin version: {}", crate::VERSION);
            }
            tracing::info!("Installed {}", target.display());
            written.push(target);
        }
        tracing::info!("Wrote Calico CNI binaries to {}", dir.display());
    }
    if !any_dir {
        let tried: Vec<String> = paths
            .host_bin_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        return Err(InstallError::NoBinDir(tried.join(", ")));
    }
    Ok(written)
}

fn install_one(src: &Source, target: &Path) -> Result<(), InstallError> {
    if let Some(link) = &src.link_to {
        if fs::read_link(target).is_ok_and(|t| t == Path::new(link)) {
            return Ok(());
        }
        let dir = target.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(
            ".{}.calico-install-{}.tmp",
            src.name,
            std::process::id()
        ));
        let _ = fs::remove_file(&tmp);
        return std::os::unix::fs::symlink(link, &tmp)
            .and_then(|()| fs::rename(&tmp, target))
            .map_err(InstallError::io("linking", target));
    }
    // A link on the host where the image has a file: replace the link, not what it names.
    let is_link = fs::symlink_metadata(target).is_ok_and(|m| m.file_type().is_symlink());
    let current = !is_link
        && files::up_to_date(&src.path, target).map_err(InstallError::io("comparing", target))?;
    if current {
        tracing::info!(file = %target.display(), "File is already up to date, skipping");
        return Ok(());
    }
    files::copy_atomic(&src.path, target).map_err(InstallError::io("installing", target))?;
    if !files::up_to_date(&src.path, target).map_err(InstallError::io("verifying", target))? {
        return Err(InstallError::Verify {
            path: target.to_path_buf(),
            why: "its contents differ from the image's after copying".into(),
        });
    }
    Ok(())
}

/// Runs the copied `calico -v`, bounded, and compares its answer with this build's version.
fn verify_calico(path: &Path) -> Result<(), InstallError> {
    let verify = |why: String| InstallError::Verify {
        path: path.to_path_buf(),
        why,
    };
    let mut child = Command::new(path)
        .arg("-v")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| verify(format!("cannot run it: {e}")))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < VERIFY_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(verify(format!(
                    "-v did not answer within {VERIFY_TIMEOUT:?}"
                )));
            }
            Err(e) => return Err(verify(format!("waiting for -v: {e}"))),
        }
    };
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = io::Read::read_to_string(&mut stdout, &mut out);
    }
    if !status.success() || out.trim() != crate::VERSION {
        return Err(verify(format!(
            "-v answered {:?} ({status}), expected {:?}",
            out.trim(),
            crate::VERSION
        )));
    }
    Ok(())
}

/// Runs one future on a current-thread runtime (the installer is otherwise synchronous).
fn run_async<T>(
    fut: impl std::future::Future<Output = Result<T, InstallError>>,
) -> Result<T, InstallError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(InstallError::io("starting the runtime", Path::new("")))?
        .block_on(fut)
}

/// Stays up as a DaemonSet container, copying renewed etcd TLS assets (a Secret updated in
/// place) to the host, until SIGTERM or SIGINT.
fn sleep_forever(settings: &Settings, paths: &Paths) -> ! {
    exit_on_termination();
    let cert = tls_asset(&settings.tls_assets_dir, "etcd-cert");
    let stamp = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut last: Option<SystemTime> = stamp(&cert);
    loop {
        std::thread::sleep(TLS_POLL);
        let now = stamp(&cert);
        if now.is_some() && now != last {
            tracing::info!("Updating installed secrets");
            let to = paths.host_net_dir.join("calico-tls");
            if let Ok(entries) = fs::read_dir(&settings.tls_assets_dir) {
                for e in entries
                    .filter_map(Result::ok)
                    .filter(|e| e.path().is_file())
                {
                    if let Err(err) = fs::create_dir_all(&to)
                        .and_then(|()| files::copy_atomic(&e.path(), &to.join(e.file_name())))
                    {
                        tracing::warn!("{err}");
                    }
                }
            }
        }
        last = now;
    }
}

/// SIGTERM/SIGINT end the sleeping installer with status 0 (as PID 1 in its container, the
/// default action would be ignored and kubelet would wait out the grace period).
fn exit_on_termination() {
    extern "C" fn on_signal(_: libc::c_int) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(0) }
    }
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only calls _exit.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}
