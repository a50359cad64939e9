//! HotSpot end to end (root): Debian's OpenJDK runs a known chain
//! (`Chain.main -> run -> outer -> middle -> leaf`), started before the agent and
//! with no profiling flag; the agent steps through its compiled and
//! interpreted frames by what the JVM's own tables say (no frame pointers:
//! HotSpot uses rbp as an ordinary register), names them from its method
//! metadata, and ships them to a real collector.

use std::process::Command;

use stackscope_test_fixtures::RunningProcess;
use stackscope_tests::{Collector, exclusive, require_root, run_agent_for};

const CHAIN: [&str; 5] = [
    "Chain.main",
    "Chain.run",
    "Chain.outer",
    "Chain.middle",
    "Chain.leaf",
];

/// Runs the fixture under `flags` (after warming it up for `warm_ms`),
/// profiles it, and checks the share of samples to the root and with the
/// chain named in order; `None` when no JDK is installed.
fn profile_chain(flags: &[&str], warm_ms: u32) -> Option<(f64, f64)> {
    if Command::new("javac").arg("-version").output().is_err() {
        eprintln!("skipped: no javac (install default-jdk-headless)");
        return None;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let source = format!("{}/fixtures/Chain.java", env!("CARGO_MANIFEST_DIR"));
    let status = Command::new("javac")
        .args(["-d".as_ref(), dir.path().as_os_str(), source.as_ref()])
        .status()
        .expect("javac");
    assert!(status.success());
    let java = RunningProcess::start_ready(
        Command::new("java")
            .args(flags)
            .arg("-cp")
            .arg(dir.path())
            .args(["Chain", "60000", &warm_ms.to_string()]),
    );
    let collector = Collector::start(dir.path());
    let pid = java.pid().to_string();
    let report = run_agent_for(&collector, "6s", &["--pid", &pid]);
    let stacks = collector.folded_stacks("");
    collector.stop();
    drop(java);

    let total: u64 = stacks.iter().map(|(_, n)| n).sum();
    let in_leaf: u64 = stacks
        .iter()
        .filter(|(stack, _)| stack.contains("Chain.leaf"))
        .map(|(_, n)| n)
        .sum();
    let chained: u64 = stacks
        .iter()
        .filter(|(stack, _)| stack.contains(&CHAIN.join(";")))
        .map(|(_, n)| n)
        .sum();
    let rooted = report["unwinding"]["outermost_percent"]
        .as_f64()
        .unwrap_or(0.0);
    let mut heaviest = stacks.clone();
    heaviest.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    eprintln!(
        "jvm {flags:?}: {total} samples, {rooted:.1}% to the root, {chained} of {in_leaf} in leaf with the chain named; heaviest: {:?}",
        &heaviest[..heaviest.len().min(3)]
    );
    assert!(
        in_leaf * 2 > total,
        "leaf is where the fixture's time goes: {in_leaf} of {total}"
    );
    Some((rooted, chained as f64 * 100.0 / in_leaf as f64))
}

#[test]
fn compiled_java_frames_reach_the_root_and_are_named() {
    require_root();
    let _serial = exclusive();
    // Not inlined, so each method keeps a frame of its own (C2 compiles
    // the chain within the warm-up).
    let Some((rooted, chained)) = profile_chain(
        &[
            "-XX:CompileCommand=quiet",
            "-XX:CompileCommand=dontinline,Chain::*",
        ],
        3000,
    ) else {
        return;
    };
    assert!(rooted >= 95.0, "{rooted:.1}% to the root");
    assert!(
        chained >= 90.0,
        "{chained:.1}% of leaf's samples with the chain named"
    );
}

#[test]
fn interpreted_java_frames_reach_the_root_and_are_named() {
    require_root();
    let _serial = exclusive();
    let Some((rooted, chained)) = profile_chain(&["-Xint"], 200) else {
        return;
    };
    assert!(rooted >= 95.0, "{rooted:.1}% to the root");
    assert!(
        chained >= 90.0,
        "{chained:.1}% of leaf's samples with the chain named"
    );
}
