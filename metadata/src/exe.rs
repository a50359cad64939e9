//! The `exe` label: each process's executable, as the process sees it (a
//! container's process shows the path inside the container), read from
//! `/proc/<pid>/exe` once per process, or taken from what its exec mapped
//! once the link is gone; forgotten on exec and exit, bounded.

use std::{
    collections::HashMap,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    sync::Arc,
};

use stackscope_telemetry::{
    StateSize,
    probes::{self, Probe},
};

/// Processes whose exe is cached before the cache starts over: about 100
/// bytes each, so a few MB.
pub const MAX_CACHED_EXES: usize = 65_536;

/// What the kernel appends to the link of an unlinked file.
const DELETED_SUFFIX: &[u8] = b" (deleted)";

/// The executable of each process, as the process sees it (a container's
/// process shows the path inside the container).
#[derive(Debug)]
pub struct ExeCache {
    proc_root: PathBuf,
    /// Exe by tgid, with the start time of the process it was read for.
    by_tgid: HashMap<u32, (u64, Arc<str>)>,
    /// Exe by tgid as learned from the process's exec, for when its link
    /// can no longer be read (it exited).
    learned: HashMap<u32, Arc<str>>,
    capacity: usize,
    empty: Arc<str>,
    /// `readlink` calls made (cache misses).
    pub reads: u64,
}

impl ExeCache {
    pub fn new(proc_root: &Path, capacity: usize) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            by_tgid: HashMap::new(),
            learned: HashMap::new(),
            capacity: capacity.max(1),
            empty: "".into(),
            reads: 0,
        }
    }

    /// The exe path of `tgid`; empty when it cannot be read (the process
    /// exited). Failures are not cached: a sample delivered late, after its
    /// process exited, must not leave an empty exe for a later process
    /// that gets the same pid by `fork` alone (no exec event forgets it).
    /// `started` is the process's start time (0: unknown); an entry made
    /// for another process with the same pid is read again.
    pub fn get(&mut self, tgid: u32, started: u64) -> Arc<str> {
        probes::count(Probe::Process);
        if let Some((at, exe)) = self.by_tgid.get(&tgid)
            && *at == started
        {
            return Arc::clone(exe);
        }
        if self.by_tgid.len() >= self.capacity {
            // Starting over costs one readlink per live process; tracking
            // recency would cost on every sample.
            self.by_tgid.clear();
        }
        self.reads += 1;
        let link = self.proc_root.join(tgid.to_string()).join("exe");
        let Ok(path) = std::fs::read_link(link) else {
            return self
                .learned
                .get(&tgid)
                .map_or_else(|| Arc::clone(&self.empty), Arc::clone);
        };
        let bytes = path.as_os_str().as_bytes();
        let bytes = bytes.strip_suffix(DELETED_SUFFIX).unwrap_or(bytes);
        let exe: Arc<str> = String::from_utf8_lossy(bytes).into();
        self.by_tgid.insert(tgid, (started, Arc::clone(&exe)));
        exe
    }

    /// The empty exe (kernel threads, exe not labelled), shared rather than
    /// allocated per sample.
    pub fn empty(&self) -> Arc<str> {
        Arc::clone(&self.empty)
    }

    /// What `tgid` exec'd, as the mapping feed saw it: its exe once the
    /// link is gone.
    pub fn set_learned(&mut self, tgid: u32, exe: &Path) {
        if self.learned.len() >= self.capacity {
            self.learned.clear();
        }
        let bytes = exe.as_os_str().as_bytes();
        self.learned
            .insert(tgid, String::from_utf8_lossy(bytes).into());
    }

    /// Forgets `tgid` (it called exec, or exited).
    pub fn forget(&mut self, tgid: u32) {
        self.by_tgid.remove(&tgid);
        self.learned.remove(&tgid);
    }

    /// Forgets every process (exec or exit records were lost).
    pub fn forget_all(&mut self) {
        self.by_tgid.clear();
        self.learned.clear();
    }

    pub fn len(&self) -> usize {
        self.by_tgid.len()
    }

    pub fn tgids_into(&self, out: &mut Vec<u32>) {
        out.extend(self.by_tgid.keys());
        out.extend(self.learned.keys());
    }

    /// Exes kept, read and learned, and the bound of each of the two.
    pub fn state_size(&self) -> StateSize {
        StateSize::entries(
            "exes",
            self.by_tgid.len() + self.learned.len(),
            Some(2 * self.capacity),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.by_tgid.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_exe_links_caches_them_and_forgets_on_request() {
        let proc = tempfile::tempdir().expect("temporary directory");
        let pid_dir = proc.path().join("42");
        std::fs::create_dir(&pid_dir).expect("pid directory");
        std::os::unix::fs::symlink("/usr/bin/redis-server (deleted)", pid_dir.join("exe"))
            .expect("exe link");
        let mut cache = ExeCache::new(proc.path(), 8);
        assert_eq!(&*cache.get(42, 1), "/usr/bin/redis-server");
        assert_eq!(&*cache.get(43, 1), "", "no such process");
        // Replaced behind the cache's back: still the cached answer.
        std::fs::remove_file(pid_dir.join("exe")).expect("removing the link");
        std::os::unix::fs::symlink("/bin/sh", pid_dir.join("exe")).expect("exe link");
        assert_eq!(&*cache.get(42, 1), "/usr/bin/redis-server");
        assert_eq!(cache.reads, 2);
        // exec: read again.
        cache.forget(42);
        assert_eq!(&*cache.get(42, 1), "/bin/sh");
        assert_eq!(cache.reads, 3);
        // Another process with the same pid (its exit record was lost):
        // read again.
        std::fs::remove_file(pid_dir.join("exe")).expect("removing the link");
        std::os::unix::fs::symlink("/bin/other", pid_dir.join("exe")).expect("exe link");
        assert_eq!(&*cache.get(42, 2), "/bin/other");
        assert_eq!(cache.reads, 4);
        // A missing process is not remembered as empty.
        std::fs::create_dir(proc.path().join("43")).expect("pid directory");
        std::os::unix::fs::symlink("/usr/bin/forked", proc.path().join("43/exe"))
            .expect("exe link");
        assert_eq!(&*cache.get(43, 1), "/usr/bin/forked");
    }

    #[test]
    fn a_learned_exe_stands_in_once_the_link_is_gone() {
        let proc = tempfile::tempdir().expect("temporary directory");
        let mut cache = ExeCache::new(proc.path(), 4);
        // Process 50 exec'd and exited before its link was read.
        cache.set_learned(50, Path::new("/usr/bin/sort"));
        assert_eq!(&*cache.get(50, 1), "/usr/bin/sort");
        // A live link wins over what was learned.
        let dir = proc.path().join("51");
        std::fs::create_dir(&dir).expect("pid directory");
        std::os::unix::fs::symlink("/usr/bin/uniq", dir.join("exe")).expect("exe link");
        cache.set_learned(51, Path::new("/usr/bin/stale"));
        assert_eq!(&*cache.get(51, 1), "/usr/bin/uniq");
        cache.forget(50);
        assert_eq!(&*cache.get(50, 1), "");
    }

    #[test]
    fn the_cache_stays_within_its_capacity() {
        let proc = tempfile::tempdir().expect("temporary directory");
        let mut cache = ExeCache::new(proc.path(), 4);
        for tgid in 0..100u32 {
            let dir = proc.path().join(tgid.to_string());
            std::fs::create_dir(&dir).expect("pid directory");
            std::os::unix::fs::symlink(format!("/bin/p{tgid}"), dir.join("exe")).expect("exe link");
            assert_eq!(&*cache.get(tgid, 1), format!("/bin/p{tgid}"));
            assert!(!cache.is_empty() && cache.len() <= 4);
        }
    }
}
