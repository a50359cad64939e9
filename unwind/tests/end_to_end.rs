//! Offline end-to-end tests: real processes built without frame pointers,
//! stopped with ptrace, their registers and stack bytes captured the way the
//! BPF sampler captures them, unwound with tables compiled from their own
//! files (and libc's), and symbolized with the files' symbol tables.
//!
//! Needs ptrace rights over child processes (root, or Yama scope 0/1) and gcc.

mod common;

use std::{thread::sleep, time::Duration};

use common::{Fixture, ProcessModules, Running, snapshot};
use stackscope_unwind::{DEFAULT_MAX_DEPTH, UnwindEnd, unwind};

/// The stack copy the sampler takes by default.
const STACK_COPY: usize = 32 * 1024;

struct Walk {
    names: Vec<String>,
    end: UnwindEnd,
}

fn walk(running: &Running, stack_copy: usize, max_depth: usize) -> Walk {
    let snapshot = snapshot(running.pid(), stack_copy);
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

/// Walks until frame 0 is in `innermost`: right after printing "ready" the
/// fixture may still be on its way back from `write`.
fn walk_in(running: &Running, innermost: &str, stack_copy: usize, max_depth: usize) -> Walk {
    for _ in 0..100 {
        let walk = walk(running, stack_copy, max_depth);
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
    let walk = walk_in(&running, "spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    assert_eq!(walk.names, chain(&["spin", "c", "b", "a", "main"]));
    assert_eq!(walk.end, UnwindEnd::Outermost);
}

#[test]
fn through_a_signal_frame() {
    let fixture = Fixture::compile("chain", &[]);
    let running = fixture.start(&["signal"]);
    let walk = walk_in(&running, "handler_spin", STACK_COPY, DEFAULT_MAX_DEPTH);
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

    let walk = walk_in(&running, "spin", STACK_COPY, 1024);
    let mut expected = vec!["spin"];
    expected.extend(std::iter::repeat_n("recurse", DEPTH + 1));
    expected.push("main");
    assert_eq!(walk.names, chain(&expected));
    assert_eq!(walk.end, UnwindEnd::Outermost);

    // The default depth limit cuts it short.
    let walk = walk_in(&running, "spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    assert_eq!(walk.names.len(), DEFAULT_MAX_DEPTH);
    assert!(walk.names[1..].iter().all(|name| name == "recurse"));
    assert_eq!(walk.end, UnwindEnd::DepthLimit);

    // So does a short copy: each recurse frame takes 32 bytes, spin's 16.
    let walk = walk_in(&running, "spin", 4096, 1024);
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
    let stripped = fixture.sibling("stripped");
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
    let walk = walk_in(&running, "spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    assert_eq!(walk.names, chain(&["spin", "c", "b", "a", "main"]));
    // _start clears rbp before calling __libc_start_main, the ABI's mark of
    // the outermost frame.
    assert_eq!(walk.end, UnwindEnd::Outermost);
}

#[test]
fn debug_frame_only_binary() {
    // GCC writes .debug_frame instead of .eh_frame with -g and no unwind
    // tables; crt1's _start only ever had .eh_frame, which is gone.
    let fixture = Fixture::compile("chain", &["-g", "-fno-asynchronous-unwind-tables"]);
    strip_eh_frame(&fixture);
    let running = fixture.start(&[]);
    let walk = walk_in(&running, "spin", STACK_COPY, DEFAULT_MAX_DEPTH);
    assert_eq!(walk.names, chain(&["spin", "c", "b", "a", "main"]));
    assert_eq!(walk.end, UnwindEnd::NoUnwindInfo);
}
