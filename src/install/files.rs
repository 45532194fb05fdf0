//! Writing onto the host so that nothing ever sees half a file: every file is written under a
//! temporary name in its own directory, fsynced, given its mode, renamed over the target and
//! the directory fsynced. kubelet then reads either the old conflist or the new one, and
//! execs either the old binary or the new one (a rename leaves a running binary's inode
//! alone, where writing into it fails with ETXTBSY or corrupts the running process).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The temporary name beside `target`: hidden, and ending in neither `.conf`, `.conflist`
/// nor `.json`, so a runtime scanning the directory never loads it.
fn temp_name(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(".{name}.calico-install-{}.tmp", std::process::id()))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes `contents` to `target` with `mode`, atomically (see the module comment).
pub fn write_atomic(target: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let tmp = temp_name(target);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(contents)?;
        // The umask may have narrowed the mode given at creation.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        fs::rename(&tmp, target)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result?;
    sync_dir(target.parent().unwrap_or(Path::new(".")))
}

/// Copies `src` to `dst` atomically with `src`'s permission bits.
pub fn copy_atomic(src: &Path, dst: &Path) -> io::Result<()> {
    let mode = fs::metadata(src)?.permissions().mode() & 0o7777;
    let tmp = temp_name(dst);
    let result = (|| {
        let mut from = File::open(src)?;
        let mut to = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        io::copy(&mut from, &mut to)?;
        to.set_permissions(fs::Permissions::from_mode(mode))?;
        to.sync_all()?;
        fs::rename(&tmp, dst)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result?;
    sync_dir(dst.parent().unwrap_or(Path::new(".")))
}

/// Whether `dst` already is `src`: same size, same mode and same bytes (upstream's test
/// before it copies). A missing `dst` is not up to date; a missing `src` is an error.
pub fn up_to_date(src: &Path, dst: &Path) -> io::Result<bool> {
    let s = fs::metadata(src)?;
    let d = match fs::metadata(dst) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if s.len() != d.len() || s.permissions().mode() != d.permissions().mode() {
        return Ok(false);
    }
    let (mut a, mut b) = (File::open(src)?, File::open(dst)?);
    let (mut buf_a, mut buf_b) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    loop {
        let n = read_full(&mut a, &mut buf_a)?;
        let m = read_full(&mut b, &mut buf_b)?;
        if n != m || buf_a[..n] != buf_b[..m] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
    }
}

/// Reads until `buf` is full or the file ends.
fn read_full(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match f.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Whether the installer can write into `dir` (upstream's `IsDirWriteable`: a file can be
/// created there).
pub fn dir_writable(dir: &Path) -> bool {
    if !dir.is_dir() {
        return false;
    }
    let probe = dir.join(format!(".calico-install-probe-{}", std::process::id()));
    match File::create(&probe) {
        Ok(_) => fs::remove_file(&probe).is_ok(),
        Err(_) => false,
    }
}

/// Go's `os.Remove`: unlink, else rmdir (an empty directory goes too); when both fail, the
/// rmdir error unless it is ENOTDIR (then the path is no directory and unlink's error is
/// the real one).
pub fn remove_as_go(path: &Path) -> io::Result<()> {
    let unlink = match fs::remove_file(path) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    match fs::remove_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Err(unlink),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("calico-install-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn removes_as_go_os_remove() {
        let d = scratch("remove");
        let file = d.join("f");
        fs::write(&file, "x").unwrap();
        fs::create_dir_all(d.join("empty")).unwrap();
        fs::create_dir_all(d.join("full/x")).unwrap();
        remove_as_go(&file).unwrap();
        remove_as_go(&d.join("empty")).unwrap();
        let errno = |p: &Path| remove_as_go(p).unwrap_err().raw_os_error();
        assert_eq!(errno(&d.join("full")), Some(libc::ENOTEMPTY));
        assert_eq!(errno(&d.join("missing")), Some(libc::ENOENT));
        assert!(!file.exists() && !d.join("empty").exists() && d.join("full/x").is_dir());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn writes_replace_whole_files_with_their_mode() {
        let d = scratch("write");
        let f = d.join("10-calico.conflist");
        write_atomic(&f, b"old", 0o644).unwrap();
        write_atomic(&f, b"new", 0o600).unwrap();
        assert_eq!(fs::read(&f).unwrap(), b"new");
        assert_eq!(
            fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // No temporary file is left beside it.
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn copies_keep_the_mode_and_compare_by_content() {
        let d = scratch("copy");
        let (src, dst) = (d.join("src"), d.join("dst"));
        write_atomic(&src, b"binary", 0o755).unwrap();
        assert!(!up_to_date(&src, &dst).unwrap());
        copy_atomic(&src, &dst).unwrap();
        assert!(up_to_date(&src, &dst).unwrap());
        assert_eq!(
            fs::metadata(&dst).unwrap().permissions().mode() & 0o777,
            0o755
        );
        write_atomic(&dst, b"binarx", 0o755).unwrap();
        assert!(!up_to_date(&src, &dst).unwrap());
        fs::set_permissions(&dst, fs::Permissions::from_mode(0o700)).unwrap();
        copy_atomic(&src, &dst).unwrap();
        assert!(up_to_date(&src, &dst).unwrap());
        assert!(up_to_date(&d.join("missing"), &dst).is_err());
        assert!(dir_writable(&d));
        assert!(!dir_writable(&d.join("missing")));
        fs::remove_dir_all(&d).unwrap();
    }
}
