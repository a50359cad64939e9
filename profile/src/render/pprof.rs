//! pprof export: the gzipped `perftools.profiles.Profile` that
//! `go tool pprof`, Pyroscope, Parca and most profilers read.
//!
//! Layout:
//! - sample types `samples/count` and `cpu/nanoseconds`, values
//!   `[weight, weight × period]`; period type `cpu/nanoseconds`. The default
//!   sample type is `cpu` when the period is known, else `samples` (a cpu
//!   column of zeros would show nothing);
//! - one Sample per root-to-node path whose node has self weight, locations
//!   leaf first; weight on the root itself (empty stacks) becomes a Sample
//!   without locations;
//! - one Location per distinct chain of frames that share an instruction:
//!   a non-inlined frame together with the inlined frames below it on the
//!   path, as several Lines, innermost first — which is how pprof models
//!   inlining. Address 0: frames reach the collector symbolized, and pprof
//!   needs no address to read names;
//! - one Function per distinct (function, file);
//! - one Mapping per distinct (binary, build id), with `has_functions` set
//!   so pprof does not try to symbolize again; frames with neither (the
//!   synthetic `[truncated]`) have no mapping. The first mapping is what
//!   pprof calls the main binary (`go tool pprof` shows it as `File:`): the
//!   binary of the outermost frames that carry the most weight, leaving out
//!   pseudo-binaries such as `[kernel]` and `[vdso]`.

use std::collections::HashMap;
use std::io::Write as _;

use flate2::{Compression, write::GzEncoder};
use prost::Message as _;
use stackscope_proto::pprof::{Function, Line, Location, Mapping, Profile, Sample, ValueType};

use crate::model::{Frame, PYTHON_BINARY, ProfileType, SENT_BINARY};
use crate::tree::CallTree;

/// The tree of `profile_type`'s samples as a gzipped pprof profile; see
/// the module documentation for the layout. `sample_period_nanos` of 0
/// (unknown) gives a cpu column of zeros. `time_nanos` and
/// `duration_nanos` describe the selection's time range.
pub fn pprof(
    tree: &CallTree,
    profile_type: &ProfileType,
    sample_period_nanos: u64,
    time_nanos: i64,
    duration_nanos: i64,
) -> Vec<u8> {
    let encoded = pprof_profile(
        tree,
        profile_type,
        sample_period_nanos,
        time_nanos,
        duration_nanos,
    )
    .encode_to_vec();
    let mut gzip = GzEncoder::new(
        Vec::with_capacity(encoded.len() / 4),
        Compression::default(),
    );
    // Writing into a Vec cannot fail: gzip's only errors are its writer's.
    let written = gzip.write_all(&encoded);
    written
        .and_then(|()| gzip.finish())
        .expect("gzip into memory cannot fail")
}

/// The profile [`pprof`] encodes, before encoding and compression. CPU
/// profiles have two values per sample, `samples/count` and
/// `cpu/nanoseconds`; off-CPU ones one, `off_cpu/nanoseconds` (their
/// weights are nanoseconds already); a sent type's one, its own sample type
/// (`alloc_space/bytes`) with its weights as stored.
pub fn pprof_profile(
    tree: &CallTree,
    profile_type: &ProfileType,
    sample_period_nanos: u64,
    time_nanos: i64,
    duration_nanos: i64,
) -> Profile {
    let mut builder = ProfileBuilder::new(tree);
    let (sample_type, period_type, default_sample_type) = match profile_type {
        ProfileType::Cpu => {
            let samples_type = builder.value_type("samples", "count");
            let cpu_type = builder.value_type("cpu", "nanoseconds");
            let default = if sample_period_nanos > 0 {
                cpu_type.r#type
            } else {
                samples_type.r#type
            };
            (vec![samples_type, cpu_type], cpu_type, default)
        }
        ProfileType::OffCpu => {
            let off_cpu = builder.value_type(profile_type.name(), "nanoseconds");
            (vec![off_cpu], off_cpu, off_cpu.r#type)
        }
        ProfileType::Sent(id) => {
            let (kind, unit) = id.sample_type();
            let sample = builder.value_type(kind, unit);
            let (kind, unit) = id.period_type();
            (vec![sample], builder.value_type(kind, unit), sample.r#type)
        }
    };
    let period = clamp(sample_period_nanos);

    let mut samples = Vec::new();
    for (index, node) in tree.nodes().iter().enumerate() {
        if node.self_weight() == 0 {
            continue;
        }
        let location_id = builder.locations_of_path(index);
        let nanos = clamp(node.self_weight().saturating_mul(sample_period_nanos));
        samples.push(Sample {
            location_id,
            value: match profile_type {
                ProfileType::Cpu => vec![clamp(node.self_weight()), nanos],
                ProfileType::OffCpu => vec![nanos],
                ProfileType::Sent(_) => vec![clamp(node.self_weight())],
            },
            label: Vec::new(),
        });
    }

    builder.put_main_mapping_first();
    Profile {
        sample_type,
        sample: samples,
        mapping: builder.mappings,
        location: builder.locations,
        function: builder.functions,
        string_table: builder.strings,
        drop_frames: 0,
        keep_frames: 0,
        time_nanos,
        duration_nanos,
        period_type: Some(period_type),
        period,
        comment: Vec::new(),
        default_sample_type,
    }
}

/// pprof values are signed; weights beyond `i64::MAX` saturate.
fn clamp(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

struct ProfileBuilder<'t> {
    tree: &'t CallTree,
    /// Per node: the node where its location chain starts (itself unless it
    /// is inlined into a non-root parent).
    chain_start: Vec<usize>,
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    functions: Vec<Function>,
    function_ids: HashMap<(&'t str, &'t str), u64>,
    mappings: Vec<Mapping>,
    mapping_ids: HashMap<(&'t str, &'t str), u64>,
    locations: Vec<Location>,
    location_ids: HashMap<Vec<&'t Frame>, u64>,
    /// Location per (chain start, chain end) node pair, so each pair's
    /// frames are collected once.
    chain_locations: HashMap<(usize, usize), u64>,
}

impl<'t> ProfileBuilder<'t> {
    fn new(tree: &'t CallTree) -> Self {
        let nodes = tree.nodes();
        let mut chain_start = Vec::with_capacity(nodes.len());
        for (index, node) in nodes.iter().enumerate() {
            // Parents come first, so the parent's chain start is known.
            let start = match node.parent() {
                Some(parent) if parent != 0 && node.frame().inlined => chain_start[parent],
                _ => index,
            };
            chain_start.push(start);
        }
        ProfileBuilder {
            tree,
            chain_start,
            // pprof requires string_table[0] = "".
            strings: vec![String::new()],
            string_ids: HashMap::from([(String::new(), 0)]),
            functions: Vec::new(),
            function_ids: HashMap::new(),
            mappings: Vec::new(),
            mapping_ids: HashMap::new(),
            locations: Vec::new(),
            location_ids: HashMap::new(),
            chain_locations: HashMap::new(),
        }
    }

    fn string(&mut self, text: &str) -> i64 {
        if let Some(&id) = self.string_ids.get(text) {
            return id;
        }
        let id = self.strings.len() as i64;
        self.strings.push(text.to_string());
        self.string_ids.insert(text.to_string(), id);
        id
    }

    fn value_type(&mut self, r#type: &str, unit: &str) -> ValueType {
        ValueType {
            r#type: self.string(r#type),
            unit: self.string(unit),
        }
    }

    fn function(&mut self, frame: &'t Frame) -> u64 {
        let key = (frame.function.as_str(), frame.file.as_str());
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let name = self.string(&frame.function);
        let filename = self.string(&frame.file);
        // A Python function (named on the node, or by an SDK) has no
        // linker name. pprof rewrites a function whose system name is its
        // name as if it were a demangled C++ one and would erase `<module>`
        // or `<lambda>` as template parameters.
        let system_name = if frame.binary == PYTHON_BINARY || frame.binary == SENT_BINARY {
            self.string("")
        } else {
            name
        };
        self.functions.push(Function {
            id,
            name,
            system_name,
            filename,
            start_line: 0,
        });
        self.function_ids.insert(key, id);
        id
    }

    /// Makes the main binary's mapping the first (see the module
    /// documentation): ids are positions, so it swaps places, and ids,
    /// with the mapping that was first.
    fn put_main_mapping_first(&mut self) {
        let tree: &'t CallTree = self.tree;
        let nodes = tree.nodes();
        let mut weights: HashMap<(&str, &str), u64> = HashMap::new();
        for child in tree.children(0) {
            let frame = nodes[child].frame();
            if frame.binary.is_empty() || frame.binary.starts_with('[') {
                continue;
            }
            *weights
                .entry((frame.binary.as_str(), frame.build_id.as_str()))
                .or_default() += nodes[child].total();
        }
        let main = weights
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
            .and_then(|(key, _)| self.mapping_ids.get(&key).copied());
        let Some(main) = main.filter(|&id| id > 1) else {
            return;
        };
        self.mappings.swap(0, main as usize - 1);
        self.mappings[0].id = 1;
        self.mappings[main as usize - 1].id = main;
        for location in &mut self.locations {
            location.mapping_id = match location.mapping_id {
                1 => main,
                id if id == main => 1,
                id => id,
            };
        }
    }

    fn mapping(&mut self, frame: &'t Frame) -> u64 {
        if frame.binary.is_empty() && frame.build_id.is_empty() {
            return 0;
        }
        let key = (frame.binary.as_str(), frame.build_id.as_str());
        if let Some(&id) = self.mapping_ids.get(&key) {
            return id;
        }
        let id = self.mappings.len() as u64 + 1;
        let filename = self.string(&frame.binary);
        let build_id = self.string(&frame.build_id);
        self.mappings.push(Mapping {
            id,
            memory_start: 0,
            memory_limit: 0,
            file_offset: 0,
            filename,
            build_id,
            has_functions: true,
            has_filenames: false,
            has_line_numbers: false,
            has_inline_frames: false,
        });
        self.mapping_ids.insert(key, id);
        id
    }

    /// The location of the chain from node `start` down to node `end` (an
    /// ancestor-or-self of `end` in the same chain).
    fn location(&mut self, start: usize, end: usize) -> u64 {
        if let Some(&id) = self.chain_locations.get(&(start, end)) {
            return id;
        }
        let tree: &'t CallTree = self.tree;
        let nodes = tree.nodes();
        // Innermost first, as pprof orders a location's lines.
        let mut frames: Vec<&'t Frame> = vec![nodes[end].frame()];
        let mut current = end;
        while current != start {
            match nodes[current].parent() {
                Some(parent) => current = parent,
                None => break,
            }
            frames.push(nodes[current].frame());
        }
        let id = match self.location_ids.get(&frames) {
            Some(&id) => id,
            None => {
                let id = self.locations.len() as u64 + 1;
                let outer = frames[frames.len() - 1];
                let mapping_id = self.mapping(outer);
                let line = frames
                    .iter()
                    .map(|frame| Line {
                        function_id: self.function(frame),
                        line: i64::from(frame.line),
                    })
                    .collect();
                if let Some(mapping) = mapping_id
                    .checked_sub(1)
                    .and_then(|index| self.mappings.get_mut(index as usize))
                {
                    mapping.has_filenames |= frames.iter().any(|f| !f.file.is_empty());
                    mapping.has_line_numbers |= frames.iter().any(|f| f.line > 0);
                    mapping.has_inline_frames |= frames.len() > 1;
                }
                self.locations.push(Location {
                    id,
                    mapping_id,
                    address: 0,
                    line,
                    is_folded: false,
                });
                self.location_ids.insert(frames, id);
                id
            }
        };
        self.chain_locations.insert((start, end), id);
        id
    }

    /// Location ids of the path from the root to `index`, leaf first.
    fn locations_of_path(&mut self, index: usize) -> Vec<u64> {
        let mut ids = Vec::new();
        let mut end = index;
        while end != 0 {
            let start = self.chain_start[end];
            ids.push(self.location(start, end));
            match self.tree.nodes()[start].parent() {
                Some(parent) => end = parent,
                None => break,
            }
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;
    use std::process::Command;
    use std::sync::Arc;

    use super::*;
    use crate::model::{StackSamples, WeightedStack};
    use crate::tree::tests::{frame, tree};

    fn decode(bytes: &[u8]) -> Profile {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut raw)
            .expect("pprof output is gzip");
        Profile::decode(raw.as_slice()).expect("pprof output is a Profile")
    }

    fn string(profile: &Profile, id: i64) -> &str {
        &profile.string_table[id as usize]
    }

    /// Each sample as (leaf-first function names, one string per location
    /// with its lines joined by `+`, innermost first; values).
    fn samples(profile: &Profile) -> Vec<(Vec<String>, Vec<i64>)> {
        profile
            .sample
            .iter()
            .map(|sample| {
                let names = sample
                    .location_id
                    .iter()
                    .map(|&id| {
                        let location = &profile.location[id as usize - 1];
                        assert_eq!(location.id, id);
                        location
                            .line
                            .iter()
                            .map(|line| {
                                let function = &profile.function[line.function_id as usize - 1];
                                format!("{}:{}", string(profile, function.name), line.line)
                            })
                            .collect::<Vec<_>>()
                            .join("+")
                    })
                    .collect();
                (names, sample.value.clone())
            })
            .collect()
    }

    fn located(function: &str, binary: &str, file: &str, line: u32, inlined: bool) -> Arc<Frame> {
        Arc::new(Frame {
            function: function.into(),
            binary: binary.into(),
            build_id: format!("{binary}-id"),
            file: file.into(),
            line,
            inlined,
            unnamed_code: None,
        })
    }

    #[test]
    fn the_main_binary_is_the_first_mapping() {
        // The first location made is the vDSO's (the first sample's leaf);
        // the program's binary holds the outermost frames of most weight.
        let samples = crate::tree::tests::samples(&[
            (
                &[
                    ("__vdso_clock_gettime", "[vdso]"),
                    ("clock_gettime", "libc.so.6"),
                    ("main", "app"),
                    ("_start", "app"),
                ],
                5,
            ),
            (
                &[("memcpy", "libc.so.6"), ("main", "app"), ("_start", "app")],
                3,
            ),
            (&[("start_thread", "libc.so.6")], 1),
            (&[("worker", "[kernel]")], 9),
        ]);
        let profile = decode(&pprof(
            &CallTree::from_stacks(&samples),
            &ProfileType::Cpu,
            0,
            0,
            0,
        ));
        let names: Vec<(u64, &str)> = profile
            .mapping
            .iter()
            .map(|m| (m.id, string(&profile, m.filename)))
            .collect();
        assert_eq!(names[0], (1, "app"), "{names:?}");
        for (index, mapping) in profile.mapping.iter().enumerate() {
            assert_eq!(mapping.id, index as u64 + 1, "ids are positions");
        }
        // Every location still points at its own binary.
        for location in &profile.location {
            let function = &profile.function[location.line[0].function_id as usize - 1];
            let binary = string(
                &profile,
                profile.mapping[location.mapping_id as usize - 1].filename,
            );
            let expected = match string(&profile, function.name) {
                "__vdso_clock_gettime" => "[vdso]",
                "clock_gettime" | "memcpy" | "start_thread" => "libc.so.6",
                "worker" => "[kernel]",
                _ => "app",
            };
            assert_eq!(binary, expected);
        }
    }

    #[test]
    fn header_and_values() {
        let tree = tree(&[("main;a;b", 3), ("main;a", 2), ("main;c", 5)]);
        let profile = decode(&pprof(
            &tree,
            &ProfileType::Cpu,
            10_000_000,
            1_700_000_000_000_000_000,
            60_000_000_000,
        ));
        assert_eq!(profile.string_table[0], "");
        let types: Vec<(&str, &str)> = profile
            .sample_type
            .iter()
            .map(|t| (string(&profile, t.r#type), string(&profile, t.unit)))
            .collect();
        assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
        let period_type = profile.period_type.as_ref().unwrap();
        assert_eq!(string(&profile, period_type.r#type), "cpu");
        assert_eq!(string(&profile, period_type.unit), "nanoseconds");
        assert_eq!(profile.period, 10_000_000);
        assert_eq!(string(&profile, profile.default_sample_type), "cpu");
        assert_eq!(profile.time_nanos, 1_700_000_000_000_000_000);
        assert_eq!(profile.duration_nanos, 60_000_000_000);

        let s = |names: &[&str], values: [i64; 2]| {
            (
                names.iter().map(|n| format!("{n}:0")).collect::<Vec<_>>(),
                values.to_vec(),
            )
        };
        assert_eq!(
            samples(&profile),
            [
                s(&["a", "main"], [2, 20_000_000]),
                s(&["b", "a", "main"], [3, 30_000_000]),
                s(&["c", "main"], [5, 50_000_000]),
            ]
        );
        // Locations, functions and the one mapping are shared.
        assert_eq!(profile.location.len(), 4);
        assert_eq!(profile.function.len(), 4);
        assert_eq!(profile.mapping.len(), 1);
        let mapping = &profile.mapping[0];
        assert_eq!(mapping.id, 1);
        assert_eq!(string(&profile, mapping.filename), "app");
        assert_eq!(string(&profile, mapping.build_id), "");
        assert!(mapping.has_functions);
        assert!(!mapping.has_inline_frames);
    }

    #[test]
    fn an_off_cpu_profile_has_one_value_in_nanoseconds() {
        // Weights of off-CPU samples are nanoseconds blocked (period 1).
        let tree = tree(&[("main;read", 7_000), ("main;sleep", 3_000)]);
        let profile = decode(&pprof(&tree, &ProfileType::OffCpu, 1, 0, 0));
        let types: Vec<(&str, &str)> = profile
            .sample_type
            .iter()
            .map(|t| (string(&profile, t.r#type), string(&profile, t.unit)))
            .collect();
        assert_eq!(types, [("off_cpu", "nanoseconds")]);
        assert_eq!(string(&profile, profile.default_sample_type), "off_cpu");
        assert_eq!(profile.period, 1);
        let values: Vec<Vec<i64>> = samples(&profile).into_iter().map(|(_, v)| v).collect();
        assert_eq!(values, [vec![7_000], vec![3_000]]);
    }

    #[test]
    fn unknown_period_defaults_to_samples() {
        let profile = decode(&pprof(&tree(&[("main", 4)]), &ProfileType::Cpu, 0, 0, 0));
        assert_eq!(profile.period, 0);
        assert_eq!(string(&profile, profile.default_sample_type), "samples");
        assert_eq!(profile.sample[0].value, [4, 0]);
    }

    #[test]
    fn inlined_frames_share_their_callers_location() {
        // Leaf first: helper2 and helper are inlined into work; work is
        // called by main. memcpy (libc) is called from helper2.
        let main = located("main", "app", "main.c", 10, false);
        let work = located("work", "app", "work.c", 20, false);
        let helper = located("helper", "app", "util.h", 30, true);
        let helper2 = located("helper2", "app", "util.h", 40, true);
        let memcpy = located("memcpy", "libc.so.6", "", 0, false);
        let stacks = vec![
            WeightedStack {
                frames: vec![helper2.clone(), helper.clone(), work.clone(), main.clone()],
                weight: 4,
            },
            WeightedStack {
                frames: vec![memcpy, helper2, helper, work.clone(), main.clone()],
                weight: 6,
            },
            WeightedStack {
                frames: vec![work, main],
                weight: 1,
            },
        ];
        let tree = CallTree::from_stacks(&StackSamples {
            stacks,
            sample_period_nanos: 1,
        });
        let profile = decode(&pprof(&tree, &ProfileType::Cpu, 1, 0, 0));
        let sample = |names: &[&str], weight: i64| {
            (
                names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
                vec![weight, weight],
            )
        };
        assert_eq!(
            samples(&profile),
            [
                sample(&["work:20", "main:10"], 1),
                sample(&["helper2:40+helper:30+work:20", "main:10"], 4),
                sample(&["memcpy:0", "helper2:40+helper:30+work:20", "main:10"], 6),
            ]
        );
        // Functions are per (name, file): helper and helper2 share util.h
        // but not a name.
        let functions: Vec<(&str, &str)> = profile
            .function
            .iter()
            .map(|f| (string(&profile, f.name), string(&profile, f.filename)))
            .collect();
        assert_eq!(
            functions,
            [
                ("work", "work.c"),
                ("main", "main.c"),
                ("helper2", "util.h"),
                ("helper", "util.h"),
                ("memcpy", ""),
            ]
        );
        let mappings: Vec<(&str, &str, bool, bool, bool)> = profile
            .mapping
            .iter()
            .map(|m| {
                (
                    string(&profile, m.filename),
                    string(&profile, m.build_id),
                    m.has_filenames,
                    m.has_line_numbers,
                    m.has_inline_frames,
                )
            })
            .collect();
        assert_eq!(
            mappings,
            [
                ("app", "app-id", true, true, true),
                ("libc.so.6", "libc.so.6-id", false, false, false),
            ]
        );
        let memcpy_location = profile.sample[2].location_id[0] as usize - 1;
        assert_eq!(profile.location[memcpy_location].mapping_id, 2);
    }

    #[test]
    fn empty_stacks_and_empty_trees() {
        let profile = decode(&pprof(
            &tree(&[("", 2), ("main", 1)]),
            &ProfileType::Cpu,
            5,
            0,
            0,
        ));
        assert_eq!(
            samples(&profile),
            [
                (vec![], vec![2, 10]),
                (vec!["main:0".to_string()], vec![1, 5])
            ]
        );
        let empty = decode(&pprof(&CallTree::default(), &ProfileType::Cpu, 5, 0, 0));
        assert!(empty.sample.is_empty());
        assert!(empty.location.is_empty());
        assert_eq!(empty.sample_type.len(), 2);
    }

    /// The real reader: `go tool pprof -top` must list the functions with
    /// their flat (self) weights.
    #[test]
    #[ignore = "needs go (cargo xtask setup installs golang-go): run by `cargo xtask test`"]
    fn go_tool_pprof_reads_it() {
        let tree = CallTree::from_stacks(&StackSamples {
            stacks: vec![
                WeightedStack {
                    frames: vec![
                        located("hot_loop", "app", "hot.c", 12, false),
                        located("main", "app", "main.c", 3, false),
                    ],
                    weight: 70,
                },
                WeightedStack {
                    frames: vec![
                        located("inlined_leaf", "app", "hot.c", 40, true),
                        located("cold_path", "app", "cold.c", 8, false),
                        located("main", "app", "main.c", 4, false),
                    ],
                    weight: 20,
                },
                WeightedStack {
                    frames: vec![
                        frame("memcpy", "libc.so.6"),
                        located("main", "app", "main.c", 5, false),
                    ],
                    weight: 5,
                },
                // Python's names in angle brackets, which pprof takes for
                // C++ templates (and removes) unless told they are names.
                WeightedStack {
                    frames: vec![
                        located("<lambda>", PYTHON_BINARY, "app.py", 3, false),
                        located("<module>", PYTHON_BINARY, "app.py", 1, false),
                        located("main", "app", "main.c", 6, false),
                    ],
                    weight: 5,
                },
            ],
            sample_period_nanos: 10_000_000,
        });
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("profile.pb.gz");
        std::fs::write(
            &path,
            pprof(&tree, &ProfileType::Cpu, 10_000_000, 0, 1_000_000_000),
        )
        .unwrap();

        let output = Command::new("go")
            // Symbolization as a user gets it: pprof's name heuristics on.
            .args(["tool", "pprof", "-top", "-sample_index=samples"])
            .arg(&path)
            .env("HOME", dir.path())
            .env("GOPATH", dir.path().join("gopath"))
            .env("GOCACHE", dir.path().join("gocache"))
            .env("PPROF_TMPDIR", dir.path())
            .env("GOTOOLCHAIN", "local")
            .env("GOFLAGS", "")
            .output();
        let output = match output {
            Ok(output) => output,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => panic!(
                "`go` is not installed: this test runs `go tool pprof` on the export; \
                 run `cargo xtask setup` (it installs Debian's golang-go)"
            ),
            Err(err) => panic!("running `go tool pprof`: {err}"),
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "go tool pprof failed ({}):\n{stderr}\n{stdout}",
            output.status
        );
        assert!(
            stdout.lines().any(|line| line == "File: app"),
            "the main binary is the program's:\n{stdout}"
        );
        // Rows look like `  flat  flat%   sum%   cum   cum%  name`, where
        // the name of a function seen only inlined ends in ` (inline)`.
        let rows: Vec<Vec<&str>> = stdout
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .filter(|fields| fields.len() >= 6 && fields[1].ends_with('%'))
            .collect();
        let row = |name: &str| {
            rows.iter()
                .find(|fields| fields[5..].join(" ") == name)
                .unwrap_or_else(|| panic!("{name} missing from go tool pprof -top:\n{stdout}"))
                .clone()
        };
        assert_eq!(row("hot_loop")[..3], ["70", "70.00%", "70.00%"], "{stdout}");
        assert_eq!(
            row("inlined_leaf (inline)")[..2],
            ["20", "20.00%"],
            "{stdout}"
        );
        assert_eq!(row("memcpy")[..2], ["5", "5.00%"], "{stdout}");
        assert_eq!(row("<lambda>")[..2], ["5", "5.00%"], "{stdout}");
        assert_eq!(row("<module>")[3..5], ["5", "5.00%"], "{stdout}");
        assert_eq!(row("main")[..2], ["0", "0%"], "{stdout}");
        assert_eq!(row("main")[3..5], ["100", "100%"], "{stdout}");
        assert_eq!(row("cold_path")[3..5], ["20", "20.00%"], "{stdout}");
        assert!(stdout.contains("Type: samples"), "{stdout}");
    }
}
