//! End to end: the BPF sampler on the real kernel against fixture processes.
//! Needs root.

use std::{
    collections::BTreeSet,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use agent_common::sample_flags;
use stackscope_agent::sampler::SamplerConfig;
use stackscope_tests::{
    Fixture, Mapping, RunningProcess, exclusive, find_word, read_maps, require_root, sample_for,
};

const CANARY: u64 = 0x05CA_1AB1_E0DD_BA11;
const FREQUENCY_HZ: u64 = 99;
const SAMPLING: Duration = Duration::from_secs(2);

fn mapping<'a>(maps: &'a [Mapping], what: impl Fn(&Mapping) -> bool, name: &str) -> &'a Mapping {
    maps.iter()
        .find(|m| what(m))
        .unwrap_or_else(|| panic!("no {name} mapping in {maps:#?}"))
}

#[test]
fn copies_the_stack_of_a_deep_recursion_with_every_frames_canary() {
    require_root();
    let _serial = exclusive();
    const DEPTH: u64 = 64;
    let fixture = Fixture::compile("deep_stack");
    let process = fixture.start(&[&DEPTH.to_string()]);
    let maps = read_maps(process.pid());
    let exe = fixture.path.to_str().unwrap();
    let text = mapping(
        &maps,
        |m| m.path == exe && m.perms.contains('x'),
        "fixture text",
    );
    let stack = mapping(&maps, |m| m.path == "[stack]", "stack");

    let config = SamplerConfig {
        frequency_hz: FREQUENCY_HZ,
        pids: vec![process.pid()],
        ..SamplerConfig::default()
    };
    let samples: Vec<_> = sample_for(&config, SAMPLING)
        .into_iter()
        .map(|s| s.expect("every record decodes"))
        .collect();

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
    let fixture = Fixture::compile("deep_stack");
    let process = fixture.start(&["0"]);
    let maps = read_maps(process.pid());
    let stack = mapping(&maps, |m| m.path == "[stack]", "stack");
    assert!(
        !maps.iter().any(|m| m.start == stack.end),
        "a mapping starts right at the stack's end; the fault that ends the copy would not happen: {maps:#?}"
    );

    let limit = agent_common::MAX_USER_STACK_BYTES;
    let config = SamplerConfig {
        frequency_hz: FREQUENCY_HZ,
        user_stack_bytes: limit,
        pids: vec![process.pid()],
        ..SamplerConfig::default()
    };
    let samples: Vec<_> = sample_for(&config, SAMPLING)
        .into_iter()
        .map(|s| s.expect("every record decodes"))
        .collect();
    assert!(!samples.is_empty(), "no samples of the fixture");
    for sample in &samples {
        let h = &sample.header;
        let remaining = stack.end - h.user_rsp;
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

/// BPF objects a process holds open, read from `/proc/<pid>/fdinfo`:
/// (program ids, map ids). Debian's bpftool cannot name a program's owner.
fn bpf_ids_held_by(pid: u32) -> (BTreeSet<u64>, BTreeSet<u64>) {
    let mut programs = BTreeSet::new();
    let mut maps = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return (programs, maps);
    };
    for entry in entries.flatten() {
        let info = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in info.lines() {
            let id = |prefix| {
                line.strip_prefix(prefix)
                    .and_then(|v: &str| v.trim().parse::<u64>().ok())
            };
            if let Some(id) = id("prog_id:") {
                programs.insert(id);
            } else if let Some(id) = id("map_id:") {
                maps.insert(id);
            }
        }
    }
    (programs, maps)
}

/// Ids of every loaded BPF object of `kind` (`prog` or `map`), per bpftool.
fn ids_loaded(kind: &str) -> BTreeSet<u64> {
    let out = Command::new("bpftool")
        .args(["--json", kind, "show"])
        .output()
        .expect("running bpftool");
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    list.as_array()
        .expect("a list")
        .iter()
        .filter_map(|entry| entry["id"].as_u64())
        .collect()
}

fn agent_binary() -> std::path::PathBuf {
    // `cargo xtask test` builds the agent before the tests; the test binary
    // lives in target/<profile>/deps, the agent in target/<profile>.
    let exe = std::env::current_exe().expect("test binary path");
    let agent = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .join("stackscope-agent");
    assert!(
        agent.exists(),
        "{} is missing: run `cargo build -p stackscope-agent` (cargo xtask test does)",
        agent.display()
    );
    agent
}

#[test]
fn agent_leaves_nothing_loaded_after_a_signal() {
    require_root();
    let _serial = exclusive();
    // Something to sample, so the agent exits with records in flight.
    let fixture = Fixture::compile("deep_stack");
    let _busy = fixture.start(&["16"]);
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let mut agent = RunningProcess::adopt(
            Command::new(agent_binary())
                .args(["--frequency", "99", "--json", "--log-level", "warn"])
                .stdout(Stdio::piped())
                .spawn()
                .expect("starting the agent"),
        );
        let pid = agent.pid();

        let started = Instant::now();
        let (programs, maps) = loop {
            let (programs, maps) = bpf_ids_held_by(pid);
            // Attached means the perf links are open too: wait for the
            // status of a running agent, not one still loading.
            if !programs.is_empty() && ids_loaded("prog").is_superset(&programs) {
                break (programs, maps);
            }
            if let Some(status) = agent.child.try_wait().expect("polling the agent") {
                panic!("the agent exited with {status} before loading its program");
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the agent never loaded its program"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(!maps.is_empty(), "the agent holds no maps");
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

        // Closing the last descriptor unloads at once; the maps a program
        // referenced are released after an RCU grace period, so give the
        // kernel a moment before calling anything a leak.
        let released = Instant::now();
        loop {
            let (programs_now, maps_now) = (ids_loaded("prog"), ids_loaded("map"));
            if programs.is_disjoint(&programs_now) && maps.is_disjoint(&maps_now) {
                break;
            }
            assert!(
                released.elapsed() < Duration::from_secs(10),
                "after signal {signal}, still loaded: programs {:?}, maps {:?}",
                programs.intersection(&programs_now).collect::<Vec<_>>(),
                maps.intersection(&maps_now).collect::<Vec<_>>(),
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
