use std::time::UNIX_EPOCH;

use stackscope_unwind::{UnwindEnd, walker::WalkOutcome};

use super::{
    test_support::{AddWithMetadata as _, add, config, file, flatten, header, module_files},
    *,
};

const KERNEL_LEAF: u64 = 0xffff_ffff_8110_0042;

/// Adds one sample whose walk placed `frames` in `space`, with `objects`.
fn add_walked(
    aggregator: &mut Aggregator,
    header: &SampleHeader,
    kernel: &[u64],
    frames: &[u64],
    objects: &[FrameObject],
    space: Option<u64>,
) {
    let walk = Walk {
        frames,
        objects,
        outcome: WalkOutcome::Ended(UnwindEnd::Outermost),
        stitched: false,
        space,
    };
    aggregator.add_with_metadata(header, kernel, Some(&walk));
}

#[test]
fn frames_shared_with_a_threads_last_walk_intern_as_they_would_one_by_one() {
    let (own, libc) = module_files();
    // Two versions of a process's module list: the second has `own`
    // mapped 0x1000 higher, so the same addresses are other file offsets.
    let place = |space: u64, pc: u64| {
        let own_base = if space == 1 { 0x1000_0000 } else { 0x1000_1000 };
        if pc >= 0x2000_0000 {
            file(&libc, pc - 0x2000_0000)
        } else {
            file(&own, pc - own_base)
        }
    };
    let pcs = [
        0x1000_2000,
        0x1000_3000,
        0x2000_0100,
        0x2000_0200,
        0x1000_4000,
    ];
    let mut seed = 7u64;
    let mut next = move |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n
    };
    // A small bound, so that the interval fills and both ways must agree
    // on which samples become `[truncated]` or are dropped.
    let small = || AggregatorConfig {
        max_entries: 40,
        ..config()
    };
    let (mut shared, mut plain) = (Aggregator::new(small()), Aggregator::new(small()));
    for round in 0..2_000 {
        let space = 1 + next(2) as u64;
        let frames: Vec<u64> = (0..1 + next(4)).map(|_| pcs[next(pcs.len())]).collect();
        let objects: Vec<FrameObject> = frames.iter().map(|&pc| place(space, pc)).collect();
        let kernel: &[u64] = if next(3) == 0 { &[KERNEL_LEAF] } else { &[] };
        let mut header = header(std::process::id(), ["a", "b"][next(2)], true);
        // Three threads, and one whose slot another thread's id shares.
        header.tid = [1, 2, 3, 1 + LAST_WALK_SLOTS as u32][next(4)];
        add_walked(&mut shared, &header, kernel, &frames, &objects, Some(space));
        add_walked(&mut plain, &header, kernel, &frames, &objects, None);
        if round == 1_000 {
            let (a, b) = (
                shared.finish_interval(UNIX_EPOCH),
                plain.finish_interval(UNIX_EPOCH),
            );
            assert_eq!(flatten(&a), flatten(&b));
        }
    }
    let remembered = |aggregator: &Aggregator| {
        aggregator
            .current
            .last_walks
            .iter()
            .filter(|walk| walk.space.is_some())
            .count()
    };
    assert!(remembered(&shared) > 0, "walks were remembered");
    assert_eq!(remembered(&plain), 0, "no space, nothing remembered");
    let (a, b) = (
        shared.finish_interval(UNIX_EPOCH),
        plain.finish_interval(UNIX_EPOCH),
    );
    assert_eq!(flatten(&a), flatten(&b));
    assert!(a.sample_count() > 0 && shared.stats().truncated > 0);
    assert_eq!(shared.stats(), plain.stats());
}

#[test]
fn outer_frames_are_shared_but_never_an_innermost_frame_with_a_return_address() {
    let last = LastWalk {
        frames: vec![0x30, 0x20, 0x10],
        ..LastWalk::default()
    };
    assert_eq!(last.shared_outer_frames(&[0x31, 0x20, 0x10]), 2);
    assert_eq!(last.shared_outer_frames(&[0x30, 0x20, 0x10]), 3);
    assert_eq!(last.shared_outer_frames(&[0x40, 0x30, 0x20, 0x10]), 2);
    // Frame 0 here is a return address there: its location differs.
    assert_eq!(last.shared_outer_frames(&[0x20, 0x10]), 1);
    assert_eq!(last.shared_outer_frames(&[0x10]), 0);
    assert_eq!(last.shared_outer_frames(&[0x11, 0x10, 0x20]), 0);
}

#[test]
fn walks_too_deep_to_remember_are_interned_and_not_remembered() {
    let (own, _) = module_files();
    let mut aggregator = Aggregator::new(config());
    let header = header(std::process::id(), "deep", true);
    let depth = MAX_REMEMBERED_FRAMES + 1;
    let frames: Vec<u64> = (0..depth as u64).map(|i| 0x1000 + i).collect();
    let objects: Vec<FrameObject> = frames.iter().map(|&pc| file(&own, pc)).collect();
    add_walked(&mut aggregator, &header, &[], &frames, &objects, Some(1));
    add_walked(&mut aggregator, &header, &[], &frames, &objects, Some(1));
    assert_eq!(aggregator.current.last_walk_bytes(), 0);
    let interval = aggregator.finish_interval(UNIX_EPOCH);
    assert_eq!(interval.samples.len(), 1);
    assert_eq!(interval.samples[0].count, 2);
    assert_eq!(interval.stacks.get(0).unwrap().len(), depth);
}

#[test]
fn the_last_walks_hold_no_more_memory_than_their_bound() {
    let (own, _) = module_files();
    let mut aggregator = Aggregator::new(config());
    let kernel: Vec<u64> = (0..agent_common::MAX_KERNEL_FRAMES as u64)
        .map(|i| KERNEL_LEAF + i)
        .collect();
    // Every slot holds a walk of 600 frames, then one of the most frames
    // remembered: vectors that doubled would hold 1,200.
    for depth in [600, MAX_REMEMBERED_FRAMES] {
        for tid in 0..LAST_WALK_SLOTS as u32 {
            let mut header = header(std::process::id(), "deep", true);
            header.tid = tid;
            let frames: Vec<u64> = (0..depth as u64).map(|i| 0x1000 + i).collect();
            let objects: Vec<FrameObject> = frames.iter().map(|&pc| file(&own, pc)).collect();
            add_walked(
                &mut aggregator,
                &header,
                &kernel,
                &frames,
                &objects,
                Some(1),
            );
        }
    }
    let held = aggregator.current.last_walk_bytes();
    assert!(
        held > MAX_LAST_WALK_BYTES * 9 / 10 && held <= MAX_LAST_WALK_BYTES,
        "{held} bytes held, bound {MAX_LAST_WALK_BYTES}"
    );
}

#[test]
fn the_next_interval_has_room_for_what_this_one_held() {
    let (own, _) = module_files();
    let mut aggregator = Aggregator::new(config());
    let header = header(std::process::id(), "app", true);
    for leaf in 0..500u64 {
        let objects = [file(&own, 0x1000 + leaf), file(&own, 0x100)];
        add(&mut aggregator, &header, &[], &objects);
    }
    let held = aggregator.finish_interval(UNIX_EPOCH);
    assert_eq!((held.stacks.len(), held.locations.len()), (500, 501));
    let next = &aggregator.current;
    assert!(next.stacks.is_empty());
    assert!(next.stacks.bounds.capacity() > 500 && next.stacks.locations.capacity() >= 1000);
    assert!(next.stack_index.capacity() >= 500);
    assert!(next.location_index.capacity() >= 501 && next.sample_index.capacity() >= 500);
}

/// An interval filling the buffers of one whose batch is built holds what
/// a fresh one would, in those buffers and in the index tables of the
/// interval before; buffers of over four times the room needed are let go.
#[test]
fn the_next_interval_fills_the_buffers_of_one_already_built() {
    let (own, _) = module_files();
    let header = header(std::process::id(), "app", true);
    let fill = |aggregator: &mut Aggregator, stacks: u64, first: u64| {
        for leaf in first..first + stacks {
            let objects = [file(&own, 0x1000 + leaf), file(&own, 0x100)];
            add(aggregator, &header, &[], &objects);
        }
    };
    let mut recycling = Aggregator::new(config());
    let mut both = |stacks: u64, first: u64, spare: Option<IntervalBuffers>| {
        // What an aggregator that never held an interval makes of it.
        let mut fresh = Aggregator::new(config());
        fill(&mut recycling, stacks, first);
        fill(&mut fresh, stacks, first);
        let (filled, expected) = (
            recycling.finish_interval_into(UNIX_EPOCH, spare),
            fresh.finish_interval(UNIX_EPOCH),
        );
        assert_eq!(flatten(&filled), flatten(&expected));
        let next = &recycling.current;
        assert!(next.stacks.is_empty() && next.samples.is_empty() && next.locations.is_empty());
        assert!(next.stack_index.is_empty() && next.sample_index.is_empty());
        assert!(next.location_index.is_empty());
        let tables = next.stack_index.capacity();
        (filled, tables)
    };
    let (built, tables) = both(500, 0, None);
    // Its batch built; the aggregator fills the next interval meanwhile,
    // and the one after that fills its buffers.
    let spare = built.into_buffers();
    // Where its buffers are and their room, which a fresh buffer sized
    // for the next interval (800 locations, 400 samples) would not have.
    let spare_stacks = (
        spare.stacks.locations.as_ptr(),
        spare.stacks.locations.capacity(),
    );
    let spare_samples = (spare.samples.as_ptr(), spare.samples.capacity());
    assert!(spare_stacks.1 > 800 && spare_samples.1 > 400);
    let (second, kept_tables) = both(400, 7, Some(spare));
    assert_eq!(kept_tables, tables);
    let (third, _) = both(300, 3, None);
    let third_stacks = (
        third.stacks.locations.as_ptr(),
        third.stacks.locations.capacity(),
    );
    assert_eq!(third_stacks, spare_stacks);
    assert_eq!(
        (third.samples.as_ptr(), third.samples.capacity()),
        spare_samples
    );

    // Buffers and tables for 400-500 stacks, when 100 were sampled.
    fill(&mut recycling, 100, 0);
    recycling.finish_interval_into(UNIX_EPOCH, Some(second.into_buffers()));
    let next = &recycling.current;
    assert!(next.stacks.locations.capacity() < 400 && next.samples.capacity() < 200);
    assert!(next.stack_index.capacity() < tables);
}

#[test]
fn stacks_kept_end_to_end_read_back_alike_by_index_and_in_order() {
    let mut stacks = Stacks::default();
    let pushed: [&[u32]; 4] = [&[1, 2, 3], &[4], &[], &[5, 6]];
    for stack in pushed {
        stacks.push(stack);
    }
    assert_eq!(stacks.len(), 4);
    assert_eq!(stacks.iter().len(), 4);
    assert!(stacks.iter().eq(pushed));
    for (index, stack) in pushed.iter().enumerate() {
        assert_eq!(stacks.get(index), Some(*stack));
    }
    assert_eq!(stacks.get(4), None);
}

#[test]
fn a_threads_label_set_is_reused_until_its_process_execs() {
    let proc_root = tempfile::tempdir().unwrap();
    let pid = 4242;
    let dir = proc_root.path().join(pid.to_string());
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("cgroup"), "0::/user.slice/session-1.scope\n").unwrap();
    let exe_link = dir.join("exe");
    std::os::unix::fs::symlink("/usr/bin/old", &exe_link).unwrap();
    let mut aggregator = Aggregator::new(AggregatorConfig {
        proc_root: proc_root.path().to_path_buf(),
        ..config()
    });
    let (own, _) = module_files();
    let stack = [file(&own, 0x1_5678)];
    let sample = header(pid, "worker", true);

    let before = stackscope_telemetry::probes::ProbeTotals::now();
    add(&mut aggregator, &sample, &[], &stack);
    let first = stackscope_telemetry::probes::ProbeTotals::now().since(&before);
    // The image changes under the same process, unannounced: the thread
    // keeps the set it has (the exe is read once per process, as before).
    std::fs::remove_file(&exe_link).unwrap();
    std::os::unix::fs::symlink("/usr/bin/new", &exe_link).unwrap();
    let before = stackscope_telemetry::probes::ProbeTotals::now();
    add(&mut aggregator, &sample, &[], &stack);
    let again = stackscope_telemetry::probes::ProbeTotals::now().since(&before);
    assert!(
        again.process + again.derived < first.process + first.derived,
        "the second sample looked its labels up again: {again:?} after {first:?}"
    );
    // The exec record: the next sample's set is made anew, with the new exe.
    aggregator.on_exec(&mut ProcessLabels::default(), None);
    add(&mut aggregator, &sample, &[], &stack);
    // Another name in the same process is another set.
    add(&mut aggregator, &header(pid, "other", true), &[], &stack);

    let interval = aggregator.finish_interval(SystemTime::now());
    let counts: Vec<(String, String, u64)> = flatten(&interval)
        .into_iter()
        .map(|(_, labels, count)| (labels.comm, labels.exe.to_string(), count))
        .collect();
    assert_eq!(
        counts,
        [
            ("worker".into(), "/usr/bin/old".into(), 2),
            ("worker".into(), "/usr/bin/new".into(), 1),
            ("other".into(), "/usr/bin/new".into(), 1),
        ]
    );
}
