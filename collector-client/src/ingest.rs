//! Pushing batches to the collector's `Ingest` service: the push of a batch
//! encoded once ([`push`]) and when a failed push is worth sending again
//! ([`retry`]: which answers are, the collector's pushback, backoff with
//! jitter). The agent's exporter owns the queue and the connection.

pub mod push;
pub mod retry;
