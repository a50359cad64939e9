//! The thread that names frames and builds batches, off the sampling loop.
//!
//! Owns the [`Symbolizer`] (blazesym's state is not `Send`, and the first
//! lookup in a large binary reads its symbols and DWARF, which can take a
//! while: the loop that drains the ring buffer must not wait for that), a
//! queue of one finished interval, the build statistics and the sink each
//! built batch goes to (the exporter's queue, which takes it without
//! waiting).
//!
//! The files the symbolizer keeps open are bounded by their share of the
//! memory budget plus the room the sink (the export queue) has left: only
//! this thread fills that queue, a batch an interval, and the symbolizer
//! closes what is over its bound before the batch is queued.
//!
//! Memory: one interval waits at most, and the buffers of the last one
//! built wait to be filled again (see `IntervalBuffers`). While one waits
//! (the worker still busy with the one before: a slow first read of large
//! files' DWARF), the interval being aggregated is not ended at its
//! boundary but runs on to the next one ([`BatchWorker::try_submit`]): its
//! samples are kept, in a longer interval bounded like any other, rather
//! than dropped.

use std::{
    io,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
        mpsc::{self, SyncSender, TrySendError},
    },
    thread::JoinHandle,
    time::Instant,
};

use prost::Message as _;

use super::{BatchOptions, Interval, IntervalBuffers, MappingKey, build_batch};
use crate::{export::debuginfo::UploadQueue, run::BatchSink};
use stackscope_symbolize::node::{
    DEFAULT_MAX_OPEN_BYTES, SymbolizeStats, Symbolizer, SymbolizerConfig,
};
use stackscope_telemetry::StateSize;

/// What the worker has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerStats {
    pub batches_built: u64,
    /// Interval ends passed over because an interval still waited for the
    /// worker: the interval ran on to the next boundary.
    pub intervals_extended: u64,
    /// Intervals lost: the worker had stopped.
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
    /// An interval was handed over and the worker has not taken it yet.
    waiting: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Mutex<WorkerStats>>,
    /// The symbolizer's state sizes, as of the last batch.
    state: Arc<Mutex<Vec<StateSize>>>,
    /// The buffers of the last interval whose batch is built, for the next
    /// interval to fill (see [`IntervalBuffers`]).
    spare: Arc<Mutex<Option<IntervalBuffers>>>,
    dropped: u64,
    extended: u64,
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
        let (intervals, queue) = mpsc::sync_channel::<Interval>(1);
        let waiting = Arc::new(AtomicBool::new(false));
        let taken = Arc::clone(&waiting);
        let shared = Arc::new(Mutex::new(WorkerStats::default()));
        let stats = Arc::clone(&shared);
        let state = Arc::new(Mutex::new(Vec::new()));
        let worker_state = Arc::clone(&state);
        let spare = Arc::new(Mutex::new(None));
        let built = Arc::clone(&spare);
        let publish_state = move |symbolizer: &Symbolizer| {
            let mut sizes = Vec::new();
            symbolizer.state_sizes(&mut sizes);
            *lock(&worker_state) = sizes;
        };
        let thread = std::thread::Builder::new()
            .name("stackscope-batch".into())
            .spawn(move || {
                // Its own share of the budget; the export queue's room is
                // lent on top, up to what the symbolizer holds by default.
                let own_share = symbolizer.max_open_bytes;
                let most = own_share.max(DEFAULT_MAX_OPEN_BYTES);
                let mut symbolizer = Symbolizer::new(symbolizer);
                lock(&stats).symbolize = symbolizer.stats();
                publish_state(&symbolizer);
                for interval in queue {
                    taken.store(false, Ordering::Release);
                    // The last interval's batch is freed by now (unless the
                    // exporter still holds it); its buffers wait in `built`
                    // for the next interval, its tables are the current one's.
                    if release_free_heap() {
                        lock(&stats).heap_trims += 1;
                    }
                    if interval.samples.is_empty() {
                        lock(&stats).intervals_empty += 1;
                        continue;
                    }
                    let started = Instant::now();
                    let lent = sink.as_ref().map_or(0, |sink| sink.spare_bytes());
                    symbolizer.set_max_open_bytes(own_share.saturating_add(lent).min(most));
                    let batch = build_batch(&interval, &mut symbolizer, &options);
                    // Sized once here: sizing walks every stack's locations,
                    // as encoding the batch does again.
                    let last_batch_bytes = batch.encoded_len() as u64;
                    let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                    if let Some(uploads) = &uploads {
                        offer_binaries(&interval, uploads);
                    }
                    // Closes the interval's files now, not with the next one.
                    // A spare not taken (this build overlapped an interval
                    // end) is freed after the lock is let go.
                    let untaken = lock(&built).replace(interval.into_buffers());
                    drop(untaken);
                    {
                        let mut stats = lock(&stats);
                        stats.batches_built += 1;
                        stats.samples_in_batches +=
                            batch.samples.iter().map(|s| s.count).sum::<u64>();
                        stats.build_micros_last = micros;
                        stats.build_micros_max = stats.build_micros_max.max(micros);
                        stats.build_micros_total += micros;
                        stats.last_batch_bytes = last_batch_bytes;
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
            waiting,
            thread: Some(thread),
            shared,
            state,
            spare,
            dropped: 0,
            extended: 0,
        })
    }

    /// Whether an interval handed over would be taken without waiting: none
    /// waits for the worker.
    pub fn has_room(&self) -> bool {
        !self.waiting.load(Ordering::Acquire)
    }

    /// Ends the interval (`finish`, given the buffers of the last interval
    /// built, if the worker has given them back) and hands it over, if the
    /// worker has room for it; otherwise leaves it running (counted, and
    /// said once in a while) and returns false.
    pub fn try_submit(&mut self, finish: impl FnOnce(Option<IntervalBuffers>) -> Interval) -> bool {
        if !self.has_room() {
            self.extended += 1;
            if self.extended.is_power_of_two() {
                tracing::warn!(
                    "still building the last batch: the interval runs on to the next boundary \
                     ({} interval ends passed over so far)",
                    self.extended
                );
            }
            return false;
        }
        let Some(intervals) = &self.intervals else {
            return true;
        };
        // Set before the send: the worker clears it once it has taken the
        // interval, which may be at once.
        self.waiting.store(true, Ordering::Release);
        let spare = lock(&self.spare).take();
        match intervals.try_send(finish(spare)) {
            Ok(()) => {}
            // Only this thread sends, and the worker takes before it
            // clears the flag: an interval waits only while it is set.
            Err(TrySendError::Full(_)) => {
                self.dropped += 1;
                tracing::error!("the batch worker's queue was full: an interval was dropped");
            }
            Err(TrySendError::Disconnected(_)) => {
                // Nothing waits: later intervals end (and are dropped) at
                // their boundaries rather than running on for ever.
                self.waiting.store(false, Ordering::Release);
                self.dropped += 1;
                if self.dropped == 1 {
                    tracing::error!("the batch worker has stopped: intervals are dropped");
                }
            }
        }
        true
    }

    /// The symbolizer's state sizes, as of the last batch built, and the
    /// spare interval buffers.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        out.extend_from_slice(&lock(&self.state));
        let spare = lock(&self.spare)
            .as_ref()
            .map_or(0, IntervalBuffers::capacity_bytes);
        out.push(StateSize::bytes("interval_spare", spare, None));
    }

    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            intervals_dropped: self.dropped,
            intervals_extended: self.extended,
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

fn lock<T>(shared: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
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

#[cfg(test)]
mod tests {
    use std::{path::PathBuf, sync::mpsc::Receiver, time::SystemTime};

    use super::*;
    use crate::aggregate::{
        Aggregator,
        test_support::{add, config, file, header, module_files},
    };
    use stackscope_proto::v1::Batch;

    /// A sink that holds the worker in `send` until the test lets each
    /// batch through, and lends `spare` bytes.
    struct GatedSink {
        gate: Receiver<()>,
        sent: SyncSender<Batch>,
        spare: u64,
    }

    impl BatchSink for GatedSink {
        fn send(&mut self, batch: Batch) {
            let _ = self.gate.recv();
            let _ = self.sent.send(batch);
        }

        fn spare_bytes(&self) -> u64 {
            self.spare
        }
    }

    /// An interval of one sample in this process's own executable, filling
    /// `spare` if given.
    fn interval_of_one_sample(spare: Option<IntervalBuffers>) -> Interval {
        let (own, _) = module_files();
        let mut aggregator = Aggregator::new(config());
        add(
            &mut aggregator,
            &header(std::process::id(), "worker-test", true),
            &[],
            &[file(&own, 0x1000)],
        );
        aggregator.finish_interval_into(SystemTime::now(), spare)
    }

    fn start(spare: u64) -> (BatchWorker, mpsc::Sender<()>, Receiver<Batch>) {
        let (open, gate) = mpsc::channel();
        let (sent, batches) = mpsc::sync_channel(16);
        let sink = GatedSink { gate, sent, spare };
        let worker = BatchWorker::start(
            SymbolizerConfig {
                kallsyms: PathBuf::from("/nonexistent/kallsyms"),
                max_open_bytes: 8 << 20,
                ..SymbolizerConfig::default()
            },
            BatchOptions::for_frequency(99),
            None,
            Some(Box::new(sink)),
        )
        .expect("the worker thread");
        (worker, open, batches)
    }

    /// A worker still busy with one batch and another waiting: the next
    /// interval is not ended (nor dropped) but runs on; nothing is lost.
    #[test]
    fn a_busy_worker_leaves_the_interval_running_and_loses_none_of_it() {
        let (mut worker, open, batches) = start(0);
        assert!(worker.try_submit(interval_of_one_sample));
        // The worker takes the first interval and waits in `send`.
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while !worker.has_room() {
            assert!(Instant::now() < deadline, "the worker never took it");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(worker.try_submit(interval_of_one_sample));
        assert!(!worker.has_room());
        let mut finished = false;
        assert!(!worker.try_submit(|spare| {
            finished = true;
            interval_of_one_sample(spare)
        }));
        assert!(!finished, "an interval that cannot go is not ended");
        for _ in 0..3 {
            open.send(()).expect("the gate");
        }
        let stats = worker.finish(interval_of_one_sample(None));
        assert_eq!((stats.intervals_extended, stats.intervals_dropped), (1, 0));
        assert_eq!((stats.batches_built, stats.samples_in_batches), (3, 3));
        assert_eq!(batches.try_iter().count(), 3);
    }

    /// A worker that died (its sink panicked) leaves no interval waiting:
    /// intervals end at their boundaries and are counted as dropped, not
    /// run on for ever.
    #[test]
    fn after_the_worker_is_gone_intervals_end_and_are_counted_lost() {
        let sink = |_batch: Batch| panic!("a sink that fails");
        let mut worker = BatchWorker::start(
            SymbolizerConfig {
                kallsyms: PathBuf::from("/nonexistent/kallsyms"),
                ..SymbolizerConfig::default()
            },
            BatchOptions::for_frequency(99),
            None,
            Some(Box::new(sink)),
        )
        .expect("the worker thread");
        assert!(worker.try_submit(interval_of_one_sample));
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while !worker.thread.as_ref().is_some_and(JoinHandle::is_finished) {
            assert!(Instant::now() < deadline, "the worker never stopped");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(worker.try_submit(interval_of_one_sample));
        assert!(worker.try_submit(interval_of_one_sample));
        let stats = worker.stats();
        assert_eq!((stats.intervals_extended, stats.intervals_dropped), (0, 2));
    }

    /// The export queue's room is the symbolizer's to use on top of its
    /// share, up to what it holds by default.
    #[test]
    fn the_sinks_room_is_lent_to_the_symbolizer() {
        let cases = [
            (0, 8 << 20),
            (40 << 20, 48 << 20),
            (u64::MAX, DEFAULT_MAX_OPEN_BYTES),
        ];
        for (spare, bound) in cases {
            let (mut worker, open, batches) = start(spare);
            assert!(worker.try_submit(interval_of_one_sample));
            open.send(()).expect("the gate");
            batches
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("the batch");
            // Published before the batch was sent.
            let mut sizes = Vec::new();
            worker.state_sizes(&mut sizes);
            let files = sizes
                .iter()
                .find(|size| size.name == "symbolizer_files")
                .expect("the symbolizer's files");
            assert_eq!(files.max_bytes, usize::try_from(bound).ok(), "{spare}");
        }
    }
}
