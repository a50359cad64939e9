//! End to end: samples from the BPF sampler unwound with the agent's stack
//! walker, for programs built without frame pointers. Needs root.

use std::time::{Duration, Instant};

use object::{Object as _, ObjectSymbol as _};
use stackscope_agent::{
    sampler::SamplerConfig,
    unwinding::{StackWalker, WalkOutcome},
};
use stackscope_process_table::{Location, ProcessTable};
use stackscope_tests::{Fixture, exclusive, require_root, sample_for};
use stackscope_unwind::UnwindEnd;

/// Function symbols of an ELF file: (start, size, name), sorted.
fn function_symbols(path: &std::path::Path) -> Vec<(u64, u64, String)> {
    let data = std::fs::read(path).expect("reading the fixture");
    let file = object::File::parse(&*data).expect("parsing the fixture");
    let mut symbols: Vec<_> = file
        .symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0)
        .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
        .collect();
    symbols.sort();
    symbols
}

#[test]
fn unwinds_a_call_chain_without_frame_pointers_down_to_main() {
    require_root();
    let _serial = exclusive();
    let fixture = Fixture::compile("call_chain");
    let process = fixture.start(&[]);
    let pid = process.pid();
    let symbols = function_symbols(&fixture.path);

    let config = SamplerConfig {
        frequency_hz: 99,
        pids: vec![pid],
        ..SamplerConfig::default()
    };
    let samples = sample_for(&config, Duration::from_secs(2)).samples;
    assert!(samples.len() >= 50, "only {} samples", samples.len());

    // Tables compile in the background: walk until the first sample no
    // longer waits for one.
    let mut walker = StackWalker::default();
    let started = Instant::now();
    while walker
        .walk(&samples[0].header, &samples[0].user_stack)
        .map(|w| w.outcome)
        == Some(WalkOutcome::TablePending)
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "tables never compiled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut processes = ProcessTable::default();
    let mut name_of = |addr: u64, lookup: u64| -> String {
        // Return addresses are looked up at addr - 1: the call may be the
        // last instruction of its function.
        match processes.lookup(pid, lookup) {
            Ok(Some(Location::Object(object)))
                if object.path().file_path() == Some(&fixture.path) =>
            {
                let vaddr = object.elf_vaddr.expect("a vaddr in the fixture");
                symbols
                    .iter()
                    .find(|(start, size, _)| (*start..start + size).contains(&vaddr))
                    .map_or_else(|| format!("?{vaddr:#x}"), |(_, _, name)| name.clone())
            }
            Ok(Some(Location::Object(object))) => format!("{}", object.path()),
            other => format!("{addr:#x}: {other:?}"),
        }
    };

    let mut complete = 0;
    for sample in &samples {
        let walk = walker
            .walk(&sample.header, &sample.user_stack)
            .expect("user registers");
        let names: Vec<String> = walk
            .frames
            .iter()
            .enumerate()
            .map(|(i, &addr)| name_of(addr, if i == 0 { addr } else { addr - 1 }))
            .collect();
        // Above main: __libc_start_call_main and __libc_start_main (libc has
        // no .symtab, so they are named by file), then the fixture's _start.
        let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
        assert_eq!(
            names,
            ["c", "b", "a", "main", libc, libc, "_start"],
            "frames of a sample"
        );
        if walk.outcome == WalkOutcome::Ended(UnwindEnd::Outermost) {
            complete += 1;
        }
    }
    assert_eq!(complete, samples.len(), "every walk reaches _start");
}
