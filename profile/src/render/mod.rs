//! What people read a call tree as.
//!
//! Owns every rendering of a [`CallTree`](crate::tree::CallTree): folded
//! stacks, SVG flamegraphs and differential flamegraphs (drawn by inferno),
//! gzipped pprof, Pyroscope's flame graph levels, nested JSON, top functions, callers and callees, and the
//! terminal tables for the last two. Every output is deterministic: the same
//! tree gives the same bytes. Does not own the tree itself nor pruning (see
//! [`tree`](crate::tree)), nor any I/O: renderers return bytes or strings.

mod folded;
mod json;
mod levels;
mod pprof;
mod svg;
mod text;
mod top;

pub use folded::{folded, folded_name};
pub use json::json;
pub use levels::{FlameGraphLevels, OTHER, flame_graph_levels};
pub use pprof::{pprof, pprof_profile};
pub use svg::{SvgOptions, diff_folded, diff_svg, svg};
pub use text::{text_callers_callees, text_top};
pub use top::{CallersCallees, FunctionStat, callers_callees, top_functions};

/// A flamegraph could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// Nothing to draw: the tree (for a differential flamegraph, the new
    /// side, whose weights set the widths) has no samples.
    #[error("no samples to draw: the selection matched no stacks")]
    NoSamples,
    /// inferno refused the folded stacks (it should not: they are produced
    /// here in the format it reads).
    #[error("inferno could not draw the flamegraph")]
    Inferno(#[source] std::io::Error),
}
