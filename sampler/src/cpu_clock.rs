//! The per-CPU cpu-clock events that run the sampling program: opened here
//! rather than through aya's `PerfEvent::attach`, which cannot ask the kernel
//! to leave out the idle task.
//!
//! Why that matters: an idle CPU still takes every tick, and the program ran
//! on each only to find the idle task and return. Under virtualisation each
//! such run cost about 2.5 us at 19 Hz (its code and maps cold): on this
//! 2-CPU VM, idle, 5.7 ms of BPF a minute beside the agent's 27 ms, a cost
//! that grows with the number of CPUs where the agent's does not. With
//! `exclude_idle` the kernel skips the program on those ticks
//! (`perf_swevent_hrtimer`), before any of it runs.

use std::io;
use std::os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};

use aya_obj::generated::{
    PERF_EVENT_IOC_ENABLE, PERF_EVENT_IOC_SET_BPF, PERF_FLAG_FD_CLOEXEC, perf_event_attr,
    perf_sw_ids::PERF_COUNT_SW_CPU_CLOCK, perf_type_id::PERF_TYPE_SOFTWARE,
};

/// Runs `program` (a loaded perf_event program) on CPU `cpu`'s cpu-clock,
/// `frequency_hz` times a second, in every task but the idle task. The
/// program stays attached while the returned descriptor is open.
pub fn attach(program: BorrowedFd<'_>, cpu: u32, frequency_hz: u64) -> io::Result<OwnedFd> {
    // SAFETY: an all-zero perf_event_attr is valid (every field off).
    let mut attr: perf_event_attr = unsafe { std::mem::zeroed() };
    attr.type_ = PERF_TYPE_SOFTWARE as u32;
    attr.config = PERF_COUNT_SW_CPU_CLOCK as u64;
    attr.size = std::mem::size_of::<perf_event_attr>() as u32;
    attr.set_freq(1);
    attr.__bindgen_anon_1.sample_freq = frequency_hz;
    attr.set_exclude_idle(1);
    attr.set_disabled(1);
    let cpu = i32::try_from(cpu).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `attr` is a valid, fully initialised attribute of the size it
    // states; pid -1 with a CPU selects every task on that CPU.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const perf_event_attr,
            -1 as libc::pid_t,
            cpu,
            -1 as libc::c_int,
            libc::c_ulong::from(PERF_FLAG_FD_CLOEXEC),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor, owned by nobody else.
    let event = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // Enabled only once the program is set: a tick before would find none.
    for (request, arg) in [
        (PERF_EVENT_IOC_SET_BPF, program.as_raw_fd()),
        (PERF_EVENT_IOC_ENABLE, 0),
    ] {
        // SAFETY: both requests take an int argument; `event` is open.
        if unsafe { libc::ioctl(event.as_raw_fd(), request as _, arg) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(event)
}
