//! The client side of a stackscope collector, shared by the agent and the
//! CLI: reaching it ([`connect`]: endpoint, TLS, bearer token) and sending
//! it debuginfo once per build-id ([`upload`], with the rule on what is
//! worth sending that the collector checks too).

pub mod connect;
mod debuginfo;

pub use debuginfo::*;
