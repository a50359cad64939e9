//! What one process's labels are made of ([`ProcessLabels`]): its exe as a
//! description read it (or as its exec mapped it, once the link is gone),
//! its container entry, and whether a description is awaited. It lives in
//! the process's record (the agent's process table), so it is found with
//! the record the sample already looked up, goes when the record goes (the
//! one exit path), and is never read for another process under a reused
//! pid: a record whose start time differs starts over.
//!
//! [`Labeller`] owns what the records share: the container labels of the
//! processes of a container ([`ContainerIndex`]) and the empty exe. Nothing
//! here reads anything: the descriptions come from [`crate::describe`], on
//! a thread that may wait.

use std::{
    os::unix::ffi::OsStrExt as _,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use stackscope_telemetry::StateSize;

use crate::{
    ContainerEntry, ContainerIndex, Placed,
    describe::{Description, Wanted},
    kubelet::PodList,
};

/// How long a description asked for is awaited before it is asked for
/// again (the metadata worker's queue was full, or the answer was lost).
pub const ASK_AGAIN: Duration = Duration::from_secs(1);

/// What is known of one process; see the module documentation.
#[derive(Debug, Default)]
pub struct ProcessLabels {
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

impl ProcessLabels {
    /// The record as of process `started`: what it held of an earlier
    /// process under the same pid goes.
    fn of(&mut self, started: u64) -> &mut Self {
        if self.started != started {
            if self.started != 0 {
                *self = Self::default();
            }
            self.started = started;
        }
        self
    }

    /// Whether to ask for a description of `wanted` now: not while one
    /// asked for less than [`ASK_AGAIN`] before `now` is awaited.
    pub fn want(&mut self, wanted: &Wanted, now: Instant) -> bool {
        let record = self.of(wanted.started);
        if record
            .asked_at
            .is_some_and(|at| now.saturating_duration_since(at) < ASK_AGAIN)
        {
            return false;
        }
        record.asked_at = Some(now);
        true
    }

    /// Whether a description came since its process started (or last
    /// exec'd): asked again, it is no process met for the first time.
    pub fn described(&self) -> bool {
        self.exe.is_some() || self.container.is_some()
    }

    /// The process exec'd (its first mapping `exe`, if the mapping feed
    /// saw it): its exe is described again.
    pub fn exec(&mut self, exe: Option<&Path>) {
        self.exe = None;
        self.asked_at = None;
        self.learned_exe =
            exe.map(|exe| String::from_utf8_lossy(exe.as_os_str().as_bytes()).into());
    }

    /// What the last exec mapped first, if an exec event said.
    pub fn learned_exe(&self) -> Option<Arc<str>> {
        self.learned_exe.clone()
    }
}

/// What the records share; see the module documentation.
#[derive(Debug)]
pub struct Labeller {
    containers: ContainerIndex,
    empty: Arc<str>,
}

impl Default for Labeller {
    fn default() -> Self {
        Self {
            containers: ContainerIndex::default(),
            empty: "".into(),
        }
    }
}

impl Labeller {
    /// The empty exe, shared.
    pub fn empty(&self) -> Arc<str> {
        Arc::clone(&self.empty)
    }

    /// What `record` says of the process started at `started`, sampled in
    /// cgroup `cgroup_id`.
    pub fn known(&mut self, record: &mut ProcessLabels, started: u64, cgroup_id: u64) -> Known {
        if record.started != started {
            return Known {
                exe: None,
                container: None,
            };
        }
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

    /// Writes a description into `record`: the exe (when `exe` labels are
    /// kept) and the container entry (when container labels are).
    pub fn describe(
        &mut self,
        record: &mut ProcessLabels,
        description: Description,
        exe: bool,
        container: bool,
    ) {
        let Wanted {
            started, cgroup_id, ..
        } = description.process;
        let entry = container.then(|| self.containers.entry(cgroup_id, description.placement));
        let record = record.of(started);
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

    /// The containers kept, against their bound.
    pub fn state_size(&self) -> StateSize {
        self.containers.state_size()
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

    fn exe(labeller: &mut Labeller, record: &mut ProcessLabels, started: u64) -> Option<String> {
        labeller
            .known(record, started, 1)
            .exe
            .map(|exe| exe.to_string())
    }

    #[test]
    fn a_record_answers_for_its_process_only() {
        let mut labeller = Labeller::default();
        let mut record = ProcessLabels::default();
        assert_eq!(
            exe(&mut labeller, &mut record, 1),
            None,
            "not described yet"
        );
        labeller.describe(
            &mut record,
            described(42, 1, Some("/usr/bin/redis-server")),
            true,
            true,
        );
        assert_eq!(
            exe(&mut labeller, &mut record, 1).as_deref(),
            Some("/usr/bin/redis-server")
        );
        let known = labeller.known(&mut record, 1, 1);
        assert_eq!(known.container.map(|placed| placed.labels), Some(None));
        // Another process with the same pid (its exit record was lost).
        assert_eq!(labeller.known(&mut record, 2, 1).exe, None);
        assert_eq!(labeller.known(&mut record, 2, 1).container, None);
        // In another cgroup: its container is described again.
        assert_eq!(labeller.known(&mut record, 1, 9).container, None);

        // A link that could not be read: empty, for this process only.
        let mut record = ProcessLabels::default();
        labeller.describe(&mut record, described(43, 1, None), true, true);
        assert_eq!(exe(&mut labeller, &mut record, 1).as_deref(), Some(""));
        assert_eq!(exe(&mut labeller, &mut record, 2), None);
        // A description for a new process under the pid replaces the record.
        labeller.describe(&mut record, described(43, 5, Some("/bin/new")), true, true);
        assert_eq!(
            exe(&mut labeller, &mut record, 5).as_deref(),
            Some("/bin/new")
        );
        assert_eq!(exe(&mut labeller, &mut record, 1), None);
        // Without a start time, a failure is not remembered: the pid may
        // belong to a forked process next.
        let mut record = ProcessLabels::default();
        labeller.describe(&mut record, described(44, 0, None), true, false);
        assert_eq!(exe(&mut labeller, &mut record, 0), None);
    }

    #[test]
    fn an_exec_describes_the_exe_again_and_what_it_mapped_stands_in() {
        let mut labeller = Labeller::default();
        let mut record = ProcessLabels::default();
        labeller.describe(&mut record, described(50, 1, Some("/bin/sh")), true, true);
        record.exec(Some(Path::new("/usr/bin/sort")));
        assert_eq!(exe(&mut labeller, &mut record, 1), None, "described again");
        assert_eq!(record.learned_exe().as_deref(), Some("/usr/bin/sort"));
        // It exited before its link was read: what its exec mapped.
        labeller.describe(&mut record, described(50, 1, None), true, true);
        assert_eq!(
            exe(&mut labeller, &mut record, 1).as_deref(),
            Some("/usr/bin/sort")
        );
        // A live link wins over what was learned.
        let mut record = ProcessLabels::default();
        record.exec(Some(Path::new("/usr/bin/stale")));
        labeller.describe(
            &mut record,
            described(51, 1, Some("/usr/bin/uniq")),
            true,
            true,
        );
        assert_eq!(
            exe(&mut labeller, &mut record, 1).as_deref(),
            Some("/usr/bin/uniq")
        );
    }

    #[test]
    fn a_description_is_asked_for_once_while_awaited() {
        let mut labeller = Labeller::default();
        let mut record = ProcessLabels::default();
        let wanted = Wanted {
            tgid: 60,
            started: 1,
            cgroup_id: 1,
        };
        let now = Instant::now();
        assert!(record.want(&wanted, now));
        assert!(!record.described());
        assert!(!record.want(&wanted, now), "awaited");
        assert!(record.want(&wanted, now + ASK_AGAIN), "asked again");
        // Another process under the pid is asked for at once.
        let other = Wanted {
            started: 2,
            ..wanted
        };
        assert!(record.want(&other, now));
        labeller.describe(&mut record, described(60, 2, Some("/bin/x")), true, true);
        assert!(record.described());
        assert!(record.want(&other, now), "answered: a new ask is a new one");
    }
}
