//! The process table: for every process seen in samples, one record with
//! its executable mappings, the object each one is, and what the table's
//! owner keeps of the process (`ProcessTable<S>`: the walker's modules and
//! copy plan), which lives and goes with the record ([`ProcessTable::state`],
//! [`ProcessTable::take_dropped`]).
//!
//! Owns: reading a process's maps on first sight and again when a sample
//! falls outside every known mapping (at most once per
//! [`REREAD_INTERVAL`] per process), at once or, with
//! [`TableConfig::defer_reads`], through its owner on another thread
//! ([`read`]); taking forks, execs and executable
//! mmaps as they happen ([`ProcessTable::forked`],
//! [`ProcessTable::exec_learned`], [`ProcessTable::mapped`]) and answering
//! from them once the process is gone, its files reached under its
//! parent's or another root and checked by build-id; dropping a process on
//! exit or `exec`; bounding memory ([`MAX_PROCESSES`],
//! [`MAX_CACHED_OBJECTS`], mappings per process); caching identities per
//! file version and by build-id, so a library mapped by a hundred
//! processes is read once; and turning an address into a file offset and
//! an ELF virtual address.
//!
//! Does not own: unwind tables (compiled elsewhere, keyed by the
//! [`ObjectId`] handed out here), symbolization, or learning about process
//! events (the caller forwards the sampler's exits and execs to
//! [`ProcessTable::remove`] and [`ProcessTable::exec`], and the kernel's
//! mmap events to the methods above, in time order with the samples). The
//! table does not poll `/proc`: until told, it keeps answering from what it
//! read or was told, so a pid reused without an exit or fork event in
//! between would be answered from the old process's mappings for addresses
//! they cover.

mod read;
mod slots;

use std::{
    collections::HashMap,
    fs::Metadata,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use thiserror::Error;

use crate::{
    elf::LoadSegment,
    maps::{Mapping, MappingPath, MapsError},
    object_id::{BuildId, IdentityError, ObjectId},
    open::{self, OpenError, OpenedFile},
};
use read::{CachedObject, Found, MapsReadError};
pub use read::{ReadAnswer, ReadRequest, TableReader};
pub use slots::Slot;
use slots::Slots;

/// Processes tracked at once; the least recently looked-up one is dropped
/// to make room (it is read again if it shows up later). A process costs
/// roughly 150 bytes per executable mapping, typically 20-100 of them, so
/// the cap keeps the table within a few tens of MB.
pub const MAX_PROCESSES: usize = 4096;

/// Shortest time between two reads of one process's maps triggered by
/// addresses outside its known mappings: a process that keeps producing an
/// unknown address (a garbage frame, code that is mapped and unmapped in a
/// loop) costs at most 10 reads per second.
pub const REREAD_INTERVAL: Duration = Duration::from_millis(100);

/// Executable mappings one process keeps from events at most.
const MAX_REGIONS_PER_PROCESS: usize = 8192;

/// Longest time between an exec event and the sampler's record of the
/// same exec (the kernel maps the new image in between: microseconds, or
/// milliseconds under load); a record later than this is another exec.
const SAME_EXEC_NS: u64 = 1_000_000_000;

/// How long a deferred read is awaited before a lookup asks for it again
/// (the owner could not hand it on: its worker's queue was full).
const ASK_AGAIN: Duration = Duration::from_secs(1);

/// Identities kept once no tracked process maps the file any more is
/// limited to this many entries; beyond it, unused ones are dropped.
pub const MAX_CACHED_OBJECTS: usize = 16384;

/// Tunables; [`Default`] gives the documented constants and the real `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableConfig {
    /// Where procfs is mounted (`/proc`, or the host's procfs seen from a
    /// container).
    pub proc_root: PathBuf,
    /// [`MAX_PROCESSES`] by default; 0 behaves as 1.
    pub max_processes: usize,
    /// [`REREAD_INTERVAL`] by default.
    pub reread_interval: Duration,
    /// [`MAX_CACHED_OBJECTS`] by default.
    pub max_cached_objects: usize,
    /// Reads of maps are asked of the owner instead of done by lookups
    /// (see [`ProcessTable::lookup`]); off by default.
    pub defer_reads: bool,
}

impl Default for TableConfig {
    fn default() -> Self {
        Self {
            proc_root: PathBuf::from("/proc"),
            max_processes: MAX_PROCESSES,
            reread_interval: REREAD_INTERVAL,
            max_cached_objects: MAX_CACHED_OBJECTS,
            defer_reads: false,
        }
    }
}

/// Counters since the table was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    pub lookups: u64,
    /// Reads of a `/proc/<pid>/maps` (first sight and re-reads), including
    /// ones that found the process gone.
    pub maps_reads: u64,
    /// Misses that did not re-read because the last read was too recent.
    pub rereads_rate_limited: u64,
    /// Files opened and identified (object cache misses).
    pub objects_identified: u64,
    /// Of those, files claiming a build-id that were not digested (too
    /// large, or the digest budget was spent): not shared with copies.
    pub build_ids_unverified: u64,
    /// Mappings whose file was found in the object cache.
    pub object_cache_hits: u64,
    /// Processes dropped to stay within `max_processes`.
    pub evictions: u64,
    /// Executable mappings learned from mmap events, and of those, files
    /// that could not be reached or identified (their frames stay unnamed).
    pub mappings_learned: u64,
    pub learned_unidentified: u64,
    /// Lookups answered from learned mappings because the process's maps
    /// could no longer be read (it had exited).
    pub answered_after_exit: u64,
    /// Reads asked of the owner (with deferred reads).
    pub reads_deferred: u64,
}

/// Why a lookup failed.
#[derive(Debug, Error)]
pub enum ProcessError {
    /// The process exited (or is a zombie). Its entry has been dropped.
    #[error("process {tgid} is gone")]
    ProcessGone { tgid: u32 },
    /// A read of the process (its maps, or a file it mapped) was asked of
    /// the owner and is not answered yet (deferred reads only).
    #[error("a read of process {tgid} is awaited")]
    ReadPending { tgid: u32 },
    /// Its maps could not be read or parsed. Retried at most once per
    /// `reread_interval`; lookups in between answer `Ok(None)`.
    #[error("reading the mappings of process {tgid}")]
    Maps {
        tgid: u32,
        #[source]
        source: MapsError,
    },
    /// The address is in a file mapping whose file could not be reached or
    /// read when the process's maps were read. The error is kept (shared)
    /// until the next read of the maps.
    #[error("cannot identify the file mapped at {start:#x}-{end:#x} in process {tgid}")]
    Unidentified {
        tgid: u32,
        start: u64,
        end: u64,
        /// The mapping: its path names the frames in it.
        region: Arc<MappedRegion>,
        #[source]
        source: Arc<MappingError>,
    },
}

/// Why one mapping's file could not be identified.
#[derive(Debug, Error)]
pub enum MappingError {
    #[error("reaching the mapped file")]
    Open(#[source] OpenError),
    #[error("identifying the mapped file")]
    Identify(#[source] IdentityError),
    /// The file reached has another build-id than the kernel reported for
    /// the mapping: not the file mapped.
    #[error("the file reached is not the one mapped (another build-id)")]
    OtherFile,
}

/// The file a module maps: its identity and the mapping it was resolved
/// from. The walker shares one between its module and every frame delivered
/// in it, and the symbolizer opens the file through it, so it lives here,
/// with the types it is made of, rather than in either.
#[derive(Debug, PartialEq, Eq)]
pub struct ModuleFile {
    /// The file's identity: build-id, or a key for this version of the file.
    pub id: Arc<ObjectId>,
    /// The mapping the module was resolved from: the path as the process
    /// sees it, and the way to open the very file mapped
    /// ([`MappedRegion::open`], through `/proc/<pid>/map_files`).
    pub region: Arc<MappedRegion>,
}

impl ModuleFile {
    /// The path as the process's maps show it.
    pub fn path(&self) -> &MappingPath {
        &self.region.mapping.path
    }
}

/// One executable mapping of one process, shared between the table and the
/// lookups that returned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedRegion {
    pub tgid: u32,
    pub mapping: Mapping,
    proc_root: Arc<Path>,
    /// For a mapping learned from an event: how to reach its file once the
    /// process is gone.
    learned: Option<Arc<Learned>>,
}

/// What an mmap event said of a mapping beyond its maps line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Learned {
    /// The build-id the kernel read from the mapped file, if it did.
    build_id: Option<BuildId>,
    /// Processes whose root may hold the file, tried in order: the process
    /// itself, its parent, the host's init.
    roots: Vec<u32>,
}

impl MappedRegion {
    /// `/proc/<tgid>/map_files/<start>-<end>`: opens the exact file mapped,
    /// even if deleted or inside a container (needs root).
    pub fn map_files_path(&self) -> PathBuf {
        open::map_files_path(
            &self.proc_root,
            self.tgid,
            self.mapping.start,
            self.mapping.end,
        )
    }

    /// The cached identity of a learned mapping's file (`cached` looks a
    /// file version up), reached as [`Self::open`] reaches it but with
    /// `stat` alone: a file identified before is not opened and read again.
    /// Of the roots, the first file not ruled out decides, as when opening
    /// (without a build-id, a file of another device or inode is; with
    /// one, a cached file with another build-id is): cached, it is the
    /// identity; not cached, it is left to be opened and read (`None`).
    fn recognize(
        &self,
        cached: impl Fn(&Metadata) -> Option<Arc<CachedObject>>,
    ) -> Option<Arc<CachedObject>> {
        let learned = self.learned.as_deref()?;
        let build_id = learned.build_id;
        let same_build =
            |object: &CachedObject| build_id.is_none_or(|id| object.id.build_id() == Some(id));
        if let Ok((metadata, _)) = open::stat_mapped(&self.proc_root, self.tgid, &self.mapping) {
            return cached(&metadata).filter(|object| same_build(object));
        }
        for metadata in open::stat_learned(&self.proc_root, &learned.roots, &self.mapping) {
            if build_id.is_none() && !open::is_mapped_file(&metadata, &self.mapping) {
                continue;
            }
            match cached(&metadata) {
                Some(object) if same_build(&object) => return Some(object),
                // Known, with another build-id: not the file mapped.
                Some(_) => continue,
                None => return None,
            }
        }
        None
    }

    /// Opens the mapped file (see [`open::open_mapped`]), e.g. for the table
    /// compiler. Once the process has exited, a mapping learned from an
    /// event is still reached by its path under the roots of its learned
    /// list (its own, its parent's, the agent's, init's) in turn, when the
    /// file there is the one mapped ([`open::open_learned`]).
    pub fn open(&self) -> Result<OpenedFile, OpenError> {
        let opened = open::open_mapped(&self.proc_root, self.tgid, &self.mapping);
        match (&self.learned, opened) {
            (Some(learned), Err(_)) => open::open_learned(
                &self.proc_root,
                &learned.roots,
                &self.mapping,
                learned.build_id,
            ),
            (_, opened) => opened,
        }
    }
}

/// Where an address is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// In a mapping of an identified file.
    Object(MappedObject),
    /// In executable memory with no file to read: `[vdso]` (the agent
    /// unwinds it with its own copy of the image; `addr - mapping.start` is
    /// the offset into it), `[vsyscall]`, or anonymous memory (JIT code).
    /// `region.mapping.path` says which.
    Unbacked(Arc<MappedRegion>),
}

/// An address in a mapping of an identified file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedObject {
    /// The file's identity, shared by every mapping of the same version.
    pub id: Arc<ObjectId>,
    /// The mapping the address is in.
    pub region: Arc<MappedRegion>,
    /// `addr - start + offset`: where the byte at the address is in the file.
    pub file_offset: u64,
    /// The address in the ELF's own virtual address space (what symbol
    /// tables and `.eh_frame` speak): `addr - start + offset - p_offset +
    /// p_vaddr` for the `PT_LOAD` segment the mapping comes from. `None` for
    /// files that are not ELF or when no segment covers the mapping's offset.
    pub elf_vaddr: Option<u64>,
}

impl MappedObject {
    /// The name the process's maps show for the file.
    pub fn path(&self) -> &MappingPath {
        &self.region.mapping.path
    }

    /// Opens the file, for the table compiler or symbolizer.
    pub fn open(&self) -> Result<OpenedFile, OpenError> {
        self.region.open()
    }
}

#[derive(Debug, Clone)]
enum Backing {
    /// `vaddr = addr - bias` (wrapping) when `bias` is known.
    Object {
        object: Arc<CachedObject>,
        bias: Option<u64>,
    },
    Failed(Arc<MappingError>),
    Unbacked,
    /// A file mapped while the agent ran, not identified yet: most
    /// processes that exec are never sampled, so their files are looked at
    /// only when a lookup lands in them.
    Learned {
        build_id: Option<BuildId>,
    },
}

#[derive(Debug, Clone)]
struct Region {
    region: Arc<MappedRegion>,
    backing: Backing,
}

impl Region {
    fn location(&self, addr: u64) -> Result<Location, ProcessError> {
        let mapping = &self.region.mapping;
        match &self.backing {
            Backing::Object { object, bias } => Ok(Location::Object(MappedObject {
                id: Arc::clone(&object.id),
                region: Arc::clone(&self.region),
                file_offset: addr
                    .wrapping_sub(mapping.start)
                    .wrapping_add(mapping.offset),
                elf_vaddr: bias.map(|bias| addr.wrapping_sub(bias)),
            })),
            Backing::Failed(err) => Err(ProcessError::Unidentified {
                tgid: self.region.tgid,
                start: mapping.start,
                end: mapping.end,
                region: Arc::clone(&self.region),
                source: Arc::clone(err),
            }),
            Backing::Unbacked => Ok(Location::Unbacked(Arc::clone(&self.region))),
            // Identified before any lookup answers (see `ProcessTable::lookup`).
            Backing::Learned { .. } => Ok(Location::Unbacked(Arc::clone(&self.region))),
        }
    }
}

#[derive(Debug)]
struct Process<S> {
    /// Executable mappings, sorted by start; the kernel never overlaps them.
    regions: Vec<Region>,
    /// Its mappings were read or learned: false for a record made for its
    /// owner's state alone ([`ProcessTable::state`]), whose maps are read
    /// on its first lookup.
    known: bool,
    read_at: Instant,
    /// When it was last used (the table's use count): the least recently
    /// used record goes first.
    last_used: u64,
    /// Its mappings were learned from events (it forked or exec'd while
    /// the agent ran): once `/proc` can no longer be read, they are kept
    /// and answer lookups, so a process that lived 5 ms is still unwound.
    learned: bool,
    /// The process it forked from, when an event said so.
    parent: Option<u32>,
    /// When an exec event reset the mappings: the sampler's own record of
    /// that exec (later: it fires once the new image is mapped) must not
    /// reset them again.
    exec_learned_at: Option<u64>,
    /// The program an exec event's first file mapping was (the kernel maps
    /// the executable before its interpreter).
    exe: Option<PathBuf>,
    /// What the table's owner keeps of the process (the walker's modules,
    /// copy plan and identity): it lives and goes with the record.
    state: S,
}

impl<S: Default> Process<S> {
    fn new(known: bool, last_used: u64) -> Self {
        Self {
            regions: Vec::new(),
            known,
            read_at: Instant::now(),
            last_used,
            learned: false,
            parent: None,
            exec_learned_at: None,
            exe: None,
            state: S::default(),
        }
    }
}

impl<S> Process<S> {
    fn find(&self, addr: u64) -> Option<&Region> {
        self.regions.get(self.position(addr)?)
    }

    fn position(&self, addr: u64) -> Option<usize> {
        let after = self
            .regions
            .partition_point(|region| region.region.mapping.start <= addr);
        let at = after.checked_sub(1)?;
        self.regions[at].region.mapping.contains(addr).then_some(at)
    }
}

/// See the module documentation. `S` is what the owner keeps per process
/// in the same record (see [`Self::state`]).
#[derive(Debug)]
pub struct ProcessTable<S = ()> {
    config: TableConfig,
    processes: Slots<Process<S>>,
    /// Counts uses of records, for `Process::last_used`.
    uses: u64,
    /// Reads maps and identifies files, with the identity cache.
    reader: TableReader,
    /// With deferred reads: the processes a read was asked for and is not
    /// answered yet, and when it was asked.
    asked: HashMap<u32, Instant>,
    /// With deferred reads: the reads to hand to the owner
    /// ([`Self::take_read_requests`]).
    requests: Vec<ReadRequest>,
    /// Parents of processes forked from untracked ones, until they exec
    /// (bounded by `max_processes`).
    fork_parents: HashMap<u32, u32>,
    /// The owner's state of every record removed since the owner last took
    /// them ([`Self::take_dropped`]), whatever removed it.
    dropped: Vec<(u32, S)>,
    /// Records the first owner let go of, for a second one
    /// ([`Self::release`], [`Self::take_released`]).
    released: Vec<(u32, S)>,
    stats: TableStats,
}

impl Default for ProcessTable {
    fn default() -> Self {
        Self::new(TableConfig::default())
    }
}

impl ProcessTable {
    /// A table that keeps nothing for an owner beside the mappings.
    pub fn new(config: TableConfig) -> Self {
        Self::with_owner_state(config)
    }
}

impl<S: Default> ProcessTable<S> {
    /// A table whose records also hold an `S` for their owner.
    pub fn with_owner_state(config: TableConfig) -> Self {
        // SAFETY: sysconf has no preconditions.
        let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let reader = TableReader::new(
            Arc::from(config.proc_root.as_path()),
            // sysconf fails only for unknown names; 4 KiB is x86_64's size.
            u64::try_from(page_size).unwrap_or(4096).max(1),
            config.max_cached_objects,
        );
        Self {
            config,
            processes: Slots::default(),
            uses: 0,
            reader,
            asked: HashMap::new(),
            requests: Vec::new(),
            fork_parents: HashMap::new(),
            dropped: Vec::new(),
            released: Vec::new(),
            stats: TableStats::default(),
        }
    }

    /// The owner's state of process `tgid`, with the record's slot; the
    /// record is made (maps unknown, read on its first lookup) if there is
    /// none, and marked as just used. One lookup.
    pub fn state(&mut self, tgid: u32) -> (Slot, &mut S) {
        let (slot, process) = self.record(tgid, false);
        (slot, &mut process.state)
    }

    /// The record of `tgid`, made (room made first) with its maps `known`
    /// or not if there is none, and marked as just used.
    fn record(&mut self, tgid: u32, known: bool) -> (Slot, &mut Process<S>) {
        self.make_room_for(tgid);
        self.uses += 1;
        let uses = self.uses;
        let (slot, process) = self.processes.entry(tgid, || Process::new(known, uses));
        process.last_used = uses;
        (slot, process)
    }

    /// The owner's state in `slot`, if the record is still there.
    pub fn state_at(&mut self, slot: Slot) -> Option<&mut S> {
        self.processes.at(slot).map(|process| &mut process.state)
    }

    /// The owner's state of `tgid`, if it has a record.
    pub fn state_of(&self, tgid: u32) -> Option<&S> {
        self.processes.get(tgid).map(|process| &process.state)
    }

    pub fn state_of_mut(&mut self, tgid: u32) -> Option<&mut S> {
        self.processes
            .get_mut(tgid)
            .map(|process| &mut process.state)
    }

    /// Every record's owner state.
    pub fn states(&self) -> impl Iterator<Item = (u32, &S)> {
        self.processes
            .iter()
            .map(|(tgid, process)| (tgid, &process.state))
    }

    pub fn states_mut(&mut self) -> impl Iterator<Item = &mut S> {
        self.processes
            .values_mut()
            .map(|process| &mut process.state)
    }

    /// The owner's state of each record removed since the last call: at an
    /// exit or exec, a fork over its pid, a read that found it gone, or to
    /// stay within `max_processes`. The one way a record goes.
    pub fn take_dropped(&mut self) -> Vec<(u32, S)> {
        std::mem::take(&mut self.dropped)
    }

    /// Hands a record taken from [`Self::take_dropped`] on to a second
    /// owner ([`Self::take_released`]), once the first has let go of its
    /// part: the walker takes every dropped record at once (its plans must
    /// go before the next sample is planned), the run loop then reads what
    /// the record counted.
    pub fn release(&mut self, tgid: u32, state: S) {
        bounded_push(&mut self.released, self.config.max_processes, (tgid, state));
    }

    /// The records handed on by [`Self::release`] since the last call.
    pub fn take_released(&mut self) -> Vec<(u32, S)> {
        std::mem::take(&mut self.released)
    }

    /// Where `addr` is in process `tgid`.
    ///
    /// Reads the process's maps on first sight. An address outside every
    /// known executable mapping, or in one whose file could not be
    /// identified, re-reads them (the process may have loaded a library
    /// since), unless they were read less than `reread_interval` ago.
    /// `Ok(None)` means "not in executable memory as far as we know".
    ///
    /// With [`TableConfig::defer_reads`], a lookup that needs the maps of
    /// a process seen for the first time asks for them
    /// ([`Self::take_read_requests`]) and answers
    /// [`ProcessError::ReadPending`] until the answer is applied
    /// ([`Self::apply`]); a re-read of a known process's maps is asked for
    /// without holding anything up. A file mapped while the agent ran is
    /// identified on the first lookup that reaches it: its samples are
    /// held for that read too.
    pub fn lookup(&mut self, tgid: u32, addr: u64) -> Result<Option<Location>, ProcessError> {
        self.lookup_at(tgid, addr, Instant::now())
    }

    /// [`lookup`](Self::lookup) at time `now`, against which the last read
    /// of the maps is aged (tests pass a later `now` instead of sleeping).
    pub fn lookup_at(
        &mut self,
        tgid: u32,
        addr: u64,
        now: Instant,
    ) -> Result<Option<Location>, ProcessError> {
        self.stats.lookups += 1;
        let interval = self.config.reread_interval;
        if let Some(request) = self.learned_unidentified_at(tgid, addr) {
            // With deferred reads the samples wait for the answer: the
            // file stays open through the process's root once it exits.
            self.read(request, now)?;
        }
        let process = self.process(tgid, now)?;
        if let Some(region) = process.find(addr) {
            // A file that could not be identified is retried with the next
            // read, under the same rate limit as unknown addresses: the
            // failure may have been a race with the process changing its
            // mappings.
            if !matches!(region.backing, Backing::Failed(_))
                || now.saturating_duration_since(process.read_at) < interval
            {
                return region.location(addr).map(Some);
            }
        } else if now.saturating_duration_since(process.read_at) < interval {
            self.stats.rereads_rate_limited += 1;
            return Ok(None);
        }
        self.reread(tgid, now)?;
        match self.processes.get(tgid).and_then(|p| p.find(addr)) {
            Some(region) => region.location(addr).map(Some),
            None => Ok(None),
        }
    }

    /// Process `child` forked from `parent`: it maps what the parent maps
    /// (known only if the parent is tracked; otherwise the child is read
    /// from `/proc` when first sampled). A fork that starts a thread, not a
    /// process, is not one for this.
    pub fn forked(&mut self, parent: u32, child: u32) {
        // Whatever the pid named before is another process.
        self.remove(child);
        let Some(regions) = self
            .processes
            .get(parent)
            .filter(|process| process.known)
            .map(|process| process.regions.clone())
        else {
            // Remembered for its exec, if it comes: the parent's root is
            // where the child's files are found once the child is gone.
            if self.fork_parents.len() >= self.config.max_processes {
                self.fork_parents.clear();
            }
            self.fork_parents.insert(child, parent);
            return;
        };
        self.insert(child, regions);
        if let Some(process) = self.processes.get_mut(child) {
            process.learned = true;
            process.parent = Some(parent);
        }
    }

    /// Process `tgid` called exec at `time_ns` (CLOCK_MONOTONIC): what it
    /// maps from now on is what [`Self::mapped`] is told. It is tracked
    /// from here on even if it exits before its maps are ever read.
    pub fn exec_learned(&mut self, tgid: u32, parent: Option<u32>, time_ns: u64) {
        let parent = parent
            .or_else(|| self.processes.get(tgid).and_then(|p| p.parent))
            .or_else(|| self.fork_parents.remove(&tgid));
        self.remove(tgid);
        self.insert(tgid, Vec::new());
        if let Some(process) = self.processes.get_mut(tgid) {
            process.learned = true;
            process.parent = parent;
            process.exec_learned_at = Some(time_ns);
        }
    }

    /// Process `tgid` mapped code: `mapping` as its maps would show it, and
    /// the build-id the kernel read from the file, if any. Whatever the new
    /// mapping overlaps is gone (the kernel replaced it). Ignored for a
    /// process the table does not track (it is read from `/proc` when
    /// first sampled) and for mappings that are not executable.
    pub fn mapped(&mut self, tgid: u32, mapping: Mapping, build_id: Option<BuildId>) {
        let Some(process) = self.processes.get(tgid).filter(|p| p.known) else {
            return;
        };
        if !mapping.perms.exec || mapping.is_empty() {
            return;
        }
        self.stats.mappings_learned += 1;
        // The process, its parent (the same mount namespace, unless it
        // made a new one), the agent's own root, the host's init (the
        // host's root when the agent runs in a container with hostPID).
        let mut roots = vec![tgid];
        for pid in process.parent.into_iter().chain([std::process::id(), 1]) {
            if !roots.contains(&pid) {
                roots.push(pid);
            }
        }
        let has_file = matches!(
            mapping.path,
            MappingPath::File { .. } | MappingPath::Memfd { .. }
        );
        let region = Arc::new(MappedRegion {
            tgid,
            mapping,
            proc_root: Arc::clone(&self.reader.proc_root),
            learned: Some(Arc::new(Learned { build_id, roots })),
        });
        let backing = if has_file {
            Backing::Learned { build_id }
        } else {
            Backing::Unbacked
        };
        let Some(process) = self.processes.get_mut(tgid) else {
            return;
        };
        if process.exec_learned_at.is_some()
            && process.exe.is_none()
            && let Some(path) = region.mapping.path.file_path()
        {
            process.exe = Some(path.to_path_buf());
        }
        if process.regions.len() >= MAX_REGIONS_PER_PROCESS {
            // munmap is no event, so a process that keeps mapping code at
            // new addresses would grow its list without end: start over
            // (a live process is read from /proc on its next miss).
            process.regions.clear();
        }
        let (start, end) = (region.mapping.start, region.mapping.end);
        process.regions.retain(|r| {
            let m = &r.region.mapping;
            m.end <= start || m.start >= end
        });
        let at = process
            .regions
            .partition_point(|r| r.region.mapping.start < start);
        process.regions.insert(at, Region { region, backing });
    }

    /// The read that identifies the learned, not yet identified file
    /// mapped at `addr` in `tgid`, if that is what is there.
    fn learned_unidentified_at(&self, tgid: u32, addr: u64) -> Option<ReadRequest> {
        let process = self.processes.get(tgid)?;
        let region = process.find(addr)?;
        match region.backing {
            Backing::Learned { build_id } => Some(ReadRequest::Learned {
                tgid,
                region: Arc::clone(&region.region),
                build_id,
            }),
            _ => None,
        }
    }

    /// Whether a read of `tgid` was asked for and is still awaited (one
    /// not answered within [`ASK_AGAIN`] may be asked for again: the owner
    /// could not hand it on).
    fn awaits_read(&mut self, tgid: u32, now: Instant) -> bool {
        match self.asked.get(&tgid) {
            Some(&at) if now.saturating_duration_since(at) < ASK_AGAIN => true,
            Some(_) => {
                self.asked.remove(&tgid);
                false
            }
            None => false,
        }
    }

    /// Does `request` now, on this thread, or with deferred reads asks the
    /// owner for it (once) and answers [`ProcessError::ReadPending`]: the
    /// samples that need it wait.
    fn read(&mut self, request: ReadRequest, now: Instant) -> Result<(), ProcessError> {
        let tgid = request.tgid();
        if !self.config.defer_reads {
            let answer = self.reader.read(request);
            return self.apply_found(answer);
        }
        self.ask_once(request, now);
        Err(ProcessError::ReadPending { tgid })
    }

    /// Reads a known process's maps again (an address outside them, or in
    /// a file not identified): now, or with deferred reads asks for them
    /// and goes on with what is known. Its samples do not wait: most such
    /// addresses are the garbage a walk ends on, and the new library a read
    /// would find is there for the samples after the answer.
    fn reread(&mut self, tgid: u32, now: Instant) -> Result<(), ProcessError> {
        if !self.config.defer_reads {
            return self.read(ReadRequest::Maps { tgid }, now);
        }
        self.ask_once(ReadRequest::Maps { tgid }, now);
        Ok(())
    }

    /// Asks the owner for `request` unless a read of its process is
    /// awaited already.
    fn ask_once(&mut self, request: ReadRequest, now: Instant) {
        let tgid = request.tgid();
        if self.awaits_read(tgid, now) {
            return;
        }
        if self.asked.len() >= self.config.max_processes {
            // Asked for and never answered (the owner dropped them): they
            // are asked for again as samples come.
            self.asked.clear();
        }
        self.asked.insert(tgid, now);
        self.requests.push(request);
        self.stats.reads_deferred += 1;
    }

    /// The reads asked for since the last call, for the owner to run
    /// ([`TableReader::read`]) and hand back ([`Self::apply`]).
    pub fn take_read_requests(&mut self) -> Vec<ReadRequest> {
        std::mem::take(&mut self.requests)
    }

    /// Turns deferred reads on or off; returns whether they were on. Off,
    /// lookups read at once, as they do by default.
    pub fn set_defer_reads(&mut self, defer: bool) -> bool {
        std::mem::replace(&mut self.config.defer_reads, defer)
    }

    /// Whether reads asked for are still unanswered (with deferred reads).
    pub fn awaits_reads(&self) -> bool {
        !self.asked.is_empty()
    }

    /// A handle that does this table's reads (sharing its identity cache)
    /// on the thread that holds it.
    pub fn reader(&self) -> TableReader {
        self.reader.clone()
    }

    /// Applies the answer to a read asked for; one whose process was
    /// forgotten since (it exited, exec'd or its pid was reused) is
    /// dropped. Returns whether it was applied.
    pub fn apply(&mut self, answer: ReadAnswer) -> bool {
        if self.asked.remove(&answer.tgid()).is_none() {
            return false;
        }
        // Errors reach the lookups that retry: a process found gone is
        // left with an empty entry, which rate-limits its reads.
        let _ = self.apply_found(answer);
        true
    }

    fn apply_found(&mut self, answer: ReadAnswer) -> Result<(), ProcessError> {
        let counts = answer.counts;
        self.stats.objects_identified += counts.objects_identified;
        self.stats.build_ids_unverified += counts.build_ids_unverified;
        self.stats.object_cache_hits += counts.object_cache_hits;
        self.stats.learned_unidentified += counts.learned_unidentified;
        let tgid = answer.tgid();
        match answer.found {
            Found::Maps(read) => self.apply_maps(tgid, read),
            Found::Learned(backing) => {
                let ReadRequest::Learned { region, .. } = answer.request else {
                    return Ok(());
                };
                // The region, if the process still maps it there.
                if let Some(slot) = self.processes.get_mut(tgid).and_then(|process| {
                    let at = process.position(region.mapping.start)?;
                    let slot = process.regions.get_mut(at)?;
                    Arc::ptr_eq(&slot.region, &region).then_some(slot)
                }) {
                    slot.backing = backing;
                }
                Ok(())
            }
        }
    }

    /// The `[vdso]` mapping of `tgid`, reading the process on first sight.
    pub fn vdso(&mut self, tgid: u32) -> Result<Option<Arc<MappedRegion>>, ProcessError> {
        let process = self.process(tgid, Instant::now())?;
        Ok(process
            .regions
            .iter()
            .find(|region| region.region.mapping.path == MappingPath::Vdso)
            .map(|region| Arc::clone(&region.region)))
    }

    /// The program `tgid` exec'd, as an exec event and its first file
    /// mapping told (the path as the process sees it).
    pub fn learned_exe(&self, tgid: u32) -> Option<&Path> {
        self.processes.get(tgid)?.exe.as_deref()
    }

    /// Forgets `tgid`: call on process exit, so a later process with the
    /// same pid starts from a fresh read. Its owner state goes to
    /// [`Self::take_dropped`].
    pub fn remove(&mut self, tgid: u32) {
        self.fork_parents.remove(&tgid);
        // A read asked for is of the process forgotten: its answer is not
        // applied.
        self.asked.remove(&tgid);
        if let Some(process) = self.processes.remove(tgid) {
            self.drop_state(tgid, process.state);
        }
    }

    fn drop_state(&mut self, tgid: u32, state: S) {
        bounded_push(&mut self.dropped, self.config.max_processes, (tgid, state));
    }

    /// Forgets every process (exec or exit records were lost), keeping the
    /// identity cache: it belongs to files, not processes.
    pub fn forget_processes(&mut self) {
        let drained: Vec<(u32, Process<S>)> = self.processes.drain().collect();
        for (tgid, process) in drained {
            self.drop_state(tgid, process.state);
        }
        self.fork_parents.clear();
        self.asked.clear();
        self.requests.clear();
    }

    /// Forgets the mappings of `tgid` because it called `exec` (the
    /// sampler's record, at `time_ns`): the new program's mappings are read
    /// on its next sample. Returns false, and keeps them, when
    /// [`Self::exec_learned`] already saw this exec, just before (its
    /// mappings since are the new program's).
    pub fn exec(&mut self, tgid: u32, time_ns: u64) -> bool {
        if let Some(process) = self.processes.get_mut(tgid)
            && let Some(learned_at) = process.exec_learned_at.take()
            && learned_at <= time_ns
            && time_ns - learned_at <= SAME_EXEC_NS
        {
            return false;
        }
        self.remove(tgid);
        true
    }

    /// The processes tracked.
    pub fn tgids(&self) -> impl Iterator<Item = u32> + '_ {
        self.processes.iter().map(|(tgid, _)| tgid)
    }

    /// Number of processes tracked.
    pub fn len(&self) -> usize {
        self.processes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }

    /// Whether `tgid` is tracked (without reading anything).
    pub fn contains(&self, tgid: u32) -> bool {
        self.processes.contains(tgid)
    }

    /// Number of file versions in the identity cache.
    pub fn cached_objects(&self) -> usize {
        self.reader.cached_objects()
    }

    pub fn stats(&self) -> TableStats {
        self.stats
    }

    /// The entry for `tgid`, read if new (or made for its owner state
    /// alone), marked as just used.
    fn process(&mut self, tgid: u32, now: Instant) -> Result<&Process<S>, ProcessError> {
        self.uses += 1;
        let uses = self.uses;
        match self.processes.get_mut(tgid) {
            Some(process) if process.known => process.last_used = uses,
            _ => self.read(ReadRequest::Maps { tgid }, now)?,
        }
        self.processes
            .get(tgid)
            .filter(|process| process.known)
            .ok_or(ProcessError::ProcessGone { tgid })
    }

    /// Replaces `tgid`'s entry with what a read of its maps found. On any
    /// error the old entry is dropped too: it was either wrong or belongs to
    /// a dead process.
    ///
    /// A process whose mappings were learned from events keeps them when
    /// its maps cannot be read (it exited): they are what is known.
    fn apply_maps(
        &mut self,
        tgid: u32,
        read: Result<Vec<Region>, MapsReadError>,
    ) -> Result<(), ProcessError> {
        self.stats.maps_reads += 1;
        if read.is_err()
            && let Some(process) = self.processes.get_mut(tgid)
            && process.learned
        {
            process.read_at = Instant::now();
            self.stats.answered_after_exit += 1;
            return Ok(());
        }
        self.fork_parents.remove(&tgid);
        self.asked.remove(&tgid);
        let (regions, result) = match read {
            Ok(regions) => (regions, Ok(())),
            Err(MapsReadError::Gone) if !self.config.defer_reads => {
                self.remove(tgid);
                return Err(ProcessError::ProcessGone { tgid });
            }
            // The samples held for it retry: an empty entry answers them
            // (and rate-limits another read).
            Err(MapsReadError::Gone) => (Vec::new(), Err(ProcessError::ProcessGone { tgid })),
            // An empty entry puts retries under the rate limit: maps we
            // cannot read or parse must not be read again every sample.
            Err(MapsReadError::Unreadable(source)) => {
                (Vec::new(), Err(ProcessError::Maps { tgid, source }))
            }
        };
        // What events said of the process, and its owner's state, outlive
        // a re-read of its maps.
        let (_, process) = self.record(tgid, true);
        process.regions = regions;
        process.known = true;
        process.read_at = Instant::now();
        result
    }

    /// Adds a process whose mappings are known (read, or learned from
    /// events), in place of any record of its pid, making room if the table
    /// is full.
    fn insert(&mut self, tgid: u32, regions: Vec<Region>) {
        self.remove(tgid);
        self.record(tgid, true).1.regions = regions;
    }

    /// Drops the least recently used record when the table is full and
    /// `tgid` has none. The length first: a sample's lookup of a table
    /// below its bound pays no membership probe.
    fn make_room_for(&mut self, tgid: u32) {
        if self.processes.len() < self.config.max_processes.max(1) || self.processes.contains(tgid)
        {
            return;
        }
        let oldest = self
            .processes
            .iter()
            .min_by_key(|(_, process)| process.last_used)
            .map(|(tgid, _)| tgid);
        if let Some(oldest) = oldest {
            self.remove(oldest);
            self.stats.evictions += 1;
        }
    }
}

/// The bias of a file mapping: `elf_vaddr = addr - bias` (wrapping), i.e.
/// `bias = start - offset + p_offset - p_vaddr` for the `PT_LOAD` segment
/// the mapping was made from.
///
/// The loader maps each segment from its page-aligned offset, so the segment
/// is one whose file range, extended down to a page boundary, holds the
/// mapping's offset. (A mapping split by `mprotect` starts further into the
/// segment; the same segment still covers it.) Segments can share a file
/// page (GNU ld puts `.rodata` and `.data` on one page, and small files
/// without `-z separate-code` put everything on one); then the segment whose
/// execute and write permissions match the mapping's wins. For executable
/// mappings, the only ones the table keeps, that settles it. A read-only
/// mapping can still be ambiguous: `mprotect` for RELRO makes the start of
/// the data segment read-only, so it looks like the `.rodata` segment that
/// shares its page.
pub fn bias(mapping: &Mapping, segments: &[LoadSegment], page_size: u64) -> Option<u64> {
    let covers = |segment: &LoadSegment| {
        let first = segment.offset - segment.offset % page_size;
        segment
            .offset
            .checked_add(segment.file_size)
            .is_some_and(|last| (first..last).contains(&mapping.offset))
    };
    let write = object::elf::PF_W.0;
    let score = |segment: &LoadSegment| {
        u8::from(segment.is_executable() == mapping.perms.exec) * 2
            + u8::from((segment.flags & write != 0) == mapping.perms.write)
    };
    // `max_by_key` keeps the last of equals; `rev` makes it the first.
    let segment = segments
        .iter()
        .filter(|segment| covers(segment))
        .rev()
        .max_by_key(|segment| score(segment))?;
    Some(
        mapping
            .start
            .wrapping_sub(mapping.offset)
            .wrapping_add(segment.offset)
            .wrapping_sub(segment.vaddr),
    )
}

/// Pushes a record let go of onto a list its owner takes. Bounded if the
/// owner never takes them: the oldest half goes (what it would have
/// cleaned up is bounded elsewhere too).
fn bounded_push<S>(list: &mut Vec<(u32, S)>, max_processes: usize, record: (u32, S)) {
    if list.len() >= max_processes.max(1) {
        let half = list.len() / 2;
        list.drain(..half.max(1));
    }
    list.push(record);
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use super::*;
    use crate::{
        maps::{Dev, Perms},
        object_id::FileKey,
    };

    const PAGE: u64 = 4096;
    const R: u32 = object::elf::PF_R.0;
    const W: u32 = object::elf::PF_W.0;
    const X: u32 = object::elf::PF_X.0;

    fn segment(offset: u64, vaddr: u64, file_size: u64, flags: u32) -> LoadSegment {
        LoadSegment {
            offset,
            vaddr,
            file_size,
            mem_size: file_size,
            flags,
        }
    }

    fn mapping(start: u64, end: u64, offset: u64, exec: bool) -> Mapping {
        Mapping {
            start,
            end,
            perms: Perms {
                read: true,
                write: false,
                exec,
                private: true,
            },
            offset,
            dev: Dev { major: 8, minor: 1 },
            inode: 12,
            path: MappingPath::File {
                path: "/lib/x.so".into(),
                deleted: false,
            },
        }
    }

    /// A PIE laid out the way GNU ld does with -z separate-code.
    fn pie_segments() -> Vec<LoadSegment> {
        vec![
            segment(0, 0, 0x628, R),
            segment(0x1000, 0x1000, 0x1c5, R | X),
            segment(0x2000, 0x2000, 0x144, R),
            segment(0x2df0, 0x3df0, 0x248, R | W),
        ]
    }

    #[test]
    fn bias_of_a_pie_code_mapping() {
        let code = mapping(0x55d0c8a01000, 0x55d0c8a02000, 0x1000, true);
        let bias = bias(&code, &pie_segments(), PAGE).expect("covered");
        assert_eq!(bias, 0x55d0c8a00000);
        // A function at ELF vaddr 0x1139.
        assert_eq!(0x55d0c8a01139u64.wrapping_sub(bias), 0x1139);
    }

    #[test]
    fn bias_of_a_data_segment_with_vaddr_ahead_of_offset() {
        // The RW segment is mapped from page 0x2000 at vaddr page 0x3000;
        // the read-only segment shares that file page at vaddr 0x2000.
        let mut data = mapping(0x55d0c8a03000, 0x55d0c8a05000, 0x2000, false);
        data.perms.write = true;
        let data_bias = bias(&data, &pie_segments(), PAGE).expect("covered");
        assert_eq!(0x55d0c8a03df0u64.wrapping_sub(data_bias), 0x3df0);
        let rodata = mapping(0x55d0c8a02000, 0x55d0c8a03000, 0x2000, false);
        let rodata_bias = bias(&rodata, &pie_segments(), PAGE).expect("covered");
        assert_eq!(0x55d0c8a02010u64.wrapping_sub(rodata_bias), 0x2010);
    }

    #[test]
    fn bias_of_a_non_pie_executable_is_zero() {
        let segments = [
            segment(0, 0x400000, 0x4e8, R),
            segment(0x1000, 0x401000, 0x1a5, R | X),
        ];
        let code = mapping(0x401000, 0x402000, 0x1000, true);
        assert_eq!(bias(&code, &segments, PAGE), Some(0));
    }

    #[test]
    fn bias_of_a_mapping_split_by_mprotect() {
        // One 3-page code segment whose middle page was made writable: the
        // last part starts two pages into the segment.
        let segments = [segment(0x1000, 0x11000, 0x3000, R | X)];
        let tail = mapping(0x7f0000003000, 0x7f0000004000, 0x3000, true);
        let bias = bias(&tail, &segments, PAGE).expect("covered");
        assert_eq!(0x7f0000003010u64.wrapping_sub(bias), 0x13010);
    }

    #[test]
    fn exec_mapping_prefers_exec_segment_on_a_shared_page() {
        // Without -z separate-code, small segments share file pages.
        let segments = [
            segment(0, 0, 0x5c8, R),
            segment(0x5c8, 0x15c8, 0x200, R | X),
        ];
        let code = mapping(0x7f0000001000, 0x7f0000002000, 0, true);
        let bias = bias(&code, &segments, PAGE).expect("covered");
        assert_eq!(0x7f00000015d0u64.wrapping_sub(bias), 0x15d0);
    }

    #[test]
    fn no_covering_segment() {
        let far = mapping(0x1000, 0x2000, 0x10_0000, true);
        assert_eq!(bias(&far, &pie_segments(), PAGE), None);
        assert_eq!(bias(&far, &[], PAGE), None);
    }

    /// A proc root with hand-written maps holding only unbacked mappings,
    /// so no file needs opening.
    struct FakeProc {
        dir: tempfile::TempDir,
    }

    impl FakeProc {
        fn new() -> Self {
            Self {
                dir: tempfile::tempdir().expect("temporary directory"),
            }
        }

        fn set_maps(&self, pid: u32, lines: &[&str]) {
            let dir = self.dir.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).expect("pid directory");
            let mut text = String::new();
            for line in lines {
                writeln!(text, "{line}").expect("formatting");
            }
            std::fs::write(dir.join("maps"), text).expect("writing maps");
        }

        fn kill(&self, pid: u32) {
            std::fs::remove_dir_all(self.dir.path().join(pid.to_string())).expect("removing pid");
        }

        fn table(&self, max_processes: usize, reread_interval: Duration) -> ProcessTable {
            ProcessTable::new(TableConfig {
                proc_root: self.dir.path().to_path_buf(),
                max_processes,
                reread_interval,
                ..TableConfig::default()
            })
        }
    }

    const JIT: &str = "7f0000000000-7f0000010000 rwxp 00000000 00:00 0 ";
    const VDSO: &str = "7ffd5e3d6000-7ffd5e3d8000 r-xp 00000000 00:00 0          [vdso]";
    const HEAP: &str = "55d0c9b2e000-55d0c9b4f000 rw-p 00000000 00:00 0          [heap]";

    fn unbacked_path(location: Option<Location>) -> MappingPath {
        match location {
            Some(Location::Unbacked(region)) => region.mapping.path.clone(),
            other => panic!("expected an unbacked location, got {other:?}"),
        }
    }

    #[test]
    fn finds_unbacked_regions_and_skips_non_executable_ones() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT, HEAP, VDSO]);
        let mut table = proc.table(8, Duration::from_secs(3600));
        let found = table.lookup(10, 0x7f0000000010).expect("lookup");
        assert_eq!(unbacked_path(found), MappingPath::Anonymous);
        let vdso = table.vdso(10).expect("vdso").expect("has a vdso");
        assert_eq!(
            (vdso.mapping.start, vdso.mapping.end),
            (0x7ffd5e3d6000, 0x7ffd5e3d8000)
        );
        assert_eq!(
            unbacked_path(table.lookup(10, 0x7ffd5e3d7fff).expect("lookup")),
            MappingPath::Vdso
        );
        // The heap is not executable: not a place a return address can be.
        assert!(table.lookup(10, 0x55d0c9b2e000).expect("lookup").is_none());
        assert_eq!(table.stats().maps_reads, 1);
    }

    #[test]
    fn unknown_address_rereads_at_most_once_per_interval() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT]);
        let interval = Duration::from_secs(3600);
        let mut table = proc.table(8, interval);
        assert!(table.lookup(10, 0x10).expect("first sight").is_none());
        // First sight read the maps just now: no re-read yet.
        assert_eq!(table.stats().maps_reads, 1);
        for _ in 0..100 {
            assert!(table.lookup(10, 0x10).expect("rate limited").is_none());
        }
        assert_eq!(table.stats().maps_reads, 1);
        assert_eq!(table.stats().rereads_rate_limited, 101);
        // An interval later a library has appeared: the re-read finds it.
        proc.set_maps(10, &[VDSO, JIT]);
        let later = Instant::now() + interval;
        let found = table.lookup_at(10, 0x7ffd5e3d6000, later).expect("re-read");
        assert_eq!(unbacked_path(found), MappingPath::Vdso);
        assert_eq!(table.stats().maps_reads, 2);
    }

    #[test]
    fn exec_drops_stale_mappings() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT]);
        let mut table = proc.table(8, Duration::from_secs(3600));
        assert!(table.lookup(10, 0x7f0000000010).expect("lookup").is_some());
        // The pid now runs another program, without the JIT area.
        proc.set_maps(10, &[VDSO]);
        // Until told, the table answers from what it read (documented).
        assert!(table.lookup(10, 0x7f0000000010).expect("lookup").is_some());
        table.exec(10, 0);
        assert!(!table.contains(10));
        assert!(table.lookup(10, 0x7f0000000010).expect("lookup").is_none());
        assert_eq!(table.stats().maps_reads, 2);
    }

    #[test]
    fn gone_process_is_reported_and_dropped() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT]);
        let mut table = proc.table(8, Duration::ZERO);
        assert!(table.lookup(10, 0x7f0000000010).expect("lookup").is_some());
        proc.kill(10);
        let err = table.lookup(10, 0x10).expect_err("gone");
        assert!(
            matches!(err, ProcessError::ProcessGone { tgid: 10 }),
            "{err:?}"
        );
        assert!(!table.contains(10));
        // A zombie has empty maps: gone as well.
        proc.set_maps(11, &[]);
        let err = table.lookup(11, 0x10).expect_err("zombie");
        assert!(
            matches!(err, ProcessError::ProcessGone { tgid: 11 }),
            "{err:?}"
        );
        assert!(table.is_empty());
    }

    #[test]
    fn the_owners_state_lives_and_goes_with_the_record() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT]);
        let mut table: ProcessTable<u32> = ProcessTable::with_owner_state(TableConfig {
            proc_root: proc.dir.path().to_path_buf(),
            max_processes: 2,
            reread_interval: Duration::ZERO,
            ..TableConfig::default()
        });
        // Made for the owner's state alone: its maps are read on its first
        // lookup, and the state stays through that read and re-reads.
        let (slot, state) = table.state(10);
        *state = 7;
        assert_eq!(table.stats().maps_reads, 0);
        assert!(table.lookup(10, 0x7f0000000010).expect("read").is_some());
        assert!(table.lookup(10, 0x10).expect("re-read").is_none());
        assert_eq!(table.stats().maps_reads, 2);
        assert_eq!(table.state_at(slot).copied(), Some(7));
        // Mapping events are for processes whose maps are known.
        table.state(11);
        table.mapped(11, anonymous(0x1000, 0x2000), None);
        assert_eq!(table.stats().mappings_learned, 0);
        assert!(table.take_dropped().is_empty());

        // Every way a record goes hands its state back, once.
        table.remove(10);
        assert_eq!(table.take_dropped(), [(10, 7)]);
        assert!(table.state_at(slot).is_none(), "its slot is stale");
        *table.state(12).1 = 12;
        *table.state(11).1 = 11;
        *table.state(13).1 = 13;
        assert_eq!(table.take_dropped(), [(12, 12)], "the least recently used");
        table.forked(11, 13);
        table.exec_learned(11, None, 100);
        assert_eq!(table.take_dropped(), [(13, 13), (11, 11)]);
        table.state(20);
        table.forget_processes();
        let dropped = table.take_dropped();
        assert_eq!(dropped.len(), 2);
        assert!(table.is_empty());

        // Handed on by the first owner to the second, once.
        for (tgid, state) in dropped {
            table.release(tgid, state);
        }
        assert_eq!(table.take_released().len(), 2);
        assert!(table.take_released().is_empty());
    }

    #[test]
    fn deferred_reads_are_asked_of_the_owner_and_answer_once_applied() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT]);
        let mut table = ProcessTable::new(TableConfig {
            proc_root: proc.dir.path().to_path_buf(),
            defer_reads: true,
            ..TableConfig::default()
        });
        let now = Instant::now();
        let pending = |result: Result<Option<Location>, ProcessError>| {
            matches!(result, Err(ProcessError::ReadPending { tgid: 10 }))
        };
        assert!(pending(table.lookup_at(10, 0x7f0000000010, now)));
        // Asked for once while awaited, however many samples come.
        assert!(pending(table.lookup_at(10, 0x7f0000000020, now)));
        let requests = table.take_read_requests();
        assert!(matches!(requests[..], [ReadRequest::Maps { tgid: 10 }]));
        assert_eq!(table.stats().maps_reads, 0, "nothing read on this thread");
        // The owner's thread reads; the answer is applied here.
        let reader = table.reader();
        let answer = std::thread::spawn(move || reader.read(requests[0].clone()))
            .join()
            .expect("reader thread");
        assert!(table.apply(answer));
        let found = table.lookup_at(10, 0x7f0000000010, now).expect("answered");
        assert!(matches!(found, Some(Location::Unbacked(_))), "{found:?}");
        assert_eq!(table.stats().reads_deferred, 1);
        // An address outside its known mappings asks for a read again, but
        // the lookup answers from what is known: nothing waits for it.
        let later = Instant::now() + REREAD_INTERVAL;
        assert!(matches!(table.lookup_at(10, 0x10, later), Ok(None)));
        assert!(matches!(table.lookup_at(10, 0x20, later), Ok(None)));
        assert_eq!(table.take_read_requests().len(), 1, "asked once");
        assert!(table.lookup_at(10, 0x7f0000000010, later).is_ok());

        // An answer for a process forgotten meanwhile is dropped.
        proc.set_maps(11, &[JIT]);
        assert!(matches!(
            table.lookup_at(11, 0x7f0000000010, now),
            Err(ProcessError::ReadPending { tgid: 11 })
        ));
        let request = table.take_read_requests().remove(0);
        table.remove(11);
        assert!(!table.apply(table.reader().read(request)));
        assert!(!table.contains(11));

        // A read never answered (the owner dropped it) is asked for again.
        proc.set_maps(12, &[JIT]);
        assert!(table.lookup_at(12, 0x10, now).is_err());
        assert_eq!(table.take_read_requests().len(), 1);
        assert!(table.lookup_at(12, 0x10, now).is_err());
        assert!(table.take_read_requests().is_empty());
        assert!(table.lookup_at(12, 0x10, now + ASK_AGAIN).is_err());
        assert_eq!(table.take_read_requests().len(), 1);

        // A process found gone answers its retries, unread, until the
        // rate limit lets another read be asked for.
        proc.kill(12);
        let request = ReadRequest::Maps { tgid: 12 };
        assert!(table.apply(table.reader().read(request)));
        let later = Instant::now();
        assert!(matches!(table.lookup_at(12, 0x10, later), Ok(None)));
        assert!(table.take_read_requests().is_empty());
    }

    #[test]
    fn garbage_maps_are_an_error_not_a_panic() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT, "this is not a maps line"]);
        let interval = Duration::from_secs(3600);
        let mut table = proc.table(8, interval);
        let err = table.lookup(10, 0x10).expect_err("parse error");
        assert!(
            matches!(
                &err,
                ProcessError::Maps {
                    tgid: 10,
                    source: MapsError::Parse { .. }
                }
            ),
            "{err:?}"
        );
        // Retrying is rate limited, then reports the error again.
        assert!(table.lookup(10, 0x10).expect("rate limited").is_none());
        assert_eq!(table.stats().maps_reads, 1);
        let later = Instant::now() + interval;
        assert!(table.lookup_at(10, 0x10, later).is_err());
        assert_eq!(table.stats().maps_reads, 2);
    }

    #[test]
    fn unidentified_file_is_an_error_and_is_retried() {
        use std::os::unix::fs::MetadataExt as _;

        let proc = FakeProc::new();
        // Not in map_files (the fake proc has none), so the table falls
        // back to the path under the process's root, checking the inode.
        let root = proc.dir.path().join("10/root");
        std::fs::create_dir_all(root.join("lib")).expect("fake root");
        let staged = root.join("staged");
        std::fs::write(&staged, b"not ELF, e.g. JIT code dumped to a file").expect("writing");
        let metadata = std::fs::metadata(&staged).expect("stat");
        let dev = Dev::from_st_dev(metadata.dev());
        let line = format!(
            "7f0000100000-7f0000101000 r-xp 00002000 {dev} {} /lib/x.so",
            metadata.ino()
        );
        proc.set_maps(10, &[&line]);
        let interval = Duration::from_secs(3600);
        let mut table = proc.table(8, interval);

        let err = table
            .lookup(10, 0x7f0000100010)
            .expect_err("no such file yet");
        assert!(
            matches!(
                &err,
                ProcessError::Unidentified {
                    tgid: 10,
                    start: 0x7f0000100000,
                    source,
                    ..
                } if matches!(**source, MappingError::Open(OpenError::Path { .. }))
            ),
            "{err:?}"
        );
        // Retrying is rate limited like unknown addresses.
        assert!(table.lookup(10, 0x7f0000100010).is_err());
        assert_eq!(table.stats().maps_reads, 1);
        std::fs::rename(&staged, root.join("lib/x.so")).expect("moving into place");
        let later = Instant::now() + interval;
        let found = match table.lookup_at(10, 0x7f0000100010, later).expect("retried") {
            Some(Location::Object(found)) => found,
            other => panic!("expected an object, got {other:?}"),
        };
        assert_eq!(
            *found.id,
            ObjectId::FileKey(FileKey::from_metadata(&metadata))
        );
        assert_eq!(found.file_offset, 0x2010);
        assert_eq!(found.elf_vaddr, None, "not ELF");
        assert_eq!(table.stats().maps_reads, 2);
        assert_eq!(table.stats().objects_identified, 1);
    }

    #[test]
    fn least_recently_used_process_is_evicted() {
        let proc = FakeProc::new();
        for pid in [1, 2, 3] {
            proc.set_maps(pid, &[JIT]);
        }
        let mut table = proc.table(2, Duration::from_secs(3600));
        let addr = 0x7f0000000010;
        table.lookup(1, addr).expect("1");
        table.lookup(2, addr).expect("2");
        // 1 is used again, so 2 is now the least recently used.
        table.lookup(1, addr).expect("1 again");
        table.lookup(3, addr).expect("3");
        assert_eq!(table.len(), 2);
        assert!(table.contains(1) && table.contains(3) && !table.contains(2));
        assert_eq!(table.stats().evictions, 1);
        table.remove(1);
        table.remove(3);
        assert!(table.is_empty());
    }

    #[test]
    fn lookup_result_is_small() {
        // Returned once per frame of every sample.
        assert!(
            std::mem::size_of::<Location>() <= 40,
            "{}",
            std::mem::size_of::<Location>()
        );
    }

    /// An executable anonymous mapping (JIT code) as an mmap event reports it.
    fn anonymous(start: u64, end: u64) -> Mapping {
        Mapping {
            dev: Dev::default(),
            inode: 0,
            path: MappingPath::Anonymous,
            ..mapping(start, end, 0, true)
        }
    }

    #[test]
    fn learned_mappings_answer_after_the_process_is_gone() {
        let proc = FakeProc::new();
        let mut table = proc.table(8, Duration::ZERO);
        // Process 20 exec'd and mapped code while the agent ran, and was
        // gone before anyone looked: no /proc/20 at all.
        table.exec_learned(20, Some(10), 100);
        table.mapped(20, anonymous(0x7f00_0000_0000, 0x7f00_0001_0000), None);
        let found = table.lookup(20, 0x7f00_0000_0010).expect("learned");
        assert_eq!(unbacked_path(found), MappingPath::Anonymous);
        // An address it never mapped: /proc is tried, and what was learned stands.
        assert!(table.lookup(20, 0x10).expect("still learned").is_none());
        let stats = table.stats();
        assert_eq!((stats.mappings_learned, stats.answered_after_exit), (1, 1));
        // A mapping that is not executable is not one a frame can be in.
        let mut data = anonymous(0x7f00_0002_0000, 0x7f00_0003_0000);
        data.perms.exec = false;
        table.mapped(20, data, None);
        assert_eq!(table.stats().mappings_learned, 1);
        // Nor does an event for a process the table does not track add one.
        table.mapped(21, anonymous(0x1000, 0x2000), None);
        assert!(!table.contains(21));
    }

    #[test]
    fn a_fork_inherits_the_mappings_and_an_exec_starts_over() {
        let proc = FakeProc::new();
        proc.set_maps(10, &[JIT]);
        let mut table = proc.table(8, Duration::ZERO);
        assert!(table.lookup(10, 0x7f00_0000_0010).expect("read").is_some());
        table.forked(10, 11);
        let found = table.lookup(11, 0x7f00_0000_0010).expect("inherited");
        assert_eq!(unbacked_path(found), MappingPath::Anonymous);
        table.exec_learned(11, None, 100);
        assert!(
            table
                .lookup(11, 0x7f00_0000_0010)
                .expect("after exec")
                .is_none()
        );
        // A remap replaces what it overlaps.
        table.mapped(11, anonymous(0x7f00_0000_8000, 0x7f00_0001_8000), None);
        table.mapped(11, anonymous(0x7f00_0001_0000, 0x7f00_0002_0000), None);
        assert!(
            table
                .lookup(11, 0x7f00_0000_9000)
                .expect("lookup")
                .is_none()
        );
        assert!(
            table
                .lookup(11, 0x7f00_0001_9000)
                .expect("lookup")
                .is_some()
        );
    }

    #[test]
    fn the_samplers_exec_record_keeps_what_the_exec_event_learned() {
        let proc = FakeProc::new();
        let mut table = proc.table(8, Duration::ZERO);
        table.exec_learned(12, None, 1_000);
        table.mapped(12, anonymous(0x1000, 0x2000), None);
        // The sampler's record of the same exec comes after the new image
        // was mapped: it keeps the mappings...
        assert!(!table.exec(12, 1_500));
        assert!(table.lookup(12, 0x1800).expect("kept").is_some());
        // ...while an exec no event reported starts over.
        assert!(table.exec(12, 2_000));
        assert!(!table.contains(12));
        // So does a record long after the event: another exec, whose own
        // event was lost.
        table.exec_learned(12, None, 1_000);
        assert!(table.exec(12, 1_000 + SAME_EXEC_NS + 1));
        assert!(!table.contains(12));
    }

    #[test]
    fn a_file_mapped_by_a_process_that_is_gone_is_found_under_its_parents_root() {
        let proc = FakeProc::new();
        let (build_id, text) = app_in_the_root_of_10(&proc);
        let mut table = proc.table(8, Duration::ZERO);
        table.exec_learned(20, Some(10), 100);
        table.mapped(20, text.clone(), Some(build_id));
        assert_eq!(table.learned_exe(20), Some(Path::new("/bin/app")));
        let at = text.start + 0x10;
        match table.lookup(20, at).expect("learned") {
            Some(Location::Object(object)) => {
                assert_eq!(object.id.build_id(), Some(build_id));
                assert!(object.elf_vaddr.is_some(), "the bias is known");
                let opened = object.open().expect("reached through the parent");
                assert!(opened.path.starts_with(proc.dir.path().join("10/root")));
            }
            other => panic!("expected the object, got {other:?}"),
        }
        // A file there with another build-id is not the one mapped.
        let other = BuildId::new(&[7; 20]).expect("a build-id");
        table.exec_learned(21, Some(10), 100);
        table.mapped(21, text, Some(other));
        let err = table.lookup(21, at).expect_err("not the file mapped");
        assert!(matches!(err, ProcessError::Unidentified { .. }), "{err:?}");
        assert_eq!(table.stats().learned_unidentified, 1);
    }

    #[test]
    fn a_learned_file_version_identified_before_is_not_opened_again() {
        let proc = FakeProc::new();
        let (build_id, text) = app_in_the_root_of_10(&proc);
        let app = proc.dir.path().join("10/root/bin/app");
        // A second file claiming the same build-id with other contents: a
        // mapping known by its build-id alone stays unidentified.
        forge(&app, &text, &proc.dir.path().join("10/root/bin/forged"));
        let mut table = proc.table(8, Duration::ZERO);
        table.exec_learned(20, Some(10), 100);
        table.mapped(20, text.clone(), Some(build_id));
        let at = text.start + 0x10;
        assert!(matches!(
            table.lookup(20, at),
            Ok(Some(Location::Object(_)))
        ));
        let forged_text = Mapping {
            path: MappingPath::File {
                path: PathBuf::from("/bin/forged"),
                deleted: false,
            },
            ..text.clone()
        };
        table.exec_learned(21, Some(10), 100);
        table.mapped(21, forged_text, Some(build_id));
        assert!(matches!(
            table.lookup(21, at),
            Ok(Some(Location::Object(_)))
        ));
        assert_eq!(table.stats().objects_identified, 2);
        // /bin/app's bytes are overwritten, its size and time kept: opened
        // and read, it would no longer be the file mapped. Known by its
        // version, it is not opened.
        let modified = std::fs::metadata(&app)
            .and_then(|m| m.modified())
            .expect("mtime");
        let len = std::fs::metadata(&app).expect("size").len();
        std::fs::write(&app, vec![0u8; len as usize]).expect("overwriting");
        let file = std::fs::File::options()
            .write(true)
            .open(&app)
            .expect("reopening");
        file.set_modified(modified).expect("restoring the time");
        table.exec_learned(22, Some(10), 100);
        table.mapped(22, text, Some(build_id));
        match table.lookup(22, at).expect("identified by its version") {
            Some(Location::Object(object)) => assert_eq!(object.id.build_id(), Some(build_id)),
            other => panic!("expected the object, got {other:?}"),
        }
        let stats = table.stats();
        assert_eq!(stats.objects_identified, 2, "nothing read again");
        assert_eq!(stats.object_cache_hits, 1, "known by its version");
        assert_eq!(stats.learned_unidentified, 0);
    }

    #[test]
    fn of_a_learned_files_roots_the_first_that_holds_it_decides_cached_or_not() {
        let proc = FakeProc::new();
        // The host's /bin/app is the test binary; the parent's (process 10)
        // claims the same build-id with other contents.
        let (build_id, text) = app_in_the_root_of_10(&proc);
        let host_bin = proc.dir.path().join("1/root/bin");
        std::fs::create_dir_all(&host_bin).expect("host root");
        let parents_app = proc.dir.path().join("10/root/bin/app");
        std::fs::copy(&parents_app, host_bin.join("app")).expect("copying the binary");
        forge(&parents_app, &text, &parents_app);
        let mut table = proc.table(8, Duration::ZERO);
        let at = text.start + 0x10;
        let identity = |table: &mut ProcessTable, tgid| match table.lookup(tgid, at) {
            Ok(Some(Location::Object(object))) => object.id,
            other => panic!("expected the object, got {other:?}"),
        };
        // A process whose parent has no root left: the host's file, read
        // and cached.
        table.exec_learned(30, Some(99), 100);
        table.mapped(30, text.clone(), Some(build_id));
        let host = identity(&mut table, 30);
        // A child of process 10: its parent's root comes first, and holds a
        // file not read yet. It is read, not passed over for the host's
        // cached one.
        table.exec_learned(31, Some(10), 100);
        table.mapped(31, text.clone(), Some(build_id));
        let parents = identity(&mut table, 31);
        assert_ne!(parents, host, "the parent's file is the one mapped");
        // Both cached now: each child of either is known by its version.
        table.exec_learned(32, Some(10), 100);
        table.mapped(32, text, Some(build_id));
        assert_eq!(identity(&mut table, 32), parents);
        assert_eq!(table.stats().objects_identified, 2);
    }

    #[test]
    fn with_deferred_reads_a_learned_file_is_identified_by_the_owner() {
        let proc = FakeProc::new();
        let (build_id, text) = app_in_the_root_of_10(&proc);
        let mut table = ProcessTable::new(TableConfig {
            proc_root: proc.dir.path().to_path_buf(),
            defer_reads: true,
            ..TableConfig::default()
        });
        table.exec_learned(20, Some(10), 100);
        table.mapped(20, text.clone(), Some(build_id));
        let at = text.start + 0x10;
        // The samples wait: no file is opened on this thread.
        let now = Instant::now();
        let err = table.lookup_at(20, at, now).expect_err("read pending");
        assert!(
            matches!(err, ProcessError::ReadPending { tgid: 20 }),
            "{err:?}"
        );
        assert_eq!(table.stats().objects_identified, 0);
        let requests = table.take_read_requests();
        assert!(
            matches!(requests[..], [ReadRequest::Learned { tgid: 20, .. }]),
            "{requests:?}"
        );
        let reader = table.reader();
        let answer = std::thread::spawn(move || reader.read(requests[0].clone()))
            .join()
            .expect("reader thread");
        assert!(table.apply(answer));
        match table.lookup_at(20, at, now).expect("identified") {
            Some(Location::Object(object)) => {
                assert_eq!(object.id.build_id(), Some(build_id));
            }
            other => panic!("expected the object, got {other:?}"),
        }
        assert!(table.take_read_requests().is_empty(), "read once");
    }

    /// Writes `to` as a copy of `binary` with a byte of the code `text` maps
    /// changed: a file that claims the same build-id with other contents.
    fn forge(binary: &Path, text: &Mapping, to: &Path) {
        let mut forged = std::fs::read(binary).expect("reading the binary");
        forged[usize::try_from(text.offset).expect("offset") + 0x100] ^= 0xff;
        std::fs::write(to, forged).expect("forging");
    }

    /// The test binary as `/bin/app` in the root of a live process 10 (the
    /// parent of the learned processes), with its build-id and a mapping
    /// of its first code page.
    fn app_in_the_root_of_10(proc: &FakeProc) -> (BuildId, Mapping) {
        let app = std::env::current_exe().expect("the test binary");
        let parent_bin = proc.dir.path().join("10/root/bin");
        std::fs::create_dir_all(&parent_bin).expect("parent root");
        std::fs::copy(&app, parent_bin.join("app")).expect("copying the binary");
        code_page_as_bin_app(&app)
    }

    /// The build-id of `binary`, and a mapping of the first page of its
    /// code as `/bin/app`.
    fn code_page_as_bin_app(binary: &Path) -> (BuildId, Mapping) {
        let file = std::fs::File::open(binary).expect("opening the binary");
        let summary = crate::elf::read_summary(&file).expect("an ELF file");
        let build_id = summary
            .build_id
            .expect("Rust test binaries carry a build-id");
        let code = summary
            .load_segments
            .iter()
            .find(|segment| segment.is_executable())
            .expect("a code segment");
        let page = code.offset - code.offset % PAGE;
        let text = Mapping {
            start: 0x5555_0000_0000 + page,
            end: 0x5555_0000_0000 + code.offset + PAGE,
            offset: page,
            path: MappingPath::File {
                path: "/bin/app".into(),
                deleted: false,
            },
            ..anonymous(0, 0)
        };
        (build_id, text)
    }

    #[test]
    fn a_build_id_claimed_by_two_different_files_names_neither_by_itself() {
        let proc = FakeProc::new();
        let app = std::env::current_exe().expect("the test binary");
        let bytes = std::fs::read(&app).expect("reading the binary");
        // The real file under 10's root, an impostor (the same bytes and
        // build-id, one more byte at the end) under 11's; 12 has neither.
        for (pid, extra) in [(10, &[][..]), (11, &[0x90][..])] {
            let bin = proc.dir.path().join(format!("{pid}/root/bin"));
            std::fs::create_dir_all(&bin).expect("root");
            std::fs::write(bin.join("app"), [&bytes[..], extra].concat()).expect("writing");
        }
        std::fs::create_dir_all(proc.dir.path().join("12/root")).expect("root");
        let (build_id, text) = code_page_as_bin_app(&app);
        let at = text.start + 0x10;
        let mut table = proc.table(8, Duration::ZERO);
        let identity_of = |table: &mut ProcessTable, pid: u32, parent: u32| {
            table.exec_learned(pid, Some(parent), 100);
            table.mapped(pid, text.clone(), Some(build_id));
            match table.lookup(pid, at) {
                Ok(Some(Location::Object(object))) => Ok(*object.id),
                Ok(other) => panic!("expected an object, got {other:?}"),
                Err(err) => Err(err),
            }
        };
        let real = identity_of(&mut table, 20, 10).expect("the real file");
        // With one file known, a mapping whose file is gone takes its identity.
        assert_eq!(identity_of(&mut table, 22, 12).ok(), Some(real));
        // One that is there is read, not taken by its build-id.
        let impostor = identity_of(&mut table, 21, 11).expect("the impostor");
        assert_eq!(impostor.build_id(), Some(build_id));
        assert_ne!(impostor, real);
        // With two, a mapping known only by the build-id is neither.
        let err = identity_of(&mut table, 23, 12).expect_err("contested");
        assert!(matches!(err, ProcessError::Unidentified { .. }), "{err:?}");
    }
}
