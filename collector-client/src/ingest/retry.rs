//! When to retry a failed push and how long to wait first (the collector
//! may say: gRPC server pushback).

use std::time::Duration;

use stackscope_proto::RETRY_PUSHBACK_KEY;
use tonic::{Code, Status};

/// Whether a push that failed with `status` may succeed if sent again as is.
///
/// Retryable: the collector or the path to it is (for now) not there —
/// `Unavailable` (also what tonic reports for a refused or dropped
/// connection), `DeadlineExceeded`, `Cancelled` (tonic's own timeouts),
/// `Aborted` — and `Unknown`/`Internal`, which tonic produces for HTTP/2 and
/// connection failures as well as for server bugs; a batch that keeps
/// failing that way is eventually displaced by the queue bound, so it cannot
/// block the agent forever. `ResourceExhausted` is retryable when it comes
/// with a server pushback ([`pushback`]): the collector's disk is full, and
/// the batch will be taken once there is room. Everything else is an answer
/// about the batch or the agent's credentials and would come back the same:
/// `InvalidArgument`, `Unauthenticated`, `PermissionDenied`,
/// `FailedPrecondition`, `Unimplemented` (e.g. a compression the collector
/// does not accept), and `ResourceExhausted` without a pushback, which the
/// collector (and tonic itself) sends for a batch larger than it accepts.
pub fn is_retryable(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Aborted
        | Code::Unknown
        | Code::Internal => true,
        Code::ResourceExhausted => pushback(status).is_some(),
        Code::Ok
        | Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::PermissionDenied
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented
        | Code::DataLoss
        | Code::Unauthenticated => false,
    }
}

/// The least wait before a retry that the collector asked for with its
/// refusal (gRPC server pushback, gRFC A6: a non-negative decimal number of
/// milliseconds in [`RETRY_PUSHBACK_KEY`]); `None` when it asked none, or
/// sent anything else (A6 reads that as "do not retry").
pub fn pushback(status: &Status) -> Option<Duration> {
    let value = status.metadata().get(RETRY_PUSHBACK_KEY)?.to_str().ok()?;
    let millis: u64 = value.trim().parse().ok()?;
    Some(Duration::from_millis(millis))
}

/// Exponential backoff with full jitter: the n-th consecutive failure waits
/// a uniformly random time in `[0, min(max, initial * 2^n)]`. Full jitter
/// spreads a fleet of agents that lost the same collector at the same moment,
/// so they do not all come back in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            failures: 0,
        }
    }

    /// The upper end of the next wait, before jitter.
    pub fn ceiling(&self) -> Duration {
        // 2^30 times any sensible initial backoff is far past any max; the
        // cap keeps the shift and the multiplication from overflowing.
        self.initial
            .saturating_mul(1u32 << self.failures.min(30))
            .min(self.max)
    }

    /// Counts one more failure and returns how long to wait before retrying.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.failures = self.failures.saturating_add(1);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::random_range(0..=nanos))
    }

    /// [`Backoff::next_delay`], but at least `pushback` (what the collector
    /// asked for), itself capped at the maximum backoff: the agent's own
    /// bound on how long a batch waits stays in force.
    pub fn next_delay_after(&mut self, pushback: Option<Duration>) -> Duration {
        let floor = pushback.unwrap_or_default().min(self.max);
        self.next_delay().max(floor)
    }

    /// Starts over from `initial`, after a success.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_pushback(code: Code, value: &str) -> Status {
        let mut status = Status::new(code, "test");
        status
            .metadata_mut()
            .insert(RETRY_PUSHBACK_KEY, value.parse().unwrap());
        status
    }

    #[test]
    fn transient_codes_are_retried_and_answers_about_the_batch_are_not() {
        for code in [
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::Cancelled,
            Code::Aborted,
            Code::Unknown,
            Code::Internal,
        ] {
            assert!(is_retryable(&Status::new(code, "test")), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::FailedPrecondition,
            Code::ResourceExhausted,
            Code::Unimplemented,
            Code::DataLoss,
        ] {
            assert!(!is_retryable(&Status::new(code, "test")), "{code:?}");
        }
    }

    #[test]
    fn resource_exhausted_is_retried_only_when_the_collector_says_when() {
        // A full disk: the collector asks for a wait.
        let full = with_pushback(Code::ResourceExhausted, "1000");
        assert!(is_retryable(&full));
        assert_eq!(pushback(&full), Some(Duration::from_secs(1)));
        // A batch too large: no pushback, or one that says not to retry.
        for value in ["-1", "soon", ""] {
            let status = with_pushback(Code::ResourceExhausted, value);
            assert!(!is_retryable(&status), "{value:?}");
            assert_eq!(pushback(&status), None, "{value:?}");
        }
        // A pushback never turns an answer about the batch into a retry.
        assert!(!is_retryable(&with_pushback(Code::InvalidArgument, "10")));
        assert_eq!(
            pushback(&with_pushback(Code::Unavailable, " 250 ")),
            Some(Duration::from_millis(250))
        );
    }

    #[test]
    fn a_pushback_is_the_least_wait_up_to_the_cap() {
        let ms = Duration::from_millis;
        let mut backoff = Backoff::new(ms(10), ms(500));
        for _ in 0..20 {
            let delay = backoff.next_delay_after(Some(ms(200)));
            assert!((ms(200)..=ms(500)).contains(&delay), "{delay:?}");
        }
        // Longer than the cap: the cap wins.
        backoff.reset();
        assert_eq!(backoff.next_delay_after(Some(ms(60_000))), ms(500));
        backoff.reset();
        assert!(backoff.next_delay_after(None) <= ms(10));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let ms = Duration::from_millis;
        let mut backoff = Backoff::new(ms(100), ms(1000));
        let mut ceilings = Vec::new();
        for _ in 0..6 {
            let ceiling = backoff.ceiling();
            let delay = backoff.next_delay();
            assert!(delay <= ceiling, "{delay:?} > {ceiling:?}");
            ceilings.push(ceiling);
        }
        assert_eq!(
            ceilings,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
        backoff.reset();
        assert_eq!(backoff.ceiling(), ms(100));
    }

    #[test]
    fn backoff_survives_many_failures() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        for _ in 0..200 {
            assert!(backoff.next_delay() <= Duration::from_secs(60));
        }
        assert_eq!(backoff.ceiling(), Duration::from_secs(60));
    }

    #[test]
    fn backoff_jitters() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let delays: std::collections::HashSet<_> = (0..20).map(|_| backoff.next_delay()).collect();
        assert!(delays.len() > 1, "{delays:?}");
    }
}
