//! The whole product end to end (root): the agent samples a fixture built
//! without frame pointers, ships to a real collector over gRPC on 127.0.0.1,
//! and the `stackscope` CLI reads the stacks back from the collector's
//! SQLite database, as folded stacks and as pprof for `go tool pprof`.

use std::process::{Command, Stdio};

use stackscope_test_fixtures::{C_FLAGS, Fixture, workspace_binary};
use stackscope_tests::{Collector, exclusive, folded, wait_success};

#[test]
fn agent_to_collector_to_cli_keeps_every_sample_and_the_call_chain() {
    let _exclusive = exclusive();
    let fixture = Fixture::compile("call_chain", C_FLAGS);
    let spinner = fixture.start(&[]);
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());

    let agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc])
        .args(["--pid", &spinner.pid().to_string()])
        .args(["--frequency", "199", "--duration", "5s", "--interval", "2s"])
        .args(["--no-table-cache", "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    let report = wait_success(agent);
    let sampled = report["top"]
        .as_array()
        .expect("top processes")
        .iter()
        .find(|p| p["tgid"] == spinner.pid())
        .and_then(|p| p["samples"].as_u64())
        .expect("the fixture was sampled");
    assert!(sampled > 300, "only {sampled} samples in 5 s at 199 Hz");

    let selection = ["--since", "10m", "--match", "comm=\"call_chain\""];
    let stacks =
        folded(&collector.cli(&[&["export", "--format", "folded"], &selection[..]].concat()));
    let total: u64 = stacks.iter().map(|(_, n)| n).sum();
    // Every sample the agent took arrived: the shutdown flushed the last
    // interval and nothing was dropped on the way.
    assert_eq!(
        total, sampled,
        "samples in the collector vs. taken by the agent"
    );
    let chained: u64 = stacks
        .iter()
        .filter(|(stack, _)| stack.contains("main;a;b;c"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        chained * 100 >= total * 80,
        "only {chained} of {total} samples read main;a;b;c: {stacks:#?}"
    );

    // pprof as `go tool pprof` reads it: c is where the time goes.
    let pprof = collector.cli(&[&["export", "--format", "pprof"], &selection[..]].concat());
    let file = data.path().join("profile.pb.gz");
    std::fs::write(&file, pprof).expect("writing the profile");
    let out = Command::new("go")
        .args(["tool", "pprof", "-top"])
        .arg(&file)
        .env("HOME", data.path())
        .env("GOCACHE", data.path().join("gocache"))
        .output()
        .expect("`go` is missing: run `cargo xtask setup` (installs golang-go)");
    let top = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = top
        .lines()
        .skip_while(|line| !line.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default();
    assert!(
        first.trim_end().ends_with(" c"),
        "pprof's top function is not c:\n{top}"
    );

    // The CLI's other views of the same samples.
    let comms = String::from_utf8(collector.cli(&["labels", "comm", "--since", "10m"])).unwrap();
    assert!(
        comms.lines().any(|c| c == "call_chain"),
        "comm values: {comms}"
    );
    let top =
        String::from_utf8(collector.cli(&[&["top", "-n", "3"], &selection[..]].concat())).unwrap();
    let leader = top.lines().nth(1).unwrap_or_default();
    assert!(leader.contains("  c  "), "c leads `stackscope top`:\n{top}");
    let callers =
        String::from_utf8(collector.cli(&[&["callers", "b"], &selection[..]].concat())).unwrap();
    let sections: Vec<&str> = callers.split("CALLEES").collect();
    assert!(
        sections.len() == 2 && sections[0].contains("  a\n") && sections[1].contains("  c\n"),
        "b is called by a and calls c:\n{callers}"
    );
    for (command, file) in [("flamegraph", "flame.svg"), ("diff", "diff.svg")] {
        let path = data.path().join(file);
        let path_arg = path.to_str().expect("UTF-8 temp path");
        collector.cli(&[&[command, "-o", path_arg], &selection[..]].concat());
        let svg = std::fs::read_to_string(&path).expect("the SVG");
        assert!(
            svg.contains("<svg") && svg.contains("<title>c ("),
            "{command}: no frame for c in {svg:.300}"
        );
    }

    // The data survives a collector restart.
    collector.stop();
    let collector = Collector::start(data.path());
    let again =
        folded(&collector.cli(&[&["export", "--format", "folded"], &selection[..]].concat()));
    assert_eq!(again, stacks, "stacks after a collector restart");
    collector.stop();
}
