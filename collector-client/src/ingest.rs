//! Pushing batches to the collector's `Ingest` service: the push of a batch
//! encoded once ([`push`]), the bounded queue of pushes waiting to be sent
//! ([`queue`]) and when a failed push is worth sending again ([`retry`]:
//! which answers are, the collector's pushback, backoff with jitter). The
//! agent's exporter owns the connection and the task that sends.

pub mod push;
pub mod queue;
pub mod retry;
