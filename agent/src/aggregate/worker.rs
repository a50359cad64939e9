//! The thread that names frames and builds batches, off the sampling loop.
//!
//! Owns the [`Symbolizer`] (blazesym's state is not `Send`, and the first
//! lookup in a large binary reads its symbols and DWARF, which can take a
//! while: the loop that drains the ring buffer must not wait for that), a
//! queue of one finished interval, the build statistics and the sink each
//! built batch goes to (the exporter's queue, which takes it without
//! waiting).
//!
//! Memory: one interval waits at most; an interval finished while the
//! worker is still busy with the one before and another waiting is dropped
//! and counted.

use std::{
    io,
    sync::{
        Arc, Mutex, PoisonError,
        mpsc::{self, SyncSender, TrySendError},
    },
    thread::JoinHandle,
    time::Instant,
};

use prost::Message as _;

use super::{BatchOptions, Interval, MappingKey, build_batch};
use crate::{export::debuginfo::UploadQueue, run::BatchSink};
use stackscope_symbolize::node::{SymbolizeStats, Symbolizer, SymbolizerConfig};
use stackscope_telemetry::StateSize;

/// What the worker has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerStats {
    pub batches_built: u64,
    /// Intervals dropped because the worker was still busy.
    pub intervals_dropped: u64,
    /// Intervals without a sample: no batch is built for them.
    pub intervals_empty: u64,
    /// Samples in the batches built (sum of counts).
    pub samples_in_batches: u64,
    /// Time to build a batch (naming included): the last, the longest and
    /// the total, in microseconds.
    pub build_micros_last: u64,
    pub build_micros_max: u64,
    pub build_micros_total: u64,
    /// Times the heap's free pages were handed back to the kernel.
    pub heap_trims: u64,
    /// The last batch: encoded size and dictionary sizes.
    pub last_batch_bytes: u64,
    pub last_batch_locations: u64,
    pub last_batch_stacks: u64,
    pub last_batch_samples: u64,
    pub symbolize: SymbolizeStats,
}

/// See the module documentation.
#[derive(Debug)]
pub struct BatchWorker {
    intervals: Option<SyncSender<Interval>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Mutex<WorkerStats>>,
    /// The symbolizer's state sizes, as of the last batch.
    state: Arc<Mutex<Vec<StateSize>>>,
    dropped: u64,
}

impl BatchWorker {
    /// Starts the worker thread; it reads kallsyms before the first batch.
    /// Each batch goes to `sink` (none: built and dropped); binaries of
    /// each batch that carry symbols are offered to `uploads`.
    pub fn start(
        symbolizer: SymbolizerConfig,
        options: BatchOptions,
        uploads: Option<UploadQueue>,
        mut sink: Option<Box<dyn BatchSink>>,
    ) -> io::Result<Self> {
        let (intervals, waiting) = mpsc::sync_channel::<Interval>(1);
        let shared = Arc::new(Mutex::new(WorkerStats::default()));
        let stats = Arc::clone(&shared);
        let state = Arc::new(Mutex::new(Vec::new()));
        let worker_state = Arc::clone(&state);
        let publish_state = move |symbolizer: &Symbolizer| {
            let mut sizes = Vec::new();
            symbolizer.state_sizes(&mut sizes);
            *worker_state.lock().unwrap_or_else(PoisonError::into_inner) = sizes;
        };
        let thread = std::thread::Builder::new()
            .name("stackscope-batch".into())
            .spawn(move || {
                let mut symbolizer = Symbolizer::new(symbolizer);
                lock(&stats).symbolize = symbolizer.stats();
                publish_state(&symbolizer);
                for interval in waiting {
                    // The last interval's tables are freed by now (its
                    // batch too, unless the exporter still holds it).
                    if release_free_heap() {
                        lock(&stats).heap_trims += 1;
                    }
                    if interval.samples.is_empty() {
                        lock(&stats).intervals_empty += 1;
                        continue;
                    }
                    let started = Instant::now();
                    let batch = build_batch(&interval, &mut symbolizer, &options);
                    let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                    if let Some(uploads) = &uploads {
                        offer_binaries(&interval, uploads);
                    }
                    // Closes the interval's files now, not with the next one.
                    drop(interval);
                    {
                        let mut stats = lock(&stats);
                        stats.batches_built += 1;
                        stats.samples_in_batches +=
                            batch.samples.iter().map(|s| s.count).sum::<u64>();
                        stats.build_micros_last = micros;
                        stats.build_micros_max = stats.build_micros_max.max(micros);
                        stats.build_micros_total += micros;
                        stats.last_batch_bytes = batch.encoded_len() as u64;
                        stats.last_batch_locations = batch.locations.len() as u64;
                        stats.last_batch_stacks = batch.stacks.len() as u64;
                        stats.last_batch_samples = batch.samples.len() as u64;
                        stats.symbolize = symbolizer.stats();
                    }
                    publish_state(&symbolizer);
                    if let Some(sink) = sink.as_mut() {
                        sink.send(batch);
                    }
                }
            })?;
        Ok(Self {
            intervals: Some(intervals),
            thread: Some(thread),
            shared,
            state,
            dropped: 0,
        })
    }

    /// Hands a finished interval over without waiting; it is dropped (and
    /// counted) when one is already waiting.
    pub fn submit(&mut self, interval: Interval) {
        let Some(intervals) = &self.intervals else {
            return;
        };
        match intervals.try_send(interval) {
            Ok(()) => {}
            Err(TrySendError::Full(interval)) => {
                self.dropped += 1;
                tracing::warn!(
                    "still building earlier batches: dropped the interval of {} samples \
                     ({} intervals dropped so far)",
                    interval.sample_count(),
                    self.dropped
                );
            }
            Err(TrySendError::Disconnected(_)) => {
                self.dropped += 1;
                if self.dropped == 1 {
                    tracing::error!("the batch worker has stopped: intervals are dropped");
                }
            }
        }
    }

    /// The symbolizer's state sizes, as of the last batch built.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        out.extend_from_slice(&self.state.lock().unwrap_or_else(PoisonError::into_inner));
    }

    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            intervals_dropped: self.dropped,
            ..*lock(&self.shared)
        }
    }

    /// Hands over the last interval (waiting for room), lets the worker
    /// build everything it was given and hand it to the sink, and returns
    /// the final statistics. Blocks until the worker is done.
    pub fn finish(mut self, last: Interval) -> WorkerStats {
        if let Some(intervals) = self.intervals.take() {
            // Fails only if the worker is gone; the interval is lost then.
            if intervals.send(last).is_err() {
                self.dropped += 1;
            }
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the batch worker panicked");
        }
        self.stats()
    }
}

impl Drop for BatchWorker {
    fn drop(&mut self) {
        // Closing the queue ends the thread after its current batch; it is
        // not joined here, so dropping never blocks.
        self.intervals.take();
    }
}

fn lock(stats: &Mutex<WorkerStats>) -> std::sync::MutexGuard<'_, WorkerStats> {
    stats.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Free heap the allocator may keep in memory for the next interval: each
/// interval allocates and frees tens of MB (its tables, its batch), and
/// memory kept is reused without a page fault, where pages handed back are
/// faulted in again (and zeroed) by the next interval.
const FREE_HEAP_KEPT: u64 = 16 << 20;

/// Hands the free pages of the heap back to the kernel once the agent
/// holds more than [`FREE_HEAP_KEPT`] of them in memory; true if it did.
/// glibc keeps what was freed in its arenas (an hour's soak saw 43 MB free
/// beside 38 MB in use), but trimming after every interval cost 5% of the
/// agent's CPU at 997 Hz in page faults and madvise calls. Once per
/// interval, off the sampling thread.
///
/// What is free and in memory is the anonymous memory less what the heap
/// has in use: the heap's own free figure (`fordblks`) still counts chunks
/// whose pages a trim already handed back, so it would call for a trim
/// every interval once the heap is fragmented.
fn release_free_heap() -> bool {
    let Some(heap) = stackscope_telemetry::heap_bytes() else {
        return false;
    };
    let Some(anonymous_kib) = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| stackscope_telemetry::status_kib(&status, "RssAnon:"))
    else {
        return false;
    };
    let free_in_memory = (anonymous_kib * 1024).saturating_sub(heap.in_use as u64);
    let trim = free_in_memory > FREE_HEAP_KEPT;
    tracing::debug!(free_in_memory, trim, "heap after the interval");
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if trim {
        // SAFETY: malloc_trim takes no pointer and only reorganises the
        // allocator's own free lists.
        unsafe {
            libc::malloc_trim(0);
        }
    }
    trim
}

/// Offers the interval's binaries with a build-id for upload (each once:
/// the queue remembers what it was offered).
fn offer_binaries(interval: &Interval, uploads: &UploadQueue) {
    for mapping in &interval.mappings {
        let (MappingKey::User { id, path }, Some(object)) = (&mapping.key, &mapping.file) else {
            continue;
        };
        let Some(build_id) = id.build_id() else {
            continue;
        };
        uploads.offer(
            build_id,
            || object.open_now().ok().and_then(|f| f.try_clone().ok()),
            path,
        );
    }
}
