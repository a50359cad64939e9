//! Go programs end to end (root): `go_chain.go`, built at test time with
//! the installed Go toolchain, with and without `-ldflags="-s -w"` (no
//! symbol table, no DWARF: how Go services ship), and as a PIE. Its goroutines recurse a
//! known chain (worker, then alpha/beta/gamma 49 deep, then leafWork) into
//! crypto/sha256's assembly (which uses rbp as a general register) and
//! encoding/json.
//!
//! Asserts, as a user would see it: the walks reach `runtime.goexit` (the
//! root of every goroutine) through the exact chain, named from the
//! binary's own Go function table; and the frames of the stripped build
//! carry their Go names in the collector, named on the node (a Go binary
//! without a GNU build-id) or at query time from the uploaded binary
//! (with one).

use std::{collections::HashMap, process::Command, time::Duration};

use agent_common::DEFAULT_USER_STACK_BYTES;
use stackscope_gopclntab::{Table, elf::GoFunctions};
use stackscope_sampler::SamplerConfig;
use stackscope_test_fixtures::Fixture;
use stackscope_tests::{
    Collector, LiveWalk, Mapping, exclusive, read_maps, require_root, run_agent_for,
};
use stackscope_unwind::UnwindEnd;
use stackscope_unwind::walker::WalkOutcome;

/// Depth of the fixture's alpha/beta/gamma recursion (`depth` in
/// go_chain.go): 49 frames from alpha(48) down to the one at 0.
const DEPTH: usize = 48;

/// The program's frames of a complete sample, from the root in: the
/// goroutine's root, the closure the compiler wraps `go worker(s)` in, the
/// worker, the recursion, the leaf.
fn expected_chain() -> Vec<String> {
    let mut chain = vec![
        "runtime.goexit".to_owned(),
        "main.main.func1".to_owned(),
        "main.worker".to_owned(),
    ];
    for level in 0..=DEPTH {
        chain.push(["main.alpha", "main.beta", "main.gamma"][level % 3].to_owned());
    }
    chain.push("main.leafWork".to_owned());
    chain
}

/// Names every frame of `walk` from the Go binary's own function table
/// (frame 0 at its address, return addresses one byte back), through the
/// process's mappings: `?` for an address outside the binary.
fn go_names(
    walk: &LiveWalk,
    functions: &GoFunctions,
    table: &Table<'_>,
    maps: &[Mapping],
    binary: &std::path::Path,
) -> Vec<String> {
    walk.frames
        .iter()
        .enumerate()
        .map(|(i, &address)| {
            let address = if i == 0 { address } else { address - 1 };
            maps.iter()
                .find(|m| m.contains(address) && m.path.file_path() == Some(binary))
                .and_then(|m| functions.address_of_offset(address - m.start + m.offset))
                .and_then(|vaddr| table.func_at(vaddr).ok().flatten())
                .map_or_else(|| "?".to_owned(), |func| func.name.to_owned())
        })
        .collect()
}

/// Samples the fixture and checks its walks; returns the share (percent)
/// of its samples that reached the root.
fn assert_walks_reach_the_root(fixture: &Fixture, build: &str) -> f64 {
    let process = fixture.start(&["2"]);
    let pid = process.pid();
    let binary = std::fs::canonicalize(&fixture.path).expect("the fixture's path");
    let maps = read_maps(pid);
    let config = SamplerConfig {
        frequency_hz: 499,
        user_stack_bytes: DEFAULT_USER_STACK_BYTES,
        pids: vec![pid],
        ..SamplerConfig::default()
    };
    let (walks, _) = stackscope_tests::walk_live(&config, Duration::from_secs(4));
    drop(process);
    let functions = GoFunctions::read(&std::fs::File::open(&binary).unwrap())
        .expect("reading .gopclntab")
        .expect("a Go binary");
    let table = functions.table().expect("the Go table");
    let walks: Vec<&LiveWalk> = walks.iter().filter(|w| w.tgid == pid).collect();
    assert!(walks.len() > 500, "{build}: only {} samples", walks.len());

    let expected = expected_chain();
    let mut rooted = 0;
    let mut full_chain = 0;
    let mut in_sha256_asm = 0;
    let mut ends: HashMap<String, usize> = HashMap::new();
    for walk in &walks {
        let names = go_names(walk, &functions, &table, &maps, &binary);
        if walk.outcome != WalkOutcome::Ended(UnwindEnd::Outermost) {
            let count = ends
                .entry(format!("{:?} at {:?}", walk.outcome, names.last()))
                .or_default();
            if *count == 0 {
                eprintln!("{build}: {:?} {names:?} {:x?}", walk.outcome, walk.frames);
            }
            *count += 1;
            continue;
        }
        let Some(root) = names.last() else { continue };
        if root != "runtime.goexit" {
            // A thread's system stack (the scheduler, the garbage
            // collector's workers): its root is mstart (or rt0_go).
            assert!(
                root == "runtime.mstart" || root == "runtime.rt0_go",
                "{build}: a walk ended at {root}: {names:?}"
            );
            rooted += 1;
            continue;
        }
        rooted += 1;
        // From the root in, the program's frames follow the chain exactly
        // as far as the sample got into it, and only library and runtime
        // frames lie inside its last one.
        let program: Vec<&String> = names
            .iter()
            .rev()
            .take_while(|name| name.starts_with("main.") || *name == "runtime.goexit")
            .collect();
        assert!(
            program
                .iter()
                .zip(&expected)
                .all(|(got, want)| *got == want),
            "{build}: not the chain: {names:?}"
        );
        assert!(
            names[..names.len() - program.len()]
                .iter()
                .all(|name| !name.starts_with("main.")),
            "{build}: program frames inside library frames: {names:?}"
        );
        if program.len() == expected.len() {
            full_chain += 1;
        }
        if names[0] == "crypto/sha256.block" {
            in_sha256_asm += 1;
        }
    }
    let share = 100.0 * rooted as f64 / walks.len() as f64;
    eprintln!(
        "{build}: {rooted} of {} walks reached the root ({share:.2}%), {full_chain} through the \
         whole chain, {in_sha256_asm} from crypto/sha256.block; the rest ended: {ends:?}",
        walks.len()
    );
    assert!(
        rooted * 100 >= walks.len() * 99,
        "{build}: only {rooted} of {} walks reached the root; the others ended: {ends:?}",
        walks.len()
    );
    assert!(
        full_chain * 2 >= walks.len(),
        "{build}: {full_chain} whole chains"
    );
    assert!(
        in_sha256_asm > 0,
        "{build}: no sample in crypto/sha256.block"
    );
    share
}

#[test]
fn goroutine_stacks_reach_runtime_goexit_through_the_exact_chain() {
    require_root();
    let _serial = exclusive();
    let full = Fixture::go("go_chain", &[]);
    let stripped = Fixture::go("go_chain", &["-ldflags=-s -w"]);
    let pie = Fixture::go("go_chain", &["-buildmode=pie", "-ldflags=-s -w"]);
    assert_walks_reach_the_root(&full, "go build");
    assert_walks_reach_the_root(&stripped, "go build -ldflags=\"-s -w\"");
    assert_walks_reach_the_root(&pie, "go build -buildmode=pie -ldflags=\"-s -w\"");
}

/// Samples of the fixture in `collector` whose stacks read `chain`, the
/// samples with a frame of the binary left unnamed, and all samples.
fn named_shares(collector: &Collector, chain: &str) -> (u64, u64, u64, Vec<(String, u64)>) {
    let stacks = collector.folded_stacks("comm=\"go_chain\"");
    let sum = |keep: &dyn Fn(&str) -> bool| -> u64 {
        stacks
            .iter()
            .filter(|(stack, _)| keep(stack))
            .map(|(_, n)| n)
            .sum()
    };
    let chained = sum(&|stack| stack.contains(chain));
    let unnamed = sum(&|stack| stack.contains("[unknown] go_chain"));
    let total = sum(&|_| true);
    (chained, unnamed, total, stacks)
}

/// The agent ships the stripped fixture's samples to a collector with
/// `agent_args`; every frame of the binary must come back named.
fn assert_stripped_frames_named(fixture: &Fixture, agent_args: &[&str], how: &str) {
    let process = fixture.start(&["2"]);
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let pid = process.pid().to_string();
    let args = [&["--pid", pid.as_str()][..], agent_args].concat();
    run_agent_for(&collector, "5s", &args);
    drop(process);
    let chain =
        "runtime.goexit;main.main.func1;main.worker;main.alpha;main.beta;main.gamma;main.alpha";
    let (chained, unnamed, total, stacks) = named_shares(&collector, chain);
    eprintln!("{how}: {chained} of {total} samples read {chain}, {unnamed} with an unnamed frame");
    assert!(total > 300, "{how}: only {total} samples");
    assert_eq!(unnamed, 0, "{how}: frames left unnamed: {stacks:#?}");
    assert!(
        chained * 100 >= total * 95,
        "{how}: only {chained} of {total} samples read the chain: {stacks:#?}"
    );
    assert!(
        stacks.iter().any(|(stack, _)| stack.ends_with(
            "main.leafWork;crypto/sha256.Sum256;crypto/sha256.(*digest).Write;crypto/sha256.block"
        )),
        "{how}: no stack down to crypto/sha256.block: {stacks:#?}"
    );
    // leafWork's frames come with the file and line of its calls into
    // crypto/sha256 (line 66) and encoding/json (line 68), as
    // `go tool pprof -lines` reads them from the exported profile.
    let pprof = collector.cli(&[
        "export",
        "--format",
        "pprof",
        "--since",
        "10m",
        "--match",
        "comm=\"go_chain\"",
    ]);
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("profile.pb.gz");
    std::fs::write(&file, pprof).expect("writing the profile");
    let out = Command::new("go")
        .args(["tool", "pprof", "-lines", "-top", "-nodecount=1000"])
        .arg(&file)
        .env("HOME", dir.path())
        .env("GOCACHE", dir.path().join("gocache"))
        .output()
        .expect("running go tool pprof");
    let top = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<u32> = top
        .lines()
        .filter_map(|line| line.split_once(" main.leafWork ")?.1.rsplit_once(':'))
        .filter(|(file, _)| file.ends_with("go_chain.go"))
        .filter_map(|(_, line)| line.trim().parse().ok())
        .collect();
    assert!(
        lines.contains(&66) && lines.contains(&68) && lines.iter().all(|l| (65..=71).contains(l)),
        "{how}: main.leafWork's lines {lines:?} in\n{top}"
    );
    collector.stop();
}

#[test]
fn stripped_go_frames_are_named_on_the_node_and_at_query_time() {
    require_root();
    let _serial = exclusive();
    // No GNU build-id (go build's default): the agent names the frames.
    let stripped = Fixture::go("go_chain", &["-ldflags=-s -w"]);
    assert_stripped_frames_named(&stripped, &[], "named on the node");
    // A GNU build-id: frames ship as build-id + offset, the binary is
    // uploaded (its .gopclntab is what it has to name), and the collector
    // names them when queried.
    let with_build_id = Fixture::go(
        "go_chain",
        &["-ldflags=-s -w -B 0x5ca1ab1e0123456789abcdef0123456789abcdef"],
    );
    assert_stripped_frames_named(
        &with_build_id,
        &["--symbolize", "collector", "--upload-debuginfo"],
        "named by the collector",
    );
}
