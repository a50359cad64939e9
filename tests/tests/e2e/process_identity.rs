//! End to end: a pid reused by another process never inherits the state
//! kept for the first one, even when the first one's exit record is lost.
//! Each sample carries its process's start time (read by the BPF program
//! through the task layout found in the kernel's BTF); the walker drops a
//! pid's modules, tables' placement and stack plans when a later process
//! shows up under it. And a ring buffer that fills up (losing exec and exit
//! records) is reported before the next drain, which is when the agent
//! drops every process's state. Needs root.

use std::{
    path::Path,
    sync::mpsc,
    time::{Duration, Instant},
};

use stackscope_sampler::SamplerConfig;
use stackscope_tests::{
    Fixture, FrameNames, LiveOptions, RunningProcess, exclusive, require_root, walk_live_with,
};
use stackscope_unwind::UnwindEnd;
use stackscope_unwind::walker::WalkOutcome;

/// Starts `fixture` under `pid`, by setting the kernel's last handed-out
/// pid just below it; retries while other processes take it first.
fn start_under_pid(fixture: &Fixture, pid: u32) -> RunningProcess {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("writing ns_last_pid");
        let process = fixture.start_without_aslr(&[]);
        if process.pid() == pid {
            return process;
        }
        assert!(Instant::now() < deadline, "pid {pid} could not be reused");
    }
}

#[test]
fn a_reused_pid_gets_none_of_the_old_processs_frames_even_without_exit_records() {
    require_root();
    let old = Fixture::compile("call_chain", &[]);
    let new = Fixture::compile("other_chain", &[]);
    let _serial = exclusive();
    let first = old.start_without_aslr(&[]);
    let pid = first.pid();
    let config = SamplerConfig {
        frequency_hz: 199,
        ..SamplerConfig::default()
    };
    // Two seconds of the first process once sampling runs (loading the
    // program takes longer on a loaded host), then the second under its pid.
    let (sampling, sampling_started) = mpsc::channel();
    let (started, second) = mpsc::channel();
    let swap = std::thread::spawn(move || {
        sampling_started.recv().expect("sampling started");
        std::thread::sleep(Duration::from_secs(2));
        drop(first);
        started
            .send(start_under_pid(&new, pid))
            .expect("sending the process");
    });
    let (walks, _) = walk_live_with(
        &config,
        Duration::from_secs(5),
        LiveOptions {
            withhold_process_events: true,
        },
        move || sampling.send(()).expect("telling the swapping thread"),
    );
    swap.join().expect("the swapping thread");
    let second = second.recv().expect("the second process");

    let of_pid: Vec<_> = walks.iter().filter(|w| w.tgid == pid).collect();
    let first_start = of_pid.first().expect("samples of the pid").process_start_ns;
    assert_ne!(first_start, 0, "samples carry their process's start time");
    let (before, after): (Vec<_>, Vec<_>) = of_pid
        .into_iter()
        .partition(|w| w.process_start_ns == first_start);
    assert!(
        before.len() >= 100,
        "{} walks of the first process",
        before.len()
    );
    assert!(
        after.len() >= 100,
        "{} walks of the second process",
        after.len()
    );

    // No frame of the second process is placed in the first one's binary,
    // and its walks name its own chain.
    let old_binary = Path::new("call_chain");
    let mut names = FrameNames::new(second.pid());
    let mut complete = 0;
    for walk in &after {
        for file in walk.files.iter().flatten() {
            assert!(
                !file.ends_with(old_binary),
                "a frame placed in {}",
                file.display()
            );
        }
        let named = names.names(&walk.frames);
        assert!(
            !named.iter().any(|n| ["a", "b", "c"].contains(&n.as_str())),
            "a frame of the old process: {named:?}"
        );
        if walk.outcome == WalkOutcome::Ended(UnwindEnd::Outermost)
            && named.starts_with(&["inner", "middle", "outer", "main"].map(String::from))
        {
            complete += 1;
        }
    }
    assert!(
        complete * 10 >= after.len() * 8,
        "{complete} of {} walks of the second process name its chain",
        after.len()
    );
}

#[test]
fn records_lost_to_a_full_ring_buffer_are_reported_before_the_next_drain() {
    require_root();
    let spinner = Fixture::compile("call_chain", &[]);
    let _serial = exclusive();
    // Each CPU writes to its own ring: on a host with more CPUs than
    // spinners, the short processes would run and exit on an idle CPU
    // whose ring has room. On one CPU, the spinners, the processes (which
    // inherit the mask) and their exits share one ring.
    let _pinned = PinnedToOneCpu::new();
    let busy = [spinner.start(&[]), spinner.start(&[])];
    let config = SamplerConfig {
        frequency_hz: 997,
        user_stack_bytes: agent_common::MAX_USER_STACK_BYTES,
        pids: Vec::new(),
        ..SamplerConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let mut sampler = stackscope_sampler::Sampler::start(&config).expect("the sampler");
        assert_eq!(sampler.take_new_losses(), 0);
        // Nobody reads for a while: two spinners at 997 Hz fill their
        // CPU's ring within a second or two (how soon depends on the ring's size
        // and on what else the host runs), and the exits of these short
        // processes started after that are among what is lost. Half a
        // second more once it is full, so the losses outnumber what comes
        // while the ring is drained.
        let deadline = Instant::now() + Duration::from_secs(20);
        let (mut started, mut lost, mut full_since) = (0, 0, None);
        while Instant::now() < deadline
            && full_since.is_none_or(|since: Instant| since.elapsed() < Duration::from_millis(500))
        {
            std::process::Command::new("true")
                .status()
                .expect("running true");
            started += 1;
            lost += sampler.take_new_losses();
            if lost > 0 && full_since.is_none() {
                full_since = Some(Instant::now());
            }
        }
        assert!(
            lost > 0,
            "nothing was lost in 20 s without reading ({started} processes)"
        );
        // Reported once: the next check counts only new losses.
        let mut exits = 0;
        sampler.drain_records(|bytes| {
            if let Ok(stackscope_sampler::record::Record::Exit(_)) =
                stackscope_sampler::record::Record::decode(bytes)
            {
                exits += 1;
            }
        });
        assert!(
            exits < started,
            "{exits} of {started} exits arrived despite the full ring"
        );
        let again = sampler.take_new_losses();
        assert!(
            again < lost,
            "losses are reported once ({lost}, then {again})"
        );
    });
    drop(busy);
}

/// Keeps the calling thread, and the processes it starts meanwhile, on the
/// first CPU it may run on; gives it back its CPUs when dropped.
struct PinnedToOneCpu(libc::cpu_set_t);

impl PinnedToOneCpu {
    fn new() -> Self {
        // SAFETY: an all-zero cpu_set_t is an empty set; the calls get
        // valid pointers and the set's size.
        unsafe {
            let mut allowed: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            assert_eq!(libc::sched_getaffinity(0, size, &mut allowed), 0);
            let cpu = (0..libc::CPU_SETSIZE as usize)
                .find(|&cpu| libc::CPU_ISSET(cpu, &allowed))
                .expect("a CPU to run on");
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            assert_eq!(libc::sched_setaffinity(0, size, &one), 0);
            Self(allowed)
        }
    }
}

impl Drop for PinnedToOneCpu {
    fn drop(&mut self) {
        // SAFETY: the set read in `new`, with its size.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0) };
    }
}
