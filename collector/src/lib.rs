//! The stackscope collector: takes batches from agents over gRPC, validates
//! them (`ingest`), stores them (`storage`, embedded SQLite by default) and
//! answers queries over gRPC and HTTP (`server`), naming frames stored
//! without names from debuginfo uploaded or fetched by build-id
//! (`debuginfo`); `metrics` counts what it does for Prometheus. Rendering lives in `stackscope-profile`, shared with the
//! `stackscope` CLI.

pub mod debuginfo;
pub mod ingest;
pub mod metrics;
pub mod query;
pub mod server;
pub mod storage;
