//! HotSpot JVMs on the sampling thread: which processes to read a JVM in,
//! asking again while one is starting (its code cache is made after
//! `libjvm.so` is mapped), and handing what was read to the walker (how to
//! step through Java frames) and the aggregator (their names).

use std::{sync::Arc, time::Instant};

use stackscope_jvm::Jvm;

/// What the JVMs' caches (code blobs, method names, inlining) hold
/// together when memory is plentiful: eight JVMs with their caches full.
pub const DEFAULT_CODE_BYTES: usize = 64 << 20;

/// Tries at reading a process's JVM, a second apart.
const MAX_TRIES: u8 = 10;

/// How long a process's samples wait for the first answer about its JVM
/// (a job dropped on a full queue is asked again; a worker that stopped
/// never answers).
const FIRST_ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// What the metadata worker read of a process's JVM: `Ok(None)` when it
/// is not HotSpot's, an error while it cannot be read (yet, or at all).
pub(super) type FoundJvm = Result<Option<Arc<Jvm>>, String>;

/// Processes waiting for their first answer at most (more are walked as
/// any JIT's until theirs comes).
const MAX_AWAITING: usize = 256;

/// A process's JVM, as far as the agent knows.
#[derive(Debug, Default)]
pub(super) enum JvmRecord {
    #[default]
    Unknown,
    Asked {
        tries: u8,
    },
    Found,
    /// Not a JVM, or one that could not be read in [`MAX_TRIES`] tries.
    None,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct JvmProcesses {
    wanted: Vec<u32>,
    /// Processes to ask about again, when due.
    retry: Vec<(u32, Instant)>,
    /// Processes whose samples wait for the first answer, and since when.
    awaiting: Vec<(u32, Instant)>,
    pub stats: JvmStats,
}

/// What the reads found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct JvmStats {
    /// Processes whose JVM is read.
    pub processes: u64,
    /// Processes that map `libjvm.so` whose JVM could not be read.
    pub unreadable: u64,
    /// Code blobs read from the JVMs' code caches, and reads that failed
    /// (a frame there ends its walk).
    pub blobs_read: u64,
    pub blob_errors: u64,
    /// Cached blobs found replaced when checked again (read anew).
    pub blobs_replaced: u64,
    /// Methods named, and those that could not be (their frames keep the
    /// process's `[jit]` name).
    pub names_read: u64,
    pub name_errors: u64,
    /// Compiled methods whose inlining was read, and those whose could not
    /// be (their frames show the compiled method alone).
    pub scopes_read: u64,
    pub scope_errors: u64,
    /// JVMs' caches emptied to keep them all within their share of the
    /// memory limit (read again as samples need them).
    pub caches_cleared: u64,
}

impl JvmStats {
    /// These, with what the JVMs' reads found.
    pub fn with_reads(self, reads: stackscope_jvm::JvmStats) -> Self {
        Self {
            blobs_read: reads.blobs_read,
            blob_errors: reads.blob_errors,
            blobs_replaced: reads.blobs_replaced,
            names_read: reads.names_read,
            name_errors: reads.name_errors,
            scopes_read: reads.scopes_read,
            scope_errors: reads.scope_errors,
            caches_cleared: reads.caches_cleared,
            ..self
        }
    }
}

impl JvmProcesses {
    /// Process `tgid` maps `libjvm.so`: read its JVM unless asked already;
    /// true when asked now (its walks wait for the first answer).
    pub fn maybe_jvm(&mut self, tgid: u32, record: &mut JvmRecord, now: Instant) -> bool {
        if !matches!(record, JvmRecord::Unknown) {
            return false;
        }
        *record = JvmRecord::Asked { tries: 1 };
        self.wanted.push(tgid);
        if self.awaiting.len() < MAX_AWAITING {
            self.awaiting.push((tgid, now));
        }
        true
    }

    /// `tgids`' job was dropped: they are asked again with the next.
    pub fn not_asked(&mut self, tgids: Vec<u32>) {
        self.wanted.extend(tgids);
    }

    /// The processes whose first answer is overdue: their samples wait no
    /// longer (they are walked as any JIT's until an answer comes).
    pub fn overdue(&mut self, now: Instant) -> Vec<u32> {
        let mut overdue = Vec::new();
        self.awaiting.retain(|&(tgid, since)| {
            let late = now.duration_since(since) > FIRST_ANSWER_WAIT;
            if late {
                overdue.push(tgid);
            }
            !late
        });
        overdue
    }

    /// The processes to read a JVM in now.
    pub fn take_wanted(&mut self, now: Instant) -> Vec<u32> {
        let mut wanted = std::mem::take(&mut self.wanted);
        self.retry.retain(|&(tgid, due)| {
            if due <= now {
                wanted.push(tgid);
            }
            due > now
        });
        wanted
    }

    /// What the worker read of `tgid`'s JVM, for the walker (whose held
    /// samples wait for the first answer only: while a JVM starts, its
    /// samples are walked as any JIT's) and the aggregator:
    /// `Some(Some(jvm))` when found, `Some(None)` when not (yet), `None`
    /// when the record did not ask (the process exec'd since: it takes
    /// nothing).
    pub fn found(
        &mut self,
        tgid: u32,
        record: &mut JvmRecord,
        found: FoundJvm,
        now: Instant,
    ) -> Option<Option<Arc<Jvm>>> {
        let JvmRecord::Asked { tries } = *record else {
            return None;
        };
        self.awaiting.retain(|&(awaited, _)| awaited != tgid);
        match found {
            Ok(Some(jvm)) => {
                tracing::debug!(tgid, "reading the process's Java frames");
                self.stats.processes += 1;
                *record = JvmRecord::Found;
                return Some(Some(jvm));
            }
            Ok(None) => *record = JvmRecord::None,
            Err(err) if tries < MAX_TRIES => {
                tracing::debug!(tgid, "the JVM is not readable yet: {err}");
                *record = JvmRecord::Asked { tries: tries + 1 };
                self.retry
                    .push((tgid, now + std::time::Duration::from_secs(1)));
            }
            Err(err) => {
                tracing::debug!(tgid, "no Java frames: {err}");
                self.stats.unreadable += 1;
                *record = JvmRecord::None;
            }
        }
        Some(None)
    }
}
