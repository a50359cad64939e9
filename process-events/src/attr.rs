//! The `perf_event_attr` ABI: the struct `perf_event_open(2)` takes, the
//! constants this crate passes in it, and the one attr it builds.
//!
//! Owns: the `#[repr(C)]` layout (pinned by tests), the bit positions of the
//! flag word, and [`side_band_attr`], the attr of a dummy software event that
//! only produces side-band records (mmap, comm, fork, exit).
//!
//! Does not own: calling `perf_event_open` or reading the ring buffer
//! ([`events`](crate::events), [`sys`](crate::sys)).
//!
//! The `libc` crate (0.2.191) exposes neither `perf_event_attr` nor the
//! `PERF_*` constants, so they are written out here from
//! `include/uapi/linux/perf_event.h`. The flag word is a C bitfield; its bit
//! positions were checked against the header by a C program that sets each
//! field alone and prints the index of the bit it lands on (x86_64,
//! little-endian bitfields, as for every Linux target this crate builds for).

/// `PERF_TYPE_SOFTWARE`.
pub(crate) const PERF_TYPE_SOFTWARE: u32 = 1;
/// `PERF_COUNT_SW_DUMMY`: counts nothing, exists to carry side-band records.
pub(crate) const PERF_COUNT_SW_DUMMY: u64 = 9;

/// `PERF_SAMPLE_TID`: `{ u32 pid, tid }`.
pub(crate) const PERF_SAMPLE_TID: u64 = 1 << 1;
/// `PERF_SAMPLE_TIME`: `{ u64 time }`.
pub(crate) const PERF_SAMPLE_TIME: u64 = 1 << 2;
/// `PERF_SAMPLE_CPU`: `{ u32 cpu, res }`.
pub(crate) const PERF_SAMPLE_CPU: u64 = 1 << 7;

/// `PERF_FLAG_FD_CLOEXEC`: open the event fd with `O_CLOEXEC`.
pub(crate) const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;

/// `PERF_ATTR_SIZE_VER8` (Linux 6.3, adds `config3`). Older kernels accept a
/// larger `size` as long as the bytes they do not know are zero, which they
/// are here.
pub(crate) const PERF_ATTR_SIZE_VER8: u32 = 136;

/// Bit positions in [`PerfEventAttr::flags`] (the anonymous bitfield after
/// `read_format`). Only the ones this crate sets or asserts clear are named.
pub(crate) mod bit {
    pub(crate) const DISABLED: u32 = 0;
    pub(crate) const INHERIT: u32 = 1;
    pub(crate) const EXCLUDE_USER: u32 = 4;
    pub(crate) const EXCLUDE_KERNEL: u32 = 5;
    pub(crate) const MMAP: u32 = 8;
    pub(crate) const COMM: u32 = 9;
    pub(crate) const FREQ: u32 = 10;
    pub(crate) const TASK: u32 = 13;
    pub(crate) const WATERMARK: u32 = 14;
    pub(crate) const MMAP_DATA: u32 = 17;
    pub(crate) const SAMPLE_ID_ALL: u32 = 18;
    pub(crate) const MMAP2: u32 = 23;
    pub(crate) const COMM_EXEC: u32 = 24;
    pub(crate) const USE_CLOCKID: u32 = 25;
    pub(crate) const CONTEXT_SWITCH: u32 = 26;
    pub(crate) const WRITE_BACKWARD: u32 = 27;
    pub(crate) const BUILD_ID: u32 = 34;
}

/// `struct perf_event_attr` up to `PERF_ATTR_SIZE_VER8`. Unions are given the
/// name of the member this crate uses; the padding the C struct does not have
/// is not needed either (every field is naturally aligned).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PerfEventAttr {
    pub(crate) type_: u32,
    pub(crate) size: u32,
    pub(crate) config: u64,
    /// Union with `sample_freq`.
    pub(crate) sample_period: u64,
    pub(crate) sample_type: u64,
    pub(crate) read_format: u64,
    /// The bitfield word; see [`bit`].
    pub(crate) flags: u64,
    /// Union with `wakeup_events`; bytes when `watermark` is set.
    pub(crate) wakeup_watermark: u32,
    pub(crate) bp_type: u32,
    /// Union with `bp_addr`, `kprobe_func`, `uprobe_path`.
    pub(crate) config1: u64,
    /// Union with `bp_len`, `kprobe_addr`, `probe_offset`.
    pub(crate) config2: u64,
    pub(crate) branch_sample_type: u64,
    pub(crate) sample_regs_user: u64,
    pub(crate) sample_stack_user: u32,
    pub(crate) clockid: i32,
    pub(crate) sample_regs_intr: u64,
    pub(crate) aux_watermark: u32,
    pub(crate) sample_max_stack: u16,
    pub(crate) reserved_2: u16,
    pub(crate) aux_sample_size: u32,
    pub(crate) reserved_3: u32,
    pub(crate) sig_data: u64,
    pub(crate) config3: u64,
}

const _: () = assert!(std::mem::size_of::<PerfEventAttr>() == PERF_ATTR_SIZE_VER8 as usize);

impl PerfEventAttr {
    pub(crate) fn set(&mut self, bit: u32, on: bool) {
        if on {
            self.flags |= 1 << bit;
        } else {
            self.flags &= !(1 << bit);
        }
    }

    #[cfg(test)]
    pub(crate) fn is_set(&self, bit: u32) -> bool {
        self.flags & (1 << bit) != 0
    }
}

/// The attr of one per-CPU side-band event: a dummy software event, enabled
/// at once, that records executable mmaps (MMAP2, with the build-id when
/// `build_id`), comm changes (flagged when due to exec), forks and exits,
/// each followed by `{pid, tid, time, cpu}`, with times on
/// `CLOCK_MONOTONIC` so they compare with the BPF program's
/// `bpf_ktime_get_ns()`.
pub(crate) fn side_band_attr(wakeup_watermark: u32, build_id: bool) -> PerfEventAttr {
    let mut attr = PerfEventAttr {
        type_: PERF_TYPE_SOFTWARE,
        size: PERF_ATTR_SIZE_VER8,
        config: PERF_COUNT_SW_DUMMY,
        // A dummy event never samples; perf(1) sets 1 as well.
        sample_period: 1,
        sample_type: PERF_SAMPLE_TID | PERF_SAMPLE_TIME | PERF_SAMPLE_CPU,
        wakeup_watermark,
        clockid: libc::CLOCK_MONOTONIC,
        ..PerfEventAttr::default()
    };
    // `mmap` must accompany `mmap2`: `account_event` bumps the global
    // `nr_mmap_events` (without which `perf_event_mmap` returns at once) only
    // for `mmap` or `mmap_data`; `mmap2` then selects the MMAP2 format.
    attr.set(bit::MMAP, true);
    attr.set(bit::MMAP2, true);
    // Executable mappings only: data mmaps are far more numerous and useless
    // to an unwinder.
    attr.set(bit::MMAP_DATA, false);
    attr.set(bit::COMM, true);
    attr.set(bit::COMM_EXEC, true);
    attr.set(bit::TASK, true);
    attr.set(bit::BUILD_ID, build_id);
    attr.set(bit::SAMPLE_ID_ALL, true);
    attr.set(bit::USE_CLOCKID, true);
    attr.set(bit::WATERMARK, true);
    // `exclude_kernel` does not filter side-band records. Leaving it clear
    // needs CAP_PERFMON or `perf_event_paranoid` <= 1, which is no extra
    // demand: a system-wide event needs CAP_PERFMON or paranoid <= 0 anyway.
    attr.set(bit::EXCLUDE_KERNEL, false);
    attr.set(bit::EXCLUDE_USER, false);
    // The rest is already clear; spelled out where a set bit would break the
    // reader. A system-wide event (pid -1) cannot inherit; `write_backward`
    // would reverse the ring's direction; `freq` would make the period a
    // frequency; context switches would flood the ring.
    attr.set(bit::INHERIT, false);
    attr.set(bit::WRITE_BACKWARD, false);
    attr.set(bit::FREQ, false);
    attr.set(bit::CONTEXT_SWITCH, false);
    attr.set(bit::DISABLED, false);
    attr
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    #[test]
    fn layout_matches_the_kernel() {
        // Offsets from `offsetof` in a C program against
        // /usr/include/linux/perf_event.h (which stops at sig_data = 120,
        // size 128: VER7); config3 follows at 128 in newer headers.
        assert_eq!(size_of::<PerfEventAttr>(), 136);
        assert_eq!(offset_of!(PerfEventAttr, config), 8);
        assert_eq!(offset_of!(PerfEventAttr, sample_type), 24);
        assert_eq!(offset_of!(PerfEventAttr, flags), 40);
        assert_eq!(offset_of!(PerfEventAttr, wakeup_watermark), 48);
        assert_eq!(offset_of!(PerfEventAttr, config1), 56);
        assert_eq!(offset_of!(PerfEventAttr, clockid), 92);
        assert_eq!(offset_of!(PerfEventAttr, sample_regs_intr), 96);
        assert_eq!(offset_of!(PerfEventAttr, sig_data), 120);
        assert_eq!(offset_of!(PerfEventAttr, config3), 128);
    }

    #[test]
    fn bit_positions_match_the_header() {
        // The positions printed by setting each bitfield alone in C.
        let expected = [
            (bit::DISABLED, 0),
            (bit::INHERIT, 1),
            (bit::EXCLUDE_USER, 4),
            (bit::EXCLUDE_KERNEL, 5),
            (bit::MMAP, 8),
            (bit::COMM, 9),
            (bit::FREQ, 10),
            (bit::TASK, 13),
            (bit::WATERMARK, 14),
            (bit::MMAP_DATA, 17),
            (bit::SAMPLE_ID_ALL, 18),
            (bit::MMAP2, 23),
            (bit::COMM_EXEC, 24),
            (bit::USE_CLOCKID, 25),
            (bit::CONTEXT_SWITCH, 26),
            (bit::WRITE_BACKWARD, 27),
            (bit::BUILD_ID, 34),
        ];
        for (got, want) in expected {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn side_band_attr_sets_exactly_the_intended_flags() {
        let attr = side_band_attr(65536, true);
        let want = [
            bit::MMAP,
            bit::COMM,
            bit::TASK,
            bit::WATERMARK,
            bit::SAMPLE_ID_ALL,
            bit::MMAP2,
            bit::COMM_EXEC,
            bit::USE_CLOCKID,
            bit::BUILD_ID,
        ]
        .iter()
        .fold(0u64, |w, b| w | 1 << b);
        assert_eq!(attr.flags, want);
        // 0x4_0384_6300: the same word written as a number, so a mistake in
        // the list above cannot hide one in `side_band_attr`.
        assert_eq!(attr.flags, 0x4_0384_6300);
        assert_eq!(attr.size, 136);
        assert_eq!(attr.wakeup_watermark, 65536);
        assert_eq!(attr.clockid, libc::CLOCK_MONOTONIC);
        assert_eq!(attr.sample_type, 0b1000_0110);
        assert!(!side_band_attr(1, false).is_set(bit::BUILD_ID));
    }
}
