//! End to end: the BPF sampler on the real kernel against fixture processes.
//! Needs root.

use std::{
    collections::HashMap,
    os::unix::fs::{FileExt as _, MetadataExt as _},
    os::unix::process::CommandExt as _,
    process::{Command, Stdio},
    time::Duration,
};

use agent_common::{
    CgroupPolicy, DEEP_COPY_CLASSES, DIRECT_COPY_CLASSES, MAX_DEEP_STACK_BYTES, MAX_SPAN_BYTES,
    MAX_TAIL_BYTES, SAMPLE_AREA_BYTES, SAMPLE_AREA_WAKEUP_BYTES, SAMPLE_HEADER_SIZE, StackPlan,
    StackTop, TAIL_SPAN_HEADER_SIZE, policy_flags, reserved_record_bytes, sample_flags, tail_span,
};
use stackscope_metadata::cgroups;
use stackscope_sampler::{OffCpuConfig, SamplerConfig, Woken, record::OwnedSample};
use stackscope_tests::{
    Fixture, Mapping, MappingPath, OffCpuFixture, Recorded, RunningProcess, TempCgroup, cpu_time,
    exclusive, find_word, kernel_symbol, kernel_symbols, read_maps, require_root, sample_for,
    sample_planned, sample_while, wait_until_loaded, wakes_planned,
};
use stackscope_unwind::walker::stitching::PlanUpdate;

const CANARY: u64 = 0x05CA_1AB1_E0DD_BA11;
const FREQUENCY_HZ: u64 = 99;
const SAMPLING: Duration = Duration::from_secs(2);

/// Samples of process `pid` only, copying `user_stack_bytes` per sample.
fn sample_process(pid: u32, user_stack_bytes: u32) -> Vec<OwnedSample> {
    let config = SamplerConfig {
        frequency_hz: FREQUENCY_HZ,
        user_stack_bytes,
        pids: vec![pid],
        ..SamplerConfig::default()
    };
    sample_for(&config, SAMPLING).samples
}

fn mapping<'a>(maps: &'a [Mapping], what: impl Fn(&Mapping) -> bool, name: &str) -> &'a Mapping {
    maps.iter()
        .find(|m| what(m))
        .unwrap_or_else(|| panic!("no {name} mapping in {maps:#?}"))
}

/// Samples of process `pid` only, at the tests' rate.
fn sampling_only(pid: u32) -> SamplerConfig {
    SamplerConfig {
        frequency_hz: FREQUENCY_HZ,
        pids: vec![pid],
        ..SamplerConfig::default()
    }
}

/// `deep_stack` spinning `depth` frames deep, and where its stack mapping
/// ends (every page of its top present: see [`map_stack_top`]).
fn start_deep_stack(fixture: &Fixture, depth: u64) -> (RunningProcess, u64) {
    let process = fixture.start(&[&depth.to_string()]);
    let maps = read_maps(process.pid());
    let stack = mapping(&maps, |m| m.path == MappingPath::Stack, "stack");
    map_stack_top(process.pid(), stack);
    (process, stack.end)
}

/// Makes every page of the top of process `pid`'s `stack` mapping present.
/// The kernel leaves a random gap of up to 8 KiB between the strings at the
/// stack's top and `argc`; a page of it that was never touched is not
/// present, and a BPF copy (which cannot fault pages in) stops there. With
/// the fixtures' empty environment that takes a gap near its largest, so
/// it is rare, but CI met it in the Linux 6.1 VM: the syscall test's copies
/// to the mapping's end faulted on every tick. Reading the pages through
/// /proc maps them. (The agent's own tops lie below the gap: a walk's root
/// frame is under `argc`.)
fn map_stack_top(pid: u32, stack: &Mapping) {
    let from = stack
        .start
        .max(stack.end - u64::from(agent_common::MAX_USER_STACK_BYTES));
    let memory =
        std::fs::File::open(format!("/proc/{pid}/mem")).expect("opening the fixture's memory");
    let mut bytes = vec![0; (stack.end - from) as usize];
    memory
        .read_exact_at(&mut bytes, from)
        .expect("reading the top of the fixture's stack");
}

/// Thread `tid`'s copies end at `top`, for the process `tgid` (as the
/// planner learns it).
fn thread_top(tid: u32, tgid: u32, top: u64) -> PlanUpdate {
    PlanUpdate::ThreadTop {
        tid,
        top: Some(StackTop {
            tgid,
            flags: 0,
            top,
        }),
    }
}

#[test]
fn copies_the_stack_of_a_deep_recursion_with_every_frames_canary() {
    require_root();
    let _serial = exclusive();
    const DEPTH: u64 = 64;
    let fixture = Fixture::compile("deep_stack", &[]);
    let process = fixture.start(&[&DEPTH.to_string()]);
    let maps = read_maps(process.pid());
    let text = mapping(
        &maps,
        |m| m.path.file_path() == Some(&fixture.path) && m.perms.exec,
        "fixture text",
    );
    let stack = mapping(&maps, |m| m.path == MappingPath::Stack, "stack");

    let samples = sample_process(process.pid(), agent_common::DEFAULT_USER_STACK_BYTES);
    // The program reads thread names from the task at this offset.
    let layout = stackscope_sampler::task_layout::TaskLayout::of_running_kernel();
    assert!(layout.is_ok_and(|layout| layout.comm.is_some()));

    // The fixture spins on one of the two CPUs the whole time: about
    // FREQUENCY_HZ * 2 s ticks land on it. Half of that is plenty of margin.
    let expected = FREQUENCY_HZ * SAMPLING.as_secs();
    assert!(
        samples.len() as u64 >= expected / 2,
        "only {} samples, expected about {expected}",
        samples.len()
    );
    for sample in &samples {
        let h = &sample.header;
        assert_eq!(
            h.tgid,
            process.pid(),
            "the allow-list let another process through"
        );
        assert_eq!(
            agent_common::comm_str(&h.comm),
            "deep_stack",
            "the thread's name: {h:?}"
        );
        assert_ne!(
            h.flags & sample_flags::USER_REGS,
            0,
            "no user registers: {h:?}"
        );
        assert!(
            text.contains(h.user_rip),
            "rip {:#x} outside the fixture's text {text:?}",
            h.user_rip
        );
        assert!(
            stack.contains(h.user_rsp),
            "rsp {:#x} outside the stack {stack:?}",
            h.user_rsp
        );
        assert!(!sample.user_stack.is_empty(), "empty stack copy: {h:?}");
        assert!(
            h.user_rsp + sample.user_stack.len() as u64 <= stack.end,
            "copied past the stack end"
        );

        // Every frame of the recursion holds [CANARY, depth]: all of them fit
        // in the default 16 KiB, innermost (depth 0) first.
        let depths: Vec<u64> = find_word(&sample.user_stack, CANARY)
            .filter_map(|at| sample.user_stack.get(at + 8..at + 16))
            .map(|word| u64::from_ne_bytes(word.try_into().unwrap()))
            .collect();
        assert_eq!(
            depths,
            (0..=DEPTH).collect::<Vec<_>>(),
            "canaries in a {h:?} sample"
        );
    }
}

#[test]
fn copies_a_short_stack_up_to_the_end_of_its_mapping() {
    require_root();
    let _serial = exclusive();
    // Depth 0: the fixture spins right below main, a few KiB under the top of
    // its stack mapping, so fewer bytes remain above rsp than the 32 KiB asked.
    let fixture = Fixture::compile("deep_stack", &[]);
    // The copy ends with a fault only where nothing is mapped right above
    // the stack. Address randomisation sometimes puts [vvar] there (seen on
    // Linux 6.1): such a process is replaced by another, laid out afresh.
    let (process, stack_end) = (0..20)
        .find_map(|_| {
            let process = fixture.start(&["0"]);
            let maps = read_maps(process.pid());
            let stack = mapping(&maps, |m| m.path == MappingPath::Stack, "stack");
            let end_is_free = !maps.iter().any(|m| m.start == stack.end);
            end_is_free.then_some((process, stack.clone()))
        })
        .map(|(process, stack)| {
            map_stack_top(process.pid(), &stack);
            (process, stack.end)
        })
        .expect("in 20 starts, a mapping always began right at the stack's end");

    let limit = agent_common::MAX_USER_STACK_BYTES;
    let samples = sample_process(process.pid(), limit);
    assert!(!samples.is_empty(), "no samples of the fixture");
    for sample in &samples {
        let h = &sample.header;
        let remaining = stack_end - h.user_rsp;
        assert!(
            remaining < u64::from(limit),
            "rsp {:#x} is not near the stack top",
            h.user_rsp
        );
        assert_eq!(
            sample.user_stack.len() as u64,
            remaining,
            "the copy must hold exactly the bytes from rsp to the end of the stack mapping"
        );
        assert_ne!(
            h.flags & sample_flags::USER_STACK_FAULTED,
            0,
            "copy end not flagged: {h:?}"
        );
        assert_eq!(
            find_word(&sample.user_stack, CANARY).count(),
            1,
            "the one frame's canary"
        );
    }
}

/// Every sample of `samples` carries process `pid`'s start time as
/// `/proc/<pid>/stat` gives it (boot time in clock ticks; the samples',
/// monotonic, differs by the time the host was suspended, added back).
fn assert_started_when_the_kernel_says(samples: &[OwnedSample], pid: u32) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process's stat");
    let after_name = &stat[stat.rfind(')').expect("a stat line") + 2..];
    // Field 22, the 20th after the name.
    let ticks: u64 = after_name
        .split(' ')
        .nth(19)
        .and_then(|field| field.parse().ok())
        .expect("a start time");
    // SAFETY: sysconf has no preconditions.
    let tick_ns = 1_000_000_000
        / u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).expect("CLK_TCK");
    let clock = |id| {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid clock id and a timespec to fill.
        unsafe { libc::clock_gettime(id, &mut now) };
        now.tv_sec * 1_000_000_000 + now.tv_nsec
    };
    let suspended_ns = clock(libc::CLOCK_BOOTTIME) - clock(libc::CLOCK_MONOTONIC);
    assert!(
        samples.iter().any(|s| s.header.tgid == pid),
        "no samples of {pid}"
    );
    for sample in samples.iter().filter(|s| s.header.tgid == pid) {
        let start = sample.header.process_start_ns as i64 + suspended_ns;
        assert!(
            (start / tick_ns as i64 - ticks as i64).abs() <= 1,
            "thread {} of {pid}: process start {} ns, the kernel's {ticks} ticks",
            sample.header.tid,
            sample.header.process_start_ns
        );
    }
}

#[test]
fn a_threads_stack_top_ends_its_copies_there_without_a_fault() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("deep_stack", &[]);
    let (process, stack_end) = start_deep_stack(&fixture, 0);
    let pid = process.pid();
    // Above the spinning frame and its canary, below the end of the mapping.
    let top = stack_end - 64;
    let config = sampling_only(pid);
    let top_of = |tgid| thread_top(pid, tgid, top);

    let samples = sample_planned(&config, SAMPLING, vec![top_of(pid)]).samples;
    assert!(!samples.is_empty(), "no samples of the fixture");
    // A main thread's samples: the start time read from its own task.
    assert_started_when_the_kernel_says(&samples, pid);
    for sample in &samples {
        let h = &sample.header;
        assert_eq!(sample.user_stack.len() as u64, top - h.user_rsp, "{h:?}");
        assert_eq!(
            h.flags & (sample_flags::COPY_AT_TOP | sample_flags::USER_STACK_FAULTED),
            sample_flags::COPY_AT_TOP,
            "stopped at the top, not by a fault: {h:?}"
        );
        assert_eq!(find_word(&sample.user_stack, CANARY).count(), 1);
    }

    // Another process's entry for the same thread id is not this thread's.
    let samples = sample_planned(&config, SAMPLING, vec![top_of(pid + 1)]).samples;
    assert!(!samples.is_empty(), "no samples of the fixture");
    for sample in &samples {
        let h = &sample.header;
        assert_eq!(sample.user_stack.len() as u64, stack_end - h.user_rsp);
        assert_eq!(h.flags & sample_flags::COPY_AT_TOP, 0, "{h:?}");
    }
}

#[test]
fn an_area_past_its_mark_rings_the_reader_long_before_its_drain_period() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("deep_stack", &[]);
    // Records of 6-10 KB (150 frames and the top of the stack): at 997 Hz
    // an area passes its mark every 50-90 ms.
    let (process, stack_end) = start_deep_stack(&fixture, 150);
    let pid = process.pid();
    let config = SamplerConfig {
        frequency_hz: 997,
        pids: vec![pid],
        // Longer than the test: only the program wakes the reader.
        drain_interval: Duration::from_secs(600),
        ..SamplerConfig::default()
    };
    // A learned thread's ticks are written to the areas.
    let wakes = wakes_planned(
        &config,
        Duration::from_secs(3),
        vec![thread_top(pid, pid, stack_end - 64)],
    );
    // The first wait may end on a signal from before the drain that
    // preceded it; the later ones, all signalled, on doorbells. A wake by
    // a doorbell finds one area past its mark but not near full, and no
    // sample sent to a ring because an area was full: without doorbells,
    // the ring's own mark wakes the reader only once full areas have sent
    // it samples, every time. Most wakes, not all: a reader held up (a
    // virtual machine's stall) finds its area fuller, and a doorbell rung
    // during a drain ends the next wait early.
    let rung = wakes.get(1..).unwrap_or_default();
    assert!(
        rung.iter().all(|wake| wake.woken == Woken::Signalled),
        "{wakes:?}"
    );
    let near_full = SAMPLE_AREA_BYTES as u64 * 3 / 4;
    let by_doorbell = rung.iter().filter(|wake| {
        let fullest = wake.area_bytes_by_cpu.values().max().copied();
        wake.ring_samples == 0
            && fullest.is_some_and(|bytes| (SAMPLE_AREA_WAKEUP_BYTES..near_full).contains(&bytes))
    });
    assert!(
        rung.len() >= 2 && by_doorbell.count() * 2 > rung.len(),
        "the reader was not rung at an area's mark: {wakes:?}"
    );
}

#[test]
fn a_learned_threads_copy_reaches_its_top_whatever_its_processs_copy_size() {
    require_root();
    let _serial = exclusive();
    // About 6 KB of frames, well above the process's copy size below.
    const DEPTH: u64 = 150;
    const PROCESS_COPY: u32 = agent_common::MIN_USER_STACK_BYTES;
    let fixture = Fixture::compile("deep_stack", &[]);
    let (process, stack_end) = start_deep_stack(&fixture, DEPTH);
    let pid = process.pid();
    let top = stack_end - 64;
    let config = sampling_only(pid);
    let process_copy = PlanUpdate::ProcessCopy {
        tgid: pid,
        bytes: Some(PROCESS_COPY),
    };

    // Unlearned, the thread copies its process's size.
    let samples = sample_planned(&config, SAMPLING, vec![process_copy.clone()]).samples;
    assert!(!samples.is_empty(), "no samples of the fixture");
    for sample in &samples {
        assert_eq!(
            sample.user_stack.len(),
            PROCESS_COPY as usize,
            "{:?}",
            sample.header
        );
    }

    // Learned, it copies up to its top, every frame: a process size learned
    // from shallower ticks would cut it short. A learned thread's plan is
    // not looked up (the planner removes the top when it writes one): a
    // short plan left beside the top changes nothing.
    let learned = thread_top(pid, pid, top);
    let plan = PlanUpdate::Thread {
        tid: pid,
        plan: Some(Box::new(StackPlan::copy_only(pid, 512))),
    };
    // As the planner writes a plan: the thread's top goes after it, though
    // it has none (a removal of an absent key is not an error).
    let no_top = PlanUpdate::ThreadTop {
        tid: pid,
        top: None,
    };
    let updates = vec![process_copy, plan, no_top, learned];
    let samples = sample_planned(&config, SAMPLING, updates).samples;
    assert!(!samples.is_empty(), "no samples of the fixture");
    for sample in &samples {
        let h = &sample.header;
        assert_eq!(sample.user_stack.len() as u64, top - h.user_rsp, "{h:?}");
        assert_ne!(h.flags & sample_flags::COPY_AT_TOP, 0, "{h:?}");
        let depths = find_word(&sample.user_stack, CANARY).count() as u64;
        assert_eq!(depths, DEPTH + 1, "every frame's canary: {h:?}");
    }
}

#[test]
fn a_tail_of_the_most_bytes_a_record_holds_arrives_whole() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("deep_stack", &[]);
    let (process, stack_end) = start_deep_stack(&fixture, 150);
    let pid = process.pid();
    // Spans of the longest kind and one short one, headers included,
    // add up to MAX_TAIL_BYTES exactly. Where they point does not matter
    // to their lengths (a span that faults is written zeroed, flagged).
    let long = TAIL_SPAN_HEADER_SIZE as u32 + MAX_SPAN_BYTES;
    let longs = MAX_TAIL_BYTES / long;
    let short = MAX_TAIL_BYTES - longs * long - TAIL_SPAN_HEADER_SIZE as u32;
    let mut plan = StackPlan::copy_only(pid, 512);
    let mut addr = stack_end - u64::from(MAX_TAIL_BYTES);
    for (i, len) in (0..longs)
        .map(|_| MAX_SPAN_BYTES)
        .chain([short])
        .enumerate()
    {
        plan.spans[i] = tail_span::pack(addr, len).expect("a span");
        plan.span_count += 1;
        addr += u64::from(len);
    }
    let spans = plan.span_count;
    let update = PlanUpdate::Thread {
        tid: pid,
        plan: Some(Box::new(plan)),
    };
    // Records that do not decode fail the recording itself.
    let samples = sample_planned(&sampling_only(pid), SAMPLING, vec![update]).samples;
    assert!(!samples.is_empty(), "no samples of the fixture");
    for sample in &samples {
        let h = &sample.header;
        assert_eq!(h.tail_len, MAX_TAIL_BYTES, "{h:?}");
        assert_eq!(h.tail_spans, spans, "{h:?}");
    }
}

#[test]
fn a_deep_copy_reserves_the_smallest_class_that_holds_the_stack() {
    require_root();
    let _serial = exclusive();
    // About 40 KB of frames: a class well below the largest.
    const DEPTH: u64 = 1000;
    let fixture = Fixture::compile("deep_stack", &[]);
    let (process, stack_end) = start_deep_stack(&fixture, DEPTH);
    let pid = process.pid();
    let mut plan = StackPlan::copy_only(pid, 512);
    plan.stack_end = stack_end;
    let config = sampling_only(pid);
    let update = PlanUpdate::Thread {
        tid: pid,
        plan: Some(Box::new(plan)),
    };
    let recorded = sample_planned(&config, SAMPLING, vec![update]);
    let (deep, fallbacks) = split_by_copy(&recorded, sample_flags::DEEP_COPY);
    for sample in fallbacks {
        // The plan's usual copy.
        assert!(sample.user_stack.len() <= 512, "{:?}", sample.header);
    }
    for (sample, record_bytes) in deep {
        let h = &sample.header;
        let copy = stack_end - h.user_rsp;
        assert_eq!(sample.user_stack.len() as u64, copy, "{h:?}");
        let class = smallest_class(&DEEP_COPY_CLASSES, copy);
        assert!(class < MAX_DEEP_STACK_BYTES, "{copy} bytes of stack");
        assert_eq!(
            record_bytes,
            reserved_record_bytes(class, true) as usize,
            "{h:?}"
        );
        let depths = find_word(&sample.user_stack, CANARY).count() as u64;
        assert_eq!(depths, DEPTH + 1, "every frame's canary: {h:?}");
    }
}

#[test]
fn records_the_kernel_stack_and_the_saved_user_registers_of_a_syscall() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("syscall_loop", &[]);
    let process = fixture.start(&[]);
    let pid = process.pid();
    let maps = read_maps(pid);
    let stack = mapping(&maps, |m| m.path == MappingPath::Stack, "stack");
    map_stack_top(pid, stack);
    let symbols = kernel_symbols();

    // An unlearned thread: the record is assembled in the scratch slot.
    let samples = sample_process(pid, agent_common::DEFAULT_USER_STACK_BYTES);
    check_syscall_samples(&samples, &maps, stack, &symbols);
    for sample in &samples {
        assert_eq!(sample.header.flags & sample_flags::DIRECT_COPY, 0);
    }

    // With its stack top known, both stacks go straight into the CPU's
    // sample area, in kernel mode as in user mode: exactly their bytes.
    // When the area has no room, into a ring reservation of the copy's
    // size class.
    let top = thread_top(pid, pid, stack.end);
    let recorded = sample_planned(&sampling_only(pid), SAMPLING, vec![top]);
    check_syscall_samples(&recorded.samples, &maps, stack, &symbols);
    let (direct, fallbacks) = split_by_copy(&recorded, sample_flags::DIRECT_COPY);
    for sample in fallbacks {
        // The ring has room for these small records: only a page that
        // could not be read makes a direct copy fall back, and the usual
        // copy then stops at it too.
        let h = &sample.header;
        assert_ne!(h.flags & sample_flags::USER_STACK_FAULTED, 0, "{h:?}");
    }
    let mut in_area = 0;
    for &(sample, record_bytes) in &direct {
        let h = &sample.header;
        assert_eq!(
            h.flags & (sample_flags::DIRECT_COPY | sample_flags::COPY_AT_TOP),
            sample_flags::DIRECT_COPY | sample_flags::COPY_AT_TOP,
            "{h:?}"
        );
        let copy = stack.end - h.user_rsp;
        assert_eq!(sample.user_stack.len() as u64, copy, "{h:?}");
        let exact = SAMPLE_HEADER_SIZE + h.kernel_stack_len as usize + copy as usize;
        if record_bytes == exact {
            in_area += 1;
            continue;
        }
        let class = smallest_class(&DIRECT_COPY_CLASSES, copy);
        let in_kernel = h.flags & sample_flags::TICK_IN_USER == 0;
        assert_eq!(
            record_bytes,
            reserved_record_bytes(class, in_kernel) as usize,
            "{h:?}"
        );
    }
    assert!(
        in_area > direct.len() / 2,
        "{in_area} of {} direct records came from the sample area",
        direct.len()
    );
}

/// The samples copied into a reservation of their class (flagged `copy`,
/// with their records' ring bytes), and the others, which fell back to the
/// usual copy: when the ring had no room (in the test VMs, the debug
/// build's reader falls behind at times) or a page of the stack could not
/// be read at that tick. Most must be the former.
fn split_by_copy(
    recorded: &Recorded,
    copy: u32,
) -> (Vec<(&OwnedSample, usize)>, Vec<&OwnedSample>) {
    let (reserved, fallbacks): (Vec<_>, Vec<_>) = recorded
        .samples
        .iter()
        .zip(recorded.sample_record_bytes.iter().copied())
        .partition(|(s, _)| s.header.flags & copy != 0);
    let first_fallbacks: Vec<_> = fallbacks
        .iter()
        .take(3)
        .map(|(s, bytes)| (s.header, s.user_stack.len(), bytes))
        .collect();
    assert!(
        reserved.len() > fallbacks.len(),
        "{} of {} samples copied into a reservation; counters {:?}; the first fallbacks \
         (header, user stack bytes, record bytes): {first_fallbacks:?}",
        reserved.len(),
        recorded.samples.len(),
        recorded.counters,
    );
    (reserved, fallbacks.into_iter().map(|(s, _)| s).collect())
}

/// The smallest of `classes` that holds `bytes`.
fn smallest_class(classes: &[u32], bytes: u64) -> u32 {
    classes
        .iter()
        .copied()
        .find(|&class| u64::from(class) >= bytes)
        .unwrap_or_else(|| panic!("no class holds {bytes} bytes"))
}

/// Samples of `syscall_loop`: most ticks in kernel mode, inside read(2),
/// each with its kernel stack and the user registers saved at the syscall.
fn check_syscall_samples(
    samples: &[OwnedSample],
    maps: &[Mapping],
    stack: &Mapping,
    symbols: &[(u64, String)],
) {
    let in_kernel: Vec<_> = samples
        .iter()
        .filter(|s| s.header.flags & sample_flags::TICK_IN_USER == 0)
        .collect();
    // Clearing 1 MiB in the kernel dominates each loop iteration.
    assert!(
        in_kernel.len() * 2 > samples.len(),
        "only {} of {} ticks hit kernel mode",
        in_kernel.len(),
        samples.len()
    );

    let mut read_paths = 0;
    for sample in &in_kernel {
        let h = &sample.header;
        assert_eq!(
            h.flags & sample_flags::KERNEL_STACK_FAILED,
            0,
            "bpf_get_stack failed: {h:?}"
        );
        assert!(!sample.kernel_frames.is_empty(), "no kernel stack: {h:?}");
        // The user part comes from the registers saved at syscall entry: the
        // syscall instruction in libc, on the fixture's stack.
        assert_ne!(
            h.flags & sample_flags::USER_REGS,
            0,
            "no saved user registers: {h:?}"
        );
        let libc_text = maps
            .iter()
            .find(|m| m.contains(h.user_rip))
            .unwrap_or_else(|| panic!("saved rip {:#x} is in no mapping", h.user_rip));
        assert!(
            libc_text.path.to_string().contains("libc") && libc_text.perms.exec,
            "saved rip {:#x} is not in libc's text but in {libc_text:?}",
            h.user_rip
        );
        assert!(
            stack.contains(h.user_rsp),
            "saved rsp {:#x} outside the stack",
            h.user_rsp
        );
        assert!(
            !sample.user_stack.is_empty(),
            "no user stack copied in a syscall"
        );
        let names: Vec<&str> = sample
            .kernel_frames
            .iter()
            .filter_map(|&addr| kernel_symbol(symbols, addr))
            .collect();
        if names.iter().any(|name| name.contains("read")) {
            read_paths += 1;
        }
    }
    // Most ticks land inside read(2); a few hit the syscall entry or exit.
    assert!(
        read_paths * 2 > in_kernel.len(),
        "only {read_paths} of {} kernel stacks go through a read function",
        in_kernel.len()
    );
}

#[test]
fn samples_only_the_selected_cgroup_and_its_descendants() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("deep_stack", &[]);
    // Declared before the processes, so they are dropped (and removed)
    // after them; the child before its parent.
    let cgroup = TempCgroup::create("filter");
    let child = cgroup.child("inner");
    let direct = fixture.start(&["8"]);
    cgroup.add(direct.pid());
    let nested = fixture.start(&["8"]);
    child.add(nested.pid());
    let outside = fixture.start(&["8"]);

    let id = cgroups::resolve(cgroup.path.to_str().unwrap()).expect("resolving the cgroup");
    assert_eq!(id, std::fs::metadata(&cgroup.path).unwrap().ino());
    assert_eq!(
        cgroups::resolve(&cgroup.relative_path()).expect("resolving the /proc form"),
        id
    );

    // Only the parent is in the map: the program finds it as an ancestor.
    let config = SamplerConfig {
        frequency_hz: FREQUENCY_HZ,
        filter_cgroups: true,
        cgroup_policies: HashMap::from([(
            id,
            CgroupPolicy {
                flags: policy_flags::SELECTED,
                divisor: 0,
            },
        )]),
        ..SamplerConfig::default()
    };
    let samples = sample_for(&config, SAMPLING).samples;
    // Three spinners share two CPUs. The floor only has to show the filter
    // lets both selected processes through, so it leaves room for a loaded
    // machine.
    let expected = FREQUENCY_HZ * SAMPLING.as_secs();
    for (name, pid) in [("direct", direct.pid()), ("nested", nested.pid())] {
        let count = samples.iter().filter(|s| s.header.tgid == pid).count() as u64;
        assert!(
            count >= expected / 6,
            "only {count} samples of the {name} process, expected about {}",
            expected * 2 / 3
        );
    }
    for sample in &samples {
        assert!(
            [direct.pid(), nested.pid()].contains(&sample.header.tgid),
            "process {} is outside the cgroup (the one outside is {})",
            sample.header.tgid,
            outside.pid()
        );
        assert_eq!(sample.header.sampling_divisor, 1);
    }
}

#[test]
fn a_cgroup_budget_keeps_about_one_tick_in_n_and_says_so() {
    require_root();
    let _serial = exclusive();
    const DIVISOR: u32 = 4;
    let fixture = Fixture::compile("deep_stack", &[]);
    let cgroup = TempCgroup::create("budget");
    let budgeted = fixture.start(&["8"]);
    cgroup.add(budgeted.pid());
    let full = fixture.start(&["8"]);

    let id = cgroups::resolve(cgroup.path.to_str().unwrap()).expect("resolving the cgroup");
    let config = SamplerConfig {
        frequency_hz: 499,
        cgroup_budgets: true,
        cgroup_policies: HashMap::from([(
            id,
            CgroupPolicy {
                flags: 0,
                divisor: DIVISOR,
            },
        )]),
        ..SamplerConfig::default()
    };
    let pids = [budgeted.pid(), full.pid()];
    let before = pids.map(cpu_time);
    let recorded = sample_for(&config, SAMPLING);
    let after = pids.map(cpu_time);
    let [budgeted_cpu, full_cpu] = [0, 1].map(|i| (after[i] - before[i]).as_secs_f64());
    let of = |pid: u32| {
        recorded
            .samples
            .iter()
            .filter(|s| s.header.tgid == pid)
            .collect::<Vec<_>>()
    };
    let (kept, all) = (of(budgeted.pid()), of(full.pid()));
    assert!(kept.iter().all(|s| s.header.sampling_divisor == DIVISOR));
    assert!(all.iter().all(|s| s.header.sampling_divisor == 1));
    // Both spin; the budgeted one keeps 1 in 4 of its ticks, drawn at
    // random: ~250 of ~1000 at equal CPU time, so 3x..5.5x is many
    // standard deviations wide. Ticks follow the CPU time each had, which
    // a virtual machine's scheduler need not share evenly (one kernel's
    // run counted 863 against 151): the ratio is per CPU second.
    assert!(
        budgeted_cpu > 0.1 && full_cpu > 0.1,
        "{budgeted_cpu} s, {full_cpu} s of CPU"
    );
    let ratio = (all.len() as f64 / full_cpu) / (kept.len().max(1) as f64 / budgeted_cpu);
    assert!(
        (3.0..5.5).contains(&ratio),
        "{} samples unbudgeted in {full_cpu:.2} s of CPU vs {} budgeted in {budgeted_cpu:.2} s: \
         ratio {ratio:.2} per CPU second, expected about {DIVISOR}",
        all.len(),
        kept.len()
    );
}

/// An idle CPU's ticks never run the program: its events leave the idle
/// task out (`exclude_idle`), where the program used to run on each such
/// tick only to count it idle. Judged against the host's idle time in the
/// window (`/proc/stat`): a second of it is some 499 ticks that would have
/// been counted.
#[test]
fn ticks_on_an_idle_cpu_never_run_the_program() {
    require_root();
    let _serial = exclusive();
    let config = SamplerConfig {
        frequency_hz: 499,
        ..SamplerConfig::default()
    };
    let before = host_idle_secs();
    let recorded = sample_for(&config, SAMPLING);
    let idle_secs = host_idle_secs() - before;
    assert_eq!(
        recorded.counters.idle, 0,
        "ticks ran the program in the idle task ({idle_secs:.2} s of idle CPU time in the window)"
    );
    if idle_secs < 0.1 {
        eprintln!(
            "the host was busy for the whole window ({idle_secs:.2} s of idle CPU time): \
             no idle tick to leave out"
        );
    }
}

/// Seconds the host's CPUs have been idle since boot (idle and iowait, in
/// clock ticks, from the first line of `/proc/stat`).
fn host_idle_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").expect("reading /proc/stat");
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("cpu "))
        .expect("a cpu line in /proc/stat")
        .split_whitespace()
        .map(|field| field.parse().expect("a number in /proc/stat"))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let ticks_per_sec = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (fields[3] + fields[4]) as f64 / ticks_per_sec
}

#[test]
fn reports_exec_and_exit_of_processes_in_order_with_samples() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("deep_stack", &[]);
    let config = SamplerConfig {
        frequency_hz: FREQUENCY_HZ,
        ..SamplerConfig::default()
    };
    let mut child_pid = 0;
    let recorded = sample_while(&config, Duration::from_secs(1), || {
        let mut child = fixture.start(&["4"]);
        child_pid = child.pid();
        std::thread::sleep(Duration::from_millis(300));
        child.child.kill().expect("killing the fixture");
        child.child.wait().expect("reaping the fixture");
    });
    let execs: Vec<_> = recorded
        .execs
        .iter()
        .filter(|e| e.tgid == child_pid)
        .collect();
    let exits: Vec<_> = recorded
        .exits
        .iter()
        .filter(|e| e.tgid == child_pid)
        .collect();
    assert_eq!(execs.len(), 1, "exec events of the fixture: {execs:?}");
    assert_eq!(exits.len(), 1, "exit events of the fixture: {exits:?}");
    // The forked child can be sampled before it execs: it already has the
    // fixture's pid but still runs the test's image. The fixture's own code
    // (user-mode ticks with its comm) must lie between the exec and the
    // exit. Kernel-mode ticks may not: exec sets the new comm a little
    // before its tracepoint fires, and a task still runs kernel code after
    // its exit tracepoint.
    let samples: Vec<_> = recorded
        .samples
        .iter()
        .filter(|s| {
            s.header.tgid == child_pid
                && s.header.comm.starts_with(b"deep_stack\0")
                && s.header.flags & sample_flags::TICK_IN_USER != 0
        })
        .collect();
    assert!(
        !samples.is_empty(),
        "the fixture spun 300 ms without a sample"
    );
    for sample in samples {
        assert!(
            (execs[0].ktime_ns..=exits[0].ktime_ns).contains(&sample.header.ktime_ns),
            "a sample of the fixture lies outside its exec..exit"
        );
    }
}

#[test]
fn records_of_every_cpu_are_read_in_time_order() {
    require_root();
    let _serial = exclusive();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        eprintln!("skipped: one CPU, one ring");
        return;
    }
    // A busy thread per CPU (busy runs 64 at most): every ring fills
    // between drains. It runs until killed below: under an emulated
    // kernel, loading the program took longer than a 3-s run, and the
    // sampler met no thread.
    let fixture = Fixture::compile("busy", &[]);
    let threads = cpus.min(64).to_string();
    let mut busy = fixture.start(&[threads.as_str(), "60"]);
    let config = SamplerConfig {
        frequency_hz: 997,
        pids: vec![busy.pid()],
        ..SamplerConfig::default()
    };
    let recorded = sample_for(&config, Duration::from_secs(2));
    // The worker threads' samples: the start time read through their
    // group leader (while the process is there to compare with).
    assert!(
        recorded
            .samples
            .iter()
            .any(|s| s.header.tid != s.header.tgid)
    );
    assert_started_when_the_kernel_says(&recorded.samples, busy.pid());
    busy.child.kill().expect("stopping busy");
    busy.child.wait().expect("reaping busy");
    let sampled_cpus: std::collections::HashSet<u32> =
        recorded.samples.iter().map(|s| s.header.cpu).collect();
    assert!(
        sampled_cpus.len() >= 2,
        "samples from CPUs {sampled_cpus:?} only"
    );
    // The reader merges the rings by time, and reads a ring it found empty
    // again before it passes on a record written after that. What stays
    // out of order is a record whose time was taken before its ring was
    // found empty and that was committed after: within one run of the
    // program, microseconds. Read ring by ring, a timed drain (every
    // 100 ms) put records 71 ms behind.
    let mut newest = 0u64;
    let mut furthest_behind = 0;
    for &time in &recorded.read_order {
        furthest_behind = furthest_behind.max(newest.saturating_sub(time));
        newest = newest.max(time);
    }
    eprintln!(
        "{} records from {} CPUs; furthest behind the newest read before it: {} µs",
        recorded.read_order.len(),
        sampled_cpus.len(),
        furthest_behind / 1_000
    );
    assert!(
        furthest_behind < 5_000_000,
        "a record came {furthest_behind} ns behind one read before it"
    );
}

#[test]
fn a_thread_whose_address_space_is_gone_is_sampled_by_its_kernel_stack() {
    require_root();
    let _serial = exclusive();
    // Processes that fill 128 MB and exit at once: the kernel frees it
    // after they let go of their address space (`mm` is null), when no
    // user stack is left to read.
    let fixture = Fixture::compile("exit_big", &[]);
    let script = format!("while :; do {} 128; done", fixture.path.display());
    let mut shell = std::process::Command::new("sh")
        .args(["-c", &script])
        .process_group(0)
        .spawn()
        .expect("starting the shell");
    let config = SamplerConfig {
        frequency_hz: 997,
        ..SamplerConfig::default()
    };
    let recorded = sample_for(&config, Duration::from_secs(4));
    // The shell and whatever pipeline it runs.
    let killed = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", shell.id())])
        .status()
        .expect("running kill");
    assert!(killed.success(), "killing the shell's process group");
    shell.wait().expect("reaping the shell");
    let gone = recorded.counters.address_space_gone;
    eprintln!(
        "{gone} ticks of threads without an address space; {} copies read nothing",
        recorded.counters.copy_failed
    );
    assert!(
        gone > 0,
        "no tick in an exiting process: {:?}",
        recorded.counters
    );
    // They are kernel-only samples, as a kernel thread's: no user registers
    // and, as none is read, no failed copy counted for them.
    let kernel_only = recorded
        .samples
        .iter()
        .filter(|s| s.header.flags & sample_flags::USER_REGS == 0 && s.header.tgid != 0)
        .filter(|s| s.header.comm.starts_with(b"exit_big\0"))
        .count();
    assert!(kernel_only > 0, "no kernel-only sample of exit_big");
}

fn agent_binary() -> std::path::PathBuf {
    stackscope_test_fixtures::workspace_binary("stackscope-agent")
}

#[test]
fn agent_leaves_nothing_loaded_after_a_signal() {
    require_root();
    let _serial = exclusive();
    // Something to sample, so the agent exits with records in flight.
    let fixture = Fixture::compile("deep_stack", &[]);
    let _busy = fixture.start(&["16"]);
    // The agent's table cache goes to a directory removed with the test.
    let table_cache = tempfile::tempdir().expect("a temporary table cache");
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let mut agent = RunningProcess::adopt(
            Command::new(agent_binary())
                .args(["--frequency", "99", "--json", "--log-level", "warn"])
                .arg("--table-cache-dir")
                .arg(table_cache.path())
                .stdout(Stdio::piped())
                .spawn()
                .expect("starting the agent"),
        );
        let pid = agent.pid();

        // Attached means the perf links are open too: wait for a running
        // agent, not one still loading.
        let held = wait_until_loaded(&mut agent);
        assert!(!held.maps.is_empty(), "the agent holds no maps");
        // Let it sample for a moment so the exit path runs with data in flight.
        std::thread::sleep(Duration::from_secs(1));

        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
        let out = agent.wait_with_output();
        assert!(
            out.status.success(),
            "agent exited with {} after signal {signal}",
            out.status
        );
        let report: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("the agent's JSON report");
        assert!(
            report["kernel"]["samples"].as_u64().is_some_and(|n| n > 0),
            "report: {report}"
        );

        held.assert_released(&format!("after signal {signal}"));
    }
}

/// Off-CPU sampling on the real kernel (and in the kernel matrix's VMs,
/// which load the `sched_switch` program this way): every blocking of the
/// fixture's threads after it starts is written as an off-CPU sample with
/// its stacks, and ended by a switch-in record; together they measure the
/// time blocked the fixture measured itself.
#[test]
fn off_cpu_samples_and_their_switch_ins_measure_the_time_threads_blocked() {
    require_root();
    let _exclusive = exclusive();
    let fixture = OffCpuFixture::start(1.5);
    let pid = fixture.pid();
    let config = SamplerConfig {
        // Every blocking switch: the totals are exact, not estimated.
        off_cpu: Some(OffCpuConfig {
            samples_per_sec: 1_000_000,
        }),
        ..sampling_only(pid)
    };
    let recorded = sample_while(&config, Duration::from_secs(4), || fixture.go());
    let measured: u64 = fixture.measured().values().sum();

    let off_cpu: Vec<&OwnedSample> = recorded
        .samples
        .iter()
        .filter(|s| s.header.flags & sample_flags::OFF_CPU != 0)
        .collect();
    assert!(
        off_cpu.len() > 300,
        "only {} off-CPU samples in 1.5 s of blocking every few ms",
        off_cpu.len()
    );
    for sample in &off_cpu {
        let header = &sample.header;
        assert_eq!(header.tgid, pid);
        assert_eq!(header.sampling_divisor, 1);
        // Blocked in a system call: its saved user registers, and the
        // kernel stack it blocked with.
        assert_ne!(header.flags & sample_flags::USER_REGS, 0);
        assert_eq!(header.flags & sample_flags::TICK_IN_USER, 0);
        assert!(!sample.kernel_frames.is_empty(), "no kernel stack");
    }
    // A thread blocking as it exits has no memory left to copy (Linux 6.1
    // showed one in a run); anything more is a copy that failed.
    let symbols = kernel_symbols();
    let without_user_stack: Vec<Vec<Option<&str>>> = off_cpu
        .iter()
        .filter(|s| s.user_stack.is_empty())
        .map(|s| {
            s.kernel_frames
                .iter()
                .map(|&addr| kernel_symbol(&symbols, addr))
                .collect()
        })
        .collect();
    assert!(
        without_user_stack.len() * 100 <= off_cpu.len(),
        "{} of {} off-CPU samples without a user stack, blocked in: {without_user_stack:?}",
        without_user_stack.len(),
        off_cpu.len()
    );
    let switched_in: HashMap<(u32, u64), u64> = recorded
        .switch_ins
        .iter()
        .map(|s| ((s.tid, s.out_ns), s.in_ns))
        .collect();
    let blocked: Vec<u64> = off_cpu
        .iter()
        .filter_map(|s| {
            let in_ns = switched_in.get(&(s.header.tid, s.header.ktime_ns))?;
            Some(in_ns - s.header.ktime_ns)
        })
        .collect();
    // About one blocking in a thousand gets no switch-in on Linux 6.18:
    // its entry is still in the map when its thread blocks again (no
    // recursion misses; cause not found). Its time is lost, not misplaced.
    let unmatched = off_cpu.len() - blocked.len();
    assert!(
        unmatched * 100 <= off_cpu.len(),
        "{unmatched} of {} blockings never switched in",
        off_cpu.len()
    );
    let total: u64 = blocked.iter().sum();
    let ratio = total as f64 / measured as f64;
    eprintln!(
        "{} off-CPU samples, {:.3} s blocked; the fixture measured {:.3} s ({ratio:.3})",
        off_cpu.len(),
        total as f64 / 1e9,
        measured as f64 / 1e9
    );
    assert!(
        (0.9..=1.1).contains(&ratio),
        "blocked {total} ns by the switches, {measured} ns by the fixture"
    );
    let counters = recorded.counters;
    assert_eq!(counters.off_cpu_skipped, 0);
    assert_eq!(counters.off_cpu_failed, 0);
    assert!(counters.off_cpu_samples >= off_cpu.len() as u64);
    assert!(counters.switch_ins >= recorded.switch_ins.len() as u64);
    let program = recorded.off_cpu_program.expect("the off-CPU program ran");
    eprintln!(
        "off-CPU program: {} runs, {:?} per run",
        program.run_count,
        program.per_run()
    );
    assert!(program.run_count >= off_cpu.len() as u64);
}
