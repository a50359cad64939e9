//! Reads what a process's labels are made from, for the caches the sampling
//! thread looks them up in without reading (each process's record,
//! [`crate::process::ProcessLabels`]): its executable's link, its cgroup and what
//! the container runtime calls that container. All of it is files under
//! `/proc`, the cgroup tree and the runtime's state, which a slow or stuck
//! filesystem can hold up: the agent reads them on its metadata worker,
//! and the answers reach the sampling thread as [`Description`]s.
//!
//! Owns the reading. Does not own what the labels are made of (the
//! container index joins a description with the kubelet's pod list) nor
//! when a process is described (the aggregator asks on a process's first
//! sample, and again while a name is missing).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    container::{self, ContainerIdentity},
    exe,
    provider::{ContainerNames, NameProvider as _},
    runtime_names::RuntimeNames,
};

/// Cgroup paths kept by id (well under a MB).
const MAX_CGROUP_PATHS: usize = 4096;

/// A process whose labels are wanted, as its sample shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    pub tgid: u32,
    /// When it started (`CLOCK_MONOTONIC` ns; 0: unknown): a pid reused by
    /// another process is another process.
    pub started: u64,
    /// The cgroup the sample was taken in.
    pub cgroup_id: u64,
}

/// What a process's labels are made from, read for [`Wanted`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Description {
    pub process: Wanted,
    /// Its executable as it sees it; `None` when the link could not be read
    /// (it exited) or the exe label is not wanted.
    pub exe: Option<Arc<str>>,
    pub placement: Placement,
}

/// Where a process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Neither its cgroup file nor its cgroup could be read (or container
    /// labels are not wanted).
    Unknown,
    Host,
    Container {
        identity: ContainerIdentity,
        /// What the runtime's state on disk calls it, if anything.
        runtime_names: Option<ContainerNames>,
    },
}

/// What [`Describer`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reads {
    pub exe: bool,
    pub container: bool,
}

/// Reads [`Description`]s; see the module documentation.
#[derive(Debug)]
pub struct Describer {
    proc_root: PathBuf,
    reads: Reads,
    names: RuntimeNames,
    /// The cgroup2 mount, found on first use (`None` inside: there is none).
    cgroup_mount: Option<Option<PathBuf>>,
    /// Paths of cgroups found by id: a gone process's cgroup is looked up
    /// by handle (three system calls), and the short processes of a build
    /// or a shell script are gone by the thousand from the same few. A
    /// cgroup id is never reused while the system runs; a cgroup renamed
    /// keeps its old path here until the map is full and emptied.
    cgroup_paths: HashMap<u64, String>,
    /// Processes described.
    pub described: u64,
}

impl Describer {
    pub fn new(proc_root: &Path, reads: Reads, names: RuntimeNames) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            reads,
            names,
            cgroup_mount: None,
            cgroup_paths: HashMap::new(),
            described: 0,
        }
    }

    /// The runtimes' names it keeps, for others that name containers (the
    /// container selection).
    pub fn runtime_names(&mut self) -> &mut RuntimeNames {
        &mut self.names
    }

    pub fn describe(&mut self, process: Wanted) -> Description {
        self.described += 1;
        let exe = if self.reads.exe {
            exe::read_exe(&self.proc_root, process.tgid)
        } else {
            None
        };
        let placement = if self.reads.container {
            self.placement(process)
        } else {
            Placement::Unknown
        };
        Description {
            process,
            exe,
            placement,
        }
    }

    /// A process gone before its first sample was read is placed by its
    /// cgroup, which its container outlives it in.
    fn placement(&mut self, process: Wanted) -> Placement {
        let path = match container::read_cgroup_path(&self.proc_root, process.tgid) {
            Ok(path) => path,
            Err(_) => match self.path_of_cgroup(process.cgroup_id) {
                Some(path) => path,
                None => return Placement::Unknown,
            },
        };
        match container::identify(&path) {
            None => Placement::Host,
            Some(identity) => Placement::Container {
                runtime_names: self.names.names(&identity),
                identity,
            },
        }
    }

    /// The path of cgroup `id` (a process's, once the process is gone).
    fn path_of_cgroup(&mut self, id: u64) -> Option<String> {
        if let Some(path) = self.cgroup_paths.get(&id) {
            return Some(path.clone());
        }
        let mount = self
            .cgroup_mount
            .get_or_insert_with(|| crate::cgroups::cgroup2_mount().ok())
            .as_deref()?;
        let path = crate::cgroups::path_of_id(mount, id).ok()?;
        if self.cgroup_paths.len() >= MAX_CGROUP_PATHS {
            self.cgroup_paths.clear();
        }
        self.cgroup_paths.insert(id, path.clone());
        Some(path)
    }
}
