//! JIT code end to end (root): Debian's `node` runs a chain of named
//! JavaScript functions; the agent walks through the JIT frames by their
//! frame pointers (and through V8's builtins, which have no CFI, the same
//! way) back into C++ with CFI, names them from what V8 writes for perf
//! (its perf map with `--perf-basic-prof`, its jitdump file with
//! `--perf-prof`), and ships them to a real collector. JavaScript that
//! calls into V8's C++ runtime is walked back out through the builtin it
//! called through.

use std::process::{Command, Stdio};

use stackscope_test_fixtures::RunningProcess;
use stackscope_tests::{Collector, exclusive, require_root, run_agent_for};

/// Removes node's perf map when the test ends, however it ends.
struct PerfMapFile(String);

impl Drop for PerfMapFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// node running the fixture `script` with `flags`, ready (it printed
/// "ready"), in a temporary directory where a collector keeps its data: with
/// perf support on, V8 writes its code log (isolate-*.log) and its jitdump
/// file there. Dropped in reverse order: the collector, the perf map, node,
/// the directory.
fn node_and_collector(
    script: &str,
    flags: &[&str],
) -> (tempfile::TempDir, RunningProcess, PerfMapFile, Collector) {
    let script = format!("{}/fixtures/{script}", env!("CARGO_MANIFEST_DIR"));
    let data = tempfile::tempdir().expect("temp dir");
    let node = RunningProcess::start_ready(
        Command::new("node")
            .args(flags)
            .arg(script)
            .current_dir(data.path())
            .stderr(Stdio::inherit()),
    );
    let perf_map = PerfMapFile(format!("/tmp/perf-{}.map", node.pid()));
    let collector = Collector::start(data.path());
    (data, node, perf_map, collector)
}

#[test]
fn walks_through_jit_frames_to_the_root_and_names_them_from_the_perf_map() {
    // `/tmp/perf-<pid>.map`, text.
    walks_and_names_jit_frames("--perf-basic-prof");
}

#[test]
fn names_jit_frames_from_a_jitdump_file() {
    // `jit-<pid>.dump` in the working directory, binary, found through the
    // process's maps.
    walks_and_names_jit_frames("--perf-prof");
}

fn walks_and_names_jit_frames(perf_flag: &str) {
    require_root();
    let _serial = exclusive();
    let (_data, node, _perf_map, collector) =
        node_and_collector("jit_chain.js", &[perf_flag, "--no-turbo-inlining"]);

    // The whole 32 KiB copied from the first tick: what is tested is the
    // walk through JIT code and its names, not how soon the adaptive copy
    // learns node's stack (issue 37's ground; the sampler and deep stack
    // tests cover it). With it, the walks of the run's first half second
    // ended truncated, 100 of 989 in one whole-suite run.
    let report = run_agent_for(
        &collector,
        "5s",
        &["--pid", &node.pid().to_string(), "--fixed-stack-copy"],
    );
    let unwinding = &report["unwinding"];
    let walks = unwinding["walks"].as_u64().expect("walks");
    let jit_walks = unwinding["jit_walks"].as_u64().expect("jit_walks");
    let jit_outermost = unwinding["jit_outermost"].as_u64().expect("jit_outermost");
    // Enough walks for the shares below to mean something, even on a
    // machine busy enough to give node a third of a CPU.
    assert!(walks > 150, "only {walks} walks in 5 s at 199 Hz");
    assert!(
        jit_walks * 100 >= walks * 80,
        "only {jit_walks} of {walks} walks went through JIT code"
    );
    assert!(
        jit_outermost * 100 >= jit_walks * 90,
        "only {jit_outermost} of {jit_walks} walks through JIT code reached the root; \
         early ends {}, by binary {}",
        unwinding["early_ends"],
        unwinding["by_binary"]
    );
    // Every walk through JIT code has JIT frames named by the JIT
    // (outer, middle, leaf: three each).
    let named = report["jit_names"]["named"].as_u64().expect("named");
    assert!(
        named >= jit_walks,
        "{named} JIT frames named by the JIT for {jit_walks} walks: {report}"
    );

    let stacks = collector.folded_stacks("comm=\"node\"");
    let total: u64 = stacks.iter().map(|(_, n)| n).sum();
    // Root first: the main thread's stacks start at _start.
    let rooted: u64 = stacks
        .iter()
        .filter(|(stack, _)| stack.starts_with("_start;"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        rooted * 100 >= total * 90,
        "only {rooted} of {total} samples reach _start: {stacks:#?}"
    );
    // The chain is outer, middle, leaf, one frame each, in that order.
    let is = |frame: &str, function: &str| {
        // `JS:*leaf /path/jit_chain.js:9:14` in node 20 (`LazyCompile:*leaf
        // /path/jit_chain.js:9` in older V8): the tier mark, the function,
        // its script.
        frame.split_once(':').is_some_and(|(_, rest)| {
            rest.trim_start_matches(['*', '^', '~', '+'])
                .starts_with(&format!("{function} "))
        }) && frame.contains("jit_chain.js")
    };
    let chained: u64 = stacks
        .iter()
        .filter(|(stack, _)| {
            let frames: Vec<&str> = stack.split(';').collect();
            frames
                .windows(3)
                .any(|w| is(w[0], "outer") && is(w[1], "middle") && is(w[2], "leaf"))
        })
        .map(|(_, n)| n)
        .sum();
    assert!(
        chained * 100 >= total * 90,
        "only {chained} of {total} samples read outer;middle;leaf: {stacks:#?}"
    );
    collector.stop();
}

#[test]
fn walks_out_of_the_cpp_runtime_through_v8s_builtins_to_the_root() {
    // Samples in C++ called from JavaScript: the walk returns into
    // `Builtins_CEntry_*` by CFI (not by a frame pointer, as from JIT
    // code), and steps out of it by rbp, which V8 keeps wherever its
    // builtins call out. Without that, every such walk stopped there.
    require_root();
    let _serial = exclusive();
    let (_data, node, _perf_map, collector) =
        node_and_collector("json_runtime.js", &["--perf-basic-prof"]);
    let report = run_agent_for(&collector, "5s", &["--pid", &node.pid().to_string()]);
    let unwinding = &report["unwinding"];
    let walks = unwinding["walks"].as_u64().expect("walks");
    let outermost = unwinding["outermost"].as_u64().expect("outermost");
    // Enough walks for the shares below to mean something, even on a
    // machine busy enough to give node a third of a CPU.
    assert!(walks > 150, "only {walks} walks in 5 s at 199 Hz");
    assert!(
        outermost * 100 >= walks * 95,
        "only {outermost} of {walks} walks reached the root: {unwinding}"
    );

    let stacks = collector.folded_stacks("comm=\"node\"");
    let total: u64 = stacks.iter().map(|(_, n)| n).sum();
    // From _start, through the named JavaScript function and the builtin
    // into the C++ JSON code, in that order.
    let through_the_runtime: u64 = stacks
        .iter()
        .filter(|(stack, _)| {
            let frames: Vec<&str> = stack.split(';').collect();
            frames.first() == Some(&"_start")
                && frames.windows(3).any(|w| {
                    w[0].contains("roundTrip")
                        && w[0].contains("json_runtime.js")
                        && w[1].starts_with("Builtins_CEntry")
                        && w[2].starts_with("v8::internal::Builtin_Json")
                })
        })
        .map(|(_, n)| n)
        .sum();
    assert!(
        through_the_runtime * 100 >= total * 50,
        "only {through_the_runtime} of {total} samples read \
         _start;...;roundTrip;Builtins_CEntry_*;v8::internal::Builtin_Json*: {stacks:#?}"
    );
    collector.stop();
}
