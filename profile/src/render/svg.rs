//! SVG flamegraphs and differential flamegraphs, drawn by inferno from
//! folded stacks (never hand-written SVG).

use inferno::{differential, flamegraph};

use super::RenderError;
use super::folded::folded;
use crate::model::ProfileType;
use crate::tree::CallTree;

/// How a flamegraph is drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct SvgOptions {
    /// Shown at the top of the image.
    pub title: String,
    /// Shown under the title.
    pub subtitle: Option<String>,
    /// What one unit of weight is called in tooltips (`samples`).
    pub count_name: String,
    /// Image width in pixels; `None` lets the SVG fill its container.
    pub width: Option<usize>,
    /// Draw an icicle graph (root at the top) instead of a flame graph.
    pub inverted: bool,
    /// Differential flamegraphs only: scale the base profile to the new
    /// profile's total, so that a change of load does not paint everything
    /// red or blue and only shifts in where the time goes show.
    pub normalize: bool,
}

impl SvgOptions {
    /// The defaults, titled `title`, for a profile of `profile_type`: its
    /// weights are samples, nanoseconds off the CPU, or a sent type's unit.
    pub fn titled(title: String, profile_type: &ProfileType) -> Self {
        SvgOptions {
            title,
            count_name: match profile_type {
                ProfileType::Cpu => "samples".to_owned(),
                ProfileType::OffCpu => "ns off-CPU".to_owned(),
                ProfileType::Sent(id) => id.sample_type().1.to_owned(),
            },
            ..SvgOptions::default()
        }
    }
}

impl Default for SvgOptions {
    fn default() -> Self {
        SvgOptions {
            title: "stackscope".to_string(),
            subtitle: None,
            count_name: "samples".to_string(),
            width: None,
            inverted: false,
            normalize: true,
        }
    }
}

impl SvgOptions {
    fn inferno(&self) -> flamegraph::Options<'static> {
        // inferno's options are `#[non_exhaustive]`: start from its defaults.
        let mut options = flamegraph::Options::default();
        options.title = self.title.clone();
        options.subtitle = self.subtitle.clone();
        options.count_name = self.count_name.clone();
        options.image_width = self.width;
        options.direction = if self.inverted {
            flamegraph::Direction::Inverted
        } else {
            flamegraph::Direction::Straight
        };
        // Colors from a hash of the name rather than at random: the same
        // tree gives the same bytes, and a function keeps its color across
        // graphs.
        options.hash = true;
        options
    }
}

/// The flamegraph of a tree as an SVG document.
/// [`RenderError::NoSamples`] when there is nothing to draw (inferno would
/// otherwise draw an error picture and fail).
pub fn svg(tree: &CallTree, options: &SvgOptions) -> Result<Vec<u8>, RenderError> {
    let folded = folded(tree);
    if folded.is_empty() {
        return Err(RenderError::NoSamples);
    }
    draw(&folded, options)
}

/// Folded stacks with two counts, `stack base new\n`, as inferno's
/// differential flamegraph reads them, sorted. With `normalize`, base
/// counts are scaled to the new total (rounded down, by inferno).
pub fn diff_folded(
    base: &CallTree,
    new: &CallTree,
    normalize: bool,
) -> Result<String, RenderError> {
    diff_lines(&folded(base), &folded(new), normalize)
}

fn diff_lines(base: &str, new: &str, normalize: bool) -> Result<String, RenderError> {
    let options = differential::Options {
        normalize,
        ..Default::default()
    };
    let mut out = Vec::new();
    differential::from_readers(options, base.as_bytes(), new.as_bytes(), &mut out)
        .map_err(RenderError::Inferno)?;
    // inferno writes the lines in hash-map order; sorting makes the output
    // deterministic (and is the order its flamegraph wants anyway).
    let text = String::from_utf8_lossy(&out);
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort_unstable();
    let mut sorted = String::with_capacity(out.len());
    for line in lines {
        sorted.push_str(line);
        sorted.push('\n');
    }
    Ok(sorted)
}

/// A differential flamegraph: frames sized by `new`, colored by how their
/// weight changed from `base` (red: grew, blue: shrank), with
/// [`SvgOptions::normalize`] deciding whether the base is first scaled to
/// the new total. [`RenderError::NoSamples`] when `new` has nothing to draw;
/// an empty `base` draws everything as new.
pub fn diff_svg(
    base: &CallTree,
    new: &CallTree,
    options: &SvgOptions,
) -> Result<Vec<u8>, RenderError> {
    let new_folded = folded(new);
    if new_folded.is_empty() {
        return Err(RenderError::NoSamples);
    }
    let lines = diff_lines(&folded(base), &new_folded, options.normalize)?;
    draw(&lines, options)
}

fn draw(lines: &str, options: &SvgOptions) -> Result<Vec<u8>, RenderError> {
    let mut inferno = options.inferno();
    let mut out = Vec::new();
    flamegraph::from_lines(&mut inferno, lines.lines(), &mut out).map_err(RenderError::Inferno)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{StackSamples, WeightedStack};
    use crate::tree::tests::{frame, stack, tree};

    fn text(svg: &[u8]) -> &str {
        std::str::from_utf8(svg).expect("inferno writes UTF-8")
    }

    /// An XML document (the reader checks that end tags match) whose
    /// root element is `<svg>`.
    fn assert_well_formed(svg: &str) {
        use quick_xml::events::Event;
        assert!(svg.starts_with("<?xml"), "{}", &svg[..svg.len().min(200)]);
        let mut reader = quick_xml::Reader::from_str(svg);
        let (mut depth, mut root) = (0usize, None);
        loop {
            match reader.read_event() {
                Ok(Event::Start(start)) => {
                    if depth == 0 {
                        root = Some(String::from_utf8_lossy(start.name().as_ref()).into_owned());
                    }
                    depth += 1;
                }
                Ok(Event::End(_)) => depth -= 1,
                Ok(Event::Eof) => break,
                Ok(_) => {}
                Err(err) => panic!("not XML at {}: {err}", reader.buffer_position()),
            }
        }
        assert_eq!(depth, 0);
        assert_eq!(root.as_deref(), Some("svg"));
    }

    #[test]
    fn svg_draws_every_function() {
        let mut samples = StackSamples {
            stacks: vec![stack("main;serve", 70)],
            sample_period_nanos: 0,
        };
        samples.stacks.push(WeightedStack {
            frames: vec![
                frame("<[u8; 8]>::fmt", "app"),
                frame("parse", "app"),
                frame("main", "app"),
            ],
            weight: 30,
        });
        let tree = CallTree::from_stacks(&samples);
        let options = SvgOptions {
            title: "redis & co".to_string(),
            ..SvgOptions::default()
        };
        let svg = svg(&tree, &options).unwrap();
        let svg = text(&svg);
        assert_well_formed(svg);
        assert!(svg.contains("redis &amp; co"));
        assert!(svg.contains("<title>main (100 samples, 100.00%)</title>"));
        assert!(svg.contains("<title>serve (70 samples, 70.00%)</title>"));
        assert!(svg.contains("<title>parse (30 samples, 30.00%)</title>"));
        assert!(
            svg.contains("&lt;[u8, 8]&gt;::fmt (30 samples, 30.00%)"),
            "{svg}"
        );
    }

    #[test]
    fn svg_is_deterministic_and_follows_options() {
        let tree = tree(&[("main;a", 3), ("main;b", 1)]);
        let options = SvgOptions {
            count_name: "ticks".to_string(),
            subtitle: Some("node-1".to_string()),
            width: Some(800),
            inverted: true,
            ..SvgOptions::default()
        };
        let first = svg(&tree, &options).unwrap();
        assert_eq!(first, svg(&tree, &options).unwrap());
        let first = text(&first);
        assert_well_formed(first);
        assert!(first.contains("<title>a (3 ticks, 75.00%)</title>"));
        assert!(first.contains("node-1"));
        assert!(first.contains("width=\"800\""));
    }

    #[test]
    fn svg_of_nothing_is_an_error() {
        let err = svg(&CallTree::default(), &SvgOptions::default()).unwrap_err();
        assert!(matches!(err, RenderError::NoSamples));
        assert_eq!(
            err.to_string(),
            "no samples to draw: the selection matched no stacks"
        );
        // Weight on the root alone (empty stacks) has nothing to draw either.
        assert!(matches!(
            svg(&tree(&[("", 5)]), &SvgOptions::default()),
            Err(RenderError::NoSamples)
        ));
    }

    #[test]
    fn diff_folded_normalizes_the_base() {
        // The base has twice the load; its shape differs.
        let base = tree(&[("main;a", 100), ("main;b", 100)]);
        let new = tree(&[("main;a", 75), ("main;c", 25)]);
        assert_eq!(
            diff_folded(&base, &new, true).unwrap(),
            "main;a 50 75\nmain;b 50 0\nmain;c 0 25\n"
        );
        assert_eq!(
            diff_folded(&base, &new, false).unwrap(),
            "main;a 100 75\nmain;b 100 0\nmain;c 0 25\n"
        );
    }

    #[test]
    fn diff_svg_draws_the_new_profile() {
        let base = tree(&[("main;a", 100), ("main;b", 100)]);
        let new = tree(&[("main;a", 75), ("main;c", 25)]);
        let normalized = diff_svg(&base, &new, &SvgOptions::default()).unwrap();
        let raw = diff_svg(
            &base,
            &new,
            &SvgOptions {
                normalize: false,
                ..SvgOptions::default()
            },
        )
        .unwrap();
        let (normalized, raw) = (text(&normalized), text(&raw));
        assert_well_formed(normalized);
        assert_well_formed(raw);
        // Widths come from the new profile; tooltips show the change.
        assert!(
            normalized.contains("<title>a (75 samples, 75.00%; +25.00%)</title>"),
            "{normalized}"
        );
        assert!(normalized.contains("<title>c (25 samples, 25.00%; +25.00%)</title>"));
        assert!(!normalized.contains("<title>b "));
        assert!(raw.contains("<title>a (75 samples, 75.00%; -25.00%)</title>"));
        assert_ne!(normalized, raw);
    }

    #[test]
    fn diff_svg_edge_cases() {
        let some = tree(&[("main;a", 3)]);
        assert!(matches!(
            diff_svg(&some, &CallTree::default(), &SvgOptions::default()),
            Err(RenderError::NoSamples)
        ));
        // An empty base: everything is new.
        let svg = diff_svg(&CallTree::default(), &some, &SvgOptions::default()).unwrap();
        assert_well_formed(text(&svg));
        assert_eq!(
            diff_folded(&CallTree::default(), &some, true).unwrap(),
            "main;a 0 3\n"
        );
    }
}
