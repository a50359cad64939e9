//! HotSpot end to end (root): every JDK under /usr/lib/jvm (Debian's
//! OpenJDK 17 at least; Temurin 25 where present) runs a known chain
//! (`Chain.main -> run -> outer -> middle -> leaf`), started before the agent and
//! with no profiling flag; the agent steps through its compiled and
//! interpreted frames by what the JVM's own tables say (no frame pointers:
//! HotSpot uses rbp as an ordinary register), names them from its method
//! metadata, and ships them to a real collector.

use std::{path::Path, process::Command};

use stackscope_test_fixtures::{RunningProcess, jdk_homes};
use stackscope_tests::{Collector, exclusive, require_root, run_agent_for};

/// The test JVMs are killed (SIGKILL) when done, which would leave their
/// `/tmp/hsperfdata_<user>/<pid>` behind; the agent does not read it.
const NO_PERF_DATA: &str = "-XX:-UsePerfData";

const CHAIN: [&str; 5] = [
    "Chain.main",
    "Chain.run",
    "Chain.outer",
    "Chain.middle",
    "Chain.leaf",
];

/// The fixtures compiled once for every JDK (class files of release 17).
fn compiled_fixtures() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let fixtures = format!("{}/fixtures", env!("CARGO_MANIFEST_DIR"));
    // javac's own JVM would leave /tmp/hsperfdata_<user> behind.
    let status = Command::new("javac")
        .arg(format!("-J{NO_PERF_DATA}"))
        .args(["--release", "17", "-d"])
        .arg(dir.path())
        .arg(format!("{fixtures}/Chain.java"))
        .arg(format!("{fixtures}/Churn.java"))
        .status()
        .expect("javac (openjdk-17-jdk-headless)");
    assert!(status.success());
    dir
}

/// Runs `class` with `args` on the JDK at `home` under `flags` (once it
/// printed "ready"), profiles it for 6 s, and returns its folded stacks and
/// the agent's share of walks to the root.
fn profile(
    home: &Path,
    classes: &Path,
    flags: &[&str],
    class: &str,
    args: &[&str],
) -> (Vec<(String, u64)>, f64) {
    let java = RunningProcess::start_ready(
        Command::new(home.join("bin/java"))
            .arg(NO_PERF_DATA)
            .args(flags)
            .arg("-cp")
            .arg(classes)
            .arg(class)
            .args(args),
    );
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let pid = java.pid().to_string();
    let report = run_agent_for(&collector, "6s", &["--pid", &pid]);
    let stacks = collector.folded_stacks("");
    collector.stop();
    drop(java);
    let rooted = report["unwinding"]["outermost_percent"]
        .as_f64()
        .unwrap_or(0.0);
    let mut unrooted: Vec<&(String, u64)> = stacks
        .iter()
        .filter(|(stack, _)| !stack.starts_with("clone3;start_thread"))
        .collect();
    unrooted.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    eprintln!(
        "jvm {} {flags:?} {class}: reads {}, walks ended early {}; the heaviest stacks not from a thread's start: {:?}",
        home.display(),
        report["jvm"],
        report["unwinding"]["early_ends"],
        &unrooted[..unrooted.len().min(5)]
    );
    (stacks, rooted)
}

/// The samples in `Chain.leaf`, and those of them with the whole chain
/// named in order.
fn leaf_samples(stacks: &[(String, u64)]) -> (u64, u64) {
    let count = |frames: &str| -> u64 {
        stacks
            .iter()
            .filter(|(stack, _)| stack.contains(frames))
            .map(|(_, n)| n)
            .sum()
    };
    (count("Chain.leaf"), count(&CHAIN.join(";")))
}

/// Profiles the chain on the JDK at `home` under `flags` (after warming it
/// up for `warm_ms`) and returns the share of samples to the root and the
/// share of leaf's samples with the chain named in order.
fn profile_chain(home: &Path, classes: &Path, flags: &[&str], warm_ms: u32) -> (f64, f64) {
    let (stacks, rooted) = profile(
        home,
        classes,
        flags,
        "Chain",
        &["60000", &warm_ms.to_string()],
    );
    let total: u64 = stacks.iter().map(|(_, n)| n).sum();
    let (in_leaf, chained) = leaf_samples(&stacks);
    let mut heaviest = stacks.clone();
    heaviest.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    eprintln!(
        "jvm {} {flags:?}: {total} samples, {rooted:.1}% to the root, {chained} of {in_leaf} in leaf with the chain named; heaviest: {:?}",
        home.display(),
        &heaviest[..heaviest.len().min(3)]
    );
    assert!(
        in_leaf * 2 > total,
        "leaf is where the fixture's time goes: {in_leaf} of {total}"
    );
    (rooted, chained as f64 * 100.0 / in_leaf as f64)
}

/// Profiles the chain on every JDK and checks the shares.
fn chain_on_every_jdk(flags: &[&str], warm_ms: u32, jdk: impl Fn(&Path) -> bool) {
    let classes = compiled_fixtures();
    for home in jdk_homes().into_iter().filter(|home| jdk(home)) {
        let (rooted, chained) = profile_chain(&home, classes.path(), flags, warm_ms);
        assert!(
            rooted >= 95.0,
            "{}: {rooted:.1}% to the root",
            home.display()
        );
        assert!(
            chained >= 90.0,
            "{}: {chained:.1}% of leaf's samples with the chain named",
            home.display()
        );
    }
}

#[test]
fn compiled_java_frames_reach_the_root_and_are_named() {
    require_root();
    let _serial = exclusive();
    // Not inlined, so each method keeps a frame of its own; C2 (the
    // default tiers) and C1 alone compile the chain within the warm-up,
    // with prologues of their own (C2: sub rsp and an rbp store; C1: push
    // rbp and sub rsp).
    for tiers in ["-XX:TieredStopAtLevel=4", "-XX:TieredStopAtLevel=1"] {
        let flags = [
            "-XX:CompileCommand=quiet",
            "-XX:CompileCommand=dontinline,Chain::*",
            tiers,
        ];
        chain_on_every_jdk(&flags, 3000, |_| true);
    }
}

#[test]
fn interpreted_java_frames_reach_the_root_and_are_named() {
    require_root();
    let _serial = exclusive();
    chain_on_every_jdk(&["-Xint"], 200, |_| true);
}

#[test]
fn methods_inlined_into_a_compiled_one_are_named_in_order() {
    require_root();
    let _serial = exclusive();
    // As services run: C2 inlines leaf and middle into outer (and outer
    // into run). The scopes reader knows JDK 9-19's.
    chain_on_every_jdk(&[], 3000, |home| {
        major_version(home).is_some_and(|major| major <= 19)
    });
}

/// The JDK's major version, from its `release` file.
fn major_version(home: &Path) -> Option<u32> {
    let release = std::fs::read_to_string(home.join("release")).ok()?;
    let version = release
        .lines()
        .find_map(|line| line.strip_prefix("JAVA_VERSION="))?
        .trim_matches('"');
    version.split('.').next()?.parse().ok()
}

/// Who may call whom among the churn fixture's methods.
const CHURN_CALLS: [(&str, &str); 7] = [
    ("Churn.main", "Churn.phase"),
    ("Churn.main", "Churn.loadAndDrop"),
    ("Churn.phase", "Churn.work"),
    ("Churn.work", "Churn$Square.area"),
    ("Churn.work", "Churn$Circle.area"),
    ("Churn.work", "Churn$Strip.area"),
    ("Churn.loadAndDrop", "Churn$Strip.area"),
];

/// Whether `callee` runs below `caller` in some chain of the fixture's
/// calls (a frame between may be missing: a method whose class was
/// unloaded before it was named, a walk that left one out; never one out of
/// order).
fn reaches(caller: &str, callee: &str) -> bool {
    CHURN_CALLS
        .iter()
        .any(|&(from, to)| from == caller && (to == callee || reaches(to, callee)))
}

#[test]
fn deoptimized_and_unloaded_code_never_yields_a_wrong_frame() {
    require_root();
    let _serial = exclusive();
    let classes = compiled_fixtures();
    for home in jdk_homes() {
        let (stacks, rooted) = profile(&home, classes.path(), &[], "Churn", &["60000"]);
        let mut samples = 0;
        let mut with_fixture = 0;
        for (stack, n) in &stacks {
            samples += n;
            // The fixture's own frames, in order: each runs below the one
            // before in a chain of the fixture's calls (frames of the JDK
            // may sit between, as reflection does).
            let own: Vec<&str> = stack
                .split(';')
                .filter(|frame| frame.starts_with("Churn"))
                .collect();
            if own.is_empty() {
                continue;
            }
            with_fixture += n;
            for pair in own.windows(2) {
                assert!(
                    reaches(pair[0], pair[1]),
                    "{}: {} below {} is in no chain of the fixture's calls: {stack}",
                    home.display(),
                    pair[0],
                    pair[1]
                );
            }
            if stack.starts_with("clone3;start_thread") {
                assert_eq!(
                    own[0],
                    "Churn.main",
                    "{}: a rooted stack starting elsewhere: {stack}",
                    home.display()
                );
            }
        }
        let mut heaviest = stacks.clone();
        heaviest.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        eprintln!(
            "jvm {} churn: {samples} samples, {with_fixture} in the fixture's methods, {rooted:.1}% to the root; heaviest {:?}",
            home.display(),
            &heaviest[..heaviest.len().min(8)]
        );
        assert!(
            with_fixture * 2 > samples,
            "{with_fixture} of {samples} samples in the fixture"
        );
        assert!(
            rooted >= 90.0,
            "{}: {rooted:.1}% to the root",
            home.display()
        );
    }
}

#[test]
fn a_jvm_started_after_the_agent_is_read_once_it_is_up() {
    require_root();
    let _serial = exclusive();
    let classes = compiled_fixtures();
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    // The JVM starts while the agent runs: libjvm.so is mapped before its
    // code cache exists, so the first reads fail and are tried again.
    let starter = std::thread::spawn({
        let classes = classes.path().to_owned();
        move || {
            std::thread::sleep(std::time::Duration::from_millis(1500));
            RunningProcess::start_ready(
                Command::new("java")
                    .args([
                        NO_PERF_DATA,
                        "-XX:CompileCommand=quiet",
                        "-XX:CompileCommand=dontinline,Chain::*",
                        "-cp",
                    ])
                    .arg(classes)
                    .args(["Chain", "60000", "0"]),
            )
        }
    });
    let report = run_agent_for(&collector, "8s", &["--label-pid"]);
    let java = starter.join().expect("the JVM started");
    let stacks = collector.folded_stacks(&format!("pid=\"{}\"", java.pid()));
    collector.stop();
    drop(java);
    let (in_leaf, chained) = leaf_samples(&stacks);
    eprintln!(
        "jvm started after the agent: {chained} of {in_leaf} leaf samples with the chain named; reads {}",
        report["jvm"]
    );
    assert!(
        report["jvm"]["processes"].as_u64() >= Some(1),
        "{}",
        report["jvm"]
    );
    assert!(in_leaf >= 200, "{in_leaf} leaf samples");
    assert!(chained * 10 >= in_leaf * 9, "{chained} of {in_leaf}");
}
