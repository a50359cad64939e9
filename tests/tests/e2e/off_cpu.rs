//! Off-CPU profiles end to end (root): the agent with `--off-cpu` samples
//! a fixture that blocks in known chains and measures its own blocked time,
//! ships to a real collector, and the CLI reads the `off-cpu` profile back
//! in nanoseconds; a CPU-bound program that is only preempted shows
//! (almost) none.

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use stackscope_test_fixtures::{C_FLAGS, Fixture, workspace_binary};
use stackscope_tests::{
    BpfIds, Collector, OFF_CPU_LEAVES, OffCpuFixture, RunningProcess, exclusive, folded,
    require_root, wait_success,
};

/// The folded off-CPU stacks of the last 10 minutes matching `matchers`.
fn off_cpu_stacks(collector: &Collector, matchers: &str) -> Vec<(String, u64)> {
    folded(&collector.cli(&[
        "export", "--format", "folded", "--type", "off-cpu", "--since", "10m", "--match", matchers,
    ]))
}

#[test]
fn off_cpu_time_lands_on_the_chains_that_blocked_and_adds_up_to_the_time_they_measured() {
    require_root();
    let _exclusive = exclusive();
    let fixture = OffCpuFixture::start(3.0);
    // Three busy loops sharing one CPU: each is preempted by the others
    // all the time, and never waits for anything.
    let busy = Fixture::compile("busy", C_FLAGS);
    let spinners: Vec<RunningProcess> = (0..3)
        .map(|_| {
            RunningProcess::start_ready(
                Command::new("taskset")
                    .args(["-c", "0"])
                    .arg(&busy.path)
                    .env_clear(),
            )
        })
        .collect();
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());

    let mut command = Command::new(workspace_binary("stackscope-agent"));
    command
        .args(["--collector", &collector.grpc])
        .args(["--pid", &fixture.pid().to_string()])
        .args(
            spinners
                .iter()
                .flat_map(|s| ["--pid".to_string(), s.pid().to_string()]),
        )
        // Every blocking switch: the totals are exact, not estimated.
        .args(["--off-cpu", "--off-cpu-rate", "1000000"])
        .args(["--frequency", "99", "--duration", "8s", "--interval", "2s"])
        .args(["--no-table-cache", "--json"])
        .stdout(Stdio::piped());
    let mut agent = command.spawn().expect("starting the agent");
    // Sampling once all four programs are in (the switch program last).
    let started = std::time::Instant::now();
    while BpfIds::held_by(agent.id()).programs.len() < 4 {
        let exited = agent.try_wait().expect("polling the agent");
        if exited.is_some() || started.elapsed() > Duration::from_secs(120) {
            let _ = agent.kill();
            panic!("the agent did not load its programs (exit: {exited:?})");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    fixture.go();
    let measured = fixture.measured();
    let report = wait_success(agent);
    drop(spinners);
    eprintln!("agent's off-CPU figures: {}", report["off_cpu"]);

    let stacks = off_cpu_stacks(&collector, "comm=\"off_cpu\"");
    let total: u64 = stacks.iter().map(|(_, nanos)| nanos).sum();
    let measured_total: u64 = measured.values().sum();
    eprintln!(
        "off-CPU: {:.3} s in the collector, {:.3} s measured by the fixture",
        total as f64 / 1e9,
        measured_total as f64 / 1e9
    );
    assert!(
        total.abs_diff(measured_total) * 10 <= measured_total,
        "{total} ns off-CPU in the collector, {measured_total} ns measured"
    );
    // Each leaf's time on its own chain, the chains read root to leaf.
    let chains = [
        ("sleep_leaf", "work_loop;sleep_chain;sleep_leaf"),
        ("pipe_read_leaf", "work_loop;pipe_chain;pipe_read_leaf"),
        ("mutex_lock_leaf", "work_loop;mutex_chain;mutex_lock_leaf"),
        ("epoll_leaf", "work_loop;epoll_chain;epoll_leaf"),
        ("answer_wait_leaf", "answerer;answer_wait_leaf"),
        ("holder_sleep_leaf", "holder;holder_sleep_leaf"),
    ];
    let on_chain = |chain: &str| -> u64 {
        stacks
            .iter()
            .filter(|(stack, _)| stack.contains(chain))
            .map(|(_, nanos)| nanos)
            .sum()
    };
    for (leaf, chain) in chains {
        let (found, expected) = (on_chain(chain), measured[leaf]);
        eprintln!(
            "{chain}: {:.1} ms, measured {:.1} ms",
            found as f64 / 1e6,
            expected as f64 / 1e6
        );
        assert!(
            found.abs_diff(expected) * 10 <= expected,
            "{chain}: {found} ns off-CPU, {expected} ns measured"
        );
    }
    let on_leaves: u64 = stacks
        .iter()
        .filter(|(stack, _)| OFF_CPU_LEAVES.iter().any(|leaf| stack.contains(leaf)))
        .map(|(_, nanos)| nanos)
        .sum();
    assert!(
        on_leaves * 100 >= total * 95,
        "only {on_leaves} of {total} ns on the fixture's chains: {stacks:#?}"
    );

    // Preempted only: at most a hundredth of their wall time off-CPU
    // (none at all, as the collector answers here).
    let out = Command::new(workspace_binary("stackscope"))
        .args(["--collector", &collector.grpc])
        .args([
            "export", "--format", "folded", "--type", "off-cpu", "--since", "10m",
        ])
        .args(["--match", "comm=\"busy\""])
        .output()
        .expect("running stackscope");
    let preempted: u64 = if out.status.success() {
        folded(&out.stdout).iter().map(|(_, nanos)| nanos).sum()
    } else {
        let error = String::from_utf8_lossy(&out.stderr);
        assert!(error.contains("no samples match"), "{error}");
        0
    };
    assert!(
        preempted < 3 * 8_000_000_000 / 100,
        "{preempted} ns off-CPU for three busy loops that only shared a CPU"
    );
    // The CPU profile of the same run is ticks, as before: the busy loops
    // fill it.
    let cpu = folded(&collector.cli(&[
        "export",
        "--format",
        "folded",
        "--since",
        "10m",
        "--match",
        "comm=\"busy\"",
    ]));
    let ticks: u64 = cpu.iter().map(|(_, n)| n).sum();
    assert!(
        (300..=2_000).contains(&ticks),
        "{ticks} CPU samples of one CPU's busy loops at 99 Hz for about 8 s"
    );
    collector.stop();
}
