//! Names frames on the node: user frames from the mapped file's own symbols
//! (`.symtab`/`.dynsym`, DWARF lines and inlined functions when present)
//! with blazesym, then, for a Go binary, the frames those leave unnamed
//! from the Go runtime's function table (`.gopclntab`, which Go binaries
//! keep when stripped of the rest), vDSO frames from the agent's own copy
//! of the vDSO, kernel frames from `/proc/kallsyms`.
//!
//! Owns: [`ObjectFile`] (a mapped file, opened while a process that maps it
//! runs, because a container's paths do not exist on the host and a process
//! may exit before its frames are named), the bounded name cache keyed by
//! (object identity, file offset) and shared by every process, the bounded
//! set of files blazesym holds open, and when the kernel symbol table is
//! read again. Does not own which addresses are looked up, or at which byte
//! (the batch builder decides), nor the wire format; nor what the agent and
//! the collector share (the rest of this crate): blazesym's set-up and its
//! recovery from a panic, its answers as lines, the `.gopclntab` fallback,
//! demangling, kallsyms and jitdump files. Behind the `node` feature,
//! which the agent enables and the collector does not: it reads `/proc`,
//! the node's debug directories and perf maps, none of which the collector
//! has.
//!
//! Naming is best effort and never fails as a whole: a frame whose file
//! cannot be opened or read, or that no symbol covers, gets no lines (and
//! the collector shows it as `binary+offset`). Errors are counted in
//! [`SymbolizeStats`] and logged at debug level once per object.
//!
//! blazesym reads files by path and caches what it parsed per path. The
//! path handed to it is `/proc/self/fd/<n>` of the agent's own descriptor,
//! which names the very file mapped, and cached answers are never checked
//! against the path again (`auto_reload` off): so a descriptor stays open
//! exactly as long as blazesym holds the path, and the path is evicted from
//! blazesym before the descriptor is closed and its number reused.

mod cache;
pub mod debug_files;
pub mod perf_map;

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use crate::{
    ReadError, Reader, ReaderOptions,
    blazesym::{
        Pid,
        symbolize::{
            Input,
            source::{Elf, Process, Source},
        },
    },
    go::{GoFunctions, GoNames, GoTableCache},
    kernel::{self, KernelSymbols},
};
use stackscope_process_table::{MappedRegion, ObjectId, elf::LoadSegment, open::OpenError};

pub use crate::{FrameLine, Lines, truncate_str};
pub use cache::GenerationalCache;

use stackscope_process_table::ModuleFile;
use stackscope_telemetry::{StateSize, error_chain};

/// Names kept by default: a few hundred bytes each, so tens of MB at most.
pub const DEFAULT_MAX_CACHED_NAMES: usize = 1 << 18;

/// Files blazesym keeps open and parsed by default. Each costs two file
/// descriptors (the agent's and blazesym's) and whatever blazesym parsed:
/// an hour's soak on a busy build host kept 171 files and about 1 GB of
/// anonymous memory with a bound of 256.
pub const DEFAULT_MAX_OPEN_OBJECTS: usize = 64;

/// Bytes blazesym holds of the files it keeps open and parsed, by default
/// (each file counted by [`held_bytes`]). What it holds grows with a
/// file's symbol tables and debug sections, so their sizes bound it where a
/// count cannot: a few binaries with full DWARF (a compiler, a browser)
/// weigh more than a thousand stripped ones. One file is kept open
/// whatever its size.
pub const DEFAULT_MAX_OPEN_BYTES: u64 = 512 << 20;

/// What MiniDebugInfo (`.gnu_debugdata`, xz) holds once decompressed, as a
/// multiple of its compressed size: blazesym keeps the symbol and string
/// tables inside (xz packs symbol tables about 4:1).
const MINI_DEBUG_INFO_RATIO: u64 = 4;

/// Modules and BPF programs come and go: this often the agent looks
/// whether they did, and reads kallsyms again if so.
pub const DEFAULT_KALLSYMS_RELOAD: Duration = Duration::from_secs(300);

/// This kernel's symbols.
const LIVE_KALLSYMS: &str = "/proc/kallsyms";

/// A kernel address no symbol names (a module loaded since kallsyms was
/// read) has kallsyms read again, at most this often.
pub const DEFAULT_KALLSYMS_RETRY: Duration = Duration::from_secs(10);

/// The longest symbol or file name kept; longer ones (generated C++ or Rust
/// names can be kilobytes) are cut, so one frame cannot bloat every batch.
const MAX_NAME_BYTES: usize = 2048;

/// Objects whose errors have been logged, before the set is cleared (and
/// errors are logged once more).
const MAX_LOGGED_OBJECTS: usize = 4096;

/// Objects whose executable segments are remembered, before the map is
/// cleared (and headers are read again as frames need them).
const MAX_SEGMENT_OBJECTS: usize = 4096;

/// Bytes of Go function tables kept at once (the largest Go programs have
/// tables of tens of MB); beyond, all are dropped and read again as needed.
pub const DEFAULT_MAX_GO_TABLE_BYTES: usize = 128 << 20;

/// Executable segments shipped per file: more is not a file a linker made.
pub const MAX_CODE_SEGMENTS: usize = 16;

/// The ELF virtual address of `file_offset` among `segments`, if one holds
/// it.
fn vaddr_of(segments: &[LoadSegment], file_offset: u64) -> Option<u64> {
    segments.iter().find_map(|segment| {
        let delta = file_offset.checked_sub(segment.offset)?;
        (delta < segment.file_size).then(|| segment.vaddr.wrapping_add(delta))
    })
}

/// How the symbolizer finds kernel symbols and bounds itself.
#[derive(Debug, Clone)]
pub struct SymbolizerConfig {
    /// Names kept, by (object, file offset), for every process at once.
    pub max_cached_names: usize,
    /// Files blazesym keeps open and parsed at once; beyond, the least
    /// recently used one named in neither the batch being built nor the
    /// last is closed, or the new one is closed at the batch's end (see
    /// [`Symbolizer::end_batch`]).
    pub max_open_objects: usize,
    /// Total size of the files blazesym keeps open, likewise
    /// ([`held_bytes`]); [`Symbolizer::set_max_open_bytes`] changes it
    /// between batches.
    pub max_open_bytes: u64,
    /// Bytes of Go function tables (stripped Go binaries) kept; all go
    /// beyond.
    pub max_go_table_bytes: usize,
    /// The kallsyms file (`/proc/kallsyms`).
    pub kallsyms: PathBuf,
    /// How often the agent looks whether modules or BPF programs came or
    /// went, and reads kallsyms again if they did.
    pub kallsyms_reload: Duration,
    /// Least time between reads of kallsyms caused by an unnamed address.
    pub kallsyms_retry: Duration,
    /// The list of loaded modules and where they lie (`/proc/modules`).
    pub modules: PathBuf,
    /// Where sysfs is mounted, for the kernel's and modules' build-ids.
    pub sys_root: PathBuf,
    /// Name frames of files with a build-id on the node; off, they ship
    /// unnamed and the collector names them from debuginfo.
    pub name_files: bool,
    /// The host's root, searched before a process's own root for separate
    /// debug files (`usr/lib/debug/...`).
    pub host_root: PathBuf,
}

impl Default for SymbolizerConfig {
    fn default() -> Self {
        Self {
            max_cached_names: DEFAULT_MAX_CACHED_NAMES,
            max_open_objects: DEFAULT_MAX_OPEN_OBJECTS,
            max_open_bytes: DEFAULT_MAX_OPEN_BYTES,
            max_go_table_bytes: DEFAULT_MAX_GO_TABLE_BYTES,
            kallsyms: PathBuf::from(LIVE_KALLSYMS),
            kallsyms_reload: DEFAULT_KALLSYMS_RELOAD,
            kallsyms_retry: DEFAULT_KALLSYMS_RETRY,
            modules: PathBuf::from("/proc/modules"),
            sys_root: PathBuf::from("/sys"),
            name_files: true,
            host_root: PathBuf::from("/"),
        }
    }
}

/// Why an object's frames could not be named.
#[derive(Debug, thiserror::Error)]
pub enum SymbolizeError {
    /// The mapped file could not be reached (the process exited before it
    /// was opened, or the agent lacks the privileges).
    #[error("opening the mapped file")]
    Open(#[source] Arc<OpenError>),
    /// blazesym could not read the file (not ELF, malformed, I/O error),
    /// or panicked on it: it is not tried again while remembered.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// An earlier attempt failed: not tried again while remembered.
    #[error("the object file failed before")]
    FailedBefore,
}

/// A mapped file to name frames in, opened at most once, ideally while a
/// process that maps it still runs ([`ObjectFile::open_now`]).
#[derive(Debug)]
pub struct ObjectFile {
    pub id: ObjectId,
    /// The mapping the file is opened through; `None` for a file handed
    /// over already open.
    region: Option<Arc<MappedRegion>>,
    file: OnceLock<Result<File, Arc<OpenError>>>,
}

impl ObjectFile {
    /// The file of `module`, not opened yet.
    pub fn new(module: &ModuleFile) -> Self {
        Self {
            id: *module.id,
            region: Some(Arc::clone(&module.region)),
            file: OnceLock::new(),
        }
    }

    /// An object file already open (a file on disk, in tests and tools).
    pub fn from_file(id: ObjectId, file: File) -> Self {
        Self {
            id,
            region: None,
            file: OnceLock::from(Ok(file)),
        }
    }

    /// Opens the file (through `/proc/<pid>/map_files`, then the process's
    /// root) unless that was tried before; fails once the process is gone.
    pub fn open_now(&self) -> Result<&File, &Arc<OpenError>> {
        self.file
            .get_or_init(|| {
                let Some(region) = &self.region else {
                    // Unreachable: `from_file` sets the file.
                    return Err(Arc::new(OpenError::ProcessGone { pid: 0 }));
                };
                region.open().map(|opened| opened.file).map_err(Arc::new)
            })
            .as_ref()
    }

    /// Whether the file was opened (and is held open).
    pub fn is_open(&self) -> bool {
        matches!(self.file.get(), Some(Ok(_)))
    }

    /// Whether opening it was tried and failed.
    pub fn open_failed(&self) -> bool {
        matches!(self.file.get(), Some(Err(_)))
    }
}

/// Counters since the symbolizer was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SymbolizeStats {
    /// Lookups of user and vDSO frames answered by the name cache, and
    /// those that were not.
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Misses that found a name, and those no symbol covers.
    pub named: u64,
    pub no_symbol: u64,
    /// Frames left unnamed because their file could not be opened or read.
    pub errors: u64,
    /// Stripped files named from a separate debug file found on the node.
    pub debug_files: u64,
    /// Frames of Go binaries named from their function table
    /// (`.gopclntab`), which blazesym left unnamed.
    pub go_named: u64,
    /// Frames of files with a build-id left for the collector to name
    /// (`--symbolize collector`).
    pub left_to_collector: u64,
    /// Frames left unnamed because the batch's time for naming ran out;
    /// they are looked up again for the next batch.
    pub deferred: u64,
    pub kernel_named: u64,
    pub kernel_unnamed: u64,
    /// Reads of kallsyms after the first: for an address no symbol
    /// named, or because modules or BPF programs came or went since the
    /// last one (looked at every [`SymbolizerConfig::kallsyms_reload`]).
    pub kernel_reloads: u64,
    /// Files handed to blazesym.
    pub objects_opened: u64,
    /// Files let go of for their bound (the symbolizer's share of the
    /// memory budget): opened and parsed again when next named in.
    pub objects_evicted: u64,
    /// Times blazesym's whole state was dropped (after a panic, or to
    /// release what path evictions do not reach).
    pub rebuilds: u64,
    pub panics: u64,
    /// Symbols in the kernel table (0 when kallsyms is hidden).
    pub kernel_symbols: u64,
}

impl SymbolizeStats {
    /// Share of user and vDSO lookups answered by the cache, in percent.
    pub fn cache_hit_percent(&self) -> f64 {
        let lookups = self.cache_hits + self.cache_misses;
        if lookups == 0 {
            0.0
        } else {
            100.0 * self.cache_hits as f64 / lookups as f64
        }
    }
}

/// Which object a cached name belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum NameSpace {
    Object(ObjectId),
    Vdso,
}

/// A file registered with blazesym.
struct Registered {
    /// Keeps the descriptor `path` names open.
    _object: Arc<ObjectFile>,
    /// The separate debug file `path` names instead, kept open for it:
    /// looked up by ELF virtual address, since it keeps no file layout.
    debug_file: Option<File>,
    path: PathBuf,
    /// What blazesym holds of the file `path` names ([`held_bytes`]).
    bytes: u64,
    last_used: u64,
    /// Over the bound when it was opened, every other file having been
    /// named in this batch: closed as soon as another file needs room, and
    /// at the batch's end.
    transient: bool,
    /// Reading it failed: its frames stay unnamed until it is forgotten.
    failed: bool,
}

/// What blazesym holds of `file` once it names addresses in it (blazesym
/// 0.2's ELF reader): the symbol tables, which it reads whole to index them
/// by address (8 bytes of index per 24-byte symbol), and the DWARF
/// sections, compressed ones decompressed on the heap, MiniDebugInfo's
/// tables decompressed. String tables are not counted: blazesym reads only
/// the pages of the names it returns, and they stay file pages the kernel
/// takes back first. A file's size overstated a large stripped library
/// 25-fold (librustc_driver: 146 MiB, 5.7 MiB held) and understated
/// compressed DWARF (libc's Debian debug file: 4 MiB, 9.4 MiB held). A file not readable as ELF counts its size (blazesym keeps nothing of
/// it; nothing when its size is unknown too).
fn held_bytes(file: &File) -> u64 {
    use object::{Object as _, ObjectSection as _};
    let size = file.metadata().map_or(0, |metadata| metadata.len());
    let cache = object::ReadCache::new(file);
    let Ok(elf) = object::File::parse(&cache) else {
        return size;
    };
    elf.sections()
        .map(|section| match section.name().unwrap_or_default() {
            ".symtab" | ".dynsym" => section.size().saturating_mul(4) / 3,
            ".gnu_debugdata" => section.size().saturating_mul(MINI_DEBUG_INFO_RATIO),
            name if name.starts_with(".debug_") || name.starts_with(".zdebug_") => section
                .compressed_file_range()
                .map_or(section.size(), |range| range.uncompressed_size),
            _ => 0,
        })
        .fold(0, u64::saturating_add)
}

/// A kernel frame's module and names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelFrame {
    /// `None` for the kernel image.
    pub module: Option<Arc<str>>,
    /// One line with the function, or none when the address is not named.
    pub lines: Lines,
}

/// See the module documentation.
pub struct Symbolizer {
    config: SymbolizerConfig,
    reader: Reader,
    registered: HashMap<ObjectId, Registered>,
    /// The sizes of the files registered, summed.
    registered_bytes: u64,
    tick: u64,
    /// The tick the batch before the one being built began at: a file not
    /// used since is cold, the only kind a new file may take the place of.
    previous_batch_start: u64,
    /// The tick the batch being built began at.
    batch_start: u64,
    /// Evictions since blazesym was last rebuilt.
    evictions: usize,
    names: GenerationalCache<(NameSpace, u64), Lines>,
    logged: HashSet<ObjectId>,
    /// Each object's executable `PT_LOAD` segments (empty when unreadable).
    code_segments: HashMap<ObjectId, Arc<[LoadSegment]>>,
    /// Each object's Go function table, read when blazesym first left one
    /// of its frames unnamed (`None`: no Go binary, or unreadable).
    go_functions: GoTableCache<ObjectId>,
    kernel: KernelSymbols,
    kernel_loaded: Instant,
    /// What the kernel's code was made of at the last read of kallsyms
    /// ([`kernel_code_fingerprint`]; `None`: unknown, read again whenever
    /// due), and when it was last compared.
    kernel_fingerprint: Option<u64>,
    kernel_checked: Instant,
    /// How long after a read a miss reads kallsyms again: the configured
    /// retry, doubled (up to the reload period) each time a read did not
    /// name the miss, so an address that stays unnamed costs little.
    kernel_retry: Duration,
    kernel_build_id: Option<String>,
    module_build_ids: HashMap<Arc<str>, Option<String>>,
    /// Where this process maps the vDSO, and the image's build-id.
    vdso: Option<(u64, Option<String>)>,
    deadline: Option<Instant>,
    stats: SymbolizeStats,
}

impl std::fmt::Debug for Symbolizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Symbolizer")
            .field("registered", &self.registered.len())
            .field("names", &self.names.len())
            .field("kernel_symbols", &self.kernel.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Symbolizer {
    pub fn new(config: SymbolizerConfig) -> Self {
        let kernel_fingerprint = kernel_code_fingerprint(&config);
        let (kernel, kernel_loaded) = load_kallsyms(&config.kallsyms, &config.modules);
        let vdso = stackscope_process_table::maps::own_vdso_image().map(|(start, image)| {
            use object::Object as _;
            let build_id = object::File::parse(image)
                .ok()
                .and_then(|elf| elf.build_id().ok().flatten())
                .map(hex);
            (start, build_id)
        });
        Self {
            reader: Reader::new(reader_options()),
            registered: HashMap::new(),
            registered_bytes: 0,
            tick: 0,
            previous_batch_start: 0,
            batch_start: 0,
            evictions: 0,
            names: GenerationalCache::new(config.max_cached_names),
            logged: HashSet::new(),
            code_segments: HashMap::new(),
            go_functions: GoTableCache::new(MAX_SEGMENT_OBJECTS, config.max_go_table_bytes),
            kernel_build_id: kernel::kernel_build_id(&config.sys_root),
            kernel,
            kernel_loaded,
            kernel_fingerprint,
            kernel_checked: kernel_loaded,
            kernel_retry: config.kallsyms_retry,
            module_build_ids: HashMap::new(),
            vdso,
            deadline: None,
            stats: SymbolizeStats::default(),
            config,
        }
    }

    /// Starts naming one batch: names not found by `deadline` are left
    /// out of it (see [`SymbolizeStats::deferred`]); reads kallsyms again
    /// when due and the kernel's code changed since the last read.
    /// (Reading it is 50 ms of kernel time and as much parsing for 120k
    /// symbols: every five minutes, a third of what an idle agent may
    /// cost.)
    pub fn begin_batch(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
        self.previous_batch_start = self.batch_start;
        self.batch_start = self.tick;
        if self.kernel_checked.elapsed() >= self.config.kallsyms_reload {
            self.kernel_checked = Instant::now();
            let now = kernel_code_fingerprint(&self.config);
            if now.is_none() || now != self.kernel_fingerprint {
                self.stats.kernel_reloads += 1;
                self.reload_kallsyms(now);
            }
        }
    }

    /// Ends the batch: closes the files opened over the bound, then the
    /// least recently used ones until the rest fit (the bound may have
    /// been lowered meanwhile).
    pub fn end_batch(&mut self) {
        let transient: Vec<ObjectId> = self
            .registered
            .iter()
            .filter(|(_, entry)| entry.transient)
            .map(|(id, _)| *id)
            .collect();
        for id in transient {
            self.evict(id);
        }
        while self.registered.len() > 1
            && self.over_bound(false, 0)
            && self.evict_least_recent(u64::MAX)
        {}
    }

    /// The bytes of files kept open, from the next file opened on; the
    /// files over it are closed at the batch's end ([`Self::end_batch`]).
    pub fn set_max_open_bytes(&mut self, bytes: u64) {
        self.config.max_open_bytes = bytes;
    }

    /// Sizes of the caches naming keeps between batches.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        out.push(StateSize::entries(
            "symbol_names",
            self.names.len(),
            Some(self.config.max_cached_names.max(2)),
        ));
        out.push(
            StateSize::entries(
                "symbolizer_files",
                self.registered.len(),
                Some(self.config.max_open_objects.max(1)),
            )
            .with_bytes(
                usize::try_from(self.registered_bytes).unwrap_or(usize::MAX),
                usize::try_from(self.config.max_open_bytes).ok(),
            ),
        );
        out.push(StateSize::entries(
            "code_segments",
            self.code_segments.len(),
            Some(MAX_SEGMENT_OBJECTS),
        ));
        let (max_go_entries, max_go_bytes) = self.go_functions.limits();
        out.push(
            StateSize::entries("go_tables", self.go_functions.len(), Some(max_go_entries))
                .with_bytes(self.go_functions.bytes(), Some(max_go_bytes)),
        );
        out.push(StateSize::entries(
            "kernel_module_ids",
            self.module_build_ids.len(),
            None,
        ));
    }

    pub fn stats(&self) -> SymbolizeStats {
        SymbolizeStats {
            cache_hits: self.names.hits,
            cache_misses: self.names.misses,
            kernel_symbols: self.kernel.len() as u64,
            ..self.stats
        }
    }

    /// Names `offsets` (file offsets, each at the byte to look up) of
    /// `object`; the result is index for index with `offsets`.
    pub fn user(&mut self, object: &Arc<ObjectFile>, offsets: &[u64]) -> Vec<Lines> {
        if !self.config.name_files && object.id.build_id().is_some() {
            self.stats.left_to_collector += offsets.len() as u64;
            return offsets.iter().map(|_| Lines::from([])).collect();
        }
        let space = NameSpace::Object(object.id);
        self.cached_or(space, offsets, |this, misses| {
            this.read_object(object, misses)
        })
    }

    /// The executable `PT_LOAD` segments of `object` (at most
    /// [`MAX_CODE_SEGMENTS`]; none when its headers cannot be read), read
    /// once per object: they travel with its frames so the collector can
    /// name file offsets from a separate debug file.
    pub fn code_segments(&mut self, object: &ObjectFile) -> Arc<[LoadSegment]> {
        if let Some(segments) = self.code_segments.get(&object.id) {
            return Arc::clone(segments);
        }
        let segments: Arc<[LoadSegment]> = match object.open_now() {
            Ok(file) => match stackscope_process_table::elf::read_summary(file) {
                Ok(summary) => {
                    let code: Vec<LoadSegment> = summary
                        .load_segments
                        .into_iter()
                        .filter(LoadSegment::is_executable)
                        .collect();
                    if code.len() > MAX_CODE_SEGMENTS {
                        Vec::new()
                    } else {
                        code
                    }
                }
                Err(_) => Vec::new(),
            },
            Err(_) => Vec::new(),
        }
        .into();
        if self.code_segments.len() >= MAX_SEGMENT_OBJECTS {
            self.code_segments.clear();
        }
        self.code_segments.insert(object.id, Arc::clone(&segments));
        segments
    }

    /// Names `offsets` in the vDSO image.
    pub fn vdso(&mut self, offsets: &[u64]) -> Vec<Lines> {
        self.cached_or(NameSpace::Vdso, offsets, Self::read_vdso)
    }

    /// The vDSO image's build-id (lower-case hex).
    pub fn vdso_build_id(&self) -> Option<&str> {
        self.vdso.as_ref()?.1.as_deref()
    }

    /// Names the kernel address `lookup` (the byte to look up).
    pub fn kernel(&mut self, lookup: u64) -> KernelFrame {
        let mut found = self.kernel.lookup(lookup).map(kernel_frame);
        // An address no symbol names may be in a module loaded since
        // kallsyms was read: read it again (at most every retry interval)
        // and look once more. An empty table (kptr_restrict) stays empty.
        if found.is_none()
            && !self.kernel.is_empty()
            && self.kernel_loaded.elapsed() >= self.kernel_retry
        {
            self.stats.kernel_reloads += 1;
            self.reload_kallsyms(kernel_code_fingerprint(&self.config));
            found = self.kernel.lookup(lookup).map(kernel_frame);
            self.kernel_retry = if found.is_some() {
                self.config.kallsyms_retry
            } else {
                (self.kernel_retry * 2).min(self.config.kallsyms_reload)
            };
        }
        match found {
            Some(frame) => {
                self.stats.kernel_named += 1;
                frame
            }
            None => {
                self.stats.kernel_unnamed += 1;
                KernelFrame {
                    module: None,
                    lines: Arc::new([]),
                }
            }
        }
    }

    /// Reads kallsyms again; `fingerprint` is the kernel's code's, taken
    /// before the read (a change while it reads is read next time).
    fn reload_kallsyms(&mut self, fingerprint: Option<u64>) {
        self.kernel_fingerprint = fingerprint;
        (self.kernel, self.kernel_loaded) =
            load_kallsyms(&self.config.kallsyms, &self.config.modules);
        self.kernel_checked = self.kernel_loaded;
        self.module_build_ids.clear();
    }

    /// The build-id of the kernel image (`module` `None`) or of a module.
    pub fn kernel_build_id(&mut self, module: Option<&Arc<str>>) -> Option<&str> {
        match module {
            None => self.kernel_build_id.as_deref(),
            Some(module) => {
                let sys = &self.config.sys_root;
                self.module_build_ids
                    .entry(Arc::clone(module))
                    .or_insert_with(|| kernel::module_build_id(sys, module))
                    .as_deref()
            }
        }
    }

    /// Answers `offsets` from the cache, and the rest with `read` (once
    /// per distinct offset), unless the deadline has passed.
    fn cached_or(
        &mut self,
        space: NameSpace,
        offsets: &[u64],
        read: impl FnOnce(&mut Self, &[u64]) -> Result<Vec<Lines>, SymbolizeError>,
    ) -> Vec<Lines> {
        let unnamed: Lines = Arc::new([]);
        let mut out: Vec<Option<Lines>> = offsets
            .iter()
            .map(|&offset| self.names.get(&(space, offset)))
            .collect();
        let mut misses: Vec<u64> = offsets
            .iter()
            .zip(&out)
            .filter(|(_, found)| found.is_none())
            .map(|(&offset, _)| offset)
            .collect();
        misses.sort_unstable();
        misses.dedup();
        if misses.is_empty() {
            return out.into_iter().map(Option::unwrap_or_default).collect();
        }
        if self
            .deadline
            .is_some_and(|deadline| Instant::now() >= deadline)
        {
            self.stats.deferred += misses.len() as u64;
        } else {
            match read(self, &misses) {
                Ok(found) => {
                    for (&offset, lines) in misses.iter().zip(&found) {
                        if lines.is_empty() {
                            self.stats.no_symbol += 1;
                        } else {
                            self.stats.named += 1;
                        }
                        self.names.insert((space, offset), Arc::clone(lines));
                    }
                    for (slot, offset) in out.iter_mut().zip(offsets) {
                        if slot.is_none()
                            && let Ok(at) = misses.binary_search(offset)
                        {
                            *slot = found.get(at).cloned();
                        }
                    }
                }
                Err(err) => {
                    self.stats.errors += misses.len() as u64;
                    self.log_once(space, &err);
                }
            }
        }
        out.into_iter()
            .map(|found| found.unwrap_or_else(|| Arc::clone(&unnamed)))
            .collect()
    }

    fn log_once(&mut self, space: NameSpace, err: &SymbolizeError) {
        let NameSpace::Object(id) = space else {
            tracing::debug!("naming vDSO frames: {}", error_chain(err));
            return;
        };
        if self.logged.len() >= MAX_LOGGED_OBJECTS {
            self.logged.clear();
        }
        if self.logged.insert(id) {
            tracing::debug!("naming frames of object {id}: {}", error_chain(err));
        }
    }

    fn read_object(
        &mut self,
        object: &Arc<ObjectFile>,
        offsets: &[u64],
    ) -> Result<Vec<Lines>, SymbolizeError> {
        let (path, via_debug_file) = self.register(object)?;
        let source = Source::Elf(Elf::new(path));
        let result = if via_debug_file {
            // Offsets outside the file's code stay unnamed.
            let segments = self.code_segments(object);
            let vaddrs: Vec<Option<u64>> = offsets
                .iter()
                .map(|&offset| vaddr_of(&segments, offset))
                .collect();
            let present: Vec<u64> = vaddrs.iter().flatten().copied().collect();
            self.read(&source, Input::VirtOffset(&present))
                .map(|found| {
                    let mut found = found.into_iter();
                    vaddrs
                        .iter()
                        .map(|vaddr| match vaddr {
                            Some(_) => found.next().unwrap_or_default(),
                            None => Lines::from([]),
                        })
                        .collect()
                })
        } else {
            self.read(&source, Input::FileOffset(offsets))
        };
        if result.is_err()
            && let Some(entry) = self.registered.get_mut(&object.id)
        {
            entry.failed = true;
        }
        self.with_go_names(object, offsets, result)
    }

    /// `found` with the frames it leaves unnamed named from `object`'s Go
    /// function table, when it is a Go binary (see
    /// [`crate::go`]).
    fn with_go_names(
        &mut self,
        object: &Arc<ObjectFile>,
        offsets: &[u64],
        found: Result<Vec<Lines>, SymbolizeError>,
    ) -> Result<Vec<Lines>, SymbolizeError> {
        let unnamed = match &found {
            Ok(lines) => lines.iter().any(|lines| lines.is_empty()),
            Err(_) => true,
        };
        if !unnamed {
            return found;
        }
        let Some(functions) = self.go_functions(object) else {
            return found;
        };
        let Some(go) = GoNames::new(&functions, MAX_NAME_BYTES) else {
            return found;
        };
        let segments = self.code_segments(object);
        let mut lines = found.unwrap_or_else(|_| offsets.iter().map(|_| Lines::from([])).collect());
        self.stats.go_named += go.fill(&mut lines, |i| vaddr_of(&segments, offsets[i]));
        Ok(lines)
    }

    /// `object`'s Go function table, read once (while remembered).
    fn go_functions(&mut self, object: &ObjectFile) -> Option<Arc<GoFunctions>> {
        if let Some(known) = self.go_functions.get(&object.id) {
            return known;
        }
        let functions = match object.open_now() {
            Ok(file) => match GoFunctions::read(file) {
                Ok(functions) => functions.map(Arc::new),
                Err(err) => {
                    tracing::debug!(
                        "reading the Go function table of object {}: {}",
                        object.id,
                        error_chain(&err)
                    );
                    None
                }
            },
            Err(_) => None,
        };
        self.go_functions.insert(object.id, functions.clone());
        functions
    }

    fn read_vdso(&mut self, offsets: &[u64]) -> Result<Vec<Lines>, SymbolizeError> {
        let Some((start, _)) = self.vdso else {
            return Ok(offsets.iter().map(|_| Lines::from([])).collect());
        };
        // The agent's own vDSO is the same image: blazesym reads it from
        // this process's memory.
        let mut process = Process::new(Pid::Slf);
        process.debug_syms = false;
        process.perf_map = false;
        process.map_files = false;
        let addresses: Vec<u64> = offsets.iter().map(|&o| start.wrapping_add(o)).collect();
        self.read(&Source::Process(process), Input::AbsAddr(&addresses))
    }

    /// One blazesym call, with a panic in it turned into an error (and
    /// blazesym's state dropped, since a panic may have left it half
    /// updated: with it go the registrations).
    fn read(
        &mut self,
        source: &Source,
        input: Input<&[u64]>,
    ) -> Result<Vec<Lines>, SymbolizeError> {
        let result = self.reader.read(source, input);
        if let Err(ReadError::Panicked) = result {
            self.stats.panics += 1;
            self.rebuilt();
        }
        Ok(result?)
    }

    /// The path blazesym reads `object` by, registering it on first use,
    /// and whether it is a separate debug file (read by ELF virtual
    /// address) rather than the object itself.
    fn register(&mut self, object: &Arc<ObjectFile>) -> Result<(PathBuf, bool), SymbolizeError> {
        self.tick += 1;
        if let Some(entry) = self.registered.get_mut(&object.id) {
            entry.last_used = self.tick;
            return if entry.failed {
                Err(SymbolizeError::FailedBefore)
            } else {
                Ok((entry.path.clone(), entry.debug_file.is_some()))
            };
        }
        let file = object
            .open_now()
            .map_err(|err| SymbolizeError::Open(Arc::clone(err)))?;
        let debug_file = self.local_debug_file(object, file);
        let via_debug_file = debug_file.is_some();
        if via_debug_file {
            self.stats.debug_files += 1;
        }
        let read = debug_file.as_ref().unwrap_or(file);
        let path = Path::new("/proc/self/fd").join(read.as_raw_fd().to_string());
        let bytes = held_bytes(read);
        // A new file takes the place only of files named in neither this
        // batch nor the last: with more files in steady use than fit (four
        // interpreters' libpython with DWARF, 10-25 MiB each), closing the
        // least recently used would close each just before the next batch
        // needs it, and every batch would parse every file again. Kept,
        // only what does not fit beside them is parsed again.
        while self.over_bound(true, bytes) && self.evict_least_recent(self.previous_batch_start) {}
        let transient = self.over_bound(true, bytes) && !self.registered.is_empty();
        tracing::debug!(
            object = %object.id,
            bytes,
            transient,
            held = self.registered_bytes,
            bound = self.config.max_open_bytes,
            "symbolizer opens a file"
        );
        self.registered_bytes += bytes;
        self.stats.objects_opened += 1;
        self.registered.insert(
            object.id,
            Registered {
                _object: Arc::clone(object),
                debug_file,
                path: path.clone(),
                bytes,
                last_used: self.tick,
                transient,
                failed: false,
            },
        );
        Ok((path, via_debug_file))
    }

    /// The separate debug file of a binary that carries only dynamic
    /// symbols, under the host's root, then under the root of the process
    /// that maps it (see [`debug_files`]).
    ///
    /// The host's first: names are cached per object, for every process
    /// that maps the same file, and any container can put a debug file
    /// that claims a build-id under its own root. The host's, where it has
    /// one, is then the one all of them are named from.
    fn local_debug_file(&self, object: &ObjectFile, file: &File) -> Option<File> {
        let source = debug_files::name_source(file)?;
        let build_id = object.id.build_id().map(|id| id.to_string());
        let mut roots = vec![self.config.host_root.clone()];
        let mut path = None;
        if let Some(region) = &object.region {
            roots.push(PathBuf::from(format!("/proc/{}/root", region.tgid)));
            path = region.mapping.path.file_path();
        }
        debug_files::find_debug_file(&roots, build_id.as_deref(), path, &source)
    }

    /// Whether the files open, and one of `bytes` more if `adding`, go over
    /// either bound.
    fn over_bound(&self, adding: bool, bytes: u64) -> bool {
        self.registered.len() + usize::from(adding) > self.config.max_open_objects.max(1)
            || self.registered_bytes.saturating_add(bytes) > self.config.max_open_bytes
    }

    /// Closes a file opened over the bound, or else the least recently used
    /// one not named since tick `cold_before`; false if there is none.
    fn evict_least_recent(&mut self, cold_before: u64) -> bool {
        let Some(id) = self
            .registered
            .iter()
            .filter(|(_, entry)| entry.transient || entry.last_used <= cold_before)
            .min_by_key(|(_, entry)| (!entry.transient, entry.last_used))
            .map(|(id, _)| *id)
        else {
            return false;
        };
        self.evict(id);
        true
    }

    fn evict(&mut self, id: ObjectId) {
        if let Some(entry) = self.registered.remove(&id) {
            self.registered_bytes -= entry.bytes;
            // Before the descriptor closes (with `entry`): see the module
            // documentation.
            self.reader.evict_elf(&entry.path);
            self.stats.objects_evicted += 1;
        }
        self.evictions += 1;
        // What blazesym caches by other paths (debug-link targets, dwp
        // files) is not reached by path evictions: start afresh now and
        // then so it stays bounded too.
        if self.evictions >= 4 * self.config.max_open_objects.max(1) {
            self.rebuild();
        }
    }

    /// Drops blazesym's whole state (and with it every registration).
    fn rebuild(&mut self) {
        self.reader.rebuild();
        self.rebuilt();
    }

    /// blazesym's state was dropped: nothing is registered any more.
    fn rebuilt(&mut self) {
        self.registered.clear();
        self.registered_bytes = 0;
        self.evictions = 0;
        self.stats.rebuilds += 1;
    }
}

fn reader_options() -> ReaderOptions {
    ReaderOptions {
        // Paths are /proc/self/fd links that name one file for as long as
        // they are registered: no need to stat them on every call.
        auto_reload: false,
        // The agent finds separate debug files itself, under the host's
        // root and then the sampled process's (see `debug_files`): blazesym's
        // own search of the host's /usr/lib/debug would repeat the host half
        // of it for every binary without one, and would not check the file
        // against the binary's build-id or debug link.
        debug_dirs: Some(Vec::new()),
        max_name_bytes: MAX_NAME_BYTES,
    }
}

/// The frame a kallsyms symbol names.
fn kernel_frame(name: kernel::KernelName<'_>) -> KernelFrame {
    KernelFrame {
        module: name.module.cloned(),
        lines: Arc::new([FrameLine {
            function: bounded(name.function).into(),
            file: "".into(),
            line: 0,
        }]),
    }
}

/// What kallsyms' function symbols change with, cheaply: the modules
/// loaded (`/proc/modules`: their names, sizes and addresses, not their
/// users, which change with every container started) and, for this
/// kernel's own kallsyms, the BPF programs loaded (their ids), hashed.
/// The same value means kallsyms would name the same code (kprobes and
/// ftrace trampolines set since aside: an address no symbol names reads it
/// again anyway). `None` when the programs cannot be listed (listing them
/// takes `CAP_SYS_ADMIN`, which an agent with `CAP_BPF` alone lacks): a BPF
/// program has no extent in kallsyms, so a new one would be named after
/// the one below it, and only reading kallsyms again keeps that short.
fn kernel_code_fingerprint(config: &SymbolizerConfig) -> Option<u64> {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut hasher = foldhash::fast::FixedState::with_seed(0).build_hasher();
    if let Ok(text) = std::fs::read_to_string(&config.modules) {
        let mut modules: Vec<_> = kernel::parse_module_extents(&text).into_iter().collect();
        modules.sort_unstable();
        for (name, (start, end)) in modules {
            hasher.write(name.as_bytes());
            hasher.write_u64(start);
            hasher.write_u64(end);
        }
    }
    if config.kallsyms == Path::new(LIVE_KALLSYMS) {
        for id in bpf_program_ids()? {
            hasher.write_u32(id);
        }
    }
    Some(hasher.finish())
}

/// The ids of the BPF programs loaded, in order, up to a bound; `None`
/// when they cannot be listed (no privilege, no BPF).
fn bpf_program_ids() -> Option<Vec<u32>> {
    /// `BPF_PROG_GET_NEXT_ID`.
    const PROG_GET_NEXT_ID: libc::c_long = 11;
    /// Far past the programs of any node (Cilium's are thousands).
    const MAX_PROGRAMS: usize = 1 << 16;
    /// The command's part of `union bpf_attr`.
    #[repr(C)]
    struct NextId {
        start_id: u32,
        next_id: u32,
        open_flags: u32,
    }
    let mut ids = Vec::new();
    while ids.len() < MAX_PROGRAMS {
        let mut attr = NextId {
            start_id: ids.last().copied().unwrap_or(0),
            next_id: 0,
            open_flags: 0,
        };
        // SAFETY: bpf(2) reads and writes `attr`, a valid value of the
        // size passed, and nothing else.
        let result = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                PROG_GET_NEXT_ID,
                &raw mut attr,
                std::mem::size_of::<NextId>(),
            )
        };
        if result != 0 {
            // ENOENT: past the last one.
            return (std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT))
                .then_some(ids);
        }
        ids.push(attr.next_id);
    }
    Some(ids)
}

fn load_kallsyms(path: &Path, modules: &Path) -> (KernelSymbols, Instant) {
    let table = KernelSymbols::load(path, modules).unwrap_or_else(|err| {
        tracing::debug!("reading {}: {err}", path.display());
        KernelSymbols::default()
    });
    if table.is_empty() {
        tracing::warn!(
            "no kernel symbols in {} (kptr_restrict, or no permission): kernel frames go unnamed",
            path.display()
        );
    }
    (table, Instant::now())
}

/// `text` cut to at most [`MAX_NAME_BYTES`].
fn bounded(text: &str) -> &str {
    truncate_str(text, MAX_NAME_BYTES)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::{io::Write as _, process::Command};

    use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
    use stackscope_process_table::{FileKey, object_id::identify};
    use stackscope_test_fixtures::{
        Fixture, RunningProcess,
        split_debug::{SplitDebug, run_tool},
        symbol_file_offset as offset_of,
    };
    use std::collections::HashSet;

    use super::*;

    /// A symbolizer that reads no real kallsyms.
    fn symbolizer() -> Symbolizer {
        Symbolizer::new(SymbolizerConfig {
            kallsyms: PathBuf::from("/nonexistent/kallsyms"),
            ..SymbolizerConfig::default()
        })
    }

    fn object_file(path: &Path) -> Arc<ObjectFile> {
        let file = File::open(path).expect("opening the fixture");
        let metadata = file.metadata().expect("fstat");
        let id = identify(&file, &metadata).expect("identifying").id;
        Arc::new(ObjectFile::from_file(id, file))
    }

    fn functions(lines: &[FrameLine]) -> Vec<&str> {
        lines.iter().map(|line| &*line.function).collect()
    }

    /// The file offset of ELF virtual address `vaddr` in the file at `path`.
    fn file_offset_of(path: &Path, vaddr: u64) -> u64 {
        let data = std::fs::read(path).expect("reading");
        let elf = object::File::parse(&*data).expect("ELF");
        let segment = elf
            .segments()
            .find(|s| (s.address()..s.address() + s.size()).contains(&vaddr))
            .expect("a segment holding the address");
        vaddr - segment.address() + segment.file_range().0
    }

    #[test]
    #[ignore = "needs Debian's libc6-dbg (cargo xtask setup installs it): run by `cargo xtask test`"]
    fn libc_static_functions_are_named_from_debians_debug_package() {
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let data = std::fs::read(libc).expect("reading libc");
        let build_id: String = object::File::parse(&*data)
            .expect("ELF")
            .build_id()
            .expect("notes")
            .expect("libc has a build-id")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let debug = PathBuf::from(format!(
            "/usr/lib/debug/.build-id/{}/{}.debug",
            &build_id[..2],
            &build_id[2..]
        ));
        let debug_data = std::fs::read(&debug).unwrap_or_else(|err| {
            panic!(
                "{}: {err}: libc6-dbg is missing (cargo xtask setup installs it)",
                debug.display()
            )
        });
        let debug_elf = object::File::parse(&*debug_data).expect("ELF");
        // A function libc keeps to itself: not in its dynamic symbols.
        let exported: HashSet<String> = object::File::parse(&*data)
            .expect("ELF")
            .dynamic_symbols()
            .filter_map(|s| s.name().ok().map(str::to_owned))
            .collect();
        let (name, vaddr) = debug_elf
            .symbols()
            .find_map(|s| {
                let name = s.name().ok()?;
                (s.kind() == object::SymbolKind::Text
                    && s.is_local()
                    && s.size() > 16
                    && name == "check_one_fd"
                    && !exported.contains(name))
                .then(|| (name.to_owned(), s.address()))
            })
            .expect("check_one_fd in libc's debug file");
        let offset = file_offset_of(libc, vaddr + 4);

        let mut symbolizer = symbolizer();
        let found = symbolizer.user(&object_file(libc), &[offset]);
        assert_eq!(found[0].last().map(|l| &*l.function), Some(&*name));
        assert_eq!(symbolizer.stats().debug_files, 1);
    }

    #[test]
    fn minidebuginfo_names_a_stripped_binary() {
        let built = SplitDebug::from_source(
            "mini",
            "static volatile int sink;\n\
             __attribute__((noinline)) static void hidden_worker(void) { sink++; sink++; }\n\
             int main(void) { hidden_worker(); return 0; }\n",
            &["-O2"],
        );
        // MiniDebugInfo as distributions make it: the symbol table alone,
        // xz-compressed, in .gnu_debugdata of the stripped binary.
        let symbols = built.dir().join("mini.symbols");
        let binary = built.dir().join("mini.minidebuginfo");
        run_tool(
            Command::new("objcopy")
                .arg("--strip-debug")
                .arg(&built.debug)
                .arg(&symbols),
        );
        run_tool(Command::new("xz").arg("--keep").arg(&symbols));
        run_tool(
            Command::new("objcopy")
                .arg(format!(
                    "--add-section=.gnu_debugdata={}.xz",
                    symbols.display()
                ))
                .arg(&built.stripped)
                .arg(&binary),
        );
        let offset = offset_of(&built.full, "hidden_worker", 2);

        let found = symbolizer().user(&object_file(&binary), &[offset]);
        assert_eq!(functions(&found[0]), ["hidden_worker"]);
        // Without the section, nothing names it (the same build-id: a new
        // symbolizer, so the name cache does not answer).
        let found = symbolizer().user(&object_file(&built.stripped), &[offset]);
        assert!(found[0].is_empty(), "{found:?}");
    }

    #[test]
    fn files_with_a_build_id_are_left_to_the_collector_when_asked() {
        let fixture = Fixture::compile("call_chain", &[]);
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: PathBuf::from("/nonexistent/kallsyms"),
            name_files: false,
            ..SymbolizerConfig::default()
        });
        let object = object_file(&fixture.path);
        assert!(matches!(object.id, ObjectId::BuildId(..)));
        let found = symbolizer.user(&object, &[offset_of(&fixture.path, "c", 1)]);
        assert!(found[0].is_empty());
        let stats = symbolizer.stats();
        assert_eq!((stats.left_to_collector, stats.objects_opened), (1, 0));
    }

    #[test]
    fn names_c_functions_from_the_symbol_table_as_they_are() {
        let fixture = Fixture::compile("call_chain", &[]);
        let object = object_file(&fixture.path);
        let mut symbolizer = symbolizer();
        let names = ["c", "b", "a", "main"];
        let offsets: Vec<u64> = names
            .iter()
            .map(|name| offset_of(&fixture.path, name, 2))
            .collect();
        let found = symbolizer.user(&object, &offsets);
        let found: Vec<Vec<&str>> = found.iter().map(|lines| functions(lines)).collect();
        // Not `char`, `bool`, `signed char`: C names are not demangled.
        assert_eq!(found, names.map(|name| vec![name]));
        let stats = symbolizer.stats();
        assert_eq!((stats.named, stats.errors, stats.objects_opened), (4, 0, 1));
    }

    #[test]
    fn malformed_files_leave_frames_unnamed_without_panicking() {
        let fixture = Fixture::compile("call_chain", &[]);
        let elf = std::fs::read(&fixture.path).expect("reading the fixture");
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut symbolizer = symbolizer();
        let mut garbage = vec![0x5au8; 4096];
        garbage[..4].copy_from_slice(b"\x7fELF");
        let cases: [(&str, &[u8]); 4] = [
            ("empty", &[]),
            ("garbage", &garbage),
            ("header only", &elf[..64]),
            ("half", &elf[..elf.len() / 2]),
        ];
        for (i, (name, bytes)) in cases.into_iter().enumerate() {
            let path = dir.path().join(name);
            std::fs::File::create(&path)
                .and_then(|mut file| file.write_all(bytes))
                .expect("writing the file");
            let object = object_of(&path, 0, i as u64);
            for _ in 0..2 {
                let found = symbolizer.user(&object, &[0x1000, 0x1010]);
                assert_eq!(found.len(), 2, "{name}");
                // A truncated file may still name from what it holds; it
                // must just not panic, and never name garbage.
                for lines in &found {
                    assert!(lines.iter().all(|line| !line.function.is_empty()), "{name}");
                }
            }
        }
        let stats = symbolizer.stats();
        assert!(stats.errors > 0, "{stats:?}");
        assert_eq!(stats.panics, 0);
        assert_eq!(
            stats.objects_opened, 4,
            "failed files are not retried at once"
        );
    }

    #[test]
    fn a_process_that_exited_before_its_file_was_opened_costs_names_only() {
        // Killed on drop, should the test fail before it kills it itself.
        let mut process = RunningProcess::adopt(
            Command::new("sleep")
                .arg("60")
                .spawn()
                .expect("starting sleep"),
        );
        let pid = process.pid();
        // Until exec has mapped the new image, the child is a copy of this
        // process (or has no mappings at all).
        let started = Instant::now();
        let code = loop {
            let found = stackscope_process_table::maps::read_maps(pid)
                .unwrap_or_default()
                .into_iter()
                .find(|m| {
                    m.perms.exec
                        && m.path
                            .file_path()
                            .and_then(Path::file_name)
                            .is_some_and(|name| name == "sleep")
                });
            if let Some(code) = found {
                break code;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "sleep never started"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut table = stackscope_process_table::ProcessTable::default();
        let module = match table.lookup(pid, code.start) {
            Ok(Some(stackscope_process_table::Location::Object(object))) => ModuleFile {
                id: object.id,
                region: object.region,
            },
            other => panic!("{other:?}"),
        };
        process.child.kill().expect("killing sleep");
        process.child.wait().expect("reaping sleep");

        let object = Arc::new(ObjectFile::new(&module));
        let mut symbolizer = symbolizer();
        for _ in 0..2 {
            let found = symbolizer.user(&object, &[0x1000, 0x2000]);
            assert!(found.iter().all(|lines| lines.is_empty()));
        }
        let stats = symbolizer.stats();
        assert_eq!(
            (stats.errors, stats.objects_opened, stats.panics),
            (4, 0, 0)
        );
        assert!(object.open_now().is_err());
    }

    #[test]
    fn names_are_cached_by_object_and_offset_across_processes() {
        let fixture = Fixture::compile("call_chain", &[]);
        let first = object_file(&fixture.path);
        let offset = offset_of(&fixture.path, "b", 1);
        let mut symbolizer = symbolizer();
        assert_eq!(
            functions(&symbolizer.user(&first, &[offset, offset])[0]),
            ["b"]
        );
        // Another process's mapping of the same build: its file is not
        // even read.
        let empty = tempfile::NamedTempFile::new().expect("temporary file");
        let second = Arc::new(ObjectFile::from_file(
            first.id,
            File::open(empty.path()).expect("opening"),
        ));
        assert_eq!(functions(&symbolizer.user(&second, &[offset])[0]), ["b"]);
        let stats = symbolizer.stats();
        // One miss for the first call (both offsets are one lookup) and a
        // hit for the second.
        assert_eq!((stats.cache_misses, stats.cache_hits), (2, 1));
        assert_eq!(stats.objects_opened, 1);
    }

    /// `path` opened as the object of inode `ino` on device `dev`: one
    /// file as many objects.
    fn object_of(path: &Path, dev: u64, ino: u64) -> Arc<ObjectFile> {
        Arc::new(ObjectFile::from_file(
            ObjectId::FileKey(FileKey {
                dev,
                ino,
                size: 0,
                mtime_ns: 0,
            }),
            File::open(path).expect("opening"),
        ))
    }

    #[test]
    fn open_files_are_bounded() {
        let fixture = Fixture::compile("call_chain", &[]);
        let offset = offset_of(&fixture.path, "a", 1);
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: PathBuf::from("/nonexistent/kallsyms"),
            max_open_objects: 2,
            ..SymbolizerConfig::default()
        });
        // Each round a batch.
        for round in 0..3u64 {
            symbolizer.begin_batch(None);
            for copy in 0..4u64 {
                // Four versions of one file, as four objects.
                let object = object_of(&fixture.path, 1, copy);
                // Distinct offsets per round so every call reads the file.
                let found = symbolizer.user(&object, &[offset + round]);
                assert_eq!(functions(&found[0]), ["a"]);
                // One over the bound while the batch is built.
                assert!(symbolizer.registered.len() <= 3);
            }
            symbolizer.end_batch();
            assert_eq!(symbolizer.registered.len(), 2);
        }
        // The two that fit stayed open; the other two were opened again
        // each round.
        assert_eq!(symbolizer.stats().objects_opened, 4 + 2 + 2);
    }

    #[test]
    fn a_file_counts_what_blazesym_holds_of_it_not_its_size() {
        let held = |fixture: &Fixture| held_bytes(&File::open(&fixture.path).expect("opening"));
        let plain = Fixture::compile("call_chain", &[]);
        let size = std::fs::metadata(&plain.path).expect("its size").len();
        // Symbol tables only: a fraction of the file.
        assert!(
            held(&plain) > 0 && held(&plain) < size / 2,
            "{} of {size}",
            held(&plain)
        );
        // DWARF counts, and compressed sections count decompressed.
        let dwarf = Fixture::compile("call_chain", &["-g"]);
        let compressed = Fixture::compile("call_chain", &["-g", "-gz=zlib"]);
        assert!(held(&dwarf) > held(&plain));
        // (The assembler lays a few sections out differently: within 1%.)
        assert!(
            held(&compressed).abs_diff(held(&dwarf)) * 100 <= held(&dwarf),
            "{} compressed, {} not",
            held(&compressed),
            held(&dwarf)
        );
        let compressed_size = std::fs::metadata(&compressed.path).expect("its size").len();
        assert!(compressed_size < std::fs::metadata(&dwarf.path).expect("its size").len());
        // Not ELF: its size.
        let text = tempfile::NamedTempFile::new().expect("a temp file");
        std::fs::write(text.path(), b"not an ELF file").expect("writing");
        assert_eq!(held_bytes(text.as_file()), 15);
    }

    #[test]
    fn open_files_are_bounded_in_bytes_and_one_is_always_kept() {
        let fixture = Fixture::compile("call_chain", &[]);
        let offset = offset_of(&fixture.path, "a", 1);
        let size = held_bytes(&File::open(&fixture.path).expect("opening"));
        let object = |ino| object_of(&fixture.path, 1, ino);
        // Room for two copies by count, but bytes for one and a half: a
        // batch opens one over the bound and closes it at its end.
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: PathBuf::from("/nonexistent/kallsyms"),
            max_open_objects: 8,
            max_open_bytes: size + size / 2,
            ..SymbolizerConfig::default()
        });
        for ino in 0..4 {
            symbolizer.begin_batch(None);
            let found = symbolizer.user(&object(ino), &[offset]);
            assert_eq!(functions(&found[0]), ["a"]);
            symbolizer.end_batch();
            assert_eq!(symbolizer.registered.len(), 1);
            assert_eq!(symbolizer.registered_bytes, size);
        }
        // A bound smaller than any file still names it: one stays open.
        let mut tiny = Symbolizer::new(SymbolizerConfig {
            kallsyms: PathBuf::from("/nonexistent/kallsyms"),
            max_open_bytes: 1,
            ..SymbolizerConfig::default()
        });
        let found = tiny.user(&object(9), &[offset]);
        assert_eq!(functions(&found[0]), ["a"]);
        let mut sizes = Vec::new();
        tiny.state_sizes(&mut sizes);
        let files = sizes
            .iter()
            .find(|size| size.name == "symbolizer_files")
            .expect("the open files' size");
        assert_eq!(
            (files.entries, files.bytes),
            (Some(1), usize::try_from(size).ok())
        );
    }

    /// More files in steady use than fit: those that fit stay open from
    /// batch to batch and only the others are parsed again, where closing
    /// the least recently used would close each just before it is needed.
    #[test]
    fn files_named_in_every_batch_stay_and_only_what_does_not_fit_is_parsed_again() {
        let fixture = Fixture::compile("call_chain", &[]);
        let size = held_bytes(&File::open(&fixture.path).expect("opening"));
        let objects: Vec<_> = (0..4).map(|ino| object_of(&fixture.path, 1, ino)).collect();
        let bound = 2 * size + size / 2;
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: PathBuf::from("/nonexistent/kallsyms"),
            max_open_bytes: bound,
            ..SymbolizerConfig::default()
        });
        for batch in 0..5 {
            symbolizer.begin_batch(None);
            // A new byte of `a` each batch: the name cache does not answer.
            let offset = offset_of(&fixture.path, "a", batch + 1);
            // Each batch in another order.
            for at in 0..4 {
                let object = &objects[(at + batch as usize) % 4];
                assert_eq!(functions(&symbolizer.user(object, &[offset])[0]), ["a"]);
                assert!(symbolizer.registered_bytes <= bound + size, "batch {batch}");
            }
            symbolizer.end_batch();
            assert_eq!(symbolizer.registered.len(), 2, "batch {batch}");
            assert!(symbolizer.registered_bytes <= bound);
        }
        // Four files the first batch, two each batch after: the same two
        // stayed open (the least recently used would reopen all four).
        assert_eq!(symbolizer.stats().objects_opened, 4 + 4 * 2);
        // A lower bound closes files at the batch's end.
        symbolizer.set_max_open_bytes(size);
        symbolizer.begin_batch(None);
        symbolizer.end_batch();
        assert_eq!(
            (symbolizer.registered.len(), symbolizer.registered_bytes),
            (1, size)
        );
    }

    #[test]
    fn names_past_the_deadline_are_deferred_not_cached() {
        let fixture = Fixture::compile("call_chain", &[]);
        let object = object_file(&fixture.path);
        let offset = offset_of(&fixture.path, "c", 1);
        let mut symbolizer = symbolizer();
        symbolizer.begin_batch(Some(Instant::now()));
        assert!(symbolizer.user(&object, &[offset])[0].is_empty());
        assert_eq!(symbolizer.stats().deferred, 1);
        symbolizer.begin_batch(None);
        assert_eq!(functions(&symbolizer.user(&object, &[offset])[0]), ["c"]);
    }

    #[test]
    fn kernel_frames_are_named_from_kallsyms_with_their_module() {
        let mut kallsyms = tempfile::NamedTempFile::new().expect("temporary file");
        kallsyms
            .write_all(
                b"ffffffff81000000 T _text\n\
                  ffffffff81100000 T do_syscall_64\n\
                  ffffffffc0001000 t nft_do_chain\t[nf_tables]\n",
            )
            .expect("writing");
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: kallsyms.path().to_path_buf(),
            sys_root: PathBuf::from("/nonexistent"),
            // The test's modules, not this machine's.
            modules: PathBuf::from("/nonexistent/modules"),
            ..SymbolizerConfig::default()
        });
        let core = symbolizer.kernel(0xffff_ffff_8110_0042);
        assert_eq!(core.module, None);
        assert_eq!(functions(&core.lines), ["do_syscall_64"]);
        let module = symbolizer.kernel(0xffff_ffff_c000_1010);
        assert_eq!(module.module.as_deref(), Some("nf_tables"));
        assert_eq!(functions(&module.lines), ["nft_do_chain"]);
        assert!(symbolizer.kernel(0x1000).lines.is_empty());
        let stats = symbolizer.stats();
        assert_eq!((stats.kernel_named, stats.kernel_unnamed), (2, 1));
        assert_eq!(symbolizer.kernel_build_id(module.module.as_ref()), None);
    }

    #[test]
    fn an_address_that_stays_unnamed_reads_kallsyms_less_and_less_often() {
        let dir = tempfile::tempdir().expect("temp dir");
        let kallsyms = dir.path().join("kallsyms");
        let modules = dir.path().join("modules");
        // Past nf_tables' end: unnamed until a module is loaded there.
        std::fs::write(
            &kallsyms,
            "ffffffff81000000 T _text\nffffffffc0001000 t nft_do_chain\t[nf_tables]\n",
        )
        .expect("writing");
        std::fs::write(&modules, "nf_tables 8192 0 - Live 0xffffffffc0000000\n").expect("writing");
        let retry = Duration::from_millis(1);
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: kallsyms.clone(),
            modules: modules.clone(),
            kallsyms_retry: retry,
            sys_root: PathBuf::from("/nonexistent"),
            ..SymbolizerConfig::default()
        });
        let in_a_module = 0xffff_ffff_c000_3010;
        std::thread::sleep(retry);
        assert!(symbolizer.kernel(in_a_module).lines.is_empty());
        assert_eq!(symbolizer.stats().kernel_reloads, 1);
        assert_eq!(symbolizer.kernel_retry, 2 * retry);
        std::thread::sleep(2 * retry);
        symbolizer.kernel(in_a_module);
        assert_eq!(symbolizer.kernel_retry, 4 * retry);
        // A read that names the miss brings the retry back.
        std::fs::write(
            &kallsyms,
            "ffffffff81000000 T _text\nffffffffc0001000 t nft_do_chain\t[nf_tables]\n\
             ffffffffc0003000 t later_fn\t[later]\n",
        )
        .expect("writing");
        std::fs::write(
            &modules,
            "nf_tables 8192 0 - Live 0xffffffffc0000000\nlater 8192 0 - Live 0xffffffffc0003000\n",
        )
        .expect("writing");
        std::thread::sleep(4 * retry);
        assert_eq!(
            functions(&symbolizer.kernel(in_a_module).lines),
            ["later_fn"]
        );
        assert_eq!(symbolizer.kernel_retry, retry);

        // With kptr_restrict the table is empty and is never read again.
        std::fs::write(&kallsyms, "").expect("writing");
        let mut restricted = Symbolizer::new(SymbolizerConfig {
            kallsyms,
            kallsyms_retry: Duration::ZERO,
            sys_root: PathBuf::from("/nonexistent"),
            ..SymbolizerConfig::default()
        });
        restricted.kernel(0x1000);
        assert_eq!(restricted.stats().kernel_reloads, 0);
    }

    #[test]
    fn kallsyms_is_read_again_when_due_only_if_modules_came_or_went() {
        let dir = tempfile::tempdir().expect("temp dir");
        let kallsyms = dir.path().join("kallsyms");
        let modules = dir.path().join("modules");
        std::fs::write(
            &kallsyms,
            "ffffffff81000000 T _text\nffffffffc0001000 t nft_do_chain\t[nf_tables]\n",
        )
        .expect("writing");
        std::fs::write(&modules, "nf_tables 8192 0 - Live 0xffffffffc0000000\n").expect("writing");
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: kallsyms.clone(),
            modules: modules.clone(),
            kallsyms_reload: Duration::ZERO,
            sys_root: PathBuf::from("/nonexistent"),
            ..SymbolizerConfig::default()
        });
        // Due at every batch, but nothing came or went: the table stands
        // (a kallsyms changed behind the modules' back is not read).
        std::fs::write(&kallsyms, "ffffffff81000000 T renamed\n").expect("writing");
        for _ in 0..3 {
            symbolizer.begin_batch(None);
        }
        assert_eq!(symbolizer.stats().kernel_reloads, 0);
        assert_eq!(
            functions(&symbolizer.kernel(0xffff_ffff_8100_0010).lines),
            ["_text"]
        );
        // A module loaded: read again at the next batch.
        std::fs::write(
            &modules,
            "nf_tables 8192 0 - Live 0xffffffffc0000000\nlater 4096 0 - Live 0xffffffffc0003000\n",
        )
        .expect("writing");
        symbolizer.begin_batch(None);
        assert_eq!(symbolizer.stats().kernel_reloads, 1);
        assert_eq!(
            functions(&symbolizer.kernel(0xffff_ffff_8100_0010).lines),
            ["renamed"]
        );
        symbolizer.begin_batch(None);
        assert_eq!(symbolizer.stats().kernel_reloads, 1);
    }

    #[test]
    fn a_module_loaded_later_is_read_again_not_named_after_its_neighbour() {
        let dir = tempfile::tempdir().expect("temp dir");
        let kallsyms = dir.path().join("kallsyms");
        let modules = dir.path().join("modules");
        std::fs::write(
            &kallsyms,
            "ffffffff81000000 T _text\nffffffffc0001000 t nft_do_chain\t[nf_tables]\n",
        )
        .expect("writing");
        std::fs::write(&modules, "nf_tables 8192 0 - Live 0xffffffffc0000000\n").expect("writing");
        let mut symbolizer = Symbolizer::new(SymbolizerConfig {
            kallsyms: kallsyms.clone(),
            modules: modules.clone(),
            kallsyms_retry: Duration::ZERO,
            sys_root: PathBuf::from("/nonexistent"),
            ..SymbolizerConfig::default()
        });
        assert_eq!(
            functions(&symbolizer.kernel(0xffff_ffff_c000_1f00).lines),
            ["nft_do_chain"]
        );
        // Past nf_tables' end: a module loaded after kallsyms was read.
        assert!(symbolizer.kernel(0xffff_ffff_c000_3010).lines.is_empty());
        std::fs::write(
            &kallsyms,
            "ffffffff81000000 T _text\nffffffffc0001000 t nft_do_chain\t[nf_tables]\n\
             ffffffffc0003000 t later_fn\t[later]\n",
        )
        .expect("writing");
        std::fs::write(
            &modules,
            "nf_tables 8192 0 - Live 0xffffffffc0000000\nlater 4096 0 - Live 0xffffffffc0003000\n",
        )
        .expect("writing");
        let frame = symbolizer.kernel(0xffff_ffff_c000_3010);
        assert_eq!(functions(&frame.lines), ["later_fn"]);
        assert_eq!(frame.module.as_deref(), Some("later"));
        assert_eq!(symbolizer.stats().kernel_reloads, 2);
    }

    #[test]
    fn the_vdso_is_named_from_the_agents_own_copy() {
        let Some((start, image)) = stackscope_process_table::maps::own_vdso_image() else {
            return;
        };
        let elf = object::File::parse(image).expect("the vDSO is ELF");
        let (name, address) = elf
            .dynamic_symbols()
            .find_map(|s| {
                let name = s.name().ok()?;
                (s.kind() == object::SymbolKind::Text && name.contains("clock_gettime"))
                    .then(|| (name.to_string(), s.address()))
            })
            .expect("clock_gettime in the vDSO");
        // The image is linked at 0 (offsets are addresses) on x86_64.
        let _ = start;
        let found = symbolizer().vdso(&[address + 1]);
        assert!(
            found[0].iter().any(|line| *line.function == name),
            "{found:?}, expected {name}"
        );
    }
}
