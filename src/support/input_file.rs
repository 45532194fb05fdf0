//! Files a call's input names (`ipam_lock_file`, `log_file_path`, `nodename_file`, the etcd
//! and Kubernetes certificate, key and kubeconfig files, host-local's data) are opened only
//! when they are regular files. A FIFO at such a path would block an ordinary open until a
//! peer came (past the call's deadline: the open is not a future that can be cut), and a
//! device or a socket is no configuration either.
//!
//! The open itself is non-blocking (`O_NONBLOCK`: a FIFO then opens at once for reading, and
//! fails with `ENXIO` for writing), and the type is checked on the open file, so a FIFO put
//! in place between a check and the open cannot stall the call either. `O_NONBLOCK` changes
//! nothing for a regular file.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The error for a path that exists but is not a regular file (without the path, as the
/// standard library's own errors: the caller names the path).
pub fn not_regular() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "not a regular file")
}

/// Opens `path` with `options` (non-blocking), and keeps it only if it is a regular file.
/// `options` must not set custom flags of its own (they are replaced).
pub fn open(path: &Path, options: &mut OpenOptions) -> io::Result<File> {
    let file = options.custom_flags(libc::O_NONBLOCK).open(path)?;
    if file.metadata()?.is_file() {
        Ok(file)
    } else {
        Err(not_regular())
    }
}

/// The whole content of the regular file `path`.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    open(path, OpenOptions::new().read(true))?.read_to_end(&mut buf)?;
    Ok(buf)
}

/// The whole content of the regular file `path`, as UTF-8.
pub fn read_to_string(path: &Path) -> io::Result<String> {
    let mut s = String::new();
    open(path, OpenOptions::new().read(true))?.read_to_string(&mut s)?;
    Ok(s)
}

/// For a path handed to a library that opens it itself: an error if `path` exists (after
/// symlinks) and is not a regular file. A path that cannot be stat'ed is left to the
/// library, which says what it says of it.
pub fn refuse_irregular(path: &Path) -> io::Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(not_regular()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("input-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = scratch("fifo");
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = read(&fifo).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(e.to_string(), "not a regular file");
        assert_eq!(
            refuse_irregular(&fifo).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        // Writing: no reader, so the non-blocking open itself fails (ENXIO).
        let e = open(&fifo, OpenOptions::new().append(true)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENXIO));
        // Read-write opens a FIFO at once on Linux; the type check still refuses it.
        let e = open(&fifo, OpenOptions::new().read(true).write(true)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn regular_files_and_directories() {
        let dir = scratch("regular");
        let f = dir.join("f");
        std::fs::write(&f, "node-1\n").unwrap();
        assert_eq!(read_to_string(&f).unwrap(), "node-1\n");
        assert!(refuse_irregular(&f).is_ok());
        assert!(refuse_irregular(&dir.join("missing")).is_ok());
        assert_eq!(read(&dir).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(
            read(&dir.join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
