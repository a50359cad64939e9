//! The widths of time spans rollups sum, on both engines: the bucket
//! width, then 10 minutes, an hour and a day where each is a multiple of
//! the one below, so spans nest and a cover of a range never counts a
//! bucket twice.

/// Span widths above the bucket: each is what a range about ten times as
/// long reads mostly. A width is used only if it is a multiple of the one
/// below it, so spans nest and a cover never double-counts.
const COARSER_WIDTHS_SECS: [i64; 3] = [600, 3600, 86_400];

/// The widths rollups are kept at, finest (the bucket width) first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tiers {
    widths: [i64; 1 + COARSER_WIDTHS_SECS.len()],
    len: usize,
}

impl Tiers {
    pub(crate) fn new(bucket_nanos: i64) -> Self {
        let mut widths = [0; 1 + COARSER_WIDTHS_SECS.len()];
        widths[0] = bucket_nanos;
        let mut len = 1;
        for secs in COARSER_WIDTHS_SECS {
            let width = secs * 1_000_000_000;
            let below = widths[len - 1];
            if width > below && width % below == 0 {
                widths[len] = width;
                len += 1;
            }
        }
        Self { widths, len }
    }

    pub(crate) fn widths(&self) -> &[i64] {
        &self.widths[..self.len]
    }

    /// The widths label rollups are kept at: those above the bucket.
    pub(crate) fn label_widths(&self) -> &[i64] {
        &self.widths()[1..]
    }

    pub(crate) fn bucket(&self) -> i64 {
        self.widths[0]
    }

    /// The width below `width`, `None` for the bucket width.
    pub(crate) fn finer(&self, width: i64) -> Option<i64> {
        let i = self.widths().iter().position(|&w| w == width)?;
        i.checked_sub(1).map(|below| self.widths[below])
    }
}

/// The widths of `widths` whose spans each lie wholly inside one point of a
/// series of points `point_width` wide (aligned alike, to multiples).
pub(crate) fn fitting(widths: &[i64], point_width: i64) -> Vec<i64> {
    widths
        .iter()
        .copied()
        .filter(|&width| width > 0 && point_width % width == 0)
        .collect()
}

/// The start of the span of `width` holding `at`.
pub(crate) fn span_start(at: i64, width: i64) -> i64 {
    at.saturating_sub(at.rem_euclid(width))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: i64 = 60_000_000_000;

    #[test]
    fn tiers_nest_above_the_bucket() {
        assert_eq!(
            Tiers::new(MINUTE).widths(),
            [MINUTE, 10 * MINUTE, 60 * MINUTE, 1440 * MINUTE]
        );
        // 7 minutes divides none of them: only the bucket itself.
        assert_eq!(Tiers::new(7 * MINUTE).widths(), [7 * MINUTE]);
        // 2 hours: only the day above it.
        assert_eq!(
            Tiers::new(120 * MINUTE).widths(),
            [120 * MINUTE, 1440 * MINUTE]
        );
        let tiers = Tiers::new(MINUTE);
        assert_eq!(tiers.finer(MINUTE), None);
        assert_eq!(tiers.finer(60 * MINUTE), Some(10 * MINUTE));
        assert_eq!(tiers.finer(3 * MINUTE), None);
    }

    #[test]
    fn span_starts_align_below() {
        assert_eq!(span_start(0, MINUTE), 0);
        assert_eq!(span_start(MINUTE - 1, MINUTE), 0);
        assert_eq!(span_start(-1, MINUTE), -MINUTE);
        assert_eq!(span_start(i64::MIN, MINUTE), i64::MIN);
    }
}
