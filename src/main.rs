//! One binary, two plugins and the node installer: run as `calico` it is the network plugin,
//! as `calico-ipam` (a symlink) the IPAM plugin, as `install` the installer of the calico/cni
//! image (`install`). Flags, parsed as Go's `flag` package does: `-v` prints the version; `calico -t` tests the
//! datastore connection (used by installers to gate writing the CNI config); `calico-ipam
//! -upgrade` migrates this node from host-local IPAM (`calico_ipam::upgrade`).

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use calico_cni::calico_ipam::upgrade;
use calico_cni::calico_ipam::IpamPlugin;
use calico_cni::plugin::CalicoPlugin;
use calico_cni::skel::{self, CniError};
use calico_cni::support::deadline;

/// The static (musl) build's allocator: see Cargo.toml.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

fn main() -> ExitCode {
    // A CNI call's deadline counts from process start (armed below, for CNI calls only).
    let started = Instant::now();
    one_malloc_arena();
    #[cfg(target_env = "musl")]
    // SAFETY: runs before any other thread exists; it registers fork handlers that take and
    // release the allocator's lock, so a child forked while another thread allocates can
    // still allocate.
    unsafe {
        dlmalloc::enable_alloc_after_fork();
    }
    let args: Vec<String> = std::env::args().collect();
    let argv0 = args.first().map(String::as_str).unwrap_or_default();
    let name = Path::new(argv0)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .trim_end_matches(".exe");
    let is_ipam = match plugin_named(name, &args) {
        Ok(is_ipam) => is_ipam,
        Err(code) => return code,
    };
    let (version, test_connection, migrate) = match plugin_flags(is_ipam, &args) {
        Ok(flags) => flags,
        Err(code) => return code,
    };
    if version {
        println!("{}", calico_cni::VERSION);
        return ExitCode::SUCCESS;
    }
    if test_connection {
        return run_connection_test();
    }
    if migrate {
        // The host paths are upstream's unless a test moves them (CALICO_IPAM_UPGRADE_TEST_*).
        let env = |k: &str| std::env::var(k).ok();
        let opts = upgrade::Options::with_test_overrides(&env);
        return ExitCode::from(upgrade::run(opts, &env));
    }
    deadline::arm(started);
    // VERSION (and a call without a command, refused at once) waits for nothing: no watchdog
    // thread, which would cost a VERSION call a good part of its start-up time.
    if std::env::var_os("CNI_COMMAND").is_some_and(|c| c != "VERSION") {
        deadline::spawn_watchdog(end_overdue_call);
    }
    let code = if is_ipam {
        skel::run(&IpamPlugin)
    } else {
        skel::run(&CalicoPlugin)
    };
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Which of the two CNI plugins `name` (argv[0]'s file name) is: `Ok(true)` for
/// `calico-ipam`. The node installer runs here and an unknown name is refused: `Err` has
/// their exit code.
fn plugin_named(name: &str, args: &[String]) -> Result<bool, ExitCode> {
    match name {
        // The node installer takes its settings from the environment only and, as
        // upstream's, ignores its arguments; but `-v` answers the version (upstream's would
        // install).
        "install" => {
            if args
                .get(1)
                .is_some_and(|a| matches!(a.as_str(), "-v" | "--v" | "-version" | "--version"))
            {
                println!("{}", calico_cni::VERSION);
                return Err(ExitCode::SUCCESS);
            }
            Err(calico_cni::install::main(&args[1..]))
        }
        "calico" => Ok(false),
        "calico-ipam" => Ok(true),
        other => {
            eprintln!(
                "Unknown binary name: {other:?} (run this binary as \"calico\", \"calico-ipam\" or \"install\")"
            );
            Err(ExitCode::from(2))
        }
    }
}

/// Go's `flag` package, as upstream's `Main`s parse: `-v` and `-t` (`calico`), `-v` and
/// `-upgrade` (`calico-ipam`); the version wins, then `-t` or `-upgrade`. `(version,
/// test_connection, migrate)`; `Err` has the exit code of `-h` or of a refused flag.
fn plugin_flags(is_ipam: bool, args: &[String]) -> Result<(bool, bool, bool), ExitCode> {
    let (flag_set, second) = match is_ipam {
        true => ("calico-ipam", "upgrade"),
        false => ("Calico", "t"),
    };
    match calico_cni::support::gocompat::parse_bool_flags(&args[1..], ["v", second]) {
        Ok([version, other]) => Ok((version, other && !is_ipam, other && is_ipam)),
        Err(calico_cni::support::gocompat::FlagError::Help) => {
            usage(flag_set, is_ipam);
            Err(ExitCode::SUCCESS)
        }
        Err(calico_cni::support::gocompat::FlagError::Refused(why)) => {
            eprintln!("{why}");
            usage(flag_set, is_ipam);
            Err(ExitCode::from(2))
        }
    }
}

/// One malloc arena for the whole process. glibc gives every thread that allocates its own
/// arena (a 128 MiB reservation, mapped and later unmapped); a call's few short-lived helper
/// threads (deadline watchdog, netns work, lock wait) allocate little and rarely at once.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// The watchdog's end of a call that outlived its deadline and grace: the error JSON, exit 1.
fn end_overdue_call(expired: deadline::Expired) {
    let err = CniError::from(calico_cni::error::Error::Deadline(expired));
    let json = skel::error_json(&err);
    // Raw write(2) and _exit(2): the stuck thread may hold stdout's lock, and nothing must
    // wait on it now.
    // SAFETY: the buffer is valid for its length; _exit never returns.
    unsafe {
        libc::write(1, json.as_ptr().cast(), json.len());
        libc::_exit(1);
    }
}

/// Go's `flag.PrintDefaults` layout: flags in name order, a one-letter flag's usage on its line.
fn usage(flag_set: &str, is_ipam: bool) {
    eprintln!("Usage of {flag_set}:");
    if is_ipam {
        eprintln!("  -upgrade\n    \tUpgrade from host-local");
    } else {
        eprintln!("  -t\tTest datastore connection");
    }
    eprintln!("  -v\tDisplay version");
}

/// `calico -t`: NetConf on stdin; exit 0 when ClusterInformation says the datastore is
/// ready, else a code-100 error JSON on stdout and exit 1.
fn run_connection_test() -> ExitCode {
    let mut stdin = Vec::new();
    let result = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => calico_cni::plugin::test_connection(&stdin),
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(cause) => {
            let err = CniError::from(calico_cni::error::Error::ConnectionTest(Box::new(cause)));
            print!("{}", skel::error_json(&err));
            ExitCode::from(1)
        }
    }
}
