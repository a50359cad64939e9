//! One record per process for what its labels are made of: its exe as a
//! description read it (or as its exec mapped it, once the link is gone),
//! its container entry, and whether a description is awaited.
//!
//! Owns the record's life: made when the process is first wanted or
//! described, found with one lookup per label lookup ([`ProcessLabels::known`]),
//! cleared of its exe at exec, dropped at exit ([`ProcessLabels::exit`], the
//! one exit path), and never read for another process under a reused pid
//! (another start time: the record starts over). Bounded: at
//! [`MAX_PROCESSES`] records the map starts over (a process met again is
//! described again). Owns the container labels shared by the processes of
//! a container too ([`ContainerIndex`]). Does not read anything: the
//! descriptions come from [`crate::describe`], on a thread that may wait.

use std::{
    collections::HashMap,
    os::unix::ffi::OsStrExt as _,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use stackscope_telemetry::{
    StateSize,
    probes::{self, Probe},
};

use crate::{
    ContainerEntry, ContainerIndex, Placed,
    describe::{Description, Wanted},
    kubelet::PodList,
};

/// Processes with a record before the map starts over: a few hundred
/// bytes each, so a few tens of MB at most.
pub const MAX_PROCESSES: usize = 65_536;

/// How long a description asked for is awaited before it is asked for
/// again (the metadata worker's queue was full, or the answer was lost).
pub const ASK_AGAIN: Duration = Duration::from_secs(1);

/// What is known of one process.
#[derive(Debug, Default)]
struct Record {
    /// The process's start time (0: not known yet): with the pid, its
    /// identity.
    started: u64,
    /// Its exe as described (`Some(None)`: the link could not be read);
    /// `None` until described (again, after an exec).
    exe: Option<Option<Arc<str>>>,
    /// What its last exec mapped first, as the mapping feed saw it.
    learned_exe: Option<Arc<str>>,
    /// Its container as described; `None` until described.
    container: Option<ContainerEntry>,
    /// When a description was last asked for, while it is awaited.
    asked_at: Option<Instant>,
}

/// What the record of a sampled process says now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// Its exe (empty when it could not be read and no exec said);
    /// `None` until described.
    pub exe: Option<Arc<str>>,
    /// Its container labels; `None` until described in this cgroup.
    pub container: Option<Placed>,
}

/// See the module documentation.
#[derive(Debug)]
pub struct ProcessLabels {
    records: HashMap<u32, Record>,
    containers: ContainerIndex,
    capacity: usize,
    empty: Arc<str>,
}

impl Default for ProcessLabels {
    fn default() -> Self {
        Self::new(MAX_PROCESSES)
    }
}

impl ProcessLabels {
    /// Records for at most `capacity` processes (0 behaves as 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            records: HashMap::new(),
            containers: ContainerIndex::default(),
            capacity: capacity.max(1),
            empty: "".into(),
        }
    }

    /// The empty exe, shared.
    pub fn empty(&self) -> Arc<str> {
        Arc::clone(&self.empty)
    }

    /// What is known of process `tgid` started at `started`, sampled in
    /// cgroup `cgroup_id`: one lookup.
    pub fn known(&mut self, tgid: u32, started: u64, cgroup_id: u64) -> Known {
        probes::count(Probe::Process);
        let Some(record) = self
            .records
            .get_mut(&tgid)
            .filter(|record| record.started == started)
        else {
            return Known {
                exe: None,
                container: None,
            };
        };
        let exe = record.exe.as_ref().map(|exe| match exe {
            Some(exe) => Arc::clone(exe),
            None => record
                .learned_exe
                .clone()
                .unwrap_or_else(|| Arc::clone(&self.empty)),
        });
        let container = record
            .container
            .as_mut()
            .and_then(|entry| self.containers.placed(entry, cgroup_id));
        Known { exe, container }
    }

    /// What the last exec of `tgid` mapped first, if an exec event said.
    pub fn learned_exe(&self, tgid: u32) -> Option<Arc<str>> {
        self.records.get(&tgid)?.learned_exe.clone()
    }

    /// Whether to ask for a description of `wanted` now: not while one
    /// asked for less than [`ASK_AGAIN`] before `now` is awaited.
    pub fn want(&mut self, wanted: &Wanted, now: Instant) -> bool {
        let record = self.record(wanted.tgid, wanted.started);
        if record
            .asked_at
            .is_some_and(|at| now.saturating_duration_since(at) < ASK_AGAIN)
        {
            return false;
        }
        record.asked_at = Some(now);
        true
    }

    /// Takes a description: the exe (when `exe` labels are kept) and the
    /// container entry (when container labels are).
    pub fn describe(&mut self, description: Description, exe: bool, container: bool) {
        let Wanted {
            tgid,
            started,
            cgroup_id,
        } = description.process;
        let entry = container.then(|| self.containers.entry(cgroup_id, description.placement));
        let record = self.record(tgid, started);
        record.asked_at = None;
        // Without a start time a failed read is not remembered: the pid
        // may belong to a forked process next.
        if exe && (description.exe.is_some() || started != 0) {
            record.exe = Some(description.exe);
        }
        if let Some(entry) = entry {
            record.container = Some(entry);
        }
    }

    /// The record of `tgid` started at `started`, made (or made again, when
    /// it was another process's) if need be.
    fn record(&mut self, tgid: u32, started: u64) -> &mut Record {
        let record = self.entry(tgid);
        if record.started != started {
            if record.started != 0 {
                // Another process under a reused pid (its exit was lost).
                *record = Record::default();
            }
            record.started = started;
        }
        record
    }

    /// The record of `tgid`, made if it has none; at the bound the map
    /// starts over first.
    fn entry(&mut self, tgid: u32) -> &mut Record {
        if self.records.len() >= self.capacity && !self.records.contains_key(&tgid) {
            self.records.clear();
        }
        self.records.entry(tgid).or_default()
    }

    /// Process `tgid` exec'd (its first mapping `exe`, if the mapping feed
    /// saw it): its exe is described again; its container stays.
    pub fn exec(&mut self, tgid: u32, exe: Option<&Path>) {
        let record = self.entry(tgid);
        record.exe = None;
        record.asked_at = None;
        record.learned_exe =
            exe.map(|exe| String::from_utf8_lossy(exe.as_os_str().as_bytes()).into());
    }

    /// Process `tgid` exited: its record goes.
    pub fn exit(&mut self, tgid: u32) {
        self.records.remove(&tgid);
    }

    /// Every record goes (exec or exit records were lost).
    pub fn forget_all(&mut self) {
        self.records.clear();
    }

    /// Forgets the labels of containers no record holds any more.
    pub fn forget_empty_containers(&mut self) {
        self.containers.forget_empty_containers();
    }

    /// A newer pod list: container labels are made again from it.
    pub fn set_pods(&mut self, pods: Arc<PodList>) {
        self.containers.set_pods(pods);
    }

    /// Whether a process of a pod missing from the pod list was seen since
    /// the last call.
    pub fn take_unknown_pod_seen(&mut self) -> bool {
        self.containers.take_unknown_pod_seen()
    }

    pub fn tgids_into(&self, out: &mut Vec<u32>) {
        out.extend(self.records.keys());
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The records and the containers kept, against their bounds.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        out.push(StateSize::entries(
            "process_labels",
            self.records.len(),
            Some(self.capacity),
        ));
        out.push(self.containers.state_size());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::describe::Placement;

    fn described(tgid: u32, started: u64, exe: Option<&str>) -> Description {
        Description {
            process: Wanted {
                tgid,
                started,
                cgroup_id: 1,
            },
            exe: exe.map(Arc::from),
            placement: Placement::Host,
        }
    }

    fn exe(labels: &mut ProcessLabels, tgid: u32, started: u64) -> Option<String> {
        labels
            .known(tgid, started, 1)
            .exe
            .map(|exe| exe.to_string())
    }

    #[test]
    fn one_record_per_process_until_exit_and_never_another_processes() {
        let mut labels = ProcessLabels::new(8);
        assert_eq!(exe(&mut labels, 42, 1), None, "not described yet");
        labels.describe(described(42, 1, Some("/usr/bin/redis-server")), true, true);
        assert_eq!(
            exe(&mut labels, 42, 1).as_deref(),
            Some("/usr/bin/redis-server")
        );
        let known = labels.known(42, 1, 1);
        assert_eq!(known.container.map(|placed| placed.labels), Some(None));
        // Another process with the same pid (its exit record was lost).
        assert_eq!(labels.known(42, 2, 1).exe, None);
        assert_eq!(labels.known(42, 2, 1).container, None);
        // In another cgroup: its container is described again.
        assert_eq!(labels.known(42, 1, 9).container, None);
        labels.exit(42);
        assert_eq!(exe(&mut labels, 42, 1), None);
        assert!(labels.is_empty());

        // A link that could not be read: empty, for this process only.
        labels.describe(described(43, 1, None), true, true);
        assert_eq!(exe(&mut labels, 43, 1).as_deref(), Some(""));
        assert_eq!(exe(&mut labels, 43, 2), None);
        // Without a start time, a failure is not remembered: the pid may
        // belong to a forked process next.
        labels.describe(described(44, 0, None), true, false);
        assert_eq!(exe(&mut labels, 44, 0), None);
        // A description for a new process under a pid replaces the record.
        labels.describe(described(43, 5, Some("/bin/new")), true, true);
        assert_eq!(exe(&mut labels, 43, 5).as_deref(), Some("/bin/new"));
        assert_eq!(exe(&mut labels, 43, 1), None);
    }

    #[test]
    fn an_exec_describes_the_exe_again_and_what_it_mapped_stands_in() {
        let mut labels = ProcessLabels::new(8);
        labels.describe(described(50, 1, Some("/bin/sh")), true, true);
        labels.exec(50, Some(Path::new("/usr/bin/sort")));
        assert_eq!(exe(&mut labels, 50, 1), None, "described again");
        assert!(
            labels.known(50, 1, 1).container.is_some(),
            "the container stays"
        );
        assert_eq!(labels.learned_exe(50).as_deref(), Some("/usr/bin/sort"));
        // It exited before its link was read: what its exec mapped.
        labels.describe(described(50, 1, None), true, true);
        assert_eq!(exe(&mut labels, 50, 1).as_deref(), Some("/usr/bin/sort"));
        // A live link wins over what was learned.
        labels.exec(51, Some(Path::new("/usr/bin/stale")));
        labels.describe(described(51, 1, Some("/usr/bin/uniq")), true, true);
        assert_eq!(exe(&mut labels, 51, 1).as_deref(), Some("/usr/bin/uniq"));
    }

    #[test]
    fn a_description_is_asked_for_once_while_awaited() {
        let mut labels = ProcessLabels::new(8);
        let wanted = Wanted {
            tgid: 60,
            started: 1,
            cgroup_id: 1,
        };
        let now = Instant::now();
        assert!(labels.want(&wanted, now));
        assert!(!labels.want(&wanted, now), "awaited");
        assert!(labels.want(&wanted, now + ASK_AGAIN), "asked again");
        // Another process under the pid is asked for at once.
        let other = Wanted {
            started: 2,
            ..wanted
        };
        assert!(labels.want(&other, now));
        labels.describe(described(60, 2, Some("/bin/x")), true, true);
        assert!(labels.want(&other, now), "answered: a new ask is a new one");
    }

    #[test]
    fn the_records_stay_within_their_bound() {
        let mut labels = ProcessLabels::new(4);
        for tgid in 0..100u32 {
            labels.describe(described(tgid, 1, Some("/bin/p")), true, true);
            assert_eq!(exe(&mut labels, tgid, 1).as_deref(), Some("/bin/p"));
            labels.exec(tgid + 1000, Some(Path::new("/bin/learned")));
            assert!(labels.len() <= 4);
        }
        let mut sizes = Vec::new();
        labels.state_sizes(&mut sizes);
        assert_eq!(sizes[0].name, "process_labels");
        assert!(sizes[0].entries.is_some_and(|n| n <= 4));
    }
}
