//! The `exe` label: each process's executable, as the process sees it (a
//! container's process shows the path inside the container). Read from
//! `/proc/<pid>/exe` once per process by [`read_exe`] (on the metadata
//! worker, see [`crate::describe`]), or taken from what its exec mapped
//! once the link is gone; kept in the process's record
//! ([`crate::process`]).

use std::{os::unix::ffi::OsStrExt as _, path::Path, sync::Arc};

/// What the kernel appends to the link of an unlinked file.
const DELETED_SUFFIX: &[u8] = b" (deleted)";

/// The executable of process `tgid` under `proc_root`; `None` when its
/// link cannot be read (the process exited).
pub fn read_exe(proc_root: &Path, tgid: u32) -> Option<Arc<str>> {
    let path = std::fs::read_link(proc_root.join(tgid.to_string()).join("exe")).ok()?;
    let bytes = path.as_os_str().as_bytes();
    let bytes = bytes.strip_suffix(DELETED_SUFFIX).unwrap_or(bytes);
    Some(String::from_utf8_lossy(bytes).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_exe_links_without_the_deleted_suffix() {
        let proc = tempfile::tempdir().expect("temporary directory");
        let pid_dir = proc.path().join("42");
        std::fs::create_dir(&pid_dir).expect("pid directory");
        std::os::unix::fs::symlink("/usr/bin/redis-server (deleted)", pid_dir.join("exe"))
            .expect("exe link");
        assert_eq!(
            read_exe(proc.path(), 42).as_deref(),
            Some("/usr/bin/redis-server")
        );
        assert_eq!(read_exe(proc.path(), 43), None, "no such process");
    }
}
