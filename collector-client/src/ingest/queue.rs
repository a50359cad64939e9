//! A byte-bounded FIFO of batches waiting for the collector, each encoded
//! (and compressed, with zstd) once as its push request.
//!
//! The bound is what keeps an agent whose collector is down for hours from
//! growing without limit: when a batch does not fit, the oldest batches go,
//! because the newest data is what people look at first once the collector
//! is back. Owns no I/O and no locking; the agent's exporter wraps it in a
//! mutex and sends what it pops.

use std::collections::VecDeque;

use stackscope_proto::v1::Batch;

use super::push::{EncodedRequest, RequestEncoder};

/// One batch waiting to be sent, encoded, with the sizes the bound and the
/// statistics need, computed once when it is enqueued.
#[derive(Debug)]
pub struct Pending {
    /// The push request carrying the batch (see [`super::push`]).
    pub request: EncodedRequest,
    /// The request's size: what it holds in memory, and what goes on the
    /// wire before gRPC's own compression (none for a compressed request).
    pub bytes: usize,
    /// Ticks the batch carries (the sum of `Sample.count`).
    pub samples: u64,
    /// Send attempts so far that failed and were retried.
    pub failed_attempts: u32,
}

impl Pending {
    pub fn new(batch: Batch, encoder: &mut RequestEncoder) -> Self {
        let samples = batch
            .samples
            .iter()
            .fold(0u64, |total, sample| total.saturating_add(sample.count));
        let request = encoder.encode(batch);
        Self {
            bytes: request.len(),
            request,
            samples,
            failed_attempts: 0,
        }
    }
}

/// Batches a push displaced to stay within the bound.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    pub batches: u64,
    pub samples: u64,
}

impl Evicted {
    fn add(&mut self, pending: &Pending) {
        self.batches += 1;
        self.samples = self.samples.saturating_add(pending.samples);
    }
}

/// A batch the queue did not take; it is dropped, and this is what the
/// statistics and the log need of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub bytes: usize,
    pub samples: u64,
}

impl Refused {
    fn of(pending: &Pending) -> Self {
        Self {
            bytes: pending.bytes,
            samples: pending.samples,
        }
    }
}

/// FIFO of [`Pending`] batches whose encoded sizes add up to at most
/// `max_bytes`.
#[derive(Debug)]
pub struct Queue {
    waiting: VecDeque<Pending>,
    bytes: usize,
    samples: u64,
    max_bytes: usize,
}

impl Queue {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            waiting: VecDeque::new(),
            bytes: 0,
            samples: 0,
            max_bytes,
        }
    }

    /// Appends a new batch, dropping the oldest waiting batches until it
    /// fits. A batch larger than the whole bound is refused (and nothing is
    /// evicted for it): keeping it would need an unbounded queue, and
    /// evicting everything else for a batch that still cannot fit would lose
    /// data for nothing.
    pub fn push_back(&mut self, pending: Pending) -> Result<Evicted, Refused> {
        if pending.bytes > self.max_bytes {
            return Err(Refused::of(&pending));
        }
        let mut evicted = Evicted::default();
        while self.bytes + pending.bytes > self.max_bytes {
            match self.pop_front() {
                Some(old) => evicted.add(&old),
                // Unreachable while `bytes` is the sum of the entries; an
                // empty queue always has room for a batch that passed the
                // check above.
                None => break,
            }
        }
        self.bytes += pending.bytes;
        self.samples = self.samples.saturating_add(pending.samples);
        self.waiting.push_back(pending);
        Ok(evicted)
    }

    /// Puts back a batch whose send failed, in front: it is still the oldest.
    /// If newer batches filled the room it left, it is the one the bound
    /// drops, so it is refused.
    pub fn push_front(&mut self, pending: Pending) -> Result<(), Refused> {
        if self.bytes + pending.bytes > self.max_bytes {
            return Err(Refused::of(&pending));
        }
        self.bytes += pending.bytes;
        self.samples = self.samples.saturating_add(pending.samples);
        self.waiting.push_front(pending);
        Ok(())
    }

    pub fn pop_front(&mut self) -> Option<Pending> {
        let pending = self.waiting.pop_front()?;
        self.bytes -= pending.bytes;
        self.samples = self.samples.saturating_sub(pending.samples);
        Some(pending)
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;
    use stackscope_proto::v1::{PushRequest, Sample};

    use super::*;

    fn pending(id: u8, samples: u64) -> Pending {
        encoded(Batch {
            batch_id: vec![id; 16],
            samples: vec![Sample {
                stack: 0,
                label_set: 0,
                count: samples,
                sampling_divisor: 0,
            }],
            ..Batch::default()
        })
    }

    fn ids(queue: &mut Queue) -> Vec<u8> {
        std::iter::from_fn(|| queue.pop_front())
            .map(|p| batch_of(&p).batch_id[0])
            .collect()
    }

    /// Plain, so sizes are easy to reason about: the queue does not look
    /// inside its requests.
    fn encoded(batch: Batch) -> Pending {
        Pending::new(batch, &mut RequestEncoder::plain())
    }

    fn batch_of(pending: &Pending) -> Batch {
        PushRequest::decode(pending.request.push_request().unwrap())
            .expect("a push request")
            .batch
            .expect("with its batch")
    }

    #[test]
    fn pending_measures_encoded_size_and_ticks() {
        let p = pending(1, 7);
        assert_eq!(p.bytes, p.request.len());
        assert_eq!(
            batch_of(&p).encoded_len() + 2,
            p.bytes,
            "tag, length, batch"
        );
        assert_eq!(p.samples, 7);
    }

    #[test]
    fn full_queue_drops_the_oldest() {
        let size = pending(0, 1).bytes;
        let mut queue = Queue::new(3 * size);
        for id in 0..3 {
            assert_eq!(queue.push_back(pending(id, 1)), Ok(Evicted::default()));
        }
        assert_eq!(
            queue.push_back(pending(3, 1)),
            Ok(Evicted {
                batches: 1,
                samples: 1
            })
        );
        assert_eq!(queue.len(), 3);
        assert_eq!(queue.bytes(), 3 * size);
        assert_eq!(queue.samples(), 3);
        assert_eq!(ids(&mut queue), [1, 2, 3]);
        assert_eq!((queue.bytes(), queue.samples()), (0, 0));
    }

    #[test]
    fn one_large_batch_evicts_as_many_as_needed() {
        let size = pending(0, 1).bytes;
        let mut queue = Queue::new(4 * size);
        for id in 0..4 {
            queue.push_back(pending(id, 2)).unwrap();
        }
        let big = encoded(Batch {
            batch_id: vec![9; 16],
            strings: vec!["x".repeat(2 * size)],
            ..Batch::default()
        });
        assert!(big.bytes > 2 * size && big.bytes <= 3 * size);
        assert_eq!(
            queue.push_back(big),
            Ok(Evicted {
                batches: 3,
                samples: 6
            })
        );
        assert_eq!(ids(&mut queue), [3, 9]);
    }

    #[test]
    fn batch_larger_than_the_bound_is_refused_without_evicting() {
        let size = pending(0, 1).bytes;
        let mut queue = Queue::new(size);
        queue.push_back(pending(0, 1)).unwrap();
        let big = encoded(Batch {
            strings: vec!["x".repeat(size)],
            samples: batch_of(&pending(1, 5)).samples,
            ..Batch::default()
        });
        let big_bytes = big.bytes;
        assert!(big_bytes > size);
        assert_eq!(
            queue.push_back(big),
            Err(Refused {
                bytes: big_bytes,
                samples: 5
            })
        );
        assert_eq!(ids(&mut queue), [0]);
    }

    #[test]
    fn failed_batch_goes_back_in_front_only_if_it_fits() {
        let size = pending(0, 1).bytes;
        let mut queue = Queue::new(2 * size);
        queue.push_back(pending(0, 1)).unwrap();
        queue.push_back(pending(1, 1)).unwrap();
        let first = queue.pop_front().unwrap();
        assert!(queue.push_front(first).is_ok());
        assert_eq!(ids(&mut queue), [0, 1]);

        queue.push_back(pending(0, 1)).unwrap();
        queue.push_back(pending(1, 1)).unwrap();
        let in_flight = queue.pop_front().unwrap();
        // While batch 0 was on the wire, batch 2 took its room.
        queue.push_back(pending(2, 1)).unwrap();
        assert_eq!(
            queue.push_front(in_flight),
            Err(Refused {
                bytes: size,
                samples: 1
            })
        );
        assert_eq!(ids(&mut queue), [1, 2]);
    }
}
