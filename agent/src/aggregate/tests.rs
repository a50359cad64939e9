use std::{collections::HashSet, io::Write as _, time::UNIX_EPOCH};

use agent_common::{RecordKind, sample_flags};
use stackscope_process_table::{Location, ProcessTable};
use stackscope_proto::v1;
use stackscope_unwind::UnwindEnd;

use super::*;
use stackscope_symbolize::node::{Symbolizer, SymbolizerConfig};
use stackscope_unwind::walker::WalkOutcome;

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

/// Two real module files of this test process: its own executable and
/// the C library.
fn module_files() -> (Arc<ModuleFile>, Arc<ModuleFile>) {
    let mut table = ProcessTable::default();
    let pid = std::process::id();
    let mut module = |address: u64| match table.lookup(pid, address) {
        Ok(Some(Location::Object(object))) => Arc::new(ModuleFile {
            id: object.id,
            region: object.region,
        }),
        other => panic!("{address:#x} is not in a file: {other:?}"),
    };
    let own = module(module_files as fn() -> _ as usize as u64);
    let libc = module(libc::getpid as unsafe extern "C" fn() -> libc::pid_t as usize as u64);
    assert_ne!(own.id, libc.id, "two different objects");
    (own, libc)
}

fn header(tgid: u32, comm: &str, user: bool) -> SampleHeader {
    let mut name = [0u8; COMM_LEN];
    name[..comm.len()].copy_from_slice(comm.as_bytes());
    SampleHeader {
        kind: RecordKind::Sample as u32,
        flags: if user { sample_flags::USER_REGS } else { 0 },
        tgid,
        tid: tgid,
        cpu: 0,
        kernel_stack_len: 0,
        user_stack_len: 0,
        sampling_divisor: 1,
        ktime_ns: 0,
        cgroup_id: 0,
        user_rip: 0,
        user_rsp: 0,
        user_rbp: 0,
        comm: name,
        tail_len: 0,
        tail_spans: 0,
        process_start_ns: 0,
    }
}

fn file(module: &Arc<ModuleFile>, file_offset: u64) -> FrameObject {
    FrameObject::File {
        file: Arc::clone(module),
        file_offset,
    }
}

/// Adds one sample with user frames `objects` (innermost first).
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

fn add(
    aggregator: &mut Aggregator,
    header: &SampleHeader,
    kernel: &[u64],
    objects: &[FrameObject],
) {
    let frames = vec![0; objects.len()];
    let walk = Walk {
        frames: &frames,
        objects,
        outcome: WalkOutcome::Ended(UnwindEnd::Outermost),
        stitched: false,
        space: None,
    };
    aggregator.add_with_metadata(header, kernel, Some(&walk));
}

/// Adding a sample as the agent does with a metadata worker that answers
/// at once: the process described first, the files the sample met opened
/// after (the label sets made before an answer have their own test).
trait AddWithMetadata {
    fn add_with_metadata(&mut self, header: &SampleHeader, kernel: &[u64], user: Option<&Walk<'_>>);
}

impl AddWithMetadata for Aggregator {
    fn add_with_metadata(
        &mut self,
        header: &SampleHeader,
        kernel: &[u64],
        user: Option<&Walk<'_>>,
    ) {
        let description = self.config.describer().describe(Wanted {
            tgid: header.tgid,
            started: header.process_start_ns,
            cgroup_id: header.cgroup_id,
        });
        self.describe(vec![description]);
        self.add(header, kernel, user);
        for file in self.take_to_open() {
            let _ = file.open_now();
        }
    }
}

fn config() -> AggregatorConfig {
    AggregatorConfig {
        node_name: "node-a".into(),
        ..AggregatorConfig::default()
    }
}

/// Every sample of `interval` as (stack as (mapping key, address), labels, count).
type Flat = Vec<(Vec<(MappingKey, u64, bool)>, LabelValues, u64)>;

fn flatten(interval: &Interval) -> Flat {
    interval
        .samples
        .iter()
        .map(|sample| {
            let frames = interval
                .stacks
                .get(sample.stack as usize)
                .unwrap()
                .iter()
                .map(|&location| {
                    let location = interval.locations[location as usize];
                    let key = interval.mappings[location.mapping as usize].key.clone();
                    (key, location.address, location.return_address)
                })
                .collect();
            (
                frames,
                interval.label_sets[sample.label_set as usize].clone(),
                sample.count,
            )
        })
        .collect()
}

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
    // Met for the first time: a set of its own, and one description asked
    // for however many samples come before it.
    aggregator.add(&sample, &[], Some(&walk_of(&stack)));
    aggregator.add(&sample, &[], Some(&walk_of(&stack)));
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
    let mut describer = aggregator.config.describer();
    let descriptions = wanted.into_iter().map(|w| describer.describe(w)).collect();
    aggregator.describe(descriptions);
    assert!(!aggregator.has_pending_labels());
    // Later samples get a set of their own, equal to the first one.
    aggregator.add(&sample, &[], Some(&walk_of(&stack)));
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
    aggregator.add(&gone, &[], Some(&walk_of(&stack)));
    let wanted = aggregator.take_wanted();
    assert_eq!(wanted.len(), 1);
    let interval = aggregator.finish_interval(SystemTime::now());
    assert_eq!(interval.label_sets.len(), 1);
    assert_eq!(
        &*interval.label_sets[0].exe, "",
        "not known when the interval ended"
    );
    assert_eq!(aggregator.stats().labels_undescribed, 1);
    let mut describer = aggregator.config.describer();
    let descriptions = wanted.into_iter().map(|w| describer.describe(w)).collect();
    aggregator.describe(descriptions);
    // Its link could not be read: the next sample's set says so and needs
    // no other description.
    aggregator.add(&gone, &[], Some(&walk_of(&stack)));
    assert!(!aggregator.has_pending_labels());
    assert!(aggregator.take_wanted().is_empty());

    // One whose exec the mapping feed saw ships the exe it exec'd, even
    // undescribed.
    let execd = SampleHeader {
        process_start_ns: 23_456,
        ..header(u32::MAX - 2, "short", true)
    };
    aggregator.on_exec(execd.tgid, Some(Path::new("/usr/bin/short")));
    aggregator.add(&execd, &[], Some(&walk_of(&stack)));
    let interval = aggregator.finish_interval(SystemTime::now());
    let exes: Vec<&str> = interval.label_sets.iter().map(|set| &*set.exe).collect();
    assert!(exes.contains(&"/usr/bin/short"), "{exes:?}");
    assert_eq!(aggregator.stats().labels_undescribed, 2);
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

    let kallsyms = kallsyms();
    let batch = build_batch(
        &interval,
        &mut symbolizer(&kallsyms),
        &BatchOptions::for_frequency(19),
    );
    check_batch(&batch);
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
    aggregator.on_exec(pid, None);
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
