//! Sums identical (labels, stack) pairs over an interval, and turns each
//! finished interval into one `stackscope.v1.Batch`.
//!
//! Owns: the interval's dictionaries (mappings, locations, stacks, label
//! sets), interned as samples arrive so a sample costs lookups, not
//! allocations; the bound on distinct entries per interval; the labels
//! ([`labels`]); building the batch ([`batch`]); and the thread that names
//! frames and builds batches off the sampling loop ([`worker`]). Does not
//! own when intervals end (the sampling thread decides), naming frames
//! (`stackscope_symbolize::node`), or sending batches (the exporter).
//!
//! A sample's stack is leaf first overall: its kernel frames (innermost
//! first), then its user frames (innermost first), since the kernel was
//! running on top of the user code.
//!
//! Addresses: a location carries the frame's address in its mapping's
//! terms (file offset for a mapped file, offset in the image for the vDSO,
//! the kernel address, the absolute address for anonymous memory) as it was
//! walked: for every frame but the innermost of each part that is a return
//! address, the instruction after the call, as in pprof. Names are looked
//! up one byte before a return address, in the call instruction (a call
//! can be a function's last instruction, and the inlined frames at a call
//! are those of the call). The innermost user frame is looked up at its
//! address even when the kernel frames sit on top of it: the address a
//! thread entered the kernel from is the instruction after `syscall`, in
//! the same function, or the faulting instruction itself.
//!
//! Memory: at most `max_entries` distinct (labels, stack) pairs per
//! interval, and so at most that many stacks, at most [`MAX_LOCATIONS`]
//! locations and [`MAX_LABEL_SETS`] label sets. Once full, a sample whose
//! labels are known but whose stack is new is counted under its labels with
//! a one-frame `[truncated]` stack, so CPU time per process stays right; a
//! sample with new labels (once the interval or its label sets are full) is
//! dropped and counted: it has no entry to go into.

pub mod batch;
pub mod labels;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
pub mod worker;

use foldhash::{HashMap, HashMapExt as _};
use hashbrown::HashTable;
use std::{
    hash::BuildHasher as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use agent_common::{COMM_LEN, PythonFrame, SampleHeader};
use stackscope_process_table::{ModuleFile, ObjectId};
use stackscope_proto::v1::ProfileType;

pub use batch::{BatchOptions, build_batch};
use labels::LabelChoice;
use stackscope_metadata::{
    describe::{Describer, Description, Reads, Wanted},
    process::{Known, Labeller, ProcessLabels},
};
pub use worker::{BatchWorker, WorkerStats};

use stackscope_jvm::{Jvm, JvmStats};
use stackscope_metadata::{
    ContainerLabels,
    kubelet::PodList,
    runtime_names::{self, RuntimeNames},
};
use stackscope_python::{
    CodeCache, Unnamed,
    merge::{self, Merged},
};
use stackscope_symbolize::node::{
    ObjectFile,
    perf_map::{self, JitRequest, JitUpdate, PerfMapReader, PerfMapStats, PerfMaps},
};
use stackscope_telemetry::{
    StateSize,
    probes::{self, Probe},
};
use stackscope_unwind::walker::{FrameObject, Walk};

/// The name of a Python frame whose code object could not be read.
pub const UNNAMED_PYTHON: &str = "[python]";

/// The frame that stands for the Python frames of an activation the
/// sampler did not read (past its frame limit, or after a failed read).
pub const PYTHON_NOT_READ: &str = "[python frames not read]";

/// A sample's Python frames, and what names them: handed in with its walk
/// (see [`Aggregator::add_with_python`]).
#[derive(Debug)]
pub struct PythonSample<'a> {
    /// Innermost first, as the sampler read them.
    pub frames: &'a [PythonFrame],
    /// The read stopped before the outermost frame.
    pub cut: bool,
    /// The code of the process's `_PyEval_EvalFrameDefault`, split parts included.
    pub eval: &'a [std::ops::Range<u64>],
    pub codes: &'a mut CodeCache,
}

/// Where the aggregator finds a process's labels record by pid: the
/// agent's process table, or a map of records for tools and tests.
pub trait LabelRecords {
    fn labels_of(&mut self, tgid: u32) -> Option<&mut ProcessLabels>;
}

/// Records made as processes are described.
impl LabelRecords for std::collections::HashMap<u32, ProcessLabels> {
    fn labels_of(&mut self, tgid: u32) -> Option<&mut ProcessLabels> {
        Some(self.entry(tgid).or_default())
    }
}

/// Default length of an interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// Default bound on distinct (labels, stack) pairs per interval. A pair
/// costs a few hundred bytes with its stack, so this is tens of MB at most.
pub const DEFAULT_MAX_ENTRIES: usize = 200_000;

/// Label sets per interval at most, and locations: below the collector's
/// default ingest limits (100k label sets, 1M locations), so that a batch
/// is never refused for its size.
pub const MAX_LABEL_SETS: usize = 65_536;
pub const MAX_LOCATIONS: usize = 900_000;

/// Frames one sample can bring: the kernel's and the walker's limits.
const MAX_FRAMES_PER_SAMPLE: usize =
    agent_common::MAX_KERNEL_FRAMES + stackscope_unwind::DEFAULT_MAX_DEPTH;

/// Mapped files newly opened per interval while their process runs (by the
/// metadata worker, see [`Aggregator::take_to_open`]; a file the previous
/// interval used is handed on, not opened again); files past this are
/// opened when the batch is built (failing if the process has exited by
/// then). Bounds the descriptors an interval holds; with the symbolizer's,
/// a few thousand at most, which is why the agent's `main` raises its soft
/// limit on open files.
pub const MAX_EAGER_OPENS: usize = 512;

/// Module files whose mapping index is remembered per interval, so that
/// frames of a module already seen cost no hashing of its path.
const MAX_MODULE_MEMO: usize = 65_536;

/// Threads whose last walk is remembered (see `Builder::last_walks`),
/// direct-mapped by thread id: a thread sampled again is most often found
/// in its slot; a collision costs only the reuse.
const LAST_WALK_SLOTS: usize = 64;

/// User frames of a walk remembered at most (the walker's default depth
/// limit).
const MAX_REMEMBERED_FRAMES: usize = stackscope_unwind::DEFAULT_MAX_DEPTH;

/// What the last walks may hold: in every slot, the most user frames
/// with their locations, and the most kernel frames (about 850 KB).
const MAX_LAST_WALK_BYTES: usize = LAST_WALK_SLOTS
    * (MAX_REMEMBERED_FRAMES * (std::mem::size_of::<u64>() + std::mem::size_of::<u32>())
        + agent_common::MAX_KERNEL_FRAMES * std::mem::size_of::<u64>());

/// How samples are labelled and aggregated.
#[derive(Debug, Clone)]
pub struct AggregatorConfig {
    /// The `node` label and the batch's node name.
    pub node_name: String,
    /// The labels put on samples besides `node`.
    pub labels: LabelChoice,
    /// Distinct (labels, stack) pairs per interval; see the module
    /// documentation for what happens beyond.
    pub max_entries: usize,
    /// Where procfs is mounted: processes are described and their perf
    /// maps read through it.
    pub proc_root: PathBuf,
    /// containers-storage's root (podman's container names) and Docker's
    /// data root (Docker's).
    pub podman_storage: PathBuf,
    pub docker_root: PathBuf,
    /// Bytes of JIT names (perf maps, jitdump) kept for every process at
    /// once; a quarter of it for one process.
    pub perf_map_bytes: usize,
    /// Bytes of code blobs, method names and inlining every JVM's caches
    /// hold together (the largest emptied first at an interval's end).
    pub jvm_code_bytes: usize,
}

impl AggregatorConfig {
    /// Where container names are read outside Kubernetes.
    pub fn runtime_names(&self) -> RuntimeNames {
        RuntimeNames::new(self.podman_storage.clone(), self.docker_root.clone())
    }

    /// What the labels chosen need read about a process, and where from.
    pub fn describer(&self) -> Describer {
        let reads = Reads {
            exe: self.labels.exe,
            container: self.labels.any_container(),
        };
        Describer::new(&self.proc_root, reads, self.runtime_names())
    }

    /// What reads the perf maps and jitdump files the aggregator asks for
    /// (on the agent's metadata worker).
    pub fn perf_map_reader(&self) -> PerfMapReader {
        PerfMapReader::new(&self.proc_root)
    }
}

impl Default for AggregatorConfig {
    fn default() -> Self {
        Self {
            node_name: labels::host_name(),
            labels: LabelChoice::default(),
            max_entries: DEFAULT_MAX_ENTRIES,
            proc_root: PathBuf::from("/proc"),
            podman_storage: PathBuf::from(runtime_names::DEFAULT_PODMAN_STORAGE),
            docker_root: PathBuf::from(runtime_names::DEFAULT_DOCKER_ROOT),
            perf_map_bytes: perf_map::MAX_TOTAL_BYTES,
            jvm_code_bytes: crate::run::DEFAULT_JVM_CODE_BYTES,
        }
    }
}

/// The mapping a location is in, before naming.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MappingKey {
    /// A mapped file: its identity, and the path the process mapped it
    /// from (as the process sees it).
    User {
        id: ObjectId,
        path: String,
    },
    Vdso,
    /// JIT code, one key per name: its perf map entry, or `[jit] <comm>`.
    Jit {
        name: Arc<str>,
    },
    /// JIT code of process `tgid` (started at `started`) that no entry
    /// read so far covered when it was sampled: renamed when the interval
    /// ends, from the read that the miss asked for (see
    /// [`Aggregator::finish_interval`]).
    JitNotYetNamed {
        tgid: u32,
        started: u64,
        comm: [u8; COMM_LEN],
    },
    /// A Python function (its qualified name and file, as its code object
    /// says); the location's address is the line.
    Python {
        function: Arc<str>,
        file: Arc<str>,
    },
    /// A file that could not be reached: shipped by its path alone, with
    /// file offsets, so it shows as `path+offset` rather than anonymous.
    Unreadable {
        path: Arc<str>,
    },
    Anonymous,
    /// The kernel: split into the image and its modules when the batch is
    /// built (kallsyms says which).
    Kernel,
    /// The one pseudo-frame of samples beyond the interval's bound.
    Truncated,
}

/// A mapping of an interval.
#[derive(Debug, Clone)]
pub struct IntervalMapping {
    pub key: MappingKey,
    /// For [`MappingKey::User`]: the file to name frames in.
    pub file: Option<Arc<ObjectFile>>,
}

/// A location of an interval: see the module documentation for what the
/// address is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IntervalLocation {
    /// Index into [`Interval::mappings`].
    pub mapping: u32,
    pub address: u64,
    /// A return address: named by the byte before it.
    pub return_address: bool,
}

impl IntervalLocation {
    /// The address to name the location by.
    pub fn lookup(&self) -> u64 {
        if self.return_address {
            self.address.wrapping_sub(1)
        } else {
            self.address
        }
    }
}

/// The labels of a label set, apart from `node` (the same for all). Values
/// of labels not chosen are left empty; empty values are not shipped.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LabelValues {
    pub comm: String,
    /// Empty for kernel threads and processes whose exe was unreadable.
    pub exe: Arc<str>,
    /// Only when the `pid` label was asked for.
    pub pid: Option<u32>,
    /// The container the process runs in; `None` on the host (or when no
    /// container label was asked for).
    pub container: Option<Arc<ContainerLabels>>,
}

/// Samples of one (stack, label set) pair of one profile type taken under
/// one sampling divisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntervalSample {
    /// Index into [`Interval::stacks`].
    pub stack: u32,
    /// Index into [`Interval::label_sets`].
    pub label_set: u32,
    /// The 1-in-N the samples were taken under (1: every one).
    pub divisor: u32,
    /// CPU: ticks; off-CPU: nanoseconds blocked.
    pub count: u64,
    pub profile_type: ProfileType,
}

/// What one sample adds to its (stack, label set) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleWeight {
    /// A timer tick.
    Tick,
    /// An off-CPU sample: the nanoseconds its thread stayed blocked.
    OffCpu { nanos: u64 },
}

impl SampleWeight {
    fn profile_type(self) -> ProfileType {
        match self {
            SampleWeight::Tick => ProfileType::Cpu,
            SampleWeight::OffCpu { .. } => ProfileType::OffCpu,
        }
    }

    fn count(self) -> u64 {
        match self {
            SampleWeight::Tick => 1,
            SampleWeight::OffCpu { nanos } => nanos,
        }
    }
}

/// The stacks of an interval: each a list of indexes into
/// [`Interval::locations`], leaf first, all of them end to end in one
/// vector. A box per stack cost a malloc and a free for most samples of a
/// busy interval (most bring a new stack), and scattered the stacks a
/// lookup compares.
#[derive(Debug, Clone)]
pub struct Stacks {
    locations: Vec<u32>,
    /// Where each stack starts in `locations`, and after the last, where
    /// the last ends: stack `i` is `bounds[i]..bounds[i + 1]`.
    bounds: Vec<usize>,
}

impl Default for Stacks {
    fn default() -> Self {
        Self {
            locations: Vec::new(),
            bounds: vec![0],
        }
    }
}

impl Stacks {
    pub fn len(&self) -> usize {
        self.bounds.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stack `index`, leaf first.
    pub fn get(&self, index: usize) -> Option<&[u32]> {
        let (&start, &end) = (self.bounds.get(index)?, self.bounds.get(index + 1)?);
        self.locations.get(start..end)
    }

    /// The stacks in index order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[u32]> {
        self.bounds
            .windows(2)
            .map(|bounds| &self.locations[bounds[0]..bounds[1]])
    }

    /// Empty, with room for `stacks` stacks of `locations` locations in
    /// all, in its own buffers if [`worth_keeping`].
    fn refill(self, stacks: usize, locations: usize) -> Self {
        let mut bounds = refill(self.bounds, stacks + 1);
        bounds.push(0);
        Self {
            locations: refill(self.locations, locations),
            bounds,
        }
    }

    /// Bytes its buffers hold.
    fn capacity_bytes(&self) -> usize {
        capacity_bytes(&self.locations) + capacity_bytes(&self.bounds)
    }

    /// Adds `stack` as the last stack.
    fn push(&mut self, stack: &[u32]) {
        self.locations.extend_from_slice(stack);
        self.bounds.push(self.locations.len());
    }
}

/// One finished interval: what a batch is built from. Plain data, sent to
/// the batch worker's thread.
#[derive(Debug, Clone)]
pub struct Interval {
    pub node: Arc<str>,
    pub start: SystemTime,
    pub end: SystemTime,
    pub mappings: Vec<IntervalMapping>,
    pub locations: Vec<IntervalLocation>,
    pub stacks: Stacks,
    pub label_sets: Vec<LabelValues>,
    /// In the order the pairs first appeared.
    pub samples: Vec<IntervalSample>,
    /// Which labels the batch carries.
    pub labels: LabelChoice,
}

/// The largest buffers of an interval whose batch is built, for a later
/// interval to fill again. They run to hundreds of KiB at 99 Hz (MiBs at
/// 997 Hz): over the allocator's mmap threshold, each interval's were
/// mapped afresh, faulted in and zeroed page by page, and unmapped again.
/// Reused, with the index tables, they took the agent's minor faults on
/// busy.c from 5,130 to 1,077 a minute at 997 Hz, from 163 to 11 at 99 Hz.
#[derive(Debug, Default)]
pub struct IntervalBuffers {
    locations: Vec<IntervalLocation>,
    stacks: Stacks,
    samples: Vec<IntervalSample>,
}

impl IntervalBuffers {
    /// Bytes they hold.
    pub fn capacity_bytes(&self) -> usize {
        capacity_bytes(&self.locations)
            + self.stacks.capacity_bytes()
            + capacity_bytes(&self.samples)
    }
}

/// Room kept for a next interval's items: at most this many times what it
/// needs. A burst's buffers are not held for ever, nor those of a busy
/// interval once the host is idle; a steady load's vary far less (and a
/// hash table's room is up to twice its items just after it grew).
const KEPT_ROOM: usize = 4;

/// Whether room for `capacity` items is kept for `len` (see [`KEPT_ROOM`]).
fn worth_keeping(capacity: usize, len: usize) -> bool {
    capacity <= len.saturating_mul(KEPT_ROOM)
}

/// `spare`, emptied, with room for `len` items (kept if
/// [`worth_keeping`]).
fn refill<T>(mut spare: Vec<T>, len: usize) -> Vec<T> {
    spare.clear();
    if !worth_keeping(spare.capacity(), len) {
        spare = Vec::new();
    }
    spare.reserve_exact(len);
    spare
}

/// `old`'s table, emptied, with room for `len` entries (kept if
/// [`worth_keeping`]).
fn refill_map<K: Eq + std::hash::Hash, V>(old: &mut HashMap<K, V>, len: usize) -> HashMap<K, V> {
    let mut map = match worth_keeping(old.capacity(), len) {
        true => std::mem::take(old),
        false => HashMap::new(),
    };
    map.clear();
    map.reserve(len);
    map
}

fn capacity_bytes<T>(vec: &Vec<T>) -> usize {
    vec.capacity() * std::mem::size_of::<T>()
}

impl Interval {
    /// Its buffers, for a later interval ([`Aggregator::finish_interval_into`]);
    /// the rest (its files among it) is dropped.
    pub fn into_buffers(self) -> IntervalBuffers {
        IntervalBuffers {
            locations: self.locations,
            stacks: self.stacks,
            samples: self.samples,
        }
    }

    /// CPU samples (ticks) counted in the interval.
    pub fn sample_count(&self) -> u64 {
        self.samples
            .iter()
            .filter(|sample| sample.profile_type == ProfileType::Cpu)
            .map(|sample| sample.count)
            .sum()
    }
}

/// Counters since the aggregator was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AggregateStats {
    /// Samples counted (including truncated ones).
    pub samples: u64,
    /// Of those, samples of kernel threads (no user part).
    pub kernel_only: u64,
    /// Samples without a single frame (the kernel stack could not be read
    /// for a kernel thread): not counted anywhere.
    pub empty: u64,
    /// Samples counted under the `[truncated]` stack, and samples dropped,
    /// because the interval was full.
    pub truncated: u64,
    pub dropped: u64,
    /// Intervals finished.
    pub intervals: u64,
    /// Distinct (labels, stack) pairs in the interval being aggregated, and
    /// the most any interval had.
    pub distinct: u64,
    pub max_distinct: u64,
    /// Mapped files handed over to be opened while their process runs,
    /// and those whose open had failed when their interval ended.
    pub files_opened: u64,
    pub files_failed: u64,
    /// Label sets shipped before their process was described (the
    /// description came too late): without their container, and without
    /// their exe unless the mapping feed saw the process exec.
    pub labels_undescribed: u64,
    /// Python frames merged into walks: named from their code object, or
    /// unnamed because the object at the address was another (stale: the
    /// one sampled was freed and its address reused) or none (unreadable).
    pub python_named: u64,
    pub python_stale: u64,
    pub python_unreadable: u64,
    /// Activations of Python frames left out: the native walk had no
    /// evaluation frame left for them (it stopped short).
    pub python_unplaced: u64,
    /// Activations read only in part (the sampler's frame limit, a failed
    /// read): their frames not read stand as one marked frame.
    pub python_cut: u64,
}

/// See the module documentation.
#[derive(Debug)]
pub struct Aggregator {
    config: AggregatorConfig,
    node: Arc<str>,
    current: Builder,
    /// The files the previous interval used: handed on to the current one
    /// when seen again, so a file in steady use is opened once, not once per
    /// interval. Files unused for a whole interval are let go.
    previous_files: HashMap<ObjectId, Arc<ObjectFile>>,
    /// What the processes' label records share (their containers); each
    /// record is in its process's record, handed in with the sample.
    labeller: Labeller,
    /// The record of a sample whose process has none any more.
    scratch: ProcessLabels,
    /// Names of JIT frames, from what the metadata worker has read of the
    /// processes' perf maps and jitdump files. A frame sampled before the
    /// read it asked for is named when its interval ends: named at sample
    /// time only, a third of node's samples went unnamed in a loaded run.
    jit_names: PerfMaps,
    /// Processes that exited in this interval: their JIT names are
    /// forgotten once its frames that missed them are named.
    jit_exits: Vec<u32>,
    /// HotSpot JVMs, which name their JIT frames themselves: by pid, with
    /// the process's start time.
    jvms: HashMap<u32, (u64, Arc<Jvm>)>,
    /// What the reads of JVMs no longer in `jvms` found.
    jvm_reads_gone: JvmStats,
    stats: AggregateStats,
    /// Location indexes of the sample being added.
    stack: Vec<u32>,
    /// The merged frames of the sample being added, when it has Python
    /// frames.
    merged: Vec<Merged>,
    /// Counts what a process's labels depend on changing (an exec, an
    /// exit, a new pod list, lost records): a thread's remembered label set
    /// stands only within one epoch.
    label_epoch: u64,
    /// Processes to describe (see [`Aggregator::take_wanted`]).
    wanted: Vec<Wanted>,
    /// Some of them were never described: processes met for the first
    /// time (see [`Aggregator::take_first_descriptions`]).
    first_descriptions: bool,
    /// Files to open while their process runs (see
    /// [`Aggregator::take_to_open`]).
    to_open: Vec<Arc<ObjectFile>>,
}

/// The labels of a sample as interned: the raw comm avoids decoding it per
/// sample.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LabelKey {
    comm: [u8; COMM_LEN],
    exe: Arc<str>,
    pid: Option<u32>,
    container: Option<SameContainer>,
    /// A process not described yet: its own set until it is (tgid and
    /// start time).
    pending: Option<(u32, u64)>,
}

/// A label set made before its process was described, filled in when the
/// description comes.
#[derive(Debug, Clone)]
struct PendingSet {
    index: u32,
    tgid: u32,
    started: u64,
    cgroup_id: u64,
    has_user: bool,
    /// What the process exec'd, as the mapping feed saw it when the sample
    /// came: its exe if the link cannot be read, even once its exit has
    /// made the cache forget it.
    learned_exe: Option<Arc<str>>,
}

/// Container labels compared by address, so that hashing a label key does
/// not read four strings per sample. The container index hands out one
/// `Arc` per container and content; a new pod list starts new ones, which
/// at most splits a container's label set in two for that interval (the
/// batch builder merges equal label sets).
#[derive(Debug, Clone)]
struct SameContainer(Arc<ContainerLabels>);

impl PartialEq for SameContainer {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SameContainer {}

impl std::hash::Hash for SameContainer {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Arc::as_ptr(&self.0).hash(state)
    }
}

/// The interval being aggregated.
#[derive(Debug)]
struct Builder {
    start: SystemTime,
    mappings: Vec<IntervalMapping>,
    mapping_index: HashMap<MappingKey, u32>,
    /// Mapping index by module file (pointer, with the `Arc` held so the
    /// pointer is not reused while remembered).
    module_memo: HashMap<usize, (Arc<ModuleFile>, u32)>,
    /// Files of this interval by identity: one open per file.
    files: HashMap<ObjectId, Arc<ObjectFile>>,
    eager_opens: usize,
    locations: Vec<IntervalLocation>,
    location_index: HashMap<IntervalLocation, u32>,
    /// Stacks in the order they first came in (their index), and found
    /// by their frames through `stack_index`, which keeps each one's hash
    /// beside its index: growing the table reads no stack again, and a
    /// lookup reads only stacks of the same hash.
    stacks: Stacks,
    stack_index: HashTable<(u64, u32)>,
    /// The last walk of recently sampled threads, in slots by thread id.
    /// Equal frames in the same space are placed in the same locations
    /// (see `Walk::space`), and a thread's next sample mostly shares its
    /// outer frames with its last one: those are reused from here without
    /// a lookup, and only the frames that changed are interned. A walk
    /// equal to the last one (kernel frames too) reuses its stack.
    last_walks: Vec<LastWalk>,
    /// The label set of recently sampled threads, in slots by thread id,
    /// with what it was made from.
    last_labels: [Option<(ThreadLabels, u32)>; LAST_WALK_SLOTS],
    /// Hashes stacks.
    hasher: foldhash::fast::RandomState,
    label_sets: Vec<LabelValues>,
    label_index: HashMap<LabelKey, u32>,
    /// Label sets whose process was not described yet.
    pending_sets: Vec<PendingSet>,
    /// In the order the pairs first appeared, as the batch lists them.
    samples: Vec<IntervalSample>,
    /// Index into `samples` by (stack, label set, divisor, type).
    sample_index: HashMap<(u32, u32, u32, ProfileType), usize>,
    truncated_stack: Option<u32>,
    /// Locations of [`MappingKey::JitNotYetNamed`], with the frames
    /// sampled in each (for the named and unnamed counts).
    jit_not_yet_named: HashMap<u32, u64>,
}

impl Builder {
    fn new(start: SystemTime) -> Self {
        Self {
            start,
            mappings: Vec::new(),
            mapping_index: HashMap::new(),
            module_memo: HashMap::new(),
            files: HashMap::new(),
            eager_opens: 0,
            locations: Vec::new(),
            location_index: HashMap::new(),
            stacks: Stacks::default(),
            stack_index: HashTable::new(),
            last_walks: std::iter::repeat_with(LastWalk::default)
                .take(LAST_WALK_SLOTS)
                .collect(),
            last_labels: [None; LAST_WALK_SLOTS],
            hasher: foldhash::fast::RandomState::default(),
            label_sets: Vec::new(),
            label_index: HashMap::new(),
            pending_sets: Vec::new(),
            samples: Vec::new(),
            sample_index: HashMap::new(),
            truncated_stack: None,
            jit_not_yet_named: HashMap::new(),
        }
    }

    /// A builder for the interval after this one, with room for as many
    /// locations, stacks and samples as this one holds: a steady load fills
    /// them again, into tables that need not grow (a growing table moves
    /// every entry, a tenth of the agent's aggregation time on busy.c).
    /// The room is this builder's index tables, emptied (this interval
    /// needs them no more), and `spare`'s buffers when given (see
    /// [`IntervalBuffers`]), each if [`worth_keeping`].
    fn next(&mut self, start: SystemTime, spare: Option<IntervalBuffers>) -> Self {
        let mut next = Self::new(start);
        let spare = spare.unwrap_or_default();
        let (locations, stacks, samples) =
            (self.locations.len(), self.stacks.len(), self.samples.len());
        next.locations = refill(spare.locations, locations);
        next.stacks = spare.stacks.refill(stacks, self.stacks.locations.len());
        next.samples = refill(spare.samples, samples);
        next.location_index = refill_map(&mut self.location_index, locations);
        next.sample_index = refill_map(&mut self.sample_index, samples);
        if worth_keeping(self.stack_index.capacity(), stacks) {
            next.stack_index = std::mem::take(&mut self.stack_index);
            next.stack_index.clear();
        }
        next.stack_index.reserve(stacks, |&(hash, _)| hash);
        next
    }

    /// The index of `key`, added when `insert`.
    fn mapping(&mut self, key: MappingKey, insert: bool) -> Option<u32> {
        probes::count(Probe::Content);
        if let Some(&index) = self.mapping_index.get(&key) {
            return Some(index);
        }
        if !insert {
            return None;
        }
        let index = index_of(self.mappings.len());
        self.mappings.push(IntervalMapping {
            key: key.clone(),
            file: None,
        });
        self.mapping_index.insert(key, index);
        Some(index)
    }

    fn location(&mut self, location: IntervalLocation, insert: bool) -> Option<u32> {
        probes::count(Probe::Content);
        if let Some(&index) = self.location_index.get(&location) {
            return Some(index);
        }
        if !insert {
            return None;
        }
        let index = index_of(self.locations.len());
        self.locations.push(location);
        self.location_index.insert(location, index);
        Some(index)
    }

    fn stack(&mut self, stack: &[u32], insert: bool) -> Option<u32> {
        let hash = self.hasher.hash_one::<&[u32]>(stack);
        probes::count(Probe::Content);
        let stacks = &self.stacks;
        let same = |&(entry_hash, index): &(u64, u32)| {
            entry_hash == hash && stacks.get(index as usize) == Some(stack)
        };
        if let Some(&(_, index)) = self.stack_index.find(hash, same) {
            return Some(index);
        }
        if !insert {
            return None;
        }
        let index = index_of(self.stacks.len());
        self.stacks.push(stack);
        self.stack_index
            .insert_unique(hash, (hash, index), |&(hash, _)| hash);
        Some(index)
    }

    /// Counts one sample of `weight` for the pair; a new pair only when
    /// `insert`.
    fn count(
        &mut self,
        stack: u32,
        label_set: u32,
        divisor: u32,
        weight: SampleWeight,
        insert: bool,
    ) -> bool {
        let profile_type = weight.profile_type();
        let key = (stack, label_set, divisor, profile_type);
        probes::count(Probe::Content);
        if let Some(&at) = self.sample_index.get(&key) {
            self.samples[at].count += weight.count();
            return true;
        }
        if !insert {
            return false;
        }
        self.sample_index.insert(key, self.samples.len());
        self.samples.push(IntervalSample {
            stack,
            label_set,
            divisor,
            count: weight.count(),
            profile_type,
        });
        true
    }

    /// What the last walks hold.
    fn last_walk_bytes(&self) -> usize {
        self.last_walks.iter().map(LastWalk::bytes).sum()
    }

    /// The `[truncated]` stack, made on first use whatever the bound: there
    /// is one per interval, and one pair per label set.
    fn truncated_stack(&mut self) -> u32 {
        if let Some(stack) = self.truncated_stack {
            return stack;
        }
        let mapping = self.mapping(MappingKey::Truncated, true).unwrap_or(0);
        let location = IntervalLocation {
            mapping,
            address: 0,
            return_address: false,
        };
        let location = self.location(location, true).unwrap_or(0);
        let stack = self.stack(&[location], true).unwrap_or(0);
        self.truncated_stack = Some(stack);
        stack
    }

    fn finish(self, node: Arc<str>, labels: LabelChoice, end: SystemTime) -> Interval {
        Interval {
            node,
            start: self.start,
            end,
            mappings: self.mappings,
            locations: self.locations,
            stacks: self.stacks,
            label_sets: self.label_sets,
            samples: self.samples,
            labels,
        }
    }
}

/// A thread's last walk in its interval: the space its user frames were
/// placed in (`None`: nothing remembered), its frames and the locations
/// they interned to, index for index, its kernel frames, and the stack
/// the whole sample interned to.
/// What a thread's label set was made from (see [`Aggregator::label_set`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ThreadLabels {
    tid: u32,
    tgid: u32,
    started: u64,
    cgroup_id: u64,
    comm: [u8; COMM_LEN],
    has_user: bool,
    epoch: u64,
}

#[derive(Debug, Default)]
struct LastWalk {
    tid: u32,
    space: Option<u64>,
    frames: Vec<u64>,
    locations: Vec<u32>,
    kernel_frames: Vec<u64>,
    stack: u32,
}

/// Replaces a vector's contents, allocating no more than they need: a
/// doubling growth would take a slot past its share of
/// [`MAX_LAST_WALK_BYTES`].
trait SetExactly<T> {
    fn set_exactly(&mut self, values: &[T]);
}

impl<T: Copy> SetExactly<T> for Vec<T> {
    fn set_exactly(&mut self, values: &[T]) {
        self.clear();
        self.reserve_exact(values.len());
        self.extend_from_slice(values);
    }
}

impl LastWalk {
    fn bytes(&self) -> usize {
        self.frames.capacity() * std::mem::size_of::<u64>()
            + self.locations.capacity() * std::mem::size_of::<u32>()
            + self.kernel_frames.capacity() * std::mem::size_of::<u64>()
    }

    /// Makes this the thread's last walk, unless it is too deep to keep.
    fn remember(
        &mut self,
        tid: u32,
        space: u64,
        frames: &[u64],
        locations: &[u32],
        kernel_frames: &[u64],
        stack: u32,
    ) {
        if frames.len() > MAX_REMEMBERED_FRAMES
            || kernel_frames.len() > agent_common::MAX_KERNEL_FRAMES
        {
            self.space = None;
            return;
        }
        self.tid = tid;
        self.space = Some(space);
        self.frames.set_exactly(frames);
        self.locations.set_exactly(locations);
        self.kernel_frames.set_exactly(kernel_frames);
        self.stack = stack;
    }

    /// How many outermost frames of `frames` are this walk's outermost
    /// frames, and so are in the same locations. A frame that is the
    /// innermost of one walk but not of the other is not: the innermost
    /// frame is a location of its own (not a return address).
    fn shared_outer_frames(&self, frames: &[u64]) -> usize {
        let shared = self
            .frames
            .iter()
            .rev()
            .zip(frames.iter().rev())
            .take_while(|(a, b)| a == b)
            .count();
        if shared == frames.len().min(self.frames.len()) && frames.len() != self.frames.len() {
            shared.saturating_sub(1)
        } else {
            shared
        }
    }
}

/// Dictionary sizes are bounded far below `u32::MAX` by `max_entries` and
/// the stack depth limits; saturating keeps this total anyway.
fn index_of(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

impl Aggregator {
    pub fn new(config: AggregatorConfig) -> Self {
        Self::starting_at(config, SystemTime::now())
    }

    /// An aggregator whose first interval starts at `start`.
    pub fn starting_at(config: AggregatorConfig, start: SystemTime) -> Self {
        Self {
            node: config.node_name.as_str().into(),
            labeller: Labeller::default(),
            scratch: ProcessLabels::default(),
            jit_names: PerfMaps::with_budget(config.perf_map_bytes, config.perf_map_bytes / 4),
            jvms: HashMap::new(),
            jvm_reads_gone: JvmStats::default(),
            jit_exits: Vec::new(),
            config,
            current: Builder::new(start),
            previous_files: HashMap::new(),
            stats: AggregateStats::default(),
            stack: Vec::with_capacity(2 * stackscope_unwind::DEFAULT_MAX_DEPTH),
            merged: Vec::new(),
            label_epoch: 0,
            wanted: Vec::new(),
            first_descriptions: false,
            to_open: Vec::new(),
        }
    }

    pub fn config(&self) -> &AggregatorConfig {
        &self.config
    }

    pub fn stats(&self) -> AggregateStats {
        AggregateStats {
            distinct: self.current.samples.len() as u64,
            ..self.stats
        }
    }

    /// The process replaced its image (`labels` is its record): it is
    /// described again, and if it is gone by then, its exe taken from `exe`
    /// (what the mapping feed saw it map).
    pub fn on_exec(&mut self, labels: &mut ProcessLabels, exe: Option<&Path>) {
        self.label_epoch += 1;
        labels.exec(exe);
    }

    /// Process `tgid` (started at `started`) runs `jvm`: its JIT frames
    /// are named by it.
    pub fn add_jvm(&mut self, tgid: u32, started: u64, jvm: Arc<Jvm>) {
        if let Some((_, old)) = self.jvms.insert(tgid, (started, jvm)) {
            self.jvm_reads_gone.add(&old.stats());
        }
    }

    /// Process `tgid` exec'd: what ran before was its JVM, not what runs
    /// now.
    pub fn forget_jvm(&mut self, tgid: u32) {
        if let Some((_, jvm)) = self.jvms.remove(&tgid) {
            self.jvm_reads_gone.add(&jvm.stats());
        }
    }

    /// Empties the largest JVMs' caches until all of them hold at most
    /// their share of the memory budget together.
    pub fn trim_jvms(&mut self) {
        let sizes = self
            .jvms
            .iter()
            .map(|(&tgid, (_, jvm))| (tgid, jvm.cached_bytes()))
            .collect();
        for tgid in crate::memory::caches_to_clear(sizes, self.config.jvm_code_bytes) {
            if let Some((_, jvm)) = self.jvms.get(&tgid) {
                jvm.clear_caches();
            }
        }
    }

    /// What the reads of the JVMs met so far found.
    pub fn jvm_stats(&self) -> JvmStats {
        let mut stats = self.jvm_reads_gone;
        for (_, jvm) in self.jvms.values() {
            stats.add(&jvm.stats());
        }
        stats
    }

    /// The process exited (its record went with it). Its JIT names stay
    /// to the end of the interval, for its frames that missed them.
    pub fn on_exit(&mut self, tgid: u32) {
        self.label_epoch += 1;
        if let Some((_, jvm)) = self.jvms.remove(&tgid) {
            self.jvm_reads_gone.add(&jvm.stats());
        }
        if self.jit_exits.len() < perf_map::MAX_PROCESSES {
            self.jit_exits.push(tgid);
        } else {
            self.jit_names.forget(tgid);
        }
    }

    /// Exec or exit records were lost: whatever is known per process may
    /// belong to a process that is gone, so all of it goes (the records
    /// with the process table's).
    pub fn forget_all_processes(&mut self) {
        self.label_epoch += 1;
        for (_, (_, jvm)) in self.jvms.drain() {
            self.jvm_reads_gone.add(&jvm.stats());
        }
        self.jit_names.forget_all();
        self.jit_exits.clear();
    }

    /// The processes to describe since the last call: met without a
    /// description (or due for another, while a container name is
    /// missing). Their answers go to [`Aggregator::describe`].
    pub fn take_wanted(&mut self) -> Vec<Wanted> {
        std::mem::take(&mut self.wanted)
    }

    /// Whether processes never described were wanted since the last call:
    /// processes met for the first time, not ones asked about again.
    pub fn take_first_descriptions(&mut self) -> bool {
        std::mem::take(&mut self.first_descriptions)
    }

    /// Takes the descriptions of processes wanted into their records, and
    /// fills in the label sets of this interval made before they came. The
    /// description of a process whose record is gone (it exited first)
    /// still fills in its sets.
    pub fn describe(&mut self, descriptions: Vec<Description>, records: &mut impl LabelRecords) {
        let choice = self.config.labels;
        for description in descriptions {
            let Wanted { tgid, started, .. } = description.process;
            let mut gone = ProcessLabels::default();
            let record = records.labels_of(tgid).unwrap_or(&mut gone);
            self.labeller
                .describe(record, description, choice.exe, choice.any_container());
            let mut pending = std::mem::take(&mut self.current.pending_sets);
            pending.retain(|set| {
                !(set.tgid == tgid && set.started == started && self.fill_in(set, record))
            });
            self.current.pending_sets = pending;
        }
    }

    /// Whether label sets of this interval wait for a description.
    pub fn has_pending_labels(&self) -> bool {
        !self.current.pending_sets.is_empty()
    }

    /// Whether JIT frames of this interval that missed a name wait for a
    /// perf map or jitdump read asked for and not answered yet: the first
    /// frames of a JIT process met in the drain that ends an interval
    /// would otherwise all ship as `[jit] <comm>` (a node run under load
    /// lost its first interval's names that way, the read answered 12 ms
    /// after the interval ended).
    pub fn awaits_jit_names(&self, now: Instant) -> bool {
        !self.current.jit_not_yet_named.is_empty() && self.jit_names.awaits_answers(now)
    }

    /// The mapped files this interval met for the first time, to open
    /// while their processes run (off the sampling thread: an open can
    /// wait on a slow filesystem). Opening one is the same for every
    /// holder of its `Arc`.
    pub fn take_to_open(&mut self) -> Vec<Arc<ObjectFile>> {
        std::mem::take(&mut self.to_open)
    }

    /// The reads of perf maps and jitdump files the JIT frames named since
    /// the last call asked for (and the files to close), for the metadata
    /// worker's [`PerfMapReader`].
    pub fn take_jit_requests(&mut self) -> Vec<JitRequest> {
        self.jit_names.take_requests()
    }

    /// What the perf maps and jitdump files added: JIT frames are named by
    /// it from now on, and so are those of this interval that missed it.
    pub fn add_jit_names(&mut self, updates: Vec<JitUpdate>) {
        self.jit_names.apply(updates);
    }

    /// Does what the agent's metadata worker does for the aggregator, on
    /// this thread: describes the processes wanted, opens the files met and
    /// reads the perf maps asked for. For tests and tools that aggregate
    /// without the agent's run.
    pub fn serve_metadata(
        &mut self,
        describer: &mut Describer,
        perf_maps: &mut PerfMapReader,
        records: &mut impl LabelRecords,
    ) {
        for object in self.take_to_open() {
            let _ = object.open_now();
        }
        let jit_names = perf_maps.serve(self.take_jit_requests(), std::time::Instant::now());
        self.add_jit_names(jit_names);
        let descriptions = self
            .take_wanted()
            .into_iter()
            .map(|wanted| describer.describe(wanted))
            .collect();
        self.describe(descriptions, records);
    }

    /// Writes the labels of a pending set, if its process is described now.
    fn fill_in(&mut self, set: &PendingSet, record: &mut ProcessLabels) -> bool {
        let choice = self.config.labels;
        let known = self.labeller.known(record, set.started, set.cgroup_id);
        let exe = match set.has_user && choice.exe {
            true => known.exe.map(|exe| match &set.learned_exe {
                Some(learned) if exe.is_empty() => Arc::clone(learned),
                _ => exe,
            }),
            false => Some(self.labeller.empty()),
        };
        let container = match choice.any_container() {
            true => known.container.map(|placed| placed.labels),
            false => Some(None),
        };
        let (Some(exe), Some(container)) = (exe, container) else {
            return false;
        };
        if let Some(values) = self.current.label_sets.get_mut(set.index as usize) {
            values.exe = exe;
            values.container = container;
        }
        true
    }

    /// Asks for a description of the sample's process, unless one is
    /// awaited already.
    fn want(&mut self, header: &SampleHeader, record: &mut ProcessLabels) {
        let wanted = Wanted {
            tgid: header.tgid,
            started: header.process_start_ns,
            cgroup_id: header.cgroup_id,
        };
        if record.want(&wanted, Instant::now()) {
            self.first_descriptions |= !record.described();
            self.wanted.push(wanted);
        }
    }

    /// Every process perf maps are kept for (the labels are in the
    /// process table's records).
    pub fn tracked_processes_into(&self, out: &mut Vec<u32>) {
        self.jit_names.tgids_into(out);
    }

    /// Where procfs is mounted.
    pub fn proc_root(&self) -> &Path {
        &self.config.proc_root
    }

    /// Sizes of the interval being built and of what is kept per process.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        let current = &self.current;
        out.push(StateSize::entries(
            "interval_samples",
            current.samples.len(),
            Some(self.config.max_entries),
        ));
        out.push(StateSize::entries(
            "interval_locations",
            current.locations.len(),
            Some(MAX_LOCATIONS),
        ));
        out.push(StateSize::entries(
            "interval_label_sets",
            current.label_sets.len(),
            Some(MAX_LABEL_SETS),
        ));
        // Stacks are added only while the samples are within their bound,
        // plus the one that stands for the samples past it.
        out.push(StateSize::entries(
            "interval_stacks",
            current.stacks.len(),
            Some(self.config.max_entries + 1),
        ));
        out.push(StateSize::bytes(
            "last_walks",
            current.last_walk_bytes(),
            Some(MAX_LAST_WALK_BYTES),
        ));
        out.push(StateSize::entries(
            "module_memo",
            current.module_memo.len(),
            Some(MAX_MODULE_MEMO),
        ));
        out.push(StateSize::entries(
            "open_files",
            current.files.len() + self.previous_files.len(),
            None,
        ));
        out.push(self.labeller.state_size());
        out.push(self.jit_names.state_size());
        out.push(StateSize::bytes(
            "jvm_code",
            self.jvms.values().map(|(_, jvm)| jvm.cached_bytes()).sum(),
            Some(self.config.jvm_code_bytes),
        ));
    }

    /// How JIT frames were named.
    pub fn jit_stats(&self) -> PerfMapStats {
        self.jit_names.stats()
    }

    /// The latest pod list from the kubelet: names the containers of pods.
    pub fn set_pods(&mut self, pods: Arc<PodList>) {
        self.label_epoch += 1;
        self.labeller.set_pods(pods);
    }

    /// Whether a sample came from a pod the pod list does not know yet
    /// (cleared by the call): time to fetch the list again.
    pub fn take_unknown_pod_seen(&mut self) -> bool {
        self.labeller.take_unknown_pod_seen()
    }

    /// Counts one sample: its kernel frames (innermost first) and, unless
    /// it is a kernel thread's, its walked user stack. `labels` is its
    /// process's labels record (`None`: the process has no record any more).
    pub fn add(
        &mut self,
        header: &SampleHeader,
        kernel_frames: &[u64],
        user: Option<&Walk<'_>>,
        labels: Option<&mut ProcessLabels>,
    ) {
        self.add_with_python(
            header,
            kernel_frames,
            user,
            labels,
            None,
            SampleWeight::Tick,
        );
    }

    /// [`Aggregator::add`] for a sample of `weight` that may come with
    /// Python frames: each native evaluation frame of its walk is replaced
    /// by the Python frames it ran (see `stackscope_python::merge`).
    pub fn add_with_python(
        &mut self,
        header: &SampleHeader,
        kernel_frames: &[u64],
        user: Option<&Walk<'_>>,
        labels: Option<&mut ProcessLabels>,
        python: Option<PythonSample<'_>>,
        weight: SampleWeight,
    ) {
        let user_frames = user.map_or(0, |walk| walk.objects.len());
        if kernel_frames.is_empty() && user_frames == 0 {
            self.stats.empty += 1;
            return;
        }
        let insert = self.current.samples.len() < self.config.max_entries
            && self.current.locations.len() + MAX_FRAMES_PER_SAMPLE <= MAX_LOCATIONS;

        let label_set = match labels {
            Some(record) => self.label_set(header, user.is_some(), insert, record),
            None => {
                let mut scratch = std::mem::take(&mut self.scratch);
                let label_set = self.label_set(header, user.is_some(), insert, &mut scratch);
                self.scratch = scratch;
                label_set
            }
        };
        let Some(labels) = label_set else {
            self.stats.dropped += 1;
            return;
        };
        self.stats.samples += 1;
        self.stats.kernel_only += u64::from(user.is_none());

        let divisor = header.sampling_divisor.max(1);
        let stack = match (python, user) {
            (Some(python), Some(walk)) if walk.frames.len() == walk.objects.len() => self
                .intern_python_stack(header, kernel_frames, walk, python, insert)
                .then(|| self.current.stack(&self.stack, insert))
                .flatten(),
            _ => self.intern_sample(header, kernel_frames, user, insert),
        };
        let counted =
            stack.is_some_and(|stack| self.current.count(stack, labels, divisor, weight, insert));
        if !counted {
            let stack = self.current.truncated_stack();
            self.current.count(stack, labels, divisor, weight, true);
            self.stats.truncated += 1;
        }
    }

    /// The index of the sample's label set in this interval; `None` when
    /// it is new and there is no room. A thread's next sample gets the set
    /// its last one got (no lookup of its exe or container) while what the
    /// set was made from stands: the same process, cgroup and name, no
    /// exec, exit or pod list since ([`Aggregator::label_epoch`]), and
    /// labels that were settled (an exe read, a container named).
    fn label_set(
        &mut self,
        header: &SampleHeader,
        has_user: bool,
        insert: bool,
        record: &mut ProcessLabels,
    ) -> Option<u32> {
        let slot = header.tid as usize % LAST_WALK_SLOTS;
        let made_from = ThreadLabels {
            tid: header.tid,
            tgid: header.tgid,
            started: header.process_start_ns,
            cgroup_id: header.cgroup_id,
            comm: header.comm,
            has_user,
            epoch: self.label_epoch,
        };
        if let Some((cached, index)) = self.current.last_labels[slot]
            && cached == made_from
        {
            return Some(index);
        }
        let choice = self.config.labels;
        let wants_exe = has_user && choice.exe;
        // The process's record, for both labels.
        let Known {
            exe: known_exe,
            container: placed,
        } = match wants_exe || choice.any_container() {
            true => self
                .labeller
                .known(record, header.process_start_ns, header.cgroup_id),
            false => Known {
                exe: None,
                container: None,
            },
        };
        // Not described yet: a set of its own, filled in when it is.
        let mut pending = false;
        let exe = match (wants_exe, known_exe) {
            (true, Some(exe)) => exe,
            (true, None) => {
                pending = true;
                self.labeller.empty()
            }
            (false, _) => self.labeller.empty(),
        };
        let mut settled = !(wants_exe && exe.is_empty());
        let mut describe_again = false;
        let container = match (choice.any_container(), placed) {
            (true, Some(placed)) => {
                settled &= placed.settled;
                describe_again = placed.describe_again;
                placed.labels.map(SameContainer)
            }
            (true, None) => {
                pending = true;
                None
            }
            (false, _) => None,
        };
        if pending || describe_again {
            self.want(header, record);
        }
        settled &= !pending;
        let key = LabelKey {
            comm: if choice.comm {
                header.comm
            } else {
                [0; COMM_LEN]
            },
            exe,
            pid: choice.pid.then_some(header.tgid),
            container,
            pending: pending.then_some((header.tgid, header.process_start_ns)),
        };
        probes::count(Probe::Derived);
        let index = match self.current.label_index.get(&key) {
            Some(&index) => index,
            None if insert && self.current.label_sets.len() < MAX_LABEL_SETS => {
                let index = index_of(self.current.label_sets.len());
                self.current.label_sets.push(LabelValues {
                    comm: agent_common::comm_str(&key.comm),
                    exe: Arc::clone(&key.exe),
                    pid: key.pid,
                    container: key.container.as_ref().map(|c| Arc::clone(&c.0)),
                });
                if pending {
                    self.current.pending_sets.push(PendingSet {
                        index,
                        tgid: header.tgid,
                        started: header.process_start_ns,
                        cgroup_id: header.cgroup_id,
                        has_user,
                        learned_exe: record.learned_exe(),
                    });
                }
                self.current.label_index.insert(key, index);
                index
            }
            None => return None,
        };
        self.current.last_labels[slot] = settled.then_some((made_from, index));
        Some(index)
    }

    /// The stack of a sample, through its thread's last walk when that
    /// was in the same space; `None` when a location or the stack is new
    /// and `insert` is off.
    fn intern_sample(
        &mut self,
        header: &SampleHeader,
        kernel_frames: &[u64],
        user: Option<&Walk<'_>>,
        insert: bool,
    ) -> Option<u32> {
        let remembered = user.and_then(|walk| {
            // Frames and objects go index for index; anything else is not
            // a walk to share frames with.
            (walk.frames.len() == walk.objects.len()).then_some((walk, walk.space?))
        });
        let Some((walk, space)) = remembered else {
            return self
                .intern_stack(header, kernel_frames, user, 0, insert)
                .then(|| self.current.stack(&self.stack, insert))
                .flatten();
        };
        let slot = header.tid as usize % LAST_WALK_SLOTS;
        let mut last = std::mem::take(&mut self.current.last_walks[slot]);
        let same_thread = last.tid == header.tid && last.space == Some(space);
        // One pass over the frames: all of them shared is the same walk.
        let shared = if same_thread {
            last.shared_outer_frames(walk.frames)
        } else {
            0
        };
        let stack = if same_thread
            && shared == walk.frames.len()
            && shared == last.frames.len()
            && last.kernel_frames == kernel_frames
        {
            Some(last.stack)
        } else {
            let stack = self
                .intern_stack(header, kernel_frames, user, shared, insert)
                .then(|| {
                    self.stack
                        .extend_from_slice(&last.locations[last.locations.len() - shared..]);
                    self.current.stack(&self.stack, insert)
                })
                .flatten();
            match stack {
                Some(stack) => {
                    let user_part = self.stack.len() - walk.frames.len();
                    last.remember(
                        header.tid,
                        space,
                        walk.frames,
                        &self.stack[user_part..],
                        kernel_frames,
                        stack,
                    );
                }
                // An incomplete stack may hold only some of the frames.
                None => last.space = None,
            }
            stack
        };
        self.current.last_walks[slot] = last;
        stack
    }

    /// Fills `self.stack` with the sample's location indexes, but for the
    /// `skip_outer` outermost user frames (the caller has them); false when
    /// a location is new and `insert` is off.
    fn intern_stack(
        &mut self,
        header: &SampleHeader,
        kernel_frames: &[u64],
        user: Option<&Walk<'_>>,
        skip_outer: usize,
        insert: bool,
    ) -> bool {
        self.stack.clear();
        if !kernel_frames.is_empty() {
            let Some(kernel) = self.current.mapping(MappingKey::Kernel, insert) else {
                return false;
            };
            for (i, &address) in kernel_frames.iter().enumerate() {
                let location = IntervalLocation {
                    mapping: kernel,
                    address,
                    return_address: i > 0,
                };
                match self.current.location(location, insert) {
                    Some(index) => self.stack.push(index),
                    None => return false,
                }
            }
        }
        let Some(walk) = user else {
            return true;
        };
        // Read once per sample, and only for samples with JIT frames: the
        // clock is not free on the per-sample path.
        let mut now = None;
        // Positions in `self.stack` of JIT frames not named yet, counted
        // once the whole sample is in (no allocation unless one missed).
        let mut not_yet_named = Vec::new();
        let own = walk.objects.len().saturating_sub(skip_outer);
        for (i, object) in walk.objects[..own].iter().enumerate() {
            if !self.push_user_frame(header, i, object, insert, &mut now, &mut not_yet_named) {
                return false;
            }
        }
        self.count_not_yet_named(not_yet_named);
        true
    }

    /// Counts the JIT frames at these positions of `self.stack` as not
    /// named yet (once the whole sample is in).
    fn count_not_yet_named(&mut self, positions: Vec<usize>) {
        for position in positions {
            *self
                .current
                .jit_not_yet_named
                .entry(self.stack[position])
                .or_default() += 1;
        }
    }

    /// Fills `self.stack` for a sample with Python frames: its kernel
    /// frames, then its walk with each evaluation frame replaced by the
    /// Python frames it ran; false when a location is new and `insert` is
    /// off.
    fn intern_python_stack(
        &mut self,
        header: &SampleHeader,
        kernel_frames: &[u64],
        walk: &Walk<'_>,
        python: PythonSample<'_>,
        insert: bool,
    ) -> bool {
        if !self.intern_stack(header, kernel_frames, None, 0, insert) {
            return false;
        }
        let mut merged = std::mem::take(&mut self.merged);
        merged.clear();
        let counts = merge::merge(
            walk.frames,
            python.eval,
            python.frames,
            python.cut,
            &mut merged,
        );
        self.stats.python_unplaced += counts.unplaced as u64;
        let mut now = None;
        let mut not_yet_named = Vec::new();
        let mut complete = true;
        for item in &merged {
            complete = match *item {
                Merged::Native(i) => self.push_user_frame(
                    header,
                    i,
                    &walk.objects[i],
                    insert,
                    &mut now,
                    &mut not_yet_named,
                ),
                Merged::Python(frame) => self.push_python_frame(frame, python.codes, insert),
                Merged::Cut => {
                    self.stats.python_cut += 1;
                    self.push_python_location(Arc::from(PYTHON_NOT_READ), Arc::from(""), 0, insert)
                }
            };
            if !complete {
                break;
            }
        }
        self.merged = merged;
        if complete {
            self.count_not_yet_named(not_yet_named);
        }
        complete
    }

    /// Pushes the location of a Python frame, named from its code object
    /// (read from the process on a miss); false when it is new and
    /// `insert` is off.
    fn push_python_frame(
        &mut self,
        frame: PythonFrame,
        codes: &mut CodeCache,
        insert: bool,
    ) -> bool {
        match codes.get(frame.code, frame.first_line & !PythonFrame::ENTRY) {
            Ok(code) => {
                self.stats.python_named += 1;
                let line = code.line_of(frame.instr_offset).unwrap_or(0);
                self.push_python_location(
                    Arc::clone(&code.qualname),
                    Arc::clone(&code.filename),
                    line,
                    insert,
                )
            }
            Err(unnamed) => {
                match unnamed {
                    Unnamed::Stale => self.stats.python_stale += 1,
                    Unnamed::Unreadable => self.stats.python_unreadable += 1,
                }
                self.push_python_location(Arc::from(UNNAMED_PYTHON), Arc::from(""), 0, insert)
            }
        }
    }

    /// Pushes the location of `function` at `line` of `file` (a Python
    /// mapping's address is the line); false when it is new and `insert`
    /// is off.
    fn push_python_location(
        &mut self,
        function: Arc<str>,
        file: Arc<str>,
        line: u32,
        insert: bool,
    ) -> bool {
        let key = MappingKey::Python { function, file };
        let Some(mapping) = self.current.mapping(key, insert) else {
            return false;
        };
        let location = IntervalLocation {
            mapping,
            address: u64::from(line),
            return_address: false,
        };
        match self.current.location(location, insert) {
            Some(index) => {
                self.stack.push(index);
                true
            }
            None => false,
        }
    }

    /// Pushes the location of user frame `i` of a walk (`object`) onto
    /// `self.stack`; false when it is new and `insert` is off. A JIT frame
    /// no name covers yet has its position put in `not_yet_named`; `now`
    /// is read for the first JIT frame.
    fn push_user_frame(
        &mut self,
        header: &SampleHeader,
        i: usize,
        object: &FrameObject,
        insert: bool,
        now: &mut Option<Instant>,
        not_yet_named: &mut Vec<usize>,
    ) -> bool {
        let (mapping, address) = match object {
            FrameObject::File { file, file_offset } => {
                (self.file_mapping(file, insert), *file_offset)
            }
            FrameObject::Vdso { offset } => {
                (self.current.mapping(MappingKey::Vdso, insert), *offset)
            }
            FrameObject::JavaInterpreted { address, method } => {
                let name = self
                    .jvm_of(header)
                    .and_then(|jvm| jvm.method_name(*method))
                    .unwrap_or_else(|| perf_map::unnamed(&header.comm));
                (
                    self.current.mapping(MappingKey::Jit { name }, insert),
                    *address,
                )
            }
            FrameObject::Jit { address } => {
                // Named now when it can be: the JIT may reuse the
                // code space later.
                let lookup = if i == 0 {
                    *address
                } else {
                    address.wrapping_sub(1)
                };
                if let Some(frames) = self
                    .jvm_of(header)
                    .and_then(|jvm| jvm.compiled_frames(*address, lookup, i == 0))
                {
                    // A compiled frame shows the methods it inlined too.
                    return frames.iter().all(|name| {
                        let name = Arc::clone(name);
                        let mapping = self.current.mapping(MappingKey::Jit { name }, insert);
                        self.push_location(mapping, *address, i, insert)
                    });
                }
                if let Some(name) = self.jvm_of(header).and_then(|jvm| jvm.blob_name(lookup)) {
                    let mapping = self.current.mapping(MappingKey::Jit { name }, insert);
                    return self.push_location(mapping, *address, i, insert);
                }
                let name = self.jit_names.name(
                    header.tgid,
                    header.process_start_ns,
                    lookup,
                    *now.get_or_insert_with(std::time::Instant::now),
                );
                let key = match name {
                    Some(name) => MappingKey::Jit { name },
                    None => {
                        not_yet_named.push(self.stack.len());
                        MappingKey::JitNotYetNamed {
                            tgid: header.tgid,
                            started: header.process_start_ns,
                            comm: header.comm,
                        }
                    }
                };
                (self.current.mapping(key, insert), *address)
            }
            FrameObject::Unreadable { path, file_offset } => (
                self.current.mapping(
                    MappingKey::Unreadable {
                        path: Arc::clone(path),
                    },
                    insert,
                ),
                *file_offset,
            ),
            FrameObject::Anonymous { address } => (
                self.current.mapping(MappingKey::Anonymous, insert),
                *address,
            ),
        };
        self.push_location(mapping, address, i, insert)
    }

    /// Pushes the location at `address` of `mapping` (`None`: new, and
    /// `insert` off) for user frame `i`; false when it is new and `insert`
    /// is off.
    fn push_location(
        &mut self,
        mapping: Option<u32>,
        address: u64,
        i: usize,
        insert: bool,
    ) -> bool {
        let Some(mapping) = mapping else {
            return false;
        };
        let location = IntervalLocation {
            mapping,
            address,
            return_address: i > 0,
        };
        match self.current.location(location, insert) {
            Some(index) => self.stack.push(index),
            None => return false,
        }
        true
    }

    /// The JVM of the sample's process, if it runs one.
    fn jvm_of(&self, header: &SampleHeader) -> Option<&Arc<Jvm>> {
        match self.jvms.get(&header.tgid) {
            Some((started, jvm)) if *started == header.process_start_ns || *started == 0 => {
                Some(jvm)
            }
            _ => None,
        }
    }

    /// Names the interval's JIT frames that missed at sample time, from
    /// what has been read since; `[jit] <comm>` when still nothing covers
    /// them.
    fn name_jit_frames_late(&mut self) {
        for (location, frames) in std::mem::take(&mut self.current.jit_not_yet_named) {
            let Some(&sampled) = self.current.locations.get(location as usize) else {
                continue;
            };
            let Some(MappingKey::JitNotYetNamed {
                tgid,
                started,
                comm,
            }) = self
                .current
                .mappings
                .get(sampled.mapping as usize)
                .map(|mapping| mapping.key.clone())
            else {
                continue;
            };
            let name = self
                .jit_names
                .name_later(tgid, started, sampled.lookup(), frames)
                .unwrap_or_else(|| perf_map::unnamed(&comm));
            // The mapping added for the name is never looked up again in
            // this interval, so the bound on new entries does not apply.
            if let Some(mapping) = self.current.mapping(MappingKey::Jit { name }, true) {
                self.current.locations[location as usize].mapping = mapping;
            }
        }
    }

    /// The mapping of a module file; a new one has its file opened (see
    /// [`MAX_EAGER_OPENS`]).
    fn file_mapping(&mut self, file: &Arc<ModuleFile>, insert: bool) -> Option<u32> {
        let pointer = Arc::as_ptr(file) as usize;
        probes::count(Probe::Content);
        if let Some((_, index)) = self.current.module_memo.get(&pointer) {
            return Some(*index);
        }
        let key = MappingKey::User {
            id: *file.id,
            path: file.path().shipped_name(),
        };
        probes::count(Probe::Content);
        let index = match self.current.mapping_index.get(&key) {
            Some(&index) => index,
            None if insert => {
                let index = self.current.mapping(key, true)?;
                let object = self.object_file(file);
                if let Some(mapping) = self.current.mappings.get_mut(index as usize) {
                    mapping.file = Some(object);
                }
                index
            }
            None => return None,
        };
        if self.current.module_memo.len() < MAX_MODULE_MEMO {
            self.current
                .module_memo
                .insert(pointer, (Arc::clone(file), index));
        }
        Some(index)
    }

    /// The interval's handle on the file of `module`, to be opened soon
    /// (while its process runs) for the first [`MAX_EAGER_OPENS`] files.
    fn object_file(&mut self, module: &ModuleFile) -> Arc<ObjectFile> {
        if let Some(object) = self.current.files.get(&*module.id) {
            return Arc::clone(object);
        }
        if let Some(object) = self.previous_files.remove(&*module.id) {
            self.current.files.insert(*module.id, Arc::clone(&object));
            return object;
        }
        let object = Arc::new(ObjectFile::new(module));
        if self.current.eager_opens < MAX_EAGER_OPENS {
            self.current.eager_opens += 1;
            self.stats.files_opened += 1;
            self.to_open.push(Arc::clone(&object));
        }
        self.current.files.insert(*module.id, Arc::clone(&object));
        object
    }

    /// Ends the interval being aggregated at `end`, starts the next one
    /// there, and returns the finished one.
    pub fn finish_interval(&mut self, end: SystemTime) -> Interval {
        self.finish_interval_into(end, None)
    }

    /// [`Aggregator::finish_interval`], the next interval filling `spare`,
    /// the buffers of an interval whose batch is built.
    pub fn finish_interval_into(
        &mut self,
        end: SystemTime,
        spare: Option<IntervalBuffers>,
    ) -> Interval {
        self.name_jit_frames_late();
        for tgid in std::mem::take(&mut self.jit_exits) {
            self.jit_names.forget(tgid);
        }
        self.stats.labels_undescribed += self.current.pending_sets.len() as u64;
        // Undescribed, but not unknown: the program the mapping feed saw
        // the process exec is its exe.
        for set in std::mem::take(&mut self.current.pending_sets) {
            if let (true, Some(learned)) = (set.has_user && self.config.labels.exe, set.learned_exe)
                && let Some(values) = self.current.label_sets.get_mut(set.index as usize)
            {
                values.exe = learned;
            }
        }
        self.stats.files_failed += self
            .current
            .files
            .values()
            .filter(|file| file.open_failed())
            .count() as u64;
        let next = self.current.next(end, spare);
        let mut finished = std::mem::replace(&mut self.current, next);
        // Only files held open: one that failed (its process gone) is
        // looked up afresh, through whichever process maps it next.
        self.previous_files = std::mem::take(&mut finished.files)
            .into_iter()
            .filter(|(_, file)| file.is_open())
            .collect();
        self.stats.intervals += 1;
        self.stats.max_distinct = self.stats.max_distinct.max(finished.samples.len() as u64);
        let interval = finished.finish(Arc::clone(&self.node), self.config.labels, end);
        self.labeller.forget_empty_containers();
        interval
    }
}

#[cfg(test)]
mod tests;
