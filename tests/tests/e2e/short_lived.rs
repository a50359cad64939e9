//! Short-lived processes end to end (root): a driver starts a dynamically
//! linked fixture about 200 times a second, each living 2 to 20 ms, long
//! gone before anyone could read its `/proc/<pid>/maps`. The agent learns
//! each one's mappings from the kernel's mmap events as they are made, so
//! its samples are unwound to `_start` through the fixture's own chain and
//! named from its binary, on the host and inside a podman container whose
//! files do not exist on the host. Without the events (the old way) most of
//! them come out unknown, which the first test checks too, so it shows the
//! difference rather than assume it. A process that started before the
//! agent has its maps read from `/proc` instead, which must happen before
//! it exits, however soon after the agent starts that is.

use stackscope_test_fixtures::{
    Fixture,
    containers::{Container, Image},
};
use stackscope_tests::{
    Collector, RunningProcess, exclusive, require_root, run_agent_for, wait_until_loaded,
    workspace_binary,
};
use std::{
    io::Read as _,
    process::{Command, Stdio},
    time::Duration,
};

/// The fixture's own frames, outermost first, as folded stacks show them.
const CHAIN: &str = "main;work;inner;spin_for";

/// Runs the agent for 5 s at 199 Hz against `collector` as node `node`.
fn run_agent(collector: &Collector, node: &str, extra: &[&str]) -> serde_json::Value {
    let args = [&["--node-name", node][..], extra].concat();
    run_agent_for(collector, "5s", &args)
}

/// The fixture's samples on `node` (comm `short_lived`) as folded stacks:
/// all of them, those in its own code (below `main`), and of those, the
/// ones unwound to `_start` through exactly its chain.
struct Shares {
    total: u64,
    in_code: u64,
    chained: u64,
}

impl Shares {
    /// At least 99% of the samples in the fixture's code read its exact
    /// chain from `_start`, and nearly all its samples are in its code (the
    /// rest: the loader and libc starting it, the kernel running its exec).
    fn assert_unwound(&self) {
        assert!(
            self.chained * 100 >= self.in_code * 99,
            "only {} of {} samples in the fixture's code read _start;…;{CHAIN}",
            self.chained,
            self.in_code
        );
        assert!(
            self.in_code * 100 >= self.total * 80,
            "only {} of {} samples are in the fixture's code",
            self.in_code,
            self.total
        );
    }
}

fn shares(collector: &Collector, node: &str) -> Shares {
    let matchers = format!("comm=\"short_lived\",node=\"{node}\"");
    let stacks = collector.folded_stacks(&matchers);
    let weight = |keep: &dyn Fn(&str) -> bool| -> u64 {
        stacks
            .iter()
            .filter(|(stack, _)| keep(stack))
            .map(|(_, n)| n)
            .sum()
    };
    Shares {
        total: weight(&|_| true),
        // In the fixture's code: spin_for (or what it calls) is on the
        // stack, whatever the walk made of the frames below it.
        in_code: weight(&|stack| stack.contains("spin_for")),
        chained: weight(&|stack| {
            stack.starts_with("_start;") && stack.contains(&format!(";{CHAIN}"))
        }),
    }
}

#[test]
fn short_lived_processes_on_the_host_are_unwound_and_named() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("short_lived", &[]);
    let spawner = Fixture::compile("spawner", &[]);
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let program = fixture.path.to_str().expect("UTF-8 path");

    for (node, extra) in [
        ("events", &[][..]),
        ("proc-only", &["--no-mapping-events"][..]),
    ] {
        let _driver = spawner.start(&[program, "200", "7"]);
        let report = run_agent(&collector, node, extra);
        let shares = shares(&collector, node);
        eprintln!(
            "{node}: {} samples of short_lived, {} in its code, {} of them chained to _start; \
             mapping feed {}",
            shares.total, shares.in_code, shares.chained, report["mapping_feed"]
        );
        assert!(
            shares.total > 200,
            "{node}: only {} samples of the short-lived processes",
            shares.total
        );
        if node == "events" {
            shares.assert_unwound();
            // Its exe label, though most of these processes were gone
            // before anyone could read their /proc/<pid>/exe.
            let exe_matchers = format!("comm=\"short_lived\",node=\"events\",exe=\"{program}\"");
            let labelled: u64 = collector
                .folded_stacks(&exe_matchers)
                .iter()
                .map(|(_, n)| n)
                .sum();
            eprintln!(
                "{node}: {labelled} of {} samples carry exe={program}; label sets shipped \
                 before their process was described: {}",
                shares.total, report["aggregation"]["labels_undescribed"]
            );
            assert!(
                labelled * 100 >= shares.total * 95,
                "only {labelled} of {} samples carry exe={program}",
                shares.total
            );
        } else {
            assert!(
                shares.chained * 100 < shares.total * 50,
                "without mapping events {} of {} samples were still chained: \
                 the test no longer shows what the events add",
                shares.chained,
                shares.total
            );
        }
    }
    collector.stop();
}

#[test]
fn short_lived_processes_in_a_container_are_unwound_and_named() {
    require_root();
    let _serial = exclusive();
    // Static: the image has no libc. The host copies are deleted with their
    // build directories once the image is made, so the files exist only
    // inside the container.
    let image = {
        let fixture = Fixture::compile("short_lived", &["-static"]);
        let spawner = Fixture::compile("spawner", &["-static"]);
        Image::build(
            "short-lived",
            &[
                (fixture.path.as_path(), "/app/short_lived"),
                (spawner.path.as_path(), "/app/spawner"),
            ],
        )
    };
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    // 100 a second, each busy 2-20 ms: about one CPU of the two, so the
    // processes' starts are not slowed by a saturated machine (at 200 a
    // second, in a whole-suite run, 39% of their samples were in exec and
    // start-up rather than their code).
    let container = Container::run(
        &image,
        "short-lived",
        &["/app/spawner", "/app/short_lived", "100", "60"],
    );
    let report = run_agent(&collector, "container", &[]);
    let shares = shares(&collector, "container");
    eprintln!(
        "container: {} samples of short_lived, {} in its code, {} of them chained to _start; \
         process table {}",
        shares.total, shares.in_code, shares.chained, report["process_table"]
    );
    assert!(shares.total > 200, "only {} samples", shares.total);
    shares.assert_unwound();
    let ids = String::from_utf8(collector.cli(&[
        "labels",
        "container_id",
        "--since",
        "10m",
        "--match",
        "comm=\"short_lived\"",
    ]))
    .expect("UTF-8 labels");
    assert!(
        ids.lines().any(|id| id == container.id),
        "the samples are not labelled with the container: {ids:?}"
    );
    drop(container);
    collector.stop();
}

#[test]
fn a_process_older_than_the_agent_that_exits_soon_after_it_starts_is_unwound() {
    require_root();
    let _serial = exclusive();
    // Spinning before the agent starts: the mapping feed never sees it map
    // its files, so its maps are read from /proc after its first samples
    // are drained, and it must still be there then.
    let spinner = Fixture::compile("call_chain", stackscope_test_fixtures::C_FLAGS).start(&[]);
    let pid = spinner.pid().to_string();
    // 99 Hz: 200 ms of samples stay below the ring buffer's wake-up mark,
    // so only the drain timer decides when they are read.
    let mut agent = RunningProcess::adopt(
        Command::new(workspace_binary("stackscope-agent"))
            .args(["--pid", &pid, "--frequency", "99", "--duration", "3s"])
            .args(["--no-table-cache", "--json", "--log-level", "warn"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the agent"),
    );
    let mut stdout = agent.child.stdout.take().expect("piped stdout");
    let output = std::thread::spawn(move || {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).map(|_| out)
    });
    wait_until_loaded(&mut agent);
    // Gone 200 ms later: before a 500 ms drain period ends.
    std::thread::sleep(Duration::from_millis(200));
    drop(spinner);
    let status = agent.child.wait().expect("waiting for the agent");
    assert!(status.success(), "the agent exited with {status}");
    let out = output
        .join()
        .expect("the output reader")
        .expect("reading the agent's output");
    let report: serde_json::Value = serde_json::from_slice(&out).expect("the agent's JSON report");
    let unwinding = &report["unwinding"];
    let (walks, outermost) = (
        unwinding["walks"].as_u64().expect("walks"),
        unwinding["outermost"].as_u64().expect("outermost"),
    );
    eprintln!(
        "{outermost} of {walks} walks reached the root; early ends {}",
        unwinding["early_ends"]
    );
    assert!(walks >= 5, "only {walks} samples of the spinner");
    assert!(
        outermost * 100 >= walks * 90,
        "{outermost} of {walks} walks reached the root: its maps were read too late"
    );
}
