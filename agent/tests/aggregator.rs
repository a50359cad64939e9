//! The aggregator seen from outside, as the agent's run drives it: samples
//! in, intervals and batches out (label sets, dictionaries, bounds, naming).
//! What only its internals show (the last walks it remembers, capacities)
//! is tested beside it, in `src/aggregate/tests.rs`.

use std::{collections::HashSet, io::Write as _, time::UNIX_EPOCH};

use stackscope_proto::v1;
use stackscope_unwind::UnwindEnd;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use agent_common::{PythonFrame, SampleHeader};
use stackscope_agent::aggregate::{
    SampleWeight,
    labels::LabelChoice,
    test_support::{
        AddWithMetadata as _, add, config, described, file, flatten, header, module_files,
    },
    *,
};
use stackscope_metadata::{describe::Wanted, process::ProcessLabels};
use stackscope_process_table::ModuleFile;
use stackscope_python::{CodeCache, Layout};
use stackscope_symbolize::node::{Symbolizer, SymbolizerConfig};
use stackscope_unwind::walker::WalkOutcome;
use stackscope_unwind::walker::{FrameObject, Walk};

const KERNEL_LEAF: u64 = 0xffff_ffff_8110_0042;
const KERNEL_CALLER: u64 = 0xffff_ffff_8120_0010;
const MODULE_FRAME: u64 = 0xffff_ffff_c000_1010;

/// A kallsyms naming the kernel addresses above.
fn kallsyms() -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("temporary file");
    file.write_all(
        b"ffffffff81100000 T do_syscall_64\n\
          ffffffff81200000 T entry_SYSCALL_64\n\
          ffffffffc0001000 t nft_do_chain\t[nf_tables]\n",
    )
    .expect("writing kallsyms");
    file
}

fn symbolizer(kallsyms: &tempfile::NamedTempFile) -> Symbolizer {
    Symbolizer::new(SymbolizerConfig {
        kallsyms: kallsyms.path().to_path_buf(),
        sys_root: PathBuf::from("/nonexistent"),
        // The test's modules, not this machine's.
        modules: PathBuf::from("/nonexistent/modules"),
        ..SymbolizerConfig::default()
    })
}

/// A walk of `objects` that reached the root.
fn walk_of(objects: &[FrameObject]) -> Walk<'_> {
    Walk {
        frames: &ZERO_FRAMES[..objects.len()],
        objects,
        outcome: WalkOutcome::Ended(UnwindEnd::Outermost),
        stitched: false,
        space: None,
    }
}

const ZERO_FRAMES: [u64; 16] = [0; 16];

#[test]
fn sums_identical_pairs_and_keeps_different_labels_apart() {
    let (own, libc) = module_files();
    let mut aggregator = Aggregator::new(config());
    let stack = [file(&libc, 0x9_1234), file(&own, 0x1_5678)];
    let pid = std::process::id();
    for _ in 0..3 {
        add(&mut aggregator, &header(pid, "worker", true), &[], &stack);
    }
    add(&mut aggregator, &header(pid, "other", true), &[], &stack);
    assert_eq!(aggregator.stats().distinct, 2);

    let interval = aggregator.finish_interval(SystemTime::now());
    assert_eq!(interval.stacks.len(), 1, "one stack for both label sets");
    assert_eq!(interval.label_sets.len(), 2);
    let counts: Vec<(String, u64)> = flatten(&interval)
        .into_iter()
        .map(|(_, labels, count)| (labels.comm, count))
        .collect();
    assert_eq!(counts, [("worker".into(), 3), ("other".into(), 1)]);
    assert_eq!(interval.sample_count(), 4);
    // This process's exe, read from /proc.
    let exe = std::fs::read_link("/proc/self/exe").expect("own exe");
    assert_eq!(&*interval.label_sets[0].exe, exe.to_str().expect("UTF-8"));
    assert_eq!(
        interval.label_sets[0].pid, None,
        "no pid label unless asked"
    );

    // The next interval starts empty where this one ended.
    assert_eq!(aggregator.stats().distinct, 0);
    let next = aggregator.finish_interval(SystemTime::now());
    assert_eq!(next.start, interval.end);
    assert!(next.samples.is_empty());
    assert_eq!(aggregator.stats().intervals, 2);
    assert_eq!(aggregator.stats().max_distinct, 2);
}

#[test]
fn samples_before_their_process_is_described_get_its_labels_when_it_is() {
    let (own, _) = module_files();
    let mut aggregator = Aggregator::new(config());
    let stack = [file(&own, 0x1_5678)];
    let pid = std::process::id();
    let sample = header(pid, "worker", true);
    let mut records = HashMap::new();
    // Met for the first time: a set of its own, and one description asked
    // for however many samples come before it.
    for _ in 0..2 {
        let record = records.labels_of(pid);
        aggregator.add(&sample, &[], Some(&walk_of(&stack)), record);
    }
    assert!(aggregator.has_pending_labels());
    let wanted = aggregator.take_wanted();
    assert_eq!(
        wanted,
        [Wanted {
            tgid: pid,
            started: sample.process_start_ns,
            cgroup_id: sample.cgroup_id,
        }]
    );
    assert!(aggregator.take_wanted().is_empty(), "asked once");
    // The metadata worker answers: the set is filled in.
    let mut describer = aggregator.config().describer();
    let descriptions = wanted.into_iter().map(|w| describer.describe(w)).collect();
    aggregator.describe(descriptions, &mut records);
    assert!(!aggregator.has_pending_labels());
    // Later samples get a set of their own, equal to the first one.
    let record = records.labels_of(pid);
    aggregator.add(&sample, &[], Some(&walk_of(&stack)), record);
    assert!(aggregator.take_wanted().is_empty(), "described");

    let interval = aggregator.finish_interval(SystemTime::now());
    let exe = std::fs::read_link("/proc/self/exe").expect("own exe");
    assert_eq!(interval.label_sets.len(), 2);
    for labels in &interval.label_sets {
        assert_eq!(&*labels.exe, exe.to_str().expect("UTF-8"));
    }
    // The batch holds one set with every sample.
    let kallsyms = kallsyms();
    let mut symbolizer = symbolizer(&kallsyms);
    let batch = build_batch(&interval, &mut symbolizer, &BatchOptions::for_frequency(19));
    assert_eq!(batch.label_sets.len(), 1);
    let counts: Vec<u64> = batch.samples.iter().map(|s| s.count).collect();
    assert_eq!(counts, [3]);
}

#[test]
fn an_interval_ended_before_the_answer_ships_what_it_knows() {
    let (own, _) = module_files();
    let mut aggregator = Aggregator::new(config());
    let stack = [file(&own, 0x1_5678)];
    // A process that exited before it could be described: asked again
    // after a while, not on every sample.
    let gone = SampleHeader {
        process_start_ns: 12_345,
        ..header(u32::MAX - 1, "short", true)
    };
    let mut records = HashMap::new();
    let record = records.labels_of(gone.tgid);
    aggregator.add(&gone, &[], Some(&walk_of(&stack)), record);
    let wanted = aggregator.take_wanted();
    assert_eq!(wanted.len(), 1);
    let interval = aggregator.finish_interval(SystemTime::now());
    assert_eq!(interval.label_sets.len(), 1);
    assert_eq!(
        &*interval.label_sets[0].exe, "",
        "not known when the interval ended"
    );
    assert_eq!(aggregator.stats().labels_undescribed, 1);
    let mut describer = aggregator.config().describer();
    let descriptions = wanted.into_iter().map(|w| describer.describe(w)).collect();
    aggregator.describe(descriptions, &mut records);
    // Its link could not be read: the next sample's set says so and needs
    // no other description.
    let record = records.labels_of(gone.tgid);
    aggregator.add(&gone, &[], Some(&walk_of(&stack)), record);
    assert!(!aggregator.has_pending_labels());
    assert!(aggregator.take_wanted().is_empty());

    // One whose exec the mapping feed saw ships the exe it exec'd, even
    // undescribed.
    let execd = SampleHeader {
        process_start_ns: 23_456,
        ..header(u32::MAX - 2, "short", true)
    };
    let record = records.labels_of(execd.tgid).expect("made");
    aggregator.on_exec(record, Some(Path::new("/usr/bin/short")));
    aggregator.add(&execd, &[], Some(&walk_of(&stack)), Some(record));
    let interval = aggregator.finish_interval(SystemTime::now());
    let exes: Vec<&str> = interval.label_sets.iter().map(|set| &*set.exe).collect();
    assert!(exes.contains(&"/usr/bin/short"), "{exes:?}");
    assert_eq!(aggregator.stats().labels_undescribed, 2);
}

#[test]
fn a_description_that_comes_after_the_process_went_still_fills_in_its_sets() {
    let (own, _) = module_files();
    let mut aggregator = Aggregator::new(config());
    let stack = [file(&own, 0x1_5678)];
    let pid = std::process::id();
    let sample = header(pid, "brief", true);
    let mut records = HashMap::new();
    let record = records.labels_of(pid);
    aggregator.add(&sample, &[], Some(&walk_of(&stack)), record);
    let wanted = aggregator.take_wanted();
    assert_eq!(wanted.len(), 1);
    // The process exits, and its record goes with it, before the answer.
    records.clear();
    aggregator.on_exit(pid);
    let mut describer = aggregator.config().describer();
    let descriptions = wanted.into_iter().map(|w| describer.describe(w)).collect();
    let mut no_records: HashMap<u32, ProcessLabels> = HashMap::new();
    struct Gone<'a>(&'a mut HashMap<u32, ProcessLabels>);
    impl LabelRecords for Gone<'_> {
        fn labels_of(&mut self, tgid: u32) -> Option<&mut ProcessLabels> {
            self.0.get_mut(&tgid)
        }
    }
    aggregator.describe(descriptions, &mut Gone(&mut no_records));
    assert!(!aggregator.has_pending_labels());
    assert!(no_records.is_empty(), "no record is made for it");
    let interval = aggregator.finish_interval(SystemTime::now());
    let exe = std::fs::read_link("/proc/self/exe").expect("own exe");
    assert_eq!(interval.label_sets.len(), 1);
    assert_eq!(&*interval.label_sets[0].exe, exe.to_str().expect("UTF-8"));
    assert_eq!(aggregator.stats().labels_undescribed, 0);
}

#[test]
fn stacks_are_kernel_then_user_frames_leaf_first() {
    let (own, libc) = module_files();
    let mut aggregator = Aggregator::new(config());
    let user = [
        file(&libc, 0x9_1234),
        FrameObject::Vdso { offset: 0x9a0 },
        file(&own, 0x1_5678),
        FrameObject::Jit {
            address: 0x3ef0_a1c0_c2a0,
        },
        FrameObject::Unreadable {
            path: "/usr/bin/gone".into(),
            file_offset: 0x2040,
        },
        FrameObject::Anonymous {
            address: 0x7f00_dead_0000,
        },
    ];
    add(
        &mut aggregator,
        &header(7, "app", true),
        &[KERNEL_LEAF, KERNEL_CALLER],
        &user,
    );
    let interval = aggregator.finish_interval(SystemTime::now());
    let (frames, _, count) = &flatten(&interval)[0];
    assert_eq!(*count, 1);
    let user_key = |module: &ModuleFile| MappingKey::User {
        id: *module.id,
        path: module.path().shipped_name(),
    };
    assert_eq!(
        frames,
        &[
            // Each part's innermost frame is looked up at its address, the
            // others are return addresses.
            (MappingKey::Kernel, KERNEL_LEAF, false),
            (MappingKey::Kernel, KERNEL_CALLER, true),
            (user_key(&libc), 0x9_1234, false),
            (MappingKey::Vdso, 0x9a0, true),
            (user_key(&own), 0x1_5678, true),
            // No perf map for this process: named by its thread.
            (
                MappingKey::Jit {
                    name: "[jit] app".into()
                },
                0x3ef0_a1c0_c2a0,
                true
            ),
            // A file no root held: by path and file offset.
            (
                MappingKey::Unreadable {
                    path: "/usr/bin/gone".into()
                },
                0x2040,
                true
            ),
            (MappingKey::Anonymous, 0x7f00_dead_0000, true),
        ]
    );
    assert_eq!(interval.locations[1].lookup(), KERNEL_CALLER - 1);
    assert_eq!(interval.locations[0].lookup(), KERNEL_LEAF);
    // The user mappings carry their file, opened while the process runs.
    let opened = interval
        .mappings
        .iter()
        .filter(|m| m.file.as_ref().is_some_and(|f| f.open_now().is_ok()))
        .count();
    assert_eq!(opened, 2);
}

#[test]
fn kernel_threads_are_aggregated_without_exe_and_empty_samples_dropped() {
    let mut aggregator = Aggregator::new(config());
    aggregator.add_with_metadata(&header(0, "kworker/0:1", false), &[KERNEL_LEAF], None);
    aggregator.add_with_metadata(&header(0, "kworker/0:1", false), &[], None);
    let stats = aggregator.stats();
    assert_eq!((stats.samples, stats.kernel_only, stats.empty), (1, 1, 1));
    let interval = aggregator.finish_interval(SystemTime::now());
    let flat = flatten(&interval);
    assert_eq!(flat.len(), 1);
    assert_eq!(flat[0].0, [(MappingKey::Kernel, KERNEL_LEAF, false)]);
    assert_eq!(&*flat[0].1.exe, "");
    assert_eq!(flat[0].1.comm, "kworker/0:1");
}

#[test]
fn pid_label_only_when_asked() {
    let kallsyms = kallsyms();
    let mut symbolizer = symbolizer(&kallsyms);
    for label_pid in [false, true] {
        let mut aggregator = Aggregator::new(AggregatorConfig {
            labels: LabelChoice {
                pid: label_pid,
                ..LabelChoice::default()
            },
            ..config()
        });
        for pid in [100, 101] {
            aggregator.add_with_metadata(&header(pid, "app", false), &[KERNEL_LEAF], None);
        }
        let interval = aggregator.finish_interval(SystemTime::now());
        let pids: Vec<Option<u32>> = interval.label_sets.iter().map(|l| l.pid).collect();
        let batch = build_batch(&interval, &mut symbolizer, &BatchOptions::for_frequency(19));
        let names: HashSet<&str> = batch
            .label_sets
            .iter()
            .flat_map(|set| &set.labels)
            .map(|label| batch.strings[label.name as usize].as_str())
            .collect();
        if label_pid {
            assert_eq!(pids, [Some(100), Some(101)]);
            // Kernel threads have no exe: an empty value is no label.
            assert_eq!(names, HashSet::from(["comm", "node", "pid"]));
            assert_eq!(batch.samples.len(), 2);
        } else {
            assert_eq!(pids, [None], "both processes in one label set");
            assert_eq!(names, HashSet::from(["comm", "node"]));
            assert_eq!(batch.samples.len(), 1);
            assert_eq!(batch.samples[0].count, 2);
        }
    }
}

#[test]
fn labels_not_chosen_are_neither_kept_apart_nor_shipped() {
    let kallsyms = kallsyms();
    let mut symbolizer = symbolizer(&kallsyms);
    let mut aggregator = Aggregator::new(AggregatorConfig {
        labels: LabelChoice::none(),
        ..config()
    });
    aggregator.add_with_metadata(&header(100, "app", false), &[KERNEL_LEAF], None);
    aggregator.add_with_metadata(&header(101, "other", false), &[KERNEL_LEAF], None);
    let interval = aggregator.finish_interval(SystemTime::now());
    assert_eq!(interval.label_sets.len(), 1, "{:?}", interval.label_sets);
    let batch = build_batch(&interval, &mut symbolizer, &BatchOptions::for_frequency(19));
    assert_eq!(batch.label_sets.len(), 1);
    let names: Vec<&str> = batch.label_sets[0]
        .labels
        .iter()
        .map(|label| batch.strings[label.name as usize].as_str())
        .collect();
    assert_eq!(names, ["node"]);
    assert_eq!(batch.samples[0].count, 2);
}

#[test]
fn samples_taken_under_a_budget_keep_their_divisor() {
    let kallsyms = kallsyms();
    let mut symbolizer = symbolizer(&kallsyms);
    let mut aggregator = Aggregator::new(config());
    let budgeted = SampleHeader {
        sampling_divisor: 4,
        ..header(100, "app", false)
    };
    for _ in 0..3 {
        aggregator.add_with_metadata(&budgeted, &[KERNEL_LEAF], None);
    }
    aggregator.add_with_metadata(&header(100, "app", false), &[KERNEL_LEAF], None);
    let interval = aggregator.finish_interval(SystemTime::now());
    let batch = build_batch(&interval, &mut symbolizer, &BatchOptions::for_frequency(19));
    let mut counts: Vec<(u32, u64)> = batch
        .samples
        .iter()
        .map(|s| (s.sampling_divisor, s.count))
        .collect();
    counts.sort_unstable();
    // Same stack, same labels: two entries, since their weights differ.
    assert_eq!(counts, [(1, 1), (4, 3)]);
}

#[test]
fn a_full_interval_truncates_known_labels_and_drops_new_ones() {
    let mut aggregator = Aggregator::new(AggregatorConfig {
        max_entries: 2,
        ..config()
    });
    let kernel_only = |aggregator: &mut Aggregator, comm: &str, address: u64| {
        aggregator.add_with_metadata(&header(0, comm, false), &[address], None);
    };
    kernel_only(&mut aggregator, "a", KERNEL_LEAF);
    kernel_only(&mut aggregator, "a", KERNEL_CALLER);
    // Full: known pairs still count, new stacks of known labels go to
    // [truncated], new labels are dropped.
    kernel_only(&mut aggregator, "a", KERNEL_LEAF);
    kernel_only(&mut aggregator, "a", MODULE_FRAME);
    kernel_only(&mut aggregator, "a", MODULE_FRAME + 1);
    kernel_only(&mut aggregator, "b", KERNEL_LEAF);
    let stats = aggregator.stats();
    assert_eq!(
        (stats.samples, stats.truncated, stats.dropped),
        (5, 2, 1),
        "{stats:?}"
    );
    let interval = aggregator.finish_interval(SystemTime::now());
    assert!(
        !interval
            .locations
            .iter()
            .any(|l| l.address == MODULE_FRAME || l.address == MODULE_FRAME + 1),
        "locations of truncated samples are not kept"
    );
    let flat = flatten(&interval);
    let counts: Vec<(MappingKey, u64)> = flat
        .iter()
        .map(|(frames, _, count)| (frames[0].0.clone(), *count))
        .collect();
    assert_eq!(
        counts,
        [
            (MappingKey::Kernel, 2),
            (MappingKey::Kernel, 1),
            (MappingKey::Truncated, 2)
        ]
    );

    let batch = checked_batch(&interval);
    // Named, with counts, as in the interval.
    let named: Vec<(&str, u64)> = batch
        .samples
        .iter()
        .map(|sample| {
            let stack = &batch.stacks[sample.stack as usize];
            let leaf = &batch.locations[stack.locations[0] as usize];
            (
                batch.strings[leaf.lines[0].function as usize].as_str(),
                sample.count,
            )
        })
        .collect();
    assert_eq!(
        named,
        [
            ("do_syscall_64", 2),
            ("entry_SYSCALL_64", 1),
            (batch::TRUNCATED, 2)
        ]
    );
}

/// Every rule of the wire format the collector checks, and no duplicate in
/// any dictionary.
/// The batch of `interval`, named with the test's kallsyms, its
/// dictionaries and indexes checked.
fn checked_batch(interval: &Interval) -> v1::Batch {
    let kallsyms = kallsyms();
    let batch = build_batch(
        interval,
        &mut symbolizer(&kallsyms),
        &BatchOptions::for_frequency(19),
    );
    check_batch(&batch);
    batch
}

fn check_batch(batch: &v1::Batch) {
    assert_eq!(batch.batch_id.len(), 16);
    assert_eq!(batch.strings.first().map(String::as_str), Some(""));
    let unique = |what: &str, count: usize, distinct: usize| {
        assert_eq!(count, distinct, "duplicate {what}");
    };
    let strings: HashSet<&String> = batch.strings.iter().collect();
    unique("strings", batch.strings.len(), strings.len());
    let string = |index: u32| {
        assert!((index as usize) < batch.strings.len(), "string {index}");
    };
    let node = batch.node.as_ref().expect("node");
    string(node.name);
    string(node.agent_version);
    assert!(!batch.strings[node.name as usize].is_empty());
    assert!(batch.end_unix_nanos > batch.start_unix_nanos);
    assert!(batch.sample_period_nanos > 0);

    let mappings: HashSet<(i32, u32, u32)> = batch
        .mappings
        .iter()
        .map(|m| {
            string(m.build_id);
            string(m.path);
            assert_ne!(m.kind, v1::MappingKind::Unspecified as i32);
            let build_id = &batch.strings[m.build_id as usize];
            assert!(
                build_id.len().is_multiple_of(2)
                    && build_id
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "build-id {build_id:?}"
            );
            (m.kind, m.build_id, m.path)
        })
        .collect();
    unique("mappings", batch.mappings.len(), mappings.len());

    let locations: HashSet<String> = batch
        .locations
        .iter()
        .map(|l| {
            assert!((l.mapping as usize) < batch.mappings.len());
            for line in &l.lines {
                string(line.function);
                string(line.file);
            }
            format!("{l:?}")
        })
        .collect();
    unique("locations", batch.locations.len(), locations.len());

    let stacks: HashSet<&Vec<u32>> = batch
        .stacks
        .iter()
        .map(|s| {
            assert!(!s.locations.is_empty());
            assert!(
                s.locations
                    .iter()
                    .all(|&l| (l as usize) < batch.locations.len())
            );
            &s.locations
        })
        .collect();
    unique("stacks", batch.stacks.len(), stacks.len());

    let label_sets: HashSet<Vec<(u32, u32)>> = batch
        .label_sets
        .iter()
        .map(|set| {
            let mut labels: Vec<(u32, u32)> = set
                .labels
                .iter()
                .map(|label| {
                    string(label.name);
                    string(label.value);
                    (label.name, label.value)
                })
                .collect();
            let names: HashSet<u32> = labels.iter().map(|&(name, _)| name).collect();
            assert_eq!(names.len(), labels.len(), "label names unique in a set");
            labels.sort_unstable();
            labels
        })
        .collect();
    unique("label sets", batch.label_sets.len(), label_sets.len());

    let samples: HashSet<(u32, u32)> = batch
        .samples
        .iter()
        .map(|s| {
            assert!((s.stack as usize) < batch.stacks.len());
            assert!((s.label_set as usize) < batch.label_sets.len());
            assert!(s.count > 0);
            assert_eq!(s.sampling_divisor, 1);
            (s.stack, s.label_set)
        })
        .collect();
    unique("samples", batch.samples.len(), samples.len());
}

#[test]
fn batches_have_deduplicated_dictionaries_and_indexes_in_range() {
    let (own, libc) = module_files();
    let kallsyms = kallsyms();
    let mut symbolizer = symbolizer(&kallsyms);
    let start = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let mut aggregator = Aggregator::starting_at(config(), start);
    let pid = std::process::id();
    // An offset inside a function of this test binary, so its name is
    // known (a return address is looked up one byte before).
    let own_offset = {
        let address = module_files as fn() -> _ as usize as u64 + 16;
        let mapping = &own.region.mapping;
        address - mapping.start + mapping.offset
    };
    let jit = FrameObject::Jit {
        address: 0x3ef0_a1c0_c2a0,
    };
    let gone = FrameObject::Unreadable {
        path: "/usr/bin/gone".into(),
        file_offset: 0x2040,
    };
    let stacks: [&[FrameObject]; 3] = [
        &[file(&libc, 0x9_1234), file(&own, own_offset)],
        &[jit, gone, file(&own, own_offset)],
        &[FrameObject::Vdso { offset: 0x9a0 }, file(&own, own_offset)],
    ];
    for (i, stack) in stacks.iter().enumerate() {
        for comm in ["a", "b"] {
            for _ in 0..=i {
                add(
                    &mut aggregator,
                    &header(pid, comm, true),
                    &[KERNEL_LEAF, MODULE_FRAME],
                    stack,
                );
            }
        }
    }
    aggregator.add_with_metadata(&header(0, "kworker", false), &[KERNEL_CALLER], None);
    let interval = aggregator.finish_interval(start + Duration::from_secs(10));

    let started = std::time::Instant::now();
    let batch = build_batch(&interval, &mut symbolizer, &BatchOptions::for_frequency(19));
    let took = started.elapsed();
    check_batch(&batch);
    assert!(took < Duration::from_secs(5), "{took:?}");

    assert_eq!(batch.start_unix_nanos, 1_700_000_000_000_000_000);
    assert_eq!(batch.end_unix_nanos, 1_700_000_010_000_000_000);
    assert_eq!(batch.sample_period_nanos, 1_000_000_000 / 19);
    let node = batch.node.as_ref().expect("node");
    assert_eq!(batch.strings[node.name as usize], "node-a");
    let total: u64 = batch.samples.iter().map(|s| s.count).sum();
    assert_eq!(total, 2 * (1 + 2 + 3) + 1);
    assert_eq!(batch.samples.len(), 2 * 3 + 1);
    assert_eq!(batch.label_sets.len(), 3);

    // Mappings: the two files with their build-ids and paths, the vDSO,
    // the kernel image and a module.
    let mapping = |m: &v1::Mapping| {
        (
            m.kind,
            batch.strings[m.build_id as usize].clone(),
            batch.strings[m.path as usize].clone(),
        )
    };
    let mappings: HashSet<(i32, String, String)> = batch.mappings.iter().map(mapping).collect();
    let user = |module: &ModuleFile| {
        let build_id = module
            .id
            .build_id()
            .map(|id| id.to_string())
            .unwrap_or_default();
        (
            v1::MappingKind::User as i32,
            build_id,
            module.path().shipped_name(),
        )
    };
    assert!(mappings.contains(&user(&own)), "{mappings:?}");
    assert!(mappings.contains(&user(&libc)), "{mappings:?}");
    // Files carry their code segments (so the collector can name their
    // offsets from separate debug files); the own offset lies in one.
    for m in &batch.mappings {
        let is_file = m.kind == v1::MappingKind::User as i32 && m.build_id != 0;
        assert_eq!(!m.load_segments.is_empty(), is_file, "{m:?}");
    }
    assert!(
        batch.mappings.iter().any(|m| m
            .load_segments
            .iter()
            .any(|s| { (s.file_offset..s.file_offset + s.file_size).contains(&own_offset) })),
        "no code segment holds {own_offset:#x}"
    );
    let kinds: Vec<(i32, &str)> = mappings
        .iter()
        .filter(|(kind, _, _)| *kind != v1::MappingKind::User as i32)
        .map(|(kind, _, path)| (*kind, path.as_str()))
        .collect();
    for expected in [
        (v1::MappingKind::Kernel as i32, "[kernel.kallsyms]"),
        (v1::MappingKind::Kernel as i32, "[nf_tables]"),
        (v1::MappingKind::Vdso as i32, "[vdso]"),
        (v1::MappingKind::Anonymous as i32, "[jit]"),
    ] {
        assert!(kinds.contains(&expected), "{kinds:?}");
    }
    // A file no root held ships by its path, without a build-id.
    assert!(
        mappings.contains(&(
            v1::MappingKind::User as i32,
            String::new(),
            "/usr/bin/gone".to_string()
        )),
        "{mappings:?}"
    );

    // Names: kernel frames from kallsyms, this binary's function from its
    // symbols, located at the byte named: a caller's one before its return
    // address.
    let names = |location: &v1::Location| -> Vec<&str> {
        location
            .lines
            .iter()
            .map(|line| batch.strings[line.function as usize].as_str())
            .collect()
    };
    let all: Vec<(Vec<&str>, u64)> = batch
        .locations
        .iter()
        .map(|l| (names(l), l.address))
        .collect();
    assert!(
        all.contains(&(vec!["do_syscall_64"], KERNEL_LEAF)),
        "{all:?}"
    );
    assert!(
        all.contains(&(vec!["nft_do_chain"], MODULE_FRAME - 1)),
        "{all:?}"
    );
    assert!(
        all.contains(&(vec!["entry_SYSCALL_64"], KERNEL_CALLER)),
        "{all:?}"
    );
    // A JIT frame without a perf map entry is named by its thread.
    assert!(
        all.contains(&(vec!["[jit] a"], 0x3ef0_a1c0_c2a0)),
        "{all:?}"
    );
    let own_names: Vec<&Vec<&str>> = all
        .iter()
        .filter(|(_, address)| *address == own_offset - 1)
        .map(|(names, _)| names)
        .collect();
    assert!(!own_names.is_empty());
    for names in own_names {
        assert!(
            names
                .last()
                .is_some_and(|name| name.ends_with("module_files")),
            "{names:?}"
        );
    }
}

#[test]
fn a_second_batch_of_the_same_stacks_is_named_from_the_cache() {
    let (own, libc) = module_files();
    let kallsyms = kallsyms();
    let mut symbolizer = symbolizer(&kallsyms);
    let mut aggregator = Aggregator::new(config());
    let pid = std::process::id();
    // 2000 distinct stacks of 20 frames: distinct leaves, callers from 500
    // offsets per file; each sample added 10 times.
    for n in (0..2000u64).flat_map(|n| std::iter::repeat_n(n, 10)) {
        let stack: Vec<FrameObject> = (0..20)
            .map(|depth| {
                let module = if depth % 2 == 0 { &own } else { &libc };
                let offset = if depth == 0 {
                    n
                } else {
                    (n * 7 + depth * 13) % 500
                };
                file(module, 0x1000 + offset)
            })
            .collect();
        add(
            &mut aggregator,
            &header(pid, "app", true),
            &[KERNEL_LEAF],
            &stack,
        );
    }
    let interval = aggregator.finish_interval(SystemTime::now());
    assert_eq!(interval.stacks.len(), 2000);
    assert_eq!(interval.sample_count(), 20_000);
    // No naming deadline: in a debug build on a loaded machine the first
    // batch could run out of time, and what it left unnamed would rightly
    // miss the cache the second time. This test is about the cache.
    let options = BatchOptions {
        naming_budget: Duration::from_secs(600),
        ..BatchOptions::for_frequency(19)
    };
    let batch = build_batch(&interval, &mut symbolizer, &options);
    check_batch(&batch);
    let first = symbolizer.stats();
    let again = build_batch(&interval, &mut symbolizer, &options);
    assert_eq!(again, batch_with_id(&batch, &again), "the same names");
    let second = symbolizer.stats();
    assert_eq!(
        second.cache_misses, first.cache_misses,
        "no lookup misses the cache"
    );
    assert!(second.cache_hits > first.cache_hits);
}

/// `batch` with the id (random per batch) of `other`.
fn batch_with_id(batch: &v1::Batch, other: &v1::Batch) -> v1::Batch {
    v1::Batch {
        batch_id: other.batch_id.clone(),
        ..batch.clone()
    }
}

#[test]
fn a_file_in_steady_use_is_opened_once_not_once_per_interval() {
    let (own, libc) = module_files();
    let mut aggregator = Aggregator::new(config());
    let pid = std::process::id();
    let sample = [file(&own, 0x1000), file(&libc, 0x2000)];
    for _ in 0..3 {
        add(&mut aggregator, &header(pid, "app", true), &[], &sample);
        let interval = aggregator.finish_interval(SystemTime::now());
        assert!(
            interval
                .mappings
                .iter()
                .filter_map(|m| m.file.as_ref())
                .all(|f| f.is_open()),
            "each interval's batch gets its files open"
        );
    }
    assert_eq!(
        aggregator.stats().files_opened,
        2,
        "two files, three intervals"
    );
    // A file unused for a whole interval is let go, and opened again later.
    aggregator.finish_interval(SystemTime::now());
    add(
        &mut aggregator,
        &header(pid, "app", true),
        &[],
        &sample[..1],
    );
    assert_eq!(aggregator.stats().files_opened, 3);
}

#[test]
fn jit_frames_sampled_before_their_perf_map_was_read_are_named_when_the_interval_ends() {
    // A process whose perf map describes one function, under a proc root
    // of the test's own.
    let proc_root = tempfile::tempdir().expect("temp dir");
    let (tgid, started) = (4242, 77);
    let process = proc_root.path().join(tgid.to_string());
    std::fs::create_dir_all(process.join("root/tmp")).expect("dirs");
    std::fs::write(process.join("status"), format!("NSpid:\t{tgid}\t9\n")).expect("status");
    std::fs::write(process.join("root/tmp/perf-9.map"), "1000 100 hot\n").expect("map");
    let mut aggregator = Aggregator::new(AggregatorConfig {
        proc_root: proc_root.path().to_path_buf(),
        ..config()
    });
    let mut header = header(tgid, "app", true);
    header.process_start_ns = started;
    let jit = |address| FrameObject::Jit { address };
    let now = std::time::Instant::now();
    assert!(!aggregator.awaits_jit_names(now));
    // Sampled before the metadata worker read the map: asked for, not named;
    // the interval's end waits for the answer.
    add(&mut aggregator, &header, &[], &[jit(0x1010), jit(0x5000)]);
    let requests = aggregator.take_jit_requests();
    assert_eq!(requests.len(), 1, "{requests:?}");
    assert!(aggregator.awaits_jit_names(now));
    // The worker's answer, then a sample of the same code named at once.
    let mut reader = aggregator.config().perf_map_reader();
    aggregator.add_jit_names(reader.serve(requests, now));
    assert!(!aggregator.awaits_jit_names(now));
    add(&mut aggregator, &header, &[], &[jit(0x1010)]);
    // The process exits before the interval ends: its names stay for it.
    aggregator.on_exit(tgid);
    let tracked = |aggregator: &Aggregator| {
        let mut tracked = Vec::new();
        aggregator.tracked_processes_into(&mut tracked);
        tracked
    };
    assert_eq!(tracked(&aggregator), [tgid]);

    let interval = aggregator.finish_interval(SystemTime::now());
    let named = |name: &str| MappingKey::Jit { name: name.into() };
    let mut stacks: Vec<Vec<(MappingKey, u64)>> = flatten(&interval)
        .into_iter()
        .map(|(frames, _, _)| {
            frames
                .into_iter()
                .map(|(key, address, _)| (key, address))
                .collect()
        })
        .collect();
    stacks.sort_by_key(|frames| frames.len());
    assert_eq!(
        stacks,
        [
            vec![(named("hot"), 0x1010)],
            // The code no entry covers is named by its thread.
            vec![(named("hot"), 0x1010), (named("[jit] app"), 0x5000)],
        ]
    );
    let stats = aggregator.jit_stats();
    assert_eq!((stats.named, stats.unnamed), (2, 1));
    // Then they go.
    assert!(tracked(&aggregator).is_empty());
    // The batch names them the same way.
    let batch = checked_batch(&interval);
    let names: HashSet<&str> = batch
        .locations
        .iter()
        .flat_map(|location| &location.lines)
        .map(|line| batch.strings[line.function as usize].as_str())
        .collect();
    assert_eq!(names, HashSet::from(["hot", "[jit] app"]));
}

/// A Python stack read in part (the sampler's frame limit, or a read that
/// failed) keeps the frames it read in place of the evaluation loop's
/// frame, then one marked frame where those not read would be, then the
/// native callers; read whole, it has no mark.
#[test]
fn a_python_stack_read_in_part_ends_its_activation_in_a_marked_frame() {
    let (own, libc) = module_files();
    let mut aggregator = Aggregator::new(config());
    let header = header(7, "python3", true);
    let mut records = described(&mut aggregator, &header);
    // libc's leaf, the evaluation loop, main.
    let objects = [
        file(&libc, 0x9_1234),
        file(&own, 0x1_1100),
        file(&own, 0x1_8000),
    ];
    let frames = [0x7f00_0009_1234, 0x5555_0001_1100, 0x5555_0001_8000];
    let eval = 0x5555_0001_1000..0x5555_0001_2000;
    let walk = Walk {
        frames: &frames,
        objects: &objects,
        outcome: WalkOutcome::Ended(UnwindEnd::Outermost),
        stitched: false,
        space: None,
    };
    // A code object at an address nothing maps (as a freed one): unnamed.
    let python = [PythonFrame {
        code: 0x10,
        instr_offset: 0,
        first_line: 3,
    }];
    let mut codes = CodeCache::new(
        std::process::id(),
        Layout::of((3, 12)).expect("a layout for 3.12"),
    );
    for cut in [true, false] {
        aggregator.add_with_python(
            &header,
            &[],
            Some(&walk),
            records.labels_of(header.tgid),
            Some(PythonSample {
                frames: &python,
                cut,
                eval: std::slice::from_ref(&eval),
                codes: &mut codes,
            }),
            SampleWeight::Tick,
        );
    }
    let stats = aggregator.stats();
    assert_eq!(stats.python_cut, 1);
    assert_eq!((stats.python_unreadable, stats.python_stale), (2, 0));
    let interval = aggregator.finish_interval(SystemTime::now());
    let user_key = |module: &ModuleFile| MappingKey::User {
        id: *module.id,
        path: module.path().shipped_name(),
    };
    let python_key = |function: &str| MappingKey::Python {
        function: function.into(),
        file: "".into(),
    };
    let stacks: Vec<_> = flatten(&interval)
        .into_iter()
        .map(|(frames, _, count)| {
            assert_eq!(count, 1);
            frames
        })
        .collect();
    let whole = vec![
        (user_key(&libc), 0x9_1234, false),
        (python_key(UNNAMED_PYTHON), 0, false),
        (user_key(&own), 0x1_8000, true),
    ];
    let mut cut = whole.clone();
    cut.insert(2, (python_key(PYTHON_NOT_READ), 0, false));
    assert_eq!(stacks.len(), 2, "{stacks:#?}");
    assert!(stacks.contains(&cut), "{stacks:#?}");
    assert!(stacks.contains(&whole), "{stacks:#?}");
}
