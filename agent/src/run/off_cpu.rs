//! Joins off-CPU samples with the switch-ins that end them.
//!
//! The BPF program writes an off-CPU sample (the stacks a thread blocked
//! with) as the thread leaves its CPU, and a switch-in record when it runs
//! again; only then is the sample's weight, the nanoseconds it waited,
//! known. The record waits here, copied out of the ring, until its
//! switch-in arrives: then it is walked like a tick's sample (with the
//! mappings of that moment, which still hold the code it blocked in) and
//! counted with its weight, which waits in [`OffCpuWeights`] for the walk.
//!
//! Owns the held records (bounded in bytes) and the weights; never the
//! walk. A held record goes, counted and never placed elsewhere, when its
//! process execs or exits (its stack would be unwound with another image's
//! mappings, or none), when a newer sample of its thread replaces it (the
//! kernel lost its switch-in), or when the bound is reached.

use std::collections::{BTreeMap, HashMap};

use agent_common::{SampleHeader, SwitchIn};
use stackscope_telemetry::StateSize;

/// Bytes of held records kept at most by default.
pub const DEFAULT_MAX_HELD_BYTES: usize = 16 << 20;

/// Weights of samples handed to the walker kept at most: each is taken by
/// its walk within the drain, or within the walker's wait for a process's
/// maps; ones the walker dropped go past this.
const MAX_WEIGHTS: usize = 65_536;

/// What was seen of off-CPU samples since the agent started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct OffCpuStats {
    /// Off-CPU samples read from the ring.
    pub samples: u64,
    /// Of those, joined with their switch-in (or with the run's end, for
    /// threads still blocked then) and handed to the walker.
    pub joined: u64,
    /// Nanoseconds those joined were blocked, and the same weighed by
    /// their sampling divisor (each stands for the blockings it was chosen
    /// among): the blocked time of the threads the agent estimates.
    pub blocked_nanos: u64,
    pub weighted_blocked_nanos: u64,
    /// Held samples let go because their process exited or exec'd first.
    pub ended_by_exit: u64,
    /// Held samples replaced by a newer one of the same thread (the
    /// switch-in of the first was lost).
    pub replaced: u64,
    /// Samples not held for want of room.
    pub dropped_full: u64,
    /// Switch-ins that matched no held sample.
    pub unmatched_switch_ins: u64,
    /// Walked samples whose weight was no longer kept.
    pub weight_missing: u64,
    /// Runs of the off-CPU program (one per context switch) and their
    /// time, counted while the kernel's BPF statistics are on.
    pub bpf_runs: u64,
    pub bpf_run_nanos: u64,
}

#[derive(Debug)]
struct Held {
    out_ns: u64,
    divisor: u32,
    record: Vec<u8>,
}

/// Off-CPU sample records waiting for their switch-in, by thread.
#[derive(Debug)]
pub struct OffCpuJoin {
    /// By (tgid, tid): a process's records are one range.
    held: BTreeMap<(u32, u32), Held>,
    /// The tgid of each held thread.
    tgid_of: HashMap<u32, u32>,
    held_bytes: usize,
    max_bytes: usize,
    pub stats: OffCpuStats,
}

impl OffCpuJoin {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            held: BTreeMap::new(),
            tgid_of: HashMap::new(),
            held_bytes: 0,
            max_bytes,
            stats: OffCpuStats::default(),
        }
    }

    /// Keeps the record `bytes` of an off-CPU sample with `header` until
    /// its switch-in.
    pub fn hold(&mut self, header: &SampleHeader, bytes: &[u8]) {
        self.stats.samples += 1;
        let (tgid, tid) = (header.tgid, header.tid);
        if self.release(tid).is_some() {
            self.stats.replaced += 1;
        }
        if self.held_bytes + bytes.len() > self.max_bytes {
            self.stats.dropped_full += 1;
            return;
        }
        self.held_bytes += bytes.len();
        self.tgid_of.insert(tid, tgid);
        self.held.insert(
            (tgid, tid),
            Held {
                out_ns: header.ktime_ns,
                divisor: header.sampling_divisor.max(1),
                record: bytes.to_vec(),
            },
        );
    }

    /// The held record `switch` ends, with its weight put in `weights`
    /// for its walk; `None` when none waits for it.
    pub fn switched_in(
        &mut self,
        switch: &SwitchIn,
        weights: &mut OffCpuWeights,
    ) -> Option<Vec<u8>> {
        let divisor = match self.held.get(&(switch.tgid, switch.tid)) {
            Some(held) if held.out_ns == switch.out_ns => held.divisor,
            _ => {
                self.stats.unmatched_switch_ins += 1;
                return None;
            }
        };
        let record = self.release(switch.tid)?;
        self.joined(
            switch.tid,
            switch.out_ns,
            switch.in_ns - switch.out_ns,
            divisor,
            weights,
        );
        Some(record)
    }

    /// Lets go of the held records of process `tgid`, which exec'd or
    /// exited.
    pub fn process_ended(&mut self, tgid: u32) {
        let tids: Vec<u32> = self
            .held
            .range((tgid, 0)..=(tgid, u32::MAX))
            .map(|(&(_, tid), _)| tid)
            .collect();
        for tid in tids {
            if self.release(tid).is_some() {
                self.stats.ended_by_exit += 1;
            }
        }
    }

    /// Every held record, each weighed as blocked until `now_ns` (the
    /// samples of threads still blocked when the run ends).
    pub fn end_all(&mut self, now_ns: u64, weights: &mut OffCpuWeights) -> Vec<Vec<u8>> {
        let held = std::mem::take(&mut self.held);
        self.tgid_of.clear();
        self.held_bytes = 0;
        held.into_iter()
            .map(|((_, tid), held)| {
                let nanos = now_ns.saturating_sub(held.out_ns);
                self.joined(tid, held.out_ns, nanos, held.divisor, weights);
                held.record
            })
            .collect()
    }

    /// Counts a sample joined with its `nanos` blocked and hands its weight
    /// to its walk.
    fn joined(
        &mut self,
        tid: u32,
        out_ns: u64,
        nanos: u64,
        divisor: u32,
        weights: &mut OffCpuWeights,
    ) {
        self.stats.joined += 1;
        self.stats.blocked_nanos += nanos;
        self.stats.weighted_blocked_nanos += nanos * u64::from(divisor);
        weights.put(tid, out_ns, nanos);
    }

    fn release(&mut self, tid: u32) -> Option<Vec<u8>> {
        let tgid = self.tgid_of.remove(&tid)?;
        let held = self.held.remove(&(tgid, tid))?;
        self.held_bytes -= held.record.len();
        Some(held.record)
    }

    pub fn state_size(&self) -> StateSize {
        StateSize {
            name: "off_cpu_held",
            entries: Some(self.held.len()),
            max_entries: None,
            bytes: Some(self.held_bytes),
            max_bytes: Some(self.max_bytes),
        }
    }
}

/// The weights of joined off-CPU samples, from their switch-in until their
/// walk reaches the aggregator (the walker may hold a sample until its
/// process's maps are read).
#[derive(Debug, Default)]
pub struct OffCpuWeights {
    /// By (tid, out_ns): nanoseconds blocked.
    nanos: HashMap<(u32, u64), u64>,
    pub missing: u64,
}

impl OffCpuWeights {
    fn put(&mut self, tid: u32, out_ns: u64, nanos: u64) {
        if self.nanos.len() >= MAX_WEIGHTS {
            // Only the walker's dropped samples pile up here.
            self.nanos.clear();
        }
        self.nanos.insert((tid, out_ns), nanos);
    }

    /// The blocked nanoseconds of the off-CPU sample with `header`;
    /// `None` when its weight is gone (counted).
    pub fn take(&mut self, header: &SampleHeader) -> Option<u64> {
        let nanos = self.nanos.remove(&(header.tid, header.ktime_ns));
        self.missing += u64::from(nanos.is_none());
        nanos
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agent_common::sample_flags;

    fn header(tgid: u32, tid: u32, out_ns: u64) -> SampleHeader {
        SampleHeader {
            kind: agent_common::RecordKind::Sample as u32,
            flags: sample_flags::OFF_CPU | sample_flags::USER_REGS,
            tgid,
            tid,
            cpu: 0,
            kernel_stack_len: 0,
            user_stack_len: 0,
            sampling_divisor: 1,
            ktime_ns: out_ns,
            cgroup_id: 0,
            user_rip: 0,
            user_rsp: 0,
            user_rbp: 0,
            comm: [0; agent_common::COMM_LEN],
            tail_len: 0,
            tail_spans: 0,
            process_start_ns: 0,
        }
    }

    fn switch_in(tgid: u32, tid: u32, out_ns: u64, in_ns: u64) -> SwitchIn {
        SwitchIn::new(tid, tgid, out_ns, in_ns)
    }

    #[test]
    fn a_switch_in_releases_its_sample_with_the_time_blocked() {
        let mut join = OffCpuJoin::new(1 << 20);
        let mut weights = OffCpuWeights::default();
        join.hold(&header(10, 11, 1_000), b"record of 11");
        join.hold(&header(10, 12, 1_500), b"record of 12");
        let record = join
            .switched_in(&switch_in(10, 11, 1_000, 4_000), &mut weights)
            .expect("held");
        assert_eq!(record, b"record of 11");
        assert_eq!(weights.take(&header(10, 11, 1_000)), Some(3_000));
        // Taken once: a second walk of it finds none.
        assert_eq!(weights.take(&header(10, 11, 1_000)), None);
        assert_eq!(weights.missing, 1);
        assert_eq!(join.stats.joined, 1);
        assert_eq!(join.stats.blocked_nanos, 3_000);
        assert_eq!(join.state_size().bytes, Some(b"record of 12".len()));
    }

    #[test]
    fn a_switch_in_of_another_switch_out_or_process_is_refused() {
        let mut join = OffCpuJoin::new(1 << 20);
        let mut weights = OffCpuWeights::default();
        join.hold(&header(10, 11, 1_000), b"a");
        // Another time out: a switch-out this record is not.
        assert!(
            join.switched_in(&switch_in(10, 11, 900, 4_000), &mut weights)
                .is_none()
        );
        // The same tid in another process (a reused id).
        assert!(
            join.switched_in(&switch_in(20, 11, 1_000, 4_000), &mut weights)
                .is_none()
        );
        assert_eq!(join.stats.unmatched_switch_ins, 2);
        assert!(
            join.switched_in(&switch_in(10, 11, 1_000, 4_000), &mut weights)
                .is_some()
        );
    }

    #[test]
    fn an_exit_or_exec_lets_go_of_its_process_s_samples_only() {
        let mut join = OffCpuJoin::new(1 << 20);
        let mut weights = OffCpuWeights::default();
        join.hold(&header(10, 10, 1_000), b"a");
        join.hold(&header(10, 11, 1_000), b"b");
        join.hold(&header(20, 21, 1_000), b"c");
        join.process_ended(10);
        assert_eq!(join.stats.ended_by_exit, 2);
        // A new process reusing the ids finds nothing of the old one.
        assert!(
            join.switched_in(&switch_in(10, 11, 1_000, 2_000), &mut weights)
                .is_none()
        );
        assert!(
            join.switched_in(&switch_in(20, 21, 1_000, 2_000), &mut weights)
                .is_some()
        );
        assert_eq!(join.state_size().entries, Some(0));
        assert_eq!(join.state_size().bytes, Some(0));
    }

    #[test]
    fn held_bytes_stay_within_their_bound_and_a_thread_holds_one_sample() {
        let mut join = OffCpuJoin::new(10);
        let mut weights = OffCpuWeights::default();
        join.hold(&header(10, 11, 1_000), b"123456");
        join.hold(&header(10, 12, 1_000), b"123456");
        assert_eq!(join.stats.dropped_full, 1);
        // A newer switch-out of 11: its switch-in was lost.
        join.hold(&header(10, 11, 2_000), b"1234");
        assert_eq!(join.stats.replaced, 1);
        assert!(join.state_size().bytes.is_some_and(|bytes| bytes <= 10));
        assert!(
            join.switched_in(&switch_in(10, 11, 1_000, 3_000), &mut weights)
                .is_none()
        );
        assert_eq!(
            join.switched_in(&switch_in(10, 11, 2_000, 3_000), &mut weights)
                .as_deref(),
            Some(&b"1234"[..])
        );
    }

    #[test]
    fn samples_still_blocked_at_the_end_are_weighed_until_then() {
        let mut join = OffCpuJoin::new(1 << 20);
        let mut weights = OffCpuWeights::default();
        join.hold(&header(10, 11, 1_000), b"a");
        join.hold(&header(20, 21, 4_000), b"b");
        let ended = join.end_all(5_000, &mut weights);
        assert_eq!(ended.len(), 2);
        assert_eq!(weights.take(&header(10, 11, 1_000)), Some(4_000));
        assert_eq!(weights.take(&header(20, 21, 4_000)), Some(1_000));
        assert_eq!(join.state_size().entries, Some(0));
        assert_eq!(join.state_size().bytes, Some(0));
    }
}
