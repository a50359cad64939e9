//! What the agent reads about a sampled process beyond its sample header:
//! its executable ([`exe`]), which container it runs in and what that is
//! called.
//!
//! Owns the per-process container identity ([`ContainerIndex`]): the cgroup
//! path of `/proc/<pid>/cgroup`, read once per process (again when a sample
//! shows the process in another cgroup), says the runtime, the container
//! id and, under Kubernetes, the pod UID ([`container`], the one place that
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
pub mod exe;
pub mod kubelet;
pub mod pod_watch;
pub mod provider;
pub mod runtime_names;
pub mod selection;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use crate::container::ContainerIdentity;

use kubelet::PodList;
use provider::NameProvider as _;
use runtime_names::RuntimeNames;

use stackscope_telemetry::StateSize;

use stackscope_telemetry::probes::{self, Probe};

/// The container labels of a sample. Empty strings for what is unknown
/// (no pod outside Kubernetes, no name before the runtime has written it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContainerLabels {
    pub id: Arc<str>,
    pub name: Arc<str>,
    pub pod: Arc<str>,
    pub namespace: Arc<str>,
}

impl ContainerLabels {
    /// Everything a container's labels can say is known.
    fn complete(&self, in_pod: bool) -> bool {
        !self.name.is_empty() && (!in_pod || !self.pod.is_empty())
    }
}

/// Processes whose container is remembered before the index starts over.
pub const MAX_PROCESSES: usize = 65_536;

/// How often labels still missing a name are looked up again for a
/// process: the runtime writes its state, and the kubelet lists a pod, a
/// little after the container's first process starts.
const INCOMPLETE_RETRY: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct ProcessEntry {
    cgroup_id: u64,
    identity: Option<ContainerIdentity>,
    labels: Option<Arc<ContainerLabels>>,
    /// The pod list generation the labels were made with.
    generation: u64,
    /// When incomplete labels may be looked up again.
    retry_at: Option<Instant>,
}

/// See the module documentation.
#[derive(Debug)]
pub struct ContainerIndex {
    proc_root: PathBuf,
    by_tgid: HashMap<u32, ProcessEntry>,
    /// Labels by container id, shared by the container's processes (for
    /// the current pod list generation).
    by_container: HashMap<String, Arc<ContainerLabels>>,
    names: RuntimeNames,
    pods: Option<Arc<PodList>>,
    generation: u64,
    unknown_pod_seen: bool,
    /// `/proc/<pid>/cgroup` reads (cache misses).
    pub reads: u64,
    /// The cgroup2 mount, found on first use (`None` inside: there is none).
    cgroup_mount: Option<Option<PathBuf>>,
}

impl ContainerIndex {
    pub fn tgids_into(&self, out: &mut Vec<u32>) {
        out.extend(self.by_tgid.keys());
    }

    /// Processes and containers whose labels are kept.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        out.push(StateSize::entries(
            "container_processes",
            self.by_tgid.len(),
            Some(MAX_PROCESSES),
        ));
        out.push(StateSize::entries(
            "containers",
            self.by_container.len(),
            Some(MAX_PROCESSES),
        ));
    }

    pub fn new(proc_root: &Path, names: RuntimeNames) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            by_tgid: HashMap::new(),
            by_container: HashMap::new(),
            names,
            pods: None,
            generation: 0,
            unknown_pod_seen: false,
            reads: 0,
            cgroup_mount: None,
        }
    }

    /// The path of cgroup `id` (a process's, once the process is gone).
    fn path_of_cgroup(&mut self, id: u64) -> Option<String> {
        let mount = self
            .cgroup_mount
            .get_or_insert_with(|| crate::cgroups::cgroup2_mount().ok())
            .as_deref()?;
        crate::cgroups::path_of_id(mount, id).ok()
    }

    /// The container of process `tgid`, seen in cgroup `cgroup_id`; `None`
    /// for host processes. A process already gone is placed by its cgroup,
    /// while that is still there.
    pub fn labels(&mut self, tgid: u32, cgroup_id: u64) -> Option<Arc<ContainerLabels>> {
        self.settled_labels(tgid, cgroup_id).0
    }

    /// [`Self::labels`], and whether they are settled: they will not
    /// change while the process stays in this cgroup and the pod list stays
    /// the same (false while a name is missing, or the process's cgroup
    /// could not be read: both are looked up again).
    pub fn settled_labels(
        &mut self,
        tgid: u32,
        cgroup_id: u64,
    ) -> (Option<Arc<ContainerLabels>>, bool) {
        // The clock is read only for labels still missing a name: this
        // runs for every sample.
        probes::count(Probe::Process);
        if let Some(entry) = self.by_tgid.get(&tgid)
            && entry.cgroup_id == cgroup_id
            && entry.generation == self.generation
            && entry.retry_at.is_none_or(|at| Instant::now() < at)
        {
            return (entry.labels.clone(), entry.retry_at.is_none());
        }
        let identity = match self.by_tgid.remove(&tgid) {
            Some(entry) if entry.cgroup_id == cgroup_id => entry.identity,
            _ => {
                if self.by_tgid.len() >= MAX_PROCESSES {
                    self.by_tgid.clear();
                }
                self.reads += 1;
                // A process gone before its first sample was read is found
                // by its cgroup, which its container outlives it in.
                let path = match container::read_cgroup_path(&self.proc_root, tgid) {
                    Ok(path) => path,
                    Err(_) => match self.path_of_cgroup(cgroup_id) {
                        Some(path) => path,
                        None => return (None, false),
                    },
                };
                container::identify(&path)
            }
        };
        let labels = identity.as_ref().map(|identity| self.labels_of(identity));
        let retry_at = match (&identity, &labels) {
            (Some(identity), Some(labels)) if !labels.complete(identity.pod_uid.is_some()) => {
                Some(Instant::now() + INCOMPLETE_RETRY)
            }
            _ => None,
        };
        self.by_tgid.insert(
            tgid,
            ProcessEntry {
                cgroup_id,
                identity,
                labels: labels.clone(),
                generation: self.generation,
                retry_at,
            },
        );
        (labels, retry_at.is_none())
    }

    /// The labels of a container: one `Arc` per container and content, so
    /// that label keys can compare them by address. Complete labels are
    /// reused as they are; incomplete ones are looked up again (a name may
    /// have appeared) and keep their `Arc` while nothing changed.
    fn labels_of(&mut self, identity: &ContainerIdentity) -> Arc<ContainerLabels> {
        let in_pod = identity.pod_uid.is_some();
        if let Some(labels) = self.by_container.get(&identity.container_id)
            && labels.complete(in_pod)
        {
            return Arc::clone(labels);
        }
        let labels = self.look_up(identity);
        if let Some(known) = self.by_container.get(&identity.container_id)
            && **known == labels
        {
            return Arc::clone(known);
        }
        if self.by_container.len() >= MAX_PROCESSES {
            self.by_container.clear();
        }
        let labels = Arc::new(labels);
        self.by_container
            .insert(identity.container_id.clone(), Arc::clone(&labels));
        labels
    }

    /// Names the container from its providers in order: the pod list
    /// (it also names pod and namespace, and is the only source for
    /// containerd's and CRI-O's containers), else the runtime's state.
    fn look_up(&mut self, identity: &ContainerIdentity) -> ContainerLabels {
        let from_pods = self.pods.as_mut().and_then(|pods| pods.names(identity));
        if from_pods.is_none() && identity.pod_uid.is_some() {
            // A pod the list does not have yet: the agent fetches it again.
            self.unknown_pod_seen = true;
        }
        let names = from_pods
            .or_else(|| self.names.names(identity))
            .unwrap_or_default();
        ContainerLabels {
            id: identity.container_id.as_str().into(),
            name: names.name,
            pod: names.pod,
            namespace: names.namespace,
        }
    }

    /// Forgets process `tgid` (it exited).
    pub fn forget(&mut self, tgid: u32) {
        self.by_tgid.remove(&tgid);
    }

    /// Forgets every process (exit records were lost).
    pub fn forget_all(&mut self) {
        self.by_tgid.clear();
    }

    /// Forgets the labels of containers that no remembered process is in
    /// any more (their last process exited): containers come and go all
    /// day on a node, and their labels would otherwise stay until
    /// [`MAX_PROCESSES`] of them had been seen. Labels still held by
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
        let mut index = ContainerIndex::new(proc.path(), names);
        let a = index.labels(10, 7).expect("process 10 is in a container");
        assert_eq!((&*a.id, &*a.name, &*a.pod), (ID_A, "api", ""));
        let again = index.labels(11, 7).expect("process 11 too");
        assert!(Arc::ptr_eq(&a, &again), "one labels value per container");
        assert_eq!(index.labels(20, 1), None, "a host process");
        assert_eq!(index.labels(99, 1), None, "a process already gone");
        let reads = index.reads;
        index.labels(10, 7);
        assert_eq!(index.reads, reads, "cached per process");
        // The process moved to another cgroup: read again.
        std::fs::write(
            proc.path().join("10/cgroup"),
            "0::/system.slice/other.service\n",
        )
        .expect("cgroup file");
        assert_eq!(index.labels(10, 8), None);
        assert_eq!(index.reads, reads + 1);
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
        let mut index = ContainerIndex::new(proc.path(), names);
        for tgid in [10, 11, 20] {
            index.labels(tgid, 7).expect("a container process");
        }
        let containers = |index: &ContainerIndex| {
            let mut sizes = Vec::new();
            index.state_sizes(&mut sizes);
            let containers = sizes
                .iter()
                .find(|size| size.name == "containers")
                .expect("the containers' size");
            containers.entries.expect("counted")
        };
        assert_eq!(containers(&index), 2);
        // B's only process exits, and one of A's two.
        index.forget(20);
        index.forget(10);
        index.forget_empty_containers();
        assert_eq!(containers(&index), 1, "only A has a process left");
        // Labels an interval still holds are kept until it lets go.
        let held = index.labels(11, 7).expect("A's labels");
        index.forget(11);
        index.forget_empty_containers();
        assert_eq!(containers(&index), 1, "A's labels are still held");
        drop(held);
        index.forget_empty_containers();
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
        let mut index = ContainerIndex::new(proc.path(), names);
        let labels = index.labels(40, id);
        let host = index.labels(41, 1);
        std::fs::remove_dir(&scope).expect("removing cgroups");
        std::fs::remove_dir(&parent).expect("removing cgroups");
        assert_eq!(labels.expect("labelled by its cgroup").id.as_ref(), ID_A);
        assert_eq!(host, None, "the root cgroup is the host's");
        // The cgroup is gone too: nothing to say.
        assert_eq!(index.labels(42, id), None);
    }

    #[test]
    fn processes_of_a_container_without_a_name_share_one_labels_value() {
        let proc = proc_with(&[
            (10, format!("0::/libpod_parent/libpod-{ID_A}\n")),
            (11, format!("0::/libpod_parent/libpod-{ID_A}\n")),
        ]);
        // podman has not written the container's name (no state at all).
        let names = RuntimeNames::new(PathBuf::from("/nonexistent"), PathBuf::from("/nonexistent"));
        let mut index = ContainerIndex::new(proc.path(), names);
        let first = index.labels(10, 7).expect("a container");
        assert_eq!((&*first.id, &*first.name), (ID_A, ""));
        let second = index.labels(11, 7).expect("a container");
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
        let mut index = ContainerIndex::new(proc.path(), names);
        let before = index.labels(30, 5).expect("a pod's container");
        assert_eq!((&*before.id, &*before.pod), (ID_B, ""));
        assert!(index.take_unknown_pod_seen());
        assert!(!index.take_unknown_pod_seen(), "cleared by the call");

        let pods = PodList::parse(
            format!(
                r#"{{"kind":"PodList","items":[{{"metadata":{{"name":"web-7d4b9","namespace":"shop","uid":"{POD_UID}"}},
                "status":{{"containerStatuses":[{{"name":"nginx","containerID":"containerd://{ID_B}"}}]}}}}]}}"#
            )
            .as_bytes(),
        )
        .expect("a pod list");
        index.set_pods(Arc::new(pods));
        let after = index.labels(30, 5).expect("a pod's container");
        assert_eq!(
            (&*after.name, &*after.pod, &*after.namespace),
            ("nginx", "web-7d4b9", "shop")
        );
        assert!(!index.take_unknown_pod_seen());
    }
}
