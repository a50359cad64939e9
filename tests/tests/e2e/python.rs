//! End to end: the sampler reads CPython's frames at each tick (issue 33),
//! for every CPython version on this machine that the profiler reads:
//! pyenv's 3.10, 3.11, 3.12 and 3.13 (libpython shared) and Debian's
//! python3.11 (libpython linked into a stripped executable). 3.10 differs
//! in what users see: each Python call goes through C (its native frames
//! stay between the Python ones), and code objects have no qualified
//! names (`run`, not `Thread.run`). Each runs
//! `python_chain.py` (`<module>` -> `outer` -> `middle` -> `leaf`, spinning
//! in `leaf`); the interpreter is found in the process's mappings, the
//! sampler told how to walk it, and every frame of every Python stack is
//! named from the process's code objects, checked against the exact chain
//! with `leaf`'s line. Versions not installed are skipped, and said so.
//! The agent finds each interpreter itself and ships the Python functions
//! in place of the evaluation loop's frames, through a real collector; so
//! too for an interpreter that exists only inside a container's image.
//! A Python process started on a quiet host, whose drains the agent paces,
//! wakes the agent with its first tick and is read from its first moments.
//! asyncio tasks read their coroutines in order below the event loop. A
//! recursion deeper than the sampler reads is marked where its read
//! stopped. And a C program that pretends to be CPython 3.12, its frame chain a
//! cycle over garbage, costs a bounded walk and names nothing.
//! Needs root.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use agent_common::{MAX_PYTHON_FRAMES, PythonFrame, python_stack_flags, sample_flags};
use stackscope_agent::aggregate::{PYTHON_NOT_READ, UNNAMED_PYTHON};
use stackscope_python::{CodeObject, FoundInterpreter, code::ProcessMemory, find_in_process};
use stackscope_sampler::SamplerConfig;
use stackscope_test_fixtures::containers::{Container, Image};
use stackscope_tests::debian_python::debian_pythons;
use stackscope_tests::{
    Collector, Fixture, Recorded, RunningProcess, TempCgroup, cpu_time, exclusive, fixture_source,
    folded, require_root, run_agent_for, sample_python, wait_success, workspace_binary,
};

/// The line `leaf` spins on in `python_chain.py`.
const LEAF_LINE: u32 = 9;

/// The chain every Python stack of the fixture must name, innermost first.
const CHAIN: [&str; 4] = ["leaf", "middle", "outer", "<module>"];

/// An interpreter tried: a name for the report, the program, its version.
struct Python {
    name: String,
    program: PathBuf,
    version: (u8, u8),
}

impl Python {
    /// Before 3.11 every Python call goes through C: native frames come
    /// between a function and the one it calls.
    fn calls_through_c(&self) -> bool {
        self.version < (3, 11)
    }

    /// What a function named `qualname` is called in this version's
    /// profiles: before 3.11 code objects carry only the last part.
    fn named<'a>(&self, qualname: &'a str) -> &'a str {
        if self.version < (3, 11) {
            qualname.rsplit('.').next().unwrap_or(qualname)
        } else {
            qualname
        }
    }

    /// `chain` (function names, in calling order) appears in `frames` in
    /// that order: contiguous from 3.11 on, with native frames between
    /// before.
    fn reads_chain(&self, frames: &[&str], chain: &[&str]) -> bool {
        if self.calls_through_c() {
            frames
                .iter()
                .filter(|frame| chain.contains(frame))
                .eq(chain.iter())
        } else {
            frames.windows(chain.len()).any(|w| w == chain)
        }
    }
}

/// The interpreters tried and installed. Those not installed are skipped,
/// and said so.
fn interpreters() -> Vec<Python> {
    let pyenv = |name: &str, version: &str, program: &str, minor| Python {
        name: name.into(),
        program: PathBuf::from(format!("/root/.pyenv/versions/{version}/bin/{program}")),
        version: (3, minor),
    };
    let all = [
        pyenv("pyenv 3.10.13", "3.10.13", "python3.10", 10),
        pyenv("pyenv 3.11.7", "3.11.7", "python3.11", 11),
        pyenv("pyenv 3.12.1", "3.12.1", "python3.12", 12),
        pyenv("pyenv 3.13.0", "3.13.0", "python3.13", 13),
        Python {
            name: "Debian python3.11".into(),
            program: PathBuf::from("/usr/bin/python3.11"),
            version: (3, 11),
        },
    ];
    let installed: Vec<_> = all
        .into_iter()
        .filter(|Python { name, program, .. }| {
            let present = program.exists();
            if !present {
                eprintln!(
                    "python frames: {name} skipped: {} is not installed",
                    program.display()
                );
            }
            present
        })
        .collect();
    assert!(
        !installed.is_empty(),
        "no CPython 3.10-3.13 on this machine"
    );
    installed
}

/// One interpreter of each version, Debian's 3.11 before pyenv's (what
/// users run): for the tests of what the agent makes of a version's frames,
/// which the builds of one version share (finding the interpreter in each
/// build is the chain tests' part).
fn one_per_version() -> Vec<Python> {
    let mut chosen: Vec<Python> = Vec::new();
    for python in interpreters().into_iter().rev() {
        if !chosen.iter().any(|kept| kept.version == python.version) {
            chosen.push(python);
        }
    }
    chosen.reverse();
    chosen
}

/// `program` running the fixture `script` with `args`, once it says ready.
fn start_script(program: &Path, script: &str, args: &[&str]) -> RunningProcess {
    RunningProcess::start_ready(
        Command::new(program)
            .arg(fixture_source(script))
            .args(args)
            .env_clear(),
    )
}

fn start_chain(program: &Path) -> RunningProcess {
    start_script(program, "python_chain.py", &[])
}

/// Every interpreter runs the chain at once, sampled by one sampler (one
/// load of the program: seconds in the kernel matrix's emulated machines)
/// for 8 s: about 300 samples each on two CPUs, at least 100 when half
/// of them goes to other tests.
#[test]
fn the_sampler_reads_every_cpython_versions_frames_in_order() {
    require_root();
    let _serial = exclusive();
    let pythons = interpreters();
    let running: Vec<_> = pythons
        .iter()
        .map(|python| {
            let process = start_chain(&python.program);
            let found = find_in_process(Path::new("/proc"), process.pid())
                .unwrap_or_else(|err| panic!("{}: {err}", python.name))
                .unwrap_or_else(|| panic!("{}: no interpreter found in its mappings", python.name));
            assert_eq!(found.layout.version, python.version, "{}", python.name);
            (process, found)
        })
        .collect();
    let pids: Vec<u32> = running.iter().map(|(process, _)| process.pid()).collect();
    let config = SamplerConfig {
        frequency_hz: 99,
        pids: pids.clone(),
        ..SamplerConfig::default()
    };
    // The entries name each process by its start time, as its samples do.
    let recorded = sample_python(&config, Duration::from_secs(8), &pids, |tgid, started| {
        let (_, found) = &running[pids.iter().position(|&pid| pid == tgid).unwrap()];
        found.layout.sampler_entry(found.runtime, started)
    });
    for (python, (process, found)) in pythons.iter().zip(&running) {
        check_chain(python, process.pid(), found, &recorded);
    }
}

/// Checks the Python stacks `recorded` of process `pid`, `python` running
/// `python_chain.py`: each names the chain, `leaf` at its line.
fn check_chain(python: &Python, pid: u32, found: &FoundInterpreter, recorded: &Recorded) {
    let name = &python.name;
    let samples = recorded
        .samples
        .iter()
        .filter(|s| s.header.tgid == pid)
        .count();
    let memory = ProcessMemory { pid };
    let mut codes: HashMap<(u64, u32), CodeObject> = HashMap::new();
    let mut exact = 0;
    let mut misses = Vec::new();
    let stacks: Vec<_> = recorded
        .python_stacks
        .iter()
        .filter(|stack| stack.header.tgid == pid)
        .collect();
    for stack in &stacks {
        assert_eq!(stack.header.flags & python_stack_flags::TRUNCATED, 0);
        let mut named = Vec::new();
        let mut leaf_line = None;
        for frame in &stack.frames {
            let first_line = frame.first_line & !PythonFrame::ENTRY;
            let code = codes.entry((frame.code, first_line)).or_insert_with(|| {
                CodeObject::read(&memory, &found.layout, frame.code, first_line)
                    .unwrap_or_else(|err| panic!("{name}: code object {:#x}: {err}", frame.code))
            });
            if named.is_empty() {
                leaf_line = code.line_of(frame.instr_offset);
            }
            named.push((
                code.qualname.clone(),
                frame.first_line & PythonFrame::ENTRY != 0,
            ));
        }
        let names: Vec<&str> = named.iter().map(|(n, _)| &**n).collect();
        // A read that fails (the frame's page not mapped at that instant)
        // ends the stack early and says so: what was read is still right.
        let read_failed = stack.header.flags & python_stack_flags::READ_FAILED != 0;
        assert!(
            if read_failed {
                CHAIN.starts_with(&names)
            } else {
                names == CHAIN
            },
            "{name}: a Python stack {names:?} (flags {:#x})",
            stack.header.flags
        );
        if read_failed {
            misses.push(describe_tick(recorded, stack, pid));
            continue;
        }
        // One activation of the evaluation loop, entered at <module>; one
        // each before 3.11.
        let entries: Vec<bool> = named.iter().map(|(_, entry)| *entry).collect();
        let expected = if python.calls_through_c() {
            [true; 4]
        } else {
            [false, false, false, true]
        };
        assert_eq!(entries, expected, "{name}: entry marks");
        assert!(
            leaf_line.is_some_and(|line| line.abs_diff(LEAF_LINE) <= 1),
            "{name}: leaf at line {leaf_line:?}"
        );
        exact += 1;
    }
    let file = codes
        .values()
        .find(|code| &*code.qualname == "leaf")
        .map(|code| code.filename.clone());
    for miss in &misses {
        eprintln!("python frames: {name}: a read failed: {miss}");
    }
    eprintln!(
        "python frames: {name} ({}, _PyRuntime at {:#x}): {exact} of {samples} samples carried the \
         exact chain; leaf in {file:?}; the run's counters (every interpreter) {} stacks, {} \
         frames, BPF {:?} per run (cargo xtask bench sampler compares it without the Python walk)",
        found.path.display(),
        found.runtime,
        recorded.counters.python_stacks,
        recorded.counters.python_frames,
        recorded.program.per_run().unwrap_or_default(),
    );
    assert!(samples >= 100, "{name}: only {samples} samples");
    assert!(
        exact * 100 >= samples * 99,
        "{name}: {exact} of {samples} samples carried the exact Python chain"
    );
    // Through the learned thread's stack top (see `sample_python`): the
    // one lookup its ticks make says they read the Python frames.
    let at_top = recorded
        .samples
        .iter()
        .filter(|s| s.header.tid == pid && s.header.flags & sample_flags::COPY_AT_TOP != 0)
        .count();
    assert!(
        at_top * 10 >= samples * 9,
        "{name}: {at_top} of {samples} samples copied up to the stack top"
    );
    assert!(
        file.is_some_and(|file| file.ends_with("python_chain.py")),
        "{name}: leaf's file"
    );
}

/// Where the thread was at a Python stack's tick, from the CPU sample
/// recorded at the same tick: its user instruction pointer and the mapping
/// that holds it, and how deep in the kernel it was.
fn describe_tick(
    recorded: &Recorded,
    stack: &stackscope_tests::PythonStackRecord,
    pid: u32,
) -> String {
    let Some(sample) = recorded
        .samples
        .iter()
        .filter(|sample| sample.header.tid == stack.header.tid)
        .min_by_key(|sample| sample.header.ktime_ns.abs_diff(stack.header.ktime_ns))
    else {
        return "no sample of its thread".into();
    };
    let rip = sample.header.user_rip;
    let mapping = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .find(|line| {
            line.split(['-', ' '])
                .take(2)
                .map(|part| u64::from_str_radix(part, 16).unwrap_or(0))
                .collect::<Vec<_>>()
                .as_slice()
                .get(..2)
                .is_some_and(|range| (range[0]..range[1]).contains(&rip))
        })
        .map(str::to_owned)
        .unwrap_or_else(|| "no mapping".into());
    format!(
        "its tick's sample {} ns away: user ip {rip:#x} in {mapping:?}, {} kernel frames, \
         user stack {} bytes",
        sample.header.ktime_ns.abs_diff(stack.header.ktime_ns),
        sample.kernel_frames.len(),
        sample.user_stack.len()
    )
}

#[test]
fn the_agent_ships_python_functions_in_place_of_the_evaluation_loop() {
    require_root();
    let _serial = exclusive();
    let pythons = interpreters();
    let run = profile_scripts(&pythons, "python_chain.py", &[]);
    let aggregation = &run.report["aggregation"];
    eprintln!(
        "python frames: agent on {} interpreters at once: python frames named {}, stale {}, \
         unreadable {}, activations unplaced {}",
        pythons.len(),
        aggregation["python_named"],
        aggregation["python_stale"],
        aggregation["python_unreadable"],
        aggregation["python_unplaced"]
    );
    assert_chained(&pythons, &run);
}

/// What one agent run shipped (see [`profile_with_agent`]).
struct AgentRun {
    /// Each process's stacks, folded, in the order of the pids.
    stacks: Vec<Vec<(String, u64)>>,
    /// What each process's CPU time during the run would give in samples
    /// at 199 Hz (the run's start-up and end included).
    cpu_samples: Vec<u64>,
    report: serde_json::Value,
}

/// One agent run over every process of `pids`, shipping to a collector of
/// its own: 199 Hz, each sample labelled with its pid. The processes run
/// at once: one run instead of one each (each run of the debug agent
/// starts for a second or more). It lasts 3 s per process, at least 6 s:
/// they share two CPUs, and the debug agent finds their interpreters one
/// after the other (the last of five once 1.5 s in; one alone 0.1 s in,
/// 0.8 s beside the suite's other tests), and the samples before must be
/// the run's first moments.
fn profile_with_agent(pids: &[u32]) -> AgentRun {
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let mut args = vec!["--label-pid".to_owned()];
    for pid in pids {
        args.extend(["--pid".to_owned(), pid.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cpu_before: Vec<Duration> = pids.iter().map(|&pid| cpu_time(pid)).collect();
    let seconds = (3 * pids.len()).max(6);
    let report = run_agent_for(&collector, &format!("{seconds}s"), &args);
    let cpu_samples = pids
        .iter()
        .zip(cpu_before)
        .map(|(&pid, before)| ((cpu_time(pid) - before).as_secs_f64() * 199.0) as u64)
        .collect();
    let stacks = pids
        .iter()
        .map(|pid| collector.folded_stacks(&format!("pid=\"{pid}\"")))
        .collect();
    collector.stop();
    AgentRun {
        stacks,
        cpu_samples,
        report,
    }
}

/// Each of `pythons` running the fixture `script` with `args`, all at
/// once, profiled by one agent run; the processes are gone after it.
fn profile_scripts(pythons: &[Python], script: &str, args: &[&str]) -> AgentRun {
    let processes: Vec<_> = pythons
        .iter()
        .map(|python| start_script(&python.program, script, args))
        .collect();
    let pids: Vec<u32> = processes.iter().map(RunningProcess::pid).collect();
    profile_with_agent(&pids)
}

impl AgentRun {
    /// The `index`th process's samples number at least half of what its
    /// CPU time would give, and at least [`MIN_SAMPLES`]: the agent
    /// sampled it all along, and it ran.
    fn assert_sampled(&self, index: usize, name: &str) {
        let total: u64 = self.stacks[index].iter().map(|(_, n)| n).sum();
        let expected = self.cpu_samples[index];
        assert!(
            total * 2 >= expected && total >= MIN_SAMPLES,
            "{name}: only {total} samples, where its CPU time in the run would give {expected}"
        );
    }
}

/// The fewest samples of a process in an agent run for its shares to say
/// anything (a fifth of a CPU for 3 s at 199 Hz: about 120).
const MIN_SAMPLES: u64 = 100;

/// A program's thread name: its file name.
fn comm_of(program: &Path) -> String {
    program
        .file_name()
        .and_then(|name| name.to_str())
        .expect("a program name")
        .to_owned()
}

/// The samples of `python_chain.py` an agent run shipped, each process
/// running under the interpreter `pythons` has at its index: those that
/// came with their Python stack (the evaluation loop's frames replaced)
/// all read root first the native frames from `_start`, then the Python
/// chain where the evaluation loop ran it, then whatever C code `leaf` was
/// in (adding, allocating). The ticks before the agent found the
/// interpreter (its metadata worker reads the interpreter's file) have no
/// Python stack: they must be the run's first moments, not a fifth of it.
/// The agent's own count of samples paired with a Python stack agrees.
fn assert_chained(pythons: &[Python], run: &AgentRun) {
    let root_first: Vec<&str> = CHAIN.iter().rev().copied().collect();
    let mut all_chained = 0;
    for (index, (python, stacks)) in pythons.iter().zip(&run.stacks).enumerate() {
        let name = &python.name;
        let (mut total, mut read, mut chained) = (0, 0, 0);
        for (stack, count) in stacks {
            let frames: Vec<&str> = stack.split(';').collect();
            total += count;
            // Without its Python stack a sample shows the evaluation loop
            // (by its name, or as `[unknown]` in a part a stripped build
            // does not name), and no Python frame, named or not: one that
            // came back unnamed is a miss of the chain, not left out.
            let python_frames = frames
                .iter()
                .any(|frame| CHAIN.contains(frame) || *frame == UNNAMED_PYTHON);
            if frames.contains(&"_PyEval_EvalFrameDefault") || !python_frames {
                continue;
            }
            read += count;
            if frames.first() == Some(&"_start") && python.reads_chain(&frames, &root_first) {
                chained += count;
            }
        }
        eprintln!(
            "python frames: {name}: {chained} of {total} samples read \
             _start;...;<module>;outer;middle;leaf; {read} came with their Python stack"
        );
        run.assert_sampled(index, name);
        assert!(
            chained * 100 >= read * 99,
            "{name}: only {chained} of the {read} samples with their Python stack read the \
             chain: {stacks:#?}"
        );
        assert!(
            read * 100 >= total * 80,
            "{name}: only {read} of {total} samples came with their Python stack"
        );
        all_chained += chained;
    }
    // The fixture frees no code object: a frame refused as stale is a
    // fingerprint read wrong (a frame's size taken across a chunk).
    assert_eq!(
        run.report["aggregation"]["python_stale"].as_u64(),
        Some(0),
        "Python frames refused as stale"
    );
    let paired = run.report["python"]["paired"].as_u64().unwrap_or(0);
    assert!(
        all_chained * 100 >= paired * 99,
        "only {all_chained} of the {paired} samples the agent paired with their Python stack \
         read the chain"
    );
}

/// A Python process that execs an interpreter keeps its pid, its thread
/// and its start time, so what the sampler keeps of a thread it ran last
/// on a CPU (where its thread state is) must not outlive the exec: the
/// script runs `before_exec` for 3 s after it says "ready" (the agent,
/// started then, finds the interpreter within 1.5 s), then the chain the
/// new interpreter runs is read, not lost to the former interpreter's
/// addresses (without forgetting them: 0 samples in `leaf`). Pinned to
/// one CPU: an exec moves a process to the idlest CPU, whose memory is of
/// another thread.
#[test]
fn a_python_process_that_execs_an_interpreter_is_read_after_the_exec() {
    require_root();
    let _serial = exclusive();
    let python = interpreters().pop().expect("an interpreter");
    let process = RunningProcess::start_ready(
        Command::new("taskset")
            .args(["--cpu-list", "0"])
            .arg(&python.program)
            .arg(fixture_source("python_exec_chain.py"))
            .arg("3")
            .env_clear(),
    );
    let run = profile_with_agent(&[process.pid()]);
    let with = |name: &str| -> u64 {
        run.stacks[0]
            .iter()
            .filter(|(stack, _)| stack.split(';').any(|frame| frame == name))
            .map(|(_, count)| count)
            .sum()
    };
    let (before, after) = (with("before_exec"), with("leaf"));
    eprintln!(
        "python frames: {}: {before} samples in before_exec, {after} in leaf after the exec",
        python.name
    );
    // The sampler had the thread before the exec, or the test shows nothing.
    assert!(before >= 20, "only {before} samples before the exec");
    // After it, a third of what the process's CPU time gives at least (the
    // agent finds the new interpreter anew).
    let expected_after = run.cpu_samples[0].saturating_sub(before);
    assert!(
        after >= 50 && after * 3 >= expected_after,
        "only {after} samples named leaf after the exec, of about {expected_after}"
    );
}

/// On a quiet host the agent's timed drains come up to 5 s apart, not every
/// 500 ms; a Python process started then wakes it with its first tick, so
/// its Python frames are read from its first moments, not after its end.
/// The agent samples one cgroup (filtered in the kernel: quiet whatever
/// else runs here) at its default 19 Hz; 5 s in (its drains paced by
/// then), `python_chain.py` starts in that cgroup and runs for 1.5 s.
/// Without the wake-up it would be met at the next drain, the interval's
/// end (2 s here) or a timed one, when it has exited and its code objects can no longer be read:
/// no Python function named at all (0 of 28 samples in three runs). With
/// it, 27-29 of 28-32 alone, and 16-27 of 17-28 beside two busy loops
/// (the stacks' code objects read as they are drained: read when the
/// walks, held for the process's maps, came, 0 of 17 in two of three such
/// runs): at least half must be.
#[test]
fn a_python_process_started_on_a_quiet_host_is_read_from_its_first_moments() {
    require_root();
    let _serial = exclusive();
    let python = interpreters().pop().expect("an interpreter");
    let cgroup = TempCgroup::create("quiet-python");
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let agent = Command::new(workspace_binary("stackscope-agent"))
        .args(["--collector", &collector.grpc])
        .args(["--frequency", "19", "--duration", "9s", "--interval", "2s"])
        .args(["--cgroup", &cgroup.relative_path()])
        .args(["--no-table-cache", "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    std::thread::sleep(Duration::from_secs(5));
    // The shell moves itself into the cgroup, then becomes the script.
    let process = RunningProcess::start_ready(
        Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#)
            .arg("sh")
            .arg(&cgroup.path)
            .arg(&python.program)
            .arg(fixture_source("python_chain.py"))
            .env_clear(),
    );
    std::thread::sleep(Duration::from_millis(1500));
    drop(process);
    let report = wait_success(agent);
    let stacks = collector.folded_stacks(&format!("comm=\"{}\"", comm_of(&python.program)));
    collector.stop();
    let total: u64 = stacks.iter().map(|(_, n)| n).sum();
    let in_leaf: u64 = stacks
        .iter()
        .filter(|(stack, _)| stack.split(';').any(|frame| frame == "leaf"))
        .map(|(_, n)| n)
        .sum();
    let wakeups = report["kernel"]["early_wakeups"].as_u64().unwrap_or(0);
    eprintln!(
        "python frames: {} started on a quiet host: {in_leaf} of {total} samples in `leaf`, \
         {wakeups} early wake-ups; frames named {}, unreadable {}",
        python.name,
        report["aggregation"]["python_named"],
        report["aggregation"]["python_unreadable"],
    );
    // Only the script runs in the cgroup: the wake-ups are its own.
    assert!(wakeups >= 1, "the new process woke no drain: {report}");
    assert!(total >= 15, "only {total} samples in 1.5 s at 19 Hz");
    assert!(
        in_leaf * 2 >= total,
        "only {in_leaf} of {total} samples named `leaf`: {stacks:#?}"
    );
}

/// A recursion deeper than the sampler reads (`MAX_PYTHON_FRAMES`): the
/// agent ships the innermost frames it read, then one marked frame where
/// the outer ones would be, then the native callers of the evaluation loop.
#[test]
fn a_stack_deeper_than_the_sampler_reads_is_marked_where_its_read_stopped() {
    require_root();
    let _serial = exclusive();
    const DEPTH: usize = 200;
    let mut read = vec!["down"; MAX_PYTHON_FRAMES - 1];
    read.push("spin");
    let pythons = one_per_version();
    let run = profile_scripts(&pythons, "python_depth.py", &[&DEPTH.to_string()]);
    eprintln!(
        "python frames: {DEPTH} deep: activations cut {}",
        run.report["aggregation"]["python_cut"]
    );
    // 200 frames cross a data stack chunk: the frame that calls into the
    // next chunk is not fingerprinted by a size taken across the two.
    assert_eq!(
        run.report["aggregation"]["python_stale"].as_u64(),
        Some(0),
        "Python frames refused as stale"
    );
    for (index, (python, stacks)) in pythons.iter().zip(&run.stacks).enumerate() {
        let name = &python.name;
        run.assert_sampled(index, name);
        let marked = Share::of(stacks, "spin", "_start", |frames| {
            frames
                .iter()
                .position(|f| *f == PYTHON_NOT_READ)
                .is_some_and(|at| {
                    let after = &frames[at + 1..];
                    if python.calls_through_c() {
                        // The native frames of each call between.
                        after.iter().filter(|f| read.contains(f)).eq(read.iter())
                    } else {
                        after.starts_with(&read)
                    }
                })
        });
        eprintln!(
            "python frames: {DEPTH} deep on {name}: {} of {} samples in spin read the \
             innermost {MAX_PYTHON_FRAMES} frames and the mark ({} did not reach the root)",
            marked.whole, marked.total, marked.rootless
        );
        if python.calls_through_c() {
            // Each of the 200 calls has native frames of its own (about
            // 100 KB of stack in all): until the agent has learned to copy
            // that deep, in the run's first moments, the native walk stops
            // short of the root. Those that reach it are all marked right.
            let rooted = marked.total - marked.rootless;
            assert!(
                rooted * 100 >= marked.total * 75,
                "{name}: only {rooted} of {} samples in spin reached the root",
                marked.total
            );
            assert_eq!(marked.whole, rooted, "{name}: {:?}", marked.busiest_miss);
        } else {
            marked.assert_at_least(name, 300, 95);
        }
    }
}

/// Of the samples (folded, root first) with a given frame on them, those
/// read whole: from their thread's root, with no evaluation loop frame
/// left, and as the test expects.
struct Share<'a> {
    frame: &'a str,
    whole: u64,
    total: u64,
    /// The most common stack with the frame not read whole, and how
    /// many such stacks did not reach the root, for a failure's message.
    busiest_miss: Option<&'a (String, u64)>,
    rootless: u64,
}

impl<'a> Share<'a> {
    fn of(
        stacks: &'a [(String, u64)],
        frame: &'a str,
        root: &str,
        expected: impl Fn(&[&str]) -> bool,
    ) -> Self {
        let mut share = Self {
            frame,
            whole: 0,
            total: 0,
            busiest_miss: None,
            rootless: 0,
        };
        for sample in stacks {
            let (stack, count) = sample;
            let frames: Vec<&str> = stack.split(';').collect();
            if !frames.contains(&frame) {
                continue;
            }
            share.total += count;
            let rooted = frames.first() == Some(&root);
            if rooted && !frames.contains(&"_PyEval_EvalFrameDefault") && expected(&frames) {
                share.whole += count;
                continue;
            }
            if !rooted {
                share.rootless += count;
            }
            if share.busiest_miss.is_none_or(|(_, most)| count > most) {
                share.busiest_miss = Some(sample);
            }
        }
        share
    }

    /// At least `min_total` samples with the frame, `percent`% of them whole.
    fn assert_at_least(&self, name: &str, min_total: u64, percent: u64) {
        let Self {
            frame,
            whole,
            total,
            busiest_miss,
            rootless,
        } = self;
        assert!(
            *total >= min_total,
            "{name}: only {total} samples in {frame}"
        );
        assert!(
            whole * 100 >= total * percent,
            "{name}: only {whole} of {total} samples in {frame} read whole ({rootless} did not \
             reach the root); the most common of the others: {busiest_miss:?}"
        );
    }
}

#[test]
fn a_services_threads_generators_recursion_and_callbacks_through_c_keep_their_order() {
    require_root();
    let _serial = exclusive();
    let pythons = one_per_version();
    let run = profile_scripts(&pythons, "python_services.py", &[]);
    for (index, (python, stacks)) in pythons.iter().zip(&run.stacks).enumerate() {
        let name = &python.name;
        run.assert_sampled(index, name);
        // The pool's threads: from the thread's start, through threading's
        // bootstrap, a method, a generator and 50 frames of recursion, in
        // that order; native frames may come between the Python ones (the
        // generator runs in an evaluation loop of its own in 3.11, called
        // from C).
        let mut pool_chain: Vec<&str> = [
            "Thread._bootstrap",
            "Thread._bootstrap_inner",
            "Thread.run",
            "worker",
            "Handler.handle",
            "items",
        ]
        .map(|qualname| python.named(qualname))
        .to_vec();
        pool_chain.extend(["recurse"; 50]);
        pool_chain.push("leaf_work");
        let pool = Share::of(stacks, "worker", "clone3", |frames| {
            frames
                .iter()
                .filter(|frame| pool_chain.contains(frame))
                .eq(&pool_chain)
        });
        // The main thread: JSON encoded in C, which calls `encode_point`
        // back.
        let iterencode = python.named("JSONEncoder.iterencode");
        let (mut callbacks, mut callbacks_in_order) = (0, 0);
        for (stack, count) in stacks {
            let frames: Vec<&str> = stack.split(';').collect();
            // The callback is innermost Python, called from the C encoder:
            // native frames (named or not: Debian's binary is stripped)
            // between it and the method that called into C.
            if let Some(at) = frames.iter().position(|f| *f == "encode_point") {
                callbacks += count;
                let in_order = frames
                    .iter()
                    .position(|f| *f == iterencode)
                    .is_some_and(|caller| caller + 1 < at);
                callbacks_in_order += if in_order { *count } else { 0 };
            }
        }
        eprintln!(
            "python frames: services on {name}: {} of {} pool samples read the whole chain; \
             {callbacks_in_order} of {callbacks} samples in the default= callback read \
             {iterencode};<C>;encode_point",
            pool.whole, pool.total
        );
        pool.assert_at_least(name, 100, 95);
        assert!(callbacks > 0, "{name}: no sample in the default= callback");
        let with_callback: Vec<_> = stacks
            .iter()
            .filter(|(stack, _)| stack.split(';').any(|f| f == "encode_point"))
            .collect();
        assert_eq!(
            callbacks_in_order, callbacks,
            "{name}: callbacks out of order: {with_callback:#?}"
        );
    }
}

/// asyncio: a task's coroutines (`handle` awaiting `compute`), run by the
/// event loop through C (the task's step), read in order below the loop's
/// own Python frames.
#[test]
fn coroutines_of_an_asyncio_task_read_in_order_below_the_event_loop() {
    require_root();
    let _serial = exclusive();
    let chain = [
        "<module>",
        "run",
        "Runner.run",
        "BaseEventLoop.run_until_complete",
        "BaseEventLoop.run_forever",
        "BaseEventLoop._run_once",
        "Handle._run",
        "handle",
        "compute",
        "crunch",
    ];
    let pythons = one_per_version();
    let run = profile_scripts(&pythons, "python_asyncio.py", &[]);
    for (index, (python, stacks)) in pythons.iter().zip(&run.stacks).enumerate() {
        let name = &python.name;
        run.assert_sampled(index, name);
        // `asyncio.Runner` came in 3.11.
        let chain: Vec<&str> = chain
            .iter()
            .filter(|qualname| python.version >= (3, 11) || **qualname != "Runner.run")
            .map(|qualname| python.named(qualname))
            .collect();
        let in_order = Share::of(stacks, "crunch", "_start", |frames| {
            frames
                .iter()
                .filter(|frame| chain.contains(frame))
                .eq(&chain)
        });
        eprintln!(
            "python frames: asyncio on {name}: {} of {} samples in crunch read the loop, the \
             task's coroutines and crunch in order",
            in_order.whole, in_order.total
        );
        in_order.assert_at_least(name, 200, 95);
    }
}

#[test]
fn python_in_a_container_is_read_from_the_interpreter_in_its_image() {
    require_root();
    // Debian's interpreter, at a path only the image has, with the few
    // files it reads at start-up (its libraries, the codecs of
    // `encodings`: everything else it needs is frozen into it).
    let python = Path::new("/usr/bin/python3.11");
    if !python.exists() {
        eprintln!(
            "python frames: container skipped: {} is not installed",
            python.display()
        );
        return;
    }
    let mut files: Vec<(PathBuf, String)> = vec![
        (python.to_path_buf(), "/opt/py/bin/python3.11".into()),
        (
            fixture_source("python_chain.py"),
            "/app/python_chain.py".into(),
        ),
    ];
    for library in shared_libraries(python) {
        let inside = library.display().to_string();
        files.push((library, inside));
    }
    for module in ["__init__.py", "aliases.py", "utf_8.py"] {
        files.push((
            PathBuf::from(format!("/usr/lib/python3.11/encodings/{module}")),
            format!("/opt/py/lib/python3.11/encodings/{module}"),
        ));
    }
    let files: Vec<(&Path, &str)> = files
        .iter()
        .map(|(host, inside)| (host.as_path(), inside.as_str()))
        .collect();
    // Before the image's build too: a build beside another test's agent
    // slowed that agent finding its interpreter to 1.3 s (a fifth of the
    // run's Python stacks lost).
    let _serial = exclusive();
    let image = Image::build("python", &files);
    let container = Container::run_with(
        &image,
        "python",
        &["-e", "PYTHONHOME=/opt/py"],
        &["/opt/py/bin/python3.11", "/app/python_chain.py"],
    );
    // The interpreter is past its start-up (into `leaf`) well within this.
    std::thread::sleep(Duration::from_millis(500));
    let run = profile_with_agent(&[container.pid]);
    let python = Python {
        name: format!("in a container ({})", container.name),
        program: python.to_path_buf(),
        version: (3, 11),
    };
    assert_chained(&[python], &run);
}

/// Debian's own builds of the versions newer than this host's, each in an
/// image of its suite's root filesystem (trixie's 3.13, sid's 3.14: see
/// `stackscope_tests::debian_python`), `python_chain.py` mounted: each
/// interpreter found through the container's files, its evaluation loop's
/// split parts located (sid's 3.14 runs its loop in a part its symbol does
/// not cover), every frame read by the sampler with `leaf`'s line, and the
/// agent shipping the chain in place of the loop. Suites that cannot be
/// built here are skipped, and said so.
#[test]
fn debians_own_builds_of_newer_versions_are_read_in_their_images() {
    require_root();
    let builds = debian_pythons();
    if builds.is_empty() {
        eprintln!("python frames: no Debian root filesystem could be built: test skipped");
        return;
    }
    // Before the images' imports: see `python_in_a_container…`.
    let _serial = exclusive();
    let fixtures = fixture_source("python_chain.py")
        .parent()
        .expect("the fixtures directory")
        .display()
        .to_string();
    let images: Vec<Image> = builds
        .iter()
        .map(|build| Image::import("debian-python", &build.root))
        .collect();
    let containers: Vec<Container> = builds
        .iter()
        .zip(&images)
        .map(|(build, image)| {
            Container::run_with(
                image,
                "debian-python",
                &["-v", &format!("{fixtures}:/fixtures:ro")],
                &[&build.program, "/fixtures/python_chain.py"],
            )
        })
        .collect();
    let pythons: Vec<Python> = builds
        .iter()
        .map(|build| Python {
            name: build.name.clone(),
            program: PathBuf::from(&build.program),
            version: build.version,
        })
        .collect();
    let pids: Vec<u32> = containers.iter().map(|container| container.pid).collect();
    let found: Vec<FoundInterpreter> = pythons
        .iter()
        .zip(&pids)
        .map(|(python, &pid)| {
            let found = find_in_process(Path::new("/proc"), pid)
                .unwrap_or_else(|err| panic!("{}: {err}", python.name))
                .unwrap_or_else(|| panic!("{}: no interpreter found in its mappings", python.name));
            assert_eq!(found.layout.version, python.version, "{}", python.name);
            eprintln!(
                "python frames: {}: the evaluation loop's code {:x?}",
                python.name, found.eval
            );
            found
        })
        .collect();
    for container in &containers {
        container.wait_for_output("ready");
    }
    let config = SamplerConfig {
        frequency_hz: 99,
        pids: pids.clone(),
        ..SamplerConfig::default()
    };
    let recorded = sample_python(&config, Duration::from_secs(6), &pids, |tgid, started| {
        let found = &found[pids.iter().position(|&pid| pid == tgid).unwrap()];
        found.layout.sampler_entry(found.runtime, started)
    });
    for ((python, &pid), found) in pythons.iter().zip(&pids).zip(&found) {
        check_chain(python, pid, found, &recorded);
    }
    let run = profile_with_agent(&pids);
    assert_chained(&pythons, &run);
}

/// The shared libraries `program` loads (as `ldd` lists them), by the paths
/// it loads them from.
fn shared_libraries(program: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd")
        .arg(program)
        .output()
        .expect("running ldd");
    assert!(out.status.success(), "ldd {}", program.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // `libm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x...)` or
            // `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has no file.
            let path = line.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

#[test]
fn a_process_that_pretends_to_be_python_costs_a_bounded_walk_and_names_nothing() {
    require_root();
    let fixture = Fixture::compile("python_impostor", &["-pthread"]);
    let _serial = exclusive();
    let process = fixture.start(&[]);
    let pid = process.pid();
    let found = find_in_process(Path::new("/proc"), pid)
        .expect("reading its mappings")
        .expect("taken for an interpreter: it exports _PyRuntime and Py_Version");
    assert_eq!(found.interpreter.version(), (3, 12));
    let config = SamplerConfig {
        frequency_hz: 99,
        pids: vec![pid],
        ..SamplerConfig::default()
    };
    let recorded = sample_python(&config, Duration::from_secs(2), &[pid], |_, started| {
        found.layout.sampler_entry(found.runtime, started)
    });
    let stacks: Vec<_> = recorded
        .python_stacks
        .iter()
        .filter(|stack| stack.header.tgid == pid)
        .collect();
    assert!(stacks.len() >= 50, "only {} stacks", stacks.len());
    let memory = ProcessMemory { pid };
    for stack in stacks {
        // The cycle ends at the bound, and says so.
        assert_eq!(stack.frames.len(), MAX_PYTHON_FRAMES);
        assert_eq!(stack.header.flags, python_stack_flags::TRUNCATED);
        let frame = stack.frames[0];
        let named = CodeObject::read(
            &memory,
            &found.layout,
            frame.code,
            frame.first_line & !PythonFrame::ENTRY,
        );
        assert!(named.is_err(), "garbage named: {named:?}");
    }
}

/// Off-CPU profiles of CPython programs show where they wait in Python:
/// each version's interpreter blocks in `time.sleep` and `os.read` under
/// known functions, and the agent's `--off-cpu` samples carry them.
#[test]
fn off_cpu_time_of_python_programs_lands_on_the_python_functions_that_wait() {
    require_root();
    let _serial = exclusive();
    let pythons = one_per_version();
    let scripts: Vec<RunningProcess> = pythons
        .iter()
        .map(|python| start_script(&python.program, "python_waits.py", &[]))
        .collect();
    let data = tempfile::tempdir().expect("temp dir");
    let collector = Collector::start(data.path());
    let mut args = vec!["--label-pid", "--off-cpu", "--off-cpu-rate", "1000000"]
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>();
    for script in &scripts {
        args.extend(["--pid".to_owned(), script.pid().to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report = run_agent_for(&collector, "6s", &args);
    eprintln!("off-CPU figures: {}", report["off_cpu"]);
    for (python, script) in pythons.iter().zip(&scripts) {
        let stacks = folded(&collector.cli(&[
            "export",
            "--format",
            "folded",
            "--type",
            "off-cpu",
            "--since",
            "10m",
            "--match",
            &format!("pid=\"{}\"", script.pid()),
        ]));
        let total: u64 = stacks.iter().map(|(_, nanos)| nanos).sum();
        let on = |chain: &[&str]| -> u64 {
            stacks
                .iter()
                .filter(|(stack, _)| {
                    python.reads_chain(&stack.split(';').collect::<Vec<_>>(), chain)
                })
                .map(|(_, nanos)| nanos)
                .sum()
        };
        let sleeping = on(&["serve", "wait_for_request"]);
        let reading = on(&["serve", "read_reply"]);
        let answering = on(&["answer"]);
        eprintln!(
            "{}: {:.2} s off-CPU: serve;wait_for_request {:.2} s, serve;read_reply {:.2} s, answer {:.2} s",
            python.name,
            total as f64 / 1e9,
            sleeping as f64 / 1e9,
            reading as f64 / 1e9,
            answering as f64 / 1e9
        );
        // The main thread waits all the time, in either; the answering
        // thread too. The first moments, before the interpreter is found,
        // show native frames only.
        assert!(
            total > 5_000_000_000,
            "{}: only {total} ns off-CPU in 6 s of two waiting threads",
            python.name
        );
        assert!(
            (sleeping + reading + answering) * 100 >= total * 80,
            "{}: only {} of {total} ns under the Python functions that wait: {stacks:#?}",
            python.name,
            sleeping + reading + answering
        );
        assert!(sleeping > 0 && reading > 0, "{}: {stacks:#?}", python.name);
    }
    collector.stop();
}
