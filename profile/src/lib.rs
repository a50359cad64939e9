//! Profiles as people read them: which samples a query selects, the merged
//! call tree of their stacks, and what is rendered from it (folded stacks,
//! SVG flamegraphs, pprof, JSON, top functions, callers and callees,
//! differential flamegraphs). Pure functions over values: no storage, no
//! network.
//!
//! - [`model`]: selections, frames and weighted stacks (shared with the
//!   collector's storage), and times as the wire holds them;
//! - [`selector`]: the `{name="value", ...}` matcher syntax and selections on
//!   the wire;
//! - [`timespec`]: selections as people type them (`--since 5m`, RFC 3339
//!   times), shared by the HTTP API and the CLI;
//! - [`tree`]: the merged [`CallTree`](tree::CallTree), pruning, and its wire
//!   form;
//! - `render`: everything drawn or exported from a tree, behind the
//!   `render` feature (the collector and the CLI enable it; the agent, which
//!   uses only [`model`], does not link inferno and flate2).

pub mod model;
#[cfg(feature = "render")]
pub mod render;
pub mod selector;
pub mod timespec;
pub mod tree;
