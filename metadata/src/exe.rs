//! The `exe` label: each process's executable, as the process sees it (a
//! container's process shows the path inside the container). Read from
//! `/proc/<pid>/exe` once per process by [`read_exe`] (on the metadata
//! worker, see [`crate::describe`]), or taken from what its exec mapped
//! once the link is gone; kept in [`ExeCache`], which never reads itself;
//! forgotten on exec and exit, bounded.

use std::{collections::HashMap, os::unix::ffi::OsStrExt as _, path::Path, sync::Arc};

use stackscope_telemetry::{
    StateSize,
    probes::{self, Probe},
};

/// Processes whose exe is cached before the cache starts over: about 100
/// bytes each, so a few MB.
pub const MAX_CACHED_EXES: usize = 65_536;

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

/// The executable of each process described so far, as the process sees
/// it.
#[derive(Debug)]
pub struct ExeCache {
    /// Exe by tgid, with the start time of the process it was read for:
    /// `None` when its link could not be read.
    by_tgid: HashMap<u32, (u64, Option<Arc<str>>)>,
    /// Exe by tgid as learned from the process's exec, for when its link
    /// can no longer be read (it exited).
    learned: HashMap<u32, Arc<str>>,
    capacity: usize,
    empty: Arc<str>,
}

impl ExeCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            by_tgid: HashMap::new(),
            learned: HashMap::new(),
            capacity: capacity.max(1),
            empty: "".into(),
        }
    }

    /// The exe path of `tgid`, started at `started` (0: unknown); empty
    /// when its link could not be read and its exec was not seen. `None`
    /// when the process was not described yet (or an entry was made for
    /// another process with the same pid).
    pub fn get(&self, tgid: u32, started: u64) -> Option<Arc<str>> {
        probes::count(Probe::Process);
        let (at, exe) = self.by_tgid.get(&tgid)?;
        if *at != started {
            return None;
        }
        Some(match exe {
            Some(exe) => Arc::clone(exe),
            None => self
                .learned
                .get(&tgid)
                .map_or_else(|| Arc::clone(&self.empty), Arc::clone),
        })
    }

    /// What [`read_exe`] found for `tgid` started at `started`. A link that
    /// could not be read is remembered only for a known start time: a
    /// later process with the same pid (by `fork` alone, which no exec
    /// record announces) has another one, and is described anew.
    pub fn insert(&mut self, tgid: u32, started: u64, exe: Option<Arc<str>>) {
        if exe.is_none() && started == 0 {
            return;
        }
        if self.by_tgid.len() >= self.capacity {
            // Starting over costs one description per live process;
            // tracking recency would cost on every sample.
            self.by_tgid.clear();
        }
        self.by_tgid.insert(tgid, (started, exe));
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

    /// What `tgid` exec'd, if the mapping feed saw it.
    pub fn learned(&self, tgid: u32) -> Option<Arc<str>> {
        self.learned.get(&tgid).cloned()
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

    #[test]
    fn caches_exes_by_process_and_forgets_on_request() {
        let mut cache = ExeCache::new(8);
        assert_eq!(cache.get(42, 1), None, "not described yet");
        cache.insert(42, 1, Some("/usr/bin/redis-server".into()));
        assert_eq!(cache.get(42, 1).as_deref(), Some("/usr/bin/redis-server"));
        // Another process with the same pid (its exit record was lost).
        assert_eq!(cache.get(42, 2), None);
        // exec: described again.
        cache.forget(42);
        assert_eq!(cache.get(42, 1), None);
        // A link that could not be read: empty, for this process only.
        cache.insert(43, 1, None);
        assert_eq!(cache.get(43, 1).as_deref(), Some(""));
        assert_eq!(cache.get(43, 2), None);
        // Without a start time, a failure is not remembered: the pid may
        // belong to a forked process next.
        cache.insert(44, 0, None);
        assert_eq!(cache.get(44, 0), None);
    }

    #[test]
    fn a_learned_exe_stands_in_once_the_link_is_gone() {
        let mut cache = ExeCache::new(4);
        // Process 50 exec'd and exited before its link was read.
        cache.set_learned(50, Path::new("/usr/bin/sort"));
        cache.insert(50, 1, None);
        assert_eq!(cache.get(50, 1).as_deref(), Some("/usr/bin/sort"));
        // A live link wins over what was learned.
        cache.set_learned(51, Path::new("/usr/bin/stale"));
        cache.insert(51, 1, Some("/usr/bin/uniq".into()));
        assert_eq!(cache.get(51, 1).as_deref(), Some("/usr/bin/uniq"));
        cache.forget(50);
        cache.insert(50, 1, None);
        assert_eq!(cache.get(50, 1).as_deref(), Some(""));
    }

    #[test]
    fn the_cache_stays_within_its_capacity() {
        let mut cache = ExeCache::new(4);
        for tgid in 0..100u32 {
            cache.insert(tgid, 1, Some(format!("/bin/p{tgid}").into()));
            assert_eq!(
                cache.get(tgid, 1).as_deref(),
                Some(&*format!("/bin/p{tgid}"))
            );
            assert!(!cache.is_empty() && cache.len() <= 4);
            cache.set_learned(tgid, Path::new("/bin/learned"));
            assert!(cache.state_size().entries.is_some_and(|n| n <= 8));
        }
    }
}
