//! End to end: samples from the BPF sampler unwound with the agent's stack
//! walker, for programs built without frame pointers: a plain call chain,
//! deep recursion (to the walker's depth limit and past it), shared libraries
//! loaded with `dlopen` and linked through the PLT, a signal handler, a
//! second thread, a static-pie, C++ templates with exceptions, and Rust. Every test names the
//! frames of every sample from the symbols of the file each frame is in and
//! asserts the exact chain, and how the walk ended. Needs root.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use stackscope_process_table::ProcessTable;
use stackscope_sampler::SamplerConfig;
use stackscope_tests::{Fixture, FrameNames, exclusive, require_root, sample_for};
use stackscope_unwind::walker::{ProcessState, StackWalker, WalkOutcome, WalkerConfig};
use stackscope_unwind::{DEFAULT_MAX_DEPTH, UnwindEnd};

/// The depth limit of the depth-limit test: low enough that a copy holds
/// a stack deeper than it.
const SMALL_DEPTH_LIMIT: usize = 256;

/// Placeholder for frames in libc that no symbol covers: Debian's libc has
/// no `.symtab`, so its static functions (`__libc_start_call_main`,
/// `__restore_rt`) are named by file.
const LIBC: &str = "libc.so.6";

/// The frames above a dynamically linked C program's `main`:
/// `__libc_start_call_main` (static, named by file), `__libc_start_main`
/// (in libc's `.dynsym`), then the program's `_start`.
const ABOVE_MAIN: [&str; 4] = ["main", LIBC, "__libc_start_main", "_start"];

const OUTERMOST: WalkOutcome = WalkOutcome::Ended(UnwindEnd::Outermost);

/// Samples a spinning fixture long enough to get well over this many.
const MIN_SAMPLES: usize = 50;

/// One sample's walk, its frames named.
#[derive(Debug)]
struct NamedWalk {
    pid: u32,
    names: Vec<String>,
    outcome: WalkOutcome,
}

/// Samples `pids` (spinning fixtures) at 99 Hz for 2 s, copying
/// `stack_bytes` of stack per sample, and walks every sample once the tables
/// it needs are compiled.
fn sample_and_walk(pids: &[u32], stack_bytes: u32) -> Vec<NamedWalk> {
    sample_and_walk_to(pids, stack_bytes, DEFAULT_MAX_DEPTH)
}

/// [`sample_and_walk`] with walks of at most `max_depth` frames.
fn sample_and_walk_to(pids: &[u32], stack_bytes: u32, max_depth: usize) -> Vec<NamedWalk> {
    let config = SamplerConfig {
        frequency_hz: 99,
        user_stack_bytes: stack_bytes,
        pids: pids.to_vec(),
        ..SamplerConfig::default()
    };
    let samples = sample_for(&config, Duration::from_secs(2)).samples;
    for &pid in pids {
        let count = samples.iter().filter(|s| s.header.tgid == pid).count();
        assert!(
            count >= MIN_SAMPLES,
            "only {count} samples of process {pid}"
        );
    }

    let walker_config = WalkerConfig {
        max_depth,
        ..WalkerConfig::default()
    };
    let mut table: ProcessTable<ProcessState> = StackWalker::process_table(&walker_config);
    let mut walker = StackWalker::new(walker_config);
    let mut symbolizers: HashMap<u32, FrameNames> = HashMap::new();
    let started = Instant::now();
    samples
        .iter()
        .map(|sample| {
            // Tables compile in the background, one module at a time as
            // the walk reaches it: walk again until none is pending.
            let walk = loop {
                let walk = walker
                    .walk(&mut table, &sample.header, sample.stack())
                    .expect("user registers");
                if walk.outcome != WalkOutcome::TablePending {
                    break walk;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "tables never compiled"
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            let pid = sample.header.tgid;
            let names = symbolizers
                .entry(pid)
                .or_insert_with(|| FrameNames::new(pid))
                .names(walk.frames);
            NamedWalk {
                pid,
                names,
                outcome: walk.outcome,
            }
        })
        .collect()
}

/// `names` followed by the frames above a C program's main.
fn down_to_main(names: &[&str]) -> Vec<String> {
    names
        .iter()
        .chain(&ABOVE_MAIN)
        .map(|name| name.to_string())
        .collect()
}

/// Every walk has exactly `expected` frames and ends as `outcome`.
fn assert_every_walk(walks: &[NamedWalk], expected: &[String], outcome: WalkOutcome) {
    for walk in walks {
        assert_eq!(walk.names, expected, "frames of a sample");
        assert_eq!(walk.outcome, outcome, "end of the walk of {:?}", walk.names);
    }
}

/// Runs `fixture` alone on the machine with `args`, and asserts the chain
/// of every sample, which ends at the outermost frame.
fn assert_chain(fixture: &Fixture, args: &[&str], expected: &[String]) {
    let _serial = exclusive();
    let process = fixture.start(args);
    let walks = sample_and_walk(&[process.pid()], agent_common::DEFAULT_USER_STACK_BYTES);
    assert_every_walk(&walks, expected, OUTERMOST);
}

#[test]
fn unwinds_a_call_chain_without_frame_pointers_down_to_main() {
    require_root();
    let fixture = Fixture::compile("call_chain", &[]);
    assert_chain(&fixture, &[], &down_to_main(&["c", "b", "a"]));
}

#[test]
fn unwinds_deep_recursion_and_stops_at_the_depth_limit() {
    require_root();
    let fixture = Fixture::compile("deep_recursion", &[]);
    // 64-byte frames: 300 of them (19 KiB) fit the largest copy.
    let stack_bytes = agent_common::MAX_USER_STACK_BYTES;
    // leaf, 240 recurse, main and 3 frames above it: 245, under the limit.
    const DEEP: usize = 240;
    // Deeper than the limit: the walk stops after SMALL_DEPTH_LIMIT frames.
    const TOO_DEEP: usize = 300;

    let _serial = exclusive();
    let deep = fixture.start(&[&DEEP.to_string()]);
    let too_deep = fixture.start(&[&TOO_DEEP.to_string()]);
    let walks = sample_and_walk_to(
        &[deep.pid(), too_deep.pid()],
        stack_bytes,
        SMALL_DEPTH_LIMIT,
    );

    let recursion = |n: usize| std::iter::once("leaf").chain(std::iter::repeat_n("recurse", n));
    let expected: Vec<String> = recursion(DEEP)
        .chain(ABOVE_MAIN)
        .map(String::from)
        .collect();
    let (deep_walks, too_deep_walks): (Vec<_>, Vec<_>) =
        walks.into_iter().partition(|w| w.pid == deep.pid());
    assert_every_walk(&deep_walks, &expected, OUTERMOST);

    let truncated: Vec<String> = recursion(SMALL_DEPTH_LIMIT - 1).map(String::from).collect();
    assert_every_walk(
        &too_deep_walks,
        &truncated,
        WalkOutcome::Ended(UnwindEnd::DepthLimit),
    );
}

#[test]
fn unwinds_a_thread_down_to_its_entry() {
    require_root();
    let fixture = Fixture::compile("threads", &[]);
    let _serial = exclusive();
    let process = fixture.start(&[]);
    let walks = sample_and_walk(&[process.pid()], agent_common::DEFAULT_USER_STACK_BYTES);

    // A thread's stack starts in libc's start_thread, called from clone3
    // (both static, named by file); clone3's CFI ends the chain.
    let (thread, main): (Vec<_>, Vec<_>) = walks
        .into_iter()
        .partition(|w| w.names.first().is_some_and(|name| name == "thread_spin"));
    for (walks, thread) in [(&thread, "new"), (&main, "main")] {
        assert!(
            walks.len() >= MIN_SAMPLES / 2,
            "{} samples of the {thread} thread",
            walks.len()
        );
    }
    let expected = ["thread_spin", "thread_main", LIBC, LIBC].map(String::from);
    assert_every_walk(&thread, &expected, OUTERMOST);
    assert_every_walk(&main, &down_to_main(&["main_spin"]), OUTERMOST);
}

/// Builds `fixtures/spin_lib.c` as `libspin.so` into a new directory.

#[test]
fn unwinds_from_a_dlopened_library_back_into_the_executable() {
    require_root();
    let fixture = Fixture::dlopen_call();
    let library = fixture.dir().join("libspin.so");
    assert_chain(
        &fixture,
        &[library.to_str().expect("a UTF-8 path")],
        &down_to_main(&["lib_spin", "lib_entry", "call_plugin"]),
    );
}

#[test]
fn unwinds_from_a_library_called_through_the_plt() {
    require_root();
    let fixture = Fixture::plt_call();
    assert_chain(
        &fixture,
        &[],
        &down_to_main(&["lib_spin", "lib_entry", "call_library"]),
    );
}

#[test]
fn unwinds_a_signal_handler_through_the_signal_frame() {
    require_root();
    let fixture = Fixture::compile("signal_handler", &[]);
    // The handler returns into libc's __restore_rt (static: named by file),
    // whose CFI restores the interrupted registers from the signal frame.
    assert_chain(
        &fixture,
        &[],
        &down_to_main(&["handler_spin", "handler", LIBC, "spin", "c", "b", "a"]),
    );
}

#[test]
fn switches_between_frame_pointers_and_cfi_through_libc() {
    require_root();
    let fixture = Fixture::compile(
        "fp_callback",
        &[
            "-O2",
            "-fno-omit-frame-pointer",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
        ],
    );
    let _serial = exclusive();
    let process = fixture.start(&[]);
    let walks = sample_and_walk(&[process.pid()], agent_common::DEFAULT_USER_STACK_BYTES);

    // compare is called from qsort's merge sort, static functions of libc
    // (named by file) under qsort_r, as deep as glibc's merge recursion
    // goes: the program's frames around them are exact.
    let first = &walks[0].names;
    assert_eq!(first[..2], ["spin", "compare"], "frames of {first:?}");
    let in_libc = first[2..]
        .iter()
        .take_while(|name| *name == LIBC || name.contains("qsort"))
        .count();
    assert!(
        in_libc >= 1,
        "no libc frame between compare and its caller: {first:?}"
    );
    assert_eq!(
        first[2 + in_libc..],
        down_to_main(&["sort_things"]),
        "frames of {first:?}"
    );
    assert_every_walk(&walks, first, OUTERMOST);
}

#[test]
fn unwinds_a_static_pie() {
    require_root();
    let fixture = Fixture::static_pie_call_chain();
    // libc is linked in, with its symbols: every frame is the fixture's.
    let expected = [
        "c",
        "b",
        "a",
        "main",
        "__libc_start_call_main",
        "__libc_start_main",
        "_start",
    ]
    .map(String::from);
    assert_chain(&fixture, &[], &expected);
}

#[test]
fn unwinds_cpp_templates_inside_a_try_block() {
    require_root();
    let fixture = Fixture::cpp_template_chain();
    assert_chain(
        &fixture,
        &[],
        &down_to_main(&["Worker<int>::run", "dispatch<Worker<int> >"]),
    );
}

#[test]
fn unwinds_rust_through_lang_start() {
    require_root();
    let fixture = Fixture::rust_chain();
    let _serial = exclusive();
    let process = fixture.start(&[]);
    let walks = sample_and_walk(&[process.pid()], agent_common::DEFAULT_USER_STACK_BYTES);

    // Between rust_chain::main and C's main, std's lang_start machinery,
    // whose exact frames depend on how std was built: assert what the
    // fixture controls, that the walk passes through std's runtime and
    // reaches _start, and that every sample agrees.
    let prefix = [
        "rust_chain::c",
        "rust_chain::b",
        "rust_chain::a",
        "rust_chain::main",
    ];
    let first = &walks[0].names;
    assert_eq!(first[..prefix.len()], prefix, "frames of {first:?}");
    assert!(
        first
            .iter()
            .any(|name| name == "std::rt::lang_start_internal"),
        "no lang_start_internal in {first:?}"
    );
    assert!(first.ends_with(&ABOVE_MAIN.map(String::from)), "{first:?}");
    assert_every_walk(&walks, first, OUTERMOST);
}
