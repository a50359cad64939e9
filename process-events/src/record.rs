//! Decoding perf side-band records.
//!
//! Owns: the byte layout of the records a side-band event produces (MMAP2,
//! MMAP, COMM, FORK, EXIT, LOST, each followed by a `sample_id` of
//! `{pid, tid, time, cpu, res}`), the [`Event`] values they become, and
//! [`parse_record`], which turns one record's bytes into an [`Event`].
//!
//! Does not own: finding record boundaries in the ring buffer
//! (the private `walk` module), or deciding what an event means for a process
//! table (the agent does that).
//!
//! The bytes come from a buffer the kernel writes, but they are treated as
//! untrusted all the same: a kernel bug, a future format, or a reader bug
//! must become a [`RecordError`] that costs one event, never a panic or a
//! read outside the record. Records are in the host's byte order.

use std::{ffi::OsStr, fmt, os::unix::ffi::OsStrExt as _, path::Path};

use thiserror::Error;

/// `PERF_RECORD_MMAP`.
pub const PERF_RECORD_MMAP: u32 = 1;
/// `PERF_RECORD_LOST`.
pub const PERF_RECORD_LOST: u32 = 2;
/// `PERF_RECORD_COMM`.
pub const PERF_RECORD_COMM: u32 = 3;
/// `PERF_RECORD_EXIT`.
pub const PERF_RECORD_EXIT: u32 = 4;
/// `PERF_RECORD_FORK`.
pub const PERF_RECORD_FORK: u32 = 7;
/// `PERF_RECORD_SAMPLE`: the one record kind that does not end with a
/// `sample_id` (its sample fields are laid out differently). A dummy event
/// never produces one.
pub const PERF_RECORD_SAMPLE: u32 = 9;
/// `PERF_RECORD_MMAP2`.
pub const PERF_RECORD_MMAP2: u32 = 10;

/// `PERF_RECORD_MISC_MMAP_DATA`: on MMAP/MMAP2, the mapping is not executable.
const PERF_RECORD_MISC_MMAP_DATA: u16 = 1 << 13;
/// `PERF_RECORD_MISC_COMM_EXEC`: on COMM, the name changed because of exec.
/// (Same bit as `MMAP_DATA`: misc bits are per record kind.)
const PERF_RECORD_MISC_COMM_EXEC: u16 = 1 << 13;
/// `PERF_RECORD_MISC_MMAP_BUILD_ID`: on MMAP2, the 24 bytes after `pgoff`
/// hold a build-id instead of device and inode.
const PERF_RECORD_MISC_MMAP_BUILD_ID: u16 = 1 << 14;

/// `struct perf_event_header`: `u32 type, u16 misc, u16 size`.
pub(crate) const HEADER_LEN: usize = 8;
/// The trailing `sample_id` with `PERF_SAMPLE_TID | TIME | CPU`:
/// `u32 pid, tid; u64 time; u32 cpu, res`.
pub const SAMPLE_ID_LEN: usize = 24;
/// `BUILD_ID_SIZE_MAX` in `include/linux/buildid.h`.
pub const BUILD_ID_MAX: usize = 20;
/// `TASK_COMM_LEN`: a task name is at most 15 bytes and a NUL.
pub const TASK_COMM_LEN: usize = 16;

/// One side-band record, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// When the kernel wrote the record, in `CLOCK_MONOTONIC` nanoseconds
    /// (the clock of `bpf_ktime_get_ns()`), from the trailing `sample_id`.
    /// Without a `sample_id`, FORK and EXIT use their own `time` field and
    /// every other kind has 0.
    pub time_ns: u64,
    /// The CPU the record was written on (from `sample_id`; 0 without one).
    pub cpu: u32,
    pub kind: EventKind,
}

impl Event {
    /// The process (thread-group id) the event is about, if it is about one.
    pub fn pid(&self) -> Option<u32> {
        match &self.kind {
            EventKind::Mmap(m) => Some(m.pid),
            EventKind::Comm(c) => Some(c.pid),
            EventKind::Fork(f) => Some(f.pid),
            EventKind::Exit(e) => Some(e.pid),
            EventKind::Lost { .. } | EventKind::Other { .. } => None,
        }
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// A process mapped something executable (`PERF_RECORD_MMAP2`, or
    /// `PERF_RECORD_MMAP` on a kernel that ignores `mmap2`).
    Mmap(Mmap),
    /// A thread's name changed: at exec (`exec`), or through
    /// `prctl(PR_SET_NAME)` / `/proc/<pid>/comm`.
    Comm(Comm),
    /// A thread or a process was created.
    Fork(Fork),
    /// A thread exited.
    Exit(Exit),
    /// The kernel dropped `count` records because this CPU's ring was full.
    /// It writes this record when it next has room, so the lost records are
    /// the ones *before* it (its time is that of the first record written
    /// after the loss, not of the loss).
    Lost { count: u64 },
    /// A record kind this crate does not decode (the side-band event should
    /// not produce any; throttling records are the likeliest).
    Other { kind: u32 },
}

/// An executable mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mmap {
    pub pid: u32,
    pub tid: u32,
    /// First address of the mapping.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// Offset in the file, in bytes (not pages, whatever the name says).
    pub pgoff: u64,
    /// `PROT_*` bits; `None` for a `PERF_RECORD_MMAP` record, which has none.
    pub prot: Option<u32>,
    /// `MAP_*` bits; `None` for a `PERF_RECORD_MMAP` record.
    pub flags: Option<u32>,
    /// Whether the mapping is executable: `PROT_EXEC` in `prot`, or for a
    /// `PERF_RECORD_MMAP` record, the absence of the data flag.
    pub exec: bool,
    /// Which file is mapped.
    pub file: FileRef,
    /// The name as the kernel wrote it, without the terminating NUL:
    /// arbitrary bytes (not necessarily UTF-8). Besides paths it can be
    /// `//anon`, `[vdso]`, `/memfd:name (deleted)`, `/path (deleted)`...
    /// The path is as seen from the mapping process's root, which in a
    /// container is not the agent's.
    pub path: Vec<u8>,
}

impl Mmap {
    /// The name as a [`Path`] (lossless: paths are bytes on Linux).
    pub fn path(&self) -> &Path {
        Path::new(OsStr::from_bytes(&self.path))
    }

    /// One past the last address.
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }
}

/// Which file a mapping maps, as the kernel identified it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileRef {
    /// The file's GNU build-id, read by the kernel from the mapped pages
    /// (requested with `build_id`, Linux 5.12+). The kernel falls back to
    /// [`FileRef::Inode`] per record when it cannot read one (no note, or
    /// the pages are not in memory).
    BuildId(BuildId),
    /// Device and inode of the file. All zero for anonymous memory.
    Inode {
        major: u32,
        minor: u32,
        ino: u64,
        ino_generation: u64,
    },
    /// A `PERF_RECORD_MMAP` record, or a build-id record whose build-id is
    /// empty: nothing identifies the file but its name.
    Unknown,
}

/// A build-id of up to [`BUILD_ID_MAX`] bytes, stored inline so an [`Mmap`]
/// does not allocate for it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BuildId {
    len: u8,
    bytes: [u8; BUILD_ID_MAX],
}

impl BuildId {
    /// `None` if `bytes` is longer than [`BUILD_ID_MAX`].
    pub fn new(bytes: &[u8]) -> Option<Self> {
        let mut id = Self {
            len: u8::try_from(bytes.len()).ok()?,
            bytes: [0; BUILD_ID_MAX],
        };
        id.bytes.get_mut(..bytes.len())?.copy_from_slice(bytes);
        Some(id)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Debug for BuildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BuildId({self})")
    }
}

impl fmt::Display for BuildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_bytes()
            .iter()
            .try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A thread's new name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Comm {
    pub pid: u32,
    pub tid: u32,
    pub name: TaskName,
    /// The name changed because the thread called `execve`: from here on
    /// `pid` runs a new program. The kernel writes this record before it
    /// maps the new program, so the MMAP records of the new image follow it.
    pub exec: bool,
}

/// A task name (`comm`): up to 15 bytes, not necessarily UTF-8.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TaskName {
    len: u8,
    bytes: [u8; TASK_COMM_LEN],
}

impl TaskName {
    /// Keeps the first [`TASK_COMM_LEN`] bytes: the kernel never writes
    /// more, and a name is informational, not worth failing a record for.
    pub fn new(bytes: &[u8]) -> Self {
        let len = bytes.len().min(TASK_COMM_LEN);
        let mut name = Self {
            len: len as u8, // <= 16
            bytes: [0; TASK_COMM_LEN],
        };
        name.bytes[..len].copy_from_slice(&bytes[..len]);
        name
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Debug for TaskName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(self.as_bytes()))
    }
}

impl fmt::Display for TaskName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.as_bytes()))
    }
}

/// A `PERF_RECORD_FORK`: a new task (`pid`, `tid`) created by the running
/// thread (`ppid`, `ptid`).
///
/// Both processes and threads are tasks: `fork`/`vfork`/`clone` without
/// `CLONE_THREAD` make a new process (`pid != ppid`, and `pid == tid`),
/// `pthread_create` makes a new thread of the same process (`pid == ppid`,
/// `tid != ptid`). A profiler's process table usually cares only about the
/// former; see [`Fork::is_new_process`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fork {
    /// Thread-group id (process id) of the new task.
    pub pid: u32,
    /// Thread-group id of the creating task.
    pub ppid: u32,
    /// Thread id of the new task.
    pub tid: u32,
    /// Thread id of the creating thread.
    pub ptid: u32,
}

impl Fork {
    /// Whether this is a new process (a copy of the parent's address space
    /// until it execs), rather than a new thread in the parent's process.
    pub fn is_new_process(&self) -> bool {
        self.pid != self.ppid
    }
}

/// A `PERF_RECORD_EXIT`: thread `tid` of process `pid` exited.
///
/// Unlike in [`Fork`], `ppid` and `ptid` are both the thread-group id of the
/// exiting task's parent *process* (that is what the kernel writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub pid: u32,
    pub ppid: u32,
    pub tid: u32,
    pub ptid: u32,
}

impl Exit {
    /// Whether the exiting thread is the thread-group leader (`pid == tid`),
    /// which is how a process's exit shows: in `exit_group` every thread
    /// exits, the leader among them, but not necessarily last. Two caveats:
    /// a leader that calls `pthread_exit` leaves its other threads running,
    /// and when a non-leader thread calls `execve` the old leader exits
    /// (this record) and the exec'ing thread takes over its pid, so a
    /// `Comm { exec: true }` for the same pid follows.
    pub fn is_leader(&self) -> bool {
        self.pid == self.tid
    }
}

/// Why a record could not be decoded. Each costs one record, not the ring:
/// the ring reader already knows where the next record starts.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecordError {
    /// Fewer bytes than the 8-byte `perf_event_header`.
    #[error("record of {len} bytes is shorter than its 8-byte header")]
    ShortHeader { len: usize },
    /// `header.size` is smaller than the header itself (0 included).
    #[error("record type {kind} says its size is {size}, less than its header")]
    SizeBelowHeader { kind: u32, size: u16 },
    /// `header.size` is not the number of bytes handed to the parser (the
    /// record was cut short, or the size lies).
    #[error("record type {kind} says its size is {size} but is {len} bytes")]
    SizeMismatch { kind: u32, size: u16, len: usize },
    /// The record is too short for the trailing `sample_id` it must carry.
    #[error("record type {kind} of {size} bytes has no room for its sample_id")]
    NoRoomForSampleId { kind: u32, size: u16 },
    /// The record's fields end before `field`.
    #[error("record type {kind} ends before its {field}")]
    Truncated { kind: u32, field: &'static str },
    /// A string field (file name, comm) has no terminating NUL.
    #[error("record type {kind}: {field} is not NUL-terminated")]
    Unterminated { kind: u32, field: &'static str },
    /// An MMAP2 build-id whose size is larger than the 20 bytes it has.
    #[error("MMAP2 build-id size {size} exceeds {BUILD_ID_MAX}")]
    BuildIdTooLong { size: u8 },
    /// A fixed-size record with bytes after its last field.
    #[error("record type {kind} has {extra} unexpected bytes after its fields")]
    TrailingBytes { kind: u32, extra: usize },
}

/// Decodes one record: `bytes` is exactly one record, header included (its
/// `header.size` must equal `bytes.len()`). `has_sample_id` says whether the
/// event was opened with `sample_id_all` and `PERF_SAMPLE_TID | TIME | CPU`
/// (what [`MappingEvents`](crate::MappingEvents) does), so that every record
/// but `PERF_RECORD_SAMPLE` ends with a 24-byte `sample_id`.
pub fn parse_record(bytes: &[u8], has_sample_id: bool) -> Result<Event, RecordError> {
    let Some(header) = bytes.first_chunk::<HEADER_LEN>() else {
        return Err(RecordError::ShortHeader { len: bytes.len() });
    };
    let kind = u32::from_ne_bytes([header[0], header[1], header[2], header[3]]);
    let misc = u16::from_ne_bytes([header[4], header[5]]);
    let size = u16::from_ne_bytes([header[6], header[7]]);
    if usize::from(size) < HEADER_LEN {
        return Err(RecordError::SizeBelowHeader { kind, size });
    }
    if usize::from(size) != bytes.len() {
        return Err(RecordError::SizeMismatch {
            kind,
            size,
            len: bytes.len(),
        });
    }
    let body = &bytes[HEADER_LEN..];

    let (payload, sample) = if has_sample_id && kind != PERF_RECORD_SAMPLE {
        let Some(split) = body.len().checked_sub(SAMPLE_ID_LEN) else {
            return Err(RecordError::NoRoomForSampleId { kind, size });
        };
        let (payload, sample_id) = body.split_at(split);
        (payload, Some(SampleId::parse(sample_id)))
    } else {
        (body, None)
    };

    let mut fields = Fields {
        kind,
        rest: payload,
    };
    let mut own_time = None;
    let event_kind = match kind {
        PERF_RECORD_MMAP2 => EventKind::Mmap(parse_mmap2(&mut fields, misc)?),
        PERF_RECORD_MMAP => EventKind::Mmap(parse_mmap(&mut fields, misc)?),
        PERF_RECORD_COMM => {
            let pid = fields.u32("pid")?;
            let tid = fields.u32("tid")?;
            let name = fields.c_string("comm")?;
            EventKind::Comm(Comm {
                pid,
                tid,
                name: TaskName::new(name),
                exec: misc & PERF_RECORD_MISC_COMM_EXEC != 0,
            })
        }
        PERF_RECORD_FORK | PERF_RECORD_EXIT => {
            let pid = fields.u32("pid")?;
            let ppid = fields.u32("ppid")?;
            let tid = fields.u32("tid")?;
            let ptid = fields.u32("ptid")?;
            own_time = Some(fields.u64("time")?);
            fields.finish()?;
            if kind == PERF_RECORD_FORK {
                EventKind::Fork(Fork {
                    pid,
                    ppid,
                    tid,
                    ptid,
                })
            } else {
                EventKind::Exit(Exit {
                    pid,
                    ppid,
                    tid,
                    ptid,
                })
            }
        }
        PERF_RECORD_LOST => {
            let _id = fields.u64("id")?;
            let count = fields.u64("lost")?;
            fields.finish()?;
            EventKind::Lost { count }
        }
        kind => EventKind::Other { kind },
    };

    let (time_ns, cpu) = match sample {
        Some(s) => (s.time, s.cpu),
        None => (own_time.unwrap_or(0), 0),
    };
    Ok(Event {
        time_ns,
        cpu,
        kind: event_kind,
    })
}

/// `pid, tid, addr, len, pgoff`: how both kinds of mmap record start.
fn parse_mmap_head(fields: &mut Fields<'_>) -> Result<Mmap, RecordError> {
    Ok(Mmap {
        pid: fields.u32("pid")?,
        tid: fields.u32("tid")?,
        start: fields.u64("addr")?,
        len: fields.u64("len")?,
        pgoff: fields.u64("pgoff")?,
        prot: None,
        flags: None,
        exec: false,
        file: FileRef::Unknown,
        path: Vec::new(),
    })
}

/// The head, `{maj, min, ino, ino_generation | build_id}, prot, flags,
/// filename`.
fn parse_mmap2(fields: &mut Fields<'_>, misc: u16) -> Result<Mmap, RecordError> {
    let mut mmap = parse_mmap_head(fields)?;
    mmap.file = if misc & PERF_RECORD_MISC_MMAP_BUILD_ID != 0 {
        let size = fields.u8("build_id_size")?;
        fields.skip(3, "build_id_size padding")?;
        let bytes = fields.take(BUILD_ID_MAX, "build_id")?;
        if size == 0 {
            FileRef::Unknown
        } else {
            let id = bytes
                .get(..usize::from(size))
                .and_then(BuildId::new)
                .ok_or(RecordError::BuildIdTooLong { size })?;
            FileRef::BuildId(id)
        }
    } else {
        FileRef::Inode {
            major: fields.u32("maj")?,
            minor: fields.u32("min")?,
            ino: fields.u64("ino")?,
            ino_generation: fields.u64("ino_generation")?,
        }
    };
    let prot = fields.u32("prot")?;
    mmap.prot = Some(prot);
    mmap.flags = Some(fields.u32("flags")?);
    mmap.exec = prot & libc::PROT_EXEC as u32 != 0;
    mmap.path = fields.c_string("filename")?.to_vec();
    Ok(mmap)
}

/// The head, `filename`.
fn parse_mmap(fields: &mut Fields<'_>, misc: u16) -> Result<Mmap, RecordError> {
    let mut mmap = parse_mmap_head(fields)?;
    mmap.exec = misc & PERF_RECORD_MISC_MMAP_DATA == 0;
    mmap.path = fields.c_string("filename")?.to_vec();
    Ok(mmap)
}

/// `sample_id` with `PERF_SAMPLE_TID | PERF_SAMPLE_TIME | PERF_SAMPLE_CPU`.
struct SampleId {
    time: u64,
    cpu: u32,
}

impl SampleId {
    /// `bytes` is exactly [`SAMPLE_ID_LEN`] long (the caller split it off).
    fn parse(bytes: &[u8]) -> Self {
        let mut fields = Fields {
            kind: 0,
            rest: bytes,
        };
        // Cannot fail on 24 bytes; defaults keep this free of panics anyway.
        let _pid_tid = fields.u64("pid, tid").unwrap_or(0);
        let time = fields.u64("time").unwrap_or(0);
        let cpu = fields.u32("cpu").unwrap_or(0);
        Self { time, cpu }
    }
}

/// A cursor over a record's fields that names the field it could not read.
struct Fields<'a> {
    kind: u32,
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], RecordError> {
        if self.rest.len() < n {
            return Err(RecordError::Truncated {
                kind: self.kind,
                field,
            });
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(taken)
    }

    fn skip(&mut self, n: usize, field: &'static str) -> Result<(), RecordError> {
        self.take(n, field).map(drop)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, RecordError> {
        Ok(self.take(1, field)?[0])
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, RecordError> {
        let b = self.take(4, field)?;
        Ok(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, RecordError> {
        let b = self.take(8, field)?;
        Ok(u64::from_ne_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    /// A NUL-terminated string filling the rest of the payload (the kernel
    /// pads it with NULs to a multiple of 8 bytes). Returns it without the NUL.
    fn c_string(&mut self, field: &'static str) -> Result<&'a [u8], RecordError> {
        if self.rest.is_empty() {
            return Err(RecordError::Truncated {
                kind: self.kind,
                field,
            });
        }
        let Some(nul) = self.rest.iter().position(|&b| b == 0) else {
            return Err(RecordError::Unterminated {
                kind: self.kind,
                field,
            });
        };
        let s = &self.rest[..nul];
        self.rest = &[];
        Ok(s)
    }

    /// A fixed-size record must have nothing left.
    fn finish(&self) -> Result<(), RecordError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(RecordError::TrailingBytes {
                kind: self.kind,
                extra: self.rest.len(),
            })
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const TIME: u64 = 1_234_567_890;
    pub(crate) const CPU: u32 = 3;

    /// Appends a sample_id and a header to `payload`, as the kernel would.
    pub(crate) fn record(kind: u32, misc: u16, payload: &[u8]) -> Vec<u8> {
        let mut body = payload.to_vec();
        body.extend_from_slice(&77u32.to_ne_bytes()); // sample pid
        body.extend_from_slice(&78u32.to_ne_bytes()); // sample tid
        body.extend_from_slice(&TIME.to_ne_bytes());
        body.extend_from_slice(&CPU.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes()); // res
        with_header(kind, misc, &body)
    }

    /// Prepends a header whose size is the true size.
    pub(crate) fn with_header(kind: u32, misc: u16, body: &[u8]) -> Vec<u8> {
        let size = u16::try_from(HEADER_LEN + body.len()).unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&misc.to_ne_bytes());
        out.extend_from_slice(&size.to_ne_bytes());
        out.extend_from_slice(body);
        out
    }

    /// A NUL-terminated string padded with NULs to a multiple of 8.
    fn c_str(s: &[u8]) -> Vec<u8> {
        let mut v = s.to_vec();
        v.push(0);
        while !v.len().is_multiple_of(8) {
            v.push(0);
        }
        v
    }

    struct P(Vec<u8>);
    impl P {
        fn new() -> Self {
            Self(Vec::new())
        }
        fn u8(mut self, v: u8) -> Self {
            self.0.push(v);
            self
        }
        fn u16(mut self, v: u16) -> Self {
            self.0.extend_from_slice(&v.to_ne_bytes());
            self
        }
        fn u32(mut self, v: u32) -> Self {
            self.0.extend_from_slice(&v.to_ne_bytes());
            self
        }
        fn u64(mut self, v: u64) -> Self {
            self.0.extend_from_slice(&v.to_ne_bytes());
            self
        }
        fn bytes(mut self, v: &[u8]) -> Self {
            self.0.extend_from_slice(v);
            self
        }
    }

    const BUILD_ID: [u8; 20] = [
        0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
    ];
    const PROT_RX: u32 = (libc::PROT_READ | libc::PROT_EXEC) as u32;
    const MAP_PRIVATE: u32 = libc::MAP_PRIVATE as u32;

    /// Payload of an MMAP2 record with a build-id: `pid` at 0, `addr` 8,
    /// `len` 16, `pgoff` 24, `build_id_size` 32, `build_id` 36, `prot` 56,
    /// `flags` 60, `filename` 64.
    fn mmap2_build_id_payload(path: &[u8]) -> Vec<u8> {
        P::new()
            .u32(100)
            .u32(101)
            .u64(0x7f00_0000_0000)
            .u64(0x2000)
            .u64(0x1000)
            .u8(20)
            .u8(0)
            .u16(0)
            .bytes(&BUILD_ID)
            .u32(PROT_RX)
            .u32(MAP_PRIVATE)
            .bytes(&c_str(path))
            .0
    }

    /// Payload of an MMAP2 record with device and inode: as above but `maj`
    /// at 32, `min` 36, `ino` 40, `ino_generation` 48.
    fn mmap2_inode_payload(path: &[u8]) -> Vec<u8> {
        P::new()
            .u32(100)
            .u32(101)
            .u64(0x5555_0000)
            .u64(0x3000)
            .u64(0)
            .u32(8)
            .u32(1)
            .u64(424242)
            .u64(7)
            .u32(PROT_RX)
            .u32(MAP_PRIVATE)
            .bytes(&c_str(path))
            .0
    }

    const MISC_BUILD_ID: u16 = PERF_RECORD_MISC_MMAP_BUILD_ID | 2; // | USER

    #[test]
    fn mmap2_with_build_id() {
        let bytes = record(
            PERF_RECORD_MMAP2,
            MISC_BUILD_ID,
            &mmap2_build_id_payload(b"/usr/bin/true"),
        );
        let event = parse_record(&bytes, true).unwrap();
        assert_eq!(event.time_ns, TIME);
        assert_eq!(event.cpu, CPU);
        let EventKind::Mmap(m) = event.kind else {
            panic!("{event:?}")
        };
        assert_eq!((m.pid, m.tid), (100, 101));
        assert_eq!(
            (m.start, m.len, m.pgoff),
            (0x7f00_0000_0000, 0x2000, 0x1000)
        );
        assert_eq!(m.end(), 0x7f00_0000_2000);
        assert_eq!((m.prot, m.flags), (Some(PROT_RX), Some(MAP_PRIVATE)));
        assert!(m.exec);
        assert_eq!(m.file, FileRef::BuildId(BuildId::new(&BUILD_ID).unwrap()));
        let FileRef::BuildId(id) = m.file else {
            unreachable!()
        };
        assert_eq!(id.to_string(), "deadbeef0102030405060708090a0b0c0d0e0f10");
        assert_eq!(m.path(), Path::new("/usr/bin/true"));
    }

    #[test]
    fn mmap2_with_short_build_id() {
        // md5-style 16-byte build-ids exist; the rest of the 20 bytes is zero.
        let mut payload = mmap2_build_id_payload(b"/lib/x.so");
        payload[32] = 16;
        let bytes = record(PERF_RECORD_MMAP2, MISC_BUILD_ID, &payload);
        let EventKind::Mmap(m) = parse_record(&bytes, true).unwrap().kind else {
            panic!()
        };
        let FileRef::BuildId(id) = m.file else {
            panic!("{m:?}")
        };
        assert_eq!(id.as_bytes(), &BUILD_ID[..16]);
    }

    #[test]
    fn mmap2_with_empty_build_id_is_unknown() {
        let mut payload = mmap2_build_id_payload(b"/lib/x.so");
        payload[32] = 0;
        let bytes = record(PERF_RECORD_MMAP2, MISC_BUILD_ID, &payload);
        let EventKind::Mmap(m) = parse_record(&bytes, true).unwrap().kind else {
            panic!()
        };
        assert_eq!(m.file, FileRef::Unknown);
    }

    #[test]
    fn mmap2_build_id_size_that_lies() {
        let mut payload = mmap2_build_id_payload(b"/lib/x.so");
        payload[32] = 21;
        let bytes = record(PERF_RECORD_MMAP2, MISC_BUILD_ID, &payload);
        assert_eq!(
            parse_record(&bytes, true),
            Err(RecordError::BuildIdTooLong { size: 21 })
        );
    }

    #[test]
    fn mmap2_with_inode() {
        let bytes = record(
            PERF_RECORD_MMAP2,
            2,
            &mmap2_inode_payload(b"/lib/libc.so.6"),
        );
        let EventKind::Mmap(m) = parse_record(&bytes, true).unwrap().kind else {
            panic!()
        };
        assert_eq!(
            m.file,
            FileRef::Inode {
                major: 8,
                minor: 1,
                ino: 424242,
                ino_generation: 7
            }
        );
        assert_eq!(m.path, b"/lib/libc.so.6");
    }

    #[test]
    fn mmap2_non_utf8_and_special_names() {
        for name in [
            &b"/opt/\xff\xfe/lib.so"[..],
            b"[vdso]",
            b"//anon",
            b"/memfd:x (deleted)",
            b"",
            b"/exactly/16bytes",
        ] {
            let bytes = record(PERF_RECORD_MMAP2, 2, &mmap2_inode_payload(name));
            let EventKind::Mmap(m) = parse_record(&bytes, true).unwrap().kind else {
                panic!()
            };
            assert_eq!(m.path, name);
        }
    }

    #[test]
    fn mmap2_not_executable() {
        let mut payload = mmap2_inode_payload(b"/data");
        payload[56..60].copy_from_slice(&(libc::PROT_READ as u32).to_ne_bytes());
        let bytes = record(PERF_RECORD_MMAP2, PERF_RECORD_MISC_MMAP_DATA, &payload);
        let EventKind::Mmap(m) = parse_record(&bytes, true).unwrap().kind else {
            panic!()
        };
        assert!(!m.exec);
    }

    #[test]
    fn mmap_v1() {
        let payload = P::new()
            .u32(5)
            .u32(6)
            .u64(0x1000)
            .u64(0x2000)
            .u64(0x3000)
            .bytes(&c_str(b"/bin/sh"))
            .0;
        let bytes = record(PERF_RECORD_MMAP, 2, &payload);
        let event = parse_record(&bytes, true).unwrap();
        let EventKind::Mmap(m) = event.kind else {
            panic!()
        };
        assert_eq!(
            (m.pid, m.tid, m.start, m.len, m.pgoff),
            (5, 6, 0x1000, 0x2000, 0x3000)
        );
        assert_eq!((m.prot, m.flags, m.file), (None, None, FileRef::Unknown));
        assert!(m.exec);
        assert_eq!(m.path, b"/bin/sh");
        let data = record(PERF_RECORD_MMAP, PERF_RECORD_MISC_MMAP_DATA, &payload);
        let EventKind::Mmap(m) = parse_record(&data, true).unwrap().kind else {
            panic!()
        };
        assert!(!m.exec);
    }

    fn comm_payload(name: &[u8]) -> Vec<u8> {
        P::new().u32(42).u32(43).bytes(&c_str(name)).0
    }

    #[test]
    fn comm_exec_and_rename() {
        let bytes = record(
            PERF_RECORD_COMM,
            PERF_RECORD_MISC_COMM_EXEC,
            &comm_payload(b"true"),
        );
        let event = parse_record(&bytes, true).unwrap();
        assert_eq!(event.pid(), Some(42));
        let EventKind::Comm(c) = event.kind else {
            panic!()
        };
        assert_eq!((c.pid, c.tid, c.exec), (42, 43, true));
        assert_eq!(c.name.as_bytes(), b"true");
        assert_eq!(c.name.to_string(), "true");

        let bytes = record(PERF_RECORD_COMM, 0, &comm_payload(b"worker\xff"));
        let EventKind::Comm(c) = parse_record(&bytes, true).unwrap().kind else {
            panic!()
        };
        assert!(!c.exec);
        assert_eq!(c.name.as_bytes(), b"worker\xff");
    }

    #[test]
    fn comm_longer_than_task_comm_len_is_cut() {
        let bytes = record(PERF_RECORD_COMM, 0, &comm_payload(b"0123456789abcdefXYZ"));
        let EventKind::Comm(c) = parse_record(&bytes, true).unwrap().kind else {
            panic!()
        };
        assert_eq!(c.name.as_bytes(), b"0123456789abcdef");
    }

    fn task_payload() -> Vec<u8> {
        P::new().u32(200).u32(100).u32(201).u32(101).u64(999).0
    }

    #[test]
    fn fork_and_exit() {
        let bytes = record(PERF_RECORD_FORK, 0, &task_payload());
        let event = parse_record(&bytes, true).unwrap();
        assert_eq!(event.time_ns, TIME, "the sample_id time wins");
        let EventKind::Fork(f) = event.kind else {
            panic!()
        };
        assert_eq!((f.pid, f.ppid, f.tid, f.ptid), (200, 100, 201, 101));
        assert!(f.is_new_process());

        let thread = P::new().u32(100).u32(100).u32(105).u32(101).u64(999).0;
        let EventKind::Fork(f) = parse_record(&record(PERF_RECORD_FORK, 0, &thread), true)
            .unwrap()
            .kind
        else {
            panic!()
        };
        assert!(!f.is_new_process());

        let exit = P::new().u32(200).u32(100).u32(200).u32(100).u64(999).0;
        let EventKind::Exit(e) = parse_record(&record(PERF_RECORD_EXIT, 0, &exit), true)
            .unwrap()
            .kind
        else {
            panic!()
        };
        assert!(e.is_leader());
    }

    #[test]
    fn without_sample_id() {
        let bytes = with_header(PERF_RECORD_FORK, 0, &task_payload());
        let event = parse_record(&bytes, false).unwrap();
        assert_eq!((event.time_ns, event.cpu), (999, 0));
        let bytes = with_header(PERF_RECORD_COMM, 0, &comm_payload(b"sh"));
        let event = parse_record(&bytes, false).unwrap();
        assert_eq!((event.time_ns, event.cpu), (0, 0));
        // The same bytes read as if they had a sample_id: the 24 bytes of
        // the task payload would be taken for it and the fields are missing.
        let bytes = with_header(PERF_RECORD_FORK, 0, &task_payload());
        assert_eq!(
            parse_record(&bytes, true),
            Err(RecordError::Truncated {
                kind: PERF_RECORD_FORK,
                field: "pid"
            })
        );
    }

    #[test]
    fn lost() {
        let bytes = record(PERF_RECORD_LOST, 0, &P::new().u64(1).u64(17).0);
        assert_eq!(
            parse_record(&bytes, true).unwrap().kind,
            EventKind::Lost { count: 17 }
        );
    }

    #[test]
    fn other_kinds() {
        // PERF_RECORD_THROTTLE: time, id, stream_id.
        let bytes = record(5, 0, &P::new().u64(1).u64(2).u64(3).0);
        let event = parse_record(&bytes, true).unwrap();
        assert_eq!(event.kind, EventKind::Other { kind: 5 });
        assert_eq!(event.time_ns, TIME);
        // A SAMPLE has no trailing sample_id, even with has_sample_id.
        let bytes = with_header(PERF_RECORD_SAMPLE, 0, &[0; 8]);
        let event = parse_record(&bytes, true).unwrap();
        assert_eq!(
            (event.kind, event.time_ns),
            (EventKind::Other { kind: 9 }, 0)
        );
    }

    // Header-level errors.

    #[test]
    fn empty_input() {
        assert_eq!(
            parse_record(&[], true),
            Err(RecordError::ShortHeader { len: 0 })
        );
    }

    #[test]
    fn cut_inside_header() {
        let bytes = record(PERF_RECORD_FORK, 0, &task_payload());
        for len in 1..HEADER_LEN {
            assert_eq!(
                parse_record(&bytes[..len], true),
                Err(RecordError::ShortHeader { len })
            );
        }
    }

    #[test]
    fn size_zero() {
        let mut bytes = record(PERF_RECORD_FORK, 0, &task_payload());
        bytes[6..8].copy_from_slice(&0u16.to_ne_bytes());
        assert_eq!(
            parse_record(&bytes, true),
            Err(RecordError::SizeBelowHeader {
                kind: PERF_RECORD_FORK,
                size: 0
            })
        );
    }

    #[test]
    fn size_below_header() {
        let mut bytes = record(PERF_RECORD_FORK, 0, &task_payload());
        bytes[6..8].copy_from_slice(&7u16.to_ne_bytes());
        assert_eq!(
            parse_record(&bytes, true),
            Err(RecordError::SizeBelowHeader {
                kind: PERF_RECORD_FORK,
                size: 7
            })
        );
    }

    #[test]
    fn size_larger_than_bytes() {
        // A record cut short: the header promises more than there is.
        let bytes = record(PERF_RECORD_FORK, 0, &task_payload());
        let len = bytes.len() - 8;
        assert_eq!(
            parse_record(&bytes[..len], true),
            Err(RecordError::SizeMismatch {
                kind: PERF_RECORD_FORK,
                size: 56,
                len
            })
        );
    }

    #[test]
    fn size_smaller_than_bytes() {
        let mut bytes = record(PERF_RECORD_FORK, 0, &task_payload());
        bytes[6..8].copy_from_slice(&48u16.to_ne_bytes());
        assert_eq!(
            parse_record(&bytes, true),
            Err(RecordError::SizeMismatch {
                kind: PERF_RECORD_FORK,
                size: 48,
                len: 56
            })
        );
    }

    #[test]
    fn no_room_for_sample_id() {
        let bytes = with_header(PERF_RECORD_COMM, 0, &[0; SAMPLE_ID_LEN - 8]);
        assert_eq!(
            parse_record(&bytes, true),
            Err(RecordError::NoRoomForSampleId {
                kind: PERF_RECORD_COMM,
                size: 24
            })
        );
    }

    #[test]
    fn other_kind_without_room_for_sample_id() {
        let bytes = with_header(5, 0, &[]);
        assert_eq!(
            parse_record(&bytes, true),
            Err(RecordError::NoRoomForSampleId { kind: 5, size: 8 })
        );
    }

    /// Builds a record from the first `cut` bytes of `payload` with an honest
    /// header (so the size agrees with the bytes: the body is what is short)
    /// and parses it.
    fn parse_cut(kind: u32, misc: u16, payload: &[u8], cut: usize) -> Result<Event, RecordError> {
        parse_record(&record(kind, misc, &payload[..cut]), true)
    }

    fn truncated(kind: u32, field: &'static str) -> Result<Event, RecordError> {
        Err(RecordError::Truncated { kind, field })
    }

    /// One test per place a record's body can end too early: `$cut` bytes of
    /// the payload are kept, and the error must name `$field`.
    macro_rules! truncation_tests {
        ($($name:ident: $kind:expr, $misc:expr, $payload:expr, $cut:expr => $expected:expr;)*) => {
            $(
                #[test]
                fn $name() {
                    let payload = $payload;
                    assert_eq!(parse_cut($kind, $misc, &payload, $cut), $expected);
                }
            )*
        };
    }

    const M2: u32 = PERF_RECORD_MMAP2;
    const M1: u32 = PERF_RECORD_MMAP;

    fn m1_payload() -> Vec<u8> {
        P::new()
            .u32(5)
            .u32(6)
            .u64(0x1000)
            .u64(0x2000)
            .u64(0x3000)
            .bytes(&c_str(b"/bin/sh"))
            .0
    }

    fn lost_payload() -> Vec<u8> {
        P::new().u64(1).u64(17).0
    }

    truncation_tests! {
        mmap2_cut_before_pid: M2, 2, mmap2_inode_payload(b"/x"), 0 => truncated(M2, "pid");
        mmap2_cut_inside_pid: M2, 2, mmap2_inode_payload(b"/x"), 3 => truncated(M2, "pid");
        mmap2_cut_before_tid: M2, 2, mmap2_inode_payload(b"/x"), 4 => truncated(M2, "tid");
        mmap2_cut_before_addr: M2, 2, mmap2_inode_payload(b"/x"), 8 => truncated(M2, "addr");
        mmap2_cut_before_len: M2, 2, mmap2_inode_payload(b"/x"), 16 => truncated(M2, "len");
        mmap2_cut_before_pgoff: M2, 2, mmap2_inode_payload(b"/x"), 24 => truncated(M2, "pgoff");
        mmap2_cut_before_maj: M2, 2, mmap2_inode_payload(b"/x"), 32 => truncated(M2, "maj");
        mmap2_cut_before_min: M2, 2, mmap2_inode_payload(b"/x"), 36 => truncated(M2, "min");
        mmap2_cut_before_ino: M2, 2, mmap2_inode_payload(b"/x"), 40 => truncated(M2, "ino");
        mmap2_cut_before_ino_generation: M2, 2, mmap2_inode_payload(b"/x"), 48 => truncated(M2, "ino_generation");
        mmap2_cut_before_prot: M2, 2, mmap2_inode_payload(b"/x"), 56 => truncated(M2, "prot");
        mmap2_cut_before_flags: M2, 2, mmap2_inode_payload(b"/x"), 60 => truncated(M2, "flags");
        mmap2_cut_before_filename: M2, 2, mmap2_inode_payload(b"/x"), 64 => truncated(M2, "filename");
        mmap2_cut_inside_filename: M2, 2, mmap2_inode_payload(b"/x"), 66 =>
            Err(RecordError::Unterminated { kind: M2, field: "filename" });
        mmap2_build_id_cut_before_size: M2, MISC_BUILD_ID, mmap2_build_id_payload(b"/x"), 32 =>
            truncated(M2, "build_id_size");
        mmap2_build_id_cut_in_padding: M2, MISC_BUILD_ID, mmap2_build_id_payload(b"/x"), 34 =>
            truncated(M2, "build_id_size padding");
        mmap2_build_id_cut_before_build_id: M2, MISC_BUILD_ID, mmap2_build_id_payload(b"/x"), 36 =>
            truncated(M2, "build_id");
        mmap2_build_id_cut_inside_build_id: M2, MISC_BUILD_ID, mmap2_build_id_payload(b"/x"), 50 =>
            truncated(M2, "build_id");
        mmap2_build_id_cut_before_prot: M2, MISC_BUILD_ID, mmap2_build_id_payload(b"/x"), 56 =>
            truncated(M2, "prot");
        mmap2_build_id_cut_before_filename: M2, MISC_BUILD_ID, mmap2_build_id_payload(b"/x"), 64 =>
            truncated(M2, "filename");
        mmap_cut_before_pid: M1, 2, m1_payload(), 0 => truncated(M1, "pid");
        mmap_cut_before_tid: M1, 2, m1_payload(), 4 => truncated(M1, "tid");
        mmap_cut_before_addr: M1, 2, m1_payload(), 8 => truncated(M1, "addr");
        mmap_cut_before_len: M1, 2, m1_payload(), 16 => truncated(M1, "len");
        mmap_cut_before_pgoff: M1, 2, m1_payload(), 24 => truncated(M1, "pgoff");
        mmap_cut_before_filename: M1, 2, m1_payload(), 32 => truncated(M1, "filename");
        mmap_cut_inside_filename: M1, 2, m1_payload(), 35 =>
            Err(RecordError::Unterminated { kind: M1, field: "filename" });
        comm_cut_before_pid: PERF_RECORD_COMM, 0, comm_payload(b"sh"), 0 => truncated(PERF_RECORD_COMM, "pid");
        comm_cut_before_tid: PERF_RECORD_COMM, 0, comm_payload(b"sh"), 4 => truncated(PERF_RECORD_COMM, "tid");
        comm_cut_before_comm: PERF_RECORD_COMM, 0, comm_payload(b"sh"), 8 => truncated(PERF_RECORD_COMM, "comm");
        comm_cut_inside_comm: PERF_RECORD_COMM, 0, comm_payload(b"sh"), 10 =>
            Err(RecordError::Unterminated { kind: PERF_RECORD_COMM, field: "comm" });
        fork_cut_before_pid: PERF_RECORD_FORK, 0, task_payload(), 0 => truncated(PERF_RECORD_FORK, "pid");
        fork_cut_before_ppid: PERF_RECORD_FORK, 0, task_payload(), 4 => truncated(PERF_RECORD_FORK, "ppid");
        fork_cut_before_tid: PERF_RECORD_FORK, 0, task_payload(), 8 => truncated(PERF_RECORD_FORK, "tid");
        fork_cut_before_ptid: PERF_RECORD_FORK, 0, task_payload(), 12 => truncated(PERF_RECORD_FORK, "ptid");
        fork_cut_before_time: PERF_RECORD_FORK, 0, task_payload(), 16 => truncated(PERF_RECORD_FORK, "time");
        fork_cut_inside_time: PERF_RECORD_FORK, 0, task_payload(), 20 => truncated(PERF_RECORD_FORK, "time");
        exit_cut_before_pid: PERF_RECORD_EXIT, 0, task_payload(), 0 => truncated(PERF_RECORD_EXIT, "pid");
        exit_cut_before_ppid: PERF_RECORD_EXIT, 0, task_payload(), 4 => truncated(PERF_RECORD_EXIT, "ppid");
        exit_cut_before_tid: PERF_RECORD_EXIT, 0, task_payload(), 8 => truncated(PERF_RECORD_EXIT, "tid");
        exit_cut_before_ptid: PERF_RECORD_EXIT, 0, task_payload(), 12 => truncated(PERF_RECORD_EXIT, "ptid");
        exit_cut_before_time: PERF_RECORD_EXIT, 0, task_payload(), 16 => truncated(PERF_RECORD_EXIT, "time");
        lost_cut_before_id: PERF_RECORD_LOST, 0, lost_payload(), 0 => truncated(PERF_RECORD_LOST, "id");
        lost_cut_before_lost: PERF_RECORD_LOST, 0, lost_payload(), 8 => truncated(PERF_RECORD_LOST, "lost");
        lost_cut_inside_lost: PERF_RECORD_LOST, 0, lost_payload(), 12 => truncated(PERF_RECORD_LOST, "lost");
    }

    #[test]
    fn fork_with_trailing_bytes() {
        let mut payload = task_payload();
        payload.extend_from_slice(&[0; 8]);
        assert_eq!(
            parse_record(&record(PERF_RECORD_FORK, 0, &payload), true),
            Err(RecordError::TrailingBytes {
                kind: PERF_RECORD_FORK,
                extra: 8
            })
        );
    }

    #[test]
    fn lost_with_trailing_bytes() {
        let mut payload = lost_payload();
        payload.extend_from_slice(&[0; 8]);
        assert_eq!(
            parse_record(&record(PERF_RECORD_LOST, 0, &payload), true),
            Err(RecordError::TrailingBytes {
                kind: PERF_RECORD_LOST,
                extra: 8
            })
        );
    }

    /// Every prefix of every kind of record, and every record with its size
    /// field set to every value, parses or fails without panicking.
    #[test]
    fn no_panic_on_any_cut_or_size() {
        let records = [
            record(
                M2,
                MISC_BUILD_ID,
                &mmap2_build_id_payload(b"/usr/lib/libc.so.6"),
            ),
            record(M2, 2, &mmap2_inode_payload(b"/usr/lib/libc.so.6")),
            record(M1, 2, &m1_payload()),
            record(PERF_RECORD_COMM, 0, &comm_payload(b"bash")),
            record(PERF_RECORD_FORK, 0, &task_payload()),
            record(PERF_RECORD_EXIT, 0, &task_payload()),
            record(PERF_RECORD_LOST, 0, &lost_payload()),
        ];
        for rec in &records {
            for cut in 0..=rec.len() {
                let _ = parse_record(&rec[..cut], true);
                let _ = parse_record(&rec[..cut], false);
                if cut >= HEADER_LEN {
                    let mut honest = rec[..cut].to_vec();
                    honest[6..8].copy_from_slice(&(cut as u16).to_ne_bytes());
                    let _ = parse_record(&honest, true);
                    let _ = parse_record(&honest, false);
                }
            }
            for size in 0..=u16::MAX {
                let mut lying = rec.clone();
                lying[6..8].copy_from_slice(&size.to_ne_bytes());
                let _ = parse_record(&lying, true);
            }
        }
    }
}
