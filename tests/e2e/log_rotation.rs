//! The log file is rotated, named, compressed and pruned as upstream's timberjack logger
//! does (`logging::rotate`): a call finding `log_file_path` full moves it aside as
//! `cni-<UTC time>-size.log`, compresses that to `.zst`, and removes backups older than
//! `log_file_max_age` days. `log_file_max_size` counts MiB (1 is its least), so the file is
//! filled before the call.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, SystemTime};

use calico_cni::logging::rotate::{format_time, recognise};

use crate::common;

#[test]
fn a_full_log_file_is_rotated_compressed_and_old_backups_pruned() {
    let dir = std::env::temp_dir().join(format!("log-rotation-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let log = dir.join("cni.log");
    // 10 bytes short of 1 MiB of earlier lines: the call's first line reaches it, which
    // rotates the file before that line is written.
    let line = b"2026-01-01 00:00:00.000 [INFO][1] cni-plugin/plugin/mod.rs 1: an earlier call\n";
    let mut old = Vec::new();
    while old.len() + line.len() < 1024 * 1024 - 10 {
        old.extend_from_slice(line);
    }
    old.resize(1024 * 1024 - 11, b'.');
    old.push(b'\n');
    fs::write(&log, &old).unwrap();
    // Backups upstream left: one past 30 days (removed), one recent (kept), and a file of
    // another name (left alone).
    let ancient = "cni-2020-01-01T00-00-00.000-size.log.zst";
    let recent_time = format_time(SystemTime::now() - Duration::from_secs(86400));
    let recent = format!("cni-{recent_time}-size.log.zst");
    fs::write(dir.join(ancient), b"x").unwrap();
    fs::write(dir.join(&recent), b"y").unwrap();
    fs::write(dir.join("cni.log.1"), b"z").unwrap();

    let conf = serde_json::json!({
        "name": "n", "cniVersion": "0.3.1", "type": "calico", "nodename": "node1",
        "log_level": "info", "log_file_path": log.display().to_string(),
        "log_file_max_size": 1,
        "datastore_type": "kubernetes", "kubernetes": {"k8s_api_root": "http://127.0.0.1:1"},
    });
    let before = SystemTime::now();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_calico"));
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("CNI_COMMAND", "DEL")
        .env("CNI_CONTAINERID", "rotation")
        .env("CNI_NETNS", "/nonexistent/netns")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/nonexistent");
    // Bounded: a call still running after the limit is killed and the test fails.
    let out = common::cni::run_command_within(
        cmd,
        &conf.to_string(),
        Duration::from_secs(60),
        "calico DEL",
    );
    let took = out.elapsed;
    let after = SystemTime::now();
    // The DEL itself fails (no API server): only its logging matters here.
    let stderr = &out.stderr;
    assert!(!stderr.contains("Failed to write to log"), "{stderr}");
    assert!(!stderr.contains("timberjack:"), "{stderr}");

    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let rotated: Vec<&String> = names
        .iter()
        .filter(|n| n.ends_with("-size.log.zst") && **n != recent)
        .collect();
    assert_eq!(rotated.len(), 1, "{names:?}");
    let rotated = rotated[0].clone();
    assert!(!names.contains(&ancient.to_string()), "{names:?}");
    assert!(names.contains(&recent), "{names:?}");
    assert!(names.contains(&"cni.log.1".to_string()), "{names:?}");
    // No uncompressed backup is left beside it.
    assert_eq!(names.len(), 4, "{names:?}");

    // Named for the rotation's UTC time, as timberjack parses it back.
    let b = recognise(&rotated, "cni", ".log").expect("a timberjack backup name");
    let nanos =
        |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos() as i128;
    assert!(
        b.time >= nanos(before) - 1_000_000 && b.time <= nanos(after),
        "{rotated}: {} not within [{}, {}]",
        b.time,
        nanos(before),
        nanos(after)
    );
    // The backup holds exactly the old content, in a frame any zstd reads.
    let zst = dir.join(&rotated);
    let back = zstd::stream::decode_all(fs::File::open(&zst).unwrap()).unwrap();
    assert!(back == old, "the backup decompresses to the old log");
    if let Ok(cli) = Command::new("zstd").arg("-dc").arg(&zst).output() {
        assert!(
            cli.status.success() && cli.stdout == old,
            "zstd(1) reads it"
        );
    }
    assert_eq!(
        fs::metadata(&zst).unwrap().permissions().mode() & 0o777,
        0o644
    );
    // The new file has this call's lines only.
    let new = fs::read_to_string(&log).unwrap();
    assert!(!new.contains("an earlier call"));
    assert!(new.contains("[INFO]"), "{new}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    fs::remove_dir_all(&dir).unwrap();
}
