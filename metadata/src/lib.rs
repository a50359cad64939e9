//! What the agent knows about a sampled process beyond its sample header:
//! its executable ([`exe`]), which container it runs in and what that is
//! called, read by [`describe`] on a thread that may wait on files.
//!
//! Owns container labels ([`ContainerIndex`], one value per container,
//! shared by its processes) and what a process's description makes of them
//! ([`ContainerEntry`], kept in the caller's per-process record): the
//! cgroup path of `/proc/<pid>/cgroup`, read once per process (again when
//! a sample shows the process in another cgroup), says the runtime, the
//! container id and, under Kubernetes, the pod UID ([`container`], the one place that
//! reads a container's identity from a cgroup path). Names come from the
//! kubelet's pod list ([`kubelet`]: pod, namespace, container name; kept
//! fresh by [`pod_watch`]) or,
//! outside Kubernetes, from the runtime's own state on disk
//! ([`runtime_names`]), both behind one trait ([`provider`]). [`selection`] turns the user's container, pod and
//! cgroup selections into the BPF program's cgroup policies, through
//! [`cgroups`]' view of the cgroup2 hierarchy.
//!
//! Keyed by process rather than by the sample's cgroup id: on a hybrid
//! host a runtime that manages only the v1 hierarchies leaves containers at
//! the v2 root, where the v2 id says nothing.
//!
//! Does not own which processes exist or what they map
//! (`stackscope-process-table`), nor the labels' place in a batch (the
//! agent's aggregator).

pub mod cgroups;
pub mod container;
pub mod describe;
pub mod exe;
pub mod kubelet;
pub mod memory_limit;
pub mod pod_watch;
pub mod process;
pub mod provider;
pub mod runtime_names;
pub mod selection;

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    container::ContainerIdentity,
    describe::Placement,
    provider::{ContainerNames, NameProvider as _},
};

use kubelet::PodList;

use stackscope_telemetry::StateSize;

/// The container labels of a sample. Empty strings for what is unknown
/// (no pod outside Kubernetes, no name before the runtime has written it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContainerLabels {
    pub id: Arc<str>,
    pub name: Arc<str>,
    pub pod: Arc<str>,
    pub namespace: Arc<str>,
    /// The pod's service (its `app` label or its workload's name).
    pub service: Arc<str>,
}

impl ContainerLabels {
    /// Everything a container's labels can say is known.
    fn complete(&self, in_pod: bool) -> bool {
        !self.name.is_empty() && (!in_pod || !self.pod.is_empty())
    }
}

/// Containers whose labels are kept before the index starts over.
pub const MAX_CONTAINERS: usize = 65_536;

/// How often a process whose labels still miss a name (or whose cgroup
/// could not be read) is described again: the runtime writes its state,
/// and the kubelet lists a pod, a little after the container's first
/// process starts.
const INCOMPLETE_RETRY: Duration = Duration::from_secs(1);

/// What a description of one process said of its container, kept in the
/// caller's record of the process (see [`ContainerIndex::entry`]).
#[derive(Debug)]
pub struct ContainerEntry {
    cgroup_id: u64,
    /// `None`: a host process, or one whose cgroup could not be read.
    identity: Option<ContainerIdentity>,
    /// Its cgroup could not be read: it is described again every
    /// [`INCOMPLETE_RETRY`].
    unread: bool,
    /// What the runtime called the container when the process was
    /// described.
    runtime_names: Option<ContainerNames>,
    labels: Option<Arc<ContainerLabels>>,
    /// The pod list generation the labels were made with.
    generation: u64,
    /// When a process whose labels are incomplete is described again.
    retry_at: Option<Instant>,
}

impl ContainerEntry {
    /// What the index says of the process now; an entry due for another
    /// description says so once per [`INCOMPLETE_RETRY`]. The clock is
    /// read only for labels still missing a name.
    fn placed(&mut self) -> Placed {
        let describe_again = self.retry_at.is_some_and(|at| Instant::now() >= at);
        if describe_again {
            self.retry_at = Some(Instant::now() + INCOMPLETE_RETRY);
        }
        Placed {
            labels: self.labels.clone(),
            settled: self.retry_at.is_none(),
            describe_again,
        }
    }
}

/// A process's container labels as the index knows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// `None` for a host process.
    pub labels: Option<Arc<ContainerLabels>>,
    /// They will not change while the process stays in this cgroup and
    /// the pod list stays the same (false while a name is missing, or the
    /// process's cgroup could not be read).
    pub settled: bool,
    /// Time to describe the process again (once per [`INCOMPLETE_RETRY`]).
    pub describe_again: bool,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct ContainerIndex {
    /// Labels by container id, shared by the container's processes (for
    /// the current pod list generation).
    by_container: HashMap<String, Arc<ContainerLabels>>,
    pods: Option<Arc<PodList>>,
    generation: u64,
    unknown_pod_seen: bool,
}

impl ContainerIndex {
    /// Containers whose labels are kept.
    pub fn state_size(&self) -> StateSize {
        StateSize::entries("containers", self.by_container.len(), Some(MAX_CONTAINERS))
    }

    /// The container labels of the process `entry` describes, seen in
    /// cgroup `cgroup_id`; `None` when it was described in another cgroup
    /// (it moved: describe it again, [`Self::entry`]).
    pub fn placed(&mut self, entry: &mut ContainerEntry, cgroup_id: u64) -> Option<Placed> {
        if entry.cgroup_id != cgroup_id {
            return None;
        }
        if entry.generation != self.generation {
            // A newer pod list: the labels are made again from it.
            let names = entry.runtime_names.clone();
            let (labels, retry_at) = self.labels_with_retry(entry.identity.as_ref(), names);
            entry.labels = labels;
            if !entry.unread {
                entry.retry_at = retry_at;
            }
            entry.generation = self.generation;
        }
        Some(entry.placed())
    }

    /// What a description of a process (in cgroup `cgroup_id`) found, as
    /// an entry for the caller's record of the process.
    pub fn entry(&mut self, cgroup_id: u64, placement: Placement) -> ContainerEntry {
        let (identity, runtime_names, unread) = match placement {
            Placement::Unknown => (None, None, true),
            Placement::Host => (None, None, false),
            Placement::Container {
                identity,
                runtime_names,
            } => (Some(identity), runtime_names, false),
        };
        let (labels, retry_at) = self.labels_with_retry(identity.as_ref(), runtime_names.clone());
        let retry_at = retry_at.or(unread.then(|| Instant::now() + INCOMPLETE_RETRY));
        ContainerEntry {
            cgroup_id,
            identity,
            unread,
            runtime_names,
            labels,
            generation: self.generation,
            retry_at,
        }
    }

    /// The labels of a container (if any), and when to describe its
    /// process again if they are incomplete.
    fn labels_with_retry(
        &mut self,
        identity: Option<&ContainerIdentity>,
        runtime_names: Option<ContainerNames>,
    ) -> (Option<Arc<ContainerLabels>>, Option<Instant>) {
        let Some(identity) = identity else {
            return (None, None);
        };
        let labels = self.labels_of(identity, runtime_names);
        let retry_at = (!labels.complete(identity.pod_uid.is_some()))
            .then(|| Instant::now() + INCOMPLETE_RETRY);
        (Some(labels), retry_at)
    }

    /// The labels of a container: one `Arc` per container and content, so
    /// that label keys can compare them by address. Complete labels are
    /// reused as they are; incomplete ones are made again (a name may have
    /// appeared) and keep their `Arc` while nothing changed.
    fn labels_of(
        &mut self,
        identity: &ContainerIdentity,
        runtime_names: Option<ContainerNames>,
    ) -> Arc<ContainerLabels> {
        let in_pod = identity.pod_uid.is_some();
        if let Some(labels) = self.by_container.get(&identity.container_id)
            && labels.complete(in_pod)
        {
            return Arc::clone(labels);
        }
        let labels = self.look_up(identity, runtime_names);
        if let Some(known) = self.by_container.get(&identity.container_id)
            && **known == labels
        {
            return Arc::clone(known);
        }
        if self.by_container.len() >= MAX_CONTAINERS {
            self.by_container.clear();
        }
        let labels = Arc::new(labels);
        self.by_container
            .insert(identity.container_id.clone(), Arc::clone(&labels));
        labels
    }

    /// Names the container from its providers in order: the pod list
    /// (it also names pod and namespace, and is the only source for
    /// containerd's and CRI-O's containers), else what the runtime's state
    /// said when the process was described.
    fn look_up(
        &mut self,
        identity: &ContainerIdentity,
        runtime_names: Option<ContainerNames>,
    ) -> ContainerLabels {
        let from_pods = self.pods.as_mut().and_then(|pods| pods.names(identity));
        if from_pods.is_none() && identity.pod_uid.is_some() {
            // A pod the list does not have yet: the agent fetches it again.
            self.unknown_pod_seen = true;
        }
        let names = from_pods.or(runtime_names).unwrap_or_default();
        ContainerLabels {
            id: identity.container_id.as_str().into(),
            name: names.name,
            pod: names.pod,
            namespace: names.namespace,
            service: names.service,
        }
    }

    /// Forgets the labels of containers that no remembered process is in
    /// any more (their last process exited): containers come and go all
    /// day on a node, and their labels would otherwise stay until
    /// [`MAX_CONTAINERS`] of them had been seen. Labels still held by
    /// something else (an interval being built) stay until it lets go.
    pub fn forget_empty_containers(&mut self) {
        self.by_container
            .retain(|_, labels| Arc::strong_count(labels) > 1);
    }

    /// A newer pod list: labels are made again from it.
    pub fn set_pods(&mut self, pods: Arc<PodList>) {
        self.pods = Some(pods);
        self.generation += 1;
        self.by_container.clear();
    }

    /// Whether a process of a pod missing from the pod list was seen since
    /// the last call.
    pub fn take_unknown_pod_seen(&mut self) -> bool {
        std::mem::take(&mut self.unknown_pod_seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        describe::{Describer, Reads, Wanted},
        runtime_names::RuntimeNames,
    };
    use std::path::{Path, PathBuf};

    /// The index with each process's entry kept by pid, as the agent's
    /// per-process records keep them.
    #[derive(Default)]
    struct Index {
        containers: ContainerIndex,
        entries: HashMap<u32, ContainerEntry>,
    }

    impl Index {
        fn placed(&mut self, tgid: u32, cgroup_id: u64) -> Option<Placed> {
            let entry = self.entries.get_mut(&tgid)?;
            self.containers.placed(entry, cgroup_id)
        }

        fn describe(&mut self, tgid: u32, cgroup_id: u64, placement: Placement) {
            let entry = self.containers.entry(cgroup_id, placement);
            self.entries.insert(tgid, entry);
        }

        fn forget(&mut self, tgid: u32) {
            self.entries.remove(&tgid);
        }
    }

    /// The index's labels of `tgid` in `cgroup_id`, describing the process
    /// first (as the agent's metadata worker does) when the index asks for
    /// it.
    fn labels(
        index: &mut Index,
        describer: &mut Describer,
        tgid: u32,
        cgroup_id: u64,
    ) -> Option<Arc<ContainerLabels>> {
        if let Some(placed) = index.placed(tgid, cgroup_id)
            && !placed.describe_again
        {
            return placed.labels;
        }
        let description = describer.describe(Wanted {
            tgid,
            started: 1,
            cgroup_id,
        });
        index.describe(tgid, cgroup_id, description.placement);
        index.placed(tgid, cgroup_id).expect("described").labels
    }

    fn describer(proc: &Path, names: RuntimeNames) -> Describer {
        let reads = Reads {
            exe: false,
            container: true,
        };
        Describer::new(proc, reads, names)
    }

    const ID_A: &str = "f4abe5cb3cffbee1e3403a24413e5f2044e0c07bb1e09d0a61ea6e69e1266c77";
    const ID_B: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const POD_UID: &str = "0b9d4c5e-1a2b-4c3d-9e8f-001122334455";

    /// A fake procfs with one process per (pid, cgroup line).
    fn proc_with(processes: &[(u32, String)]) -> tempfile::TempDir {
        let proc = tempfile::tempdir().expect("temporary directory");
        for (pid, cgroup) in processes {
            let dir = proc.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).expect("pid directory");
            std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup file");
        }
        proc
    }

    fn podman_storage(names: &[(&str, &str)]) -> tempfile::TempDir {
        let storage = tempfile::tempdir().expect("temporary directory");
        let dir = storage.path().join("overlay-containers");
        std::fs::create_dir_all(&dir).expect("directory");
        let entries: Vec<String> = names
            .iter()
            .map(|(id, name)| format!(r#"{{"id":"{id}","names":["{name}"]}}"#))
            .collect();
        std::fs::write(
            dir.join("containers.json"),
            format!("[{}]", entries.join(",")),
        )
        .expect("containers.json");
        storage
    }

    #[test]
    fn labels_podman_containers_by_process_and_leaves_host_processes_alone() {
        let proc = proc_with(&[
            (10, format!("0::/libpod_parent/libpod-{ID_A}\n")),
            (11, format!("0::/libpod_parent/libpod-{ID_A}\n")),
            (20, "0::/system.slice/ssh.service\n".to_string()),
        ]);
        let storage = podman_storage(&[(ID_A, "api")]);
        let names = RuntimeNames::new(storage.path().to_path_buf(), PathBuf::from("/nonexistent"));
        let (mut index, mut describer) = (Index::default(), describer(proc.path(), names));
        assert_eq!(index.placed(10, 7), None, "not described yet");
        let a = labels(&mut index, &mut describer, 10, 7).expect("process 10 is in a container");
        assert_eq!((&*a.id, &*a.name, &*a.pod), (ID_A, "api", ""));
        let again = labels(&mut index, &mut describer, 11, 7).expect("process 11 too");
        assert!(Arc::ptr_eq(&a, &again), "one labels value per container");
        assert_eq!(
            labels(&mut index, &mut describer, 20, 1),
            None,
            "a host process"
        );
        assert_eq!(
            labels(&mut index, &mut describer, 99, 1),
            None,
            "a process already gone"
        );
        let described = describer.described;
        let placed = index.placed(10, 7).expect("described");
        assert!(placed.settled && !placed.describe_again);
        labels(&mut index, &mut describer, 10, 7);
        assert_eq!(describer.described, described, "kept per process");
        // The process moved to another cgroup: described again.
        std::fs::write(
            proc.path().join("10/cgroup"),
            "0::/system.slice/other.service\n",
        )
        .expect("cgroup file");
        assert_eq!(index.placed(10, 8), None);
        assert_eq!(labels(&mut index, &mut describer, 10, 8), None);
        assert_eq!(describer.described, described + 1);
    }

    #[test]
    fn a_containers_labels_go_with_its_last_process() {
        let proc = proc_with(&[
            (10, format!("0::/libpod_parent/libpod-{ID_A}\n")),
            (11, format!("0::/libpod_parent/libpod-{ID_A}\n")),
            (20, format!("0::/libpod_parent/libpod-{ID_B}\n")),
        ]);
        let storage = podman_storage(&[(ID_A, "api"), (ID_B, "db")]);
        let names = RuntimeNames::new(storage.path().to_path_buf(), PathBuf::from("/nonexistent"));
        let (mut index, mut describer) = (Index::default(), describer(proc.path(), names));
        for tgid in [10, 11, 20] {
            labels(&mut index, &mut describer, tgid, 7).expect("a container process");
        }
        let containers = |index: &Index| {
            index
                .containers
                .state_size()
                .entries
                .expect("containers are counted")
        };
        assert_eq!(containers(&index), 2);
        // B's only process exits, and one of A's two.
        index.forget(20);
        index.forget(10);
        index.containers.forget_empty_containers();
        assert_eq!(containers(&index), 1, "only A has a process left");
        // Labels an interval still holds are kept until it lets go.
        let held = labels(&mut index, &mut describer, 11, 7).expect("A's labels");
        index.forget(11);
        index.containers.forget_empty_containers();
        assert_eq!(containers(&index), 1, "A's labels are still held");
        drop(held);
        index.containers.forget_empty_containers();
        assert_eq!(containers(&index), 0);
    }

    #[test]
    #[ignore = "needs root (creates a cgroup): run by `cargo xtask test`"]
    fn a_process_gone_before_it_was_read_is_labelled_by_its_cgroup() {
        // A real cgroup named as podman names a container's.
        stackscope_test_fixtures::require_root("creating a cgroup");
        let mount = crate::cgroups::cgroup2_mount().expect("a cgroup2 mount");
        let parent = mount.join(format!("stackscope-test-gone-{}", std::process::id()));
        let scope = parent.join(format!("libpod-{ID_A}.scope"));
        std::fs::create_dir_all(&scope).expect("creating cgroups");
        let id = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&scope).expect("cgroup"));
        // No /proc entry for pid 40: it exited before its sample was read.
        let proc = proc_with(&[]);
        let names = RuntimeNames::new(PathBuf::from("/nonexistent"), PathBuf::from("/nonexistent"));
        let (mut index, mut describer) = (Index::default(), describer(proc.path(), names));
        let gone = labels(&mut index, &mut describer, 40, id);
        let host = labels(&mut index, &mut describer, 41, 1);
        std::fs::remove_dir(&scope).expect("removing cgroups");
        std::fs::remove_dir(&parent).expect("removing cgroups");
        assert_eq!(gone.expect("labelled by its cgroup").id.as_ref(), ID_A);
        assert_eq!(host, None, "the root cgroup is the host's");
        // The cgroup is gone too: a describer that found its path before
        // still knows it (a cgroup id is never reused)...
        let remembered = labels(&mut index, &mut describer, 42, id).expect("its path kept");
        assert_eq!(remembered.id.as_ref(), ID_A);
        // ...one that did not has nothing to say, and asks again later.
        let names = RuntimeNames::new(PathBuf::from("/nonexistent"), PathBuf::from("/nonexistent"));
        let mut fresh = self::describer(proc.path(), names);
        assert_eq!(labels(&mut index, &mut fresh, 43, id), None);
        assert!(!index.placed(43, id).expect("described").settled);
    }

    #[test]
    fn processes_of_a_container_without_a_name_share_one_labels_value() {
        let proc = proc_with(&[
            (10, format!("0::/libpod_parent/libpod-{ID_A}\n")),
            (11, format!("0::/libpod_parent/libpod-{ID_A}\n")),
        ]);
        // podman has not written the container's name (no state at all).
        let names = RuntimeNames::new(PathBuf::from("/nonexistent"), PathBuf::from("/nonexistent"));
        let (mut index, mut describer) = (Index::default(), describer(proc.path(), names));
        let first = labels(&mut index, &mut describer, 10, 7).expect("a container");
        assert_eq!((&*first.id, &*first.name), (ID_A, ""));
        let placed = index.placed(10, 7).expect("described");
        assert!(
            !placed.settled && !placed.describe_again,
            "asked again in a second"
        );
        let second = labels(&mut index, &mut describer, 11, 7).expect("a container");
        assert!(
            Arc::ptr_eq(&first, &second),
            "label keys compare container labels by address: one value per container"
        );
    }

    #[test]
    fn pods_are_named_from_the_pod_list_and_unknown_pods_are_reported() {
        let pod_path = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{ID_B}.scope\n",
            POD_UID.replace('-', "_")
        );
        let proc = proc_with(&[(30, pod_path)]);
        let names = RuntimeNames::new(PathBuf::from("/nonexistent"), PathBuf::from("/nonexistent"));
        let (mut index, mut describer) = (Index::default(), describer(proc.path(), names));
        let before = labels(&mut index, &mut describer, 30, 5).expect("a pod's container");
        assert_eq!((&*before.id, &*before.pod), (ID_B, ""));
        assert!(index.containers.take_unknown_pod_seen());
        assert!(
            !index.containers.take_unknown_pod_seen(),
            "cleared by the call"
        );

        let pods = PodList::parse(
            format!(
                r#"{{"kind":"PodList","items":[{{"metadata":{{"name":"web-7d4b9","namespace":"shop","uid":"{POD_UID}"}},
                "status":{{"containerStatuses":[{{"name":"nginx","containerID":"containerd://{ID_B}"}}]}}}}]}}"#
            )
            .as_bytes(),
        )
        .expect("a pod list");
        index.containers.set_pods(Arc::new(pods));
        let described = describer.described;
        let after = index
            .placed(30, 5)
            .expect("still described")
            .labels
            .expect("a pod's container");
        assert_eq!(
            describer.described, described,
            "named from the pod list alone"
        );
        assert_eq!(
            (&*after.name, &*after.pod, &*after.namespace),
            ("nginx", "web-7d4b9", "shop")
        );
        assert!(!index.containers.take_unknown_pod_seen());
    }
}
