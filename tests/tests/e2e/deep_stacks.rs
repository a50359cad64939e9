//! End to end: deep stacks reach their root through stack tails. The real
//! sampler and the agent's walker run together as in the agent (walks
//! decide the copy sizes and stack plans the sampler reads next), on
//! fixtures far deeper than any stack copy: C recursing through 4 KiB
//! frames to 64 KiB, 256 KiB and 1 MiB in three threads at once, a Rust
//! thread with a 16 MiB stack, and threads switching between two deep call
//! chains that differ only at the top and the bottom; and, through deep
//! copies, a stack 300 KB deep that changes shape every millisecond, which
//! no tail can follow, also in threads that live a quarter of a second
//! each (copied deep from their first tick once their program is known to
//! need deep copies) and in images that exec themselves every quarter of a
//! second (learned at their first tick). Every frame of every sample is
//! named and checked against the exact chain, except across those images.
//! Needs root.

use std::{collections::HashMap, sync::MutexGuard, time::Duration};

use stackscope_agent::run::FEED_DRAIN_INTERVAL;
use stackscope_sampler::{Counters, SamplerConfig};
use stackscope_tests::{
    Fixture, FrameNames, LiveWalk, RunningProcess, exclusive, require_root, walk_live,
};
use stackscope_unwind::UnwindEnd;
use stackscope_unwind::walker::WalkOutcome;

/// Static libc functions (no `.symtab` in Debian's libc): named by file.
const LIBC: &str = "libc.so.6";
const OUTERMOST: WalkOutcome = WalkOutcome::Ended(UnwindEnd::Outermost);

/// How long each `deep_churn` run is sampled: its first walks end
/// truncated until its stack plan is learned (a few hundred milliseconds,
/// the table compiles included: 0.33 s in a fresh clone's CI run, where
/// 10 s left 94.9%), so the window is long enough for them to be a small
/// share.
const WINDOW: Duration = Duration::from_secs(15);

/// How long the fixtures whose stacks keep their depth are sampled (see
/// [`assert_chain`]: their learning is judged apart).
const STEADY_WINDOW: Duration = Duration::from_secs(6);

/// Walks of a thread before its first one that reaches the root: its
/// stack plan is being learned. 16-44 of each thread of `deep_frames`
/// (0.3-0.7 s: three threads share two CPUs, about 66 walks a second
/// each); at most about 2.3 s of them.
const MAX_LEARNING_WALKS: usize = 150;

/// Of a thread's walks once it has been learned, the share that must
/// reach the root (all of them in a 15 s run: 973 of 973, 916 of 916,
/// 924 of 924).
const MIN_LEARNED_ROOT_SHARE: f64 = 0.99;

/// How long the alternating fixture is sampled, at 997 Hz: about 2,800
/// stitched walks of each chain (15 s gave 14,000), where 100 are enough
/// to trust that none carried the other's tail.
const STITCH_WINDOW: Duration = Duration::from_secs(3);

/// The share of a `deep_churn` thread's walks that must reach the root.
const MIN_ROOT_SHARE: f64 = 0.95;

/// How long a teacher (see [`sample_deep_churn`]) runs: its main thread's
/// stack is learned, found stale twice, then copied deep within a second.
const TEACHING: Duration = Duration::from_secs(2);

/// Steps of `deep_churn`'s descent: 201 frames of 600 or 2,600 bytes
/// picked at random, about 320 KB.
const CHURN_DEPTH: usize = 200;

/// A `deep_churn` run sampled at 99 Hz for `WINDOW`, its process still
/// alive (its frames are named from it) and the sampler still the test's
/// alone.
struct ChurnRun {
    process: RunningProcess,
    config: SamplerConfig,
    walks: Vec<LiveWalk>,
    counters: Counters,
    /// Its file: the exec mode runs it again and again.
    _fixture: Fixture,
    _serial: MutexGuard<'static, ()>,
}

/// Builds `deep_churn` with `cflags`, starts it with `mode` after its
/// depth, and samples only it, the reader draining every `drain_interval`
/// when no wake-up comes sooner. With `teacher`, another run of the program
/// churns on its main thread for the first [`TEACHING`] of the window, and
/// is sampled too.
fn sample_deep_churn(
    cflags: &[&str],
    mode: &[&str],
    drain_interval: Duration,
    teacher: bool,
) -> ChurnRun {
    let fixture = Fixture::compile("deep_churn", cflags);
    let _serial = exclusive();
    let depth = CHURN_DEPTH.to_string();
    let args: Vec<&str> = [depth.as_str()]
        .into_iter()
        .chain(mode.iter().copied())
        .collect();
    let process = fixture.start(&args);
    let mut pids = vec![process.pid()];
    if teacher {
        let teacher = fixture.start(&[depth.as_str()]);
        pids.push(teacher.pid());
        // Killed (on drop) once it has taught.
        std::thread::spawn(move || {
            std::thread::sleep(TEACHING);
            drop(teacher);
        });
    }
    let config = SamplerConfig {
        frequency_hz: 99,
        pids,
        drain_interval,
        ..SamplerConfig::default()
    };
    let (walks, counters) = walk_live(&config, WINDOW);
    ChurnRun {
        process,
        config,
        walks,
        counters,
        _fixture: fixture,
        _serial,
    }
}

/// Samples `pid` with the default copy ceiling at 99 Hz and names every
/// walk's frames.
fn walk_named(pid: u32) -> Vec<(LiveWalk, Vec<String>)> {
    let config = SamplerConfig {
        frequency_hz: 99,
        pids: vec![pid],
        ..SamplerConfig::default()
    };
    let (walks, counters) = walk_live(&config, STEADY_WINDOW);
    assert!(
        counters.tail_spans > 0,
        "no tail span was read: {counters:?}"
    );
    let mut names = FrameNames::new(pid);
    walks
        .into_iter()
        .filter(|w| w.tgid == pid)
        .map(|w| {
            let named = names.names(&w.frames);
            (w, named)
        })
        .collect()
}

/// How a thread's walks went (see [`assert_chain`]).
#[derive(Debug, Default, Clone, Copy)]
struct ChainWalks {
    /// Walks that reached the root.
    complete: usize,
    /// Complete walks that went through the stack tail...
    stitched: usize,
    /// ... and those whose copy held the whole stack.
    whole_copy: usize,
}

/// Every walk of a thread names a prefix of `expected` (never a wrong
/// frame); its stack plan is learned within [`MAX_LEARNING_WALKS`] walks
/// (those before the first complete one), and from then on at least
/// [`MIN_LEARNED_ROOT_SHARE`] of them name all of it, reaching the root.
fn assert_chain(
    thread: &str,
    walks: &[&(LiveWalk, Vec<String>)],
    expected: &[String],
) -> ChainWalks {
    assert!(walks.len() >= 100, "only {} walks of {thread}", walks.len());
    let mut counts = ChainWalks::default();
    for (walk, names) in walks {
        assert!(
            expected.starts_with(names),
            "{thread}: a walk is not a prefix of the chain ({:?}): {names:?}",
            walk.outcome
        );
        if walk.outcome == OUTERMOST {
            assert_eq!(names.as_slice(), expected, "{thread}: a complete walk");
            counts.complete += 1;
            counts.stitched += usize::from(walk.stitched);
            counts.whole_copy += usize::from(walk.whole_copy);
        }
    }
    let learning = walks
        .iter()
        .position(|(walk, _)| walk.outcome == OUTERMOST)
        .unwrap_or(walks.len());
    let learned = walks.len() - learning;
    let ChainWalks {
        complete,
        stitched,
        whole_copy,
        ..
    } = counts;
    let share = complete as f64 / learned.max(1) as f64;
    eprintln!(
        "{thread}: learned after {learning} walks; then {complete} of {learned} reached the root \
         ({:.1}%), {stitched} through the tail, {whole_copy} from a copy of the whole stack",
        100.0 * share
    );
    assert!(
        learning <= MAX_LEARNING_WALKS,
        "{thread}: the first of {} walks to reach the root was walk {learning}",
        walks.len()
    );
    assert!(
        share >= MIN_LEARNED_ROOT_SHARE,
        "{thread}: once learned, only {:.1}% reached the root",
        100.0 * share
    );
    counts
}

/// `innermost`, then `recursion` frames of `recurse`, then `outer`.
fn chain(innermost: &[&str], recurse: &str, recursion: usize, outer: &[&str]) -> Vec<String> {
    innermost
        .iter()
        .copied()
        .chain(std::iter::repeat_n(recurse, recursion))
        .chain(outer.iter().copied())
        .map(String::from)
        .collect()
}

/// The thread ids of a process by their names.
fn threads_by_name(pid: u32) -> HashMap<String, u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("listing the threads")
        .filter_map(|entry| {
            let tid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
            Some((comm.trim().to_string(), tid))
        })
        .collect()
}

#[test]
fn c_threads_at_64k_256k_and_1m_reach_the_root() {
    require_root();
    let fixture = Fixture::compile("deep_frames", &["-pthread"]);
    let _serial = exclusive();
    let process = fixture.start(&["65536", "262144", "1048576"]);
    let pid = process.pid();
    let threads = threads_by_name(pid);
    let walks = walk_named(pid);

    // recurse(bytes) recurses while more than its 4000-byte frame is left.
    let recursion = |bytes: usize| bytes.div_ceil(4000);
    let cases = [
        (
            "main, 64 KiB",
            pid,
            chain(
                &["spin"],
                "recurse",
                recursion(65536),
                &["main", LIBC, "__libc_start_main", "_start"],
            ),
        ),
        (
            "thread, 256 KiB",
            threads["d262144"],
            chain(
                &["spin"],
                "recurse",
                recursion(262144),
                &["thread_main", LIBC, LIBC],
            ),
        ),
        (
            "thread, 1 MiB",
            threads["d1048576"],
            chain(
                &["spin"],
                "recurse",
                recursion(1048576),
                &["thread_main", LIBC, LIBC],
            ),
        ),
    ];
    let mut all = ChainWalks::default();
    for (thread, tid, expected) in cases {
        let of_thread: Vec<_> = walks.iter().filter(|(w, _)| w.tid == tid).collect();
        let counts = assert_chain(thread, &of_thread, &expected);
        // Each stack is deeper than the default copy: a walk reaches its
        // root through a tail or a copy to the stack's end, nothing else.
        assert_eq!(
            counts.stitched + counts.whole_copy,
            counts.complete,
            "{thread}: complete walks neither through a tail nor from a whole copy"
        );
        all.complete += counts.complete;
        all.stitched += counts.stitched;
    }
    // Which of the two a thread gets is the planner's choice, made anew
    // as its tails keep up or go stale (once, under the whole suite's
    // load, the main thread's went the other way); frames that stay where
    // they are get tails.
    assert!(
        all.stitched * 2 > all.complete,
        "only {} of {} complete walks went through a tail",
        all.stitched,
        all.complete
    );
}

#[test]
fn a_stack_with_pages_never_touched_reaches_the_root_through_them() {
    require_root();
    // A C++ frame's large local array, only partly used (as in LLVM), leaves
    // pages of the live stack never written: not present, so one read of
    // the whole stack fails. The deep copy is read again page by page,
    // those pages left as zeros, and walks go through them (`hole`'s
    // return address lies above them).
    let fixture = Fixture::compile("stack_hole", &["-fno-stack-clash-protection"]);
    let _serial = exclusive();
    const DEPTH: usize = 100;
    let process = fixture.start(&[&DEPTH.to_string()]);
    let pid = process.pid();
    let config = SamplerConfig {
        frequency_hz: 99,
        pids: vec![pid],
        ..SamplerConfig::default()
    };
    let (walks, counters) = walk_live(&config, Duration::from_secs(3));
    let mut names = FrameNames::new(pid);
    // spin, 50 downs, hole, 51 downs, main, then libc's start.
    let mut expected = chain(&["spin"], "down", DEPTH / 2, &["hole"]);
    expected.extend(chain(&[], "down", DEPTH / 2 + 1, &["main"]));
    let ours: Vec<_> = walks.iter().filter(|w| w.tgid == pid).collect();
    let whole = ours
        .iter()
        .filter(|w| {
            let named = names.names(&w.frames);
            assert!(
                expected.starts_with(&named) || named.starts_with(&expected),
                "a wrong frame: {named:?}"
            );
            w.outcome == OUTERMOST && named.starts_with(&expected)
        })
        .count();
    eprintln!(
        "stack_hole: {whole} of {} walks reached the root through the untouched pages; \
         {} deep copies, {} with holes, {} fell back",
        ours.len(),
        counters.deep_copies,
        counters.deep_copies_with_holes,
        counters.deep_copy_fallbacks
    );
    assert!(counters.deep_copies_with_holes > 0, "{counters:?}");
    assert!(ours.len() >= 100, "only {} walks", ours.len());
    assert!(
        whole as f64 >= MIN_ROOT_SHARE * ours.len() as f64,
        "{whole} of {} walks reached the root",
        ours.len()
    );
}

#[test]
fn a_rust_thread_with_a_16_mib_stack_reaches_the_root() {
    require_root();
    let fixture = Fixture::deep_rust();
    let _serial = exclusive();
    const DEPTH: usize = 300;
    let process = fixture.start(&[&DEPTH.to_string()]);
    let pid = process.pid();
    let walks = walk_named(pid);
    let deep: Vec<_> = walks.iter().filter(|(w, _)| w.tid != pid).collect();

    // Between the closure and clone3, std's thread start machinery, whose
    // frames depend on how std was built: take them from the longest walk
    // that reached the root, after checking what the fixture controls.
    let complete = deep
        .iter()
        .filter(|(w, _)| w.outcome == OUTERMOST)
        .map(|(_, names)| names)
        .max_by_key(|names| names.len())
        .expect("a walk of the deep thread reached the root");
    let prefix = chain(&["deep_rust::spin"], "deep_rust::recurse", DEPTH, &[]);
    assert_eq!(complete[..prefix.len()], prefix, "the recursion");
    assert!(
        complete.ends_with(&[LIBC.to_string(), LIBC.to_string()]),
        "ends in start_thread and clone3: {complete:?}"
    );
    let expected = complete.clone();
    assert_chain("deep Rust thread", &deep, &expected);
}

#[test]
fn a_stitched_walk_never_carries_the_other_chains_tail() {
    require_root();
    let fixture = Fixture::compile("alternating", &["-pthread"]);
    let _serial = exclusive();
    const DEPTH: usize = 40;
    let process = fixture.start(&[&DEPTH.to_string(), "2"]);
    let pid = process.pid();
    let config = SamplerConfig {
        frequency_hz: 997,
        pids: vec![pid],
        ..SamplerConfig::default()
    };
    let (walks, _) = walk_live(&config, STITCH_WINDOW);
    let mut names = FrameNames::new(pid);
    let mut checked = [0usize; 2];
    let mut stitched = [0usize; 2];
    for walk in walks.iter().filter(|w| w.tgid == pid && w.tid != pid) {
        let named = names.names(&walk.frames);
        // The innermost frame says which chain the thread is in; the
        // bottom of the stack must say the same.
        let which = match named.first().map(String::as_str) {
            Some("spin_a") => 0,
            Some("spin_b") => 1,
            _ => continue,
        };
        let chain_frame = ["chain_a", "chain_b"][which];
        let other = ["chain_b", "chain_a"][which];
        assert!(
            !named.iter().any(|n| n == other),
            "{chain_frame}'s walk carries {other}: {named:?}"
        );
        if walk.outcome == OUTERMOST {
            let expected: Vec<String> = [["spin_a", "spin_b"][which], "leaf"]
                .into_iter()
                .chain(std::iter::repeat_n("common", DEPTH))
                .chain([chain_frame, "worker", LIBC, LIBC])
                .map(String::from)
                .collect();
            assert_eq!(named, expected, "a complete walk of {chain_frame}");
            checked[which] += 1;
            stitched[which] += usize::from(walk.stitched);
        }
    }
    eprintln!("complete walks of chain_a, chain_b: {checked:?}, through the tail: {stitched:?}");
    for which in 0..2 {
        assert!(
            stitched[which] >= 100,
            "too few stitched walks to trust the check: {stitched:?}"
        );
    }
}

#[test]
fn a_deep_stack_that_keeps_changing_shape_reaches_the_root_through_deep_copies() {
    require_root();
    let default_drain = SamplerConfig::default().drain_interval;
    let run = sample_deep_churn(&[], &[], default_drain, false);
    let ChurnRun {
        process,
        config,
        walks,
        counters,
        ..
    } = &run;
    let pid = process.pid();
    assert!(counters.deep_copies > 0, "no deep copy: {counters:?}");
    let mut names = FrameNames::new(pid);
    let outer = ["main", LIBC, "__libc_start_main", "_start"];
    let (mut total, mut complete) = (0usize, 0usize);
    for walk in walks.iter().filter(|w| w.tgid == pid) {
        total += 1;
        let named = names.names(&walk.frames);
        complete += usize::from(churn_walk_is_whole(walk, &named, &outer));
    }
    let share = complete as f64 / total.max(1) as f64;
    eprintln!(
        "deep_churn: {complete} of {total} walks reached the root ({:.1}%); {} deep copies, {} fell back",
        100.0 * share,
        counters.deep_copies,
        counters.deep_copy_fallbacks
    );
    assert!(total >= 100, "only {total} walks");
    assert!(
        share >= MIN_ROOT_SHARE,
        "{:.1}% reached the root",
        100.0 * share
    );

    // Without deep copies, tails alone cannot follow it.
    let without = SamplerConfig {
        deep_stack_bytes: 0,
        ..config.clone()
    };
    let (walks, counters) = walk_live(&without, Duration::from_secs(5));
    let ours: Vec<_> = walks.iter().filter(|w| w.tgid == pid).collect();
    let complete = ours.iter().filter(|w| w.outcome == OUTERMOST).count();
    eprintln!(
        "deep_churn without deep copies: {complete} of {} walks reached the root",
        ours.len()
    );
    assert_eq!(counters.deep_copies, 0);
    assert!(
        complete * 2 < ours.len(),
        "{complete} of {} reached the root without deep copies",
        ours.len()
    );
}

/// Checks a walk of `deep_churn` (never a wrong frame: `spin`, unless the
/// tick caught a step going down or up, then steps, then `outer`, however
/// far the walk went); true when it is whole, down to the root.
fn churn_walk_is_whole(walk: &LiveWalk, named: &[String], outer: &[&str]) -> bool {
    churn_walk_of_depth_is_whole(walk, named, outer, CHURN_DEPTH)
}

/// [`churn_walk_is_whole`] for a run `depth` steps deep.
fn churn_walk_of_depth_is_whole(
    walk: &LiveWalk,
    named: &[String],
    outer: &[&str],
    depth: usize,
) -> bool {
    let in_spin = named.first().is_some_and(|n| n == "spin");
    let steps = named
        .iter()
        .skip(usize::from(in_spin))
        .take_while(|n| *n == "step_small" || *n == "step_large")
        .count();
    let rest: Vec<&str> = named[usize::from(in_spin) + steps..]
        .iter()
        .map(String::as_str)
        .collect();
    assert!(
        steps <= depth + 1 && outer.starts_with(&rest),
        "not a prefix of the chain ({:?}): {named:?}",
        walk.outcome
    );
    if walk.outcome != OUTERMOST {
        return false;
    }
    assert_eq!(rest, outer, "a complete walk: {named:?}");
    if in_spin {
        assert_eq!(steps, depth + 1, "a complete walk: {named:?}");
    }
    true
}

#[test]
fn new_threads_of_a_program_that_needed_deep_copies_reach_the_root_from_their_first_tick() {
    require_root();
    // A new deep thread every 250 ms: half the half-second drain the agent
    // uses with its mapping feed, so a thread learned only at a timed
    // drain has lived most of its life truncated, or is gone.
    let run = sample_deep_churn(&["-pthread"], &["250"], FEED_DRAIN_INTERVAL, false);
    let ChurnRun {
        process,
        walks,
        counters,
        ..
    } = &run;
    let pid = process.pid();
    let mut names = FrameNames::new(pid);
    let outer = ["churn_thread", LIBC, LIBC];
    // Per thread, in the order they were first sampled: whether each of
    // its walks was whole.
    let mut threads: Vec<(u32, Vec<bool>)> = Vec::new();
    // The main thread only starts and joins them.
    for walk in walks.iter().filter(|w| w.tgid == pid && w.tid != pid) {
        let named = names.names(&walk.frames);
        // A thread starting or ending in libc (clone3, start_thread and
        // what it calls before and after churn_thread).
        let churning = ["churn_thread", "step_small", "step_large", "spin"];
        if !named.iter().any(|name| churning.contains(&name.as_str())) {
            continue;
        }
        let whole = churn_walk_is_whole(walk, &named, &outer);
        match threads.iter_mut().find(|t| t.0 == walk.tid) {
            Some(thread) => thread.1.push(whole),
            None => threads.push((walk.tid, vec![whole])),
        }
    }
    // The first threads teach that the program needs deep copies (a tail,
    // stale twice, then a deep copy, all within one thread's life); the
    // threads after the first one with a whole walk are new threads of a
    // known deep program. From their first tick on, the sampler copies
    // them deep to their thread pointer, before the agent learns them; a
    // tick whose copy faults wakes the reader instead. Without that copy,
    // every first walk is cut short.
    let threads: Vec<Vec<bool>> = threads.into_iter().map(|(_, walks)| walks).collect();
    FirstWalks::of(&threads, walks, counters).check("threads", counters);
}

/// How the walks of a deep program's new threads (or images) went, from
/// whether each one's walks were whole, in order, per thread in the order
/// first sampled. The first threads teach the agent that the program
/// needs deep copies; those after the first one with a whole walk are new
/// threads of a known deep program.
struct FirstWalks {
    threads: usize,
    teaching: usize,
    /// Of the threads after the teaching ones: how many, and how many of
    /// their first walks were whole.
    later: usize,
    first_whole: usize,
    /// Their walks after their first: how many, and how many were whole.
    after_first: usize,
    after_first_whole: usize,
}

impl FirstWalks {
    /// `walks` and `counters` are the whole run's, for the message when
    /// no walk is whole (nothing was learned).
    fn of(threads: &[Vec<bool>], walks: &[LiveWalk], counters: &Counters) -> Self {
        let Some(first_whole) = threads.iter().position(|walks| walks.contains(&true)) else {
            let mut outcomes: HashMap<String, usize> = HashMap::new();
            for walk in walks {
                *outcomes.entry(format!("{:?}", walk.outcome)).or_default() += 1;
            }
            panic!(
                "no walk reached the root: {} threads or images, {} walks in all, by outcome \
                 {outcomes:?}; {counters:?}",
                threads.len(),
                walks.len()
            );
        };
        let teaching = 1 + first_whole;
        let later = &threads[teaching..];
        let after_first = || later.iter().flat_map(|walks| walks.iter().skip(1));
        Self {
            threads: threads.len(),
            teaching,
            later: later.len(),
            first_whole: later.iter().filter(|walks| walks[0]).count(),
            after_first: after_first().count(),
            after_first_whole: after_first().filter(|&&whole| whole).count(),
        }
    }

    /// Prints the figures and checks them: learned only at a timed drain, a
    /// thread would stay truncated for a quarter of a second on average,
    /// most of its life, and its first walk would be cut short.
    fn check(&self, what: &str, counters: &Counters) {
        let share = self.after_first_whole as f64 / self.after_first.max(1) as f64;
        eprintln!(
            "deep_churn {what}: {} in all, {} teaching; after them, {} of {} walks after the \
             first reached the root ({:.1}%), and {} of {} first walks; {} early wake-ups, {} \
             deep copies",
            self.threads,
            self.teaching,
            self.after_first_whole,
            self.after_first,
            100.0 * share,
            self.first_whole,
            self.later,
            counters.early_wakeups,
            counters.deep_copies
        );
        assert!(self.later >= 20, "only {} later {what}", self.later);
        assert!(self.after_first >= 40, "only {} walks", self.after_first);
        assert!(share >= 0.8, "{:.1}% reached the root", 100.0 * share);
        assert!(
            self.first_whole * 10 >= self.later * 7,
            "{} of {} first walks reached the root",
            self.first_whole,
            self.later
        );
    }
}

#[test]
fn new_images_of_a_program_that_needed_deep_copies_reach_the_root_from_their_first_tick() {
    require_root();
    // The main thread churns 320 KB deep and execs the program again every
    // 250 ms: each image's main thread is new to the agent, and its thread
    // pointer lies below its stack. From its first tick on, the sampler
    // copies it deep up to where its process's stack started at exec.
    //
    // What teaches the sampler that the program needs deep copies is
    // another run of it, churning on one long-lived thread, as a build
    // fleet's first compiler runs do. Left to the exec'ing process alone,
    // learning hung on when the timed drains fell in its images' quarter
    // second lives: this walker reads a process's maps when it walks its
    // samples (the agent learns them from the kernel's mmap events), and a
    // sample walked after its image had exec'd again met the next image's
    // maps. Twice in whole suites every walk ended unmapped or truncated.
    let run = sample_deep_churn(&[], &["250", "exec"], FEED_DRAIN_INTERVAL, true);
    let ChurnRun {
        process,
        walks,
        counters,
        ..
    } = &run;
    let pid = process.pid();
    let fixture_path = std::fs::read_link(format!("/proc/{pid}/exe")).expect("the fixture's path");
    // A churning walk to the root holds every step (each image names its
    // frames at new addresses: the chain itself is checked by the other
    // tests of this fixture).
    let whole = |w: &LiveWalk| w.outcome == OUTERMOST && w.frames.len() > CHURN_DEPTH;
    // Each image maps the fixture at a new random base, far from the last
    // one's; its walks' frames in the fixture lie within its few pages.
    let in_fixture = |w: &LiveWalk| {
        w.frames
            .iter()
            .zip(&w.files)
            .find(|(_, file)| file.as_deref() == Some(fixture_path.as_path()))
            .map(|(&address, _)| address)
    };
    let mut images: Vec<Vec<bool>> = Vec::new();
    let mut last_address = None;
    for walk in walks.iter().filter(|w| w.tgid == pid) {
        let Some(address) = in_fixture(walk) else {
            continue;
        };
        let same_image = last_address.is_some_and(|last: u64| address.abs_diff(last) < 1 << 16);
        last_address = Some(address);
        match images.last_mut() {
            Some(image) if same_image => image.push(whole(walk)),
            _ => images.push(vec![whole(walk)]),
        }
    }
    // The first images teach that the program needs deep copies (their
    // tails go stale). Without the copy to the stack start, every later
    // image's first walk is cut short too (its tick wakes the reader,
    // which learns the image for its next).
    FirstWalks::of(&images, walks, counters).check("images", counters);
}

/// Threads of `deep_churn`'s short-lived deep process (see the test below).
const SHORT_RUN_THREADS: &str = "3";
/// Their depth: 301 steps, about 480 KB of stack each.
const SHORT_RUN_DEPTH: usize = 300;
/// How long they churn: a compile that lives under a second.
const SHORT_RUN_MS: &str = "700";

#[test]
fn a_short_lived_deep_process_the_agent_has_never_seen_reaches_the_root_from_its_first_tick() {
    // A fresh sampler and walker, nothing learned, no program known to be
    // deep: the process is new to them (a shell that execs the fixture
    // once they sample it), and its threads are 300 frames deep from
    // their first instruction and gone within a second, as a compile's
    // are. Each tick of a thread not learned yet is copied to its stack's
    // end (the thread pointer), so its walks reach the root before the
    // agent has seen any of them.
    short_lived_deep_process(ShortRun {
        depth: SHORT_RUN_DEPTH,
        threads: SHORT_RUN_THREADS,
        run_ms: SHORT_RUN_MS,
        frequency_hz: 199,
    });
}

#[test]
fn a_short_lived_process_more_than_one_mib_deep_reaches_the_root() {
    // As above, 850 steps deep: about 1.4 MB of stack (each step 600 or
    // 2,600 bytes of locals at random, ~1.66 KB on average), past a 1 MiB
    // copy and within the largest deep class (a compiler recursing
    // through a deeply nested crate runs 1-1.5 MiB deep). Two threads at
    // 99 Hz: more would leave the test's own reader, unoptimised, so
    // little CPU that the 2 MiB records fill the ring before it drains
    // them (the release agent, three threads at 199 Hz: 278 of 278).
    short_lived_deep_process(ShortRun {
        depth: 850,
        threads: "2",
        run_ms: "1500",
        frequency_hz: 99,
    });
}

/// One run of `deep_churn`'s short-lived process (see
/// [`short_lived_deep_process`]).
struct ShortRun {
    depth: usize,
    threads: &'static str,
    run_ms: &'static str,
    frequency_hz: u64,
}

/// Runs `deep_churn`'s short-lived process (see the tests above) under a
/// fresh sampler and walker, and checks that [`MIN_ROOT_SHARE`] of its
/// threads' walks reach the root.
fn short_lived_deep_process(run: ShortRun) {
    let ShortRun {
        depth,
        threads,
        run_ms,
        frequency_hz,
    } = run;
    require_root();
    let fixture = Fixture::compile("deep_churn", &["-pthread"]);
    let _serial = exclusive();
    let script = format!(
        "echo ready; read go; exec {} {depth} {run_ms} threads {threads}",
        fixture.path.display()
    );
    let mut process = RunningProcess::start_ready(
        std::process::Command::new("sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::piped()),
    );
    let pid = process.pid();
    let mut go = process.child.stdin.take().expect("the shell's stdin");
    let starter = std::thread::spawn(move || {
        // Once the sampler is up.
        std::thread::sleep(Duration::from_secs(1));
        use std::io::Write as _;
        go.write_all(b"go\n").expect("starting the fixture");
    });
    let config = SamplerConfig {
        frequency_hz,
        pids: vec![pid],
        drain_interval: FEED_DRAIN_INTERVAL,
        ..SamplerConfig::default()
    };
    let (walks, counters) = walk_live(&config, Duration::from_secs(4));
    starter.join().expect("the starter");
    let mut names = FrameNames::new(pid);
    let outer = ["churn_thread", LIBC, LIBC];
    let churning = ["churn_thread", "step_small", "step_large", "spin"];
    let (mut total, mut whole) = (0usize, 0usize);
    let mut threads = std::collections::HashSet::new();
    for walk in walks.iter().filter(|w| w.tgid == pid && w.tid != pid) {
        let named = names.names(&walk.frames);
        if !named.iter().any(|name| churning.contains(&name.as_str())) {
            continue;
        }
        threads.insert(walk.tid);
        total += 1;
        whole += usize::from(churn_walk_of_depth_is_whole(walk, &named, &outer, depth));
    }
    let share = whole as f64 / total.max(1) as f64;
    eprintln!(
        "short process {depth} deep: {whole} of {total} walks of {} threads reached the root ({:.1}%); \
         {} deep copies, {} fell back",
        threads.len(),
        100.0 * share,
        counters.deep_copies,
        counters.deep_copy_fallbacks
    );
    assert!(total >= 100, "only {total} walks of its threads");
    assert!(
        share >= MIN_ROOT_SHARE,
        "{:.1}% reached the root",
        100.0 * share
    );
}
