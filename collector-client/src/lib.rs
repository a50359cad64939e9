//! The client side of a stackscope collector, shared by the agent and the
//! CLI: reaching it ([`connect`]: endpoint, TLS, bearer token), pushing
//! batches to it ([`ingest`]: encoded once, retried when the answer says
//! so) and sending it debuginfo once per build-id ([`upload`], with the
//! rule on what is worth sending that the collector checks too).

pub mod connect;
mod debuginfo;
pub mod ingest;

pub use debuginfo::*;
