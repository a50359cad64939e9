//! Batch ids written behind ingest: once a batch's samples are stored, its
//! id goes to a queue that one thread writes to each server's `batches`
//! table, many ids per insert, instead of in a round trip of the batch's
//! own. Owns the queue, the thread and the ids it has not written yet.
//!
//! Why it may lag: the id only spares a retry's rows (a batch stored twice
//! counts once through `attempts`) and tells the compactor a try is done
//! (a try without its id is in flight: see `rollup`). Written in the
//! batch's own round trip, it cost a fifth of a batch's ingest on 18.16
//! (2.1 of 10.2 ms, timed in `bench collector`), most of it the server
//! creating a part for one row.
//!
//! What it keeps: a retry to this collector answers `Duplicate` while the
//! id waits (`is_pending`); another collector sees the id within about
//! `batch_id_linger` while the servers take it (100 ms by default; a retry
//! through it meanwhile stores the batch again, and it counts once); the
//! compactor and retention write the queue first (`flush`), and so does
//! dropping the storage. A collector that dies with ids queued leaves
//! their tries looking in flight until `in_flight_nanos` passes, which
//! only delays their spans' rollups.

use std::{
    collections::HashSet,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};

use super::client::{ClickhouseError, Client, Endpoint};

/// How long the thread waits after a failed write before the next.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// How long an id's writes may keep failing before it is dropped (at
/// least two writes: a write may take a whole request timeout): a retry of
/// its batch is then stored again and counts once.
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

/// The columns of a row in `batches`.
pub(super) const BATCH_COLUMNS: &str = "batch, received_unix_nanos, end_unix_nanos";

/// A batch id waiting to be written.
struct QueuedId {
    /// Index of the server that stored the batch's samples.
    endpoint: usize,
    id: u128,
    /// Its `batches` row, in RowBinary.
    row: Bytes,
    /// When its first write failed.
    failing_since: Option<Instant>,
}

#[derive(Default)]
struct State {
    /// Ids queued or being written: not known to be on their server yet.
    pending: HashSet<u128>,
    queued: Vec<QueuedId>,
    /// Writes under way (the thread's, and `flush`es').
    writing: usize,
    closing: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when ids are queued, a write ends, or the storage closes.
    changed: Condvar,
    client: Client,
    endpoints: Vec<Endpoint>,
    /// The servers' own `batches` table.
    table: String,
    /// How long the thread waits after an id arrives for the ids of the
    /// batches that follow, so one insert (one part on the server)
    /// carries many: at a hundred batches a second and 100 ms, about ten.
    linger: Duration,
    /// Most ids waiting at once (about 100 bytes each); past it, ingest
    /// writes its batch's id itself, as if there were no queue, so a
    /// server that keeps refusing them costs bounded memory.
    max_pending: usize,
}

/// The queue of batch ids and the thread that writes it (see the module
/// doc).
pub(super) struct BatchIdWriter {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl BatchIdWriter {
    /// Starts the thread that writes ids to `table` on `endpoints` (as
    /// indexed in `queue`).
    pub(super) fn start(
        client: Client,
        endpoints: Vec<Endpoint>,
        table: String,
        linger: Duration,
        max_pending: usize,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            client,
            endpoints,
            table,
            linger,
            max_pending,
        });
        let thread = std::thread::Builder::new()
            .name("clickhouse-batch-ids".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || shared.run()
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Whether batch `id` was stored by this collector and its id not yet
    /// written.
    pub(super) fn is_pending(&self, id: u128) -> bool {
        self.shared.lock().pending.contains(&id)
    }

    /// Queues batch `id`'s `row` for the server `endpoint` (an index of the
    /// endpoints given to `start`); gives the row back when the queue is
    /// full.
    pub(super) fn queue(&self, endpoint: usize, id: u128, row: Bytes) -> Result<(), Bytes> {
        let mut state = self.shared.lock();
        if state.pending.len() >= self.shared.max_pending {
            return Err(row);
        }
        if state.pending.insert(id) {
            state.queued.push(QueuedId {
                endpoint,
                id,
                row,
                failing_since: None,
            });
            self.shared.changed.notify_all();
        }
        Ok(())
    }

    /// Writes the queued ids now (once: what fails stays queued for the
    /// thread), then waits for every write under way.
    pub(super) fn flush(&self) {
        let mut state = self.shared.lock();
        if !state.queued.is_empty() {
            (state, _) = self.shared.write_queued(state);
        }
        let _state = self
            .shared
            .changed
            .wait_while(state, |state| state.writing > 0)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }

    /// Ids not yet written, against their bound.
    pub(super) fn pending(&self) -> (usize, usize) {
        (self.shared.lock().pending.len(), self.shared.max_pending)
    }
}

impl Drop for BatchIdWriter {
    /// Writes what is queued (once) and stops the thread.
    fn drop(&mut self) {
        self.shared.lock().closing = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The thread: waits for ids, lingers for more, writes them all.
    fn run(&self) {
        let mut state = self.lock();
        loop {
            state = self
                .changed
                .wait_while(state, |s| s.queued.is_empty() && !s.closing)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if state.queued.is_empty() {
                return; // closing, nothing left
            }
            if !state.closing {
                (state, _) = self
                    .changed
                    .wait_timeout_while(state, self.linger, |s| !s.closing)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
            let closing = state.closing;
            let failed;
            (state, failed) = self.write_queued(state);
            if closing {
                return;
            }
            if failed {
                // What failed waits (with the ids queued meanwhile),
                // unless closing.
                (state, _) = self
                    .changed
                    .wait_timeout_while(state, RETRY_DELAY, |s| !s.closing)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
    }

    /// Takes the queue, writes it (one insert per server, all at once, so
    /// a server that hangs delays no other's; the lock released
    /// meanwhile), and takes back what failed; whether a write failed.
    fn write_queued<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
    ) -> (MutexGuard<'a, State>, bool) {
        let mut queued = std::mem::take(&mut state.queued);
        state.writing += 1;
        drop(state);

        queued.sort_by_key(|queued| queued.endpoint);
        let groups: Vec<&[QueuedId]> = queued.chunk_by(|a, b| a.endpoint == b.endpoint).collect();
        let write = |group: &[QueuedId]| {
            let mut rows = BytesMut::new();
            for queued in group {
                rows.extend_from_slice(&queued.row);
            }
            let endpoint = &self.endpoints[group[0].endpoint];
            self.client
                .insert(endpoint, &self.table, BATCH_COLUMNS, rows.freeze())
        };
        let results: Vec<Result<(), ClickhouseError>> = match groups.as_slice() {
            [] => Vec::new(),
            [one] => vec![write(one)],
            several => std::thread::scope(|scope| {
                let writes: Vec<_> = several
                    .iter()
                    .map(|&group| scope.spawn(move || write(group)))
                    .collect();
                writes
                    .into_iter()
                    .map(|write| {
                        write
                            .join()
                            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                    })
                    .collect()
            }),
        };
        let outcomes: Vec<(usize, Result<(), ClickhouseError>)> = groups
            .iter()
            .map(|group| group[0].endpoint)
            .zip(results)
            .collect();

        let mut state = self.lock();
        state.writing -= 1;
        let closing = state.closing;
        let failed = outcomes.iter().any(|(_, result)| result.is_err());
        for (endpoint, result) in outcomes {
            let ids = queued.extract_if(.., |queued| queued.endpoint == endpoint);
            match result {
                Ok(()) => {
                    for queued in ids {
                        state.pending.remove(&queued.id);
                    }
                }
                Err(err) => {
                    let ids: Vec<QueuedId> = ids.collect();
                    self.failed(&mut state, ids, endpoint, &err, closing);
                }
            }
        }
        self.changed.notify_all();
        (state, failed)
    }

    /// Puts the ids of a failed write to `endpoint` back in the queue, or
    /// drops those failing for too long (all of them when closing).
    fn failed(
        &self,
        state: &mut State,
        ids: Vec<QueuedId>,
        endpoint: usize,
        err: &ClickhouseError,
        closing: bool,
    ) {
        let now = Instant::now();
        let mut dropped = 0;
        for mut id in ids {
            let since = *id.failing_since.get_or_insert(now);
            if closing || now.duration_since(since) >= GIVE_UP_AFTER {
                state.pending.remove(&id.id);
                dropped += 1;
            } else {
                state.queued.push(id);
            }
        }
        let server = &self.endpoints[endpoint].url;
        if dropped > 0 {
            tracing::warn!(
                %server,
                dropped,
                "storing batch ids failed: {err}; giving up on them (a retry of one of those \
                 batches will be stored again and count once)"
            );
        } else {
            tracing::warn!(%server, "storing batch ids failed: {err}; trying again");
        }
    }
}
