//! HotSpot JVMs on the sampling thread: which processes to read a JVM in,
//! asking again while one is starting (its code cache is made after
//! `libjvm.so` is mapped), and handing what was read to the walker (how to
//! step through Java frames) and the aggregator (their names).

use std::{sync::Arc, time::Instant};

use stackscope_jvm::Jvm;

use super::process::ProcessRecord;
use crate::aggregate::Aggregator;

/// Tries at reading a process's JVM, a second apart.
const MAX_TRIES: u8 = 10;

/// What the metadata worker read of a process's JVM: `Ok(None)` when it
/// is not HotSpot's, an error while it cannot be read (yet, or at all).
pub(super) type FoundJvm = Result<Option<Arc<Jvm>>, String>;

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
    pub stats: JvmStats,
}

/// What the reads found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct JvmStats {
    /// Processes whose JVM is read.
    pub processes: u64,
    /// Processes that map `libjvm.so` whose JVM could not be read.
    pub unreadable: u64,
}

impl JvmProcesses {
    /// Process `tgid` maps `libjvm.so`: read its JVM unless asked already.
    pub fn maybe_jvm(&mut self, tgid: u32, record: &mut JvmRecord) {
        if matches!(record, JvmRecord::Unknown) {
            *record = JvmRecord::Asked { tries: 1 };
            self.wanted.push(tgid);
        }
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

    /// What the worker read of `tgid`'s JVM.
    pub fn found(
        &mut self,
        tgid: u32,
        record: &mut ProcessRecord,
        found: FoundJvm,
        aggregator: &mut Aggregator,
        now: Instant,
    ) {
        let JvmRecord::Asked { tries } = record.jvm else {
            return;
        };
        match found {
            Ok(Some(jvm)) => {
                tracing::debug!(tgid, "reading the process's Java frames");
                self.stats.processes += 1;
                record.jvm = JvmRecord::Found;
                aggregator.add_jvm(tgid, record.started(), Arc::clone(&jvm));
                record.run_jvm(jvm);
            }
            Ok(None) => record.jvm = JvmRecord::None,
            Err(err) if tries < MAX_TRIES => {
                tracing::debug!(tgid, "the JVM is not readable yet: {err}");
                record.jvm = JvmRecord::Asked { tries: tries + 1 };
                self.retry
                    .push((tgid, now + std::time::Duration::from_secs(1)));
            }
            Err(err) => {
                tracing::debug!(tgid, "no Java frames: {err}");
                self.stats.unreadable += 1;
                record.jvm = JvmRecord::None;
            }
        }
    }
}
