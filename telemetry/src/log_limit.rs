//! At most one log line per interval for each kind of repeated trouble,
//! with a count of the ones held back: a peer that is down or refuses
//! everything must not flood the node's log.

use std::time::{Duration, Instant};

/// Lets one log line through per interval and counts the ones it held back,
/// so a collector that rejects every batch does not flood the node's log.
#[derive(Debug, Clone)]
pub struct LogLimiter {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl LogLimiter {
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(n)` when the event at `now` should be logged, `n` being how many
    /// events were held back since the last one logged; `None` to stay quiet.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiter_lets_one_through_per_interval_and_counts_the_rest() {
        let start = Instant::now();
        let secs = Duration::from_secs;
        let mut limiter = LogLimiter::new(secs(10));
        assert_eq!(limiter.allow(start), Some(0));
        assert_eq!(limiter.allow(start + secs(1)), None);
        assert_eq!(limiter.allow(start + secs(9)), None);
        assert_eq!(limiter.allow(start + secs(10)), Some(2));
        assert_eq!(limiter.allow(start + secs(11)), None);
        assert_eq!(limiter.allow(start + secs(25)), Some(1));
    }
}
