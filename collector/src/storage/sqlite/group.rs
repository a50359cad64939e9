//! Group commit: batches that arrive while another is being stored share
//! its write transaction, so one commit (one sync of the log, each dirtied
//! page written once) stores them all.
//!
//! Agents end their intervals on the same wall-clock boundaries, so a
//! fleet's batches come in bursts; stored one transaction each, the writer
//! spent a quarter of its CPU on commits (the log's sync and its page
//! writes) and, on a disk whose sync takes milliseconds, most of its time
//! waiting for them. Each batch is still stored whole or not at all: each
//! after the first is written under a savepoint of its own, and one that
//! fails is rolled back to it alone (the first has the transaction to
//! itself until the second comes: a savepoint copies every page it first
//! changes, which cost a batch of new stacks about as much again). An
//! error that ends the whole transaction (SQLite does on a full disk or out
//! of memory) fails every batch of the group; their senders keep them and
//! retry.
//!
//! How: a thread about to store a batch says so ([`Groups::join`]) before
//! it takes the writer. Whoever holds the writer stores its batch in the
//! open transaction, then leaves the transaction open for the next thread
//! if one is coming (and the group is not full), and waits for the group's
//! commit ([`Groups::wait_for`]); otherwise it commits and tells the waiting
//! members how the commit went ([`Groups::finished`]). Every other use of
//! the writer (retention, compaction) commits an open group first. Owns
//! none of the storing itself (`write`).

use std::{
    collections::HashMap,
    sync::{
        Condvar, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
};

use stackscope_telemetry::error_chain;

use super::StorageError;

/// Batches one transaction stores at most, by default: bounds how long the
/// first of them waits for its answer, and how many dirty pages the
/// transaction holds.
pub(super) const MAX_GROUP_BATCHES: usize = 32;

/// The open group's bookkeeping, kept with the writer.
#[derive(Debug)]
pub(super) struct OpenGroup {
    pub id: u64,
    /// Batches stored in it, or tried, so far.
    pub members: usize,
    /// Of those, the batches stored.
    pub stored: usize,
    /// Members waiting for its commit.
    pub waiting: usize,
    /// Its transaction is gone, or holds part of a failed batch: it can
    /// only be rolled back.
    pub lost: bool,
}

/// How a group's commit went, for the members that waited for it.
#[derive(Debug, Clone)]
struct Failure {
    /// SQLite's error code, kept so a full disk stays a full disk.
    code: rusqlite::ffi::Error,
    message: String,
    /// Members that have not read it yet.
    unread: usize,
}

#[derive(Debug, Default)]
struct Finished {
    /// Every group up to this id is committed or rolled back.
    through: u64,
    failures: HashMap<u64, Failure>,
}

/// What the threads storing batches share besides the writer.
#[derive(Debug, Default)]
pub(super) struct Groups {
    /// Threads that said they will store a batch and have not taken the
    /// writer yet.
    joining: AtomicUsize,
    finished: Mutex<Finished>,
    changed: Condvar,
}

impl Groups {
    /// Says a batch is about to be stored, until the guard is dropped
    /// (once the writer is taken).
    pub fn join(&self) -> Joining<'_> {
        self.joining.fetch_add(1, Ordering::SeqCst);
        Joining(self)
    }

    /// Whether the open group should stay open for a batch that is coming.
    pub fn someone_joining(&self) -> bool {
        self.joining.load(Ordering::SeqCst) > 0
    }

    /// Records how group `id` ended (`Err`: nothing of it was stored) and
    /// wakes its waiting members.
    pub fn finished(&self, group: &OpenGroup, result: Result<(), &StorageError>) {
        let mut finished = self.lock_finished();
        finished.through = finished.through.max(group.id);
        if let Err(err) = result
            && group.waiting > 0
        {
            let code = match err {
                StorageError::Database(rusqlite::Error::SqliteFailure(code, _)) => *code,
                _ => rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
            };
            finished.failures.insert(
                group.id,
                Failure {
                    code,
                    message: error_chain(err),
                    unread: group.waiting,
                },
            );
        }
        drop(finished);
        self.changed.notify_all();
    }

    /// Waits until group `id` has ended: `Err` when its commit failed.
    pub fn wait_for(&self, id: u64) -> Result<(), StorageError> {
        let mut finished = self.lock_finished();
        while finished.through < id {
            finished = self
                .changed
                .wait(finished)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let Some(failure) = finished.failures.get_mut(&id) else {
            return Ok(());
        };
        failure.unread -= 1;
        let failure = if failure.unread == 0 {
            finished.failures.remove(&id).expect("present")
        } else {
            failure.clone()
        };
        Err(StorageError::Database(rusqlite::Error::SqliteFailure(
            failure.code,
            Some(format!(
                "the transaction this batch was stored in failed: {}",
                failure.message
            )),
        )))
    }

    fn lock_finished(&self) -> std::sync::MutexGuard<'_, Finished> {
        // Nothing that holds this lock can panic half way.
        self.finished.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A thread on its way to the writer (see [`Groups::join`]).
pub(super) struct Joining<'a>(&'a Groups);

impl Drop for Joining<'_> {
    fn drop(&mut self) {
        self.0.joining.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn every_waiting_member_learns_of_a_failed_commit_as_it_was() {
        let groups = Arc::new(Groups::default());
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let groups = Arc::clone(&groups);
                std::thread::spawn(move || groups.wait_for(7))
            })
            .collect();
        // An earlier group ending wakes no one for group 7.
        let earlier = OpenGroup {
            id: 6,
            members: 1,
            stored: 1,
            waiting: 0,
            lost: false,
        };
        groups.finished(&earlier, Ok(()));
        let full = StorageError::Database(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
            Some("database or disk is full".into()),
        ));
        let group = OpenGroup {
            id: 7,
            members: 3,
            stored: 3,
            waiting: 2,
            lost: false,
        };
        groups.finished(&group, Err(&full));
        for waiter in waiters {
            let err = waiter
                .join()
                .expect("waiter")
                .expect_err("the commit failed");
            assert!(err.is_disk_full(), "{err:?}");
            assert!(format!("{err:?}").contains("database or disk is full"));
        }
        assert!(groups.lock_finished().failures.is_empty(), "read by both");
        // A group that committed is no error.
        groups.finished(
            &OpenGroup {
                id: 8,
                members: 2,
                stored: 2,
                waiting: 1,
                lost: false,
            },
            Ok(()),
        );
        groups.wait_for(8).expect("committed");
    }
}
