//! Offline end-to-end tests: real processes built without frame pointers,
//! stopped with ptrace, their registers and stack bytes captured the way the
//! BPF sampler captures them, unwound with tables compiled from their own
//! files (and libc's), and symbolized with the files' symbol tables: C call
//! chains, a signal frame, deep recursion, C++ templates with exceptions,
//! Rust, shared libraries reached through `dlopen` and through the PLT, a
//! static-pie, and a second thread's stack.
//!
//! Needs ptrace rights over child processes (root, or Yama scope 0/1), gcc,
//! g++, rustc, and glibc's static libraries (for the static-pie).

mod common;

use std::{thread::sleep, time::Duration};

use common::{ProcessModules, snapshot};
use stackscope_test_fixtures::Fixture;
use stackscope_unwind::{DEFAULT_MAX_DEPTH, UnwindEnd, unwind};

/// The stack copy the sampler takes by default.
const STACK_COPY: usize = 32 * 1024;

struct Walk {
    names: Vec<String>,
    end: UnwindEnd,
}

/// Snapshots thread `tid` and walks its stack.
fn walk(tid: u32, stack_copy: usize, max_depth: usize) -> Walk {
    let snapshot = snapshot(tid, stack_copy);
    let modules = ProcessModules::from_maps(&snapshot.maps);
    let mut frames = Vec::new();
    let end = unwind(
        snapshot.regs,
        &snapshot.stack,
        &modules,
        max_depth,
        &mut frames,
    );
    Walk {
        names: modules.symbolize(&frames),
        end,
    }
}

/// Walks thread `tid` until frame 0 is in `innermost`: right after printing
/// "ready" the fixture may still be on its way back from `write`.
fn walk_in(tid: u32, innermost: &str, stack_copy: usize, max_depth: usize) -> Walk {
    for _ in 0..100 {
        let walk = walk(tid, stack_copy, max_depth);
        if walk.names.first().is_some_and(|name| name == innermost) {
            return walk;
        }
        sleep(Duration::from_millis(10));
    }
    panic!("the fixture never stopped in {innermost}");
}

/// What follows `main` in every glibc program: `__libc_start_call_main`
/// (static, so only the file name is known from a stripped libc),
/// `__libc_start_main` and the executable's `_start`.
const START: [&str; 3] = ["libc.so.6?", "__libc_start_main", "_start"];

fn chain(names: &[&str]) -> Vec<String> {
    names
        .iter()
        .chain(&START)
        .map(|name| name.to_string())
        .collect()
}

#[test]
fn call_chain_without_frame_pointers() {
    let fixture = Fixture::compile("chain", &[]);
    let running = fixture.start(&[]);
    let walk = walk_in(running.pid(), "spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    assert_eq!(walk.names, chain(&["spin", "c", "b", "a", "main"]));
    assert_eq!(walk.end, UnwindEnd::Outermost);
}

#[test]
fn through_a_signal_frame() {
    let fixture = Fixture::compile("chain", &[]);
    let running = fixture.start(&["signal"]);
    let walk = walk_in(running.pid(), "handler_spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    // __restore_rt is static in libc: only its file is known.
    assert_eq!(
        walk.names,
        chain(&[
            "handler_spin",
            "on_alarm",
            "libc.so.6?",
            "spin",
            "c",
            "b",
            "a",
            "main"
        ])
    );
    assert_eq!(walk.end, UnwindEnd::Outermost);
}

#[test]
fn deep_recursion() {
    const DEPTH: usize = 300;
    let fixture = Fixture::compile("deep", &[]);
    let running = fixture.start(&[&DEPTH.to_string()]);

    let walk = walk_in(running.pid(), "spin", STACK_COPY, 1024);
    let mut expected = vec!["spin"];
    expected.extend(std::iter::repeat_n("recurse", DEPTH + 1));
    expected.push("main");
    assert_eq!(walk.names, chain(&expected));
    assert_eq!(walk.end, UnwindEnd::Outermost);

    // A depth limit cuts it short.
    const LIMIT: usize = 256;
    let walk = walk_in(running.pid(), "spin", STACK_COPY, LIMIT);
    assert_eq!(walk.names.len(), LIMIT);
    assert!(walk.names[1..].iter().all(|name| name == "recurse"));
    assert_eq!(walk.end, UnwindEnd::DepthLimit);

    // So does a short copy: each recurse frame takes 32 bytes, spin's 16.
    let walk = walk_in(running.pid(), "spin", 4096, 1024);
    assert!(walk.names[1..].iter().all(|name| name == "recurse"));
    assert!(
        (120..=129).contains(&walk.names.len()),
        "{} frames from 4 KiB",
        walk.names.len()
    );
    assert_eq!(walk.end, UnwindEnd::StackTruncated);
}

/// Removes `.eh_frame` and `.eh_frame_hdr` from the fixture.
fn strip_eh_frame(fixture: &Fixture) {
    let stripped = fixture.dir().join("stripped");
    let out = std::process::Command::new("objcopy")
        .args([
            "--remove-section=.eh_frame",
            "--remove-section=.eh_frame_hdr",
        ])
        .arg(&fixture.path)
        .arg(&stripped)
        .output()
        .expect("running objcopy");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&stripped, &fixture.path).expect("replacing the fixture");
}

#[test]
fn frame_pointer_fallback_for_a_binary_without_cfi() {
    // Frame pointers but no CFI at all in the executable; libc keeps its
    // .eh_frame, so the walk goes back to tables after main.
    let fixture = Fixture::compile(
        "chain",
        &["-fno-omit-frame-pointer", "-fno-asynchronous-unwind-tables"],
    );
    strip_eh_frame(&fixture);
    let running = fixture.start(&[]);
    let walk = walk_in(running.pid(), "spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    assert_eq!(walk.names, chain(&["spin", "c", "b", "a", "main"]));
    // _start clears rbp before calling __libc_start_main, the ABI's mark of
    // the outermost frame.
    assert_eq!(walk.end, UnwindEnd::Outermost);
}

#[test]
fn debug_frame_only_binary() {
    // GCC writes .debug_frame instead of .eh_frame with -g and no unwind
    // tables; crt1's _start only ever had .eh_frame, which is gone, but it
    // is the ELF entry point: nothing called it, the walk is complete.
    let fixture = Fixture::compile("chain", &["-g", "-fno-asynchronous-unwind-tables"]);
    strip_eh_frame(&fixture);
    let running = fixture.start(&[]);
    let walk = walk_in(running.pid(), "spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    assert_eq!(walk.names, chain(&["spin", "c", "b", "a", "main"]));
    assert_eq!(walk.end, UnwindEnd::Outermost);
}

/// Snapshots taken of every spinning fixture below, each of which must
/// show the same chain.
const SNAPSHOTS: usize = 5;

/// Waits for thread `tid` to spin in `expected[0]`, then takes
/// [`SNAPSHOTS`] snapshots a few milliseconds apart, each walked with the
/// default limits, and asserts that every walk has exactly `expected`
/// frames and ends as `end`.
fn assert_every_walk(tid: u32, expected: &[String], end: UnwindEnd) {
    let innermost = expected.first().expect("an expected chain");
    walk_in(tid, innermost, STACK_COPY, DEFAULT_MAX_DEPTH);
    for i in 0..SNAPSHOTS {
        let walk = walk(tid, STACK_COPY, DEFAULT_MAX_DEPTH);
        assert_eq!(walk.names, expected, "frames of snapshot {i}");
        assert_eq!(walk.end, end, "end of snapshot {i}: {:?}", walk.names);
        sleep(Duration::from_millis(20));
    }
}

#[test]
fn cpp_templates_inside_a_try_block() {
    // main has a landing pad and an LSDA (its FDE has an augmentation
    // pointer); the templates are instantiated out of line.
    let fixture = Fixture::cpp_template_chain();
    let running = fixture.start(&[]);
    assert_every_walk(
        running.pid(),
        &chain(&["Worker<int>::run", "dispatch<Worker<int> >", "main"]),
        UnwindEnd::Outermost,
    );
}

#[test]
fn from_a_dlopened_library_back_into_the_executable() {
    let fixture = Fixture::dlopen_call();
    let library = fixture.dir().join("libspin.so");
    // The library is mapped after the process started: the snapshot's maps
    // have it, and its table is compiled from it like any other.
    let running = fixture.start(&[library.to_str().expect("a UTF-8 path")]);
    assert_every_walk(
        running.pid(),
        &chain(&["lib_spin", "lib_entry", "call_plugin", "main"]),
        UnwindEnd::Outermost,
    );
}

#[test]
fn from_a_library_called_through_the_plt() {
    let fixture = Fixture::plt_call();
    let running = fixture.start(&[]);
    // The PLT stubs jump, they do not call: no frame of their own.
    assert_every_walk(
        running.pid(),
        &chain(&["lib_spin", "lib_entry", "call_library", "main"]),
        UnwindEnd::Outermost,
    );
}

#[test]
fn static_pie() {
    let fixture = Fixture::static_pie_call_chain();
    let running = fixture.start(&[]);
    // libc is linked in, with its symbols: every frame is the fixture's, and
    // __libc_start_call_main has a name.
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
    assert_every_walk(running.pid(), &expected, UnwindEnd::Outermost);
}

#[test]
fn a_thread_down_to_clone3() {
    let fixture = Fixture::compile("threads", &[]);
    let running = fixture.start(&[]);
    let [thread] = running.other_threads()[..] else {
        panic!("not one other thread: {:?}", running.other_threads());
    };
    // The thread's stack starts in libc's start_thread, called from clone3
    // (both static, named by file); clone3's CFI marks rip undefined, the
    // outermost frame.
    let expected = ["thread_spin", "thread_main", "libc.so.6?", "libc.so.6?"].map(String::from);
    assert_every_walk(thread, &expected, UnwindEnd::Outermost);
    // The main thread, stopped on its own, still walks down to _start.
    assert_every_walk(
        running.pid(),
        &chain(&["main_spin", "main"]),
        UnwindEnd::Outermost,
    );
}

#[test]
fn rust_through_lang_start() {
    let fixture = Fixture::rust_chain();
    let running = fixture.start(&[]);
    walk_in(
        running.pid(),
        "rust_chain::c",
        STACK_COPY,
        DEFAULT_MAX_DEPTH,
    );
    let first = walk(running.pid(), STACK_COPY, DEFAULT_MAX_DEPTH);

    // Between rust_chain::main and C's main, std's lang_start machinery,
    // whose exact frames depend on how std was built (with 1.95:
    // __rust_begin_short_backtrace, lang_start::{{closure}},
    // lang_start_internal): assert what the fixture controls, that every
    // frame between is std's and lang_start_internal is one of them, what
    // glibc puts above main, and that every snapshot agrees.
    let names = &first.names;
    let prefix = [
        "rust_chain::c",
        "rust_chain::b",
        "rust_chain::a",
        "rust_chain::main",
    ];
    let suffix = chain(&["main"]);
    assert!(
        names.len() > prefix.len() + suffix.len(),
        "no std frames in {names:?}"
    );
    assert_eq!(names[..prefix.len()], prefix, "frames of {names:?}");
    assert_eq!(
        names[names.len() - suffix.len()..],
        suffix,
        "frames of {names:?}"
    );
    let runtime = &names[prefix.len()..names.len() - suffix.len()];
    assert!(
        runtime.iter().all(|name| name.starts_with("std::")),
        "not std's: {runtime:?}"
    );
    assert!(
        runtime
            .iter()
            .any(|name| name == "std::rt::lang_start_internal"),
        "no lang_start_internal in {names:?}"
    );
    assert_eq!(first.end, UnwindEnd::Outermost, "end of {names:?}");
    assert_every_walk(running.pid(), names, UnwindEnd::Outermost);
}
