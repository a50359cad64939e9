//! Names of JIT-compiled code from perf map files (and jitdump files).
//!
//! A JIT that runs with perf support (`node --perf-basic-prof`, the JVM with
//! perf-map-agent, .NET with `DOTNET_PerfMapEnabled=1`, LuaJIT, ...) appends
//! one line per compiled function to `/tmp/perf-<pid>.map`:
//! `START SIZE NAME`, start and size in hex. The pid is the process's pid
//! in its own pid namespace and `/tmp` is its own, so the file is reached
//! through `/proc/<pid>/root` with the pid `NSpid` gives.
//!
//! Two halves, on two threads, so that naming a frame never waits for a
//! file:
//! - [`PerfMaps`], on the sampling thread, owns the entries (a later line
//!   for an address replaces what covered it: JITs reuse code space) and
//!   names JIT frames at sample time from what has been read so far: the
//!   entry that covers the address. A frame no entry covers yet is named
//!   later ([`PerfMaps::name_later`], when the caller's interval ends), so
//!   that a read asked for by the frame itself can still name it. It owns the bounds
//!   ([`MAX_PROCESSES`] maps, at most [`MAX_TOTAL_BYTES`] of entries over
//!   all of them, [`MAX_PROCESS_BYTES`] for one), forgetting a process when
//!   it exits or its pid turns out to be another process's, and when to
//!   read on: at most once per [`REFRESH_INTERVAL`] while a process's JIT
//!   frames are sampled, hit or miss (the JIT may have reused the space),
//!   asked for as [`JitRequest`]s.
//! - [`PerfMapReader`], on the metadata worker, owns the files: it finds
//!   and opens each process's perf map and jitdump file and reads only the
//!   bytes appended since its last read (at most [`MAX_READ_PER_REFRESH`]
//!   of each per read, so a 2 GB map is taken in over many reads), and
//!   answers with what they added ([`JitUpdate`]).
//!
//! Does not own which frames are JIT code (the walker decides), when a
//! process exits (the run loop says) nor what an unnamed frame is called
//! ([`unnamed`] is the usual choice).
//!
//! Malformed lines are skipped and counted; an incomplete last line is kept
//! until the JIT finishes writing it. A process that writes a jitdump file
//! instead (`node --perf-prof`, JVM and .NET agents) has it found through
//! its maps (the JIT maps it executable) and read the same way, by
//! [`crate::jitdump`].

use stackscope_telemetry::probes::{self, Probe};
use std::{
    collections::BTreeMap,
    fs::File,
    io::{Read as _, Seek as _, SeekFrom},
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use foldhash::{HashMap, HashMapExt as _};

use crate::jitdump::{DumpEvent, DumpReader};
use stackscope_telemetry::StateSize;

/// Shortest time between two reads of one process's map: a frame that no
/// entry covers (code the JIT has not described yet, or never will) costs
/// at most this many reads.
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(200);

/// Most bytes read from one file per read: a huge map is taken in over
/// several reads, so one answer stays small.
pub const MAX_READ_PER_REFRESH: usize = 4 << 20;

/// How long an unanswered read is waited for (see
/// [`PerfMaps::awaits_answers`]): far longer than a read takes (about 10 ms
/// for node's 2,800 entries in a debug build under load).
const ANSWER_WAIT: Duration = Duration::from_secs(1);

/// Processes whose maps are kept; beyond, the least recently used goes.
/// The reader keeps as many open files, likewise.
pub const MAX_PROCESSES: usize = 256;

/// Bytes of entries (names plus bookkeeping) kept over all processes.
/// Beyond, the least recently used other process's map goes; when the
/// process in hand alone fills it, its further lines are skipped and
/// counted.
pub const MAX_TOTAL_BYTES: usize = 64 << 20;

/// Bytes of entries one process may hold: a quarter of the total, so one
/// process with an endless map cannot evict every other JIT's names (and
/// then have its own read again from the start when they come back).
pub const MAX_PROCESS_BYTES: usize = MAX_TOTAL_BYTES / 4;

/// Longest name kept; longer ones are cut (on a character boundary).
pub const MAX_NAME_BYTES: usize = 1024;

/// Requests kept for the owner to take: beyond, reads are not asked for
/// (the next due frame asks again) and forgotten processes' files wait for
/// the reader's own bound.
const MAX_REQUESTS: usize = 2 * MAX_PROCESSES;

/// Shortest time between two looks for a process's jitdump file (its
/// maps are read to find it).
const DUMP_LOOK_INTERVAL: Duration = Duration::from_secs(2);

/// Lines longer than this are malformed (skipped), so an endless line
/// cannot grow the pending buffer without bound.
const MAX_LINE_BYTES: usize = MAX_NAME_BYTES + 64;

/// What an entry costs besides its name: the map node and the `Arc`.
const ENTRY_OVERHEAD: usize = 64;

/// Counters since the maps were created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PerfMapStats {
    /// JIT frames named from an entry, and those no entry covered.
    pub named: u64,
    pub unnamed: u64,
    /// Lines read into entries, and lines skipped as malformed.
    pub lines: u64,
    pub malformed: u64,
    /// Lines skipped because the entries were at their byte bound (the
    /// total, or the process's share of it).
    pub over_budget: u64,
    /// Maps dropped to stay within the bounds.
    pub evicted: u64,
}

/// What [`PerfMaps`] asks of the [`PerfMapReader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JitRequest {
    /// Read on in process `tgid`'s files (the process started at
    /// `started`: another start time is another process, read afresh).
    Read { tgid: u32, started: u64 },
    /// Close process `tgid`'s files: it exited, or its map was dropped.
    Forget { tgid: u32 },
    /// Close every file (exit records were lost).
    ForgetAll,
}

/// What one read of a process's files added, to apply in order.
#[derive(Debug, Default)]
pub struct JitUpdate {
    pub tgid: u32,
    pub started: u64,
    /// The perf map was truncated: what was read before describes code
    /// that is gone.
    pub restart: bool,
    pub events: Vec<DumpEvent>,
    /// Lines (or jitdump streams) found malformed.
    pub malformed: u64,
    /// When the files were read.
    pub read_at: Option<Instant>,
}

/// One compiled function.
#[derive(Debug, Clone)]
struct Entry {
    end: u64,
    name: Arc<str>,
}

/// What is known of one process's JIT code.
#[derive(Debug)]
struct PerfMap {
    /// The process's start time: with the pid, its identity.
    started: u64,
    entries: BTreeMap<u64, Entry>,
    bytes: usize,
    /// When a read was last asked for (`None`: never).
    last_asked: Option<Instant>,
    /// Whether the last read asked for has not been answered yet.
    unanswered: bool,
    last_used: Instant,
}

impl PerfMap {
    fn new(started: u64, now: Instant) -> Self {
        Self {
            started,
            entries: BTreeMap::new(),
            bytes: 0,
            last_asked: None,
            unanswered: false,
            last_used: now,
        }
    }

    /// Whether this is another process's map than one started at
    /// `started` (0: unknown, no verdict).
    fn is_other_process(&self, started: u64) -> bool {
        started != 0 && self.started != 0 && self.started != started
    }

    fn find(&self, address: u64) -> Option<&Arc<str>> {
        let (_, entry) = self.entries.range(..=address).next_back()?;
        (address < entry.end).then_some(&entry.name)
    }

    /// Adds an entry; whatever it overlaps goes (the JIT reused the space).
    fn insert(&mut self, start: u64, end: u64, name: Arc<str>) {
        let overlapping: Vec<u64> = self
            .entries
            .range(..end)
            .rev()
            .take_while(|(_, entry)| entry.end > start)
            .map(|(&start, _)| start)
            .collect();
        // Entries are disjoint, so walking down from `end` the overlapping
        // ones come first and the first that ends at or below `start` ends
        // the run.
        for old in overlapping {
            if let Some(entry) = self.entries.remove(&old) {
                self.bytes -= entry_bytes(&entry.name);
            }
        }
        self.bytes += entry_bytes(&name);
        self.entries.insert(start, Entry { end, name });
    }
}

/// `[jit] <comm>`: the name of JIT code no entry describes, by the thread
/// that ran it.
pub fn unnamed(comm: &[u8; agent_common::COMM_LEN]) -> Arc<str> {
    format!("[jit] {}", agent_common::comm_str(comm)).into()
}

fn entry_bytes(name: &str) -> usize {
    name.len() + ENTRY_OVERHEAD
}

/// The entries half; see the module documentation.
#[derive(Debug)]
pub struct PerfMaps {
    maps: HashMap<u32, PerfMap>,
    total_bytes: usize,
    max_total_bytes: usize,
    max_process_bytes: usize,
    requests: Vec<JitRequest>,
    stats: PerfMapStats,
}

impl Default for PerfMaps {
    fn default() -> Self {
        Self::with_budget(MAX_TOTAL_BYTES, MAX_PROCESS_BYTES)
    }
}

impl PerfMaps {
    /// Maps kept within `max_total_bytes` of entries, each process's within
    /// `max_process_bytes`.
    pub fn with_budget(max_total_bytes: usize, max_process_bytes: usize) -> Self {
        Self {
            maps: HashMap::new(),
            total_bytes: 0,
            max_total_bytes,
            max_process_bytes: max_process_bytes.min(max_total_bytes),
            requests: Vec::new(),
            stats: PerfMapStats::default(),
        }
    }

    pub fn stats(&self) -> PerfMapStats {
        self.stats
    }

    /// Processes whose maps are kept now.
    pub fn tracked(&self) -> usize {
        self.maps.len()
    }

    pub fn tgids_into(&self, out: &mut Vec<u32>) {
        out.extend(self.maps.keys());
    }

    /// The maps kept: processes and bytes of entries.
    pub fn state_size(&self) -> StateSize {
        StateSize::entries("perf_maps", self.maps.len(), Some(MAX_PROCESSES))
            .with_bytes(self.total_bytes, Some(self.max_total_bytes))
    }

    /// The name of the JIT code at `address` in process `tgid` (started at
    /// `started`, 0 if unknown): the entry read so far that covers it.
    /// Asks for a read when one is due ([`Self::take_requests`]), hit or
    /// miss. A miss is not counted: the caller names the frame later.
    pub fn name(
        &mut self,
        tgid: u32,
        started: u64,
        address: u64,
        now: Instant,
    ) -> Option<Arc<str>> {
        probes::count(Probe::Process);
        let known = self
            .maps
            .get(&tgid)
            .map(|map| map.is_other_process(started));
        if known != Some(false) {
            if known == Some(true) {
                self.forget(tgid);
            }
            self.make_room();
            self.maps.insert(tgid, PerfMap::new(started, now));
        }
        probes::count(Probe::Process);
        let Some(map) = self.maps.get_mut(&tgid) else {
            unreachable!("inserted above");
        };
        map.last_used = now;
        // Read on when due, hit or miss: a JIT that reused the code space
        // has written the new function's line, which replaces the old. A
        // map that fills its share would only have lines skipped.
        let due = map
            .last_asked
            .is_none_or(|last| now.saturating_duration_since(last) >= REFRESH_INTERVAL);
        if due
            && map.bytes + entry_bytes("") <= self.max_process_bytes
            && self.requests.len() < MAX_REQUESTS
        {
            map.last_asked = Some(now);
            map.unanswered = true;
            self.requests.push(JitRequest::Read {
                tgid,
                started: map.started,
            });
        }
        let name = Arc::clone(map.find(address)?);
        self.stats.named += 1;
        Some(name)
    }

    /// The name of JIT code that [`Self::name`] missed, from what has been
    /// read since (the read that miss asked for, when it has come): counted
    /// as `frames` frames named, or unnamed. Asks for no read.
    pub fn name_later(
        &mut self,
        tgid: u32,
        started: u64,
        address: u64,
        frames: u64,
    ) -> Option<Arc<str>> {
        probes::count(Probe::Process);
        let name = self
            .maps
            .get(&tgid)
            .filter(|map| !map.is_other_process(started))
            .and_then(|map| map.find(address))
            .map(Arc::clone);
        match name {
            Some(_) => self.stats.named += frames,
            None => self.stats.unnamed += frames,
        }
        name
    }

    /// Whether a read asked for less than [`ANSWER_WAIT`] before `now` has
    /// not been answered yet: frames [`Self::name`] missed may be named
    /// by it. An older one is taken as lost (dropped with a full queue; the
    /// next frame named asks again).
    pub fn awaits_answers(&self, now: Instant) -> bool {
        self.maps.values().any(|map| {
            map.unanswered
                && map
                    .last_asked
                    .is_some_and(|asked| now.saturating_duration_since(asked) < ANSWER_WAIT)
        })
    }

    /// The reads and forgets asked for since the last call, for the
    /// [`PerfMapReader`].
    pub fn take_requests(&mut self) -> Vec<JitRequest> {
        std::mem::take(&mut self.requests)
    }

    /// Applies what the reader read. An answer for another process than
    /// the one kept under its pid is dropped; one for a process without a
    /// map (a read done with its maps, before any of its JIT frames was
    /// named) makes one.
    pub fn apply(&mut self, updates: Vec<JitUpdate>) {
        for update in updates {
            self.stats.malformed += update.malformed;
            let tgid = update.tgid;
            match self
                .maps
                .get(&tgid)
                .map(|map| map.is_other_process(update.started))
            {
                Some(true) => continue,
                Some(false) => {}
                None => {
                    self.make_room();
                    let read_at = update.read_at.unwrap_or_else(Instant::now);
                    let mut map = PerfMap::new(update.started, read_at);
                    // Just read: the first frame named need not ask again.
                    map.last_asked = update.read_at;
                    self.maps.insert(tgid, map);
                }
            }
            let Some(map) = self.maps.get_mut(&tgid) else {
                continue;
            };
            map.unanswered = false;
            if update.restart {
                self.total_bytes -= map.bytes;
                map.entries.clear();
                map.bytes = 0;
            }
            for event in update.events {
                match event {
                    DumpEvent::Load { start, end, name } => self.add_entry(tgid, start, end, &name),
                    DumpEvent::Move { from, to, size } => {
                        let Some(name) = self
                            .maps
                            .get(&tgid)
                            .and_then(|map| map.entries.get(&from).map(|e| Arc::clone(&e.name)))
                        else {
                            continue;
                        };
                        if let Some(end) = to.checked_add(size).filter(|_| size > 0) {
                            self.add_entry(tgid, to, end, &name);
                        }
                    }
                }
            }
        }
    }

    /// The process exited: its map goes.
    pub fn forget(&mut self, tgid: u32) {
        if let Some(map) = self.maps.remove(&tgid) {
            self.total_bytes -= map.bytes;
            if self.requests.len() < MAX_REQUESTS {
                self.requests.push(JitRequest::Forget { tgid });
            }
        }
    }

    /// Every process's map goes (exit records were lost).
    pub fn forget_all(&mut self) {
        self.maps.clear();
        self.total_bytes = 0;
        self.requests.clear();
        self.requests.push(JitRequest::ForgetAll);
    }

    fn make_room(&mut self) {
        if self.maps.len() < MAX_PROCESSES {
            return;
        }
        if let Some(oldest) = self.least_recently_used(None) {
            self.forget(oldest);
            self.stats.evicted += 1;
        }
    }

    fn least_recently_used(&self, except: Option<u32>) -> Option<u32> {
        self.maps
            .iter()
            .filter(|(tgid, _)| Some(**tgid) != except)
            .min_by_key(|(_, map)| map.last_used)
            .map(|(&tgid, _)| tgid)
    }

    /// Adds one function of `tgid`'s JIT code, within the byte budget.
    fn add_entry(&mut self, tgid: u32, start: u64, end: u64, name: &str) {
        let name = floor_char_boundary(name, MAX_NAME_BYTES);
        let cost = entry_bytes(name);
        let own = self.maps.get(&tgid).map_or(0, |map| map.bytes);
        if own + cost > self.max_process_bytes {
            self.stats.over_budget += 1;
            return;
        }
        while self.total_bytes + cost > self.max_total_bytes {
            match self.least_recently_used(Some(tgid)) {
                Some(other) => {
                    self.forget(other);
                    self.stats.evicted += 1;
                }
                None => break,
            }
        }
        if self.total_bytes + cost > self.max_total_bytes {
            self.stats.over_budget += 1;
            return;
        }
        let Some(map) = self.maps.get_mut(&tgid) else {
            return;
        };
        let before = map.bytes;
        map.insert(start, end, name.into());
        self.total_bytes = self.total_bytes + map.bytes - before;
        self.stats.lines += 1;
    }
}

/// A jitdump file being read.
#[derive(Debug)]
struct Dump {
    file: File,
    offset: u64,
    reader: DumpReader,
}

/// What the reader keeps of one process's files.
#[derive(Debug)]
struct MapFiles {
    started: u64,
    /// The map, open since first found: it stays readable after the
    /// process exits, for the samples still to be named.
    file: Option<File>,
    /// Bytes of the file consumed so far (complete lines).
    offset: u64,
    /// The start of a line the JIT has not finished writing.
    partial: Vec<u8>,
    /// In the middle of an overlong line: skip to its end.
    skipping: bool,
    /// The process's jitdump file, once found, and when it was last
    /// looked for.
    dump: Option<Dump>,
    dump_looked_for: Option<Instant>,
    last_used: Instant,
}

impl MapFiles {
    fn new(started: u64, now: Instant) -> Self {
        Self {
            started,
            file: None,
            offset: 0,
            partial: Vec::new(),
            skipping: false,
            dump: None,
            dump_looked_for: None,
            last_used: now,
        }
    }
}

/// The files half; see the module documentation.
#[derive(Debug)]
pub struct PerfMapReader {
    proc_root: PathBuf,
    files: HashMap<u32, MapFiles>,
    buffer: Vec<u8>,
}

impl PerfMapReader {
    pub fn new(proc_root: &Path) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            files: HashMap::new(),
            buffer: Vec::new(),
        }
    }

    /// Processes whose files are kept open now.
    pub fn tracked(&self) -> usize {
        self.files.len()
    }

    /// Carries out `requests` in order; the reads' answers.
    pub fn serve(&mut self, requests: Vec<JitRequest>, now: Instant) -> Vec<JitUpdate> {
        let mut updates = Vec::new();
        for request in requests {
            match request {
                JitRequest::Read { tgid, started } => updates.push(self.read(tgid, started, now)),
                JitRequest::Forget { tgid } => {
                    self.files.remove(&tgid);
                }
                JitRequest::ForgetAll => self.files.clear(),
            }
        }
        updates
    }

    /// Reads what process `tgid` (started at `started`, 0 if unknown)
    /// appended since the last read, to its perf map and to its jitdump
    /// file.
    pub fn read(&mut self, tgid: u32, started: u64, now: Instant) -> JitUpdate {
        if self
            .files
            .get(&tgid)
            .is_some_and(|f| f.started != 0 && started != 0 && f.started != started)
        {
            self.files.remove(&tgid);
        }
        if !self.files.contains_key(&tgid) && self.files.len() >= MAX_PROCESSES {
            let oldest = self
                .files
                .iter()
                .min_by_key(|(_, files)| files.last_used)
                .map(|(&tgid, _)| tgid);
            if let Some(oldest) = oldest {
                self.files.remove(&oldest);
            }
        }
        let files = self
            .files
            .entry(tgid)
            .or_insert_with(|| MapFiles::new(started, now));
        files.last_used = now;
        let mut update = JitUpdate {
            tgid,
            started,
            read_at: Some(now),
            ..JitUpdate::default()
        };
        read_perf_map(&self.proc_root, tgid, files, &mut self.buffer, &mut update);
        read_jitdump(
            &self.proc_root,
            tgid,
            files,
            &mut self.buffer,
            &mut update,
            now,
        );
        update
    }
}

fn read_perf_map(
    proc_root: &Path,
    tgid: u32,
    files: &mut MapFiles,
    buffer: &mut Vec<u8>,
    update: &mut JitUpdate,
) {
    if files.file.is_none() {
        files.file = open_perf_map(proc_root, tgid);
    }
    let Some(file) = files.file.as_mut() else {
        return;
    };
    let Ok(metadata) = file.metadata() else {
        return;
    };
    if metadata.len() < files.offset {
        // Truncated: what was read describes code that is gone; read it
        // from the start.
        // The jitdump file's entries go with them: it is read again too.
        update.restart = true;
        files.offset = 0;
        files.partial.clear();
        files.skipping = false;
        files.dump = None;
        files.dump_looked_for = None;
    }
    let Some(read) = read_appended(file, files.offset, metadata.len(), buffer) else {
        return;
    };
    files.offset += read as u64;
    let mut bytes = std::mem::take(&mut files.partial);
    bytes.extend_from_slice(&buffer[..read]);
    if files.skipping {
        // The rest of an overlong line: up to its newline it is not the
        // start of one.
        match bytes.iter().position(|&b| b == b'\n') {
            Some(end) => {
                bytes.drain(..=end);
                files.skipping = false;
            }
            None => bytes.clear(),
        }
    }
    let complete = bytes
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |at| at + 1);
    let (lines, rest) = bytes.split_at(complete);
    if rest.len() > MAX_LINE_BYTES {
        // No newline in sight: not a perf map line; skip to the next one.
        update.malformed += 1;
        files.skipping = true;
    } else {
        files.partial = rest.to_vec();
    }
    for line in lines.split(|&b| b == b'\n') {
        if line.is_empty() {
            continue;
        }
        let parsed = (line.len() <= MAX_LINE_BYTES)
            .then(|| parse_line(line))
            .flatten();
        match parsed {
            Some((start, end, name)) => update.events.push(DumpEvent::Load {
                start,
                end,
                name: name.to_owned(),
            }),
            None => update.malformed += 1,
        }
    }
    *buffer = bytes;
}

fn read_jitdump(
    proc_root: &Path,
    tgid: u32,
    files: &mut MapFiles,
    buffer: &mut Vec<u8>,
    update: &mut JitUpdate,
    now: Instant,
) {
    if files.dump.is_none()
        && files
            .dump_looked_for
            .is_none_or(|last| now.saturating_duration_since(last) >= DUMP_LOOK_INTERVAL)
    {
        files.dump_looked_for = Some(now);
        files.dump = open_jitdump(proc_root, tgid).map(|file| Dump {
            file,
            offset: 0,
            reader: DumpReader::default(),
        });
    }
    let Some(dump) = files.dump.as_mut() else {
        return;
    };
    if dump.reader.is_broken() {
        return;
    }
    let Ok(metadata) = dump.file.metadata() else {
        return;
    };
    let Some(read) = read_appended(&mut dump.file, dump.offset, metadata.len(), buffer) else {
        return;
    };
    dump.offset += read as u64;
    dump.reader
        .feed(&buffer[..read], |event| update.events.push(event));
    if dump.reader.is_broken() {
        update.malformed += 1;
    }
}

/// Reads what `file` (now `len` bytes long) holds past `offset`, at most
/// [`MAX_READ_PER_REFRESH`] of it, into `buffer`: how many bytes, `None`
/// when there are none or the read failed.
fn read_appended(file: &mut File, offset: u64, len: u64, buffer: &mut Vec<u8>) -> Option<usize> {
    let want = usize::try_from(len.saturating_sub(offset))
        .unwrap_or(usize::MAX)
        .min(MAX_READ_PER_REFRESH);
    if want == 0 {
        return None;
    }
    buffer.clear();
    buffer.resize(want, 0);
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| read_up_to(file, buffer))
        .ok()
}

/// `read` until `buffer` is full or the end of the file.
fn read_up_to(file: &mut File, buffer: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        match file.read(&mut buffer[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(filled)
}

/// The jitdump file `tgid` writes, opened through its root: the JIT maps
/// it executable (how perf finds it too), as `jit-<pid>.dump` wherever the
/// process was told to write.
fn open_jitdump(proc_root: &Path, tgid: u32) -> Option<File> {
    let process = proc_root.join(tgid.to_string());
    let maps = std::fs::read(process.join("maps")).ok()?;
    let path = maps.split(|&b| b == b'\n').find_map(|line| {
        let path = &line[line.iter().position(|&b| b == b'/')?..];
        let name = path.rsplit(|&b| b == b'/').next()?;
        (name.starts_with(b"jit-") && name.ends_with(b".dump")).then_some(path)
    })?;
    let relative = std::ffi::OsStr::from_bytes(&path[1..]);
    File::open(process.join("root").join(relative)).ok()
}

/// `/proc/<tgid>/root/tmp/perf-<pid in its namespace>.map`, opened.
fn open_perf_map(proc_root: &Path, tgid: u32) -> Option<File> {
    let process = proc_root.join(tgid.to_string());
    let status = std::fs::read(process.join("status")).ok()?;
    let pid = namespace_pid(&status).unwrap_or(tgid);
    File::open(process.join(format!("root/tmp/perf-{pid}.map"))).ok()
}

/// The pid in the process's own (innermost) pid namespace: the last field
/// of `NSpid:` in `/proc/<pid>/status`.
fn namespace_pid(status: &[u8]) -> Option<u32> {
    let line = status
        .split(|&b| b == b'\n')
        .find_map(|line| line.strip_prefix(b"NSpid:"))?;
    let last = line
        .split(|b| b.is_ascii_whitespace())
        .rfind(|f| !f.is_empty())?;
    std::str::from_utf8(last).ok()?.parse().ok()
}

/// `START SIZE NAME`: start and size in hex (with or without `0x`), the
/// name the rest of the line. `None` for anything else, an empty range, or
/// one that wraps.
fn parse_line(line: &[u8]) -> Option<(u64, u64, &str)> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut fields = line.splitn(3, |&b| b == b' ');
    let start = parse_hex(fields.next()?)?;
    let size = parse_hex(fields.next()?)?;
    let name = std::str::from_utf8(fields.next()?).ok()?.trim();
    if name.is_empty() || size == 0 {
        return None;
    }
    let end = start.checked_add(size)?;
    Some((start, end, floor_char_boundary(name, MAX_NAME_BYTES)))
}

fn parse_hex(field: &[u8]) -> Option<u64> {
    let digits = field
        .strip_prefix(b"0x")
        .or_else(|| field.strip_prefix(b"0X"))
        .unwrap_or(field);
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

fn floor_char_boundary(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    const COMM: [u8; 16] = *b"node\0\0\0\0\0\0\0\0\0\0\0\0";

    /// A fake proc root holding process `tgid` whose root is `dir`.
    struct FakeProcess {
        proc_root: tempfile::TempDir,
        map: PathBuf,
    }

    fn fake_process(tgid: u32, namespace_pid: u32) -> FakeProcess {
        let proc_root = tempfile::tempdir().expect("temp dir");
        let process = proc_root.path().join(tgid.to_string());
        std::fs::create_dir_all(process.join("root/tmp")).expect("dirs");
        std::fs::write(
            process.join("status"),
            format!("Name:\tnode\nNSpid:\t{tgid}\t{namespace_pid}\nPPid:\t1\n"),
        )
        .expect("status");
        let map = process.join(format!("root/tmp/perf-{namespace_pid}.map"));
        FakeProcess { proc_root, map }
    }

    /// Both halves, joined as the run loop joins them.
    struct Joined {
        maps: PerfMaps,
        reader: PerfMapReader,
    }

    impl Joined {
        fn new(proc_root: &Path) -> Self {
            Self::with_budget(proc_root, MAX_TOTAL_BYTES, MAX_PROCESS_BYTES)
        }

        fn with_budget(proc_root: &Path, total: usize, process: usize) -> Self {
            Self {
                maps: PerfMaps::with_budget(total, process),
                reader: PerfMapReader::new(proc_root),
            }
        }

        /// A frame named on the sampling thread, from what was read so far
        /// (a miss named at once, as unnamed).
        fn name(&mut self, tgid: u32, started: u64, address: u64, now: Instant) -> Arc<str> {
            self.maps
                .name(tgid, started, address, now)
                .or_else(|| self.maps.name_later(tgid, started, address, 1))
                .unwrap_or_else(|| unnamed(&COMM))
        }

        /// The reader answers what was asked; how many reads it did.
        fn answer(&mut self, now: Instant) -> usize {
            let updates = self.reader.serve(self.maps.take_requests(), now);
            let reads = updates.len();
            self.maps.apply(updates);
            reads
        }

        /// A frame named after the read its first sight asked for.
        fn named(&mut self, tgid: u32, started: u64, address: u64, now: Instant) -> Arc<str> {
            self.name(tgid, started, address, now);
            self.answer(now);
            self.name(tgid, started, address, now)
        }
    }

    fn append(path: &Path, text: &[u8]) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("perf map");
        file.write_all(text).expect("write");
    }

    #[test]
    fn parses_perf_map_lines() {
        assert_eq!(
            parse_line(b"3ef0a1c0c2a0 1a4 LazyCompile:~hot /app/x.js:3"),
            Some((
                0x3ef0a1c0c2a0,
                0x3ef0a1c0c444,
                "LazyCompile:~hot /app/x.js:3"
            ))
        );
        assert_eq!(
            parse_line(b"0x1000 0x10 Foo::bar(int)\r"),
            Some((0x1000, 0x1010, "Foo::bar(int)"))
        );
        for bad in [
            &b""[..],
            b"1000",
            b"1000 10",
            b"1000 10 ",
            b"1000 0 zero",
            b"zz 10 name",
            b"1000 -1 name",
            b"ffffffffffffffff 10 wraps",
            b"11112222333344445 10 too-long",
            b"1000 10 \xff\xfe",
        ] {
            assert_eq!(parse_line(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        let long = format!("1000 10 {}", "é".repeat(MAX_NAME_BYTES));
        let (_, _, name) = parse_line(long.as_bytes()).expect("a long name");
        assert!(name.len() <= MAX_NAME_BYTES && name.chars().all(|c| c == 'é'));
    }

    #[test]
    fn finds_the_pid_in_the_innermost_namespace() {
        assert_eq!(namespace_pid(b"Name:\tx\nNSpid:\t4242\t7\n"), Some(7));
        assert_eq!(namespace_pid(b"NSpid:\t4242\n"), Some(4242));
        assert_eq!(namespace_pid(b"Name:\tx\n"), None);
        assert_eq!(namespace_pid(b"NSpid:\tx\n"), None);
    }

    #[test]
    fn names_jit_frames_and_reads_a_growing_map() {
        let process = fake_process(4242, 7);
        append(
            &process.map,
            b"1000 100 first\nnot a line\n2000 100 second\n3000 100 thi",
        );
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        // Nothing is read on the sampling thread: the first frame asks.
        assert_eq!(&*jit.name(4242, 1, 0x1080, t0), "[jit] node");
        assert_eq!(jit.reader.tracked(), 0);
        assert_eq!(jit.answer(t0), 1);
        assert_eq!(&*jit.name(4242, 1, 0x1080, t0), "first");
        assert_eq!(&*jit.name(4242, 1, 0x20ff, t0), "second");
        // The third line is still being written: not an entry yet.
        assert_eq!(&*jit.name(4242, 1, 0x3000, t0), "[jit] node");
        append(&process.map, b"rd\n4000 100 fourth\n");
        // Not read again before the refresh interval...
        let soon = t0 + REFRESH_INTERVAL / 2;
        assert_eq!(&*jit.name(4242, 1, 0x3000, soon), "[jit] node");
        assert_eq!(jit.answer(soon), 0);
        // ...then read on from where it stopped.
        let later = t0 + REFRESH_INTERVAL;
        assert_eq!(&*jit.named(4242, 1, 0x3000, later), "third");
        assert_eq!(&*jit.name(4242, 1, 0x4010, later), "fourth");
        let stats = jit.maps.stats();
        assert_eq!((stats.lines, stats.malformed), (4, 1));
        assert_eq!((stats.named, stats.unnamed), (4, 4));
    }

    #[test]
    fn a_frame_missed_before_its_read_is_named_later_by_that_read() {
        let process = fake_process(21, 21);
        append(&process.map, b"1000 100 first\n");
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        // Missed: nothing read yet, and not counted either way.
        assert!(!jit.maps.awaits_answers(t0));
        assert_eq!(jit.maps.name(21, 5, 0x1010, t0), None);
        assert_eq!(jit.maps.stats(), PerfMapStats::default());
        // The read it asked for is awaited until answered, or for
        // ANSWER_WAIT when it never is (a job dropped with a full queue).
        assert!(jit.maps.awaits_answers(t0));
        assert!(jit.maps.awaits_answers(t0 + ANSWER_WAIT / 2));
        assert!(!jit.maps.awaits_answers(t0 + ANSWER_WAIT));
        // Named later by the read the miss asked for, for every frame
        // that missed it.
        assert_eq!(jit.answer(t0), 1);
        assert!(!jit.maps.awaits_answers(t0));
        assert_eq!(
            jit.maps.name_later(21, 5, 0x1010, 3).as_deref(),
            Some("first")
        );
        // Code no entry covers stays unnamed; another process under the
        // pid is not named by this one's entries; later lookups ask for
        // no read.
        assert_eq!(jit.maps.name_later(21, 5, 0x5000, 2), None);
        assert_eq!(jit.maps.name_later(21, 6, 0x1010, 1), None);
        assert!(jit.maps.take_requests().is_empty());
        let stats = jit.maps.stats();
        assert_eq!((stats.named, stats.unnamed), (3, 3));
    }

    #[test]
    fn a_read_done_with_the_processs_maps_names_its_first_frames() {
        let process = fake_process(16, 16);
        append(&process.map, b"1000 100 first\n");
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        // Read before any JIT frame of it was named, its start unknown.
        let update = jit.reader.read(16, 0, t0);
        jit.maps.apply(vec![update]);
        assert_eq!(&*jit.name(16, 77, 0x1010, t0), "first");
        assert!(jit.maps.take_requests().is_empty(), "just read");
        // Later reads go on from where that one stopped.
        append(&process.map, b"2000 100 second\n");
        let t1 = t0 + REFRESH_INTERVAL;
        assert_eq!(&*jit.named(16, 77, 0x2010, t1), "second");
        assert_eq!(jit.maps.stats().lines, 2);
    }

    #[test]
    fn a_later_entry_replaces_what_it_overlaps() {
        let process = fake_process(10, 10);
        append(
            &process.map,
            b"1000 100 old-a\n1100 100 old-b\n1300 100 old-c\n10c0 80 new\n",
        );
        let mut jit = Joined::new(process.proc_root.path());
        let now = Instant::now();
        assert_eq!(&*jit.named(10, 0, 0x10c0, now), "new");
        assert_eq!(&*jit.name(10, 0, 0x1000, now), "[jit] node");
        assert_eq!(&*jit.name(10, 0, 0x1100, now), "new");
        // What remains of old-b's range is no longer old-b's.
        assert_eq!(&*jit.name(10, 0, 0x1180, now), "[jit] node");
        assert_eq!(&*jit.name(10, 0, 0x1300, now), "old-c");
        assert_eq!(jit.maps.maps[&10].entries.len(), 2);
    }

    #[test]
    fn a_reused_code_address_takes_the_new_name_on_the_next_refresh() {
        let process = fake_process(14, 14);
        append(&process.map, b"1000 100 old\n");
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*jit.named(14, 0, 0x1010, t0), "old");
        append(&process.map, b"1000 80 new\n");
        assert_eq!(&*jit.named(14, 0, 0x1010, t0), "old", "not due yet");
        let t1 = t0 + REFRESH_INTERVAL;
        // A hit asks too, when due: the space may have been reused.
        assert_eq!(&*jit.name(14, 0, 0x1010, t1), "old");
        assert_eq!(jit.answer(t1), 1);
        assert_eq!(&*jit.name(14, 0, 0x1010, t1), "new");
    }

    #[test]
    fn names_come_from_a_jitdump_file_found_through_the_maps() {
        use crate::jitdump::test_streams::{header, load};
        let process = fake_process(15, 15);
        let root = process.proc_root.path().join("15");
        std::fs::create_dir_all(root.join("root/work")).expect("cwd");
        std::fs::write(
            root.join("maps"),
            "7f0000000000-7f0000001000 r-xp 00000000 08:01 99 /work/jit-15.dump\n",
        )
        .expect("maps");
        let dump = root.join("root/work/jit-15.dump");
        append(
            &dump,
            &[header(), load(0x1000, 0x100, "JS:*leaf x.js:2", 64)].concat(),
        );
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*jit.named(15, 0, 0x1010, t0), "JS:*leaf x.js:2");
        // The JIT writes on, half a record at a time.
        let next = load(0x2000, 0x80, "JS:*middle x.js:7", 16);
        append(&dump, &next[..30]);
        let t1 = t0 + REFRESH_INTERVAL;
        assert_eq!(&*jit.named(15, 0, 0x2010, t1), "[jit] node");
        append(&dump, &next[30..]);
        let t2 = t1 + REFRESH_INTERVAL;
        assert_eq!(&*jit.named(15, 0, 0x2010, t2), "JS:*middle x.js:7");
        // A perf map of the same process adds to it.
        append(&process.map, b"3000 10 from-the-perf-map\n");
        let t3 = t2 + REFRESH_INTERVAL;
        assert_eq!(&*jit.named(15, 0, 0x3000, t3), "from-the-perf-map");
        assert_eq!(jit.maps.stats().malformed, 0);
    }

    #[test]
    fn a_missing_map_names_frames_by_comm_and_retries_later() {
        let process = fake_process(11, 11);
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*jit.named(11, 0, 0x1000, t0), "[jit] node");
        append(&process.map, b"1000 10 late\n");
        assert_eq!(&*jit.named(11, 0, 0x1000, t0 + REFRESH_INTERVAL), "late");
    }

    #[test]
    fn a_reused_pid_starts_afresh() {
        let process = fake_process(12, 12);
        append(&process.map, b"1000 10 old\n");
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*jit.named(12, 100, 0x1000, t0), "old");
        std::fs::remove_file(&process.map).expect("rm");
        append(&process.map, b"2000 10 new\n");
        assert_eq!(&*jit.named(12, 200, 0x1000, t0), "[jit] node");
        assert_eq!(&*jit.name(12, 200, 0x2000, t0), "new");
        // An answer about the process gone is not applied to the new one.
        let stale = JitUpdate {
            tgid: 12,
            started: 100,
            events: vec![DumpEvent::Load {
                start: 0x1000,
                end: 0x1010,
                name: "old".into(),
            }],
            ..JitUpdate::default()
        };
        jit.maps.apply(vec![stale]);
        assert_eq!(&*jit.name(12, 200, 0x1000, t0), "[jit] node");
    }

    #[test]
    fn a_truncated_map_is_read_from_the_start() {
        let process = fake_process(13, 13);
        append(&process.map, b"1000 10 old\n1100 10 older\n");
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*jit.named(13, 0, 0x1000, t0), "old");
        std::fs::write(&process.map, b"2000 10 new\n").expect("truncate");
        let t1 = t0 + REFRESH_INTERVAL;
        assert_eq!(&*jit.named(13, 0, 0x2000, t1), "new");
        assert_eq!(&*jit.name(13, 0, 0x1000, t1), "[jit] node");
    }

    #[test]
    fn entries_stay_within_the_byte_budget() {
        let a = fake_process(20, 20);
        let mut text = Vec::new();
        for i in 0..100u64 {
            text.extend_from_slice(format!("{:x} 10 function_{i}\n", 0x1000 + i * 0x10).as_bytes());
        }
        append(&a.map, &text);
        // Room for about 50 entries.
        let budget = 50 * entry_bytes("function_00");
        let mut jit = Joined::with_budget(a.proc_root.path(), budget, budget);
        let now = Instant::now();
        assert_eq!(&*jit.named(20, 0, 0x1000, now), "function_0");
        assert!(jit.maps.total_bytes <= budget);
        let stats = jit.maps.stats();
        assert!(stats.over_budget > 0 && stats.lines + stats.over_budget == 100);
        // A second process evicts the first when it needs the room.
        let b_dir = a.proc_root.path().join("21");
        std::fs::create_dir_all(b_dir.join("root/tmp")).expect("dirs");
        std::fs::write(b_dir.join("status"), "NSpid:\t21\n").expect("status");
        append(&b_dir.join("root/tmp/perf-21.map"), &text);
        let later = now + REFRESH_INTERVAL;
        assert_eq!(&*jit.named(21, 0, 0x1000, later), "function_0");
        assert!(jit.maps.total_bytes <= budget);
        assert!(
            !jit.maps.maps.contains_key(&20),
            "the least recently used map went"
        );
        assert_eq!(jit.maps.stats().evicted, 1);
        // Its files are closed with it.
        assert_eq!(jit.answer(later), 0);
        assert_eq!(jit.reader.tracked(), 1);
        jit.maps.forget(21);
        assert_eq!((jit.maps.total_bytes, jit.maps.tracked()), (0, 0));
        jit.answer(later);
        assert_eq!(jit.reader.tracked(), 0);
    }

    #[test]
    fn a_map_that_fills_its_share_is_read_no_further() {
        let process = fake_process(40, 40);
        let mut text = Vec::new();
        for i in 0..1000u64 {
            text.extend_from_slice(
                format!("{:x} 10 function_{i:03}\n", 0x1000 + i * 0x10).as_bytes(),
            );
        }
        append(&process.map, &text);
        let budget = 10 * entry_bytes("function_000");
        let mut jit = Joined::with_budget(process.proc_root.path(), 4 * budget, budget);
        let t0 = Instant::now();
        assert_eq!(&*jit.named(40, 0, 0x1000, t0), "function_000");
        let lines = |jit: &Joined| (jit.maps.stats().lines, jit.maps.stats().over_budget);
        let read_before = lines(&jit);
        // Later reads would only skip lines: none is asked for.
        append(&process.map, &text);
        let t1 = t0 + REFRESH_INTERVAL;
        assert_eq!(&*jit.name(40, 0, 0x1000, t1), "function_000");
        assert_eq!(jit.answer(t1), 0);
        assert_eq!(lines(&jit), read_before);
    }

    #[test]
    fn an_endless_line_is_skipped_not_kept() {
        let process = fake_process(30, 30);
        append(&process.map, &vec![b'a'; MAX_LINE_BYTES * 2]);
        let mut jit = Joined::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*jit.named(30, 0, 0x1000, t0), "[jit] node");
        assert!(jit.reader.files[&30].partial.is_empty());
        assert_eq!(jit.maps.stats().malformed, 1);
        append(&process.map, b"aaaa\n1000 10 after\n");
        assert_eq!(&*jit.named(30, 0, 0x1000, t0 + REFRESH_INTERVAL), "after");
        assert_eq!(
            jit.maps.stats().malformed,
            1,
            "the rest of the long line is skipped"
        );
    }
}
