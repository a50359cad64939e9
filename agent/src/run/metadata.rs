//! The metadata workers: threads for the reads that walk `/proc` and the
//! cgroup tree, kept off the sampling thread (a slow filesystem must not
//! delay a drain) and off the runtime (which exports and serves).
//!
//! The first describes the processes the sampling thread meets (their
//! exe, cgroup and container names: what their labels are made of), reads
//! the maps of processes the walker meets without knowing them and
//! identifies the files they map (the process table's reads), opens the
//! mapped files the aggregator will name frames in while their processes
//! run, resolves the container selection into cgroup policies, with the
//! container runtimes' names it keeps, finds the CPython interpreters of
//! processes that map one, and finds which of the processes the sampling
//! thread tracks are gone.
//!
//! The second reads what JIT runtimes publish of their code: the perf maps
//! and jitdump files JIT frames are named from, and HotSpot JVMs' code
//! caches. Those reads follow what a process writes (a perf map of
//! gigabytes, a JVM's tables) and can take seconds; on a thread of their
//! own they do not hold the labels and maps every sample waits for.
//!
//! Their answers go to the sampling thread as [`Command`]s.

use std::{
    io,
    path::PathBuf,
    sync::{
        Arc,
        atomic::Ordering,
        mpsc::{self, SyncSender, TrySendError},
    },
    time::Instant,
};

use stackscope_sampler::mapping_feed::monotonic_ns;
use tokio::sync::mpsc::Sender;

use super::{Handoffs, sampling::Command};
use stackscope_metadata::{
    describe::{Describer, Wanted},
    kubelet::PodList,
    selection::Resolver,
};
use stackscope_process_table::{ReadRequest, TableReader};
use stackscope_python::FoundInterpreter;
use stackscope_symbolize::node::{
    ObjectFile,
    perf_map::{JitRequest, PerfMapReader},
};

/// What the worker is asked to do.
#[derive(Debug)]
enum Job {
    /// Resolve the selection against the cgroup tree as it is now (and
    /// this pod list).
    Resolve(Option<Arc<PodList>>),
    /// Which of these processes have no `/proc` entry any more.
    FindGone(Vec<u32>),
    /// What these processes' labels are made of.
    Describe(Vec<Wanted>),
    /// The process table's reads: maps and the identities of mapped files.
    Read(TableReader, Vec<ReadRequest>),
    /// Open these mapped files while their processes run (the interval
    /// that met them holds them for naming).
    Open(Vec<Arc<ObjectFile>>),
    /// Look for a CPython interpreter in these processes.
    FindPython(Vec<u32>),
}

/// What the runtime-code worker is asked to do.
#[derive(Debug)]
enum RuntimeJob {
    /// Read on in these processes' perf maps and jitdump files (or close
    /// them).
    ReadJit(Vec<JitRequest>),
    /// Read the HotSpot JVM these processes run.
    FindJvm(Vec<u32>),
}

/// Room in the worker's queue: selections and sweeps come every few
/// seconds, descriptions at most once per drain (processes first met in
/// it). When it is full the worker is stuck on a slow read; the job that
/// finds it full is dropped and counted, and asked for again later (the
/// next selection tick or interval; a description a second later).
const JOB_QUEUE: usize = 64;

/// A handle to ask the workers for work, from any thread.
#[derive(Debug, Clone)]
pub(super) struct MetadataJobs {
    jobs: SyncSender<Job>,
    runtime_jobs: SyncSender<RuntimeJob>,
    handoffs: Arc<Handoffs>,
}

impl MetadataJobs {
    /// Asks for the selection's policies now; they reach the sampling
    /// thread when resolved.
    pub fn resolve(&self, pods: Option<Arc<PodList>>) {
        self.send(&self.jobs, Job::Resolve(pods));
    }

    /// Asks which of `tracked` are gone; those reach the sampling thread
    /// to be forgotten.
    pub fn find_gone(&self, tracked: Vec<u32>) {
        if !tracked.is_empty() {
            self.send(&self.jobs, Job::FindGone(tracked));
        }
    }

    /// Asks for `files` to be opened (each open is seen by every holder of
    /// the file).
    pub fn open(&self, files: Vec<Arc<ObjectFile>>) {
        if !files.is_empty() {
            self.send(&self.jobs, Job::Open(files));
        }
    }

    /// Asks for the process table's reads; the answers reach the sampling
    /// thread when read (a read dropped with a full queue is asked for
    /// again by the table, a second later).
    pub fn read(&self, reader: TableReader, requests: Vec<ReadRequest>) {
        if !requests.is_empty() {
            self.send(&self.jobs, Job::Read(reader, requests));
        }
    }

    /// Asks for what JIT frames' names are read from (a read dropped with
    /// a full queue is asked for again when due).
    pub fn read_jit(&self, requests: Vec<JitRequest>) {
        if !requests.is_empty() {
            self.send(&self.runtime_jobs, RuntimeJob::ReadJit(requests));
        }
    }

    /// Asks which of `tgids` run a CPython interpreter the sampler reads;
    /// the answers reach the sampling thread.
    pub fn find_python(&self, tgids: Vec<u32>) {
        if !tgids.is_empty() {
            self.send(&self.jobs, Job::FindPython(tgids));
        }
    }

    /// Asks for the JVMs `tgids` run; the answers reach the sampling thread.
    /// Whether the job was queued (false: ask again later).
    pub fn find_jvm(&self, tgids: Vec<u32>) -> bool {
        tgids.is_empty() || self.send(&self.runtime_jobs, RuntimeJob::FindJvm(tgids))
    }

    /// Asks for descriptions of `wanted`; they reach the sampling thread
    /// when read.
    pub fn describe(&self, wanted: Vec<Wanted>) {
        if !wanted.is_empty() {
            self.send(&self.jobs, Job::Describe(wanted));
        }
    }

    /// Queues `job`; false when it was dropped (a full queue, or a worker
    /// that stopped).
    fn send<T>(&self, queue: &SyncSender<T>, job: T) -> bool {
        match queue.try_send(job) {
            Ok(()) => return true,
            Err(TrySendError::Full(_)) => self.handoffs.count_job_dropped(),
            Err(TrySendError::Disconnected(_)) => {
                // It panicked: selection refreshes and sweeps stop.
                if !self.handoffs.metadata_lost.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        "a metadata worker has stopped: new processes may no longer be \
                         described (their exe and container labels stay empty) or their \
                         JIT frames named, and the container selection and the sweep of \
                         gone processes may no longer be refreshed"
                    );
                }
            }
        }
        false
    }
}

/// Starts the worker threads. They end when every [`MetadataJobs`] is
/// dropped (they are never joined: a read stuck on a dead filesystem must
/// not hold the agent's exit).
pub(super) fn start(
    resolver: Resolver,
    mut describer: Describer,
    mut perf_maps: PerfMapReader,
    proc_root: PathBuf,
    commands: Sender<Command>,
    handoffs: Arc<Handoffs>,
) -> io::Result<MetadataJobs> {
    let (jobs, queued) = mpsc::sync_channel(JOB_QUEUE);
    let (runtime_jobs, runtime_queued) = mpsc::sync_channel(JOB_QUEUE);
    let jvm_proc_root = proc_root.clone();
    serve(
        "stackscope-metadata",
        queued,
        &commands,
        &handoffs,
        move |job| {
            Some(match job {
                Job::Resolve(pods) => {
                    match resolver.policies(pods.as_deref(), describer.runtime_names()) {
                        Ok(wanted) => Command::Policies(wanted),
                        Err(err) => {
                            tracing::warn!("resolving the container selection failed: {err}");
                            return None;
                        }
                    }
                }
                Job::FindGone(tracked) => {
                    // Before the first look: a process that has a pid found
                    // gone started after this.
                    let checked_at = monotonic_ns();
                    let tgids = gone_processes(&proc_root, tracked);
                    if tgids.is_empty() {
                        return None;
                    }
                    Command::Gone { tgids, checked_at }
                }
                Job::Open(files) => {
                    for file in files {
                        // A failure stays in the file for the batch to see.
                        let _ = file.open_now();
                    }
                    return None;
                }
                Job::Read(reader, requests) => Command::Read(
                    requests
                        .into_iter()
                        .map(|request| reader.read(request))
                        .collect(),
                ),
                Job::FindPython(tgids) => Command::Python(
                    tgids
                        .into_iter()
                        .map(|tgid| (tgid, find_python(&proc_root, tgid)))
                        .collect(),
                ),
                Job::Describe(wanted) => Command::Described(
                    wanted
                        .into_iter()
                        .map(|process| describer.describe(process))
                        .collect(),
                ),
            })
        },
    )?;
    serve(
        "stackscope-runtime-code",
        runtime_queued,
        &commands,
        &handoffs,
        move |job| match job {
            RuntimeJob::ReadJit(requests) => {
                let updates = perf_maps.serve(requests, Instant::now());
                (!updates.is_empty()).then_some(Command::JitNames(updates))
            }
            RuntimeJob::FindJvm(tgids) => Some(Command::Jvm(
                tgids
                    .into_iter()
                    .map(|tgid| {
                        let found = stackscope_jvm::find_in_process(&jvm_proc_root, tgid)
                            .map(|jvm| jvm.map(Arc::new))
                            .map_err(|err| err.to_string());
                        (tgid, found)
                    })
                    .collect(),
            )),
        },
    )?;
    Ok(MetadataJobs {
        jobs,
        runtime_jobs,
        handoffs,
    })
}

/// Starts a thread named `name` that does each job `queued` hands it and
/// sends its answer, if any, to the sampling thread.
fn serve<T: Send + 'static>(
    name: &str,
    queued: mpsc::Receiver<T>,
    commands: &Sender<Command>,
    handoffs: &Arc<Handoffs>,
    mut work: impl FnMut(T) -> Option<Command> + Send + 'static,
) -> io::Result<()> {
    let commands = commands.clone();
    let answers = Arc::clone(handoffs);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            for job in queued {
                if let Some(answer) = work(job) {
                    answers.command(&commands, answer);
                }
            }
        })
        .map(drop)
}

/// The CPython interpreter process `tgid` runs, if the sampler reads it;
/// why not is logged (at debug: a process that exited, a Python 2).
fn find_python(proc_root: &std::path::Path, tgid: u32) -> Option<FoundInterpreter> {
    stackscope_python::find_in_process(proc_root, tgid)
        .inspect_err(|err| tracing::debug!("process {tgid}: no Python frames: {err}"))
        .ok()
        .flatten()
}

/// The processes of `tracked` without a directory under `proc_root`; none
/// when there is no procfs to ask there (or not this pid namespace's). A
/// zombie's directory stays until it is reaped: its state goes then.
fn gone_processes(proc_root: &std::path::Path, mut tracked: Vec<u32>) -> Vec<u32> {
    if std::fs::symlink_metadata(proc_root.join("1")).is_err() {
        return Vec::new();
    }
    tracked.retain(|tgid| std::fs::symlink_metadata(proc_root.join(tgid.to_string())).is_err());
    tracked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gone_processes_are_those_without_a_proc_entry() {
        let proc_root = PathBuf::from("/proc");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let reaped = child.id();
        child.wait().unwrap();
        let own = std::process::id();
        assert_eq!(gone_processes(&proc_root, vec![own, reaped]), [reaped]);
        // No procfs there: nothing is said to be gone.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(
            gone_processes(empty.path(), vec![own, reaped]),
            Vec::<u32>::new()
        );
    }
}
