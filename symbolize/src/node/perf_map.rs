//! Names of JIT-compiled code from perf map files (and jitdump files).
//!
//! A JIT that runs with perf support (`node --perf-basic-prof`, the JVM with
//! perf-map-agent, .NET with `DOTNET_PerfMapEnabled=1`, LuaJIT, ...) appends
//! one line per compiled function to `/tmp/perf-<pid>.map`:
//! `START SIZE NAME`, start and size in hex. The pid is the process's pid
//! in its own pid namespace and `/tmp` is its own, so the file is reached
//! through `/proc/<pid>/root` with the pid `NSpid` gives.
//!
//! Owns: finding and reading each process's perf map incrementally as it
//! grows (only the bytes appended since the last read, at most
//! [`MAX_READ_PER_REFRESH`] per refresh and at most one refresh per
//! [`REFRESH_INTERVAL`], so a 2 GB map costs bounded time per sample), the
//! entries (a later line for an address replaces what covered it: JITs
//! reuse code space), the bounds ([`MAX_PROCESSES`] maps, at most
//! [`MAX_TOTAL_BYTES`] of entries over all of them), the name of a JIT
//! frame no entry covers (`[jit] <comm>`), and forgetting a process when
//! it exits or its pid turns out to be another process's. Does not own
//! which frames are JIT code (the walker decides) nor when a process exits
//! (the run loop says).
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

/// Most bytes read from one map per refresh: a huge map is taken in over
/// several refreshes instead of stalling the sampling loop.
pub const MAX_READ_PER_REFRESH: usize = 4 << 20;

/// Processes whose maps are kept; beyond, the least recently used goes.
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

/// A jitdump file being read.
#[derive(Debug)]
struct Dump {
    file: File,
    offset: u64,
    reader: DumpReader,
}

/// One compiled function.
#[derive(Debug, Clone)]
struct Entry {
    end: u64,
    name: Arc<str>,
}

/// What is known of one process's perf map.
#[derive(Debug)]
struct PerfMap {
    /// The process's start time: with the pid, its identity.
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
    entries: BTreeMap<u64, Entry>,
    bytes: usize,
    last_read: Option<Instant>,
    last_used: Instant,
    /// `[jit] <comm>`, for frames no entry covers, with the comm it was
    /// made from.
    unnamed: Option<([u8; agent_common::COMM_LEN], Arc<str>)>,
}

impl PerfMap {
    fn new(started: u64, now: Instant) -> Self {
        Self {
            started,
            file: None,
            offset: 0,
            partial: Vec::new(),
            skipping: false,
            dump: None,
            dump_looked_for: None,
            entries: BTreeMap::new(),
            bytes: 0,
            last_read: None,
            last_used: now,
            unnamed: None,
        }
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

    fn unnamed(&mut self, comm: &[u8; agent_common::COMM_LEN]) -> Arc<str> {
        match &self.unnamed {
            Some((made_from, name)) if made_from == comm => Arc::clone(name),
            _ => {
                let text = agent_common::comm_str(comm);
                let name: Arc<str> = format!("[jit] {text}").into();
                self.unnamed = Some((*comm, Arc::clone(&name)));
                name
            }
        }
    }
}

fn entry_bytes(name: &str) -> usize {
    name.len() + ENTRY_OVERHEAD
}

/// See the module documentation.
#[derive(Debug)]
pub struct PerfMaps {
    proc_root: PathBuf,
    maps: HashMap<u32, PerfMap>,
    total_bytes: usize,
    max_total_bytes: usize,
    max_process_bytes: usize,
    stats: PerfMapStats,
    buffer: Vec<u8>,
}

impl PerfMaps {
    pub fn new(proc_root: &Path) -> Self {
        Self::with_budget(proc_root, MAX_TOTAL_BYTES, MAX_PROCESS_BYTES)
    }

    /// Maps kept within `max_total_bytes` of entries, each process's within
    /// `max_process_bytes`.
    pub fn with_budget(proc_root: &Path, max_total_bytes: usize, max_process_bytes: usize) -> Self {
        Self {
            proc_root: proc_root.to_path_buf(),
            maps: HashMap::new(),
            total_bytes: 0,
            max_total_bytes,
            max_process_bytes: max_process_bytes.min(max_total_bytes),
            stats: PerfMapStats::default(),
            buffer: Vec::new(),
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
    /// `started`, 0 if unknown, with thread name `comm`): the perf map's
    /// entry, read on if none covers it yet, else `[jit] <comm>`.
    pub fn name(
        &mut self,
        tgid: u32,
        started: u64,
        comm: &[u8; agent_common::COMM_LEN],
        address: u64,
        now: Instant,
    ) -> Arc<str> {
        probes::count(Probe::Process);
        if self
            .maps
            .get(&tgid)
            .is_some_and(|map| started != 0 && map.started != 0 && map.started != started)
        {
            self.forget(tgid);
        }
        probes::count(Probe::Process);
        if !self.maps.contains_key(&tgid) {
            self.make_room();
            self.maps.insert(tgid, PerfMap::new(started, now));
        }
        let found = self.lookup(tgid, address, now);
        probes::count(Probe::Process);
        let map = self.maps.get_mut(&tgid).expect("inserted above");
        map.last_used = now;
        match found {
            Some(name) => {
                self.stats.named += 1;
                name
            }
            None => {
                self.stats.unnamed += 1;
                map.unnamed(comm)
            }
        }
    }

    fn lookup(&mut self, tgid: u32, address: u64, now: Instant) -> Option<Arc<str>> {
        // Read on when due, hit or miss: a JIT that reused the code space
        // has written the new function's line, which replaces the old.
        probes::count(Probe::Process);
        let due = self
            .maps
            .get(&tgid)?
            .last_read
            .is_none_or(|last| now.saturating_duration_since(last) >= REFRESH_INTERVAL);
        if due {
            self.refresh(tgid, now);
        }
        probes::count(Probe::Process);
        self.maps.get(&tgid)?.find(address).cloned()
    }

    /// The process exited: its map goes.
    pub fn forget(&mut self, tgid: u32) {
        if let Some(map) = self.maps.remove(&tgid) {
            self.total_bytes -= map.bytes;
        }
    }

    /// Every process's map goes (exit records were lost).
    pub fn forget_all(&mut self) {
        self.maps.clear();
        self.total_bytes = 0;
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

    /// Reads what the JIT appended since the last read.
    /// Reads what the JIT appended since the last read, to its perf map
    /// and to its jitdump file.
    fn refresh(&mut self, tgid: u32, now: Instant) {
        if let Some(map) = self.maps.get_mut(&tgid) {
            map.last_read = Some(now);
        }
        self.read_perf_map(tgid, now);
        self.read_jitdump(tgid, now);
    }

    fn read_jitdump(&mut self, tgid: u32, now: Instant) {
        let proc_root = self.proc_root.clone();
        let Some(map) = self.maps.get_mut(&tgid) else {
            return;
        };
        if map.dump.is_none()
            && map
                .dump_looked_for
                .is_none_or(|last| now.saturating_duration_since(last) >= DUMP_LOOK_INTERVAL)
        {
            map.dump_looked_for = Some(now);
            map.dump = open_jitdump(&proc_root, tgid).map(|file| Dump {
                file,
                offset: 0,
                reader: DumpReader::default(),
            });
        }
        let Some(dump) = map.dump.as_mut() else {
            return;
        };
        if dump.reader.is_broken() {
            return;
        }
        let Ok(metadata) = dump.file.metadata() else {
            return;
        };
        let want = usize::try_from(metadata.len().saturating_sub(dump.offset))
            .unwrap_or(usize::MAX)
            .min(MAX_READ_PER_REFRESH);
        if want == 0 {
            return;
        }
        self.buffer.clear();
        self.buffer.resize(want, 0);
        let read = dump
            .file
            .seek(SeekFrom::Start(dump.offset))
            .and_then(|_| read_up_to(&mut dump.file, &mut self.buffer));
        let Ok(read) = read else {
            return;
        };
        dump.offset += read as u64;
        let mut events = Vec::new();
        dump.reader
            .feed(&self.buffer[..read], |event| events.push(event));
        if dump.reader.is_broken() {
            self.stats.malformed += 1;
        }
        for event in events {
            match event {
                DumpEvent::Load { start, end, name } => self.add_entry(tgid, start, end, &name),
                DumpEvent::Move { from, to, size } => {
                    let Some(name) = self
                        .maps
                        .get_mut(&tgid)
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

    fn read_perf_map(&mut self, tgid: u32, now: Instant) {
        let proc_root = self.proc_root.clone();
        let Some(map) = self.maps.get_mut(&tgid) else {
            return;
        };
        if map.bytes + entry_bytes("") > self.max_process_bytes {
            // Its entries fill its share: every line read now would be
            // skipped, and reading on (a 2 GB map, 4 MiB a refresh) would
            // cost the run loop its time and name nothing.
            return;
        }
        if map.file.is_none() {
            let Some(file) = open_perf_map(&proc_root, tgid) else {
                return;
            };
            map.file = Some(file);
        }
        let Some(file) = map.file.as_mut() else {
            return;
        };
        let Ok(metadata) = file.metadata() else {
            return;
        };
        if metadata.len() < map.offset {
            // Truncated: what was read describes code that is gone.
            self.total_bytes -= map.bytes;
            let started = map.started;
            *map = PerfMap::new(started, now);
            return;
        }
        let available = metadata.len() - map.offset;
        let want = usize::try_from(available)
            .unwrap_or(usize::MAX)
            .min(MAX_READ_PER_REFRESH);
        if want == 0 {
            return;
        }
        self.buffer.clear();
        self.buffer.resize(want, 0);
        let read = file
            .seek(SeekFrom::Start(map.offset))
            .and_then(|_| read_up_to(file, &mut self.buffer));
        let Ok(read) = read else {
            return;
        };
        map.offset += read as u64;
        let mut bytes = std::mem::take(&mut map.partial);
        bytes.extend_from_slice(&self.buffer[..read]);
        if map.skipping {
            // The rest of an overlong line: up to its newline it is not
            // the start of one.
            match bytes.iter().position(|&b| b == b'\n') {
                Some(end) => {
                    bytes.drain(..=end);
                    map.skipping = false;
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
            self.stats.malformed += 1;
            map.skipping = true;
        } else {
            map.partial = rest.to_vec();
        }
        self.add_lines(tgid, lines);
        self.buffer = bytes;
    }

    fn add_lines(&mut self, tgid: u32, lines: &[u8]) {
        for line in lines.split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            let parsed = (line.len() <= MAX_LINE_BYTES)
                .then(|| parse_line(line))
                .flatten();
            let Some((start, end, name)) = parsed else {
                self.stats.malformed += 1;
                continue;
            };
            self.add_entry(tgid, start, end, name);
        }
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
        let mut maps = PerfMaps::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*maps.name(4242, 1, &COMM, 0x1080, t0), "first");
        assert_eq!(&*maps.name(4242, 1, &COMM, 0x20ff, t0), "second");
        // The third line is still being written: not an entry yet.
        assert_eq!(&*maps.name(4242, 1, &COMM, 0x3000, t0), "[jit] node");
        append(&process.map, b"rd\n4000 100 fourth\n");
        // Not read again before the refresh interval...
        let soon = t0 + REFRESH_INTERVAL / 2;
        assert_eq!(&*maps.name(4242, 1, &COMM, 0x3000, soon), "[jit] node");
        // ...then read on from where it stopped.
        let later = t0 + REFRESH_INTERVAL;
        assert_eq!(&*maps.name(4242, 1, &COMM, 0x3000, later), "third");
        assert_eq!(&*maps.name(4242, 1, &COMM, 0x4010, later), "fourth");
        let stats = maps.stats();
        assert_eq!((stats.lines, stats.malformed), (4, 1));
        assert_eq!((stats.named, stats.unnamed), (4, 2));
    }

    #[test]
    fn a_later_entry_replaces_what_it_overlaps() {
        let process = fake_process(10, 10);
        append(
            &process.map,
            b"1000 100 old-a\n1100 100 old-b\n1300 100 old-c\n10c0 80 new\n",
        );
        let mut maps = PerfMaps::new(process.proc_root.path());
        let now = Instant::now();
        assert_eq!(&*maps.name(10, 0, &COMM, 0x10c0, now), "new");
        assert_eq!(&*maps.name(10, 0, &COMM, 0x1000, now), "[jit] node");
        assert_eq!(&*maps.name(10, 0, &COMM, 0x1100, now), "new");
        // What remains of old-b's range is no longer old-b's.
        assert_eq!(&*maps.name(10, 0, &COMM, 0x1180, now), "[jit] node");
        assert_eq!(&*maps.name(10, 0, &COMM, 0x1300, now), "old-c");
        assert_eq!(maps.maps[&10].entries.len(), 2);
    }

    #[test]
    fn a_reused_code_address_takes_the_new_name_on_the_next_refresh() {
        let process = fake_process(14, 14);
        append(&process.map, b"1000 100 old\n");
        let mut maps = PerfMaps::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*maps.name(14, 0, &COMM, 0x1010, t0), "old");
        append(&process.map, b"1000 80 new\n");
        assert_eq!(&*maps.name(14, 0, &COMM, 0x1010, t0), "old", "not due yet");
        let t1 = t0 + REFRESH_INTERVAL;
        assert_eq!(&*maps.name(14, 0, &COMM, 0x1010, t1), "new");
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
        let mut maps = PerfMaps::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*maps.name(15, 0, &COMM, 0x1010, t0), "JS:*leaf x.js:2");
        // The JIT writes on, half a record at a time.
        let next = load(0x2000, 0x80, "JS:*middle x.js:7", 16);
        append(&dump, &next[..30]);
        let t1 = t0 + REFRESH_INTERVAL;
        assert_eq!(&*maps.name(15, 0, &COMM, 0x2010, t1), "[jit] node");
        append(&dump, &next[30..]);
        let t2 = t1 + REFRESH_INTERVAL;
        assert_eq!(&*maps.name(15, 0, &COMM, 0x2010, t2), "JS:*middle x.js:7");
        // A perf map of the same process adds to it.
        append(&process.map, b"3000 10 from-the-perf-map\n");
        let t3 = t2 + REFRESH_INTERVAL;
        assert_eq!(&*maps.name(15, 0, &COMM, 0x3000, t3), "from-the-perf-map");
        assert_eq!(maps.stats().malformed, 0);
    }

    #[test]
    fn a_missing_map_names_frames_by_comm_and_retries_later() {
        let process = fake_process(11, 11);
        let mut maps = PerfMaps::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*maps.name(11, 0, &COMM, 0x1000, t0), "[jit] node");
        append(&process.map, b"1000 10 late\n");
        assert_eq!(
            &*maps.name(11, 0, &COMM, 0x1000, t0 + REFRESH_INTERVAL),
            "late"
        );
    }

    #[test]
    fn a_reused_pid_starts_afresh() {
        let process = fake_process(12, 12);
        append(&process.map, b"1000 10 old\n");
        let mut maps = PerfMaps::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*maps.name(12, 100, &COMM, 0x1000, t0), "old");
        std::fs::remove_file(&process.map).expect("rm");
        append(&process.map, b"2000 10 new\n");
        assert_eq!(&*maps.name(12, 200, &COMM, 0x1000, t0), "[jit] node");
        assert_eq!(&*maps.name(12, 200, &COMM, 0x2000, t0), "new");
    }

    #[test]
    fn a_truncated_map_is_read_from_the_start() {
        let process = fake_process(13, 13);
        append(&process.map, b"1000 10 old\n1100 10 older\n");
        let mut maps = PerfMaps::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*maps.name(13, 0, &COMM, 0x1000, t0), "old");
        std::fs::write(&process.map, b"2000 10 new\n").expect("truncate");
        let t1 = t0 + REFRESH_INTERVAL;
        assert_eq!(&*maps.name(13, 0, &COMM, 0x2000, t1), "[jit] node");
        assert_eq!(&*maps.name(13, 0, &COMM, 0x2000, t1), "new");
        assert_eq!(&*maps.name(13, 0, &COMM, 0x1000, t1), "[jit] node");
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
        let mut maps = PerfMaps::with_budget(a.proc_root.path(), budget, budget);
        let now = Instant::now();
        assert_eq!(&*maps.name(20, 0, &COMM, 0x1000, now), "function_0");
        assert!(maps.total_bytes <= budget);
        let stats = maps.stats();
        assert!(stats.over_budget > 0 && stats.lines + stats.over_budget == 100);
        // A second process evicts the first when it needs the room.
        let b_dir = a.proc_root.path().join("21");
        std::fs::create_dir_all(b_dir.join("root/tmp")).expect("dirs");
        std::fs::write(b_dir.join("status"), "NSpid:\t21\n").expect("status");
        append(&b_dir.join("root/tmp/perf-21.map"), &text);
        let later = now + REFRESH_INTERVAL;
        assert_eq!(&*maps.name(21, 0, &COMM, 0x1000, later), "function_0");
        assert!(maps.total_bytes <= budget);
        assert!(
            !maps.maps.contains_key(&20),
            "the least recently used map went"
        );
        assert_eq!(maps.stats().evicted, 1);
        maps.forget(21);
        assert_eq!((maps.total_bytes, maps.tracked()), (0, 0));
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
        let mut maps = PerfMaps::with_budget(process.proc_root.path(), 4 * budget, budget);
        let t0 = Instant::now();
        assert_eq!(&*maps.name(40, 0, &COMM, 0x1000, t0), "function_000");
        let offset = maps.maps[&40].offset;
        let lines = |maps: &PerfMaps| (maps.stats().lines, maps.stats().over_budget);
        let read_before = lines(&maps);
        // Later refreshes would only skip lines: the file is not read on.
        append(&process.map, &text);
        assert_eq!(
            &*maps.name(40, 0, &COMM, 0x1000, t0 + REFRESH_INTERVAL),
            "function_000"
        );
        assert_eq!(maps.maps[&40].offset, offset);
        assert_eq!(lines(&maps), read_before);
    }

    #[test]
    fn an_endless_line_is_skipped_not_kept() {
        let process = fake_process(30, 30);
        append(&process.map, &vec![b'a'; MAX_LINE_BYTES * 2]);
        let mut maps = PerfMaps::new(process.proc_root.path());
        let t0 = Instant::now();
        assert_eq!(&*maps.name(30, 0, &COMM, 0x1000, t0), "[jit] node");
        assert!(maps.maps[&30].partial.is_empty());
        assert_eq!(maps.stats().malformed, 1);
        append(&process.map, b"aaaa\n1000 10 after\n");
        assert_eq!(
            &*maps.name(30, 0, &COMM, 0x1000, t0 + REFRESH_INTERVAL),
            "after"
        );
        assert_eq!(
            maps.stats().malformed,
            1,
            "the rest of the long line is skipped"
        );
    }
}
